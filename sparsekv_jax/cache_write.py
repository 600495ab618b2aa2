"""Writes into the paged cache (`sparsekv_jax.cache`): a prefill chunk (`write_chunk`), one token per
row (`append_token`, the decode step's; in place with per-head slots), a run of tokens into a quantised
cache (`write_tokens`), each keeping the page summaries and, for quantised K/V, the pages' scales
current (`sparsekv_jax.cache_quant`: a page is re-scaled as it fills).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from sparsekv_jax.cache_pages import _key_summaries, pages_for
from sparsekv_jax.cache_quant import _rescale_pages, mid_range, page_scales, page_zeros, quantize

if TYPE_CHECKING:
    from sparsekv_jax.cache import LayerKV


def write_chunk(kv: LayerKV, k_new: jax.Array, v_new: jax.Array, start: jax.Array,
                positions: jax.Array, lengths: jax.Array | None = None) -> LayerKV:
    """Write a chunk of ``T`` tokens for every row at slots ``start .. start+T`` (one layer).

    ``k_new``/``v_new``: ``[B, Hkv, T, D]``; ``start``: scalar int (the same slot for every row:
    prefill writes prompts slot-aligned, padding included, and masks by length);
    ``positions``: ``[B, T]``. Page summaries are *not* updated here: call
    `summarize_pages` once the chunks are written.

    A quantised cache is written in whole pages: ``start`` must be a multiple of the page size
    (the one-pass prefill writes at 0; a chunked one in chunks of whole pages) and the chunk is
    padded to whole pages. The pages' scales come from the chunk's slots below ``lengths`` ``[B]``
    (all of them when ``None``); slots past it are written as zeros. The key page summaries the
    cache holds are written here, from the keys before quantisation.
    """
    B, H, T, _ = k_new.shape
    pos = jnp.broadcast_to(positions[:, None, :], (B, H, T)).astype(jnp.int32)
    positions_all = jax.lax.dynamic_update_slice_in_dim(kv.positions, pos, start, axis=2)
    if kv.quantized:
        return _write_chunk_quantized(kv, k_new, v_new, start, lengths).replace(positions=positions_all)
    k = jax.lax.dynamic_update_slice_in_dim(kv.k, k_new.astype(kv.k.dtype), start, axis=2)
    v = jax.lax.dynamic_update_slice_in_dim(kv.v, v_new.astype(kv.v.dtype), start, axis=2)
    return kv.replace(k=k, v=v, positions=positions_all)


def _page_size(kv: LayerKV) -> int:
    return kv.k.shape[-2] // kv.k_scale.shape[-2]


def _write_chunk_quantized(kv: LayerKV, k_new: jax.Array, v_new: jax.Array, start: jax.Array,
                           lengths: jax.Array | None) -> LayerKV:
    """`write_chunk`'s K/V, scales and key summaries for a quantised cache."""
    B, H, T, D = k_new.shape
    ps = _page_size(kv)
    Tp = pages_for(T, ps) * ps
    valid = (jnp.arange(Tp) < T)[None, :]
    if lengths is not None:
        valid = valid & (start + jnp.arange(Tp)[None, :] < lengths[:, None])
    valid = jnp.broadcast_to(valid[:, None, :], (B, H, Tp))
    pad = ((0, 0), (0, 0), (0, Tp - T), (0, 0))
    k = jnp.where(valid[..., None], jnp.pad(k_new, pad), 0)
    v = jnp.where(valid[..., None], jnp.pad(v_new, pad), 0)
    kz = page_zeros(k, valid, ps)
    ks, vs = page_scales(k, v, valid, ps, kv.k.dtype, kv.v.dtype, k_zero=kz)
    kq = quantize(k, jnp.repeat(ks, ps, axis=-2), kv.k.dtype, jnp.repeat(kz, ps, axis=-2))
    vq = quantize(v, jnp.repeat(vs, ps, axis=-1)[..., None], kv.v.dtype)
    first = start // ps

    def put(x: jax.Array, value: jax.Array, at: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), at, axis=2)

    new = {"k": put(kv.k, kq, start), "v": put(kv.v, vq, start), "k_scale": put(kv.k_scale, ks, first),
           "k_zero": put(kv.k_zero, kz, first), "v_scale": put(kv.v_scale, vs, first)}
    for name, value in _key_summaries(kv, k, valid, ps).items():
        new[name] = put(getattr(kv, name), value, first)
    return kv.replace(**new)


