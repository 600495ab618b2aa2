"""One functional decoder-only transformer shared by Llama, Qwen2, Qwen3 and Mistral.

Family differences are data in `ModelConfig` (qkv bias, q/k norm, sliding window, RoPE
scaling, tied embeddings). Layers run under one `lax.scan`; the attention of each layer is a
callable passed in by the caller (`generate`), which decides how the KV cache is written and
read. The port itself knows nothing of selection policies.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from sparsekv_jax.models.params import LayerParams, Params
from sparsekv_jax.models.rope import apply_rope, inverse_frequencies

# attend(q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D], layer_cache, layer_index, hidden [B,T,H])
#   -> (out [B,T,Hq,D], new_layer_cache, extras pytree); `hidden` is the layer's input
#   (policies that look at hidden states, e.g. BSER, observe it during prefill)
# Unroll factor of the layer scan over many tokens (prefill; 1 = rolled).
SCAN_UNROLL = 1
# ... and over one token per row (decode). A benchmark knob, rolled by default. Measured on an
# H100 (Llama-3.1-8B shapes, B=1, 8k): a rolled layer scan copies each layer's weights out of the
# stacked arrays before cuBLAS reads them (the matmuls alone: 15.7 ms rolled, 6.5 ms unrolled
# outside a loop); but inside the decode `while_loop` full unrolling did *not* remove the copies
# (19.05 ms/token unrolled vs 16.57 rolled, and +11 GiB of temporaries), so it is not the default.
# "auto" = rolled everywhere for now; see docs/BENCHMARKS.md ("Decode: where the time goes").
DECODE_UNROLL: int | bool | str = "auto"


def decode_unroll() -> int | bool:
    return 1 if DECODE_UNROLL == "auto" else DECODE_UNROLL


# Decode matmuls: "xla" (cuBLAS on a slice of the stacked weights, which XLA copies out first),
# "pallas" (`sparsekv_jax.pallas.matmul.layer_matmul` reads the layer's tiles from the stack: no
# copy) or "auto": "pallas" on a GPU, "xla" elsewhere (on CPU the kernel only runs interpreted).
# Measured on an H100 (Llama-3.1-8B shapes, FullKV decode step at 8k): 20.97 -> 7.71 ms/token at
# B=1 and 19.46 -> 10.55 at B=8 (docs/BENCHMARKS.md, "Decode matmuls"). The environment variable
# SPARSEKV_DECODE_MATMUL sets it for a whole process (benches, eval).
DECODE_MATMUL = os.environ.get("SPARSEKV_DECODE_MATMUL", "auto")
if DECODE_MATMUL not in ("auto", "xla", "pallas"):
    raise ValueError(f"SPARSEKV_DECODE_MATMUL={DECODE_MATMUL!r}: expected 'auto', 'xla' or 'pallas'")


def decode_weights_by_index(params: Params) -> bool:
    """Whether decode matmuls read the stacked weights by layer index (`DECODE_MATMUL`, resolved).

    "auto" also falls back to XLA where the kernel does not apply: a weight dimension that is not
    a multiple of 16, or weights in more than one dtype.
    """
    mode = DECODE_MATMUL
    if mode == "auto":
        names = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
        ws = [getattr(params.layers, n) for n in names]
        fits = all(w.shape[1] % 16 == 0 and w.shape[2] % 16 == 0 for w in ws) and len({w.dtype for w in ws}) == 1
        mode = "pallas" if jax.default_backend() == "gpu" and fits else "xla"
    return mode == "pallas"


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


def stacked_matmul(params: Params, layer: jax.Array) -> MatMul:
    """Matmuls that read layer ``layer`` of the stacked weights in the Pallas kernel (no slice)."""
    from sparsekv_jax.pallas.matmul import layer_matmul

    def mm(h: jax.Array, name: str) -> jax.Array:
        w = getattr(params.layers, name)
        out = layer_matmul(h.reshape(-1, h.shape[-1]), w, layer, interpret=jax.default_backend() != "gpu")
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
            unroll: int | bool | None = None, weights_by_index: bool = False):
    """Run all layers over ``tokens`` ``[B, T]`` at RoPE ``positions`` ``[B, T]``.

    ``layer_caches`` is any pytree with a leading ``[L]`` axis (scanned alongside the
    weights). Returns ``(hidden [B, T, H], new_layer_caches, extras)`` where ``extras`` is
    whatever ``attend`` returned per layer, stacked on a leading ``[L]`` axis.

    ``carried`` (optional) is state that rides the scan *carry* instead: every layer sees all
    of it and ``attend`` is called with ``(layer_cache, carried)`` and returns the pair
    updated. Decode carries the whole KV cache this way and writes one token per layer in
    place; scanning the cache as ``xs``/``ys`` instead would copy all of it every step. Then
    the return is ``(hidden, (new_layer_caches, new_carried), extras)``.

    ``unroll``: the scan's unroll factor (default `SCAN_UNROLL`). ``weights_by_index``: the
    matmuls read each layer's weights from the stacked arrays by layer index (`stacked_matmul`)
    instead of the scan's slice of them.
    """
    cfg = params.config
    x = embed(params, tokens) if hidden_in is None else hidden_in

    def layer(carry, xs):
        x, state = carry
        lw, kv, idx = xs
        mm = stacked_matmul(params, idx) if weights_by_index else slice_matmul(lw)
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
        layer, (x, carried), (params.layers, layer_caches, idx), unroll=SCAN_UNROLL if unroll is None else unroll)
    if carried is None:
        return x, new_caches, extras
    return x, (new_caches, state), extras
