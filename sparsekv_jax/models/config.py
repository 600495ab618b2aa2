"""Model configuration shared by every family port.

`ModelConfig` is frozen and hashable: it rides along as static aux data of `Params`, so a
jitted function that receives params knows the architecture without extra arguments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "gemma3")
HIDDEN_ACTS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
# The window a full-attention layer gets when windows are per-layer arrays (`layer_windows`):
# larger than any position, so ``k > q - window`` always holds.
NO_WINDOW = 1 << 30

# HF `architectures` / `model_type` values we map onto a family.
_ARCH_TO_FAMILY = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
}
_MODEL_TYPE_TO_FAMILY = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral",
                         "gemma3_text": "gemma3"}


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
    ``p - sliding_window < k <= p`` (Mistral's convention in transformers). With
    ``layer_types`` set, the window applies only to the ``"sliding_attention"`` layers (Gemma 3's
    local layers); without it, to every layer (Mistral).

    Gemma 3 is data here too: ``hidden_act="gelu_tanh"``; ``norm_weight_offset=1.0`` (RMSNorm
    scales by ``1 + w``, multiplied in fp32 before the cast back); ``sandwich_norms`` (a norm after
    attention and after the MLP, before each residual add; ``mlp_norm`` is the pre-MLP norm);
    ``scale_embeddings`` (embeddings times ``sqrt(hidden_size)``, rounded to the weights' dtype);
    ``query_pre_attn_scalar`` (scores scaled by ``query_pre_attn_scalar ** -0.5`` instead of
    ``head_dim ** -0.5``); ``rope_local_theta`` (the RoPE base of the sliding layers);
    ``final_logit_softcapping`` (``c * tanh(logits / c)``).
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
    hidden_act: str = "silu"
    norm_weight_offset: float = 0.0
    sandwich_norms: bool = False
    scale_embeddings: bool = False
    query_pre_attn_scalar: float | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    final_logit_softcapping: float | None = None

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
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not one of {HIDDEN_ACTS}")
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", tuple(self.layer_types))  # hashable (e.g. read from JSON)
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise ValueError(f"layer_types {bad} are not among {LAYER_TYPES}")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                raise ValueError("sliding_attention layers need a sliding_window")
        if self.query_pre_attn_scalar is not None and self.query_pre_attn_scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar={self.query_pre_attn_scalar} must be positive")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            raise ValueError(f"final_logit_softcapping={self.final_logit_softcapping} must be positive")

    @property
    def per_layer_attention(self) -> bool:
        """Whether layers differ in window or RoPE base (then both are per-layer arrays in the scan)."""
        return self.layer_types is not None

    def layer_windows(self) -> tuple[int, ...]:
        """Per-layer sliding window (`NO_WINDOW` for full-attention layers); needs ``layer_types``."""
        if self.layer_types is None:
            raise ValueError("layer_windows() needs layer_types")
        return tuple(self.sliding_window if t == "sliding_attention" else NO_WINDOW for t in self.layer_types)

    def layer_rope_thetas(self) -> tuple[float, ...]:
        """Per-layer RoPE base: ``rope_local_theta`` (else ``rope_theta``) on sliding layers."""
        local = self.rope_theta if self.rope_local_theta is None else self.rope_local_theta
        types = self.layer_types or ("full_attention",) * self.num_layers
        return tuple(local if t == "sliding_attention" else self.rope_theta for t in types)

    def local_layer_ids(self) -> tuple[int, ...]:
        """Model indices of the sliding-window (local) layers named in ``layer_types`` (none without it)."""
        return tuple(i for i, t in enumerate(self.layer_types or ()) if t == "sliding_attention")

    def global_layer_ids(self) -> tuple[int, ...]:
        """Model indices of the full-attention (global) layers: every layer without ``layer_types``."""
        local = set(self.local_layer_ids())
        return tuple(i for i in range(self.num_layers) if i not in local)

    @property
    def interleaved(self) -> bool:
        """Local and global layers interleaved (Gemma 3): local layers can keep a ring buffer of their
        window while the global layers keep the policy's cache (`sparsekv_jax.generate`)."""
        return bool(self.local_layer_ids()) and bool(self.global_layer_ids())

    def global_view(self) -> ModelConfig:
        """The global layers as a model of their own: what a KV policy manages when the local layers keep
        ring buffers (``num_layers`` = the global layers, their RoPE base, no window, no layer types)."""
        return dataclasses.replace(self, num_layers=len(self.global_layer_ids()), layer_types=None,
                                   sliding_window=None, rope_local_theta=None)

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
        per_layer = attn + 3 * h * i + (4 if self.sandwich_norms else 2) * h
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
        if family == "gemma3":
            return cls._gemma3_from_hf_dict(cfg)
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

    @classmethod
    def _gemma3_from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Gemma 3 text config (``Gemma3TextConfig``, transformers 4.50+ and 5.x layouts)."""
        for key, ok in (("attn_logit_softcapping", None), ("use_bidirectional_attention", False),
                        ("attention_bias", False)):
            if cfg.get(key) not in (ok, None):
                raise ValueError(f"gemma3 with {key}={cfg[key]!r} is not supported")
        act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"gemma3 with hidden_activation={act!r} is not supported")
        n_layers = cfg["num_hidden_layers"]
        types = cfg.get("layer_types")
        if types is None:  # older configs: every `sliding_window_pattern`-th layer is global
            pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n_layers)]
        rp = cfg.get("rope_parameters")
        if isinstance(rp, dict) and "full_attention" in rp:  # transformers >= 5: one dict per layer type
            full, local = rp.get("full_attention") or {}, rp.get("sliding_attention") or {}
        else:
            full = dict(cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta", 1_000_000.0))
            local = {"rope_theta": cfg.get("rope_local_base_freq", 10_000.0)}
        for name, r in (("full_attention", full), ("sliding_attention", local)):
            rtype = r.get("rope_type", r.get("type", "default"))
            if rtype not in (None, "default"):
                raise ValueError(f"gemma3 {name} rope scaling type {rtype!r} is not supported")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        num_heads = cfg["num_attention_heads"]
        return cls(
            family="gemma3",
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            num_layers=n_layers,
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            intermediate_size=cfg["intermediate_size"],
            rope_theta=float(full.get("rope_theta", 1_000_000.0)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            qk_norm=True,
            sliding_window=int(cfg["sliding_window"]) if "sliding_attention" in types else cfg.get("sliding_window"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 131072)),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            hidden_act="gelu_tanh",
            norm_weight_offset=1.0,
            sandwich_norms=True,
            scale_embeddings=True,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
            layer_types=tuple(types),
            rope_local_theta=float(local.get("rope_theta", 10_000.0)),
            final_logit_softcapping=cfg.get("final_logit_softcapping"),
        )


def gemma3_config(*, vocab_size: int, hidden_size: int, num_layers: int, num_heads: int, num_kv_heads: int,
                  head_dim: int, intermediate_size: int, sliding_window: int = 512, pattern: int = 6,
                  query_pre_attn_scalar: float = 256.0, rope_theta: float = 1_000_000.0,
                  rope_local_theta: float = 10_000.0, max_position_embeddings: int = 32768,
                  final_logit_softcapping: float | None = None, **kw: Any) -> ModelConfig:
    """A Gemma 3 config: every ``pattern``-th layer global, the others sliding (``pattern - 1`` : 1)."""
    types = tuple("sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers))
    return ModelConfig(
        family="gemma3", vocab_size=vocab_size, hidden_size=hidden_size, num_layers=num_layers,
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
        rope_theta=rope_theta, rms_norm_eps=kw.pop("rms_norm_eps", 1e-6), qk_norm=True,
        sliding_window=sliding_window, tie_word_embeddings=kw.pop("tie_word_embeddings", True),
        max_position_embeddings=max_position_embeddings, hidden_act="gelu_tanh", norm_weight_offset=1.0,
        sandwich_norms=True, scale_embeddings=True, query_pre_attn_scalar=query_pre_attn_scalar,
        layer_types=types, rope_local_theta=rope_local_theta, final_logit_softcapping=final_logit_softcapping,
        **kw)


def gemma3_270m_config() -> ModelConfig:
    """Gemma 3 270M's shapes: 18 layers (5 sliding : 1 global, window 512), 4 query / 1 KV head,
    head_dim 256, 262k vocabulary, 32k context."""
    return gemma3_config(vocab_size=262144, hidden_size=640, num_layers=18, num_heads=4, num_kv_heads=1,
                         head_dim=256, intermediate_size=2048, bos_token_id=2, eos_token_ids=(1,))


def llama31_8b_config() -> ModelConfig:
    """Llama-3.1-8B's shapes (for speed work with random weights)."""
    return ModelConfig(
        family="llama", vocab_size=128256, hidden_size=4096, num_layers=32, num_heads=32,
        num_kv_heads=8, head_dim=128, intermediate_size=14336, rope_theta=500000.0,
        rope_scaling=RopeScaling(8.0, 1.0, 4.0, 8192), rms_norm_eps=1e-5,
        max_position_embeddings=131072, bos_token_id=128000, eos_token_ids=(128001, 128008, 128009),
    )


def qwen25_coder_15b_config() -> ModelConfig:
    """Qwen2.5-Coder-1.5B-Instruct's shapes (for speed work with random weights; the config `load` reads from the
    GGUF of ``"qwen2.5-coder-1.5b"``): 28 layers, 12 query / 2 KV heads of 128, q/k/v biases, untied head."""
    return ModelConfig(
        family="qwen2", vocab_size=151936, hidden_size=1536, num_layers=28, num_heads=12,
        num_kv_heads=2, head_dim=128, intermediate_size=8960, rope_theta=1000000.0, rms_norm_eps=1e-6,
        qkv_bias=True, max_position_embeddings=32768, bos_token_id=151643, eos_token_ids=(151645,),
    )


def smollm2_135m_config() -> ModelConfig:
    """SmolLM2-135M-Instruct's shapes (the embedded model)."""
    return ModelConfig(
        family="llama", vocab_size=49152, hidden_size=576, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, intermediate_size=1536, rope_theta=100000.0,
        rms_norm_eps=1e-5, tie_word_embeddings=True, max_position_embeddings=8192,
        bos_token_id=1, eos_token_ids=(2,),
    )
