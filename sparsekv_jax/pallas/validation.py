"""Argument validation for the Pallas kernels, run at the Python boundary before ``jit``.

Why here and not in the kernels: inside ``jit`` a bad page id becomes an out-of-bounds
gather that silently reads another row's keys (Triton does not bounds-check), and a bad
shape becomes an opaque lowering error. So every public kernel entry point calls one of the
``check_*`` functions first. Shape and dtype checks always run; value checks (ids in range,
counts within the list, causality, duplicates) need concrete arrays and are skipped for
tracers, i.e. when the kernel is called from inside someone else's ``jit`` -- the caller
(policy code) is then responsible, and validates its own outputs at construction.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.pallas._common import cdiv, is_pow2


def is_concrete(*xs: Any) -> bool:
    """True when no argument is a JAX tracer (None counts as concrete)."""
    return not any(isinstance(x, jax.core.Tracer) for x in xs if x is not None)


def _shape(x: Any) -> tuple[int, ...]:
    return tuple(np.shape(x))


def _dtype(x: Any) -> np.dtype:
    return jnp.result_type(x)


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_float(name: str, x: Any) -> None:
    _require(jnp.issubdtype(_dtype(x), jnp.floating), f"{name} must be floating point, got {_dtype(x)}")


def _check_int(name: str, x: Any) -> None:
    _require(jnp.issubdtype(_dtype(x), jnp.integer), f"{name} must be an integer array, got {_dtype(x)}")


def _check_qkv_dtypes(q: Any, k: Any, v: Any, D: int) -> None:
    """q, k, v floating point and of one dtype; ``D`` a power of two >= 16."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_float(name, x)
    _require(_dtype(q) == _dtype(k) == _dtype(v),
             f"q, k, v must share a dtype, got {_dtype(q)}, {_dtype(k)}, {_dtype(v)}")
    _require(is_pow2(D) and D >= 16, f"head_dim {D} must be a power of two >= 16 (Triton dot tiles)")


def _check_qkv(q: Any, k: Any, v: Any, q_rank: int) -> tuple[int, int, int, int, int]:
    """Shared q/k/v checks; returns (B, Hq, Hkv, S, D)."""
    _require(len(_shape(q)) == q_rank, f"q must have rank {q_rank}, got shape {_shape(q)}")
    _require(len(_shape(k)) == 4, f"k must be [B, Hkv, S, D], got shape {_shape(k)}")
    _require(_shape(v) == _shape(k), f"v shape {_shape(v)} != k shape {_shape(k)}")
    B, Hkv, S, D = _shape(k)
    qs = _shape(q)
    _require(qs[0] == B, f"q batch {qs[0]} != k batch {B}")
    _require(qs[-1] == D, f"q head_dim {qs[-1]} != k head_dim {D}")
    Hq = qs[1]
    _require(Hkv > 0 and Hq % Hkv == 0, f"query heads {Hq} must be a multiple of kv heads {Hkv}")
    _check_qkv_dtypes(q, k, v, D)
    return B, Hq, Hkv, S, D


