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

Page pool (``page_table=``, issue 38, docs/PAGE_POOL.md): the keys are one pool of head-free pages
``[N, ps, D]`` for every layer, each (row, head) has a page table ``[M]`` of pool pages and its own
length, and ``out[b, h, m] = sum_j R(-j) · pool[table[b, h, m], j]`` over the slots ``m·ps + j`` below
the head's length: a page past the length, or one the table does not map (the sentinel ``N``), gives
zero, as an unheld page. The same loop (`_turn_back_and_sum`), a program's ``block_p`` pages gathered
through the table (one int load per page) from the whole pool ``[N·ps, D]`` (a free reshape). A separate
kernel and ``jit`` (`_call_pool`): the uniform call traces exactly as before. Not yet timed on a GPU.
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
from sparsekv_jax.pallas.validation import check_pool_table, is_concrete

__all__ = ["rope_page_sums", "rope_page_sums_reference", "slot_rotations"]


def slot_rotations(page_size: int, inv_freq) -> tuple[jax.Array, jax.Array]:
    """``cos, sin`` ``[page_size, D/2]`` fp32 of the angles ``j · inv_freq`` (computed in float64)."""
    angle = np.arange(page_size)[:, None] * np.asarray(inv_freq, np.float64)[None]
    return jnp.asarray(np.cos(angle), jnp.float32), jnp.asarray(np.sin(angle), jnp.float32)


def _turn_back_and_sum(k_ref, cos_ref, sin_ref, o_ref, lo, hi, locate, *, page_size: int, block_p: int) -> None:
    """The loop both kernels run over the ``page_size`` slots of this program's ``block_p`` pages:
    ``locate(j)`` gives the index of slot ``j``'s key rows in ``k_ref`` (all but the last axis, each
    ``[block_p, 1]`` or broadcasting to it) and where they are valid; the two halves ``lo``/``hi``
    ``[1, D/2]`` of each row are loaded (zero where not valid), turned by ``-j``, summed in fp32 and
    stored in ``o_ref`` ``[block_p, D]``."""

    def body(j, acc):
        acc1, acc2 = acc
        at, valid = locate(j)
        k1 = plgpu.load(k_ref.at[(*at, lo)], mask=valid, other=0.0).astype(jnp.float32)  # [block_p, D/2]
        k2 = plgpu.load(k_ref.at[(*at, hi)], mask=valid, other=0.0).astype(jnp.float32)
        row = jnp.full((1, 1), j, jnp.int32)
        c = plgpu.load(cos_ref.at[row, lo])  # [1, D/2]
        s = plgpu.load(sin_ref.at[row, lo])
        return acc1 + k1 * c + k2 * s, acc2 + k2 * c - k1 * s

    zeros = jnp.zeros((block_p, cos_ref.shape[-1]), jnp.float32)
    acc1, acc2 = lax.fori_loop(0, page_size, body, (zeros, zeros))
    rows = jnp.arange(block_p, dtype=jnp.int32)[:, None]
    plgpu.store(o_ref.at[rows, lo], acc1)
    plgpu.store(o_ref.at[rows, hi], acc2)


def _kernel(k_ref, cos_ref, sin_ref, layer_ref, o_ref, *, page_size: int, block_p: int, S: int) -> None:
    pb = pl.program_id(2)
    # broadcasting int arrays for every index (interpret mode only discharges all-array gathers)
    layer = jnp.full((1, 1), layer_ref[0], jnp.int32)
    half = cos_ref.shape[-1]
    lo = jnp.arange(half, dtype=jnp.int32)[None, :]
    hi = lo + half
    first = (pb * block_p + jnp.arange(block_p, dtype=jnp.int32)[:, None]) * page_size  # [block_p, 1]

    def locate(j):
        slot = first + j
        valid = slot < S
        return (layer, jnp.where(valid, slot, 0)), valid

    _turn_back_and_sum(k_ref, cos_ref, sin_ref, o_ref, lo, hi, locate, page_size=page_size, block_p=block_p)


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
    """The whole array as every program's block."""
    return pl.BlockSpec(shape, lambda b, h, p: (0,) * len(shape))


