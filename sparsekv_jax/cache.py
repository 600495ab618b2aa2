"""The paged KV cache pytree and its page summaries.

Layout (per layer, stacked over layers with a leading ``L`` axis in `KVCache.layers`):

* ``k``, ``v``: ``[B, Hkv, S, D]`` with ``S = num_pages * page_size``. Page ``p`` of row ``b``
  is ``k[b, :, p*page_size:(p+1)*page_size]``; a reshape to ``[B, Hkv, P, page_size, D]``
  (free) gives the page view kernels read. Keys are stored *after* RoPE.
* ``positions``: ``[B, Hkv, S]`` int32, the RoPE position of each slot (``-1`` when empty).
  Compression may keep different positions per KV head, so positions are per head.
* ``bias``: ``[B, Hkv, S]`` float32 additive logit per slot (SemantiCache's log cluster size;
  zero otherwise; ``-inf`` for a *hole*: a slot below ``length`` that a head does not use because
  heads keep different numbers of entries, which also has position ``-1``). Any in-place
  overwrite of a slot (`append_token`) resets its bias to 0; slots at or past ``length`` always
  hold bias 0.
* ``page_sum``/``page_min``/``page_max``: ``[B, Hkv, P, D]`` summaries of the keys in each page
  (CHESS uses the mean = sum / count, Quest the elementwise min/max). The sum is float32; min and
  max are in the keys' dtype, where they are exact (a minimum of bf16 keys is a bf16 key) at half
  the bytes of float32 (0.27 GB per 32k-token row of Llama-3.1-8B). ``page_max_bias``
  ``[B, Hkv, P]`` float32 is the largest bias in the page, so a bound on a page's logits stays a
  bound after merging (Quest). Summaries cover the page's live slots (below ``length``, position
  ``>= 0``). Maintained on single-token append; recomputed in one pass after prefill or compression.
  Each summary is held only where it is read: a policy declares the ones it reads
  (`Policy.page_summaries`), the engine's cache allocates those (`init_cache(summaries=...)`) and a
  summary left out is ``None`` (no leaf: no bytes, no work on append or compaction).

**Local layers** (a model with interleaved sliding-window and global layers, Gemma 3, under
``Backend(local_cache="ring")``): ``layers`` holds the *global* layers only and ``local`` (`LocalKV`) a
ring buffer per local layer: ``k``/``v`` ``[Ll, B, Hkv, R, D]`` and ``positions`` ``[Ll, B, R]`` (``-1``
empty), position ``p`` in slot ``p % R``. ``R`` is the window plus the tokens a policy may take
back (CHESS's regeneration), so a rewind never loses a key the window still needs. Local layers are
never paged, summarised, compressed or page-selected (`sparsekv_jax.local_layers`).

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

``length[b]`` is the number of slots used (the same for every head), ``next_position[b]`` the
RoPE position the next token gets. They differ once entries were evicted or merged.
Capacity is fixed at creation: every shape is static.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax.backend import KV_DTYPES
from sparsekv_jax.models.config import ModelConfig

# the page summaries a cache may hold (module docstring); a policy declares the ones it reads
SUMMARIES = ("page_sum", "page_min", "page_max", "page_max_bias")
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


@struct.dataclass
class LayerKV:
    """One layer's cache (or all layers, stacked on a leading axis). A page summary the cache was
    not asked to hold is ``None``."""

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    bias: jax.Array
    page_sum: jax.Array | None = None
    page_min: jax.Array | None = None
    page_max: jax.Array | None = None
    page_max_bias: jax.Array | None = None
    k_scale: jax.Array | None = None  # [..., P, D] SCALE_DTYPE, a quantised cache's key scales
    v_scale: jax.Array | None = None  # [..., P] SCALE_DTYPE, its value scales

    @property
    def quantized(self) -> bool:
        """Whether K/V are quantised codes with scales (``init_cache(kv_dtype=...)``)."""
        return self.k_scale is not None

    @property
    def summaries(self) -> frozenset[str]:
        """The page summaries this cache holds (names from `SUMMARIES`)."""
        return frozenset(name for name in SUMMARIES if getattr(self, name) is not None)


@struct.dataclass
class LocalKV:
    """Ring buffers of the local (sliding-window) layers: ``k``/``v`` ``[Ll, B, Hkv, R, D]``, ``positions``
    ``[Ll, B, R]`` int32 (``-1`` empty); position ``p`` lives in slot ``p % R`` (one layer: no ``Ll`` axis)."""

    k: jax.Array
    v: jax.Array
    positions: jax.Array
    window: int = struct.field(pytree_node=False, default=0)  # the layers' sliding window (<= R)


@struct.dataclass
class KVCache:
    """Paged KV cache for a batch of sequences. See the module docstring for the layout."""

    layers: LayerKV  # every field with a leading [L] axis (the global layers when `local` is set)
    length: jax.Array  # [B] int32 slots used
    next_position: jax.Array  # [B] int32 RoPE position of the next token
    local: LocalKV | None = None  # ring buffers of the local layers, or None (every layer in `layers`)
    page_size: int = struct.field(pytree_node=False, default=16)

    @property
    def batch(self) -> int:
        return self.length.shape[0]

    @property
    def capacity(self) -> int:
        return self.layers.k.shape[-2]

    @property
    def num_pages(self) -> int:
        return self.capacity // self.page_size

    def nbytes(self) -> int:
        """Device bytes held by the cache (all leaves)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))

    def kv_nbytes(self) -> int:
        """Bytes of the K and V tensors alone, with their scales when quantised (the local layers'
        rings included)."""
        ring = 0 if self.local is None else 2 * self.local.k.size * self.local.k.dtype.itemsize
        scales = sum(0 if x is None else x.size * x.dtype.itemsize for x in (self.layers.k_scale, self.layers.v_scale))
        return 2 * self.layers.k.size * self.layers.k.dtype.itemsize + ring + scales


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


