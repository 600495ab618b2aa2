"""BSER ablations on SmolLM2 (the analogue of the paper's Section 5.2), question-aware and agnostic.

Every variant runs the real policy through `generate` on the same prompts: RULER tasks at one
length and LongBench-mini truncated to a length, question-aware (``question_start`` = the context
length, so BSER probes with the question) or question-agnostic (context only, the question read
after compression; BSER falls back to the prompt's tail). Variants (``--variants``, default all):

    full               full attention (the reference)
    snapkv             SnapKV at the budget (the question-aware peer)
    bser               BSER at the budget, defaults
    thresholds         BSER's threshold mode (the paper's (α, β) = (0.3, 0.7)), cache sized for 50% of the prompt
    thresholds-uncapped  the same with a cache sized for the whole prompt: the budget the thresholds give
    no-stage2          block representation mean-pooled instead of attention-weighted
    softmax            the paper's literal Eq. 4: softmax over the averaged attention probabilities
    no-stage3-drop     refine blocks discarded (threshold mode)
    no-stage3-keep     refine blocks kept whole (threshold mode)
    hidden             E = hidden states entering the first probed layer (instead of token embeddings)
    centred            E centred on the context's mean
    L1, L2             probing the top 1 / 2 layers (default 4)
    v1, v1-thresholds  the first version's Stage III at the budget / at the thresholds: fixed anchors,
                       refined tokens ranked by block s, the question as given (min_question=1)
    fixed-anchors      thresholds with round(ρ·B/(2r+1)) anchors instead of filling ρ of the block
    block-order        the budget with refined tokens ranked by their block's s, not their salience
    question-as-given  thresholds without reaching a short question back into the context

Prints one table (score per task, average, % of full, KV stored) and writes records and the
table under ``--out``. CPU-sized by default; the same script runs full size on a GPU:

    python scripts/bser_ablation.py --out out/bser_ablation            # CPU (2 cores): 40-60 min
    # GPU, full size (RULER and LongBench-mini apart: one padded width each; 7,400 context tokens leave
    # room for the question and 128 new tokens within SmolLM2's 8,192 positions)
    python scripts/bser_ablation.py --model /tmp/smollm2.gguf --dtype bfloat16 --tasks all --lengths 4k \\
        --n 25 --longbench-n 0 --batch-size 25 --max-new 128 --out $OUT/bser_ablation_ruler4k
    python scripts/bser_ablation.py --model /tmp/smollm2.gguf --dtype bfloat16 --n 0 --longbench-tasks all \\
        --longbench-n 26 --longbench-tokens 7400 --batch-size 16 --max-new 128 --out $OUT/bser_ablation_lb
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gzip
import json
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# the first version's Stage III and question (before the niah_single_1 diagnosis, docs/BSER.md)
V1 = {"fill": False, "refine_order": "block", "min_question": 1}


def variants(budget: float) -> dict:
    from sparsekv_jax.policies import BSER, Dense, SnapKV

    b = BSER(budget)
    return {
        "full": Dense(), "snapkv": SnapKV(budget), "bser": b, "thresholds": BSER(),
        "no-stage2": b.replace(salience="mean"), "softmax": b.replace(salience="softmax"),
        "no-stage3-drop": BSER(refine="drop"), "no-stage3-keep": BSER(refine="keep"),
        "thresholds-uncapped": BSER(max_kept=1.0),
        "hidden": b.replace(embedding="hidden"), "centred": b.replace(centred=True),
        "L1": b.replace(probe_layers=1), "L2": b.replace(probe_layers=2),
        "v1": b.replace(**V1), "v1-thresholds": BSER(**V1),
        "fixed-anchors": BSER(fill=False), "block-order": b.replace(refine_order="block"),
        "question-as-given": BSER(min_question=1),
    }


@dataclasses.dataclass
class Item:
    task: str
    sample: object
    context: list[int]
    question: list[int]
    max_new: int


def ruler_items(tok, tasks, length, n, seed) -> list[Item]:
    from sparsekv_jax.eval import ruler

    out = []
    for task in tasks:
        for s in ruler.generate_samples(task, length, n, seed, tok, chat=True):
            out.append(Item(task, s, tok(s.context, add_special_tokens=False)["input_ids"],
                            tok(s.question, add_special_tokens=False)["input_ids"], s.max_new_tokens))
    return out


def longbench_dir(path: str | None) -> Path:
    if path:
        return Path(path)
    from sparsekv_jax.datasets import longbench_mini_files

    tmp = Path(tempfile.mkdtemp(prefix="lbmini_"))
    for task, f in longbench_mini_files().items():
        with gzip.open(f, "rb") as src, open(tmp / f"{task}.jsonl", "wb") as dst:
            shutil.copyfileobj(src, dst)
    return tmp


def longbench_items(tok, path, tasks, n, max_tokens) -> list[Item]:
    from sparsekv_jax.eval import longbench

    out = []
    for task, samples in longbench.load_longbench(longbench_dir(path), tasks=tasks, limit=n).items():
        for s in samples:
            s = longbench.prepare(s, tok, max_tokens=max_tokens, chat=True)
            chat = bool(s.meta.get("chat", True))
            ctx = tok(s.context, add_special_tokens=not chat)["input_ids"]
            q = tok(s.question, add_special_tokens=False)["input_ids"] if s.question else []
            if not q:
                ctx, q = ctx[:-1], ctx[-1:]
            out.append(Item(task, s, ctx, q, min(longbench.DATASET2MAXGEN.get(task, 128), 128)))
    return out


def batches(items: list[Item], size: int):
    items = sorted(items, key=lambda it: len(it.context) + len(it.question))
    for i in range(0, len(items), size):
        yield items[i:i + size]


def run_batch(params, policy, batch: list[Item], size: int, aware: bool, width: int, qwidth: int, new: int, stop):
    from sparsekv_jax.generate import generate

    rows = batch + [batch[-1]] * (size - len(batch))  # fixed shapes: one compile per variant
    if aware:
        toks = np.zeros((size, width), np.int32)
        for i, it in enumerate(rows):
            toks[i, : len(it.context) + len(it.question)] = it.context + it.question
        lengths = np.array([len(it.context) + len(it.question) for it in rows], np.int32)
        qs = np.array([len(it.context) for it in rows], np.int32)
        out = generate(params, policy, toks, lengths=lengths, question_start=qs, max_new_tokens=new, stop_tokens=stop)
    else:
        toks = np.zeros((size, width - qwidth), np.int32)
        suf = np.zeros((size, qwidth), np.int32)
        for i, it in enumerate(rows):
            toks[i, : len(it.context)] = it.context
            suf[i, : len(it.question)] = it.question
        lengths = np.array([len(it.context) for it in rows], np.int32)
        out = generate(params, policy, toks, lengths=lengths, suffix=suf,
                       suffix_lengths=np.array([len(it.question) for it in rows], np.int32),
                       max_new_tokens=new, stop_tokens=stop)
    return np.asarray(out.tokens), np.asarray(out.num_generated), np.asarray(out.stats["kv_stored_fraction"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--tasks", default="niah_single_2,niah_multikey_1,qa_1", help="RULER tasks, or 'all'")
    p.add_argument("--lengths", default="1k", help="RULER prompt length (one)")
    p.add_argument("--n", type=int, default=4, help="RULER prompts per task (0: none)")
    p.add_argument("--longbench-tasks", default="2wikimqa,multifieldqa_en", help="LongBench-mini tasks, or 'all'")
    p.add_argument("--longbench-n", type=int, default=2)
    p.add_argument("--longbench-tokens", type=int, default=1024, help="LongBench middle truncation")
    p.add_argument("--longbench-path", default=None, help="LongBench jsonl dir (default: the package's copy)")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--variants", default="all")
    p.add_argument("--question", default="aware,agnostic", help="question modes to run")
    p.add_argument("--agnostic-variants", default="full,snapkv,bser,thresholds,thresholds-uncapped")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--max-new", type=int, default=32, help="decode steps (answers are also cut to each task's limit)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-minutes", type=float, default=None,
                   help="start no new variant past this; a rerun with the same --out resumes")
    p.add_argument("--out", default="out/bser_ablation")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from sparsekv_jax.eval.runner import parse_length
    from sparsekv_jax.models.embedded import load

    t_start = time.time()
    params, tok = load(args.model, dtype=getattr(jnp, args.dtype), progress=False)
    stop = tuple(sorted({*params.config.eos_token_ids, *([tok.eos_token_id] if tok.eos_token_id is not None else [])}))
    from sparsekv_jax.eval import ruler

    names = list(ruler.RULER_TASKS) if args.tasks == "all" else [t for t in args.tasks.split(",") if t]
    items = ruler_items(tok, names, parse_length(args.lengths), args.n, args.seed) if args.n > 0 else []
    if args.longbench_n > 0:
        lb_tasks = None if args.longbench_tasks == "all" else [t for t in args.longbench_tasks.split(",") if t]
        items += longbench_items(tok, args.longbench_path, lb_tasks, args.longbench_n, args.longbench_tokens)
    qwidth = -(-max(len(it.question) for it in items) // 64) * 64
    width = -(-max(len(it.context) for it in items) // 64) * 64 + qwidth
    all_variants = variants(args.budget)
    names = list(all_variants) if args.variants == "all" else args.variants.split(",")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    # resume: every finished (question mode, variant) is appended to records.jsonl and skipped on a rerun
    partial = out_dir / "records.jsonl"
    records = [json.loads(line) for line in partial.open()] if partial.exists() else []
    done = {(r["question"], r["variant"]) for r in records}
    stopped = False
    for mode in args.question.split(","):
        aware = mode == "aware"
        for name in names if aware else [v for v in names if v in args.agnostic_variants.split(",")]:
            if (mode, name) in done:
                continue
            if args.max_minutes is not None and time.time() - t_start > 60 * args.max_minutes:
                stopped = True
                break
            t0 = time.time()
            fresh = []
            for batch in batches(items, args.batch_size):
                toks, num, stored = run_batch(params, all_variants[name], batch, args.batch_size, aware, width,
                                              qwidth, args.max_new, stop)
                for i, it in enumerate(batch):
                    ids = [t for t in toks[i, : min(int(num[i]), it.max_new)].tolist() if t not in stop]
                    pred = tok.decode(ids, skip_special_tokens=True)
                    fresh.append({"question": mode, "variant": name, "task": it.task,
                                  "score": 100 * it.sample.score(pred),
                                  "stored": float(stored[i]), "prediction": pred})
            records += fresh
            with partial.open("a") as sink:
                sink.writelines(json.dumps(r) + "\n" for r in fresh)
            print(f"{mode:9s} {name:15s} {time.time() - t0:7.1f} s", file=sys.stderr, flush=True)
            jax.clear_caches()
    if stopped:
        print(f"--max-minutes {args.max_minutes}: stopped; rerun with the same --out to resume", file=sys.stderr)
    tasks = list(dict.fromkeys(it.task for it in items))
    lines = [f"| question | variant | {' | '.join(tasks)} | average | % of full | KV stored |",
             "|---" * (len(tasks) + 5) + "|"]
    for mode in args.question.split(","):
        rows = {}
        for name in names:
            recs = [r for r in records if r["question"] == mode and r["variant"] == name]
            if recs:
                per = [float(np.mean([r["score"] for r in recs if r["task"] == t])) for t in tasks]
                rows[name] = (per, float(np.mean(per)), float(np.mean([r["stored"] for r in recs])))
        full = rows.get("full", (None, None))[1]
        for name, (per, avg, stored) in rows.items():
            kept = f"{100 * avg / full:.1f}" if full else "—"
            lines.append(f"| {mode} | {name} | {' | '.join(f'{x:.1f}' for x in per)} | {avg:.2f} | {kept} | "
                         f"{stored:.3f} |")
    table = "\n".join(lines)
    meta = {"command": " ".join(sys.argv), "device": f"{jax.devices()[0].device_kind} ({platform.node()})",
            "date": datetime.date.today().isoformat(), "seconds": round(time.time() - t_start),
            "prompts": {t: sum(1 for it in items if it.task == t) for t in tasks}, "args": vars(args)}
    (out_dir / "records.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1))
    (out_dir / "table.md").write_text(table + "\n")
    print(json.dumps(meta))
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
