"""One functional decoder-only transformer shared by Llama, Qwen2, Qwen3 and Mistral.

Family differences are data in `ModelConfig` (qkv bias, q/k norm, sliding window, RoPE
scaling, tied embeddings). Layers run under one `lax.scan`; the attention of each layer is a
callable passed in by the caller (`generate`), which decides how the KV cache is written and
read. The port itself knows nothing of selection policies.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sparsekv_jax.models.params import LayerParams, Params
from sparsekv_jax.models.rope import apply_rope, inverse_frequencies

# attend(q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D], layer_cache, layer_index, hidden [B,T,H])
#   -> (out [B,T,Hq,D], new_layer_cache, extras pytree); `hidden` is the layer's input
#   (policies that look at hidden states, e.g. BSER, observe it during prefill)
# Unroll factor of the layer scan (1 = rolled). A benchmark knob: on the GPU a rolled scan slices
# each layer's weights out of the stacked arrays every step; unrolling lets XLA use static slices.
SCAN_UNROLL = 1

AttendFn = Callable[[jax.Array, jax.Array, jax.Array, Any, jax.Array], tuple[jax.Array, Any, Any]]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in fp32 and cast back, as transformers does."""
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * xf.astype(x.dtype)


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    return jnp.take(params.embed, tokens, axis=0)


def logits_from_hidden(params: Params, hidden: jax.Array) -> jax.Array:
    """Final norm + LM head → fp32 logits."""
    cfg = params.config
    h = rms_norm(hidden, params.final_norm, cfg.rms_norm_eps)
    w = params.embed.T if params.lm_head is None else params.lm_head
    return jnp.einsum("...h,hv->...v", h, w, preferred_element_type=jnp.float32)


def qkv_projection(params: Params, lw: LayerParams, x: jax.Array, positions: jax.Array):
    """Normed input → RoPE'd q ``[B,T,Hq,D]``, k ``[B,T,Hkv,D]`` and v for one layer."""
    cfg = params.config
    B, T, _ = x.shape
    h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
    q = h @ lw.wq
    k = h @ lw.wk
    v = h @ lw.wv
    if lw.bq is not None:
        q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
    q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if lw.q_norm is not None:
        q = rms_norm(q, lw.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k, lw.k_norm, cfg.rms_norm_eps)
    inv_freq = inverse_frequencies(cfg)
    return apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq), v


def mlp(params: Params, lw: LayerParams, x: jax.Array) -> jax.Array:
    h = rms_norm(x, lw.mlp_norm, params.config.rms_norm_eps)
    return (jax.nn.silu(h @ lw.w_gate) * (h @ lw.w_up)) @ lw.w_down


def forward(params: Params, tokens: jax.Array, positions: jax.Array, layer_caches: Any,
            attend: AttendFn, *, hidden_in: jax.Array | None = None):
    """Run all layers over ``tokens`` ``[B, T]`` at RoPE ``positions`` ``[B, T]``.

    ``layer_caches`` is any pytree with a leading ``[L]`` axis (scanned alongside the
    weights). Returns ``(hidden [B, T, H], new_layer_caches, extras)`` where ``extras`` is
    whatever ``attend`` returned per layer, stacked on a leading ``[L]`` axis.
    """
    cfg = params.config
    x = embed(params, tokens) if hidden_in is None else hidden_in

    def layer(x, xs):
        lw, kv, idx = xs
        q, k, v = qkv_projection(params, lw, x, positions)
        out, kv, extras = attend(q, k, v, kv, idx, x)
        B, T = out.shape[:2]
        x = x + out.reshape(B, T, cfg.num_heads * cfg.head_dim) @ lw.wo
        x = x + mlp(params, lw, x)
        return x, (kv, extras)

    idx = jnp.arange(cfg.num_layers)
    x, (new_caches, extras) = jax.lax.scan(layer, x, (params.layers, layer_caches, idx), unroll=SCAN_UNROLL)
    return x, new_caches, extras
