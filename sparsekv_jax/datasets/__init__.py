"""Small real datasets shipped inside the package (sources and licenses: ``README.md`` here).

* :func:`wikitext2_text` — the WikiText-2 raw test split as one string.
* :func:`longbench_mini_files` — MiniLongBench's 10 LongBench tasks, one gzip'd jsonl per task.

These are what ``sparsekv eval --suite longbench``, ``sparsekv calibrate --suite wikitext`` and the
test suite read by default: a clone or an installed wheel needs nothing beside it.
"""

from __future__ import annotations

import gzip
from pathlib import Path

__all__ = ["DATA_DIR", "LONGBENCH_MINI_DIR", "WIKITEXT2_TEST", "longbench_mini_files", "wikitext2_text"]

DATA_DIR = Path(__file__).resolve().parent
LONGBENCH_MINI_DIR = DATA_DIR / "longbench_mini"
WIKITEXT2_TEST = DATA_DIR / "wikitext2" / "wiki.test.raw.gz"


def wikitext2_text() -> str:
    """The WikiText-2 raw test split (1.29 MB of text, CC BY-SA 3.0)."""
    with gzip.open(WIKITEXT2_TEST, "rt", encoding="utf-8") as f:
        return f.read()


def longbench_mini_files() -> dict[str, Path]:
    """``{task: path}`` of the shipped MiniLongBench jsonl files (``.jsonl.gz``)."""
    return {p.name.removesuffix(".jsonl.gz"): p for p in sorted(LONGBENCH_MINI_DIR.glob("*.jsonl.gz"))}