def check_index_lists(ids: Any, counts: Any, *, upper: int, name: str,
                      causal_limit: np.ndarray | None = None) -> None:
    """Value checks on a ``[..., K]`` index list with ``[...]`` valid-entry counts.

    Entries ``[:count]`` must lie in ``[0, upper)``, be duplicate-free, and (when
    ``causal_limit`` is given, broadcastable to ``ids.shape[:-1]``) be ``<= causal_limit``.
    Entries past ``count`` are ignored (padding).
    """
    ids_np = np.asarray(ids).astype(np.int64)
    cnt_np = np.asarray(counts).astype(np.int64)
    K = ids_np.shape[-1]
    if cnt_np.size and (cnt_np.min() < 0 or cnt_np.max() > K):
        raise ValueError(f"{name} counts must lie in [0, {K}] (the list length); "
                         f"got min {cnt_np.min()}, max {cnt_np.max()}")
    live = np.arange(K) < cnt_np[..., None]
    if not live.any():
        return
    vals = ids_np[live]
    if vals.min() < 0 or vals.max() >= upper:
        raise ValueError(f"{name} ids must lie in [0, {upper}); got min {vals.min()}, max {vals.max()}")
    if causal_limit is not None:
        lim = np.broadcast_to(np.asarray(causal_limit), ids_np.shape[:-1])[..., None]
        bad = live & (ids_np > lim)
        if bad.any():
            where = tuple(int(i[0]) for i in np.nonzero(bad))
            raise ValueError(f"{name} breaks causality: a KV block after its query block at index "
                             f"{where} (id {ids_np[where]} > {np.broadcast_to(lim, ids_np.shape)[where]})")
    # Duplicates: sort each list with dead entries pushed to distinct sentinels.
    sentinel = upper + np.arange(K)
    keyed = np.sort(np.where(live, ids_np, sentinel), axis=-1)
    if K > 1 and (np.diff(keyed, axis=-1) == 0).any():
        raise ValueError(f"{name} lists must be duplicate-free within their counts")


def _check_page_list_shapes(page_ids: Any, page_counts: Any, B: int, Hkv: int) -> None:
    """Shapes and dtypes of the decode kernel's page lists ``[B, Hkv, K]`` and counts ``[B, Hkv]``."""
    if page_counts is not None and page_ids is None:
        raise ValueError("page_counts given without page_ids")
    if page_ids is not None:
        ids_shape = _shape(page_ids)
        _require(len(ids_shape) == 3 and ids_shape[:2] == (B, Hkv) and ids_shape[2] >= 1,
                 f"page_ids must be [B, Hkv, K]=[{B}, {Hkv}, K>=1], got {ids_shape}")
        _check_int("page_ids", page_ids)
        if page_counts is not None:
            _require(_shape(page_counts) == (B, Hkv),
                     f"page_counts must be [B, Hkv]=[{B}, {Hkv}], got {_shape(page_counts)}")
            _check_int("page_counts", page_counts)


def _check_page_list_values(page_ids: Any, page_counts: Any, *, upper: int) -> None:
    """With concrete lists (and counts), `check_index_lists` on them, ids in ``[0, upper)``; no counts: all ``K``."""
    if page_ids is not None and is_concrete(page_ids, page_counts):
        ids_shape = _shape(page_ids)
        counts = page_counts if page_counts is not None else np.full(ids_shape[:2], ids_shape[2], np.int64)
        check_index_lists(page_ids, counts, upper=upper, name="page_ids")


def check_decode_args(q: Any, k: Any, v: Any, lengths: Any, *, page_size: int, page_ids: Any,
                      page_counts: Any, bias: Any) -> None:
    """Validate `decode_attention` arguments (raises ValueError)."""
    B, Hq, Hkv, S, D = _check_qkv(q, k, v, q_rank=3)
    _require(isinstance(page_size, int) and is_pow2(page_size),
             f"page_size={page_size} must be a positive power of two")
    _require(S % page_size == 0, f"cache length S={S} must be a multiple of page_size={page_size}")
    P = S // page_size
    _require(_shape(lengths) == (B,), f"lengths must be [B]=[{B}], got {_shape(lengths)}")
    _check_int("lengths", lengths)
    _check_page_list_shapes(page_ids, page_counts, B, Hkv)
    if bias is not None:
        _require(_shape(bias) == (B, Hkv, S), f"bias must be [B, Hkv, S]=[{B}, {Hkv}, {S}], got {_shape(bias)}")
        _check_float("bias", bias)
    if is_concrete(lengths):
        ln = np.asarray(lengths)
        if ln.size and (ln.min() < 0 or ln.max() > S):
            raise ValueError(f"lengths must lie in [0, S={S}], got min {ln.min()}, max {ln.max()}")
    _check_page_list_values(page_ids, page_counts, upper=P)


