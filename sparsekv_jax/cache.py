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
hold int8 or float8_e4m3fn codes with power-of-two scales per page, ``k_scale`` ``[B, Hkv, P, D]`` and
``v_scale`` ``[B, Hkv, P]``, and the keys' zero points ``k_zero`` ``[B, Hkv, P, D]`` (a key is
``code * k_scale + k_zero``; `sparsekv_jax.cache_quant` says how they are chosen and how writes
re-scale a page as it fills).

``length[b]`` is the number of slots used (the same for every head), ``next_position[b]`` the
RoPE position the next token gets. They differ once entries were evicted or merged.
Capacity is fixed at creation: every shape is static.

This module holds the structs, `init_cache` and `layer_view`, and is the public face of the cache:
it re-exports the names of `cache_pages` (page counts and summaries), `cache_quant` (codes and
scales) and `cache_write` (prefill chunks, appends, token runs), which import from it only for types.
The same cache as one page pool with per-head page tables (issue 38, docs/PAGE_POOL.md; not yet used by
the engine) is `sparsekv_jax.cache_pooled`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax.backend import KV_DTYPES
from sparsekv_jax.cache_pages import (
    SUMMARIES,
    check_summaries,
    empty_summaries,
    page_counts,
    page_mean,
    pages_for,
    summarize_pages,
)
from sparsekv_jax.cache_quant import (
    SCALE_DTYPE,
    check_kv_dtype,
    dequantize,
    dequantize_kv,
    is_quantized,
    mid_range,
    page_scales,
    page_zeros,
    pow2_scale,
    quantize,
    slot_scales,
    slot_zeros,
)
from sparsekv_jax.cache_write import append_token, write_chunk, write_tokens
from sparsekv_jax.models.config import ModelConfig

# every name this module has exported (the cache's public face)
__all__ = ["KV_DTYPES", "SCALE_DTYPE", "SUMMARIES", "KVCache", "LayerKV", "LocalKV", "append_token", "check_kv_dtype",
           "check_sizes", "check_summaries", "dequantize", "dequantize_kv", "empty_summaries", "init_cache",
           "is_quantized", "layer_view", "mid_range", "page_counts", "page_mean", "page_scales", "page_zeros",
           "pages_for", "pow2_scale", "quantize", "slot_scales", "slot_zeros", "summarize_pages", "write_chunk",
           "write_tokens"]


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
    k_zero: jax.Array | None = None  # [..., P, D] SCALE_DTYPE, its key zero points (a key is code * scale + zero)
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
        scales = sum(0 if x is None else x.size * x.dtype.itemsize
                     for x in (self.layers.k_scale, self.layers.k_zero, self.layers.v_scale))
        return 2 * self.layers.k.size * self.layers.k.dtype.itemsize + ring + scales


def check_sizes(batch: int, capacity: int, page_size: int) -> None:
    """Refuse (before any allocation, naming the value) a cache of no rows, no capacity, or pages that are
    not a positive power of two; `init_cache` and `cache_pooled.init_pool` share it."""
    if batch <= 0:
        raise ValueError(f"batch={batch} must be positive")
    if capacity <= 0:
        raise ValueError(f"capacity={capacity} must be positive")
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a positive power of two")


def init_cache(cfg: ModelConfig, batch: int, capacity: int, *, page_size: int = 16,
               dtype: jnp.dtype = jnp.bfloat16, ring: int | None = None,
               summaries: Iterable[str] = SUMMARIES, kv_dtype: str | None = None) -> KVCache:
    """An empty cache holding ``capacity`` tokens per row (rounded up to whole pages).

    ``dtype`` is the model's (activations, page min/max, the local layers' rings); ``kv_dtype`` the
    storage of the paged K/V (`KV_DTYPES`; ``None``: ``dtype``): ``"int8"``/``"float8_e4m3fn"``
    store quantised codes with per-page scales (`sparsekv_jax.cache_quant`).

    ``ring`` (a model with interleaved local and global layers only): the local layers keep ring
    buffers of ``ring`` slots (at least the window) and ``layers`` holds the global layers alone.
    ``summaries``: the page summaries to hold (default all of `SUMMARIES`; the engine passes the
    policy's `page_summaries`); the others are ``None``.
    """
    summaries = check_summaries(summaries)
    store = dtype if check_kv_dtype(kv_dtype) is None else jnp.dtype(kv_dtype)
    check_sizes(batch, capacity, page_size)
    n_pages = pages_for(capacity, page_size)
    S = n_pages * page_size
    L, H, D = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
    local = init_local(cfg, batch, ring, dtype)
    if local is not None:
        L = len(cfg.global_layer_ids())
    quantized = is_quantized(store)
    layers = LayerKV(
        k=jnp.zeros((L, batch, H, S, D), store),
        v=jnp.zeros((L, batch, H, S, D), store),
        positions=jnp.full((L, batch, H, S), -1, jnp.int32),
        bias=jnp.zeros((L, batch, H, S), jnp.float32),
        **empty_summaries(summaries, (L, batch, H, n_pages, D), dtype),
        k_scale=jnp.zeros((L, batch, H, n_pages, D), SCALE_DTYPE) if quantized else None,
        k_zero=jnp.zeros((L, batch, H, n_pages, D), SCALE_DTYPE) if quantized else None,
        v_scale=jnp.zeros((L, batch, H, n_pages), SCALE_DTYPE) if quantized else None,
    )
    zeros = jnp.zeros((batch,), jnp.int32)
    return KVCache(layers=layers, length=zeros, next_position=zeros, local=local, page_size=page_size)


def init_local(cfg: ModelConfig, batch: int, ring: int | None, dtype: jnp.dtype) -> LocalKV | None:
    """Empty ring buffers of ``ring`` slots for the local layers of ``cfg`` (``None`` when ``ring`` is ``None``);
    ``ValueError`` when the model has no local layers or the ring is shorter than the window."""
    if ring is None:
        return None
    if not cfg.interleaved:
        raise ValueError(f"ring={ring}: the {cfg.family} config has no interleaved local and global layers")
    if ring < cfg.sliding_window:
        raise ValueError(f"ring={ring} is smaller than the sliding window {cfg.sliding_window}")
    Ll, H, D = len(cfg.local_layer_ids()), cfg.num_kv_heads, cfg.head_dim
    return LocalKV(k=jnp.zeros((Ll, batch, H, ring, D), dtype), v=jnp.zeros((Ll, batch, H, ring, D), dtype),
                   positions=jnp.full((Ll, batch, ring), -1, jnp.int32), window=cfg.sliding_window)


def layer_view(tree: Any, layer: jax.Array) -> Any:
    """Layer ``layer`` of a stacked cache (or any pytree with a leading ``[L]`` axis): slices
    that XLA fuses into their readers."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False), tree)
