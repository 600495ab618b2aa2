"""The cache as a page pool (issue 38, docs/PAGE_POOL.md, migration step 2; `sparsekv_jax.cache_pooled`).

A uniform cache (`init_cache`, `write_chunk`, `summarize_pages`, `append_token`: the code the engine runs
today) is the reference. The same random prompt written into the prefill pool's stacked view must give
that cache byte for byte, every leaf, bf16 and int8 K/V; read through the tables it is the uniform layer.

Then the pool's pages are *shuffled*: every page moved to a random place, the tables relabelled, and every
page no table points to filled with junk (NaN, random codes and positions). The readers (`layer_pages`,
`summarize_pool`, `pool_page_mean`), three decode appends (one opening a page popped from the free stack,
one opening a page the head already held past its length, quantised ones re-scaling a page) and the decode
kernel's pool mode must give exactly what they give on the identity pool, and the identity pool exactly what
the uniform cache gives: nothing reads a page except through the table.

Each test in bf16 or int8, drawn from the run's seed with both drawn each run (`KV_DTYPE_OF`; ``pytest --seed N``
replays a draw).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.cache import append_token, init_cache, layer_view, page_mean, summarize_pages, write_chunk
from sparsekv_jax.cache_pool import owned
from sparsekv_jax.cache_pooled import (
    PoolCache,
    append_token_pool,
    decode_kernel_args,
    init_pool,
    layer_kv,
    layer_lengths,
    layer_pages,
    pool_from_stack,
    pool_page_mean,
    reserve_token,
    shuffle_pages,
    stack_view,
    summarize_pool,
    with_stack,
)
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.pallas.decode import decode_attention
from sparsekv_jax.pallas.testing import junk_like

L, B, H, D, ps = 2, 2, 2, 32, 16
P, M = 2, 4  # the prompt's pages per head, the most a head may hold
SPARE = 5  # pool pages past the prefill's L·B·H·P
N = L * B * H * P + SPARE
LENGTHS = np.array([P * ps, ps - 2])  # row 0 fills its pages (its appends pop); row 1's third append opens page 1
CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=64, num_layers=L, num_heads=2 * H, num_kv_heads=H,
                  head_dim=D, intermediate_size=48, max_position_embeddings=512, eos_token_ids=(0,))
KV_DTYPES = [None, "int8"]  # bf16 K/V, int8 codes with scales
# each test below in one store, drawn from the run's seed with both stores drawn each run: every (test, store) over
# runs, a failing draw replays with ``--seed`` (each store compiles its own operations)
_DRAW = seeded_rng()
KV_DTYPE_OF = dict(zip(("identity", "shuffled", "kernel"), [KV_DTYPES[i] for i in _DRAW.permutation(
    [0, 1, _DRAW.integers(2)])], strict=True))


def _prompt(rng: np.random.Generator):
    T = P * ps
    k, v = (jnp.asarray(rng.standard_normal((L, B, H, T, D)), jnp.bfloat16) for _ in range(2))
    return k, v, jnp.broadcast_to(jnp.arange(T), (B, T))


def _write_prompt(layers, k, v, pos):
    """The prefill's writes, layer by layer, into a stacked cache (today's `write_chunk`) and its summaries."""
    lengths = jnp.asarray(LENGTHS)
    written = [write_chunk(layer_view(layers, l), k[l], v[l], 0, pos, lengths) for l in range(L)]
    return summarize_pages(jax.tree.map(lambda *a: jnp.stack(a), *written), lengths, ps)


def _prefill(rng, kv_dtype):
    """``(uniform stacked layers [L, B, H, M·ps, ...], identity pool)`` holding the same random prompt."""
    k, v, pos = _prompt(rng)
    uniform = init_cache(CFG, B, M * ps, page_size=ps, kv_dtype=kv_dtype).layers
    uniform = _write_prompt(uniform, k, v, pos)
    pool = init_pool(CFG, B, M * ps, prompt=P * ps, num_pages=N, page_size=ps, kv_dtype=kv_dtype)
    view = _write_prompt(stack_view(pool), k, v, pos)  # the engine's prefill, on the pool's view
    pool = summarize_pool(with_stack(pool, view, jnp.asarray(LENGTHS)))
    return uniform, pool


def _permute(pool: PoolCache, rng: np.random.Generator) -> PoolCache:
    """The same pool with its pages at random places and junk in every page no (layer, row, head) owns."""
    shuffled = shuffle_pages(pool, rng.permutation(N), junk_like(rng))
    held = np.asarray(owned(shuffled.alloc)).sum()
    assert held == L * B * H * P and held < N
    return shuffled


def _assert_tree_equal(got, want, what):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                      err_msg=f"{what}: {jax.tree_util.keystr(path)}")


def _assert_same_heads(a: PoolCache, b: PoolCache, what: str):
    """Two pools hold the same tokens: per layer, every slot below a head's length and every page it owns
    read alike through the tables (slots past the length of a page popped from the stack may differ)."""
    for l in range(L):
        np.testing.assert_array_equal(layer_lengths(a, l), layer_lengths(b, l))
        n = np.asarray(layer_lengths(a, l))
        pa, pb = layer_pages(a, l), layer_pages(b, l)
        live = (np.arange(M * ps) < n[..., None]).reshape(B, H, M, ps)
        held = np.arange(M) < np.asarray(a.alloc.held).reshape(L, B, H)[l][..., None]
        for name in ("k", "v", "positions", "bias", "page_sum", "page_min", "page_max", "page_max_bias",
                     "k_scale", "k_zero", "v_scale"):
            x, y = getattr(pa, name), getattr(pb, name)
            if x is None:
                continue
            mask = live if name in ("k", "v", "positions", "bias") else held
            np.testing.assert_array_equal(np.asarray(x, np.float32)[mask], np.asarray(y, np.float32)[mask],
                                          err_msg=f"{what}: layer {l} {name}")


@pytest.mark.parametrize("kv_dtype", [KV_DTYPE_OF["identity"]])
def test_identity_prefill_pool_is_the_stacked_cache(rng, kv_dtype):
    """The prefill pool's ids are ``((l·B + b)·H + h)·P + p``; its stacked view holds the uniform cache's first
    ``P`` pages byte for byte, every leaf (summaries by `summarize_pool` against `summarize_pages`); read
    through the tables (`layer_kv`) each layer is the uniform layer, its unowned pages an empty cache's;
    `pool_from_stack` gives the same pool; page means agree with per-head lengths."""
    uniform, pool = _prefill(rng, kv_dtype)
    ids = ((np.arange(L)[:, None, None, None] * B + np.arange(B)[:, None, None]) * H
           + np.arange(H)[:, None]) * P + np.arange(M)
    want = np.where(np.arange(M) < P, ids, N)
    np.testing.assert_array_equal(np.asarray(pool.tables), want)
    np.testing.assert_array_equal(np.asarray(pool.lengths), np.broadcast_to(LENGTHS[None, :, None], (L, B, H)))
    head = jax.tree.map(lambda a: a[:, :, :, :P * ps] if a.shape[3] == M * ps else a[:, :, :, :P],
                        uniform)
    _assert_tree_equal(stack_view(pool), head, "stack view")
    for l in range(L):
        _assert_tree_equal(layer_kv(pool, l), layer_view(uniform, l), f"layer {l} through the table")
        n = layer_lengths(pool, l)
        np.testing.assert_array_equal(pool_page_mean(pool, l), page_mean(layer_view(uniform, l),
                                                                          jnp.asarray(LENGTHS), ps))
        assert n.shape == (B, H)
    rebuilt = pool_from_stack(stack_view(pool), jnp.asarray(LENGTHS), pool.next_position, page_size=ps,
                              num_pages=N, max_pages_per_head=M)
    _assert_tree_equal(rebuilt.pages, pool.pages, "pool_from_stack")
    np.testing.assert_array_equal(rebuilt.alloc.table, pool.alloc.table)


def _appends(rng, kv_dtype):
    """The identity pool, its shuffled copy and the uniform cache after the prefill and each of three appends."""
    uniform, ident = _prefill(rng, kv_dtype)
    perm = _permute(ident, rng)
    length = jnp.asarray(LENGTHS)
    states = [(uniform, ident, perm)]
    for step in range(3):
        kn, vn = (rng.standard_normal((L, B, H, D)) for _ in range(2))
        if step == 1:  # outliers: their pages' scales grow (row 0's page 2, row 1's full page 0)
            kn, vn = kn * 40, vn * 40
        kn, vn = jnp.asarray(kn, jnp.bfloat16), jnp.asarray(vn, jnp.bfloat16)
        pos = length
        for l in range(L):
            uniform = append_token(uniform, kn[l], vn[l], length, pos, length + 1, ps, layer=l)
        pools = []
        for pool in (ident, perm):
            pool, page, offset = reserve_token(pool, jnp.ones((B,), bool))
            for l in range(L):
                pool = append_token_pool(pool, l, kn[l], vn[l], pos, page[l], offset[l])
            pools.append(pool)
        ident, perm = pools
        length = length + 1
        states.append((uniform, ident, perm))
    return states


@pytest.mark.parametrize("kv_dtype", [KV_DTYPE_OF["shuffled"]])
def test_shuffled_pool_reads_and_appends_as_the_identity_one(rng, kv_dtype):
    """Readers and appends through a shuffled table (junk in every unowned page) give exactly the identity
    pool's results, and the identity pool's appends give exactly the uniform `append_token`'s cache, after
    each of three appends: one opening a page popped from the stack (row 0), one opening a page held past
    the head's length (row 1, third append), quantised ones re-scaling the pages they write (second append)."""
    states = _appends(rng, kv_dtype)
    uniform0, ident0, perm0 = states[0]
    for l in range(L):  # readers on the prefill pool
        _assert_tree_equal(layer_pages(perm0, l), layer_pages(ident0, l), f"layer_pages {l}")
        np.testing.assert_array_equal(pool_page_mean(perm0, l), pool_page_mean(ident0, l))
    _assert_same_heads(summarize_pool(perm0), ident0, "summarize_pool on the shuffled pool")
    for step, (uniform, ident, perm) in enumerate(states[1:], 1):
        for l in range(L):
            _assert_tree_equal(layer_kv(ident, l), layer_view(uniform, l), f"append {step}, identity pool")
            np.testing.assert_array_equal(pool_page_mean(perm, l), pool_page_mean(ident, l))
        _assert_same_heads(perm, ident, f"append {step}, shuffled pool")
        _assert_same_heads(summarize_pool(perm), summarize_pool(ident), f"append {step}, summarize_pool")
    # the cases the docstring promises were exercised
    held = [np.asarray(s[1].alloc.held).reshape(L, B, H) for s in states]
    assert (held[1][:, 0] == P + 1).all() and (held[1][:, 1] == P).all(), "row 0 pops a page, row 1 does not"
    assert int(states[-1][1].alloc.num_free) == SPARE - L * H
    if kv_dtype is not None:
        vs = [np.asarray(s[0].v_scale, np.float32) for s in states]
        assert (vs[2][:, 0, :, P] > vs[1][:, 0, :, P]).all(), "the outlier re-scales row 0's new page"
        assert (vs[2][:, 1, :, 0] > vs[1][:, 1, :, 0]).all(), "the outlier re-scales row 1's prompt page"


