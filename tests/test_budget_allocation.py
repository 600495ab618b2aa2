"""AdaKV and PyramidKV (issue #38, item 2): budgets that differ by head and by layer over a scored
compressor, on today's one-capacity cache.

The kept entries of every (layer, row, head) are checked against numpy references written from
the papers (a loop per layer and row, no code of the policies): AdaKV's floor per head then the
joint top-k across heads, PyramidKV's linear schedule with its clip and largest-remainder rounding.
The totals equal the uniform budget's, the floor holds, the static capacity bounds every head, and
a budget that covers a row's prompt gives that row full attention's logits on a tiny random model.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng
from flax import struct

from sparsekv_jax.cache import init_cache, pages_for, summarize_pages
from sparsekv_jax.generate import teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import AdaKV, Dense, PyramidKV, SnapKV, parse_policy
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.h2o import H2O
from sparsekv_jax.policies.scored import ScoredCompression

L, H, D, PAGE = 3, 4, 4, 8
LENGTHS = np.array([60, 45])
CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=32, num_layers=L, num_heads=H, num_kv_heads=H,
                  head_dim=D, intermediate_size=24, max_position_embeddings=256)


@struct.dataclass
class Given(ScoredCompression):
    """A scored compressor whose scores are its observations (the test's random draw)."""

    budget: float | int = struct.field(pytree_node=False, default=0.25)
    sinks: int = struct.field(pytree_node=False, default=2)
    window: int = struct.field(pytree_node=False, default=4)

    def score(self, cache, observations: Any, prompt: Prompt) -> jax.Array:
        return observations


def _cache(rng: np.random.Generator, capacity: int = 64):
    """A prefilled cache of random K/V, slot = position, rows of `LENGTHS`."""
    cache = init_cache(CFG, len(LENGTHS), capacity, page_size=PAGE, dtype=jnp.float32)
    S = cache.capacity
    k = rng.normal(size=(L, len(LENGTHS), H, S, D)).astype(np.float32)
    v = rng.normal(size=k.shape).astype(np.float32)
    slot = np.arange(S)
    pos = np.where(slot[None, :] < LENGTHS[:, None], slot[None, :], -1)
    layers = cache.layers.replace(k=jnp.asarray(k), v=jnp.asarray(v),
                                  positions=jnp.asarray(np.broadcast_to(pos[None, :, None], (L, len(LENGTHS), H, S))))
    ln = jnp.asarray(LENGTHS, jnp.int32)
    return cache.replace(layers=summarize_pages(layers, ln, PAGE), length=ln, next_position=ln), k, v


def _compress(policy, rng: np.random.Generator, new: int = 3):
    """Random scores → ``(scores, compressed cache, original k, v, capacity)``."""
    cache, k, v = _cache(rng)
    # heads on different levels (as real heads are: concentrated or spread), so that the joint top-k
    # starves the low heads and the floor binds
    level = np.linspace(3.0, -3.0, H)[None, None, :, None]
    scores = (rng.normal(size=(L, len(LENGTHS), H, cache.capacity)) + level).astype(np.float32)
    policy = policy.bind(Setup(config=CFG, prompt_len=int(LENGTHS.max()), max_new_tokens=new))
    capacity = policy.compressed_capacity(int(LENGTHS.max()), new)
    prompt = Prompt(tokens=jnp.zeros((len(LENGTHS), int(LENGTHS.max())), jnp.int32),
                    lengths=jnp.asarray(LENGTHS, jnp.int32))
    out = jax.jit(lambda c, o: policy.compress(c, o, capacity, prompt))(cache, jnp.asarray(scores))
    return scores, out, k, v, capacity


def _kept(out, k, v) -> dict[tuple[int, int, int], set[int]]:
    """Each (layer, row, head)'s kept positions, checking the entries were moved whole and in order."""
    pos, ck, cv = (np.asarray(x) for x in (out.layers.positions, out.layers.k, out.layers.v))
    bias = np.asarray(out.layers.bias)
    length = np.asarray(out.length)
    kept = {}
    for l in range(L):
        for b in range(len(LENGTHS)):
            for h in range(H):
                p = pos[l, b, h, :length[b]]
                live = p >= 0
                assert (live[:live.sum()]).all(), "live entries first, holes after"
                row_bias = bias[l, b, h, :length[b]]
                assert np.isneginf(row_bias[~live]).all() and (row_bias[live] == 0).all()
                got = p[live]
                assert (np.diff(got) > 0).all(), "kept entries in position order"
                np.testing.assert_array_equal(ck[l, b, h, :live.sum()], k[l, b, h, got])
                np.testing.assert_array_equal(cv[l, b, h, :live.sum()], v[l, b, h, got])
                kept[l, b, h] = set(got.tolist())
    return kept


# -- numpy references, from the papers ---------------------------------------------------------------
def _uniform(budget: float | int, length: int) -> int:
    if isinstance(budget, float):
        return max(1, min(length, int(np.floor(budget * length + 1e-9))))
    return min(budget, length)


def _forced(length: int, sinks: int, window: int) -> set[int]:
    return set(range(min(sinks, length))) | set(range(max(0, length - window), length))


def _best(scores: np.ndarray, length: int, exclude: set[int], count: int) -> set[int]:
    rest = [t for t in np.argsort(-scores[:length], kind="stable") if t not in exclude]
    return set(int(t) for t in rest[:count])


def ada_reference(scores, budget, sinks, window, alpha) -> dict[tuple[int, int, int], set[int]]:
    """Ada-KV: every head keeps its forced entries and its best up to floor(alpha·n); the rest of
    the layer's H·n is the best of all heads' remaining entries."""
    kept = {}
    for l in range(L):
        for b, ln in enumerate(LENGTHS.tolist()):
            n = _uniform(budget, ln)
            w = window if isinstance(window, int) else int(window[b])
            forced = _forced(ln, sinks, w)
            assert len(forced) <= n
            own = max(int(np.floor(alpha * n + 1e-9)), len(forced))
            sets = [forced | _best(scores[l, b, h], ln, forced, own - len(forced)) for h in range(H)]
            pool = [(scores[l, b, h, t], h, t) for h in range(H) for t in range(ln) if t not in sets[h]]
            pool.sort(key=lambda x: -x[0])
            for _, h, t in pool[:H * n - sum(map(len, sets))]:
                sets[h].add(t)
            kept.update({(l, b, h): sets[h] for h in range(H)})
    return kept


def pyramid_layer_counts(n: int, forced: int, length: int, beta: float, layers: int = L) -> list[int]:
    """PyramidKV's per-layer counts for one row (forced entries included in each)."""
    m, avail = n - forced, length - forced
    low = int(np.floor(m / beta + 1e-9))
    high = 2 * m - low
    if high > avail:  # the paper's clip: the bottom layer keeps everything, the mean stays m
        high, low = avail, 2 * m - avail
    line = [high - i * (high - low) / (layers - 1) for i in range(layers)]
    counts = [int(np.floor(x + 1e-9)) for x in line]
    frac = [round(x - c, 9) for x, c in zip(line, counts, strict=True)]
    for i in sorted(range(layers), key=lambda i: (-frac[i], i))[:layers * m - sum(counts)]:
        counts[i] += 1
    return [forced + c for c in counts]


def pyramid_reference(scores, budget, sinks, window, beta) -> dict[tuple[int, int, int], set[int]]:
    kept = {}
    for b, ln in enumerate(LENGTHS.tolist()):
        n = _uniform(budget, ln)
        forced = _forced(ln, sinks, window)
        for l, c in enumerate(pyramid_layer_counts(n, len(forced), ln, beta)):
            for h in range(H):
                kept[l, b, h] = forced | _best(scores[l, b, h], ln, forced, c - len(forced))
    return kept


# -- AdaKV -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.2, 0.5])
@pytest.mark.parametrize("budget", [0.25, 20])
def test_adakv_keeps_the_papers_allocation(alpha, budget, rng):
    inner = Given(budget=budget)
    scores, out, k, v, capacity = _compress(AdaKV(inner, alpha=alpha), rng)
    kept = _kept(out, k, v)
    assert kept == ada_reference(scores, budget, inner.sinks, inner.window, alpha)
    bound = 0
    for b, ln in enumerate(LENGTHS.tolist()):
        n = _uniform(budget, ln)
        for l in range(L):
            sizes = [len(kept[l, b, h]) for h in range(H)]
            assert sum(sizes) == H * n  # the uniform total, exactly
            floor = max(int(np.floor(alpha * n + 1e-9)), inner.sinks + inner.window)
            assert min(sizes) == floor  # the floor holds, and binds for the lowest head
            bound = max(bound, max(sizes))
        assert len({len(kept[l, b, h]) for l in range(L) for h in range(H)}) > 1, "random scores: heads differ"
    n0 = _uniform(budget, int(LENGTHS.max()))
    static = min(int(LENGTHS.max()), H * n0 - (H - 1) * int(np.floor(alpha * n0 + 1e-9)))
    assert bound <= static and capacity == static + 3
    assert out.capacity == pages_for(capacity, PAGE) * PAGE


def test_adakv_with_a_floor_of_one_is_the_uniform_inner(rng):
    """alpha = 1: every head keeps its own budget, the inner's own compression (another code path)."""
    inner = Given(budget=0.3)
    cache, k, v = _cache(rng)
    scores = jnp.asarray(rng.normal(size=(L, len(LENGTHS), H, cache.capacity)).astype(np.float32))
    prompt = Prompt(tokens=jnp.zeros((2, 60), jnp.int32), lengths=jnp.asarray(LENGTHS, jnp.int32))
    ada = AdaKV(inner, alpha=1.0).bind(Setup(config=CFG, prompt_len=60))
    assert ada.compressed_capacity(60, 3) == inner.compressed_capacity(60, 3)
    uniform = _kept(inner.compress(cache, scores, 21, prompt), k, v)
    assert _kept(ada.compress(cache, scores, 21, prompt), k, v) == uniform


def test_adakv_over_h2o_keeps_each_rows_recent_window(rng):
    """H2O's recent share depends on the row's budget ([B] windows): every head keeps it."""
    inner = H2O(budget=0.3)
    cache, k, v = _cache(rng)
    scores = rng.random(size=(L, len(LENGTHS), H, int(LENGTHS.max()))).astype(np.float32)
    ada = AdaKV(inner).bind(Setup(config=CFG, prompt_len=60))
    prompt = Prompt(tokens=jnp.zeros((2, 60), jnp.int32), lengths=jnp.asarray(LENGTHS, jnp.int32))
    out = ada.compress(cache, jnp.asarray(scores), ada.compressed_capacity(60, 2), prompt)
    padded = np.pad(scores, ((0, 0),) * 3 + ((0, cache.capacity - 60),), constant_values=-np.inf)
    recent = [int(np.floor(0.5 * _uniform(0.3, ln))) for ln in LENGTHS.tolist()]
    assert _kept(out, k, v) == ada_reference(padded, 0.3, 0, np.array(recent), 0.2)


# -- PyramidKV ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("beta", [20.0, 2.5])
@pytest.mark.parametrize("budget", [0.25, 0.75])  # 0.75: the bottom layer would need more than the prompt
def test_pyramidkv_keeps_the_papers_schedule(beta, budget, rng):
    inner = Given(budget=budget)
    scores, out, k, v, capacity = _compress(PyramidKV(inner, beta=beta), rng)
    kept = _kept(out, k, v)
    assert kept == pyramid_reference(scores, budget, inner.sinks, inner.window, beta)
    w = inner.sinks + inner.window
    for b, ln in enumerate(LENGTHS.tolist()):
        n = _uniform(budget, ln)
        per_layer = [len(kept[l, b, 0]) for l in range(L)]
        assert all(len(kept[l, b, h]) == per_layer[l] for l in range(L) for h in range(H))
        assert sum(per_layer) == L * n  # the uniform total, exactly
        assert per_layer == sorted(per_layer, reverse=True) and per_layer[0] > per_layer[-1]
        m = n - w
        if 2 * m - int(np.floor(m / beta + 1e-9)) <= ln - w:  # unclipped: the top layer keeps total / (beta L)
            assert per_layer[-1] - w == int(np.floor(m / beta + 1e-9))
        else:
            assert per_layer[0] == ln
    n0 = _uniform(budget, 60)
    m0 = n0 - w
    assert capacity == min(60, n0 + m0 - int(np.floor(m0 / beta + 1e-9))) + 3
    assert max(len(s) for s in kept.values()) <= capacity - 3


@pytest.mark.parametrize("layers", [1, 2, 7, 28])
def test_pyramid_counts_total_and_line(layers, rng):
    """The schedule alone over many rows: exact total, within a step of the line, non-increasing."""
    from sparsekv_jax.policies.pyramidkv import pyramid_counts

    avail = rng.integers(1, 5000, size=64)
    m = (rng.random(64) * avail).astype(np.int64)
    beta = float(rng.choice([1.0, 2.0, 20.0, 7.5]))
    got = np.asarray(pyramid_counts(jnp.asarray(m, jnp.int32), jnp.asarray(avail, jnp.int32), layers, beta))
    np.testing.assert_array_equal(got.sum(0), layers * m)
    assert (np.diff(got, axis=0) <= 0).all() and (got <= avail).all() and (got >= 0).all()
    if layers > 1:
        want = [pyramid_layer_counts(int(mm), 0, int(a), beta, layers) for mm, a in zip(m, avail, strict=True)]
        np.testing.assert_array_equal(got, np.array(want).T)


# -- a budget covering the prompt is full attention --------------------------------------------------
TINY = ModelConfig(family="llama", vocab_size=61, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=48, max_position_embeddings=512, eos_token_ids=(0,))


@pytest.fixture(scope="module")
def tiny():
    params = random_params(TINY, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, 0.3)
    tokens = seeded_rng().integers(1, TINY.vocab_size, (2, 96))
    forced = seeded_rng().integers(1, TINY.vocab_size, (2, 4))
    lengths = np.array([96, 70])
    dense = np.asarray(teacher_force(params, Dense(), tokens, forced, lengths=lengths)[0])
    return params, tokens, forced, lengths, dense


@pytest.mark.parametrize("spec", ["adakv(snapkv(70, window=8))", "pyramidkv(snapkv(70, window=8))",
                                  "adakv(snapkv(1.0))", "pyramidkv(snapkv(1.0))"])
def test_a_budget_covering_the_prompt_is_full_attention(spec, tiny):
    """70 tokens cover row 1 (70 long) but not row 0: row 0 is compressed (the compaction runs), row 1
    keeps everything and gives full attention's logits; 1.0 covers both (no compression at all)."""
    params, tokens, forced, lengths, dense = tiny
    got = np.asarray(teacher_force(params, parse_policy(spec), tokens, forced, lengths=lengths)[0])
    if "1.0" in spec:
        np.testing.assert_array_equal(got, dense)
    else:
        np.testing.assert_allclose(got[1], dense[1], rtol=1e-5, atol=1e-5)
        assert np.abs(got[0] - dense[0]).max() > 1e-3  # row 0 really was compressed


# -- spec and errors ---------------------------------------------------------------------------------
def test_spec_names_and_defaults():
    ada = parse_policy("adakv(snapkv(0.25))")
    assert ada == AdaKV(SnapKV(0.25)) and ada.alpha == 0.2 and ada.name == "AdaKV(SnapKV)"
    pyr = parse_policy("PyramidKV(snapkv(0.1, window=16), beta=10)")
    assert pyr == PyramidKV(SnapKV(0.1, window=16), beta=10) and pyr.budget == 0.1
    assert ada.stages == ("compress",) and ada.needs_observations and ada.needs_whole_prefill
    recency = parse_policy("adakv(streamingllm(0.2))")  # observes nothing, but is declared one-pass
    assert recency.needs_observations is False and recency.needs_whole_prefill is True


@pytest.mark.parametrize("spec, match", [
    ("adakv(quest(0.25))", r"AdaKV\(inner=Quest\).*scored compressor"),
    ("pyramidkv(0.25)", r"PyramidKV\(inner=0.25\).*scored compressor"),
    ("adakv(snapkv(0.25), alpha=1.5)", r"alpha=1.5 must be a fraction in \[0, 1\]"),
    ("adakv(snapkv(0.25), alpha=-0.1)", r"alpha=-0.1"),
    ("pyramidkv(snapkv(0.25), beta=0.5)", r"beta=0.5 must be a number >= 1"),
    ("adakv(snapkv(0.25), gamma=1)", r"policy adakv: .*gamma"),
    ("adakv(snapkv(1.5))", r"budget=1.5"),
])
def test_bad_values_are_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(spec)


def test_unbound_adakv_says_to_bind_and_bind_checks_the_inner():
    with pytest.raises(ValueError, match="bind the policy"):
        AdaKV(SnapKV(0.25)).compressed_capacity(1000, 10)
    with pytest.raises(ValueError, match="window=32"):  # SnapKV's window does not fit 10% of 100 tokens
        PyramidKV(SnapKV(0.1)).bind(Setup(config=CFG, prompt_len=100))
    assert AdaKV(SnapKV(0.5)).bind(Setup(config=CFG, prompt_len=100)).num_kv_heads == H
