"""Where BSER's relevance scores fall on real prompts: per prompt, the spread of the block cosines
``s``, how the (α, β) gates split the blocks, and what happens to the needle (its blocks' ``s``,
tier, and how many of its tokens the selection keeps). SmolLM2, RULER needle tasks, question-aware.

    python scripts/bser_diagnose.py --task niah_single_2 --length 1k --n 4 \\
        --variants "BSER(); BSER(centred=True); BSER(embedding='hidden'); BSER(salience='softmax')"

Each variant is a Python expression for a `BSER` (defaults = threshold mode, cap 50%).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--task", default="niah_single_2")
    p.add_argument("--length", default="1k")
    p.add_argument("--n", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="BSER(); BSER(centred=True); BSER(embedding='hidden')")
    args = p.parse_args(argv)

    from sparsekv_jax.cache import init_cache
    from sparsekv_jax.eval import ruler
    from sparsekv_jax.eval.runner import parse_length
    from sparsekv_jax.generate import prefill
    from sparsekv_jax.models.embedded import load
    from sparsekv_jax.policies import BSER
    from sparsekv_jax.policies.base import Prompt, Setup

    params, tok = load(args.model, progress=False)
    cfg = params.config
    rows = []
    for s in ruler.generate_samples(args.task, parse_length(args.length), args.n, args.seed, tok, chat=True):
        enc = tok(s.context, add_special_tokens=False, return_offsets_mapping=True)
        spans = s.meta["needle_spans"]
        needle = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if any(a < e and b > st for st, e in spans)]
        rows.append((enc["input_ids"], tok(s.question, add_special_tokens=False)["input_ids"], needle))
    width = -(-max(len(c) + len(q) for c, q, _ in rows) // 64) * 64
    tokens = np.zeros((len(rows), width), np.int32)
    for i, (c, q, _) in enumerate(rows):
        tokens[i, : len(c) + len(q)] = c + q
    lengths = jnp.asarray([len(c) + len(q) for c, q, _ in rows], jnp.int32)
    qs = jnp.asarray([len(c) for c, _, _ in rows], jnp.int32)
    prompt = Prompt(tokens=jnp.asarray(tokens), lengths=lengths, question_start=qs)
    for text in args.variants.split(";"):
        policy = eval(text.strip(), {"BSER": BSER}).bind(Setup(cfg, prompt_len=width))  # noqa: S307 - our own CLI
        obs = jax.jit(lambda t, policy=policy: prefill(params, policy, t, lengths, init_cache(cfg, len(rows), width),
                                                       question_start=qs)[2]["compress"])(prompt.tokens)
        sel = policy.select(obs, prompt)
        s, tier, scores = np.asarray(sel["s"]), np.asarray(sel["tier"]), np.asarray(sel["scores"])
        print(f"== {text.strip()}  (alpha={policy.alpha}, beta={policy.beta}, cap {policy.max_kept})")
        for i, (c, _, needle) in enumerate(rows):
            nb = -(-len(c) // policy.block_size)
            si = s[i, :nb]
            kept = set(np.argsort(-scores[i, : int(lengths[i])], kind="stable")[: int(sel["keep"][i])].tolist())
            blocks = sorted({t // policy.block_size for t in needle})
            counts = np.bincount(tier[i, :nb], minlength=3)
            print(f"  prompt {i}: s median {np.median(si):.2f} max {si.max():.2f}; blocks discard/refine/retain "
                  f"{counts[0]}/{counts[1]}/{counts[2]}; needle block s {[round(float(si[b]), 2) for b in blocks]} "
                  f"tier {[int(tier[i, b]) for b in blocks]} rank {[int((si > si[b]).sum()) for b in blocks]}; "
                  f"needle tokens kept {sum(t in kept for t in needle)}/{len(needle)}; gated "
                  f"{int(sel['gated'][i]) / int(lengths[i]):.2f}, kept {int(sel['keep'][i]) / int(lengths[i]):.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
