"""S³-Attention (Ma et al., 2026; Algorithm 1, §3.4-3.6) as ``context``-stage policies.

* `S3Pure`: the context is scanned in chunks by the model; every chunk's target-layer pre-RoPE
  keys become SAE feature ids in a host-side inverted index (`sparsekv_jax.retrieval.scan`) and the
  chunk's KV is dropped; the question's own pre-RoPE query features score every position
  (`sparsekv_jax.retrieval.scoring`, on the device) and sentence-aligned spans around the peaks are
  kept (`sparsekv_jax.retrieval.spans`).
* `S3Hybrid`: S³'s spans ∪ BM25's passages ∪ lead/tail (Eq. 8).

The budget, lead/tail and prompt assembly are shared with the baselines (`policies.retrieval`).

Choices the paper leaves open (defaults; docs/S3.md measures them):

* **What a scan chunk attends to**: only itself (``sinks = window = 0``: the paper's
  "chunk-independent" prefill, one causal attention per chunk, the cheapest scan); a carried sink +
  window is an option (``sinks=``, ``window=``). Positions stay absolute (RoPE is relative).
* **Models with local and global layers** (Gemma 3): the scan runs every layer with its own window
  and RoPE base, and the SAEs sit on the global layers only (a local layer's keys see 512 tokens).
* **The question's features**: its pre-RoPE *queries* at the target layers, encoded by the key
  SAEs (the shared codebook), activations summed over the question's tokens.
* **Frequent-feature exclusion**: features active at more than ``stop_df`` = 50% of a row's context
  positions get weight 0 (the paper's absolute ``df > 5000`` does not scale with the length).
* **Span cutting**: a centre ``c`` becomes ``[c - h, c + h]``, ``h = span / 2`` (default
  ``span = budget // n_centres``, ~25 tokens at 1,024 / 40), each end moved to the enclosing
  sentence boundary when it lies within ``max_extend`` = 32 tokens; NMS suppresses ``2h``.
* **Budget**: ``budget`` context tokens (default 1,024, the paper's "about 1-2k"; an int or a
  fraction of each row's context), the same for every method; the span that overflows keeps the
  tokens nearest its centre.
* **Lead / tail share**: the first 64 and last 32 context tokens (chat template, instruction, the
  context's end), scaled down to at most a quarter of the budget; the rest goes to the sources,
  round-robin by rank (S³ #1, BM25 #1, S³ #2, ...: an equal share without a tuned weight; `S3Hybrid`'s
  ``mix`` changes it, and docs/S3.md compares three mixes).
* **Smoothing kernel**: 48 (Table 6); pass ``kernel=8`` for QA (the policy does not know the task).
"""

from __future__ import annotations

