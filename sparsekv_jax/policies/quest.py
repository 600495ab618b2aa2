"""Quest (Tang et al., 2024): query-aware page selection at every decode step.

Each page keeps the elementwise min and max of its keys (the cache's page summaries). For the
current query ``q`` the upper bound of any key's logit in a page is
``sum_d max(q_d * min_d, q_d * max_d) / sqrt(D)`` plus the page's largest per-slot bias (merged
entries carry ``log |cluster|``, so without it the bound would not bound them); the top
``budget / page_size`` pages per KV head are
read. With GQA the bound of a KV head is the max over its query heads (a bound for each of
them). The page holding the newest token is always read (it is partial; Quest does the same),
and, as in the paper, the first ``dense_layers`` layers (paper: 2) stay dense. Nothing is
evicted: Quest saves reads, not memory.

A Quest page of ``m`` cache pages over a cache of ``P`` pages, ``P`` not a multiple of ``m`` (a capacity that
is not a whole number of Quest pages), ends with a partial Quest page, bounded from the cache pages it has.
The page list handed to attention names cache pages in use only (so ``pages_read`` counts what is read).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax.cache import LayerKV
from sparsekv_jax.policies.base import Policy, Selection, Setup
from sparsekv_jax.policies.common import budget_tokens, check_budget, top_pages


@struct.dataclass
class Quest(Policy):
    """Quest decode-time page selection.

    Args:
      budget: tokens read per step: fraction of the prompt or token count.
      page_size: Quest page (paper: 16); a multiple of the cache's page size.
      dense_layers: leading layers that read every page (paper: 2).
      backend: the run's `Backend`, set by `bind` (where the policy runs, not what it is: not in its
        `spec_key`). Off a mesh the pages are chosen by `jax.lax.top_k`; on one (or unbound) by a stable sort,
        which XLA partitions over the sharded heads (`policies.common.top_k`): the same pages either way.
    """

    budget: float | int = struct.field(pytree_node=False, default=0.25)
    page_size: int = struct.field(pytree_node=False, default=16)
    dense_layers: int = struct.field(pytree_node=False, default=2)
    prompt_len: int = struct.field(pytree_node=False, default=0)  # set by `bind` before jit
    backend: Any = struct.field(pytree_node=False, default=None)  # set by `bind` before jit

    stages = ("decode",)
    selects_pages = True  # its decode stage only selects pages (`decode_select`): it runs on a page pool
    page_summaries = frozenset({"page_min", "page_max", "page_max_bias"})  # the bound reads these alone

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if self.page_size < 1 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a positive power of two")
        if self.dense_layers < 0:
            raise ValueError(f"dense_layers={self.dense_layers} must be >= 0")

    def bind(self, setup: Setup) -> Quest:
        if self.page_size % setup.page_size:
            raise ValueError(f"Quest page_size={self.page_size} is not a multiple of the cache "
                             f"page_size={setup.page_size}")
        return self.replace(prompt_len=setup.prompt_len, backend=setup.backend)

    @property
    def exact(self) -> bool:
        """A budget covering the whole prompt reads everything: exact dense attention."""
        return budget_tokens(self.budget, self.prompt_len) >= self.prompt_len

    def pages_read(self, prompt_len: int) -> int:
        return -(-budget_tokens(self.budget, prompt_len) // self.page_size)

    def page_bound(self, qg: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
        """``sum_d max(q_d * min_d, q_d * max_d)`` of every page for every query head: ``qg`` ``[B, Hkv, G, D]``
        float32, ``lo``/``hi`` ``[B, Hkv, Pq, D]`` → ``[B, Hkv, G, Pq]`` float32 (the paper's elementwise form;
        `experiments/quest_select_bench.py` times an equal sign-split form beside it)."""
        lo, hi = lo.astype(jnp.float32), hi.astype(jnp.float32)
        return jnp.maximum(qg[:, :, :, None] * lo[:, :, None], qg[:, :, :, None] * hi[:, :, None]).sum(-1)

    def decode_select(self, q: jax.Array, kv: LayerKV, length: jax.Array, layer_state: Any, shared_state: Any,
                      layer_index: jax.Array, page_size: int) -> Selection:
        """The pages to read: ``None`` (an exact budget) or ``(page_ids [B, Hkv, P], counts [B, Hkv])``. ``kv``'s
        page summaries ``[B, Hkv, P, D]`` and ``length`` ``[B]``, or on a page pool (``Options(pool=True)``,
        experimental) the layer's logical pages read through its tables (`cache_pooled.layer_kv`) and each
        head's length ``[B, Hkv]``: the ids are then logical pages of each head, ``[0, M)``. The list has
        ``P`` entries: the cache pages of the read Quest pages that are in use (below the length), the newest
        Quest page's last; entries past the count are valid page ids the kernel ignores."""
        if self.exact:
            return None
        missing = self.page_summaries - kv.summaries
        if missing:
            raise ValueError(f"Quest reads the page summaries {sorted(missing)}, which this cache does not hold "
                             "(build it with init_cache(summaries=policy.page_summaries))")
        B, Hkv, P, D = kv.page_min.shape
        m = self.page_size // page_size  # cache pages per Quest page
        Pq = -(-P // m)  # the last Quest page may hold fewer than m cache pages (a capacity of P % m != 0)

        def grouped(x: jax.Array, reduce) -> jax.Array:
            """``[B, Hkv, P, ...]`` cache-page summaries → ``[B, Hkv, Pq, ...]`` Quest pages: the page axis
            padded with copies of the last cache page (neutral for min and max: a partial last Quest page
            is summarised from the cache pages it has), then reduced over each Quest page's m pages."""
            if Pq * m != P:
                x = jnp.pad(x, ((0, 0), (0, 0), (0, Pq * m - P)) + ((0, 0),) * (x.ndim - 3), mode="edge")
            return reduce(x.reshape(B, Hkv, Pq, m, *x.shape[3:]), axis=3)

        lo, hi = grouped(kv.page_min, jnp.min), grouped(kv.page_max, jnp.max)
        qg = q.reshape(B, Hkv, -1, D).astype(jnp.float32)  # [B, Hkv, G, D]
        bias = grouped(kv.page_max_bias, jnp.max)  # [B, Hkv, Pq]
        score = self.page_bound(qg, lo, hi).max(2) / jnp.sqrt(jnp.float32(D)) + bias  # [B, Hkv, Pq]
        # each (row, head)'s length: a page pool's [B, Hkv] (each head's own pages in use) or the rows' [B]
        lengths = jnp.broadcast_to(length if length.ndim == 2 else length[:, None], (B, Hkv))
        used = -(-lengths // self.page_size)  # Quest pages in use
        used_cache = -(-lengths // page_size)  # cache pages in use (<= P)
        newest = used - 1  # the Quest page holding the newest token: always read, listed last
        k = min(self.pages_read(self.prompt_len), Pq)
        # the k - 1 best pages before the newest one (all whole: every cache page in use), then the newest
        if k > 1:
            by_sort = self.backend is None or self.backend.mesh is not None
            best, n_best = top_pages(score, jnp.maximum(newest, 0), k - 1, by_sort=by_sort)
        else:
            best, n_best = jnp.zeros((B, Hkv, 0), jnp.int32), jnp.zeros((B, Hkv), jnp.int32)
        slot = jnp.arange(Pq, dtype=jnp.int32)
        ids = jnp.pad(best, ((0, 0), (0, 0), (0, Pq - best.shape[-1])))
        ids = jnp.where(slot == n_best[..., None], newest[..., None], ids)
        n = n_best + 1
        # dense layers: every page in use, in order (so the newest is listed last there too)
        dense = layer_index < self.dense_layers
        ids = jnp.where(dense, jnp.broadcast_to(slot, (B, Hkv, Pq)), ids).astype(jnp.int32)
        n = jnp.where(dense, used, n)
        # expand Quest pages to the cache's pages: the listed pages before the newest are whole; of the newest
        # only the cache pages in use are counted (none past P, nor past the length: read = pages really read)
        ids = (ids[..., None] * m + jnp.arange(m, dtype=jnp.int32)).reshape(B, Hkv, Pq * m)[..., :P]
        ids = jnp.minimum(ids, P - 1)  # entries past the count (ignored) stay valid page indices
        counts = jnp.where(used > 0, (n - 1) * m + used_cache - newest * m, 0).astype(jnp.int32)
        return ids, counts
