"""`layer_matmul` (interpret mode) against its jnp reference: one layer of a stack read by index,
every other layer NaN-poisoned; split-K, padded rows, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.pallas.matmul import MATMUL_MAX_PROGRAMS, layer_matmul, layer_matmul_reference, matmul_plan


@pytest.mark.parametrize("M,K,N,dtype,splits", [
    (1, 256, 192, jnp.float32, None),
    (5, 576, 576, jnp.bfloat16, None),
    (20, 128, 1024, jnp.float32, 1),
    (33, 64, 48, jnp.float32, None),
    (8, 512, 128, jnp.bfloat16, 4),
    (3, 256, 192, jnp.float32, 2),
])
def test_matches_reference_and_reads_only_its_layer(rng, M, K, N, dtype, splits):
    L = 3
    layer = int(rng.integers(L))
    x = jnp.asarray(rng.standard_normal((M, K)), dtype)
    w1 = jnp.asarray(rng.standard_normal((K, N)) / np.sqrt(K), dtype)
    w = jnp.stack([w1 if i == layer else jnp.full_like(w1, jnp.nan) for i in range(L)])
    out = jax.jit(lambda i: layer_matmul(x, w, i, num_splits=splits, interpret=True))(jnp.int32(layer))
    ref = layer_matmul_reference(x.astype(jnp.float32), w1[None].astype(jnp.float32), 0)
    assert out.shape == (M, N) and out.dtype == dtype
    got = np.asarray(out, np.float32)
    assert np.isfinite(got).all(), "read a poisoned layer"
    tol = 2e-2 if dtype == jnp.bfloat16 else 1e-5
    np.testing.assert_allclose(got, np.asarray(ref), rtol=tol, atol=tol)


def test_plan_fills_the_grid_and_divides_k():
    for K, N in ((4096, 1024), (4096, 4096), (14336, 4096), (4096, 14336), (576, 192)):
        bm, bn, bk, splits = matmul_plan(1, K, N)
        assert (bm, bn) == (16, 64) and K % bk == 0 and (K // bk) % splits == 0
        # within the programs cap, and no larger split would still fit under it
        assert splits == 1 or (N // bn) * splits <= MATMUL_MAX_PROGRAMS
        bigger = [d for d in range(splits + 1, K // bk + 1) if (K // bk) % d == 0]
        assert not bigger or (N // bn) * bigger[0] > MATMUL_MAX_PROGRAMS
    # the narrow K/V projection still fills the chip: 256 programs of 2 K tiles
    assert matmul_plan(1, 4096, 1024)[3] * (1024 // 64) >= 200
    assert matmul_plan(32, 4096, 14336)[0] == 32


def test_errors():
    x = jnp.zeros((2, 32), jnp.float32)
    w = jnp.zeros((2, 32, 48), jnp.float32)
    with pytest.raises(ValueError, match="layer=2"):
        layer_matmul(x, w, 2, interpret=True)
    with pytest.raises(ValueError, match="same K"):
        layer_matmul(jnp.zeros((2, 16), jnp.float32), w, 0, interpret=True)
    with pytest.raises(ValueError, match="dtype"):
        layer_matmul(x.astype(jnp.bfloat16), w, 0, interpret=True)
    with pytest.raises(ValueError, match="multiples of 16"):
        layer_matmul(jnp.zeros((2, 24), jnp.float32), jnp.zeros((1, 24, 48), jnp.float32), 0, interpret=True)
