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

Page vectors: which keys, and centring (the paper says only that "Key states inherently encode
the semantic attributes of the input tokens"; docs/results/chess_needle_ranks_4k.json):

* ``keys="pre_rope"`` (default): each cached key is rotated back by its own position before the
  page means, so a page vector is the page's *content*. The literal reading, the keys as the cache
  stores them (``keys="post_rope"``), carries RoPE's phase: anchor · page is then dominated by how
  close a page sits to the window (on SmolLM2 at 4k the needle's page ranked 28-124 of 125 for its
  question, and `moderate` answered 1 of 4 single needles). The cache's incremental page sums are
  post-RoPE, so a pre-RoPE rebuild reads every cached key once, one layer at a time. Where a
  page's positions are consecutive (any cache that was not compressed), R(-(p0+j)) = R(-p0)·R(-j):
  each key is turned by its slot in the page with a fixed table and summed (the Pallas
  `rope_page_sums` on a GPU, reading the layer in place), then each page sum by its first
  position (experiments/diary/BENCHMARKS_DIARY.md, "CHESS decode speed", has the rebuild's time); compressed layers
  rotate key by key. Rebuilds are rare and the per-step page list is the same either way.
  ``post_rope`` reads only the page sums (3.4 ms).
* ``centred=True`` (default; not in the paper): keys share a large common component, so every
  page scores high against any anchor; subtracting the context's mean page vector from page
  vectors and anchor alike scores what distinguishes a page (pre-RoPE alone ranked the needle's
  page no better than post-RoPE; pre-RoPE + centred ranked it second of 125, behind only the
  haystack's instructions page, on 4 of 4 prompts).
  ``(v - mu)·(a - mu) = v·(a - mu) - const``: it moves the anchor, the sums stay, it costs nothing.
* ``CHESS(keys="post_rope", centred=False)`` is the paper taken literally, kept for comparison.

On a quantised cache (``Backend(kv_dtype="int8" | "float8_e4m3fn")``, `sparsekv_jax.cache`) the keys
CHESS reads are the codes' values (`sparsekv_jax.cache.dequantize_kv`: exact in bf16): a pre-RoPE
rebuild dequantises one layer at a time and sums it as above (a one-layer copy, as the jnp path's
slice of an unquantised layer); the post-RoPE page sums were written from the keys before
quantisation, and the keys taken back at the edge page are subtracted dequantised.
"""

from __future__ import annotations

import functools
import json
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache, LayerKV, dequantize, dequantize_kv, layer_view, page_counts
from sparsekv_jax.models.rope import inverse_frequencies
from sparsekv_jax.pallas import dispatch
from sparsekv_jax.policies.base import Policy, Selection, Setup
from sparsekv_jax.policies.common import entropy_stats, pages_to_list

PRESETS = {"conservative": (0.9, 0.9, 0.9), "moderate": (0.8, 0.7, 0.7), "aggressive": (0.5, 0.2, 0.1)}
TRIGGERS = ("uncertainty", "interval")
TRIGGER_ON = ("both", "either")
KEYS = ("post_rope", "pre_rope")
CALIBRATION_DIR = os.path.join(os.path.dirname(__file__), "calibration")


def _ceil_count(ratio: float, n: jax.Array) -> jax.Array:
    # 0.7 * 10 is 7.000000000000001 in floating point: the epsilon keeps ceil from taking 8
    return jnp.ceil(ratio * n.astype(jnp.float32) - 1e-4).astype(jnp.int32)


def uncertain(mean_entropy: jax.Array, varentropy: jax.Array, entropy_threshold: Any, varentropy_threshold: Any,
              trigger_on: str) -> jax.Array:
    """``[B]`` bool: a page is uncertain when its mean entropy and its varentropy are strictly
    above their thresholds, ``"both"`` of them or ``"either"``."""
    high_h, high_v = mean_entropy > entropy_threshold, varentropy > varentropy_threshold
    return (high_h & high_v) if trigger_on == "both" else (high_h | high_v)


def top_fraction(scores: jax.Array, available: jax.Array, ratio: float) -> jax.Array:
    """``[B, N]`` bool: the ``ceil(ratio · #available)`` best-scored available units of each row."""
    k = _ceil_count(ratio, available.sum(-1))
    order = jnp.argsort(jnp.where(available, -scores, jnp.inf), axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1, stable=True)  # position of each unit in the ranking
    return available & (rank < k[:, None])


def hierarchical_select(page_scores: jax.Array, in_use: jax.Array, candidate: jax.Array,
                        ratios: tuple[float, float, float], chunk_pages: int, grid_chunks: int) -> jax.Array:
    """Algorithm 1: ``[B, P]`` bool mask of the pages kept by grid → chunk → page selection.

    ``page_scores`` ``[B, P]`` anchor · page vector; ``in_use`` pages holding tokens (their scores
    make up the chunk/grid means); ``candidate`` pages that may be selected.
    """
    B, P = page_scores.shape
    per_grid = chunk_pages * grid_chunks
    pad = -P % per_grid
    s, used, cand = (jnp.pad(x, ((0, 0), (0, pad))) for x in (page_scores.astype(jnp.float32), in_use, candidate))
    C, G = (P + pad) // chunk_pages, (P + pad) // per_grid
    rho_g, rho_c, rho_p = ratios

    def mean_of_children(x, present, n):  # [B, M*n] → [B, M] means over present children
        cnt = present.reshape(B, -1, n).sum(-1)
        return jnp.where(present, x, 0.0).reshape(B, -1, n).sum(-1) / jnp.maximum(cnt, 1), cnt > 0

    s_chunk, chunk_used = mean_of_children(s, used, chunk_pages)
    s_grid, _ = mean_of_children(s_chunk, chunk_used, grid_chunks)
    cand_chunk = cand.reshape(B, C, chunk_pages).any(-1)
    cand_grid = cand_chunk.reshape(B, G, grid_chunks).any(-1)
    keep_grid = top_fraction(s_grid, cand_grid, rho_g)
    keep_chunk = top_fraction(s_chunk, cand_chunk & jnp.repeat(keep_grid, grid_chunks, axis=1), rho_c)
    keep_page = top_fraction(s, cand & jnp.repeat(keep_chunk, chunk_pages, axis=1), rho_p)
    return keep_page[:, :P]


def max_selected(num_pages: int, ratios: tuple[float, float, float], chunk_pages: int, grid_chunks: int) -> int:
    """Static upper bound of `hierarchical_select`'s kept pages for ``num_pages`` pages."""
    rho_g, rho_c, rho_p = ratios
    grids = -(-num_pages // (chunk_pages * grid_chunks))
    k_g = math.ceil(rho_g * grids - 1e-4)
    k_c = math.ceil(rho_c * min(k_g * grid_chunks, -(-num_pages // chunk_pages)) - 1e-4)
    return min(num_pages, math.ceil(rho_p * min(k_c * chunk_pages, num_pages) - 1e-4))


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
        if isinstance(self.ratios, str):
            if self.ratios not in PRESETS:
                raise ValueError(f"ratios={self.ratios!r}: unknown preset; choose from {', '.join(PRESETS)}")
            object.__setattr__(self, "ratios", PRESETS[self.ratios])
        ratios = tuple(float(r) for r in self.ratios) if isinstance(self.ratios, (tuple, list)) else None
        if ratios is None or len(ratios) != 3 or not all(0.0 < r <= 1.0 for r in ratios):
            raise ValueError(f"ratios={self.ratios!r} must be three fractions in (0, 1] (ρ_g, ρ_c, ρ_p)")
        object.__setattr__(self, "ratios", ratios)
        for name in ("page_size", "chunk_pages", "grid_chunks", "interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be a positive int")
        if self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size={self.page_size} must be a power of two")
        for name in ("sink_pages", "window_pages", "max_backtracks", "next_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an int >= 0")
        if self.window_pages < 1:
            raise ValueError(f"window_pages={self.window_pages} must be >= 1 (the anchor is the window's mean)")
        if self.keys not in KEYS:
            raise ValueError(f"keys={self.keys!r} must be one of {KEYS}")
        if not isinstance(self.centred, bool):
            raise ValueError(f"centred={self.centred!r} must be a bool")
        if self.trigger not in TRIGGERS:
            raise ValueError(f"trigger={self.trigger!r} must be one of {TRIGGERS}")
        if self.trigger_on not in TRIGGER_ON:
            raise ValueError(f"trigger_on={self.trigger_on!r} must be one of {TRIGGER_ON}")
        if not isinstance(self.regenerate, bool):
            raise ValueError(f"regenerate={self.regenerate!r} must be a bool")
        for name in ("entropy_threshold", "varentropy_threshold"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not value >= 0:
                raise ValueError(f"{name}={value} must be >= 0")

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

    # -- selection -----------------------------------------------------------------------
    def _page_scores(self, cache: KVCache, anchor_end: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Scores ``[B, P]`` of CHESS pages against the anchor of the window ending at slot
        ``anchor_end`` ``[B]``, and the pages in use ``[B, P]``."""
        Pc, cps = cache.num_pages, cache.page_size
        B = cache.batch
        m = self.page_size // cps
        P = -(-Pc // m)  # the last CHESS page may stand past the cache's end: pad per-page values, not sums
        live_tokens = page_counts(anchor_end, Pc, cps)  # [B, Pc] slots before anchor_end
        tokens = jnp.pad(live_tokens, ((0, 0), (0, P * m - Pc))).reshape(B, P, m).sum(-1)  # [B, P]
        in_use = tokens > 0
        page = jnp.arange(P)
        last = (anchor_end - 1) // self.page_size
        in_window = (page[None] <= last[:, None]) & (page[None] > last[:, None] - self.window_pages) & in_use
        # A page vector is its key sum / its tokens, so every score is a weighted sum of page sums:
        # the anchor (mean of the window's page vectors) is sum_p w_p * sum_p.
        w = jnp.where(in_window, 1.0 / jnp.maximum(tokens, 1), 0.0) / jnp.maximum(in_window.sum(-1, keepdims=True), 1)
        if self.centred:
            # (v_p - mu)·(a - mu) = v_p·(a - mu) - a row constant: centring only moves the anchor
            w = w - jnp.where(in_use, 1.0 / jnp.maximum(tokens, 1), 0.0) / jnp.maximum(in_use.sum(-1, keepdims=True), 1)
        if self.keys == "pre_rope":
            dots = self._pre_rope_dots(cache, anchor_end, w)
        else:
            dots = self._post_rope_dots(cache, anchor_end, w, live_tokens)
        return dots / jnp.maximum(tokens, 1), in_use

    def _post_rope_dots(self, cache: KVCache, anchor_end: jax.Array, w: jax.Array,
                        live_tokens: jax.Array) -> jax.Array:
        """``[B, P]`` page key sums · (sum_p w_p · page sum), from the cache's page sums (no key read)."""
        page_sum = cache.layers.page_sum  # [L, B, H, Pc, D] fp32 sums of keys per cache page
        if page_sum is None:
            raise ValueError("CHESS(keys='post_rope') reads the cache's page_sum, which this cache does not hold "
                             "(build it with init_cache(summaries=policy.page_summaries))")
        B, Pc, cps = cache.batch, cache.num_pages, cache.page_size
        m = self.page_size // cps
        P = w.shape[1]
        # Keys past anchor_end may still sit in the cache (a page being taken back for
        # regeneration): cache pages wholly past it are left out, and the sum of the page holding
        # slot anchor_end - 1 loses its stale keys. Scores are linear in the sums, so the
        # correction is applied to the anchor and to that page's dot.
        live = live_tokens > 0  # [B, Pc]
        w_cache = jnp.repeat(w, m, axis=1)[:, :Pc] * live  # [B, Pc] weight of each cache page's sum
        edge = jnp.maximum(anchor_end - 1, 0) // cps  # [B]
        slots = edge[:, None] * cps + jnp.arange(cps)  # [B, cps]
        keys = jnp.take_along_axis(cache.layers.k, slots[None, :, None, :, None], axis=3)  # [L, B, H, cps, D]
        if cache.layers.quantized:  # codes: their values with the edge page's scales (one page per row)
            keys = dequantize(keys, jnp.take_along_axis(cache.layers.k_scale, edge[None, :, None, None, None], axis=3))
        # keys at or past the cache's length were never summed (their slots may hold garbage)
        stale = ((slots >= anchor_end[:, None]) & (slots < cache.length[:, None]))[None, :, None, :, None]
        extra = jnp.where(stale, keys.astype(jnp.float32), 0.0).sum(3)  # [L, B, H, D]
        at_edge = jnp.arange(Pc)[None] == edge[:, None]  # [B, Pc]
        anchor = jnp.einsum("lbhpd,bp->lbhd", page_sum, w_cache)
        anchor = anchor - extra * (w_cache * at_edge).sum(-1)[None, :, None, None]
        # one contraction with every page sum: the scores of all pages (chunks, grids = their means)
        dots = jnp.einsum("lbhpd,lbhd->bp", page_sum, anchor)
        dots = jnp.where(live, dots - at_edge * jnp.einsum("lbhd,lbhd->b", extra, anchor)[:, None], 0.0)
        return jnp.pad(dots, ((0, 0), (0, P * m - Pc))).reshape(B, P, m).sum(-1)

    def _pre_rope_dots(self, cache: KVCache, anchor_end: jax.Array, w: jax.Array) -> jax.Array:
        """As `_post_rope_dots` on keys rotated back to position 0 (the content, without RoPE's
        position phase): reads every cached key once per rebuild, one layer at a time."""
        if self.inv_freq is None:
            raise ValueError("CHESS(keys='pre_rope') needs the model's RoPE frequencies: call "
                             "policy.bind(Setup(params.config)) first (generate and sparsekv eval do)")
        L, B, H, S, D = cache.layers.k.shape
        if 2 * len(self.inv_freq) != D:
            raise ValueError(f"CHESS inv_freq has {len(self.inv_freq)} frequencies, the cache's head_dim is {D}")
        P, ps = w.shape[1], self.page_size
        inv_freq = jnp.asarray(np.asarray(self.inv_freq), jnp.float32)
        k_all, pos_all = cache.layers.k, cache.layers.positions  # [L, B, H, S, D], [L, B, H, S]
        quantized = cache.layers.quantized
        pad = P * ps - S

        def paged(x):  # [L, B, H, S, ...] → [L, B, H, P, ps, ...] (a copy only when S % ps)
            x = jnp.pad(x, ((0, 0),) * 3 + ((0, pad),) + ((0, 0),) * (x.ndim - 4)) if pad else x
            return x.reshape(x.shape[0], B, H, P, ps, *x.shape[4:])

        def rotate_back(x1, x2, angle):  # R(-angle) of the pair halves (RoPE's rotate-half layout)
            cos, sin = jnp.cos(angle), jnp.sin(angle)
            return x1 * cos + x2 * sin, x2 * cos - x1 * sin

        def token_sums(k, pos, mask):  # [..., n, D] keys → [..., D] sum of the masked ones rotated back
            k1, k2 = jnp.split(k.astype(jnp.float32), 2, axis=-1)
            r1, r2 = rotate_back(k1, k2, pos.astype(jnp.float32)[..., None] * inv_freq)
            return jnp.where(mask[..., None], jnp.concatenate([r1, r2], axis=-1), 0.0).sum(-2)

        slot_live = (jnp.arange(S)[None] < anchor_end[:, None])[None, :, None]  # [1, B, 1, S]
        edge = jnp.maximum(anchor_end - 1, 0) // ps  # [B] the page holding the window's last slot
        at_edge = (jnp.arange(P)[None] == edge[:, None])[None, :, None]  # [1, B, 1, P]
        edge_slots = edge[:, None] * ps + jnp.arange(ps)  # [B, ps]
        edge_live = (edge_slots < jnp.minimum(anchor_end, S)[:, None])[None, :, None]  # [1, B, 1, ps]
        # the kernel (per device on a mesh) or its reference, as the bound backend says
        backend = self.backend if self.backend is not None else Backend(page_sums="jnp")
        page_sums = functools.partial(dispatch.rope_page_sums, backend, page_size=ps)
        # Per layer (the cache read by layer index), two exact ways to the pages' sums of un-rotated
        # keys. Fast, when every page's live positions are consecutive (p0, p0+1, ...) and only the
        # edge page is partly live — every layer that was not compressed: R(-(p0+j)) = R(-p0)·R(-j),
        # so a page's sum is R(-p0) applied to sum_j R(-j)·k_j (`rope_page_sums`: the keys read once
        # in place, a fixed table of the slots' angles) and a rotation per page; the edge
        # page (slots past anchor_end may hold stale keys) key by key. Otherwise (per-head or
        # per-layer compression) every key is rotated back by its own position: B·H·S·D/2 sines
        # and cosines per layer, 20x slower at 32k x 22 on an H200.

        def layer_sums(layer):  # → [B, H, P, D]
            pos = jax.lax.dynamic_index_in_dim(pos_all, layer, keepdims=False)[None]  # [1, B, H, S] (small)
            # A quantised cache's keys are codes: the layer is dequantised once (`dequantize_kv`; exact in
            # bf16, the scales being powers of two) and read as a one-layer stack by both paths below
            keys_of, in_stack = ((k_all, layer) if not quantized else
                                 (dequantize_kv(layer_view(cache.layers, layer), jnp.bfloat16)[0][None], 0))
            mask = paged(slot_live & (pos >= 0))  # [1, B, H, P, ps]
            pos_paged = paged(pos)
            consecutive = jnp.all(~mask | (pos_paged == pos_paged[..., :1] + jnp.arange(ps)))
            partial = mask.any(-1) & ~mask.all(-1)

            def by_pages():
                # the keys read in place from the stack (a jnp slice of the layer would be a copy)
                sums = page_sums(keys_of, self.inv_freq, in_stack)[None]  # [1, B, H, P, D]: sum_j R(-j)·k_j
                base = pos_paged[..., 0, None].astype(jnp.float32) * inv_freq  # [1, B, H, P, D/2]
                s1, s2 = rotate_back(*jnp.split(sums, 2, axis=-1), base)
                sums = jnp.where(mask.all(-1)[..., None], jnp.concatenate([s1, s2], axis=-1), 0.0)
                slots = jnp.minimum(edge_slots, S - 1)[:, None, :]  # [B, 1, ps]
                keys = keys_of[in_stack, jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None], slots][None]
                at = jnp.take_along_axis(pos, slots[None], axis=3)  # [1, B, H, ps]
                edge_sum = token_sums(keys, at, edge_live & (at >= 0))  # [1, B, H, D]
                return jnp.where(at_edge[..., None], edge_sum[:, :, :, None], sums)[0]

            def by_tokens():
                k = jax.lax.dynamic_index_in_dim(keys_of, in_stack, keepdims=True)  # [1, B, H, S, D]
                return token_sums(paged(k), pos_paged, mask)[0]

            return jax.lax.cond(consecutive & ~jnp.any(partial & ~at_edge), by_pages, by_tokens)

        sums = jax.lax.map(layer_sums, jnp.arange(L))  # [L, B, H, P, D]
        anchor = jnp.einsum("lbhpd,bp->lbhd", sums, w)
        return jnp.einsum("lbhpd,lbhd->bp", sums, anchor)

    def select_pages(self, cache: KVCache, anchor_end: jax.Array) -> jax.Array:
        """``[B, P]`` the context rebuilt for the window ending at ``anchor_end``: the semantic
        selection plus that moment's sink and window pages (they stay read until the next rebuild,
        so e.g. the question's pages do not drop out once generation moves the window on)."""
        scores, in_use = self._page_scores(cache, anchor_end)
        forced = self._forced(anchor_end, in_use.shape[1])
        semantic = hierarchical_select(scores, in_use, in_use & ~forced, self.ratios, self.chunk_pages,
                                       self.grid_chunks)
        following = semantic
        for shift in range(1, self.next_pages + 1):  # static, small: the pages after each kept one
            following = following | jnp.pad(semantic, ((0, 0), (shift, 0)))[:, :semantic.shape[1]]
        return (following & in_use) | forced

    def _used(self, length: jax.Array) -> jax.Array:
        """``[B]`` CHESS pages in use by a cache of ``length`` slots (what `_forced` depends on)."""
        return -(-length // self.page_size)

    def _forced(self, length: jax.Array, P: int) -> jax.Array:
        """``[B, P]`` sink and window pages for a cache of ``length`` slots."""
        page = jnp.arange(P)[None]
        used = self._used(length)[:, None]
        return (page < jnp.minimum(self.sink_pages, used)) | ((page >= used - self.window_pages) & (page < used))

    def _page_list(self, selected: jax.Array, length: jax.Array, cache: KVCache) -> tuple[jax.Array, jax.Array]:
        """Cache-page lists ``[B, H, K]`` and counts ``[B, H]`` for a step at ``length`` slots."""
        B, P = selected.shape
        H, Pc = cache.layers.k.shape[2], cache.num_pages
        m = self.page_size // cache.page_size
        read = selected | self._forced(length, P)
        K = min(P, max_selected(P, self.ratios, self.chunk_pages, self.grid_chunks) * (1 + self.next_pages)
                + self.sink_pages + 2 * self.window_pages)  # the rebuild's window + the current one
        ids, counts = pages_to_list(read, K)
        if m > 1:  # CHESS pages → the cache's pages (ascending, so pages past the cache's end come last)
            ids = (ids[..., None] * m + jnp.arange(m)).reshape(B, K * m)
            counts = ((jnp.arange(K * m) < counts[:, None] * m) & (ids < Pc)).sum(-1)
            ids = jnp.minimum(ids, Pc - 1)
        return (jnp.broadcast_to(ids[:, None], (B, H, ids.shape[-1])).astype(jnp.int32),
                jnp.broadcast_to(counts[:, None], (B, H)).astype(jnp.int32))

    def page_list(self, selected: jax.Array, length: jax.Array, cache: KVCache) -> tuple[jax.Array, jax.Array]:
        """Cache-page lists ``[B, H, K]`` and counts ``[B, H]`` that a decode step at ``length`` slots
        reads for the CHESS pages ``selected`` ``[B, P]`` (with the sink and window pages forced in):
        the page-list rebuild `sparsekv_jax.bench.chess` times."""
        return self._page_list(selected, length, cache)

    # -- decode stages -------------------------------------------------------------------
    def decode_init(self, cache: KVCache, observations: Any) -> tuple[Any, Any]:
        B = cache.batch
        selected = self.select_pages(cache, cache.length)
        ids, counts = self._page_list(selected, cache.length + 1, cache)
        # distinct buffers (a donated state may not hold one array twice)
        shared = {"selected": selected, "ids": ids, "counts": counts, "used": self._used(cache.length + 1),
                  **{k: jnp.zeros((B,), jnp.float32) for k in ("ent_sum", "ent_sq")},
                  **{k: jnp.zeros((B,), jnp.int32) for k in ("in_page", "pages", "reselections", "backtracks",
                                                             "changed_backtracks", "rewind")},
                  # the page's greedy tokens, and those of the page last taken back (compared once
                  # its regeneration completes: `pending`)
                  **{k: jnp.zeros((B, self.page_size), jnp.int32) for k in ("page_tokens", "replaced")},
                  "pending": jnp.zeros((B,), bool)}
        return None, shared

    def decode_select(self, q: jax.Array, kv: LayerKV, length: jax.Array, layer_state: Any, shared_state: Any,
                      layer_index: jax.Array, page_size: int) -> Selection:
        if self.exact:
            return None
        return shared_state["ids"], shared_state["counts"]

    def decode_update(self, shared_state: Any, cache: KVCache, logits: jax.Array) -> Any:
        st = dict(shared_state)
        h = entropy_stats(logits)
        slot = jnp.arange(self.page_size)[None] == st["in_page"][:, None]  # [B, ps] this token's place
        st["page_tokens"] = jnp.where(slot, jnp.argmax(logits, axis=-1)[:, None].astype(jnp.int32),
                                      st["page_tokens"])
        st["ent_sum"] = st["ent_sum"] + h
        st["ent_sq"] = st["ent_sq"] + h * h
        st["in_page"] = st["in_page"] + 1
        page_done = st["in_page"] >= self.page_size
        st["pages"] = st["pages"] + page_done
        n = jnp.maximum(st["in_page"], 1).astype(jnp.float32)
        mean = st["ent_sum"] / n
        varent = jnp.maximum(st["ent_sq"] / n - mean * mean, 0.0)
        if self.trigger == "uncertainty":
            fire = page_done & uncertain(mean, varent, self.entropy_threshold, self.varentropy_threshold,
                                         self.trigger_on)
            back = fire & (st["backtracks"] < self.max_backtracks) if self.regenerate else jnp.zeros_like(fire)
        else:
            fire = page_done & (st["pages"] % self.interval == 0)
            back = jnp.zeros_like(fire)
        rewind = jnp.where(back, self.page_size, 0).astype(jnp.int32)
        length = cache.length - rewind  # what the cache holds once the page is taken back
        st["reselections"] = st["reselections"] + fire
        st["backtracks"] = st["backtracks"] + back
        st["rewind"] = rewind
        # a regenerated page that completes: did it come out unlike the one it replaced?
        differs = (st["page_tokens"] != st["replaced"]).any(-1)
        st["changed_backtracks"] = st["changed_backtracks"] + (page_done & st["pending"] & differs)
        st["pending"] = jnp.where(page_done, back, st["pending"])
        st["replaced"] = jnp.where(back[:, None], st["page_tokens"], st["replaced"])
        for key in ("ent_sum", "ent_sq", "in_page"):
            st[key] = jnp.where(page_done, jnp.zeros_like(st[key]), st[key])
        # The page list is a function of the selection and of the pages in use (sinks and window):
        # rebuilt only when one of them changed for some row (a page starts, a rebuild, a rewind),
        # not every step (its sort and scatter cost ~0.3 ms at 32k x 11 on an H100, 4% of a step).
        # The selection is rebuilt only when some row fired (it reads every key); that cond sits
        # inside the first, so a step inside a page runs one conditional, not two (each costs the
        # GPU a round trip of its predicate to the host).
        used = self._used(length + 1)
        changed = fire.any() | (used != st["used"]).any()

        def rebuild():
            # the anchor is the window as it stands, the uncertain page included (module doc). A row
            # taking its page back keeps only the pages that stay, plus the window of the context it
            # regenerates from, read until the next rebuild (as `select_pages` keeps its window)
            P = st["selected"].shape[1]
            stays = jnp.arange(P)[None] < self._used(length)[:, None]
            return (self.select_pages(cache, cache.length) & stays) | (self._forced(length, P) & back[:, None])

        def refresh():
            rebuilt = jax.lax.cond(fire.any(), rebuild, lambda: st["selected"])
            selected = jnp.where(fire[:, None], rebuilt, st["selected"])
            return (selected, *self._page_list(selected, length + 1, cache))

        st["selected"], st["ids"], st["counts"] = jax.lax.cond(
            changed, refresh, lambda: (st["selected"], st["ids"], st["counts"]))
        st["used"] = used
        return st

    def decode_rewind(self, shared_state: Any) -> jax.Array | None:
        return shared_state["rewind"] if self.max_rewind_tokens else None

    def decode_stats(self, shared_state: Any) -> dict[str, jax.Array]:
        """Per row: ``reselections`` (rebuilds), ``backtracks`` (pages taken back) and
        ``changed_backtracks`` (regenerated pages that completed unlike the page they replaced; the
        tokens compared are the greedy choices, the decoded tokens under greedy decoding)."""
        return {k: shared_state[k] for k in ("reselections", "backtracks", "changed_backtracks")}


def load_thresholds(calibration: str) -> dict[str, float]:
    """``{"entropy_threshold", "varentropy_threshold"}`` from a `sparsekv calibrate` JSON file."""
    path = calibration
    if not os.path.exists(path):
        shipped = os.path.join(CALIBRATION_DIR, f"{calibration}.json")
        if not os.path.exists(shipped):
            raise ValueError(f"calibration={calibration!r}: no such file, and no shipped calibration of that name")
        path = shipped
    with open(path) as f:
        data = json.load(f)
    try:
        return {"entropy_threshold": float(data["entropy_threshold"]),
                "varentropy_threshold": float(data["varentropy_threshold"])}
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"calibration file {path} lacks entropy_threshold/varentropy_threshold: {e}") from None
