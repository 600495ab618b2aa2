"""Policy framework and baselines: properties of what is kept and read, exactness, bad input."""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparsekv_jax.cache import init_cache, summarize_pages
from sparsekv_jax.generate import decode_step, generate, prefill
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import H2O, Dense, Pipeline, Quest, SnapKV, StreamingLLM, parse_policies, parse_policy
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.common import budget_tokens

T = 48  # prompt width of the synthetic caches (one shape: one compile per policy setting)
HYP = settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def _cfg(heads: int, kv_heads: int, layers: int = 2) -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=61, hidden_size=heads * 8, num_layers=layers, num_heads=heads,
                       num_kv_heads=kv_heads, head_dim=8, intermediate_size=24, max_position_embeddings=256)


def _synthetic(cfg: ModelConfig, lengths: np.ndarray, seed: int, capacity: int = 64):
    """A prefilled cache of random keys/values and random prefill q/k per layer."""
    rng = np.random.default_rng(seed)
    B = len(lengths)
    cache = init_cache(cfg, B, capacity, page_size=8, dtype=jnp.float32)
    L, H, D, Hq = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.num_heads
    S = cache.capacity
    k = rng.normal(size=(L, B, H, S, D)).astype(np.float32)
    v = rng.normal(size=(L, B, H, S, D)).astype(np.float32)
    slot = np.arange(S)
    pos = np.where(slot[None, :] < lengths[:, None], slot[None, :], -1)
    layers = cache.layers.replace(k=jnp.asarray(k), v=jnp.asarray(v),
                                  positions=jnp.asarray(np.broadcast_to(pos[None, :, None], (L, B, H, S))))
    ln = jnp.asarray(lengths, jnp.int32)
    cache = cache.replace(layers=summarize_pages(layers, ln, 8), length=ln, next_position=ln)
    q = rng.normal(size=(L, B, T, Hq, D)).astype(np.float32)
    kq = np.transpose(k[:, :, :, :T], (0, 1, 3, 2, 4))  # [L, B, T, H, D]
    return cache, jnp.asarray(q), jnp.asarray(kq)


def _prompt(lengths) -> Prompt:
    lengths = jnp.asarray(lengths, jnp.int32)
    return Prompt(tokens=jnp.zeros((len(lengths), T), jnp.int32), lengths=lengths)


def _observations(policy, q, kq, lengths):
    return _observe(policy, q, kq, _prompt(lengths))


# The hypothesis tests run observe and compress as one jitted program each, the policy passed as a pytree
# (its static fields, the budget, key the program): one compile per drawn setting instead of op-by-op
# dispatch of every op at every new shape (about half the CPU time per example).
@jax.jit
def _observe(policy, q, kq, prompt):
    return jax.vmap(lambda qq, kk: policy.observe(qq, kk, None, None, 0, prompt))(q, kq)


@partial(jax.jit, static_argnums=4)
def _compress(policy, cache, obs, prompt, capacity):
    return policy.compress(cache, obs, capacity, prompt)


