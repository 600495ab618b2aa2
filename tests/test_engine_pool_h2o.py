"""H2O on a page pool, ``Options(pool=True)`` (issue 38, docs/PAGE_POOL.md, migration step 4; experimental): its
running eviction (``Policy.writes_in_place``) overwrites the logical slot its ``decode_write`` names, through the
head's page table, taking no page, and the step's probabilities at logical slots reach ``decode_observe``
(`engine.pooled._decode_step_in_place`). Against the default uniform path, for a ragged batch of 2 and more new
tokens than any head has room left in its last page (so every head evicts at every step, 11 times): the same
greedy tokens, `teacher_force` logits within 1e-5 (fp32), the same entries kept (positions at each logical
slot), every head at its budget, and a pool of exactly the budget's pages, none reserved while decoding.

Tiny random model (head_dim 16: the kernel's smallest); prompts drawn from the run's seed (tests/conftest.py:
printed in the header, ``pytest --seed N`` replays it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax import engine
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import append_token, init_cache, layer_view, pages_for, summarize_pages, write_chunk
from sparsekv_jax.cache_pooled import (
    PoolCache,
    append_token_pool,
    layer_kv,
    layer_tables,
    logical_positions,
    pool_from_stack,
    shuffle_pages,
)
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import expected_shapes, params_from_arrays
from sparsekv_jax.pallas.testing import junk_like
from sparsekv_jax.policies import FullKV
from sparsekv_jax.policies.h2o import H2O

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=256, eos_token_ids=(0,))
# pages of 4: H2O(0.25) keeps 10 and 7 entries (3 and 2 pages, 2 and 1 free slots), H2O(0.5) 20 and 14 (5 and 4
# pages, 0 and 2 free slots); 12 new tokens write 11 times per head, each an eviction
T, LENGTHS, NEW, PS = 40, np.array([40, 29]), 12, 4
BACKENDS = {"jnp": Backend(), "kernel": Backend.kernels(),  # the kernel interpreted on a CPU
            "kernel-int8": dataclasses.replace(Backend.kernels(), kv_dtype="int8")}


@pytest.fixture(scope="module")
def params():
    """`random_params`' weights (norms near 1, the rest normal at scale 0.3) drawn with NumPy: drawn by JAX eagerly,
    each weight's shape compiled programs of its own (~2 s a module)."""
    rng = seeded_rng()
    return params_from_arrays(CFG, {name: jnp.asarray(1 + 0.1 * rng.standard_normal(shape) if name.endswith("norm")
                                                      else 0.3 * rng.standard_normal(shape), jnp.float32)
                                    for name, shape in expected_shapes(CFG).items()})


def _kw(backend: str) -> dict:
    return dict(lengths=LENGTHS, page_size=PS, backend=BACKENDS[backend], stop_tokens=())


def _budget_pages(budget: float) -> tuple[np.ndarray, int]:
    """``(kept [B], pages)``: each row's budget (floor(budget·length)) and the pages its heads need, over layers."""
    kept = np.floor(budget * LENGTHS + 1e-6).astype(int)
    return kept, CFG.num_layers * CFG.num_kv_heads * sum(pages_for(int(n), PS) for n in kept)


_logical_positions = jax.jit(logical_positions)  # one program (eagerly: one per op)


def _uniform_positions(cache) -> np.ndarray:
    """``[L, B, Hkv, S]`` a uniform cache's positions, -1 at and past each row's length."""
    pos = np.asarray(cache.layers.positions)
    return np.where(np.arange(pos.shape[-1]) < np.asarray(cache.length)[None, :, None, None], pos, -1)


# each budget and each store once (every compile of the interpreted kernel is slow): H2O(0.5) on the jnp path,
# H2O(0.25) on the kernel in int8. H2O(0.25) on the jnp path or on the kernel in fp32 (drawn): the step-by-step test
# below (logits, scores and victims at every step). The shuffled-pool test with a stopped row (tokens): H2O(0.5) on
# jnp, its uniform run without a stop token the jnp-0.5 case's program.
RUNS = {"jnp-0.5": ("jnp", 0.5), "kernel-int8-0.25": ("kernel-int8", 0.25)}


