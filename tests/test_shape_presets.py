"""The model-shape presets of the speed benchmarks (`sparsekv bench e2e --models ...`): random weights of real
shapes, so each preset must be the real model's shapes. Checked against the model cards' published numbers."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sparsekv_jax.bench.e2e import MODELS
from sparsekv_jax.models import config as mc
from sparsekv_jax.models.params import random_params


def _param_counts(cfg) -> tuple[int, int]:
    """(all parameters, parameters outside the embedding and the LM head), from shapes only (no memory)."""
    shapes = jax.eval_shape(lambda: random_params(cfg, jax.random.key(0), jnp.bfloat16))
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(shapes))
    vocab = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_word_embeddings else 2)
    return total, total - vocab


def test_qwen_preset_is_qwen25_coder_15b():
    """Qwen2.5-Coder-1.5B-Instruct's model card: 28 layers, 12 query / 2 KV heads, 32,768 positions, 1.31B
    non-embedding parameters; its config: hidden 1536, head_dim 128, rope θ 1e6, q/k/v biases. The preset is the
    GGUF's config as `load` reads it (untied head: the GGUF stores `output.weight`), which the eval runs."""
    assert MODELS["qwen2.5-coder-1.5b"] == "qwen25_coder_15b_config"
    cfg = mc.qwen25_coder_15b_config()
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("qwen2", 28, 12, 2, 128)
    assert (cfg.hidden_size, cfg.rope_theta, cfg.max_position_embeddings, cfg.qkv_bias) == (1536, 1e6, 32768, True)
    _, non_embedding = _param_counts(cfg)
    assert round(non_embedding / 1e9, 2) == 1.31


def test_llama_preset_is_llama31_8b():
    """Llama-3.1-8B: 8.03B parameters (model card), untied head; 32 layers, 32 / 8 heads of 128."""
    cfg = mc.llama31_8b_config()
    total, _ = _param_counts(cfg)
    assert round(total / 1e9, 2) == 8.03
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (32, 32, 8, 128)
