"""RULER 4k and 8k, both question modes, SmolLM2: SemantiCache keeping the sentences that hold a digit (the
default since 2026-11-26 19:00 UTC), the words that hold one (the default from 16:00), only the digits (the
default before), and as the paper writes it
(digits merge), against SnapKV, H2O, StreamingLLM and (question-aware)
BSER at 20 / 35 / 50%. Every number comes from a committed `summary.json` of a `sparsekv eval` run on an
H100 with the same prompts (seed 0, n = 25 per task); the sources of each panel are listed below.
`python docs/results/semanticache_numbers_h100/plot.py` draws `score_vs_budget.png` and prints the table."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

here = Path(__file__).parent
res = here.parent
words = res / "semanticache_number_words_h100"
sentences = res / "semanticache_number_sentences_h100"
PANELS = {  # (question, length): summaries; the first that has a policy gives its row
    ("agnostic", 4096): [sentences / "s4ag", here / "k4ag", words / "w4ag",
                         res / "semanticache_eval_h100/sc_ruler4k_agnostic",
                         res / "methods_h100/ruler4k_agnostic", res / "bser_rows_h100/r4ag"],
    ("agnostic", 8192): [sentences / "s8ag", here / "k8ag", words / "w8ag",
                         res / "semanticache_eval_h100/sc_ruler8k_agnostic",
                         res / "semanticache_eval_h100/round2/sc8k", res / "bser_rows_h100/r8ag"],
    ("aware", 4096): [sentences / "s4aw", here / "k4aw", words / "w4aw", res / "aware_budgets_h100/a4",
                      res / "aware_budgets_h100/b4",
                      res / "bser_eval_h100/ruler4k_aware_budgets"],
    ("aware", 8192): [sentences / "s8aw", here / "k8aw", words / "w8aw", res / "aware_budgets_h100/c8",
                      res / "aware_budgets_h100/d8",
                      res / "bser_eval_h100/ruler8k_aware_budgets"],
}
LINES = {  # label -> policy spec as recorded
    "semanticache (number sentences kept)": "semanticache({b}, number_sentences=64)",
    "semanticache (number words kept)": "semanticache({b}, number_words=True)",
    "semanticache (digits kept)": "semanticache({b}, keep_numbers=True)",
    "semanticache (paper: digits merge)": "semanticache({b})",
    "snapkv": "snapkv({b})", "h2o": "h2o({b})", "streamingllm": "streamingllm({b})", "bser": "bser({b})",
}
BUDGETS = (0.2, 0.35, 0.5)


def averages(sources: list[Path]) -> dict[str, float]:
    """``{policy: average}``; the first source that has a policy gives its row (full attention: the
    first source's, the run the new rows were seeded from)."""
    out: dict[str, float] = {}
    for src in sources:
        for row in json.loads((src / "summary.json").read_text())["rows"]:
            out.setdefault(row["policy"], row["average"])
    return out


fig, axes = plt.subplots(2, 2, figsize=(11, 8.6))
table = ["| policy | " + " | ".join(f"{q} {n // 1024}k {int(100 * b)}%" for q, n in PANELS for b in BUDGETS) + " |",
         "|---|" + "---:|" * (len(PANELS) * len(BUDGETS))]
found = {panel: averages(src) for panel, src in PANELS.items()}
for label, spec in LINES.items():
    cells = []
    for ax, panel in zip(axes.flat, PANELS, strict=True):
        ys = [found[panel].get(spec.format(b=b)) for b in BUDGETS]
        cells += ["" if y is None else f"{y:.2f}" for y in ys]
        if any(y is not None for y in ys):
            ax.plot([100 * b for b in BUDGETS], ys, marker="o", label=label,
                    lw=2.6 if "sentences" in label else 1.6 if "kept" in label else 1.2,
                    ls=":" if "paper" in label else "--" if "digits" in label else "-." if "words" in label
                    else "-")
    table.append(f"| {label} | " + " | ".join(cells) + " |")
for ax, (question, length) in zip(axes.flat, PANELS, strict=True):
    ax.axhline(found[question, length]["fullkv"], color="black", ls="--", label="full attention")
    ax.set_title(f"RULER {length // 1024}k, question-{question}, 13 tasks × 25")
    ax.set_xticks([100 * b for b in BUDGETS])
    ax.set_xlabel("KV kept (% of the prompt)")
    ax.set_ylabel("average score")
fig.legend(*axes[0, 0].get_legend_handles_labels(), loc="lower center", ncol=4, fontsize=8)
fig.suptitle("SmolLM2-135M, H100: SemantiCache keeping numbers (sentences, words, digits), the paper's rule, "
             "the baselines")
fig.tight_layout(rect=(0, 0.07, 1, 1))
fig.savefig(here / "score_vs_budget.png", dpi=110)
print("\n".join(table))
print("full attention: " + ", ".join(f"{q} {n // 1024}k {found[q, n]['fullkv']:.2f}" for q, n in PANELS))
