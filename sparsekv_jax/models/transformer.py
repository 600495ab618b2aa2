"""One functional decoder-only transformer shared by Llama, Qwen2, Qwen3, Mistral and Gemma 3.

Family differences are data in `ModelConfig` (qkv bias, q/k norm, sliding window, RoPE
scaling, tied embeddings; Gemma 3's ``(1 + w)`` norms, sandwich norms, GELU-tanh MLP, embedding
scale, query scale, final logit softcapping and per-layer windows and RoPE bases). Layers run
under one `lax.scan`; where layers differ (Gemma 3's local and global layers), the difference is
a per-layer array scanned alongside the weights (the RoPE table) or indexed by the traced layer
index (`attention_window`), never a Python branch per layer. The attention of each layer is a
callable passed in by the caller (`generate`), which decides how the KV cache is written and
read. The port itself knows nothing of selection policies.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import LayerParams, Params
from sparsekv_jax.models.rope import apply_rope, inverse_frequencies, layer_inverse_frequencies

# attend(q [B,T,Hq,D], k [B,T,Hkv,D], v [B,T,Hkv,D], layer_cache, layer_index, hidden [B,T,H])
#   -> (out [B,T,Hq,D], new_layer_cache, extras pytree); `hidden` is the layer's input
#   (policies that look at hidden states, e.g. BSER, observe it during prefill).
# How the layer scan unrolls and how decode matmuls read the weights are the caller's choice
# (`sparsekv_jax.backend.Backend`: ``prefill_unroll``, ``decode_unroll``, ``decode_matmul``).
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, Any, jax.Array], tuple[jax.Array, Any, Any]]


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in fp32 and cast back, as transformers does.

    ``offset == 0`` (Llama): ``w * cast(x_normed)``. ``offset == 1`` (Gemma): ``cast(x_normed *
    (1 + w))``, the scale applied in fp32 before the cast, as transformers' Gemma3RMSNorm does.
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if offset:
        return (xf * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * xf.astype(x.dtype)


def _norm(cfg: ModelConfig, x: jax.Array, weight: jax.Array) -> jax.Array:
    return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_weight_offset)


def attention_window(cfg: ModelConfig, layer: jax.Array) -> int | jax.Array | None:
    """The sliding window of layer ``layer`` (a traced index inside the layer scan).

    A static ``int``/``None`` when every layer has the same window (Mistral, Llama, Qwen), so the
    attention dispatch keeps its static-window paths; with per-layer windows (Gemma 3) a traced
    int32 scalar from the per-layer table, `NO_WINDOW` on full-attention layers.
    """
    if not cfg.per_layer_attention:
        return cfg.sliding_window
    return jnp.asarray(np.asarray(cfg.layer_windows(), np.int32))[layer]


def embed(params: Params, tokens: jax.Array) -> jax.Array:
    """Token embeddings (times ``sqrt(hidden_size)`` in the weights' dtype when the config scales them)."""
    x = jnp.take(params.embed, tokens, axis=0)
    if params.config.scale_embeddings:
        x = x * jnp.asarray(math.sqrt(params.config.hidden_size), x.dtype)
    return x


def logits_from_hidden(params: Params, hidden: jax.Array) -> jax.Array:
    """Final norm + LM head → fp32 logits (soft-capped when the config says so)."""
    return _lm_head(params, _norm(params.config, hidden, params.final_norm))


def last_token_logits(params: Params, hidden: jax.Array, lengths: jax.Array, *,
                      norm_every_position: bool = False) -> jax.Array:
    """fp32 logits ``[B, V]`` at each row's last real token of ``hidden`` ``[B, T, H]``.

    ``norm_every_position`` applies the final norm to every position before taking the last, so
    the LM head's dot reads a gather instead of the norm's multiply. XLA:CPU's oneDNN dot fusion
    (`Backend.prefill_dots`) takes a lone elementwise producer into the dot, and oneDNN cannot run
    that; a gather stays outside. It costs one norm over ``[B, T, H]`` (used on a CPU only).
    """
    last = (lengths - 1)[:, None, None]
    if norm_every_position:
        normed = _norm(params.config, hidden, params.final_norm)
        return _lm_head(params, jnp.take_along_axis(normed, last, axis=1)[:, 0])
    return logits_from_hidden(params, jnp.take_along_axis(hidden, last, axis=1)[:, 0])


def _lm_head(params: Params, h: jax.Array) -> jax.Array:
    cfg = params.config
    w = params.embed.T if params.lm_head is None else params.lm_head
    logits = jnp.einsum("...h,hv->...v", h, w, preferred_element_type=jnp.float32)
    if cfg.final_logit_softcapping is not None:
        cap = cfg.final_logit_softcapping
        logits = cap * jnp.tanh(logits / cap)
    return logits


MatMul = Callable[[jax.Array, str], jax.Array]  # (activations [..., K], weight name) -> [..., N]


def slice_matmul(lw: LayerParams) -> MatMul:
    """Matmuls against the layer's own weight arrays (what the layer scan hands each layer)."""
    return lambda h, name: h @ getattr(lw, name)


def stacked_matmul(params: Params, layer: jax.Array, interpret: bool | None = None, mesh: Any = None) -> MatMul:
    """Matmuls that read layer ``layer`` of the stacked weights in the Pallas kernel (no slice);
    ``interpret`` defaults to off a GPU; on a ``mesh`` the kernel runs per device
    (`sparsekv_jax.pallas.dispatch.layer_matmul`)."""
    from sparsekv_jax.backend import Backend
    from sparsekv_jax.pallas import dispatch

    backend = Backend(interpret=interpret, mesh=mesh)

    def mm(h: jax.Array, name: str) -> jax.Array:
        w = getattr(params.layers, name)
        out = dispatch.layer_matmul(backend, name, h.reshape(-1, h.shape[-1]), w, layer)
        return out.reshape(*h.shape[:-1], w.shape[-1])

    return mm


def qkv_projection(params: Params, lw: LayerParams, x: jax.Array, positions: jax.Array, mm: MatMul | None = None,
                   inv_freq: np.ndarray | jax.Array | None = None):
    """Normed input → RoPE'd q ``[B,T,Hq,D]``, k ``[B,T,Hkv,D]`` and v for one layer.

    ``inv_freq`` is the layer's RoPE table (default: the model's single one). With
    ``query_pre_attn_scalar`` set, q is scaled by ``sqrt(head_dim / query_pre_attn_scalar)`` so
    that the attention's ``1 / sqrt(head_dim)`` gives Gemma's ``query_pre_attn_scalar ** -0.5``.
    """
    cfg = params.config
    B, T, _ = x.shape
    mm = slice_matmul(lw) if mm is None else mm
    h = _norm(cfg, x, lw.attn_norm)
    q = mm(h, "wq")
    k = mm(h, "wk")
    v = mm(h, "wv")
    if lw.bq is not None:
        q, k, v = q + lw.bq, k + lw.bk, v + lw.bv
    q = q.reshape(B, T, cfg.num_heads, cfg.head_dim)
    k = k.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    v = v.reshape(B, T, cfg.num_kv_heads, cfg.head_dim)
    if lw.q_norm is not None:
        q = _norm(cfg, q, lw.q_norm)
        k = _norm(cfg, k, lw.k_norm)
    inv_freq = inverse_frequencies(cfg) if inv_freq is None else inv_freq
    q = apply_rope(q, positions, inv_freq)
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim:
        q = q * jnp.asarray(math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar), q.dtype)
    return q, apply_rope(k, positions, inv_freq), v


