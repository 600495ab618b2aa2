"""Row-wise top-k of non-negative values by a threshold search (Pallas / Triton) and its jnp reference.

Why: XLA's GPU compiler has a fast top-k only for ``k <= 16``; the SAE's ``k`` (64-128, one per head
dimension in S³) makes ``lax.top_k`` sort every 8,192- or 16,384-wide row, which took 30.7 of a
40.3 ms SAE training step on an H200 (experiments/diary/BENCHMARKS_DIARY.md). A row's top k does not need an order,
only a threshold: the k-th largest value ``t``. One program holds one row in registers and finds
``t`` by bisection on its bit pattern: for non-negative IEEE floats the int32 bits order like the
values, so 31 passes of "how many bits >= candidate" (a compare and a sum over the row, no memory
traffic) fix the bits of ``t`` from the top down. The row is read from HBM once. A row stops early
once exactly ``k`` entries are at or above the bits fixed so far (then those are its top k).

Then, still in registers, the exact selection: every entry ``> t``, plus the first (lowest-index)
``k - #(> t)`` entries equal to ``t`` (ties broken by index, an inclusive prefix count), and a
prefix sum over the selection gives each selected entry its output slot. Unselected lanes are
stored one past the end of the output row: Triton never touches a masked lane, and interpret mode
drops out-of-bound updates (a clamped index could overwrite a real store).

Outputs are ``(values, ids)`` ``[M, k]`` in ascending id order (not sorted by value), plus ``t``.
Inputs must be non-negative (the SAE's ``ReLU`` outputs); negative entries and NaN are treated as 0,
so in a row with fewer than ``k`` positive entries the last slots hold zeros at the lowest-index
zero positions. Rows must be a power of two wide (Triton block shapes), >= 16.

Backend: Pallas' Triton lowering; ``interpret=True`` runs the same kernel on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sparsekv_jax.pallas._common import is_pow2, next_pow2, triton_params

__all__ = ["threshold_top_k", "threshold_top_k_reference", "threshold_top_k_applies"]


def threshold_top_k_applies(width: int, k: int) -> bool:
    """Whether `threshold_top_k` takes rows of ``width`` (a power of two, >= 16, up to 64k) and ``k``."""
    return is_pow2(width) and 16 <= width <= 65536 and 1 <= k <= width


def _nonneg_bits(x: jax.Array) -> jax.Array:
    """int32 bit patterns that order like the values for x >= 0; everything else (<= 0, NaN) is 0."""
    return jnp.where(x > 0, lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32), 0)


def _kernel(x_ref, v_ref, i_ref, t_ref, *, k: int, rows: int, width: int, k_pad: int, early_exit: bool,
            fast_select: bool):
    bits = _nonneg_bits(x_ref[...])  # [rows, W]; only the bits stay live (values are their bitcast)

    def bisect(b, t, n):  # fix bit (30 - b) of each row's k-th largest pattern; n = #(bits >= t)
        cand = t | lax.shift_left(jnp.ones_like(t), 30 - b)
        count = jnp.sum((bits >= cand).astype(jnp.int32), axis=-1, keepdims=True)
        take = count >= k
        return jnp.where(take, cand, t), jnp.where(take, count, n)

    t0, n0 = jnp.zeros((rows, 1), jnp.int32), jnp.full((rows, 1), width, jnp.int32)
    if early_exit:
        # Stop once exactly k entries are >= t: they are the top k, whatever the lower bits of the
        # k-th value. On continuous data that takes about as many passes as the bits that separate
        # the k-th from the (k+1)-th value (measured in experiments/topk_gpu.py), not 31.
        def more(state):
            b, _, n = state
            return (b < 31) & (jnp.max((n != k).astype(jnp.int32)) > 0)

        def step(state):
            b, t, n = state
            return (b + 1, *bisect(b, t, n))

        _, bound, n = lax.while_loop(more, step, (jnp.int32(0), t0, n0))
        # the k-th value itself: the smallest of the k entries >= bound (only a lower bound of it)
        big = jnp.int32(jnp.iinfo(jnp.int32).max)
        t = jnp.where(n == k, jnp.min(jnp.where(bits >= bound, bits, big), axis=-1, keepdims=True), bound)
    else:
        t, _ = lax.fori_loop(0, 31, lambda b, tn: bisect(b, *tn), (t0, n0))

    def with_ties():  # every entry > t, then the lowest-index entries == t up to k
        above = bits > t
        tied = (bits == t).astype(jnp.int32)
        need = k - jnp.sum(above.astype(jnp.int32), axis=-1, keepdims=True)
        return above | ((tied == 1) & (jnp.cumsum(tied, axis=-1) <= need))

    if early_exit and fast_select:
        # rows that exited early have exactly k entries >= bound: the selection needs no tie scan
        every_row_exact = jnp.min((n == k).astype(jnp.int32)) > 0  # (Triton lowers no reduce_and)
        sel = lax.cond(every_row_exact, lambda: bits >= bound, with_ties)
    else:
        sel = with_ties()
    slot = jnp.cumsum(sel.astype(jnp.int32), axis=-1) - 1
    slot = jnp.where(sel, slot, k_pad)  # out of bounds: never stored (see module docstring)
    col = lax.broadcasted_iota(jnp.int32, (rows, width), 1)
    row = lax.broadcasted_iota(jnp.int32, (rows, width), 0)
    plgpu.store(v_ref.at[row, slot], lax.bitcast_convert_type(bits, jnp.float32), mask=sel)
    plgpu.store(i_ref.at[row, slot], col, mask=sel)
    t_ref[...] = lax.bitcast_convert_type(t, jnp.float32)


@functools.partial(jax.jit, static_argnames=("k", "block_rows", "num_warps", "early_exit", "fast_select",
                                             "interpret"))
def threshold_top_k(x: jax.Array, k: int, *, block_rows: int | None = None, num_warps: int | None = None,
                    early_exit: bool = True, fast_select: bool = True,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(values [..., k], int32 ids [..., k], kth [...])`` of the k largest entries of each row of ``x``.

    ``x`` ``[..., W]`` is non-negative (see the module docstring); ids are ascending within a row;
    ``kth`` is the k-th largest value (the threshold). ``block_rows`` rows share a program (a power
    of two dividing the rows; default 1). ``num_warps`` defaults to one warp per
    2,048 entries of a row, 4 to 8 (the fastest of 4/8/16/32 on an H100 at widths 8,192 and 16,384,
    experiments/topk_gpu.py). ``early_exit`` stops the bisection of a row once exactly ``k`` entries are
    at or above its lower bound (``False``: always 31 passes; the results are the same).
    ``fast_select`` (with ``early_exit``): when every row of a program exited early, select the
    entries ``>=`` the bound directly instead of the tie-breaking prefix count (same results).
    """
    *lead, W = x.shape
    if not threshold_top_k_applies(W, k):
        raise ValueError(f"threshold_top_k needs a power-of-two row width in [16, 65536] and 1 <= k <= width; "
                         f"got width={W}, k={k}")
    x2 = x.reshape(-1, W)
    M = x2.shape[0]
    k_pad = next_pow2(k)
    rows = block_rows or 1
    if not is_pow2(rows) or M % rows:
        raise ValueError(f"block_rows={block_rows} must be a power of two dividing the {M} rows")
    warps = num_warps or min(8, max(4, W // 2048))
    kernel = functools.partial(_kernel, k=k, rows=rows, width=W, k_pad=k_pad, early_exit=early_exit,
                               fast_select=fast_select)
    vals, ids, kth = pl.pallas_call(
        kernel,
        grid=(M // rows,),
        in_specs=[pl.BlockSpec((rows, W), lambda m: (m, 0))],
        out_specs=[pl.BlockSpec((rows, k_pad), lambda m: (m, 0)),
                   pl.BlockSpec((rows, k_pad), lambda m: (m, 0)),
                   pl.BlockSpec((rows, 1), lambda m: (m, 0))],
        out_shape=[jax.ShapeDtypeStruct((M, k_pad), jnp.float32),
                   jax.ShapeDtypeStruct((M, k_pad), jnp.int32),
                   jax.ShapeDtypeStruct((M, 1), jnp.float32)],
        compiler_params=triton_params(warps, 1),
        interpret=interpret,
        name="sparsekv_threshold_top_k",
    )(x2)
    return (vals[:, :k].reshape(*lead, k), ids[:, :k].reshape(*lead, k), kth[:, 0].reshape(lead))


def threshold_top_k_reference(x: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The same contract in jnp: ``lax.top_k`` of ``max(x, 0)`` (ties to the lower index), ids ascending."""
    r = jnp.where(x > 0, x, 0.0).astype(jnp.float32)
    v, i = lax.top_k(r, k)
    kth = jnp.min(v, axis=-1)
    i, v = lax.sort((i.astype(jnp.int32), v), dimension=-1, num_keys=1)
    return v, i, kth
