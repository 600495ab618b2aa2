"""generate(): input validation before jit, sampling rules, cache bookkeeping."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng
from flax import struct

from sparsekv_jax.cache import SUMMARIES, init_cache, page_mean
from sparsekv_jax.generate import Sampling, full_logits, generate, sample
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import expected_shapes, params_from_arrays
from sparsekv_jax.policies import CHESS, Dense, Pipeline, Quest, SnapKV

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, max_position_embeddings=64, eos_token_ids=(0,))


def _random_params(cfg: ModelConfig, rng: np.random.Generator, dtype=jnp.float32):
    """`random_params`' weights (norms near 1, the rest normal at scale 0.3) drawn with NumPy: drawn by JAX
    eagerly, each weight's shape compiled programs of its own."""
    return params_from_arrays(cfg, {
        name: jnp.asarray(1 - cfg.norm_weight_offset + 0.1 * rng.standard_normal(shape) if name.endswith("norm")
                          else 0.3 * rng.standard_normal(shape), dtype)
        for name, shape in expected_shapes(cfg).items()})


@pytest.fixture(scope="module")
def params():
    return _random_params(CFG, seeded_rng())


@pytest.mark.parametrize("tokens, match", [
    (np.array([[5, 97, 3]]), "token id 97 out of range"),
    (np.array([[5, -1, 3]]), "token id -1 out of range"),
    (np.zeros((1, 0), np.int32), "empty prompt"),
    (np.zeros((1, 2, 3), np.int32), "rank"),
    (np.ones((1, 4), np.float32), "must be integers"),
])
def test_bad_tokens(params, tokens, match):
    with pytest.raises(ValueError, match=match):
        generate(params, None, tokens, max_new_tokens=2)


def test_too_long_for_positions_names_both_numbers(params):
    with pytest.raises(ValueError, match=r"prompt length 60 \+ max_new_tokens 10 = 70 exceeds the model's "
                                         r"max_position_embeddings 64"):
        generate(params, None, np.ones((1, 60), np.int32), max_new_tokens=10)


def test_too_long_for_cache_names_both_numbers(params):
    with pytest.raises(ValueError, match=r"= 30 exceeds the cache capacity 24"):
        generate(params, None, np.ones((1, 20), np.int32), max_new_tokens=10, capacity=24)


@pytest.mark.parametrize("lengths, match", [([0], r"lengths must be in \[1, 5\]"), ([6], r"lengths must be in"),
                                            ([1, 2], r"lengths must have shape \(1,\)")])
def test_bad_lengths(params, lengths, match):
    with pytest.raises(ValueError, match=match):
        generate(params, None, np.ones((1, 5), np.int32), lengths=np.array(lengths), max_new_tokens=2)


@pytest.mark.parametrize("kwargs, match", [
    (dict(temperature=-1.0), "temperature=-1.0"), (dict(top_k=-2), "top_k=-2"), (dict(top_p=0.0), "top_p=0.0"),
])
def test_bad_sampling(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Sampling(**kwargs)


def test_bad_page_size_and_chunk(params):
    with pytest.raises(ValueError, match="page_size=12"):
        generate(params, None, np.ones((1, 5), np.int32), max_new_tokens=2, page_size=12)
    with pytest.raises(ValueError, match="prefill_chunk=0"):
        generate(params, None, np.ones((1, 5), np.int32), max_new_tokens=2, prefill_chunk=0)


def test_chunked_prefill_only_for_policies_that_need_no_whole_prompt(params):
    """Chunked prefill runs no prefill pattern and no prefill observations: a policy that needs
    them is refused before jit, naming it; a decode-stage policy prefilled in chunks decodes what
    it decodes after one pass."""
    from sparsekv_jax.policies import H2O, Pipeline, Quest, SnapKV, Stem, StreamingLLM

    rng = seeded_rng()
    tokens = rng.integers(1, CFG.vocab_size, (2, 48))
    lengths = np.array([48, 35])
    for policy, culprit in ((SnapKV(0.5), "SnapKV"), (H2O(0.5), "H2O"), (Stem(block_size=16), r"Stem\(block_size=16\)"),
                            (Pipeline(compress=SnapKV(0.5), decode=Quest(0.5)), "SnapKV")):
        with pytest.raises(ValueError, match=f"prefill_chunk=16: {culprit} need.*one prefill pass"):
            generate(params, policy, tokens, lengths=lengths, max_new_tokens=4, prefill_chunk=16)
    for policy in (Quest(0.5), StreamingLLM(0.5)):  # StreamingLLM needs no observation: chunks are fine
        one = generate(params, policy, tokens, lengths=lengths, max_new_tokens=12)
        chunked = generate(params, policy, tokens, lengths=lengths, max_new_tokens=12, prefill_chunk=16)
        np.testing.assert_array_equal(np.asarray(chunked.tokens), np.asarray(one.tokens))
    # a chunk covering the prompt is one pass, whatever the policy
    generate(params, SnapKV(0.9), tokens, lengths=lengths, max_new_tokens=2, prefill_chunk=48)


@pytest.fixture(scope="module")
def greedy(params):
    """(tokens, greedy `generate` output): the one eager run the sampling and the user-jit tests compare with
    (one program, not one each)."""
    tokens = seeded_rng().integers(1, CFG.vocab_size, (3, 9))
    return tokens, generate(params, None, tokens, max_new_tokens=6, stop_tokens=())


def test_top_k_one_and_tiny_top_p_are_greedy(params, greedy):
    tokens, greedy = greedy
    for s in (Sampling(temperature=1.5, top_k=1), Sampling(temperature=1.5, top_p=1e-6)):
        out = generate(params, None, tokens, max_new_tokens=6, stop_tokens=(), sampling=s, seed=3)
        np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(greedy.tokens))


