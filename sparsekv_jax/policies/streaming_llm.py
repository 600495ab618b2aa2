"""StreamingLLM (Xiao et al., 2023): attention sinks + the most recent tokens.

After prefill the cache keeps the first ``sinks`` tokens and the last ``budget - sinks`` tokens of
the prompt (kvpress' ``StreamingLLMPress``: n_sink=4). Decoded tokens are appended after them,
so the cache holds ``budget + max_new_tokens`` entries; the positions of kept entries are their
original RoPE positions (kvpress' default; the paper's re-rotation is not applied).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax.cache import KVCache
from sparsekv_jax.policies.base import Prompt
from sparsekv_jax.policies.scored import ScoredCompression


@struct.dataclass
class StreamingLLM(ScoredCompression):
    """Keep ``sinks`` initial tokens and the most recent ones, ``budget`` in all.

    Args:
      budget: fraction of the prompt (``0.1``) or token count (``2048``), sinks included.
      sinks: initial tokens always kept (paper and kvpress: 4).
    """

    budget: float | int = struct.field(pytree_node=False, default=0.25)
    sinks: int = struct.field(pytree_node=False, default=4)

    # recency needs nothing from the prefill: chunked prefill works
    needs_whole_prefill = False
    needs_observations = False

    def score(self, cache: KVCache, observations: Any, prompt: Prompt) -> jax.Array:
        L, B, H, S = cache.layers.positions.shape
        return jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32), (L, B, H, S))