def _page_sums_call(kernel, in_specs: list, args: tuple, *, B: int, H: int, D: int, pages: int, block_p: int,
                    itemsize: int, interpret: bool, num_warps: int, num_stages: int, name: str) -> jax.Array:
    """Both modes' ``pallas_call``: grid ``(B, H, ⌈pages / block_p⌉)``, each program's ``[block_p, D]``
    fp32 block of the output ``[B, H, pages, D]`` (the padding past ``pages`` cut off)."""
    n_blocks = cdiv(pages, block_p)
    out = pl.pallas_call(
        kernel,
        grid=(B, H, n_blocks),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((None, None, block_p, D), lambda b, h, p: (b, h, p, 0)),
        out_shape=jax.ShapeDtypeStruct((B, H, n_blocks * block_p, D), jnp.float32),
        compiler_params=triton_params(num_warps, fit_stages(num_stages, block_p * D * itemsize)),
        interpret=interpret,
        name=name,
    )(*args)
    return out[:, :, :pages]


@functools.partial(jax.jit, static_argnames=("page_size", "block_p", "interpret", "num_warps", "num_stages"))
def _call(k, cos, sin, layer, *, page_size, block_p, interpret, num_warps, num_stages):
    L, B, H, S, D = k.shape
    kernel = functools.partial(_kernel, page_size=page_size, block_p=block_p, S=S)
    # the block holds this (row, head) of every layer; the kernel picks the layer
    in_specs = [pl.BlockSpec((L, None, None, S, D), lambda b, h, p: (0, b, h, 0, 0)),
                _whole(cos.shape), _whole(sin.shape), _whole((1,))]
    return _page_sums_call(kernel, in_specs, (k, cos, sin, jnp.reshape(layer, (1,)).astype(jnp.int32)), B=B, H=H,
                           D=D, pages=cdiv(S, page_size), block_p=block_p, itemsize=k.dtype.itemsize,
                           interpret=interpret, num_warps=num_warps, num_stages=num_stages,
                           name="sparsekv_rope_page_sums")


def _pool_kernel(k_ref, cos_ref, sin_ref, len_ref, table_ref, o_ref, *, page_size: int, block_p: int) -> None:
    """`_kernel` over the pool: ``k_ref`` ``[N·ps, D]`` (every pool page), ``table_ref`` ``[M]`` this
    (row, head)'s page table, ``len_ref`` ``[B, H]`` the heads' lengths. A slot is read where its
    logical page is mapped to a pool page in ``[0, N)`` and it lies below the head's length; nothing
    else is (unchecked under jit: a sentinel or stray entry, a length past ``M·ps``, reads nothing)."""
    b, h, pb = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    length = len_ref[b, h]
    n_pool = k_ref.shape[0] // page_size  # N, also the table's "no page" sentinel
    M = table_ref.shape[0]
    half = cos_ref.shape[-1]
    lo = jnp.arange(half, dtype=jnp.int32)[None, :]
    hi = lo + half
    lpage = pb * block_p + jnp.arange(block_p, dtype=jnp.int32)[:, None]  # [block_p, 1] logical pages
    in_table = lpage < M
    phys = plgpu.load(table_ref.at[jnp.where(in_table, lpage, 0)], mask=in_table, other=n_pool)
    mapped = in_table & (phys >= 0) & (phys < n_pool)
    first = phys * page_size  # [block_p, 1] the pool slot of each page's slot 0
    logical = lpage * page_size

    def locate(j):
        valid = mapped & (logical + j < length)
        return (jnp.where(valid, first + j, 0),), valid

    _turn_back_and_sum(k_ref, cos_ref, sin_ref, o_ref, lo, hi, locate, page_size=page_size, block_p=block_p)


@functools.partial(jax.jit, static_argnames=("page_size", "block_p", "interpret", "num_warps", "num_stages"))
def _call_pool(k, cos, sin, lengths, page_table, *, page_size, block_p, interpret, num_warps, num_stages):
    N, ps, D = k.shape
    B, H, M = page_table.shape
    kernel = functools.partial(_pool_kernel, page_size=page_size, block_p=block_p)
    # the block is the whole pool (a head's pages lie anywhere in it) and this (row, head)'s table
    in_specs = [_whole((N * ps, D)), _whole(cos.shape), _whole(sin.shape), _whole((B, H)),
                pl.BlockSpec((None, None, M), lambda b, h, p: (b, h, 0))]
    args = (k.reshape(N * ps, D), cos, sin, lengths.astype(jnp.int32), page_table.astype(jnp.int32))
    return _page_sums_call(kernel, in_specs, args, B=B, H=H, D=D, pages=M, block_p=block_p,
                           itemsize=k.dtype.itemsize, interpret=interpret, num_warps=num_warps,
                           num_stages=num_stages, name="sparsekv_rope_page_sums_pool")


