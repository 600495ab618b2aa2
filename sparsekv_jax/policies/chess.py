"""CHESS (context-aware hierarchical efficient semantic selection): which pages each decode step reads.

The paper (arXiv 2602.20732), as implemented here:

* **Page vectors.** A page of ``page_size`` tokens (paper: 32) is represented by the mean of its
  keys, flattened over every layer and KV head (Eq. 1). Chunks are ``chunk_pages`` pages, grids
  ``grid_chunks`` chunks; their vectors are the means of their children's (Eq. 2). Which keys,
  and centring, are choices (below).
* **Anchor and scores.** The anchor is the mean page vector of the recent window (Eq. 3); a unit's
  score is ``anchor · vector`` (Eq. 4). Scores are linear in the vectors, so a chunk's score *is*
  the mean of its pages' scores and a grid's the mean of its chunks': one contraction of the
  anchor with every page's key sum gives all three levels (the paper's single GEMM over the
  coalesced hierarchy, Algorithm 1 lines 2-4), without building chunk/grid vectors.
* **Coarse to fine** (Algorithm 1): keep the top ``ρ_g`` of the grids, then the top ``ρ_c`` of the
  chunks inside kept grids, then the top ``ρ_p`` of the pages inside kept chunks — counts are
  ``ceil(ρ · available)``, so the semantic set is ``≈ ρ_g·ρ_c·ρ_p`` of the context (the paper's
  73% / 40% / 1%). Vectorised with masks and ranks: no data-dependent control flow.
* **Union** with ``sink_pages`` attention-sink pages and the ``window_pages`` most recent pages.
  The page-sparse decode kernel reads exactly those pages of the cache: zero copy, nothing is
  evicted (CHESS saves reads, not memory — as in the paper).
* **Reconstruction.** The selection is kept across steps. After every ``page_size`` generated
  tokens, the mean entropy and the varentropy of that page's next-token distributions are
  compared with thresholds (from ``sparsekv calibrate``: the 99th percentiles on a calibration
  set). Above both (``trigger_on="both"``, default) — Figure 4: "Dashed lines represent the
  selected 99th percentile thresholds. The shaded upper-right region highlights the pruned area,
  corresponding to high-uncertainty outliers" — or above either (``trigger_on="either"``; the
  text, "two complementary uncertainty metrics", names no rule), the selection is rebuilt and,
  with ``regenerate``, the page is thrown away and generated again with the new selection
  (backtracking, at most ``max_backtracks`` times per sequence). ``trigger="interval"`` instead
  rebuilds every ``interval`` pages (the paper's fixed-window comparison, Appendix C; no
  backtracking).
* **The rebuild's anchor** is the window as it stands when the trigger fires, the uncertain page
  included (its keys are read before the page is taken back): "To capture the evolving semantic
  information of the current generation, CHESS constructs a query anchor by aggregating the Key
  states of the recent local window" (Sec. 3.2, Eq. 3), backtracking "dynamically retrieving
  previously pruned information" (Sec. 1). Only the pages that stay (before the taken-back
  tokens) are selected. An anchor at the context's end after the rewind would, on the first
  generated page, be the prompt's end again: the first selection, and greedy decoding would
  regenerate the same page.

Choices where the paper is silent (shown in docs/results/chess_ablation*, experiments/README.md):

* ``chunk_pages=4`` and ``grid_chunks=8`` (a chunk = 128 tokens, a grid = 1024 tokens at page 32):
  at 4k-8k contexts that leaves 4-8 grids, enough for the grid level to prune anything.
* ``sink_pages=1`` (the first 32 tokens hold the usual 4 sink tokens) and ``window_pages=2`` (the
  partial page being written plus the last full one, i.e. 33-64 recent tokens, the question's tail
  at the first step). Sink and window pages are read anyway, so they are not candidates for the
  semantic set (scoring them would spend the budget on pages already read); they do count in the
  chunk/grid means, whose vectors describe content. The window *at the time of a rebuild* belongs
  to the rebuilt context and stays read until the next rebuild, while the live window moves on
  with generation (otherwise the question's last pages would drop out after 64 generated tokens).
* Varentropy is the variance over the page's tokens of the per-token entropy (the paper's
  ``Var(H)_p``, "temporal instability"), not the per-token variance of the surprisal.
* Without a calibration file the thresholds are infinite: the first selection (made right after
  the prompt) is never rebuilt.

Page vectors (which keys, and centring; ``keys`` and ``centred`` below) and how a quantised cache is
read: `sparsekv_jax.policies.chess_scores`. The selection math is in `chess_select`, the trigger and
backtracking in `chess_trigger`, the presets, field checks and calibration files in `chess_config`, and
what CHESS reads of a page pool (``Options(pool=True)``, experimental: the rows' lengths, a layer through its
tables) in `chess_pool`.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import struct

from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache, LayerKV
from sparsekv_jax.models.rope import inverse_frequencies
from sparsekv_jax.pallas import dispatch
from sparsekv_jax.policies import chess_scores, chess_select, chess_trigger
from sparsekv_jax.policies.base import Policy, Selection, Setup
from sparsekv_jax.policies.chess_config import (
    CALIBRATION_DIR,
    KEYS,
    PRESETS,
    TRIGGER_ON,
    TRIGGERS,
    check_fields,
    load_thresholds,
)
from sparsekv_jax.policies.chess_pool import view
from sparsekv_jax.policies.chess_select import hierarchical_select, max_selected, top_fraction
from sparsekv_jax.policies.chess_trigger import uncertain

# the names this module has always exported (tests, benchmarks and scripts import them from here)
__all__ = ["CALIBRATION_DIR", "CHESS", "KEYS", "PRESETS", "TRIGGERS", "TRIGGER_ON", "hierarchical_select",
           "load_thresholds", "max_selected", "top_fraction", "uncertain"]


@struct.dataclass
class CHESS(Policy):
    """CHESS decode-time page selection with uncertainty-triggered reconstruction.

    Args:
      ratios: ``(ρ_g, ρ_c, ρ_p)`` or a preset name: ``conservative`` (0.9, 0.9, 0.9), ``moderate``
        (0.8, 0.7, 0.7), ``aggressive`` (0.5, 0.2, 0.1).
      page_size: CHESS page in tokens (paper: 32); a multiple of the cache's page size.
      chunk_pages, grid_chunks: hierarchy fan-outs (paper: not given; 4 and 8, see module doc).
      sink_pages, window_pages: pages always read at the start and at the end (1 and 2).
      next_pages: also read the ``next_pages`` pages that follow each semantically selected page
        (default 0, the paper). Not in the paper: pages are scored independently, so a needle cut
        by a page boundary loses its second half whenever that page looks like the haystack (the
        cause of CHESS-moderate's RULER niah_single_2 losses at 4k; experiments/diary/RESULTS_DIARY.md). On SmolLM2,
        ``moderate`` with ``next_pages=2`` keeps 99.6-103% of full attention on RULER 4k/8k, reading
        65-76% of the pages; plain CHESS at the same reads keeps 96.5-100%.
      trigger: ``"uncertainty"`` (the paper) or ``"interval"`` (rebuild every ``interval`` pages).
      trigger_on: a page is uncertain when its mean entropy and varentropy pass ``"both"``
        thresholds (default, Figure 4's shaded region) or ``"either"`` (module doc).
      interval: pages between rebuilds for ``trigger="interval"`` (paper's comparison: 6).
      regenerate: on an uncertainty trigger, take the page back and generate it again with the new
        selection (backtracking); ``False`` only rebuilds the selection for the pages that follow
        (the "without regeneration" ablation; name suffix ``no-regen``).
      max_backtracks: regenerations allowed per sequence.
      keys: page vectors from the cached keys rotated back to position 0, ``"pre_rope"`` (default;
        needs `bind`, which `generate` calls), or as stored, ``"post_rope"`` (module doc).
      centred: score against the anchor minus the context's mean page vector (default; module doc).
      inv_freq: RoPE inverse frequencies, set by `bind` for ``keys="pre_rope"``.
      backend: the run's `Backend`, set by `bind`: how the pre-RoPE rebuild sums pages
        (`sparsekv_jax.pallas.dispatch.rope_page_sums`: the Pallas kernel, the keys read in place,
        per device on the backend's mesh, or its jnp reference; `page_sums` says which).
      entropy_threshold, varentropy_threshold: trigger thresholds (leaves; ``inf`` = never).
    """

    ratios: tuple[float, float, float] = struct.field(pytree_node=False, default=PRESETS["moderate"])
    page_size: int = struct.field(pytree_node=False, default=32)
    chunk_pages: int = struct.field(pytree_node=False, default=4)
    grid_chunks: int = struct.field(pytree_node=False, default=8)
    sink_pages: int = struct.field(pytree_node=False, default=1)
    window_pages: int = struct.field(pytree_node=False, default=2)
    next_pages: int = struct.field(pytree_node=False, default=0)
    trigger: str = struct.field(pytree_node=False, default="uncertainty")
    trigger_on: str = struct.field(pytree_node=False, default="both")
    interval: int = struct.field(pytree_node=False, default=6)
    regenerate: bool = struct.field(pytree_node=False, default=True)
    max_backtracks: int = struct.field(pytree_node=False, default=2)
    keys: str = struct.field(pytree_node=False, default="pre_rope")
    centred: bool = struct.field(pytree_node=False, default=True)
    inv_freq: tuple[float, ...] | None = struct.field(pytree_node=False, default=None)
    backend: Backend | None = struct.field(pytree_node=False, default=None)
    entropy_threshold: Any = float("inf")
    varentropy_threshold: Any = float("inf")

    def __post_init__(self) -> None:
        check_fields(self)  # `chess_config.check_fields`: a preset name becomes its ratios

    # -- construction helpers ------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, **kwargs: Any) -> CHESS:
        return cls(ratios=name, **kwargs)

    @classmethod
    def covering(cls) -> CHESS:
        return cls(ratios=(1.0, 1.0, 1.0))

    @classmethod
    def conservative(cls, **kwargs: Any) -> CHESS:
        return cls(ratios="conservative", **kwargs)

    @classmethod
    def moderate(cls, **kwargs: Any) -> CHESS:
        return cls(ratios="moderate", **kwargs)

    @classmethod
    def aggressive(cls, **kwargs: Any) -> CHESS:
        return cls(ratios="aggressive", **kwargs)

    @classmethod
    def from_spec(cls, ratios: str | tuple = "moderate", calibration: str | None = None, **kwargs: Any) -> CHESS:
        """``chess('aggressive', calibration='smollm2')`` in policy specs: thresholds from a
        `sparsekv calibrate` JSON file (a path, or the name of one shipped in ``calibration/``)."""
        if calibration is not None:
            kwargs = {**load_thresholds(calibration), **kwargs}
        return cls(ratios=ratios, **kwargs)

    stages = ("decode",)

    def bind(self, setup: Setup) -> CHESS:
        if self.page_size % setup.page_size:
            raise ValueError(f"CHESS page_size={self.page_size} is not a multiple of the cache "
                             f"page_size={setup.page_size}")
        if self.keys != "pre_rope":
            return self
        return self.replace(inv_freq=tuple(float(f) for f in inverse_frequencies(setup.config)),
                            backend=setup.backend)

    @property
    def page_sums(self) -> str:
        """How the pre-RoPE rebuild sums pages: ``"pallas"`` (`rope_page_sums`) or ``"jnp"``
        (`sparsekv_jax.pallas.dispatch.rope_page_sums_method` of the bound backend; ``"jnp"`` unbound)."""
        if self.inv_freq is None or self.backend is None:
            return "jnp"
        return dispatch.rope_page_sums_method(self.backend, 2 * len(self.inv_freq))

    @property
    def name(self) -> str:
        names = {v: k for k, v in PRESETS.items()}
        uncertainty = self.trigger == "uncertainty"
        variant = [v for v, on in (("post-RoPE", self.keys == "post_rope"), ("uncentred", not self.centred),
                                   (f"next={self.next_pages}", self.next_pages > 0),
                                   (f"interval={self.interval}", not uncertainty),
                                   ("either", uncertainty and self.trigger_on == "either"),
                                   ("no-regen", uncertainty and not self.regenerate)) if on]
        return f"CHESS-{names.get(self.ratios, '-'.join(map(str, self.ratios)))}" + (
            f"[{', '.join(variant)}]" if variant else "")

    @property
    def max_rewind_tokens(self) -> int:
        # a selection of every page has nothing to rebuild: a regenerated page would come out the same
        regenerates = self.trigger == "uncertainty" and self.regenerate and not self.exact
        return self.max_backtracks * self.page_size if regenerates else 0

    @property
    def exact(self) -> bool:
        return self.ratios == (1.0, 1.0, 1.0)

    @property
    def page_summaries(self) -> frozenset[str]:  # type: ignore[override]
        """Post-RoPE page vectors are the cache's page sums; pre-RoPE ones are rebuilt from the keys."""
        return frozenset({"page_sum"}) if self.keys == "post_rope" else frozenset()

    # -- selection (`chess_scores`, `chess_select`) ------------------------------------
    def _page_scores(self, cache: KVCache, anchor_end: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Scores ``[B, P]`` of CHESS pages against the anchor of the window ending at slot
        ``anchor_end`` ``[B]``, and the pages in use ``[B, P]``."""
        return chess_scores.page_scores(self, cache, anchor_end)

    def select_pages(self, cache: KVCache, anchor_end: jax.Array) -> jax.Array:
        """``[B, P]`` the context rebuilt for the window ending at ``anchor_end``: the semantic
        selection plus that moment's sink and window pages (they stay read until the next rebuild,
        so e.g. the question's pages do not drop out once generation moves the window on)."""
        return chess_select.select_pages(self, view(cache), anchor_end)

    def _used(self, length: jax.Array) -> jax.Array:
        """``[B]`` CHESS pages in use by a cache of ``length`` slots (what `_forced` depends on)."""
        return chess_select.used_pages(self, length)

    def _forced(self, length: jax.Array, P: int) -> jax.Array:
        """``[B, P]`` sink and window pages for a cache of ``length`` slots."""
        return chess_select.forced_pages(self, length, P)

    def _page_list(self, selected: jax.Array, length: jax.Array, cache: KVCache) -> tuple[jax.Array, jax.Array]:
        """Cache-page lists ``[B, H, K]`` and counts ``[B, H]`` for a step at ``length`` slots."""
        return chess_select.page_list(self, selected, length, cache)

    def page_list(self, selected: jax.Array, length: jax.Array, cache: KVCache) -> tuple[jax.Array, jax.Array]:
        """Cache-page lists ``[B, H, K]`` and counts ``[B, H]`` that a decode step at ``length`` slots
        reads for the CHESS pages ``selected`` ``[B, P]`` (with the sink and window pages forced in):
        the page-list rebuild `sparsekv_jax.bench.chess` times."""
        return self._page_list(selected, length, view(cache))

    # -- decode stages (`chess_trigger`) --------------------------------------------------
    def decode_init(self, cache: KVCache, observations: Any) -> tuple[Any, Any]:
        # a page pool (`Options(pool=True)`, experimental) is read through its tables: `chess_pool`
        return None, chess_trigger.init_state(self, view(cache))

    def decode_select(self, q: jax.Array, kv: LayerKV, length: jax.Array, layer_state: Any, shared_state: Any,
                      layer_index: jax.Array, page_size: int) -> Selection:
        if self.exact:
            return None
        return shared_state["ids"], shared_state["counts"]

    def decode_update(self, shared_state: Any, cache: KVCache, logits: jax.Array) -> Any:
        return chess_trigger.update_state(self, shared_state, view(cache), logits)

    def decode_rewind(self, shared_state: Any) -> jax.Array | None:
        return shared_state["rewind"] if self.max_rewind_tokens else None

    def decode_stats(self, shared_state: Any) -> dict[str, jax.Array]:
        """Per row: ``reselections`` (rebuilds), ``backtracks`` (pages taken back) and
        ``changed_backtracks`` (regenerated pages that completed unlike the page they replaced; the
        tokens compared are the greedy choices, the decoded tokens under greedy decoding)."""
        return {k: shared_state[k] for k in ("reselections", "backtracks", "changed_backtracks")}
