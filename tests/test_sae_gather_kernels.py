"""The SAE's gather kernels (`sparsekv_jax.pallas.sae_decode`, interpret mode on CPU) against jnp, and the
training loss built on them against the dense-gradient loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.pallas.sae_decode import (
    gather_decode,
    gather_decode_reference,
    gather_dot,
    gather_dot_reference,
    scatter_rows,
)
from sparsekv_jax.sae.config import TrainConfig
from sparsekv_jax.sae.model import pre_activations, selected_activations
from sparsekv_jax.sae.train import init_train_state, losses


def _seed() -> int:
    return int(seeded_rng().integers(1 << 30))


def _inputs(S=2, N=40, W=256, D=16, k=5):
    """Random table, k distinct ids per row (as a top-k gives), coefficients, per-row vectors."""
    keys = jax.random.split(jax.random.key(_seed()), 5)
    table = jax.random.normal(keys[0], (S, W, D))
    bias = jax.random.normal(keys[1], (S, D))
    ids = jax.lax.top_k(jax.random.uniform(keys[2], (S, N, W)), k)[1].astype(jnp.int32)
    coef = jax.random.uniform(keys[3], (S, N, k)) * 2 - 0.5
    vec = jax.random.normal(keys[4], (S, N, D))
    return table, bias, ids, coef, vec


@pytest.mark.share(2)
@pytest.mark.parametrize("N,k,block_rows,unroll", [(40, 5, 16, 2), (64, 8, 32, 4), (7, 3, 8, 1)])
def test_gather_decode_and_its_gradient_equal_jnp(N, k, block_rows, unroll):
    table, bias, ids, coef, vec = _inputs(N=N, k=k)

    def kern(t, b, c):
        return gather_decode(t, b, ids, c, block_rows=block_rows, unroll=unroll, interpret=True)

    def ref(t, b, c):
        return gather_decode_reference(t, b, ids, c)

    np.testing.assert_allclose(kern(table, bias, coef), ref(table, bias, coef), rtol=1e-5, atol=1e-5)
    g = jax.random.normal(jax.random.key(_seed()), (2, N, 16))
    for got, want in zip(jax.vjp(kern, table, bias, coef)[1](g), jax.vjp(ref, table, bias, coef)[1](g), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("N,k,block_rows,unroll", [(40, 5, 16, 2), (64, 8, 32, 4)])
def test_gather_dot_and_its_gradient_equal_jnp(N, k, block_rows, unroll):
    table, _, ids, _, vec = _inputs(N=N, k=k)

    def kern(t, v):
        return gather_dot(t, ids, v, block_rows=block_rows, unroll=unroll, interpret=True)

    def ref(t, v):
        return gather_dot_reference(t, ids, v)

    np.testing.assert_allclose(kern(table, vec), ref(table, vec), rtol=1e-5, atol=1e-5)
    g = jax.random.normal(jax.random.key(_seed()), (2, N, k))
    for got, want in zip(jax.vjp(kern, table, vec)[1](g), jax.vjp(ref, table, vec)[1](g), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_scatter_rows_equals_numpy():
    _, _, ids, coef, vec = _inputs(W=64)  # few latents: many rows share one
    want = np.zeros((2, 64, 16), np.float32)
    i, c, v = np.asarray(ids), np.asarray(coef), np.asarray(vec)
    for s in range(2):
        for n in range(ids.shape[1]):
            for j in range(ids.shape[2]):
                want[s, i[s, n, j]] += c[s, n, j] * v[s, n]
    np.testing.assert_allclose(scatter_rows(ids, coef, vec, 64), want, rtol=1e-5, atol=1e-5)


def test_gather_kernels_reject_bad_input():
    table, bias, ids, coef, vec = _inputs()
    with pytest.raises(ValueError, match="power-of-two row size"):
        gather_decode(table[..., :12], bias[..., :12], ids, coef, interpret=True)
    with pytest.raises(ValueError, match="one shape"):
        gather_decode(table, bias, ids, coef[..., :3], interpret=True)
    with pytest.raises(ValueError, match="block_rows=24"):
        gather_dot(table, ids, vec, block_rows=24, interpret=True)


def test_selected_activations_equal_the_dense_ones():
    cfg = TrainConfig(width=128, k=8, batch_size=64)
    x = jax.random.normal(jax.random.key(_seed()), (2, 64, 16)) * 3 + 1
    sae = init_train_state(jax.random.key(_seed()), x, cfg, 10).sae
    sae = sae.replace(b_enc=jax.random.normal(jax.random.key(_seed()), (2, 128)))
    pre = pre_activations(sae, x)
    ids = jax.lax.top_k(pre, 8)[1].astype(jnp.int32)
    want = jnp.take_along_axis(jax.nn.relu(pre), ids, axis=-1)
    for method in ("xla", "pallas"):
        np.testing.assert_allclose(selected_activations(sae, x, ids, method), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("auxk", [False, True])
def test_loss_with_the_gather_kernels_has_the_dense_loss_gradient(auxk):
    """decode="pallas" (sparse encoder gradient, kernels) against "xla" (dense ∂pre and xᵀ·∂pre)."""
    x = jax.random.normal(jax.random.key(_seed()), (2, 128, 16)) * 3 + 1
    dead = jnp.broadcast_to(jnp.arange(128) % 3 == 0, (2, 128)) if auxk else jnp.zeros((2, 128), bool)
    out = {}
    for method in ("xla", "pallas"):
        cfg = TrainConfig(width=128, k=8, batch_size=128, topk="lax", decode=method)
        sae = init_train_state(jax.random.key(0), x, cfg, 10).sae
        (loss, parts), grads = jax.value_and_grad(losses, has_aux=True)(sae, x, dead, cfg, auxk)
        out[method] = (loss, parts, grads)
    np.testing.assert_allclose(out["pallas"][0], out["xla"][0], rtol=1e-5)
    assert float(out["xla"][1]["auxk"].sum() > 0) == auxk
    for name in ("w_enc", "b_enc", "w_dec", "b_dec"):
        want = getattr(out["xla"][2], name)
        got = getattr(out["pallas"][2], name)
        assert float(jnp.max(jnp.abs(want))) > 0
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * float(jnp.max(jnp.abs(want))))


def test_decode_method_is_validated():
    with pytest.raises(ValueError, match="decode='cuda'"):
        TrainConfig(width=128, k=8, batch_size=64, decode="cuda")
