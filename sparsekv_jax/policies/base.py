"""The policy protocol: the stages `generate` calls, each with a dense/identity default.

A policy is a `flax.struct.dataclass` pytree. Shape-changing hyperparameters are static fields,
learned or calibrated state are leaves. The stages (DESIGN.md, "The policy stages"):

* ``prefill_pattern`` — inside each layer during prefill: which KV blocks each query block
  attends to (``None`` = dense causal).
* ``observe`` — inside each layer during prefill: whatever ``compress`` needs (window scores,
  attention mass, ...), stacked over layers. ``None`` = nothing.
* ``compress`` — after prefill: a *smaller* cache (``compressed_capacity`` fixes its size).
* ``decode_init`` / ``decode_select`` / ``decode_update`` — the decode loop: which pages each
  step reads per (row, KV head), with state carried through the loop.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from sparsekv_jax.cache import KVCache, LayerKV


@struct.dataclass
class Policy:
    """Base policy: dense prefill, no compression, dense decode."""

    @property
    def name(self) -> str:
        return type(self).__name__

    def validate(self, prompt_len: int, max_new_tokens: int, page_size: int) -> None:
        """Raise ``ValueError`` for settings that cannot work with these sizes (before jit)."""

    # -- prefill -----------------------------------------------------------------------
    def prefill_pattern(self, q: jax.Array, k: jax.Array, layer_index: jax.Array) -> Any:
        return None

    def observe(self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                layer_index: jax.Array) -> Any:
        return None

    # -- compress ------------------------------------------------------------------------
    def compressed_capacity(self, prompt_len: int, max_new_tokens: int) -> int | None:
        """Tokens the compressed cache holds, or ``None`` to keep the prefill cache."""
        return None

    def compress(self, cache: KVCache, observations: Any, capacity: int) -> KVCache:
        return cache

    # -- decode --------------------------------------------------------------------------
    def decode_init(self, cache: KVCache) -> Any:
        return None

    def decode_select(self, q: jax.Array, kv: LayerKV, length: jax.Array, state: Any,
                      layer_index: jax.Array, page_size: int) -> tuple[jax.Array, jax.Array] | None:
        """``(page_ids [B, Hkv, P], counts [B, Hkv])`` to read this step, or ``None`` = all."""
        return None

    def decode_update(self, state: Any, cache: KVCache, logits: jax.Array) -> Any:
        return state


@struct.dataclass
class Dense(Policy):
    """Full attention everywhere: the reference every policy is measured against."""