def test_temperature_sampling_matches_softmax():
    rng = seeded_rng()
    logits = jnp.asarray(rng.normal(size=(1, 6)) * 2, jnp.float32)
    n = 20000
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), n)
    draws = jax.vmap(lambda k: sample(logits, k, Sampling(temperature=0.7)))(keys)[:, 0]
    freq = np.bincount(np.asarray(draws), minlength=6) / n
    expect = np.asarray(jax.nn.softmax(logits[0] / 0.7))
    assert np.abs(freq - expect).max() < 0.015, (freq, expect)


def test_top_k_and_top_p_restrict_support():
    rng = seeded_rng()
    logits = jnp.asarray(rng.normal(size=(1, 50)), jnp.float32)
    keys = jax.random.split(jax.random.key(int(rng.integers(1 << 30))), 3000)
    top3 = set(np.argsort(-np.asarray(logits[0]))[:3].tolist())
    drawn = set(np.asarray(jax.vmap(lambda k: sample(logits, k, Sampling(1.0, top_k=3)))(keys)[:, 0]).tolist())
    assert drawn <= top3 and len(drawn) == 3
    probs = np.sort(np.asarray(jax.nn.softmax(logits[0])))[::-1]
    p = float(probs[:4].sum()) - 1e-4  # nucleus = the 4 most likely tokens
    nucleus = set(np.argsort(-np.asarray(logits[0]))[:4].tolist())
    drawn = set(np.asarray(jax.vmap(lambda k: sample(logits, k, Sampling(1.0, top_p=p)))(keys)[:, 0]).tolist())
    assert drawn == nucleus


def test_same_seed_same_samples_other_seed_differs(params):
    tokens = seeded_rng().integers(1, CFG.vocab_size, (2, 7))
    s = Sampling(temperature=1.0)
    a = generate(params, None, tokens, max_new_tokens=12, stop_tokens=(), sampling=s, seed=1)
    b = generate(params, None, tokens, max_new_tokens=12, stop_tokens=(), sampling=s, seed=1)
    c = generate(params, None, tokens, max_new_tokens=12, stop_tokens=(), sampling=s, seed=2)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert not np.array_equal(np.asarray(a.tokens), np.asarray(c.tokens))


@struct.dataclass
class EverySummary(Dense):
    """Full attention whose cache holds every page summary (it declares them all; reads none)."""

    page_summaries = frozenset(SUMMARIES)


