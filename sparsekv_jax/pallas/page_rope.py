"""Per-page sums of keys rotated back by their slot in the page, over one layer of a stacked KV
cache (Pallas / Triton), and the jnp reference.

``out[b, h, p] = sum_j R(-j) · k[layer, b, h, p·ps + j]`` for ``j < ps``, with ``R(a)`` RoPE's
rotation by ``a`` positions in the rotate-half layout (pairs ``(d, d + D/2)`` turned by
``a · inv_freq[d]``), ``k`` every layer's keys ``[L, B, H, S, D]`` and ``layer`` a runtime index.

Why it exists: CHESS's pre-RoPE page vectors are each page's keys rotated back to position 0 and
summed. Where a page's positions run ``p0, p0+1, ...``, ``R(-(p0+j)) = R(-p0)·R(-j)``, so the
page's vector is ``R(-p0)`` applied to this sum (`sparsekv_jax.policies.chess`). In jnp over the
stacked cache, the layer loop slices layer ``l`` out of the stack and XLA copies that slice (1.5 GB
per layer at 32k × 23 rows of Llama-3.1-8B) before reading it; the kernel reads the layer's pages
in place, as the decode attention kernel does, once, with fp32 cosine/sine tables.

Design: grid ``(B, H, ⌈P / block_p⌉)``; a program owns ``block_p`` pages of one (row, head) and
loops over the ``ps`` slots of a page: the two halves of slot ``j``'s keys (``block_p`` rows a page
apart, ``D/2`` contiguous values each) are turned by ``-j`` with four fused multiply-adds per pair
and accumulated in fp32. Memory bound: every key is read once and no FLOP is wasted (a matmul with
the equivalent ``[ps·D, D]`` rotation matrix does ``D/2`` times the work; measured 1.8 TB/s on an
H200, experiments/diary/BENCHMARKS_DIARY.md). Slots past the cache's end (``S`` not a multiple of ``ps``) are masked
to zero, so nothing is padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sparsekv_jax.pallas._common import cdiv, fit_stages, triton_params
from sparsekv_jax.pallas.validation import is_concrete

__all__ = ["rope_page_sums", "rope_page_sums_reference", "slot_rotations"]


def slot_rotations(page_size: int, inv_freq) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` ``[page_size, D/2]`` fp32 of the angles ``j · inv_freq`` (computed in float64)."""
    angle = np.arange(page_size)[:, None] * np.asarray(inv_freq, np.float64)[None]
    return jnp.asarray(np.cos(angle), jnp.float32), jnp.asarray(np.sin(angle), jnp.float32)


def _kernel(k_ref, cos_ref, sin_ref, layer_ref, o_ref, *, page_size: int, block_p: int, S: int) -> None:
    pb = pl.program_id(2)
    # broadcasting int arrays for every index (interpret mode only discharges all-array gathers)
    layer = jnp.full((1, 1), layer_ref[0], jnp.int32)
    half = cos_ref.shape[-1]
    lo = jnp.arange(half, dtype=jnp.int32)[None, :]
    hi = lo + half
    first = (pb * block_p + jnp.arange(block_p, dtype=jnp.int32)[:, None]) * page_size  # [block_p, 1]

    def body(j, acc):
        acc1, acc2 = acc
        slot = first + j
        valid = slot < S
        slot = jnp.where(valid, slot, 0)
        k1 = plgpu.load(k_ref.at[layer, slot, lo], mask=valid, other=0.0).astype(jnp.float32)  # [block_p, D/2]
        k2 = plgpu.load(k_ref.at[layer, slot, hi], mask=valid, other=0.0).astype(jnp.float32)
        row = jnp.full((1, 1), j, jnp.int32)
        c = plgpu.load(cos_ref.at[row, lo])  # [1, D/2]
        s = plgpu.load(sin_ref.at[row, lo])
        return acc1 + k1 * c + k2 * s, acc2 + k2 * c - k1 * s

    zeros = jnp.zeros((block_p, half), jnp.float32)
    acc1, acc2 = lax.fori_loop(0, page_size, body, (zeros, zeros))
    rows = jnp.arange(block_p, dtype=jnp.int32)[:, None]
    plgpu.store(o_ref.at[rows, lo], acc1)
    plgpu.store(o_ref.at[rows, hi], acc2)