def mlp(params: Params, lw: LayerParams, x: jax.Array, mm: MatMul | None = None) -> jax.Array:
    """Pre-norm gated MLP: SiLU (Llama) or GELU-tanh (Gemma) gate; Gemma's post-MLP norm when present."""
    cfg = params.config
    mm = slice_matmul(lw) if mm is None else mm
    h = _norm(cfg, x, lw.mlp_norm)
    gate = mm(h, "w_gate")
    gate = jax.nn.gelu(gate, approximate=True) if cfg.hidden_act == "gelu_tanh" else jax.nn.silu(gate)
    out = mm(gate * mm(h, "w_up"), "w_down")
    if lw.post_mlp_norm is not None:
        out = _norm(cfg, out, lw.post_mlp_norm)
    return out


def forward(params: Params, tokens: jax.Array, positions: jax.Array, layer_caches: Any,
            attend: AttendFn, *, hidden_in: jax.Array | None = None, carried: Any = None,
            unroll: int | bool = 1, weights_by_index: bool = False, interpret: bool | None = None,
            mesh: Any = None):
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
    ``interpret``, per device on ``mesh``) instead of the scan's slice of them.
    """
    x = embed(params, tokens) if hidden_in is None else hidden_in

    def layer(carry, xs):
        x, state = carry
        lw, kv, idx, inv_freq = xs

        def attention(q, k, v, x):
            nonlocal kv, state
            if carried is None:
                out, kv, extras = attend(q, k, v, kv, idx, x)
            else:
                out, (kv, state), extras = attend(q, k, v, (kv, state), idx, x)
            return out, extras

        x, extras = decoder_layer(params, lw, x, positions, idx, inv_freq, attention, weights_by_index, interpret,
                                   mesh)
        return (x, state), (kv, extras)

    (x, state), (new_caches, extras) = jax.lax.scan(
        layer, (x, carried), (params.layers, layer_caches, jnp.arange(params.config.num_layers),
                              _rope_tables(params.config)), unroll=unroll)
    if carried is None:
        return x, new_caches, extras
    return x, (new_caches, state), extras


def _rope_tables(cfg: ModelConfig) -> jax.Array | None:
    """Per-layer RoPE tables riding the scan (Gemma 3: local and global bases), or None (one static table)."""
    return jnp.asarray(layer_inverse_frequencies(cfg), jnp.float32) if cfg.per_layer_attention else None


def decoder_layer(params: Params, lw: LayerParams, x: jax.Array, positions: jax.Array, idx: jax.Array,
                  inv_freq: jax.Array | None, attention: Callable, weights_by_index: bool, interpret: bool | None,
                  mesh: Any = None):
    """One decoder layer around ``attention(q, k, v, x) -> (out [B, T, Hq, D], extras)``: the block
    every forward pass here runs, and the one S3's retrieval scan runs layer by layer (so its keys
    and queries are the model's own, per-layer windows and norms included)."""
    cfg = params.config
    mm = stacked_matmul(params, idx, interpret, mesh) if weights_by_index else slice_matmul(lw)
    q, k, v = qkv_projection(params, lw, x, positions, mm, inv_freq)
    out, extras = attention(q, k, v, x)
    B, T = out.shape[:2]
    attn = mm(out.reshape(B, T, cfg.num_heads * cfg.head_dim), "wo")
    if lw.post_attn_norm is not None:
        attn = _norm(cfg, attn, lw.post_attn_norm)
    x = x + attn
    return x + mlp(params, lw, x, mm), extras


