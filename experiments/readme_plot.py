"""The README's plot: Qwen2.5-Coder-1.5B-Instruct's score (95% interval) against the KV kept or read per
decode step, from the records in docs/results/qwen2.5-coder-1.5b_h200 (H200, 2026-11-27, 25 samples per
task): RULER at 8k and at 32k (13 tasks) and RULER's value-type needles at 16k (numbers, words, uuids), all
question-agnostic, complete rows only. The records are read and summarised by the functions the report
uses (:mod:`sparsekv_jax.eval.report`), so every number here is the report's.

    python experiments/readme_plot.py            # writes docs/results/readme_frontier.png
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from sparsekv_jax.eval import report

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
RECORDS = RESULTS / "qwen2.5-coder-1.5b_h200"
MODEL = "qwen2.5-coder-1.5b"
PANELS = (("ruler", 8192, "RULER at 8k: 13 tasks"),
          ("ruler", 32768, "RULER at 32k: 13 tasks"),
          ("ruler-variants", 16384, "value-type needles at 16k: 17 tasks\n(numbers, words, uuids)"))


def records(source: Path = RECORDS) -> list[dict[str, Any]]:
    """Every record of ``source`` (the last per key, as the report reads them), question-aware samples
    paired with question-agnostic full attention (:func:`report.with_agnostic_reference`)."""
    recs: dict[str, dict[str, Any]] = {}
    for f in report.find_results([source]):
        for r in report.load_results(f):
            recs[r.get("key", str(len(recs)))] = r
    return report.with_agnostic_reference(list(recs.values()))


def summary(recs: list[dict[str, Any]], suite: str, length: int, question: str = "agnostic") -> dict[str, Any]:
    """The report's summary of one model, suite, length and question mode (its rows, order and intervals)."""
    rs = [r for r in recs if r.get("model") == MODEL and r.get("suite") == suite and r.get("length") == length
          and r.get("question") == question]
    if not rs:
        raise ValueError(f"no {MODEL} {suite} records at length {length}, question-{question} in {RECORDS}")
    return report.summarize(rs, policy_order=report.row_order(rs), column_order=report.column_order(rs))


def point_groups(summ: dict[str, Any]) -> list[tuple[float, float, list[str]]]:
    """The drawn points (complete rows but full attention) that sit together (KV kept within 10%, scores within
    5 points) as ``(x, y, [policy names])``, to name each group once beside it (``chess ×3``: three readings)."""
    pts = sorted((report.kv_kept(r), r["ci"]["average"][0], r["policy"])
                 for r in summ["rows"] if report.is_complete(r) and r["family"] != "fullkv" and r.get("ci")
                 and report.kv_kept(r) is not None)
    groups: list[list[tuple[float, float, str]]] = []
    for p in pts:
        g = next((g for g in groups if abs(g[0][0] - p[0]) <= 0.1 * p[0] and abs(g[0][1] - p[1]) <= 5), None)
        if g is None:
            groups.append([p])
        else:
            g.append(p)
    out = []
    for g in groups:
        # a policy alone in its family is named as its record spells it (an opt-in rule, e.g. SemantiCache's
        # digit rule, must not pass for the default); several readings of one family that sit together, once
        families = [report.family_name(q[2]) for q in g]
        counts = {f: families.count(f) for f in dict.fromkeys(families)}
        names = [f"{f} ×{k}" if k > 1 else next(q[2] for q in g if report.family_name(q[2]) == f)
                 for f, k in counts.items()]
        out.append((max(q[0] for q in g), sum(q[1] for q in g) / len(g), names))
    return out


def main(argv: list[str] | None = None) -> None:
    """Draw and save the plot (``--out``, default docs/results/readme_frontier.png)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS / "readme_frontier.png", help="the PNG to write")
    out = p.parse_args(argv).out
    recs = records()
    styles = report.policy_styles([r["policy"] for r in recs])  # the report's colours and markers
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.8 * len(PANELS), 4.6), layout="constrained", squeeze=False)
    handles: dict[str, Any] = {}
    for ax, (suite, length, title) in zip(axes[0], PANELS, strict=True):
        summ = summary(recs, suite, length)
        report.draw_kv_panel(ax, summ, styles, handles)
        ax.set_title(title, fontsize="medium")
        ax.set_xlabel("KV kept (compressors) or read per decode step (Quest, CHESS)", fontsize="small")
        for x, y, names in point_groups(summ):
            if names == ["stem"]:
                ax.annotate("stem: at 1, it saves prefill\ncompute, not KV", (x, y), xytext=(0.5, y - 22),
                            fontsize="small", color="0.25", arrowprops={"arrowstyle": "->", "color": "0.5"})
            else:
                ax.annotate(",\n".join(names), (x, y), xytext=(9, 0), textcoords="offset points", va="center",
                            fontsize="small", color="0.25")
        partial = sum(not report.is_complete(r) for r in summ["rows"])
        if partial:
            ax.text(0.01, 0.01, f"{partial} partial rows not drawn", transform=ax.transAxes, fontsize="x-small",
                    color="0.4", va="bottom")
    labels = sorted(handles, key=lambda x: (report.family_name(x) != "fullkv", list(styles).index(x)))
    fig.legend([handles[x] for x in labels],
               ["fullkv (dashed; band: its 95% CI)" if x == "fullkv" else x for x in labels],
               loc="outside lower center", ncols=2, fontsize=9, frameon=False)
    fig.suptitle("Qwen2.5-Coder-1.5B-Instruct, question-agnostic, n = 25 per task, average score with 95% CI "
                 "(H200, 2026-11-27)", fontsize="medium")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(out)


if __name__ == "__main__":
    main()
