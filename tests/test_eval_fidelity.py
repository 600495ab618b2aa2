"""Fidelity metrics (KL, top-1 agreement, attention-output error) on a tiny random model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.backend import Backend
from sparsekv_jax.eval import fidelity as fid
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import Dense, SnapKV, StreamingLLM

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, max_position_embeddings=512, eos_token_ids=(0,))
T, NEW = 160, 10


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(0), jnp.float32, scale=0.3)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    tokens = rng.integers(1, CFG.vocab_size, (3, T)).astype(np.int32)
    lengths = np.array([T, T - 17, T - 40], np.int32)
    suffix = rng.integers(1, CFG.vocab_size, (3, 6)).astype(np.int32)
    suffix_lengths = np.array([6, 4, 5], np.int32)
    return tokens, lengths, suffix, suffix_lengths


def np_kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(p_logits.astype(np.float64)), log_softmax(q_logits.astype(np.float64))
    p = np.exp(lp)
    return (p * np.where(p > 0, lp - lq, 0.0)).sum(-1)


def test_kl_matches_numpy_on_known_distributions():
    # hand-made distributions: KL([.5,.5] || [.9,.1]) = .5 ln(.5/.9) + .5 ln(.5/.1)
    p = np.log(np.array([[0.5, 0.5], [0.25, 0.75]]))
    q = np.log(np.array([[0.9, 0.1], [0.25, 0.75]]))
    want = np.array([0.5 * np.log(0.5 / 0.9) + 0.5 * np.log(0.5 / 0.1), 0.0])
    np.testing.assert_allclose(np.asarray(fid.kl_divergence(p, q)), want, rtol=1e-5, atol=1e-7)
    # random logits, with a zero-probability token in p (its term is 0, not nan)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(4, 7, 50)) * 3, rng.normal(size=(4, 7, 50)) * 3
    a[0, 0, 3] = -np.inf
    got = np.asarray(fid.kl_divergence(a, b))
    np.testing.assert_allclose(got, np_kl(a, b), rtol=1e-4, atol=1e-6)
    assert np.all(np.isfinite(got)) and np.all(got >= 0)
    assert float(fid.kl_divergence(a[1, 1], a[1, 1])) == 0.0


@pytest.mark.parametrize("agnostic", [False, True])
def test_full_attention_against_itself(params, prompts, agnostic):
    tokens, lengths, suffix, suffix_lengths = prompts
    kw = dict(suffix=suffix, suffix_lengths=suffix_lengths) if agnostic else {}
    ref = fid.reference(params, tokens, lengths=lengths, max_new_tokens=NEW, stop_tokens=(), **kw)
    rows = fid.compare(params, Dense(), ref)
    assert len(rows) == 3
    for row in rows:
        assert row["kl_first"] <= 1e-6 and row["kl_mean"] <= 1e-6
        assert row["top1_agreement"] == 1.0
        assert row["steps"] == NEW
        assert len(row["layer_rel_error"]) == CFG.num_layers and max(row["layer_rel_error"]) <= 1e-6
    # the shortcut the runner takes for full attention says the same
    assert fid.identical(ref, CFG.num_layers)[0]["layer_rel_error"] == [0.0] * CFG.num_layers


def test_sinks_only_is_far_from_full_attention(params, prompts):
    tokens, lengths, suffix, suffix_lengths = prompts
    ref = fid.reference(params, tokens, lengths=lengths, max_new_tokens=NEW, stop_tokens=())
    severe = fid.compare(params, StreamingLLM(budget=4, sinks=4), ref)
    mild = fid.compare(params, StreamingLLM(budget=0.95, sinks=4), ref)
    mean = lambda rows, k: float(np.mean([r[k] for r in rows]))  # noqa: E731
    assert mean(severe, "kl_mean") > 0.5
    assert mean(severe, "kl_mean") > 3 * mean(mild, "kl_mean")
    assert mean(severe, "layer_rel_error_mean") > 2 * mean(mild, "layer_rel_error_mean")
    assert mean(severe, "top1_agreement") < mean(mild, "top1_agreement")
    # question-aware, compression only: the first answer token comes from the dense prefill
    assert max(r["kl_first"] for r in severe) <= 1e-6


def test_agnostic_first_token_sees_the_compressed_cache(params, prompts):
    tokens, lengths, suffix, suffix_lengths = prompts
    ref = fid.reference(params, tokens, lengths=lengths, suffix=suffix, suffix_lengths=suffix_lengths,
                        max_new_tokens=NEW, stop_tokens=())
    rows = fid.compare(params, SnapKV(budget=8, window=4), ref)
    assert min(r["kl_first"] for r in rows) > 1e-3


def test_padded_steps_are_masked(params, prompts):
    """Rows whose answer stops early are averaged over their own steps only (numpy reference)."""
    tokens, lengths, _, _ = prompts
    out = generate(params, Dense(), tokens, lengths=lengths, max_new_tokens=NEW, stop_tokens=())
    forced = np.asarray(out.tokens)
    steps = np.array([NEW, 3, 1])  # pretend rows 1 and 2 stopped after 3 and 1 tokens
    ref = fid.reference(params, tokens, lengths=lengths, forced=forced, steps=steps)
    policy = StreamingLLM(budget=16, sinks=4)
    rows = fid.compare(params, policy, ref)
    # collect_attention as `reference` and `compare` ask (the attention outputs unused here): their programs
    full, _ = teacher_force(params, Dense(), tokens, forced, lengths=lengths, collect_attention=True)
    pol, _ = teacher_force(params, policy, tokens, forced, lengths=lengths, collect_attention=True)
    kl = np_kl(np.asarray(full), np.asarray(pol))
    agree = np.asarray(full).argmax(-1) == np.asarray(pol).argmax(-1)
    for b, n in enumerate(steps):
        assert rows[b]["steps"] == n
        np.testing.assert_allclose(rows[b]["kl_mean"], kl[b, :n].mean(), rtol=2e-3, atol=1e-5)
        np.testing.assert_allclose(rows[b]["kl_first"], kl[b, 0], rtol=2e-3, atol=1e-5)
        assert rows[b]["top1_agreement"] == pytest.approx(agree[b, :n].mean())
    assert rows[2]["layer_rel_error"] is None  # one answer token: no decode step to compare
    assert rows[1]["layer_rel_error"] is not None


def test_fidelity_wrapper_matches_reference_then_compare(params, prompts):
    tokens, lengths, _, _ = prompts
    policy = SnapKV(budget=0.3, window=8)
    direct = fid.fidelity(params, policy, tokens[:2], lengths=lengths[:2], max_new_tokens=4, stop_tokens=())
    ref = fid.reference(params, tokens[:2], lengths=lengths[:2], max_new_tokens=4, stop_tokens=())
    assert direct == fid.compare(params, policy, ref)


def test_fidelity_runs_on_the_given_backend(params, prompts):
    """``backend=Backend(kv_dtype="int8")``: the reference is full attention's greedy answer and
    logits on the int8 cache, and a policy is compared on the same int8 cache: its KL and top-1
    agreement equal numpy's on the two teacher-forced int8 runs (not the float cache's, which
    differ), and full attention against itself is exactly zero."""
    tokens, lengths, _, _ = prompts
    int8 = Backend(kv_dtype="int8")
    policy = StreamingLLM(budget=16, sinks=4)
    ref = fid.reference(params, tokens, lengths=lengths, max_new_tokens=NEW, stop_tokens=(), backend=int8)
    assert ref.inputs["backend"] is int8
    out = generate(params, Dense(), tokens, lengths=lengths, max_new_tokens=NEW, stop_tokens=(), backend=int8)
    forced = np.asarray(out.tokens)
    np.testing.assert_array_equal(np.asarray(ref.forced), forced)  # the int8 run's answer (no stop: no padding)
    # the teacher-forced runs collect the attention outputs as `reference` and `compare` do (unused here): one
    # program each for `reference`'s and `compare`'s runs and these; the float pair's are
    # test_padded_steps_are_masked's
    tf = dict(lengths=lengths, collect_attention=True)
    full, _ = teacher_force(params, Dense(), tokens, forced, backend=int8, **tf)
    np.testing.assert_array_equal(np.asarray(ref.logits), np.asarray(full))
    pol, _ = teacher_force(params, policy, tokens, forced, backend=int8, **tf)
    kl = np_kl(np.asarray(full), np.asarray(pol))
    agree = (np.asarray(full).argmax(-1) == np.asarray(pol).argmax(-1)).mean(-1)
    rows = fid.compare(params, policy, ref)
    np.testing.assert_allclose([r["kl_mean"] for r in rows], kl.mean(-1), rtol=2e-3, atol=1e-6)
    np.testing.assert_allclose([r["top1_agreement"] for r in rows], agree)
    # the float cache's KL along the same answer is another number: the backend was not ignored
    full_f, _ = teacher_force(params, Dense(), tokens, forced, **tf)
    pol_f, _ = teacher_force(params, policy, tokens, forced, **tf)
    assert np.abs(np_kl(np.asarray(full_f), np.asarray(pol_f)).mean(-1) - kl.mean(-1)).max() > 1e-5
    assert all(r["kl_mean"] == 0.0 and r["top1_agreement"] == 1.0 for r in fid.compare(params, Dense(), ref))
    assert fid.fidelity(params, policy, tokens, lengths=lengths, max_new_tokens=NEW, stop_tokens=(),
                        backend=int8) == rows
    with pytest.raises(ValueError, match="backend must be a sparsekv_jax.Backend, got str"):
        fid.reference(params, tokens, backend="int8")