@functools.partial(jax.jit, static_argnames=("page_size", "block_p", "interpret", "num_warps", "num_stages"))
def _call(k, cos, sin, layer, *, page_size, block_p, interpret, num_warps, num_stages):
    L, B, H, S, D = k.shape
    P = cdiv(S, page_size)
    n_blocks = cdiv(P, block_p)
    kernel = functools.partial(_kernel, page_size=page_size, block_p=block_p, S=S)
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, p: (0,) * len(shape))  # noqa: E731
    out = pl.pallas_call(
        kernel,
        grid=(B, H, n_blocks),
        # the block holds this (row, head) of every layer; the kernel picks the layer
        in_specs=[pl.BlockSpec((L, None, None, S, D), lambda b, h, p: (0, b, h, 0, 0)),
                  full(cos.shape), full(sin.shape), full((1,))],
        out_specs=pl.BlockSpec((None, None, block_p, D), lambda b, h, p: (b, h, p, 0)),
        out_shape=jax.ShapeDtypeStruct((B, H, n_blocks * block_p, D), jnp.float32),
        compiler_params=triton_params(num_warps, fit_stages(num_stages, block_p * D * k.dtype.itemsize)),
        interpret=interpret,
        name="sparsekv_rope_page_sums",
    )(k, cos, sin, jnp.reshape(layer, (1,)).astype(jnp.int32))
    return out[:, :, :P]


def _check(k: jax.Array, inv_freq, layer: int | jax.Array, page_size: int) -> None:
    if k.ndim != 5:
        raise ValueError(f"rope_page_sums needs stacked keys k [L, B, H, S, D], got shape {k.shape}")
    if 2 * len(inv_freq) != k.shape[-1]:
        raise ValueError(f"inv_freq has {len(inv_freq)} frequencies, expected head_dim/2 = {k.shape[-1] // 2}")
    if page_size < 1:
        raise ValueError(f"page_size={page_size} must be positive")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.asarray(layer).dtype, jnp.integer):
        raise ValueError(f"layer must be an int scalar, got {layer!r}")
    if is_concrete(layer) and not 0 <= int(layer) < k.shape[0]:
        raise ValueError(f"layer={int(layer)} out of range [0, {k.shape[0]})")


def rope_page_sums(k: jax.Array, inv_freq, layer: int | jax.Array, *, page_size: int, block_p: int = 32,
                   interpret: bool = False, num_warps: int = 8, num_stages: int = 3) -> jax.Array:
    """``[B, H, P, D]`` fp32: each page of layer ``layer``'s keys, slot ``j`` turned by ``-j``, summed.

    Args:
      k: ``[L, B, H, S, D]`` stacked keys (bf16/f16/f32); ``D/2`` a power of two.
      inv_freq: the model's ``D/2`` RoPE inverse frequencies (static: numpy or a list).
      layer: int scalar, may be traced.
      page_size: slots per page; ``P = ⌈S / page_size⌉`` (a last partial page sums its slots).
      block_p: pages per program (a power of two >= 16).
      interpret: Pallas interpret mode (CPU tests).
      num_warps, num_stages: Triton compiler params.
    """
    _check(k, inv_freq, layer, page_size)
    half = k.shape[-1] // 2
    if half & (half - 1):
        raise ValueError(f"head_dim={k.shape[-1]}: the kernel needs head_dim/2 a power of two")
    if block_p < 16 or block_p & (block_p - 1):
        raise ValueError(f"block_p={block_p} must be a power of two >= 16")
    cos, sin = slot_rotations(page_size, inv_freq)
    return _call(k, cos, sin, jnp.asarray(layer, jnp.int32), page_size=page_size, block_p=block_p,
                 interpret=interpret, num_warps=num_warps, num_stages=num_stages)


def rope_page_sums_reference(k: jax.Array, inv_freq, layer: int | jax.Array, *, page_size: int) -> jax.Array:
    """jnp reference (slices the layer, pads a partial last page), fp32."""
    _check(k, inv_freq, layer, page_size)
    kl = lax.dynamic_index_in_dim(k, layer, keepdims=False)  # [B, H, S, D]
    B, H, S, D = kl.shape
    P = cdiv(S, page_size)
    if P * page_size != S:
        kl = jnp.pad(kl, ((0, 0), (0, 0), (0, P * page_size - S), (0, 0)))
    k1, k2 = jnp.split(kl.reshape(B, H, P, page_size, D).astype(jnp.float32), 2, axis=-1)
    cos, sin = slot_rotations(page_size, inv_freq)  # [ps, D/2], broadcast over pages
    return jnp.concatenate([(k1 * cos + k2 * sin).sum(3), (k2 * cos - k1 * sin).sum(3)], axis=-1)
