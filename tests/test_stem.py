"""Stem prefill: Eq. 3 budgets, valid block lists, the OAM metric against a brute-force reference,
the tiled routing against the whole-metric one (lists, ties, memory) and its Pallas kernel against
its reference, exactness when the budget covers everything, the Pallas path, bad settings, the
ablation script."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
from fractions import Fraction
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng
from jax.experimental import pallas as pl

from sparsekv_jax import attention
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import init_cache
from sparsekv_jax.generate import generate, prefill
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.pallas.stem_route import stem_tile_metric_kernel
from sparsekv_jax.pallas.validation import check_index_lists
from sparsekv_jax.policies import Dense, Pipeline, Quest, Stem, parse_policies, parse_policy
from sparsekv_jax.policies.base import Prompt
from sparsekv_jax.policies.stem import select_blocks
from sparsekv_jax.policies.stem_routing import strided, tile_metric, value_magnitude

ROOT = Path(__file__).resolve().parents[1]


def _qkv(rng: np.random.Generator, B: int, T: int, Hq: int, Hkv: int, D: int = 16):
    """Random q/k/v with peaked attention (q scaled up) and value norms spread around 1."""
    q = rng.normal(size=(B, T, Hq, D)) * 2.0
    k = rng.normal(size=(B, T, Hkv, D))
    v = rng.normal(size=(B, T, Hkv, D)) * np.exp(rng.normal(size=(B, T, Hkv, 1)))
    return (jnp.asarray(x, jnp.float32) for x in (q, k, v))


@jax.jit
def _block_metric(pol: Stem, q, k, v, lengths):
    """``pol.block_metric`` as one program, the policy a pytree argument (its static fields key the program):
    eagerly, each of its ops compiled on its own at each shape."""
    return pol.block_metric(q, k, v, lengths)


def eq3(length: int, block_size: int, ratio: float | None, mu: float, min_blocks: int | None,
        schedule: str) -> list[int]:
    """Paper Eq. 3 at block granularity in exact rational arithmetic (independent of stem.py)."""
    N = -(-length // block_size)
    r = Fraction(str(ratio)) if ratio is not None else Fraction(1, 10 if length > 16384 else 5)
    mu = Fraction(str(mu))
    k_start = max(r * N, Fraction(6912 // block_size if min_blocks is None else min_blocks))
    if schedule == "uniform":
        return [math.ceil((1 + mu) / 2 * k_start)] * N
    return [math.ceil(k_start - k_start * (1 - mu) / N * i) for i in range(1, N + 1)]


@pytest.mark.parametrize("block_size, ratio, mu, min_blocks, schedule", [
    (64, None, 0.7, None, "decay"), (128, None, 0.7, None, "decay"), (64, None, 0.7, 32, "decay"),
    (128, None, 0.7, 0, "decay"),
    (64, 0.15, 0.5, 8, "decay"), (16, 0.3, 0.9, 3, "decay"), (64, None, 0.7, 32, "uniform"),
    (128, 0.2, 0.6, 0, "uniform"),
])
def test_schedule_is_eq3(block_size, ratio, mu, min_blocks, schedule):
    rng = seeded_rng()
    top = 1024 * block_size  # up to 128k tokens at block 128 (the table is [n+1, n])
    lengths = np.concatenate([[1, 4096, 8192, 16384, 16385, 32768], rng.integers(1, top, 9), [top]])
    lengths = np.minimum(lengths, top).astype(np.int32)
    pol = Stem(block_size=block_size, k_start_ratio=ratio, mu=mu, min_blocks=min_blocks, schedule=schedule)
    n = -(-int(lengths.max()) // block_size)
    traced = np.asarray(jax.jit(lambda ln: pol.schedule_for(ln, n))(jnp.asarray(lengths)))
    static = pol.schedule_for(lengths, n, np)
    for b, length in enumerate(lengths):
        ref = eq3(int(length), block_size, ratio, mu, min_blocks, schedule)
        np.testing.assert_array_equal(traced[b, :len(ref)], ref, err_msg=f"length {length}")
        np.testing.assert_array_equal(static[b, :len(ref)], ref, err_msg=f"length {length} (numpy)")


def test_default_floor_is_the_papers_6912_tokens():
    assert Stem().floor_blocks == 108 and Stem(block_size=128).floor_blocks == 54
    assert Stem(min_blocks=7).floor_blocks == 7
    # dense up to 76 blocks (ceil(0.7 * 108) = 76), sparse beyond
    assert Stem().is_dense(76 * 64) and not Stem().is_dense(76 * 64 + 1) and not Stem().is_dense(8192)
    assert Stem().list_width(8192) == 108 and Stem(min_blocks=32).list_width(8192) == 32


def test_uniform_is_085_kstart_at_equal_total_budget():
    pol = Stem(block_size=128, k_start_ratio=0.1, min_blocks=0)  # 64k tokens: 512 blocks, k_start 51.2
    uni = pol.replace(schedule="uniform")
    lengths = np.array([65536])
    k_dec, k_uni = pol.schedule_for(lengths, 512, np)[0], uni.schedule_for(lengths, 512, np)[0]
    assert (k_uni == math.ceil(0.85 * 51.2)).all() and k_dec[0] == 52 and k_dec[-1] == math.ceil(0.7 * 51.2)
    i = np.arange(1, 513)
    total_dec, total_uni = np.minimum(k_dec, i).sum(), np.minimum(k_uni, i).sum()
    assert abs(total_dec - total_uni) / total_uni < 0.03


def _expected_counts(pol: Stem, length: int, n: int) -> np.ndarray:
    k = pol.schedule_for(np.array([length]), n, np)[0]
    forced = np.minimum(np.arange(n) + 1, pol.sink_blocks + pol.local_blocks)
    counts = np.minimum(np.maximum(k, forced), np.arange(n) + 1)
    return np.where(np.arange(n) < -(-length // pol.block_size), counts, forced)


@pytest.mark.parametrize("hq, hkv", [(4, 4), (6, 2), (8, 2)])
def test_lists_are_causal_distinct_forced_and_top_scored(hq, hkv):
    rng = seeded_rng()
    T = int(rng.integers(330, 400))
    lengths = np.array([T, int(rng.integers(180, T)), int(rng.integers(20, 120))], np.int32)
    q, k, v = _qkv(rng, 3, T, hq, hkv)
    pol = Stem(block_size=16, stride=4, k_start_ratio=0.4, min_blocks=10, sink_blocks=2, local_blocks=3,
               gqa=str(rng.choice(["mean", "max"])))
    ln = jnp.asarray(lengths)
    ids, counts, bs = jax.jit(pol.prefill_pattern)(q, k, v, jnp.int32(0), Prompt(jnp.zeros((3, T), jnp.int32), ln))
    ids, counts = np.asarray(ids), np.asarray(counts)
    metric = np.asarray(_block_metric(pol, q, k, v, ln))
    n = -(-T // 16)
    assert bs == 16 and ids.shape == (3, hkv, n, pol.list_width(T)) and counts.shape == (3, hkv, n)
    check_index_lists(ids, counts, upper=n, name="stem", causal_limit=np.arange(n))
    assert (counts < np.arange(n) + 1).any(), "the pattern must be sparse somewhere"
    for b in range(3):
        np.testing.assert_array_equal(counts[b], np.broadcast_to(_expected_counts(pol, lengths[b], n), (hkv, n)))
        for h in range(hkv):
            for i in range(n):
                chosen = set(ids[b, h, i, :counts[b, h, i]].tolist())
                assert len(chosen) == counts[b, h, i] <= i + 1
                assert max(chosen) <= i
                forced = {j for j in range(i + 1) if j < 2 or j > i - 3}
                assert forced <= chosen, (b, h, i)
                free = sorted(chosen - forced)
                rest = [j for j in range(i + 1) if j not in chosen]
                if free and rest:  # the free picks are the top-scored causal blocks
                    assert metric[b, h, i, free].min() >= metric[b, h, i, rest].max()


def _metric_reference(q, k, v, lengths, block_size, stride, beta, gqa):
    """Brute force: per strided query row, softmax over its causal tiles' anti-diagonal mean logits;
    mass per key block averaged over the block's rows that hold a real query; log; + beta * magnitude."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, T, Hq, D = q.shape
    Hkv, G = k.shape[2], Hq // k.shape[2]
    n = -(-T // block_size)
    m, t = n * block_size // stride, block_size // stride
    out = np.zeros((B, Hkv, n, n))
    for b in range(B):
        for h in range(Hkv):
            per_head = []
            for g in range(G):
                mass = np.zeros((n, n))
                rows = np.zeros(n)
                for a in range(m):
                    if a * stride >= lengths[b]:
                        continue
                    logits = np.zeros(a + 1)
                    for c in range(a + 1):
                        for s in range(stride):
                            qi, kj = a * stride + stride - 1 - s, c * stride + s
                            if qi < T and kj < T:
                                logits[c] += q[b, qi, h * G + g] @ k[b, kj, h]
                    p = np.exp(logits / (stride * math.sqrt(D)) - (logits / (stride * math.sqrt(D))).max())
                    p /= p.sum()
                    for c in range(a + 1):
                        mass[a // t, c // t] += p[c]
                    rows[a // t] += 1
                per_head.append(np.log(mass / np.maximum(rows, 1)[:, None] + 1e-30))
            route = np.mean(per_head, 0) if gqa == "mean" else np.max(per_head, 0)
            mag = np.full(n, -np.inf)
            for j in range(min(T, lengths[b])):
                mag[j // block_size] = max(mag[j // block_size], np.log(np.linalg.norm(v[b, j, h])))
            out[b, h] = route + beta * np.maximum(mag, 0.0)[None, :]
    return out


@pytest.mark.parametrize("gqa", ["mean", "max"])
def test_oam_metric_matches_bruteforce(gqa):
    rng = seeded_rng()
    T = int(rng.integers(70, 100))
    lengths = np.array([T, int(rng.integers(20, T))])
    q, k, v = _qkv(rng, 2, T, 6, 2)
    pol = Stem(block_size=16, stride=4, beta=0.2, gqa=gqa)
    got = np.asarray(_block_metric(pol, q, k, v, jnp.asarray(lengths)))
    ref = _metric_reference(q, k, v, lengths, 16, 4, 0.2, gqa)
    n = ref.shape[-1]
    for b in range(2):
        live = np.tril(np.ones((n, n), bool)) & (np.arange(n) < -(-lengths[b] // 16))[:, None]
        np.testing.assert_allclose(got[b][:, live], ref[b][:, live], rtol=1e-4, atol=1e-4)
    # beta = 0: routing only, V never read
    sam = pol.replace(beta=0.0)
    a = np.asarray(_block_metric(sam, q, k, v, jnp.asarray(lengths)))
    b_ = np.asarray(_block_metric(sam, q, k, v * 1e3 + 5.0, jnp.asarray(lengths)))
    np.testing.assert_array_equal(a, b_)
    assert not np.allclose(np.asarray(_block_metric(pol, q, k, v * 1e3, jnp.asarray(lengths))), got)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(family="llama", vocab_size=89, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2,
                      head_dim=16, intermediate_size=64, max_position_embeddings=512)
    return random_params(cfg, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, 0.3)


def _prefill_logits(params, policy, tokens, lengths):
    """One jitted `prefill` on a fresh cache (eagerly, each of their ops compiled on its own for each shape)."""
    run = jax.jit(lambda p, t, n: prefill(p, policy, t, n, init_cache(p.config, t.shape[0], t.shape[1], page_size=8,
                                                                      dtype=jnp.float32)))
    logits, cache, _, fraction = run(params, jnp.asarray(tokens), jnp.asarray(lengths))
    return np.asarray(logits), cache, float(fraction)


def test_budget_covering_every_block_is_fullkv(tiny):
    rng = seeded_rng()
    tokens = rng.integers(0, 89, (2, 200)).astype(np.int32)
    lengths = np.array([200, 131], np.int32)
    stem = Stem(block_size=16, stride=4, min_blocks=18)  # last of 13 blocks: ceil(0.7 * 18) = 13
    assert stem.is_dense(200) and not stem.replace(min_blocks=17).is_dense(200)
    ref, ref_cache, _ = _prefill_logits(tiny, Dense(), tokens, lengths)
    got, got_cache, fraction = _prefill_logits(tiny, stem, tokens, lengths)
    np.testing.assert_array_equal(got, ref)
    np.testing.assert_array_equal(np.asarray(got_cache.layers.k), np.asarray(ref_cache.layers.k))
    assert fraction == 1.0
    a = generate(tiny, stem, tokens, lengths=lengths, max_new_tokens=5, stop_tokens=(), page_size=8)
    b = generate(tiny, None, tokens, lengths=lengths, max_new_tokens=5, stop_tokens=(), page_size=8)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))


def test_covering_lists_equal_dense_attention_and_short_rows_stay_exact(tiny):
    rng = seeded_rng()
    T = 200
    q, k, v = _qkv(rng, 2, T, 6, 2)
    lengths = jnp.asarray([T, 77])
    n = -(-T // 16)
    metric = jnp.asarray(rng.normal(size=(2, 2, n, n)), jnp.float32)
    ids, counts = jax.jit(select_blocks, static_argnums=(3, 4, 5, 6))(metric, jnp.full((2, n), n + 5), lengths,
                                                                      16, 4, 4, n)
    for b, length in enumerate([T, 77]):
        rows = -(-length // 16)
        np.testing.assert_array_equal(np.asarray(counts[b, :, :rows]), np.broadcast_to(np.arange(rows) + 1, (2, rows)))
        for i in range(rows):
            assert sorted(np.asarray(ids[b, 0, i, :i + 1]).tolist()) == list(range(i + 1))
    out = jax.jit(lambda q, k, v, ids, counts: attention.prefill(q, k, v, (ids, counts, 16)))(q, k, v, ids, counts)
    dense = jax.jit(attention.dense_causal_attention)(q, k, v)
    np.testing.assert_allclose(np.asarray(out[0]), np.asarray(dense[0]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out[1, :77]), np.asarray(dense[1, :77]), rtol=1e-5, atol=1e-5)

    # a batch whose long row is sparse: the short row (<= 8 blocks: all forced) is still exact
    tokens = rng.integers(0, 89, (2, 240)).astype(np.int32)
    stem = Stem(block_size=16, stride=4, min_blocks=2, k_start_ratio=0.2)
    both, _, fraction = _prefill_logits(tiny, stem, tokens, np.array([240, 100], np.int32))
    alone, _, _ = _prefill_logits(tiny, Dense(), tokens[1:, :100], np.array([100], np.int32))
    assert fraction < 0.8
    np.testing.assert_allclose(both[1], alone[0], rtol=1e-4, atol=1e-4)
    sparse_first = _prefill_logits(tiny, Dense(), tokens[:1], np.array([240], np.int32))[0]
    assert not np.allclose(both[0], sparse_first[0], atol=1e-4), "the long row is really sparse"


def _pattern(pol: Stem, q, k, v, lengths) -> tuple[np.ndarray, np.ndarray]:
    B, T = q.shape[:2]
    fn = jax.jit(lambda q, k, v, ln: pol.prefill_pattern(q, k, v, jnp.int32(0), Prompt(jnp.zeros((B, T), jnp.int32),
                                                                                        ln))[:2])
    ids, counts = fn(q, k, v, jnp.asarray(lengths, jnp.int32))
    return np.asarray(ids), np.asarray(counts)


@pytest.mark.parametrize("hq, hkv, gqa, beta, lo, hi", [
    (6, 2, "max", 0.2, 150, 260), (8, 2, "mean", 0.2, 300, 420), (4, 4, "max", 0.0, 200, 330)])
def test_tiled_routing_lists_equal_the_full_metrics(rng, hq, hkv, gqa, beta, lo, hi):
    """The default routing (a lax.map over query-block tiles keeping only the lists) gives the lists of
    the whole-metric reference (select_blocks over block_metric), ids in the same order, at any tile."""
    T = int(rng.integers(lo, hi))
    lengths = [T, int(rng.integers(20, T - 16))]  # ragged: the second row ends blocks before the width
    q, k, v = _qkv(rng, 2, T, hq, hkv)
    full = Stem(block_size=16, stride=4, k_start_ratio=0.3, min_blocks=4, sink_blocks=2, local_blocks=2, gqa=gqa,
                beta=beta, routing="full")
    ref_ids, ref_counts = _pattern(full, q, k, v, lengths)
    n = -(-T // 16)
    assert ref_ids.shape == (2, hkv, n, full.list_width(T)) and (ref_counts < np.arange(n) + 1).any()
    for tile in (None, 1, 3):  # None: one step here (the default budget covers all n query blocks)
        ids, counts = _pattern(full.replace(routing="tiled", route_tile=tile), q, k, v, lengths)
        np.testing.assert_array_equal(ids, ref_ids, err_msg=f"T={T} lengths={lengths} tile={tile}")
        np.testing.assert_array_equal(counts, ref_counts)


def test_tiled_routing_breaks_ties_by_the_lower_block(rng):
    """q = 0 makes every causal tile's logit 0 and unit-norm values make every magnitude 0, so all
    earlier key blocks tie: both paths list forced blocks, then the free ones, then future ones, each
    in increasing order (the tie rule of `top_k`), whatever the row's length."""
    B, T, hq, hkv, D = 2, 150, 6, 2, 16
    q = jnp.zeros((B, T, hq, D), jnp.float32)
    k = jnp.asarray(rng.normal(size=(B, T, hkv, D)), jnp.float32)
    v = rng.normal(size=(B, T, hkv, D))
    v = jnp.asarray(v / np.linalg.norm(v, axis=-1, keepdims=True), jnp.float32)
    lengths = [T, int(rng.integers(20, 100))]
    pol = Stem(block_size=16, stride=4, k_start_ratio=0.3, min_blocks=3, sink_blocks=2, local_blocks=2, beta=0.2)
    n, width = -(-T // 16), pol.list_width(T)
    expected = np.zeros((n, width), np.int32)
    for i in range(n):
        forced = [j for j in range(i + 1) if j < 2 or j > i - 2]
        free = [j for j in range(i + 1) if j not in forced]
        expected[i] = (forced + free + list(range(i + 1, n)))[:width]
    for routed in (pol.replace(routing="full"), pol, pol.replace(route_tile=2)):
        ids, _ = _pattern(routed, q, k, v, lengths)
        np.testing.assert_array_equal(ids, np.broadcast_to(expected, ids.shape), err_msg=routed.name)


def _largest_intermediate(jaxpr) -> int:
    """Bytes of the largest value any equation of ``jaxpr`` (or of a jaxpr inside one: a lax.map's
    body) produces."""
    best = 0
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            best = max(best, math.prod(var.aval.shape) * var.aval.dtype.itemsize)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    best = max(best, _largest_intermediate(inner))
    return best


def test_tiled_routing_memory_is_linear_in_the_strided_length():
    """At 1k and 2k tokens (stride 4: 256 and 512 strided rows), the reference holds the whole
    [T/stride]^2 fp32 strided scores; the tiled routing at 2 query blocks a step holds no value larger
    than q itself, one step's scores [B, Hq, 2 * t, T/stride] or the lists, and XLA's temporaries grow
    2x, not 4x, when T doubles."""
    B, hq, hkv, D, tile = 1, 2, 1, 8, 2
    pol = Stem(block_size=16, stride=4, min_blocks=4, k_start_ratio=0.2)
    sizes = {}
    for T in (1024, 2048):
        q = jax.ShapeDtypeStruct((B, T, hq, D), jnp.float32)
        k = jax.ShapeDtypeStruct((B, T, hkv, D), jnp.float32)
        ln = jax.ShapeDtypeStruct((B,), jnp.int32)
        m, n, width = T // 4, T // 16, pol.list_width(T)
        for routed in (pol.replace(routing="full"), pol.replace(route_tile=tile)):
            def fn(q, k, v, ln, routed=routed, T=T):
                return routed.prefill_pattern(q, k, v, jnp.int32(0), Prompt(jnp.zeros((B, T), jnp.int32), ln))[:2]
            largest = _largest_intermediate(jax.make_jaxpr(fn)(q, k, k, ln).jaxpr)
            temp = jax.jit(fn).lower(q, k, k, ln).compile().memory_analysis().temp_size_in_bytes
            sizes[routed.routing, T] = largest, temp
        squared = B * hq * m * m * 4
        assert sizes["full", T][0] >= squared, sizes
        bound = max(B * T * hq * D * 4, B * hq * tile * 4 * m * 4, B * hkv * n * width * 4)
        assert sizes["tiled", T][0] <= bound < squared // 4, (sizes, bound, squared)
        assert sizes["tiled", T][1] < sizes["full", T][1] / 3, sizes
    assert sizes["full", 2048][1] > 3.5 * sizes["full", 1024][1], sizes
    assert sizes["tiled", 2048][1] < 2.5 * sizes["tiled", 1024][1], sizes


@pytest.mark.parametrize("gqa", ["max", "mean"])
def test_route_kernel_interpret_matches_tile_metric(rng, gqa):
    """The Pallas routing kernel (interpreted) gives its jnp reference's metric on every causal block of a
    tile of query blocks: ragged batch 2, GQA 6/2 (the group padded to 4 heads in the kernel), the
    value-norm bonus on, key chunks and feature chunks smaller than the prompt."""
    B, hq, hkv, D, bs, S = 2, 6, 2, 16, 16, 4
    T = int(rng.integers(150, 230))
    lengths = jnp.asarray([T, int(rng.integers(20, T - 32))])
    q, k, v = _qkv(rng, B, T, hq, hkv, D)
    # each step one jitted program (eagerly, each op compiled on its own at each shape)
    qs, ks, rows_in = jax.jit(strided, static_argnums=(3, 4))(q, k, lengths, bs, S)
    bonus = jax.jit(lambda v, lengths: 0.2 * jnp.maximum(value_magnitude(v, lengths, bs), 0.0))(v, lengths)
    n = qs.shape[0]
    qi = jnp.asarray(np.sort(rng.choice(n, 4, replace=False)), jnp.int32)
    kw = dict(gqa=gqa, scale=1.0 / (S * math.sqrt(D)))
    ref = np.asarray(jax.jit(functools.partial(tile_metric, **kw))(qs[qi], qi, rows_in[qi], ks, bonus))
    kernel = functools.partial(stem_tile_metric_kernel, chunk=16, feature_chunk=32, interpret=True, **kw)
    got = np.asarray(jax.jit(kernel)(qs[qi], qi, rows_in[qi], ks, bonus))
    assert got.shape == ref.shape == (B, hkv, 4, n)
    causal = np.arange(n)[None, :] <= np.asarray(qi)[:, None]
    np.testing.assert_allclose(got[:, :, causal], ref[:, :, causal], rtol=1e-5, atol=1e-4)
    assert np.ptp(ref[:, :, causal]) > 1.0  # the metric varies: a constant would pass any kernel


def test_route_kernel_loops_yield_values_not_literals(rng):
    """The routing kernel's loops return their carry, not a literal: jax 0.11.2's Triton lowering failed on the
    literal (`scf.yield` "Operand 0 ... must be a Value", H200, 2026-11-27) while interpret mode and jax 0.10.2
    accept it, so the kernel's traced loops are checked on the CPU (`pallas.testing.loop_literal_yields`)."""
    from sparsekv_jax.pallas.testing import loop_literal_yields

    B, hq, hkv, D, bs, S = 1, 4, 2, 16, 16, 4
    q, k, v = _qkv(rng, B, 96, hq, hkv, D)
    lengths = jnp.asarray([96])
    qs, ks, rows_in = strided(q, k, lengths, bs, S)
    qi = jnp.asarray([1, 3], jnp.int32)
    bonus = jnp.zeros((B, hkv, qs.shape[0]), jnp.float32)
    args = (qs[qi], qi, rows_in[qi], ks, bonus)
    assert loop_literal_yields(stem_tile_metric_kernel, *args, gqa="max", scale=0.1, chunk=16, feature_chunk=16) == []

    def literal_loop(x):  # the checker itself: a kernel whose loop (dynamic bounds, as above) returns 0 is caught
        def kernel(x_ref, o_ref):
            def body(i, _):
                o_ref[i] = x_ref[i] * 2
                return 0
            jax.lax.fori_loop(0, x_ref.shape[0] - pl.program_id(0), body, 0)
        return pl.pallas_call(kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype), grid=(1,), interpret=True)(x)

    assert len(loop_literal_yields(literal_loop, jnp.arange(8.0))) == 1


def test_kernel_routing_lists_match_the_full_metrics_up_to_near_ties(rng):
    """Stem(routing="kernel") through prefill_pattern: the counts of the reference, and every list the
    same set of blocks unless the blocks swapped lie within 1e-4 of each other in the reference metric."""
    T, hq, hkv = int(rng.integers(200, 300)), 8, 2
    lengths = np.array([T, int(rng.integers(20, T - 16))], np.int32)
    q, k, v = _qkv(rng, 2, T, hq, hkv)
    full = Stem(block_size=16, stride=4, k_start_ratio=0.3, min_blocks=4, sink_blocks=2, local_blocks=2,
                routing="full", route_tile=3)
    ref_ids, ref_counts = _pattern(full, q, k, v, lengths)
    ids, counts = _pattern(full.replace(routing="kernel"), q, k, v, lengths)
    np.testing.assert_array_equal(counts, ref_counts)
    metric = np.asarray(_block_metric(full, q, k, v, jnp.asarray(lengths)))
    same = 0
    for b, h, i in np.ndindex(*counts.shape):
        want, have = set(ref_ids[b, h, i, :counts[b, h, i]]), set(ids[b, h, i, :counts[b, h, i]])
        same += want == have
        if want != have:
            swapped = metric[b, h, i, sorted(want ^ have)]
            assert np.ptp(swapped) < 1e-4, (b, h, i, sorted(want), sorted(have))
    assert same >= 0.95 * counts.size


def test_pallas_kernel_interpret_matches_jnp():
    rng = seeded_rng()
    T = 72  # not a multiple of the block: the kernel pads KV, the lists stay valid
    q, k, v = _qkv(rng, 1, T, 4, 2)
    pol = Stem(block_size=16, stride=4, sink_blocks=1, local_blocks=1, min_blocks=2, k_start_ratio=0.4)
    ids, counts = _pattern(pol, q, k, v, [T])
    assert (counts < np.arange(5) + 1).any()
    pattern = (jnp.asarray(ids), jnp.asarray(counts), pol.block_size)
    # each one jitted program (eagerly, each op compiled on its own)
    run = {impl: jax.jit(lambda q, k, v, ids, counts, impl=impl: attention.prefill(
        q, k, v, (ids, counts, pol.block_size), backend=Backend(sparse_prefill=impl))) for impl in ("jnp", "pallas")}
    ref = run["jnp"](q, k, v, *pattern[:2])
    got = run["pallas"](q, k, v, *pattern[:2])
    np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=2e-5, atol=2e-5)
    dense = jax.jit(attention.dense_causal_attention)(q, k, v)
    assert not np.allclose(np.asarray(ref), np.asarray(dense), atol=1e-3)


def _question_pattern(pol: Stem, q, k, v, lengths, starts) -> tuple[np.ndarray, np.ndarray]:
    """``pol.prefill_pattern`` with a question split (``starts``; ``None``: no split), as host arrays."""
    B, T = q.shape[:2]
    prompt = Prompt(jnp.zeros((B, T), jnp.int32), jnp.asarray(lengths, jnp.int32),
                    None if starts is None else jnp.asarray(starts, jnp.int32))
    ids, counts, _ = jax.jit(lambda q, k, v, p: pol.prefill_pattern(q, k, v, jnp.int32(0), p))(q, k, v, prompt)
    return np.asarray(ids), np.asarray(counts)


@pytest.mark.parametrize("routing", ["tiled", "full"])
def test_dense_question_widens_only_the_question_blocks(rng, routing):
    """``dense_question``: the blocks from the question's first one to the row's last list every causal
    block; every other list (and every list without a split) is the default's, id for id."""
    T = int(rng.integers(330, 400))
    lengths = np.array([T, int(rng.integers(200, T)), int(rng.integers(60, 150))], np.int32)
    starts = np.array([int(rng.integers(1, n)) for n in lengths], np.int32)
    q, k, v = _qkv(rng, 3, T, 6, 2)
    base = Stem(block_size=16, stride=4, k_start_ratio=0.4, min_blocks=4, sink_blocks=1, local_blocks=2,
                routing=routing)
    wide = dataclasses.replace(base, dense_question=True)
    ids0, counts0 = _question_pattern(base, q, k, v, lengths, starts)
    ids, counts = _question_pattern(wide, q, k, v, lengths, starts)
    n = -(-T // 16)
    assert ids.shape == (3, 2, n, n) and counts.shape == (3, 2, n)
    check_index_lists(ids, counts, upper=n, name="stem", causal_limit=np.arange(n))
    widened = False
    for b in range(3):
        first, live = starts[b] // 16, -(-lengths[b] // 16)
        for i in range(n):
            if first <= i < live:
                np.testing.assert_array_equal(counts[b, :, i], i + 1)
                assert all(sorted(ids[b, h, i, :i + 1].tolist()) == list(range(i + 1)) for h in range(2))
                widened |= bool((counts0[b, :, i] < i + 1).any())
            else:
                np.testing.assert_array_equal(counts[b, :, i], counts0[b, :, i])
                for h in range(2):
                    c = counts0[b, h, i]
                    np.testing.assert_array_equal(ids[b, h, i, :c], ids0[b, h, i, :c])
    assert widened, "no question block was sparse by default: the draw tests nothing"
    no_split = _question_pattern(wide, q, k, v, lengths, None)
    for got, want in zip(no_split, _question_pattern(base, q, k, v, lengths, None), strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("impl", ["jnp", "pallas"])
def test_dense_question_rows_equal_dense_attention(rng, impl):
    """The question's rows of a ``dense_question`` prefill equal dense causal attention (jnp reference);
    the context's blocks before the question equal the default's; a question from token 0 is dense."""
    T = 96
    lengths = np.array([T, int(rng.integers(60, T))], np.int32)
    starts = np.array([int(rng.integers(64, 80)), int(rng.integers(40, lengths[1]))], np.int32)
    q, k, v = _qkv(rng, 2, T, 4, 2)
    base = Stem(block_size=16, stride=4, k_start_ratio=0.3, min_blocks=2, sink_blocks=1, local_blocks=1)
    wide = dataclasses.replace(base, dense_question=True)
    run = jax.jit(lambda q, k, v, ids, counts: attention.prefill(
        q, k, v, (ids, counts, 16), backend=Backend(sparse_prefill=impl)))
    dense = np.asarray(jax.jit(attention.dense_causal_attention)(q, k, v))
    sparse = np.asarray(run(q, k, v, *_question_pattern(base, q, k, v, lengths, starts)))
    got = np.asarray(run(q, k, v, *_question_pattern(wide, q, k, v, lengths, starts)))
    differs = False
    for b in range(2):
        lo, hi = starts[b], lengths[b]
        np.testing.assert_allclose(got[b, lo:hi], dense[b, lo:hi], rtol=2e-5, atol=2e-5)
        ctx = starts[b] // 16 * 16
        np.testing.assert_allclose(got[b, :ctx], sparse[b, :ctx], rtol=2e-5, atol=2e-5)
        differs |= not np.allclose(sparse[b, lo:hi], dense[b, lo:hi], atol=1e-3)
    assert differs, "the default's question rows already equal dense attention: the draw tests nothing"
    from_zero = np.asarray(run(q, k, v, *_question_pattern(wide, q, k, v, lengths, np.zeros(2, np.int32))))
    for b in range(2):
        np.testing.assert_allclose(from_zero[b, :lengths[b]], dense[b, :lengths[b]], rtol=2e-5, atol=2e-5)


def test_dense_question_reaches_the_prefill_through_generate(tiny):
    """`generate(question_start=...)` hands the split to Stem's prefill: ``dense_question`` computes more
    blocks than the default with a split and the same without one."""
    rng = seeded_rng()
    tokens = rng.integers(0, 89, (2, 320)).astype(np.int32)
    lengths, starts = np.array([320, 250]), np.array([200, 150])
    base = Stem(block_size=16, stride=4, min_blocks=2, k_start_ratio=0.2)
    wide = dataclasses.replace(base, dense_question=True)

    def fraction(pol, **split):
        out = generate(tiny, pol, tokens, lengths, max_new_tokens=1, stop_tokens=(), page_size=8, **split)
        return float(out.stats["prefill_block_fraction"])

    assert fraction(wide, question_start=starts) > fraction(base, question_start=starts) + 0.05
    assert fraction(wide) == fraction(base)


@pytest.mark.parametrize("make, match", [
    (lambda: Stem(block_size=48), "block_size=48"), (lambda: Stem(block_size=8), "block_size=8"),
    (lambda: Stem(k_start_ratio=0.0), "k_start_ratio=0.0"), (lambda: Stem(k_start_ratio=True), "k_start_ratio=True"),
    (lambda: Stem(mu=0.0), "mu=0.0"), (lambda: Stem(mu=1.5), "mu=1.5"), (lambda: Stem(beta=-0.1), "beta=-0.1"),
    (lambda: Stem(beta=float("nan")), "beta=nan"), (lambda: Stem(sink_blocks=-1), "sink_blocks=-1"),
    (lambda: Stem(local_blocks=0), "local_blocks=0"), (lambda: Stem(min_blocks=2.5), "min_blocks=2.5"),
    (lambda: Stem(schedule="linear"), "schedule='linear'"), (lambda: Stem(stride=3), "stride=3"),
    (lambda: Stem(block_size=16, stride=32), "stride=32"), (lambda: Stem(gqa="sum"), "gqa='sum'"),
    (lambda: Stem(routing="fast"), "routing='fast'"), (lambda: Stem(route_tile=0), "route_tile=0"),
    (lambda: Stem(dense_question=1), "dense_question=1"),
    (lambda: parse_policy("stem(colour=1)"), "colour"),
])
def test_bad_settings_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_spec_and_pipeline(tiny):
    a, b, c = parse_policies("stem, stem(k_start_ratio=0.1, block_size=128), stem(dense_question=True)")
    assert a == Stem() and b.k_start_ratio == 0.1 and b.block_size == 128
    assert c.dense_question is True and c.name == "Stem(dense_question=True)"
    pol = Pipeline(prefill=Stem(block_size=16, stride=4, min_blocks=2),
                   decode=Quest(budget=64, page_size=8, dense_layers=0))
    tokens = seeded_rng().integers(0, 89, (1, 300)).astype(np.int32)
    out = generate(tiny, pol, tokens, max_new_tokens=3, stop_tokens=(), page_size=8)
    assert float(out.stats["prefill_block_fraction"]) < 0.7 and float(out.stats["kv_read_fraction"][0]) < 1.0


def test_ablation_script_core(tiny, tmp_path):
    spec = importlib.util.spec_from_file_location("stem_ablation", ROOT / "experiments" / "stem_ablation.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = seeded_rng()
    prompts = [rng.integers(0, 89, 300).tolist(), rng.integers(0, 89, 260).tolist()]
    policies = {"sparse": Stem(block_size=16, stride=4, min_blocks=2),
                "covering": Stem(block_size=16, stride=4, min_blocks=40)}
    out = mod.ablate(tiny, prompts, policies, last=16, progress=False)
    assert out["covering"]["mean_layer_mse"] == 0 and out["covering"]["logit_mse"] == 0
    assert out["covering"]["block_fraction"] == 1 and out["covering"]["top1"] == 1
    s = out["sparse"]
    assert len(s["layer_mse"]) == 2 and s["mean_layer_mse"] > 0 and s["logit_mse"] > 0 and s["block_fraction"] < 0.8
    assert s["layer_mse"][0] == pytest.approx(s["layer_mse_local"][0])  # layer 0 sees the same input
    table = mod.markdown(out)
    assert table.count("\n") == 3 and "| sparse |" in table
    assert set(mod.configs(block_size=16)) == {"Uniform + SAM", "TPD + SAM", "Uniform + OAM", "TPD + OAM (Stem)",
                                               "TPD + OAM, GQA mean"}
