"""CHESS's `rope_page_sums` in page-pool mode (issue 38, docs/PAGE_POOL.md, migration step 1), interpret mode.

Each case draws per-head keys ``[B, H, M·ps, D]`` with a length per (row, head), lays their pages out in a pool
``[N, ps, D]`` through a *shuffled* page table (a random permutation of the pool's pages, a few spare pages, and
now and then a page held past a head's length, as after a rewind; `sparsekv_jax.pallas.testing`'s
`shuffled_page_table`, `poisoned_pool`), and checks pool mode against

* a float64 numpy loop turning each key back by its slot (independent of the code under test),
* the jnp reference's pool mode, which gathers the pool back through the table, and
* the uniform kernel on the same keys as a stack (zero past each head's length): the same loads in the same
  order, so the sums agree to the bit.

Everything the kernel must not read is NaN: spare pages, pages held past a length, slots of a partial page past
its head's length, so a read through a wrong table entry or past a length turns the sums into NaN. A page at or
past a head's length gives zero, as an unheld page.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.pallas.page_rope import rope_page_sums, rope_page_sums_reference
from sparsekv_jax.pallas.testing import poisoned_pool, random_head_lengths, shuffled_page_table


def _inv_freq(rng: np.random.Generator, D: int) -> np.ndarray:
    return 1.0 / (rng.uniform(100, 10000) ** (np.arange(0, D, 2) / D))


def _rotate_back(x: np.ndarray, angle: np.ndarray) -> np.ndarray:
    """R(-angle) on [..., D] in the rotate-half layout, float64."""
    x1, x2 = np.split(x, 2, axis=-1)
    c, s = np.cos(angle), np.sin(angle)
    return np.concatenate([x1 * c + x2 * s, x2 * c - x1 * s], axis=-1)


def _loop(keys: np.ndarray, lengths: np.ndarray, inv_freq: np.ndarray, M: int, ps: int) -> np.ndarray:
    """float64 ``[B, H, M, D]``: page ``m`` of (b, h) sums ``R(-j)·keys[b, h, m·ps + j]`` below the head's length."""
    B, H, _, D = keys.shape
    want = np.zeros((B, H, M, D))
    for (b, h), n in np.ndenumerate(lengths):
        for t in range(n):
            want[b, h, t // ps] += _rotate_back(keys[b, h, t], (t % ps) * inv_freq)
    return want


@pytest.mark.parametrize("H,M,ps,D,block_p,dtype", [
    (3, 5, 8, 32, 16, jnp.float32),    # M < block_p: one padded block per head
    (2, 20, 4, 16, 16, jnp.bfloat16),  # M past one block: a second, partial block (D/2 = 8)
    (2, 4, 16, 64, 32, jnp.bfloat16),
])
def test_pool_matches_loop_reference_and_uniform_kernel(rng, H, M, ps, D, block_p, dtype):
    B = 2
    S = M * ps
    inv_freq = _inv_freq(rng, D)
    lengths = random_head_lengths(rng, B, H, M, ps)
    table, held, N = shuffled_page_table(rng, lengths, M, ps)
    inside = np.arange(S) < lengths[..., None]  # [B, H, S] a head's own tokens
    keys = np.asarray(jnp.asarray(rng.standard_normal((B, H, S, D)), dtype).astype(jnp.float32), np.float64)
    pool = poisoned_pool(keys, lengths, table, held, N)
    k_pool, la, ta = jnp.asarray(pool, dtype), jnp.asarray(lengths), jnp.asarray(table)

    out = rope_page_sums(k_pool, inv_freq, page_size=ps, page_table=ta, lengths=la, block_p=block_p, interpret=True)
    assert out.shape == (B, H, M, D) and out.dtype == jnp.float32
    got = np.asarray(out)
    assert np.isfinite(got).all(), "NaN in the pool kernel's sums: a poisoned page or slot was read"
    want = _loop(keys, lengths, inv_freq, M, ps)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    past = np.arange(M) >= -(-lengths // ps)[..., None]  # pages at or past a head's length: unheld, or held
    assert past.any() and np.all(got[past] == 0), "a page past a head's length must sum to zero"
    assert np.all(got[-1, -1] == 0), "an empty head must give zeros"
    ref = rope_page_sums_reference(k_pool, inv_freq, page_size=ps, page_table=ta, lengths=la)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-4)
    # the uniform kernel on the same keys, a one-layer stack with zeros past each head's length: the same bits
    stack = jnp.asarray(np.where(inside[..., None], keys, 0.0)[None], dtype)
    uniform = rope_page_sums(stack, inv_freq, 0, page_size=ps, block_p=block_p, interpret=True)
    np.testing.assert_array_equal(got, np.asarray(uniform))


def test_pool_identity_table_of_a_stacked_cache_is_its_layer(rng):
    """The stacked cache ``[L, B, H, S, D]`` reshaped into pages is a pool whose identity table for layer ``l`` is
    ``((l·B + b)·H + h)·P + p`` (docs/PAGE_POOL.md, Readers): with every head at the full length, pool mode gives
    the ``layer=l`` call's sums bit for bit, the layer traced under ``jit``, kernel and reference alike; every
    other layer is NaN."""
    L, B, H, P, ps, D = 3, 2, 2, 6, 8, 32
    S, layer = P * ps, int(rng.integers(L))
    inv_freq = _inv_freq(rng, D)
    k1 = jnp.asarray(rng.standard_normal((B, H, S, D)), jnp.bfloat16)
    k = jnp.stack([k1 if i == layer else jnp.full_like(k1, jnp.nan) for i in range(L)])
    ids = jnp.arange(L * B * H * P, dtype=jnp.int32).reshape(L, B, H, P)
    full = jnp.full((B, H), S, jnp.int32)

    def both(fn, **kw):
        pool = jax.jit(lambda k, i: fn(k.reshape(-1, ps, D), inv_freq, page_size=ps, page_table=ids[i], lengths=full,
                                       **kw))(k, jnp.int32(layer))
        stacked = jax.jit(lambda k, i: fn(k, inv_freq, i, page_size=ps, **kw))(k, jnp.int32(layer))
        return np.asarray(pool), np.asarray(stacked)

    pool, stacked = both(rope_page_sums, block_p=16, interpret=True)
    assert pool.shape == (B, H, P, D) and np.isfinite(pool).all()
    np.testing.assert_array_equal(pool, stacked)
    pool_ref, stacked_ref = both(rope_page_sums_reference)
    np.testing.assert_array_equal(pool_ref, stacked_ref)
    np.testing.assert_allclose(pool, pool_ref, rtol=1e-5, atol=1e-4)


def test_pool_unmapped_entries_under_jit_read_nothing(rng):
    """Under ``jit`` (no value checks) a table entry a length reaches but holding the sentinel, a negative id or one
    past the pool reads nothing, nor does a length past ``M·ps``: those pages sum to zero, the others are read, and
    the kernel matches the reference, which masks them."""
    M, ps, D, N = 3, 4, 16, 8  # one row, two heads
    inv_freq = _inv_freq(rng, D)
    k = jnp.asarray(rng.standard_normal((N, ps, D)), jnp.float32)
    table = jnp.asarray([[[3, N, 5], [-2, 1, N + 4]]], jnp.int32)
    lengths = jnp.asarray([[M * ps + 5, M * ps - 1]], jnp.int32)
    call = jax.jit(lambda n, t: rope_page_sums(k, inv_freq, page_size=ps, page_table=t, lengths=n, interpret=True))
    got = np.asarray(call(lengths, table))
    ref = np.asarray(jax.jit(lambda n, t: rope_page_sums_reference(k, inv_freq, page_size=ps, page_table=t,
                                                                   lengths=n))(lengths, table))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    read = np.array([[[True, False, True], [False, True, False]]])
    assert np.all(got[~read] == 0) and np.all(np.abs(got[read]).sum(-1) > 0)
    want = _rotate_back(np.asarray(k, np.float64), np.arange(ps)[:, None] * inv_freq).sum(1)  # whole pool pages
    np.testing.assert_allclose(got[0, 0, [0, 2]], want[[3, 5]], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(got[0, 1, 1], want[1], rtol=1e-5, atol=1e-4)


# --- bad pool-mode input: raised before jit, naming the value -------------------------------------------------

def _pool_ok(B=2, H=2, M=3, ps=4, D=16, N=16):
    return dict(k=jnp.zeros((N, ps, D)), inv_freq=np.ones(D // 2), page_size=ps,
                page_table=jnp.arange(B * H * M, dtype=jnp.int32).reshape(B, H, M),
                lengths=jnp.full((B, H), M * ps, jnp.int32))


@pytest.mark.parametrize("fn", [rope_page_sums, rope_page_sums_reference])
@pytest.mark.parametrize("kw,match", [
    (dict(layer=0), "layer= indexes a stacked uniform cache"),
    (dict(lengths=None), r"with page_table, lengths \[B, H\]"),
    (dict(lengths=jnp.full((2,), 12, jnp.int32)), r"lengths must be an int array \[B, H\]=\[2, 2\]"),
    (dict(lengths=jnp.full((2, 2), 12.0)), r"lengths must be an int array .* got float32"),
    (dict(lengths=jnp.full((2, 2), 13, jnp.int32)), r"lengths must lie in \[0, M\*page_size=12\]"),
    (dict(lengths=jnp.full((2, 2), -1, jnp.int32)), "got min -1"),
    (dict(page_table=jnp.asarray(np.tile([0, 16, 2], (2, 2, 1)), jnp.int32)), r"page_table\[0, 0, 1\] = 16"),
    (dict(page_table=jnp.asarray(np.tile([0, 1, -1], (2, 2, 1)), jnp.int32)), r"page_table\[0, 0, 2\] = -1"),
    (dict(page_table=jnp.zeros((2, 2, 3))), r"page_table must be an int array \[B, H, M>=1\], got float32"),
    (dict(page_table=jnp.zeros((2, 3), jnp.int32)), r"page_table must be .* of shape \(2, 3\)"),
    (dict(k=jnp.zeros((1, 2, 2, 12, 16))), r"k must be a pool \[N, page_size, D\], got shape \(1, 2, 2, 12, 16\)"),
    (dict(page_size=8), r"pool pages hold 4 tokens \(k.shape\[1\]\) but page_size=8"),
    (dict(k=jnp.zeros((16, 4, 16), jnp.int8)), "k must be floating point, got int8"),
    (dict(inv_freq=np.ones(4)), "inv_freq has 4 frequencies, expected head_dim/2 = 8"),
])
def test_pool_bad_input_raises(fn, kw, match):
    a = {**_pool_ok(), **kw, **(dict(interpret=True) if fn is rope_page_sums else {})}
    with pytest.raises(ValueError, match=match):
        fn(a.pop("k"), a.pop("inv_freq"), **a)


def test_mode_mixups_raise():
    """``lengths`` belong to pool mode, and a call names its layer or its table."""
    k = jnp.zeros((2, 1, 1, 8, 16))
    for fn in (rope_page_sums, rope_page_sums_reference):
        with pytest.raises(ValueError, match="lengths= is for pool mode"):
            fn(k, np.ones(8), 0, page_size=4, lengths=jnp.full((1, 1), 8, jnp.int32))
        with pytest.raises(ValueError, match="needs layer= .* or page_table="):
            fn(k, np.ones(8), page_size=4)
    with pytest.raises(ValueError, match="block_p=24"):
        rope_page_sums(**_pool_ok(), block_p=24, interpret=True)
    with pytest.raises(ValueError, match="head_dim=24"):
        rope_page_sums(jnp.zeros((4, 4, 24)), np.ones(12), page_size=4, page_table=jnp.zeros((1, 1, 1), jnp.int32),
                       lengths=jnp.ones((1, 1), jnp.int32), interpret=True)