@pytest.mark.share(2)
@pytest.mark.parametrize("case", list(RUNS))
def test_h2o_on_the_pool_gives_the_uniform_tokens_and_logits(params, rng, case):
    """`generate` and `teacher_force` with ``pool=True``: the uniform path's tokens, its logits within 1e-5 (fp32;
    int8: at int8's rounding, 1e-4), the same entries kept at the same logical slots, every head at its row's
    budget, and the pool exactly the budget's pages (the policy's bound), all held, none left or reserved."""
    backend, budget = RUNS[case]
    kw, policy = _kw(backend), H2O(budget)
    kept, pages = _budget_pages(budget)
    assert (pages_for(kept, PS) * PS - kept < NEW - 1).all()  # appending would open pages the pool does not have
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    want = generate(params, policy, tokens, max_new_tokens=NEW, **kw)
    got = generate(params, policy, tokens, max_new_tokens=NEW, pool=True, **kw)
    assert isinstance(got.cache, PoolCache) and not isinstance(want.cache, PoolCache)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(want.cache.length), kept)  # the uniform cache stays at the budget
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), np.broadcast_to(kept[None, :, None], (2, 2, 2)))
    # the same entries evicted: each logical slot holds the uniform slot's position (decoded ones included)
    got_pos, want_pos = np.asarray(_logical_positions(got.cache)), _uniform_positions(want.cache)
    np.testing.assert_array_equal(got_pos, want_pos[..., :got_pos.shape[-1]])
    assert (want_pos[..., got_pos.shape[-1]:] == -1).all()
    assert (got_pos.max(-1) == (LENGTHS + NEW - 2)[None, :, None]).all()  # the last token written is held
    assert got.cache.num_pages == pages == engine.setup(params, policy, tokens, pool=True, **kw).pool_pages
    np.testing.assert_array_equal(np.asarray(got.cache.alloc.held).reshape(2, 2, 2),
                                  np.broadcast_to(pages_for(kept, PS)[None, :, None], (2, 2, 2)))
    assert int(got.cache.alloc.num_free) == 0
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    want_logits, _ = teacher_force(params, policy, tokens, forced, **kw)
    got_logits, _ = teacher_force(params, policy, tokens, forced, pool=True, **kw)
    tol = 1e-4 if "int8" in backend else 1e-5
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=tol, rtol=tol)


def test_h2o_on_a_shuffled_pool_with_room_and_a_row_that_stops(params, rng):
    """One pooled run checks two things. After the compression the decode pool (8 pages more than the budget's) has
    its pages moved by a random permutation and every free page filled with junk (NaN, random positions): the
    eviction's slots, read and written through the tables, give the uniform path's tokens, and the 8 free pages are
    still free at the end (an overwrite takes no page). Row 1 stops early (a stop token taken from the uniform run's
    own output): on the pool it then writes nothing (every head still at its row's budget), and both rows' tokens
    equal the uniform path's (row 0 decodes on, evicting, beside it). (One run, not one each: each stop token set
    compiles its own decode loop; H2O(0.5), whose uniform run without a stop token is the jnp-0.5 case's program.)"""
    kw, policy = _kw("jnp"), H2O(0.5)
    kept, pages = _budget_pages(0.5)
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    free = generate(params, policy, tokens, max_new_tokens=NEW, **kw)
    row1 = np.asarray(free.tokens)[1]
    stop = next(int(t) for t in row1[2:] if t not in np.asarray(free.tokens)[0] and t not in row1[:2])
    kw["stop_tokens"] = (stop,)
    want = generate(params, policy, tokens, max_new_tokens=NEW, **kw)
    n = np.asarray(want.num_generated)
    assert n[0] == NEW and n[1] < NEW, n  # row 1 stopped, row 0 did not
    N = pages + 8
    session = engine.Session.start(params, policy, tokens, max_new_tokens=NEW, pool=True, pool_pages=N, **kw)
    compressed = session.compress()
    assert compressed.cache.num_pages == N and int(compressed.cache.alloc.num_free) == 8
    session.compressed = compressed.replace(cache=shuffle_pages(compressed.cache, rng.permutation(N),
                                                                junk_like(rng)))
    got = session.decode()
    np.testing.assert_array_equal(np.asarray(got.num_generated), n)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert int(got.cache.alloc.num_free) == 8
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), np.broadcast_to(kept[None, :, None], (2, 2, 2)))