def append_token(kv: LayerKV, k_new: jax.Array, v_new: jax.Array, slot: jax.Array,
                 position: jax.Array, new_length: jax.Array, page_size: int,
                 layer: jax.Array | None = None) -> LayerKV:
    """Write one token per row at ``slot`` and refresh that page's summaries (those ``kv`` holds).

    ``kv`` is one layer's cache, or with ``layer`` (int scalar, may be traced) every layer's,
    stacked ``[L, ...]``: then only that layer's token and page are written, in place (a decode
    step that carries the whole cache through the layer scan copies nothing).
    ``k_new``/``v_new``: ``[B, Hkv, D]``; ``slot``: ``[B]`` (append) or ``[B, Hkv]`` (a slot per
    head, e.g. in-place eviction); ``position``: ``[B]``; ``new_length``: ``[B]`` slots in use
    after the write. The written page's sum/min/max are recomputed from its ``page_size`` keys,
    which stays exact when a slot is overwritten and costs O(page) per step.

    Biases: an append (``slot`` ``[B]``, at the row's length) writes past every live entry, where
    slots always hold bias 0 (compression pads with 0, holes lie below the length), so only the
    page's max bias is raised to 0. An in-place overwrite (``slot`` ``[B, Hkv]``) resets the slot's
    bias to 0 (an evicted merged entry's log-size must not carry over to the new token) and
    recomputes the page's max bias from its live slots. (Appends skip the bias gather: at 32
    layers it costs ~0.1 ms of a 6 ms decode step on an H200.) The key summaries are over the
    page's live slots, appends included: below the length, holes (position -1, left by a compressor
    whose heads keep different counts) are not live.

    A quantised cache re-scales the written page (`sparsekv_jax.cache_quant`): the whole page is written
    back, its scale ``max(old, the new token's)``; its summaries come from its earlier entries
    dequantised and the new key as given.
    """
    B, H, D = k_new.shape
    in_place = slot.ndim == 2  # static: per-head slots overwrite (eviction); one slot per row appends
    slot = jnp.broadcast_to(slot[:, None] if slot.ndim == 1 else slot, (B, H))
    scales, page_keys = {}, None
    if kv.quantized:
        k, v, scales, page_keys = _append_quantized(kv, layer, slot, k_new, v_new, page_size, in_place)
    else:
        k = _write(kv.k, layer, slot, k_new)
        v = _write(kv.v, layer, slot, v_new)
    pos = _write(kv.positions, layer, slot, jnp.broadcast_to(position[:, None], (B, H)))
    bias = _write(kv.bias, layer, slot, jnp.zeros((B, H))) if in_place else kv.bias
    held = kv.summaries
    if not held:
        return kv.replace(k=k, v=v, positions=pos, bias=bias, **scales)
    page = slot // page_size  # [B, H]
    in_page = page[..., None] * page_size + jnp.arange(page_size)  # [B, H, ps]
    pick = (lambda a: a) if layer is None else (lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False))
    # holes stay out: a compressor that keeps fewer entries in some heads (AdaKV, PyramidKV) leaves holes
    # (position -1) below the row's length, which an append's page may hold too
    live = (in_page < new_length[:, None, None]) & (jnp.take_along_axis(pick(pos), in_page, axis=2) >= 0)
    new = {}
    if "page_max_bias" in held:
        if in_place:
            page_bias = jnp.where(live, jnp.take_along_axis(pick(bias), in_page, axis=2), -jnp.inf).max(-1)
            new["page_max_bias"] = _write(kv.page_max_bias, layer, page, page_bias)
        else:
            new["page_max_bias"] = _write(kv.page_max_bias, layer, page, jnp.zeros((B, H)), jax.lax.scatter_max)
    if held - {"page_max_bias"}:
        if page_keys is None:
            keys = jnp.take_along_axis(pick(k), in_page[..., None], axis=2).astype(jnp.float32)  # [B, H, ps, D]
        else:
            keys = page_keys

        def put(name: str, value: jax.Array) -> None:
            new[name] = _write(getattr(kv, name), layer, page, value)

        _page_key_summaries(kv, keys, live, k.dtype if page_keys is None else None, put)
    return kv.replace(k=k, v=v, positions=pos, bias=bias, **new, **scales)


