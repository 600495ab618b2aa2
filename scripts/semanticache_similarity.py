"""Why SemantiCache loses RULER's numeric needles on SmolLM2: the key cosines GSC compares.

For RULER single-needle prompts, the cosine of pre-RoPE keys (the policy's default similarity) of
token pairs inside the needle's number (its digits are single tokens) and inside haystack chunks
(the paper's chunks: runs between delimiters), per layer, averaged over KV heads; then, for each
budget, the share of the number's digits that SemantiCache keeps as their own entry (a singleton,
bias 0) over all (layer, KV head).

    python scripts/semanticache_similarity.py --out docs/results/semanticache_similarity.json
"""

from __future__ import annotations

import argparse
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.cache import init_cache
from sparsekv_jax.generate import prefill
from sparsekv_jax.models.rope import inverse_frequencies
from sparsekv_jax.policies import Dense, SemantiCache
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.clustering import rotate


def pair_cosines(unit: np.ndarray, runs: list[list[int]]) -> np.ndarray:
    """``[L, H]`` mean cosine over the pairs inside each run (``unit``: ``[L, H, T, D]`` unit keys)."""
    pairs = [(r[a], r[b]) for r in runs for a in range(len(r)) for b in range(a + 1, len(r))]
    i, j = np.array(pairs).T
    return np.einsum("lhpd,lhpd->lhp", unit[:, :, i], unit[:, :, j]).mean(-1)


def main(argv: list[str] | None = None) -> int:
    from sparsekv_jax.eval.ruler import generate_samples
    from sparsekv_jax.models.embedded import load

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="niah_single_1,niah_single_2")
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--n", type=int, default=2)
    p.add_argument("--budgets", default="0.2,0.35,0.5")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    params, tok = load("smollm2", progress=False)
    cfg = params.config
    mask = np.asarray(SemantiCache.from_tokenizer(tok).delimiter_mask)
    report = []
    for task in args.tasks.split(","):
        for s in generate_samples(task, args.length, args.n, 0, tok):
            ids = np.array(tok(s.context, add_special_tokens=False)["input_ids"])
            T = len(ids)
            pieces = [tok.decode([i]) for i in ids]
            ends = np.cumsum([len(x) for x in pieces])
            at = "".join(pieces).find(s.answers[0])
            number = [t for t in range(T) if ends[t] > at and ends[t] - len(pieces[t]) < at + len(s.answers[0])]
            runs, run = [], []
            for t in range(4, T - 32):
                if mask[ids[t]] or t in number:
                    if len(run) > 1:
                        runs.append(run)
                    run = []
                else:
                    run.append(t)
            tokens, lengths = jnp.asarray(ids[None], jnp.int32), jnp.asarray([T], jnp.int32)
            cache = init_cache(cfg, 1, T, page_size=16, dtype=jnp.float32)
            _, cache, _, _ = jax.jit(lambda t, ln, c: prefill(params, Dense(), t, ln, c))(tokens, lengths, cache)
            k = cache.layers.k[:, 0, :, :T]  # [L, H, T, D]
            pre = np.asarray(rotate(k, -jnp.broadcast_to(jnp.arange(T), k.shape[:-1]), inverse_frequencies(cfg)))
            unit = pre / np.linalg.norm(pre, axis=-1, keepdims=True)
            row = {"task": task, "index": s.index, "tokens": T, "answer": s.answers[0],
                   "digit_tokens": [pieces[t] for t in number],
                   "cos_number": [round(float(x), 3) for x in pair_cosines(unit, [number]).mean(1)],
                   "cos_haystack_chunks": [round(float(x), 3) for x in pair_cosines(unit, runs).mean(1)],
                   "digits_kept_singleton": {}}
            for chunking in ("delimiters", "fixed"):
                for budget in map(float, args.budgets.split(",")):
                    pol = SemantiCache.from_tokenizer(tok, budget, chunking=chunking).bind(Setup(cfg, prompt_len=T))
                    comp = jax.jit(lambda c, pr, pol=pol, T=T: pol.compress(c, None, T, pr))(
                        cache, Prompt(tokens=tokens, lengths=lengths))
                    pos, bias = np.asarray(comp.layers.positions[:, 0]), np.asarray(comp.layers.bias[:, 0])
                    alone = np.mean([((pos == t) & (bias == 0)).any(-1).mean() for t in number])
                    row["digits_kept_singleton"][f"{chunking}@{budget}"] = round(float(alone), 3)
            report.append(row)
            print(json.dumps(row), flush=True)
    print("\nmean over prompts: cosine of pre-RoPE keys, pairs inside the number vs inside haystack chunks")
    print("layer " + " ".join(f"{layer:>5}" for layer in range(0, cfg.num_layers, 3)))
    for key in ("cos_number", "cos_haystack_chunks"):
        mean = np.mean([r[key] for r in report], axis=0)
        print(f"{key:<20}" + " ".join(f"{x:>5.2f}" for x in mean[::3]))
    print("\nshare of the number's digits kept as their own entry (mean over layers, heads, prompts)")
    for key in report[0]["digits_kept_singleton"]:
        print(f"  {key:<18}{np.mean([r['digits_kept_singleton'][key] for r in report]):.3f}")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
