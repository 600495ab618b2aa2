"""Compare two `sparsekv eval` runs of the same prompts (e.g. the code before and after a refactor,
on one machine): per policy, the average score of each run and how many predictions are identical.

    python experiments/compare_eval_runs.py OLD_DIR NEW_DIR [--pair OLD_SPEC=NEW_SPEC ...] [--out compare.md]

Records are matched by (task, length, question mode, seed, sample index) and by the policy's label
(the spec text), so resume keys written by different code versions need not agree; ``--pair`` matches
an old label to a new one where a default changed between the versions (the same behaviour spelled
differently). "same prompts" counts the matched samples whose answers and prompt length agree (the two
versions generated the same task). Reads ``results.jsonl`` or ``results.jsonl.gz``.
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


def compare(old: list[dict], new: list[dict], pairs: dict[str, str] | None = None) -> list[dict]:
    """One row per (new) policy label: samples matched, mean score of each run, identical predictions
    and matched prompts. ``pairs`` maps an old label to the new label it is compared with."""
    pairs = pairs or {}

    def key(r: dict, label: str) -> tuple:
        return label, r["task"], r.get("length"), r.get("question"), r.get("seed"), r["index"]

    by_key = {key(r, pairs.get(r["policy"], r["policy"])): r for r in old}
    rows: dict[str, dict] = defaultdict(lambda: {"n": 0, "old": 0.0, "new": 0.0, "same": 0, "prompts": 0})
    for r in new:
        o = by_key.get(key(r, r["policy"]))
        if o is None:
            continue
        row = rows[r["policy"]]
        row["n"] += 1
        row["old"] += o["score"]
        row["new"] += r["score"]
        row["same"] += o["prediction"] == r["prediction"]
        row["prompts"] += (o.get("answers"), o.get("prompt_tokens")) == (r.get("answers"), r.get("prompt_tokens"))
    olds = {v: k for k, v in pairs.items()}
    return [{"policy": p, "old_policy": olds.get(p, p), "samples": v["n"], "old_mean": v["old"] / v["n"],
             "new_mean": v["new"] / v["n"], "identical_predictions": v["same"] / v["n"],
             "same_prompts": v["prompts"] / v["n"]} for p, v in rows.items() if v["n"]]


def parse_pair(text: str) -> tuple[str, str]:
    """``OLD_SPEC=NEW_SPEC`` (split at the first ``=`` that is not inside parentheses)."""
    depth = 0
    for i, ch in enumerate(text):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "=" and depth == 0:
            return text[:i].strip(), text[i + 1:].strip()
    raise argparse.ArgumentTypeError(f"--pair wants OLD_SPEC=NEW_SPEC, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", help="run directory (or results file) of the reference code")
    ap.add_argument("new", help="run directory (or results file) of the code under test")
    ap.add_argument("--pair", action="append", default=[], type=parse_pair, metavar="OLD_SPEC=NEW_SPEC",
                    help="compare the old run's OLD_SPEC rows with the new run's NEW_SPEC rows (repeatable)")
    ap.add_argument("--out", help="also write the table (markdown) here")
    args = ap.parse_args(argv)
    rows = compare(read_records(args.old), read_records(args.new), dict(args.pair))
    if not rows:
        raise SystemExit("no sample is in both runs")
    lines = ["| policy | samples | old mean | new mean | identical predictions | same prompts |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        label = r["policy"] if r["old_policy"] == r["policy"] else f"{r['policy']} (old: {r['old_policy']})"
        lines.append(f"| {label} | {r['samples']} | {r['old_mean']:.2f} | {r['new_mean']:.2f} | "
                     f"{100 * r['identical_predictions']:.1f}% | {100 * r['same_prompts']:.1f}% |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
