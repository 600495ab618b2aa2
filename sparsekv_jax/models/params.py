"""The `Params` pytree: weights of a decoder-only transformer, stacked over layers.

Per-layer weights carry a leading ``num_layers`` axis so the forward pass is one `lax.scan`.
Projection matrices are stored ``[in, out]`` (``x @ w``). Optional pieces (qkv bias, q/k
norm, an untied LM head) are ``None`` when the family does not have them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax.models.config import ModelConfig


@struct.dataclass
class LayerParams:
    """Weights of all layers, each with a leading ``[num_layers]`` axis."""

    attn_norm: jax.Array  # [L, H]
    wq: jax.Array  # [L, H, Hq*D]
    wk: jax.Array  # [L, H, Hkv*D]
    wv: jax.Array  # [L, H, Hkv*D]
    wo: jax.Array  # [L, Hq*D, H]
    mlp_norm: jax.Array  # [L, H]
    w_gate: jax.Array  # [L, H, I]
    w_up: jax.Array  # [L, H, I]
    w_down: jax.Array  # [L, I, H]
    bq: jax.Array | None = None  # [L, Hq*D]   (Qwen2)
    bk: jax.Array | None = None  # [L, Hkv*D]
    bv: jax.Array | None = None  # [L, Hkv*D]
    q_norm: jax.Array | None = None  # [L, D]  (Qwen3)
    k_norm: jax.Array | None = None  # [L, D]
    post_attn_norm: jax.Array | None = None  # [L, H]  (Gemma 3: after attention, before the residual add)
    post_mlp_norm: jax.Array | None = None  # [L, H]  (Gemma 3: after the MLP, before the residual add)


@struct.dataclass
class Params:
    """Model weights plus the static `ModelConfig` (aux data, not a leaf)."""

    embed: jax.Array  # [V, H]
    layers: LayerParams
    final_norm: jax.Array  # [H]
    lm_head: jax.Array | None  # [H, V]; None when tied to `embed`
    config: ModelConfig = struct.field(pytree_node=False)

    @property
    def dtype(self) -> jnp.dtype:
        return self.embed.dtype

    def astype(self, dtype: jnp.dtype) -> Params:
        """All weights cast to ``dtype`` (bf16 or fp32)."""
        return jax.tree.map(lambda x: x.astype(dtype), self)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every weight, keyed by `LayerParams`/`Params` field name (layer fields with L)."""
    L, H, I, D = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_heads * D, cfg.num_kv_heads * D
    shapes = {
        "embed": (cfg.vocab_size, H), "final_norm": (H,),
        "attn_norm": (L, H), "wq": (L, H, q), "wk": (L, H, kv), "wv": (L, H, kv), "wo": (L, q, H),
        "mlp_norm": (L, H), "w_gate": (L, H, I), "w_up": (L, H, I), "w_down": (L, I, H),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (H, cfg.vocab_size)
    if cfg.qkv_bias:
        shapes.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if cfg.qk_norm:
        shapes.update(q_norm=(L, D), k_norm=(L, D))
    if cfg.sandwich_norms:
        shapes.update(post_attn_norm=(L, H), post_mlp_norm=(L, H))
    return shapes


def params_from_arrays(cfg: ModelConfig, arrays: dict[str, jax.Array]) -> Params:
    """Assemble `Params` from a flat dict of field name → array, checking every shape."""
    shapes = expected_shapes(cfg)
    missing = sorted(set(shapes) - set(arrays))
    if missing:
        raise ValueError(f"weights missing for {cfg.family}: {missing}")
    for name, shape in shapes.items():
        if tuple(arrays[name].shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(arrays[name].shape)}, expected {shape}")
    layer_fields = {f: arrays.get(f) for f in LayerParams.__dataclass_fields__}
    return Params(
        embed=arrays["embed"], layers=LayerParams(**layer_fields), final_norm=arrays["final_norm"],
        lm_head=arrays.get("lm_head"), config=cfg,
    )


def random_params(cfg: ModelConfig, key: jax.Array, dtype: jnp.dtype = jnp.bfloat16,
                  scale: float = 0.02) -> Params:
    """Random weights of the given shapes (speed work on real model shapes, tests)."""
    shapes = expected_shapes(cfg)
    keys = jax.random.split(key, len(shapes))
    arrays = {}
    for k, (name, shape) in zip(keys, sorted(shapes.items()), strict=True):
        if name.endswith("norm"):  # a scale near 1 under either norm convention (w or 1 + w)
            centre = 1.0 - cfg.norm_weight_offset
            arrays[name] = (centre + 0.1 * jax.random.normal(k, shape)).astype(dtype)
        else:
            arrays[name] = (scale * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
    return params_from_arrays(cfg, arrays)
