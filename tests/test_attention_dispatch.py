"""The model path through the Pallas kernels (interpret mode on CPU) equals the jnp path."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng
from flax import struct

from sparsekv_jax.backend import Backend
from sparsekv_jax.generate import generate
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import CHESS, H2O, Dense, Quest, SnapKV
from sparsekv_jax.policies.base import Policy

CFG = ModelConfig(family="llama", vocab_size=71, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=256)


@struct.dataclass
class RandomBlocks(Policy):
    """A test-only prefill policy: each query block attends to a random causal subset of KV blocks
    (always the diagonal); ``full=True`` lists every causal block."""

    block_size: int = struct.field(pytree_node=False, default=16)
    full: bool = struct.field(pytree_node=False, default=False)
    seed: int = struct.field(pytree_node=False, default=0)

    stages = ("prefill",)
    needs_whole_prefill = True

    def prefill_pattern(self, q, k, v, layer_index, prompt):
        B, T, _, _ = q.shape
        H = k.shape[2]
        n = -(-T // self.block_size)
        qb = jnp.arange(n)[:, None]
        kb = jnp.arange(n)[None, :]
        keep = jax.random.bernoulli(jax.random.fold_in(jax.random.key(self.seed), layer_index), 0.5, (B, H, n, n))
        keep = (keep | (kb == qb) | self.full) & (kb <= qb)
        # listed blocks first (in a shuffled order), the rest after the count
        order = jnp.argsort(~keep, axis=-1, stable=True)
        return order.astype(jnp.int32), keep.sum(-1).astype(jnp.int32), self.block_size


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, 0.3)


def _run(params, policy, tokens, lengths, decode, prefill, carry=False, matmul="xla"):
    # the backend is a static argument: each value compiles its own program, no cache clearing
    backend = Backend(decode_attention=decode, sparse_prefill=prefill, decode_carry=carry, decode_matmul=matmul,
                      page_sums=prefill)
    return generate(params, policy, tokens, lengths=lengths, max_new_tokens=5, stop_tokens=(), page_size=16,
                    backend=backend)


@pytest.mark.share(2)
@pytest.mark.parametrize("policy", [Dense(), Quest(budget=32, dense_layers=0), SnapKV(budget=40, window=8),
                                    H2O(budget=40), CHESS.aggressive(chunk_pages=1, grid_chunks=2),
                                    RandomBlocks(seed=int(seeded_rng().integers(1000)))],
                         ids=["dense", "quest", "snapkv", "h2o", "chess", "block-sparse-prefill"])
def test_pallas_path_equals_jnp_path(params, policy):
    """The GPU's configuration (Pallas kernels, the cache carried through the layer scan and read
    by layer index) against the CPU's (jnp, the cache scanned layer by layer)."""
    rng = seeded_rng()
    tokens = rng.integers(0, CFG.vocab_size, (2, 70))
    lengths = np.array([70, 45])
    ref = _run(params, policy, tokens, lengths, "jnp", "jnp", carry=False)
    got = _run(params, policy, tokens, lengths, "pallas", "pallas", carry=True)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    # fp32, different summation orders: layer 1's keys (|k| up to ~5) differ by up to ~2e-5 over 12 draws,
    # so the bound is relative too (one fresh-clone run failed at 2.3e-5 on a key of 3.9 with atol alone)
    np.testing.assert_allclose(np.asarray(got.cache.layers.k), np.asarray(ref.cache.layers.k), rtol=2e-5, atol=2e-5)


def test_block_pattern_listing_every_causal_block_is_dense(params):
    tokens = seeded_rng().integers(0, CFG.vocab_size, (1, 50))
    dense = generate(params, None, tokens, max_new_tokens=4, stop_tokens=())
    full = generate(params, RandomBlocks(full=True), tokens, max_new_tokens=4, stop_tokens=())
    np.testing.assert_array_equal(np.asarray(full.tokens), np.asarray(dense.tokens))
    assert float(full.stats["prefill_block_fraction"]) == pytest.approx(1.0)
    sparse = generate(params, RandomBlocks(), tokens, max_new_tokens=4, stop_tokens=())
    assert float(sparse.stats["prefill_block_fraction"]) < 1.0


@pytest.mark.share(2)
@pytest.mark.parametrize("policy", [Dense(), H2O(budget=40), Quest(budget=32, dense_layers=0)],
                         ids=["dense", "h2o", "quest"])
def test_carried_cache_equals_scanned_cache(params, policy):
    """Decode with the cache in the scan carry (in-place writes by layer index) gives the same
    tokens, cache and policy state effects as scanning it layer by layer (jnp attention both)."""
    rng = seeded_rng()
    tokens = rng.integers(0, CFG.vocab_size, (2, 60))
    lengths = np.array([60, 33])
    ref = _run(params, policy, tokens, lengths, "jnp", "jnp", carry=False)
    got = _run(params, policy, tokens, lengths, "jnp", "jnp", carry=True)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    # the page summaries the policy reads (Quest's min/max/bias; none for Dense and H2O), and only those
    assert got.cache.layers.summaries == ref.cache.layers.summaries == policy.page_summaries
    for name in ("k", "v", "positions", "bias", *sorted(policy.page_summaries)):
        np.testing.assert_allclose(np.asarray(getattr(got.cache.layers, name)),
                                   np.asarray(getattr(ref.cache.layers, name)), atol=1e-5, err_msg=name)


@pytest.mark.parametrize("carry", [False, True], ids=["scanned-cache", "carried-cache"])
def test_decode_weights_read_by_layer_index_equal_sliced(params, carry, monkeypatch):
    """The Pallas layer-indexed matmul path (weights read from the stack, interpret mode) gives
    the tokens and cache of the default path (the scan's slice of the weights)."""
    from sparsekv_jax.pallas import matmul

    calls = []
    real = matmul.layer_matmul
    monkeypatch.setattr(matmul, "layer_matmul", lambda *a, **k: calls.append(a[1].shape) or real(*a, **k))

    rng = seeded_rng()
    tokens = rng.integers(0, CFG.vocab_size, (2, 40))
    lengths = np.array([40, 23])
    ref = _run(params, Dense(), tokens, lengths, "jnp", "jnp", carry=carry)
    got = _run(params, Dense(), tokens, lengths, "jnp", "jnp", carry=carry, matmul="pallas")
    assert len(calls) == 7, calls  # q, k, v, o, gate, up, down: traced once in the layer scan
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    # fp32, different summation orders: a relative bound too, as in test_pallas_path_equals_jnp_path
    np.testing.assert_allclose(np.asarray(got.cache.layers.k), np.asarray(ref.cache.layers.k), rtol=2e-5, atol=2e-5)
