"""Stem ablations against dense prefill: the analogue of the paper's Tables 1 (SAM vs OAM) and 5
(uniform vs position-decay budget at equal total budget).

Every config runs the same forward (`models.transformer.forward`) over the same prompts; only the
prefill attention differs. Reported per config, averaged over the prompts:

* attention-output MSE per layer against the dense run (``acc``: the sparse model's own outputs,
  errors accumulated from earlier layers, as in the paper's Table 1; ``local``: dense attention
  on the sparse run's own q/k/v, the error this layer adds), at layers 5/15/25 (0-based) and the
  mean over layers (real prompt tokens only);
* final-logit MSE, KL(dense || sparse) and top-1 agreement at each prompt's last ``--last``
  positions (logits only ever built for those);
* the fraction of causal blocks computed (``attention.block_fraction``; the padded tail of a
  prompt counts with its forced blocks only).

Prompts are RULER-style tasks (``--tasks``, cycled; ``sparsekv_jax.eval.ruler``) of about
``--length`` tokens with the chat template, or windows of a plain-text file (``--text``),
right-padded to one width so each config compiles once. Writes ``ablation.json`` and
``ablation.md`` to ``--out`` and prints the table last.

Stem's default floor (6912 tokens) leaves an 8k prompt 87% dense, where the rows differ little;
``--min-blocks 32`` (2048 tokens, 37% of the blocks at 8k) is the sparser setting where the
schedule and the metric matter:

    python experiments/stem_ablation.py --length 8k --n 8 --out stem_ablation_8k
    python experiments/stem_ablation.py --length 8k --n 8 --min-blocks 32 --out stem_ablation_8k_min32
    python experiments/stem_ablation.py --length 1k --n 1 --out /tmp/stem_ablation  # CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

LAYERS = (5, 15, 25)  # the paper's L5/L15/L25 (0-based here)
TASKS = "niah_single_2,niah_multikey_1,niah_multivalue,vt,cwe,fwe,qa_1,qa_2"


def configs(**base: Any) -> dict[str, Any]:
    """The ablation rows: (schedule, metric) pairs at one total budget, plus the GQA reduction."""
    from sparsekv_jax.policies import Stem

    return {
        "Uniform + SAM": Stem(schedule="uniform", **{**base, "beta": 0.0}),
        "TPD + SAM": Stem(**{**base, "beta": 0.0}),
        "Uniform + OAM": Stem(schedule="uniform", **base),
        "TPD + OAM (Stem)": Stem(**base),
        "TPD + OAM, GQA mean": Stem(**{**base, "gqa": "mean"}),
    }


def _forward_fn(params: Any, policy: Any, last: int) -> Callable:
    """jit: ``(tokens [1, W], lengths [1], dense_outs or None)`` → per-layer stats and the last logits."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax import attention
    from sparsekv_jax.models.transformer import forward, logits_from_hidden
    from sparsekv_jax.policies.base import Prompt

    def run(tokens: jax.Array, lengths: jax.Array, dense_outs: Any) -> Any:
        B, W = tokens.shape
        positions = jnp.broadcast_to(jnp.arange(W, dtype=jnp.int32), (B, W))
        real = (jnp.arange(W)[None, :] < lengths[:, None])[:, :, None, None]  # [B, W, 1, 1]
        n_real = lengths.sum() * params.config.num_heads * params.config.head_dim

        def mse(a: jax.Array, b: jax.Array) -> jax.Array:
            d = a.astype(jnp.float32) - b.astype(jnp.float32)
            return jnp.sum(jnp.where(real, d * d, 0.0)) / n_real

        def attend(q, k, v, ref, idx, hidden):
            dense = attention.dense_causal_attention(q, k, v)
            if policy is None:
                return dense, dense, None
            pattern = policy.prefill_pattern(q, k, v, idx, Prompt(tokens, lengths))
            out = attention.prefill(q, k, v, pattern)
            frac = jnp.float32(1.0) if pattern is None else attention.block_fraction(pattern, W)
            return out, None, (mse(out, ref), mse(out, dense), frac)

        hidden, outs, stats = forward(params, tokens, positions, dense_outs, attend)
        pos = jnp.clip(lengths[:, None] - last + jnp.arange(last), 0, W - 1)
        tail = jnp.take_along_axis(hidden, pos[:, :, None], axis=1)
        return outs, stats, logits_from_hidden(params, tail)  # logits [B, last, V] fp32

    return jax.jit(run)


def ablate(params: Any, prompts: list[np.ndarray], policies: dict[str, Any], *, last: int = 128,
           progress: bool = True) -> dict[str, Any]:
    """Errors of each policy's prefill against dense on ``prompts`` (lists of token ids, run one at a time,
    right-padded to the longest). Returns ``{name: {stat: value}}`` averaged over the prompts."""
    import jax
    import jax.numpy as jnp
    from tqdm import tqdm

    width = max(len(p) for p in prompts)
    last = min(last, min(len(p) for p in prompts))
    dense_fn = _forward_fn(params, None, last)
    fns = {name: _forward_fn(params, pol, last) for name, pol in policies.items()}
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    bar = tqdm(total=len(prompts) * (len(policies) + 1), disable=not progress, desc="stem ablation")
    for ids in prompts:
        tokens = jnp.asarray(np.pad(np.asarray(ids, np.int32), (0, width - len(ids)))[None])
        lengths = jnp.asarray([len(ids)], jnp.int32)
        dense_outs, _, ref_logits = dense_fn(tokens, lengths, None)
        ref_logp = jax.nn.log_softmax(ref_logits, -1)
        bar.update()
        for name, fn in fns.items():
            _, (acc, local, frac), logits = fn(tokens, lengths, dense_outs)
            logp = jax.nn.log_softmax(logits, -1)
            rows[name].append({
                "layer_mse": np.asarray(acc).tolist(),
                "layer_mse_local": np.asarray(local).tolist(),
                "block_fraction": float(np.mean(frac)),
                "logit_mse": float(jnp.mean(jnp.square(logits - ref_logits))),
                "kl": float(jnp.mean(jnp.sum(jnp.exp(ref_logp) * (ref_logp - logp), -1))),
                "top1": float(jnp.mean(jnp.argmax(logits, -1) == jnp.argmax(ref_logits, -1))),
            })
            bar.update()
    bar.close()
    summary = {}
    for name, rs in rows.items():
        layer = np.mean([r["layer_mse"] for r in rs], axis=0)
        local = np.mean([r["layer_mse_local"] for r in rs], axis=0)
        summary[name] = {
            "policy": repr(policies[name]),
            "layer_mse": layer.tolist(),
            "layer_mse_local": local.tolist(),
            "mean_layer_mse": float(layer.mean()),
            "mean_layer_mse_local": float(local.mean()),
            **{k: float(np.mean([r[k] for r in rs])) for k in ("block_fraction", "logit_mse", "kl", "top1")},
            "per_prompt": rs,
        }
    return summary