def test_cache_bookkeeping_and_page_summaries(params):
    rng = seeded_rng()
    tokens = rng.integers(1, CFG.vocab_size, (2, 21))
    lengths = np.array([21, 10])
    out = generate(params, EverySummary(), tokens, lengths=lengths, max_new_tokens=5, stop_tokens=(), page_size=8)
    cache = out.cache
    np.testing.assert_array_equal(np.asarray(cache.length), lengths + 4)  # last token is not fed back
    np.testing.assert_array_equal(np.asarray(cache.next_position), lengths + 4)
    pos = np.asarray(cache.layers.positions)
    for b, n in enumerate(lengths + 4):
        assert (pos[:, b, :, :n] == np.arange(n)).all() and (pos[:, b, :, n:] == -1).all()
    # summaries maintained on append equal a recomputation from the stored keys
    k = np.asarray(cache.layers.k, np.float32)
    mean = np.asarray(page_mean(cache.layers, cache.length, 8))
    for b, n in enumerate(lengths + 4):
        for pg in range(-(-n // 8)):
            sl = k[:, b, :, pg * 8: min(n, pg * 8 + 8)]
            np.testing.assert_allclose(mean[:, b, :, pg], sl.mean(-2), rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(np.asarray(cache.layers.page_min)[:, b, :, pg], sl.min(-2), atol=1e-6)
            np.testing.assert_allclose(np.asarray(cache.layers.page_max)[:, b, :, pg], sl.max(-2), atol=1e-6)
        # the pages' max bias (0 everywhere live: nothing merged), -inf for pages holding nothing
        page_bias = np.asarray(cache.layers.page_max_bias)[:, b]
        used = -(-n // 8)
        assert (page_bias[..., :used] == 0).all() and (page_bias[..., used:] == -np.inf).all()


def test_cache_holds_only_the_page_summaries_its_policy_reads(params):
    """FullKV's cache holds K, V, positions and biases and nothing else (no page summary, so its
    bytes drop by exactly theirs); Quest's holds min/max/max-bias, post-RoPE CHESS's the sums,
    pre-RoPE CHESS's none, a Pipeline's the union of its members'; the tokens stay those of a cache
    holding every summary."""
    rng = seeded_rng()
    tokens = rng.integers(1, CFG.vocab_size, (2, 21))
    lengths = np.array([21, 10])
    run = dict(lengths=lengths, max_new_tokens=5, stop_tokens=(), page_size=8)
    full, every = generate(params, Dense(), tokens, **run), generate(params, EverySummary(), tokens, **run)
    np.testing.assert_array_equal(np.asarray(full.tokens), np.asarray(every.tokens))
    layers = full.cache.layers
    assert layers.summaries == frozenset() and all(getattr(layers, n) is None for n in SUMMARIES)
    L, B, H, S, D = layers.k.shape
    P, item = S // 8, layers.k.dtype.itemsize
    assert full.cache.local is None
    assert full.stats["cache_bytes"] == L * B * H * S * (2 * D * item + 4 + 4) + 2 * B * 4  # K, V, positions, bias
    assert full.stats["cache_bytes"] == full.cache.kv_nbytes() + L * B * H * S * 8 + 2 * B * 4
    summary_bytes = L * B * H * P * (D * 4 + 2 * D * item + 4)  # sum fp32, min/max in the keys' dtype, max bias
    assert every.stats["cache_bytes"] - full.stats["cache_bytes"] == summary_bytes
    quest, snap = Quest(budget=8, page_size=8, dense_layers=0), SnapKV(budget=0.5, window=2)
    for policy, want in ((quest, {"page_min", "page_max", "page_max_bias"}), (CHESS(page_size=8), set()),
                         (CHESS(page_size=8, keys="post_rope"), {"page_sum"}),
                         (Pipeline(compress=snap, decode=quest), {"page_min", "page_max", "page_max_bias"})):
        assert policy.page_summaries == want, policy.name
        out = generate(params, policy, tokens, **run)
        assert out.cache.layers.summaries == want, policy.name
    with pytest.raises(ValueError, match=r"unknown page summaries \['page_mean'\]"):
        init_cache(CFG, 1, 16, summaries=("page_sum", "page_mean"))


def test_bf16_cache_page_min_max_are_exact_in_the_keys_dtype():
    """Min/max summaries are stored in the cache's dtype (half of float32's bytes) and, being
    minima and maxima of stored keys, equal them exactly — after prefill and after appends."""
    rng = seeded_rng()
    params16 = _random_params(CFG, rng, jnp.bfloat16)
    tokens = rng.integers(1, CFG.vocab_size, (2, 19))
    lengths = np.array([19, 11])
    cache = generate(params16, EverySummary(), tokens, lengths=lengths, max_new_tokens=6, stop_tokens=(),
                     page_size=8).cache
    assert cache.layers.page_min.dtype == cache.layers.page_max.dtype == jnp.bfloat16
    assert cache.layers.page_sum.dtype == jnp.float32
    k = np.asarray(cache.layers.k.astype(jnp.float32))
    lo, hi = (np.asarray(x.astype(jnp.float32)) for x in (cache.layers.page_min, cache.layers.page_max))
    for b, n in enumerate(np.asarray(cache.length)):
        for pg in range(-(-n // 8)):
            sl = k[:, b, :, pg * 8: min(n, pg * 8 + 8)]
            np.testing.assert_array_equal(lo[:, b, :, pg], sl.min(-2))
            np.testing.assert_array_equal(hi[:, b, :, pg], sl.max(-2))
        assert not np.any(lo[:, b, :, -(-n // 8):]) and not np.any(hi[:, b, :, -(-n // 8):])  # empty pages: 0


def test_generate_traces_under_user_jit(params, greedy):
    tokens, eager = greedy
    jitted = jax.jit(lambda p, t: generate(p, None, t, max_new_tokens=6, stop_tokens=()).tokens)(params, tokens)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(eager.tokens))


def test_bf16_params_close_to_fp32(params):
    tokens = seeded_rng().integers(1, CFG.vocab_size, (1, 12))
    ref = np.asarray(full_logits(params, tokens))
    low = np.asarray(full_logits(params.astype(jnp.bfloat16), tokens))
    # bf16 keeps ~3 significant digits; the whole-tensor relative error stays at the percent level (the largest of
    # 600 random draws was 0.048; one suite run drew 0.064), and a broken bf16 path is off by ~100%
    assert np.linalg.norm(low - ref) / np.linalg.norm(ref) < 0.1


def test_init_cache_rejects_bad_sizes():
    with pytest.raises(ValueError, match="page_size=3"):
        init_cache(CFG, 1, 16, page_size=3)
    with pytest.raises(ValueError, match="capacity=0"):
        init_cache(CFG, 1, 0)


def test_suffix_after_dense_prefill_equals_one_prompt(params):
    rng = seeded_rng()
    ctx = rng.integers(1, CFG.vocab_size, (2, 30))
    q = rng.integers(1, CFG.vocab_size, (2, 7))
    lengths, qlen = [30, 19], [7, 3]
    out = generate(params, None, ctx, lengths=np.array(lengths), suffix=q, suffix_lengths=np.array(qlen),
                   max_new_tokens=6, stop_tokens=(), page_size=8)
    # each row's context and question as one prompt, right-padded into one batch (one program, not one per row)
    wholes = np.zeros((2, 37), ctx.dtype)
    for b in range(2):
        wholes[b, :lengths[b] + qlen[b]] = np.concatenate([ctx[b, : lengths[b]], q[b, : qlen[b]]])
    alone = generate(params, None, wholes, lengths=np.add(lengths, qlen), max_new_tokens=6, stop_tokens=(),
                     page_size=8)
    assert out.sequences() == alone.sequences()


def test_teacher_force_dense_equals_full_forward(params):
    from sparsekv_jax.generate import teacher_force

    rng = seeded_rng()
    prompt = rng.integers(1, CFG.vocab_size, (1, 20))
    forced = rng.integers(1, CFG.vocab_size, (1, 8))
    logits, outs = teacher_force(params, None, prompt, forced, collect_attention=True)
    ref = np.asarray(full_logits(params, np.concatenate([prompt, forced[:, :-1]], axis=1)))[:, 19:]
    np.testing.assert_allclose(np.asarray(logits), ref, atol=1e-4, rtol=1e-4)
    assert outs.shape == (7, CFG.num_layers, 1, CFG.num_heads, CFG.head_dim)
    with pytest.raises(ValueError, match=r"forced must be \[B, N\]"):
        teacher_force(params, None, prompt, np.zeros((1, 0), np.int32))


def test_prefill_shared_then_compress_equals_prepare(params):
    """One dense prefill observed by several policies, each compressing a copy, gives what each
    policy's own `prepare` gives (the demo's shared prefill)."""
    from sparsekv_jax.engine import compress, prepare, setup, share_prefill
    from sparsekv_jax.generate import prefill_shared
    from sparsekv_jax.policies import parse_policies

    rng = seeded_rng()
    tokens = rng.integers(1, CFG.vocab_size, (1, 40))
    qs = np.array([32])
    runs = [setup(params, p, tokens, question_start=qs, max_new_tokens=4, page_size=8)
            for p in parse_policies("fullkv, snapkv(0.5, window=8), h2o(0.5), streamingllm(0.25), quest(0.5)")]
    r0 = runs[0]
    for r, pre in zip(runs, share_prefill(params, runs), strict=True):
        got = compress(params, r, pre)
        want = prepare(params, r)
        np.testing.assert_allclose(np.asarray(got.logits), np.asarray(want.logits), atol=1e-5)
        np.testing.assert_array_equal(np.asarray(got.cache.layers.positions), np.asarray(want.cache.layers.positions))
    cache = init_cache(CFG, 1, r0.capacity, page_size=8, dtype=params.dtype)
    with pytest.raises(ValueError, match="prefill pattern"):
        prefill_shared(params, parse_policies("stem"), r0.tokens, r0.lengths, cache)
