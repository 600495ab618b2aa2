"""The decode kernel's page-pool mode (issue 38, docs/PAGE_POOL.md, migration step 1), in Pallas interpret mode.

Each case draws a uniform cache ``[B, Hkv, M·ps, D]`` with a length per (row, kv head), lays its pages out in a
pool ``[N, ps, D]`` through a *shuffled* page table (a random permutation of the pool's pages, a few spare pages,
and now and then a page held past a head's length, as after a rewind; `sparsekv_jax.pallas.testing`'s
`shuffled_page_table`, `poisoned_pool`), and checks pool mode against

* the jnp reference, which gathers the pool back through the table (`decode_attention_reference`), and
* the uniform kernel on the uniform cache, a head's short length given there as today's holes (bias -inf):
  the same tiles in the same order, so the outputs agree to the bit.

Everything the kernel must not read is NaN: spare pages, pages held past a length, and slots of a partial page
past its head's length (their scales, for a quantised pool), so a read through a wrong table entry or past a
head's length turns the output into NaN.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.pallas.decode import POOL_VARIANTS, decode_attention, decode_attention_reference, pool_slot_mask
from sparsekv_jax.pallas.testing import (
    place_pages,
    poisoned_pool,
    random_head_lengths,
    random_page_lists,
    rel_err,
    shuffled_page_table,
)

TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-2}


def _pool_case(rng: np.random.Generator, B: int, Hq: int, Hkv: int, D: int, M: int, ps: int, dtype, *,
               with_bias: bool = False) -> dict:
    """Uniform arrays (finite wherever the uniform kernel may look) and their pool, NaN wherever pool mode must
    not look."""
    S = M * ps
    lengths = random_head_lengths(rng, B, Hkv, M, ps)
    table, held, N = shuffled_page_table(rng, lengths, M, ps)
    inside = np.arange(S) < lengths[..., None]  # [B, Hkv, S] a head's own tokens
    k, v = (rng.standard_normal((B, Hkv, S, D)) for _ in range(2))
    bias = np.log(rng.integers(1, 9, (B, Hkv, S))) if with_bias else np.zeros((B, Hkv, S))
    pool = {name: poisoned_pool(x, lengths, table, held, N) for name, x in (("k", k), ("v", v), ("bias", bias))}
    row_len = lengths.max(axis=1)
    past_row = np.arange(S) >= row_len[:, None, None]  # the uniform kernel must not read there either
    return dict(
        q=jnp.asarray(rng.standard_normal((B, Hq, D)), dtype), lengths=lengths, table=table, N=N,
        k_pool=jnp.asarray(pool["k"], dtype), v_pool=jnp.asarray(pool["v"], dtype),
        bias_pool=jnp.asarray(pool["bias"], jnp.float32) if with_bias else None,
        k=jnp.asarray(np.where(past_row[..., None], np.nan, k), dtype),
        v=jnp.asarray(np.where(past_row[..., None], np.nan, v), dtype),
        row_len=jnp.asarray(row_len, jnp.int32),
        # today's holes: past a head's own length, up to its row's, bias -inf (K/V finite there)
        bias_holes=jnp.asarray(np.where(inside, bias, -np.inf), jnp.float32))


def _check(out, ref, dtype):
    assert np.isfinite(np.asarray(out, np.float32)).all(), "NaN/inf in the pool kernel's output: a poisoned read"
    err = rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    assert err <= TOL[dtype], f"rel err {err:.3g} > {TOL[dtype]}"


# (Hq, Hkv, listed, dtype): GQA 2 and 4, dense and listed pages, fp32 and bf16 queries; bias on the listed cases
CASES = [(4, 2, False, jnp.float32), (8, 2, True, jnp.bfloat16), (8, 2, False, jnp.bfloat16),
         (6, 3, True, jnp.float32)]


@pytest.mark.share(2)
@pytest.mark.parametrize("Hq,Hkv,listed,dtype", CASES)
def test_pool_matches_reference_and_uniform_kernel(rng, Hq, Hkv, listed, dtype):
    B, D, M, ps = 2, 64, 5, 16
    c = _pool_case(rng, B, Hq, Hkv, D, M, ps, dtype, with_bias=listed)
    sel = {}
    if listed:  # logical pages, unsorted, ragged, junk past the counts, some past a head's length
        ids, counts = random_page_lists(rng, c["lengths"].max(axis=1), Hkv, M, ps, list_len=M - 1)
        sel = dict(page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts))
    tune = dict(interpret=True, block_k=32, num_splits=2)
    lengths, table = jnp.asarray(c["lengths"]), jnp.asarray(c["table"])
    out = decode_attention(c["q"], c["k_pool"], c["v_pool"], lengths, page_size=ps, page_table=table,
                           bias=c["bias_pool"], **sel, **tune)
    assert out.shape == c["q"].shape and out.dtype == dtype
    f32 = lambda x: None if x is None else x.astype(jnp.float32)  # noqa: E731
    ref = decode_attention_reference(f32(c["q"]), f32(c["k_pool"]), f32(c["v_pool"]), lengths, page_size=ps,
                                     page_table=table, bias=c["bias_pool"], **sel)
    _check(out, ref, dtype)
    uniform = decode_attention(c["q"], c["k"], c["v"], c["row_len"], page_size=ps, bias=c["bias_holes"], **sel,
                               **tune)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(uniform, np.float32))
    G = Hq // Hkv
    assert np.all(np.asarray(out, np.float32)[-1, -G:] == 0), "an empty head must give zeros"


def test_pool_identity_table_is_the_uniform_kernel(rng):
    """The uniform caller's adapter (PAGE_POOL.md step 1): the stack reshaped into pages and the identity table,
    the row's length for every head, give the uniform kernel's output bit for bit."""
    B, Hq, Hkv, D, M, ps = 2, 4, 2, 64, 4, 16
    S = M * ps
    q, k, v = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((B, Hq, D), (B, Hkv, S, D), (B, Hkv, S, D)))
    lengths = jnp.asarray([S - int(rng.integers(1, ps)), int(rng.integers(1, S))], jnp.int32)
    table = jnp.arange(B * Hkv * M, dtype=jnp.int32).reshape(B, Hkv, M)
    tune = dict(interpret=True, block_k=32, num_splits=2)
    out = decode_attention(q, k.reshape(-1, ps, D), v.reshape(-1, ps, D), jnp.broadcast_to(lengths[:, None], (B, Hkv)),
                           page_size=ps, page_table=table, **tune)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(decode_attention(q, k, v, lengths, page_size=ps, **tune)))


def test_pool_identity_table_of_a_stacked_cache_reads_its_layer(rng):
    """The stacked cache ``[L, B, Hkv, S, D]`` reshaped into pages is a pool whose identity table for layer ``l``
    is ``((l·B + b)·Hkv + h)·P + p`` (docs/PAGE_POOL.md, Readers): the layer moves into the table, and pool
    mode gives the ``layer=l`` call's output bit for bit, listed pages and a bias included; every other
    layer is NaN."""
    L, B, Hq, Hkv, D, M, ps = 3, 2, 4, 2, 64, 4, 16
    S, layer = M * ps, int(rng.integers(L))
    nan_but = lambda x: jnp.stack([x if i == layer else jnp.full_like(x, jnp.nan) for i in range(L)])  # noqa: E731
    k, v = (nan_but(jnp.asarray(rng.standard_normal((B, Hkv, S, D)), jnp.float32)) for _ in range(2))
    bias = nan_but(jnp.asarray(rng.standard_normal((B, Hkv, S)), jnp.float32))
    q = jnp.asarray(rng.standard_normal((B, Hq, D)), jnp.float32)
    lengths = jnp.asarray([S - int(rng.integers(1, ps)), int(rng.integers(1, S))], jnp.int32)
    ids, counts = random_page_lists(rng, np.asarray(lengths), Hkv, M, ps, list_len=M - 1)
    sel = dict(page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts), interpret=True, block_k=32)
    table = jnp.arange(L * B * Hkv * M, dtype=jnp.int32).reshape(L, B, Hkv, M)[layer]
    out = decode_attention(q, k.reshape(-1, ps, D), v.reshape(-1, ps, D), jnp.broadcast_to(lengths[:, None], (B, Hkv)),
                           page_size=ps, page_table=table, bias=bias.reshape(-1, ps), **sel)
    want = decode_attention(q, k, v, lengths, page_size=ps, bias=bias, layer=layer, **sel)
    assert np.isfinite(np.asarray(out)).all()
    np.testing.assert_array_equal(np.asarray(out), np.asarray(want))


def test_pool_return_probs_at_logical_slots(rng):
    """``return_probs`` in pool mode: ``[B, Hq, M·ps]`` at *logical* slots, equal to the uniform kernel's (whose
    slots are the logical ones) and to the reference; exactly 0 off the read set; under ``jit``."""
    B, Hq, Hkv, D, M, ps = 2, 6, 2, 64, 5, 16
    c = _pool_case(rng, B, Hq, Hkv, D, M, ps, jnp.float32, with_bias=True)
    ids, counts = random_page_lists(rng, c["lengths"].max(axis=1), Hkv, M, ps, list_len=M - 1)
    sel = dict(page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts))
    lengths, table = jnp.asarray(c["lengths"]), jnp.asarray(c["table"])
    tune = dict(interpret=True, block_k=32, num_splits=2)
    call = jax.jit(lambda q, k, v, n, t, b, i, cnt: decode_attention(
        q, k, v, n, page_size=ps, page_table=t, bias=b, page_ids=i, page_counts=cnt, return_probs=True, **tune))
    out, probs = call(c["q"], c["k_pool"], c["v_pool"], lengths, table, c["bias_pool"], sel["page_ids"],
                      sel["page_counts"])
    assert probs.shape == (B, Hq, M * ps) and probs.dtype == jnp.float32
    ref_out, ref = decode_attention_reference(c["q"], c["k_pool"], c["v_pool"], lengths, page_size=ps,
                                              page_table=table, bias=c["bias_pool"], return_probs=True, **sel)
    _check(out, ref_out, jnp.float32)
    _check(probs, ref, jnp.float32)
    u_out, u_probs = decode_attention(c["q"], c["k"], c["v"], c["row_len"], page_size=ps, bias=c["bias_holes"],
                                      return_probs=True, **sel, **tune)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(u_out))
    np.testing.assert_array_equal(np.asarray(probs), np.asarray(u_probs))
    read = np.repeat(np.asarray(pool_slot_mask(lengths, table, c["N"], page_size=ps, **sel)), Hq // Hkv, axis=1)
    p = np.asarray(probs)
    assert np.all(p[~read] == 0), "probability outside the read (logical) slots"
    np.testing.assert_allclose(p.sum(-1), read.any(-1).astype(np.float32), atol=1e-5)


def test_pool_quantized_int8_with_zero_points(rng):
    """An int8 pool: codes ``[N, ps, D]``, key scales and zero points ``[N, D]`` and value scales ``[N]`` per pool
    page, loaded at the physical page. Unheld pages hold junk codes with NaN scales."""
    B, Hq, Hkv, D, M, ps = 2, 8, 2, 64, 5, 16
    S = M * ps
    lengths = random_head_lengths(rng, B, Hkv, M, ps)
    table, held, N = shuffled_page_table(rng, lengths, M, ps)
    codes = lambda *s: rng.integers(-127, 128, s).astype(np.int8)  # noqa: E731
    kc, vc = codes(B, Hkv, S, D), codes(B, Hkv, S, D)
    ks = 2.0 ** rng.integers(-9, -5, (B, Hkv, M, D))
    kz = rng.standard_normal((B, Hkv, M, D))
    vs = 2.0 ** rng.integers(-9, -5, (B, Hkv, M))
    page = lambda x: x.reshape(B, Hkv, M, ps, D)  # noqa: E731
    pool = dict(k=place_pages(page(kc), table, held, codes(N, ps, D)), v=place_pages(page(vc), table, held,
                                                                                     codes(N, ps, D)),
                k_scale=place_pages(ks, table, held, np.full((N, D), np.nan)),
                k_zero=place_pages(kz, table, held, np.full((N, D), np.nan)),
                v_scale=place_pages(vs, table, held, np.full(N, np.nan)))
    pool = {n: jnp.asarray(x) if x.dtype == np.int8 else jnp.asarray(x, jnp.float32) for n, x in pool.items()}
    q = jnp.asarray(rng.standard_normal((B, Hq, D)), jnp.bfloat16)
    ids, counts = random_page_lists(rng, lengths.max(axis=1), Hkv, M, ps, list_len=M - 1)
    kw = dict(page_size=ps, page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts))
    la, ta = jnp.asarray(lengths), jnp.asarray(table)
    tune = dict(interpret=True, block_k=32, num_splits=2)
    out = decode_attention(q, pool["k"], pool["v"], la, page_table=ta, k_scale=pool["k_scale"],
                           v_scale=pool["v_scale"], k_zero=pool["k_zero"], **kw, **tune)
    ref = decode_attention_reference(q, pool["k"], pool["v"], la, page_table=ta, k_scale=pool["k_scale"],
                                     v_scale=pool["v_scale"], k_zero=pool["k_zero"], **kw)
    _check(out, ref, jnp.bfloat16)
    inside = np.arange(S) < lengths[..., None]
    uniform = decode_attention(q, jnp.asarray(kc), jnp.asarray(vc), jnp.asarray(lengths.max(axis=1)),
                               k_scale=jnp.asarray(ks, jnp.float32), v_scale=jnp.asarray(vs, jnp.float32),
                               k_zero=jnp.asarray(kz, jnp.float32),
                               bias=jnp.asarray(np.where(inside, 0.0, -np.inf), jnp.float32), **kw, **tune)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(uniform, np.float32))


@pytest.mark.parametrize("variant", POOL_VARIANTS)
def test_pool_unmapped_entry_under_jit_reads_nothing(rng, variant):
    """Under ``jit`` (no value checks) a table entry a length reaches but holding the sentinel (or any id outside
    the pool) reads nothing, nor does a length past ``M·ps`` or a listed page past the table: the kernel matches
    the reference, which masks them, and never reads out of bounds; in every ``pool_variant``."""
    B, Hq, D, M, ps = 1, 4, 64, 3, 16  # two kv heads
    N = 8
    k, v = (jnp.asarray(rng.standard_normal((N, ps, D)), jnp.float32) for _ in range(2))
    q = jnp.asarray(rng.standard_normal((B, Hq, D)), jnp.float32)
    table = jnp.asarray([[[3, N, 5], [-2, 1, N + 4]]], jnp.int32)
    lengths = jnp.asarray([[M * ps + 5, M * ps]], jnp.int32)
    call = jax.jit(lambda n, t, i: decode_attention(q, k, v, n, page_size=ps, page_table=t, page_ids=i,
                                                    interpret=True, block_k=16, pool_variant=variant))
    dense = call(lengths, table, None)
    _check(dense, decode_attention_reference(q, k, v, lengths, page_size=ps, page_table=table), jnp.float32)
    ids = jnp.asarray([[[2, M, 0, 1], [M + 1, 1, 0, 2]]], jnp.int32)
    listed = call(lengths, table, ids)
    _check(listed, decode_attention_reference(q, k, v, lengths, page_size=ps, page_table=table, page_ids=ids),
           jnp.float32)
    np.testing.assert_allclose(np.asarray(listed), np.asarray(dense), rtol=1e-5, atol=1e-6)  # same pages
    mask = np.asarray(pool_slot_mask(lengths, table, N, page_size=ps))
    np.testing.assert_array_equal(mask.reshape(1, 2, M, ps).all(-1), [[[True, False, True], [False, True, False]]])


# --- bad pool-mode input: raised before jit, naming the value -------------------------------------------------

def _pool_ok(B=2, Hq=4, Hkv=2, D=64, M=3, ps=16, N=16):
    return dict(q=jnp.zeros((B, Hq, D)), k=jnp.zeros((N, ps, D)), v=jnp.zeros((N, ps, D)),
                lengths=jnp.full((B, Hkv), M * ps, jnp.int32),
                page_table=jnp.arange(B * Hkv * M, dtype=jnp.int32).reshape(B, Hkv, M), page_size=ps)


def _pool_call(**kw):
    a = _pool_ok()
    a.update(kw)
    return decode_attention(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("lengths"), interpret=True, **a)


@pytest.mark.parametrize("kw,match", [
    (dict(lengths=jnp.full((2,), 48, jnp.int32)), r"lengths must be \[B, Hkv\]"),
    (dict(lengths=jnp.full((2, 2), 49, jnp.int32)), r"lengths must lie in \[0, M\*page_size=48\]"),
    (dict(page_table=jnp.asarray(np.tile([0, 16, 2], (2, 2, 1)), jnp.int32)), r"page_table\[0, 0, 1\] = 16"),
    (dict(k=jnp.zeros((2, 2, 48, 64)), v=jnp.zeros((2, 2, 48, 64))), r"pool \[N, page_size, D\]"),
    (dict(page_size=32), "pool pages hold 16 tokens"),
    (dict(page_ids=jnp.full((2, 2, 1), 3, jnp.int32)), r"ids must lie in \[0, 3\)"),
    (dict(bias=jnp.zeros((2, 2, 48))), r"bias must be per pool slot \[N, page_size\]"),
    (dict(layer=0), "layer= indexes a stacked uniform cache"),
    (dict(k=jnp.zeros((16, 16, 64), jnp.int8), v=jnp.zeros((16, 16, 64), jnp.int8), k_scale=jnp.ones((2, 2, 3, 64)),
          v_scale=jnp.ones((16,))), r"k_scale must be \[N, D\]"),
    (dict(page_table=jnp.zeros((2, 3, 3), jnp.int32)), "multiple of kv heads 3"),
])
def test_pool_bad_input_raises(kw, match):
    with pytest.raises(ValueError, match=match):
        _pool_call(**kw)



def _variant_case(rng, B, M, ps, listed, with_bias):
    """A shuffled fp32 pool case (4 query / 2 KV heads, D 32) for the ``pool_variant`` tests, with random listed
    pages when ``listed``: ``(case, lengths, table, page selection kwargs)``."""
    Hkv = 2
    c = _pool_case(rng, B, 4, Hkv, 32, M, ps, jnp.float32, with_bias=with_bias)
    sel = {}
    if listed:
        ids, counts = random_page_lists(rng, c["lengths"].max(axis=1), Hkv, M, ps, list_len=M - 1)
        sel = dict(page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts))
    return c, jnp.asarray(c["lengths"]), jnp.asarray(c["table"]), sel


# which look-ahead variant goes with the dense call and which with the listed one: drawn once per run from the
# run's seed (at collection: the same on every xdist worker)
_AHEAD = ("ahead1", "ahead2")[::1 - 2 * int(seeded_rng().integers(2))]


@pytest.mark.parametrize("listed", [False, True])
def test_pool_variants_match_lanes_bit_for_bit(rng, listed):
    """``pool_variant`` changes how a tile's pool slots are found (per page, one or two tiles ahead, carried by the
    loop), not what is read: the output and the probabilities equal the first kernel's (``"lanes"``) bit for bit
    and match the reference, on a shuffled, NaN-poisoned pool. Tiles of 2 pages, splits of up to 3 tiles
    (``M = 11``, 2 splits, ragged lengths): the look-ahead crosses tiles and runs past a split's end and past a
    short head's length, where it must read nothing. Each look-ahead variant runs in every run, one with dense
    pages and the other with listed ones, the pairing drawn from the run's seed (both pairings across runs; a
    kernel program per pair, so not all four each run)."""
    variant = _AHEAD[int(listed)]
    print(f"pool_variant={variant!r}")  # shown with a failure
    ps = 8
    c, lengths, table, sel = _variant_case(rng, B=2, M=11, ps=ps, listed=listed, with_bias=True)
    call = lambda v: decode_attention(c["q"], c["k_pool"], c["v_pool"], lengths, page_size=ps,  # noqa: E731
                                      page_table=table, bias=c["bias_pool"], return_probs=True, interpret=True,
                                      block_k=2 * ps, num_splits=2, pool_variant=v, **sel)
    out, probs = call(variant)
    ref_out, ref_probs = decode_attention_reference(c["q"], c["k_pool"], c["v_pool"], lengths, page_size=ps,
                                                    page_table=table, bias=c["bias_pool"], return_probs=True, **sel)
    _check(out, ref_out, jnp.float32)
    _check(probs, ref_probs, jnp.float32)
    base_out, base_probs = call("lanes")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(base_out))
    np.testing.assert_array_equal(np.asarray(probs), np.asarray(base_probs))


@pytest.mark.parametrize("listed", [False, True])
def test_default_pool_variant_is_the_faster_measured_one(rng, listed):
    """``pool_variant=None`` compiles the variant the H200 measured faster for the call's mode (2026-11-27,
    docs/PAGE_POOL.md step 1): ``"ahead1"`` reading every page, ``"lanes"`` reading listed pages -- the program
    (jaxpr) of the default call is the named variant's and differs from the other's."""
    ps = 8
    c, lengths, table, sel = _variant_case(rng, B=1, M=6, ps=ps, listed=listed, with_bias=False)

    def program(**variant):
        return str(jax.make_jaxpr(lambda q: decode_attention(q, c["k_pool"], c["v_pool"], lengths, page_size=ps,
                                                             page_table=table, interpret=True, block_k=2 * ps,
                                                             num_splits=1, **variant, **sel))(c["q"]))

    chosen, other = ("lanes", "ahead1") if listed else ("ahead1", "lanes")
    assert program() == program(pool_variant=chosen)
    assert program() != program(pool_variant=other)


def test_pool_variant_of_an_int8_pool_tile_f32(rng):
    """``dequant="tile_f32"`` (the kernel's per-lane scale path) shares the variants' look-ahead: an int8 pool with
    NaN scales on unheld pages gives ``"lanes"``'s output bit for bit with ``"ahead2"``."""
    B, Hq, Hkv, D, M, ps = 1, 4, 2, 32, 6, 8
    lengths = random_head_lengths(rng, B, Hkv, M, ps)
    table, held, N = shuffled_page_table(rng, lengths, M, ps)
    codes = lambda *s: rng.integers(-127, 128, s).astype(np.int8)  # noqa: E731
    page = lambda x: x.reshape(B, Hkv, M, ps, D)  # noqa: E731
    k = jnp.asarray(place_pages(page(codes(B, Hkv, M * ps, D)), table, held, codes(N, ps, D)))
    v = jnp.asarray(place_pages(page(codes(B, Hkv, M * ps, D)), table, held, codes(N, ps, D)))
    ks = jnp.asarray(place_pages(2.0 ** rng.integers(-9, -5, (B, Hkv, M, D)), table, held, np.full((N, D), np.nan)),
                     jnp.float32)
    vs = jnp.asarray(place_pages(2.0 ** rng.integers(-9, -5, (B, Hkv, M)), table, held, np.full(N, np.nan)),
                     jnp.float32)
    q = jnp.asarray(rng.standard_normal((B, Hq, D)), jnp.bfloat16)
    la, ta = jnp.asarray(lengths), jnp.asarray(table)
    call = lambda v_: decode_attention(q, k, v, la, page_size=ps, page_table=ta, k_scale=ks, v_scale=vs,  # noqa
                                       dequant="tile_f32", interpret=True, block_k=2 * ps, num_splits=1,
                                       pool_variant=v_)
    out = call("ahead2")
    _check(out, decode_attention_reference(q, k, v, la, page_size=ps, page_table=ta, k_scale=ks, v_scale=vs),
           jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(call("lanes"), np.float32))


def test_pool_variant_bad_value_raises():
    with pytest.raises(ValueError, match="pool_variant='tiles' must be one of"):
        _pool_call(pool_variant="tiles")
    a = _pool_ok()
    with pytest.raises(ValueError, match="pool_variant='ahead2' is for pool mode"):
        decode_attention(a["q"], jnp.zeros((2, 2, 48, 64)), jnp.zeros((2, 2, 48, 64)), jnp.full((2,), 48),
                         page_size=16, pool_variant="ahead2", interpret=True)