@pytest.mark.parametrize("kv_dtype", [KV_DTYPE_OF["kernel"]])
def test_decode_kernel_on_a_shuffled_pool_is_the_uniform_kernel(rng, kv_dtype):
    """The decode kernel's pool mode (interpret) on the shuffled pool after the appends, fed by
    `decode_kernel_args`, equals the uniform kernel on the stacked cache (``layer=l``) bit for bit."""
    uniform, _, perm = _appends(rng, kv_dtype)[-1]
    length = jnp.asarray(LENGTHS) + 3
    q = jnp.asarray(rng.standard_normal((B, 2 * H, D)), jnp.bfloat16)
    tune = dict(interpret=True, block_k=32, num_splits=2)
    for l in range(L):
        out = decode_attention(q, page_size=ps, **decode_kernel_args(perm, l), **tune)
        want = decode_attention(q, uniform.k, uniform.v, length, page_size=ps, layer=l, bias=uniform.bias,
                                k_scale=uniform.k_scale, v_scale=uniform.v_scale, k_zero=uniform.k_zero, **tune)
        assert np.isfinite(np.asarray(out, np.float32)).all()
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_bad_input_is_refused(rng):
    """Clear errors before any work: a prompt longer than the pool's heads may hold, a pool too small for the
    prefill, a stack of the wrong shape, appends of the wrong shapes."""
    with pytest.raises(ValueError, match="exceed max_pages_per_head"):
        init_pool(CFG, B, 32, prompt=64, page_size=ps)
    with pytest.raises(ValueError, match="num_pages=3 is smaller"):
        init_pool(CFG, B, 32, num_pages=3, page_size=ps)
    pool = init_pool(CFG, B, M * ps, prompt=P * ps, num_pages=N, page_size=ps)
    with pytest.raises(ValueError, match="layers.k is"):
        with_stack(pool, init_cache(CFG, B, M * ps, page_size=ps).layers, jnp.asarray(LENGTHS))
    with pytest.raises(ValueError, match="active must be"):
        reserve_token(pool, jnp.ones((B, H), bool))
    z = jnp.zeros((B, H), jnp.int32)
    with pytest.raises(ValueError, match="k_new/v_new"):
        append_token_pool(pool, 0, jnp.zeros((B, D)), jnp.zeros((B, D)), jnp.zeros((B,), jnp.int32), z, z)


def test_decode_step_under_jit_scans_the_layers(rng):
    """The engine's shape of a decode step: one `reserve_token`, then a traced layer index (`lax.fori_loop`)
    writing each layer's token, all under `jax.jit`, gives the eager per-layer appends' pool (which the test
    above checks against the uniform cache), on a shuffled int8 pool."""
    _, ident = _prefill(rng, "int8")
    pool = _permute(ident, rng)
    kn, vn = (jnp.asarray(rng.standard_normal((L, B, H, D)), jnp.bfloat16) for _ in range(2))
    pos = jnp.asarray(LENGTHS)

    def step(pool):
        pool, page, offset = reserve_token(pool, jnp.ones((B,), bool))
        return jax.lax.fori_loop(0, L, lambda l, p: append_token_pool(p, l, kn[l], vn[l], pos, page[l], offset[l]),
                                 pool)

    eager, page, offset = reserve_token(pool, jnp.ones((B,), bool))
    for l in range(L):
        eager = append_token_pool(eager, l, kn[l], vn[l], pos, page[l], offset[l])
    _assert_same_heads(jax.jit(step)(pool), eager, "jit + fori_loop")
