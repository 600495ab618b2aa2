"""Where BSER's selection cuts a needle: per RULER prompt (question-aware, the eval's own tokenization),
the needle's tokens, the block edges they straddle, each block's relevance ``s`` and tier, and which
needle tokens a variant keeps. One prefill per prompt set records the question's attention in every
layer (``probe_layers`` = all) and is cached (``--cache``), so variants are compared without
prefilling again; ``E`` = the token embeddings is recomputed from the weights.

    python scripts/bser_needle_edges.py --task niah_single_1 --length 4k --indices 1,6,12,15,18,0,2 \\
        --variants "BSER(budget=0.25); BSER(budget=0.5); BSER()"

Each variant is a Python expression for a `BSER` (``embedding="input"`` only). ``--generate``
also decodes each variant's answer (one more prefill per variant).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's sparsekv_jax, not an installed one


def needle_tokens(tok, sample, ctx_len: int) -> list[int]:
    """Context token indices that overlap the sample's needle spans (character offsets)."""
    enc = tok(sample.context, add_special_tokens=False, return_offsets_mapping=True)
    spans = sample.meta["needle_spans"]
    idx = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if any(a < e and b > s for s, e in spans)]
    shift = ctx_len - len(enc["input_ids"])  # the eval may add special tokens in front
    return [i + shift for i in idx]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--length", default="4k")
    p.add_argument("--n", type=int, default=25, help="samples generated (the eval's --n: the seed's stream)")
    p.add_argument("--indices", default="1,6,12,15,18")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--variants", default="BSER(budget=0.25); BSER()")
    p.add_argument("--cache", default="/tmp/bser_needle_edges")
    p.add_argument("--generate", action="store_true")
    p.add_argument("--max-new", type=int, default=16)
    args = p.parse_args(argv)

    from sparsekv_jax.cache import init_cache
    from sparsekv_jax.eval.batching import encode
    from sparsekv_jax.eval.runner import parse_length
    from sparsekv_jax.eval.suites import build_groups
    from sparsekv_jax.generate import generate, prefill
    from sparsekv_jax.models.embedded import load
    from sparsekv_jax.policies import BSER
    from sparsekv_jax.policies.base import Prompt, Setup
    from sparsekv_jax.policies.bser import embedding_stats, probe_queries

    params, tok = load(args.model, progress=False)
    cfg = params.config
    length = parse_length(args.length)
    _, groups = build_groups("ruler", [args.task], [length], args.n, args.seed, tok, cfg.max_position_embeddings,
                             None, None)
    samples = [groups[0].samples[int(i)] for i in args.indices.split(",")]
    rows = [encode(tok, s) for s in samples]
    width = -(-max(len(c) + len(q) for c, q in rows) // 1024) * 1024
    tokens = np.zeros((len(rows), width), np.int32)
    for i, (c, q) in enumerate(rows):
        tokens[i, : len(c) + len(q)] = c + q
    lengths = jnp.asarray([len(c) + len(q) for c, q in rows], jnp.int32)
    qs = jnp.asarray([len(c) for c, _ in rows], jnp.int32)
    prompt = Prompt(tokens=jnp.asarray(tokens), lengths=lengths, question_start=qs)

    path = f"{args.cache}_{args.task}_{args.length}_{args.seed}_{args.indices.replace(',', '-')}.npz"
    if os.path.exists(path):
        attn = np.load(path)["attn"]
    else:
        probe = BSER(budget=0.25, probe_layers=cfg.num_layers).bind(Setup(cfg, prompt_len=width))
        obs = jax.jit(lambda t: prefill(params, probe, t, lengths, init_cache(cfg, len(rows), width),
                                        question_start=qs)[2]["compress"]["attn"])(prompt.tokens)
        attn = np.asarray(obs)  # [layers, B, T]: every layer's question attention
        np.savez(path, attn=attn)
    E = params.embed[prompt.tokens]

    for text in args.variants.split(";"):
        policy = eval(text.strip(), {"BSER": BSER}).bind(Setup(cfg, prompt_len=width))  # noqa: S307 - our own CLI
        first = cfg.num_layers - policy.probed
        qpos, valid = probe_queries(prompt, policy.tail, policy.max_question, width, policy.min_question)
        stats = embedding_stats(E, qpos, valid, policy.block_size, False)
        obs = {"attn": jnp.asarray(np.where(np.arange(cfg.num_layers)[:, None, None] >= first, attn, 0.0)),
               **{k: v[None] for k, v in stats.items()}}
        obs = {k: jnp.concatenate([v, jnp.zeros((cfg.num_layers - v.shape[0],) + v.shape[1:], v.dtype)])
               if k != "attn" else v for k, v in obs.items()}
        sel = policy.select(obs, prompt)
        s, tier, scores = np.asarray(sel["s"]), np.asarray(sel["tier"]), np.asarray(sel["scores"])
        answers = None
        if args.generate:
            out = generate(params, policy, prompt.tokens, lengths=lengths, question_start=qs,
                           max_new_tokens=args.max_new, stop_tokens=tuple(cfg.eos_token_ids))
            answers = [tok.decode(seq) for seq in out.sequences()]
        bs = policy.block_size
        print(f"== {text.strip()}")
        for i, (sample, (c, _)) in enumerate(zip(samples, rows, strict=True)):
            needle = needle_tokens(tok, sample, len(c))
            kept = set(np.argsort(-scores[i, : int(lengths[i])], kind="stable")[: int(sel["keep"][i])].tolist())
            nb = -(-len(c) // bs)
            blocks = sorted({t // bs for t in needle})
            rank = {b: int((s[i, :nb] > s[i, b]).sum()) for b in blocks}
            marks = "".join("K" if t in kept else "." for t in needle)
            edges = [t for t in needle[1:] if t % bs == 0]
            toks = [tok.decode([int(tokens[i, t])]) for t in needle]
            print(f"  #{sample.index} answer {sample.answers[0]} needle {needle[0]}..{needle[-1]} blocks {blocks} "
                  f"edges at {edges}; s {[round(float(s[i, b]), 3) for b in blocks]} tier "
                  f"{[int(tier[i, b]) for b in blocks]} rank {[rank[b] for b in blocks]} of {nb}; "
                  f"s median {np.median(s[i, :nb]):.3f}; kept {len(kept) / int(lengths[i]):.2f}")
            print(f"      {marks}  {''.join(toks)!r}")
            if answers is not None:
                print(f"      -> {answers[i]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
