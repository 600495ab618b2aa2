"""The GSC kernel (`sparsekv_jax.pallas.gsc`, interpreted on the CPU) against its jnp reference,
`clustering.greedy_seed_clustering`, on fresh random keys with planted clusters."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.pallas.gsc import greedy_seed_clustering_kernel
from sparsekv_jax.policies import clustering


def planted_band(rng, B: int, H: int, T: int, width: int, groups: int = 5, noise: float = 0.4):
    D = 8
    centres = rng.standard_normal((B, H, groups, D))
    which = rng.integers(0, groups, (B, H, T))
    keys = np.take_along_axis(centres, which[..., None], axis=2) + noise * rng.standard_normal((B, H, T, D))
    return clustering.similarity_band(jnp.asarray(keys, jnp.float32), width)


@pytest.mark.share(2)
@pytest.mark.parametrize("width, tile, T", [(16, 32, 150), (8, 64, 70), (32, 16, 97)])
def test_kernel_equals_the_jnp_reference_on_every_layout(width, tile, T):
    rng = seeded_rng()
    B, H, K = 2, 3, 5
    band = planted_band(rng, B, H, T, width)
    is_delim = jnp.asarray(rng.random((B, T)) < 0.15)
    lengths = jnp.asarray([T, T - 17], jnp.int32)
    keep = jnp.asarray([T // 2, T // 3], jnp.int32)
    _, _, member, place, _ = clustering.candidate_layouts(is_delim, lengths, keep, 4, 8, width, (0, 1, 2))
    # thresholds spread over the cosines' range, and one above all (every member its own seed)
    taus = rng.uniform(-0.2, 0.95, (3, K, B, H)).astype(np.float32)
    taus[:, 0] = 1.0
    ref = np.stack([np.asarray(clustering.greedy_seed_clustering(band, member[n], place[n], jnp.asarray(taus[n])))
                    for n in range(3)])
    got = np.asarray(greedy_seed_clustering_kernel(band, member, place, jnp.asarray(taus), tile=tile,
                                                   interpret=True))
    assert got.shape == ref.shape == (3, K, B, H, T) and got.dtype == ref.dtype
    assert (ref[:, 1:] != 0).mean() > 0.2, "members did merge"
    assert not ref[:, 0].any(), "tau = 1 merges nothing"
    np.testing.assert_array_equal(got, ref)


def test_search_on_the_kernel_equals_the_jnp_search():
    rng = seeded_rng()
    B, H, T, width = 2, 2, 120, 16
    band = planted_band(rng, B, H, T, width)
    is_delim = jnp.asarray(rng.random((B, T)) < 0.3)
    lengths = jnp.asarray([T, T - 9], jnp.int32)
    keep = jnp.asarray([40, 50], jnp.int32)
    *layouts, _ = clustering.candidate_layouts(is_delim, lengths, keep, 4, 8, width, (0, 1, 2))
    ref = clustering.least_lossy_clustering(band, layouts, keep, 1.0, 6, "jnp")
    got = clustering.least_lossy_clustering(band, layouts, keep, 1.0, 6, "interpret")
    for r, g in zip(ref, got, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))
    assert np.isfinite(np.asarray(ref[3])).all()


def test_bad_inputs_are_named():
    band = jnp.zeros((1, 1, 10, 12), jnp.float32)
    member, place = jnp.zeros((1, 1, 10), bool), jnp.zeros((1, 1, 10), jnp.int32)
    with pytest.raises(ValueError, match="band width"):
        greedy_seed_clustering_kernel(band, member, place, jnp.zeros((1, 1, 1, 1)), interpret=True)
    with pytest.raises(ValueError, match=r"member/place \[N, B, T\]"):
        greedy_seed_clustering_kernel(band[..., :8], member[0], place, jnp.zeros((1, 1, 1, 1)), interpret=True)
    with pytest.raises(ValueError, match="gsc='pallas'"):
        clustering.resolve_gsc("pallas", 48)
    with pytest.raises(ValueError, match="must be one of"):
        clustering.resolve_gsc("cuda", 16)
