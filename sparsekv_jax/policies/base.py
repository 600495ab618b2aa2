"""The policy protocol: the stages `generate` calls, each with a dense/identity default.

A policy is a `flax.struct.dataclass` pytree. Shape-changing hyperparameters are static fields,
learned or calibrated state are leaves. The stages (DESIGN.md, "The policy stages"):

* ``prefill_pattern`` — inside each layer during prefill: which KV blocks each query block
  attends to (``None`` = dense causal).
* ``observe`` — inside each layer during prefill: whatever ``compress`` needs (window scores,
  attention mass, ...), stacked over layers by the layer scan. ``None`` = nothing.
* ``compress`` — after prefill: a *smaller* cache of ``compressed_capacity`` tokens.
* decode: ``decode_init`` builds ``(layer_state, shared_state)``; ``layer_state`` has a leading
  ``[L]`` axis and rides the layer scan. Each step, inside each layer: ``decode_write`` picks the
  slot the new token goes to (append, or overwrite an evicted entry), ``decode_select`` the pages
  read, ``decode_observe`` sees the step's attention probabilities (only if
  ``needs_decode_probs``). After the step ``decode_update`` sees the logits; it may ask the loop to
  take back the last tokens of a row (``decode_rewind``: CHESS's backtracking).

Every method receives static sizes as Python ints and arrays as traced values: no host syncs.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from sparsekv_jax.cache import KVCache, LayerKV

Selection = tuple[jax.Array, jax.Array] | None  # (page_ids [B, Hkv, P], counts [B, Hkv]) or all pages


@struct.dataclass
class Policy:
    """Base policy: dense prefill, no compression, dense decode."""

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def needs_decode_probs(self) -> bool:
        return False

    @property
    def needs_whole_prefill(self) -> bool:
        """Whether the prompt must be prefilled in one pass: the policy sets a prefill block
        pattern or observes the prefill (for ``compress``), which chunked prefill does not run."""
        cls = type(self)
        return cls.prefill_pattern is not Policy.prefill_pattern or cls.observe is not Policy.observe

    def validate(self, prompt_len: int, max_new_tokens: int, page_size: int) -> None:
        """Raise ``ValueError`` for settings that cannot work with these sizes (before jit)."""

    def bind(self, prompt_len: int) -> Policy:
        """This policy with sizes that depend on the prompt fixed as static fields (before jit)."""
        return self

    def bind_model(self, config: Any) -> Policy:
        """This policy with what it needs of the model's `ModelConfig` fixed as static fields
        (before jit; e.g. RoPE frequencies to un-rotate cached keys)."""
        return self

    # -- prefill -----------------------------------------------------------------------
    def prefill_pattern(self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                        layer_index: jax.Array) -> Any:
        """``None`` (dense causal) or ``(block_ids [B,Hkv,nQ,K], counts [B,Hkv,nQ], block_size)``."""
        return None

    def observe(self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, layer_index: jax.Array, *,
                tokens: jax.Array | None = None, hidden: jax.Array | None = None) -> Any:
        """Per-layer observation for ``compress`` (stacked over layers by the scan).

        ``q`` ``[B,T,Hq,D]`` and ``k``/``v`` ``[B,T,Hkv,D]`` (RoPE applied), ``tokens`` ``[B,T]``
        the prompt ids (delimiter-based methods), ``hidden`` ``[B,T,H]`` the layer's input
        hidden states (hidden-state probes).
        """
        return None

    # -- compress ------------------------------------------------------------------------
    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        """Tokens the compressed cache holds, or ``None`` to keep the prefill cache.

        ``max_new_tokens`` counts every token still to be written after compression (the suffix,
        e.g. a question read after the context was compressed, included); ``suffix_tokens`` is
        the suffix's share of it.
        """
        return None

    def compress(self, cache: KVCache, observations: Any, capacity: int) -> KVCache:
        return cache

    # -- decode --------------------------------------------------------------------------
    def decode_init(self, cache: KVCache, observations: Any) -> tuple[Any, Any]:
        """``(layer_state, shared_state)`` for the decode loop; ``observations`` are this policy's
        prefill observations when it also ran ``compress`` (else ``None``)."""
        return None, None

    def decode_write(self, kv: LayerKV, length: jax.Array, layer_state: Any) -> tuple[jax.Array, jax.Array]:
        """``(slot [B] or [B, Hkv], new_length [B])`` for this step's token: append by default."""
        return length, length + 1

    def decode_select(self, q: jax.Array, kv: LayerKV, length: jax.Array, layer_state: Any,
                      shared_state: Any, layer_index: jax.Array, page_size: int) -> Selection:
        """Pages to read this step, or ``None`` = every page in use."""
        return None

    def decode_observe(self, layer_state: Any, probs: jax.Array, kv: LayerKV) -> Any:
        """See ``probs`` ``[B, Hq, S]`` of this step (only called if ``needs_decode_probs``)."""
        return layer_state

    def decode_update(self, shared_state: Any, cache: KVCache, logits: jax.Array) -> Any:
        return shared_state

    @property
    def max_rewind_tokens(self) -> int:
        """Most tokens a row may take back over a generation (backtracking; 0 = never)."""
        return 0

    def decode_rewind(self, shared_state: Any) -> jax.Array | None:
        """``[B]`` int: tokens each row takes back after this step (decided in ``decode_update``):
        the generation loop drops them from the output and the cache and generates them again."""
        return None

    def decode_stats(self, shared_state: Any) -> dict[str, jax.Array]:
        """Per-row counters the policy reports at the end of generation (e.g. re-selections)."""
        return {}


@struct.dataclass
class Dense(Policy):
    """Full attention everywhere: the reference every policy is measured against."""


FullKV = Dense
