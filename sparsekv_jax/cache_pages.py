"""Pages of the paged cache (`sparsekv_jax.cache`): how many a capacity needs (`pages_for`), how many
live slots each holds (`page_counts`), and the key summaries kept per page (`SUMMARIES`, the layout in
`sparsekv_jax.cache`'s docstring): allocated empty (`empty_summaries`), recomputed in one pass
(`summarize_pages`), read as means (`page_mean`). The writes keep them current (`sparsekv_jax.cache_write`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

if TYPE_CHECKING:
    from sparsekv_jax.cache import LayerKV

# the page summaries a cache may hold (`sparsekv_jax.cache` docstring); a policy declares the ones it reads
SUMMARIES = ("page_sum", "page_min", "page_max", "page_max_bias")


def pages_for(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size)


def check_summaries(summaries: Iterable[str]) -> frozenset[str]:
    """``summaries`` as a frozenset of names from `SUMMARIES` (``ValueError`` naming an unknown one)."""
    if isinstance(summaries, str):
        raise ValueError(f"summaries={summaries!r} must be a collection of names from {SUMMARIES}, not a string")
    names = frozenset(summaries)
    unknown = sorted(names - set(SUMMARIES))
    if unknown:
        raise ValueError(f"unknown page summaries {unknown}; a cache holds {SUMMARIES}")
    return names


def empty_summaries(summaries: Iterable[str], shape: tuple[int, ...], dtype: jnp.dtype) -> dict[str, Any]:
    """The page-summary fields of an empty `LayerKV` with pages ``shape`` ``[..., P, D]`` and keys of
    ``dtype``: each of ``summaries`` allocated (sums fp32, min/max in ``dtype``, max bias ``-inf``),
    the others ``None``."""
    make = {"page_sum": lambda: jnp.zeros(shape, jnp.float32), "page_min": lambda: jnp.zeros(shape, dtype),
            "page_max": lambda: jnp.zeros(shape, dtype),
            "page_max_bias": lambda: jnp.full(shape[:-1], -jnp.inf, jnp.float32)}
    names = check_summaries(summaries)
    return {name: make[name]() if name in names else None for name in SUMMARIES}


def _key_summaries(kv: LayerKV, keys: jax.Array, valid: jax.Array, page_size: int) -> dict[str, jax.Array]:
    """The key page summaries ``kv`` holds (sum, min, max) of ``keys`` ``[..., S, D]`` over the
    ``valid`` ``[..., S]`` slots, ``[..., S / page_size, D]`` each (an empty page: zeros)."""
    held = kv.summaries - {"page_max_bias"}
    *lead, S, D = keys.shape
    P = S // page_size
    live = valid.reshape(*lead, P, page_size, 1)
    k = keys.reshape(*lead, P, page_size, D)
    big = jnp.asarray(jnp.finfo(k.dtype).max, k.dtype)
    has_any = live.any(-2)
    new = {}
    if "page_sum" in held:
        new["page_sum"] = jnp.where(live, k, 0).sum(-2, dtype=jnp.float32)
    if "page_min" in held:
        new["page_min"] = jnp.where(has_any, jnp.where(live, k, big).min(-2).astype(kv.page_min.dtype), 0)
    if "page_max" in held:
        new["page_max"] = jnp.where(has_any, jnp.where(live, k, -big).max(-2).astype(kv.page_max.dtype), 0)
    return new


def summarize_pages(kv: LayerKV, length: jax.Array, page_size: int, keys: jax.Array | None = None) -> LayerKV:
    """Recompute the page summaries ``kv`` holds from the keys in slots ``< length`` (one layer or
    stacked layers; a cache holding none is returned as it is).

    Stacked layers are summarised one at a time (`lax.map`) and min/max are taken in the storage
    dtype (exact), so no fp32 copy of the whole cache is ever materialised. ``keys`` (the shape of
    ``kv.k``): the keys to summarise instead of the stored ones (a quantised cache's, before
    quantisation); a quantised cache without them keeps its key summaries, written with the keys,
    and only ``page_max_bias`` is recomputed.
    """
    held = kv.summaries
    if kv.quantized and keys is None:
        held = held & {"page_max_bias"}
    if not held:
        return kv
    if kv.k.ndim == 5:
        if keys is None:
            return jax.lax.map(lambda layer: summarize_pages(layer, length, page_size), kv)
        return jax.lax.map(lambda a: summarize_pages(a[0], length, page_size, a[1]), (kv, keys))
    B, H, S, D = kv.k.shape
    P = S // page_size
    valid = _slot_valid(length, (B, H, S)) & (kv.positions >= 0)
    new = _key_summaries(kv, kv.k if keys is None else keys, valid, page_size) if held - {"page_max_bias"} else {}
    if "page_max_bias" in held:
        new["page_max_bias"] = jnp.where(valid.reshape(B, H, P, page_size), kv.bias.reshape(B, H, P, page_size),
                                         -jnp.inf).max(-1)
    return kv.replace(**new)


def _slot_valid(length: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """Bool mask of shape ``shape`` (``[..., B, H, S]``) true where slot < length[b]."""
    S = shape[-1]
    return jnp.broadcast_to(jnp.arange(S)[None, None, :] < length[:, None, None], shape)


def page_counts(length: jax.Array, num_pages: int, page_size: int) -> jax.Array:
    """``[B, P]`` number of valid slots in each page; with per-head lengths ``[B, H]`` (a page pool's,
    `sparsekv_jax.cache_pooled`) ``[B, H, P]``, and so on for any leading shape."""
    starts = jnp.arange(num_pages) * page_size
    return jnp.clip(length[..., None] - starts, 0, page_size)


def page_mean(kv: LayerKV, length: jax.Array, page_size: int) -> jax.Array:
    """``[..., B, H, P, D]`` mean key of each page (zero for empty pages); ``kv`` must hold ``page_sum``.

    ``length``: ``[B]`` (the uniform cache's, one per row) or ``[B, H]`` (one per head: a page pool's
    layer, `sparsekv_jax.cache_pooled.layer_pages`)."""
    if kv.page_sum is None:
        raise ValueError("page_mean: this cache holds no page_sum (build it with init_cache(summaries=...) "
                         "naming 'page_sum', or from a policy whose page_summaries include it)")
    counts = page_counts(length, kv.page_sum.shape[-2], page_size)  # [B, P] or [B, H, P]
    if length.ndim == 1:
        counts = counts[:, None, :]
    denom = jnp.maximum(counts, 1).astype(jnp.float32)[..., None]
    return kv.page_sum / denom
