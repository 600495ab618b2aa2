"""`make demo`'s machinery on a tiny random model: unregistered policies are skipped with a note,
policies with a dense prefill share one prefill, and each answers what `generate` answers alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax import demo
from sparsekv_jax.generate import generate
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, max_position_embeddings=128, eos_token_ids=(0,))


class _Tokenizer:
    """Just what the demo calls: ``decode`` of ids (as text of the ids)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_demo_policy_list_skips_unregistered_and_labels_budgets():
    policies, notes = demo.resolve_policies(["fullkv", "snapkv({b})", "nosuchpolicy({b})"], 0.25, _Tokenizer())
    assert [label for label, _ in policies] == ["Dense", "SnapKV(0.25)"]
    assert len(notes) == 1 and "nosuchpolicy" in notes[0]
    assert demo._split("fullkv, pipeline(compress=snapkv(0.2), decode=quest(0.25))") == [
        "fullkv", "pipeline(compress=snapkv(0.2), decode=quest(0.25))"]


def test_demo_shared_prefill_answers_like_generate():
    params = random_params(CFG, jax.random.key(3), jnp.float32, scale=0.3)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CFG.vocab_size, (1, 64)).astype(np.int32)
    qs = np.array([56], np.int32)
    policies, _ = demo.resolve_policies(["fullkv", "snapkv(0.5, window=8)", "quest(0.5)", "stem(block_size=16)"],
                                        0.5, _Tokenizer())
    rows, _ = demo.run(params, _Tokenizer(), policies, tokens, qs, max_new_tokens=5, stop_tokens=(), progress=False)
    assert [r.shared_prefill for r in rows] == [True, True, True, False]
    for (label, policy), row in zip(policies, rows, strict=True):
        alone = generate(params, policy, tokens, question_start=qs, max_new_tokens=5, stop_tokens=(),
                         page_size=demo.PAGE_SIZE)
        assert row.answer == _Tokenizer().decode(alone.sequences()[0]), label
    print(demo.table(rows))
