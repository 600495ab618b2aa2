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
#   (policies that look at hidden states, e.g. BSER, observe it during prefill).
# How the layer scan unrolls and how decode matmuls read the weights are the caller's choice
# (`sparsekv_jax.backend.Backend`: ``prefill_unroll``, ``decode_unroll``, ``decode_matmul``).
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


MatMul = Callable[[jax.Array, str], jax.Array]  # (activations [..., K], weight name) -> [..., N]


def slice_matmul(lw: LayerParams) -> MatMul:
    """Matmuls against the layer's own weight arrays (what the layer scan hands each layer)."""
    return lambda h, name: h @ getattr(lw, name)


def stacked_matmul(params: Params, layer: jax.Array, interpret: bool | None = None) -> MatMul:
    """Matmuls that read layer ``layer`` of the stacked weights in the Pallas kernel (no slice);
    ``interpret`` defaults to off a GPU."""
    from sparsekv_jax.pallas.matmul import layer_matmul

    interpret = jax.default_backend() != "gpu" if interpret is None else interpret

    def mm(h: jax.Array, name: str) -> jax.Array:
        w = getattr(params.layers, name)
        out = layer_matmul(h.reshape(-1, h.shape[-1]), w, layer, interpret=interpret)
        return out.reshape(*h.shape[:-1], w.shape[-1])

    return mm


def qkv_projection(params: Params, lw: LayerParams, x: jax.Array, positions: jax.Array, mm: MatMul | None = None):
    """Normed input → RoPE'd q ``[B,T,Hq,D]``, k ``[B,T,Hkv,D]`` and v for one layer."""
    cfg = params.config
    B, T, _ = x.shape
    mm = slice_matmul(lw) if mm is None else mm
    h = rms_norm(x, lw.attn_norm, cfg.rms_norm_eps)
    q = mm(h, "wq")
    k = mm(h, "wk")
    v = mm(h, "wv")
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


def mlp(params: Params, lw: LayerParams, x: jax.Array, mm: MatMul | None = None) -> jax.Array:
    mm = slice_matmul(lw) if mm is None else mm
    h = rms_norm(x, lw.mlp_norm, params.config.rms_norm_eps)
    return mm(jax.nn.silu(mm(h, "w_gate")) * mm(h, "w_up"), "w_down")


def forward(params: Params, tokens: jax.Array, positions: jax.Array, layer_caches: Any,
            attend: AttendFn, *, hidden_in: jax.Array | None = None, carried: Any = None,
            unroll: int | bool = 1, weights_by_index: bool = False, interpret: bool | None = None):
    """Run all layers over ``tokens`` ``[B, T]`` at RoPE ``positions`` ``[B, T]``.

    ``layer_caches`` is any pytree with a leading ``[L]`` axis (scanned alongside the
    weights). Returns ``(hidden [B, T, H], new_layer_caches, extras)`` where ``extras`` is
    whatever ``attend`` returned per layer, stacked on a leading ``[L]`` axis.

    ``carried`` (optional) is state that rides the scan *carry* instead: every layer sees all
    of it and ``attend`` is called with ``(layer_cache, carried)`` and returns the pair
    updated. Decode carries the whole KV cache this way and writes one token per layer in
    place; scanning the cache as ``xs``/``ys`` instead would copy all of it every step. Then
    the return is ``(hidden, (new_layer_caches, new_carried), extras)``.

    ``unroll``: the scan's unroll factor (1 = rolled). ``weights_by_index``: the matmuls read each
    layer's weights from the stacked arrays by layer index (`stacked_matmul`, run interpreted if
    ``interpret``) instead of the scan's slice of them.
    """
    cfg = params.config
    x = embed(params, tokens) if hidden_in is None else hidden_in

    def layer(carry, xs):
        x, state = carry
        lw, kv, idx = xs
        mm = stacked_matmul(params, idx, interpret) if weights_by_index else slice_matmul(lw)
        q, k, v = qkv_projection(params, lw, x, positions, mm)
        if carried is None:
            out, kv, extras = attend(q, k, v, kv, idx, x)
        else:
            out, (kv, state), extras = attend(q, k, v, (kv, state), idx, x)
        B, T = out.shape[:2]
        x = x + mm(out.reshape(B, T, cfg.num_heads * cfg.head_dim), "wo")
        x = x + mlp(params, lw, x, mm)
        return (x, state), (kv, extras)

    idx = jnp.arange(cfg.num_layers)
    (x, state), (new_caches, extras) = jax.lax.scan(
        layer, (x, carried), (params.layers, layer_caches, idx), unroll=unroll)
    if carried is None:
        return x, new_caches, extras
    return x, (new_caches, state), extras
