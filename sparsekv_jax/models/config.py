"""Model configuration shared by every family port.

`ModelConfig` is frozen and hashable: it rides along as static aux data of `Params`, so a
jitted function that receives params knows the architecture without extra arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral")

# HF `architectures` / `model_type` values we map onto a family.
_ARCH_TO_FAMILY = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
}
_MODEL_TYPE_TO_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (``rope_type == "llama3"``)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters of a decoder-only transformer.

    Attributes follow Hugging Face naming where one exists. ``sliding_window`` is ``None``
    for full attention; when set, a query at position p sees keys at positions
    ``p - sliding_window < k <= p`` (Mistral's convention in transformers).
    """

    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-5
    qk_norm: bool = False
    qkv_bias: bool = False
    sliding_window: int | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not one of {FAMILIES}")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "intermediate_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}={getattr(self, name)} must be positive")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window={self.sliding_window} must be positive or None")

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA ratio)."""
        return self.num_heads // self.num_kv_heads

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """Bytes of K and V stored per token over all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def num_params(self) -> int:
        """Parameter count (embedding counted once when tied)."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads + 2 * self.num_kv_heads) + self.num_heads * d * h
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        per_layer = attn + 3 * h * i + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Parse a Hugging Face ``config.json`` dict.

        Raises ``ValueError`` naming the architecture when it is not one we port, and naming
        the rope type when its scaling is not supported.
        """
        archs = cfg.get("architectures") or []
        family = None
        for arch in archs:
            family = _ARCH_TO_FAMILY.get(arch)
            if family:
                break
        if family is None:
            family = _MODEL_TYPE_TO_FAMILY.get(cfg.get("model_type", ""))
        if family is None:
            name = archs[0] if archs else cfg.get("model_type", "<missing>")
            raise ValueError(
                f"unsupported architecture {name!r}: supported are {sorted(_ARCH_TO_FAMILY)}")
        num_heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        head_dim = cfg.get("head_dim") or hidden // num_heads
        rope_scaling = None
        rs = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        rp = cfg.get("rope_parameters")  # transformers >= 5 folds theta + scaling in here
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default":
                rs = rp
        if rs:
            rtype = rs.get("rope_type", rs.get("type"))
            if rtype == "llama3":
                rope_scaling = RopeScaling(
                    factor=float(rs["factor"]),
                    low_freq_factor=float(rs["low_freq_factor"]),
                    high_freq_factor=float(rs["high_freq_factor"]),
                    original_max_position_embeddings=int(rs["original_max_position_embeddings"]),
                )
            elif rtype not in (None, "default"):
                raise ValueError(f"unsupported rope scaling type {rtype!r}: only 'llama3' is ported")
        sliding = None
        if family == "mistral":
            sliding = cfg.get("sliding_window")
        elif family in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
            raise ValueError(
                f"{family} with use_sliding_window=True is not supported (per-layer windows)")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            family=family,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            intermediate_size=cfg["intermediate_size"],
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=rope_scaling,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qk_norm=family == "qwen3",
            qkv_bias=family == "qwen2" or bool(cfg.get("attention_bias", False)),
            sliding_window=sliding,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def llama31_8b_config() -> ModelConfig:
    """Llama-3.1-8B's shapes (for speed work with random weights)."""
    return ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=14336, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), rms_norm_eps=1e-5,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    )


def smollm2_135m_config() -> ModelConfig:
    """SmolLM2-135M-Instruct's shapes (the embedded model)."""
    return ModelConfig(
        family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, intermediate_size=1536, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192,
        bos_token_id=1, eos_token_ids=(2,),
    )
