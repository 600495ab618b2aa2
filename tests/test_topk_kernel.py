"""The Pallas threshold top-k (interpret mode on CPU) against numpy, ties and short rows included."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.pallas.topk import threshold_top_k, threshold_top_k_applies, threshold_top_k_reference


def _numpy_top_k(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """k largest of max(x, 0), ties to the lower index; ids ascending."""
    r = np.where(x > 0, x, 0).astype(np.float32)
    order = np.argsort(-r, axis=-1, kind="stable")[:, :k]
    kth = np.take_along_axis(r, order, -1).min(-1)
    ids = np.sort(order, -1)
    return np.take_along_axis(r, ids, -1), ids.astype(np.int32), kth


def _rows(rng: np.random.Generator, M: int, W: int) -> np.ndarray:
    x = rng.normal(size=(M, W)).astype(np.float32) * rng.uniform(0.01, 100)
    x[0] = np.abs(x[0])  # all positive
    x[1, : W - 3] = -np.abs(x[1, : W - 3])  # three positive entries only: the rest fill with zeros
    x[2, rng.choice(W, W // 3, replace=False)] = 0.75  # a large tie straddling the k-th place
    x[3, ::2] = -0.0  # negative zeros count as zeros
    return x


# (early_exit, fast_select, block_rows): the fast selection runs only where every row of a program
# exited early; with 2 rows per program a tied row sends its neighbour down the tie scan too
@pytest.mark.parametrize("early_exit,fast_select,block_rows", [(True, True, 1), (True, True, 2), (True, False, 1),
                                                               (False, False, 1)])
@pytest.mark.parametrize("W,k", [(64, 1), (128, 17), (256, 64), (256, 256)])
def test_threshold_top_k_equals_numpy(W, k, early_exit, fast_select, block_rows):
    rng = seeded_rng()
    x = _rows(rng, 6, W)
    want_v, want_i, want_t = _numpy_top_k(x, k)
    v, i, t = threshold_top_k(jnp.asarray(x), k, early_exit=early_exit, fast_select=fast_select,
                              block_rows=block_rows, interpret=True)
    np.testing.assert_array_equal(np.asarray(i), want_i)
    np.testing.assert_array_equal(np.asarray(v), want_v)
    np.testing.assert_array_equal(np.asarray(t), want_t)
    rv, ri, rt = threshold_top_k_reference(jnp.asarray(x), k)  # the jnp reference: same contract
    np.testing.assert_array_equal(np.asarray(ri), want_i)
    np.testing.assert_array_equal(np.asarray(rv), want_v)


def test_threshold_top_k_keeps_leading_axes():
    rng = seeded_rng()
    x = np.abs(rng.normal(size=(2, 3, 128))).astype(np.float32)
    v, i, t = threshold_top_k(jnp.asarray(x), 8, interpret=True)
    assert v.shape == i.shape == (2, 3, 8) and t.shape == (2, 3)
    want_v, want_i, _ = _numpy_top_k(x.reshape(6, 128), 8)
    np.testing.assert_array_equal(np.asarray(i).reshape(6, 8), want_i)


def test_threshold_top_k_rejects_bad_shapes():
    assert not threshold_top_k_applies(1000, 8) and not threshold_top_k_applies(8, 4)
    with pytest.raises(ValueError, match="width=1000"):
        threshold_top_k(jnp.ones((2, 1000)), 8, interpret=True)
    with pytest.raises(ValueError, match="k=300"):
        threshold_top_k(jnp.ones((2, 256)), 300, interpret=True)
