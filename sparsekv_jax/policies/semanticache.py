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

Choices where the paper is silent (docs/SEMANTICACHE.md shows them in ablations):

* **Delimiter tokens.** A token is a delimiter when its decoded text is non-empty and consists only
  of the paper's characters ``. , ? ! ; :`` space, tab, newline (SmolLM2: 177 of 49,152 tokens, e.g.
  ``"."``, ``" "``, ``"\\n\\n"``, ``" ."``). "Space" is read as a token that *is* whitespace, not one
  that starts with a space: SmolLM2's BPE glues the leading space to 65% of its vocabulary (every
  word after the first), so that reading would make nearly every word an unmerged anchor. The mask
  over the vocabulary is computed once (`delimiter_mask`) and held as a leaf.
* **Protection from merging** (``protect``; default ``None``: the paper's algorithm as written).
  Every rule below is our addition, opt-in, and a results row that uses one names it.

  ``protect="digits"``: numbers are kept unmerged. A token made only of digits (`number_mask`;
  SmolLM2, Gemma and Qwen2 split every number into single digits) is an anchor at every chunk
  layout. The digits of one number have similar keys (pre-RoPE cosine 0.80-0.98 on SmolLM2), so
  GSC merges a number into one entry whose mean value is no digit: RULER's needles were lost at
  every budget. Kept digits count in the budget; a row whose digits would not fit with one entry
  per chunk merges them as the paper does.
  The same prefilled caches, RULER 4k at 50%, question-agnostic: 28.81 with, 13.32 without
  (docs/SEMANTICACHE.md). These rules recognise RULER's default answer format: on the same tasks
  with word-valued needles the digit rules keep less than the paper's algorithm (issue #36;
  docs/RESULTS.md), which is why none of them is the default.

  ``protect="digit_words"``: so are the words around them: every
  token of a word that holds a digit (a UUID's letters, ``"x86"``, ``"1990s"``; a word is cut before
  a token that starts with whitespace and around delimiters, `clustering.number_words`). A row where
  the words would not fit keeps only the digits; one where the digits would not fit, nothing.
  RULER 4k at 50%, question-agnostic: 30.24 with the words, 29.07 with the digits only (UUID
  needles: 16 against 4; experiments/diary/RESULTS_DIARY.md).

  ``protect="digit_sentences"`` (the default until 2026-11-27): and the sentences that hold them:
  every token of a sentence of at most 64 tokens that holds a digit (a sentence ends at a delimiter
  token holding ``.`` ``?`` ``!`` or a newline, `clustering.sentence_end_mask`), so a fact keeps the
  words that say what its number is: "One of the special magic numbers for wise-cook is: 7975467."
  (``number_sentences`` = 64 tokens at most.) A row keeps its sentences only while they take at
  most ``sentence_share`` (half) of its budget; else the words, as above. RULER at 50%,
  question-agnostic: 33.00 at 4k (95.8% of full attention) and 22.84 at 8k, against 30.24 and
  20.71 with the words; LongBench-mini even (experiments/diary/RESULTS_DIARY.md).

  ``protect="rare_tokens"``: a rule that does not look at the answer's format. The tokens whose id
  occurs least often in the row's prompt are kept unmerged, as many as ``sentence_share`` of the
  row's budget holds (per row the largest count ``c`` such that the tokens occurring at most ``c``
  times fit; `rare_tokens`). A needle's value is new to its haystack, as a name or a figure is new
  to the document around it; a haystack's repeated words are what merging can afford to lose.

  The next two are format-blind too, and chosen per (layer, row, KV head), so they are not anchors
  (a chunk layout is one per row): a protected slot stays in its chunk with its cosines set below
  every threshold (`merge_protection.unmergeable`), so GSC makes it a cluster of one (kept bit for
  bit) and clusters the rest of the chunk around it. How many: ``sentence_share`` of the row's
  budget, fewer where the coarsest clustering (one cluster per chunk) of the reference layout —
  budget mode: the last, ``chunk_size`` blocks; threshold mode: the row's — leaves less room; each
  protected slot adds at most one entry to it, so that layout still fits, and a finer layout that
  then overflows is not chosen.

  ``protect="attended"``: the slots the observation window attends to most, SnapKV's scores (the
  last ``window`` prompt queries' softmax over the earlier keys, averaged over the window and the
  GQA group, max-pooled over 7 slots: SnapKV's paper settings, `policies.snapkv`), highest first
  (ties: the earlier slot), among every slot outside sinks and window. What the prompt's end asks
  about is kept whole, whatever its format. It observes the prefill, so it needs the whole prompt
  in one pass (`needs_whole_prefill`; chunked prefill is refused before jit).

  ``protect="outlier_keys"``: the keys of lowest cosine with their chunk's mean key, on the paper's
  chunk layout (delimiter chunks; the only layout of ``chunking="fixed"``/``"none"``), lowest first,
  among its members. A key unlike its chunk is what a cluster's mean would blur most; a singleton
  chunk's key is its own mean (cosine 1) and never protected.
