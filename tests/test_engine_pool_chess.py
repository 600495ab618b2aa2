"""CHESS on a page pool, ``Options(pool=True)`` (issue 38, docs/PAGE_POOL.md, migration step 4; experimental):
its selection is rebuilt from the pool read through the page tables (`policies.chess_pool`), its page lists are
logical pages, and its backtracking takes tokens back through the allocator (`cache_pooled.rewind_pool`: the
lengths move back, the pages stay held and the regenerated tokens refill them). Against the default uniform path,
for a ragged batch of 2 with thresholds of 0 so that every generated page is uncertain and taken back (twice per
row): the same tokens, backtracks, rebuilds and pages read, on the jnp path and the interpreted kernel (fp32), and
with CHESS pages of two cache pages; step by step on a pool whose pages were moved at random with junk in every
free page, the same logits (1e-5), pages read, rewinds and lengths after every rewind, the rewound pages still held
and refilled without a page popped (int8 on the kernel); with int8 K/V, the uniform int8 cache's codes
and scales in every live slot and page once the rewound pages are refilled (`cache_quant._rescale_pages` resets a
refilled page's value scale as the pool's empty page has it); a row that stops while the other rewinds. Also:
which CHESS runs on a pool (the refusals), and `Pipeline` declaring its members' `writes_in_place`/
`decode_appends` (H2O).

Tiny random model (head_dim 16: the kernel's smallest); weights and prompts drawn from the run's seed
(tests/conftest.py: printed in the header, ``pytest --seed N`` replays it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import decode_rewinding, seeded_rng

from sparsekv_jax import engine
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache
from sparsekv_jax.cache_pooled import PoolCache, init_pool, layer_kv, rewind_pool, shuffle_pages
from sparsekv_jax.generate import generate
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.pallas.testing import junk_like
from sparsekv_jax.policies import H2O, Pipeline, SnapKV
from sparsekv_jax.policies.chess import CHESS
from sparsekv_jax.policies.spec import parse_policy

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=256, eos_token_ids=(0,))
# prompts of 40 and 29 tokens in cache pages of 8; 20 new tokens: each row's first generated page (8 tokens) is
# taken back twice (thresholds 0: every page is uncertain; max_backtracks=2), then the run goes on
T, LENGTHS, NEW, PS = 40, np.array([40, 29]), 20, 8
BACKENDS = {"jnp": Backend(), "kernel": Backend.kernels(),  # the kernel interpreted on a CPU
            "jnp-int8": dataclasses.replace(Backend(), kv_dtype="int8"),
            "kernel-int8": dataclasses.replace(Backend.kernels(), kv_dtype="int8")}
SHAKY = dict(ratios="aggressive", chunk_pages=2, grid_chunks=2, entropy_threshold=0.0, varentropy_threshold=0.0,
             max_backtracks=2)
CHESS8 = CHESS(page_size=PS, **SHAKY)
CHESS16 = CHESS(page_size=2 * PS, window_pages=1, **SHAKY)  # pages of two cache pages: a rewind of 16 tokens
RUNS = {"jnp": ("jnp", CHESS8), "kernel": ("kernel", CHESS8), "jnp-chess16": ("jnp", CHESS16)}


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, scale=0.3)


def _kw(backend: str) -> dict:
    return dict(lengths=LENGTHS, page_size=PS, backend=BACKENDS[backend], stop_tokens=())


def _stats(out) -> dict[str, np.ndarray]:
    return {k: np.asarray(out.stats[k]) for k in ("backtracks", "reselections", "changed_backtracks")}


@pytest.mark.share(2)
@pytest.mark.parametrize("case", list(RUNS))
def test_chess_on_the_pool_backtracks_as_the_uniform_layout(params, rng, case):
    """`generate` with ``pool=True``: the default path's tokens, its backtracks (every row takes its first page
    back twice), rebuilds and regenerated pages that changed, its pages read (fewer than every page), and at the
    end its lengths, each head holding exactly the pages of its length: the regenerated tokens refilled the pages
    kept at the rewinds, none was popped again."""
    backend, chess = RUNS[case]
    kw = _kw(backend)
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    want = generate(params, chess, tokens, max_new_tokens=NEW, **kw)
    got = generate(params, chess, tokens, max_new_tokens=NEW, pool=True, **kw)
    assert isinstance(got.cache, PoolCache) and isinstance(want.cache, KVCache)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    ref = _stats(want)
    np.testing.assert_array_equal(ref["backtracks"], [2, 2])  # the rewinds fired, in both rows
    for key, value in _stats(got).items():
        np.testing.assert_array_equal(value, ref[key], err_msg=key)
    read = np.asarray(want.stats["kv_read_fraction"])
    assert (read < 0.95).any(), read  # a row reads fewer than every page (CHESS16's 29-token row reads all)
    np.testing.assert_allclose(np.asarray(got.stats["kv_read_fraction"]), read, rtol=1e-6)
    length = np.asarray(want.cache.length)
    np.testing.assert_array_equal(length, LENGTHS + NEW - 1)
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), np.broadcast_to(length[None, :, None], (2, 2, 2)))
    held = np.asarray(got.cache.alloc.held).reshape(2, 2, 2)
    np.testing.assert_array_equal(held, np.broadcast_to(-(-length // PS)[None, :, None], (2, 2, 2)))


def test_chess_on_a_shuffled_pool_rewinds_step_by_step_as_the_uniform_cache(params, rng):
    """After the prefill the pool's pages are moved by a random permutation and every free page is filled with
    junk (NaN, random positions). Decoding greedily step by step with the same jitted `decode_step` on either
    cache, each rewind applied as `decode_loop` applies it (the uniform cache's length, the pool's through
    `rewind_pool`): the same logits (1e-5), pages read and rewinds at every step; after each step the pool's
    lengths are the uniform cache's; a rewind keeps the pages held (more than its length needs) and pops or
    frees none, and the regenerated tokens refill them (the greedy tokens of either layout are the argmax of these
    equal logits). On the interpreted kernel in int8, the one step-by-step CHESS run of the int8 kernel (each
    compile of it is slow); nothing checked here depends on the backend, and `generate` (the decode loop) on the
    pool is checked on the jnp path and the kernel in fp32 above, in int8 on jnp below: its two decode loops on the
    int8 kernel (pool and uniform, for the tokens and backtracks again) are left out."""
    kw = _kw("kernel-int8")
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    N = 60  # the prompt's 2·2·2·5 = 40 pages and 20 free ones (each head opens 3 while decoding: 12 in all)
    pool = engine.Session.start(params, CHESS8, tokens, max_new_tokens=NEW, pool=True, pool_pages=N, **kw)
    pre = pool.prefill()
    assert pre.cache.num_pages == N and int(pre.cache.alloc.num_free) == N - 40
    pool.prefilled = pre.replace(cache=shuffle_pages(pre.cache, rng.permutation(N), junk_like(rng)))
    uniform = engine.Session.start(params, CHESS8, tokens, max_new_tokens=NEW, **kw)
    got, ref = decode_rewinding(params, pool, NEW - 1), decode_rewinding(params, uniform, NEW - 1)
    np.testing.assert_allclose(got["logits"], ref["logits"], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got["read"], ref["read"], rtol=1e-6)
    assert (ref["read"] < 0.95).any(), ref["read"]
    np.testing.assert_array_equal(got["rewind"], ref["rewind"])
    assert (ref["rewind"] == PS).sum(0).tolist() == [2, 2], ref["rewind"]  # both rows rewound twice
    np.testing.assert_array_equal(got["lengths"], np.broadcast_to(ref["lengths"][:, None, :, None],
                                                                  got["lengths"].shape))
    back = ref["rewind"] > 0  # [steps, B]
    for s, b in zip(*np.nonzero(back), strict=True):
        held_before, held, free_before, free = (got[k][s] for k in ("held_before", "held", "free_before", "free"))
        np.testing.assert_array_equal(held[:, b], held_before[:, b])  # the rewind kept its pages ...
        assert (held[:, b] > -(-got["lengths"][s][:, b] // PS)).all()  # ... more than its length needs
        assert free == free_before
    # over the run each head popped the pages of the longest it grew, once: the rewound pages were refilled
    most = ref["lengths"].max(0)  # [B]
    np.testing.assert_array_equal(got["held"][-1], np.broadcast_to(-(-most // PS)[None, :, None], (2, 2, 2)))
    assert int(got["free"][-1]) == N - 2 * 2 * int((-(-most // PS)).sum())


def test_chess_on_an_int8_pool_stores_the_uniform_int8_caches_codes(params, rng):
    """int8 K/V (jnp): after both rows took their first generated page back twice and regenerated it, the pool
    gives the uniform int8 cache's tokens, backtracks, rebuilds and pages read, and through its tables holds
    the same codes in every live slot and the same key scales, key zero points and value scales in every page
    holding one, in every layer, row and head. The pages the rewinds emptied and the regenerated tokens refilled
    (row 0's page 5, row 1's page 4) are among them: the uniform cache used to keep the value scale of the
    tokens taken back there (`cache_quant._rescale_pages`), the pool's page starts empty. (Logits, step by
    step: the shuffled-pool test's ``kernel-int8`` case.)"""
    kw = _kw("jnp-int8")
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    want = generate(params, CHESS8, tokens, max_new_tokens=NEW, **kw)
    got = generate(params, CHESS8, tokens, max_new_tokens=NEW, pool=True, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(_stats(want)["backtracks"], [2, 2])
    for key, value in _stats(got).items():
        np.testing.assert_array_equal(value, _stats(want)[key], err_msg=key)
    np.testing.assert_allclose(np.asarray(got.stats["kv_read_fraction"]), np.asarray(want.stats["kv_read_fraction"]),
                               rtol=1e-6)
    uniform, length = want.cache.layers, np.asarray(want.cache.length)
    assert uniform.k.dtype == jnp.int8 and got.cache.pages.k.dtype == jnp.int8
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), np.broadcast_to(length[None, :, None], (2, 2, 2)))
    pages = -(-length // PS)
    for layer in range(CFG.num_layers):
        pool = layer_kv(got.cache, layer)
        for b in range(2):
            live, full = slice(0, int(length[b])), slice(0, int(pages[b]))
            for name, at in (("k", live), ("v", live), ("k_scale", full), ("k_zero", full), ("v_scale", full)):
                np.testing.assert_array_equal(np.asarray(getattr(pool, name))[b, :, at],
                                              np.asarray(getattr(uniform, name))[layer, b, :, at],
                                              err_msg=f"{name} of layer {layer} row {b}")


def test_chess_on_the_pool_with_a_row_that_stops(params, rng):
    """Row 0 hits its stop token while row 1 runs on, taking pages back (jnp): on the pool the stopped row writes
    nothing and each step's rewind moves only its position back (`decode_loop` steps a stopped row back by one
    token, which the uniform cache wrote and the pool did not), so both layouts give the same tokens, counts and
    backtracks, and the pool's lengths are the uniform cache's (a stopped row's length stays where it stopped)."""
    kw = {**_kw("jnp"), "max_new_tokens": NEW}
    # row 0's stop: a token of its last pages that it did not generate before and row 1 never does (row 1 may still
    # meet it in a page it takes back, which stops it: then the next candidate); a draw with none that works (row 0
    # repeating one token, seed 2) is replaced by the next one
    def suits(tokens, stop):
        want = generate(params, CHESS8, tokens, **{**kw, "stop_tokens": (stop,)})
        return want if int(want.num_generated[0]) < NEW - 2 and int(want.num_generated[1]) == NEW else None

    for _ in range(4):
        tokens = rng.integers(1, CFG.vocab_size, (2, T))
        free = np.asarray(generate(params, CHESS8, tokens, **kw).tokens)
        candidates = [int(t) for j, t in enumerate(free[0]) if 10 <= j < NEW - 2 and t not in free[0, :j]
                      and t not in free[1]]
        stop, want = next(((c, w) for c in candidates if (w := suits(tokens, c)) is not None), (None, None))
        if stop is not None:
            break
    else:
        pytest.fail(f"no stop token for row 0 in 4 draws that row 1 never generates: {free.tolist()}")
    got = generate(params, CHESS8, tokens, pool=True, **{**kw, "stop_tokens": (stop,)})
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.num_generated), np.asarray(want.num_generated))
    for key, value in _stats(got).items():
        np.testing.assert_array_equal(value, _stats(want)[key], err_msg=key)
    assert _stats(want)["backtracks"][1] == 2  # row 1 rewound (row 0 may have stopped before its own)
    length = np.asarray(want.cache.length)
    np.testing.assert_array_equal(length, [T + int(want.num_generated[0]) - 1, LENGTHS[1] + NEW - 1])
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), np.broadcast_to(length[None, :, None], (2, 2, 2)))


