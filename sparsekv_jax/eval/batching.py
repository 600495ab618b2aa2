"""Samples → `generate` inputs: tokenize context and question apart, batch rows of similar length.

Both question modes feed the model the same token ids (context and question are tokenized
separately and concatenated):

* ``"aware"``: ``tokens`` = context + question, ``question_start`` = each row's context length
  (where its question begins inside ``tokens``): the compress stage sees the question.
* ``"agnostic"``: ``tokens`` = the context, ``suffix`` = the question, read after compression.

Rows are right-padded to a multiple of ``pad_multiple`` and a short batch is filled with copies
of its last row, so shapes (and compiled programs) repeat.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np

from sparsekv_jax.eval.tasks import Sample

__all__ = ["QUESTION_MODES", "Item", "batch_inputs", "batches", "bucket", "context_batches", "encode", "shared_inputs"]

QUESTION_MODES = ("agnostic", "aware")
SUFFIX_MULTIPLE = 64  # questions are padded to a multiple of this (agnostic mode)


def bucket(n: int) -> int:
    """Decode length rounded up to a power of two (at least 32): fewer distinct programs."""
    return max(32, 1 << (n - 1).bit_length())


@dataclasses.dataclass
class Item:
    """One sample of a (task, length) group, tokenized."""

    group: Any  # the `sparsekv_jax.eval.suites.Group` it belongs to
    sample: Sample
    context_ids: list[int]
    question_ids: list[int]
    max_new_tokens: int

    @property
    def num_tokens(self) -> int:
        return len(self.context_ids) + len(self.question_ids)


def encode(tokenizer: Any, sample: Sample) -> tuple[list[int], list[int]]:
    """Context and question ids; the question gets at least one token (the context's last)."""
    chat = bool(sample.meta.get("chat", True))  # RULER samples are generated with the chat template
    ctx = list(tokenizer(sample.context, add_special_tokens=not chat)["input_ids"])
    q = list(tokenizer(sample.question, add_special_tokens=False)["input_ids"]) if sample.question else []
    if not q:
        ctx, q = ctx[:-1], ctx[-1:]
    if not ctx:
        raise ValueError(f"{sample.task} sample {sample.index}: empty context")
    return ctx, q


def _pad(rows: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out, np.asarray([len(r) for r in rows], np.int32)


def _round_width(n: int, multiple: int, limit: int) -> int:
    return max(n, min(limit, -(-n // multiple) * multiple))


def batches(items: list[Item], batch_size: int, max_positions: int | None = None) -> Iterator[list[Item]]:
    """Rows of similar length, at most ``batch_size`` a batch, and never more than fit together:
    in question-agnostic mode the longest context and the longest question of a batch (plus the
    decode length) must fit in the model's positions even when they come from different rows."""
    items = sorted(items, key=lambda it: (it.num_tokens, it.sample.index))
    batch: list[Item] = []
    for it in items:
        trial = batch + [it]
        if batch and (len(batch) == batch_size or not _fits(trial, max_positions)):
            yield batch
            trial = [it]
        batch = trial
    if batch:
        yield batch


def _fits(items: list[Item], max_positions: int | None) -> bool:
    """Whether ``items`` fit one batch: the longest context, the longest question and the bucketed
    decode length (they may come from different rows) within the model's positions."""
    return max_positions is None or (
        max(len(x.context_ids) for x in items) + max(len(x.question_ids) for x in items)
        + bucket(max(x.max_new_tokens for x in items)) <= max_positions)


def batch_inputs(items: list[Item], question: str, max_positions: int, pad_multiple: int,
                 fill_to: int) -> dict[str, Any]:
    """``generate`` keyword arguments (``tokens``, ``lengths``, ``question_start``, ``suffix``,
    ``suffix_lengths``) for a batch, padded to ``fill_to`` rows."""
    if question not in QUESTION_MODES:
        raise ValueError(f"question={question!r} must be one of {QUESTION_MODES}")
    rows = items + [items[-1]] * (fill_to - len(items))
    new = bucket(max(it.max_new_tokens for it in items))
    if question == "aware":
        seqs = [it.context_ids + it.question_ids for it in rows]
        width = _round_width(max(map(len, seqs)), pad_multiple, max_positions - new)
        tokens, lengths = _pad(seqs, width)
        question_start = np.asarray([len(it.context_ids) for it in rows], np.int32)
        return {"tokens": tokens, "lengths": lengths, "question_start": question_start, "suffix": None,
                "suffix_lengths": None}
    ctx = [it.context_ids for it in rows]
    qwidth = _round_width(max(len(it.question_ids) for it in rows), SUFFIX_MULTIPLE,
                          max_positions - new - max(map(len, ctx)))
    width = _round_width(max(map(len, ctx)), pad_multiple, max_positions - new - qwidth)
    tokens, lengths = _pad(ctx, width)
    suffix, suffix_lengths = _pad([it.question_ids for it in rows], qwidth)
    return {"tokens": tokens, "lengths": lengths, "question_start": None, "suffix": suffix,
            "suffix_lengths": suffix_lengths}


# ----------------------------------------------------------------------------------------------
# shared contexts: one context, several questions asked in turn (``ruler-shared``)
# ----------------------------------------------------------------------------------------------


def context_batches(contexts: list[list[Item]], batch_size: int,
                    max_positions: int | None = None) -> Iterator[list[list[Item]]]:
    """Contexts (each the list of its questions' items, in question order) of similar length, at
    most ``batch_size`` a batch, and never more than fit together: the longest context, the longest
    question of the batch and the decode length must fit in the model's positions."""
    contexts = sorted(contexts, key=lambda c: (len(c[0].context_ids), c[0].sample.index))
    batch: list[list[Item]] = []
    for c in contexts:
        trial = batch + [c]
        if batch and (len(batch) == batch_size or not _fits([it for x in trial for it in x], max_positions)):
            yield batch
            trial = [c]
        batch = trial
    if batch:
        yield batch


def shared_inputs(contexts: list[list[Item]], max_positions: int, pad_multiple: int,
                  fill_to: int) -> tuple[dict[str, Any], list[tuple[np.ndarray, np.ndarray, list[Item]]]]:
    """The inputs of contexts asked their questions in turn, padded to ``fill_to`` rows (copies of
    the last context): ``(context inputs, questions)``. The context inputs are `batch_inputs`'
    question-agnostic keys without the suffix (``tokens``, ``lengths``); ``questions[j]`` is
    ``(suffix [rows, Tq], suffix_lengths [rows], items)``: every row's ``j``-th question (a context
    with fewer questions repeats its last). Widths are those `batch_inputs` gives all the items at
    once: one question width ``Tq`` for every turn (one compiled program for every question)."""
    rows = contexts + [contexts[-1]] * (fill_to - len(contexts))
    items = [it for c in contexts for it in c]
    new = bucket(max(it.max_new_tokens for it in items))
    longest = max(len(it.context_ids) for it in items)
    qwidth = _round_width(max(len(it.question_ids) for it in items), SUFFIX_MULTIPLE, max_positions - new - longest)
    width = _round_width(longest, pad_multiple, max_positions - new - qwidth)
    tokens, lengths = _pad([c[0].context_ids for c in rows], width)
    questions = []
    for j in range(max(len(c) for c in contexts)):
        asked = [c[min(j, len(c) - 1)] for c in rows]
        suffix, suffix_lengths = _pad([it.question_ids for it in asked], qwidth)
        questions.append((suffix, suffix_lengths, asked))
    return {"tokens": tokens, "lengths": lengths}, questions
