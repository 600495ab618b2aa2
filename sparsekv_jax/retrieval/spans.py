"""From ranked evidence to the new prompt: sentence-aligned spans, a budget, the gathered tokens.

All host-side numpy over one row's context (at most a few dozen spans per source):

* `sentence_spans`: each S³ centre becomes the span ``[c - half, c + half]`` widened to the
  enclosing sentence boundaries when one lies within ``max_extend`` tokens (the paper's
  "variable-length spans cut at natural semantic boundaries").
* `passages`: whole sentences packed greedily into passages of at most ``size`` tokens (a longer
  sentence is cut into ``size`` pieces): the units BM25 and dense RAG rank.
* `assemble`: the lead and tail tokens first (scaled down to a quarter of the budget when they
  would take more), then the sources' spans round-robin in rank order
  (S³ #1, BM25 #1, S³ #2, ...: the union of Eq. 8 under a budget) until ``budget`` tokens are
  kept; the span that would overflow keeps its tokens nearest its centre.
* `gather_prompt`: kept context tokens in their original order, then the question.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Span = tuple[int, int, int]  # [start, end) and the position it was ranked for


def sentence_starts_ends(ends: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(start_of [L], end_of [L])``: the first and last position of each position's sentence
    (a sentence ends at a position where ``ends`` is true, or at the context's end)."""
    L = ends.shape[0]
    t = np.arange(L)
    starts = np.zeros(L, bool)
    starts[0] = True
    starts[1:] = ends[:-1]
    start_of = np.maximum.accumulate(np.where(starts, t, 0))
    last = ends.copy()
    last[-1] = True
    end_of = np.minimum.accumulate(np.where(last, t, L - 1)[::-1])[::-1]
    return start_of, end_of


def sentence_spans(centres: Sequence[int], ends: np.ndarray, half: int, max_extend: int) -> list[Span]:
    """Spans around ``centres`` (ranked, ``-1`` = none) over a context with sentence ``ends`` ``[L]``."""
    L = ends.shape[0]
    start_of, end_of = sentence_starts_ends(ends)
    out = []
    for c in centres:
        c = int(c)
        if c < 0 or c >= L:
            continue
        a, b = max(0, c - half), min(L - 1, c + half)
        if a - start_of[a] <= max_extend:
            a = int(start_of[a])
        if end_of[b] - b <= max_extend:
            b = int(end_of[b])
        out.append((a, b + 1, c))
    return out


def passages(ends: np.ndarray, size: int) -> list[tuple[int, int]]:
    """Whole sentences packed into ``[start, end)`` passages of at most ``size`` tokens."""
    L = ends.shape[0]
    cuts = np.flatnonzero(ends[:-1]) + 1
    bounds = np.concatenate([[0], cuts, [L]])
    out: list[tuple[int, int]] = []
    a = 0
    for s, e in zip(bounds[:-1], bounds[1:], strict=True):
        if e - a > size and s > a:  # this sentence does not fit: close the passage before it
            out.append((a, int(s)))
            a = int(s)
        while e - a > size:  # a sentence longer than a passage
            out.append((a, a + size))
            a += size
    if a < L:
        out.append((a, L))
    return out


def assemble(length: int, budget: int, lead: int, tail: int, sources: Sequence[Sequence[Span]]) -> np.ndarray:
    """``[length]`` bool mask of kept context positions, at most ``budget`` of them (see above)."""
    kept = np.zeros(length, bool)
    if budget >= length:
        kept[:] = True
        return kept
    if lead + tail > budget // 4:  # the positional prior takes at most a quarter of the budget
        lead, tail = lead * (budget // 4) // (lead + tail), tail * (budget // 4) // (lead + tail)
    kept[:lead] = True
    if tail:
        kept[length - tail:] = True
    room = budget - int(kept.sum())
    for rank in range(max((len(s) for s in sources), default=0)):
        for spans in sources:
            if room <= 0:
                return kept
            if rank >= len(spans):
                continue
            a, b, c = spans[rank]
            new = np.flatnonzero(~kept[a:b]) + a
            if new.size > room:  # keep the tokens nearest the centre
                new = new[np.argsort(np.abs(new - c), kind="stable")[:room]]
            kept[new] = True
            room -= new.size
    return kept


def gather_prompt(rows: Sequence[np.ndarray], width_multiple: int, max_width: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded ``[B, W]`` int32 prompt of ``rows`` and their lengths; ``W`` is the longest row
    rounded up to ``width_multiple`` (fewer compiled shapes), at most ``max_width``."""
    lengths = np.array([r.shape[0] for r in rows], np.int32)
    width = min(max_width, -(-int(lengths.max()) // width_multiple) * width_multiple)
    width = max(width, int(lengths.max()))
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out, lengths
