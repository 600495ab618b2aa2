"""RULER 4k and 8k, question-aware, SmolLM2: score against budget for BSER, SemantiCache and the three
eviction baselines at 20 / 35 / 50%, from the records of three device runs (docs/RESULTS.md), and the
table printed below the plot. `python docs/results/aware_budgets_h100/plot.py`."""

import gzip
import json
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
SOURCES = [here / d for d in ("a4", "b4", "c8", "d8")] + [
    here.parent / "bser_eval_h100" / d for d in ("ruler4k_aware_budgets", "ruler8k_aware_budgets")]
FAMILIES = ("bser", "snapkv", "semanticache", "h2o", "streamingllm")
BUDGETS = (0.2, 0.35, 0.5)
# BSER's rows as their records name them under today's defaults (scripts/migrate_records.py): token
# embeddings and B = 64 at both lengths; at 4k the first version (fixed anchors, refined tokens by block s,
# the question as given), at 8k the second round (docs/BSER.md)
BSER_ROW = {4096: "bser({}, block_size=64, min_question=1, fill=False, refine_order='block')",
            8192: "bser({}, block_size=64)"}

scores = defaultdict(list)  # (policy, length, task) -> per-sample scores, each record once
seen = set()
for src in SOURCES:
    with gzip.open(src / "results.jsonl.gz", "rt") as f:
        for line in f:
            r = json.loads(line)
            if r["key"] not in seen:
                seen.add(r["key"])
                scores[r["policy"], r["length"], r["task"]].append(r["score"])


def average(policy: str, length: int) -> float | None:
    tasks = [v for (p, n, _), v in scores.items() if p == policy and n == length]
    return 100 * sum(sum(v) / len(v) for v in tasks) / len(tasks) if len(tasks) == 13 else None


fig, axes = plt.subplots(1, 2, figsize=(10, 4), sharey=False)
lines = ["| policy | " + " | ".join(f"{int(b * 100)}% @{n // 1024}k" for n in (4096, 8192) for b in BUDGETS) + " |",
         "|---|" + "---:|" * 6]
for family in FAMILIES:
    row = []
    for ax, length in zip(axes, (4096, 8192), strict=True):
        ys = [average(BSER_ROW[length].format(b) if family == "bser" else f"{family}({b})", length) for b in BUDGETS]
        row += ["" if y is None else f"{y:.2f}" for y in ys]
        ax.plot([100 * b for b in BUDGETS], ys, marker="o", label=family, lw=2.2 if family == "bser" else 1.2)
    lines.append(f"| {family} | " + " | ".join(row) + " |")
for ax, length in zip(axes, (4096, 8192), strict=True):
    ax.axhline(average("fullkv", length), color="black", ls="--", label="full attention")
    ax.set_title(f"RULER {length // 1024}k, question-aware, n = 25 × 13 tasks")
    ax.set_xlabel("KV kept (% of the prompt)")
    ax.set_xticks([20, 35, 50])
axes[0].set_ylabel("average score")
axes[1].legend(fontsize=8, loc="lower right")
fig.suptitle("SmolLM2-135M, H100: every policy at the same budgets")
fig.tight_layout()
fig.savefig(here / "score_vs_budget.png", dpi=120)
print("\n".join(lines))