def init_cache(cfg: ModelConfig, batch: int, capacity: int, *, page_size: int = 16,
               dtype: jnp.dtype = jnp.bfloat16, ring: int | None = None,
               summaries: Iterable[str] = SUMMARIES, kv_dtype: str | None = None) -> KVCache:
    """An empty cache holding ``capacity`` tokens per row (rounded up to whole pages).

    ``dtype`` is the model's (activations, page min/max, the local layers' rings); ``kv_dtype`` the
    storage of the paged K/V (`KV_DTYPES`; ``None``: ``dtype``): ``"int8"``/``"float8_e4m3fn"``
    store quantised codes with per-page scales (module docstring).

    ``ring`` (a model with interleaved local and global layers only): the local layers keep ring
    buffers of ``ring`` slots (at least the window) and ``layers`` holds the global layers alone.
    ``summaries``: the page summaries to hold (default all of `SUMMARIES`; the engine passes the
    policy's `page_summaries`); the others are ``None``.
    """
    summaries = check_summaries(summaries)
    store = dtype if check_kv_dtype(kv_dtype) is None else jnp.dtype(kv_dtype)
    if batch <= 0:
        raise ValueError(f"batch={batch} must be positive")
    if capacity <= 0:
        raise ValueError(f"capacity={capacity} must be positive")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a positive power of two")
    n_pages = pages_for(capacity, page_size)
    S = n_pages * page_size
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    local = None
    if ring is not None:
        if not cfg.interleaved:
            raise ValueError(f"ring={ring}: the {cfg.family} config has no interleaved local and global layers")
        if ring < cfg.sliding_window:
            raise ValueError(f"ring={ring} is smaller than the sliding window {cfg.sliding_window}")
        Ll, L = len(cfg.local_layer_ids()), len(cfg.global_layer_ids())
        local = LocalKV(k=jnp.zeros((Ll, batch, H, ring, D), dtype), v=jnp.zeros((Ll, batch, H, ring, D), dtype),
                        positions=jnp.full((Ll, batch, ring), -1, jnp.int32), window=cfg.sliding_window)
    quantized = is_quantized(store)
    layers = LayerKV(
        k=jnp.zeros((L, batch, H, S, D), store),
        v=jnp.zeros((L, batch, H, S, D), store),
        positions=jnp.full((L, batch, H, S), -1, jnp.int32),
        bias=jnp.zeros((L, batch, H, S), jnp.float32),
        **empty_summaries(summaries, (L, batch, H, n_pages, D), dtype),
        k_scale=jnp.zeros((L, batch, H, n_pages, D), SCALE_DTYPE) if quantized else None,
        v_scale=jnp.zeros((L, batch, H, n_pages), SCALE_DTYPE) if quantized else None,
    )
    zeros = jnp.zeros((batch,), jnp.int32)
    return KVCache(layers=layers, length=zeros, next_position=zeros, local=local, page_size=page_size)


