"""Where does CHESS rank the needle's page? (diagnostic, SmolLM2, RULER niah_single_1 prompts)

For each prompt (the question read after the context, as `sparsekv eval` does), builds the cache
once and asks the policy itself (`CHESS._page_scores` / `select_pages`) how it ranks the page that
holds the needle, for the four page-vector variants: the paper's (mean of the stored, post-RoPE
keys), centred, pre-RoPE (keys rotated back to position 0), and pre-RoPE + centred (the default). With
``--answers`` it also generates each variant's answer at the given presets.

    python scripts/chess_needle_ranks.py --length 4096 --seeds 0,1,2,3 --answers moderate,aggressive \
        --out docs/results/chess_needle_ranks_4k.json
"""

from __future__ import annotations

import argparse
import json

import jax
import numpy as np
from tqdm import tqdm

from sparsekv_jax import load
from sparsekv_jax.engine import prepare, setup
from sparsekv_jax.eval import ruler, runner
from sparsekv_jax.generate import generate
from sparsekv_jax.policies import CHESS, Dense
from sparsekv_jax.policies.base import Setup

VARIANTS = {"post-RoPE (paper)": {"keys": "post_rope", "centred": False},
            "post-RoPE, centred": {"keys": "post_rope", "centred": True},
            "pre-RoPE": {"keys": "pre_rope", "centred": False},
            "pre-RoPE, centred (default)": {"keys": "pre_rope", "centred": True}}


def needle_page(tok, ctx: list[int], answer: str, page_size: int) -> int:
    needle = tok(" " + answer, add_special_tokens=False)["input_ids"]
    at = [i for i in range(len(ctx) - len(needle) + 1) if list(ctx[i:i + len(needle)]) == needle]
    if not at:
        raise ValueError(f"needle {answer!r} not found in the context's tokens")
    return at[0] // page_size


def prompt_cache(params, policy, ctx: list[int], q: list[int]):
    """The cache as the first decode step sees it (context prefilled, question read)."""
    run = setup(params, policy, np.array([ctx]), suffix=np.array([q]), max_new_tokens=12, page_size=16)
    return jax.jit(prepare)(params, run).cache


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--seeds", default="0,1,2,3", help="comma-separated sample seeds")
    ap.add_argument("--answers", default="", help="comma-separated presets to generate answers with")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args()
    params, tok = load(args.model, progress=False)
    cfg = params.config
    stop = tuple(cfg.eos_token_ids)
    presets = [p for p in args.answers.split(",") if p]
    rows = []
    for seed in tqdm([int(s) for s in args.seeds.split(",")], desc="prompts"):
        s = ruler.generate_samples("niah_single_1", args.length, 1, seed, tok, chat=True)[0]
        ctx, q = runner._encode(tok, s)
        base = CHESS.moderate()
        cache = prompt_cache(params, base, ctx, q)
        page = needle_page(tok, ctx, s.answers[0], base.page_size)
        row = {"seed": seed, "answer": s.answers[0], "needle_page": page,
               "pages": int(-(-int(cache.length[0]) // base.page_size)), "variants": {}}
        if presets:
            full = generate(params, Dense(), np.array([ctx]), suffix=np.array([q]), max_new_tokens=12,
                            stop_tokens=stop)
            row["full"] = tok.decode(full.sequences()[0])
        for name, kw in VARIANTS.items():
            pol = CHESS.moderate(**kw).bind(Setup(cfg))
            scores, in_use = pol._page_scores(cache, cache.length)
            forced = np.asarray(pol._forced(cache.length, in_use.shape[1]))[0]
            cand = np.asarray(in_use)[0] & ~forced
            sc = np.where(cand, np.asarray(scores)[0], -np.inf)
            order = np.argsort(-sc, kind="stable")
            v = {"rank": int(np.where(order == page)[0][0]), "candidates": int(cand.sum()),
                 "top": order[:6].tolist()}
            for preset in presets:
                p = CHESS(ratios=preset, **kw).bind(Setup(cfg))
                v[f"selected_{preset}"] = bool(np.asarray(p.select_pages(cache, cache.length))[0, page])
                out = generate(params, p, np.array([ctx]), suffix=np.array([q]), max_new_tokens=12, stop_tokens=stop)
                text = tok.decode(out.sequences()[0])
                v[f"answer_{preset}"] = text
                v[f"right_{preset}"] = s.answers[0] in text
            row["variants"][name] = v
        rows.append(row)
    print(f"\nniah_single_1 at {args.length} tokens; rank of the needle's page among the candidate pages "
          f"(0 = best){'; ✓ = answer right' if presets else ''}")
    head = "| variant | " + " | ".join(f"seed {r['seed']} (page {r['needle_page']}/{r['pages']})" for r in rows)
    print(head + " |\n|---|" + "---|" * len(rows))
    for name in VARIANTS:
        cells = []
        for r in rows:
            v = r["variants"][name]
            marks = "".join(("✓" if v[f"right_{p}"] else "✗") for p in presets)
            cells.append(f"{v['rank']}" + (f" {marks}" if presets else ""))
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"length": args.length, "presets": presets, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
