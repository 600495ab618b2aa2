"""The Top-K SAE's encoder, ReLU and top-k fused (Pallas / Triton), and its jnp reference.

``ids, vals = TopK(ReLU(x · W + b) · keep, k)`` per row, with ``x [S, N, D]`` (already centred: ``x − b_dec``),
``W [S, D, W]`` one encoder per stacked SAE, ``b [S, W]`` and an optional ``keep [S, W]`` (1 / 0 per latent:
AuxK's top-k over the dead latents only; a latent not kept counts as 0).

Why: the unfused step writes the dense ``[N, W]`` pre-activations (2 GiB fp32 at the paper's width,
Llama's 32,768 × 16,384) and the threshold top-k kernel (`sparsekv_jax.pallas.topk`) reads them back
and bisects every row: 4.7 of a 9.0 ms SAE step on an H200 (experiments/diary/BENCHMARKS_DIARY.md). Here a
program owns ``block_rows`` rows and walks the width in tiles of ``block_w`` latents, each tile a
``[block_rows, D] × [D, block_w]`` tensor-core dot plus the bias, the ReLU and the mask, in registers.
Nothing of size ``N × W`` reaches memory.

Why a threshold pass and a selection pass, not a running top-k: a running top-k has to merge each
tile's values into a per-row set of k, a sort or a bisection per tile (Triton has neither in
registers across tiles), and the row (64 KiB per row at 16,384 latents) does not fit a program.
Recomputing the dot is cheaper (about 1 ms of TF32 for the whole batch at the paper's width), so each
program runs over the width twice:

1. **a lower bound ``τ`` of the row's k-th value.** Column ``c`` of a tile belongs to class
   ``c mod block_w``; an elementwise max over the tiles keeps each class's two largest values
   (``m1``, ``m2``: ``2·block_w`` distinct entries of the row) at no cost beyond the dot. ``τ`` is
   the k-th largest of those, found by a 31-step bisection on the float bits (as in
   `sparsekv_jax.pallas.topk`) over ``[block_rows, 2·block_w]``: small. At least ``k`` entries of the
   row are ``>= τ``, so the row's k-th value is ``>= τ``;
2. **candidates.** The dot again (same tiles, same bits); every entry ``>= τ`` is appended, in
   ascending latent order, to the row's buffer of ``capacity`` slots (a prefix sum gives each its
   slot; stores past the end are dropped), except that a row whose ``τ`` is 0 keeps only its first
   ``k`` zeros (lowest index first). That is at least ``k`` candidates, and every entry of the top k.

With latents in random order (a learned SAE's order means nothing) a row's top k lands on the classes
like a random subset, and few rows hold more than ``k`` plus a few candidates. Simulated in numpy on
2,000 rows of ReLU'd Gaussians per shape: at 16,384 latents, k = 128 and ``block_w`` 128, a mean of 146
and at most 174 of the 256 slots; at 8,192, k = 64, a mean of 66, at most 74 of 128. (A ``block_w`` of
64 at k = 128 gave a mean of 430: the tile must be at least k wide.)

Cost, as designed (not yet measured): two TF32 dots of the batch, and every program reads all of ``W``
twice from L2 (8 MiB at the paper's width; 512 programs of 64 rows read 8 GiB). More rows per program
read less but hold more registers (``m1``, ``m2``, the dot and the prefix sums are ``[rows, block_w]``
each). `sae_training/bench.py --fused` sweeps a few tilings.

3. **the exact top k among the candidates**: `sparsekv_jax.pallas.topk.threshold_top_k` on
   ``[N, capacity]`` (a 256-wide row instead of a 16,384-wide one); unused slots count as 0 and come
   after every real candidate, so its lowest-position tie rule is the lowest latent id.

Exactness: the result is the top k of ``ReLU(pre) · keep`` with ties to the lower latent id (the
contract of `threshold_top_k_reference`), for the kernel's own values of ``pre``, unless a row's
candidates overflow its buffer (latents with large values crowded in a few classes, or a row with
many positive entries whose classes hide most of them). Then the whole batch is recomputed by the
unfused path (the dense pre-activations and `threshold_top_k`) under a `lax.cond`: only the taken
branch runs. A safety net (tests force it), not a path.

Precision: the kernel's dot is TF32 on a GPU by default (``precision=None``), like XLA's default
for the unfused fp32 einsum it replaces; ``HIGHEST`` asks for full fp32. Its values only choose ids:
the training step recomputes the k activations at the ids in fp32 (`sparsekv_jax.sae.model.selected_activations`).

Backend: Pallas' Triton lowering; ``interpret=True`` runs the same kernel on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sparsekv_jax.pallas._common import fit_stages, is_pow2, next_pow2, triton_params
from sparsekv_jax.pallas.topk import _nonneg_bits, threshold_top_k, threshold_top_k_reference

__all__ = ["fused_encoder_applies", "fused_encoder_candidates", "fused_encoder_plan", "fused_encoder_top_k",
           "fused_encoder_top_k_reference"]

# The encoder tile ``[D, block_w]`` of W (fp32) is staged in shared memory: at most this many bytes
# (D = 128, block_w = 128: 64 KiB; D = 256 needs block_w <= 128).
_W_TILE_BYTES = 128 * 1024


def fused_encoder_plan(width: int, k: int, block_w: int | None = None) -> tuple[int, int]:
    """``(block_w, capacity)``: latents per tile (default ``max(128, next_pow2(k))``; the bound of step 1
    needs ``2·block_w >= k`` and is only tight for ``block_w >= k``) and candidate slots per row
    (``next_pow2(2k)``, at least 16)."""
    bw = max(128, next_pow2(k)) if block_w is None else block_w
    return bw, max(16, next_pow2(2 * k))


# Whether ``topk="auto"`` takes this kernel on a GPU. False until the kernel has compiled and matched
# the unfused selection on one (`python sae_training/bench.py --fused ...`, docs/SAE.md): written on a
# CPU, checked there interpreted and lowered to Triton IR, never yet compiled by Triton or timed.
# ``topk="fused"`` runs it on request.
AUTO_ON_GPU = False


def fused_encoder_applies(d_in: int, width: int, k: int, block_w: int | None = None) -> bool:
    """Whether the fused kernel takes SAEs of ``d_in``, ``width`` and ``k`` (power-of-two ``d_in`` 16-1,024
    and tile; the width whole tiles, at least two; ``k <= block_w``; the ``W`` tile within 128 KiB)."""
    bw, _ = fused_encoder_plan(width, k, block_w)
    return (is_pow2(d_in) and 16 <= d_in <= 1024 and is_pow2(bw) and bw >= 16 and width % bw == 0
            and width // bw >= 2 and 1 <= k <= bw and d_in * bw * 4 <= _W_TILE_BYTES)


def _kernel(x_ref, w_ref, b_ref, keep_ref, cv_ref, ci_ref, cnt_ref, *, k: int, block_rows: int, block_w: int,
            n_tiles: int, capacity: int, precision, has_keep: bool):
    x = x_ref[...]  # [bm, D] fp32, stays in registers for both passes
    bm, bw = block_rows, block_w

    def tile_bits(j):  # tile j's ReLU(x·W + b)·keep as non-negative float bits [bm, bw]
        start = pl.multiple_of(j * bw, bw)
        pre = plgpu.dot(x, w_ref[:, pl.ds(start, bw)], precision=precision) + b_ref[pl.ds(start, bw)][None, :]
        if has_keep:
            pre = jnp.where(keep_ref[pl.ds(start, bw)][None, :] > 0, pre, 0.0)
        return _nonneg_bits(pre)

    # 1. each class's two largest values, then tau = the k-th largest of those 2·bw entries
    def top2(j, carry):
        m1, m2 = carry
        bits = tile_bits(j)
        return jnp.maximum(m1, bits), jnp.maximum(m2, jnp.minimum(m1, bits))

    zeros = jnp.zeros((bm, bw), jnp.int32)
    m1, m2 = lax.fori_loop(0, n_tiles, top2, (zeros, zeros))

    def bisect(b, t):  # fix bit (30 - b) of tau: the largest t with #(union >= t) >= k
        cand = t | lax.shift_left(jnp.ones_like(t), 30 - b)
        count = (jnp.sum((m1 >= cand).astype(jnp.int32), axis=-1, keepdims=True)
                 + jnp.sum((m2 >= cand).astype(jnp.int32), axis=-1, keepdims=True))
        return jnp.where(count >= k, cand, t)

    tau = lax.fori_loop(0, 31, bisect, jnp.zeros((bm, 1), jnp.int32))

    # 2. the candidates, in latent order: every entry > tau, and the entries == tau -- all of them where
    # tau > 0 (few: tau is one of the row's values), the first k where tau == 0 (a row of fewer than k
    # positive entries in the union: its zeros may be most of the row). The tie rank (a second prefix
    # sum per tile) runs only in programs holding such a row (Triton lowers no reduce_and: max of a flag).
    col = lax.broadcasted_iota(jnp.int32, (bm, bw), 1)
    row = lax.broadcasted_iota(jnp.int32, (bm, bw), 0)
    some_row_at_zero = jnp.max((tau == 0).astype(jnp.int32)) > 0

    def collect(j, carry):
        count, ties = carry  # [bm, 1]: candidates so far (may pass capacity), entries == tau so far
        bits = tile_bits(j)
        tied = (bits == tau).astype(jnp.int32)

        def ranked():
            return (bits > tau) | ((tied == 1) & ((tau > 0) | (ties + jnp.cumsum(tied, axis=-1) <= k)))

        sel = lax.cond(some_row_at_zero, ranked, lambda: bits >= tau)
        seli = sel.astype(jnp.int32)
        slot = count + jnp.cumsum(seli, axis=-1) - 1
        ok = sel & (slot < capacity)
        slot = jnp.where(ok, slot, capacity)  # out of bounds: never stored (see pallas/topk.py)
        plgpu.store(cv_ref.at[row, slot], lax.bitcast_convert_type(bits, jnp.float32), mask=ok)
        plgpu.store(ci_ref.at[row, slot], col + j * bw, mask=ok)
        return (count + jnp.sum(seli, axis=-1, keepdims=True), ties + jnp.sum(tied, axis=-1, keepdims=True))

    one = jnp.zeros((bm, 1), jnp.int32)
    count, _ = lax.fori_loop(0, n_tiles, collect, (one, one))
    cnt_ref[...] = count


@functools.partial(jax.jit, static_argnames=("k", "block_rows", "block_w", "num_warps", "num_stages", "precision",
                                             "poison", "interpret"))
def fused_encoder_candidates(x: jax.Array, w: jax.Array, bias: jax.Array, keep: jax.Array | None, *, k: int,
                             block_rows: int = 64, block_w: int | None = None, num_warps: int = 8,
                             num_stages: int = 2, precision: lax.Precision | None = None, poison: bool = False,
                             interpret: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Steps 1-2: ``(values [S, N, C], ids [S, N, C], count [S, N])``, ``C`` = the capacity.

    A row's first ``min(count, C)`` slots hold its candidates in ascending id order; the rest are
    unspecified (``poison``: +inf values, which would win any top-k, and id -1 there, written before the
    kernel runs, for tests).
    ``count > C`` means the row overflowed. Arguments as in `fused_encoder_top_k`.
    """
    S, N, D = x.shape
    W = w.shape[-1]
    bw, cap = fused_encoder_plan(W, k, block_w)
    bm = max(16, min(block_rows, next_pow2(N)))
    n_pad = -(-N // bm) * bm
    xp = jnp.pad(x.astype(jnp.float32), ((0, 0), (0, n_pad - N), (0, 0)))
    keep_in = jnp.ones((S, W), jnp.float32) if keep is None else keep.astype(jnp.float32)
    kernel = functools.partial(_kernel, k=k, block_rows=bm, block_w=bw, n_tiles=W // bw, capacity=cap,
                               precision=precision, has_keep=keep is not None)
    stages = fit_stages(num_stages, D * bw * 4, bm * D * 4)
    per_row = lambda n: pl.BlockSpec((None, bm, n), lambda s, i: (s, i, 0))  # noqa: E731
    per_sae = lambda *shape: pl.BlockSpec((None, *shape), lambda s, i: (s,) + (0,) * len(shape))  # noqa: E731
    out_shape = [jax.ShapeDtypeStruct((S, n_pad, cap), jnp.float32),
                 jax.ShapeDtypeStruct((S, n_pad, cap), jnp.int32),
                 jax.ShapeDtypeStruct((S, n_pad, 1), jnp.int32)]
    args = [xp, w.astype(jnp.float32), bias.astype(jnp.float32), keep_in]
    in_specs = [per_row(D), per_sae(D, W), per_sae(W), per_sae(W)]
    aliases = {}
    if poison:  # the outputs start as garbage (aliased inputs): an unwritten slot that is read shows
        args += [jnp.full((S, n_pad, cap), jnp.inf, jnp.float32), jnp.full((S, n_pad, cap), -1, jnp.int32),
                 jnp.full((S, n_pad, 1), -(1 << 30), jnp.int32)]
        in_specs += [per_row(cap), per_row(cap), per_row(1)]
        aliases = {4: 0, 5: 1, 6: 2}

        def kernel_with_outs(x_ref, w_ref, b_ref, keep_ref, _a, _b, _c, cv_ref, ci_ref, cnt_ref):
            base(x_ref, w_ref, b_ref, keep_ref, cv_ref, ci_ref, cnt_ref)

        base, kernel = kernel, kernel_with_outs
    vals, ids, count = pl.pallas_call(
        kernel,
        grid=(S, n_pad // bm),
        in_specs=in_specs,
        out_specs=[per_row(cap), per_row(cap), per_row(1)],
        out_shape=out_shape,
        input_output_aliases=aliases,
        compiler_params=triton_params(num_warps, stages),
        interpret=interpret,
        name="sparsekv_sae_fused_encoder",
    )(*args)
    return vals[:, :N], ids[:, :N], count[:, :N, 0]


def _check(x, w, bias, keep, k, block_w):
    if x.ndim != 3 or w.ndim != 3 or bias.ndim != 2 or x.shape[0] != w.shape[0] or x.shape[-1] != w.shape[1] \
            or bias.shape != (w.shape[0], w.shape[2]):
        raise ValueError(f"need x [S, N, D], w [S, D, W] and bias [S, W] of one S, D and W; got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, bias {tuple(bias.shape)}")
    if keep is not None and keep.shape != bias.shape:
        raise ValueError(f"keep {tuple(keep.shape)} must have bias's shape {tuple(bias.shape)}")
    D, W = w.shape[1:]
    if not fused_encoder_applies(D, W, k, block_w):
        raise ValueError(f"the fused SAE encoder needs a power-of-two d_in in [16, 1024], a width of >= 2 tiles of "
                         f"block_w (a power of two >= k) and d_in * block_w * 4 <= {_W_TILE_BYTES}; got d_in={D}, "
                         f"width={W}, k={k}, block_w={fused_encoder_plan(W, k, block_w)[0]}")


def fused_encoder_top_k(x: jax.Array, w: jax.Array, bias: jax.Array, k: int, *, keep: jax.Array | None = None,
                        block_rows: int = 64, block_w: int | None = None, num_warps: int = 8, num_stages: int = 2,
                        precision: lax.Precision | None = None, poison: bool = False,
                        interpret: bool = False) -> tuple[jax.Array, jax.Array]:
    """``(values [S, N, k], int32 ids [S, N, k])``: the top k of ``ReLU(x · w + bias) · keep`` per row, ids
    ascending, ties to the lower id; the ``[S, N, W]`` pre-activations are never written (module docstring).

    ``x [S, N, D]`` (centred), ``w [S, D, W]``, ``bias [S, W]``, ``keep [S, W]`` (nonzero: the latent
    counts; default every latent). ``block_rows`` rows per program (>= 16; fewer rows are padded),
    ``block_w`` latents per tile (default `fused_encoder_plan`); ``num_warps``/``num_stages``: Triton's.
    ``precision``: the dot's (``None``: TF32 on a GPU). No gradient: the ids are a selection, the
    values only its scores (the training step recomputes the activations at the ids).
    """
    _check(x, w, bias, keep, k, block_w)
    x, w, bias = (lax.stop_gradient(a) for a in (x, w, bias))
    keep = None if keep is None else lax.stop_gradient(keep)
    vals, ids, count = fused_encoder_candidates(x, w, bias, keep, k=k, block_rows=block_rows, block_w=block_w,
                                                num_warps=num_warps, num_stages=num_stages, precision=precision,
                                                poison=poison, interpret=interpret)
    cap = vals.shape[-1]

    def fused():
        used = jnp.arange(cap)[None, None, :] < count[..., None]
        v, pos, _ = threshold_top_k(jnp.where(used, vals, -1.0), k, interpret=interpret)
        return v, jnp.take_along_axis(ids, pos, axis=-1)

    def unfused():  # a row overflowed its buffer: the dense pre-activations and the threshold kernel
        pre = jnp.einsum("snd,sdw->snw", x.astype(jnp.float32), w.astype(jnp.float32), precision=precision,
                         preferred_element_type=jnp.float32) + bias[:, None].astype(jnp.float32)
        if keep is not None:
            pre = jnp.where(keep[:, None] != 0, pre, 0.0)
        v, i, _ = threshold_top_k(pre, k, interpret=interpret)
        return v, i

    return lax.cond(jnp.any(count > cap), unfused, fused)


def fused_encoder_top_k_reference(x: jax.Array, w: jax.Array, bias: jax.Array, k: int, *,
                                  keep: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """The same contract in jnp: the dense pre-activations, ``lax.top_k`` (ties to the lower id), ids ascending."""
    pre = jnp.einsum("snd,sdw->snw", x.astype(jnp.float32), w.astype(jnp.float32),
                     precision=lax.Precision.HIGHEST) + bias[:, None].astype(jnp.float32)
    if keep is not None:
        pre = jnp.where(keep[:, None] != 0, pre, 0.0)
    v, i, _ = threshold_top_k_reference(pre, k)
    return v, i
