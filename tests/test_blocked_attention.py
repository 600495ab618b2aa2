"""The CPU prefill's blocked (flash-style) causal attention against a numpy brute force."""

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax import attention
from sparsekv_jax.backend import Backend


def _reference(q, k, v, window=None):
    """Causal softmax attention in float64, one (row, head) at a time; GQA by head // group."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = np.zeros((B, T, Hq, D))
    for b in range(B):
        for h in range(Hq):
            s = q[b, :, h].astype(np.float64) @ k[b, :, h // G].astype(np.float64).T / np.sqrt(D)
            delta = np.arange(T)[:, None] - np.arange(T)[None, :]
            visible = (delta >= 0) if window is None else (delta >= 0) & (delta < window)
            s = np.where(visible, s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[b, :, h] = (p / p.sum(-1, keepdims=True)) @ v[b, :, h // G].astype(np.float64)
    return out


@pytest.mark.parametrize("T,block,window", [(37, 16, None), (64, 16, None), (100, 32, 40), (70, 16, 5)])
def test_blocked_matches_brute_force(T, block, window):
    rng = seeded_rng()
    q = rng.normal(size=(2, T, 6, 16)).astype(np.float32)
    k = rng.normal(size=(2, T, 2, 16)).astype(np.float32)
    v = rng.normal(size=(2, T, 2, 16)).astype(np.float32)
    got = attention.blocked_causal_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), block=block,
                                             sliding_window=window)
    np.testing.assert_allclose(np.asarray(got), _reference(q, k, v, window), atol=2e-5, rtol=1e-4)


def test_blocked_bf16_stays_close_to_fp32():
    rng = seeded_rng()
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((1, 50, 4, 16), (1, 50, 2, 16), (1, 50, 2, 16)))
    got = attention.blocked_causal_attention(*(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)), block=16)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), _reference(q, k, v), atol=3e-2)


def test_prefill_dispatch_picks_blocked_on_cpu_past_one_block():
    rng = seeded_rng()
    T = attention.PREFILL_BLOCK + 5
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in ((1, T, 2, 8), (1, T, 1, 8), (1, T, 1, 8)))
    auto = attention.prefill(q, k, v, None, backend=Backend())
    xla = attention.prefill(q, k, v, None, backend=Backend(dense_prefill="xla"))
    blocked = attention.blocked_causal_attention(q, k, v)
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(blocked))  # the same program: bit-identical
    np.testing.assert_allclose(np.asarray(auto), np.asarray(xla), atol=1e-5)
    with pytest.raises(ValueError, match="dense_prefill"):
        Backend(dense_prefill="flash")