def check_pool_table(page_table: Any, lengths: Any, *, num_pages: int, page_size: int, head: str = "head") -> None:
    """Value checks of a page pool's tables (raises ValueError; a no-op for tracers).

    ``page_table`` ``[B, H, M]`` and ``lengths`` ``[B, H]``, their shapes and dtypes already checked.
    With concrete lengths: each in ``[0, M·page_size]``; with a concrete table too: every entry a
    head's length reaches (logical pages below ``ceil(length / page_size)``) a pool page in
    ``[0, num_pages)``. The first bad entry is named by its index, value and the length that reaches
    it; ``head`` is what the middle axis is called there ("kv head" for the decode kernel).
    """
    if not is_concrete(lengths):
        return
    M = _shape(page_table)[2]
    ln = np.asarray(lengths).astype(np.int64)
    if ln.size and (ln.min() < 0 or ln.max() > M * page_size):
        raise ValueError(f"lengths must lie in [0, M*page_size={M * page_size}] (M={M} table entries), "
                         f"got min {ln.min()}, max {ln.max()}")
    if is_concrete(page_table):
        tab = np.asarray(page_table).astype(np.int64)
        needed = np.arange(M) < ((ln + page_size - 1) // page_size)[..., None]
        bad = needed & ((tab < 0) | (tab >= num_pages))
        if bad.any():
            b, h, p = (int(i[0]) for i in np.nonzero(bad))
            raise ValueError(f"page_table[{b}, {h}, {p}] = {tab[b, h, p]} is not a pool page in [0, {num_pages}), "
                             f"but length {ln[b, h]} of (row {b}, {head} {h}) reaches logical page {p}")


def check_pool_decode_args(q: Any, k: Any, v: Any, lengths: Any, page_table: Any, *, page_size: int,
                           page_ids: Any, page_counts: Any, bias: Any) -> None:
    """Validate `decode_attention`'s page-pool mode (raises ValueError).

    ``k``/``v`` ``[N, page_size, D]`` (the pool), ``page_table`` ``[B, Hkv, M]``, ``lengths``
    ``[B, Hkv]``, logical ``page_ids`` ``[B, Hkv, K]`` in ``[0, M)``, ``bias`` ``[N, page_size]``.
    With concrete values, also: lengths in ``[0, M·page_size]``, and every table entry a head's
    length reaches (logical pages below ``ceil(length / page_size)``) a pool page in ``[0, N)``.
    """
    _require(isinstance(page_size, int) and is_pow2(page_size),
             f"page_size={page_size} must be a positive power of two")
    _require(len(_shape(q)) == 3, f"q must have rank 3, got shape {_shape(q)}")
    _require(len(_shape(k)) == 3, f"with page_table, k must be a pool [N, page_size, D], got shape {_shape(k)}")
    _require(_shape(v) == _shape(k), f"v shape {_shape(v)} != k shape {_shape(k)}")
    N, ps, D = _shape(k)
    _require(ps == page_size, f"pool pages hold {ps} tokens (k.shape[1]) but page_size={page_size}")
    _require(N >= 1, "the pool must hold at least one page")
    tshape = _shape(page_table)
    _require(len(tshape) == 3 and tshape[2] >= 1, f"page_table must be [B, Hkv, M>=1], got shape {tshape}")
    _check_int("page_table", page_table)
    B, Hkv, M = tshape
    qs = _shape(q)
    _require(qs[0] == B, f"q batch {qs[0]} != page_table batch {B}")
    _require(qs[-1] == D, f"q head_dim {qs[-1]} != k head_dim {D}")
    _require(Hkv > 0 and qs[1] % Hkv == 0, f"query heads {qs[1]} must be a multiple of kv heads {Hkv} (page_table)")
    _check_qkv_dtypes(q, k, v, D)
    _require(_shape(lengths) == (B, Hkv),
             f"with page_table, lengths must be [B, Hkv]=[{B}, {Hkv}] (one per head), got {_shape(lengths)}")
    _check_int("lengths", lengths)
    _check_page_list_shapes(page_ids, page_counts, B, Hkv)
    if bias is not None:
        _require(_shape(bias) == (N, ps),
                 f"with page_table, bias must be per pool slot [N, page_size]=[{N}, {ps}], got {_shape(bias)}")
        _check_float("bias", bias)
    check_pool_table(page_table, lengths, num_pages=N, page_size=ps, head="kv head")
    _check_page_list_values(page_ids, page_counts, upper=M)


def check_prefill_args(q: Any, k: Any, v: Any, *, q_offset: Any, block_size: int, block_ids: Any,
                       block_counts: Any, kv_lengths: Any, sliding_window: int | None) -> None:
    """Validate `prefill_attention` arguments (raises ValueError)."""
    B, Hq, Hkv, S, D = _check_qkv(q, k, v, q_rank=4)
    T = _shape(q)[2]
    _require(T >= 1, "q must hold at least one query")
    _require(isinstance(block_size, int) and is_pow2(block_size) and block_size >= 16,
             f"block_size={block_size} must be a power of two >= 16")
    _require(S % block_size == 0, f"cache length S={S} must be a multiple of block_size={block_size}")
    nK = S // block_size
    nQ = cdiv(T, block_size)
    _require(len(_shape(q_offset)) == 0 or _shape(q_offset) == (1,),
             f"q_offset must be a scalar, got shape {_shape(q_offset)}")
    _check_int("q_offset", q_offset)
    if is_concrete(q_offset):
        off = int(np.asarray(q_offset).reshape(()))
        _require(off >= 0, f"q_offset={off} must be >= 0")
        _require(off % block_size == 0, f"q_offset={off} must be a multiple of block_size={block_size}")
        _require(off + T <= S, f"q_offset + T = {off + T} exceeds the cache length S={S}")
    else:
        _require(T <= S, f"T={T} exceeds the cache length S={S}")
    if sliding_window is not None:
        _require(isinstance(sliding_window, int) and sliding_window >= 1,
                 f"sliding_window={sliding_window} must be a positive int")
    if kv_lengths is not None:
        _require(_shape(kv_lengths) == (B,), f"kv_lengths must be [B]=[{B}], got {_shape(kv_lengths)}")
        _check_int("kv_lengths", kv_lengths)
        if is_concrete(kv_lengths):
            ln = np.asarray(kv_lengths)
            if ln.size and (ln.min() < 0 or ln.max() > S):
                raise ValueError(f"kv_lengths must lie in [0, S={S}], got min {ln.min()}, max {ln.max()}")
    if block_counts is not None and block_ids is None:
        raise ValueError("block_counts given without block_ids")
    if block_ids is not None:
        bs = _shape(block_ids)
        _require(len(bs) == 4 and bs[:3] == (B, Hkv, nQ) and bs[3] >= 1,
                 f"block_ids must be [B, Hkv, nQ, K]=[{B}, {Hkv}, {nQ}, K>=1] (nQ = ceil(T/block_size)), "
                 f"got {bs}")
        _check_int("block_ids", block_ids)
        if block_counts is not None:
            _require(_shape(block_counts) == (B, Hkv, nQ),
                     f"block_counts must be [B, Hkv, nQ]=[{B}, {Hkv}, {nQ}], got {_shape(block_counts)}")
            _check_int("block_counts", block_counts)
        if is_concrete(block_ids, block_counts, q_offset):
            counts = (block_counts if block_counts is not None
                      else np.full((B, Hkv, nQ), bs[3], np.int64))
            qb = int(np.asarray(q_offset).reshape(())) // block_size + np.arange(nQ)
            check_index_lists(block_ids, counts, upper=nK, name="block_ids", causal_limit=qb)
