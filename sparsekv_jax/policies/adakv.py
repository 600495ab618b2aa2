"""AdaKV (Feng et al., 2024, *Ada-KV: Optimizing KV Cache Eviction by Adaptive Budget Allocation*):
one budget per layer, spent on the best-scored entries of all its KV heads together.

A uniform compressor keeps ``n`` entries in every KV head; AdaKV keeps ``Hkv·n`` per (layer, row) in
all, taken jointly across the heads by the inner scorer's scores, so a head whose attention is
concentrated gives budget to a head whose attention is spread. The paper's safeguard: every head
keeps at least ``floor(alpha·n)`` entries (its own best; paper and kvpress default ``alpha=0.2``),
and the joint top-k spends the rest. The inner's sinks and observation window stay in every head
(they are part of each head's floor, as in the paper's Ada-SnapKV, where the window is kept per
head).

Scores are the inner's, unchanged. The paper needs scores that compare across heads; SnapKV's
already do: each query head's softmax over the prompt sums to one, so window-averaged (and pooled)
weights of two heads are on one scale, and the AdaKV authors and kvpress rank SnapKV's scores across
heads as they are (no further normalisation is applied here). H2O's accumulated attention is on one
scale across heads too (each head's mass sums to the number of queries). A scorer whose scores do
not depend on the head (StreamingLLM's recency) gives ties across heads: the lower head wins them,
so AdaKV over it is not meaningful.

Memory: today's cache is ``[B, Hkv, S, D]`` per layer with one capacity ``S`` for every head, so the
compressed cache is sized for the largest head any allocation can produce,
``min(prompt, Hkv·n - (Hkv-1)·floor(alpha·n))`` entries (plus the tokens still to come), and heads
that keep fewer leave holes (bias −∞). The attention quality is AdaKV's, the memory is the largest
head's, until the per-head page pool (issue #38, item 1) lands.

`BudgetAllocation` is the shape both allocating wrappers (this one and `PyramidKV`) share: it runs
the inner's observation and scores, asks the subclass for per-(layer, row, head) counts, and keeps
each head's best entries.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.cache import KVCache, pages_for
from sparsekv_jax.policies.base import Policy, Prompt, Setup
from sparsekv_jax.policies.common import (
    budget_tokens,
    force_sinks_and_window,
    row_budgets,
    write_kept,
)
from sparsekv_jax.policies.scored import ScoredCompression
from sparsekv_jax.policies.snapkv import SnapKV

_FINITE_MIN = float(jnp.finfo(jnp.float32).min)


def as_fraction(x: float) -> Fraction:
    """``x`` as the nearest fraction with a denominator of at most 1000 (exact for decimals such as
    0.2 or 20), so that ``floor(x·n)`` is integer arithmetic on every device and every length."""
    return Fraction(x).limit_denominator(1000) if isinstance(x, float) else Fraction(int(x))


def head_order(scores: jax.Array, length: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each head's slots best first: ``(values, slots)`` ``[L, B, H, S]`` (stable: ties keep slot
    order). Slots past the row's length sort last (value −inf); used slots with −inf scores are
    raised to the lowest finite float so that they still come before unused ones."""
    S = scores.shape[-1]
    used = jnp.arange(S) < length[:, None, None]
    s = jnp.where(used, jnp.maximum(scores.astype(jnp.float32), _FINITE_MIN), -jnp.inf)
    slots = jnp.argsort(s, axis=-1, descending=True, stable=True)
    return jnp.take_along_axis(s, slots, axis=-1), slots.astype(jnp.int32)


def keep_counts(cache: KVCache, slots: jax.Array, counts: jax.Array, capacity: int) -> KVCache:
    """A new cache of ``capacity`` tokens holding each (layer, row, head)'s first ``counts`` slots of
    ``slots`` (`head_order`'s, best first), in slot order (RoPE positions ascending).

    ``counts`` ``[L, B, H]`` (more than ``min(S, capacity)`` keep that many: size ``capacity`` with
    `compressed_capacity`). As `common.compact` (which takes one count per row), written by
    `common.write_kept`: heads keeping fewer leave holes.
    """
    L, B, H, S = slots.shape
    k_static = min(S, capacity)
    counts = jnp.minimum(counts, k_static)
    top = slots[..., :k_static]
    chosen = jnp.arange(k_static) < counts[..., None]
    idx = jnp.minimum(jnp.sort(jnp.where(chosen, top, S), axis=-1), S - 1)
    return write_kept(cache, idx, counts, capacity)


