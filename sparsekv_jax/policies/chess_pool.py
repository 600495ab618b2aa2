"""CHESS on a page pool (``Options(pool=True)``, experimental; issue 38, docs/PAGE_POOL.md, step 4): what CHESS
reads of a `cache_pooled.PoolCache`.

CHESS's decode state is per row (its selection ``[B, P]`` of CHESS pages, the cache-page lists it hands the
attention), and its hooks read a cache's row lengths, its pages per head and, when a trigger fires, every layer's
keys (`chess_scores.pre_rope_dots`). `PoolView` gives them that of a pool (the view copies nothing): ``length`` is the
row's (every head of a full-attention pool holds the row's tokens: CHESS runs on the pool only after full
attention's compress stage, `engine.run.pool_refusal`), ``num_pages`` the pages per head ``M`` (the uniform
cache's ``num_pages``: the same capacity), and `PoolView.layer` one layer read through its page tables
(`cache_pooled.layer_kv`, logical slots) with every slot at or past its head's length emptied (position -1, key
0): a pool page is not cleared when it is opened or refilled after a rewind, so such a slot may hold anything.
The rebuild reads the pool one layer at a time, as it reads a quantised uniform cache (a one-layer copy); the
per-step page lists are *logical* pages, which `attention.decode_pool` maps through each head's table.

A rewind (`CHESS.decode_rewind`) moves the allocator's lengths back (`cache_pooled.rewind_pool`, called by
`engine.decode.decode_loop`): the pages stay held and the regenerated tokens refill them at the same logical
slots, no page popped again.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax.cache import LayerKV
from sparsekv_jax.cache_pooled import PoolCache, layer_kv, layer_lengths

__all__ = ["PoolView", "view"]


@struct.dataclass
class PoolView:
    """A `PoolCache` as CHESS's hooks read it (module doc): row ``length`` ``[B]``, ``num_pages`` per head,
    ``page_size``, ``batch``, ``heads``, ``num_layers`` and `layer`."""

    pool: PoolCache

    @property
    def batch(self) -> int:
        return self.pool.batch

    @property
    def heads(self) -> int:
        return self.pool.heads

    @property
    def num_layers(self) -> int:
        return self.pool.num_layers

    @property
    def page_size(self) -> int:
        return self.pool.page_size

    @property
    def num_pages(self) -> int:
        """Pages per head (``M``: the most a head may hold), as `KVCache.num_pages` counts them."""
        return self.pool.max_pages_per_head

    @property
    def capacity(self) -> int:
        return self.num_pages * self.page_size

    @property
    def length(self) -> jax.Array:
        """``[B]`` the row's tokens: the most any of its heads holds (they hold the same on a full-attention
        pool)."""
        return self.pool.lengths.max((0, 2))

    @property
    def quantized(self) -> bool:
        return self.pool.pages.quantized

    @property
    def head_dim(self) -> int:
        return self.pool.pages.k.shape[-1]

    def layer(self, layer: int | jax.Array) -> LayerKV:
        """Layer ``layer`` in a uniform layer's shapes (``k`` ``[B, Hkv, M·ps, D]``, per-page leaves ``[B, Hkv, M,
        ...]``) read through its tables, each slot at or past its head's length empty (position -1, key and value
        0): what a uniform layer's readers may read."""
        kv = layer_kv(self.pool, layer)
        live = jnp.arange(kv.positions.shape[-1]) < layer_lengths(self.pool, layer)[..., None]  # [B, Hkv, M·ps]
        empty = lambda a: jnp.where(live[..., None], a, jnp.zeros((), a.dtype))  # noqa: E731
        return kv.replace(k=empty(kv.k), v=empty(kv.v), positions=jnp.where(live, kv.positions, -1))


def view(cache: PoolCache | object) -> PoolView | object:
    """``cache`` as CHESS reads it: a `PoolView` of a `PoolCache`, any other cache as it is."""
    return PoolView(cache) if isinstance(cache, PoolCache) else cache
