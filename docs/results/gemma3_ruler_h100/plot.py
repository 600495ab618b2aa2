"""Score against context length for every policy in table.md (Gemma 3 270M, RULER needle tasks):
the mean of the four tasks at 8k / 16k / 32k;
question-aware rows dashed. `python docs/results/gemma3_ruler_h100/plot.py`."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
rows = [line.strip("|").split("|") for line in (here / "table.md").read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| policy")]
SAME = {"bser(0.5) (question-aware)", "semanticache(0.2)"}  # the same scores as bser / semanticache(0.25)
rows = [cells for cells in rows if cells[0].strip() not in SAME]
fig, ax = plt.subplots(figsize=(8, 5))
for i, cells in enumerate(rows):
    name, scores = cells[0].strip(), [float(c) for c in cells[1:13]]
    means = [sum(scores[i:i + 4]) / 4 for i in (0, 4, 8)]
    ax.plot([8, 16, 32], means, marker="o", lw=2.5 if name == "fullkv" else 1.2, label=name,
            ls="--" if "aware" in name else "-", color="black" if name == "fullkv" else plt.cm.tab20(i))
ax.set_xscale("log", base=2)
ax.set_xticks([8, 16, 32], ["8k", "16k", "32k"])
ax.set_xlabel("context (tokens)")
ax.set_ylabel("RULER needle tasks, mean score")
ax.set_title("Gemma 3 270M, RULER needle tasks (n = 25 each), H100")
ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
fig.tight_layout()
fig.savefig(here / "score_vs_length.png", dpi=120)