def _page_key_summaries(kv: LayerKV, keys: jax.Array, live: jax.Array, key_dtype: Any, put: Any) -> None:
    """The key summaries ``kv`` holds (sum, min, max) of one page per (row, head): ``keys`` ``[B, H, ps, D]`` over
    the ``live`` ``[B, H, ps]`` slots, each ``[B, H, D]`` handed to ``put(name, value)`` in that order (the
    uniform and the pooled append write them their own way). ``key_dtype``: the stored keys' dtype, or
    ``None`` for a quantised cache's float32 keys (min/max are then in the model's dtype)."""
    held = kv.summaries
    valid = live[..., None]
    # representable in the summaries' dtype (min/max are in the keys', or the model's when quantised)
    big = jnp.finfo(key_dtype if key_dtype is not None else kv.page_min.dtype if kv.page_min is not None
                    else kv.page_max.dtype if kv.page_max is not None else jnp.float32).max
    if "page_sum" in held:
        put("page_sum", jnp.where(valid, keys, 0.0).sum(-2))
    if "page_min" in held:
        put("page_min", jnp.where(valid, keys, big).min(-2))
    if "page_max" in held:
        put("page_max", jnp.where(valid, keys, -big).max(-2))


def _append_quantized(kv: LayerKV, layer: jax.Array | None, slot: jax.Array, k_new: jax.Array, v_new: jax.Array,
                      page_size: int, in_place: bool):
    """`append_token`'s write into a quantised cache: ``(k, v, {"k_scale", "k_zero", "v_scale"}, page_keys)``,
    the written page's float32 keys ``[B, H, ps, D]`` (for its summaries). An append that opens a page
    gives it the previous page's key zero points (the token's own key on page 0).

    The page is read with one gather from the (stacked) arrays and written back with one scatter on
    their own shape, the read values passed through an `jax.lax.optimization_barrier`: no layer
    slice, no reshape of the carried stack, and no fusion that reads a buffer while it writes it in
    place (each of which can make XLA copy the whole stacked cache at every layer of every step)."""
    page = slot // page_size  # [B, H]
    first = page * page_size
    new = jnp.arange(page_size) == (slot % page_size)[..., None]  # [B, H, ps]
    fresh = jnp.zeros(page.shape, bool) if in_place else slot % page_size == 0  # an append opening a page
    old = jax.lax.optimization_barrier((
        _read(kv.k, layer, first, page_size), _read(kv.v, layer, first, page_size),
        _read(kv.k_scale, layer, page), _read(kv.k_zero, layer, page), _read(kv.v_scale, layer, page),
        _read(kv.k_zero, layer, jnp.maximum(page - 1, 0))))
    keys, kq, vq, ks, kz, vs = _rescale_append(old, page > 0, k_new, v_new, new, fresh)
    k = _write(kv.k, layer, first, kq, window=page_size)
    v = _write(kv.v, layer, first, vq, window=page_size)
    scales = {"k_scale": _write(kv.k_scale, layer, page, ks), "k_zero": _write(kv.k_zero, layer, page, kz),
              "v_scale": _write(kv.v_scale, layer, page, vs)}
    return k, v, scales, keys


