"""Page-sparse decode kernel vs its jnp reference, in Pallas interpret mode on CPU.

Every test draws fresh random inputs (the seed is printed; pytest shows it on failure).
Interpret mode fills kernel outputs with NaN before the kernel runs, so an element the
kernel forgot to write fails the finite check; unused cache slots are poisoned with NaN
too, so any read of a slot that should be masked shows up as NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.pallas.decode import decode_attention, decode_attention_reference, listed_chunk, selected_slot_mask
from sparsekv_jax.pallas.testing import random_page_lists, rel_err

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _inputs(rng, B, Hq, Hkv, D, P, ps, dtype, *, lengths=None):
    S = P * ps
    q = rng.standard_normal((B, Hq, D))
    k = rng.standard_normal((B, Hkv, S, D))
    v = rng.standard_normal((B, Hkv, S, D))
    if lengths is None:
        lengths = rng.integers(1, S + 1, B)
        lengths[0] = S - int(rng.integers(1, ps))  # partial last page
    lengths = np.asarray(lengths, np.int32)
    return (jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype), jnp.asarray(lengths))


def _poison(x, mask):
    """NaN wherever the kernel must not look (mask False), per [B, Hkv, S] slot."""
    return jnp.where(mask[..., None], x, jnp.nan).astype(x.dtype)


def _assert_matches_reference(out, q, k, v, lengths, dtype, **kw):
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref = decode_attention_reference(f32(q), f32(k), f32(v), lengths, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.isfinite(np.asarray(out, np.float32)).all(), "NaN/inf in kernel output"
    err = rel_err(np.asarray(out, np.float32), np.asarray(ref))
    assert err <= TOL[dtype], f"rel err {err:.3g} > {TOL[dtype]}"
    return ref


# (Hq, Hkv, D, page_size, num_pages, dtype): GQA 1/3/4/8, page 16..128, D 64/128.
DENSE_CASES = [
    (2, 2, 64, 16, 9, jnp.float32),
    (6, 2, 64, 32, 5, jnp.bfloat16),
    (8, 2, 128, 16, 7, jnp.float32),
    (16, 2, 64, 64, 3, jnp.bfloat16),
    (9, 3, 64, 128, 2, jnp.float32),
    (32, 4, 128, 32, 4, jnp.bfloat16),
]


@pytest.mark.share(2)
@pytest.mark.parametrize("Hq,Hkv,D,ps,P,dtype", DENSE_CASES)
def test_dense_matches_reference(rng, Hq, Hkv, D, ps, P, dtype):
    q, k, v, lengths = _inputs(rng, 3, Hq, Hkv, D, P, ps, dtype)
    mask = selected_slot_mask(lengths, P * ps, Hkv, page_size=ps)
    k, v = _poison(k, mask), _poison(v, mask)
    out = decode_attention(q, k, v, lengths, page_size=ps, interpret=True, block_k=32)
    _assert_matches_reference(out, q, k, v, lengths, dtype, page_size=ps)


SPARSE_CASES = [
    (4, 4, 64, 16, 12, jnp.float32),
    (6, 2, 64, 32, 8, jnp.bfloat16),
    (8, 2, 128, 64, 5, jnp.float32),
    (16, 2, 64, 128, 4, jnp.bfloat16),
]


@pytest.mark.share(2)
@pytest.mark.parametrize("Hq,Hkv,D,ps,P,dtype", SPARSE_CASES)
def test_sparse_unsorted_ragged_matches_reference(rng, Hq, Hkv, D, ps, P, dtype):
    B = 3
    q, k, v, lengths = _inputs(rng, B, Hq, Hkv, D, P, ps, dtype)
    ids, counts = random_page_lists(rng, np.asarray(lengths), Hkv, P, ps, list_len=max(2, P - 2))
    counts[1, 0] = 0  # an empty selection
    kw = dict(page_size=ps, page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts))
    mask = selected_slot_mask(lengths, P * ps, Hkv, **kw)
    k, v = _poison(k, mask), _poison(v, mask)
    out = decode_attention(q, k, v, lengths, interpret=True, block_k=64, num_splits=2, **kw)
    _assert_matches_reference(out, q, k, v, lengths, dtype, **kw)
    G = Hq // Hkv
    assert np.all(np.asarray(out, np.float32)[1, :G] == 0), "empty selection must give zeros"


def test_listed_chunks_spread_the_count_over_every_split():
    """`listed_chunk` (each split's run of a page list): for every count, tile and split count, the runs partition
    ``[0, count)`` in order, start on whole tiles, and the longest is the fewest tiles that cover the count over
    the splits (a list padded to its full width but counting few pages keeps every split busy)."""
    for ppb in (1, 2, 8):
        for num_splits in (1, 3, 8, 64):
            for count in (0, 1, 2, 7, 8, 9, 63, 64, 200, 511, 512):
                runs = [tuple(int(x) for x in listed_chunk(jnp.int32(s), jnp.int32(count), ppb, num_splits))
                        for s in range(num_splits)]
                covered = [e for start, end in runs for e in range(start, end)]
                assert covered == list(range(count)), (ppb, num_splits, count, runs)
                assert all(start % ppb == 0 for start, end in runs if end > start)
                tiles = -(-count // ppb)
                assert max(end - start for start, end in runs) <= -(-tiles // num_splits) * ppb


@pytest.mark.parametrize("Hq,Hkv,ps,dtype", [(4, 2, 16, jnp.float32), (8, 2, 32, jnp.bfloat16)])
def test_a_full_width_list_counting_few_pages_over_many_splits(rng, Hq, Hkv, ps, dtype):
    """Quest's and CHESS's shape of list: as wide as the cache (every page id), only the first ``count`` read, and
    more splits than the count has tiles; counts per (row, head) from 0 to 5 of 16 pages, against the reference."""
    B, D, P = 3, 64, 16
    q, k, v, lengths = _inputs(rng, B, Hq, Hkv, D, P, ps, dtype, lengths=[P * ps, P * ps - 3, 7 * ps])
    ids = np.stack([np.stack([rng.permutation(P) for _ in range(Hkv)]) for _ in range(B)]).astype(np.int32)
    counts = rng.integers(0, 6, (B, Hkv)).astype(np.int32)
    counts[0, 0] = 5
    kw = dict(page_size=ps, page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts))
    mask = selected_slot_mask(lengths, P * ps, Hkv, **kw)
    k, v = _poison(k, mask), _poison(v, mask)
    out = decode_attention(q, k, v, lengths, interpret=True, block_k=2 * ps, num_splits=8, **kw)
    _assert_matches_reference(out, q, k, v, lengths, dtype, **kw)


@pytest.mark.parametrize("sparse", [False, True])
def test_stacked_layers_read_by_index(rng, sparse):
    """``layer=`` reads one layer of a stacked [L, ...] cache (the decode scan's zero-copy path);
    every other layer is NaN-poisoned, so reading the wrong one shows."""
    L, B, Hq, Hkv, D, P, ps = 3, 2, 6, 2, 64, 5, 16
    layer = int(rng.integers(L))
    q, k1, v1, lengths = _inputs(rng, B, Hq, Hkv, D, P, ps, jnp.float32)
    bias1 = jnp.asarray(rng.standard_normal((B, Hkv, P * ps)), jnp.float32)
    kw = dict(page_size=ps)
    if sparse:
        ids, counts = random_page_lists(rng, np.asarray(lengths), Hkv, P, ps, list_len=P - 1)
        kw.update(page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts))
    mask = selected_slot_mask(lengths, P * ps, Hkv, **kw)
    stack = lambda x: jnp.stack([x if i == layer else jnp.full_like(x, jnp.nan) for i in range(L)])  # noqa: E731
    k, v, bias = stack(_poison(k1, mask)), stack(_poison(v1, mask)), stack(bias1)
    out = jax.jit(lambda i: decode_attention(q, k, v, lengths, bias=bias, layer=i, interpret=True, block_k=32,
                                             **kw))(jnp.int32(layer))
    _assert_matches_reference(out, q, k1, v1, lengths, jnp.float32, bias=bias1, **kw)


def test_error_layer_out_of_range(rng):
    q, k, v, lengths = _inputs(rng, 1, 2, 2, 64, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="layer=3"):
        decode_attention(q, k[None], v[None], lengths, page_size=16, layer=3, interpret=True)
    with pytest.raises(ValueError, match="stacked"):
        decode_attention(q, k, v, lengths, page_size=16, layer=0, interpret=True)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_bias_and_scale(rng, dtype):
    B, Hq, Hkv, D, ps, P = 2, 8, 2, 64, 16, 6
    q, k, v, lengths = _inputs(rng, B, Hq, Hkv, D, P, ps, dtype)
    bias = jnp.asarray(np.log(rng.integers(1, 9, (B, Hkv, P * ps))), jnp.float32)
    ids, counts = random_page_lists(rng, np.asarray(lengths), Hkv, P, ps, list_len=4, allow_empty=False)
    kw = dict(page_size=ps, page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts), bias=bias,
              scale=0.3)
    out = decode_attention(q, k, v, lengths, interpret=True, block_k=32, **kw)
    _assert_matches_reference(out, q, k, v, lengths, dtype, **kw)


def test_full_selection_equals_dense(rng):
    B, Hq, Hkv, D, ps, P = 2, 4, 2, 64, 16, 8
    q, k, v, lengths = _inputs(rng, B, Hq, Hkv, D, P, ps, jnp.float32)
    used = -(-np.asarray(lengths) // ps)
    ids = np.zeros((B, Hkv, P), np.int32)
    counts = np.zeros((B, Hkv), np.int32)
    for b in range(B):
        for h in range(Hkv):
            ids[b, h, : used[b]] = rng.permutation(used[b])
            counts[b, h] = used[b]
    sparse = decode_attention(q, k, v, lengths, page_size=ps, page_ids=jnp.asarray(ids),
                              page_counts=jnp.asarray(counts), interpret=True, block_k=32, num_splits=3)
    dense = decode_attention(q, k, v, lengths, page_size=ps, interpret=True, block_k=64)
    assert rel_err(np.asarray(sparse), np.asarray(dense)) <= 1e-5
    _assert_matches_reference(sparse, q, k, v, lengths, jnp.float32, page_size=ps)


def test_all_empty_gives_zeros_not_nan(rng):
    B, Hq, Hkv, D, ps, P = 2, 4, 2, 64, 16, 4
    q, k, v, lengths = _inputs(rng, B, Hq, Hkv, D, P, ps, jnp.bfloat16, lengths=[0, 17])
    ids = jnp.asarray(rng.integers(0, P, (B, Hkv, 3)), jnp.int32)
    out = decode_attention(q, k, v, lengths, page_size=ps, page_ids=ids,
                           page_counts=jnp.zeros((B, Hkv), jnp.int32), interpret=True, block_k=32)
    assert np.all(np.asarray(out, np.float32) == 0)
    dense = decode_attention(q, k, v, lengths, page_size=ps, interpret=True, block_k=32)
    assert np.all(np.asarray(dense, np.float32)[0] == 0)  # length 0 row
    assert np.isfinite(np.asarray(dense, np.float32)).all()


def test_pages_past_length_are_masked(rng):
    """A listed page entirely past the row's length contributes nothing."""
    B, Hq, Hkv, D, ps, P = 1, 4, 1, 64, 16, 6
    q, k, v, lengths = _inputs(rng, B, Hq, Hkv, D, P, ps, jnp.float32, lengths=[40])
    ids = jnp.asarray([[[5, 1, 2]]], jnp.int32)  # page 5 is past length 40, page 2 partial
    kw = dict(page_size=ps, page_ids=ids, page_counts=jnp.asarray([[3]], jnp.int32))
    mask = selected_slot_mask(lengths, P * ps, Hkv, **kw)
    out = decode_attention(q, _poison(k, mask), _poison(v, mask), lengths, interpret=True, block_k=16, **kw)
    _assert_matches_reference(out, q, k, v, lengths, jnp.float32, **kw)


def test_under_jit_with_tracers(rng):
    B, Hq, Hkv, D, ps, P = 2, 4, 2, 64, 16, 4
    q, k, v, lengths = _inputs(rng, B, Hq, Hkv, D, P, ps, jnp.float32)
    ids, counts = random_page_lists(rng, np.asarray(lengths), Hkv, P, ps, list_len=3)
    f = jax.jit(lambda q, k, v, n, i, c: decode_attention(q, k, v, n, page_size=ps, page_ids=i,
                                                          page_counts=c, interpret=True, block_k=32))
    out = f(q, k, v, lengths, jnp.asarray(ids), jnp.asarray(counts))
    _assert_matches_reference(out, q, k, v, lengths, jnp.float32, page_size=ps, page_ids=jnp.asarray(ids),
           page_counts=jnp.asarray(counts))


# --- bad inputs: one test per case -------------------------------------------------------------

def _ok(B=2, Hq=4, Hkv=2, D=64, P=4, ps=16, dtype=jnp.float32):
    S = P * ps
    return dict(q=jnp.zeros((B, Hq, D), dtype), k=jnp.zeros((B, Hkv, S, D), dtype),
                v=jnp.zeros((B, Hkv, S, D), dtype), lengths=jnp.full((B,), S, jnp.int32), page_size=ps)


def _call(**kw):
    a = _ok()
    a.update(kw)
    return decode_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("lengths"), interpret=True, **a)


def test_error_kv_shape_mismatch():
    with pytest.raises(ValueError, match="v shape"):
        _call(v=jnp.zeros((2, 2, 32, 64)))


def test_error_batch_mismatch():
    with pytest.raises(ValueError, match="batch"):
        _call(q=jnp.zeros((3, 4, 64)))


def test_error_dtype_mismatch():
    with pytest.raises(ValueError, match="dtype"):
        _call(q=jnp.zeros((2, 4, 64), jnp.bfloat16))


def test_error_heads_not_multiple():
    with pytest.raises(ValueError, match="multiple of kv heads"):
        _call(q=jnp.zeros((2, 3, 64)))


def test_error_head_dim_not_pow2():
    with pytest.raises(ValueError, match="head_dim"):
        _call(q=jnp.zeros((2, 4, 48)), k=jnp.zeros((2, 2, 64, 48)), v=jnp.zeros((2, 2, 64, 48)))


def test_error_cache_not_whole_pages():
    with pytest.raises(ValueError, match="multiple of page_size"):
        _call(page_size=128)


def test_error_page_size_not_pow2():
    with pytest.raises(ValueError, match="power of two"):
        _call(page_size=48)


def test_error_lengths_out_of_range():
    with pytest.raises(ValueError, match="lengths"):
        _call(lengths=jnp.asarray([65, 3], jnp.int32))


def test_error_lengths_float():
    with pytest.raises(ValueError, match="integer"):
        _call(lengths=jnp.asarray([6.0, 3.0]))


def test_error_page_id_out_of_range():
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 4\)"):
        _call(page_ids=jnp.asarray(np.full((2, 2, 2), 4), jnp.int32))