import functools
import time
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.policies.base import Setup
from sparsekv_jax.policies.retrieval import ContextRetrieval
from sparsekv_jax.retrieval import rankers, spans


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
    backend: Any = struct.field(pytree_node=False, default=None)  # the run's `Backend` (`bind`); None: the default

    def bind(self, setup: Setup) -> S3Pure:
        """This policy holding the run's `Backend`: the scan's ``"auto"`` choices (features,
        attention) are made for its platform (the engine binds the context stage before it runs)."""
        return self.replace(backend=setup.backend)

    def stacked_saes(self, params: Any) -> tuple[tuple[int, ...], Any]:
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
        mcfg = params.config
        local = sorted(set(layers) & set(mcfg.local_layer_ids()))
        if local:  # Gemma 3: a local layer's keys only ever see its window
            raise ValueError(f"{self.name}: layers {local} of the {mcfg.family} model are sliding-window (local) "
                             f"layers; S3's SAEs go on its global layers {list(mcfg.global_layer_ids())}")
        if stack.d_in != params.config.head_dim:
            raise ValueError(f"{self.name}: SAEs {self.saes!r} encode {stack.d_in}-dim keys but the model's head_dim "
                             f"is {params.config.head_dim}; pass SAEs trained for this model (saes=path or weights=)")
        return tuple(layers), stack

    def scan(self, params: Any, tokens: np.ndarray, ctx: np.ndarray, ql: np.ndarray) -> Any:
        """The streaming scan of every row (`sparsekv_jax.retrieval.scan.scan_context`)."""
        from sparsekv_jax.retrieval.scan import ScanConfig, scan_context

        layers, stack = self.stacked_saes(params)
        cfg = ScanConfig(chunk=self.chunk, sinks=self.sinks, window=self.window, features=self.features)
        return scan_context(params, stack, layers, tokens, ctx, ctx, ql, cfg, backend=self.backend)

    def s3_spans(self, result: Any, tokens: np.ndarray, ctx: np.ndarray, budgets: np.ndarray) -> list[list[spans.Span]]:
        """Per row: ranked spans from a scan ``result`` (only this policy's layers of it are scored)."""
        from sparsekv_jax.retrieval.scoring import retrieve_centres

        use = list(range(len(result.layers))) if self.layers is None else [result.layers.index(i) for i in self.layers]
        half = np.maximum(1, (np.full(len(ctx), self.span) if self.span else budgets // self.n_centres) // 2)
        idx = result.index
        every = use == list(range(len(result.layers)))  # no host copy of the postings then
        postings, counts = (idx.postings, idx.counts) if every else (idx.postings[use], idx.counts[use])
        weights = result.query_weights if every else result.query_weights[jnp.asarray(use)]
        centres, _, _ = retrieve_centres(postings, counts, weights,
                                         jnp.asarray(ctx), jnp.asarray(2 * half), width=idx.num_segments * idx.chunk,
                                         kernel=self.kernel, n_centres=self.n_centres, stop_df=self.stop_df)
        centres = np.asarray(centres)
        return [spans.sentence_spans(centres[b], self.codec.ends(tokens[b, : ctx[b]]), int(half[b]), self.max_extend)
                for b in range(len(ctx))]

    def rank(self, params: Any, tokens: np.ndarray, ctx: np.ndarray, ql: np.ndarray, budgets: np.ndarray,
             scan: Any = None) -> tuple[list[list[list[spans.Span]]], dict[str, float]]:
        result = self.scan(params, tokens, ctx, ql) if scan is None else scan
        t0 = time.perf_counter()
        ranking = self.s3_spans(result, tokens, ctx, budgets)
        return [ranking], {**(result.seconds if scan is None else {}), "score": time.perf_counter() - t0}


@struct.dataclass
class S3Hybrid(S3Pure):
    """S³'s spans ∪ BM25 passages (of ``passage`` tokens) ∪ lead/tail: the paper's S³-Hybrid.

    ``mix``: the order in which the two rankings fill the budget, one round at a time, e.g.
    ``"s3,bm25"`` (S³ #1, BM25 #1, S³ #2, ...: an equal share), ``"bm25,s3"`` (BM25's passage first
    in each round) or ``"bm25,bm25,s3"`` (two BM25 passages per S³ span). A source that runs out
    leaves its turns to the others. The paper takes the union of both sets and does not say how a
    fixed budget is shared; docs/S3.md compares the mixes.
    """

    passage: int = struct.field(pytree_node=False, default=64)
    mix: str = struct.field(pytree_node=False, default="s3,bm25")

    def __post_init__(self) -> None:
        parts = self.mix.split(",")
        if not {"s3", "bm25"} <= set(parts) or not set(parts) <= {"s3", "bm25"}:
            raise ValueError(f"S3Hybrid mix={self.mix!r} must list 's3' and 'bm25' (comma-separated), e.g. 's3,bm25'")

    def rank(self, params: Any, tokens: np.ndarray, ctx: np.ndarray, ql: np.ndarray, budgets: np.ndarray,
             scan: Any = None) -> tuple[list[list[list[spans.Span]]], dict[str, float]]:
        (s3,), seconds = S3Pure.rank(self, params, tokens, ctx, ql, budgets, scan)
        t0 = time.perf_counter()
        bm25 = self.passage_ranking(tokens, ctx, ql, self.passage, rankers.bm25_scores)
        seconds = {**seconds, "bm25": time.perf_counter() - t0}
        if self.mix == "s3,bm25":  # `spans.assemble`'s own round-robin: keep the two sources apart
            return [s3, bm25], seconds
        pattern = self.mix.split(",")
        return [[_mixed({"s3": a, "bm25": b}, pattern) for a, b in zip(s3, bm25, strict=True)]], seconds


def _mixed(ranked: dict[str, list[spans.Span]], pattern: list[str]) -> list[spans.Span]:
    """One ranked list from several, taking turns as ``pattern`` says, round after round."""
    at = dict.fromkeys(ranked, 0)
    out: list[spans.Span] = []
    while any(at[name] < len(r) for name, r in ranked.items()):
        for name in pattern:
            if at[name] < len(ranked[name]):
                out.append(ranked[name][at[name]])
                at[name] += 1
    return out

