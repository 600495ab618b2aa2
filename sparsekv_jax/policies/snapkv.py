"""SnapKV (Li et al., 2024): keep the prompt entries the last queries attend to.

The last ``window`` queries of the prompt (the observation window) attend to all earlier keys;
their softmax weights are averaged over the window, smoothed with a 1-D pool of ``kernel_size``,
averaged over the query heads of each GQA group (one selection per KV head, as kvpress does for
GQA), and the top entries are kept with the window itself. Paper defaults: window 32, max-pool
kernel 7. (kvpress defaults differ: window 64, avg-pool 5; both poolings are offered so the two
can be compared with matched settings.)
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax.cache import KVCache
from sparsekv_jax.policies.base import Prompt
from sparsekv_jax.policies.common import prompt_scores_to_slots
from sparsekv_jax.policies.scored import ScoredCompression


def window_attention_scores(q: jax.Array, k: jax.Array, lengths: jax.Array, window: int) -> jax.Array:
    """Softmax weights of each row's last ``window`` queries over its keys, averaged over the window.

    ``q`` ``[B, T, Hq, D]``, ``k`` ``[B, T, Hkv, D]`` (RoPE applied) → ``[B, Hq, T]`` fp32; keys
    inside the window get 0 (they are kept regardless).
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qpos = jnp.clip(lengths[:, None] - window + jnp.arange(window), 0, T - 1)  # [B, w]
    qw = jnp.take_along_axis(q, qpos[:, :, None, None], axis=1)  # [B, w, Hq, D]
    qw = qw.reshape(B, window, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bwhgd,bthd->bhgwt", qw, k, preferred_element_type=jnp.float32) / jnp.sqrt(D)
    t = jnp.arange(T)
    causal = t[None, None, :] <= qpos[:, :, None]  # [B, w, T]
    s = jnp.where(causal[:, None, None], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1).mean(-2)  # [B, Hkv, G, T]
    prefix = t[None, :] < (lengths - window)[:, None]  # [B, T]
    return jnp.where(prefix[:, None, None], p, 0.0).reshape(B, Hq, T)


def pool1d(x: jax.Array, kernel_size: int, kind: str) -> jax.Array:
    """Same-length 1-D pooling along the last axis with zero padding (torch's ``*_pool1d`` with
    ``padding=k//2``; avg counts the padding, as torch's default does)."""
    pad = kernel_size // 2
    dims = (1,) * (x.ndim - 1) + (kernel_size,)
    padding = ((0, 0),) * (x.ndim - 1) + ((pad, pad),)
    if kind == "max":
        xp = jnp.pad(x, padding)
        return jax.lax.reduce_window(xp, -jnp.inf, jax.lax.max, dims, (1,) * x.ndim, "VALID")
    return jax.lax.reduce_window(x, 0.0, jax.lax.add, dims, (1,) * x.ndim, padding) / kernel_size


@struct.dataclass
class SnapKV(ScoredCompression):
    """SnapKV compression after prefill.

    Args:
      budget: fraction of the prompt or token count, observation window included.
      window: observation window (paper: 32).
      kernel_size: pooling kernel (paper: 7).
      pooling: ``"max"`` (paper) or ``"avg"`` (kvpress).
      sinks: initial tokens always kept (SnapKV: 0).
    """

    budget: float | int = struct.field(pytree_node=False, default=0.25)
    window: int = struct.field(pytree_node=False, default=32)
    kernel_size: int = struct.field(pytree_node=False, default=7)
    pooling: str = struct.field(pytree_node=False, default="max")
    sinks: int = struct.field(pytree_node=False, default=0)

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"window={self.window} must be >= 1")
        super().__post_init__()
        if self.kernel_size < 1 or self.kernel_size % 2 == 0:
            raise ValueError(f"kernel_size={self.kernel_size} must be a positive odd number")
        if self.pooling not in ("max", "avg"):
            raise ValueError(f"pooling={self.pooling!r} must be 'max' or 'avg'")

    def observe(self, q, k, v, hidden, layer_index, prompt: Prompt) -> jax.Array:
        scores = pool1d(window_attention_scores(q, k, prompt.lengths, self.window), self.kernel_size, self.pooling)
        B, Hq, T = scores.shape
        Hkv = k.shape[2]
        return scores.reshape(B, Hkv, Hq // Hkv, T).mean(2)  # [B, Hkv, T]

    def score(self, cache: KVCache, observations: Any, prompt: Prompt) -> jax.Array:
        return prompt_scores_to_slots(observations, cache.capacity)
