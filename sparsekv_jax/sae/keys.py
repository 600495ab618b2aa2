"""Pre-RoPE key (and query) projections of chosen layers, from one forward pass.

Why pre-RoPE: RoPE rotates each key by an angle proportional to its position, so the same
content at two positions gives two different post-RoPE vectors, and a feature learned on them
would partly encode position. S³ matches query features to key features across arbitrary
distances, so the SAEs see (and S³ encodes) keys and queries *before* the rotation: exactly what
the model's ``k_proj`` (plus Qwen2's bias and Qwen3's k-norm) produces.

How: the model port (`sparsekv_jax.models.transformer.forward`) hands every layer's RoPE'd
q/k to an ``attend`` callback. `projections` runs the forward with dense causal attention and, at
the target layers only, rotates q/k back by their negated positions (exact up to fp32 rounding;
a bf16 model's keys carry its own bf16 rounding) into a carried buffer of
``[n_targets, B, T, H, D]``, so memory is bounded by the chunk, not by the layer count. Layers
after the deepest target are not run.

Models whose layers differ (Gemma 3: sliding-window local layers at one RoPE base, global layers at
another) are handled per layer inside the scan: `layer_inverse_frequency` gives the layer's RoPE
table (so each layer's keys are un-rotated by the base they were rotated with) and `layer_attention`
runs the layer's own window (a `lax.cond` between two static windows, so cuDNN's and the CPU's
blocked attention keep their static-window paths). Gemma's query scaling
(``query_pre_attn_scalar``) is undone too (`pre_rope_queries`): the queries are ``q_proj`` (+ q-norm)
outputs, as the keys are ``k_proj``'s.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import Params
from sparsekv_jax.models.rope import apply_rope, inverse_frequencies, layer_inverse_frequencies
from sparsekv_jax.models.transformer import forward


def unrotate(x: jax.Array, positions: jax.Array, params_or_inv_freq) -> jax.Array:
    """Undo RoPE: ``x`` ``[..., T, H, D]`` rotated at ``positions`` ``[..., T]`` → the pre-RoPE vectors (fp32)."""
    inv = inverse_frequencies(params_or_inv_freq.config) if isinstance(params_or_inv_freq, Params) \
        else params_or_inv_freq
    return apply_rope(x.astype(jnp.float32), -positions, inv)


def layer_inverse_frequency(cfg: ModelConfig, layer: jax.Array) -> np.ndarray | jax.Array:
    """The RoPE table ``[D/2]`` of layer ``layer`` (a traced index inside the layer scan): the model's one
    table, or with per-layer RoPE bases (Gemma 3) that layer's row of the per-layer tables."""
    if not cfg.per_layer_attention:
        return inverse_frequencies(cfg)
    return jnp.asarray(layer_inverse_frequencies(cfg), jnp.float32)[layer]


def layer_attention(cfg: ModelConfig, layer: jax.Array, attend: Callable[[int | None], jax.Array]) -> jax.Array:
    """``attend(window)`` with layer ``layer``'s sliding window (``None``: full causal attention).

    One call with the model's static window when every layer has the same one; with per-layer windows
    (Gemma 3's local and global layers) a `lax.cond` between ``attend(sliding_window)`` and
    ``attend(None)`` on the traced layer index, both with static windows."""
    if not cfg.per_layer_attention:
        return attend(cfg.sliding_window)
    windows = cfg.layer_windows()
    local = jnp.asarray(np.asarray([w == cfg.sliding_window for w in windows]))[layer]
    return jax.lax.cond(local, lambda: attend(cfg.sliding_window), lambda: attend(None))


def pre_rope_queries(cfg: ModelConfig, q: jax.Array, positions: jax.Array, inv_freq) -> jax.Array:
    """The model's RoPE'd (and, for Gemma 3, ``query_pre_attn_scalar``-scaled) queries → ``q_proj``'s
    pre-RoPE queries (after any q-norm), fp32."""
    q = unrotate(q, positions, inv_freq)
    if cfg.query_pre_attn_scalar is not None and cfg.query_pre_attn_scalar != cfg.head_dim:
        q = q * (1.0 / math.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar))
    return q


def check_layers(layers: tuple[int, ...], num_layers: int) -> tuple[int, ...]:
    """Validate target layer indices (distinct, in range); returns them as a tuple."""
    layers = tuple(int(i) for i in layers)
    if not layers:
        raise ValueError("no target layers given")
    if len(set(layers)) != len(layers):
        raise ValueError(f"target layers {layers} repeat a layer")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"target layers {bad} are outside the model's {num_layers} layers")
    return layers


def truncate(params: Params, num_layers: int) -> Params:
    """The first ``num_layers`` layers of ``params`` (the rest is never needed for their keys)."""
    if num_layers == params.config.num_layers:
        return params
    types = params.config.layer_types
    cfg = dataclasses.replace(params.config, num_layers=num_layers,
                              layer_types=None if types is None else types[:num_layers])
    layers = jax.tree.map(lambda a: a[:num_layers], params.layers)
    return params.replace(layers=layers, config=cfg)


@partial(jax.jit, static_argnames=("layers", "queries", "attention"))
def projections(params: Params, tokens: jax.Array, layers: tuple[int, ...], *, queries: bool = False,
                attention: str = "xla") -> tuple[jax.Array, jax.Array | None]:
    """Pre-RoPE keys ``[n, B, T, Hkv, D]`` (and queries ``[n, B, T, Hq, D]``) of ``layers``, fp32.

    ``tokens`` ``[B, T]`` are whole rows at positions ``0 .. T-1``. ``attention``: ``"xla"`` or
    ``"cudnn"`` (`jax.nn.dot_product_attention`; cuDNN needs bf16/fp16 weights).
    """
    cfg = params.config
    check_layers(layers, cfg.num_layers)
    params = truncate(params, max(layers) + 1)
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    slot_of = jnp.full((params.config.num_layers,), -1, jnp.int32).at[jnp.asarray(layers)].set(
        jnp.arange(len(layers), dtype=jnp.int32))
    n = len(layers)
    buf = {"k": jnp.zeros((n, B, T, cfg.num_kv_heads, cfg.head_dim), jnp.float32)}
    if queries:
        buf["q"] = jnp.zeros((n, B, T, cfg.num_heads, cfg.head_dim), jnp.float32)

    def keep(store, value, slot):
        i = jnp.maximum(slot, 0)
        new = jnp.where(slot >= 0, value, store[i])
        return jax.lax.dynamic_update_index_in_dim(store, new, i, 0)

    def attend(q, k, v, cache_and_buf, idx, hidden):
        del hidden
        cache, store = cache_and_buf
        out = layer_attention(cfg, idx, lambda w: jax.nn.dot_product_attention(
            q, k, v, is_causal=True, local_window_size=None if w is None else (w - 1, 0), implementation=attention))
        slot = slot_of[idx]
        inv = layer_inverse_frequency(cfg, idx)
        store = dict(store, k=keep(store["k"], unrotate(k, positions, inv), slot))
        if queries:
            store["q"] = keep(store["q"], pre_rope_queries(cfg, q, positions, inv), slot)
        return out, (cache, store), None

    dummy = jnp.zeros((params.config.num_layers,), jnp.int8)  # no KV cache: one scanned placeholder
    _, (_, store), _ = forward(params, tokens, positions, dummy, attend, carried=buf)
    return store["k"], store.get("q")