@struct.dataclass
class BudgetAllocation(Policy):
    """A compress stage that runs a scored compressor (``inner``) with budgets that differ by head
    or by layer; the per-row total is the inner's (``budget`` per (layer, KV head) on average).

    Only the inner's compress stage runs: an H2O inner compresses once (its running eviction
    during decode is not carried over; compose a decode stage with `Pipeline`). Subclasses
    implement `allocate` and `max_kept`.
    """

    inner: ScoredCompression = struct.field(default_factory=SnapKV)

    stages = ("compress",)
    # declared, not the inner's: compares scores across heads or layers, so the inner observes the
    # whole prompt (StreamingLLM, the one scored compressor that would chunk, gives nothing to
    # allocate by: its scores do not depend on the head or the layer)
    needs_whole_prefill = True
    writes_entries = True  # through `keep_counts`: the engine may send it into a page pool

    def __post_init__(self) -> None:
        if not isinstance(self.inner, ScoredCompression):
            what = self.inner.name if isinstance(self.inner, Policy) else repr(self.inner)
            raise ValueError(f"{type(self).__name__}(inner={what}): the inner policy must be a scored compressor "
                             "(a ScoredCompression: SnapKV, H2O, StreamingLLM), e.g. "
                             f"{type(self).__name__.lower()}(snapkv(0.25))")

    @classmethod
    def covering(cls) -> BudgetAllocation:
        return cls(SnapKV(1.0))

    @property
    def name(self) -> str:
        return f"{type(self).__name__}({self.inner.name})"

    @property
    def budget(self) -> float | int:
        """The inner's budget: the mean kept per (layer, KV head)."""
        return self.inner.budget

    @property
    def needs_observations(self) -> bool:  # type: ignore[override]
        return self.inner.needs_observations

    @property
    def needs_question(self) -> bool:  # type: ignore[override]
        return self.inner.needs_question

    @property
    def page_summaries(self) -> frozenset[str]:  # type: ignore[override]
        return self.inner.page_summaries

    def bind(self, setup: Setup) -> BudgetAllocation:
        return self.replace(inner=self.inner.bind(setup))

    def observe(self, q, k, v, hidden, layer_index, prompt: Prompt) -> Any:
        return self.inner.observe(q, k, v, hidden, layer_index, prompt)

    def max_kept(self, prompt_len: int) -> int:
        """The most entries any (layer, head) of a row of ``prompt_len`` tokens can keep (static)."""
        raise NotImplementedError

    def allocate(self, scores: jax.Array, length: jax.Array, keep: jax.Array, floor: jax.Array) -> jax.Array:
        """``[L, B, H]`` entries each (layer, row, head) keeps; ``scores`` ``[L, B, H, S]`` (sinks and
        window forced), ``keep`` ``[B]`` the uniform count, ``floor`` ``[B]`` the forced entries
        (sinks + window) each head keeps whatever its budget."""
        raise NotImplementedError

    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        if budget_tokens(self.inner.budget, prompt_len) >= prompt_len:
            return None  # every row keeps its whole prompt: full attention, no compression
        return min(prompt_len, self.max_kept(prompt_len)) + max_new_tokens

    def compress(self, cache: KVCache, observations: Any, capacity: int, prompt: Prompt) -> KVCache:
        inner = self.inner
        keep = row_budgets(inner.budget, cache.length)  # [B] the uniform per-head count
        sinks, window = inner.forced_counts(keep)
        scores = force_sinks_and_window(inner.score(cache, observations, prompt), cache.length, sinks, window)
        forced = jnp.minimum(sinks + jnp.asarray(window, jnp.int32), keep)
        counts = self.allocate(scores, cache.length, keep, forced)
        _, slots = head_order(scores, cache.length)
        return keep_counts(cache, slots, counts, capacity)


