"""Which CHESS pages hold a RULER needle's answer, and did the selection keep them? (diagnostic)

For chosen samples of a RULER task (the same prompts `sparsekv eval --suite ruler` builds for that
seed and length), builds the cache as the first decode step sees it (context, then the question),
finds the answer's tokens in the context, and reports, for every CHESS page from the needle
sentence's start to the answer's last token: its rank among the candidate pages and whether the
policy's `select_pages` kept it.

    python scripts/chess_needle_pages.py --task niah_single_2 --length 4096 --seed 0 \
        --indices 0,1,2,10,11,12,16,24 --out needle_pages.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).parent))
from chess_needle_ranks import prompt_cache  # noqa: E402

from sparsekv_jax import load  # noqa: E402
from sparsekv_jax.eval import ruler, runner  # noqa: E402
from sparsekv_jax.policies import CHESS  # noqa: E402
from sparsekv_jax.policies.base import Setup  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--task", default="niah_single_2", help="a RULER niah task (default niah_single_2)")
    ap.add_argument("--length", type=int, default=4096, help="prompt tokens (default 4096)")
    ap.add_argument("--seed", type=int, default=0, help="sample seed, as `sparsekv eval --seed` (default 0)")
    ap.add_argument("--n", type=int, default=25, help="samples generated for the seed, as `--n` (default 25)")
    ap.add_argument("--indices", default="0,1,2", help="comma-separated sample indices to inspect")
    ap.add_argument("--preset", default="moderate", help="CHESS preset (default moderate)")
    ap.add_argument("--lead", type=int, default=20, help="tokens before the answer counted as its sentence")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.task not in ruler.RULER_TASKS or not args.task.startswith("niah"):
        raise SystemExit(f"--task {args.task!r}: expected a RULER niah task")
    indices = [int(i) for i in args.indices.split(",") if i]
    if any(not 0 <= i < args.n for i in indices):
        raise SystemExit(f"--indices {args.indices!r}: each must be in [0, {args.n})")

    params, tok = load(args.model, progress=False)
    pol = CHESS(ratios=args.preset).bind(Setup(params.config))
    ps = pol.page_size
    samples = ruler.generate_samples(args.task, args.length, args.n, args.seed, tok, chat=True)
    rows = []
    for i in tqdm(indices, desc="samples"):
        s = samples[i]
        ctx, q = runner._encode(tok, s)
        cache = prompt_cache(params, pol, ctx, q)
        answer = tok(" " + s.answers[0], add_special_tokens=False)["input_ids"]
        at = [j for j in range(len(ctx) - len(answer) + 1) if list(ctx[j:j + len(answer)]) == answer]
        if not at:
            raise SystemExit(f"sample {i}: answer {s.answers[0]!r} not found in the context's tokens")
        first, last = at[0], at[0] + len(answer) - 1
        selected = np.asarray(pol.select_pages(cache, cache.length))[0]
        scores, in_use = pol._page_scores(cache, cache.length)
        forced = np.asarray(pol._forced(cache.length, in_use.shape[1]))[0]
        candidate = np.asarray(in_use)[0] & ~forced
        order = np.argsort(-np.where(candidate, np.asarray(scores)[0], -np.inf), kind="stable")
        pages = range(max(0, first - args.lead) // ps, last // ps + 1)
        rows.append({"index": i, "answer": s.answers[0], "answer_tokens": [first, last],
                     "answer_pages": sorted({first // ps, last // ps}),
                     "pages_in_use": int(np.asarray(in_use)[0].sum()), "pages_selected": int(selected.sum()),
                     "pages": [{"page": p, "rank": int(np.where(order == p)[0][0]), "selected": bool(selected[p])}
                               for p in pages]})
    print(f"\n{args.task} @ {args.length}, seed {args.seed}, CHESS {args.preset} (page {ps}): the answer's pages "
          "(rank among candidates, kept?)")
    print("| sample | answer tokens | straddles a page boundary | pages from the sentence's start | "
          "every answer page kept |\n|---|---|---|---|---|")
    for r in rows:
        cells = ", ".join(f"p{c['page']}: {c['rank']} {'✓' if c['selected'] else '✗'}" for c in r["pages"])
        kept = all(c["selected"] for c in r["pages"] if c["page"] in r["answer_pages"])
        print(f"| {r['index']} | {r['answer_tokens'][0]}–{r['answer_tokens'][1]} | "
              f"{'yes' if len(r['answer_pages']) > 1 else 'no'} | {cells} | {'yes' if kept else 'no'} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
