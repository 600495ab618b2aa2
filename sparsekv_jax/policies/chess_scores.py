"""CHESS's page scores (`sparsekv_jax.policies.chess`): every page's vector dotted with the anchor,
the mean page vector of the recent window, from one contraction over the pages' key sums.

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
CHESS reads are the codes' values (`sparsekv_jax.cache.dequantize_kv`; in bf16 rounded once, the keys
having zero points): a pre-RoPE
rebuild dequantises one layer at a time and sums it as above (a one-layer copy, as the jnp path's
slice of an unquantised layer); the post-RoPE page sums were written from the keys before
quantisation, and the keys taken back at the edge page are subtracted dequantised.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache, dequantize, dequantize_kv, layer_view, page_counts
from sparsekv_jax.pallas import dispatch
from sparsekv_jax.policies.chess_pool import PoolView

if TYPE_CHECKING:
    from sparsekv_jax.policies.chess import CHESS


def page_scores(pol: CHESS, cache: KVCache | PoolView, anchor_end: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Scores ``[B, P]`` of CHESS pages against the anchor of the window ending at slot
    ``anchor_end`` ``[B]``, and the pages in use ``[B, P]``."""
    Pc, cps = cache.num_pages, cache.page_size
    B = cache.batch
    m = pol.page_size // cps
    P = -(-Pc // m)  # the last CHESS page may stand past the cache's end: pad per-page values, not sums
    live_tokens = page_counts(anchor_end, Pc, cps)  # [B, Pc] slots before anchor_end
    tokens = jnp.pad(live_tokens, ((0, 0), (0, P * m - Pc))).reshape(B, P, m).sum(-1)  # [B, P]
    in_use = tokens > 0
    page = jnp.arange(P)
    last = (anchor_end - 1) // pol.page_size
    in_window = (page[None] <= last[:, None]) & (page[None] > last[:, None] - pol.window_pages) & in_use
    # A page vector is its key sum / its tokens, so every score is a weighted sum of page sums:
    # the anchor (mean of the window's page vectors) is sum_p w_p * sum_p.
    w = jnp.where(in_window, 1.0 / jnp.maximum(tokens, 1), 0.0) / jnp.maximum(in_window.sum(-1, keepdims=True), 1)
    if pol.centred:
        # (v_p - mu)·(a - mu) = v_p·(a - mu) - a row constant: centring only moves the anchor
        w = w - jnp.where(in_use, 1.0 / jnp.maximum(tokens, 1), 0.0) / jnp.maximum(in_use.sum(-1, keepdims=True), 1)
    if pol.keys == "pre_rope":
        dots = pre_rope_dots(pol, cache, anchor_end, w)
    else:
        dots = post_rope_dots(pol, cache, anchor_end, w, live_tokens)
    return dots / jnp.maximum(tokens, 1), in_use


def post_rope_dots(pol: CHESS, cache: KVCache, anchor_end: jax.Array, w: jax.Array,
                    live_tokens: jax.Array) -> jax.Array:
    """``[B, P]`` page key sums · (sum_p w_p · page sum), from the cache's page sums (no key read)."""
    if isinstance(cache, PoolView):
        raise ValueError("CHESS(keys='post_rope') does not run on a page pool yet (its page sums and edge keys are "
                         "read from the uniform stack); use keys='pre_rope' (the default) or leave pool unset")
    page_sum = cache.layers.page_sum  # [L, B, H, Pc, D] fp32 sums of keys per cache page
    if page_sum is None:
        raise ValueError("CHESS(keys='post_rope') reads the cache's page_sum, which this cache does not hold "
                         "(build it with init_cache(summaries=policy.page_summaries))")
    B, Pc, cps = cache.batch, cache.num_pages, cache.page_size
    m = pol.page_size // cps
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
        at = edge[None, :, None, None, None]
        keys = dequantize(keys, jnp.take_along_axis(cache.layers.k_scale, at, axis=3),
                          zero=jnp.take_along_axis(cache.layers.k_zero, at, axis=3))
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


def pre_rope_dots(pol: CHESS, cache: KVCache | PoolView, anchor_end: jax.Array, w: jax.Array) -> jax.Array:
    """As `post_rope_dots` on keys rotated back to position 0 (the content, without RoPE's
    position phase): reads every cached key once per rebuild, one layer at a time."""
    if pol.inv_freq is None:
        raise ValueError("CHESS(keys='pre_rope') needs the model's RoPE frequencies: call "
                         "policy.bind(Setup(params.config)) first (generate and sparsekv eval do)")
    if isinstance(cache, PoolView):  # a page pool (`chess_pool`): each layer read through its tables
        L, B, H, S, D = cache.num_layers, cache.batch, cache.heads, cache.capacity, cache.head_dim
        k_all = pos_all = None
        quantized = cache.quantized
    else:
        L, B, H, S, D = cache.layers.k.shape
        k_all, pos_all = cache.layers.k, cache.layers.positions  # [L, B, H, S, D], [L, B, H, S]
        quantized = cache.layers.quantized
    if 2 * len(pol.inv_freq) != D:
        raise ValueError(f"CHESS inv_freq has {len(pol.inv_freq)} frequencies, the cache's head_dim is {D}")
    P, ps = w.shape[1], pol.page_size
    inv_freq = jnp.asarray(np.asarray(pol.inv_freq), jnp.float32)
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
    backend = pol.backend if pol.backend is not None else Backend(page_sums="jnp")
    page_sums = functools.partial(dispatch.rope_page_sums, backend, page_size=ps)
    # Per layer (the cache read by layer index), two exact ways to the pages' sums of un-rotated
    # keys. Fast, when every page's live positions are consecutive (p0, p0+1, ...) and only the
    # edge page is partly live — every layer that was not compressed: R(-(p0+j)) = R(-p0)·R(-j),
    # so a page's sum is R(-p0) applied to sum_j R(-j)·k_j (`rope_page_sums`: the keys read once
    # in place, a fixed table of the slots' angles) and a rotation per page; the edge
    # page (slots past anchor_end may hold stale keys) key by key. Otherwise (per-head or
    # per-layer compression) every key is rotated back by its own position: B·H·S·D/2 sines
    # and cosines per layer, 20x slower at 32k x 22 on an H200.

    def read_layer(layer):  # → (a stack holding the layer's keys, the layer's index in it, positions [1, B, H, S])
        if isinstance(cache, PoolView):
            # a pool's layer gathered through its tables (a one-layer copy, the slots past a head's length empty),
            # read as a one-layer stack by both paths below
            kv = cache.layer(layer)
            keys = kv.k if not quantized else dequantize_kv(kv, jnp.bfloat16)[0]
            return keys[None], 0, kv.positions[None]
        pos = jax.lax.dynamic_index_in_dim(pos_all, layer, keepdims=False)[None]  # [1, B, H, S] (small)
        # A quantised cache's keys are codes: the layer is dequantised once (`dequantize_kv`; to bf16,
        # rounded once: the keys have zero points) and read as a one-layer stack by both paths below
        if quantized:
            return dequantize_kv(layer_view(cache.layers, layer), jnp.bfloat16)[0][None], 0, pos
        return k_all, layer, pos

    def layer_sums(layer):  # → [B, H, P, D]
        keys_of, in_stack, pos = read_layer(layer)
        mask = paged(slot_live & (pos >= 0))  # [1, B, H, P, ps]
        pos_paged = paged(pos)
        consecutive = jnp.all(~mask | (pos_paged == pos_paged[..., :1] + jnp.arange(ps)))
        partial = mask.any(-1) & ~mask.all(-1)

        def by_pages():
            # the keys read in place from the stack (a jnp slice of the layer would be a copy)
            sums = page_sums(keys_of, pol.inv_freq, in_stack)[None]  # [1, B, H, P, D]: sum_j R(-j)·k_j
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
