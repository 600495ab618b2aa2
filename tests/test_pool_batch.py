"""Issue 38's "Batching that memory makes possible": the page-pool layout of the largest-batch search
(`scripts/kv_quant_show.py e2e --layouts uniform,pool`, docs/PAGE_POOL.md step 4).

* `bench.e2e.pool_decode_cache` builds the pool the engine decodes from after compression without a prefill:
  its pages, tables, free stack and lengths are those of `engine.Session`'s pool (``pool=True``) on a tiny
  model for the same per-head counts (full attention: the prefill pool; SnapKV, AdaKV: the decode pool);
  SnapKV's default counts are the session's, AdaKV's are its own allocation (the row's ``Hkv·n`` in all,
  every head at least its floor).
* Decoding from it (`bench.e2e.decode_fn`, the engine's pooled step) gives the logits the uniform builder's
  cache (`bench.e2e.decode_cache`) gives holding the same entries (fp32, jnp path; AdaKV's uniform cache with
  the holes its compression leaves), and ``start=restart_point(pool)`` restarts every call from the built
  allocator.
* The CLI refuses a bad layout name, and the pool with a quantised cache, before anything runs.

Tiny random models; the draws come from the run's seed (tests/conftest.py: printed in the header, ``pytest
--seed N`` replays it)."""

from __future__ import annotations

import importlib.util
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax import engine
from sparsekv_jax.backend import Backend
from sparsekv_jax.bench.e2e import decode_cache, decode_fn, policy_counts, pool_decode_cache, restart_point
from sparsekv_jax.cache_pooled import take_logical
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import parse_policy
from sparsekv_jax.policies.base import Setup

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=512, eos_token_ids=(0,))
T, B, STEPS, PS = 64, 2, 6, 8
POLICIES = {"fullkv": "fullkv", "snapkv": "snapkv(0.25, window=4)", "adakv": "adakv(snapkv(0.25, window=4))"}
ALLOC = ("table", "held", "length", "free", "num_free", "overflow")

_spec = importlib.util.spec_from_file_location("kv_quant_show", pathlib.Path(__file__).parents[1] / "scripts" /
                                               "kv_quant_show.py")
kv_quant_show = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kv_quant_show)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, scale=0.3)


def _bound(spec: str):
    return parse_policy(spec).bind(Setup(CFG, prompt_len=T, max_new_tokens=STEPS, backend=Backend()))


def _session_pool(params, spec: str, rng):
    """The pool `Session` (``pool=True``) decodes from: full attention's prefill pool, a compressor's decode pool."""
    tokens = rng.integers(1, CFG.vocab_size, (B, T))
    session = engine.Session.start(params, parse_policy(spec), tokens, max_new_tokens=STEPS, page_size=PS,
                                   stop_tokens=(), backend=Backend(), pool=True)
    return session.prefill().cache if spec == "fullkv" else session.compress().cache


@pytest.mark.share(2)
@pytest.mark.parametrize("name", list(POLICIES))
def test_pool_builder_is_the_engines_pool(params, name, rng):
    """Same pool size, table width, tables, held pages, lengths, free stack and leaves as the session's pool."""
    spec = POLICIES[name]
    want = _session_pool(params, spec, rng)
    pol = _bound(spec)
    counts = None if name == "fullkv" else want.lengths
    got, _ = pool_decode_cache(CFG, pol, T, B, STEPS, jax.random.key(int(rng.integers(1 << 30))), page_size=PS,
                               counts=counts, dtype=jnp.float32)
    assert (got.num_pages, got.max_pages_per_head, got.num_layers, got.prompt_pages) == \
        (want.num_pages, want.max_pages_per_head, want.num_layers, want.prompt_pages)
    for f in ALLOC:
        np.testing.assert_array_equal(np.asarray(getattr(got.alloc, f)), np.asarray(getattr(want.alloc, f)), f)
    np.testing.assert_array_equal(np.asarray(got.next_position), np.asarray(want.next_position))
    assert jax.tree.map(lambda x: (x.shape, x.dtype), got.pages) == jax.tree.map(lambda x: (x.shape, x.dtype),
                                                                                  want.pages)
    assert got.nbytes() == want.nbytes()
    # the live slots are those the session's heads hold: position >= 0 exactly there
    at = jnp.broadcast_to(jnp.arange(got.max_pages_per_head * PS), (*got.lengths.shape, got.max_pages_per_head * PS))
    live = np.arange(at.shape[-1]) < np.asarray(got.lengths)[..., None]
    np.testing.assert_array_equal(np.asarray(take_logical(got, got.pages.positions, at)) >= 0, live)
    assert np.all(np.abs(np.asarray(take_logical(got, got.pages.k, at)))[live].sum(-1) > 0)  # random, not zeros
    if name == "snapkv":  # the default counts are the policy's: every head n
        np.testing.assert_array_equal(np.asarray(policy_counts(CFG, pol, T, B, STEPS, jax.random.key(0))),
                                      np.asarray(want.lengths))


