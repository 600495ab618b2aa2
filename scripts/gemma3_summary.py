"""One summary of scripts/gemma3_gpu.sh's RULER runs, from their results.jsonl (a run cut by the device's
time limit writes no summary of its own): every policy at 8k / 16k / 32k in one table, with "% of full"
against question-agnostic full attention (`sparsekv_jax.eval.report` writes summary.md/json and
score_vs_length.png). The question-aware rows (BSER and its SnapKV comparison) are labelled so.

    python scripts/gemma3_summary.py RUNS_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from sparsekv_jax.eval import report

RUNS = ("agnostic", "agnostic_32k", "chess_agnostic", "aware")


def main(runs: Path) -> None:
    records = []
    for d in RUNS:
        path = runs / d / "results.jsonl"
        for line in path.read_text().splitlines() if path.exists() else []:
            if line.strip():
                r = json.loads(line)
                if r.get("question") == "aware":
                    r["policy"] += " (question-aware)"
                records.append(r)
    if not records:
        print("no RULER records yet")
        return
    labels = sorted({r["policy"] for r in records}, key=lambda p: (p != "fullkv", p))  # full attention first
    report.write_reports(report.summarize(records, policy_order=labels), runs / "ruler")
    print(f"=== RULER: {len(records)} records\n" + (runs / "ruler" / "summary.md").read_text())


if __name__ == "__main__":
    main(Path(sys.argv[1]))
