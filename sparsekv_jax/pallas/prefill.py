"""Block-sparse causal GQA prefill attention (Pallas / Triton) and its jnp reference.

A chunk of ``T`` queries, starting at cache slot ``q_offset``, attends to the cache
(which already holds the chunk's own keys). Queries and keys are cut into blocks of
``block_size`` slots (absolute slot blocks, so ``q_offset`` must be block aligned); each
query block attends to a *list* of KV blocks (Stem-style patterns), or to every causal
block when no list is given. The diagonal block is masked causally.

Design (why it looks like this):

* **Flash attention, one program per (query tile, row, query head).** The kv head is
  ``h // G`` in the BlockSpec index map, so GQA never materialises repeated K/V; the
  ``G`` programs of a group run next to each other and share K/V through L2.
* **No mask work off the diagonal.** Masking costs an elementwise select per logit, a
  visible fraction of a compute-bound kernel. Listed blocks strictly below the diagonal run
  an unmasked loop; the diagonal block runs afterwards with the causal mask. For sparse
  lists the wrapper moves a listed diagonal to the end of its list (a swap, no sort), so
  the kernel gets "first ``n_off`` entries: unmasked; then maybe the diagonal".
* **Heavy tiles first.** Query tiles late in the sequence have the most causal blocks;
  the grid is walked from the last tile down so the tail of the launch is short tiles.
* **exp2 with the scale folded in**, fp32 running max/sum, bf16 P@V on the tensor cores.
* Rows that see no key (``kv_lengths`` masking everything) get zero output and lse -inf.

``kv_lengths`` masks keys at slots ``>= kv_lengths[b]`` (ragged batches). Slots past the
chunk end or the row's length may hold garbage, even NaN: masked tiles load their V with a
mask (0 instead), since a zero softmax weight times NaN would still poison P @ V.
Backend: Pallas' Triton lowering with explicit compiler params; ``interpret=True`` runs it
on CPU.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sparsekv_jax.pallas._common import LN2, LOG2E, M_INIT, cdiv, fit_stages, triton_params
from sparsekv_jax.pallas.validation import check_prefill_args

__all__ = ["prefill_attention", "prefill_attention_reference", "dense_block_lists", "causal_block_mask"]


def _prefill_kernel(*refs: jax.Array, sparse: bool, has_lengths: bool, window: int | None,
                    block_size: int, block_q: int, block_k: int, n_q_tiles: int, qk_scale: float,
                    return_lse: bool, f32_dot: bool, group: int, chunk_len: int) -> None:
    """One program = one (query tile, row b, query head hq); kv head is ``hq // group``."""
    it = iter(refs)
    q_ref, k_ref, v_ref, off_ref = next(it), next(it), next(it), next(it)
    len_ref = next(it) if has_lengths else None
    ids_ref = noff_ref = diag_ref = None
    if sparse:
        ids_ref, noff_ref, diag_ref = next(it), next(it), next(it)
    o_ref = next(it)
    lse_ref = next(it) if return_lse else None

    qt = n_q_tiles - 1 - pl.program_id(0)  # heavy (late) query tiles first
    b, hq = pl.program_id(1), pl.program_id(2)
    q_per_block = block_size // block_q
    k_per_block = block_size // block_k
    qi = lax.div(qt, q_per_block)  # query block inside the chunk (all operands >= 0)
    q_start = off_ref[0] + qt * block_q  # absolute slot of the tile's first query
    qb = lax.div(q_start, block_size)  # absolute block index of the diagonal KV block
    precision = lax.Precision.HIGHEST if f32_dot else None

    q = q_ref[...]
    q_pos = q_start + jnp.arange(block_q, dtype=jnp.int32)[:, None]
    k_lane = jnp.arange(block_k, dtype=jnp.int32)[None, :]
    k_row = jnp.arange(block_k, dtype=jnp.int32)[:, None]
    chunk_end = off_ref[0] + chunk_len
    kv_len = len_ref[b] if has_lengths else None

    def tile(k_start: jax.Array, carry: Any, *, causal: bool) -> Any:
        acc, m_prev, l_prev = carry
        k_start = pl.multiple_of(k_start, block_k)
        kt = k_ref[pl.ds(k_start, block_k), :]
        k_pos = k_start + k_lane
        if causal or kv_len is not None:
            # Keys past the chunk end / the row's length get weight 0, but 0 * NaN = NaN in
            # P @ V: never read their V (masked load -> 0). Only masked tiles pay for this.
            limit = chunk_end if kv_len is None else jnp.minimum(chunk_end, kv_len)
            v_ok = (k_start + k_row) < limit
            vt = plgpu.load(v_ref.at[pl.ds(k_start, block_k), :], mask=v_ok, other=0.0)
        else:
            vt = v_ref[pl.ds(k_start, block_k), :]
        s = plgpu.dot(q, kt, trans_b=True, precision=precision)  # raw logits, scaled below
        mask = None
        if causal:
            mask = k_pos <= q_pos
        if window is not None:
            w = (q_pos - k_pos) < window
            mask = w if mask is None else mask & w
        if kv_len is not None:
            ln = k_pos < kv_len
            mask = ln if mask is None else mask & ln
        if mask is not None:
            s = jnp.where(mask, s, -jnp.inf)
        # Scale the row max (a [block_q] vector), not the [block_q, block_k] logits: the
        # exponent ``s * c - m`` is then one FMA per logit (qk_scale > 0 keeps the max).
        m_next = jnp.maximum(m_prev, s.max(axis=-1) * qk_scale)
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(s * qk_scale - m_next[:, None])
        l_next = l_prev * alpha + p.sum(axis=-1)
        acc = acc * alpha[:, None] + plgpu.dot(p.astype(vt.dtype), vt, precision=precision)
        return acc, m_next, l_next

    carry = (jnp.zeros((block_q, q_ref.shape[-1]), jnp.float32),
             jnp.full((block_q,), M_INIT, jnp.float32),
             jnp.zeros((block_q,), jnp.float32))

    if sparse:
        n_off = noff_ref[b, hq // group, qi]
        has_diag = diag_ref[b, hq // group, qi]

        def off_body(t: jax.Array, c: Any) -> Any:
            blk = ids_ref[lax.div(t, k_per_block)]
            return tile(blk * block_size + lax.rem(t, k_per_block) * block_k, c, causal=False)

        carry = lax.fori_loop(0, n_off * k_per_block, off_body, carry)
    else:
        lo = 0
        if window is not None:
            lo = lax.div(jnp.maximum(q_start - window + 1, 0), block_size)
        hi = qb
        if kv_len is not None:
            hi = jnp.minimum(hi, lax.div(kv_len + block_size - 1, block_size))
        carry = lax.fori_loop(lo * k_per_block, jnp.maximum(hi, lo) * k_per_block,
                              lambda t, c: tile(t * block_k, c, causal=False), carry)
        has_diag = None

    # The diagonal block: only its sub-tiles at or before the tile's last query matter.
    diag_tiles = lax.div((lax.rem(qt, q_per_block) + 1) * block_q + block_k - 1, block_k)
    if has_diag is not None:
        diag_tiles = diag_tiles * (has_diag > 0).astype(diag_tiles.dtype)
    carry = lax.fori_loop(0, diag_tiles, lambda t, c: tile(qb * block_size + t * block_k, c, causal=True),
                          carry)

    acc, m, l = carry
    safe_l = jnp.where(l > 0, l, 1.0)
    o_ref[...] = jnp.where(l[:, None] > 0, acc / safe_l[:, None], 0.0).astype(o_ref.dtype)
    if lse_ref is not None:
        lse_ref[...] = jnp.where(l > 0, (m + jnp.log2(safe_l)) * LN2, -jnp.inf)


def _diag_last(block_ids: jax.Array, block_counts: jax.Array, q_offset: jax.Array,
               block_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Move a listed diagonal block to the end of its list.

    Returns ``(ids, n_off, has_diag)``: the first ``n_off`` entries are strictly causal
    (no mask needed), and ``has_diag`` says whether the diagonal was listed. O(list) jnp
    work (a compare, an argmax and two swaps), negligible next to the attention.
    """
    nQ, K = block_ids.shape[-2:]
    qb = (q_offset // block_size + jnp.arange(nQ, dtype=jnp.int32))[:, None]  # [nQ, 1]
    live = jnp.arange(K, dtype=jnp.int32) < block_counts[..., None]
    is_diag = live & (block_ids == qb)
    has = is_diag.any(-1)
    pos = jnp.argmax(is_diag, axis=-1)
    last = jnp.maximum(block_counts - 1, 0)
    last_id = jnp.take_along_axis(block_ids, last[..., None], axis=-1)[..., 0]
    lane = jnp.arange(K, dtype=jnp.int32)
    swapped = jnp.where(lane == pos[..., None], last_id[..., None], block_ids)
    ids = jnp.where(has[..., None], swapped, block_ids)
    return ids, block_counts - has.astype(jnp.int32), has.astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=(
    "block_size", "scale", "return_lse", "window", "interpret", "block_q", "block_k", "num_warps",
    "num_stages"))
def _prefill_call(q: jax.Array, k: jax.Array, v: jax.Array, q_offset: jax.Array,
                  block_ids: jax.Array | None, block_counts: jax.Array | None,
                  kv_lengths: jax.Array | None, *, block_size: int, scale: float, return_lse: bool,
                  window: int | None, interpret: bool, block_q: int, block_k: int, num_warps: int,
                  num_stages: int) -> Any:
    B, Hq, T, D = q.shape
    _, Hkv, S, _ = k.shape
    G = Hq // Hkv
    nQ = cdiv(T, block_size)
    T_pad = nQ * block_size
    n_tiles = T_pad // block_q
    if T_pad != T:
        q = jnp.pad(q, ((0, 0), (0, 0), (0, T_pad - T), (0, 0)))
    off = jnp.asarray(q_offset, jnp.int32).reshape(1)

    args = [q, k, v, off]
    last = n_tiles - 1
    in_specs = [
        pl.BlockSpec((None, None, block_q, D), lambda i, b, h: (b, h, last - i, 0)),
        pl.BlockSpec((None, None, S, D), lambda i, b, h: (b, h // G, 0, 0)),
        pl.BlockSpec((None, None, S, D), lambda i, b, h: (b, h // G, 0, 0)),
        pl.BlockSpec((1,), lambda i, b, h: (0,)),
    ]
    if kv_lengths is not None:
        args.append(kv_lengths.astype(jnp.int32))
        in_specs.append(pl.BlockSpec((B,), lambda i, b, h: (0,)))
    sparse = block_ids is not None
    if sparse:
        K = block_ids.shape[-1]
        counts = (jnp.full((B, Hkv, nQ), K, jnp.int32) if block_counts is None
                  else block_counts.astype(jnp.int32))
        ids, n_off, has_diag = _diag_last(block_ids.astype(jnp.int32), counts, off[0], block_size)
        qpb = block_size // block_q
        args += [ids, n_off, has_diag]
        in_specs += [
            pl.BlockSpec((None, None, None, K), lambda i, b, h: (b, h // G, (last - i) // qpb, 0)),
            pl.BlockSpec((B, Hkv, nQ), lambda i, b, h: (0, 0, 0)),
            pl.BlockSpec((B, Hkv, nQ), lambda i, b, h: (0, 0, 0)),
        ]
    out_shape = [jax.ShapeDtypeStruct((B, Hq, T_pad, D), q.dtype)]
    out_specs = [pl.BlockSpec((None, None, block_q, D), lambda i, b, h: (b, h, last - i, 0))]
    if return_lse:
        out_shape.append(jax.ShapeDtypeStruct((B, Hq, T_pad), jnp.float32))
        out_specs.append(pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, last - i)))

    item = q.dtype.itemsize
    num_stages = fit_stages(num_stages, 2 * block_k * D * item, fixed_bytes=block_q * D * item)
    kernel = functools.partial(
        _prefill_kernel, sparse=sparse, has_lengths=kv_lengths is not None, window=window,
        block_size=block_size, block_q=block_q, block_k=block_k, n_q_tiles=n_tiles,
        qk_scale=scale * LOG2E, return_lse=return_lse, f32_dot=q.dtype == jnp.float32, group=G,
        chunk_len=T)
    outs = pl.pallas_call(
        kernel,
        grid=(n_tiles, B, Hq),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="sparsekv_prefill",
    )(*args)
    out = outs[0][:, :, :T]
    if return_lse:
        return out, outs[1][:, :, :T]
    return out


def prefill_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, q_offset: int | jax.Array = 0,
                      block_size: int = 128, block_ids: jax.Array | None = None,
                      block_counts: jax.Array | None = None, kv_lengths: jax.Array | None = None,
                      return_lse: bool = False, sliding_window: int | None = None,
                      scale: float | None = None, interpret: bool = False, block_q: int | None = None,
                      block_k: int | None = None, num_warps: int = 8,
                      num_stages: int = 3) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Causal GQA flash attention where each query block attends to a list of KV blocks.

    Args:
      q: ``[B, Hq, T, D]`` the chunk's queries (bf16/f16/f32).
      k, v: ``[B, Hkv, S, D]`` the cache, already holding the chunk's keys at slots
        ``q_offset .. q_offset+T``; ``S`` a multiple of ``block_size``.
      q_offset: slot of the chunk's first query (Python int or int scalar array; a multiple
        of ``block_size``). Keys at slots ``< q_offset + T`` are causal context.
      block_size: query/KV block granularity of the lists (power of two >= 16).
      block_ids: ``[B, Hkv, nQ, K]`` int, ``nQ = ceil(T / block_size)``: absolute KV block
        indices for each query block, duplicate-free, any order, each ``<=`` the query
        block's own absolute index ``q_offset // block_size + i`` (causality). None = dense.
      block_counts: ``[B, Hkv, nQ]`` valid entries per list (default K). A listed diagonal
        is causally masked; an unlisted diagonal is skipped (the query block then sees only
        its listed past blocks, and a query block with an empty list outputs zeros).
      kv_lengths: ``[B]`` optional, keys at slots ``>= kv_lengths[b]`` are masked.
      return_lse: also return the natural-log log-sum-exp ``[B, Hq, T]`` float32 (-inf for
        queries that saw no key), for merging with other chunks.
      sliding_window: keys with ``q_pos - k_pos >= sliding_window`` are masked (Mistral).
      scale: logit scale, default ``1/sqrt(D)``.
      interpret: run in Pallas interpret mode (CPU tests).
      block_q, block_k: kernel tile sizes dividing block_size (default: `default_tiles`).
      num_warps, num_stages: Triton compiler params.

    Returns:
      ``out [B, Hq, T, D]`` in q's dtype, plus ``lse`` if requested.
    """
    check_prefill_args(q, k, v, q_offset=q_offset, block_size=block_size, block_ids=block_ids,
                       block_counts=block_counts, kv_lengths=kv_lengths, sliding_window=sliding_window)
    bq, bk = default_tiles(block_size, q.shape[-1], jnp.dtype(q.dtype).itemsize)
    block_q = bq if block_q is None else block_q
    block_k = bk if block_k is None else block_k
    for name, t in (("block_q", block_q), ("block_k", block_k)):
        if t < 16 or block_size % t:
            raise ValueError(f"{name}={t} must be >= 16 and divide block_size={block_size}")
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if not scale > 0:
        raise ValueError(f"scale={scale} must be positive")
    if isinstance(q_offset, (int, np.integer)):
        q_offset = np.int32(q_offset)
    return _prefill_call(q, k, v, q_offset, block_ids, block_counts, kv_lengths, block_size=block_size,
                         scale=float(scale), return_lse=return_lse, window=sliding_window,
                         interpret=interpret, block_q=block_q, block_k=block_k, num_warps=num_warps,
                         num_stages=num_stages)


def default_tiles(block_size: int, head_dim: int, itemsize: int = 2) -> tuple[int, int]:
    """Kernel tiles ``(block_q, block_k)`` for a list granularity.

    128x128 at 8 warps / 3 stages was the fastest of an 8-point grid for bf16, D=128 on an
    H200 (experiments/diary/BENCHMARKS_DIARY.md); float32 inputs take smaller tiles so registers and shared
    memory still fit.
    """
    bq, bk = 128, 128
    if itemsize > 2:
        bq, bk = 64, 32
    return min(bq, block_size), min(bk, block_size)


def dense_block_lists(batch: int, kv_heads: int, T: int, block_size: int,
                      q_offset: int = 0) -> tuple[jax.Array, jax.Array]:
    """Block lists equivalent to dense causal attention (every block ``<=`` the diagonal)."""
    nQ = cdiv(T, block_size)
    qb0 = q_offset // block_size
    K = qb0 + nQ
    ids = np.broadcast_to(np.arange(K, dtype=np.int32), (batch, kv_heads, nQ, K))
    counts = np.broadcast_to(qb0 + np.arange(nQ, dtype=np.int32) + 1, (batch, kv_heads, nQ))
    return jnp.asarray(ids), jnp.asarray(counts)


def causal_block_mask(T: int, S: int, *, q_offset: int | jax.Array, block_size: int,
                      block_ids: jax.Array | None, block_counts: jax.Array | None,
                      kv_lengths: jax.Array | None, sliding_window: int | None, batch: int,
                      kv_heads: int) -> jax.Array:
    """``[B, Hkv, T, S]`` bool: which (query, key) pairs `prefill_attention` lets through."""
    q_pos = q_offset + jnp.arange(T)[:, None]
    k_pos = jnp.arange(S)[None, :]
    allowed = jnp.broadcast_to(k_pos <= q_pos, (batch, kv_heads, T, S))
    if sliding_window is not None:
        allowed = allowed & ((q_pos - k_pos) < sliding_window)
    if kv_lengths is not None:
        allowed = allowed & (k_pos < kv_lengths[:, None, None, None])
    if block_ids is not None:
        nQ, K = block_ids.shape[-2:]
        nK = S // block_size
        counts = jnp.full(block_ids.shape[:-1], K) if block_counts is None else block_counts
        live = jnp.arange(K) < counts[..., None]
        tgt = jnp.where(live, block_ids, nK)
        sel = jnp.zeros((batch, kv_heads, nQ, nK), bool)
        bi, hi, qi = jnp.meshgrid(jnp.arange(batch), jnp.arange(kv_heads), jnp.arange(nQ), indexing="ij")
        sel = sel.at[bi[..., None], hi[..., None], qi[..., None], tgt].set(True, mode="drop")
        sel = jnp.repeat(jnp.repeat(sel, block_size, axis=2)[:, :, :T], block_size, axis=3)
        allowed = allowed & sel
    return allowed


def prefill_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *,
                                q_offset: int | jax.Array = 0, block_size: int = 128,
                                block_ids: jax.Array | None = None, block_counts: jax.Array | None = None,
                                kv_lengths: jax.Array | None = None, return_lse: bool = False,
                                sliding_window: int | None = None,
                                scale: float | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """jnp reference: materialised masked softmax in float32 (HIGHEST precision)."""
    B, Hq, T, D = q.shape
    _, Hkv, S, _ = k.shape
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    allowed = causal_block_mask(T, S, q_offset=q_offset, block_size=block_size, block_ids=block_ids,
                                block_counts=block_counts, kv_lengths=kv_lengths,
                                sliding_window=sliding_window, batch=B, kv_heads=Hkv)
    hp = lax.Precision.HIGHEST
    # Keys no query may see (past the chunk, past the row's length) are zeroed, so garbage
    # stored there cannot turn into NaN through 0 * NaN.
    seen = allowed.any(axis=2)[..., None]  # [B, Hkv, S, 1]
    kf = jnp.where(seen, k.astype(jnp.float32), 0.0)
    vf = jnp.where(seen, v.astype(jnp.float32), 0.0)
    qf = q.astype(jnp.float32).reshape(B, Hkv, G, T, D)
    logits = jnp.einsum("bhgtd,bhsd->bhgts", qf, kf, precision=hp) * scale
    logits = jnp.where(allowed[:, :, None], logits, -jnp.inf)
    m = logits.max(-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(logits - m)
    l = p.sum(-1, keepdims=True)
    out = jnp.einsum("bhgts,bhsd->bhgtd", p, vf, precision=hp)
    out = (out / jnp.where(l > 0, l, 1.0)).reshape(B, Hq, T, D).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(l[..., 0] > 0, m[..., 0] + jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)), -jnp.inf)
    return out, lse.reshape(B, Hq, T)
