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
    """

    budget: float | int = struct.field(pytree_node=False, default=0.25)
    page_size: int = struct.field(pytree_node=False, default=16)
    dense_layers: int = struct.field(pytree_node=False, default=2)
    prompt_len: int = struct.field(pytree_node=False, default=0)  # set by `bind` before jit

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
        return self.replace(prompt_len=setup.prompt_len)

    @property
    def exact(self) -> bool:
        """A budget covering the whole prompt reads everything: exact dense attention."""
        return budget_tokens(self.budget, self.prompt_len) >= self.prompt_len

    def pages_read(self, prompt_len: int) -> int:
        return -(-budget_tokens(self.budget, prompt_len) // self.page_size)

    def decode_select(self, q: jax.Array, kv: LayerKV, length: jax.Array, layer_state: Any, shared_state: Any,
                      layer_index: jax.Array, page_size: int) -> Selection:
        """The pages to read: ``None`` (an exact budget) or ``(page_ids [B, Hkv, P], counts [B, Hkv])``. ``kv``'s
        page summaries ``[B, Hkv, P, D]`` and ``length`` ``[B]``, or on a page pool (``Options(pool=True)``,
        experimental) the layer's logical pages read through its tables (`cache_pooled.layer_kv`) and each
        head's length ``[B, Hkv]``: the ids are then logical pages of each head, ``[0, M)``."""
        if self.exact:
            return None
        missing = self.page_summaries - kv.summaries
        if missing:
            raise ValueError(f"Quest reads the page summaries {sorted(missing)}, which this cache does not hold "
                             "(build it with init_cache(summaries=policy.page_summaries))")
        B, Hkv, P, D = kv.page_min.shape
        m = self.page_size // page_size  # cache pages per Quest page
        Pq = P // m
        lo = kv.page_min.reshape(B, Hkv, Pq, m, D).min(3)
        hi = kv.page_max.reshape(B, Hkv, Pq, m, D).max(3)
        qg = q.reshape(B, Hkv, -1, D).astype(jnp.float32)  # [B, Hkv, G, D]
        bound = jnp.maximum(qg[:, :, :, None] * lo[:, :, None], qg[:, :, :, None] * hi[:, :, None]).sum(-1)
        bias = kv.page_max_bias.reshape(B, Hkv, Pq, m).max(3)  # [B, Hkv, Pq]
        score = bound.max(2) / jnp.sqrt(jnp.float32(D)) + bias  # [B, Hkv, Pq]
        per_head = length.ndim == 2  # a page pool's [B, Hkv] lengths: each head's own pages in use
        used = -(-length // self.page_size)
        newest = (jnp.arange(Pq) == ((used - 1)[..., None] if per_head else (used - 1)[:, None, None]))
        k = min(self.pages_read(self.prompt_len), Pq)
        ids, counts = top_pages(score, used, k, forced=newest)
        # dense layers: every page in use (list padded to the same static length)
        dense = layer_index < self.dense_layers
        all_ids = jnp.broadcast_to(jnp.arange(Pq, dtype=jnp.int32), (B, Hkv, Pq))
        ids = jnp.where(dense, all_ids, jnp.pad(ids, ((0, 0), (0, 0), (0, Pq - k))))
        counts = jnp.where(dense, jnp.broadcast_to(used if per_head else used[:, None], counts.shape),
                           counts).astype(jnp.int32)
        if m > 1:  # expand Quest pages to the cache's pages
            ids = (ids[..., None] * m + jnp.arange(m)).reshape(B, Hkv, Pq * m)
            counts = counts * m
        return ids, counts
