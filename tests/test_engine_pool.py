"""Full attention decoding from a page pool, ``Options(pool=True)`` (issue 38, docs/PAGE_POOL.md,
migration step 4's first slice; experimental): the same tokens and logits as today's uniform cache,
on the jnp path and on the decode kernel's pool mode (interpreted), fp32, bf16 and int8 (each store on one
backend a run, drawn from the seed: every pairing over runs); pages
moved at random after the prefill (junk in the pages nobody owns) change nothing; a pool that runs
out raises after the run, naming the pages needed; a policy that cannot run on a pool is refused (the
compressors that can: tests/test_engine_pool_compress.py).

Tiny random model (head_dim 16: the kernel's smallest); ragged batch of 2 whose first row opens a
page while decoding and whose second fills the pages its prompt left. Draws from the run's seed
(tests/conftest.py: printed in the header, ``pytest --seed N`` replays it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import decode_forced, seeded_rng

from sparsekv_jax import engine
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import pages_for
from sparsekv_jax.cache_pooled import PoolCache, shuffle_pages
from sparsekv_jax.engine.programs import decode_program
from sparsekv_jax.generate import PAD_TOKEN, generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.pallas.testing import junk_like
from sparsekv_jax.policies import FullKV, parse_policy

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=128, eos_token_ids=(0,))
T, LENGTHS, NEW, PS = 20, np.array([20, 13]), 10, 8  # row 0 opens a 4th page at its 25th token; row 1 does not
BACKENDS = {"jnp": Backend(), "kernel": Backend.kernels()}  # the kernel interpreted on a CPU
STORES = {"fp32": (jnp.float32, None), "bf16": (jnp.bfloat16, None), "int8": (jnp.float32, "int8")}
# each store runs on one backend, drawn from the run's seed with both backends drawn (the kernel's cases compile
# slowly): every (backend, store) pair is covered over runs and a failing pairing replays with ``--seed``
_DRAW = seeded_rng()
BACKEND_OF = dict(zip(STORES, [list(BACKENDS)[i] for i in _DRAW.permutation([0, 1, _DRAW.integers(2)])], strict=True))


@pytest.fixture(scope="module")
def weights():
    key = jax.random.key(int(seeded_rng().integers(1 << 30)))
    return {dtype: random_params(CFG, key, dtype, scale=0.3) for dtype in (jnp.float32, jnp.bfloat16)}


def _case(weights, backend: str, store: str):
    dtype, kv_dtype = STORES[store]
    return weights[dtype], dict(lengths=LENGTHS, page_size=PS,
                                backend=dataclasses.replace(BACKENDS[backend], kv_dtype=kv_dtype))


def _pages_needed(lengths, new: int) -> int:
    """L·Hkv·Σ_rows max(prompt pages, pages for the prompt and the new - 1 tokens fed back), by hand."""
    P = -(-T // PS)
    return CFG.num_layers * CFG.num_kv_heads * sum(max(P, -(-(int(n) + new - 1) // PS)) for n in lengths)


@pytest.mark.share(2)
@pytest.mark.parametrize("store", list(STORES))
def test_pool_decodes_full_attentions_tokens_and_logits(weights, rng, store):
    """`generate` and `teacher_force` with ``pool=True``: the default path's tokens, and its logits within
    1e-5 (they came out equal bit for bit in every case here); the pool holds what the run wrote. Each store on
    one backend, `BACKEND_OF` (drawn from the run's seed, both backends each run; every pairing over runs)."""
    backend = BACKEND_OF[store]
    print(f"{store} on the {backend} backend")
    params, kw = _case(weights, backend, store)
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    want = generate(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(), **kw)
    got = generate(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(), pool=True, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert isinstance(got.cache, PoolCache) and not isinstance(want.cache, PoolCache)
    L, B, H = CFG.num_layers, 2, CFG.num_kv_heads
    # every head holds its prompt and the NEW - 1 tokens fed back; its row's pages, never another's
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), np.broadcast_to((LENGTHS + NEW - 1)[None, :, None],
                                                                                  (L, B, H)))
    held = np.asarray(got.cache.alloc.held).reshape(L, B, H)
    np.testing.assert_array_equal(held[:, 0], 4)  # row 0 opened its 4th page (29 tokens)
    np.testing.assert_array_equal(held[:, 1], 3)  # row 1 filled its prompt's 3 pages (22 tokens)
    assert got.stats["cache_capacity"] == want.stats["cache_capacity"]
    np.testing.assert_array_equal(np.asarray(got.stats["kv_stored_fraction"]), 1.0)
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    want_logits, _ = teacher_force(params, FullKV(), tokens, forced, **kw)
    got_logits, _ = teacher_force(params, FullKV(), tokens, forced, pool=True, **kw)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)


def test_a_stopped_row_writes_nothing_more(weights, rng):
    """With a stop token one row meets early, the pool path gives the default path's tokens, and the
    stopped row's heads hold its prompt and the tokens fed back before it stopped, nothing after."""
    params, kw = _case(weights, "jnp", "fp32")
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    free_run = np.asarray(generate(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(), **kw).tokens)
    # a token one row meets by its 4th and the other never: that row stops while the other decodes on
    stops = [(b, int(t)) for b in (1, 0) for t in free_run[b, :4] if t not in free_run[1 - b]]
    assert stops, free_run
    row, stop = stops[0]
    want = generate(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(stop,), **kw)
    got = generate(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(stop,), pool=True, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    n = np.asarray(got.num_generated)
    assert n[row] <= 4 and n[1 - row] == NEW, n
    fed = LENGTHS + n - 1  # every token but the last sampled one is fed back
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), np.broadcast_to(fed[None, :, None], (2, 2, 2)))


