"""Derive BSER's (α, β) for ``E`` = hidden states from the paper's (0.3, 0.7) for token embeddings.

The rule (answer-agnostic: no eval data, no answers, no scores). The paper's thresholds were set
for cosines between token embeddings. On a calibration set, pool the block relevances ``s`` of
every context block measured both ways, from one prefill:

* ``p_α`` = the share of blocks with ``s ≤ 0.3`` under token embeddings (discarded by the paper's α),
* ``p_β`` = the share of blocks with ``s < 0.7`` under token embeddings (not retained by the paper's β),

and take ``α``, ``β`` for hidden states as the ``p_α`` / ``p_β`` quantiles of ``s`` under hidden
states (order statistics: α = the ``n·p_α``-th smallest hidden-state ``s``, β = the
``n·(1 − p_β)``-th largest), rounded outwards to 3 decimals (α up, β down; hidden-state cosines are
bunched near 1, so 2 decimals would move many blocks). The gates then discard, refine and retain the same shares of
blocks as the paper's thresholds do with token embeddings. Where no embedding block falls at or
below 0.3 (``p_α = 0``), α is set just under the lowest hidden-state ``s`` seen.

Calibration set: ``--prompts`` prompts of about ``--tokens`` tokens cut from the WikiText-2 test
split the package ships (`sparsekv_jax.datasets.wikitext2_text`; not an eval suite), each from a
seeded article start, followed by a question naming one of the section headings inside it
("What does the text say about <heading>?"), in the model's chat template where it has one (as
the eval renders prompts). BSER's other settings are its defaults (block size, probe layers,
attention salience, question reach-back).

    python scripts/bser_thresholds.py                           # SmolLM2, 8 prompts of 2k tokens (CPU: ~1.5 min)
    python scripts/bser_thresholds.py --model gemma3-270m                     # CPU: ~3 min
    python scripts/bser_thresholds.py --model qwen2.5-coder-1.5b --prompts 4 --tokens 1024   # CPU: ~10 min
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time

import numpy as np

PAPER = (0.3, 0.7)


def calibration_texts(tok, n: int, tokens: int, seed: int) -> list[tuple[str, str]]:
    """``[(context text, question text)]``: WikiText-2 windows from seeded article starts, and a
    question naming a section heading inside each window (not its first line)."""
    from sparsekv_jax.datasets import wikitext2_text

    text = wikitext2_text()
    starts = [m.start() for m in re.finditer(r"^ = [^=\n]+ = \n", text, flags=re.M)]
    rng = np.random.default_rng(seed)
    out: list[tuple[str, str]] = []
    for start in rng.permutation(starts):
        ids = tok(text[start: start + 12 * tokens], add_special_tokens=False)["input_ids"][:tokens]
        window = tok.decode(ids)
        heads = [h.strip() for h in re.findall(r"^ = = ([^=\n]+?) = = \n", window, flags=re.M)]
        if len(ids) < tokens or not heads:
            continue
        out.append((window, f"\n\nQuestion: What does the text say about {heads[rng.integers(len(heads))]}?"))
        if len(out) == n:
            break
    return out


def relevances(params, tok, texts, chat: bool) -> tuple[dict[str, np.ndarray], tuple]:
    """``({"input": s, "hidden": s}, key)``: every context block's relevance under each ``E``, from one
    prefill of all prompts, set up as `generate` sets it up (`engine.run.setup`: on Gemma 3 the
    policy sees the global layers, as in the eval), observed by both policies at once; ``key`` is
    the model's `bser.config_key` (its `HIDDEN_THRESHOLDS` entry)."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax import local_layers
    from sparsekv_jax.engine.prefill import share_prefill
    from sparsekv_jax.engine.run import setup
    from sparsekv_jax.eval.tasks import render_prompt
    from sparsekv_jax.policies import BSER
    from sparsekv_jax.policies.base import Prompt
    from sparsekv_jax.policies.bser import config_key

    rows = []
    for context, question in texts:
        c, q = render_prompt(tok, context, question, chat=chat)
        rows.append((tok(c, add_special_tokens=not chat)["input_ids"], tok(q, add_special_tokens=False)["input_ids"]))
    width = -(-max(len(c) + len(q) for c, q in rows) // 64) * 64
    tokens = np.zeros((len(rows), width), np.int32)
    for i, (c, q) in enumerate(rows):
        tokens[i, : len(c) + len(q)] = c + q
    lengths = np.asarray([len(c) + len(q) for c, q in rows], np.int32)
    qs = np.asarray([len(c) for c, _ in rows], np.int32)
    # B = 64: the block size the table's pairs were derived at (the default until 2026-11-27; now 128)
    runs = [setup(params, BSER(0.25, embedding=e, block_size=64), tokens, lengths, question_start=qs, max_new_tokens=1)
            for e in ("input", "hidden")]
    seen = jax.jit(share_prefill)(params, runs)
    prompt = Prompt(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths), question_start=jnp.asarray(qs))
    s = {e: np.asarray(run.policy.select(pre.observations["compress"], prompt)["s"])
         for e, run, pre in zip(("input", "hidden"), runs, seen, strict=True)}
    return s, config_key(local_layers.policy_config(params.config, runs[0].backend))


