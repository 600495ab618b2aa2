"""SemantiCache (Wu et al., 2025): delimiter chunking, greedy seed-based clustering (GSC), merged
semantic cores with proportional attention. A compressor that *merges* KV entries.

The paper ("SemantiCache: Efficient KV Cache Compression via Semantic Chunking and Clustered
Merging"), per (layer, KV head), on the prompt's entries:

* **Semantic chunking.** The prompt is cut at delimiter tokens into chunks; delimiters are kept
  unmerged as anchors (Eq. 1).
* **GSC** (Algorithm 1) inside each chunk: the first unassigned token seeds a cluster that absorbs
  every *later* unassigned token whose key cosine with the seed exceeds ``tau`` (Eq. 2).
* **Merging.** A cluster becomes one entry: the mean key and mean value (Eq. 3), with bias
  ``log |S|`` in the cache's per-slot bias, so every decode path computes
  ``softmax(q·k/√d + log s)·V`` (proportional attention, Eq. 4) — the Pallas decode kernel included.

Choices where the paper is silent (docs/SEMANTICACHE.md shows them in ablations) are documented
beside their code:

* `semanticache_tokens`: which tokens are delimiters, and the opt-in ``protect`` rules that read
  the prompt's ids (``"digits"``, ``"digit_words"``, ``"digit_sentences"``: they recognise number
  answers);
* `semanticache_merge`: sinks and window, bounded chunks, pre-RoPE keys and the merged entry's
  position, budget mode's search over three chunk layouts, threshold mode and quantised caches.

Issue 36's answer-agnostic candidates (``protect="rare_tokens"``, ``"attended"``, ``"outlier_keys"``
and ``max_cluster_size``) were measured on Qwen2.5-Coder-1.5B and removed: each lost to the paper's
algorithm on at least one needle value type (docs/RESULTS.md). So was ``similarity="keys_values"``
(cluster on the lesser of the key and the value cosine): on 2026-11-28, lower than keys alone on every
value type (-16.67 points at 25%, -21.33 at 50%; docs/SEMANTICACHE.md).

The mechanics (layout, GSC, the threshold search, the merged entries) are `policies/clustering.py`;
the cache write is `common.write_entries`. This file holds the settings, their checks and the stages.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from flax import struct

from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache, pages_for
from sparsekv_jax.models.rope import inverse_frequencies
from sparsekv_jax.policies import clustering, semanticache_merge, semanticache_tokens
from sparsekv_jax.policies.base import Policy, Prompt, Setup
from sparsekv_jax.policies.common import budget_tokens, check_budget, check_sinks_window, row_budgets, write_entries

CHUNKINGS = ("delimiters", "fixed", "none")
LEVEL_RULES = ("least_lossy", "finest")
KEYS = ("pre_rope", "post_rope")
PROTECT = (None, *semanticache_tokens.PROTECT_TOKENS)
# issue 36's answer-agnostic candidates, measured and removed (docs/RESULTS.md): named in the error
REMOVED_PROTECT = ("rare_tokens", "attended", "outlier_keys")


@struct.dataclass
class SemantiCache(Policy):
    """SemantiCache compression after prefill (the module docstring says where each choice is documented).

    Args:
      budget: entries kept per (layer, row, KV head): fraction of the prompt or token count, sinks
        and window included. In threshold mode, the cap (the cache's static capacity).
      tau: ``None`` = budget mode (the largest threshold that fits, per head, on the layout that
        reaches the highest); a float = GSC at that threshold (paper: 0.5-0.9), capped by ``budget``.
      sinks, window: first / last prompt entries kept unmerged (4 / 32).
      recent_ratio: the window is at least this share of the row's budget (H2O's ``recent_ratio``;
        default 0: ``window`` entries).
      protect: entries kept unmerged, anchors at every chunk layout (our additions, opt-in;
        `semanticache_tokens`): ``None`` (the paper as written), ``"digits"``, ``"digit_words"``
        (the digits only in a row where the words would not fit) or ``"digit_sentences"`` (then the
        words, then the digits): rules that recognise number answers. A row where the protected
        slots would not fit the budget merges as the paper does.
      number_sentences: with ``protect="digit_sentences"``, the longest sentence (tokens) kept whole.
      sentence_share: the largest share of a row's budget its digit sentences take.
      chunking: ``"delimiters"`` (the paper), ``"fixed"`` (``chunk_size`` blocks, no anchors) or
        ``"none"`` (one chunk: global clustering) — the paper's Table 4 variants.
      chunk_size: longest chunk (longer delimiter-free runs are split); the fixed block size.
      keys: ``"pre_rope"`` (content similarity, merged at the mean position) or ``"post_rope"``.
      search_steps: thresholds tried per grid pass in budget mode (two passes).
      level_rule: budget mode's layout per (layer, row, KV head): ``"least_lossy"`` (the highest
        threshold) or ``"finest"`` (per row the first that fits: the previous rule, for ablations).
      layer_batch: layers compressed together (`jax.lax.map` batch: memory against launches).
      gsc: where GSC runs: ``"auto"`` (the Pallas kernel on a GPU, jnp elsewhere), ``"jnp"``,
        ``"pallas"`` or ``"interpret"`` (the kernel on the CPU, for tests); same result on every path.
      delimiter_mask: ``[V]`` bool leaf (`from_tokenizer` / `with_tokenizer`).
      number_mask: ``[V]`` bool leaf of digit tokens, set by `with_tokenizer` for the digit rules.
      word_start_mask: ``[V]`` bool leaf of tokens that begin a word, set by `with_tokenizer` for
        ``"digit_words"`` and ``"digit_sentences"``.
      sentence_end_mask: ``[V]`` bool leaf of tokens that close a sentence, set by `with_tokenizer`
        for ``"digit_sentences"``.
      inv_freq: RoPE frequencies, set by `bind` for ``keys="pre_rope"``.
      backend: the run's `Backend`, set by `bind`: its platform resolves ``gsc="auto"``
        (`sparsekv_jax.pallas.dispatch.gsc_method`).
    """

    budget: float | int = struct.field(pytree_node=False, default=0.25)
    tau: float | None = struct.field(pytree_node=False, default=None)
    sinks: int = struct.field(pytree_node=False, default=4)
    window: int = struct.field(pytree_node=False, default=32)
    recent_ratio: float = struct.field(pytree_node=False, default=0.0)
    protect: str | None = struct.field(pytree_node=False, default=None)
    number_sentences: int = struct.field(pytree_node=False, default=64)
    sentence_share: float = struct.field(pytree_node=False, default=0.5)
    chunking: str = struct.field(pytree_node=False, default="delimiters")
    chunk_size: int = struct.field(pytree_node=False, default=64)
    keys: str = struct.field(pytree_node=False, default="pre_rope")
    search_steps: int = struct.field(pytree_node=False, default=16)
    level_rule: str = struct.field(pytree_node=False, default="least_lossy")
    layer_batch: int = struct.field(pytree_node=False, default=4)
    gsc: str = struct.field(pytree_node=False, default="auto")
    delimiter_mask: jax.Array | None = None
    number_mask: jax.Array | None = None
    word_start_mask: jax.Array | None = None
    sentence_end_mask: jax.Array | None = None
    inv_freq: tuple[float, ...] | None = struct.field(pytree_node=False, default=None)
    backend: Backend | None = struct.field(pytree_node=False, default=None)

    stages = ("compress",)
    # the delimiters and protected slots come from the prompt's ids: nothing observed, chunked prefill works
    needs_whole_prefill = False
    needs_observations = False
    writes_entries = True  # its merge's one write is `common.write_entries`: the engine may send it into a page pool

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_sinks_window(self.budget, self.sinks, self.window)
        if isinstance(self.recent_ratio, bool) or not 0.0 <= self.recent_ratio < 1.0:
            raise ValueError(f"recent_ratio={self.recent_ratio!r} must be in [0, 1): the share of the budget kept as "
                             "the exact recent window")
        if self.tau is not None and (isinstance(self.tau, bool) or not -1.0 <= self.tau <= 1.0):
            raise ValueError(f"tau={self.tau!r} must be None (budget mode) or a cosine threshold in [-1, 1]")
        if self.protect in REMOVED_PROTECT:
            raise ValueError(f"protect={self.protect!r} must be one of {PROTECT}: 'rare_tokens', 'attended' and "
                             "'outlier_keys' were issue 36's answer-agnostic candidates, measured on "
                             "Qwen2.5-Coder-1.5B and removed (each lost on some needle value type; docs/RESULTS.md)")
        if self.protect not in PROTECT:
            raise ValueError(f"protect={self.protect!r} must be one of {PROTECT}")
        if isinstance(self.number_sentences, bool) or not isinstance(self.number_sentences, int) \
                or self.number_sentences < 1:
            raise ValueError(f"number_sentences={self.number_sentences!r} must be a positive int: the longest "
                             "sentence, in tokens, that protect='digit_sentences' keeps whole around a digit")
        if isinstance(self.sentence_share, bool) or not 0.0 < self.sentence_share <= 1.0:
            raise ValueError(f"sentence_share={self.sentence_share!r} must be in (0, 1]: the largest share of a row's "
                             "budget its digit sentences may take")
        if self.chunking not in CHUNKINGS:
            raise ValueError(f"chunking={self.chunking!r} must be one of {CHUNKINGS}")
        if self.keys not in KEYS:
            raise ValueError(f"keys={self.keys!r} must be one of {KEYS}")
        if self.chunk_size < 2:
            raise ValueError(f"chunk_size={self.chunk_size} must be >= 2")
        if self.level_rule not in LEVEL_RULES:
            raise ValueError(f"level_rule={self.level_rule!r} must be one of {LEVEL_RULES}")
        if self.search_steps < 3:
            raise ValueError(f"search_steps={self.search_steps} must be >= 3")
        if self.gsc not in clustering.GSC_METHODS:
            raise ValueError(f"gsc={self.gsc!r} must be one of {clustering.GSC_METHODS}")
        if self.layer_batch < 1:
            raise ValueError(f"layer_batch={self.layer_batch} must be >= 1")
        if self.chunking != "none" and isinstance(self.budget, float) and self.budget < 2 / self.chunk_size:
            raise ValueError(f"budget={self.budget} is below 2/chunk_size={2 / self.chunk_size:.4f}: one entry per "
                             f"{self.chunk_size}-token block would not fit; raise chunk_size or use chunking='none'")

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *args: Any, **kwargs: Any) -> SemantiCache:
        """``SemantiCache(*args, **kwargs)`` with the delimiter mask of ``tokenizer``."""
        return cls(*args, **kwargs).with_tokenizer(tokenizer)

    def with_tokenizer(self, tokenizer: Any) -> SemantiCache:
        """This policy with ``tokenizer``'s masks (`semanticache_tokens.tokenizer_masks`)."""
        return self.replace(**semanticache_tokens.tokenizer_masks(tokenizer, self.protect))

    def bind(self, setup: Setup) -> SemantiCache:
        semanticache_tokens.check_masks(self)
        T = setup.prompt_len
        check_sinks_window(self.budget, self.sinks, self.window, T)
        if T and self.chunking != "none" and budget_tokens(self.budget, T) < -(-T // self.chunk_size):
            raise ValueError(f"budget={self.budget} keeps {budget_tokens(self.budget, T)} entries of a {T}-token "
                             f"prompt, fewer than its {-(-T // self.chunk_size)} blocks of chunk_size="
                             f"{self.chunk_size}")
        if T and self.gsc in ("pallas", "interpret"):
            clustering.resolve_gsc(self.gsc, self._width(T))  # a band the kernel cannot take: say so before jit
        bound = self.replace(backend=setup.backend)
        if self.keys == "pre_rope":
            return bound.replace(inv_freq=tuple(float(f) for f in inverse_frequencies(setup.config)))
        return bound

    @property
    def name(self) -> str:
        defaults = {f.name: f.default for f in dataclasses.fields(SemantiCache)}
        shown = [f"{n}={getattr(self, n)!r}"
                 for n in ("tau", "sinks", "window", "recent_ratio", "protect", "number_sentences", "sentence_share",
                           "chunking", "chunk_size", "keys", "level_rule")
                 if getattr(self, n) != defaults[n]]
        return f"SemantiCache({', '.join([repr(self.budget), *shown])})"

    @property
    def threshold_mode(self) -> bool:
        return self.tau is not None

    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        kept = budget_tokens(self.budget, prompt_len)
        if kept >= prompt_len and not self.threshold_mode:
            return None  # the budget covers the prompt: nothing merges (tau = 1 fits)
        return kept + max_new_tokens

    def compressed_pages(self, lengths: np.ndarray, prompt_len: int, max_new_tokens: int, page_size: int,
                         num_layers: int, num_kv_heads: int, suffix_tokens: int = 0) -> int | None:
        """A head keeps at most ``min(length_b, n)`` entries (``n`` = `budget_tokens` of the prompt's width,
        `semanticache_merge.cluster`'s static count: `clustering.merge_clusters` clips to it and makes at most
        one entry per live slot), then the tokens to come: ``L·Hkv·Σ_b pages_for(min(length_b, n) +
        max_new_tokens)``. Not the row budget: a row whose sinks, window and anchors exceed it merges past
        it (`clustering.first_fitting` falls back to the last layout)."""
        if self.compressed_capacity(prompt_len, max_new_tokens) is None:
            return None
        n = min(prompt_len, budget_tokens(self.budget, prompt_len))
        return num_layers * num_kv_heads * sum(pages_for(min(int(b), n) + max_new_tokens, page_size)
                                               for b in np.asarray(lengths))

    # -- compress -----------------------------------------------------------------------
    def _width(self, T: int) -> int:
        return T if self.chunking == "none" else min(self.chunk_size, T)

    def _levels(self) -> tuple[int, ...]:
        return (0, 1, 2) if self.chunking == "delimiters" else (2,)

    def layout(self, prompt: Prompt) -> tuple[jax.Array, ...]:
        """``(forced, anchor, member, place, level)`` of each prompt slot (`clustering.chunk_layout`)
        and each row's level (0 = the paper's layout; 1, 2 = the fallbacks): the first level whose
        coarsest clustering fits this budget. Threshold mode's layout (and budget mode's with
        ``level_rule="finest"``); budget mode chooses per (layer, row, KV head): `choices`."""
        keep = row_budgets(self.budget, prompt.lengths)
        return clustering.fitting_layout(semanticache_tokens.delimiters(self, prompt), prompt.lengths, keep,
                                         self.sinks, self.window, self._width(prompt.tokens.shape[1]),
                                         self._levels(), self.recent_ratio,
                                         *semanticache_tokens.protected_slots(self, prompt))

    def choices(self, cache: KVCache, prompt: Prompt) -> tuple[jax.Array, jax.Array]:
        """``(level, tau)`` ``[L, B, H]``: the chunk layout level (0, 1, 2) and the threshold GSC
        ran at, per (layer, row, KV head) — what `compress` decides, for inspection."""
        return self._cluster(cache, prompt)[1]

    def _cluster(self, cache: KVCache, prompt: Prompt) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, jax.Array]]:
        """`semanticache_merge.cluster`, after the checks that can fail before jit."""
        semanticache_tokens.check_masks(self)
        if self.keys == "pre_rope" and self.inv_freq is None:
            raise ValueError("SemantiCache(keys='pre_rope') needs the RoPE frequencies: policy.bind(Setup(config)) "
                             "first (generate and sparsekv eval do)")
        return semanticache_merge.cluster(self, cache, prompt)

    def compress_with_choices(self, cache: KVCache, observations: Any, capacity: int,
                              prompt: Prompt) -> tuple[KVCache, tuple[jax.Array, jax.Array]]:
        """`compress` and `choices` from one clustering (``observations``: none, `compress`'s signature). Given
        a `common.PoolTarget` (``Options(pool=True)``), `write_entries` writes a fresh decode pool."""
        (k, v, pos, bias, counts), chosen = self._cluster(cache, prompt)
        return write_entries(cache, k, v, pos, bias, counts, capacity), chosen

    def compress(self, cache: KVCache, observations: Any, capacity: int, prompt: Prompt) -> KVCache:
        return self.compress_with_choices(cache, observations, capacity, prompt)[0]