def interleaving(cfg: ModelConfig) -> tuple[int, int, int]:
    """``(k, n, r)`` of a model whose layers are ``n`` groups of ``k`` local layers then one global layer,
    followed by ``r <= k`` local layers (every Gemma 3: ``k = 5``; the 270M ``n = 3, r = 0``, the 1B
    ``n = 4, r = 2``); ``ValueError`` for any other arrangement."""
    types = cfg.layer_types or ()
    n = types.count("full_attention")
    k = types.index("full_attention") if n else 0
    r = cfg.num_layers - n * (k + 1)
    want = (("sliding_attention",) * k + ("full_attention",)) * n + ("sliding_attention",) * r
    if not n or not k or r < 0 or r > k or tuple(types) != want:
        raise ValueError(f"layer_types {types} are not groups of local layers each followed by one global layer")
    return k, n, r


def forward_interleaved(params: Params, tokens: jax.Array, positions: jax.Array, global_caches: Any,
                        local_caches: Any, attend_global: AttendFn, attend_local: AttendFn, *,
                        carried: Any = None, unroll: int | bool = 1, weights_by_index: bool = False,
                        interpret: bool | None = None, mesh: Any = None):
    """`forward` for a model whose local (sliding-window) layers keep a cache of their own (Gemma 3's rings).

    The caches differ in shape (a ring of the window per local layer, the policy's cache per global
    layer) and in number, so they cannot ride one scan over the layers as per-layer ``xs``. Gemma 3's
    layers are groups of ``k`` local layers each followed by one global layer, then ``r`` local ones
    (`interleaving`): the layers run as a `lax.scan` over the groups, each step an inner `lax.scan` over
    its local layers (their rings as ``xs``) then the global layer (its cache as ``xs``, or through
    ``carried`` as in `forward`), and one more inner scan for the ``r`` trailing local layers. Every
    layer's kind, window and RoPE base are static, so the local layers' one-pass prefill is cuDNN's
    (or the CPU's blocked) sliding-window attention, not an explicit ``[T, T]`` mask, and no buffer
    passes through a `lax.cond`: a first version chose the kind per layer under a `cond` in one scan
    over the layers, and XLA copied the whole global cache through both branches at every layer.
    Weights are read by layer index (the slice a scan over them would take; none with
    ``weights_by_index``).

    ``attend_local(q, k, v, ring, j, hidden) -> (out, ring, extras)`` gets local layer ``j``'s ring
    (``local_caches`` ``[Ll, ...]``); ``attend_global`` gets global layer ``g``'s slice of
    ``global_caches`` ``[Lg, ...]`` and, with ``carried``, ``(slice or None, carried)`` as `forward` does
    (decode on a GPU carries the whole cache and its kernels read layer ``g`` in place). The index an
    ``attend`` receives is the layer's rank among its kind. Returns ``(hidden, (global_caches,
    local_caches[, carried]), (global extras stacked [Lg, ...], local extras stacked [Ll, ...]))``.
    """
    cfg = params.config
    k, n, r = interleaving(cfg)
    local_freq = inverse_frequencies(cfg, cfg.rope_local_theta)
    global_freq = inverse_frequencies(cfg)
    x = embed(params, tokens)

    def local_layers(x, rings, ranks, ids):
        def body(x, xs):
            ring, j, idx = xs

            def attention(q, kk, vv, h):
                nonlocal ring
                out, ring, extras = attend_local(q, kk, vv, ring, j, h)
                return out, extras

            x, extras = decoder_layer(params, layer_view_of(params.layers, idx), x, positions, idx, local_freq,
                                       attention, weights_by_index, interpret, mesh)
            return x, (ring, extras)

        x, (rings, extras) = jax.lax.scan(body, x, (rings, ranks, ids), unroll=unroll)
        return x, rings, extras

    def group(carry, xs):
        x, state = carry
        kv, rings, g = xs
        x, rings, local_extras = local_layers(x, rings, g * k + jnp.arange(k), g * (k + 1) + jnp.arange(k))
        idx = g * (k + 1) + k

        def attention(q, kk, vv, h):
            nonlocal kv, state
            if carried is None:
                out, kv, extras = attend_global(q, kk, vv, kv, g, h)
            else:
                out, (kv, state), extras = attend_global(q, kk, vv, (kv, state), g, h)
            return out, extras

        x, global_extras = decoder_layer(params, layer_view_of(params.layers, idx), x, positions, idx,
                                          global_freq, attention, weights_by_index, interpret, mesh)
        return (x, state), (kv, rings, global_extras, local_extras)

    grouped = jax.tree.map(lambda a: a[:n * k].reshape(n, k, *a.shape[1:]), local_caches)
    (x, state), (global_caches, rings, global_extras, local_extras) = jax.lax.scan(
        group, (x, carried), (global_caches, grouped, jnp.arange(n)), unroll=unroll)
    flat = lambda t: jax.tree.map(lambda a: a.reshape(n * k, *a.shape[2:]), t)  # noqa: E731
    rings, local_extras = flat(rings), flat(local_extras)
    if r:  # the trailing local layers
        tail = jax.tree.map(lambda a: a[n * k:], local_caches)
        x, tail, tail_extras = local_layers(x, tail, n * k + jnp.arange(r), n * (k + 1) + jnp.arange(r))
        cat = lambda a, b: jnp.concatenate([a, b])  # noqa: E731
        rings, local_extras = jax.tree.map(cat, rings, tail), jax.tree.map(cat, local_extras, tail_extras)
    caches = (global_caches, rings) if carried is None else (global_caches, rings, state)
    return x, caches, (global_extras, local_extras)