* **Cluster cap** (``max_cluster_size=N``; default ``None``: the paper's unbounded clusters, our
  addition). A seed absorbs its first ``N - 1`` similar members in chunk order; its later similar
  members stay unassigned and seed or join later clusters as GSC would. A cap bounds what one mean
  entry blurs, but it also bounds compression: a chunk of ``m`` members keeps at least
  ``ceil(m / N)`` entries, so the budget search's lowest threshold ("merge all") may no longer fit.
  Per row and layout the cap is then raised to the smallest that fits (`merge_protection.fitting_caps`):
  the search still finds the largest threshold that fits wherever the paper's would. The threshold
  no longer rises monotonically with the budget where the cap is raised: a budget just large enough
  for ``N`` has the binding cap and may reach a lower threshold than a slightly smaller budget with a
  raised one. GSC then runs in jnp (the Pallas kernel has no cap; ``gsc="pallas"`` is refused).
* **Sinks and window.** The first ``sinks`` (4) and last ``window`` (32) prompt entries are kept as
  they are, counted inside the budget (as every compressor here).
* **Bounded chunks.** A run of more than ``chunk_size`` (64) tokens without a delimiter is split, so
  GSC is a loop over the places in a chunk (to the longest chunk present, at most ``chunk_size``
  steps), vectorised over all chunks, heads, rows and thresholds (one band of ``chunk_size``
  cosines per token, computed once; one gather per step).
* **Keys and the merged entry's RoPE position.** Similarity and merging use *pre-RoPE* keys by
  default (each cached key is rotated back by its position): the cosine of contents, without
  RoPE's position phase. A cluster's key is the mean content rotated to the cluster's *mean
  position* (rounded half up), which is also the entry's position; a singleton keeps its stored
  key, value and position bit for bit. Entries are stored in the order of their first slot.
  ``keys="post_rope"`` compares and averages the stored keys (position: the mean too).
  ``similarity="keys_values"`` (an ablation) clusters on the lesser of the key and the value cosine,
  so a member's value must be as alike as its key: lower on RULER 4k (27.26 against 29.71 at 50%).
* **Budget mode** (``tau=None``): per (layer, row, KV head) the *largest* ``tau`` whose clusters fit
  the budget: a pass of ``search_steps`` thresholds log-spaced below the top (`search_grid`), then
  a linear pass between the last that did not fit and the first that did; each pass evaluates all
  its thresholds at once. The search runs on three chunk layouts — the paper's (delimiters are
  anchors; level 0), clauses (a run of words and the delimiters closing it, no anchors; level 1)
  and ``chunk_size`` blocks (level 2) — and each (layer, row, KV head) keeps the layout whose search
  reaches the **highest threshold** (ties: the finer layout): the least lossy merge, since every
  member of a cluster has at least that cosine with its seed. A layout whose one-cluster-per-chunk
  clustering overflows the budget reaches nothing. Each layout's threshold never falls when the
  budget grows, so neither does the chosen one. (``level_rule="finest"``: the previous rule, per
  row the first layout that fits; its threshold *fell* as the budget grew — a larger budget admits
  the paper's layout with little room to spare — and RULER's score with it: docs/SEMANTICACHE.md.)
  The kept count never exceeds the budget. `SemantiCache.choices` reports level and threshold.
