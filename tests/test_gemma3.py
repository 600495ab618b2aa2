"""Gemma 3 (interleaved local/global attention) against transformers' `Gemma3ForCausalLM`.

A tiny random model through the directory loader: every logit of a one-pass prefill, of
generate's prefill followed by step-by-step decode (one-shot and chunked prefill), on prompts far
longer than the tiny sliding window, within 1e-4 in fp32.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from conftest import seeded_rng

from sparsekv_jax.generate import full_logits, teacher_force
from sparsekv_jax.models.config import NO_WINDOW, ModelConfig, gemma3_270m_config
from sparsekv_jax.models.embedded import _config_from_json, _config_to_json
from sparsekv_jax.models.loading import load_hf_dir
from sparsekv_jax.models.transformer import attention_window

TOL = 1e-4


@pytest.fixture(scope="module")
def tiny(hf_tiny_dir):
    """(params, cfg, tokens [2, 40], transformers' logits [2, 40, V]) with fresh random tokens."""
    path = hf_tiny_dir("gemma3")
    params, cfg = load_hf_dir(path, dtype=jnp.float32)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    assert type(model).__name__ == "Gemma3ForCausalLM"
    tokens = seeded_rng().integers(0, cfg.vocab_size, (2, 40))  # 5x the window of 8
    with torch.no_grad():
        ref = model(torch.as_tensor(tokens)).logits.numpy()
    return params, cfg, tokens, ref


def test_config_is_read_as_gemma3(tiny):
    _, cfg, _, _ = tiny
    assert cfg.family == "gemma3" and cfg.sliding_window == 8 and cfg.query_pre_attn_scalar == 24
    assert cfg.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert cfg.layer_rope_thetas() == (1e4,) * 5 + (1e6, 1e4)
    assert cfg.final_logit_softcapping == 30.0 and cfg.norm_weight_offset == 1.0 and cfg.sandwich_norms


def test_prefill_logits_match_transformers(tiny):
    params, _, tokens, ref = tiny
    ours = np.asarray(full_logits(params, tokens))
    assert np.abs(ours - ref).max() <= TOL, np.abs(ours - ref).max()


@pytest.mark.parametrize("chunk", [None, 6])
def test_decode_logits_match_transformers(tiny, chunk):
    """generate's prefill of 12 (or 20, in chunks of 6) tokens, then one decode step per token."""
    params, _, tokens, ref = tiny
    n = 12 if chunk is None else 20
    ours = np.asarray(teacher_force(params, None, tokens[:, :n], tokens[:, n:], page_size=8, prefill_chunk=chunk)[0])
    assert ours.shape == (2, 40 - n, ref.shape[-1])
    assert np.abs(ours - ref[:, n - 1:39]).max() <= TOL, np.abs(ours - ref[:, n - 1:39]).max()


def test_the_tests_see_the_window_and_the_local_rope(tiny):
    """The prompts are long enough that dropping the local window, or giving local layers the global
    RoPE base, moves the logits far past the tolerance: the tests above would catch either."""
    params, cfg, tokens, ref = tiny
    no_window = dataclasses.replace(cfg, layer_types=None, sliding_window=None, rope_local_theta=None)
    same_rope = dataclasses.replace(cfg, rope_local_theta=cfg.rope_theta)
    for wrong in (no_window, same_rope):
        ours = np.asarray(full_logits(params.replace(config=wrong), tokens))
        assert np.abs(ours - ref).max() > 100 * TOL


def test_layer_windows_are_scanned_values():
    cfg = gemma3_270m_config()
    windows = cfg.layer_windows()
    assert windows == tuple(NO_WINDOW if (i + 1) % 6 == 0 else 512 for i in range(18))
    assert [int(attention_window(cfg, jnp.int32(i))) for i in (0, 5, 6, 17)] == [512, NO_WINDOW, 512, NO_WINDOW]
    llama = ModelConfig(family="mistral", vocab_size=8, hidden_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                        head_dim=4, intermediate_size=8, sliding_window=4)
    assert attention_window(llama, jnp.int32(1)) == 4  # uniform windows stay static ints
    assert hash(_config_from_json(json.loads(json.dumps(_config_to_json(cfg))))) == hash(cfg)  # the converted cache
    with pytest.raises(ValueError, match="layer_types"):
        dataclasses.replace(cfg, layer_types=("full_attention",))
    with pytest.raises(ValueError, match="hidden_act"):
        dataclasses.replace(cfg, hidden_act="relu")


def test_unsupported_gemma3_options_are_refused():
    base = tf.Gemma3TextConfig(vocab_size=16, hidden_size=8, intermediate_size=8, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, head_dim=4).to_dict()
    base["architectures"] = ["Gemma3ForCausalLM"]
    assert ModelConfig.from_hf_dict(base).family == "gemma3"
    with pytest.raises(ValueError, match="attn_logit_softcapping"):
        ModelConfig.from_hf_dict(dict(base, attn_logit_softcapping=50.0))
    scaled = dict(base, rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="linear"):
        ModelConfig.from_hf_dict(scaled)
