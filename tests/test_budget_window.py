"""A fractional budget too small for a policy's forced entries (SnapKV's paper window of 32 on a short
prompt) is refused with changes a user can make, and each change it names then runs (issue 42, 11)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.generate import generate
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import SnapKV

CFG = ModelConfig(family="llama", vocab_size=89, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=8, intermediate_size=64, max_position_embeddings=256)


def test_a_window_over_a_fractional_budget_says_what_to_change_and_each_change_runs():
    rng = seeded_rng()
    seed = int(rng.integers(1 << 30))
    params = random_params(CFG, jax.random.key(seed), jnp.float32, 0.3)
    tokens = jnp.asarray(rng.integers(1, 89, (2, 40)), jnp.int32)  # batch of 2: a 40-token prompt keeps 10 at 0.25
    msg = (r"sinks=0 \+ window=32 = 32 tokens are always kept, more than budget=0.25 keeps of a 40-token prompt "
           r"\(10 tokens\): pass a budget of at least 0.8 \(or budget=32, a token count\), a window of at most 10 "
           r"\(window=10\), or a prompt of at least 128 tokens")
    with pytest.raises(ValueError, match=msg):
        generate(params, SnapKV(budget=0.25), tokens, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"sinks=4 \+ window=8 = 12 tokens .* a window of at most 6 \(window=6\)"):
        generate(params, SnapKV(budget=0.25, sinks=4, window=8), tokens, max_new_tokens=2)
    # every way out it names runs, and keeps what it says
    for policy, toks, kept in [(SnapKV(budget=0.8), tokens, 32), (SnapKV(budget=32), tokens, 32),
                               (SnapKV(budget=0.25, window=10), tokens, 10),
                               (SnapKV(budget=0.25), jnp.tile(tokens, (1, 4))[:, :128], 32)]:
        out = generate(params, policy, toks, max_new_tokens=2)
        assert out.tokens.shape == (2, 2)
        np.testing.assert_allclose(np.asarray(out.stats["kv_stored_fraction"]), kept / toks.shape[1], rtol=1e-6)
