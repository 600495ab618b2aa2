"""Decode-time matmul against one layer of stacked weights (Pallas / Triton) and its jnp reference.

``x [M, K] @ w[layer] [K, N]`` with ``w`` every layer's weight stacked ``[L, K, N]`` and ``layer``
a runtime index. Why it exists: in a decode step (``M`` = batch, small) the layer `lax.scan`
slices each layer's weights out of the stacked arrays, and XLA materialises that slice before
cuBLAS reads it — a read and a write of every weight per token, measured at 15.7 ms for
Llama-3.1-8B's matmuls where reading the weights once takes 6.5 ms (experiments/diary/BENCHMARKS_DIARY.md, "Decode:
where the time goes"). This kernel reads the tiles of ``w[layer]`` straight from the stack, like
the decode attention kernel reads its layer of the cache.

Design: memory bound (each weight byte is used ``M`` times), so it streams ``w``:

* grid ``(N / block_n, num_splits)``; a program owns ``block_n`` output columns and a contiguous
  range of ``K`` (split-K), loops over it in ``block_k`` tiles and writes an fp32 partial; a jnp
  epilogue sums the splits. Splits are chosen so the grid stays within two waves of programs
  (`MATMUL_MAX_PROGRAMS`, measured) yet fills the chip for narrow ``N`` (the K/V projections);
* the ``M`` rows of ``x`` are padded in registers to ``block_m >= 16`` (the smallest Triton dot
  tile): no padded copy of ``x`` in HBM;
* ``w``'s block spans every layer and the program indexes its layer at run time, so nothing is
  sliced or copied (offsets are 64-bit when the stack passes 4 GiB).

Backend: Pallas' Triton lowering with explicit compiler params; ``interpret=True`` runs the same
kernel on CPU for tests. ``transformer``'s decode path uses it on GPUs by default
(`Backend.decode_matmul`, `$SPARSEKV_DECODE_MATMUL` at the command line; measurements in
experiments/diary/BENCHMARKS_DIARY.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sparsekv_jax.pallas._common import fit_stages, next_pow2, triton_params
from sparsekv_jax.pallas.validation import is_concrete

__all__ = ["MATMUL_MAX_PROGRAMS", "layer_matmul", "layer_matmul_reference", "matmul_plan"]


# At most two waves of programs on a 132-SM Hopper part. Fewer, longer programs stream the weight
# faster than the four waves the attention kernels aim for: the H200 sweep of 2026-11-22
# (experiments/diary/BENCHMARKS_DIARY.md, "Decode matmul tiling") found 128-256 programs of >= 8 K tiles best for
# every Llama-3.1-8B weight, and 512-1024 programs 10-30% slower.
MATMUL_MAX_PROGRAMS = 2 * 132


def matmul_plan(M: int, K: int, N: int, *, block_n: int | None = None, block_k: int | None = None,
                num_splits: int | None = None) -> tuple[int, int, int, int]:
    """Static tiling: ``(block_m, block_n, block_k, num_splits)``.

    ``block_n``: the largest of 64/32/16 dividing ``N``; ``block_k``: the largest of 128/64/32/16
    dividing ``K`` (unless given); ``num_splits``: the largest divisor of ``K / block_k`` that keeps
    the grid within `MATMUL_MAX_PROGRAMS` (at least 1), so narrow weights (the K/V projections)
    still fill the chip and wide ones run one long K loop per program.
    """
    def largest_divisor(dim: int, sizes: tuple[int, ...]) -> int:
        for b in sizes:
            if dim % b == 0:
                return b
        raise ValueError(f"dimension {dim} is not a multiple of 16")

    block_m = max(16, next_pow2(M))
    block_n = largest_divisor(N, (64, 32, 16)) if block_n is None else block_n
    block_k = largest_divisor(K, (128, 64, 32, 16)) if block_k is None else block_k
    k_tiles = K // block_k
    if num_splits is None:
        columns = N // block_n
        num_splits = max(d for d in range(1, k_tiles + 1) if k_tiles % d == 0 and (d == 1 or columns * d
                                                                                      <= MATMUL_MAX_PROGRAMS))
    return block_m, block_n, block_k, num_splits


def _kernel(x_ref, w_ref, layer_ref, o_ref, *, M: int, block_m: int, block_n: int, block_k: int,
            tiles_per_split: int, f32_dot: bool) -> None:
    n, s = pl.program_id(0), pl.program_id(1)
    # broadcasting int arrays for every index (interpret mode only discharges all-array gathers)
    layer = jnp.full((1, 1), layer_ref[0], jnp.int32)
    rows = jnp.arange(block_m, dtype=jnp.int32)[:, None]
    cols = n * block_n + jnp.arange(block_n, dtype=jnp.int32)[None, :]
    k0 = s * tiles_per_split * block_k
    precision = lax.Precision.HIGHEST if f32_dot else None

    def body(j, acc):
        kk = k0 + j * block_k + jnp.arange(block_k, dtype=jnp.int32)
        xt = plgpu.load(x_ref.at[jnp.minimum(rows, M - 1), kk[None, :]], mask=rows < M, other=0.0)
        wt = plgpu.load(w_ref.at[layer, kk[:, None], cols])
        return acc + plgpu.dot(xt, wt, precision=precision)

    o_ref[...] = lax.fori_loop(0, tiles_per_split, body, jnp.zeros((block_m, block_n), jnp.float32))


@functools.partial(jax.jit, static_argnames=("block_n", "block_k", "num_splits", "interpret", "num_warps",
                                             "num_stages"))
def _call(x, w, layer, *, block_n, block_k, num_splits, interpret, num_warps, num_stages):
    M, K = x.shape
    L, _, N = w.shape
    block_m, block_n, block_k, num_splits = matmul_plan(M, K, N, block_n=block_n, block_k=block_k,
                                                        num_splits=num_splits)
    full = lambda shape: pl.BlockSpec(shape, lambda n, s: (0,) * len(shape))  # noqa: E731
    tiles_per_split, f32_dot = K // block_k // num_splits, x.dtype == jnp.float32
    kernel = functools.partial(_kernel, M=M, block_m=block_m, block_n=block_n, block_k=block_k,
                               tiles_per_split=tiles_per_split, f32_dot=f32_dot)
    stages = fit_stages(num_stages, (block_m + block_n) * block_k * w.dtype.itemsize)
    partial = pl.pallas_call(
        kernel,
        grid=(N // block_n, num_splits),
        in_specs=[full(x.shape), full((L, K, N)), full((1,))],
        out_specs=pl.BlockSpec((None, block_m, block_n), lambda n, s: (s, 0, n)),
        out_shape=jax.ShapeDtypeStruct((num_splits, block_m, N), jnp.float32),
        compiler_params=triton_params(num_warps, stages),
        interpret=interpret,
        name="sparsekv_layer_matmul",
    )(x, w, jnp.reshape(layer, (1,)).astype(jnp.int32))
    return partial.sum(0)[:M].astype(x.dtype)


def layer_matmul(x: jax.Array, w: jax.Array, layer: int | jax.Array, *, block_n: int | None = None,
                 block_k: int | None = None, num_splits: int | None = None, interpret: bool = False,
                 num_warps: int = 4, num_stages: int = 3) -> jax.Array:
    """``x @ w[layer]`` without slicing ``w``.

    Args:
      x: ``[M, K]`` activations (bf16/f16/f32), ``M`` small (decode rows).
      w: ``[L, K, N]`` stacked weights, same dtype; ``K`` and ``N`` multiples of 16.
      layer: int scalar, may be traced.
      block_n, block_k, num_splits: tiling overrides (default: `matmul_plan`).
      interpret: Pallas interpret mode (CPU tests).
      num_warps, num_stages: Triton compiler params.

    Returns:
      ``[M, N]`` in ``x``'s dtype (fp32 accumulation).
    """
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"layer_matmul needs x [M, K] and w [L, K, N] with the same K, got {x.shape} and {w.shape}")
    if x.dtype != w.dtype:
        raise ValueError(f"x and w must share a dtype, got {x.dtype} and {w.dtype}")
    if w.shape[1] % 16 or w.shape[2] % 16:
        raise ValueError(f"K={w.shape[1]} and N={w.shape[2]} must be multiples of 16")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.asarray(layer).dtype, jnp.integer):
        raise ValueError(f"layer must be an int scalar, got {layer!r}")
    if is_concrete(layer) and not 0 <= int(layer) < w.shape[0]:
        raise ValueError(f"layer={int(layer)} out of range [0, {w.shape[0]})")
    return _call(x, w, jnp.asarray(layer, jnp.int32), block_n=block_n, block_k=block_k, num_splits=num_splits,
                 interpret=interpret, num_warps=num_warps, num_stages=num_stages)


def layer_matmul_reference(x: jax.Array, w: jax.Array, layer: int | jax.Array) -> jax.Array:
    """jnp reference: fp32 ``x @ w[layer]`` at HIGHEST precision."""
    wl = lax.dynamic_index_in_dim(w, layer, keepdims=False)
    out = jnp.dot(x.astype(jnp.float32), wl.astype(jnp.float32), precision=lax.Precision.HIGHEST)
    return out.astype(x.dtype)