def _check_pool(k: jax.Array, inv_freq, layer, page_size: int, page_table, lengths) -> None:
    """Pool-mode checks (``ValueError``, before jit): shapes and dtypes always; with concrete values,
    lengths in ``[0, M·ps]`` and every table entry a head's length reaches a pool page in ``[0, N)``."""
    if layer is not None:
        raise ValueError("layer= indexes a stacked uniform cache; with page_table the pool holds every layer: "
                         "pass that layer's tables and lengths (table[l], length[l]) instead")
    if lengths is None:
        raise ValueError("with page_table, lengths [B, H] (each head's tokens) are needed")
    if k.ndim != 3:
        raise ValueError(f"with page_table, k must be a pool [N, page_size, D], got shape {tuple(k.shape)}")
    N, ps, D = k.shape
    if not isinstance(page_size, (int, np.integer)) or page_size < 1:
        raise ValueError(f"page_size={page_size} must be a positive int")
    if ps != page_size:
        raise ValueError(f"pool pages hold {ps} tokens (k.shape[1]) but page_size={page_size}")
    if N < 1:
        raise ValueError("the pool must hold at least one page")
    if N * ps >= 2**31:
        raise ValueError(f"a pool of N={N} pages of {ps} slots has more slots than an int32 index reaches")
    if not jnp.issubdtype(k.dtype, jnp.floating):
        raise ValueError(f"k must be floating point, got {k.dtype}")
    if 2 * len(inv_freq) != D:
        raise ValueError(f"inv_freq has {len(inv_freq)} frequencies, expected head_dim/2 = {D // 2}")
    tshape = tuple(np.shape(page_table))
    if len(tshape) != 3 or tshape[2] < 1 or not jnp.issubdtype(jnp.result_type(page_table), jnp.integer):
        raise ValueError(f"page_table must be an int array [B, H, M>=1], got {jnp.result_type(page_table)} "
                         f"of shape {tshape}")
    B, H, _ = tshape
    if tuple(np.shape(lengths)) != (B, H) or not jnp.issubdtype(jnp.result_type(lengths), jnp.integer):
        raise ValueError(f"with page_table, lengths must be an int array [B, H]=[{B}, {H}] (one per head), got "
                         f"{jnp.result_type(lengths)} of shape {tuple(np.shape(lengths))}")
    check_pool_table(page_table, lengths, num_pages=N, page_size=ps)


def _check(k: jax.Array, inv_freq, layer: int | jax.Array | None, page_size: int, lengths, *, fn: str) -> None:
    """Uniform-mode checks (``ValueError``, before jit) of `fn`'s arguments: no ``lengths``, a ``layer``
    (in range where concrete) of a stack ``[L, B, H, S, D]``, ``D/2`` frequencies, a positive page size."""
    if lengths is not None:
        raise ValueError("lengths= is for pool mode (with page_table); the uniform stack sums whole pages")
    if layer is None:
        raise ValueError(f"{fn} needs layer= (a stacked cache) or page_table= and lengths= (a pool)")
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


