"""CHESS ablation: uncertainty-triggered rebuilds vs rebuilding every k pages, at equal rebuilds.

The paper (Appendix C) compares its event-triggered reconstruction with a fixed window. Here:

1. run CHESS (``--preset``, calibrated thresholds, backtracking on) through `sparsekv eval` on
   tasks with long answers, and count its rebuilds per generated page;
2. run the fixed-interval variant with ``k = round(pages / rebuilds)`` — the same average number
   of rebuilds — on the same samples;
3. report both: task score, rebuilds, backtracks, KV read, and full attention's score.

    python scripts/chess_ablation.py --calibration sparsekv_jax/policies/calibration/smollm2.json \\
        --suite longbench --tasks gov_report,samsum,narrativeqa,qasper --length 8k --out runs/chess_ablation
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from sparsekv_jax.eval import runner


def _records(out: Path, policy_label: str) -> list[dict]:
    return [r for r in runner._read_results(out / "results.jsonl") if r.get("policy") == policy_label]


def _row(recs: list[dict], page_size: int) -> dict:
    pages = sum(max(0, r["generated_tokens"] - 1) // page_size for r in recs)
    return {"score": float(np.mean([r["score"] for r in recs])) * 100 if recs else float("nan"),
            "samples": len(recs), "generated_pages": pages,
            "reselections": sum(r["stats"].get("reselections", 0) for r in recs),
            "backtracks": sum(r["stats"].get("backtracks", 0) for r in recs),
            "kv_read": float(np.nanmean([r["stats"]["kv_read_fraction"] for r in recs])) if recs else float("nan")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--calibration", required=True, help="thresholds JSON from `sparsekv calibrate`")
    p.add_argument("--preset", default="aggressive")
    p.add_argument("--suite", default="longbench")
    p.add_argument("--tasks", default="gov_report,samsum,narrativeqa,qasper")
    p.add_argument("--length", default="8k")
    p.add_argument("--n", type=int, default=25)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16"))
    p.add_argument("--out", default="chess_ablation")
    p.add_argument("-q", "--quiet", action="store_true")
    args = p.parse_args(argv)

    import jax.numpy as jnp

    out = Path(args.out)
    common = dict(model=args.model, suite=args.suite, tasks=args.tasks.split(","),
                  lengths=runner.parse_lengths(args.length), n=args.n, out_dir=out, question="aware",
                  batch_size=args.batch_size, progress=not args.quiet, pad_multiple=1024,
                  dtype={"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype])
    event = f"chess('{args.preset}', calibration='{args.calibration}')"
    runner.run_eval(policies=event, **common)
    event_label = runner.policy_specs(event)[0].label
    ev = _row(_records(out, event_label), 32)
    interval = max(1, round(ev["generated_pages"] / max(ev["reselections"], 1)))
    fixed = f"chess('{args.preset}', trigger='interval', interval={interval})"
    runner.run_eval(policies=f"{event}, {fixed}", **common)
    fixed_label = runner.policy_specs(fixed)[0].label
    rows = {"full attention": _row(_records(out, runner.policy_specs("fullkv")[0].label), 32),
            f"event-triggered ({args.preset})": _row(_records(out, event_label), 32),
            f"every {interval} pages ({args.preset})": _row(_records(out, fixed_label), 32)}
    (out / "ablation.json").write_text(json.dumps({"interval": interval, "rows": rows, "args": vars(args)}, indent=2))
    lines = ["| run | score | samples | pages generated | rebuilds | backtracks | KV read |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['score']:.2f} | {r['samples']} | {r['generated_pages']} | {r['reselections']} | "
                     f"{r['backtracks']} | {r['kv_read']:.3f} |")
    (out / "ablation.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
