"""Block-sparse causal prefill kernel vs its jnp reference, in Pallas interpret mode on CPU.

Fresh random inputs per test (seed printed; shown on failure). Interpret mode pre-fills
outputs with NaN, so unwritten elements fail the finite check; cache slots past the
chunk (the "future") are poisoned with NaN, so a causality leak shows up as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.pallas.prefill import dense_block_lists, prefill_attention, prefill_attention_reference
from sparsekv_jax.pallas.testing import random_block_lists, rel_err

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _inputs(rng, B, Hq, Hkv, T, S, D, dtype, q_offset):
    q = jnp.asarray(rng.standard_normal((B, Hq, T, D)), dtype)
    k = rng.standard_normal((B, Hkv, S, D))
    v = rng.standard_normal((B, Hkv, S, D))
    k[:, :, q_offset + T:] = np.nan  # the future: must never reach an output
    v[:, :, q_offset + T:] = np.nan
    return q, jnp.asarray(k, dtype), jnp.asarray(v, dtype)


def _assert_matches_reference(got, q, k, v, dtype, **kw):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = prefill_attention_reference(f32(q), f32(k), f32(v), **kw)
    if kw.get("return_lse"):
        (got, lse), (ref, ref_lse) = got, ref
        lse, ref_lse = np.asarray(lse), np.asarray(ref_lse)
        assert lse.shape == ref_lse.shape and lse.dtype == np.float32
        assert np.array_equal(np.isneginf(lse), np.isneginf(ref_lse))
        fin = np.isfinite(ref_lse)
        assert not np.isnan(lse).any()
        np.testing.assert_allclose(lse[fin], ref_lse[fin], atol=1e-4 if dtype == jnp.float32 else 2e-2)
    assert got.shape == q.shape and got.dtype == q.dtype
    g = np.asarray(got, np.float32)
    assert np.isfinite(g).all(), "NaN/inf in kernel output"
    err = rel_err(g, np.asarray(ref))
    assert err <= TOL[dtype], f"rel err {err:.3g} > {TOL[dtype]}"
    return g


# (Hq, Hkv, D, block_size, T, q_offset, dtype): GQA 1/3/4/8, D 64/128, ragged T, chunk offsets.
DENSE_CASES = [
    (2, 2, 64, 16, 40, 0, jnp.float32),
    (6, 2, 64, 32, 64, 32, jnp.bfloat16),
    (4, 1, 128, 16, 33, 48, jnp.float32),
    (16, 2, 64, 16, 24, 16, jnp.bfloat16),
    (9, 3, 64, 32, 50, 0, jnp.float32),
]


@pytest.mark.share(2)
@pytest.mark.parametrize("Hq,Hkv,D,bs,T,off,dtype", DENSE_CASES)
def test_dense_matches_reference(rng, Hq, Hkv, D, bs, T, off, dtype):
    S = off + -(-T // bs) * bs + bs
    q, k, v = _inputs(rng, 2, Hq, Hkv, T, S, D, dtype, off)
    kw = dict(q_offset=off, block_size=bs, return_lse=True)
    _assert_matches_reference(prefill_attention(q, k, v, interpret=True, **kw), q, k, v, dtype, **kw)


SPARSE_CASES = [
    (4, 4, 64, 16, 64, 32, jnp.float32, "random"),
    (6, 2, 64, 16, 40, 16, jnp.bfloat16, "never"),
    (8, 2, 128, 32, 64, 64, jnp.float32, "always"),
    (8, 1, 64, 16, 48, 0, jnp.bfloat16, "random"),
]


@pytest.mark.share(2)
@pytest.mark.parametrize("Hq,Hkv,D,bs,T,off,dtype,diag", SPARSE_CASES)
def test_sparse_unsorted_matches_reference(rng, Hq, Hkv, D, bs, T, off, dtype, diag):
    B = 2
    S = off + -(-T // bs) * bs
    q, k, v = _inputs(rng, B, Hq, Hkv, T, S, D, dtype, off)
    K = off // bs + 2
    ids, counts = random_block_lists(rng, B, Hkv, T, bs, off, K, diag=diag)
    counts[0, 0, 0] = 0  # an empty list: those queries output zeros
    kw = dict(q_offset=off, block_size=bs, block_ids=jnp.asarray(ids), block_counts=jnp.asarray(counts),
              return_lse=True)
    out = _assert_matches_reference(prefill_attention(q, k, v, interpret=True, **kw), q, k, v, dtype, **kw)
    G = Hq // Hkv
    assert np.all(out[0, :G, : min(bs, T)] == 0)


def test_full_lists_equal_dense(rng):
    B, Hq, Hkv, D, bs, T, off = 2, 4, 2, 64, 16, 48, 16
    S = off + T + bs
    q, k, v = _inputs(rng, B, Hq, Hkv, T, S, D, jnp.float32, off)
    ids, counts = dense_block_lists(B, Hkv, T, bs, off)
    ids = np.asarray(ids).copy()
    for idx in np.ndindex(*ids.shape[:3]):  # shuffle each list's live part
        c = int(counts[idx])
        ids[idx][:c] = rng.permutation(ids[idx][:c])
    sparse = prefill_attention(q, k, v, q_offset=off, block_size=bs, block_ids=jnp.asarray(ids),
                               block_counts=counts, interpret=True)
    dense = prefill_attention(q, k, v, q_offset=off, block_size=bs, interpret=True)
    assert rel_err(np.asarray(sparse), np.asarray(dense)) <= 1e-5
    _assert_matches_reference(sparse, q, k, v, jnp.float32, q_offset=off, block_size=bs)


def test_chunked_prefill_matches_full(rng):
    """Two chunks at offsets 0 and 32 give the rows of one full causal prefill."""
    B, Hq, Hkv, D, bs, T = 1, 6, 2, 64, 16, 64
    q, k, v = _inputs(rng, B, Hq, Hkv, T, T, D, jnp.float32, 0)
    full = prefill_attention(q, k, v, block_size=bs, interpret=True)
    first = prefill_attention(q[:, :, :32], k, v, q_offset=0, block_size=bs, interpret=True)
    second = prefill_attention(q[:, :, 32:], k, v, q_offset=32, block_size=bs, interpret=True)
    got = np.concatenate([np.asarray(first), np.asarray(second)], axis=2)
    assert rel_err(got, np.asarray(full)) <= 1e-5


def test_traced_offset_under_jit(rng):
    B, Hq, Hkv, D, bs, T, S = 1, 4, 2, 64, 16, 32, 96
    off = 32
    q, k, v = _inputs(rng, B, Hq, Hkv, T, S, D, jnp.float32, off)
    f = jax.jit(lambda q, k, v, o: prefill_attention(q, k, v, q_offset=o, block_size=bs, interpret=True))
    _assert_matches_reference(f(q, k, v, jnp.int32(off)), q, k, v, jnp.float32, q_offset=off, block_size=bs)


@pytest.mark.parametrize("sparse", [False, True])
def test_kv_lengths_ragged(rng, sparse):
    B, Hq, Hkv, D, bs, T = 3, 4, 2, 64, 16, 48
    q, k, v = _inputs(rng, B, Hq, Hkv, T, T, D, jnp.bfloat16, 0)
    lens = np.array([T, 21, 0], np.int32)
    k = jnp.where((jnp.arange(T) < lens[:, None])[:, None, :, None], k, jnp.nan).astype(k.dtype)
    v = jnp.where((jnp.arange(T) < lens[:, None])[:, None, :, None], v, jnp.nan).astype(v.dtype)
    kw = dict(block_size=bs, kv_lengths=jnp.asarray(lens), return_lse=True)
    if sparse:
        ids, counts = random_block_lists(rng, B, Hkv, T, bs, 0, 3, diag="always")
        kw.update(block_ids=jnp.asarray(ids), block_counts=jnp.asarray(counts))
    out = _assert_matches_reference(prefill_attention(q, k, v, interpret=True, **kw), q, k, v, jnp.bfloat16, **kw)
    assert np.all(out[2] == 0)


def test_sliding_window(rng):
    B, Hq, Hkv, D, bs, T, off = 1, 4, 2, 64, 16, 48, 32
    q, k, v = _inputs(rng, B, Hq, Hkv, T, off + T, D, jnp.float32, off)
    kw = dict(q_offset=off, block_size=bs, sliding_window=20)
    _assert_matches_reference(prefill_attention(q, k, v, interpret=True, **kw), q, k, v, jnp.float32, **kw)


def test_sub_tiles(rng):
    """block_q / block_k smaller than the list granularity (several tiles per block)."""
    B, Hq, Hkv, D, bs, T, off = 1, 4, 2, 64, 64, 128, 64
    q, k, v = _inputs(rng, B, Hq, Hkv, T, off + T, D, jnp.float32, off)
    ids, counts = random_block_lists(rng, B, Hkv, T, bs, off, 3)
    kw = dict(q_offset=off, block_size=bs, block_ids=jnp.asarray(ids), block_counts=jnp.asarray(counts))
    _assert_matches_reference(prefill_attention(q, k, v, interpret=True, block_q=32, block_k=16, **kw), q, k, v,
           jnp.float32, **kw)


# --- bad inputs: one test per case -------------------------------------------------------------

def _ok(B=1, Hq=4, Hkv=2, T=32, S=64, D=64, dtype=jnp.float32):
    return dict(q=jnp.zeros((B, Hq, T, D), dtype), k=jnp.zeros((B, Hkv, S, D), dtype),
                v=jnp.zeros((B, Hkv, S, D), dtype), block_size=16)


def _call(**kw):
    a = _ok()
    a.update(kw)
    return prefill_attention(a.pop("q"), a.pop("k"), a.pop("v"), interpret=True, **a)


def test_error_block_after_query_block():
    ids = np.zeros((1, 2, 2, 2), np.int32)
    ids[0, 0, 0] = [0, 1]  # query block 0 lists KV block 1: the future
    with pytest.raises(ValueError, match="causality"):
        _call(block_ids=jnp.asarray(ids))


def test_error_block_id_out_of_range():
    with pytest.raises(ValueError, match="ids must lie"):
        _call(q_offset=32, block_ids=jnp.full((1, 2, 2, 1), 4, jnp.int32))


def test_error_block_id_negative():
    with pytest.raises(ValueError, match="ids must lie"):
        _call(block_ids=jnp.full((1, 2, 2, 1), -1, jnp.int32))


def test_error_block_counts_exceed_list():
    with pytest.raises(ValueError, match="counts must lie"):
        _call(block_ids=jnp.zeros((1, 2, 2, 1), jnp.int32), block_counts=jnp.full((1, 2, 2), 2, jnp.int32))


def test_error_duplicate_blocks():
    ids = jnp.asarray(np.tile([0, 0], (1, 2, 2, 1)), jnp.int32)
    with pytest.raises(ValueError, match="duplicate"):
        _call(block_ids=ids)


def test_error_block_ids_wrong_nq():
    with pytest.raises(ValueError, match="block_ids must be"):
        _call(block_ids=jnp.zeros((1, 2, 3, 1), jnp.int32))


def test_error_counts_without_ids():
    with pytest.raises(ValueError, match="without block_ids"):
        _call(block_counts=jnp.ones((1, 2, 2), jnp.int32))


def test_error_offset_misaligned():
    with pytest.raises(ValueError, match="multiple of block_size"):
        _call(q_offset=8)


def test_error_chunk_past_cache():
    with pytest.raises(ValueError, match="exceeds the cache"):
        _call(q_offset=48)


def test_error_cache_not_whole_blocks():
    with pytest.raises(ValueError, match="multiple of block_size"):
        _call(k=jnp.zeros((1, 2, 72, 64)), v=jnp.zeros((1, 2, 72, 64)))


def test_error_heads_not_multiple():
    with pytest.raises(ValueError, match="multiple of kv heads"):
        _call(q=jnp.zeros((1, 3, 32, 64)))


def test_error_dtype_mismatch():
    with pytest.raises(ValueError, match="dtype"):
        _call(q=jnp.zeros((1, 4, 32, 64), jnp.bfloat16))


def test_error_kv_lengths_out_of_range():
    with pytest.raises(ValueError, match="kv_lengths"):
        _call(kv_lengths=jnp.asarray([65], jnp.int32))


def test_error_bad_tile():
    with pytest.raises(ValueError, match="block_q"):
        _call(block_q=24)


def test_error_bad_window():
    with pytest.raises(ValueError, match="sliding_window"):
        _call(sliding_window=0)


def test_error_nonpositive_scale():
    with pytest.raises(ValueError, match="scale"):
        _call(scale=-0.1)
