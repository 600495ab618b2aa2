"""Attention dispatch: dense and sparse prefill, dense and page-sparse decode.

Model ports call these with what the policy decided; they pick the implementation:
cuDNN for dense prefill on the GPU, XLA on the CPU, Pallas kernels for the sparse paths on the
GPU (jnp references on the CPU, where the kernels only run interpreted, under test).
GQA is handled by grouping query heads as ``[B, Hkv, G, ...]``: keys are never repeated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsekv_jax.backend import Backend, resolved
from sparsekv_jax.cache import dequantize_kv, layer_view
from sparsekv_jax.cache_pooled import PoolCache, decode_kernel_args, layer_kv, layer_lengths
from sparsekv_jax.pallas import dispatch

__all__ = ["Backend", "blocked_causal_attention", "cached_attention", "decode", "decode_pool", "dense_causal_attention",
           "prefill"]

NEG_INF = -1e30  # finite: a fully masked row gives zeros, never NaN


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                           sliding_window: int | None = None,
                           implementation: str | None = None, backend: Backend | None = None) -> jax.Array:
    """Causal self-attention within one chunk that starts at slot 0.

    ``q`` ``[B, T, Hq, D]``, ``k``/``v`` ``[B, T, Hkv, D]`` → ``[B, T, Hq, D]``.
    ``implementation``: ``"cudnn"``, ``"xla"`` (`jax.nn.dot_product_attention`), ``"blocked"``
    (`blocked_causal_attention`) or ``None``/``"auto"``: cuDNN on the GPU for bf16/fp16 (the strongest
    dense baseline), ``"blocked"`` on the CPU for prompts longer than one block, XLA otherwise (the
    platform is ``backend``'s; ``None``: this process's default).
    ``sliding_window`` may be a traced scalar (a per-layer window inside the layer scan, Gemma 3):
    then it is an explicit mask, and JAX picks the implementation.
    """
    if sliding_window is not None and not isinstance(sliding_window, int):
        T = q.shape[1]
        i = jnp.arange(T)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
        explicit = implementation if implementation in ("cudnn", "xla") else None
        return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation=explicit)
    if implementation in (None, "auto"):
        if resolved(backend).gpu:
            implementation = "cudnn" if q.dtype in (jnp.bfloat16, jnp.float16) else "xla"
        else:
            implementation = "blocked" if q.shape[1] > PREFILL_BLOCK else "xla"
    if implementation == "blocked":
        return blocked_causal_attention(q, k, v, sliding_window=sliding_window)
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                        implementation=implementation)


PREFILL_BLOCK = 256  # query/key block of the CPU prefill: a [G*256, 256] fp32 score tile stays in L2


def _rows_matmul(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``einsum(spec, a, b)`` over ``[B, H, ...]`` operands as one batch of ``B*H`` matrices (fp32 out).

    With two batch dimensions XLA:CPU's oneDNN dot fusion (`Backend.prefill_dots`) takes the online
    softmax's ``acc * rescale + pv`` into the dot, a fusion oneDNN cannot run (the program then
    falls back to XLA's dots); reshaped to one batch dimension and back, the dot stays alone, as
    it does at B = 1. A reshape of leading dimensions: free on every backend."""
    B, H = a.shape[:2]
    out = jnp.einsum(spec.replace("bh", "z"), a.reshape(B * H, *a.shape[2:]), b.reshape(B * H, *b.shape[2:]),
                     preferred_element_type=jnp.float32)
    return out.reshape(B, H, *out.shape[1:])