* **Threshold mode** (``tau=x``): GSC at ``x`` on the paper's layout (the paper's algorithm); where
  its one cluster per chunk would overflow ``budget`` (a cap: the static cache capacity), the row
  uses the first coarser layout that fits; heads that would keep more merge at the largest lower
  threshold that fits.
  ``SemantiCache(budget=1.0, tau=x)`` is the paper's pure threshold (room for the whole prompt).

On SmolLM2 the digits of a needle's number (one token each) are among the most similar neighbours
in the prompt (keys and values alike), so without protection any budget that merges prose
merges a number in it first (docs/SEMANTICACHE.md).

On a quantised cache (``Backend(kv_dtype="int8" | "float8_e4m3fn")``) the clustering reads the
entries' values (`sparsekv_jax.cache.dequantize_kv`, float32, exact), so similarities and means are
those of the dequantised cache, and `common.write_entries` quantises the merged entries into the new
pages (a singleton moves losslessly unless its new page needs a larger scale).

The mechanics (layout, GSC, the threshold search, the merged entries) are `policies/clustering.py`;
the cache write is `common.write_entries`. This file holds the settings and the order of the steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache, LayerKV, dequantize_kv
from sparsekv_jax.models.rope import inverse_frequencies
from sparsekv_jax.pallas import dispatch
from sparsekv_jax.policies import clustering, merge_protection
from sparsekv_jax.policies.base import Policy, Prompt, Setup
from sparsekv_jax.policies.common import budget_tokens, check_budget, check_sinks_window, row_budgets, write_entries
from sparsekv_jax.policies.snapkv import SnapKV

CHUNKINGS = ("delimiters", "fixed", "none")
LEVEL_RULES = ("least_lossy", "finest")
KEYS = ("pre_rope", "post_rope")
SIMILARITIES = ("keys", "keys_values")
PROTECT = (None, "digits", "digit_words", "digit_sentences", "rare_tokens", *merge_protection.PROTECT_PER_HEAD)


