"""Rotary position embeddings, including Llama-3 frequency-dependent scaling.

The rotation follows transformers' `rotate_half` layout (first half / second half of the head
dimension), which is what HF checkpoints and GGUF files (after un-permuting) expect.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.models.config import ModelConfig


def inverse_frequencies(cfg: ModelConfig, theta: float | None = None) -> np.ndarray:
    """``[head_dim // 2]`` inverse frequencies (float64 numpy; computed once, host side).

    ``theta`` overrides ``cfg.rope_theta`` (Gemma 3's local layers); for a model whose layers
    differ, this is the global layers' table and `layer_inverse_frequencies` has every layer's.
    """
    d = cfg.head_dim
    theta = cfg.rope_theta if theta is None else theta
    inv = 1.0 / (theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    rs = cfg.rope_scaling
    if rs is None:
        return inv
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > low_wavelen, inv / rs.factor, inv)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rs.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return np.where(medium, smoothed, scaled)


def layer_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """``[num_layers, head_dim // 2]`` inverse frequencies, each layer at its own RoPE base."""
    return np.stack([inverse_frequencies(cfg, t) for t in cfg.layer_rope_thetas()])


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray | jax.Array) -> jax.Array:
    """Rotate ``x`` ``[..., T, H, D]`` by ``positions`` ``[..., T]`` (computed in fp32).

    ``inv_freq`` is a host table or a traced ``[D/2]`` row (a layer's, indexed inside the scan)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    cos = jnp.cos(freqs)[..., None, :]  # [..., T, 1, D/2]
    sin = jnp.sin(freqs)[..., None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)