def blocked_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, block: int = PREFILL_BLOCK,
                             sliding_window: int | None = None) -> jax.Array:
    """Causal attention as a loop over key blocks with an online softmax (flash-style), for the CPU.

    XLA:CPU's `dot_product_attention` materialises the ``[B, Hq, T, T]`` fp32 scores and reads them
    back several times (mask, max, exp, sum, divide): at T = 4k that is 0.6 GB per layer, far out of
    cache, and it also computes the masked upper triangle. Here each query block visits only the
    key blocks at or before it (inside the sliding window, if any) and the ``[G*block, block]`` tile
    of scores stays in cache (SmolLM2's prefill at 4k on a CPU: experiments/diary/BENCHMARKS_DIARY.md, "CPU speed
    against transformers"). Same shapes and semantics as
    `dense_causal_attention` (GQA grouped, no repeated keys); fp32 accumulation. The inner loop has
    a data-dependent trip count, so it is not reverse-differentiable (nothing here differentiates
    through attention).
    """
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    n = -(-T // block)
    pad = ((0, 0), (0, n * block - T), (0, 0), (0, 0))  # padded keys sit after every real query
    # the 1/sqrt(D) scale folded into the queries once, not into every score tile
    q = q * jnp.asarray(1.0 / float(D) ** 0.5, q.dtype)
    # [n, B, Hkv, G*block, D]: a query block's G heads of one KV head as one matrix
    qb = jnp.pad(q, pad).reshape(B, n, block, Hkv, G, D).transpose(1, 0, 3, 4, 2, 5).reshape(n, B, Hkv, G * block, D)
    kb = jnp.pad(k, pad).reshape(B, n, block, Hkv, D).transpose(1, 0, 3, 2, 4)  # [n, B, Hkv, block, D]
    vb = jnp.pad(v, pad).reshape(B, n, block, Hkv, D).transpose(1, 0, 3, 2, 4)
    q_off = jnp.tile(jnp.arange(block), G)[:, None]  # each row's query position within its block
    k_off = jnp.arange(block)[None, :]

    def query_block(_, xs):
        qi, i = xs
        qi = qi.astype(k.dtype)

        def key_block(j, carry, masked: bool):
            m, l, acc = carry
            kj = jax.lax.dynamic_index_in_dim(kb, j, keepdims=False)
            vj = jax.lax.dynamic_index_in_dim(vb, j, keepdims=False)
            s = _rows_matmul("bhqd,bhkd->bhqk", qi, kj)
            if masked:
                delta = (i - j) * block + q_off - k_off  # query position - key position
                visible = delta >= 0
                if sliding_window is not None:
                    visible = visible & (delta < sliding_window)
                s = jnp.where(visible, s, NEG_INF)
            m_new = jnp.maximum(m, s.max(-1))
            p = jnp.exp(s - m_new[..., None])
            rescale = jnp.exp(m - m_new)
            pv = _rows_matmul("bhqk,bhkd->bhqd", p.astype(v.dtype), vj)
            return m_new, l * rescale + p.sum(-1), acc * rescale[..., None] + pv

        init = (jnp.full((B, Hkv, G * block), NEG_INF, jnp.float32), jnp.zeros((B, Hkv, G * block), jnp.float32),
                jnp.zeros((B, Hkv, G * block, D), jnp.float32))
        if sliding_window is None:
            # blocks before the diagonal are wholly visible: no mask to build and apply there
            carry = jax.lax.fori_loop(0, i, lambda j, c: key_block(j, c, False), init)
            _, l, acc = key_block(i, carry, True)
        else:
            first = jnp.maximum(0, (i * block - sliding_window + 1) // block)
            _, l, acc = jax.lax.fori_loop(first, i + 1, lambda j, c: key_block(j, c, True), init)
        return None, (acc / l[..., None]).astype(q.dtype)  # every query sees itself: l > 0

    _, out = jax.lax.scan(query_block, None, (qb, jnp.arange(n)))
    out = out.reshape(n, B, Hkv, G, block, D).transpose(1, 0, 4, 2, 3, 5).reshape(B, n * block, Hq, D)
    return out[:, :T]


def _grouped(q: jax.Array, num_kv_heads: int) -> jax.Array:
    """``[B, Hq, ...]`` → ``[B, Hkv, G, ...]`` (a view, no copy of K/V)."""
    B, Hq = q.shape[:2]
    return q.reshape(B, num_kv_heads, Hq // num_kv_heads, *q.shape[2:])


def cached_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_positions: jax.Array,
                     kv_positions: jax.Array, kv_valid: jax.Array, *,
                     bias: jax.Array | None = None, sliding_window: int | None = None,
                     return_weights: bool = False):
    """Queries against a cache (jnp reference path): chunked prefill and decode.

    ``q`` ``[B, Hq, T, D]``; ``k``/``v`` ``[B, Hkv, S, D]``; ``q_positions`` ``[B, T]``;
    ``kv_positions`` ``[B, Hkv, S]``; ``kv_valid`` ``[B, Hkv, T or 1, S]`` bool (slot usable by
    that query: length, causality by slot, page selection). Causality by position is applied
    on top (a key at a later RoPE position is never seen); so is the sliding window.
    Returns ``[B, Hq, T, D]`` (and the ``[B, Hq, T, S]`` probabilities if asked).
    """
    B, Hkv, S, D = k.shape
    T = q.shape[2]
    qp = q_positions[:, None, :, None]  # [B, 1, T, 1]
    kp = kv_positions[:, :, None, :]  # [B, Hkv, 1, S]
    mask = kv_valid & (kp <= qp) & (kp >= 0)
    if sliding_window is not None:
        mask = mask & (kp > qp - sliding_window)
    if T == 1:
        # One query per row (decode): the same math without the length-1 query axis. With it, XLA:CPU
        # lays the scores' dot out against a transposed copy of each layer's keys (the largest cost of
        # a CPU decode step at 4k; experiments/diary/BENCHMARKS_DIARY.md, "CPU speed against transformers").
        out, probs = _attend(_grouped(q[:, :, 0], Hkv).astype(k.dtype), k, v, bias, mask[:, :, 0], "bhgd,bhsd->bhgs",
                             "bhgs,bhsd->bhgd", bias_at=(slice(None), slice(None), None))
        out, probs = out[:, :, :, None], probs[:, :, :, None]
    else:
        out, probs = _attend(_grouped(q, Hkv).astype(k.dtype), k, v, bias, mask, "bhgtd,bhsd->bhgts",
                             "bhgts,bhsd->bhgtd", bias_at=(slice(None), slice(None), None, None))
    out = out.reshape(q.shape).astype(q.dtype)
    if return_weights:
        return out, probs.reshape(B, -1, *probs.shape[3:])
    return out


def _attend(qg: jax.Array, k: jax.Array, v: jax.Array, bias: jax.Array | None, mask: jax.Array, scores_eq: str,
            out_eq: str, bias_at: tuple) -> tuple[jax.Array, jax.Array]:
    """Masked softmax attention of grouped queries ``qg`` (``[B, Hkv, G, (T,) D]``) against ``k``/``v``
    ``[B, Hkv, S, D]``; ``mask`` ``[B, Hkv, (T,) S]``, ``bias`` ``[B, Hkv, S]`` indexed by ``bias_at``.
    Returns ``(out, probs)`` with fp32 accumulation; K/V stay in their storage dtype (no fp32 copy)."""
    scores = jnp.einsum(scores_eq, qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(k.shape[-1])
    if bias is not None:
        scores = scores + bias[(*bias_at, slice(None))]
    mask = mask[:, :, None]
    scores = jnp.where(mask, scores, NEG_INF)
    m = scores.max(-1, keepdims=True)
    p = jnp.exp(scores - m) * mask
    probs = p / jnp.maximum(p.sum(-1, keepdims=True), 1e-30)
    return jnp.einsum(out_eq, probs.astype(v.dtype), v, preferred_element_type=jnp.float32), probs


def page_mask(page_ids: jax.Array, page_counts: jax.Array, num_pages: int) -> jax.Array:
    """``[..., P_sel]`` page lists (first ``count`` valid) → ``[..., num_pages]`` bool (a scatter,
    so memory stays O(P), not O(P_sel · P))."""
    sel = jnp.arange(page_ids.shape[-1]) < page_counts[..., None]
    ids = jnp.where(sel, page_ids, num_pages)  # unused entries land in a spill column
    lead = page_ids.shape[:-1]
    flat = ids.reshape(-1, ids.shape[-1])
    rows = jnp.arange(flat.shape[0])[:, None]
    mask = jnp.zeros((flat.shape[0], num_pages + 1), jnp.bool_).at[rows, flat].set(True)
    return mask[:, :num_pages].reshape(*lead, num_pages)


def block_mask(block_ids: jax.Array, block_counts: jax.Array, num_blocks: int, block_size: int) -> jax.Array:
    """Block lists ``[B, Hkv, nQ, K]`` → token mask ``[B, Hkv, nQ*bs, num_blocks*bs]`` (no causality)."""
    blocks = page_mask(block_ids, block_counts, num_blocks)  # [B, Hkv, nQ, nK]
    return jnp.repeat(jnp.repeat(blocks, block_size, axis=-2), block_size, axis=-1)


def prefill(q: jax.Array, k: jax.Array, v: jax.Array, pattern, *,
            sliding_window: int | None = None, backend: Backend | None = None) -> jax.Array:
    """Prefill attention of a chunk starting at slot 0: dense, or the policy's block pattern.

    ``pattern`` is ``None`` (dense causal) or ``(block_ids, block_counts, block_size)``;
    ``backend.sparse_prefill`` picks the Pallas kernel or the jnp path for a pattern.
    """
    backend = resolved(backend)
    if pattern is None:
        return dense_causal_attention(q, k, v, sliding_window=sliding_window, implementation=backend.dense_prefill,
                                      backend=backend)
    block_ids, block_counts, block_size = pattern
    B, T = q.shape[:2]
    if backend.sparse_prefill == "pallas" and (sliding_window is None or isinstance(sliding_window, int)):
        pad = -(-T // block_size) * block_size - T  # the kernel wants whole KV blocks; causality masks the pad
        kp = jnp.pad(jnp.swapaxes(k, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0)))
        vp = jnp.pad(jnp.swapaxes(v, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0)))
        out = dispatch.prefill_attention(backend, jnp.swapaxes(q, 1, 2), kp, vp, block_size=block_size,
                                         block_ids=block_ids, block_counts=block_counts, sliding_window=sliding_window)
        return jnp.swapaxes(out, 1, 2)
    n_blocks = -(-T // block_size)
    mask = block_mask(block_ids, block_counts, n_blocks, block_size)[..., :T, :T]
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    kv_pos = jnp.broadcast_to(positions[:, None], (B, k.shape[2], T))
    out = cached_attention(jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2),
                           positions, kv_pos, mask, sliding_window=sliding_window)
    return jnp.swapaxes(out, 1, 2)


def decode(q: jax.Array, q_position: jax.Array, kv, length: jax.Array, page_size: int, selection, *,
           sliding_window: int | None = None, return_probs: bool = False, layer: jax.Array | None = None,
           backend: Backend | None = None):
    """One query per row ``[B, Hq, D]`` at RoPE ``q_position`` ``[B]`` against a layer's cache
    ``kv`` (`LayerKV`) whose first ``length`` slots are in use.

    ``selection`` is ``None`` (every page in use) or ``(page_ids [B, Hkv, P], counts [B, Hkv])``.
    With ``layer``, ``kv`` is every layer's cache stacked ``[L, ...]`` and layer ``layer`` is read
    (the kernel indexes the stack: no per-layer copy).
    Returns the output ``[B, Hq, D]``, per row the fraction of in-use pages read, and with
    ``return_probs`` the attention probabilities ``[B, Hq, S]`` (H2O's running eviction: the
    Pallas kernel returns them with the output, so it needs no second pass over the keys).
    ``backend.decode_attention`` picks the kernel or the jnp path; a sliding window takes the jnp
    path (the kernel has no window). A quantised cache (``kv.k_scale`` set) is dequantised in the
    kernel's registers, or by the jnp path to ``q``'s dtype (one layer at a time).
    """
    backend = resolved(backend)
    B, Hkv, S, _ = kv.k.shape[-4:]
    n_pages = S // page_size
    used_pages = -(-length // page_size)  # [B]
    valid = jnp.arange(S)[None, None, :] < length[:, None, None]  # [B, 1, S]
    if selection is None:
        read = jnp.ones((B,), jnp.float32)
    else:  # page lists hold distinct in-use pages, so the count is what is read
        read = jnp.minimum(selection[1], used_pages[:, None]).sum(1) / (Hkv * jnp.maximum(used_pages, 1))
    if backend.decode_attention == "pallas" and sliding_window is None:
        ids, counts = (None, None) if selection is None else selection
        res = dispatch.decode_attention(backend, q, kv.k, kv.v, length, page_size=page_size, page_ids=ids,
                                        page_counts=counts, bias=kv.bias, layer=layer, return_probs=return_probs,
                                        k_scale=kv.k_scale, v_scale=kv.v_scale, k_zero=kv.k_zero)
        if return_probs:
            return res[0], read.astype(jnp.float32), res[1]
        return res, read.astype(jnp.float32)
    if layer is not None:
        kv = layer_view(kv, layer)
    if selection is not None:
        pm = page_mask(selection[0], selection[1], n_pages)  # [B, Hkv, P]
        valid = valid & jnp.repeat(pm, page_size, axis=-1)
    valid = jnp.broadcast_to(valid, (B, Hkv, S))[:, :, None, :]
    k, v = dequantize_kv(kv, q.dtype)
    res = cached_attention(q[:, :, None], k, v, q_position[:, None], kv.positions, valid, bias=kv.bias,
                           sliding_window=sliding_window, return_weights=return_probs)
    if return_probs:
        out, probs = res
        return out[:, :, 0], read.astype(jnp.float32), probs[:, :, 0]
    return res[:, :, 0], read.astype(jnp.float32)


def decode_pool(q: jax.Array, q_position: jax.Array, cache: PoolCache, layer: int | jax.Array,
                selection: tuple[jax.Array, jax.Array] | None = None, *, sliding_window: int | jax.Array | None = None,
                return_probs: bool = False, backend: Backend | None = None):
    """`decode` of layer ``layer`` of a page pool (``Options(pool=True)``, experimental): one
    query per row ``[B, Hq, D]`` at RoPE ``q_position`` ``[B]`` against each (row, KV head)'s first
    ``length[layer, b, h]`` logical slots. ``selection``: ``None`` (every page in use) or ``(page_ids [B, Hkv, P],
    counts [B, Hkv])`` of *logical* pages in ``[0, M)`` (Quest's `Policy.decode_select` on the pool), each
    mapped through the head's table.

    ``backend.decode_attention == "pallas"`` runs the decode kernel's pool mode (`pallas.decode.decode_attention`
    with ``page_table=``, through `cache_pooled.decode_kernel_args`: the pool leaves as stored, read through the
    layer's tables; the listed logical pages as its ``page_ids``); else (and for a sliding window, which the
    kernel lacks) the jnp path: the layer gathered through its tables (`cache_pooled.layer_kv`, ``[B, Hkv, M·ps,
    ...]`` at logical slots) and `cached_attention` with the per-head lengths and the listed logical pages'
    mask. Slots past a head's length or off its list are zeroed before the products (a pool page is not
    cleared when it is freed or opened, so they may hold anything, NaN included), so an unread slot weighs
    exactly 0, as in `decode`. Returns ``(out [B, Hq, D], read [B])``, ``read`` the row's pages read over its
    pages in use, summed over its heads (1 without a selection; with equal heads `decode`'s fraction), and
    with ``return_probs`` the attention probabilities ``[B, Hq, M·ps]`` at *logical* slots (H2O's eviction on
    a pool; zero off a head's length)."""
    backend = resolved(backend)
    ps = cache.page_size
    length = layer_lengths(cache, layer)  # [B, Hkv]
    if selection is None:
        read = jnp.ones((q.shape[0],), jnp.float32)
    else:  # page lists hold distinct in-use pages, so the count is what is read
        used = -(-length // ps)
        read = (jnp.minimum(selection[1], used).sum(1) / jnp.maximum(used, 1).sum(1)).astype(jnp.float32)
    if backend.decode_attention == "pallas" and sliding_window is None:
        args = decode_kernel_args(cache, layer)
        ids, counts = (None, None) if selection is None else selection
        res = dispatch.decode_attention(backend, q, args.pop("k"), args.pop("v"), args.pop("lengths"),
                                        page_size=ps, page_ids=ids, page_counts=counts, return_probs=return_probs,
                                        **args)
        return (res[0], read, res[1]) if return_probs else (res, read)
    kv = layer_kv(cache, layer)
    valid = jnp.arange(kv.k.shape[-2])[None, None, :] < length[..., None]  # [B, Hkv, M·ps]
    if selection is not None:
        valid = valid & jnp.repeat(page_mask(selection[0], selection[1], kv.k.shape[-2] // ps), ps, axis=-1)
    k, v = dequantize_kv(kv, q.dtype)
    k, v = (jnp.where(valid[..., None], x, jnp.zeros((), x.dtype)) for x in (k, v))
    res = cached_attention(q[:, :, None], k, v, q_position[:, None], kv.positions, valid[:, :, None, :], bias=kv.bias,
                           sliding_window=sliding_window, return_weights=return_probs)
    if return_probs:
        return res[0][:, :, 0], read, res[1][:, :, 0]
    return res[:, :, 0], read


def block_fraction(pattern, T: int) -> jax.Array:
    """Fraction of the causal attention blocks a block pattern computes (mean over rows, heads)."""
    _, block_counts, block_size = pattern
    n = -(-T // block_size)
    causal_blocks = n * (n + 1) / 2
    return block_counts.sum(-1).mean().astype(jnp.float32) / causal_blocks
