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
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from sparsekv_jax.models.params import Params
from sparsekv_jax.models.rope import apply_rope, inverse_frequencies
from sparsekv_jax.models.transformer import forward


def unrotate(x: jax.Array, positions: jax.Array, params_or_inv_freq) -> jax.Array:
    """Undo RoPE: ``x`` ``[..., T, H, D]`` rotated at ``positions`` ``[..., T]`` → the pre-RoPE vectors (fp32)."""
    inv = inverse_frequencies(params_or_inv_freq.config) if isinstance(params_or_inv_freq, Params) \
        else params_or_inv_freq
    return apply_rope(x.astype(jnp.float32), -positions, inv)


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
    cfg = dataclasses.replace(params.config, num_layers=num_layers)
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
    inv = inverse_frequencies(cfg)
    slot_of = jnp.full((params.config.num_layers,), -1, jnp.int32).at[jnp.asarray(layers)].set(
        jnp.arange(len(layers), dtype=jnp.int32))
    window = None if cfg.sliding_window is None else (cfg.sliding_window - 1, 0)
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
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, local_window_size=window,
                                           implementation=attention)
        slot = slot_of[idx]
        store = dict(store, k=keep(store["k"], unrotate(k, positions, inv), slot))
        if queries:
            store["q"] = keep(store["q"], unrotate(q, positions, inv), slot)
        return out, (cache, store), None

    dummy = jnp.zeros((params.config.num_layers,), jnp.int8)  # no KV cache: one scanned placeholder
    _, (_, store), _ = forward(params, tokens, positions, dummy, attend, carried=buf)
    return store["k"], store.get("q")
