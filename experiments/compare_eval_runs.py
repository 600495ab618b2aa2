"""Compare two `sparsekv eval` runs of the same prompts (e.g. the code before and after a refactor,
on one machine): per policy, the average score of each run and how many predictions are identical.

    python experiments/compare_eval_runs.py OLD_DIR NEW_DIR [--out compare.md]

Records are matched by (task, length, question mode, seed, sample index) and by the policy's label
(the spec text), so resume keys written by different code versions need not agree. Reads
``results.jsonl`` or ``results.jsonl.gz``.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path


def read_records(run: str | Path) -> list[dict]:
    run = Path(run)
    path = run if run.is_file() else next((run / n for n in ("results.jsonl", "results.jsonl.gz")
                                           if (run / n).exists()), None)
    if path is None:
        raise SystemExit(f"no results.jsonl(.gz) in {run}")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def compare(old: list[dict], new: list[dict]) -> list[dict]:
    """One row per policy label: samples matched, mean score of each run, identical predictions."""
    def key(r: dict) -> tuple:
        return r["policy"], r["task"], r.get("length"), r.get("question"), r.get("seed"), r["index"]

    by_key = {key(r): r for r in old}
    rows: dict[str, dict] = defaultdict(lambda: {"n": 0, "old": 0.0, "new": 0.0, "same": 0})
    for r in new:
        o = by_key.get(key(r))
        if o is None:
            continue
        row = rows[r["policy"]]
        row["n"] += 1
        row["old"] += o["score"]
        row["new"] += r["score"]
        row["same"] += o["prediction"] == r["prediction"]
    return [{"policy": p, "samples": v["n"], "old_mean": v["old"] / v["n"], "new_mean": v["new"] / v["n"],
             "identical_predictions": v["same"] / v["n"]} for p, v in rows.items() if v["n"]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="run directory (or results file) of the reference code")
    ap.add_argument("new", help="run directory (or results file) of the code under test")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    rows = compare(read_records(args.old), read_records(args.new))
    if not rows:
        raise SystemExit("no sample is in both runs")
    lines = ["| policy | samples | old mean | new mean | identical predictions |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['policy']} | {r['samples']} | {r['old_mean']:.2f} | {r['new_mean']:.2f} | "
              f"{100 * r['identical_predictions']:.1f}% |" for r in rows]
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