def test_shuffled_pool_decodes_the_same(weights, rng):
    """After the prefill the pool's pages are moved by a random permutation and every page nobody owns
    filled with junk (NaN, random positions): the decode opens some of them and still gives the default path's
    tokens and logits, so nothing reads a page except through the tables. jnp, fp32 (full attention on the
    interpreted kernel in int8 from a shuffled pool with junk: tests/test_engine_pool_extend.py, each run; every
    compile of that kernel is slow)."""
    params, kw = _case(weights, "jnp", "fp32")
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    want = generate(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(), **kw)
    want_logits, _ = teacher_force(params, FullKV(), tokens, forced, **kw)
    session = engine.Session.start(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(), pool=True,
                                   pool_pages=40, **kw)
    pre = session.prefill()
    pool = pre.cache
    assert pool.num_pages == 40 and int(pool.alloc.num_free) == 40 - 24  # the prompt's 2·2·2·3 pages; 16 free
    session.prefilled = pre.replace(cache=shuffle_pages(pool, rng.permutation(40), junk_like(rng)))
    got = session.decode()
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    # the logits along `forced`, step by step from the shuffled pool
    np.testing.assert_allclose(decode_forced(params, session, forced)[0], np.asarray(want_logits), atol=1e-5, rtol=1e-5)


def test_a_pool_that_runs_out_raises_after_the_run(weights, rng):
    """A pool of exactly the pages the run needs decodes as today; one page fewer sets the allocator's
    overflow when row 0 opens its 4th pages (four heads, three free pages): that row stops without the
    token of that step, the other row is untouched, and `generate` / `teacher_force` raise naming the
    pages needed and the pool's size."""
    params, kw = _case(weights, "jnp", "fp32")
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    need = _pages_needed(LENGTHS, NEW)
    assert need == 28  # 2 layers · 2 heads · (4 + 3)
    want = generate(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(), **kw)
    exact = generate(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(), pool=True, pool_pages=need, **kw)
    np.testing.assert_array_equal(np.asarray(exact.tokens), np.asarray(want.tokens))
    assert int(exact.cache.alloc.num_free) == 0
    msg = rf"rows \[0\] needed a page .*pool_pages={need - 1} .*needs up to {need} pages"
    with pytest.raises(ValueError, match=msg):
        generate(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(), pool=True, pool_pages=need - 1, **kw)
    with pytest.raises(ValueError, match=msg):
        teacher_force(params, FullKV(), tokens, rng.integers(1, CFG.vocab_size, (2, NEW)), pool=True,
                      pool_pages=need - 1, **kw)
    # what the loop did (the program, before the host check): row 0's tokens up to the step before it
    # lacked a page (its 25th token is written by step 5: the first token and steps 1-4 are kept)
    run = engine.setup(params, FullKV(), tokens, max_new_tokens=NEW, stop_tokens=(), pool=True,
                       pool_pages=need - 1, **kw)
    out = decode_program(params, run, engine.prepare(params, run), jax.random.key(0))
    toks, ref = np.asarray(out.tokens), np.asarray(want.tokens)
    np.testing.assert_array_equal(toks[0, :5], ref[0, :5])
    np.testing.assert_array_equal(toks[0, 5:], PAD_TOKEN)
    np.testing.assert_array_equal(toks[1], ref[1])
    np.testing.assert_array_equal(np.asarray(out.cache.alloc.overflow).reshape(2, 2), [[False, False], [True, False]])


def test_pool_option_is_refused_where_not_supported(weights, rng):
    """Before jit, naming the value: a policy that cannot run on a pool (the compressors that can:
    tests/test_engine_pool_compress.py), pool_pages without pool or below the prefill's pages (a suffix or room
    for questions runs on a pool before every decode stage that does: tests/test_engine_pool_extend.py,
    tests/test_engine_pool_suffix_h2o_chess.py)."""
    params = weights[jnp.float32]
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    for spec, name in [("chess(keys='post_rope')", r"CHESS-moderate\[post-RoPE\]")]:  # CHESS itself runs on a pool
        with pytest.raises(ValueError, match=rf"pool=True is experimental and policy {name} does not decode"):
            engine.setup(params, parse_policy(spec), tokens, pool=True)
        with pytest.raises(ValueError, match=rf"policy {name} does not"):
            generate(params, parse_policy(spec), tokens, pool=True, max_new_tokens=2)
    with pytest.raises(ValueError, match="pool_pages=30 without pool=True"):
        engine.setup(params, FullKV(), tokens, pool_pages=30)
    prefill_pages = CFG.num_layers * 2 * CFG.num_kv_heads * pages_for(T, PS)
    with pytest.raises(ValueError, match=rf"pool_pages={prefill_pages - 1} must be an int >= .* = {prefill_pages}"):
        engine.setup(params, FullKV(), tokens, page_size=PS, pool=True, pool_pages=prefill_pages - 1)
    with pytest.raises(ValueError, match="pool=1 must be True or False"):
        engine.setup(params, FullKV(), tokens, pool=1)
