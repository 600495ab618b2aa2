"""Helpers shared by the Pallas kernels: Triton compiler params, constants, small math.

Kept apart from the kernels so that the decode and prefill kernels agree on the masking
conventions (see `M_INIT`) and on how the Triton backend is addressed across JAX versions.
"""

from __future__ import annotations

import math
from typing import Any

from jax.experimental.pallas import triton as plgpu

LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

# Running-max initial value. It is finite on purpose: masked logits are set to -inf, so a
# tile in which *every* logit is masked gives ``max(M_INIT, -inf) = M_INIT`` and
# ``exp2(-inf - M_INIT) = 0`` -- the tile contributes exactly nothing and no ``-inf - -inf``
# NaN can appear. Any real logit (|logit| << 1e30) replaces it on first sight.
M_INIT = -1e30

# Grid programs the split heuristics aim for: ~4 waves on a 132-SM Hopper part, so that
# small batches still fill the chip. Only a heuristic; every kernel takes an override.
TARGET_PROGRAMS = 4 * 132


def _compiler_params_cls() -> Any:
    """The Triton ``CompilerParams`` class under whichever name this JAX version exports.

    jax 0.10.2 and 0.11.2 both export ``jax.experimental.pallas.triton.CompilerParams``;
    older releases called it ``TritonCompilerParams`` (in ``pallas`` or ``pallas.triton``).
    """
    for name in ("CompilerParams", "TritonCompilerParams"):
        cls = getattr(plgpu, name, None)
        if cls is not None:
            return cls
    from jax.experimental import pallas as pl  # noqa: PLC0415 -- very old JAX only

    return pl.TritonCompilerParams  # type: ignore[attr-defined]


def triton_params(num_warps: int, num_stages: int) -> Any:
    """Explicit Triton compiler params (the design asks that we never rely on defaults)."""
    return _compiler_params_cls()(num_warps=num_warps, num_stages=num_stages)


def next_pow2(x: int) -> int:
    """Smallest power of two >= ``x`` (>= 1)."""
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division for Python ints."""
    return -(-a // b)


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


# Shared memory the software pipeliner may fill with K/V tiles. The H100/H200 limit is
# 227 KiB per block; stay well under it so Triton's own scratch (layout conversions,
# reductions) still fits.
SMEM_BUDGET = 160 * 1024


def fit_stages(num_stages: int, tile_bytes_per_stage: int, fixed_bytes: int = 0) -> int:
    """Largest pipelining depth <= ``num_stages`` whose buffers fit `SMEM_BUDGET` (>= 1).

    Why: float32 inputs double the tile bytes of the bf16-tuned defaults, and Triton fails
    at compile time ("shared memory size limit exceeded") rather than degrading.
    """
    while num_stages > 1 and fixed_bytes + num_stages * tile_bytes_per_stage > SMEM_BUDGET:
        num_stages -= 1
    return num_stages
