"""S³'s endogenous retrieval on the device: co-activation scores, smoothing, peak picking.

For each context position ``t`` (the paper's Eqs. 7 and 9-10)::

    S[t] = Σ_layers Σ_{f ∈ F_Q} w_Q[f] · IDF(f) · 1[t ∈ I_layer[f]],   IDF(f) = 1 / (log(1 + df(f)) + 1)

``w_Q`` is the question's summed feature activation (`sparsekv_jax.retrieval.scan`), ``df(f)`` the
number of positions where f is active, and features active at more than ``stop_df`` of the
context's positions are excluded (the paper drops features with df > 5,000; a fraction keeps the
rule independent of the context length). The sum is a segment-sum over the index's postings:
every posting carries its feature's weight, scattered into a ``[B, T]`` score (one jitted call
for all layers and rows; no host round trip per feature). The score is smoothed by a box filter
of ``kernel`` tokens (the paper's 1-D convolution: 48, 8 for QA) and non-maximum suppression picks
up to ``n_centres`` peaks (paper: 40), each suppressing ``radius`` tokens on either side.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp


def feature_weights(query_weights: jax.Array, df: jax.Array, context_lengths: jax.Array, stop_df: float) -> jax.Array:
    """``[n, B, W]`` weight of each feature's postings: ``w_Q · IDF``, 0 for stop features."""
    idf = 1.0 / (jnp.log1p(df.astype(jnp.float32)) + 1.0)
    common = df.astype(jnp.float32) > stop_df * context_lengths[None, :, None].astype(jnp.float32)
    return jnp.where(common, 0.0, query_weights * idf)


def posting_features(counts: jax.Array, slots: int) -> jax.Array:
    """``[..., slots]`` feature id of each posting slot of CSR segments with ``counts`` ``[..., W]``
    (``W`` for unused slots): the number of features whose run ends at or before the slot."""
    ends = jnp.cumsum(counts, axis=-1)
    lead = counts.shape[:-1]
    flat = ends.reshape(-1, counts.shape[-1])
    rows = jnp.arange(flat.shape[0])[:, None]
    marks = jnp.zeros((flat.shape[0], slots + 1), jnp.int32).at[rows, flat].add(1)
    return jnp.cumsum(marks, axis=-1)[:, :slots].reshape(*lead, slots)


def position_scores(postings: jax.Array, counts: jax.Array, weights: jax.Array, width: int) -> jax.Array:
    """``[B, width]`` S³ score from segmented postings ``[n, B, S, P]``, ``counts [n, B, S, W]`` and
    per-feature ``weights [n, B, W]`` (a segment-sum over all postings)."""
    n, B, S, P = postings.shape
    feat = posting_features(counts, P)  # [n, B, S, P]
    w = jnp.concatenate([weights, jnp.zeros((n, B, 1), weights.dtype)], -1)  # feature W: unused slot
    per_post = jnp.take_along_axis(w, feat.reshape(n, B, S * P), axis=-1)
    pos = jnp.where(postings >= 0, postings, width).reshape(n, B, S * P)
    rows = jnp.arange(B)[None, :, None]
    return jnp.zeros((B, width + 1), jnp.float32).at[rows, pos].add(per_post)[:, :width]


def smooth(score: jax.Array, kernel: int) -> jax.Array:
    """Box filter along the last axis: mean of ``score[t - kernel//2 : t - kernel//2 + kernel]``
    (zeros outside), the same length as ``score``. A windowed sum (`lax.reduce_window`), not a
    difference of running sums: in float32 those lose ``eps * |running sum|``, which grows with
    the context (128k positions) and swamps small scores."""
    lo = kernel // 2
    ones = (1,) * (score.ndim - 1)
    total = jax.lax.reduce_window(score, jnp.zeros((), score.dtype), jax.lax.add, ones + (kernel,),
                                  ones + (1,), [(0, 0)] * (score.ndim - 1) + [(lo, kernel - 1 - lo)])
    return total / kernel


def pick_centres(density: jax.Array, lengths: jax.Array, n_centres: int,
                 radius: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Greedy non-maximum suppression: ``(centres [B, N], values [B, N])``, best first; each pick
    removes ``|t - c| < radius[b]``; a slot with no positive peak left is ``-1`` (value 0)."""
    B, T = density.shape
    t = jnp.arange(T)
    d = jnp.where(t[None] < lengths[:, None], density, -jnp.inf)

    def pick(i, carry):
        d, centres, values = carry
        c = jnp.argmax(d, axis=-1)
        v = jnp.take_along_axis(d, c[:, None], axis=-1)[:, 0]
        ok = v > 0
        centres = centres.at[:, i].set(jnp.where(ok, c, -1))
        values = values.at[:, i].set(jnp.where(ok, v, 0.0))
        d = jnp.where(jnp.abs(t[None] - c[:, None]) < radius[:, None], -jnp.inf, d)
        return d, centres, values

    init = (d, jnp.full((B, n_centres), -1, jnp.int32), jnp.zeros((B, n_centres), jnp.float32))
    _, centres, values = jax.lax.fori_loop(0, n_centres, pick, init)
    return centres, values


@partial(jax.jit, static_argnames=("width", "kernel", "n_centres"))
def retrieve_centres(postings: jax.Array, counts: jax.Array, query_weights: jax.Array, context_lengths: jax.Array,
                     radius: jax.Array, *, width: int, kernel: int, n_centres: int, stop_df: float):
    """Scores, smoothing and peaks in one call: ``(centres [B, N], values [B, N], score [B, width])``
    from the index's ``postings``/``counts`` and the question's ``query_weights`` (same layers)."""
    w = feature_weights(query_weights, counts.sum(2), context_lengths, stop_df)
    score = position_scores(postings, counts, w, width)
    centres, values = pick_centres(smooth(score, kernel), context_lengths, n_centres, radius)
    return centres, values, score