@struct.dataclass
class AdaKV(BudgetAllocation):
    """Ada-KV's head-wise allocation over a scored compressor: ``AdaKV(SnapKV(0.25))``.

    Per (layer, row): each KV head keeps its own best ``max(floor(alpha·n), sinks + window)``
    entries (capped at ``n``), then the remaining ``Hkv·n`` minus those are the best-scored of all
    heads' other entries together (ties: the lower head, then the lower slot). ``n`` is the inner's
    per-head budget for the row (batch rows of different lengths get their own).

    Memory is the largest head's (the cache has one capacity per layer until the page pool of
    issue #38 lands): ``min(prompt, Hkv·n - (Hkv-1)·floor(alpha·n))`` entries per head.

    Args:
      inner: the scored compressor whose scores and budget are used (default ``SnapKV(0.25)``).
      alpha: the safeguard: the fraction of the uniform budget every head keeps (paper: 0.2; 1.0 is
        the inner's uniform allocation, 0.0 no floor beyond the inner's sinks and window).
      num_kv_heads: set by `bind` from the model (sizes the compressed cache).
    """

    alpha: float = struct.field(pytree_node=False, default=0.2)
    num_kv_heads: int = struct.field(pytree_node=False, default=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"AdaKV alpha={self.alpha!r} must be a fraction in [0, 1] (paper: 0.2)")

    def bind(self, setup: Setup) -> AdaKV:
        return self.replace(inner=self.inner.bind(setup), num_kv_heads=int(setup.config.num_kv_heads))

    def floor_tokens(self, keep: jax.Array) -> jax.Array:
        """``floor(alpha·keep)`` (exact integer arithmetic, `as_fraction`)."""
        a = as_fraction(self.alpha)
        return (keep * a.numerator) // a.denominator

    def max_kept(self, prompt_len: int) -> int:
        if self.num_kv_heads < 1:
            raise ValueError("AdaKV: the compressed capacity depends on the model's KV heads: bind the policy "
                             "first (policy.bind(Setup(config=...)); generate and Session do)")
        n = budget_tokens(self.inner.budget, prompt_len)
        a = as_fraction(self.alpha)
        H = self.num_kv_heads
        return H * n - (H - 1) * ((n * a.numerator) // a.denominator)

    def compressed_pages(self, lengths: np.ndarray, prompt_len: int, max_new_tokens: int, page_size: int,
                         num_layers: int, num_kv_heads: int, suffix_tokens: int = 0) -> int | None:
        """Per (layer, row) the heads keep ``Hkv·n_b`` entries in all and each the tokens to come, so at most
        one partial page per head more than the tokens need: ``L·Σ_b min(pages_for(Hkv·(n_b + e)) + Hkv,
        Hkv·pages_for(capacity))`` (``e`` = ``max_new_tokens``; the second term is the largest head's bound)."""
        capacity = self.compressed_capacity(prompt_len, max_new_tokens)
        if capacity is None:
            return None
        H, e = num_kv_heads, max_new_tokens
        n = np.asarray(row_budgets(self.inner.budget, jnp.asarray(lengths, jnp.int32)))
        return num_layers * sum(min(pages_for(H * (int(k) + e), page_size) + H, H * pages_for(capacity, page_size))
                                for k in n)

    def allocate(self, scores: jax.Array, length: jax.Array, keep: jax.Array, floor: jax.Array) -> jax.Array:
        L, B, H, S = scores.shape
        values, _ = head_order(scores, length)  # [L, B, H, S] best first
        own = jnp.minimum(jnp.maximum(self.floor_tokens(keep), floor), keep)  # [B] each head's floor
        key = jnp.where(jnp.arange(S) < own[:, None, None], jnp.inf, values).reshape(L, B, H * S)
        # the layer's H·n best keys (ties: the lower head, then the lower slot, as a stable sort of the
        # heads' lists would take them), found by the threshold rather than by scattering a joint
        # argsort: XLA partitions the sort over (layer, row) but gathers a scatter's operands whole
        total = (H * keep)[None, :, None]  # [1, B, 1]
        threshold = jnp.take_along_axis(jnp.sort(key, axis=-1, descending=True),
                                        jnp.broadcast_to(total - 1, (L, B, 1)), axis=-1)
        above = key > threshold
        ties = key == threshold
        picked = above | (ties & (jnp.cumsum(ties, axis=-1) <= total - above.sum(-1, keepdims=True)))
        # each head's picks are a prefix of its own order (its keys are sorted), so counting is selecting
        return picked.reshape(L, B, H, S).sum(-1, dtype=jnp.int32)