class StackOut(NamedTuple):
    """What `LayerStack` returns, whatever the caches: ``hidden`` ``[B, T, H]``, ``caches`` (the
    per-layer caches or carried state, updated), ``local`` (the local layers' rings, updated; ``None``
    without rings), ``extras`` (what ``attend`` returned, stacked over its layers) and ``ring_extras``
    (what ``ring_attend`` returned, stacked over the local layers; ``None`` without rings)."""

    hidden: jax.Array
    caches: Any
    local: Any
    extras: Any
    ring_extras: Any


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """The model's layers over a cache, hiding how the cache is laid out and passed.

    Uniform caches (every layer's cache stacked ``[L, ...]``: `forward`) or rings for the local
    layers beside the global layers' caches (Gemma 3: `forward_interleaved`, chosen by ``local`` not
    being ``None``); ``caches`` scanned as per-layer inputs or, with ``carry``, riding the scan's carry
    (``attend`` then gets ``(None, caches)`` and returns it updated, as `forward` describes). The other
    fields are `forward`'s options. Calling it always returns a `StackOut`."""

    carry: bool = False
    unroll: int | bool = 1
    weights_by_index: bool = False
    interpret: bool | None = None
    mesh: Any = None

    def __call__(self, params: Params, tokens: jax.Array, positions: jax.Array, caches: Any, local: Any,
                 attend: AttendFn, ring_attend: AttendFn | None = None) -> StackOut:
        """All layers over ``tokens`` ``[B, T]`` at ``positions``; ``ring_attend`` serves the local
        layers when ``local`` holds their rings."""
        opts = dict(unroll=self.unroll, weights_by_index=self.weights_by_index, interpret=self.interpret,
                    mesh=self.mesh)
        scanned, carried = (None, caches) if self.carry else (caches, None)
        if local is None:
            hidden, new, extras = forward(params, tokens, positions, scanned, attend, carried=carried, **opts)
            return StackOut(hidden, new[1] if self.carry else new, None, extras, None)
        hidden, new, (extras, ring_extras) = forward_interleaved(params, tokens, positions, scanned, local, attend,
                                                                 ring_attend, carried=carried, **opts)
        return StackOut(hidden, new[2] if self.carry else new[0], new[1], extras, ring_extras)


def layer_view_of(tree: Any, i: jax.Array) -> Any:
    """Entry ``i`` of every leaf's leading axis (a traced index)."""
    return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, keepdims=False), tree)