def _rescale_append(old: tuple, has_prev: jax.Array, k_new: jax.Array, v_new: jax.Array, new: jax.Array,
                    fresh: jax.Array) -> tuple:
    """One token into its page, quantised (the math `append_token` and the pooled append share):
    ``old`` = the page's ``(k, v, k_scale, k_zero, v_scale)`` ``[B, H, ps, D]``/``[B, H, D]``/``[B, H]`` and the
    previous page's ``k_zero`` ``[B, H, D]`` (read where ``has_prev`` ``[B, H]``); ``new`` ``[B, H, ps]`` the
    token's slot, ``fresh`` ``[B, H]`` the append opens the page (it takes the previous page's zero points,
    on a first page the token's own key) -> ``(keys f32, k codes, v codes, k_scale, k_zero, v_scale)``."""
    old_k, old_v, old_ks, old_kz, old_vs, prev = old
    fresh_zero = jnp.where(has_prev[..., None], prev.astype(jnp.float32), k_new.astype(jnp.float32))
    keys, _, kq, vq, ks, kz, vs = _rescale_pages(old_k, old_ks, old_kz, old_v, old_vs, k_new[:, :, None],
                                                 v_new[:, :, None], new, fresh, fresh_zero)
    return keys, kq, vq, ks, kz, vs


def write_tokens(kv: LayerKV, k_new: jax.Array, v_new: jax.Array, slots: jax.Array, written: jax.Array,
                 new_length: jax.Array) -> LayerKV:
    """Write ``T`` tokens per row at ``slots`` ``[B, T]`` (consecutive, any page offset) into one
    layer of a *quantised* cache: ``k_new``/``v_new`` ``[B, T, Hkv, D]`` (the model's layout), only
    those ``written`` ``[B, T]`` count. Every page the tokens touch is re-scaled as in `append_token`
    (earlier entries re-quantised where its scale grows) and its key summaries recomputed from
    its live entries (``< new_length``, position ``>= 0``: write positions first). Slots past the
    cache are dropped. Positions and biases are the caller's (`engine.prefill.extend`)."""
    B, T, H, D = k_new.shape
    S = kv.k.shape[-2]
    ps = _page_size(kv)
    P = S // ps
    n = (T - 1) // ps + 2  # pages a run of T slots can touch
    pages = slots[:, :1] // ps + jnp.arange(n)[None, :]  # [B, n]
    gather = jnp.minimum(pages, P - 1)
    rows, heads = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    kp, vp = kv.k.reshape(B, H, P, ps, D), kv.v.reshape(B, H, P, ps, D)
    idx = (rows, heads, gather[:, None, :])
    offs = jnp.where(written, slots - pages[:, :1] * ps, n * ps)  # unwritten tokens drop
    b = jnp.arange(B)[:, None]
    new = jnp.zeros((B, n * ps), bool).at[b, offs].set(True, mode="drop").reshape(B, 1, n, ps)

    def spread(x: jax.Array) -> jax.Array:  # [B, T, H, D] -> [B, H, n, ps, D] at the window's slots
        w = jnp.zeros((B, n * ps, H, D), x.dtype).at[b, offs].set(x, mode="drop")
        return jnp.swapaxes(w, 1, 2).reshape(B, H, n, ps, D)

    fresh = jnp.broadcast_to((pages * ps >= slots[:, :1])[:, None, :], (B, H, n))  # no live entry before
    k_spread = spread(k_new)
    keys, _, kq, vq, ks, kz, vs = _rescale_pages(kp[idx], kv.k_scale[idx], kv.k_zero[idx], vp[idx], kv.v_scale[idx],
                                                 k_spread, spread(v_new), new, fresh,
                                                 mid_range(k_spread, new[..., None]))
    out = {"k": kp.at[(rows, heads, pages[:, None, :])].set(kq, mode="drop").reshape(kv.k.shape),
           "v": vp.at[(rows, heads, pages[:, None, :])].set(vq, mode="drop").reshape(kv.v.shape),
           "k_scale": kv.k_scale.at[(rows, heads, pages[:, None, :])].set(ks, mode="drop"),
           "k_zero": kv.k_zero.at[(rows, heads, pages[:, None, :])].set(kz, mode="drop"),
           "v_scale": kv.v_scale.at[(rows, heads, pages[:, None, :])].set(vs, mode="drop")}
    slot_w = (pages[:, :, None] * ps + jnp.arange(ps)).reshape(B, 1, n * ps)
    pos_w = jnp.take_along_axis(kv.positions, jnp.broadcast_to(jnp.minimum(slot_w, S - 1), (B, H, n * ps)), axis=2)
    live = (slot_w < new_length[:, None, None]) & (slot_w < S) & (pos_w >= 0)
    for name, value in _key_summaries(kv, keys.reshape(B, H, n * ps, D), live, ps).items():
        out[name] = getattr(kv, name).at[(rows, heads, pages[:, None, :])].set(value, mode="drop")
    return kv.replace(**out)


