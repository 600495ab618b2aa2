"""The shape every evicting compressor shares: sizing → scores → sinks and window → compaction.

kvpress' ``ScorerPress`` idea: the base owns the budget, the forced entries and the gather; a
method writes only ``score``. StreamingLLM, SnapKV and H2O are subclasses.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.cache import KVCache, pages_for
from sparsekv_jax.policies.base import Policy, Prompt, Setup
from sparsekv_jax.policies.common import (
    budget_tokens,
    check_budget,
    check_sinks_window,
    compact,
    force_sinks_and_window,
    row_budgets,
)


@struct.dataclass
class ScoredCompression(Policy):
    """Keep, per (layer, row, KV head), the ``budget`` best-scored prompt entries.

    Subclasses declare a ``budget`` field (a fraction of the prompt or a token count) and optional
    ``sinks`` / ``window`` fields (first / last entries always kept, counted inside the budget),
    and implement `score`. Kept entries keep their RoPE positions; the compressed cache holds the
    kept entries and room for every token still to come.
    """

    stages = ("compress",)
    needs_whole_prefill = True
    needs_observations = True
    writes_entries = True  # through `compact`: the engine may send it into a page pool

    def __post_init__(self) -> None:
        check_budget(self.budget)
        sinks, window = self.forced_counts(None)
        check_sinks_window(self.budget, sinks, window if isinstance(window, int) else 0)

    def forced_counts(self, keep: jax.Array | None) -> tuple[int, int | jax.Array]:
        """``(sinks, window)`` kept regardless of score for rows keeping ``keep`` ``[B]`` entries
        (``keep=None``: the static values, for validation)."""
        return getattr(self, "sinks", 0), getattr(self, "window", 0)

    def bind(self, setup: Setup) -> Policy:
        sinks, window = self.forced_counts(None)
        check_sinks_window(self.budget, sinks, window if isinstance(window, int) else 0, setup.prompt_len)
        return self

    def score(self, cache: KVCache, observations: Any, prompt: Prompt) -> jax.Array:
        """``[L, B, H, S]`` importance of every slot of the prefill cache (higher = keep)."""
        raise NotImplementedError

    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        kept = budget_tokens(self.budget, prompt_len)
        return None if kept >= prompt_len else kept + max_new_tokens

    def compressed_pages(self, lengths: np.ndarray, prompt_len: int, max_new_tokens: int, page_size: int,
                         num_layers: int, num_kv_heads: int, suffix_tokens: int = 0) -> int | None:
        """Each head keeps its row's budget (`row_budgets`, as `compress` counts it) and the tokens to come:
        ``L·Hkv·Σ_b pages_for(n_b + max_new_tokens)``."""
        if self.compressed_capacity(prompt_len, max_new_tokens) is None:
            return None
        n = np.asarray(row_budgets(self.budget, jnp.asarray(lengths, jnp.int32)))
        return num_layers * num_kv_heads * sum(pages_for(int(k) + max_new_tokens, page_size) for k in n)

    def compress(self, cache: KVCache, observations: Any, capacity: int, prompt: Prompt) -> KVCache:
        keep = row_budgets(self.budget, cache.length)
        sinks, window = self.forced_counts(keep)
        scores = force_sinks_and_window(self.score(cache, observations, prompt), cache.length, sinks, window)
        return compact(cache, scores, keep, capacity)