def test_adakv_counts_are_its_allocation(rng):
    """AdaKV's drawn split: each (layer, row) keeps ``Hkv·n`` in all, every head at least its floor, at most its
    capacity, and the heads differ (the draw is uneven)."""
    pol = _bound(POLICIES["adakv"])
    counts = np.asarray(policy_counts(CFG, pol, T, B, STEPS, jax.random.key(int(rng.integers(1 << 30)))))
    n = int(0.25 * T)
    floor = max(int(0.2 * n), 4)  # alpha·n, or the window the floor includes
    assert counts.shape == (CFG.num_layers, B, CFG.num_kv_heads)
    np.testing.assert_array_equal(counts.sum(-1), CFG.num_kv_heads * n)
    assert counts.min() >= floor and counts.max() <= pol.compressed_capacity(T, STEPS) - STEPS
    assert (counts != n).any()


@pytest.mark.share(2)
@pytest.mark.parametrize("name", list(POLICIES))
def test_pool_decode_equals_uniform_decode(params, name, rng):
    """The engine's pooled step on the built pool gives the uniform builder's logits on the same entries, step by
    step (fp32, jnp path), and `decode_fn` with ``start=restart_point`` restarts each call from the built pool."""
    pol = _bound(POLICIES[name])
    key = jax.random.key(int(rng.integers(1 << 30)))
    pool, _ = pool_decode_cache(CFG, pol, T, B, STEPS, key, page_size=PS, dtype=jnp.float32)
    uni, obs = decode_cache(CFG, pol, T, B, STEPS, key, page_size=PS, dtype=jnp.float32)
    # the uniform cache holding the pool's entries; AdaKV's heads keeping fewer than the row leave holes
    L, _, H, S, _ = uni.layers.k.shape
    at = jnp.broadcast_to(jnp.arange(S), (L, B, H, S))
    hole = (np.arange(S) >= np.asarray(pool.lengths)[..., None]) & (np.arange(S) < np.asarray(uni.length)[:, None])
    layers = uni.layers.replace(k=take_logical(pool, pool.pages.k, at), v=take_logical(pool, pool.pages.v, at),
                                positions=jnp.where(hole, -1, uni.layers.positions),
                                bias=jnp.where(hole, -jnp.inf, uni.layers.bias))
    np.testing.assert_array_equal(np.asarray(take_logical(pool, pool.pages.positions, at))[~hole & (at < np.asarray(
        uni.length)[:, None])], np.asarray(uni.layers.positions)[~hole & (at < np.asarray(uni.length)[:, None])])
    uni = uni.replace(layers=layers)
    assert hole.any() == (name == "adakv")
    step = jax.jit(lambda cache, token, state: engine.decode_step(params, pol, cache, token, state,
                                                                  backend=Backend()))
    forced = rng.integers(1, CFG.vocab_size, (STEPS, B))
    caches, states = {"pool": pool, "uniform": uni}, {"pool": pol.stage("decode").decode_init(pool, None),
                                                      "uniform": pol.decode_init(uni, obs)}
    for i in range(STEPS):
        out = {}
        for layout in caches:
            out[layout] = step(caches[layout], jnp.asarray(forced[i], jnp.int32), states[layout])
            caches[layout], states[layout] = out[layout].cache, out[layout].state
        np.testing.assert_allclose(np.asarray(out["pool"].logits), np.asarray(out["uniform"].logits),
                                   atol=1e-5, rtol=1e-5, err_msg=f"step {i}")
    assert not bool(caches["pool"].alloc.overflow.any())
    # decode_fn from the pool restarts each call from the built allocator: two calls, the same tokens and pool
    built = jax.tree.map(np.asarray, pool.alloc)
    fn = decode_fn(params, pol, STEPS, start=restart_point(pool), backend=Backend())
    first = fn(params, pool, pol.stage("decode").decode_init(pool, None), jnp.ones((B,), jnp.int32))
    alloc1, token1 = jax.tree.map(np.asarray, first[0].alloc), np.asarray(first[2])
    second = fn(params, *first[:2], jnp.ones((B,), jnp.int32))
    np.testing.assert_array_equal(np.asarray(second[2]), token1)
    for f in ALLOC:
        np.testing.assert_array_equal(np.asarray(getattr(second[0].alloc, f)), getattr(alloc1, f), f)
    assert int(alloc1.num_free) < int(built.num_free)  # the calls took pages: the restart gave them back
    ufn = decode_fn(params, pol, STEPS, start=restart_point(uni), backend=Backend())
    np.testing.assert_array_equal(np.asarray(ufn(params, uni, pol.decode_init(uni, obs),
                                                 jnp.ones((B,), jnp.int32))[2]), token1)


@pytest.mark.parametrize("argv, bad", [(["--layouts", "uniform,paged"], "'paged'"),
                                       (["--layouts", "pool", "--kv-dtypes", "int8"], "int8")])
def test_cli_rejects_bad_layouts_before_running(argv, bad, capsys, monkeypatch):
    """A bad layout name, or the pool with a quantised cache: a usage error naming it, before any search runs."""
    ran = []
    monkeypatch.setattr(kv_quant_show, "run_e2e", lambda *a, **k: ran.append(a))
    monkeypatch.setattr(kv_quant_show, "run_e2e_isolated", lambda *a, **k: ran.append(a))
    with pytest.raises(SystemExit) as e:
        kv_quant_show.main(["e2e", *argv])
    assert e.value.code == 2 and not ran
    assert bad in capsys.readouterr().err
