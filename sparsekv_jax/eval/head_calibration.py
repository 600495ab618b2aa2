"""`sparsekv calibrate --heads`: per-KV-head retrieval scores for `HeadSplit`
(`sparsekv_jax.policies.headsplit`), a DuoAttention-style split of retrieval and streaming heads.

DuoAttention (Xiao et al., 2024) trains a gate per KV head on synthetic passkey data. This is a
cheaper proxy in its spirit, not its method: per KV head, the share of the attention of each
prompt's last ``queries`` tokens (the question) that falls outside the first ``sinks`` tokens and
each query's ``recent`` most recent ones (what a streaming head of that shape would lose), averaged
over the query heads of its GQA group and over RULER needle prompts (generated with their own
seed, apart from the rows `sparsekv eval` reports). Higher: more of a retrieval head.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from sparsekv_jax._progress import bar_disabled
from sparsekv_jax.eval.calibrate import suite_prompts

HEAD_TASKS = ("niah_single_2", "niah_multikey_1")


def attention_share_outside(q: Any, k: Any, lengths: Any, *, sinks: int, recent: int, queries: int,
                            scale: float) -> Any:
    """Per KV head, the share of the attention mass of each row's last ``queries`` queries that falls
    outside the first ``sinks`` keys and each query's ``recent`` most recent keys (itself included):
    what a streaming head of that shape would lose. Averaged over those queries and the query heads
    of each GQA group.

    ``q`` ``[B, T, Hq, D]``, ``k`` ``[B, T, Hkv, D]`` (RoPE applied), ``lengths`` ``[B]``, ``scale`` the
    model's attention scale → ``[B, Hkv]`` fp32.
    """
    import jax
    import jax.numpy as jnp

    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    qpos = jnp.clip(lengths[:, None] - queries + jnp.arange(queries), 0, T - 1)  # [B, Q]
    qw = jnp.take_along_axis(q, qpos[:, :, None, None], axis=1).reshape(B, queries, Hkv, Hq // Hkv, D)
    s = jnp.einsum("bwhgd,bthd->bhgwt", qw, k, preferred_element_type=jnp.float32) * scale
    t = jnp.arange(T)[None, None, :]
    causal = t <= qpos[:, :, None]  # [B, Q, T]
    p = jax.nn.softmax(jnp.where(causal[:, None, None], s, -jnp.inf), axis=-1)
    far = (t >= sinks) & (t <= qpos[:, :, None] - recent)  # [B, Q, T]
    return (p * far[:, None, None]).sum(-1).mean((2, 3))  # [B, Hkv]


def head_share_scores(params: Any, prompts: list[list[int]], *, sinks: int = 64, recent: int = 256,
                      queries: int = 64, batch_size: int = 2, progress: bool = True) -> np.ndarray:
    """``[L, Hkv]``: `attention_share_outside` of every layer and KV head, averaged over ``prompts``
    (token id lists, each longer than ``sinks + recent + queries``), prefilled with full attention
    ``batch_size`` at a time (one compile: every batch is padded to the longest prompt)."""
    import jax
    import jax.numpy as jnp
    from flax import struct
    from tqdm.auto import tqdm

    from sparsekv_jax.cache import init_cache
    from sparsekv_jax.engine.prefill import prefill
    from sparsekv_jax.policies.base import Policy

    cfg = params.config
    if cfg.interleaved:
        raise ValueError("head calibration of a model with interleaved local/global layers (Gemma 3) is not "
                         "supported: its policies see the global layers only")
    for name, value in (("sinks", sinks), ("recent", recent), ("queries", queries), ("batch_size", batch_size)):
        if value < (1 if name in ("queries", "batch_size") else 0):
            raise ValueError(f"{name}={value} must be >= {1 if name in ('queries', 'batch_size') else 0}")
    if not prompts:
        raise ValueError("no calibration prompts")
    short = min(map(len, prompts))
    if short <= sinks + recent + queries:
        raise ValueError(f"a calibration prompt of {short} tokens is too short for sinks={sinks} + recent={recent} + "
                         f"queries={queries}: nothing would lie outside the streaming pattern")
    scale = (cfg.query_pre_attn_scalar if cfg.query_pre_attn_scalar is not None else cfg.head_dim) ** -0.5

    @struct.dataclass
    class Probe(Policy):
        stages = ("compress",)
        needs_observations = True

        def observe(self, q, k, v, hidden, layer_index, prompt):
            return attention_share_outside(q, k, prompt.lengths, sinks=sinks, recent=recent, queries=queries,
                                           scale=scale)

    width = max(map(len, prompts))
    # the weights are an argument, not constants folded into the program
    run = jax.jit(lambda p, tokens, lengths: prefill(
        p, Probe(), tokens, lengths, init_cache(cfg, batch_size, width, dtype=p.dtype))[2]["compress"])
    total = np.zeros((cfg.num_layers, cfg.num_kv_heads), np.float64)
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    for batch in tqdm(batches, disable=bar_disabled(progress), desc="head calibration", unit="batch"):
        rows = batch + [batch[-1]] * (batch_size - len(batch))
        tokens = np.zeros((batch_size, width), np.int32)
        for i, r in enumerate(rows):
            tokens[i, :len(r)] = r
        shares = np.asarray(run(params, jnp.asarray(tokens), jnp.asarray([len(r) for r in rows], jnp.int32)))
        total += shares[:, :len(batch)].sum(1)  # [L, B, Hkv] → [L, Hkv]
    return (total / len(prompts)).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class HeadCalibrateOptions:
    """The options of `calibrate_heads` besides the model and output file.

    Attributes:
      tasks: RULER tasks whose generated prompts are used (default `HEAD_TASKS`: needles in essays).
      length: prompt length in tokens.
      n: prompts per task.
      seed: the seed generating the prompts (keep it apart from the seeds of the rows you evaluate:
        `sparsekv eval` generates RULER rows with seed 0 by default).
      sinks: the streaming pattern's first keys.
      recent: the streaming pattern's recent window.
      queries: the prompt's last queries whose attention is measured (the question).
      batch_size: prompts per prefill.
      progress: a tqdm bar over batches.
      dtype: weight dtype when loading ``model`` (default float32).
      cache_dir: cache root for the embedded model.
      model_name: the model's name recorded in the JSON (default: ``model`` when it is a name, else
        ``"custom"``).
    """

    tasks: tuple[str, ...] | list[str] | None = None
    length: int = 2048
    n: int = 2
    seed: int = 1234
    sinks: int = 64
    recent: int = 256
    queries: int = 64
    batch_size: int = 2
    progress: bool = True
    dtype: Any = None
    cache_dir: str | None = None
    model_name: str | None = None


def calibrate_heads(model: Any = "smollm2", *, out: str | os.PathLike[str] = "head_scores.json",
                    **options: Any) -> dict[str, Any]:
    """Per-head retrieval scores for `HeadSplit` (`head_share_scores` on RULER needle prompts),
    written as JSON (``HeadSplit(calibration=out)`` loads it; the shipped ones live in
    ``policies/calibration/*_heads.json``).

    A proxy in the spirit of DuoAttention, not its method: DuoAttention trains a gate per KV head on
    synthetic passkey prompts; this measures, per KV head, how much of the question's attention
    lies outside the sinks and the recent window (higher: more of a retrieval head).

    Args:
      model: ``"smollm2"``, a model directory / ``.gguf`` path, or a loaded ``(params, tokenizer)``.
      out: the JSON file written.
      **options: the fields of `HeadCalibrateOptions`, or ``options=HeadCalibrateOptions(...)``
        (an unknown keyword raises `TypeError` naming it, before the model loads).

    Returns:
      The JSON written to ``out``.
    """
    from sparsekv_jax.engine.run import options_of

    o = options_of(options, HeadCalibrateOptions)
    import jax
    import jax.numpy as jnp

    from sparsekv_jax.models.embedded import load
    from sparsekv_jax.policies.headsplit import FINGERPRINT

    tasks = list(o.tasks) if o.tasks else list(HEAD_TASKS)
    if isinstance(model, tuple):
        params, tokenizer = model
    else:
        params, tokenizer = load(model, dtype=jnp.float32 if o.dtype is None else o.dtype, progress=o.progress,
                                 cache_dir=o.cache_dir)
    cfg = params.config
    prompts = suite_prompts("ruler", tokenizer, cfg, tasks, o.length, o.n, o.seed, o.cache_dir)
    scores = head_share_scores(params, prompts, sinks=o.sinks, recent=o.recent, queries=o.queries,
                               batch_size=o.batch_size, progress=o.progress)
    result = {
        "head_scores": [[round(float(x), 6) for x in row] for row in scores],
        "score": "share of the last queries' attention outside sinks + recent window, per KV head",
        "config": {k: getattr(cfg, k) for k in FINGERPRINT},
        "model": o.model_name or (model if isinstance(model, str) else "custom"), "suite": "ruler", "tasks": tasks,
        "length": o.length, "samples": len(prompts), "seed": o.seed, "sinks": o.sinks, "recent": o.recent,
        "queries": o.queries, "date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    return result
