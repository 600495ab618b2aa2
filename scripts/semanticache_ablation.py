"""SemantiCache ablations on SmolLM2 (docs/SEMANTICACHE.md): the paper's Table 4 (delimiter chunking
vs fixed 64-token chunks vs no chunking, at 20%), Table 5 (tau from 0.5 to 0.9 with the compression
it gives), budget mode's layout rule (the least lossy layout per head vs the previous rule, per row
the first layout that fits) and the keys used for similarity and merging (pre- vs post-RoPE).

Every variant compresses the *same* prefilled cache: each batch of prompts is prefilled once with
full attention, then each variant compresses it, the question is read (question-agnostic: the
context is compressed before the question arrives, as in docs/RESULTS.md) and the answer decoded
greedily; RULER's / LongBench's metrics score it. At a few prompts per task those scores are coarse,
so each variant also scores full attention's own answer (teacher-forced, its first ``--follow``
tokens): "agree" is the share of those tokens that are the variant's top-1 too, "NLL" their mean
negative log-likelihood. Caches keep one capacity for all variants (the
entries a variant keeps sit below it; slots past a row's length are never read), so the answer
step compiles once. "kept" is the mean fraction of the prompt's entries kept per (layer, KV head).

    python scripts/semanticache_ablation.py --out docs/results/semanticache_ablation_cpu   # CPU, small
    python scripts/semanticache_ablation.py --length 4096 --n 25 --tasks all --batch 25 --dtype bfloat16 \\
        --model /tmp/smollm2.gguf --out semanticache_ablation_gpu                          # GPU, full size
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import tempfile
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.cache import init_cache
from sparsekv_jax.engine import Decoding, Ready, decode_loop, decode_step, extend, prefill, stored_entries
from sparsekv_jax.policies import Dense, SemantiCache, parse_policy
from sparsekv_jax.policies.base import Prompt, Setup

VARIANTS = {
    # Table 4: chunking at 20%. "delimiters" = the default: the paper's layout and its two
    # coarsenings, per (layer, KV head) the one whose budget search reaches the highest threshold
    "delimiters@0.2": dict(budget=0.2),
    "fixed64@0.2": dict(budget=0.2, chunking="fixed"),
    "none@0.2": dict(budget=0.2, chunking="none", layer_batch=1),  # one [T, T] band per layer
    # Table 5: tau, no cap (the paper's threshold mode; room for the whole prompt)
    **{f"tau={t}": dict(budget=1.0, tau=t) for t in (0.5, 0.6, 0.7, 0.8, 0.9)},
    # the other budgets
    "delimiters@0.35": dict(budget=0.35),
    "delimiters@0.5": dict(budget=0.5),
    "fixed64@0.35": dict(budget=0.35, chunking="fixed"),
    "fixed64@0.5": dict(budget=0.5, chunking="fixed"),
    "none@0.35": dict(budget=0.35, chunking="none", layer_batch=1),
    "none@0.5": dict(budget=0.5, chunking="none", layer_batch=1),
    # wider blocks: repeats a few sentences apart fall in one chunk (GSC in jnp: the kernel takes <= 128)
    **{f"fixed512@{b}": dict(budget=b, chunking="fixed", chunk_size=512) for b in (0.2, 0.35, 0.5)},
    # numbers: the default keeps the sentences (up to 64 tokens) that hold a digit unmerged, while they
    # take at most half the budget; "words" keeps the words that hold a digit; "digits" only the digit
    # tokens; "paper" merges them as the paper's algorithm does (every variant above keeps the sentences;
    # rows recorded before 2026-11-26 15:00 UTC kept nothing, those before 16:00 UTC only the digits,
    # those before 19:00 UTC the words)
    **{f"words@{b}": dict(budget=b, number_sentences=0) for b in (0.2, 0.35, 0.5)},
    **{f"digits@{b}": dict(budget=b, number_words=False) for b in (0.2, 0.35, 0.5)},
    **{f"paper@{b}": dict(budget=b, keep_numbers=False) for b in (0.2, 0.35, 0.5)},
    # the previous layout rule (per row, the first layout that fits)
    **{f"finest@{b}": dict(budget=b, level_rule="finest") for b in (0.2, 0.35, 0.5)},
    # keys: pre-RoPE content (default: delimiters@0.35) vs the stored post-RoPE keys
    "post_rope@0.35": dict(budget=0.35, keys="post_rope"),
}
RULER_DEFAULT = ("niah_single_1", "niah_single_2", "niah_multikey_1", "vt", "fwe", "qa_1")


def samples_for(args, tok) -> dict[str, list]:
    """``{task: samples}``: RULER tasks generated at ``--length``, LongBench-mini truncated to it."""
    from sparsekv_jax.eval import longbench, ruler

    out = {}
    tasks = list(ruler.RULER_TASKS) if args.tasks == "all" else [t for t in args.tasks.split(",") if t]
    for task in tasks:
        out[task] = ruler.generate_samples(task, args.length, args.n, args.seed, tok, chat=True)
    if args.longbench:
        from sparsekv_jax.datasets import longbench_mini_files

        files = longbench_mini_files()
        with tempfile.TemporaryDirectory() as tmp:
            for task in args.longbench.split(","):
                plain = os.path.join(tmp, f"{task}.jsonl")
                with gzip.open(files[task], "rt", encoding="utf-8") as f, open(plain, "w", encoding="utf-8") as g:
                    g.write(f.read())
                limit = args.length - 64  # the chat template's room, as the harness leaves it
                out[f"lb_{task}"] = [longbench.prepare(s, tok, max_tokens=limit)
                                     for s in longbench.read_jsonl(plain, task, limit=args.n)]
    return out


def encode(tok, sample) -> tuple[list[int], list[int]]:
    chat = bool(sample.meta.get("chat", True))
    ctx = list(tok(sample.context, add_special_tokens=not chat)["input_ids"])
    q = list(tok(sample.question, add_special_tokens=False)["input_ids"]) if sample.question else []
    return (ctx[:-1], ctx[-1:]) if not q else (ctx, q)


def pad(rows: list[list[int]], width: int) -> tuple[np.ndarray, np.ndarray]:
    out = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        out[i, : len(r)] = r
    return out, np.array([len(r) for r in rows], np.int32)


def run(args) -> list[dict]:
    from sparsekv_jax.models.embedded import load

    dtype = jnp.bfloat16 if args.dtype == "bfloat16" else jnp.float32
    params, tok = load(args.model, dtype=dtype, progress=False)
    cfg = params.config
    stop = tuple(sorted({*cfg.eos_token_ids, tok.eos_token_id} - {None}))
    names = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(";")]
    policies = {name: (SemantiCache(**VARIANTS[name]) if name in VARIANTS else parse_policy(name)).with_tokenizer(tok)
                for name in names}
    for name, pol in policies.items():  # every variant compresses a plain prefill, nothing observed
        if pol.needs_observations or set(pol.stages) != {"compress"}:
            raise SystemExit(f"{name}: this script runs compressors that observe nothing (SemantiCache, StreamingLLM); "
                             "compare with SnapKV/H2O through `sparsekv eval` (docs/SEMANTICACHE.md)")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "rows.jsonl")  # appended as rows come: a stopped run resumes
    rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
    done = {(r["task"], r["index"], r["variant"]) for r in rows}
    compressors: dict[tuple, object] = {}

    for task, samples in samples_for(args, tok).items():
        max_new = int(samples[0].max_new_tokens or 64)
        for start in range(0, len(samples), args.batch):
            batch = samples[start:start + args.batch]
            if all((task, s.index, v) in done for s in batch for v in ["fullkv", *names]):
                continue
            enc = [encode(tok, s) for s in batch]
            if args.question == "aware":
                ctx_rows, q_rows = [c + q for c, q in enc], None
            else:
                ctx_rows, q_rows = [c for c, _ in enc], [q for _, q in enc]
            # one prompt width and one cache capacity for every task where they fit, so each variant's
            # compression compiles once (compiling dominates a small CPU run)
            T = max(-(-max(map(len, ctx_rows)) // 64) * 64, -(-args.length // 64) * 64)
            tokens, lengths = pad(ctx_rows, T)
            tq = 0 if q_rows is None else -(-max(map(len, q_rows)) // 64) * 64
            capacity = T + max(tq, 64) + max(max_new, 128)
            suffix = None if q_rows is None else tuple(map(jnp.asarray, pad(q_rows, tq)))
            tokens, lengths = jnp.asarray(tokens), jnp.asarray(lengths)

            @jax.jit
            def prefilled(params, tokens, lengths, capacity=capacity):
                cache = init_cache(cfg, tokens.shape[0], capacity, page_size=16, dtype=dtype)
                logits, cache, _, _ = prefill(params, Dense(), tokens, lengths, cache)
                return logits, cache

            @jax.jit
            def answer(params, logits, cache, suffix, reference, max_new=max_new):
                """The greedy answer, and how the cache scores full attention's answer ``reference``
                (teacher-forced: log-probability and top-1 agreement at each of its tokens)."""
                if suffix is not None:
                    logits, cache = extend(params, cache, *suffix)
                dec = decode_loop(params, Dense(), Ready(logits, cache, (None, None), {}), jax.random.key(0),
                                  Decoding(max_new, stop_tokens=stop))
                out, num = dec.tokens, dec.num_generated

                def step(cache, token):
                    step_logits, cache, _, _ = decode_step(params, Dense(), cache, token, (None, None))
                    return cache, step_logits

                _, rest = jax.lax.scan(step, cache, reference[:, :-1].T)
                followed = jnp.concatenate([logits[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)  # [B, N, V]
                logp = jnp.take_along_axis(jax.nn.log_softmax(followed, -1), reference[..., None], -1)[..., 0]
                return out, num, logp, jnp.argmax(followed, -1) == reference

            t0 = time.perf_counter()
            logits, cache = prefilled(params, tokens, lengths)
            jax.block_until_ready(cache)
            prefill_s = time.perf_counter() - t0
            prompt = Prompt(tokens=tokens, lengths=lengths)
            follow = min(max_new, args.follow)
            reference = jnp.zeros((len(batch), follow), jnp.int32)  # full attention's answer, once known
            for name in ["fullkv", *names]:
                t0 = time.perf_counter()
                levels = np.full((len(batch), 3), np.nan)  # share of (layer, KV head)s at each layout level
                if name == "fullkv":
                    comp = cache
                else:
                    key = (name, tokens.shape, capacity)
                    if key not in compressors:
                        pol = policies[name].bind(Setup(cfg, prompt_len=T, max_new_tokens=tq + max_new))
                        run_one = pol.compress_with_choices if isinstance(pol, SemantiCache) else pol.compress
                        compressors[key] = jax.jit(lambda c, p, f=run_one, cap=capacity: f(c, None, cap, p))
                    comp = compressors[key](cache, prompt)
                    if isinstance(comp, tuple):
                        comp, (chosen, _) = comp  # [L, B, H] levels
                        levels = np.stack([(np.asarray(chosen) == lv).mean((0, 2)) for lv in (0, 1, 2)], axis=1)
                total, pairs = stored_entries(comp)  # per row: live entries over (layer, KV head) pairs
                kept = np.asarray(total) / pairs / np.asarray(lengths)
                out, num, logp, agree = map(np.asarray, answer(params, logits, comp, suffix, reference))
                if name == "fullkv":  # its answer is the reference; score it again against itself
                    ref_len = np.minimum(num, follow)
                    reference = jnp.asarray(np.where(np.arange(follow) < ref_len[:, None], out[:, :follow], 0))
                    _, _, logp, agree = map(np.asarray, answer(params, logits, comp, suffix, reference))
                on = np.arange(follow)[None] < ref_len[:, None]
                seconds = time.perf_counter() - t0
                scores = []
                for i, s in enumerate(batch):
                    ids = [t for t in out[i, : int(num[i])].tolist() if t not in stop]
                    pred = tok.decode(ids, skip_special_tokens=True)
                    scores.append(float(s.score(pred)))
                    if (task, s.index, name) in done:
                        continue
                    rows.append({"task": task, "index": s.index, "variant": name, "score": scores[-1],
                                 "kept": float(kept[i]), "levels": levels[i].tolist(), "prediction": pred,
                                 "answers": list(s.answers), "tokens": int(lengths[i]), "seconds": seconds / len(batch),
                                 "nll": float(-logp[i][on[i]].mean()), "agree": float(agree[i][on[i]].mean()),
                                 "prefill_seconds": prefill_s / len(batch)})
                    with open(path, "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
                print(f"{task} [{start}:{start + len(batch)}] {name}: {np.mean(scores):.2f} kept {kept.mean():.3f} "
                      f"({seconds:.1f}s)", flush=True)
    return rows


def table(rows: list[dict]) -> str:
    tasks = list(dict.fromkeys(r["task"] for r in rows))
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cell = defaultdict(list)
    for r in rows:
        cell[r["variant"], r["task"]].append(r)
    full = np.mean([np.mean([x["score"] for x in cell["fullkv", t]]) for t in tasks])
    lines = ["| variant | " + " | ".join(tasks) + " | average | % of full | agree | NLL | kept | compression "
             "| heads at level 0/1/2 |", "|---" + "|---:" * (len(tasks) + 7) + "|"]
    for v in variants:
        scores = [100 * np.mean([x["score"] for x in cell[v, t]]) for t in tasks]
        kept = np.mean([x["kept"] for t in tasks for x in cell[v, t]])
        avg = float(np.mean(scores))
        share = 100 * avg / (100 * full) if full else math.nan
        levels = np.array([x.get("levels", [math.nan] * 3) for t in tasks for x in cell[v, t]], float)
        share_of = "-" if np.isnan(levels).any() else "/".join(f"{x:.2f}" for x in levels.mean(0))
        agree = 100 * np.mean([x["agree"] for t in tasks for x in cell[v, t]])
        nll = np.mean([x["nll"] for t in tasks for x in cell[v, t]])
        lines.append(f"| {v} | " + " | ".join(f"{s:.1f}" for s in scores) + f" | {avg:.2f} | {share:.1f} | "
                     f"{agree:.1f} | {nll:.3f} | {kept:.3f} | {100 * (1 - kept):.1f}% | {share_of} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--tasks", default=",".join(RULER_DEFAULT), help="RULER tasks (comma list or 'all'; '' = none)")
    p.add_argument("--longbench", default="", help="LongBench-mini tasks, e.g. 'hotpotqa,2wikimqa'")
    p.add_argument("--length", type=int, default=1024, help="RULER prompt length / LongBench truncation")
    p.add_argument("--n", type=int, default=4, help="prompts per task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=4, help="prompts per prefill")
    p.add_argument("--variants", default="all",
                   help="';'-separated names (" + ", ".join(VARIANTS) + ") or specs of compressors that observe "
                        "nothing, e.g. 'semanticache(0.5, chunking=\"fixed\")', 'streamingllm(0.2)'")
    p.add_argument("--question", choices=("agnostic", "aware"), default="agnostic")
    p.add_argument("--follow", type=int, default=32, help="tokens of full attention's answer teacher-forced")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "semanticache_ablation"))
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    rows = run(args)
    os.makedirs(args.out, exist_ok=True)
    info = {"args": vars(args), "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "date": time.strftime("%Y-%m-%d"), "seconds": time.perf_counter() - t0}
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    text = table(rows)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write(text + "\n")
    print(f"\n{json.dumps(info)}\n{text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
