"""`rope_page_sums` (interpret mode) and its jnp reference against a numpy loop that rotates each
key back by its slot: one layer of a stacked cache read by index (every other layer
NaN-poisoned), partial last pages, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.pallas.page_rope import rope_page_sums, rope_page_sums_reference


def _rotate_back(x: np.ndarray, angle: np.ndarray) -> np.ndarray:
    """R(-angle) on [..., D] in the rotate-half layout, float64."""
    x1, x2 = np.split(x, 2, axis=-1)
    c, s = np.cos(angle), np.sin(angle)
    return np.concatenate([x1 * c + x2 * s, x2 * c - x1 * s], axis=-1)


@pytest.mark.parametrize("B,H,S,D,ps,block_p,dtype", [
    (2, 2, 128, 32, 8, 16, jnp.float32),    # P = 16 = one block
    (1, 3, 200, 64, 16, 16, jnp.float32),   # S % ps != 0: a partial last page, P past one block
    (2, 1, 96, 32, 4, 32, jnp.bfloat16),    # P = 24 < block_p: a padded block
    (1, 2, 64, 16, 32, 16, jnp.float32),    # D/2 = 8
])
def test_matches_loop_and_reads_only_its_layer(rng, B, H, S, D, ps, block_p, dtype):
    L = 3
    layer = int(rng.integers(L))
    inv_freq = 1.0 / (rng.uniform(100, 10000) ** (np.arange(0, D, 2) / D))
    k1 = jnp.asarray(rng.standard_normal((B, H, S, D)), dtype)
    k = jnp.stack([k1 if i == layer else jnp.full_like(k1, jnp.nan) for i in range(L)])
    out = jax.jit(lambda i: rope_page_sums(k, inv_freq, i, page_size=ps, block_p=block_p, interpret=True))(
        jnp.int32(layer))
    P = -(-S // ps)
    assert out.shape == (B, H, P, D) and out.dtype == jnp.float32
    got = np.asarray(out)
    assert np.isfinite(got).all(), "read a poisoned layer"
    kn = np.asarray(k1, np.float64)
    want = np.zeros((B, H, P, D))
    for p in range(P):
        for j in range(min(ps, S - p * ps)):
            want[:, :, p] += _rotate_back(kn[:, :, p * ps + j], j * inv_freq)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-4)
    ref = rope_page_sums_reference(k, inv_freq, layer, page_size=ps)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=1e-5, atol=1e-4)


def test_errors():
    k = jnp.zeros((2, 1, 1, 32, 16), jnp.float32)
    inv_freq = np.ones(8)
    with pytest.raises(ValueError, match="layer=2"):
        rope_page_sums(k, inv_freq, 2, page_size=4, interpret=True)
    with pytest.raises(ValueError, match="head_dim/2 = 8"):
        rope_page_sums(k, np.ones(4), 0, page_size=4, interpret=True)
    with pytest.raises(ValueError, match="block_p=24"):
        rope_page_sums(k, inv_freq, 0, page_size=4, block_p=24, interpret=True)
    with pytest.raises(ValueError, match="head_dim=24"):
        rope_page_sums(jnp.zeros((1, 1, 1, 8, 24)), np.ones(12), 0, page_size=4, interpret=True)
    with pytest.raises(ValueError, match="k \\[L, B, H, S, D\\]"):
        rope_page_sums(k[0], inv_freq, 0, page_size=4, interpret=True)