def rope_page_sums(k: jax.Array, inv_freq, layer: int | jax.Array | None = None, *, page_size: int,
                   page_table: jax.Array | None = None, lengths: jax.Array | None = None, block_p: int = 32,
                   interpret: bool = False, num_warps: int = 8, num_stages: int = 3) -> jax.Array:
    """``[B, H, P, D]`` fp32: each page of layer ``layer``'s keys, slot ``j`` turned by ``-j``, summed.

    Args:
      k: ``[L, B, H, S, D]`` stacked keys (bf16/f16/f32); ``D/2`` a power of two. Pool mode: the pool
        ``[N, page_size, D]`` as stored (every layer's pages).
      inv_freq: the model's ``D/2`` RoPE inverse frequencies (static: numpy or a list).
      layer: int scalar, may be traced (uniform stack only; refused with ``page_table``: the caller
        passes the layer's tables and lengths instead).
      page_size: slots per page; ``P = ⌈S / page_size⌉`` (a last partial page sums its slots).
      page_table: pool mode: ``[B, H, M]`` int, the pool page holding each logical page of a
        (row, head) -- one layer's tables, ``table[l]`` of the pool. Entries a head's length
        reaches must lie in ``[0, N)``; the rest may be the sentinel ``N`` or anything: never read.
      lengths: pool mode: ``[B, H]`` int, each head's tokens, in ``[0, M·page_size]``.
      block_p: pages per program (a power of two >= 16).
      interpret: Pallas interpret mode (CPU tests).
      num_warps, num_stages: Triton compiler params.

    Returns:
      ``[B, H, P, D]`` float32; pool mode ``[B, H, M, D]`` at *logical* pages: page ``m`` sums the
      slots ``m·ps + j`` below the head's length (a partial last page its slots, a page at or past the
      length, or unmapped, exactly zero). Under ``jit`` (no value checks) an entry outside ``[0, N)``
      or a length past ``M·ps`` reads nothing rather than another page.

    Raises:
      ValueError: bad shapes, dtypes, ``layer``, ``block_p``; with concrete values, ``layer`` out of
        range, lengths out of range, a table entry a length reaches outside the pool.
    """
    if page_table is not None:
        _check_pool(k, inv_freq, layer, page_size, page_table, lengths)
        _check_kernel_sizes(k.shape[-1], block_p)
        cos, sin = slot_rotations(page_size, inv_freq)
        return _call_pool(k, cos, sin, jnp.asarray(lengths), jnp.asarray(page_table), page_size=int(page_size),
                          block_p=block_p, interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    _check(k, inv_freq, layer, page_size, lengths, fn="rope_page_sums")
    _check_kernel_sizes(k.shape[-1], block_p)
    cos, sin = slot_rotations(page_size, inv_freq)
    return _call(k, cos, sin, jnp.asarray(layer, jnp.int32), page_size=page_size, block_p=block_p,
                 interpret=interpret, num_warps=num_warps, num_stages=num_stages)


def _check_kernel_sizes(head_dim: int, block_p: int) -> None:
    half = head_dim // 2
    if half & (half - 1):
        raise ValueError(f"head_dim={head_dim}: the kernel needs head_dim/2 a power of two")
    if block_p < 16 or block_p & (block_p - 1):
        raise ValueError(f"block_p={block_p} must be a power of two >= 16")


def rope_page_sums_reference(k: jax.Array, inv_freq, layer: int | jax.Array | None = None, *, page_size: int,
                             page_table: jax.Array | None = None, lengths: jax.Array | None = None) -> jax.Array:
    """jnp reference (slices the layer, pads a partial last page), fp32.

    Pool mode (``page_table``, ``lengths``, shapes as `rope_page_sums`): each head's logical pages are
    gathered out of the pool (``k[page_table]``, ``mode="fill"``), and slots at or past the head's
    length or on an unmapped page are zeroed (selected away: they may hold anything, NaN included)."""
    if page_table is not None:
        _check_pool(k, inv_freq, layer, page_size, page_table, lengths)
        N, ps, D = k.shape
        B, H, M = page_table.shape
        kp = k.at[page_table].get(mode="fill", fill_value=0)  # [B, H, M, ps, D]
        mapped = (page_table >= 0) & (page_table < N)
        inside = jnp.arange(M * ps).reshape(M, ps) < jnp.asarray(lengths)[..., None, None]  # [B, H, M, ps]
        kp = jnp.where((mapped[..., None] & inside)[..., None], kp.astype(jnp.float32), 0.0)
        k1, k2 = jnp.split(kp, 2, axis=-1)
    else:
        _check(k, inv_freq, layer, page_size, lengths, fn="rope_page_sums_reference")
        kl = lax.dynamic_index_in_dim(k, layer, keepdims=False)  # [B, H, S, D]
        B, H, S, D = kl.shape
        P = cdiv(S, page_size)
        if P * page_size != S:
            kl = jnp.pad(kl, ((0, 0), (0, 0), (0, P * page_size - S), (0, 0)))
        k1, k2 = jnp.split(kl.reshape(B, H, P, page_size, D).astype(jnp.float32), 2, axis=-1)
    cos, sin = slot_rotations(page_size, inv_freq)  # [ps, D/2], broadcast over pages
    return jnp.concatenate([(k1 * cos + k2 * sin).sum(3), (k2 * cos - k1 * sin).sum(3)], axis=-1)
