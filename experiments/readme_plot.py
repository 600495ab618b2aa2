"""The README's plot: RULER-4k score against the KV read per decode step and the KV stored, for
every policy recorded in docs/results/ruler4k and docs/results/ruler4k_chess_stem (SmolLM2-135M,
25 samples per task).

    python experiments/readme_plot.py            # writes docs/results/readme_frontier.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
RUNS = ("ruler4k", "ruler4k_chess_stem")


def rows() -> list[dict]:
    """Summary rows of the recorded runs, full attention once."""
    out, seen = [], set()
    for run in RUNS:
        for row in json.loads((RESULTS / run / "summary.json").read_text())["rows"]:
            if row["policy"] not in seen:
                seen.add(row["policy"])
                out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    """Draw and save the plot (``--out``, default docs/results/readme_frontier.png)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS / "readme_frontier.png", help="the PNG to write")
    out = p.parse_args(argv).out
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for i, r in enumerate(rows()):
        label = r["policy"].replace(", calibration='smollm2'", "")
        x = min(r["kv_stored_fraction"], r["kv_read_fraction"])
        ax.scatter(x, r["average"], s=36, color=plt.get_cmap("tab20")(i % 20), label=f"{label}: {r['average']:.1f}")
    ax.set_xlim(0, 1.05)
    ax.set_xlabel("KV kept or read per decode step (fraction of full attention)")
    ax.set_ylabel("RULER 4k average (13 tasks)")
    ax.set_title("SmolLM2-135M-Instruct, RULER at 4k tokens, n = 25 per task", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6.5, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    fig.savefig(out, dpi=110, bbox_inches="tight")
    print(out)


if __name__ == "__main__":
    main()
