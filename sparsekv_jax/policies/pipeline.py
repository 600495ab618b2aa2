"""Composition: one policy per stage, e.g. ``Pipeline(prefill=Stem(), compress=SnapKV(0.2),
decode=Quest(0.25))``, still one jitted `generate` call."""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from sparsekv_jax.cache import KVCache, LayerKV
from sparsekv_jax.policies.base import Dense, Policy, Selection


@struct.dataclass
class Pipeline(Policy):
    """Delegates each stage to the policy given for it (dense/identity where none is given)."""

    prefill: Policy = Dense()
    compress_with: Policy = Dense()
    decode: Policy = Dense()

    def __init__(self, prefill: Policy | None = None, compress: Policy | None = None,
                 decode: Policy | None = None, *, compress_with: Policy | None = None) -> None:
        stages = {"prefill": prefill, "compress": compress if compress is not None else compress_with,
                  "decode": decode}
        for stage, pol in stages.items():
            if pol is not None and not isinstance(pol, Policy):
                raise ValueError(f"Pipeline {stage}={pol!r} is not a Policy")
            if isinstance(pol, Pipeline):
                raise ValueError(f"Pipeline {stage}= cannot be another Pipeline")
        object.__setattr__(self, "prefill", stages["prefill"] or Dense())
        object.__setattr__(self, "compress_with", stages["compress"] or Dense())
        object.__setattr__(self, "decode", stages["decode"] or Dense())

    @property
    def name(self) -> str:
        parts = [f"{k}={p.name}" for k, p in (("prefill", self.prefill), ("compress", self.compress_with),
                                              ("decode", self.decode)) if type(p) is not Dense]
        return "Pipeline(" + ", ".join(parts) + ")"

    @property
    def needs_decode_probs(self) -> bool:
        return self.decode.needs_decode_probs

    @property
    def needs_whole_prefill(self) -> bool:
        return any(p.needs_whole_prefill for p in (self.prefill, self.compress_with, self.decode))

    def validate(self, prompt_len: int, max_new_tokens: int, page_size: int) -> None:
        for p in (self.prefill, self.compress_with, self.decode):
            p.validate(prompt_len, max_new_tokens, page_size)

    def bind(self, prompt_len: int) -> Pipeline:
        return Pipeline(self.prefill.bind(prompt_len), self.compress_with.bind(prompt_len),
                        self.decode.bind(prompt_len))

    def bind_model(self, config) -> Pipeline:
        return Pipeline(self.prefill.bind_model(config), self.compress_with.bind_model(config),
                        self.decode.bind_model(config))

    def prefill_pattern(self, q, k, v, lengths, layer_index):
        return self.prefill.prefill_pattern(q, k, v, lengths, layer_index)

    def observe(self, q, k, v, lengths, layer_index, **inputs):
        return self.compress_with.observe(q, k, v, lengths, layer_index, **inputs)

    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        return self.compress_with.compressed_capacity(prompt_len, max_new_tokens, suffix_tokens)

    def compress(self, cache: KVCache, observations: Any, capacity: int) -> KVCache:
        return self.compress_with.compress(cache, observations, capacity)

    def decode_init(self, cache: KVCache, observations: Any) -> tuple[Any, Any]:
        same = self.decode is self.compress_with or self.decode == self.compress_with
        return self.decode.decode_init(cache, observations if same else None)

    def decode_write(self, kv: LayerKV, length: jax.Array, layer_state: Any):
        return self.decode.decode_write(kv, length, layer_state)

    def decode_select(self, q, kv, length, layer_state, shared_state, layer_index, page_size) -> Selection:
        return self.decode.decode_select(q, kv, length, layer_state, shared_state, layer_index, page_size)

    def decode_observe(self, layer_state, probs, kv):
        return self.decode.decode_observe(layer_state, probs, kv)

    def decode_update(self, shared_state, cache, logits):
        return self.decode.decode_update(shared_state, cache, logits)

    @property
    def max_rewind_tokens(self) -> int:
        return self.decode.max_rewind_tokens

    def decode_rewind(self, shared_state):
        return self.decode.decode_rewind(shared_state)

    def decode_stats(self, shared_state):
        return self.decode.decode_stats(shared_state)
