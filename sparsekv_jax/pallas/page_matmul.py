"""Per-page matmul over one layer of a stacked KV cache (Pallas / Triton) and its jnp reference.

``out[b, h, p] = k[layer, b, h, p·ps : (p+1)·ps].reshape(ps·D) @ m`` with ``k`` every layer's
keys ``[L, B, H, S, D]``, ``m`` a fixed ``[ps·D, N]`` matrix and ``layer`` a runtime index.

Why it exists: CHESS's pre-RoPE page vectors are each page's keys rotated back to position 0 and
summed, which is this product with a fixed un-rotation matrix (`sparsekv_jax.policies.chess`).
Written in jnp over the stacked cache, the layer loop slices layer ``l`` out of the stack and XLA
copies that slice (1.5 GB per layer at 32k × 23 rows of Llama-3.1-8B) before the matmul reads it;
the copy was most of a rebuild's 62 ms on an H200 (docs/BENCHMARKS.md, "CHESS decode speed").
The kernel reads the layer's pages from the stack in place, as the decode attention kernel does.

Design: grid ``(B, H, ⌈P / block_p⌉)``; a program owns ``block_p`` pages of one (row, head) and
loops over the ``ps`` slots of a page: slot ``j`` of its pages (``block_p`` rows of ``D``
contiguous values, a page apart) times rows ``j·D:(j+1)·D`` of ``m``, accumulated in fp32. Slots
past the cache's end (``S`` not a multiple of ``ps``) are masked to zero, so nothing is padded.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sparsekv_jax.pallas._common import cdiv, fit_stages, triton_params
from sparsekv_jax.pallas.validation import is_concrete

__all__ = ["page_matmul", "page_matmul_reference"]


def _kernel(k_ref, m_ref, layer_ref, o_ref, *, page_size: int, block_p: int, S: int, f32_dot: bool) -> None:
    pb = pl.program_id(2)
    # broadcasting int arrays for every index (interpret mode only discharges all-array gathers)
    layer = jnp.full((1, 1), layer_ref[0], jnp.int32)
    D, N = k_ref.shape[-1], o_ref.shape[-1]
    k_cols = jnp.arange(D, dtype=jnp.int32)[None, :]
    m_cols = jnp.arange(N, dtype=jnp.int32)[None, :]
    first = (pb * block_p + jnp.arange(block_p, dtype=jnp.int32)[:, None]) * page_size  # [block_p, 1]
    precision = lax.Precision.HIGHEST if f32_dot else None

    def body(j, acc):
        slot = first + j
        valid = slot < S
        kt = plgpu.load(k_ref.at[layer, jnp.where(valid, slot, 0), k_cols], mask=valid, other=0.0)  # [block_p, D]
        mt = plgpu.load(m_ref.at[j * D + k_cols.T, m_cols])  # [D, N]
        return acc + plgpu.dot(kt, mt, precision=precision)

    o_ref[...] = lax.fori_loop(0, page_size, body, jnp.zeros((block_p, N), jnp.float32))


@functools.partial(jax.jit, static_argnames=("page_size", "block_p", "interpret", "num_warps", "num_stages"))
def _call(k, m, layer, *, page_size, block_p, interpret, num_warps, num_stages):
    L, B, H, S, D = k.shape
    N = m.shape[1]
    P = cdiv(S, page_size)
    n_blocks = cdiv(P, block_p)
    kernel = functools.partial(_kernel, page_size=page_size, block_p=block_p, S=S, f32_dot=k.dtype == jnp.float32)
    stages = fit_stages(num_stages, (block_p * D + D * N) * k.dtype.itemsize)
    out = pl.pallas_call(
        kernel,
        grid=(B, H, n_blocks),
        # the block holds this (row, head) of every layer; the kernel picks the layer
        in_specs=[pl.BlockSpec((L, None, None, S, D), lambda b, h, p: (0, b, h, 0, 0)),
                  pl.BlockSpec(m.shape, lambda b, h, p: (0, 0)),
                  pl.BlockSpec((1,), lambda b, h, p: (0,))],
        out_specs=pl.BlockSpec((None, None, block_p, N), lambda b, h, p: (b, h, p, 0)),
        out_shape=jax.ShapeDtypeStruct((B, H, n_blocks * block_p, N), jnp.float32),
        compiler_params=triton_params(num_warps, stages),
        interpret=interpret,
        name="sparsekv_page_matmul",
    )(k, m, jnp.reshape(layer, (1,)).astype(jnp.int32))
    return out[:, :, :P]


def page_matmul(k: jax.Array, m: jax.Array, layer: int | jax.Array, *, page_size: int, block_p: int = 64,
                interpret: bool = False, num_warps: int = 4, num_stages: int = 2) -> jax.Array:
    """Each page of layer ``layer``'s keys, flattened, times ``m``: ``[B, H, P, N]`` fp32.

    Args:
      k: ``[L, B, H, S, D]`` stacked keys (bf16/f16/f32); ``D`` a multiple of 16.
      m: ``[page_size·D, N]`` in ``k``'s dtype; ``N`` a multiple of 16.
      layer: int scalar, may be traced.
      page_size: slots per page; ``P = ⌈S / page_size⌉`` (a last partial page counts its slots).
      block_p: pages per program (a power of two >= 16).
      interpret: Pallas interpret mode (CPU tests).
      num_warps, num_stages: Triton compiler params.
    """
    if k.ndim != 5 or m.ndim != 2:
        raise ValueError(f"page_matmul needs k [L, B, H, S, D] and m [page_size*D, N], got {k.shape} and {m.shape}")
    if m.shape[0] != page_size * k.shape[-1]:
        raise ValueError(f"m has {m.shape[0]} rows, expected page_size*D = {page_size}*{k.shape[-1]}")
    if k.dtype != m.dtype:
        raise ValueError(f"k and m must share a dtype, got {k.dtype} and {m.dtype}")
    if k.shape[-1] % 16 or m.shape[1] % 16:
        raise ValueError(f"D={k.shape[-1]} and N={m.shape[1]} must be multiples of 16")
    if block_p < 16 or block_p & (block_p - 1):
        raise ValueError(f"block_p={block_p} must be a power of two >= 16")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.asarray(layer).dtype, jnp.integer):
        raise ValueError(f"layer must be an int scalar, got {layer!r}")
    if is_concrete(layer) and not 0 <= int(layer) < k.shape[0]:
        raise ValueError(f"layer={int(layer)} out of range [0, {k.shape[0]})")
    return _call(k, m, jnp.asarray(layer, jnp.int32), page_size=page_size, block_p=block_p, interpret=interpret,
                 num_warps=num_warps, num_stages=num_stages)


def page_matmul_reference(k: jax.Array, m: jax.Array, layer: int | jax.Array, *, page_size: int) -> jax.Array:
    """jnp reference (slices the layer, pads a partial last page): fp32 accumulation at HIGHEST precision."""
    kl = lax.dynamic_index_in_dim(k, layer, keepdims=False)  # [B, H, S, D]
    B, H, S, D = kl.shape
    P = cdiv(S, page_size)
    if P * page_size != S:
        kl = jnp.pad(kl, ((0, 0), (0, 0), (0, P * page_size - S), (0, 0)))
    out = jnp.dot(kl.reshape(B * H * P, page_size * D), m, precision=lax.Precision.HIGHEST,
                  preferred_element_type=jnp.float32)
    return out.reshape(B, H, P, m.shape[1])
