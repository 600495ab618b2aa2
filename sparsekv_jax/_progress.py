"""Progress bars that honour ``TQDM_DISABLE``.

tqdm reads ``TQDM_<argument>`` environment variables only as defaults: an explicit ``disable=False`` (what
``disable=not progress`` passes when progress is on) overrides ``TQDM_DISABLE=1``, so scripts that set it to keep
their logs short still got a bar line every few steps (a 1 MB log per SAE arm on 2026-11-28).
"""

from __future__ import annotations

import os

_TRUE = ("1", "true", "yes", "on")


def bar_disabled(progress: bool) -> bool:
    """tqdm's ``disable`` for a ``progress`` flag: off when ``progress`` is false or ``TQDM_DISABLE`` is set true."""
    return not progress or os.environ.get("TQDM_DISABLE", "").strip().lower() in _TRUE
