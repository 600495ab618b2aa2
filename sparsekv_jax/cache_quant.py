"""Quantised K/V of the paged cache (`sparsekv_jax.cache`): codes, their power-of-two scales, the
keys' zero points, and the conversions both ways.

**Quantised K/V** (``init_cache(kv_dtype="int8" | "float8_e4m3fn")``, `Backend.kv_dtype`): ``k``/``v``
hold int8 or float8_e4m3fn codes, ``k_scale``/``k_zero`` ``[B, Hkv, P, D]`` and ``v_scale`` ``[B, Hkv, P]``
(bfloat16) their scales and the keys' zero points: a key is ``k * k_scale[page, channel] +
k_zero[page, channel]`` (per page and channel: key outliers sit in channels, KIVI), a value
``v * v_scale[page]`` (per page and KV head, symmetric). A scale is the smallest power of two with
``amax / scale <= qmax`` (127 for int8, 448 for float8_e4m3fn) over the page's live entries (``0``
for a page with none), ``amax`` of ``|key - zero|`` for keys.

*Zero points* (issue 39): Qwen2's k_proj bias puts large, nearly constant offsets into some key
channels (RoPE barely turns the low-frequency ones within a page). A symmetric scale spends the codes
on the offset: float8_e4m3fn has 3 mantissa bits, so a channel at 50 +- 0.5 was stored in steps of 4
and its variation, what the logits depend on, was lost (int8 kept a step of 0.5). A page's zero
point is each channel's mid-range ``(max + min) / 2`` over its live entries (`mid_range`), rounded
to bf16, so the codes cover only ``|key - zero| <= (max - min) / 2`` (plus the zero's rounding):
never more than the symmetric ``max |key|``, so int8 is as good or better on every whole page.
What it costs: ``k_zero`` is as large as ``k_scale`` (2 bytes per page and channel: 1/16 byte per
key element at 32-token pages); and a key is no longer a power-of-two multiple, so a dequantised
key is exact in float32 (``code * scale`` is exact and the bf16 zero's sum fits a float32
significand unless the two are ~2**15 apart) but a bf16 one is rounded once, to half a bf16 ulp of
the key -- the precision a bf16 cache holds keys in. The Pallas kernel and the jnp paths still
compute the same numbers (``code * scale + zero`` in float32, then cast to the query's dtype).

Values stay symmetric with power-of-two scales, which makes their dequantisation exact in any float
format. Re-quantising stored entries is exact unless the scale grows (a page keeps its zero point
while it fills); compaction moves values between pages losslessly when the new page needs no larger
scale, keys are re-rounded against the new page's zero points (half a step of it for int8, after
the bf16 rounding of the dequantised key). They
cost int8 up to one bit (half a bit on average) on the page's largest entries against an arbitrary
scale.

Writes quantise: prefill (`write_chunk`, whole pages: zero points from the pages' live keys),
compaction and merged entries (`policies.common.write_entries`, from dequantised or merged entries,
likewise), `append_token` and `write_tokens` (`engine.prefill.extend`) into a partly filled page:
the page is **re-scaled as it fills** -- its scale becomes ``max(old scale, the new token's)`` and its
earlier entries are re-quantised with it (exact when the scale did not grow; each growth, at least
a doubling, re-rounds them by at most half a new step, so an entry is off by less than one step of
the page's final scale), its zero points kept. A page a write opens (no live entry before it) starts
from no scale, key or value, whatever codes it holds: a page that CHESS's rewind emptied (its length
moved back, `engine.decode.decode_loop`) is refilled as if the tokens taken back had never been
written, as a page pool's empty page is (a page the rewind cut inside keeps the scales they grew it
to: its surviving entries were re-rounded with them). It gets
new zero points: `write_tokens` the mid-range of its new keys, an `append_token` the previous page's
zero points (the offsets carry over from page to page; on page 0, the token's own key), so a
decoded page's codes cover ``max |key - previous page's zero|``: far less than the symmetric range
where an offset carries over, more where a channel's level moved between the pages (whole pages,
the prompt's and compaction's, have no such case). Readers dequantise: the
Pallas decode kernel in registers, the jnp paths (`dequantize_kv`) per layer. The key page
summaries are computed at write time from the keys being written before they are quantised (the
prompt's own keys at prefill; the entries written by compaction; on append, the page's earlier
entries dequantised and the new key as computed), so `summarize_pages` without ``keys`` leaves them
be. The local layers' rings stay in the model dtype.

"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from sparsekv_jax.backend import KV_DTYPES

if TYPE_CHECKING:
    from sparsekv_jax.cache import LayerKV

_QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}  # largest code magnitude
SCALE_DTYPE = jnp.bfloat16  # scales are powers of two: exact in bf16


def check_kv_dtype(kv_dtype: str | None) -> str | None:
    """``kv_dtype`` if it is None or one of `KV_DTYPES`, else ``ValueError`` naming it."""
    if kv_dtype is not None and (not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES):
        raise ValueError(f"kv_dtype={kv_dtype!r} is not a KV cache dtype: expected one of {KV_DTYPES} "
                         "(or None: the model's dtype)")
    return kv_dtype


def is_quantized(dtype: Any) -> bool:
    """Whether K/V stored in ``dtype`` are quantised codes (int8, float8_e4m3fn) with scales."""
    return jnp.dtype(dtype).name in _QMAX


def pow2_scale(amax: jax.Array, qmax: float) -> jax.Array:
    """The smallest power of two ``s`` with ``amax / s <= qmax`` (0 where ``amax`` is 0), `SCALE_DTYPE`."""
    y = amax.astype(jnp.float32) / qmax
    m, e = jnp.frexp(y)  # y = m * 2**e, m in [0.5, 1)
    s = jnp.ldexp(jnp.where(m == 0.5, 0.5, 1.0).astype(jnp.float32), e)
    return jnp.where(amax > 0, s, 0.0).astype(SCALE_DTYPE)


def quantize(x: jax.Array, scale: jax.Array, dtype: Any, zero: jax.Array | None = None) -> jax.Array:
    """``(x - zero) / scale`` as ``dtype`` codes (int8: rounded to nearest; float8_e4m3fn: its own
    rounding), clipped to the codes' range; 0 where ``scale`` is 0. ``scale`` and ``zero`` (default
    0) broadcast against ``x``."""
    qmax = _QMAX[jnp.dtype(dtype).name]
    s = scale.astype(jnp.float32)
    xf = x.astype(jnp.float32) if zero is None else x.astype(jnp.float32) - zero.astype(jnp.float32)
    y = jnp.clip(xf * jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0), -qmax, qmax)
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32, zero: jax.Array | None = None) -> jax.Array:
    """``q * scale + zero`` (``zero`` default 0) computed in float32, returned as ``dtype``.

    ``q * scale`` is exact (codes fit bf16's significand, scales are powers of two); with a bf16
    ``zero`` the float32 sum is exact too unless the two are more than ~2**15 apart in magnitude, and
    a bf16 ``dtype`` rounds the sum once (half a bf16 ulp of the key: the precision a bf16 cache
    stores keys in). Without a zero, every float ``dtype`` from bf16 up is exact."""
    y = q.astype(jnp.float32) * scale.astype(jnp.float32)
    return (y if zero is None else y + zero.astype(jnp.float32)).astype(dtype)


def mid_range(x: jax.Array, valid: jax.Array, axis: int = -2) -> jax.Array:
    """``(max + min) / 2`` of ``x`` over ``axis`` among the ``valid`` entries (broadcasting against
    ``x``), 0 where none is; rounded to `SCALE_DTYPE` (a key zero point)."""
    xf = x.astype(jnp.float32)
    big = jnp.finfo(jnp.float32).max
    hi = jnp.where(valid, xf, -big).max(axis)
    lo = jnp.where(valid, xf, big).min(axis)
    return jnp.where(hi >= lo, (hi * 0.5 + lo * 0.5), 0.0).astype(SCALE_DTYPE)


def page_zeros(k: jax.Array, valid: jax.Array, page_size: int) -> jax.Array:
    """Key zero points of whole pages: ``k`` ``[..., S, D]``, ``valid`` ``[..., S]`` → ``[..., P, D]``,
    each channel's mid-range over the page's live slots (`mid_range`; 0 for a page with none)."""
    *lead, S, D = k.shape
    P = S // page_size
    return mid_range(k.reshape(*lead, P, page_size, D), valid.reshape(*lead, P, page_size, 1))


def page_scales(k: jax.Array, v: jax.Array, valid: jax.Array, page_size: int,
                dtype: Any, v_dtype: Any = None, k_zero: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Scales of whole pages: ``k``/``v`` ``[..., S, D]`` (float), ``valid`` ``[..., S]`` the live
    slots → ``(k_scale [..., P, D], v_scale [..., P])`` for key codes of ``dtype`` and value codes
    of ``v_dtype`` (default ``dtype``); key scales cover ``k - k_zero`` (``[..., P, D]``, default 0)."""
    qmax = _QMAX[jnp.dtype(dtype).name]
    vmax = _QMAX[jnp.dtype(dtype if v_dtype is None else v_dtype).name]
    *lead, S, D = k.shape
    P = S // page_size
    live = valid[..., None]
    kc = k.astype(jnp.float32).reshape(*lead, P, page_size, D)
    if k_zero is not None:
        kc = kc - k_zero.astype(jnp.float32)[..., None, :]
    ka = jnp.where(live.reshape(*lead, P, page_size, 1), jnp.abs(kc), 0.0).max(-2)
    va = jnp.where(live, jnp.abs(v.astype(jnp.float32)), 0.0).reshape(*lead, P, page_size * D).max(-1)
    return pow2_scale(ka, qmax), pow2_scale(va, vmax)


def slot_scales(kv: LayerKV) -> tuple[jax.Array, jax.Array]:
    """A quantised cache's scales per slot: ``([..., S, D], [..., S, 1])``."""
    ps = kv.k.shape[-2] // kv.k_scale.shape[-2]
    return jnp.repeat(kv.k_scale, ps, axis=-2), jnp.repeat(kv.v_scale, ps, axis=-1)[..., None]


def slot_zeros(kv: LayerKV) -> jax.Array | None:
    """A quantised cache's key zero points per slot ``[..., S, D]`` (None without them)."""
    if kv.k_zero is None:
        return None
    return jnp.repeat(kv.k_zero, kv.k.shape[-2] // kv.k_zero.shape[-2], axis=-2)


def dequantize_kv(kv: LayerKV, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` of ``kv`` (one layer or stacked) as ``dtype`` values: dequantised when quantised,
    else the stored arrays as they are (what the jnp attention paths read)."""
    if not kv.quantized:
        return kv.k, kv.v
    ks, vs = slot_scales(kv)
    return dequantize(kv.k, ks, dtype, slot_zeros(kv)), dequantize(kv.v, vs, dtype)


def _rescale_pages(old_k: jax.Array, old_ks: jax.Array, old_kz: jax.Array, old_v: jax.Array, old_vs: jax.Array,
                   new_k: jax.Array, new_v: jax.Array, new: jax.Array, fresh: jax.Array, fresh_zero: jax.Array):
    """Pages ``[..., ps, D]`` of codes ``old_k``/``old_v`` (key scales and zero points ``old_ks``/``old_kz``
    ``[..., D]``, value scales ``old_vs`` ``[...]``) with the slots ``new`` ``[..., ps]`` replaced by
    ``new_k``/``new_v`` (broadcasting to the pages; float): ``(k, v, k_codes, v_codes, k_scale, k_zero,
    v_scale)``, ``k``/``v`` the pages' float32 values (earlier entries dequantised).

    A page keeps its key zero point unless it is ``fresh`` (``[...]``: it held no live entry before
    this write) and gets a new slot: then its zero point is ``fresh_zero`` ``[..., D]`` and none of
    its old scales are kept (its old entries are dead: slots never written, or tokens a rewind took
    back, whose key scales belong to another zero point and whose value scale would quantise the new
    values more coarsely than a page that never held them). Scales are ``max(old, what the new slots
    need)``, so earlier entries are re-quantised exactly unless their page's scale grew."""
    dt, vdt = old_k.dtype, old_v.dtype
    qmax, vmax = _QMAX[jnp.dtype(dt).name], _QMAX[jnp.dtype(vdt).name]
    mask = new[..., None]
    k = jnp.where(mask, new_k.astype(jnp.float32), dequantize(old_k, old_ks[..., None, :], zero=old_kz[..., None, :]))
    v = jnp.where(mask, new_v.astype(jnp.float32), dequantize(old_v, old_vs[..., None, None]))
    restart = fresh & new.any(-1)  # [...]
    kz = jnp.where(restart[..., None], fresh_zero.astype(SCALE_DTYPE), old_kz.astype(SCALE_DTYPE))
    # a fresh page's earlier codes are dead (past the length: never written, or taken back by a rewind),
    # so none of its old scales are kept
    old_ks = jnp.where(restart[..., None], 0.0, old_ks).astype(SCALE_DTYPE)
    old_vs = jnp.where(restart, 0.0, old_vs).astype(SCALE_DTYPE)
    need_k = pow2_scale(jnp.where(mask, jnp.abs(k - kz[..., None, :].astype(jnp.float32)), 0.0).max(-2), qmax)
    need_v = pow2_scale(jnp.where(mask, jnp.abs(v), 0.0).max((-2, -1)), vmax)
    ks, vs = jnp.maximum(old_ks, need_k), jnp.maximum(old_vs, need_v)
    return (k, v, quantize(k, ks[..., None, :], dt, kz[..., None, :]), quantize(v, vs[..., None, None], vdt), ks, kz,
            vs)
