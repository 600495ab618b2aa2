"""S³-Attention (Ma et al., 2026) and its baselines as ``context``-stage policies.

Each rewrites the prompt on the host before the jitted ``generate``: the context is ranked, the
best evidence is kept up to ``budget`` tokens (with the context's ``lead`` first and ``tail`` last
tokens, the paper's positional prior), and the kept tokens, in their original order, followed by
the question become the new prompt. Any prefill/compress/decode policy may follow
(``Pipeline(context=S3Hybrid(), decode=CHESS())``).

* `S3Pure`: the streaming SAE index (`sparsekv_jax.retrieval.scan`) and the question's own query
  features (`sparsekv_jax.retrieval.scoring`): endogenous retrieval, sentence-aligned spans.
* `S3Hybrid`: S³'s spans ∪ BM25's passages ∪ lead/tail (Eq. 8), taken round-robin in rank order.
* `BM25Retrieval`: BM25 passages alone (bm25s). `DenseRAG`: all-MiniLM-L6-v2 passages of 256
  tokens (the optional extra ``rag``).

The question: with ``question_start`` (the harness' question-aware mode) the question is
``tokens[b, question_start[b]:lengths[b]]``. Without one (question-agnostic mode, where the real
question arrives later as ``suffix``) the last ``question_tail`` tokens of the prompt stand in for
it — a documented fallback that retrieves by the context's end; use question-aware mode.

A budget covering a row's context keeps that row unchanged; when it covers every row the prompt
is returned as given (full attention's logits exactly). Call ``with_tokenizer`` first (sentence
boundaries, passage text): the eval harness and the generate CLI do.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax.numpy as jnp
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

    def passage_ranking(self, tokens: np.ndarray, ctx: np.ndarray, ql: np.ndarray, size: int, score,
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

    def rank(self, params, tokens, ctx, ql, budgets, scan=None):
        t0 = time.perf_counter()
        # alone, BM25 fills the budget (passages without a query term last, in context order)
        ranking = self.passage_ranking(tokens, ctx, ql, self.passage, rankers.bm25_scores, positive_only=False)
        return [ranking], {"bm25": time.perf_counter() - t0}


@struct.dataclass
class DenseRAG(ContextRetrieval):
    """Dense retrieval (all-MiniLM-L6-v2, cosine) over passages of ``passage`` tokens (optional extra)."""

    passage: int = struct.field(pytree_node=False, default=256)

    def rank(self, params, tokens, ctx, ql, budgets, scan=None):
        t0 = time.perf_counter()
        ranking = self.passage_ranking(tokens, ctx, ql, self.passage, rankers.dense_scores, positive_only=False)
        return [ranking], {"dense": time.perf_counter() - t0}


@functools.lru_cache(maxsize=4)
def _shipped(name: str):
    from sparsekv_jax.sae.export import load_saes, load_shipped

    return (load_saes(name) if name.endswith(".safetensors") else load_shipped(name))[0]


@struct.dataclass
class S3Pure(ContextRetrieval):
    """S³'s endogenous retrieval (Algorithm 1 without BM25).

    Args:
      saes: shipped SAE set name (`sparsekv_jax.sae.load_shipped`) or a ``.safetensors`` path.
      weights: stacked SAEs for ``layers`` instead (a leaf; e.g. random SAEs for speed runs).
      layers: target layers used (default: every layer of ``saes``).
      chunk, sinks, window, features: the scan (`sparsekv_jax.retrieval.scan.ScanConfig`).
      n_centres, kernel, stop_df: peaks, smoothing and stop features (`retrieval.scoring`).
      span: tokens around a centre before sentence snapping (default ``budget // n_centres``).
      max_extend: farthest a span end moves to reach a sentence boundary.
    """

    saes: str = struct.field(pytree_node=False, default="smollm2")
    weights: Any = None
    layers: tuple[int, ...] | None = struct.field(pytree_node=False, default=None)
    chunk: int = struct.field(pytree_node=False, default=2048)
    sinks: int = struct.field(pytree_node=False, default=0)
    window: int = struct.field(pytree_node=False, default=0)
    features: str = struct.field(pytree_node=False, default="auto")
    n_centres: int = struct.field(pytree_node=False, default=40)
    kernel: int = struct.field(pytree_node=False, default=48)
    stop_df: float = struct.field(pytree_node=False, default=0.5)
    span: int | None = struct.field(pytree_node=False, default=None)
    max_extend: int = struct.field(pytree_node=False, default=32)

    def stacked_saes(self, params: Any):
        """``(layers, stacked TopKSAE)`` for this policy; ``ValueError`` if they do not fit the model."""
        from sparsekv_jax.sae.export import stack_saes

        if self.weights is not None:
            if self.layers is None:
                raise ValueError(f"{self.name}: weights= needs layers= (the model layer of each stacked SAE)")
            layers, stack = tuple(self.layers), self.weights
        else:
            found = _shipped(self.saes)
            want = sorted(found) if self.layers is None else list(self.layers)
            missing = [i for i in want if i not in found]
            if missing:
                raise ValueError(f"{self.name}: SAEs {self.saes!r} have layers {sorted(found)}, not {missing}")
            layers, stack = stack_saes({i: found[i] for i in want})
        if stack.d_in != params.config.head_dim:
            raise ValueError(f"{self.name}: SAEs {self.saes!r} encode {stack.d_in}-dim keys but the model's head_dim "
                             f"is {params.config.head_dim}; pass SAEs trained for this model (saes=path or weights=)")
        return tuple(layers), stack

    def scan(self, params: Any, tokens: np.ndarray, ctx: np.ndarray, ql: np.ndarray):
        """The streaming scan of every row (`sparsekv_jax.retrieval.scan.scan_context`)."""
        from sparsekv_jax.retrieval.scan import ScanConfig, scan_context

        layers, stack = self.stacked_saes(params)
        cfg = ScanConfig(chunk=self.chunk, sinks=self.sinks, window=self.window, features=self.features)
        return scan_context(params, stack, layers, tokens, ctx, ctx, ql, cfg)

    def s3_spans(self, result, tokens: np.ndarray, ctx: np.ndarray, budgets: np.ndarray) -> list[list[spans.Span]]:
        """Per row: ranked spans from a scan ``result`` (only this policy's layers of it are scored)."""
        from sparsekv_jax.retrieval.scoring import retrieve_centres

        use = list(range(len(result.layers))) if self.layers is None else [result.layers.index(i) for i in self.layers]
        half = np.maximum(1, (np.full(len(ctx), self.span) if self.span else budgets // self.n_centres) // 2)
        idx = result.index
        centres, _, _ = retrieve_centres(idx.postings[use], idx.counts[use], result.query_weights[jnp.asarray(use)],
                                         jnp.asarray(ctx), jnp.asarray(2 * half), width=idx.num_segments * idx.chunk,
                                         kernel=self.kernel, n_centres=self.n_centres, stop_df=self.stop_df)
        centres = np.asarray(centres)
        return [spans.sentence_spans(centres[b], self.codec.ends(tokens[b, : ctx[b]]), int(half[b]), self.max_extend)
                for b in range(len(ctx))]

    def rank(self, params, tokens, ctx, ql, budgets, scan=None):
        result = self.scan(params, tokens, ctx, ql) if scan is None else scan
        t0 = time.perf_counter()
        ranking = self.s3_spans(result, tokens, ctx, budgets)
        return [ranking], {**(result.seconds if scan is None else {}), "score": time.perf_counter() - t0}


@struct.dataclass
class S3Hybrid(S3Pure):
    """S³'s spans ∪ BM25 passages (of ``passage`` tokens) ∪ lead/tail: the paper's S³-Hybrid."""

    passage: int = struct.field(pytree_node=False, default=64)

    def rank(self, params, tokens, ctx, ql, budgets, scan=None):
        (s3,), seconds = S3Pure.rank(self, params, tokens, ctx, ql, budgets, scan)
        t0 = time.perf_counter()
        bm25 = self.passage_ranking(tokens, ctx, ql, self.passage, rankers.bm25_scores)
        return [s3, bm25], {**seconds, "bm25": time.perf_counter() - t0}