def test_h2o_that_appends_on_the_pool(params, rng):
    """The two H2Os whose decode appends (``decode_appends`` all true): ``evict_during_decode=False`` gives the
    uniform path's tokens with every head grown past its budget by the decoded tokens (its pool sized for them),
    and a budget covering the prompt (no compression, no eviction) gives full attention's pool tokens."""
    kw, new = _kw("jnp"), 8
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    grow = H2O(0.25, evict_during_decode=False)
    want = generate(params, grow, tokens, max_new_tokens=new, **kw)
    got = generate(params, grow, tokens, max_new_tokens=new, pool=True, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    kept, _ = _budget_pages(0.25)
    np.testing.assert_array_equal(np.asarray(got.cache.lengths),
                                  np.broadcast_to((kept + new - 1)[None, :, None], (2, 2, 2)))
    full = generate(params, FullKV(), tokens, max_new_tokens=new, pool=True, **kw)
    covering = generate(params, H2O(1.0), tokens, max_new_tokens=new, pool=True, **kw)
    np.testing.assert_array_equal(np.asarray(covering.tokens), np.asarray(full.tokens))
    np.testing.assert_array_equal(np.asarray(covering.cache.lengths), np.asarray(full.cache.lengths))


def test_h2o_pool_scores_follow_the_uniform_scores_step_by_step(params, rng):
    """`decode_step` along forced tokens on either layout (the same jitted step): after every step the logits
    (1e-5) and the accumulated scores of every logical slot (``decode_observe`` fed the pool's probabilities at
    logical slots; 1e-5) equal the uniform cache's, and so do the positions held (the same victims). On the jnp path
    or the interpreted kernel in fp32, drawn from the run's seed (each over runs, a failure replays with ``--seed``;
    each compiles its own steps; both backends run H2O on a pool each run in the tests above)."""
    backend = ("jnp", "kernel")[int(rng.integers(2))]
    print(f"on the {backend} backend")
    kw, policy = _kw(backend), H2O(0.25, recent_ratio=0.25)  # a short recent window: the scores pick most victims
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    pool = engine.Session.start(params, policy, tokens, max_new_tokens=NEW, pool=True, **kw)
    uniform = engine.Session.start(params, policy, tokens, max_new_tokens=NEW, **kw)
    got, want = _steps(params, pool, forced), _steps(params, uniform, forced)
    S = got[0][2].shape[-1]
    for i, ((g_logits, g_scores, g_pos), (w_logits, w_scores, w_pos)) in enumerate(zip(got, want, strict=True)):
        np.testing.assert_allclose(g_logits, w_logits, atol=1e-5, rtol=1e-5, err_msg=f"step {i}")
        np.testing.assert_array_equal(g_pos, w_pos[..., :S], err_msg=f"step {i}")
        live = g_pos >= 0
        np.testing.assert_allclose(np.where(live, g_scores, 0), np.where(live, w_scores[..., :S], 0), atol=1e-5,
                                   rtol=1e-5, err_msg=f"step {i}")
    # the decoded tokens' scores grew from the step's probabilities (not only the prefill's)
    assert not np.allclose(got[-1][1], got[0][1])


def _steps(params, session, forced: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """``(logits [B, V], scores [L, B, Hkv, S], positions [L, B, Hkv, S])`` of ``session`` before and after each
    of ``forced``'s tokens but the last, fed one `decode_step` at a time (positions -1 past the lengths)."""
    ready = session.begin()
    step = jax.jit(lambda cache, token, state: engine.decode_step(params, session.run.policy, cache, token, state,
                                                                  backend=session.run.backend))

    def seen(logits, cache, state):
        pos = np.asarray(_logical_positions(cache)) if isinstance(cache, PoolCache) else _uniform_positions(cache)
        return np.asarray(logits), np.asarray(state[0]["scores"]), pos

    out, cache, state = [seen(ready.logits, ready.cache, ready.state)], ready.cache, ready.state
    for i in range(forced.shape[1] - 1):
        res = step(cache, jnp.asarray(forced[:, i], jnp.int32), state)
        cache, state = res.cache, res.state
        out.append(seen(res.logits, cache, state))
    return out


def test_an_overwrite_through_the_table_is_the_uniform_in_place_write(rng):
    """`append_token_pool` with ``overwrite``: one token per (row, head) at a slot below the head's length, mapped
    through a shuffled table (junk in every free page), gives exactly the uniform in-place `append_token`'s layer:
    K/V (int8: codes and the re-scaled page's scales), positions, biases and every page summary, page max bias
    included (the slots carry random biases, as a merging compressor's do). The slots include offset 0 of a
    full page and of a partly filled last page: neither is a fresh page (an append's offset 0 would be). The store,
    fp32 or int8, drawn from the run's seed (each over runs, a failure replays with ``--seed``; each compiles its own
    programs; an int8 pool's in-place writes run every time in the ``kernel-int8`` case above)."""
    kv_dtype = (None, "int8")[int(rng.integers(2))]
    print(f"kv_dtype: {kv_dtype}")
    Lc, Bc, Hc, D, ps, S = 2, 2, 2, 16, 4, 12
    length = np.array([12, 9])
    cfg = dataclasses.replace(CFG, num_layers=Lc, num_kv_heads=Hc, head_dim=D)
    k, v = (jnp.asarray(rng.standard_normal((Lc, Bc, Hc, S, D)), jnp.float32) for _ in range(2))
    n = jnp.asarray(length)
    slot = np.stack([rng.integers(0, m, (Lc, Hc)) for m in length], axis=1)  # [L, B, H]
    slot[0, 0, 1], slot[1, 1, 0], slot[0, 1, 1] = 4, 8, 8  # offset 0: a full page's, the last partial page's
    live = np.arange(S) < length[None, :, None, None]
    bias = np.where(live, rng.uniform(-3, 0.5, (Lc, Bc, Hc, S)), 0.0)
    # each evicted slot held its page's max bias, above the new token's 0: the page's max must come down
    np.put_along_axis(bias, slot[..., None], 0.9, axis=-1)

    @jax.jit  # one program each (eagerly, every op compiles on its own: 3x the time)
    def build(k, v, bias):
        layers = init_cache(cfg, Bc, S, page_size=ps, dtype=jnp.float32, kv_dtype=kv_dtype).layers
        pos = jnp.broadcast_to(jnp.arange(S), (Bc, S))
        layers = jax.tree.map(lambda *a: jnp.stack(a), *[write_chunk(layer_view(layers, i), k[i], v[i], 0, pos, n)
                                                           for i in range(Lc)])
        layers = summarize_pages(layers.replace(bias=bias), n, ps)
        return layers, pool_from_stack(layers, n, n, page_size=ps, num_pages=Lc * Bc * Hc * 3 + 6)

    layers, pool = build(k, v, jnp.asarray(bias, jnp.float32))
    pool = shuffle_pages(pool, rng.permutation(pool.num_pages), junk_like(rng))
    kn, vn = (jnp.asarray(rng.standard_normal((Lc, Bc, Hc, D)) * 5, jnp.float32) for _ in range(2))
    at = jnp.asarray(length + 100, jnp.int32)  # the new token's position

    @jax.jit
    def write(layers, pool):
        for i in range(Lc):
            layers = append_token(layers, kn[i], vn[i], jnp.asarray(slot[i], jnp.int32), at, n, ps, layer=i)
            table = layer_tables(pool, i)[0]
            phys = jnp.take_along_axis(table, jnp.asarray(slot[i] // ps)[..., None], axis=-1)[..., 0]
            pool = append_token_pool(pool, i, kn[i], vn[i], at, phys, jnp.asarray(slot[i] % ps),
                                     overwrite=jnp.ones((Bc, Hc), jnp.bool_))
        return pool, [layer_kv(pool, i) for i in range(Lc)], [layer_view(layers, i) for i in range(Lc)]

    pool, got_layers, want_layers = write(layers, pool)
    np.testing.assert_array_equal(np.asarray(pool.lengths), np.broadcast_to(length[None, :, None], (Lc, Bc, Hc)))
    used = np.arange(S // ps) < pages_for(length, ps)[:, None, None]  # [B, 1, P] pages in use
    for i in range(Lc):
        got, want = got_layers[i], want_layers[i]
        for name in ("k", "v", "positions", "bias", "page_sum", "page_min", "page_max", "page_max_bias", "k_scale",
                     "k_zero", "v_scale"):
            g, w = getattr(got, name), getattr(want, name)
            assert (g is None) == (w is None), name
            if g is None:
                continue
            g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
            mask = np.broadcast_to(live[0] if name in ("k", "v", "positions", "bias") else used, g.shape[:3])
            np.testing.assert_array_equal(g[mask], w[mask], err_msg=f"layer {i} {name}")
        wrote = np.asarray(got.positions)[np.arange(Bc)[:, None], np.arange(Hc), slot[i]]
        assert (wrote == length[:, None] + 100).all()  # the token is where decode_write would have put it