def _capacity(budget) -> int:
    """The compressed cache's capacity: the largest row's budget and 4 tokens to come, rounded up to the
    cache's pages (8 slots) as `generate` sizes it; fewer distinct shapes across draws."""
    return -(-(budget_tokens(budget, T) + 4) // 8) * 8


def _check_compressed(orig, comp, keep, sinks, windows):
    """Invariants every compression must keep (numpy, per layer/row/head)."""
    pos = np.asarray(comp.layers.positions)
    k_new, k_old = np.asarray(comp.layers.k), np.asarray(orig.layers.k)
    L, B, H, _ = pos.shape
    np.testing.assert_array_equal(np.asarray(comp.length), keep)
    np.testing.assert_array_equal(np.asarray(comp.next_position), np.asarray(orig.next_position))
    for l in range(L):
        for b in range(B):
            n, length = keep[b], int(orig.length[b])
            for h in range(H):
                kept = pos[l, b, h, :n]
                assert (np.diff(kept) > 0).all(), "kept positions strictly increasing"
                assert (kept >= 0).all() and (kept < length).all()
                assert (pos[l, b, h, n:] == -1).all()
                n_sinks = min(sinks, n)
                must = set(range(n_sinks)) | set(range(length - min(windows[b], n - n_sinks), length))
                assert must <= set(kept.tolist()), "sinks and window kept"
                # entries moved with their RoPE'd keys intact (prefill slot == position)
                np.testing.assert_array_equal(k_new[l, b, h, :n], k_old[l, b, h, kept])


budgets = st.one_of(st.floats(0.15, 0.9), st.integers(12, 40))


@HYP
@given(budget=budgets, lengths=st.lists(st.integers(20, T), min_size=1, max_size=3), seed=st.integers(0, 2**31),
       gqa=st.sampled_from([(2, 2), (6, 2), (4, 1), (8, 1)]))
def test_streaming_llm_properties(budget, lengths, seed, gqa):
    cfg = _cfg(*gqa)
    lengths = np.array(lengths)
    cache, _, _ = _synthetic(cfg, lengths, seed)
    pol = StreamingLLM(budget=budget, sinks=4)
    comp = _compress(pol, cache, None, _prompt(lengths), _capacity(budget))
    keep = np.array([budget_tokens(budget, int(n)) for n in lengths])
    _check_compressed(cache, comp, keep, 4, np.maximum(keep - 4, 0))
    # StreamingLLM keeps exactly sinks + the most recent
    pos = np.asarray(comp.layers.positions)
    for b, n in enumerate(lengths):
        s = min(4, keep[b])
        expect = list(range(s)) + list(range(n - (keep[b] - s), n))
        assert (pos[:, b, :, : keep[b]] == np.array(expect)).all()


@HYP
@given(budget=budgets, lengths=st.lists(st.integers(20, T), min_size=1, max_size=3), seed=st.integers(0, 2**31),
       gqa=st.sampled_from([(2, 2), (6, 2), (8, 1)]))
def test_snapkv_properties(budget, lengths, seed, gqa):
    cfg = _cfg(*gqa)
    lengths = np.array(lengths)
    cache, q, kq = _synthetic(cfg, lengths, seed)
    pol = SnapKV(budget=budget, window=8, kernel_size=7)
    obs = _observations(pol, q, kq, lengths)
    comp = _compress(pol, cache, obs, _prompt(lengths), _capacity(budget))
    keep = np.array([budget_tokens(budget, int(n)) for n in lengths])
    _check_compressed(cache, comp, keep, 0, np.minimum(8, keep))
    # the kept non-window entries are the top-scored ones (brute force from the observation)
    o, pos = np.asarray(obs), np.asarray(comp.layers.positions)
    for l in range(cfg.num_layers):
        for b, n in enumerate(lengths):
            for h in range(cfg.num_kv_heads):
                rest = keep[b] - min(8, keep[b])
                kept = set(pos[l, b, h, : keep[b]].tolist()) - set(range(n - 8, n))
                if rest:
                    thresh = np.sort(o[l, b, h, : n - 8])[::-1][rest - 1]
                    assert all(o[l, b, h, p] >= thresh - 1e-7 for p in kept)


@HYP
@given(budget=budgets, lengths=st.lists(st.integers(20, T), min_size=1, max_size=3), seed=st.integers(0, 2**31))
def test_h2o_compress_properties(budget, lengths, seed):
    cfg = _cfg(6, 2)
    lengths = np.array(lengths)
    cache, q, kq = _synthetic(cfg, lengths, seed)
    pol = H2O(budget=budget)
    obs = _observations(pol, q, kq, lengths)
    comp = _compress(pol, cache, obs, _prompt(lengths), _capacity(budget))
    keep = np.array([budget_tokens(budget, int(n)) for n in lengths])
    _check_compressed(cache, comp, keep, 0, np.floor(0.5 * keep).astype(int))


@pytest.mark.parametrize("implementation, segments", [("dense", 1), ("dense", 3), ("dense", 8), ("blocked", 8)])
def test_attention_mass_matches_dense_reference(implementation, segments):
    rng = seeded_rng()
    B, Tq, Hq, Hkv, D = 2, 37, 6, 2, 8
    q = rng.normal(size=(B, Tq, Hq, D)).astype(np.float32)
    k = rng.normal(size=(B, Tq, Hkv, D)).astype(np.float32)
    lengths = np.array([37, 21])
    from sparsekv_jax.policies.h2o import attention_mass

    got = np.asarray(attention_mass(jnp.asarray(q), jnp.asarray(k), jnp.asarray(lengths), block=8,
                                    implementation=implementation, segments=segments))
    kk = np.repeat(k, Hq // Hkv, axis=2)
    s = np.einsum("bqhd,bthd->bhqt", q, kk) / np.sqrt(D)
    s = np.where(np.tril(np.ones((Tq, Tq), bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    p = p * (np.arange(Tq)[None, None, :, None] < lengths[:, None, None, None])
    ref = p.sum(2).reshape(B, Hkv, Hq // Hkv, Tq).sum(2)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


def test_quest_bound_and_topk_against_bruteforce():
    rng = seeded_rng()
    cfg = _cfg(6, 2, layers=1)
    lengths = np.array([45, 30])
    cache, _, _ = _synthetic(cfg, lengths, int(rng.integers(1 << 30)))
    pol = Quest(budget=16, page_size=8, dense_layers=0).bind(Setup(cfg, prompt_len=T, page_size=8))
    q = rng.normal(size=(2, 6, 8)).astype(np.float32)
    kv = jax.tree.map(lambda x: x[0], cache.layers)
    ids, counts = pol.decode_select(jnp.asarray(q), kv, cache.length, None, None, jnp.int32(0), 8)
    ids, counts = np.asarray(ids), np.asarray(counts)
    keys = np.asarray(kv.k)
    for b, n in enumerate(lengths):
        used = -(-n // 8)
        for h in range(2):
            sel = ids[b, h, : counts[b, h]]
            assert counts[b, h] == min(2, used) and len(set(sel.tolist())) == len(sel)
            assert used - 1 in sel  # the newest page is always read
            qg = q[b, 3 * h: 3 * h + 3]
            bound = []
            for pg in range(used):
                kp = keys[b, h, pg * 8: min(n, pg * 8 + 8)]
                ub = np.maximum(qg * kp.min(0), qg * kp.max(0)).sum(-1)  # [3] per query head
                assert (qg @ kp.T <= ub[:, None] + 1e-5).all()  # a true upper bound of every logit
                bound.append(ub.max())
            bound = np.array(bound)
            others = [p for p in np.argsort(-bound) if p != used - 1]
            assert set(sel.tolist()) == {used - 1, others[0]}


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(family="llama", vocab_size=89, hidden_size=48, num_layers=3, num_heads=6, num_kv_heads=2,
                      head_dim=8, intermediate_size=64, max_position_embeddings=256)
    return random_params(cfg, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, 0.3)


def _logits_after(params, pol, tokens, lengths):
    """Logits of prefill, compress (if ``pol`` has that stage) and 4 greedy decode steps, run eagerly."""
    cache = init_cache(params.config, 2, 48, page_size=8, dtype=jnp.float32)
    first, cache, obs, _ = prefill(params, pol, tokens, lengths, cache)
    squeeze = pol.stage("compress")
    cap = squeeze.compressed_capacity(40, 8)
    if cap is not None:
        cache = squeeze.compress(cache, obs["compress"], cap, Prompt(tokens, lengths))
    state = pol.stage("decode").decode_init(cache, obs.get("decode"))
    out = [first]
    tok = jnp.argmax(first, -1).astype(jnp.int32)
    for _ in range(4):
        lg, cache, state, _ = decode_step(params, pol, cache, tok, state)
        out.append(lg)
        tok = jnp.argmax(lg, -1).astype(jnp.int32)
    return np.stack([np.asarray(x) for x in out])


@pytest.fixture(scope="module")
def dense_run(tiny):
    """(tokens, lengths, full attention's logits): one prompt and its reference, shared by the policies
    compared with it (the reference is ~2 s of eager dispatch, the same run for each)."""
    tokens = jnp.asarray(seeded_rng().integers(0, 89, (2, 40)), jnp.int32)
    lengths = jnp.asarray([40, 23], jnp.int32)
    return tokens, lengths, _logits_after(tiny, Dense(), tokens, lengths)


@pytest.mark.parametrize("policy", [StreamingLLM(budget=40), SnapKV(budget=1.0), H2O(budget=40), Quest(budget=40),
                                    Pipeline(compress=SnapKV(budget=64), decode=Quest(budget=1.0))])
def test_budget_covering_prompt_is_exactly_dense(tiny, dense_run, policy):
    tokens, lengths, dense = dense_run
    bound = policy.bind(Setup(tiny.config, prompt_len=40, page_size=8))
    np.testing.assert_array_equal(_logits_after(tiny, bound, tokens, lengths), dense)


def test_h2o_running_eviction_keeps_cache_size_and_recent(tiny):
    rng = seeded_rng()
    tokens = rng.integers(0, 89, (2, 60))
    out = generate(tiny, H2O(budget=20), tokens, lengths=np.array([60, 44]), max_new_tokens=12, stop_tokens=(),
                   page_size=8)
    cache = out.cache
    assert cache.capacity == 24  # 20 rounded up to pages: memory stays at the budget while decoding
    # each row stays at its budget (not at the page-rounded capacity)
    np.testing.assert_array_equal(np.asarray(cache.length), [20, 20])
    pos = np.asarray(cache.layers.positions)
    for b, n in enumerate([60, 44]):
        last = n + 11 - 1  # position of the newest token fed back
        for l in range(3):
            for h in range(2):
                kept = set(pos[l, b, h].tolist()) - {-1}
                assert len(kept) == 20
                assert set(range(last - 9, last + 1)) <= kept  # recent half of the budget survives


def test_h2o_keeps_a_question_read_after_compression(tiny):
    """Question-agnostic: the suffix read after compression is stored whole (the cache has room for
    it) and the running eviction then keeps the cache at budget + suffix."""
    rng = seeded_rng()
    tokens, suffix = rng.integers(0, 89, (2, 60)), rng.integers(0, 89, (2, 13))
    out = generate(tiny, H2O(budget=20), tokens, lengths=np.array([60, 44]), suffix=suffix,
                   suffix_lengths=np.array([13, 9]), max_new_tokens=1, stop_tokens=(), page_size=8)
    pos = np.asarray(out.cache.layers.positions)
    for b, (n, q) in enumerate([(60, 13), (44, 9)]):
        assert int(out.cache.length[b]) == 20 + q
        for l in range(3):
            assert set(range(n, n + q)) <= set(pos[l, b, 0].tolist()), f"row {b} lost question tokens"


def test_rows_are_compressed_independently(tiny):
    rng = seeded_rng()
    lengths = [50, 31]
    tokens = rng.integers(0, 89, (2, 50))
    for pol in (SnapKV(budget=0.4, window=8), H2O(budget=0.4), StreamingLLM(budget=0.4)):
        both = generate(tiny, pol, tokens, lengths=np.array(lengths), max_new_tokens=6, stop_tokens=(), page_size=8)
        for i, n in enumerate(lengths):
            alone = generate(tiny, pol, tokens[i:i + 1, :n], max_new_tokens=6, stop_tokens=(), page_size=8)
            assert both.sequences()[i] == alone.sequences()[0], pol.name


def test_stats_report_fractions(tiny):
    tokens = seeded_rng().integers(0, 89, (1, 64))
    snap = generate(tiny, SnapKV(budget=16, window=8), tokens, max_new_tokens=4, stop_tokens=(), page_size=8)
    assert float(snap.stats["kv_stored_fraction"][0]) == pytest.approx(16 / 64)
    assert snap.stats["cache_capacity"] == 24
    quest = generate(tiny, Quest(budget=16, page_size=8, dense_layers=0), tokens, max_new_tokens=4, stop_tokens=(),
                     page_size=8)
    assert float(quest.stats["kv_read_fraction"][0]) == pytest.approx(2 / 9, abs=0.03)
    dense = generate(tiny, None, tokens, max_new_tokens=4, stop_tokens=(), page_size=8)
    assert snap.stats["cache_bytes"] < dense.stats["cache_bytes"] / 2
    assert float(dense.stats["kv_read_fraction"][0]) == 1.0
    first = int(dense.tokens[0, 0])  # stopping at the first token: no decode step, nothing read
    stopped = generate(tiny, None, tokens, max_new_tokens=4, stop_tokens=(first,), page_size=8)
    assert int(stopped.num_generated[0]) == 1 and np.isnan(float(stopped.stats["kv_read_fraction"][0]))


@pytest.mark.parametrize("make, match", [
    (lambda: SnapKV(budget=-0.1), "budget=-0.1"), (lambda: SnapKV(budget=1.5), "budget=1.5"),
    (lambda: StreamingLLM(budget=0), "budget=0"), (lambda: SnapKV(budget=16, window=32), "window=32"),
    (lambda: StreamingLLM(budget=3, sinks=4), "sinks=4"), (lambda: Quest(page_size=12), "page_size=12"),
    (lambda: H2O(recent_ratio=2.0), "recent_ratio=2.0"), (lambda: SnapKV(pooling="min"), "pooling='min'"),
    (lambda: parse_policy("snapkv(budget=0.1"), "not well formed"), (lambda: parse_policy("nosuch"), "nosuch"),
    (lambda: parse_policy("snapkv(colour=1)"), "colour"),
])
def test_bad_settings_raise_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_page_size_not_dividing_cache_and_window_over_fraction(tiny):
    tokens = np.ones((1, 40), np.int32)
    with pytest.raises(ValueError, match="Quest page_size=8 is not a multiple of the cache page_size=16"):
        generate(tiny, Quest(page_size=8), tokens, max_new_tokens=2, page_size=16)
    with pytest.raises(ValueError, match="window=32"):
        generate(tiny, SnapKV(budget=0.5), tokens, max_new_tokens=2)


def test_spec_grammar():
    pols = parse_policies("fullkv, snapkv(budget=0.1), quest(2048), pipeline(compress=h2o(0.2), decode=quest(0.25))")
    assert [p.name for p in pols] == ["Dense", "SnapKV", "Quest", "Pipeline(compress=H2O, decode=Quest)"]
    assert pols[1].budget == 0.1 and pols[2].budget == 2048 and pols[3].stage("decode").budget == 0.25


def test_observe_sees_prompt_tokens_and_each_layers_input(tiny):
    """Delimiter-based and hidden-state methods get token ids and layer inputs during prefill."""
    from flax import struct

    from sparsekv_jax.models.transformer import embed
    from sparsekv_jax.policies.base import Policy

    @struct.dataclass
    class Recorder(Policy):
        stages = ("compress",)
        needs_observations = True

        def observe(self, q, k, v, hidden, layer_index, prompt):
            return prompt.tokens, hidden

    rng = seeded_rng()
    tokens = jnp.asarray(rng.integers(0, 89, (2, 24)), jnp.int32)
    cache = init_cache(tiny.config, 2, 32, page_size=8, dtype=jnp.float32)
    _, _, obs, _ = prefill(tiny, Recorder(), tokens, jnp.asarray([24, 17], jnp.int32), cache)
    toks, hidden = obs["compress"]
    assert toks.shape == (3, 2, 24) and (np.asarray(toks) == np.asarray(tokens)[None]).all()
    assert hidden.shape == (3, 2, 24, tiny.config.hidden_size)
    np.testing.assert_allclose(np.asarray(hidden[0]), np.asarray(embed(tiny, tokens)), rtol=1e-6)
    assert not np.allclose(np.asarray(hidden[1]), np.asarray(hidden[0]))  # later layers see transformed states
