"""SemantiCache's compress step (`sparsekv_jax.policies.semanticache`): per layer, the keys GSC
compares and their similarity band, the chunk layout and threshold each (row, KV head) clusters at,
and the merged entries. It orders the mechanics of `policies/clustering.py` (layouts, GSC, the
threshold search, the merge); the cache write is `common.write_entries`.

Choices where the paper is silent (docs/SEMANTICACHE.md shows them in ablations):

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
* **Budget mode** (``tau=None``): per (layer, row, KV head) the *largest* ``tau`` whose clusters fit
  the budget: a pass of ``search_steps`` thresholds log-spaced below the top
  (`clustering.search_grid`), then a linear pass between the last that did not fit and the first
  that did; each pass evaluates all its thresholds at once. The search runs on three chunk layouts —
  the paper's (delimiters are anchors; level 0), clauses (a run of words and the delimiters closing
  it, no anchors; level 1) and ``chunk_size`` blocks (level 2) — and each (layer, row, KV head)
  keeps the layout whose search reaches the **highest threshold** (ties: the finer layout): the
  least lossy merge, since every member of a cluster has at least that cosine with its seed. A
  layout whose one-cluster-per-chunk clustering overflows the budget reaches nothing. Each layout's
  threshold never falls when the budget grows, so neither does the chosen one.
  (``level_rule="finest"``: the previous rule, per row the first layout that fits; its threshold
  *fell* as the budget grew — a larger budget admits the paper's layout with little room to spare —
  and RULER's score with it: docs/SEMANTICACHE.md.) The kept count never exceeds the budget.
  `SemantiCache.choices` reports level and threshold.
* **Threshold mode** (``tau=x``): GSC at ``x`` on the paper's layout (the paper's algorithm); where
  its one cluster per chunk would overflow ``budget`` (a cap: the static cache capacity), the row
  uses the first coarser layout that fits; heads that would keep more merge at the largest lower
  threshold that fits.
  ``SemantiCache(budget=1.0, tau=x)`` is the paper's pure threshold (room for the whole prompt).
* **Quantised caches** (``Backend(kv_dtype="int8" | "float8_e4m3fn")``): the clustering reads the
  entries' values (`sparsekv_jax.cache.dequantize_kv`, float32, exact), so similarities and means are
  those of the dequantised cache, and `common.write_entries` quantises the merged entries into the new
  pages (a singleton moves losslessly unless its new page needs a larger scale).

Shapes: ``L`` layers, ``B`` rows, ``H`` KV heads, ``T`` prompt slots, ``D`` head dim.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.cache import KVCache, LayerKV, dequantize_kv
from sparsekv_jax.policies import clustering, semanticache_tokens
from sparsekv_jax.policies.base import Prompt
from sparsekv_jax.policies.common import budget_tokens, row_budgets

if TYPE_CHECKING:
    from sparsekv_jax.policies.semanticache import SemantiCache


def cluster(pol: SemantiCache, cache: KVCache,
            prompt: Prompt) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, jax.Array]]:
    """``((k, v, positions, bias, counts), (level, tau))``: every layer's merged prompt entries
    (`clustering.merge_clusters`, ``[L, B, H, n_out, ...]``; `common.write_entries` writes them) and
    the chunk layout level and threshold GSC ran at, ``[L, B, H]`` each. ``pol`` is bound and
    checked (`SemantiCache._cluster`)."""
    T = prompt.tokens.shape[1]
    keep = row_budgets(pol.budget, prompt.lengths)
    n_out = min(T, budget_tokens(pol.budget, T))
    width, levels = pol._width(T), pol._levels()
    gsc = clustering.resolve_gsc(pol.gsc, width, pol.backend)  # "auto": the bound backend's platform decides
    is_delim = semanticache_tokens.delimiters(pol, prompt)[:, :T]
    protect, shares = semanticache_tokens.protected_slots(pol, prompt)
    protect = None if protect is None else tuple(p[:, :T] for p in protect)
    per_head = not pol.threshold_mode and pol.level_rule == "least_lossy"
    # every layout (overflow: fits False); budget mode searches them all and keeps the least lossy per
    # (row, head), threshold mode (and level_rule="finest") the first that fits per row
    *layouts, fits = clustering.candidate_layouts(is_delim, prompt.lengths, keep, pol.sinks, pol.window,
                                                  width, levels, pol.recent_ratio, protect, shares)
    if not per_head:
        first = clustering.first_fitting(fits)  # [B]
        forced, anchor, member, place = (jnp.take_along_axis(x, first[None, :, None], 0)[0] for x in layouts)
        row_level = jnp.asarray(levels, jnp.int32)[first]
    search = not pol.threshold_mode or n_out < T
    top = 1.0 if pol.tau is None else float(pol.tau)
    inv_freq = None if pol.keys == "post_rope" else np.asarray(pol.inv_freq)

    def layer(kv):
        # a quantised cache's codes are read as their values (float32, exact): the clusters and the
        # merged means are those of the dequantised cache, quantised again by `write_entries`
        k, v = (y[:, :, :T] for y in dequantize_kv(kv, jnp.float32))  # [B, H, T, D]
        pos = kv.positions[:, :, :T]  # [B, H, T]
        content = k.astype(jnp.float32)
        if inv_freq is not None:
            content = clustering.rotate(content, -pos, inv_freq)
        band = clustering.similarity_band(content, width)
        if per_head:
            back, kept_as_is, choice, tau = clustering.least_lossy_clustering(band, layouts, keep, top,
                                                                              pol.search_steps, gsc)
            level = jnp.asarray(levels, jnp.int32)[choice]
        else:
            kept_as_is = (forced | anchor)[:, None]
            level = jnp.broadcast_to(row_level[:, None], k.shape[:2])
            if search:
                back, tau = clustering.largest_fitting_clustering(band, member, place, kept_as_is[:, 0], keep,
                                                                  top, pol.search_steps, gsc)
            else:
                taus = jnp.full((1, 1) + k.shape[:2], top)
                back = clustering.clusterings(band, member[None], place[None], taus, gsc)[0, 0]
                tau = jnp.full(k.shape[:2], top)
        seed_of = jnp.arange(T) - back.astype(jnp.int32)  # members: their seed; others: kept_as_is overrides
        return (clustering.merge_clusters(k, v, pos, content, seed_of, kept_as_is, prompt.lengths, n_out,
                                          inv_freq), (level, tau))

    layers = cache.layers
    kv = LayerKV(k=layers.k, v=layers.v, positions=layers.positions, bias=layers.bias, k_scale=layers.k_scale,
                 k_zero=layers.k_zero, v_scale=layers.v_scale)  # what clustering reads (no page summaries)
    return jax.lax.map(layer, kv, batch_size=min(pol.layer_batch, layers.k.shape[0]))
