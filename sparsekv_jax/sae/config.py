"""Configuration of SAE training: the step's hyperparameters and a whole run's (no JAX import here,
so the ``sparsekv`` command builds its parser quickly)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

SCHEDULES = ("constant", "wsd", "cosine")
TOPK_METHODS = ("auto", "lax", "blocked", "threshold", "fused")
DECODE_METHODS = ("auto", "xla", "pallas")
# `RunConfig` fields that may differ from a run's saved config on resume, when named (``--change``):
# none changes the steps already taken. ``steps`` sets the schedule's length from the checkpoint on
# (the weights equal a run planned that long while the schedule had not yet depended on its length:
# a constant one, or WSD before its decay); the others change logging, checkpoints, evaluation,
# export or the time budget (which only a run's start uses). docs/INTERRUPTION.md.
RESUMABLE_FIELDS = ("steps", "max_minutes", "log_every", "checkpoint_every", "keep_checkpoints", "eval_batch_rows",
                    "eval_max_rows", "export_dtype", "name", "cache_dir")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Hyperparameters of the SAE step (static: hashable, passed to jit as a static value).

    Attributes:
      width: latents per SAE; k: active latents per vector.
      batch_size: vectors per layer per step (converts ``dead_after`` to steps).
      lr, warmup_steps, schedule, decay_fraction: see `sparsekv_jax.sae.optim.lr_at`.
      adam_b1, adam_b2, adam_eps: Adam's constants.
      aux_k: dead latents in the AuxK reconstruction (None: d_in // 2, Gao et al. §B.1).
      aux_coef: AuxK loss weight (1/32 in both references); 0 turns AuxK off.
      dead_after: vectors without firing after which a latent counts as dead.
      dead_bias_step: opt-in, not the paper's nor the references' (0: off): after each optimizer step the
        encoder bias of every dead latent rises by this much (in the pre-activation's units). A latent whose
        pre-activation is <= 0 on every vector gets no gradient from the loss or from AuxK (whose activations
        pass the same ReLU); raising its bias reopens it until it wins top-k slots and the reconstruction trains
        it again (docs/SAE.md, "Why 96–97% of the latents die"). Measured on Qwen2.5-Coder-1.5B at 1e-2: training's
        window 1–3% dead, but 90–93% on held-out keys, and S3Pure 31 RULER points worse: not recommended for S3.
      b_dec_init: ``"geometric_median"`` or ``"mean"`` of the init sample.
      w_dec_init: ``"random"`` (unit Gaussian rows, the references') or ``"data"`` (opt-in: rows drawn from the
        init sample, centred at ``b_dec`` and normalised, with 1% of the random rows mixed in so no two are equal),
        so that every latent starts inside the data's subspace: the low-rank keys of a first layer leave most
        random directions unused from the start (docs/SAE.md, "Why 96–97% of the latents die").
      topk: top-k algorithm (`sparsekv_jax.sae.topk`), or ``"fused"``: the encoder matmul, ReLU and top-k in
        one kernel (`sparsekv_jax.pallas.sae_encode`; what ``"auto"`` takes on a GPU where it applies, with
        fp32 encoder inputs; `sparsekv_jax.sae.model.resolve_select`).
      compute_dtype: ``"float32"`` or ``"bfloat16"`` inputs of the encoder matmul.
      decode: the decoder's gather (`sparsekv_jax.sae.model.decode`): ``"auto"``, ``"xla"``, ``"pallas"``.
    """

    width: int
    k: int
    batch_size: int
    lr: float = 1e-3
    warmup_steps: int = 200
    schedule: str = "wsd"
    decay_fraction: float = 0.2
    adam_b1: float = 0.9
    adam_b2: float = 0.999
    adam_eps: float = 1e-8
    aux_k: int | None = None
    aux_coef: float = 1 / 32
    dead_after: int = 10_000_000
    dead_bias_step: float = 0.0
    b_dec_init: str = "geometric_median"
    w_dec_init: str = "random"
    topk: str = "auto"
    compute_dtype: str = "float32"
    decode: str = "auto"

    def __post_init__(self) -> None:
        for name in ("width", "k", "batch_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.k > self.width:
            raise ValueError(f"k={self.k} must be <= width={self.width}")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr} must be > 0")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {SCHEDULES}")
        if not 0 < self.decay_fraction <= 1:
            raise ValueError(f"decay_fraction={self.decay_fraction} must be in (0, 1]")
        if self.aux_k is not None and not 1 <= self.aux_k <= self.width:
            raise ValueError(f"aux_k={self.aux_k} must be in [1, width={self.width}]")
        if self.aux_coef < 0:
            raise ValueError(f"aux_coef={self.aux_coef} must be >= 0")
        if self.dead_after < 1:
            raise ValueError(f"dead_after={self.dead_after} must be >= 1")
        if not self.dead_bias_step >= 0:  # NaN refused too
            raise ValueError(f"dead_bias_step={self.dead_bias_step} must be >= 0")
        if self.b_dec_init not in ("geometric_median", "mean"):
            raise ValueError(f"b_dec_init={self.b_dec_init!r} is not 'geometric_median' or 'mean'")
        if self.w_dec_init not in ("random", "data"):
            raise ValueError(f"w_dec_init={self.w_dec_init!r} is not 'random' or 'data'")
        if self.topk not in TOPK_METHODS:
            raise ValueError(f"topk={self.topk!r} is not one of {TOPK_METHODS}")
        if self.compute_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"compute_dtype={self.compute_dtype!r} is not 'float32' or 'bfloat16'")
        if self.decode not in DECODE_METHODS:
            raise ValueError(f"decode={self.decode!r} is not one of {DECODE_METHODS}")

    def resolved_aux_k(self, d_in: int) -> int:
        return min(self.aux_k or max(d_in // 2, 1), self.width)

    @property
    def dead_after_steps(self) -> int:
        return -(-self.dead_after // self.batch_size)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything a run needs (YAML keys are these field names). Defaults: SmolLM2, docs/SAE.md.

    ``corpus`` defaults to ``"kjv"`` (`sparsekv_jax.sae.data`: a training text that shares nothing with
    the evaluation suites), streamed in rows of ``seq_len`` = 4,100 tokens (4,096 kept after the sink
    positions), so keys come from long-context positions.
    """

    out: str = "sae_out"
    name: str = "sae"
    model: str = "smollm2"
    cache_dir: str | None = None
    dtype: str = "float32"
    attention: str = "xla"
    layers: tuple[int, ...] = (0, 11, 15, 27)
    corpus: str = "kjv"
    holdout: float = 0.1
    seq_len: int = 4100
    drop_first: int = 4
    rows_per_chunk: int = 4
    buffer_chunks: int = 8
    batch_size: int = 12288
    init_vectors: int = 65536
    steps: int = 8000
    max_minutes: float | None = None
    width: int = 8192
    k: int = 64
    lr: float = 1e-3
    warmup_steps: int = 500
    schedule: str = "wsd"
    decay_fraction: float = 0.2
    aux_k: int | None = None
    aux_coef: float = 1 / 32
    dead_after: int = 10_000_000
    dead_bias_step: float = 0.0
    b_dec_init: str = "geometric_median"
    w_dec_init: str = "random"
    topk: str = "auto"
    compute_dtype: str = "float32"
    decode: str = "auto"
    log_every: int = 50
    checkpoint_every: int = 1000
    checkpoint_dir: str | None = None  # default: OUT/checkpoints
    keep_checkpoints: int = 2
    export_dtype: str = "float16"
    eval_batch_rows: int = 2
    eval_max_rows: int | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        positive = ("seq_len", "rows_per_chunk", "buffer_chunks", "batch_size", "init_vectors", "steps",
                    "log_every", "checkpoint_every", "keep_checkpoints", "eval_batch_rows")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if not 0 <= self.drop_first < self.seq_len:
            raise ValueError(f"drop_first={self.drop_first} must be in [0, seq_len={self.seq_len})")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r} is not 'float32' or 'bfloat16'")
        if self.attention not in ("xla", "cudnn"):
            raise ValueError(f"attention={self.attention!r} is not 'xla' or 'cudnn'")
        if self.export_dtype not in ("float32", "float16"):
            raise ValueError(f"export_dtype={self.export_dtype!r} is not 'float32' or 'float16'")
        if self.max_minutes is not None and self.max_minutes <= 0:
            raise ValueError(f"max_minutes={self.max_minutes} must be > 0")
        self.train_config()  # validates the SAE hyperparameters

    def train_config(self) -> TrainConfig:
        return TrainConfig(width=self.width, k=self.k, batch_size=self.batch_size, lr=self.lr,
                           warmup_steps=self.warmup_steps, schedule=self.schedule,
                           decay_fraction=self.decay_fraction, aux_k=self.aux_k, aux_coef=self.aux_coef,
                           dead_after=self.dead_after, dead_bias_step=self.dead_bias_step,
                           b_dec_init=self.b_dec_init, w_dec_init=self.w_dec_init, topk=self.topk,
                           compute_dtype=self.compute_dtype, decode=self.decode)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> RunConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown}; known: {sorted(known)}")
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> RunConfig:
        import yaml

        values = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a mapping of config keys")
        return cls.from_dict({**values, **{k: v for k, v in overrides.items() if v is not None}})

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["layers"] = list(self.layers)
        return d
