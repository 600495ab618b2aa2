"""CHESS's selection math (`sparsekv_jax.policies.chess`): Algorithm 1's coarse-to-fine top fractions
(grids → chunks → pages) over the pages' scores, the sink and window pages every step reads, the
rebuilt selection and the cache-page lists a decode step reads.

Functions of a `CHESS` policy ``pol`` call back through its methods (``pol._page_scores``) where a
subclass may change them.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from sparsekv_jax.cache import KVCache
from sparsekv_jax.policies.chess_pool import PoolView
from sparsekv_jax.policies.common import pages_to_list

if TYPE_CHECKING:
    from sparsekv_jax.policies.chess import CHESS


def _ceil_count(ratio: float, n: jax.Array) -> jax.Array:
    # 0.7 * 10 is 7.000000000000001 in floating point: the epsilon keeps ceil from taking 8
    return jnp.ceil(ratio * n.astype(jnp.float32) - 1e-4).astype(jnp.int32)


def top_fraction(scores: jax.Array, available: jax.Array, ratio: float) -> jax.Array:
    """``[B, N]`` bool: the ``ceil(ratio · #available)`` best-scored available units of each row."""
    k = _ceil_count(ratio, available.sum(-1))
    order = jnp.argsort(jnp.where(available, -scores, jnp.inf), axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)  # position of each unit in the ranking
    return available & (rank < k[:, None])


def hierarchical_select(page_scores: jax.Array, in_use: jax.Array, candidate: jax.Array,
                        ratios: tuple[float, float, float], chunk_pages: int, grid_chunks: int) -> jax.Array:
    """Algorithm 1: ``[B, P]`` bool mask of the pages kept by grid → chunk → page selection.

    ``page_scores`` ``[B, P]`` anchor · page vector; ``in_use`` pages holding tokens (their scores
    make up the chunk/grid means); ``candidate`` pages that may be selected.
    """
    B, P = page_scores.shape
    per_grid = chunk_pages * grid_chunks
    pad = -P % per_grid
    s, used, cand = (jnp.pad(x, ((0, 0), (0, pad))) for x in (page_scores.astype(jnp.float32), in_use, candidate))
    C, G = (P + pad) // chunk_pages, (P + pad) // per_grid
    rho_g, rho_c, rho_p = ratios

    def mean_of_children(x, present, n):  # [B, M*n] → [B, M] means over present children
        cnt = present.reshape(B, -1, n).sum(-1)
        return jnp.where(present, x, 0.0).reshape(B, -1, n).sum(-1) / jnp.maximum(cnt, 1), cnt > 0

    s_chunk, chunk_used = mean_of_children(s, used, chunk_pages)
    s_grid, _ = mean_of_children(s_chunk, chunk_used, grid_chunks)
    cand_chunk = cand.reshape(B, C, chunk_pages).any(-1)
    cand_grid = cand_chunk.reshape(B, G, grid_chunks).any(-1)
    keep_grid = top_fraction(s_grid, cand_grid, rho_g)
    keep_chunk = top_fraction(s_chunk, cand_chunk & jnp.repeat(keep_grid, grid_chunks, axis=1), rho_c)
    keep_page = top_fraction(s, cand & jnp.repeat(keep_chunk, chunk_pages, axis=1), rho_p)
    return keep_page[:, :P]


def max_selected(num_pages: int, ratios: tuple[float, float, float], chunk_pages: int, grid_chunks: int) -> int:
    """Static upper bound of `hierarchical_select`'s kept pages for ``num_pages`` pages."""
    rho_g, rho_c, rho_p = ratios
    grids = -(-num_pages // (chunk_pages * grid_chunks))
    k_g = math.ceil(rho_g * grids - 1e-4)
    k_c = math.ceil(rho_c * min(k_g * grid_chunks, -(-num_pages // chunk_pages)) - 1e-4)
    return min(num_pages, math.ceil(rho_p * min(k_c * chunk_pages, num_pages) - 1e-4))


def used_pages(pol: CHESS, length: jax.Array) -> jax.Array:
    """``[B]`` CHESS pages in use by a cache of ``length`` slots (what `forced_pages` depends on)."""
    return -(-length // pol.page_size)


def forced_pages(pol: CHESS, length: jax.Array, P: int) -> jax.Array:
    """``[B, P]`` sink and window pages for a cache of ``length`` slots."""
    page = jnp.arange(P)[None]
    used = used_pages(pol, length)[:, None]
    return (page < jnp.minimum(pol.sink_pages, used)) | ((page >= used - pol.window_pages) & (page < used))


def select_pages(pol: CHESS, cache: KVCache, anchor_end: jax.Array) -> jax.Array:
    """``[B, P]`` the context rebuilt for the window ending at ``anchor_end``: the semantic
    selection plus that moment's sink and window pages (they stay read until the next rebuild,
    so e.g. the question's pages do not drop out once generation moves the window on)."""
    scores, in_use = pol._page_scores(cache, anchor_end)
    forced = forced_pages(pol, anchor_end, in_use.shape[1])
    semantic = hierarchical_select(scores, in_use, in_use & ~forced, pol.ratios, pol.chunk_pages,
                                   pol.grid_chunks)
    following = semantic
    for shift in range(1, pol.next_pages + 1):  # static, small: the pages after each kept one
        following = following | jnp.pad(semantic, ((0, 0), (shift, 0)))[:, :semantic.shape[1]]
    return (following & in_use) | forced


def page_list(pol: CHESS, selected: jax.Array, length: jax.Array, cache: KVCache) -> tuple[jax.Array, jax.Array]:
    """Cache-page lists ``[B, H, K]`` and counts ``[B, H]`` for a step at ``length`` slots."""
    B, P = selected.shape
    # a page pool's view (`chess_pool.PoolView`) has no stacked layers: its heads and pages per head
    H, Pc = (cache.heads if isinstance(cache, PoolView) else cache.layers.k.shape[2]), cache.num_pages
    m = pol.page_size // cache.page_size
    read = selected | forced_pages(pol, length, P)
    K = min(P, max_selected(P, pol.ratios, pol.chunk_pages, pol.grid_chunks) * (1 + pol.next_pages)
            + pol.sink_pages + 2 * pol.window_pages)  # the rebuild's window + the current one
    ids, counts = pages_to_list(read, K)
    if m > 1:  # CHESS pages → the cache's pages (ascending, so pages past the cache's end come last)
        ids = (ids[..., None] * m + jnp.arange(m)).reshape(B, K * m)
        counts = ((jnp.arange(K * m) < counts[:, None] * m) & (ids < Pc)).sum(-1)
        ids = jnp.minimum(ids, Pc - 1)
    return (jnp.broadcast_to(ids[:, None], (B, H, ids.shape[-1])).astype(jnp.int32),
            jnp.broadcast_to(counts[:, None], (B, H)).astype(jnp.int32))
