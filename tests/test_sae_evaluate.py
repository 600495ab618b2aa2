"""The held-out SAE evaluation (`sparsekv_jax.sae.evaluate`): its metrics against a numpy reference, and its
memory bounded by the encoding chunk (an H200 run of Qwen2.5-Coder-1.5B's paper SAEs ran out of memory,
asking 97 GiB, when a batch's query vectors were all encoded at once; docs/SAE.md)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.sae.evaluate import _batch_stats, batch_moments, default_chunk, evaluate, merge_moments
from sparsekv_jax.sae.keys import projections
from sparsekv_jax.sae.model import TopKSAE

TINY = ModelConfig(family="llama", vocab_size=211, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=96, max_position_embeddings=256)
LAYERS = (2, 0)  # stack order differs from layer order


def _random_sae(rng: np.random.Generator, width: int, k: int, bias: float) -> TopKSAE:
    """Random stacked SAEs (not the tied init: encoder and decoder unrelated); ``bias`` shifts the latent
    bias so that some vectors have fewer than ``k`` positive pre-activations (L0 < k)."""
    L, D = len(LAYERS), TINY.head_dim
    f = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    return TopKSAE(w_enc=f(L, D, width) * 0.5, b_enc=f(L, width) * 0.3 + bias, w_dec=f(L, width, D) * 0.3,
                   b_dec=f(L, D) * 0.1, k=k).validate()


def _reference(sae: TopKSAE, params, rows: np.ndarray, drop_first: int) -> list[dict]:
    """FVU, L0 and dead fraction in float64 numpy: dense pre-activations, top k by argsort, all vectors at once;
    ``margin``: the smallest gap between a vector's k-th and (k+1)-th positive pre-activation."""
    keys, queries = projections(params, jnp.asarray(rows), LAYERS, queries=True)
    w_enc, b_enc, w_dec, b_dec = (np.asarray(a, np.float64) for a in (sae.w_enc, sae.b_enc, sae.w_dec, sae.b_dec))
    out = []
    for i, layer in enumerate(LAYERS):
        rec = {"layer": layer}
        for name, v in (("", keys), ("_queries", queries)):
            x = np.asarray(v[i][:, drop_first:], np.float64).reshape(-1, TINY.head_dim)
            z = np.maximum((x - b_dec[i]) @ w_enc[i] + b_enc[i], 0)
            order = np.argsort(-z, axis=1)
            top = order[:, : sae.k]
            kth, next_ = (np.take_along_axis(z, order[:, j:j + 1], axis=1)[:, 0] for j in (sae.k - 1, sae.k))
            rec["margin"] = min(rec.get("margin", np.inf), np.min(np.where(kth > 0, kth - next_, np.inf)))
            a = np.take_along_axis(z, top, axis=1)
            x_hat = np.einsum("nk,nkd->nd", a, w_dec[i][top]) + b_dec[i]
            rec["fvu" + name] = np.sum((x - x_hat) ** 2) / np.sum((x - x.mean(0)) ** 2)
            rec["l0" + name] = np.mean(np.sum(a > 0, axis=1))
            rec["vectors" + name] = len(x)
            if name == "":
                fired = np.zeros(sae.width, bool)
                fired[top[a > 0]] = True
                rec["dead_fraction"] = 1 - fired.mean()
        out.append(rec)
    return out


@pytest.mark.parametrize("bias", [0.0, -4.5])
def test_chunked_evaluation_matches_a_numpy_reference(bias):
    """5 rows in batches of 2 (the last batch padded), encoded 7 vectors at a time (dividing neither the
    keys' 2 x 30 x 2 = 120 vectors a batch nor the queries' 240), and in one chunk (the default here):
    FVU, L0 and dead fraction of keys and queries equal the float64 reference's; the two chunkings agree
    to fp32 rounding and on every latent that fired."""
    rng = seeded_rng()
    for _ in range(6):  # redraw while a k-th and (k+1)-th pre-activation tie within float32 rounding: the fp32
        # top k may then pick the other latent, moving a random SAE's FVU by 3e-4 (one CI draw)
        params = random_params(TINY, jax.random.key(int(rng.integers(2**31))), jnp.float32, scale=0.1)
        sae = _random_sae(rng, width=512, k=8, bias=bias)
        rows = rng.integers(1, TINY.vocab_size, size=(5, 34))
        want = _reference(sae, params, rows, drop_first=4)
        if min(r["margin"] for r in want) > 1e-5:
            break
    else:
        pytest.fail("no draw without near-ties")
    chunked = evaluate(sae, params, rows, LAYERS, drop_first=4, batch_rows=2, method="lax", chunk=7)
    whole = evaluate(sae, params, rows, LAYERS, drop_first=4, batch_rows=2, method="lax")
    assert default_chunk(len(LAYERS), 512) >= 240  # so `whole` encodes each batch in one chunk
    for got in (chunked, whole):
        for g, r in zip(got, want, strict=True):
            assert g["layer"] == r["layer"]
            assert g["vectors"] == r["vectors"] == 5 * 30 * 2 and g["vectors_queries"] == 5 * 30 * 4
            for key in ("fvu", "fvu_queries", "l0", "l0_queries"):
                np.testing.assert_allclose(g[key], r[key], rtol=2e-5, err_msg=f"{key} of layer {r['layer']}")
            assert g["dead_fraction"] == r["dead_fraction"], (g, r)
    for c, w in zip(chunked, whole, strict=True):
        assert c["dead_fraction"] == w["dead_fraction"] and c["l0"] == w["l0"] and c["l0_queries"] == w["l0_queries"]
        for key in ("fvu", "fvu_queries"):
            np.testing.assert_allclose(c[key], w[key], rtol=1e-6)
    l0s = [r["l0"] for r in want]
    if bias < 0:  # the shifted bias leaves fewer than k positive on some vectors, and latents dead
        assert all(0 < v < 8 for v in l0s) and all(r["dead_fraction"] > 0 for r in want), want
    else:
        assert all(v == 8 for v in l0s), want


