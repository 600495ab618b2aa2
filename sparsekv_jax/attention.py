"""Attention dispatch: dense and sparse prefill, dense and page-sparse decode.

Model ports call these with what the policy decided; they pick the implementation:
cuDNN for dense prefill on the GPU, XLA on the CPU, Pallas kernels for the sparse paths on the
GPU (jnp references on the CPU, where the kernels only run interpreted, under test).
GQA is handled by grouping query heads as ``[B, Hkv, G, ...]``: keys are never repeated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsekv_jax.backend import Backend, on_gpu
from sparsekv_jax.cache import layer_view

__all__ = ["Backend", "cached_attention", "decode", "dense_causal_attention", "on_gpu", "prefill"]

NEG_INF = -1e30  # finite: a fully masked row gives zeros, never NaN


def _resolved(backend: Backend | None) -> Backend:
    backend = Backend() if backend is None else backend
    return backend if backend.resolved else backend.resolve()


def dense_causal_attention(q: jax.Array, k: jax.Array, v: jax.Array, *,
                           sliding_window: int | None = None,
                           implementation: str | None = None) -> jax.Array:
    """Causal self-attention within one chunk that starts at slot 0.

    ``q`` ``[B, T, Hq, D]``, ``k``/``v`` ``[B, T, Hkv, D]`` → ``[B, T, Hq, D]``. cuDNN on the
    GPU for bf16/fp16 (the strongest dense baseline), XLA otherwise. ``sliding_window`` may be a
    traced scalar (a per-layer window inside the layer scan, Gemma 3): then it is an explicit mask.
    """
    if sliding_window is not None and not isinstance(sliding_window, int):
        T = q.shape[1]
        i = jnp.arange(T)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - sliding_window)
        return jax.nn.dot_product_attention(q, k, v, mask=mask[None, None], implementation=implementation)
    if implementation is None:
        implementation = "cudnn" if on_gpu() and q.dtype in (jnp.bfloat16, jnp.float16) else "xla"
    window = None if sliding_window is None else (sliding_window - 1, 0)
    return jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                        implementation=implementation)


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
    qg = _grouped(q, Hkv).astype(k.dtype)  # [B, Hkv, G, T, D]
    # K/V stay in their storage dtype (no fp32 copy of the cache); accumulate in fp32
    scores = jnp.einsum("bhgtd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) / jnp.sqrt(D)
    if bias is not None:
        scores = scores + bias[:, :, None, None, :]
    qp = q_positions[:, None, :, None]  # [B, 1, T, 1]
    kp = kv_positions[:, :, None, :]  # [B, Hkv, 1, S]
    mask = kv_valid & (kp <= qp) & (kp >= 0)
    if sliding_window is not None:
        mask = mask & (kp > qp - sliding_window)
    scores = jnp.where(mask[:, :, None], scores, NEG_INF)
    m = scores.max(-1, keepdims=True)
    p = jnp.exp(scores - m) * mask[:, :, None]
    denom = p.sum(-1, keepdims=True)
    probs = p / jnp.maximum(denom, 1e-30)
    out = jnp.einsum("bhgts,bhsd->bhgtd", probs.astype(v.dtype), v, preferred_element_type=jnp.float32)
    out = out.reshape(q.shape).astype(q.dtype)
    if return_weights:
        return out, probs.reshape(B, -1, *probs.shape[3:])
    return out


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
    if pattern is None:
        return dense_causal_attention(q, k, v, sliding_window=sliding_window)
    backend = _resolved(backend)
    block_ids, block_counts, block_size = pattern
    B, T = q.shape[:2]
    if backend.sparse_prefill == "pallas" and (sliding_window is None or isinstance(sliding_window, int)):
        from sparsekv_jax.pallas.prefill import prefill_attention

        pad = -(-T // block_size) * block_size - T  # the kernel wants whole KV blocks; causality masks the pad
        kp = jnp.pad(jnp.swapaxes(k, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0)))
        vp = jnp.pad(jnp.swapaxes(v, 1, 2), ((0, 0), (0, 0), (0, pad), (0, 0)))
        out = prefill_attention(jnp.swapaxes(q, 1, 2), kp, vp, block_size=block_size, block_ids=block_ids,
                                block_counts=block_counts, sliding_window=sliding_window, interpret=backend.interpret)
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
    path (the kernel has no window).
    """
    backend = _resolved(backend)
    B, Hkv, S, _ = kv.k.shape[-4:]
    n_pages = S // page_size
    used_pages = -(-length // page_size)  # [B]
    valid = jnp.arange(S)[None, None, :] < length[:, None, None]  # [B, 1, S]
    if selection is None:
        read = jnp.ones((B,), jnp.float32)
    else:  # page lists hold distinct in-use pages, so the count is what is read
        read = jnp.minimum(selection[1], used_pages[:, None]).sum(1) / (Hkv * jnp.maximum(used_pages, 1))
    if backend.decode_attention == "pallas" and sliding_window is None:
        from sparsekv_jax.pallas.decode import decode_attention

        ids, counts = (None, None) if selection is None else selection
        res = decode_attention(q, kv.k, kv.v, length, page_size=page_size, page_ids=ids, page_counts=counts,
                               bias=kv.bias, layer=layer, interpret=backend.interpret, return_probs=return_probs)
        if return_probs:
            return res[0], read.astype(jnp.float32), res[1]
        return res, read.astype(jnp.float32)
    if layer is not None:
        kv = layer_view(kv, layer)
    if selection is not None:
        pm = page_mask(selection[0], selection[1], n_pages)  # [B, Hkv, P]
        valid = valid & jnp.repeat(pm, page_size, axis=-1)
    valid = jnp.broadcast_to(valid, (B, Hkv, S))[:, :, None, :]
    res = cached_attention(q[:, :, None], kv.k, kv.v, q_position[:, None], kv.positions, valid, bias=kv.bias,
                           sliding_window=sliding_window, return_weights=return_probs)
    if return_probs:
        out, probs = res
        return out[:, :, 0], read.astype(jnp.float32), probs[:, :, 0]
    return res[:, :, 0], read.astype(jnp.float32)


def block_fraction(pattern, T: int) -> jax.Array:
    """Fraction of the causal attention blocks a block pattern computes (mean over rows, heads)."""
    _, block_counts, block_size = pattern
    n = -(-T // block_size)
    causal_blocks = n * (n + 1) / 2
    return block_counts.sum(-1).mean().astype(jnp.float32) / causal_blocks
