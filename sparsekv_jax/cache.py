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

from sparsekv_jax.models.config import ModelConfig

# the page summaries a cache may hold (module docstring); a policy declares the ones it reads
SUMMARIES = ("page_sum", "page_min", "page_max", "page_max_bias")


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
        """Bytes of the K and V tensors alone (the local layers' rings included)."""
        ring = 0 if self.local is None else 2 * self.local.k.size * self.local.k.dtype.itemsize
        return 2 * self.layers.k.size * self.layers.k.dtype.itemsize + ring


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
               summaries: Iterable[str] = SUMMARIES) -> KVCache:
    """An empty cache holding ``capacity`` tokens per row (rounded up to whole pages).

    ``ring`` (a model with interleaved local and global layers only): the local layers keep ring
    buffers of ``ring`` slots (at least the window) and ``layers`` holds the global layers alone.
    ``summaries``: the page summaries to hold (default all of `SUMMARIES`; the engine passes the
    policy's `page_summaries`); the others are ``None``.
    """
    summaries = check_summaries(summaries)
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
    layers = LayerKV(
        k=jnp.zeros((L, batch, H, S, D), dtype),
        v=jnp.zeros((L, batch, H, S, D), dtype),
        positions=jnp.full((L, batch, H, S), -1, jnp.int32),
        bias=jnp.zeros((L, batch, H, S), jnp.float32),
        **empty_summaries(summaries, (L, batch, H, n_pages, D), dtype),
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
                positions: jax.Array) -> LayerKV:
    """Write a chunk of ``T`` tokens for every row at slots ``start .. start+T`` (one layer).

    ``k_new``/``v_new``: ``[B, Hkv, T, D]``; ``start``: scalar int (the same slot for every row:
    prefill writes prompts slot-aligned, padding included, and masks by length);
    ``positions``: ``[B, T]``. Page summaries are *not* updated here: call
    `summarize_pages` once the chunks are written.
    """
    B, H, T, _ = k_new.shape
    k = jax.lax.dynamic_update_slice_in_dim(kv.k, k_new.astype(kv.k.dtype), start, axis=2)
    v = jax.lax.dynamic_update_slice_in_dim(kv.v, v_new.astype(kv.v.dtype), start, axis=2)
    pos = jnp.broadcast_to(positions[:, None, :], (B, H, T)).astype(jnp.int32)
    positions_all = jax.lax.dynamic_update_slice_in_dim(kv.positions, pos, start, axis=2)
    return kv.replace(k=k, v=v, positions=positions_all)


def summarize_pages(kv: LayerKV, length: jax.Array, page_size: int) -> LayerKV:
    """Recompute the page summaries ``kv`` holds from the keys in slots ``< length`` (one layer or
    stacked layers; a cache holding none is returned as it is).

    Stacked layers are summarised one at a time (`lax.map`) and min/max are taken in the storage
    dtype (exact), so no fp32 copy of the whole cache is ever materialised.
    """
    held = kv.summaries
    if not held:
        return kv
    if kv.k.ndim == 5:
        return jax.lax.map(lambda layer: summarize_pages(layer, length, page_size), kv)
    B, H, S, D = kv.k.shape
    P = S // page_size
    valid = (_slot_valid(length, (B, H, S)) & (kv.positions >= 0)).reshape(B, H, P, page_size, 1)
    k = kv.k.reshape(B, H, P, page_size, D)
    big = jnp.asarray(jnp.finfo(k.dtype).max, k.dtype)
    has_any = valid.any(-2)
    new = {}
    if "page_sum" in held:
        new["page_sum"] = jnp.where(valid, k, 0).sum(-2, dtype=jnp.float32)
    if "page_min" in held:
        new["page_min"] = jnp.where(has_any, jnp.where(valid, k, big).min(-2).astype(kv.page_min.dtype), 0)
    if "page_max" in held:
        new["page_max"] = jnp.where(has_any, jnp.where(valid, k, -big).max(-2).astype(kv.page_max.dtype), 0)
    if "page_max_bias" in held:
        new["page_max_bias"] = jnp.where(valid[..., 0], kv.bias.reshape(B, H, P, page_size), -jnp.inf).max(-1)
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
    """
    B, H, D = k_new.shape
    in_place = slot.ndim == 2  # static: per-head slots overwrite (eviction); one slot per row appends
    slot = jnp.broadcast_to(slot[:, None] if slot.ndim == 1 else slot, (B, H))
    k = _write(kv.k, layer, slot, k_new)
    v = _write(kv.v, layer, slot, v_new)
    pos = _write(kv.positions, layer, slot, jnp.broadcast_to(position[:, None], (B, H)))
    bias = _write(kv.bias, layer, slot, jnp.zeros((B, H))) if in_place else kv.bias
    held = kv.summaries
    if not held:
        return kv.replace(k=k, v=v, positions=pos, bias=bias)
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
        keys = jnp.take_along_axis(pick(k), in_page[..., None], axis=2).astype(jnp.float32)  # [B, H, ps, D]
        valid = live[..., None]
        big = jnp.finfo(k.dtype).max  # representable in the summaries' dtype (min/max are in the keys')
        if "page_sum" in held:
            new["page_sum"] = _write(kv.page_sum, layer, page, jnp.where(valid, keys, 0.0).sum(-2))
        if "page_min" in held:
            new["page_min"] = _write(kv.page_min, layer, page, jnp.where(valid, keys, big).min(-2))
        if "page_max" in held:
            new["page_max"] = _write(kv.page_max, layer, page, jnp.where(valid, keys, -big).max(-2))
    return kv.replace(k=k, v=v, positions=pos, bias=bias, **new)


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