def test_error_page_id_negative():
    with pytest.raises(ValueError, match="ids must lie"):
        _call(page_ids=jnp.asarray(np.full((2, 2, 1), -1), jnp.int32))


def test_error_counts_exceed_list():
    with pytest.raises(ValueError, match="counts must lie"):
        _call(page_ids=jnp.zeros((2, 2, 2), jnp.int32), page_counts=jnp.full((2, 2), 3, jnp.int32))


def test_error_duplicate_pages():
    ids = jnp.asarray(np.tile([1, 2, 1], (2, 2, 1)), jnp.int32)
    with pytest.raises(ValueError, match="duplicate"):
        _call(page_ids=ids)


def test_junk_past_count_is_ignored():
    ids = jnp.asarray(np.tile([1, 1, 99], (2, 2, 1)), jnp.int32)  # junk after count 1
    out = _call(page_ids=ids, page_counts=jnp.ones((2, 2), jnp.int32))
    assert np.isfinite(np.asarray(out)).all()


def test_error_counts_without_ids():
    with pytest.raises(ValueError, match="without page_ids"):
        _call(page_counts=jnp.ones((2, 2), jnp.int32))


def test_error_page_ids_shape():
    with pytest.raises(ValueError, match="page_ids must be"):
        _call(page_ids=jnp.zeros((2, 3, 2), jnp.int32))


