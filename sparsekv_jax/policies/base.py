"""The policy protocol: four stages `generate` calls, each with a dense/identity default.

A policy is a `flax.struct.dataclass` pytree. Shape-changing hyperparameters are static fields,
learned or calibrated state are leaves. The stages, in the order a prompt meets them
(docs/POLICIES.md has the diagram):

``context``  (host, before jit) rewrites the prompt: ``context(params, tokens, lengths,
             question_start) -> ContextResult``; it may run the model in chunks (S³'s scan).
``prefill``  inside each layer during prefill: ``prefill_pattern`` — which KV blocks each query
             block attends to (``None`` = dense causal).
``compress`` after prefill: ``observe`` (inside each layer: what ``compress`` needs, stacked over
             layers), ``compressed_capacity`` (static size) and ``compress`` (a *smaller* cache,
             built with `common.compact` or `common.write_entries`).
``decode``   ``decode_init`` builds ``(layer_state, shared_state)`` (``layer_state`` has a leading
             ``[L]`` axis and rides the layer scan). Each step, inside each layer: ``decode_write``
             picks the slot the new token goes to, ``decode_select`` the pages read,
             ``decode_observe`` sees the step's attention probabilities. After the step
             ``decode_update`` sees the logits and may ask for a rewind (``decode_rewind``).

A policy *declares* which stages it implements (``stages``) and what it needs — nothing is
inferred from which methods a class overrides:

* ``needs_whole_prefill``: the prompt must be prefilled in one pass (a prefill pattern, or
  observations of the whole prompt); chunked prefill is refused before jit.
* ``needs_observations``: ``observe`` runs during prefill and its output reaches ``compress`` and
  ``decode_init`` of this policy, whatever policy fills the other stages.
* ``needs_decode_probs``: the decode step computes attention probabilities for ``decode_observe``.
* ``needs_question``: the policy scores with the question (``Prompt.question_start``); without a
  split it uses a documented fallback.
* ``writes_entries``: the compress stage's one write is `common.write_entries` on the cache it is given
  (directly, as SemantiCache's merge, or through `common.write_kept`: `common.compact`,
  `adakv.keep_counts`), so the engine can point that write at a page pool (``Options(pool=True)``,
  experimental: `common.PoolTarget`); its `compressed_pages` sizes the pool.
* ``selects_pages``: the decode stage's one hook is ``decode_select`` (no ``decode_write``, probabilities,
  state or rewinds), which reads the layer's page summaries and lengths, ``[B]`` or a page pool's per-head
  ``[B, Hkv]``, and returns logical page ids, so the engine can run it on a page pool
  (``Options(pool=True)``, experimental: `engine.pooled.decode_step_pool`).
* ``writes_in_place``: the decode stage's ``decode_write`` may name a slot below a head's length (an
  overwrite: H2O's running eviction) and its ``decode_appends`` says, before the step's layer scan, which
  heads append instead, so the engine can run it on a page pool (appending heads get a page from the free
  stack, overwriting heads write through their page tables and take none; `engine.pooled.decode_step_pool`).
* ``page_summaries``: the cache's page summaries (`sparsekv_jax.cache.SUMMARIES`: ``page_sum``,
  ``page_min``, ``page_max``, ``page_max_bias``) the policy reads, in any stage. The engine's cache
  holds only those (others are ``None``: no bytes, no work on append); default none.

`Pipeline` puts one policy in each stage; ``policy.stage(name)`` is the policy that runs a stage
(the policy itself, or `Dense` where it implements none). Every method receives static sizes as
Python ints and arrays as traced values: no host syncs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache, LayerKV, pages_for

Selection = tuple[jax.Array, jax.Array] | None  # (page_ids [B, Hkv, P], counts [B, Hkv]) or all pages
STAGES = ("context", "prefill", "compress", "decode")


@dataclasses.dataclass(frozen=True)
class Setup:
    """What a policy may fix as static fields before jit (`Policy.bind`).

    ``prompt_len`` is the padded prompt width the prefill sees (after the context stage),
    ``max_new_tokens`` every token still to be written after the prompt (a suffix included),
    ``backend`` the resolved `Backend`.
    """

    config: Any
    prompt_len: int = 0
    max_new_tokens: int = 0
    page_size: int = 16
    backend: Backend = dataclasses.field(default_factory=lambda: Backend().resolve())


@struct.dataclass
class Prompt:
    """The prompt as the prefill sees it: ``tokens`` ``[B, T]`` (right-padded), ``lengths`` ``[B]``,
    ``question_start`` ``[B]`` (where each row's question begins; ``None`` when the caller gave no
    split), ``offset`` the first position of this chunk (0 for a one-pass prefill)."""

    tokens: jax.Array
    lengths: jax.Array
    question_start: jax.Array | None = None
    offset: Any = 0


@dataclasses.dataclass(frozen=True)
class ContextResult:
    """What the context stage hands on: the new prompt (``tokens`` ``[B, T']`` right-padded,
    ``lengths``, ``question_start``) and host-side ``info`` (timings, spans) for reports."""

    tokens: np.ndarray
    lengths: np.ndarray
    question_start: np.ndarray | None
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


@struct.dataclass
class Policy:
    """Base policy: implements no stage (dense prefill, no compression, dense decode)."""

    stages: ClassVar[tuple[str, ...]] = ()
    needs_whole_prefill: ClassVar[bool] = False
    needs_observations: ClassVar[bool] = False
    needs_decode_probs: ClassVar[bool] = False
    needs_question: ClassVar[bool] = False
    writes_entries: ClassVar[bool] = False
    selects_pages: ClassVar[bool] = False
    writes_in_place: ClassVar[bool] = False
    page_summaries: ClassVar[frozenset[str]] = frozenset()

    @property
    def name(self) -> str:
        return type(self).__name__

    def stage(self, name: str) -> Policy:
        """The policy that runs stage ``name``: this one if it implements it, else `Dense`."""
        if name not in STAGES:
            raise ValueError(f"unknown stage {name!r}; stages are {STAGES}")
        return self if name in self.stages else DENSE

    def spec_key(self) -> str:
        """A stable text naming this policy with every field (resume keys of ``sparsekv eval``).

        Unlike ``repr`` it never prints an array's contents: a leaf array (calibrated thresholds,
        SAE weights) is named by shape, dtype and a hash of its bytes. A ``backend`` field (the run's
        `Backend`, which `bind` sets where a policy runs a kernel-level choice) is where the policy
        runs, not what it is: it is left out.
        """
        fields = {}
        for f in dataclasses.fields(self):
            if f.name == "backend":
                continue
            fields[f.name] = spec_key_value(getattr(self, f.name))
        return json.dumps([type(self).__name__, fields], sort_keys=True, default=str)

    def bind(self, setup: Setup) -> Policy:
        """Check this policy against the run (``ValueError`` naming the bad value) and return it
        with what it needs of the run fixed as static fields (before jit)."""
        return self

    @classmethod
    def covering(cls) -> Policy:
        """An instance whose budget covers any prompt: it must give exactly full attention's logits
        (tests/test_contract.py checks every registered policy). Default: ``cls(budget=1.0)``."""
        return cls(budget=1.0)

    def with_tokenizer(self, tokenizer: Any) -> Policy:
        """This policy with what it needs of the tokenizer fixed (e.g. SemantiCache's delimiter
        mask over the vocabulary); identity by default. ``sparsekv eval``/``generate`` on the command
        line call it; in Python, call it (or the policy's own constructor) once per tokenizer."""
        return self

    # -- context -------------------------------------------------------------------------
    def context(self, params: Any, tokens: np.ndarray, lengths: np.ndarray,
                question_start: np.ndarray | None) -> ContextResult:
        """Rewrite the prompt on the host before the jitted prefill (identity)."""
        return ContextResult(tokens, lengths, question_start)

    # -- prefill -------------------------------------------------------------------------
    def prefill_pattern(self, q: jax.Array, k: jax.Array, v: jax.Array, layer_index: jax.Array,
                        prompt: Prompt) -> Any:
        """``None`` (dense causal) or ``(block_ids [B,Hkv,nQ,K], counts [B,Hkv,nQ], block_size)``."""
        return None

    # -- compress ------------------------------------------------------------------------
    def observe(self, q: jax.Array, k: jax.Array, v: jax.Array, hidden: jax.Array, layer_index: jax.Array,
                prompt: Prompt) -> Any:
        """Per-layer observation (only called if ``needs_observations``), stacked over layers.

        ``q`` ``[B,T,Hq,D]`` and ``k``/``v`` ``[B,T,Hkv,D]`` (RoPE applied), ``hidden`` ``[B,T,H]``
        the layer's input hidden states.
        """
        return None

    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        """Tokens the compressed cache holds, or ``None`` to keep the prefill cache.

        ``max_new_tokens`` counts every token still to be written after compression (the suffix,
        e.g. a question read after the context was compressed, included); ``suffix_tokens`` is
        the suffix's share of it.
        """
        return None

    def compressed_pages(self, lengths: np.ndarray, prompt_len: int, max_new_tokens: int, page_size: int,
                         num_layers: int, num_kv_heads: int, suffix_tokens: int = 0) -> int | None:
        """Pages of a page pool (docs/PAGE_POOL.md, Sizing) that the compressed cache of rows of ``lengths``
        ``[B]`` (host ints) can occupy with ``max_new_tokens`` tokens still to come, each (layer, row, KV head)
        in pages of its own (``page_size`` tokens): a bound over every allocation the policy can make, used
        to size the decode pool of ``Options(pool=True)``. ``None`` where `compressed_capacity` is ``None``
        (the prefill cache is kept). ``suffix_tokens`` is the share of ``max_new_tokens`` that a suffix (a
        question read after compression: the widest, `Options.question_tokens` for `Session.ask`) takes, as
        `compressed_capacity`'s: a policy whose decode stays at its size (H2O's eviction) counts only those.
        Default: every head at `compressed_capacity`, the uniform cache's pages, ``B·L·Hkv·pages_for(capacity)``;
        a policy whose heads or layers keep less says so."""
        capacity = self.compressed_capacity(prompt_len, max_new_tokens, suffix_tokens)
        if capacity is None:
            return None
        return len(lengths) * num_layers * num_kv_heads * pages_for(capacity, page_size)

    def compress(self, cache: KVCache, observations: Any, capacity: int, prompt: Prompt) -> KVCache:
        return cache

    # -- decode --------------------------------------------------------------------------
    def decode_init(self, cache: KVCache, observations: Any) -> tuple[Any, Any]:
        """``(layer_state, shared_state)`` for the decode loop; ``observations`` are this policy's
        prefill observations if it ``needs_observations`` (else ``None``). The leaves of
        ``shared_state`` are per row, ``[B, ...]``: the decode loop keeps a stopped row's as they
        were (`sparsekv_jax.engine.decode.hold_stopped_rows`)."""
        return None, None

    def decode_write(self, kv: LayerKV, length: jax.Array, layer_state: Any) -> tuple[jax.Array, jax.Array]:
        """``(slot [B] or [B, Hkv], new_length [B])`` for this step's token: append by default."""
        return length, length + 1

    def decode_appends(self, layer_state: Any, lengths: jax.Array) -> jax.Array:
        """``[L, B, Hkv]`` bool: the heads whose token this step goes at their length (an append), the others
        overwrite the slot ``decode_write`` names below it. Decided before the layer scan from the heads'
        ``lengths`` ``[L, B, Hkv]`` and ``layer_state`` (``[L, ...]``), so a page pool can reserve pages for the
        appending heads only (read when ``writes_in_place``); it must agree with ``decode_write``. Default:
        every head appends."""
        return jnp.ones(lengths.shape, jnp.bool_)

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
        """``[B]`` int: tokens each row takes back after this step (decided in ``decode_update``), or
        ``None`` (static: never; the default). Any decode policy may use it (CHESS regenerates a
        page with a rebuilt selection): the decode loop drops those tokens from the row's output
        and its cache (``length`` and ``next_position`` step back; the slots are overwritten) and
        generates them again, running up to ``max_rewind_tokens`` extra steps, which must bound
        the total a row takes back. The new selection is the policy's own: ``decode_update`` sets it
        for the cache as it will be after the rewind (``cache.length - rewind``)."""
        return None

    def decode_stats(self, shared_state: Any) -> dict[str, jax.Array]:
        """Per-row ``[B]`` counters the policy reports at the end of generation (e.g. re-selections);
        the eval harness records every key."""
        return {}


def spec_key_value(value: Any) -> Any:
    """A field's value as `Policy.spec_key` writes it (a policy by its key, an array by shape, dtype
    and hash, a non-finite float as text)."""
    if isinstance(value, Policy):
        return json.loads(value.spec_key())
    if isinstance(value, (jax.Array, np.ndarray)):
        a = np.asarray(value)
        if a.size == 1:
            return float(a.reshape(()))
        return f"array{list(a.shape)}:{a.dtype}:{hashlib.sha1(a.tobytes()).hexdigest()[:12]}"
    if isinstance(value, dict):
        return {str(k): spec_key_value(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [spec_key_value(v) for v in value]
    if isinstance(value, float) and not np.isfinite(value):
        return str(value)
    return value


@struct.dataclass
class Dense(Policy):
    """Full attention everywhere: the reference every policy is measured against."""

    @classmethod
    def covering(cls) -> Dense:
        return cls()


FullKV = Dense
DENSE = Dense()
