"""Context-stage retrieval policies: the shared mechanics, and the exogenous baselines.

`ContextRetrieval` rewrites the prompt on the host before the jitted ``generate``: a subclass
ranks evidence spans (`rank`), the best are kept up to ``budget`` tokens with the context's
``lead`` first and ``tail`` last tokens (a positional prior; see `sparsekv_jax.retrieval.spans.assemble`
for how sources share the budget), and the kept tokens, in their original order, followed by the
question become the new prompt. Any prefill/compress/decode policy may follow
(``Pipeline(context=S3Hybrid(), decode=CHESS())``). The S³ policies are in `policies.s3`.

* `BM25Retrieval`: BM25 (bm25s, a dependency) over sentence-packed passages.
* `DenseRAG`: all-MiniLM-L6-v2 cosine similarity over 256-token passages (the optional extra
  ``rag``; a clear error names it when missing).

The question: with ``question_start`` (the harness' question-aware mode) the question is
``tokens[b, question_start[b]:lengths[b]]``. Without one (question-agnostic mode, where the real
question arrives later as ``suffix``) the last ``question_tail`` tokens of the prompt stand in for
it — a documented fallback that retrieves by the context's end; use question-aware mode.

A budget covering a row's context keeps that row unchanged; when it covers every row the prompt
is returned as given (full attention's logits exactly). Call ``with_tokenizer`` first (sentence
boundaries, passage text): the eval harness and the generate CLI do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from flax import struct

from sparsekv_jax.policies.base import ContextResult, Policy
from sparsekv_jax.policies.common import budget_tokens
from sparsekv_jax.retrieval import rankers, spans
from sparsekv_jax.retrieval.text import TextCodec


@struct.dataclass
class ContextRetrieval(Policy):
    """Shared mechanics of the retrieval policies: split, budget, assemble, gather (subclasses rank).

    Args:
      budget: context tokens kept (int) or a fraction of each row's context (float).
      lead, tail: the context's first / last tokens always kept (within the budget).
      question_tail: prompt tokens taken as the question when no ``question_start`` is given.
    """

    budget: float | int = struct.field(pytree_node=False, default=1024)
    lead: int = struct.field(pytree_node=False, default=64)
    tail: int = struct.field(pytree_node=False, default=32)
    question_tail: int = struct.field(pytree_node=False, default=32)
    codec: TextCodec | None = struct.field(pytree_node=False, default=None)

    stages = ("context",)
    needs_question = True

    def with_tokenizer(self, tokenizer: Any) -> ContextRetrieval:
        return self.replace(codec=TextCodec(tokenizer))

    def split(self, lengths: np.ndarray, question_start: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
        """``(context lengths, question lengths)`` per row (see the module docstring's fallback)."""
        lengths = np.asarray(lengths, np.int32)
        if question_start is None:
            q = np.minimum(self.question_tail, lengths - 1)
            return lengths - q, q
        qs = np.asarray(question_start, np.int32)
        return qs, lengths - qs

    def context(self, params: Any, tokens: np.ndarray, lengths: np.ndarray, question_start: np.ndarray | None,
                *, scan: Any = None) -> ContextResult:
        """The rewritten prompt (see the module docstring). ``scan``: an S³ `ScanResult` of these rows
        to reuse (ablations score one scan several ways); other rankers ignore it."""
        if isinstance(self.budget, bool) or self.budget <= 0:
            raise ValueError(f"{self.name} budget={self.budget!r} must be a positive count or fraction")
        ctx, ql = self.split(lengths, question_start)
        budgets = np.array([budget_tokens(self.budget, max(int(c), 1)) for c in ctx])
        info: dict[str, Any] = {"context_tokens": ctx.copy(), "budget_tokens": budgets}
        if (budgets >= ctx).all():
            return ContextResult(tokens, lengths, question_start, {**info, "kept_tokens": ctx.copy()})
        if self.codec is None:
            raise ValueError(f"{self.name} needs a tokenizer: call policy.with_tokenizer(tokenizer) first")
        t0 = time.perf_counter()
        sources, seconds = self.rank(params, tokens, ctx, ql, budgets, scan=scan)
        t1 = time.perf_counter()
        rows, kept_n = [], []
        for b in range(tokens.shape[0]):
            kept = spans.assemble(int(ctx[b]), int(budgets[b]), self.lead, self.tail, [s[b] for s in sources])
            rows.append(np.concatenate([tokens[b, : ctx[b]][kept], tokens[b, ctx[b]: ctx[b] + ql[b]]]))
            kept_n.append(int(kept.sum()))
        new, new_lengths = spans.gather_prompt(rows, 64, tokens.shape[1])
        seconds = {**seconds, "rank": t1 - t0, "assemble": time.perf_counter() - t1}
        per_source = np.array([[len(s[b]) for s in sources] for b in range(len(ctx))])
        info.update(kept_tokens=np.array(kept_n), spans=per_source, seconds=seconds)
        return ContextResult(new, new_lengths, np.array(kept_n, np.int32), info)

    def rank(self, params: Any, tokens: np.ndarray, ctx: np.ndarray, ql: np.ndarray, budgets: np.ndarray,
             scan: Any = None) -> tuple[list[list[list[spans.Span]]], dict[str, float]]:
        """``(sources, seconds)``: per source, per row, its spans in rank order."""
        raise NotImplementedError

    def passage_ranking(self, tokens: np.ndarray, ctx: np.ndarray, ql: np.ndarray, size: int,
                        score: Callable[[list[str], str], np.ndarray],
                        positive_only: bool = True) -> list[list[spans.Span]]:
        """Per row: sentence-packed passages of ``size`` tokens ranked by ``score(texts, query)``
        (with ``positive_only``, passages scoring <= 0 are no hits)."""
        out = []
        for b in range(tokens.shape[0]):
            row = tokens[b, : ctx[b]]
            units = spans.passages(self.codec.ends(row), size)
            texts = self.codec.decode([row[a:e] for a, e in units])
            query = self.codec.decode([tokens[b, ctx[b]: ctx[b] + ql[b]]])[0]
            out.append(rankers.ranked(units, score(texts, query), positive_only))
        return out


@struct.dataclass
class BM25Retrieval(ContextRetrieval):
    """BM25 (bm25s) over sentence-packed passages of at most ``passage`` tokens (alone it fills the
    budget in rank order; inside `S3Hybrid` only passages sharing a term with the question count)."""

    passage: int = struct.field(pytree_node=False, default=64)

    def rank(self, params: Any, tokens: np.ndarray, ctx: np.ndarray, ql: np.ndarray, budgets: np.ndarray,
             scan: Any = None) -> tuple[list[list[list[spans.Span]]], dict[str, float]]:
        t0 = time.perf_counter()
        # alone, BM25 fills the budget (passages without a query term last, in context order)
        ranking = self.passage_ranking(tokens, ctx, ql, self.passage, rankers.bm25_scores, positive_only=False)
        return [ranking], {"bm25": time.perf_counter() - t0}


@struct.dataclass
class DenseRAG(ContextRetrieval):
    """Dense retrieval (all-MiniLM-L6-v2, cosine) over passages of ``passage`` tokens (optional extra)."""

    passage: int = struct.field(pytree_node=False, default=256)

    def rank(self, params: Any, tokens: np.ndarray, ctx: np.ndarray, ql: np.ndarray, budgets: np.ndarray,
             scan: Any = None) -> tuple[list[list[list[spans.Span]]], dict[str, float]]:
        t0 = time.perf_counter()
        ranking = self.passage_ranking(tokens, ctx, ql, self.passage, rankers.dense_scores, positive_only=False)
        return [ranking], {"dense": time.perf_counter() - t0}
