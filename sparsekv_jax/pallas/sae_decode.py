"""The Top-K SAE's two sparse products as gather kernels (Pallas / Triton), their gradients, jnp references.

With ``ids [S, N, k]`` the k active latents of each of N vectors (a leading stack axis S: one SAE per
layer, trained together) and ``table [S, W, D]`` one row per latent:

* `gather_decode` — the decoder: ``out[n] = Σ_j coef[n, j] · table[ids[n, j]] + bias``  → ``[S, N, D]``;
* `gather_dot` — the encoder at the selected latents: ``out[n, j] = table[ids[n, j]] · vec[n]`` → ``[S, N, k]``
  (with ``table = W_encᵀ``: the k pre-activations a Top-K SAE keeps, without the dense ``[N, W]`` ones).

Why: XLA runs the jnp forms (``table[ids]`` then an einsum) as a gather that writes the ``[S, N, k, D]``
rows to memory and a reduction that reads them back: 2 GiB each way at Llama's SAE step (N = 32,768,
k = 128, D = 128), 2.8 ms of the decode on an H200 (experiments/diary/BENCHMARKS_DIARY.md). The table is small (16,384
x 128 fp32 = 8 MiB, it stays in L2), so one program per block of rows gathers its rows straight
into registers and accumulates: 0.41-0.54 ms. Nothing of size ``N·k·D`` touches HBM.

The two are each other's gradient (both are ``custom_vjp``):

* ``∂coef`` of `gather_decode` is `gather_dot` of the incoming gradient; ``∂vec`` of `gather_dot` is
  `gather_decode` of its incoming gradient;
* ``∂table`` of both is `scatter_rows`: ``Σ_{(n, j): ids[n, j] = w} c[n, j] · v[n]`` into row ``w``,
  left to XLA's scatter (on an H200 it beat Triton atomics in the kernel, 1.77 vs 2.44 ms for the
  decoder's forward + backward at Llama's shape, `experiments/sae_decode_gpu.py`).

For the encoder this replaces a dense ``[N, W]`` gradient of the pre-activations and a dense
``xᵀ · ∂pre`` matmul by one scatter of N·k rows. ``D`` must be a power of two (Triton block shapes);
``N`` and ``k`` are padded inside (padding has coefficient 0). Backend: Pallas' Triton lowering;
``interpret=True`` runs the same kernels on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sparsekv_jax.pallas._common import is_pow2, next_pow2, triton_params

__all__ = ["gather_decode", "gather_dot", "scatter_rows", "gather_decode_reference", "gather_dot_reference",
           "gather_kernels_apply"]


def gather_kernels_apply(d_in: int) -> bool:
    """Whether the kernels take rows of ``d_in`` (a power of two, 16 to 1,024)."""
    return is_pow2(d_in) and 16 <= d_in <= 1024


# ---- jnp references (and the XLA path) ------------------------------------------------------------

def gather_decode_reference(table: jax.Array, bias: jax.Array, ids: jax.Array, coef: jax.Array) -> jax.Array:
    """The jnp decoder: gather the rows, weight and sum them (XLA writes the ``[S, N, k, D]`` rows)."""
    rows = jax.vmap(lambda t, i: t[i])(table, ids)
    return jnp.einsum("snk,snkd->snd", coef.astype(jnp.float32), rows.astype(jnp.float32)) + bias[:, None]


def gather_dot_reference(table: jax.Array, ids: jax.Array, vec: jax.Array) -> jax.Array:
    """The jnp encoder at ``ids``: ``table[ids[n, j]] · vec[n]``."""
    rows = jax.vmap(lambda t, i: t[i])(table, ids)
    return jnp.einsum("snkd,snd->snk", rows.astype(jnp.float32), vec.astype(jnp.float32))


def scatter_rows(ids: jax.Array, coef: jax.Array, vec: jax.Array, width: int) -> jax.Array:
    """``out[s, w] = Σ_{(n, j): ids[s, n, j] = w} coef[s, n, j] · vec[s, n]`` → ``[S, width, D]`` (XLA's scatter)."""
    contrib = coef.astype(jnp.float32)[..., None] * vec.astype(jnp.float32)[:, :, None, :]
    out = jax.vmap(lambda i, c: jnp.zeros((width, vec.shape[-1]), jnp.float32).at[i].add(c))(ids, contrib)
    # The barrier keeps the scatter in this row layout: for the encoder (``table = W_encᵀ``) XLA
    # otherwise folded the transpose back to ``[D, W]`` into the scatter, which then wrote each row
    # as a strided column: 13.6 instead of 9.1 ms for Llama's SAE step on an H200
    # (experiments/diary/BENCHMARKS_DIARY.md).
    return jax.lax.optimization_barrier(out)


# ---- kernels --------------------------------------------------------------------------------------

def _sum_kernel(ids_ref, coef_ref, table_ref, bias_ref, o_ref, *, k: int, unroll: int):
    bn, d = o_ref.shape

    def body(step, acc):
        for u in range(unroll):  # static: independent gathers in flight together
            j = step * unroll + u
            rows = table_ref[ids_ref[:, j], :]  # [bn, d]: whole table rows, gathered (from L2)
            acc = acc + coef_ref[:, j][:, None] * rows
        return acc

    acc = lax.fori_loop(0, k // unroll, body, jnp.zeros((bn, d), jnp.float32))
    o_ref[...] = acc + bias_ref[...][None, :]


def _dot_kernel(ids_ref, table_ref, vec_ref, o_ref, *, k: int, unroll: int):
    vec = vec_ref[...]  # [bn, d]

    def body(step, carry):
        for u in range(unroll):
            j = step * unroll + u
            o_ref[:, j] = jnp.sum(table_ref[ids_ref[:, j], :] * vec, axis=1)
        return carry

    lax.fori_loop(0, k // unroll, body, 0)


def _pad(ids, coef, block_rows):
    """Pad N to a multiple of the block and k to a power of two (id 0, coefficient 0)."""
    S, N, k = ids.shape
    k_pad, n_pad = next_pow2(k), -(-N // block_rows) * block_rows
    pad = ((0, 0), (0, n_pad - N), (0, k_pad - k))
    coef = None if coef is None else jnp.pad(coef.astype(jnp.float32), pad)
    return jnp.pad(ids.astype(jnp.int32), pad), coef, n_pad, k_pad


def _specs(W: int, D: int, bn: int, k_pad: int):
    per_slot = pl.BlockSpec((None, bn, k_pad), lambda s, i: (s, i, 0))
    per_row = pl.BlockSpec((None, bn, D), lambda s, i: (s, i, 0))
    table = pl.BlockSpec((None, W, D), lambda s, i: (s, 0, 0))
    return per_slot, per_row, table


def _sum_call(table, bias, ids, coef, cfg):
    block_rows, num_warps, unroll, interpret = cfg
    S, W, D = table.shape
    N = ids.shape[1]
    ids_p, coef_p, n_pad, k_pad = _pad(ids, coef, block_rows)
    per_slot, per_row, tab = _specs(W, D, block_rows, k_pad)
    out = pl.pallas_call(
        functools.partial(_sum_kernel, k=k_pad, unroll=min(unroll, k_pad)),
        grid=(S, n_pad // block_rows),
        in_specs=[per_slot, per_slot, tab, pl.BlockSpec((None, D), lambda s, i: (s, 0))],
        out_specs=per_row,
        out_shape=jax.ShapeDtypeStruct((S, n_pad, D), jnp.float32),
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="sparsekv_sae_gather_sum",
    )(ids_p, coef_p, table.astype(jnp.float32), bias.astype(jnp.float32))
    return out[:, :N]


def _dot_call(table, ids, vec, cfg):
    block_rows, num_warps, unroll, interpret = cfg
    S, W, D = table.shape
    N, k = ids.shape[1:]
    ids_p, _, n_pad, k_pad = _pad(ids, None, block_rows)
    vec_p = jnp.pad(vec.astype(jnp.float32), ((0, 0), (0, n_pad - N), (0, 0)))
    per_slot, per_row, tab = _specs(W, D, block_rows, k_pad)
    out = pl.pallas_call(
        functools.partial(_dot_kernel, k=k_pad, unroll=min(unroll, k_pad)),
        grid=(S, n_pad // block_rows),
        in_specs=[per_slot, tab, per_row],
        out_specs=per_slot,
        out_shape=jax.ShapeDtypeStruct((S, n_pad, k_pad), jnp.float32),
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="sparsekv_sae_gather_dot",
    )(ids_p, table.astype(jnp.float32), vec_p)
    return out[:, :N, :k]


# ---- differentiable wrappers ----------------------------------------------------------------------

def _float0(x):
    return jnp.zeros(x.shape, jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _decode(table, bias, ids, coef, cfg):
    return _sum_call(table, bias, ids, coef, cfg)


def _decode_fwd(table, bias, ids, coef, cfg):
    return _sum_call(table, bias, ids, coef, cfg), (table, ids, coef)


def _decode_bwd(cfg, res, g):
    table, ids, coef = res
    d_table = scatter_rows(ids, coef, g, table.shape[1]).astype(table.dtype)
    d_coef = _dot_call(table, ids, g, cfg).astype(coef.dtype)
    return d_table, jnp.sum(g, axis=1).astype(table.dtype), _float0(ids), d_coef


_decode.defvjp(_decode_fwd, _decode_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _dot(table, ids, vec, cfg):
    return _dot_call(table, ids, vec, cfg)


def _dot_fwd(table, ids, vec, cfg):
    return _dot_call(table, ids, vec, cfg), (table, ids, vec)


def _dot_bwd(cfg, res, g):
    table, ids, vec = res
    d_table = scatter_rows(ids, g, vec, table.shape[1]).astype(table.dtype)
    # ∂vec (unused when vec is data: XLA drops it then)
    d_vec = _sum_call(table, jnp.zeros((table.shape[0], table.shape[2]), jnp.float32), ids, g, cfg)
    return d_table, _float0(ids), d_vec.astype(vec.dtype)


_dot.defvjp(_dot_fwd, _dot_bwd)


def _check(table: jax.Array, ids: jax.Array, other: jax.Array, other_name: str, block_rows: int,
           unroll: int) -> None:
    if table.ndim != 3 or ids.ndim != 3 or ids.shape[0] != table.shape[0] or other.shape[:2] != ids.shape[:2]:
        raise ValueError(f"need table [S, W, D], ids [S, N, k] and {other_name} [S, N, ...] of one S and N; got "
                         f"table {tuple(table.shape)}, ids {tuple(ids.shape)}, {other_name} {tuple(other.shape)}")
    if not gather_kernels_apply(table.shape[-1]):
        raise ValueError(f"the SAE gather kernels need a power-of-two row size in [16, 1024]; got {table.shape[-1]}")
    if not is_pow2(block_rows) or not is_pow2(unroll):
        raise ValueError(f"block_rows={block_rows} and unroll={unroll} must be powers of two")


def gather_decode(table: jax.Array, bias: jax.Array, ids: jax.Array, coef: jax.Array, *, block_rows: int = 32,
                  num_warps: int = 8, unroll: int = 4, interpret: bool = False) -> jax.Array:
    """``Σ_j coef[s, n, j] · table[s, ids[s, n, j]] + bias[s]`` → ``[S, N, D]`` fp32; differentiable in
    ``table``, ``bias`` and ``coef``. ``block_rows`` rows share a program; ``unroll`` gathers are
    issued per loop step (defaults: the fastest of 32/64/128 x 4/8 warps x 1/4/8 on an H200)."""
    if coef.shape != ids.shape:
        raise ValueError(f"coef {tuple(coef.shape)} and ids {tuple(ids.shape)} must have one shape")
    _check(table, ids, coef, "coef", block_rows, unroll)
    return _decode(table, bias, ids, coef, (block_rows, num_warps, unroll, interpret))


def gather_dot(table: jax.Array, ids: jax.Array, vec: jax.Array, *, block_rows: int = 32, num_warps: int = 8,
               unroll: int = 4, interpret: bool = False) -> jax.Array:
    """``table[s, ids[s, n, j]] · vec[s, n]`` → ``[S, N, k]`` fp32; differentiable in ``table`` and ``vec``."""
    if vec.ndim != 3 or vec.shape[-1] != table.shape[-1]:
        raise ValueError(f"vec must be [S, N, D] with D = {table.shape[-1]}; got {tuple(vec.shape)}")
    _check(table, ids, vec, "vec", block_rows, unroll)
    return _dot(table, ids, vec, (block_rows, num_warps, unroll, interpret))