def empty_summaries(summaries: Iterable[str], shape: tuple[int, ...], dtype: jnp.dtype) -> dict[str, Any]:
    """The page-summary fields of an empty `LayerKV` with pages ``shape`` ``[..., P, D]`` and keys of
    ``dtype``: each of ``summaries`` allocated (sums fp32, min/max in ``dtype``, max bias ``-inf``),
    the others ``None``."""
    make = {"page_sum": lambda: jnp.zeros(shape, jnp.float32), "page_min": lambda: jnp.zeros(shape, dtype),
            "page_max": lambda: jnp.zeros(shape, dtype),
            "page_max_bias": lambda: jnp.full(shape[:-1], -jnp.inf, jnp.float32)}
    names = check_summaries(summaries)
    return {name: make[name]() if name in names else None for name in SUMMARIES}


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
    ks, vs = page_scales(k, v, valid, ps, kv.k.dtype)
    kq = quantize(k, jnp.repeat(ks, ps, axis=-2), kv.k.dtype)
    vq = quantize(v, jnp.repeat(vs, ps, axis=-1)[..., None], kv.v.dtype)
    first = start // ps

    def put(x: jax.Array, value: jax.Array, at: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(x, value.astype(x.dtype), at, axis=2)

    new = {"k": put(kv.k, kq, start), "v": put(kv.v, vq, start), "k_scale": put(kv.k_scale, ks, first),
           "v_scale": put(kv.v_scale, vs, first)}
    for name, value in _key_summaries(kv, k, valid, ps).items():
        new[name] = put(getattr(kv, name), value, first)
    return kv.replace(**new)


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
    recomputes the page's max bias from its live slots. (Appends skip the extra gathers: at 32
    layers they cost ~0.1 ms of a 6 ms decode step on an H200.)

    A quantised cache re-scales the written page (module docstring): the whole page is written
    back, its scale ``max(old, the new token's)``; its summaries come from its earlier entries
    dequantised and the new key as given.
    """
    B, H, D = k_new.shape
    in_place = slot.ndim == 2  # static: per-head slots overwrite (eviction); one slot per row appends
    slot = jnp.broadcast_to(slot[:, None] if slot.ndim == 1 else slot, (B, H))
    scales, page_keys = {}, None
    if kv.quantized:
        k, v, scales, page_keys = _append_quantized(kv, layer, slot, k_new, v_new, page_size)
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
    live = in_page < new_length[:, None, None]
    if in_place:
        live = live & (jnp.take_along_axis(pick(pos), in_page, axis=2) >= 0)  # holes stay out
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
        valid = live[..., None]
        # representable in the summaries' dtype (min/max are in the keys', or the model's when quantised)
        big = jnp.finfo(k.dtype if page_keys is None else kv.page_min.dtype if kv.page_min is not None
                        else kv.page_max.dtype if kv.page_max is not None else jnp.float32).max
        if "page_sum" in held:
            new["page_sum"] = _write(kv.page_sum, layer, page, jnp.where(valid, keys, 0.0).sum(-2))
        if "page_min" in held:
            new["page_min"] = _write(kv.page_min, layer, page, jnp.where(valid, keys, big).min(-2))
        if "page_max" in held:
            new["page_max"] = _write(kv.page_max, layer, page, jnp.where(valid, keys, -big).max(-2))
    return kv.replace(k=k, v=v, positions=pos, bias=bias, **new, **scales)


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


def _append_quantized(kv: LayerKV, layer: jax.Array | None, slot: jax.Array, k_new: jax.Array, v_new: jax.Array,
                      page_size: int):
    """`append_token`'s write into a quantised cache: ``(k, v, {"k_scale", "v_scale"}, page_keys)``, the
    written page's float32 keys ``[B, H, ps, D]`` (for its summaries)."""
    *_, S, D = kv.k.shape
    P = S // page_size
    page = slot // page_size  # [B, H]
    pick = (lambda a: a) if layer is None else (lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False))

    def paged(x: jax.Array) -> jax.Array:  # [..., S, D] -> [..., P, ps, D] (free)
        return x.reshape(*x.shape[:-2], P, page_size, D)

    def at_page(x: jax.Array) -> jax.Array:  # this (row, head)'s page of a [B, H, P, ...] array
        idx = page.reshape(page.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, idx, axis=2)[:, :, 0]

    kp, vp = paged(kv.k), paged(kv.v)
    new = jnp.arange(page_size) == (slot % page_size)[..., None]  # [B, H, ps]
    keys, _, kq, vq, ks, vs = _rescale_pages(at_page(pick(kp)), at_page(pick(kv.k_scale)), at_page(pick(vp)),
                                             at_page(pick(kv.v_scale)), k_new[:, :, None], v_new[:, :, None], new)
    k = _write(kp, layer, page, kq).reshape(kv.k.shape)
    v = _write(vp, layer, page, vq).reshape(kv.v.shape)
    scales = {"k_scale": _write(kv.k_scale, layer, page, ks), "v_scale": _write(kv.v_scale, layer, page, vs)}
    return k, v, scales, keys


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

    keys, _, kq, vq, ks, vs = _rescale_pages(kp[idx], kv.k_scale[idx], vp[idx], kv.v_scale[idx], spread(k_new),
                                             spread(v_new), new)
    out = {"k": kp.at[(rows, heads, pages[:, None, :])].set(kq, mode="drop").reshape(kv.k.shape),
           "v": vp.at[(rows, heads, pages[:, None, :])].set(vq, mode="drop").reshape(kv.v.shape),
           "k_scale": kv.k_scale.at[(rows, heads, pages[:, None, :])].set(ks, mode="drop"),
           "v_scale": kv.v_scale.at[(rows, heads, pages[:, None, :])].set(vs, mode="drop")}
    slot_w = (pages[:, :, None] * ps + jnp.arange(ps)).reshape(B, 1, n * ps)
    pos_w = jnp.take_along_axis(kv.positions, jnp.broadcast_to(jnp.minimum(slot_w, S - 1), (B, H, n * ps)), axis=2)
    live = (slot_w < new_length[:, None, None]) & (slot_w < S) & (pos_w >= 0)
    for name, value in _key_summaries(kv, keys.reshape(B, H, n * ps, D), live, ps).items():
        out[name] = getattr(kv, name).at[(rows, heads, pages[:, None, :])].set(value, mode="drop")
    return kv.replace(**out)


