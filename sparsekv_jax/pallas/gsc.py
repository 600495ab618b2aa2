"""Greedy seed-based clustering (SemantiCache's Algorithm 1) as a Pallas / Triton kernel.

The jnp reference is `sparsekv_jax.policies.clustering.greedy_seed_clustering` (same arguments, same
result, exactly: both compare the same fp32 cosines with the same thresholds).

Why a kernel: the reference runs Algorithm 1 seed place by seed place (a loop of up to
``width`` = 64 steps), and every step gathers each slot's cosine to its candidate seed and that
seed's status across the whole ``[K, B, H, T]`` state. On an H200 at Llama-3.1-8B's shapes and a 32k
prompt, the budget search (2 passes x 16 thresholds x 3 chunk layouts, 32 layers) took 23% of the
prefill that way (experiments/diary/BENCHMARKS_DIARY.md); the issue's target is 10%.

The kernel reads Algorithm 1 as a scan over slots. A member ``t`` joins the *earliest* seed of its
chunk whose cosine with it exceeds ``tau`` (seeds absorb in order, and an absorbed slot is never
absorbed again); a member that joins none is a seed itself. So walking the slots in order, ``t``
only needs the seed flags of the ``place[t]`` slots before it in its chunk, at most ``width - 1``:
a ring of ``width`` flags per threshold, indexed by slot mod ``width``, is the scan's whole state
(``[K, width]`` in registers). One program scans one tile of slots of one (row, KV head, layout)
for all ``K`` thresholds, starting ``width`` slots early: a chunk is at most ``width`` long, so every
chunk that reaches into the tile starts inside that lead-in, and the ring is exact from its start
(slots of other chunks are masked out by ``place``). Per slot it reads the slot's ``width`` cosines
once (shared by the ``K`` thresholds) and its place; nothing of size ``K x T`` but the output is
touched.

``width`` must be a power of two (Triton block shapes), at most 128 (the int8 distances).
Backend: Pallas' Triton lowering; ``interpret=True`` runs the same kernel on CPU for tests.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from sparsekv_jax.pallas._common import cdiv, is_pow2, next_pow2, triton_params

__all__ = ["gsc_kernel_applies", "greedy_seed_clustering_kernel"]


def gsc_kernel_applies(width: int) -> bool:
    """Whether the kernel takes bands of ``width`` cosines (a power of two, 2 to 128)."""
    return is_pow2(width) and 2 <= width <= 128


def _gsc_kernel(taus_ref, place_ref, band_ref, back_ref, *, tile: int, width: int, length: int):
    i = pl.program_id(1)
    start = i * tile
    taus = taus_ref[...]  # [K]
    ring_slot = jnp.arange(width, dtype=jnp.int32)

    def step(t, ring, write: bool):
        p = place_ref[t]  # this slot's place in its chunk (-1: not a cluster member)
        offs = (t - ring_slot) & (width - 1)  # how far back the slot held in each ring entry sits
        cos = band_ref[t, offs]  # [W]: cos(k_t, k_{t - offs}), as the band stores it
        cand = (ring != 0) & ((offs >= 1) & (offs <= p))[None, :] & (cos[None, :] > taus[:, None])  # [K, W]
        back = jnp.max(jnp.where(cand, offs[None, :], 0), axis=1)  # the earliest seed that takes t
        seed = jnp.where((p >= 0) & (back == 0), 1, 0).astype(jnp.int32)  # [K]
        ring = jnp.where(ring_slot[None, :] == (t & (width - 1)), seed[:, None], ring)
        if write:
            back_ref[:, t - start] = back.astype(back_ref.dtype)
        return ring

    ring = jnp.zeros((taus.shape[0], width), jnp.int32)
    ring = lax.fori_loop(jnp.maximum(start - width, 0), start, lambda t, r: step(t, r, False), ring)
    lax.fori_loop(start, jnp.minimum(start + tile, length), lambda t, r: step(t, r, True), ring)


@functools.partial(jax.jit, static_argnames=("tile", "num_warps", "interpret"))
def greedy_seed_clustering_kernel(band: jax.Array, member: jax.Array, place: jax.Array, taus: jax.Array, *,
                                  tile: int = 512, num_warps: int = 1, interpret: bool = False) -> jax.Array:
    """`clustering.greedy_seed_clustering` with a layouts axis, on the kernel: ``[N, K, B, H, T]`` int8
    distances back to each member's seed (0 for seeds and non-members).

    ``band`` ``[B, H, T, W]`` fp32 (`clustering.similarity_band`, shared by the layouts),
    ``member``/``place`` ``[N, B, T]`` (N chunk layouts, `clustering.chunk_layout`), ``taus``
    ``[N, K, B, H]``. One program per (layout, row, head, tile of ``tile`` slots). Defaults: the fastest
    of tiles 128-1,024 x 1/2/4 warps on an H100 at Llama-3.1-8B's shapes (`experiments/gsc_gpu.py`).
    """
    B, H, T, W = band.shape
    N, K = taus.shape[:2]
    if member.shape != (N, B, T) or place.shape != (N, B, T) or taus.shape != (N, K, B, H):
        raise ValueError(f"need band [B, H, T, W], member/place [N, B, T], taus [N, K, B, H]; got band "
                         f"{tuple(band.shape)}, member {tuple(member.shape)}, place {tuple(place.shape)}, taus "
                         f"{tuple(taus.shape)}")
    if not gsc_kernel_applies(W):
        raise ValueError(f"the GSC kernel needs a power-of-two band width in [2, 128]; got {W}")
    if not is_pow2(tile):
        raise ValueError(f"tile={tile} must be a power of two")
    k_pad = next_pow2(K)
    n_tiles = cdiv(T, tile)
    t_pad = n_tiles * tile
    # non-members carry place -1, so the padding slots are inert
    place = jnp.where(member, place, -1).astype(jnp.int32)
    place = jnp.pad(place, ((0, 0), (0, 0), (0, t_pad - T)), constant_values=-1)
    band = jnp.pad(band.astype(jnp.float32), ((0, 0), (0, 0), (0, t_pad - T), (0, 0)))
    # padded thresholds (above every cosine) are never read back
    taus = jnp.pad(taus.astype(jnp.float32), ((0, 0), (0, k_pad - K), (0, 0), (0, 0)), constant_values=2.0)
    taus = taus.transpose(0, 2, 3, 1).reshape(N * B * H, k_pad)  # [(n, b, h), K]
    dtype = jnp.int8  # distances < W <= 128

    def row(g):  # flattened (layout, row, head) -> (layout, row)
        return g // (B * H), (g // H) % B

    out = pl.pallas_call(
        functools.partial(_gsc_kernel, tile=tile, width=W, length=T),
        grid=(N * B * H, n_tiles),
        in_specs=[pl.BlockSpec((None, k_pad), lambda g, i: (g, 0)),
                  pl.BlockSpec((None, None, t_pad), lambda g, i: (*row(g), 0)),
                  pl.BlockSpec((None, None, t_pad, W), lambda g, i: ((g // H) % B, g % H, 0, 0))],
        out_specs=pl.BlockSpec((None, k_pad, tile), lambda g, i: (g, 0, i)),
        out_shape=jax.ShapeDtypeStruct((N * B * H, k_pad, t_pad), dtype),
        compiler_params=triton_params(num_warps, 1),
        interpret=interpret,
        name="sparsekv_greedy_seed_clustering",
    )(taus, place, band)
    return out.reshape(N, B, H, k_pad, t_pad)[:, :, :, :K, :T].transpose(0, 3, 1, 2, 4)