def markdown(summary: dict[str, Any], layers: tuple[int, ...] = LAYERS) -> str:
    """The summary as a markdown table (accumulated per-layer MSE, then the logit metrics)."""
    n_layers = len(next(iter(summary.values()))["layer_mse"])
    shown = [i for i in layers if i < n_layers]
    head = (["config", "blocks"] + [f"L{i}" for i in shown]
            + ["mean L (acc)", "mean L (local)", "logit MSE", "KL", "top-1"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" + "---:|" * (len(head) - 1)]
    for name, s in summary.items():
        cells = ([name, f"{s['block_fraction']:.3f}"] + [f"{s['layer_mse'][i]:.2e}" for i in shown]
                 + [f"{s['mean_layer_mse']:.2e}", f"{s['mean_layer_mse_local']:.2e}", f"{s['logit_mse']:.4f}",
                    f"{s['kl']:.4f}", f"{s['top1']:.3f}"])
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def build_prompts(tokenizer: Any, length: int, n: int, tasks: list[str], seed: int, text: str | None) -> list:
    """``n`` prompts of at most ``length`` tokens: RULER tasks cycled, or windows of a text file."""
    if text is not None:
        ids = tokenizer(Path(text).read_text(), add_special_tokens=False)["input_ids"]
        if len(ids) < n * length:
            raise SystemExit(f"{text} has {len(ids)} tokens, fewer than --n {n} x --length {length}")
        return [ids[i * length:(i + 1) * length] for i in range(n)]
    from sparsekv_jax.eval.ruler import generate_samples

    prompts = []
    for i in range(n):
        sample = generate_samples(tasks[i % len(tasks)], length, 1, seed + i, tokenizer, chat=True)[0]
        prompts.append(tokenizer(sample.prompt, add_special_tokens=False)["input_ids"][:length])
    return prompts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2", help="embedded name, HF directory or .gguf file")
    ap.add_argument("--length", default="8k", help="prompt tokens (8k = 8192; capped to the model's window)")
    ap.add_argument("--n", type=int, default=8, help="prompts")
    ap.add_argument("--tasks", default=TASKS, help="RULER tasks, cycled over the prompts")
    ap.add_argument("--text", default=None, help="plain-text file to cut prompts from instead of RULER")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--last", type=int, default=128, help="final positions whose logits are compared")
    ap.add_argument("--block-size", type=int, default=None, help="Stem block size (default: Stem's)")
    ap.add_argument("--k-start-ratio", type=float, default=None, help="Stem k_start_ratio (default: automatic)")
    ap.add_argument("--min-blocks", type=int, default=None, help="Stem min_blocks (default: Stem's)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="weights/activations (auto: bfloat16 on the GPU, float32 elsewhere)")
    ap.add_argument("--out", default="stem_ablation", help="output directory")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from sparsekv_jax import load
    from sparsekv_jax.eval.runner import parse_length

    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}.get(args.dtype)
    if dtype is None:
        dtype = jnp.bfloat16 if jax.default_backend() == "gpu" else jnp.float32
    params, tok = load(args.model, dtype=dtype, progress=False)
    length = min(parse_length(args.length), params.config.max_position_embeddings)
    base = {k: v for k, v in (("block_size", args.block_size), ("k_start_ratio", args.k_start_ratio),
                              ("min_blocks", args.min_blocks)) if v is not None}
    policies = configs(**base)
    t0 = time.perf_counter()
    prompts = build_prompts(tok, length, args.n, [t.strip() for t in args.tasks.split(",") if t.strip()],
                            args.seed, args.text)
    print(f"{len(prompts)} prompts of {min(map(len, prompts))}-{max(map(len, prompts))} tokens "
          f"({time.perf_counter() - t0:.0f} s)", flush=True)
    summary = ablate(params, prompts, policies, last=args.last)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"model": str(args.model), "length": length, "n": len(prompts), "tasks": args.tasks, "text": args.text,
            "seed": args.seed, "last": args.last, "dtype": str(jnp.dtype(dtype)), "backend": jax.default_backend(),
            "prompt_tokens": [len(p) for p in prompts]}
    (out / "ablation.json").write_text(json.dumps({"meta": meta, "configs": summary}, indent=1))
    table = markdown(summary)
    (out / "ablation.md").write_text(
        f"Stem ablation: {meta['model']}, {len(prompts)} prompts of ~{length} tokens, {meta['dtype']}, "
        f"{meta['backend']}\n\n{table}\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
