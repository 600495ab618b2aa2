"""StreamingLLM (Xiao et al., 2023): attention sinks + the most recent tokens.

After prefill the cache keeps the first ``sinks`` tokens and the last ``budget - sinks`` tokens of
the prompt (kvpress' ``StreamingLLMPress``: n_sink=4). Decoded tokens are appended after them,
so the cache holds ``budget + max_new_tokens`` entries; the positions of kept entries are their
original RoPE positions (kvpress' default; the paper's re-rotation is not applied).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
from flax import struct

from sparsekv_jax.cache import KVCache
from sparsekv_jax.policies.base import Policy
from sparsekv_jax.policies.common import (
    budget_tokens,
    check_budget,
    check_sinks_window,
    compact,
    force_sinks_and_window,
    row_budgets,
)


@struct.dataclass
class StreamingLLM(Policy):
    """Keep ``sinks`` initial tokens and the most recent ones, ``budget`` in all.

    Args:
      budget: fraction of the prompt (``0.1``) or token count (``2048``), sinks included.
      sinks: initial tokens always kept (paper and kvpress: 4).
    """

    budget: float | int = struct.field(pytree_node=False, default=0.25)
    sinks: int = struct.field(pytree_node=False, default=4)

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_sinks_window(self.budget, self.sinks, 0)

    def validate(self, prompt_len: int, max_new_tokens: int, page_size: int) -> None:
        check_sinks_window(self.budget, self.sinks, 0, prompt_len)

    def observe(self, q, k, v, lengths, layer_index, **inputs) -> Any:
        return None

    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        kept = budget_tokens(self.budget, prompt_len)
        return None if kept >= prompt_len else kept + max_new_tokens

    def compress(self, cache: KVCache, observations: Any, capacity: int) -> KVCache:
        L, B, H, S = cache.layers.positions.shape
        recency = jnp.broadcast_to(jnp.arange(S, dtype=jnp.float32), (L, B, H, S))
        scores = force_sinks_and_window(recency, cache.length, self.sinks, 0)
        return compact(cache, scores, row_budgets(self.budget, cache.length), capacity)