def _write(x: jax.Array, layer: jax.Array | None, index: jax.Array, value: jax.Array,
           scatter: Any = jax.lax.scatter) -> jax.Array:
    """``x[(layer,) b, h, index[b, h]] = value[b, h]`` (or `jax.lax.scatter_max`) for every row ``b`` and KV
    head ``h`` of ``x`` ``[(L,) B, H, S, ...]``, as one scatter whose rows and heads are *batch* dimensions:
    on a device mesh XLA then writes each (row, head) on the device that holds it (the same write
    indexed by iotas, ``x.at[rows, heads, index]``, had the values gathered onto every device first).
    Indices past the end are dropped."""
    lead = 0 if layer is None else 1
    if layer is None:
        idx = index[..., None]
    else:
        idx = jnp.stack([jnp.broadcast_to(layer, index.shape).astype(index.dtype), index], axis=-1)
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=tuple(range(2, value.ndim)), inserted_window_dims=(lead + 2,) if layer is None else (0, 3),
        scatter_dims_to_operand_dims=(lead + 2,) if layer is None else (0, 3), operand_batching_dims=(lead, lead + 1),
        scatter_indices_batching_dims=(0, 1))
    return scatter(x, idx, value.astype(x.dtype), dims, indices_are_sorted=True, unique_indices=True,
                   mode=jax.lax.GatherScatterMode.FILL_OR_DROP)


def layer_view(tree: Any, layer: jax.Array) -> Any:
    """Layer ``layer`` of a stacked cache (or any pytree with a leading ``[L]`` axis): slices
    that XLA fuses into their readers."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), tree)


def page_counts(length: jax.Array, num_pages: int, page_size: int) -> jax.Array:
    """``[B, P]`` number of valid slots in each page."""
    starts = jnp.arange(num_pages) * page_size
    return jnp.clip(length[:, None] - starts[None, :], 0, page_size)


def page_mean(kv: LayerKV, length: jax.Array, page_size: int) -> jax.Array:
    """``[..., B, H, P, D]`` mean key of each page (zero for empty pages); ``kv`` must hold ``page_sum``."""
    if kv.page_sum is None:
        raise ValueError("page_mean: this cache holds no page_sum (build it with init_cache(summaries=...) "
                         "naming 'page_sum', or from a policy whose page_summaries include it)")
    counts = page_counts(length, kv.page_sum.shape[-2], page_size)  # [B, P]
    denom = jnp.maximum(counts, 1).astype(jnp.float32)[:, None, :, None]
    return kv.page_sum / denom
