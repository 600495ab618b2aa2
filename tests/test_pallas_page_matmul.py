"""`page_matmul` (interpret mode) against its jnp reference and a numpy loop: one layer of a
stacked cache read by index (every other layer NaN-poisoned), partial last pages, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.pallas.page_matmul import page_matmul, page_matmul_reference


@pytest.fixture
def rng() -> np.random.Generator:
    seed = int(np.random.SeedSequence().entropy % 2**32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("B,H,S,D,N,ps,block_p,dtype", [
    (2, 2, 128, 16, 16, 8, 16, jnp.float32),   # P = 16 = one block
    (1, 3, 200, 32, 16, 16, 16, jnp.float32),  # S % ps != 0: a partial last page, P past one block
    (2, 1, 96, 16, 32, 4, 32, jnp.bfloat16),   # P = 24 < block_p: a padded block
])
def test_matches_loop_and_reads_only_its_layer(rng, B, H, S, D, N, ps, block_p, dtype):
    L = 3
    layer = int(rng.integers(L))
    k1 = jnp.asarray(rng.standard_normal((B, H, S, D)), dtype)
    k = jnp.stack([k1 if i == layer else jnp.full_like(k1, jnp.nan) for i in range(L)])
    m = jnp.asarray(rng.standard_normal((ps * D, N)) / np.sqrt(ps * D), dtype)
    out = jax.jit(lambda i: page_matmul(k, m, i, page_size=ps, block_p=block_p, interpret=True))(jnp.int32(layer))
    P = -(-S // ps)
    assert out.shape == (B, H, P, N) and out.dtype == jnp.float32
    got = np.asarray(out)
    assert np.isfinite(got).all(), "read a poisoned layer"
    kn, mn = np.asarray(k1, np.float64), np.asarray(m, np.float64)
    want = np.zeros((B, H, P, N))
    for p in range(P):  # a page's slots j against rows j*D:(j+1)*D of m
        for j in range(min(ps, S - p * ps)):
            want[:, :, p] += kn[:, :, p * ps + j] @ mn[j * D:(j + 1) * D]
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol)
    ref = page_matmul_reference(k, m, layer, page_size=ps)
    np.testing.assert_allclose(np.asarray(ref), want, rtol=tol, atol=tol)


def test_errors():
    k = jnp.zeros((2, 1, 1, 32, 16), jnp.float32)
    m = jnp.zeros((4 * 16, 16), jnp.float32)
    with pytest.raises(ValueError, match="layer=2"):
        page_matmul(k, m, 2, page_size=4, interpret=True)
    with pytest.raises(ValueError, match="page_size\\*D"):
        page_matmul(k, m, 0, page_size=8, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        page_matmul(k, m.astype(jnp.bfloat16), 0, page_size=4, interpret=True)
    with pytest.raises(ValueError, match="block_p=24"):
        page_matmul(k, m, 0, page_size=4, block_p=24, interpret=True)
    with pytest.raises(ValueError, match="k \\[L, B, H, S, D\\]"):
        page_matmul(k[0], m, 0, page_size=4, interpret=True)