def test_error_bias_shape():
    with pytest.raises(ValueError, match="bias must be"):
        _call(bias=jnp.zeros((2, 2, 63)))


def test_shape_errors_still_raised_under_jit():
    a = _ok()
    with pytest.raises(ValueError, match="page_ids must be"):
        jax.jit(lambda i: decode_attention(a["q"], a["k"], a["v"], a["lengths"], page_size=16,
                                           page_ids=i, interpret=True))(jnp.zeros((2, 3, 2), jnp.int32))


def test_error_nonpositive_scale():
    with pytest.raises(ValueError, match="scale"):
        _call(scale=0.0)


# --- return_probs: the step's attention probabilities (H2O and other mass-accumulating policies) ------

def _assert_probs(q, k, v, lengths, dtype, *, tune, **kw):
    """Kernel ``(out, probs)`` against the jnp reference, plus the invariants the reference alone
    would not pin down: exact zeros off the read set, rows summing to 1 (0 when nothing is read),
    and ``out`` unchanged by asking for the probabilities. ``kw`` goes to both, ``tune`` (tiles,
    splits) to the kernel only."""
    out, probs = decode_attention(q, k, v, lengths, interpret=True, return_probs=True, **tune, **kw)
    plain = decode_attention(q, k, v, lengths, interpret=True, **tune, **kw)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(plain, np.float32))
    _assert_matches_reference(out, q, k, v, lengths, dtype, **kw)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    _, ref = decode_attention_reference(f32(q), f32(k), f32(v), lengths, return_probs=True, **kw)
    B, Hq, _ = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    assert probs.shape == (B, Hq, S) and probs.dtype == jnp.float32
    p, r = np.asarray(probs), np.asarray(ref)
    assert np.isfinite(p).all(), "NaN/inf in probs"
    err = rel_err(p, r)
    assert err <= TOL[dtype], f"probs rel err {err:.3g} > {TOL[dtype]}"
    sel = {name: kw[name] for name in ("page_size", "page_ids", "page_counts") if name in kw}
    read = np.repeat(np.asarray(selected_slot_mask(lengths, S, Hkv, **sel)), Hq // Hkv, axis=1)
    assert np.all(p[~read] == 0), "probability outside the read slots"
    live = (r.sum(-1) > 0.5)  # reference rows with mass (not empty, not all -inf bias)
    np.testing.assert_allclose(p.sum(-1)[live], 1.0, atol=1e-5)
    assert np.all(p[~live] == 0), "a row with nothing read must be all zeros"
    return p


@pytest.mark.parametrize("Hq,Hkv,ps,P,dtype", [(4, 4, 16, 5, jnp.float32), (8, 2, 32, 3, jnp.bfloat16)])
def test_probs_dense(rng, Hq, Hkv, ps, P, dtype):
    """Dense, GQA group 1 and 4, several splits, a partial last page and a length-0 row."""
    S = P * ps
    lengths = [S - int(rng.integers(1, ps)), 0, int(rng.integers(1, S + 1))]
    q, k, v, lengths = _inputs(rng, 3, Hq, Hkv, 64, P, ps, dtype, lengths=lengths)
    mask = selected_slot_mask(lengths, S, Hkv, page_size=ps)
    k, v = _poison(k, mask), _poison(v, mask)
    p = _assert_probs(q, k, v, lengths, dtype, page_size=ps, tune=dict(block_k=32, num_splits=2))
    assert np.all(p[1] == 0)


def test_probs_sparse_bias_with_holes(rng):
    """Unsorted ragged page lists (one empty), junk past the counts, several splits, a per-slot
    bias with -inf holes (the cache's evicted slots): holes get probability exactly 0."""
    B, Hq, Hkv, D, ps, P = 3, 6, 2, 64, 16, 6
    q, k, v, lengths = _inputs(rng, B, Hq, Hkv, D, P, ps, jnp.float32)
    ids, counts = random_page_lists(rng, np.asarray(lengths), Hkv, P, ps, list_len=4)
    counts[1, 0] = 0
    bias = rng.standard_normal((B, Hkv, P * ps))
    bias[rng.random(bias.shape) < 0.2] = -np.inf
    kw = dict(page_size=ps, page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts),
              bias=jnp.asarray(bias, jnp.float32))
    mask = selected_slot_mask(lengths, P * ps, Hkv, page_size=ps, page_ids=kw["page_ids"],
                              page_counts=kw["page_counts"])
    k, v = _poison(k, mask), _poison(v, mask)
    p = _assert_probs(q, k, v, lengths, jnp.float32, tune=dict(block_k=32, num_splits=2), **kw)
    hole = np.repeat(np.isinf(bias), Hq // Hkv, axis=1)
    assert np.all(p[hole] == 0)
    assert np.all(p[1, : Hq // Hkv] == 0)  # the empty selection


def test_probs_stacked_layer(rng):
    """``layer=`` (traced, under jit): probabilities of that layer only, the others NaN-poisoned."""
    L, B, Hq, Hkv, D, P, ps = 3, 2, 6, 2, 64, 5, 16
    layer = int(rng.integers(L))
    q, k1, v1, lengths = _inputs(rng, B, Hq, Hkv, D, P, ps, jnp.bfloat16)
    bias1 = jnp.asarray(rng.standard_normal((B, Hkv, P * ps)), jnp.float32)
    ids, counts = random_page_lists(rng, np.asarray(lengths), Hkv, P, ps, list_len=P - 1, allow_empty=False)
    sel = dict(page_size=ps, page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts))
    mask = selected_slot_mask(lengths, P * ps, Hkv, **sel)
    k1, v1 = _poison(k1, mask), _poison(v1, mask)
    stack = lambda x: jnp.stack([x if i == layer else jnp.full_like(x, jnp.nan) for i in range(L)])  # noqa: E731
    k, v, bias = stack(k1), stack(v1), stack(bias1)
    call = jax.jit(lambda i, probs: decode_attention(q, k, v, lengths, bias=bias, layer=i, interpret=True,
                                                     block_k=32, return_probs=probs, **sel), static_argnums=1)
    out, probs = call(jnp.int32(layer), True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(call(jnp.int32(layer), False), np.float32))
    _, ref = decode_attention_reference(q.astype(jnp.float32), k1.astype(jnp.float32), v1.astype(jnp.float32),
                                        lengths, bias=bias1, return_probs=True, **sel)
    assert probs.shape == (B, Hq, P * ps)
    assert rel_err(np.asarray(probs), np.asarray(ref)) <= TOL[jnp.bfloat16]
    read = np.repeat(np.asarray(mask), Hq // Hkv, axis=1)
    assert np.all(np.asarray(probs)[~read] == 0)
    # a head whose one listed page lies past its row's length reads nothing: its probabilities are all 0
    np.testing.assert_allclose(np.asarray(probs).sum(-1), read.any(-1).astype(np.float32), atol=1e-5)
