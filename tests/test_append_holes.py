"""`append_token`'s page summaries on a uniform cache with holes below the row's length.

A compressor whose heads keep different counts (AdaKV, PyramidKV) leaves holes (position -1) below the row's
length in the uniform layout; decoding appends at the row's length, which can fall in a page that holds holes.
The appended page's key summaries (sum, min, max: Quest's bound and CHESS's page scores read them) must be over
its live slots only. Until 2026-11-27 an append counted every slot below the length, holes included, which made
a Quest pipeline after AdaKV list a page by keys that are not in the cache
(tests/test_engine_pool_pipeline.py failed on seed 1064268454). Reference: numpy over the live slots."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.cache import append_token, init_cache, layer_view, summarize_pages, write_chunk
from sparsekv_jax.models.config import ModelConfig

B, H, D, PS, T = 2, 2, 16, 8, 24
CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=H,
                  head_dim=D, intermediate_size=48, max_position_embeddings=512)


def _np_summaries(k: np.ndarray, live: np.ndarray, page: int) -> dict[str, np.ndarray]:
    """Sum / min / max of ``k`` ``[B, H, S, D]`` over the ``live`` ``[B, H, S]`` slots of page ``page``."""
    sl = slice(page * PS, (page + 1) * PS)
    kk, ll = k[:, :, sl], live[:, :, sl, None]
    big = np.finfo(np.float32).max
    return {"page_sum": np.where(ll, kk, 0).sum(2), "page_min": np.where(ll, kk, big).min(2),
            "page_max": np.where(ll, kk, -big).max(2)}


@pytest.mark.parametrize("stacked", [False, True])
def test_an_append_summarises_its_page_over_live_slots_only(stacked, rng):
    """Rows of 21 and 18 tokens, each head with a run of holes (position -1, keys left as large junk) ending at the
    row's length; two appends land in the page that holds them: its sum/min/max equal numpy's over the live
    slots (the junk would move all three), and the other pages' are untouched."""
    lengths = np.array([21, 18])
    cache = init_cache(CFG, B, 40, page_size=PS, dtype=jnp.float32)
    k0, v0 = (rng.standard_normal((B, H, T, D)).astype(np.float32) for _ in range(2))
    positions = np.broadcast_to(np.arange(T), (B, T))
    kv = write_chunk(layer_view(cache.layers, 0), jnp.asarray(k0), jnp.asarray(v0), 0, jnp.asarray(positions),
                     jnp.asarray(lengths))
    # holes: head h of row b keeps `lengths[b] - holes[b, h]` entries, the rest of its slots below the length hold
    # junk keys 50 at position -1 (what compaction leaves there is not the point: the summaries must not read it)
    holes = rng.integers(1, 5, (B, H))
    slot = np.arange(kv.k.shape[2])
    hole = (slot >= lengths[:, None, None] - holes[..., None]) & (slot < lengths[:, None, None])  # [B, H, S]
    k = np.where(hole[..., None], 50.0, np.asarray(kv.k)).astype(np.float32)
    pos = np.where(hole, -1, np.asarray(kv.positions)).astype(np.int32)
    kv = summarize_pages(kv.replace(k=jnp.asarray(k), positions=jnp.asarray(pos)), jnp.asarray(lengths), PS)
    layers = jax.tree.map(lambda a: a[None], kv) if stacked else kv
    length = lengths.copy()
    for _ in range(2):
        kn, vn = (jnp.asarray(rng.standard_normal((B, H, D)), jnp.float32) for _ in range(2))
        at = jnp.asarray(length, jnp.int32)
        layers = append_token(layers, kn, vn, at, at, at + 1, PS, **({"layer": jnp.int32(0)} if stacked else {}))
        k[np.arange(B), :, length] = np.asarray(kn)
        pos[np.arange(B), :, length] = length[:, None]
        length = length + 1
    got = jax.tree.map(lambda a: a[0], layers) if stacked else layers
    live = (slot[None, None] < length[:, None, None]) & (pos >= 0)
    assert (~live & (slot[None, None] < length[:, None, None])).any()  # some hole lies below the length
    for b in range(B):
        page = (length[b] - 1) // PS  # the page the appends wrote (both land in it: 21, 22 -> 2; 18, 19 -> 2)
        want = _np_summaries(k[b:b + 1], live[b:b + 1], page)
        for name, value in want.items():
            np.testing.assert_allclose(np.asarray(getattr(got, name))[b, :, page], value[0], rtol=1e-6, atol=1e-6,
                                       err_msg=f"{name} of row {b}'s page {page}")
        untouched = [p for p in range(kv.k.shape[2] // PS) if p != page]
        for name in want:
            np.testing.assert_array_equal(np.asarray(getattr(got, name))[b, :, untouched],
                                          np.asarray(getattr(kv, name))[b, :, untouched])