def test_which_chess_runs_on_a_pool(params, rng):
    """Before jit: CHESS (pre-RoPE keys, alone or as a pipeline's decode stage after full attention) is admitted
    and decodes from the prefill pool of today's cache size; after a compressor, or reading post-RoPE page sums,
    it is refused naming why; `rewind_pool` refuses a bad token count naming its shape."""
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    for policy in (CHESS8, Pipeline(decode=CHESS8), parse_policy("chess()")):
        assert engine.run.pool_refusal(policy) is None, policy.name
        assert engine.setup(params, policy, tokens, pool=True, page_size=PS).pool_pages is None
    for spec, why in [("pipeline(compress=snapkv(0.5, window=4), decode=chess())",
                       r"its decode stage \(CHESS-moderate\) rewinds and selects a row's pages after a compress "
                       r"stage \(SnapKV\)"),
                      ("chess(keys='post_rope')", r"its decode stage \(CHESS-moderate\[post-RoPE\]\) reads post-RoPE")]:
        with pytest.raises(ValueError, match=rf"pool=True is experimental and policy .* does not decode from a page "
                                             rf"pool yet: {why}.*CHESS \(pre-RoPE keys, after full attention\)"):
            engine.setup(params, parse_policy(spec), tokens, pool=True)
    # one jitted program (eagerly, each of its ops compiled on its own: ~2 s)
    cache = jax.jit(lambda: init_pool(CFG, 2, T + NEW, prompt=T, page_size=PS))()
    with pytest.raises(ValueError, match=r"tokens must be an int array \[B=2\], got int32 of shape \(3,\)"):
        rewind_pool(cache, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match=r"positions must be an int array \[B=2\], got float32 of shape \(2,\)"):
        rewind_pool(cache, jnp.ones((2,), jnp.int32), jnp.ones((2,), jnp.float32))