@struct.dataclass
class SemantiCache(Policy):
    """SemantiCache compression after prefill (module docstring for the choices).

    Args:
      budget: entries kept per (layer, row, KV head): fraction of the prompt or token count, sinks
        and window included. In threshold mode, the cap (the cache's static capacity).
      tau: ``None`` = budget mode (the largest threshold that fits, per head, on the layout that
        reaches the highest); a float = GSC at that threshold (paper: 0.5-0.9), capped by ``budget``.
      sinks, window: first / last prompt entries kept unmerged (4 / 32).
      recent_ratio: the window is at least this share of the row's budget (H2O's ``recent_ratio``;
        default 0: ``window`` entries).
      protect: entries kept unmerged, anchors at every chunk layout (our additions, opt-in; module
        docstring): ``None`` (the paper as written), ``"digits"``, ``"digit_words"`` (the digits
        only in a row where the words would not fit), ``"digit_sentences"`` (then the words, then
        the digits) or ``"rare_tokens"`` (the prompt's least frequent token ids): a row where the
        protected slots would not fit the budget merges as the paper does. Per (layer, row, KV
        head), format-blind: ``"attended"`` (the slots SnapKV's observation window, the last
        ``window`` queries, attends to most; needs the whole prompt in one prefill) or
        ``"outlier_keys"`` (the keys of lowest cosine with their chunk's mean key), as many as
        ``sentence_share`` of the budget, fewer where the coarsest clustering leaves less room.
      max_cluster_size: ``None`` (the paper: unbounded) or the most slots one cluster holds, its seed
        included (>= 2); raised per row and layout to the smallest cap whose one-cluster-per-chunk
        clustering fits the budget. GSC then runs in jnp (the kernel has no cap).
      number_sentences: with ``protect="digit_sentences"``, the longest sentence (tokens) kept whole.
      sentence_share: the largest share of a row's budget its digit sentences (or rare tokens, attended
        slots, outlier keys) take.
      chunking: ``"delimiters"`` (the paper), ``"fixed"`` (``chunk_size`` blocks, no anchors) or
        ``"none"`` (one chunk: global clustering) — the paper's Table 4 variants.
      chunk_size: longest chunk (longer delimiter-free runs are split); the fixed block size.
      keys: ``"pre_rope"`` (content similarity, merged at the mean position) or ``"post_rope"``.
      similarity: ``"keys"`` (the paper: GSC compares keys) or ``"keys_values"`` (the lesser of the
        key and the value cosine; an ablation).
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
    max_cluster_size: int | None = struct.field(pytree_node=False, default=None)
    chunking: str = struct.field(pytree_node=False, default="delimiters")
    chunk_size: int = struct.field(pytree_node=False, default=64)
    keys: str = struct.field(pytree_node=False, default="pre_rope")
    similarity: str = struct.field(pytree_node=False, default="keys")
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
    chunkable_when: ClassVar[str] = "unless protect='attended'"  # `sparsekv eval --help`'s list

    @property
    def needs_observations(self) -> bool:  # type: ignore[override]
        """Only ``protect="attended"`` observes the prefill; the rest reads the prompt's ids and the cache."""
        return self.protect == "attended"

    @property
    def needs_whole_prefill(self) -> bool:  # type: ignore[override]
        """The observation window attends to the whole prompt; otherwise chunked prefill works."""
        return self.protect == "attended"

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_sinks_window(self.budget, self.sinks, self.window)
        if isinstance(self.recent_ratio, bool) or not 0.0 <= self.recent_ratio < 1.0:
            raise ValueError(f"recent_ratio={self.recent_ratio!r} must be in [0, 1): the share of the budget kept as "
                             "the exact recent window")
        if self.tau is not None and (isinstance(self.tau, bool) or not -1.0 <= self.tau <= 1.0):
            raise ValueError(f"tau={self.tau!r} must be None (budget mode) or a cosine threshold in [-1, 1]")
        if self.protect not in PROTECT:
            raise ValueError(f"protect={self.protect!r} must be one of {PROTECT}")
        if isinstance(self.number_sentences, bool) or not isinstance(self.number_sentences, int) \
                or self.number_sentences < 1:
            raise ValueError(f"number_sentences={self.number_sentences!r} must be a positive int: the longest "
                             "sentence, in tokens, that protect='digit_sentences' keeps whole around a digit")
        if isinstance(self.sentence_share, bool) or not 0.0 < self.sentence_share <= 1.0:
            raise ValueError(f"sentence_share={self.sentence_share!r} must be in (0, 1]: the largest share of a row's "
                             "budget its digit sentences or rare tokens may take")
        if self.max_cluster_size is not None and (isinstance(self.max_cluster_size, bool)
                                                  or not isinstance(self.max_cluster_size, int)
                                                  or self.max_cluster_size < 2):
            raise ValueError(f"max_cluster_size={self.max_cluster_size!r} must be None (unbounded clusters, the paper) "
                             "or an int >= 2: the most prompt slots one merged entry may hold")
        if self.max_cluster_size is not None and self.gsc in ("pallas", "interpret"):
            raise ValueError(f"gsc={self.gsc!r} with max_cluster_size={self.max_cluster_size}: the GSC kernel has no "
                             "cluster cap; use gsc='auto' or 'jnp'")
        if self.protect == "attended" and self.window < 1:
            raise ValueError(f"window={self.window} with protect='attended': the observation window is the last "
                             "`window` prompt queries; it must be >= 1")
        if self.chunking not in CHUNKINGS:
            raise ValueError(f"chunking={self.chunking!r} must be one of {CHUNKINGS}")
        if self.keys not in KEYS:
            raise ValueError(f"keys={self.keys!r} must be one of {KEYS}")
        if self.similarity not in SIMILARITIES:
            raise ValueError(f"similarity={self.similarity!r} must be one of {SIMILARITIES}")
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
        numbers = jnp.asarray(clustering.number_mask(tokenizer)) if self._digits else None
        starts = jnp.asarray(clustering.word_start_mask(tokenizer)) if self._words else None
        ends = jnp.asarray(clustering.sentence_end_mask(tokenizer)) if self._sentences else None
        return self.replace(delimiter_mask=jnp.asarray(clustering.delimiter_mask(tokenizer)), number_mask=numbers,
                            word_start_mask=starts, sentence_end_mask=ends)

    def bind(self, setup: Setup) -> SemantiCache:
        self._check_masks()
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
                           "max_cluster_size", "chunking", "chunk_size", "keys", "similarity", "level_rule")
                 if getattr(self, n) != defaults[n]]
        return f"SemantiCache({', '.join([repr(self.budget), *shown])})"

    @property
    def _digits(self) -> bool:
        return self.protect in ("digits", "digit_words", "digit_sentences")

    @property
    def _words(self) -> bool:
        """Words holding a digit are kept (the sentences rule falls back on them)."""
        return self.protect in ("digit_words", "digit_sentences")

    @property
    def _sentences(self) -> bool:
        return self.protect == "digit_sentences"

    @property
    def threshold_mode(self) -> bool:
        return self.tau is not None

    def observe(self, q, k, v, hidden, layer_index, prompt: Prompt) -> jax.Array | None:
        """``protect="attended"``: SnapKV's scores (its paper's pooling: max over 7) of this layer,
        ``[B, Hkv, T]``, from the last ``window`` queries (`policies.snapkv.SnapKV.observe`)."""
        if self.protect != "attended":
            return None
        return SnapKV(budget=1.0, window=self.window).observe(q, k, v, hidden, layer_index, prompt)

    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        kept = budget_tokens(self.budget, prompt_len)
        if kept >= prompt_len and not self.threshold_mode:
            return None  # the budget covers the prompt: nothing merges (tau = 1 fits)
        return kept + max_new_tokens

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
        return clustering.fitting_layout(self._is_delim(prompt), prompt.lengths, keep, self.sinks, self.window,
                                         self._width(prompt.tokens.shape[1]), self._levels(), self.recent_ratio,
                                         *self._protected(prompt))

    def _is_delim(self, prompt: Prompt) -> jax.Array:
        if self.chunking == "delimiters":
            return jnp.take(self.delimiter_mask, prompt.tokens, mode="fill", fill_value=False)
        return jnp.zeros(prompt.tokens.shape, bool)

    def _protected(self, prompt: Prompt) -> tuple[tuple[jax.Array, ...] | None, tuple[float, ...] | None]:
        """The slots kept unmerged at every layout, most protective first (`clustering.candidate_layouts`
        takes, per row, the first that fits), and the budget share each may take: the sentences
        holding a digit (with the words of longer ones), the words holding a digit, the digits; or
        the rare tokens (sized to their share here)."""
        if self.protect is None or self.protect in merge_protection.PROTECT_PER_HEAD:
            return None, None  # per (layer, row, head): `_cluster`
        if self.protect == "rare_tokens":
            cap = jnp.floor(self.sentence_share * row_budgets(self.budget, prompt.lengths)).astype(jnp.int32)
            return (clustering.rare_tokens(prompt.tokens, prompt.lengths, cap),), (1.0,)

        def take(mask):
            return jnp.take(mask, prompt.tokens, mode="fill", fill_value=False)

        digits = take(self.number_mask)
        if not self._words:
            return (digits,), (1.0,)
        words = clustering.number_words(digits, take(self.word_start_mask), take(self.delimiter_mask))
        if not self._sentences:
            return (words, digits), (1.0, 1.0)
        sentences = clustering.number_sentences(digits, take(self.sentence_end_mask), prompt.lengths,
                                                self.number_sentences)
        return (sentences | words, words, digits), (self.sentence_share, 1.0, 1.0)

    def _check_masks(self) -> None:
        fix = "build it with SemantiCache.from_tokenizer(tokenizer, ...) or call policy.with_tokenizer(tokenizer)"
        if self._digits and self.number_mask is None:
            raise ValueError(f"SemantiCache(protect={self.protect!r}) needs the tokenizer's digit tokens: {fix}")
        if self._words and self.word_start_mask is None:
            raise ValueError(f"SemantiCache(protect={self.protect!r}) needs the tokenizer's word-start tokens: {fix}")
        if self._sentences and self.sentence_end_mask is None:
            raise ValueError(f"SemantiCache(protect={self.protect!r}) needs the tokenizer's sentence-end tokens: {fix}")
        if (self.chunking == "delimiters" or self._words) and self.delimiter_mask is None:
            raise ValueError(f"SemantiCache(chunking={self.chunking!r}, protect={self.protect!r}) needs the "
                             f"tokenizer's delimiter mask: {fix}")

    def choices(self, cache: KVCache, prompt: Prompt, observations: Any = None) -> tuple[jax.Array, jax.Array]:
        """``(level, tau)`` ``[L, B, H]``: the chunk layout level (0, 1, 2) and the threshold GSC
        ran at, per (layer, row, KV head) — what `compress` decides, for inspection
        (``observations``: this policy's, with ``protect="attended"``)."""
        return self._cluster(cache, prompt, observations)[1]

    def _cluster(self, cache: KVCache, prompt: Prompt,
                 observations: Any = None) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, jax.Array]]:
        self._check_masks()
        if self.keys == "pre_rope" and self.inv_freq is None:
            raise ValueError("SemantiCache(keys='pre_rope') needs the RoPE frequencies: policy.bind(Setup(config)) "
                             "first (generate and sparsekv eval do)")
        if self.protect == "attended" and observations is None:
            raise ValueError("SemantiCache(protect='attended') needs its prefill observations (the observation "
                             "window's attention): run it through generate / sparsekv eval, or pass them")
        T = prompt.tokens.shape[1]
        keep = row_budgets(self.budget, prompt.lengths)
        n_out = min(T, budget_tokens(self.budget, T))
        width, levels = self._width(T), self._levels()
        # "auto": the bound backend's platform decides; a cluster cap runs in jnp (the kernel has none)
        gsc = "jnp" if self.max_cluster_size is not None else dispatch.gsc_method(self.backend, self.gsc, width)
        is_delim = self._is_delim(prompt)[:, :T]
        protect, shares = self._protected(prompt)
        protect = None if protect is None else tuple(p[:, :T] for p in protect)
        per_head = not self.threshold_mode and self.level_rule == "least_lossy"
        # every layout (overflow: fits False); budget mode searches them all and keeps the least lossy per
        # (row, head), threshold mode (and level_rule="finest") the first that fits per row
        *layouts, fits = clustering.candidate_layouts(is_delim, prompt.lengths, keep, self.sinks, self.window,
                                                      width, levels, self.recent_ratio, protect, shares)
        all_kept = layouts[0] | layouts[1]
        first = clustering.first_fitting(fits)  # [B]
        caps = None if self.max_cluster_size is None else merge_protection.fitting_caps(
            all_kept, layouts[2], layouts[3], keep, self.max_cluster_size, width)  # [N, B]
        if not per_head:
            forced, anchor, member, place = (jnp.take_along_axis(x, first[None, :, None], 0)[0] for x in layouts)
            row_level = jnp.asarray(levels, jnp.int32)[first]
            row_cap = None if caps is None else jnp.take_along_axis(caps, first[None], 0)[0]
        per_head_protect = self.protect in merge_protection.PROTECT_PER_HEAD
        if per_head_protect:  # how many per row, among which slots: `merge_protection.plan`
            count, eligible = merge_protection.plan(self.protect, layouts, caps, width, keep, prompt.lengths,
                                                    self.sentence_share, None if per_head else first)
        search = not self.threshold_mode or n_out < T
        top = 1.0 if self.tau is None else float(self.tau)
        inv_freq = None if self.keys == "post_rope" else np.asarray(self.inv_freq)

        def layer(x):
            kv, seen = x
            # a quantised cache's codes are read as their values (float32, exact): the clusters and the
            # merged means are those of the dequantised cache, quantised again by `write_entries`
            k, v = (y[:, :, :T] for y in dequantize_kv(kv, jnp.float32))  # [B, H, T, D]
            pos = kv.positions[:, :, :T]  # [B, H, T]
            content = k.astype(jnp.float32)
            if inv_freq is not None:
                content = clustering.rotate(content, -pos, inv_freq)
            band = clustering.similarity_band(content, width)
            if self.similarity == "keys_values":  # a member's value must be as alike as its key
                band = jnp.minimum(band, clustering.similarity_band(v.astype(jnp.float32), width))
            if per_head_protect:  # a cluster of one each
                band = merge_protection.guard(band, self.protect, seen, content, layouts, eligible, count)
            if per_head:
                back, kept_as_is, choice, tau = clustering.least_lossy_clustering(band, layouts, keep, top,
                                                                                  self.search_steps, gsc, caps)
                level = jnp.asarray(levels, jnp.int32)[choice]
            else:
                kept_as_is = (forced | anchor)[:, None]
                level = jnp.broadcast_to(row_level[:, None], k.shape[:2])
                if search:
                    back, tau = clustering.largest_fitting_clustering(band, member, place, kept_as_is[:, 0], keep,
                                                                      top, self.search_steps, gsc, row_cap)
                else:
                    taus = jnp.full((1, 1) + k.shape[:2], top)
                    back = clustering.clusterings(band, member[None], place[None], taus, gsc,
                                                  None if row_cap is None else row_cap[None])[0, 0]
                    tau = jnp.full(k.shape[:2], top)
            seed_of = jnp.arange(T) - back.astype(jnp.int32)  # members: their seed; others: kept_as_is overrides
            return (clustering.merge_clusters(k, v, pos, content, seed_of, kept_as_is, prompt.lengths, n_out,
                                              inv_freq), (level, tau))

        layers = cache.layers
        kv = LayerKV(k=layers.k, v=layers.v, positions=layers.positions, bias=layers.bias, k_scale=layers.k_scale,
                     k_zero=layers.k_zero, v_scale=layers.v_scale)  # what clustering reads (no page summaries)
        seen = observations if self.protect == "attended" else None
        return jax.lax.map(layer, (kv, seen), batch_size=min(self.layer_batch, layers.k.shape[0]))

    def compress_with_choices(self, cache: KVCache, observations: Any, capacity: int,
                              prompt: Prompt) -> tuple[KVCache, tuple[jax.Array, jax.Array]]:
        """`compress` and `choices` from one clustering."""
        (k, v, pos, bias, counts), chosen = self._cluster(cache, prompt, observations)
        return write_entries(cache, k, v, pos, bias, counts, capacity), chosen

    def compress(self, cache: KVCache, observations: Any, capacity: int, prompt: Prompt) -> KVCache:
        return self.compress_with_choices(cache, observations, capacity, prompt)[0]
