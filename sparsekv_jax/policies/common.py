"""Mechanics every policy shares: budgets, forced slots (sinks, recent window), compaction of the
cache to the kept entries, page top-k. Written once here; policies only score.

Compaction has two targets. The uniform cache (`write_entries`, `write_kept`, `compact`: the engine's
default) gives every head the row's largest count and leaves holes. The page pool (issue 38,
docs/PAGE_POOL.md, migration steps 3-4) writes each head's entries into pages of its own, no holes:
`write_entries_pool`, `write_kept_pool`, with the same per-page math (`_entry_pages`). The engine picks the
target, not the policy: with ``Options(pool=True)`` (experimental) a compress stage that declares
``writes_entries`` is handed a `PoolTarget` (the prefill pool's uniform view), and `write_entries`, the one
write of every compressor (directly: SemantiCache's merge; through `write_kept`: `compact`,
`adakv.keep_counts`), then writes a fresh decode pool (`write_entries_pool`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax.cache import (
    SCALE_DTYPE,
    KVCache,
    LayerKV,
    dequantize,
    empty_summaries,
    page_scales,
    page_zeros,
    pages_for,
    quantize,
    summarize_pages,
)
from sparsekv_jax.cache_pooled import PoolCache, decode_pool, put_pages, take_logical

KEEP = 1e30  # score that forces an entry to be kept (finite: sorts above everything else)


@struct.dataclass
class PoolTarget(KVCache):
    """A uniform cache (the prefill pool's `cache_pooled.stack_view`, no copy) whose compaction goes into a
    fresh decode pool of ``pool_pages`` pages: `write_entries` given one writes `write_entries_pool`, so a
    compress stage whose one write is `write_entries` (directly, or through `write_kept`, `compact` or
    `adakv.keep_counts`: ``Policy.writes_entries``) returns a `cache_pooled.PoolCache` unchanged. Made by
    the engine (``Options(pool=True)``, experimental, `engine.pooled.compress_target`); the policy reads it
    as any `KVCache`."""

    pool_pages: int = struct.field(pytree_node=False, default=0)


def check_budget(budget: float | int, field: str = "budget") -> None:
    """A budget is a fraction in (0, 1] of the context or a positive token count."""
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"{field}={budget!r} must be a fraction in (0, 1] or a token count >= 1")
    if isinstance(budget, float) and not 0.0 < budget <= 1.0:
        raise ValueError(f"{field}={budget} must be a fraction in (0, 1] or an integer token count")
    if isinstance(budget, int) and budget < 1:
        raise ValueError(f"{field}={budget} must be a token count >= 1 (or a fraction in (0, 1])")


def budget_tokens(budget: float | int, context: int) -> int:
    """Tokens kept for a prompt of ``context`` tokens: ``floor(f * T)`` (at least 1) or the count,
    never more than the context. (floor matches kvpress' ``int(T * (1 - ratio))``.)"""
    if isinstance(budget, float):
        return max(1, min(context, int(math.floor(budget * context + 1e-9))))
    return min(budget, context)


def row_budgets(budget: float | int, lengths: jax.Array) -> jax.Array:
    """Per-row kept counts ``[B]`` for right-padded rows of different lengths (traceable)."""
    if isinstance(budget, float):
        n = jnp.floor(budget * lengths.astype(jnp.float32) + 1e-6).astype(jnp.int32)
        return jnp.clip(n, 1, lengths)
    return jnp.minimum(jnp.int32(budget), lengths)


def check_sinks_window(budget: float | int, sinks: int, window: int, context: int | None = None) -> None:
    """Sinks and the recent window are counted inside the budget: they must fit."""
    if sinks < 0:
        raise ValueError(f"sinks={sinks} must be >= 0")
    if window < 0:
        raise ValueError(f"window={window} must be >= 0")
    if isinstance(budget, int) and sinks + window > budget:
        raise ValueError(f"sinks={sinks} + window={window} = {sinks + window} is larger than budget={budget}")
    if context is not None and isinstance(budget, float):
        n = budget_tokens(budget, context)
        need = sinks + window
        if need > n and n < context:  # e.g. SnapKV's paper window (32) on a short prompt: say what to change
            longer = math.ceil(need / budget - 1e-9)
            while budget_tokens(budget, longer) < need:
                longer += 1
            fraction = math.ceil(need / context * 100) / 100
            smaller = f" a window of at most {n - sinks} (window={n - sinks})," if n - sinks >= 1 else ""
            raise ValueError(f"sinks={sinks} + window={window} = {need} tokens are always kept, more than "
                             f"budget={budget} keeps of a {context}-token prompt ({n} tokens): pass a budget of at "
                             f"least {fraction:g} (or budget={need}, a token count),{smaller} or a prompt of at "
                             f"least {longer} tokens")


def force_sinks_and_window(scores: jax.Array, length: jax.Array, sinks: int, window: int | jax.Array) -> jax.Array:
    """Raise the scores of the first ``sinks`` and last ``window`` used slots above any score.

    ``scores`` ``[..., B, H, S]``; ``length`` ``[B]``; ``window`` an int or ``[B]``. When a row's
    budget is smaller than sinks + window, sinks win, then the most recent tokens.
    """
    S = scores.shape[-1]
    slot = jnp.arange(S)
    ln = length[:, None, None]
    win = jnp.asarray(window).reshape(-1, 1, 1)
    in_window = (slot >= ln - win) & (slot < ln)
    # distinct forced scores in fp32: 2·KEEP for sinks, KEEP·(1 + slot/S) for the window
    forced = jnp.where(slot < sinks, 2.0 * KEEP, KEEP * (1.0 + slot / S))
    return jnp.where((slot < sinks) | in_window, forced.astype(scores.dtype), scores)


def top_k(x: jax.Array, k: int, by_sort: bool = True) -> tuple[jax.Array, jax.Array]:
    """``(values, indices)`` of the ``k`` largest entries of the last axis, as `jax.lax.top_k` (ties:
    the lower index first) but by a stable descending sort: XLA partitions a sort over the leading
    (layer, row, head) axes of a sharded operand, whereas it gathers `lax.top_k`'s operand whole onto
    every device (`sparsekv_jax.sharding`). For a budget of many entries XLA sorts for a top-k anyway.
    ``by_sort=False``: `jax.lax.top_k` itself (the same entries, the same order), for a caller that knows
    its operand is not sharded (Quest's per-step page choice: 18% of its selection on one GPU,
    docs/BENCHMARKS.md "Quest's page selection alone")."""
    if not by_sort:
        values, ids = jax.lax.top_k(x, k)
        return values, ids.astype(jnp.int32)
    ids = jnp.argsort(x, axis=-1, descending=True, stable=True)[..., :k]
    return jnp.take_along_axis(x, ids, axis=-1), ids.astype(jnp.int32)


def keep_slots(scores: jax.Array, length: jax.Array, keep: jax.Array, k_static: int) -> tuple[jax.Array, jax.Array]:
    """Top ``keep[b]`` used slots by score, as ascending slot indices.

    ``scores`` ``[..., B, H, S]``. Returns ``(slots [..., B, H, k_static], valid [..., B, H, k_static])``:
    the kept slots sorted ascending (so RoPE positions stay in order), padded with ``S`` where a
    row keeps fewer than ``k_static``.
    """
    S = scores.shape[-1]
    used = jnp.arange(S) < length[:, None, None]
    scores = jnp.where(used, scores.astype(jnp.float32), -jnp.inf)
    _, top = top_k(scores, k_static)
    chosen = jnp.arange(k_static) < keep[:, None, None]
    slots = jnp.sort(jnp.where(chosen, top, S), axis=-1)
    return slots, slots < S


def write_entries(cache: KVCache, k: jax.Array, v: jax.Array, positions: jax.Array, bias: jax.Array,
                  counts: jax.Array, capacity: int, k_zero: jax.Array | None = None) -> KVCache:
    """A new cache of ``capacity`` tokens holding the given entries: the one write every compressor
    ends with, whether it keeps existing entries (`compact`) or writes new ones (merged entries).

    ``k``/``v`` ``[L, B, H, K, D]``, ``positions`` ``[L, B, H, K]`` (RoPE positions the keys were
    rotated with), ``bias`` ``[L, B, H, K]`` (additive logit, e.g. log cluster size), ``counts``
    ``[L, B, H]`` or ``[B]``: the first ``counts`` entries of each (layer, row, KV head) are live.
    Heads may keep different numbers: the row's ``length`` is its largest count, and the slots a
    head leaves empty below it are *holes* (position ``-1``, bias ``-inf``, zero K/V) that no
    attention path reads. ``next_position`` is kept: decoding continues after the original prompt.
    The page summaries the cache holds are recomputed (the others stay ``None``).

    A quantised cache (`sparsekv_jax.cache`, ``kv_dtype``) gets the entries quantised into its new
    pages, scales from each page's live entries, and its key summaries from ``k`` as given (before
    quantisation), key scales and zero points as `sparsekv_jax.cache_quant` says. Values that come
    from a quantised cache are exact multiples of their old scale, so they move to a new page
    losslessly unless that page needs a larger scale. Keys that come from one (``k_zero``
    ``[L, B, H, K, D]``: each entry's old page's zero points, with ``k`` dequantised in float32,
    `write_kept`) keep their zero points where a new page's live entries all share them (a page
    kept whole, or in part), so they too move losslessly unless the page needs a larger scale;
    elsewhere the new page's mid-range re-rounds them (at most half a step of it, for int8).

    Given a `PoolTarget` (the engine's ``Options(pool=True)``), the same entries go into a fresh decode
    pool of its ``pool_pages`` pages instead, each head in pages of its own, no holes (`write_entries_pool`;
    ``capacity`` is then each head's most tokens): a `PoolCache`.
    """
    if isinstance(cache, PoolTarget):
        return write_entries_pool(cache, k, v, positions, bias, counts, capacity, cache.pool_pages, k_zero)
    L, B, H, K, D = k.shape
    new_S = pages_for(capacity, cache.page_size) * cache.page_size
    if K > new_S:
        raise ValueError(f"write_entries: {K} entries per head do not fit a cache of capacity {capacity}")
    counts = jnp.broadcast_to(counts[None, :, None] if counts.ndim == 1 else counts, (L, B, H)).astype(jnp.int32)
    length = counts.max(axis=(0, 2))  # [B]
    slot = jnp.arange(K)
    live = slot < counts[..., None]  # [L, B, H, K]
    hole = ~live & (slot < length[None, :, None, None])
    layers, keys = _entry_pages(cache.layers, k, v, positions, bias, live, hole, new_S, cache.page_size, k_zero)
    layers = summarize_pages(layers, length, cache.page_size, keys=keys if cache.layers.quantized else None)
    # the local layers' ring buffers (if any) are the policy's to leave alone
    return KVCache(layers=layers, length=length, next_position=cache.next_position, local=cache.local,
                   page_size=cache.page_size)


def _entry_pages(old: LayerKV, k: jax.Array, v: jax.Array, positions: jax.Array, bias: jax.Array, live: jax.Array,
                 hole: jax.Array | None, width: int, page_size: int,
                 k_zero: jax.Array | None) -> tuple[LayerKV, jax.Array]:
    """The per-page math of a compaction write, shared by `write_entries` (the uniform cache) and
    `write_entries_pool` (a page pool): the entries ``[L, B, H, K, ...]`` (the ``live`` ``[L, B, H, K]`` ones
    kept, the rest emptied) laid out over ``width`` slots per head (``K <= width``, whole pages of
    ``page_size``), stored as ``old``'s leaves (codes, scales and zero points when quantised: `page_zeros`,
    `page_scales`, `quantize`). ``hole`` ``[L, B, H, K]`` (or None: no holes) marks slots whose bias is
    ``-inf``. Returns ``(layers [L, B, H, width, ...], keys)``, the page summaries still empty (the caller
    recomputes them from ``keys``, the float keys before quantisation)."""
    L, B, H, K, D = k.shape
    new_S = width

    def pad(x: jax.Array, fill) -> jax.Array:
        widths = [(0, 0)] * x.ndim
        widths[3] = (0, new_S - K)
        return jnp.pad(x, widths, constant_values=fill)

    zero = jnp.zeros((), k.dtype)
    quantized = old.quantized
    keys = pad(jnp.where(live[..., None], k, zero), 0)
    values = pad(jnp.where(live[..., None], v, zero), 0)
    n_pages = new_S // page_size
    scales = {}
    if quantized:  # summaries in the model's dtype (the min/max the cache holds), K/V as codes
        summary_dtype = next((x.dtype for x in (old.page_min, old.page_max) if x is not None), jnp.float32)
        kz = page_zeros(keys, pad(live, False), page_size)
        if k_zero is not None:  # a page whose live entries share their old zero points keeps them
            ps, big = page_size, jnp.finfo(jnp.float32).max
            hint = pad(k_zero.astype(jnp.float32), 0).reshape(L, B, H, n_pages, ps, D)
            lp = pad(live, False).reshape(L, B, H, n_pages, ps, 1)
            hi, lo = jnp.where(lp, hint, -big).max(4), jnp.where(lp, hint, big).min(4)
            kz = jnp.where(hi == lo, hi, kz.astype(jnp.float32)).astype(SCALE_DTYPE)
        ks, vs = page_scales(keys, values, pad(live, False), page_size, old.k.dtype, old.v.dtype, k_zero=kz)
        scales = {"k_scale": ks.astype(SCALE_DTYPE), "k_zero": kz, "v_scale": vs.astype(SCALE_DTYPE)}
        stored_k = quantize(keys, jnp.repeat(ks, page_size, axis=-2), old.k.dtype,
                            jnp.repeat(kz, page_size, axis=-2))
        stored_v = quantize(values, jnp.repeat(vs, page_size, axis=-1)[..., None], old.v.dtype)
    else:
        summary_dtype = old.k.dtype
        stored_k, stored_v = keys.astype(old.k.dtype), values.astype(old.v.dtype)
    layers = LayerKV(
        k=stored_k, v=stored_v,
        positions=pad(jnp.where(live, positions, -1).astype(jnp.int32), -1),
        bias=pad(jnp.where(live, bias, 0.0 if hole is None else jnp.where(hole, -jnp.inf, 0.0)).astype(jnp.float32),
                 0.0),
        **empty_summaries(old.summaries, (L, B, H, n_pages, D), summary_dtype), **scales)
    return layers, keys


def compact(cache: KVCache, scores: jax.Array, keep: jax.Array, capacity: int) -> KVCache | PoolCache:
    """A new, smaller cache holding, per (layer, row, KV head), the ``keep[b]`` best-scored slots.

    ``scores`` ``[L, B, H, S]`` (higher = keep); ``keep`` ``[B]``; ``capacity`` the new cache's
    size in tokens (rounded up to pages; must be >= max kept + the tokens still to decode).
    Entries keep their RoPE positions and biases, in slot order; written by `write_kept` (into a
    page pool when ``cache`` is a `PoolTarget`).
    """
    L, B, H, S = scores.shape
    k_static = min(S, capacity)
    slots, _ = keep_slots(scores, cache.length, keep, k_static)  # [L, B, H, K]
    return write_kept(cache, jnp.minimum(slots, S - 1), jnp.minimum(keep, cache.length), capacity)


def write_kept(cache: KVCache, idx: jax.Array, counts: jax.Array, capacity: int) -> KVCache | PoolCache:
    """A new cache of ``capacity`` tokens holding, per (layer, row, KV head), the entries at slots
    ``idx`` ``[L, B, H, K]`` (in slot order; the first ``counts`` of them are kept: ``counts`` ``[B]``
    or ``[L, B, H]``), with their RoPE positions and biases, written by `write_entries` (a quantised
    cache's entries are dequantised exactly with their pages' scales, then re-quantised there).

    Given a `PoolTarget` (the engine's ``Options(pool=True)``), `write_entries` writes them into a fresh
    decode pool instead, each head in pages of its own (as `write_kept_pool` would): a `PoolCache`."""
    def take(x: jax.Array, at: jax.Array, per_page: bool) -> jax.Array:
        return jnp.take_along_axis(x, at.reshape(at.shape + (1,) * (x.ndim - 4)), axis=3)

    k, v, positions, bias, k_zero = _kept_entries(cache.layers, idx, cache.page_size, take)
    return write_entries(cache, k, v, positions, bias, counts, capacity, k_zero)


def _kept_entries(old: LayerKV, idx: jax.Array, page_size: int, take) -> tuple[jax.Array, ...]:
    """The entries at slots ``idx`` ``[L, B, H, K]`` of the cache whose leaves are ``old``: ``(k, v, positions,
    bias, k_zero)``, a quantised cache's dequantised exactly with their pages' scales and key zero points
    (keys in float32, exact with their zero points; values exact in bf16; ``k_zero`` the zero points, else
    None). ``take(leaf, at, per_page)`` reads ``leaf`` at the slots (``per_page`` false) or pages
    ``at`` ``[L, B, H, K]``: along the slot axis of a uniform cache (`write_kept`), through the tables of a
    pool (`write_kept_pool`)."""
    k, v = take(old.k, idx, False), take(old.v, idx, False)
    k_zero = None
    if old.quantized:
        page = idx // page_size
        k_zero = take(old.k_zero, page, True)
        k = dequantize(k, take(old.k_scale, page, True), jnp.float32, k_zero)
        v = dequantize(v, take(old.v_scale, page, True)[..., None], jnp.bfloat16)
    return k, v, take(old.positions, idx, False), take(old.bias, idx, False), k_zero


def write_entries_pool(cache: KVCache | PoolCache, k: jax.Array, v: jax.Array, positions: jax.Array,
                       bias: jax.Array, counts: jax.Array, capacity: int, num_pages: int | None = None,
                       k_zero: jax.Array | None = None) -> PoolCache:
    """`write_entries` into a fresh decode pool (docs/PAGE_POOL.md, Lifecycle → Compaction; issue 38, step 3):
    each (layer, row, KV head) keeps its first ``counts`` entries in pages of its own, no holes.

    ``k``, ``v``, ``positions``, ``bias``, ``counts`` (``[L, B, H]`` or ``[B]``), ``k_zero``: as `write_entries`.
    ``cache`` (a uniform `KVCache` or a `PoolCache`, e.g. the prefill pool) gives the leaves' dtypes and the
    summaries held, ``page_size``, ``next_position`` and ``local``; its contents are not read. ``capacity``: the
    most tokens a head may ever hold (appends included): ``max_pages_per_head = pages_for(capacity,
    page_size)`` (``M``), and ``K <= M·page_size``. ``num_pages``: the pool's size ``N`` (static; default
    ``L·B·H·M``, the uniform cache's size, which never overflows); size it exactly with
    `cache_pool.pool_pages_needed` (``counts`` plus the tokens still to come).

    Steps (docs/PAGE_POOL.md): (1) ``counts`` → `cache_pooled.decode_pool` (the allocator's prefix sum over the
    ``[L·B, H]`` rows); (2) the entries packed per head, ``[L, B, H, Mk·ps, ...]`` with ``Mk = pages_for(K)``;
    (3) per page exactly `write_entries`' math (`_entry_pages`: zero points, scales, codes; then
    `summarize_pages` over the live entries), then one scatter per leaf by the table (`cache_pooled.put_pages`).
    So logical page ``m`` of a head holds what page ``m`` of that head holds after `write_entries` (which puts
    the same entries in the same first ``count`` slots), byte for byte; the head's ``length`` is its count
    (clipped to ``K``). A pool too small sets ``alloc.overflow`` (check it outside jit): the heads concerned
    keep a prefix of their entries."""
    L, B, H, K, D = k.shape
    ps = cache.page_size
    like = cache.layers if isinstance(cache, KVCache) else cache.pages
    M = pages_for(capacity, ps)
    if K > M * ps:
        raise ValueError(f"write_entries_pool: {K} entries per head do not fit a head of capacity {capacity} "
                         f"({M} pages of {ps})")
    if tuple(cache.next_position.shape) != (B,):
        raise ValueError(f"write_entries_pool: the entries' batch {B} is not the cache's "
                         f"{cache.next_position.shape[0]}")
    c = jnp.asarray(counts)
    if tuple(c.shape) not in ((B,), (L, B, H)):
        raise ValueError(f"counts must be [B]={[B]} or [L, B, H]={[L, B, H]}, got shape {tuple(c.shape)}")
    c = jnp.broadcast_to(c[None, :, None] if c.ndim == 1 else c, (L, B, H))
    c = jnp.minimum(c.astype(jnp.int32), K)
    width = pages_for(K, ps) * ps
    live = jnp.arange(K) < c[..., None]
    layers, keys = _entry_pages(like, k, v, positions, bias, live, None, width, ps, k_zero)
    layers = summarize_pages(layers, jnp.full((B,), width, jnp.int32), ps, keys=keys if like.quantized else None)
    pool = decode_pool(like, c, page_size=ps, max_pages_per_head=M, num_pages=L * B * H * M if num_pages is None
                       else num_pages, next_position=cache.next_position, local=cache.local)
    return put_pages(pool, layers)


def write_kept_pool(cache: KVCache | PoolCache, idx: jax.Array, counts: jax.Array, capacity: int,
                    num_pages: int | None = None) -> PoolCache:
    """`write_kept` into a fresh decode pool: per (layer, row, KV head), the entries at slots ``idx``
    ``[L, B, H, K]`` (the first ``counts`` of them: ``[B]`` or ``[L, B, H]``) gathered from ``cache`` as
    `write_kept` gathers them (a quantised cache's dequantised exactly with their pages' scales and zero
    points), then written by `write_entries_pool` (``capacity``, ``num_pages`` as there). ``cache``: a uniform
    `KVCache` (slots along its slot axis) or a `PoolCache` (logical slots through its tables,
    `cache_pooled.take_logical`: the prefill pool, or any pool). Any scored compressor's ``idx``/``counts``
    (`compact`'s, `adakv.keep_counts`') give the same entries as `write_kept`, each head in its own pages."""
    if isinstance(cache, KVCache):
        def take(x: jax.Array, at: jax.Array, per_page: bool) -> jax.Array:
            return jnp.take_along_axis(x, at.reshape(at.shape + (1,) * (x.ndim - 4)), axis=3)
        old = cache.layers
    else:
        def take(x: jax.Array, at: jax.Array, per_page: bool) -> jax.Array:
            return take_logical(cache, x, at, per_page)
        old = cache.pages
    if jnp.ndim(idx) != 4 or tuple(jnp.shape(idx)[1:2]) != (cache.next_position.shape[0],):
        raise ValueError(f"idx must be [L, B, H, K] with B={cache.next_position.shape[0]}, got shape {jnp.shape(idx)}")
    k, v, positions, bias, k_zero = _kept_entries(old, jnp.asarray(idx, jnp.int32), cache.page_size, take)
    return write_entries_pool(cache, k, v, positions, bias, counts, capacity, num_pages, k_zero)


def top_pages(page_scores: jax.Array, used_pages: jax.Array, k: int,
              forced: jax.Array | None = None, by_sort: bool = True) -> tuple[jax.Array, jax.Array]:
    """Top-``k`` pages per (row, KV head) among the pages in use.

    ``page_scores`` ``[B, H, P]``; ``used_pages`` ``[B]``, or ``[B, H]`` (a page pool's heads, each with its
    own length: the pages are then its logical pages); ``forced`` ``[B, H, P]`` bool pages always selected;
    ``by_sort`` as in `top_k`. Returns ``(page_ids [B, H, k], counts [B, H])`` (ids past ``count`` unused).
    """
    P = page_scores.shape[-1]
    k = min(k, P)
    page = jnp.arange(P)
    per_head = used_pages.ndim == 2
    in_use = page < (used_pages[..., None] if per_head else used_pages[:, None, None])
    s = page_scores.astype(jnp.float32)
    if forced is not None:
        s = jnp.where(forced, KEEP + page, s)
    s = jnp.where(in_use, s, -jnp.inf)
    _, ids = top_k(s, k, by_sort)
    fewer = jnp.minimum(used_pages, k)
    counts = jnp.broadcast_to(fewer if per_head else fewer[:, None], ids.shape[:2]).astype(jnp.int32)
    return ids.astype(jnp.int32), counts


def pages_to_list(mask: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``[..., P]`` bool page mask → ``(ids [..., k], counts [...])``: the marked pages in ascending
    order first (at most ``k`` of them), then unmarked ones the kernel ignores (past the count)."""
    ids = jnp.argsort(~mask, axis=-1, stable=True)[..., :k]
    return ids.astype(jnp.int32), jnp.minimum(mask.sum(-1), k).astype(jnp.int32)


def grouped_mean(x: jax.Array, num_kv_heads: int, axis: int = 1) -> jax.Array:
    """Average query-head scores over each GQA group: ``[B, Hq, ...]`` → ``[B, Hkv, ...]``."""
    shape = x.shape
    g = shape[axis] // num_kv_heads
    return x.reshape(*shape[:axis], num_kv_heads, g, *shape[axis + 1:]).mean(axis + 1)


def prompt_scores_to_slots(observations: jax.Array, capacity: int) -> jax.Array:
    """``[L, B, H, T]`` per-prompt-token scores → ``[L, B, H, S]`` slot scores (after prefill,
    slot = position); slots past the prompt get ``-inf``."""
    T = observations.shape[-1]
    return jnp.pad(observations, ((0, 0),) * 3 + ((0, capacity - T),), constant_values=-jnp.inf)


def entropy_stats(logits: jax.Array) -> jax.Array:
    """Entropy (nats) of the next-token distribution ``softmax(logits)``, ``[B, V]`` → ``[B]``: the
    uncertainty CHESS's trigger averages over a page and `sparsekv_jax.eval.calibrate` measures."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -(jnp.exp(logp) * logp).sum(-1)
