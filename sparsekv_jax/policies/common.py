"""Mechanics every policy shares: budgets, forced slots (sinks, recent window), compaction of the
cache to the kept entries, page top-k. Written once here; policies only score.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

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

KEEP = 1e30  # score that forces an entry to be kept (finite: sorts above everything else)


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


def top_k(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """``(values, indices)`` of the ``k`` largest entries of the last axis, as `jax.lax.top_k` (ties:
    the lower index first) but by a stable descending sort: XLA partitions a sort over the leading
    (layer, row, head) axes of a sharded operand, whereas it gathers `lax.top_k`'s operand whole onto
    every device (`sparsekv_jax.sharding`). For a budget of many entries XLA sorts for a top-k anyway."""
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
    """
    L, B, H, K, D = k.shape
    new_S = pages_for(capacity, cache.page_size) * cache.page_size
    if K > new_S:
        raise ValueError(f"write_entries: {K} entries per head do not fit a cache of capacity {capacity}")
    counts = jnp.broadcast_to(counts[None, :, None] if counts.ndim == 1 else counts, (L, B, H)).astype(jnp.int32)
    length = counts.max(axis=(0, 2))  # [B]
    slot = jnp.arange(K)
    live = slot < counts[..., None]  # [L, B, H, K]
    hole = ~live & (slot < length[None, :, None, None])

    def pad(x: jax.Array, fill) -> jax.Array:
        widths = [(0, 0)] * x.ndim
        widths[3] = (0, new_S - K)
        return jnp.pad(x, widths, constant_values=fill)

    zero = jnp.zeros((), k.dtype)
    old = cache.layers
    quantized = old.quantized
    keys = pad(jnp.where(live[..., None], k, zero), 0)
    values = pad(jnp.where(live[..., None], v, zero), 0)
    n_pages = new_S // cache.page_size
    scales = {}
    if quantized:  # summaries in the model's dtype (the min/max the cache holds), K/V as codes
        summary_dtype = next((x.dtype for x in (old.page_min, old.page_max) if x is not None), jnp.float32)
        kz = page_zeros(keys, pad(live, False), cache.page_size)
        if k_zero is not None:  # a page whose live entries share their old zero points keeps them
            ps, big = cache.page_size, jnp.finfo(jnp.float32).max
            hint = pad(k_zero.astype(jnp.float32), 0).reshape(L, B, H, n_pages, ps, D)
            lp = pad(live, False).reshape(L, B, H, n_pages, ps, 1)
            hi, lo = jnp.where(lp, hint, -big).max(4), jnp.where(lp, hint, big).min(4)
            kz = jnp.where(hi == lo, hi, kz.astype(jnp.float32)).astype(SCALE_DTYPE)
        ks, vs = page_scales(keys, values, pad(live, False), cache.page_size, old.k.dtype, old.v.dtype, k_zero=kz)
        scales = {"k_scale": ks.astype(SCALE_DTYPE), "k_zero": kz, "v_scale": vs.astype(SCALE_DTYPE)}
        stored_k = quantize(keys, jnp.repeat(ks, cache.page_size, axis=-2), old.k.dtype,
                            jnp.repeat(kz, cache.page_size, axis=-2))
        stored_v = quantize(values, jnp.repeat(vs, cache.page_size, axis=-1)[..., None], old.v.dtype)
    else:
        summary_dtype = old.k.dtype
        stored_k, stored_v = keys.astype(old.k.dtype), values.astype(old.v.dtype)
    layers = LayerKV(
        k=stored_k, v=stored_v,
        positions=pad(jnp.where(live, positions, -1).astype(jnp.int32), -1),
        bias=pad(jnp.where(live, bias, jnp.where(hole, -jnp.inf, 0.0)).astype(jnp.float32), 0.0),
        **empty_summaries(old.summaries, (L, B, H, n_pages, D), summary_dtype), **scales)
    layers = summarize_pages(layers, length, cache.page_size, keys=keys if quantized else None)
    # the local layers' ring buffers (if any) are the policy's to leave alone
    return KVCache(layers=layers, length=length, next_position=cache.next_position, local=cache.local,
                   page_size=cache.page_size)


def compact(cache: KVCache, scores: jax.Array, keep: jax.Array, capacity: int) -> KVCache:
    """A new, smaller cache holding, per (layer, row, KV head), the ``keep[b]`` best-scored slots.

    ``scores`` ``[L, B, H, S]`` (higher = keep); ``keep`` ``[B]``; ``capacity`` the new cache's
    size in tokens (rounded up to pages; must be >= max kept + the tokens still to decode).
    Entries keep their RoPE positions and biases, in slot order; written by `write_entries`.
    """
    L, B, H, S = scores.shape
    k_static = min(S, capacity)
    slots, _ = keep_slots(scores, cache.length, keep, k_static)  # [L, B, H, K]
    return write_kept(cache, jnp.minimum(slots, S - 1), jnp.minimum(keep, cache.length), capacity)


def write_kept(cache: KVCache, idx: jax.Array, counts: jax.Array, capacity: int) -> KVCache:
    """A new cache of ``capacity`` tokens holding, per (layer, row, KV head), the entries at slots
    ``idx`` ``[L, B, H, K]`` (in slot order; the first ``counts`` of them are kept: ``counts`` ``[B]``
    or ``[L, B, H]``), with their RoPE positions and biases, written by `write_entries` (a quantised
    cache's entries are dequantised exactly with their pages' scales, then re-quantised there)."""
    old = cache.layers

    def take(x: jax.Array, at: jax.Array = idx) -> jax.Array:
        return jnp.take_along_axis(x, at.reshape(at.shape + (1,) * (x.ndim - 4)), axis=3)

    k, v = take(old.k), take(old.v)
    k_zero = None
    if old.quantized:  # the kept entries dequantised with their pages' scales and key zero points (keys in
        page = idx // cache.page_size  # float32, exact with their zero points; values exact in bf16)
        k_zero = take(old.k_zero, page)
        k = dequantize(k, take(old.k_scale, page), jnp.float32, k_zero)
        v = dequantize(v, take(old.v_scale, page)[..., None], jnp.bfloat16)
    return write_entries(cache, k, v, take(old.positions), take(old.bias), counts, capacity, k_zero)


def top_pages(page_scores: jax.Array, used_pages: jax.Array, k: int,
              forced: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Top-``k`` pages per (row, KV head) among the pages in use.

    ``page_scores`` ``[B, H, P]``; ``used_pages`` ``[B]``; ``forced`` ``[B, H, P]`` bool pages
    always selected. Returns ``(page_ids [B, H, k], counts [B, H])`` (ids past ``count`` unused).
    """
    P = page_scores.shape[-1]
    k = min(k, P)
    page = jnp.arange(P)
    in_use = page < used_pages[:, None, None]
    s = page_scores.astype(jnp.float32)
    if forced is not None:
        s = jnp.where(forced, KEEP + page, s)
    s = jnp.where(in_use, s, -jnp.inf)
    _, ids = top_k(s, k)
    counts = jnp.broadcast_to(jnp.minimum(used_pages, k)[:, None], ids.shape[:2]).astype(jnp.int32)
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
