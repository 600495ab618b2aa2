"""Quantised K/V of the paged cache (`sparsekv_jax.cache`): codes, their power-of-two scales, and
the conversions both ways.

**Quantised K/V** (``init_cache(kv_dtype="int8" | "float8_e4m3fn")``, `Backend.kv_dtype`): ``k``/``v``
hold int8 or float8_e4m3fn codes and ``k_scale`` ``[B, Hkv, P, D]`` / ``v_scale`` ``[B, Hkv, P]``
(bfloat16) their scales: a key is ``k * k_scale[page, channel]`` (a scale per page and channel: key
outliers sit in channels, KIVI), a value ``v * v_scale[page]`` (per page and KV head). A scale is the
smallest power of two with ``amax / scale <= qmax`` (127 for int8, 448 for float8_e4m3fn) over the
page's live entries (``0`` for a page with none). Powers of two make dequantisation exact in any
float format (the Pallas kernel and the jnp paths dequantise to the same numbers, bf16 included)
and re-quantising stored entries exact unless the scale grows (compaction moves entries between
pages losslessly when the new page's entries need no larger scale); they cost int8 up to one bit
(half a bit on average) on the page's largest entries against an arbitrary scale. Writes quantise:
prefill (`write_chunk`, whole pages), compaction and merged entries (`policies.common.write_entries`,
from dequantised or merged entries), `append_token` and `write_tokens` (`engine.prefill.extend`)
into a partly filled page: the page is **re-scaled as it fills** -- its scale becomes
``max(old scale, the new token's)`` and its earlier entries are re-quantised with it (exact when the
scale did not grow; each growth, at least a doubling, re-rounds them by at most half a new step, so
an entry is off by less than one step of the page's final scale). Readers dequantise: the Pallas
decode kernel in registers, the jnp paths (`dequantize_kv`) per layer. The key page summaries are
computed at write time from the keys being written before they are quantised (the prompt's own
keys at prefill; the entries written by compaction; on append, the page's earlier entries
dequantised and the new key as computed), so `summarize_pages` without ``keys`` leaves them be.
The local layers' rings stay in the model dtype.

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


def quantize(x: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """``x / scale`` as ``dtype`` codes (int8: rounded to nearest; float8_e4m3fn: its own rounding),
    clipped to the codes' range; 0 where ``scale`` is 0. ``scale`` broadcasts against ``x``."""
    qmax = _QMAX[jnp.dtype(dtype).name]
    s = scale.astype(jnp.float32)
    y = jnp.clip(x.astype(jnp.float32) * jnp.where(s > 0, 1.0 / jnp.where(s > 0, s, 1.0), 0.0), -qmax, qmax)
    if jnp.dtype(dtype) == jnp.int8:
        y = jnp.round(y)
    return y.astype(dtype)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any = jnp.float32) -> jax.Array:
    """``q * scale`` in ``dtype`` (exact for bf16 and wider: codes fit its significand, scales are
    powers of two)."""
    return (q.astype(jnp.float32) * scale.astype(jnp.float32)).astype(dtype)


def page_scales(k: jax.Array, v: jax.Array, valid: jax.Array, page_size: int,
                dtype: Any) -> tuple[jax.Array, jax.Array]:
    """Scales of whole pages: ``k``/``v`` ``[..., S, D]`` (float), ``valid`` ``[..., S]`` the live
    slots → ``(k_scale [..., P, D], v_scale [..., P])`` for codes of ``dtype``."""
    qmax = _QMAX[jnp.dtype(dtype).name]
    *lead, S, D = k.shape
    P = S // page_size
    live = valid[..., None]
    ka = jnp.where(live, jnp.abs(k.astype(jnp.float32)), 0.0).reshape(*lead, P, page_size, D).max(-2)
    va = jnp.where(live, jnp.abs(v.astype(jnp.float32)), 0.0).reshape(*lead, P, page_size * D).max(-1)
    return pow2_scale(ka, qmax), pow2_scale(va, qmax)


def slot_scales(kv: LayerKV) -> tuple[jax.Array, jax.Array]:
    """A quantised cache's scales per slot: ``([..., S, D], [..., S, 1])``."""
    ps = kv.k.shape[-2] // kv.k_scale.shape[-2]
    return jnp.repeat(kv.k_scale, ps, axis=-2), jnp.repeat(kv.v_scale, ps, axis=-1)[..., None]


def dequantize_kv(kv: LayerKV, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """``(k, v)`` of ``kv`` (one layer or stacked) as ``dtype`` values: dequantised when quantised,
    else the stored arrays as they are (what the jnp attention paths read)."""
    if not kv.quantized:
        return kv.k, kv.v
    ks, vs = slot_scales(kv)
    return dequantize(kv.k, ks, dtype), dequantize(kv.v, vs, dtype)


def _rescale_pages(old_k: jax.Array, old_ks: jax.Array, old_v: jax.Array, old_vs: jax.Array, new_k: jax.Array,
                   new_v: jax.Array, new: jax.Array):
    """Pages ``[..., ps, D]`` of codes ``old_k``/``old_v`` (scales ``old_ks`` ``[..., D]``, ``old_vs``
    ``[...]``) with the slots ``new`` ``[..., ps]`` replaced by ``new_k``/``new_v`` (broadcasting to
    the pages; float): ``(k, v, k_codes, v_codes, k_scale, v_scale)``, ``k``/``v`` the pages' float32
    values (earlier entries dequantised), their scales ``max(old, what the new slots need)``."""
    dt = old_k.dtype
    qmax = _QMAX[jnp.dtype(dt).name]
    mask = new[..., None]
    k = jnp.where(mask, new_k.astype(jnp.float32), dequantize(old_k, old_ks[..., None, :]))
    v = jnp.where(mask, new_v.astype(jnp.float32), dequantize(old_v, old_vs[..., None, None]))
    need_k = pow2_scale(jnp.where(mask, jnp.abs(k), 0.0).max(-2), qmax)
    need_v = pow2_scale(jnp.where(mask, jnp.abs(v), 0.0).max((-2, -1)), qmax)
    ks, vs = jnp.maximum(old_ks, need_k), jnp.maximum(old_vs, need_v)
    return k, v, quantize(k, ks[..., None, :], dt), quantize(v, vs[..., None, None], dt), ks, vs