def derive(s_input: np.ndarray, s_hidden: np.ndarray, paper: tuple[float, float] = PAPER) -> dict:
    """(α, β) for hidden states that discard / retain as many blocks as the paper's thresholds do
    with token embeddings (see the module docstring); inputs are the pooled finite ``s``."""
    h = np.sort(s_hidden)
    n_discard, n_retain = int(np.sum(s_input <= paper[0])), int(np.sum(s_input >= paper[1]))
    # 3 decimals, rounded outwards so the block at the boundary stays on its side (α up, β down)
    alpha = math.ceil(1000 * h[n_discard - 1]) if n_discard else math.floor(1000 * h[0]) - 1
    beta = math.floor(1000 * h[len(h) - n_retain]) if n_retain else math.ceil(1000 * h[-1]) + 1
    return {"p_alpha": n_discard / len(h), "p_beta": 1 - n_retain / len(h), "alpha": alpha / 1000, "beta": beta / 1000}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="an embedded model name, HF directory or .gguf")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=2048, help="context tokens per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from sparsekv_jax.eval.suites import has_chat_template
    from sparsekv_jax.models.embedded import load

    t0 = time.time()
    params, tok = load(args.model, dtype=getattr(jnp, args.dtype), progress=False)
    chat = has_chat_template(tok)
    texts = calibration_texts(tok, args.prompts, args.tokens, args.seed)
    s, key = relevances(params, tok, texts, chat)
    pooled = {k: v[np.isfinite(v)] for k, v in s.items()}
    d = derive(pooled["input"], pooled["hidden"])
    print(f"model {args.model}: {len(texts)} WikiText-2 prompts of {args.tokens} context tokens (seed {args.seed}), "
          f"chat template {chat}, {pooled['input'].size} blocks, {time.time() - t0:.0f} s")
    for i, (_, q) in enumerate(texts):
        print(f"  prompt {i}: {q.strip()!r}")
    qs = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
    print("quantile      " + " ".join(f"{q:6.2f}" for q in qs))
    for k, v in pooled.items():
        print(f"s ({k:6s})    " + " ".join(f"{x:6.3f}" for x in np.quantile(v, qs)))
    print(f"token embeddings, paper's (α, β) = {PAPER}: discard {d['p_alpha']:.3f}, refine "
          f"{d['p_beta'] - d['p_alpha']:.3f}, retain {1 - d['p_beta']:.3f} of the blocks")
    h = pooled["hidden"]
    print(f"hidden states, derived (α, β) = ({d['alpha']}, {d['beta']}): discard {np.mean(h <= d['alpha']):.3f}, "
          f"refine {np.mean((h > d['alpha']) & (h < d['beta'])):.3f}, retain {np.mean(h >= d['beta']):.3f}")
    print(f"hidden states, paper's (α, β): discard {np.mean(h <= PAPER[0]):.3f}, retain {np.mean(h >= PAPER[1]):.3f}")
    print(f"bser.HIDDEN_THRESHOLDS entry: {key}: ({d['alpha']}, {d['beta']})")
    print(json.dumps({"model": args.model, **d}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