def test_bad_chunk_and_batch_rows_are_refused_by_name():
    rng = seeded_rng()
    params = random_params(TINY, jax.random.key(0), jnp.float32, scale=0.1)
    sae = _random_sae(rng, width=32, k=4, bias=0.0)
    rows = rng.integers(1, TINY.vocab_size, size=(2, 12))
    with pytest.raises(ValueError, match="chunk=0"):
        evaluate(sae, params, rows, LAYERS, drop_first=4, chunk=0)
    with pytest.raises(ValueError, match="batch_rows=0"):
        evaluate(sae, params, rows, LAYERS, drop_first=4, batch_rows=0)


def _temp_bytes(heads: int, batch_rows: int, width: int, chunk: int) -> int:
    """XLA's temporary buffer size of `_batch_stats` compiled for the given shape (nothing is run)."""
    cfg = dataclasses.replace(TINY, num_heads=heads)
    params = jax.eval_shape(lambda: random_params(cfg, jax.random.key(0), jnp.float32))
    f = jax.ShapeDtypeStruct
    sae = TopKSAE(w_enc=f((2, 16, width), jnp.float32), b_enc=f((2, width), jnp.float32),
                  w_dec=f((2, width, 16), jnp.float32), b_dec=f((2, 16), jnp.float32), k=8)
    lowered = _batch_stats.lower(sae, params, f((batch_rows, 36), jnp.int32), f((batch_rows,), jnp.float32),
                                 LAYERS, 4, "lax", "xla", chunk)
    return lowered.compile().memory_analysis().temp_size_in_bytes


def test_evaluation_memory_is_bounded_by_the_chunk_not_the_rows_or_heads():
    """The defect: a batch's [layers, rows x tokens x heads, width] fp32 scores were built at once (Qwen's
    queries: 48 GiB, 97 GiB with the top-k's). Compiled on the CPU, the temporaries of a batch with 4x the
    rows, or 4x the query heads, are no larger than the base batch's, and stay within 4 chunks of scores
    (the old code: 24, 97 and 72 MiB, 3x the queries' scores; here at most 16 MiB)."""
    width, chunk = 4096, 128
    chunk_scores = len(LAYERS) * chunk * width * 4  # 4 MiB
    base = _temp_bytes(heads=4, batch_rows=2, width=width, chunk=chunk)
    more_rows = _temp_bytes(heads=4, batch_rows=8, width=width, chunk=chunk)
    more_heads = _temp_bytes(heads=16, batch_rows=2, width=width, chunk=chunk)
    for got in (base, more_rows, more_heads):
        assert got <= 4 * chunk_scores, (base, more_rows, more_heads, chunk_scores)
    assert max(more_rows, more_heads) <= 1.25 * base, (base, more_rows, more_heads)


def test_moments_far_from_zero_merge_to_the_float64_variance():
    """Vectors whose mean (1e3) is large against their spread (0.1..1), as a real layer's keys can be, in
    batches of unequal sizes with padding weighted 0: the merged centred sum of squares equals float64
    numpy's within 1e-4. Sum of squares minus squared sum in float32 over all vectors (the form `evaluate`
    used within each batch before) misses by orders of magnitude more, which the test shows on this data."""
    rng = seeded_rng()
    L, D = 2, 16
    sizes = [int(s) for s in rng.integers(50, 400, size=5)]
    x = (1e3 + rng.normal(size=(L, sum(sizes), D)) * rng.uniform(0.1, 1.0, size=(L, 1, D))).astype(np.float32)
    want = np.sum(np.square(x.astype(np.float64) - x.astype(np.float64).mean(1, keepdims=True)), axis=(1, 2))
    acc = None
    start = 0
    for size in sizes:
        part = np.concatenate([x[:, start:start + size], np.full((L, 7, D), 5e3, np.float32)], axis=1)
        w = np.r_[np.ones(size), np.zeros(7)].astype(np.float32)  # padding of weight 0, far off the mean
        m = {k: np.asarray(v, np.float64) for k, v in batch_moments(jnp.asarray(part), jnp.asarray(w)).items()}
        acc = m if acc is None else merge_moments(acc, m)
        start += size
    assert acc["n"] == sum(sizes)
    np.testing.assert_allclose(acc["mean"], x.astype(np.float64).mean(1), rtol=1e-6)
    np.testing.assert_allclose(acc["m2"], want, rtol=1e-4)
    x32 = jnp.asarray(x)
    naive = jnp.sum(x32 * x32, axis=(1, 2)) - jnp.sum(jnp.square(jnp.sum(x32, axis=1)), axis=-1) / x.shape[1]
    assert np.max(np.abs(np.asarray(naive, np.float64) / want - 1)) > 1e-2