def test_pipeline_declares_its_decode_members_in_place_writes(rng):
    """`Pipeline` declares what its stage's member declares: with H2O decoding, ``writes_in_place`` and
    ``decode_appends`` (the heads below their size append, on random lengths and sizes) are H2O's; with Quest,
    ``selects_pages``; with SnapKV compressing, ``writes_entries``; with full attention, none."""
    h2o = H2O(0.5)
    for pipe in (Pipeline(decode=h2o), Pipeline(compress=h2o, decode=h2o), Pipeline(compress=SnapKV(0.5), decode=h2o)):
        assert pipe.writes_in_place is True and pipe.selects_pages is False
        lengths = jnp.asarray(rng.integers(0, 12, (2, 3, 2)), jnp.int32)
        for size in (rng.integers(0, 12, (2, 3)), rng.integers(0, 12, (2, 3, 2))):  # the uniform / pool sizes
            state = {"size": jnp.asarray(size, jnp.int32), "scores": jnp.zeros((2, 3, 2, 12))}
            want = np.asarray(h2o.decode_appends(state, lengths))
            np.testing.assert_array_equal(want, lengths < (size[..., None] if size.ndim == 2 else size))
            np.testing.assert_array_equal(np.asarray(pipe.decode_appends(state, lengths)), want)
        np.testing.assert_array_equal(np.asarray(pipe.decode_appends(None, lengths)), True)
    assert Pipeline(compress=SnapKV(0.5), decode=h2o).writes_entries is True
    assert Pipeline(decode=h2o).writes_entries is False  # full attention compresses nothing
    assert Pipeline(decode=parse_policy("quest(0.25)")).selects_pages is True
    plain = Pipeline()
    assert not (plain.writes_in_place or plain.selects_pages or plain.writes_entries)
    np.testing.assert_array_equal(np.asarray(plain.decode_appends(None, jnp.zeros((1, 2, 2), jnp.int32))), True)
