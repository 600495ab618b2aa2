"""How much of a prompt SemantiCache's number rules keep unmerged: the share of its context tokens that
are digits (`keep_numbers`, ``number_words=False``) and that belong to a word holding a digit (the
default, ``number_words=True``), per task, on SmolLM2's tokenizer. LongBench-mini's contexts (the first
``--max-tokens`` tokens of each) and RULER's at ``--ruler-length``; no model is run.

    python scripts/semanticache_number_shares.py            # LongBench-mini, n = 26 per task, and RULER 4k

``--compare`` instead counts, per budget, the prompts whose score rose or fell from the digits-only rule
to the default in two committed `sparsekv eval` record files (LongBench-mini, question-agnostic, by default).
"""

from __future__ import annotations

import argparse
import gzip
import json

import jax.numpy as jnp
import numpy as np

from sparsekv_jax.policies import clustering


def shares(tok, masks, texts: list[str], max_tokens: int) -> tuple[float, float, float]:
    """Mean digit share, mean number-word share and the largest number-word share over ``texts``."""
    digits, starts, delims = masks
    d, w = [], []
    for text in texts:
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"][:max_tokens])[None]
        kept = clustering.number_words(*(jnp.asarray(m[ids]) for m in (digits, starts, delims)))
        d.append(digits[ids].mean())
        w.append(float(np.asarray(kept).mean()))
    return float(np.mean(d)), float(np.mean(w)), float(np.max(w))


def compare(digits_path: str, words_path: str) -> None:
    """Per budget: prompts with the same prediction, a higher and a lower score (words vs digits only)."""
    def records(path: str, label: str) -> dict:
        rows = (json.loads(line) for line in gzip.open(path, "rt"))
        return {(r["task"], r["index"]): r for r in rows if r["policy"] == label}

    print("| budget | prompts | same prediction | higher with words | lower with words |\n|---:|---:|---:|---:|---:|")
    for budget in ("0.2", "0.35", "0.5"):
        old = records(digits_path, f"semanticache({budget}, keep_numbers=True)")
        new = records(words_path, f"semanticache({budget}, number_words=True)")
        same = sum(new[k]["prediction"] == old[k]["prediction"] for k in old)
        up = sum(new[k]["score"] > old[k]["score"] for k in old)
        down = sum(new[k]["score"] < old[k]["score"] for k in old)
        print(f"| {budget} | {len(old)} | {same} | {up} | {down} |")


def main(argv: list[str] | None = None) -> int:
    from sparsekv_jax.eval.longbench import load_longbench
    from sparsekv_jax.eval.ruler import RULER_TASKS, generate_samples
    from sparsekv_jax.models.embedded import load

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=26, help="samples per task")
    p.add_argument("--max-tokens", type=int, default=8192, help="LongBench context tokens read")
    p.add_argument("--ruler-length", type=int, default=4096, help="RULER prompt length (0: skip RULER)")
    p.add_argument("--compare", nargs=2, metavar=("DIGITS", "WORDS"),
                   help="two results.jsonl.gz files: the digits-only rows and the default's")
    args = p.parse_args(argv)
    if args.compare:
        compare(*args.compare)
        return 0

    _, tok = load("smollm2", progress=False)  # the tokenizer; the converted weights load from the cache
    masks = (clustering.number_mask(tok), clustering.word_start_mask(tok), clustering.delimiter_mask(tok))
    print("| suite | task | digits | number words | number words, largest |\n|---|---|---:|---:|---:|")
    for task, samples in load_longbench().items():
        d, w, top = shares(tok, masks, [s.context for s in samples[:args.n]], args.max_tokens)
        print(f"| LongBench-mini | {task} | {d:.3f} | {w:.3f} | {top:.3f} |")
    if args.ruler_length:
        for task in RULER_TASKS:
            samples = generate_samples(task, args.ruler_length, args.n, 0, tok)
            d, w, top = shares(tok, masks, [s.context for s in samples], args.ruler_length)
            print(f"| RULER {args.ruler_length // 1024}k | {task} | {d:.3f} | {w:.3f} | {top:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
