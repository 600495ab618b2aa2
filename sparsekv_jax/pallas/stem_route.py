"""Stem's routing metric for a tile of query blocks as a Pallas / Triton kernel.

The jnp reference is `sparsekv_jax.policies.stem_routing.tile_metric` (same arguments, same result
up to float rounding: the kernel takes the softmax online over key chunks, the reference over the
whole row, so lists cut at a near-tie may differ; tests/test_stem.py compares the metrics within
1e-4 and the lists wherever the cut is clear).

Why a kernel: the jnp routing writes every strided score of a step (``[B, Hq, tile*t, T/stride]``
fp32) to memory and reads it back for the softmax max, its sum and the block sums; at 128k tokens
of Llama-3.1-8B that is ~34 GB of fp32 per layer, written once and read about three times. The
kernel keeps the scores in registers: one program per (row x KV head, query block) computes its
``G * t`` strided query rows (the GQA group's heads together) against the causal key chunks only,
once for the running max and sum, once more for the probabilities summed per key block, and writes
only the ``[nK]`` metric of its query block: the GQA combine of ``log(mass)`` plus the value-norm
bonus. Twice the causal half of the strided matmul is the full square the jnp path computes.

Backend: Pallas' Triton lowering; ``interpret=True`` runs the same kernel on CPU for tests. It has
not run on a GPU yet: `experiments/stem_routing_gpu.py` checks it against the reference and times it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sparsekv_jax.pallas._common import M_INIT, cdiv, next_pow2, triton_params

__all__ = ["stem_tile_metric_kernel"]


def _route_kernel(qi_ref, q_ref, k_ref, w_ref, bonus_ref, o_ref, *, t: int, groups: int, chunk: int,
                  feature_chunk: int, scale: float, gqa: str):
    j = pl.program_id(1)
    i = qi_ref[j]  # this program's query block
    rows, features = q_ref.shape
    g_pad = rows // t
    kb = chunk // t  # key blocks per chunk
    row_in_block = lax.rem(jnp.arange(rows, dtype=jnp.int32), t)
    a = i * t + row_in_block  # strided query row of each row
    n_chunks = lax.div((i + 1) * t + chunk - 1, chunk)  # chunks holding a causal key row

    def scores(c):
        s = jnp.zeros((rows, chunk), jnp.float32)
        for f in range(0, features, feature_chunk):
            qf = q_ref[:, pl.ds(f, feature_chunk)]
            kf = k_ref[pl.ds(c * chunk, chunk), pl.ds(f, feature_chunk)]
            s += lax.dot_general(qf, kf, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        col = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
        return jnp.where(col[None, :] <= a[:, None], s * scale, -jnp.inf)

    def stats(c, carry):
        m, z = carry
        s = scores(c)
        m_new = jnp.maximum(m, s.max(1))
        return m_new, z * jnp.exp(m - m_new) + jnp.exp(s - m_new[:, None]).sum(1)

    m, z = lax.fori_loop(0, n_chunks, stats, (jnp.full((rows,), M_INIT, jnp.float32), jnp.zeros((rows,), jnp.float32)))
    weight = w_ref[row_in_block]  # 1 / (rows inside) for a row inside, 0 outside
    head_ok = jnp.arange(g_pad) < groups

    # The write-only loops pass their (unused) carry through rather than return a literal: jax 0.11's Triton
    # lowering yields a literal as a non-Value and fails (`scf.yield` "Operand 0 ... must be a Value", H200,
    # 2026-11-27); sae_decode's `_dot_kernel` passes its carry through and compiles there.
    def zeros(c, carry):  # key blocks no causal chunk reaches (masked by the selection)
        o_ref[pl.ds(c * kb, kb)] = jnp.zeros((kb,), o_ref.dtype)
        return carry

    lax.fori_loop(n_chunks, o_ref.shape[0] // kb, zeros, 0)

    def mass(c, carry):
        p = jnp.exp(scores(c) - m[:, None]) * (weight / z)[:, None]  # [rows, chunk]
        per_block = p.reshape(rows, kb, t).sum(2).reshape(g_pad, t, kb).sum(1)  # [G_pad, kb]
        log_mass = jnp.log(per_block + 1e-30)
        if gqa == "max":
            comb = jnp.where(head_ok[:, None], log_mass, -jnp.inf).max(0)
        else:
            comb = jnp.where(head_ok[:, None], log_mass, 0.0).sum(0) / groups
        o_ref[pl.ds(c * kb, kb)] = comb + bonus_ref[pl.ds(c * kb, kb)]
        return carry

    lax.fori_loop(0, n_chunks, mass, 0)


@functools.partial(jax.jit, static_argnames=("gqa", "scale", "chunk", "feature_chunk", "num_warps", "num_stages",
                                             "interpret"))
def stem_tile_metric_kernel(qb: jax.Array, qi: jax.Array, inside: jax.Array, ks: jax.Array, bonus: jax.Array, *,
                            gqa: str, scale: float, chunk: int = 64, feature_chunk: int = 128, num_warps: int = 4,
                            num_stages: int = 1, interpret: bool = False) -> jax.Array:
    """`stem_routing.tile_metric` on the kernel: the OAM metric ``[B, Hkv, tile, nK]`` fp32 of a tile of
    query blocks (future key blocks: 0 or the bonus; the selection masks them).

    ``qb [tile, B, Hkv, G, t, S*D]`` the tile's strided query rows, ``qi [tile]`` int32 their block
    indices, ``inside [tile, B, t]`` which rows hold a query, ``ks [B, Hkv, m, S*D]`` the strided keys,
    ``bonus [B, Hkv, nK]`` fp32 (``beta * max(0, log ||V||)``, zeros for ``beta = 0``). ``chunk``:
    strided key rows per step (a power of two, a multiple of ``t``); ``feature_chunk``: features per
    dot (divides ``S*D``).
    """
    tile, B, Hkv, G, t, F = qb.shape
    m = ks.shape[2]
    n = m // t
    if gqa not in ("max", "mean"):
        raise ValueError(f"gqa={gqa!r} must be 'max' or 'mean'")
    if chunk % t or chunk & (chunk - 1):
        raise ValueError(f"chunk={chunk} must be a power of two and a multiple of t={t} (strided rows per block)")
    feature_chunk = min(feature_chunk, F)
    if F % feature_chunk:
        raise ValueError(f"feature_chunk={feature_chunk} must divide stride * head_dim = {F}")
    g_pad = next_pow2(G)
    kb = chunk // t
    n_pad = cdiv(n, kb) * kb
    qb = jnp.pad(qb, ((0, 0),) * 3 + ((0, g_pad - G), (0, 0), (0, 0)))
    qb = qb.transpose(1, 2, 0, 3, 4, 5).reshape(B * Hkv, tile, g_pad * t, F)
    ks = jnp.pad(ks, ((0, 0), (0, 0), (0, n_pad * t - m), (0, 0))).reshape(B * Hkv, n_pad * t, F)
    weight = inside.astype(jnp.float32) / jnp.maximum(inside.sum(-1, keepdims=True), 1).astype(jnp.float32)
    weight = weight.transpose(1, 0, 2)  # [B, tile, t]
    bonus = jnp.pad(bonus.astype(jnp.float32), ((0, 0), (0, 0), (0, n_pad - n))).reshape(B * Hkv, n_pad)
    out = pl.pallas_call(
        functools.partial(_route_kernel, t=t, groups=G, chunk=chunk, feature_chunk=feature_chunk, scale=scale,
                          gqa=gqa),
        grid=(B * Hkv, tile),
        in_specs=[pl.BlockSpec((next_pow2(tile),), lambda g, j: (0,)),
                  pl.BlockSpec((None, None, g_pad * t, F), lambda g, j: (g, j, 0, 0)),
                  pl.BlockSpec((None, n_pad * t, F), lambda g, j: (g, 0, 0)),
                  pl.BlockSpec((None, None, t), lambda g, j: (g // Hkv, j, 0)),
                  pl.BlockSpec((None, n_pad), lambda g, j: (g, 0))],
        out_specs=pl.BlockSpec((None, None, n_pad), lambda g, j: (g, j, 0)),
        out_shape=jax.ShapeDtypeStruct((B * Hkv, tile, n_pad), jnp.float32),
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="sparsekv_stem_route",
    )(jnp.pad(qi.astype(jnp.int32), (0, next_pow2(tile) - tile)), qb, ks, weight, bonus)
    return out.reshape(B, Hkv, tile, n_pad)[..., :n]