def _dims(layer: jax.Array | None, index: jax.Array, window: int | None):
    """What `_write` and `_read` share: the indices ``[B, H, 1 | 2]`` and, for ``x`` ``[(L,) B, H, N, ...]``,
    the indexed operand dims, the batching dims and the dims collapsed (the layer's; the slot's too
    without a ``window``)."""
    if layer is None:
        idx, indexed, batching = index[..., None], (2,), (0, 1)
    else:
        idx = jnp.stack([jnp.broadcast_to(layer, index.shape).astype(index.dtype), index], axis=-1)
        indexed, batching = (0, 3), (1, 2)
    collapsed = indexed if window is None else indexed[:-1]
    return idx, indexed, batching, collapsed


def _read(x: jax.Array, layer: jax.Array | None, index: jax.Array, window: int | None = None) -> jax.Array:
    """``x[(layer,) b, h, index[b, h]]`` ``[B, H, ...]`` (with ``window``: the ``window`` entries from there,
    ``[B, H, window, ...]``) of ``x`` ``[(L,) B, H, N, ...]``, as one gather from ``x`` itself: no slice of
    the layer is made first. Windows past the end are clamped (callers read whole pages)."""
    idx, indexed, batching, collapsed = _dims(layer, index, window)
    lead = 0 if layer is None else 1
    sizes = tuple(1 if d in indexed[:-1] or d in batching else (window or 1) if d == lead + 2 else n
                  for d, n in enumerate(x.shape))
    out_rank = x.ndim - len(collapsed) - len(batching) + 2
    dims = jax.lax.GatherDimensionNumbers(
        offset_dims=tuple(range(2, out_rank)), collapsed_slice_dims=collapsed, start_index_map=indexed,
        operand_batching_dims=batching, start_indices_batching_dims=(0, 1))
    return jax.lax.gather(x, idx, dims, sizes, indices_are_sorted=True, unique_indices=True,
                          mode=jax.lax.GatherScatterMode.CLIP)


def _write(x: jax.Array, layer: jax.Array | None, index: jax.Array, value: jax.Array,
           scatter: Any = jax.lax.scatter, window: int | None = None) -> jax.Array:
    """``x[(layer,) b, h, index[b, h]] = value[b, h]`` (or `jax.lax.scatter_max`) for every row ``b`` and KV
    head ``h`` of ``x`` ``[(L,) B, H, S, ...]``, as one scatter whose rows and heads are *batch* dimensions:
    on a device mesh XLA then writes each (row, head) on the device that holds it (the same write
    indexed by iotas, ``x.at[rows, heads, index]``, had the values gathered onto every device first).
    With ``window``, ``value[b, h]`` ``[window, ...]`` goes to slots ``index .. index + window``.
    Indices past the end are dropped."""
    idx, indexed, batching, collapsed = _dims(layer, index, window)
    lead = 0 if layer is None else 1
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(2, value.ndim)), inserted_window_dims=collapsed,
        scatter_dims_to_operand_dims=indexed, operand_batching_dims=(lead, lead + 1),
        scatter_indices_batching_dims=(0, 1))
    return scatter(x, idx, value.astype(x.dtype), dims, indices_are_sorted=True, unique_indices=True,
                   mode=jax.lax.GatherScatterMode.FILL_OR_DROP)
