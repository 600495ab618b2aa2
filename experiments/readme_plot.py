"""The README's plot: Qwen2.5-Coder-1.5B-Instruct's score (95% interval) against the KV kept or read per
decode step, from the records in docs/results/qwen2.5-coder-1.5b_h200 (H200, 2026-11-27, 25 samples per
task): RULER at 8k and at 32k (13 tasks) and RULER's value-type needles at 16k (numbers, words, uuids), all
question-agnostic, complete rows only. The records are read and summarised by the functions the report
uses (:mod:`sparsekv_jax.eval.report`), so every number here is the report's.

Drawn: each method and baseline as its paper sets it (:func:`drawn`), at every budget it ran; the ablations,
opt-in variants and quantised caches are in the report, not here (with them the legend outgrew the panels).
The value-type panel averages the columns every nearly complete drawn row ran (:func:`shared_columns`).

    python experiments/readme_plot.py            # writes docs/results/readme_frontier.png
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path
from typing import Any

from sparsekv_jax.eval import report

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"
RECORDS = RESULTS / "qwen2.5-coder-1.5b_h200"
MODEL = "qwen2.5-coder-1.5b"
PANELS = (("ruler", 8192, "RULER at 8k: 13 tasks"),
          ("ruler", 32768, "RULER at 32k: 13 tasks"),
          ("ruler-variants", 16384, "value-type needles at 16k: {tasks} tasks\n× (numbers, words, uuids)"))
# the families drawn, and the keyword arguments a drawn row may name (what a method needs, not an option)
FAMILIES = ("fullkv", "snapkv", "h2o", "streamingllm", "quest", "adakv", "bm25", "semanticache", "stem", "chess",
            "s3hybrid", "bser")
NEEDED_ARGUMENTS = ("calibration", "saes")
_KEYWORD = re.compile(r"(\w+)=")
_NEEDED = re.compile(r", (?:calibration|saes)='[^']*'")


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


def drawn(policy: str) -> bool:
    """Whether the README draws ``policy``: a method or baseline of :data:`FAMILIES` with no option but what it
    needs (CHESS's calibration, S3's SAEs) and a bf16 cache."""
    return (report.family_name(policy) in FAMILIES and "[kv=" not in policy
            and set(_KEYWORD.findall(policy)) <= set(NEEDED_ARGUMENTS))


def short_name(policy: str) -> str:
    """``policy`` without the file it names (``chess('moderate')``, ``s3hybrid(0.25)``): the legend's label."""
    return _NEEDED.sub("", policy)


def shared_columns(recs: list[dict[str, Any]], share: float = 0.9) -> set[str]:
    """The columns that every policy of ``recs`` completing at least ``share`` of all the columns has completed,
    kept only for the tasks that have all their value types among them (so the panel weighs the types alike).
    A row that completed fewer columns is then partial on the panel, and not drawn: without the threshold, two
    rows that ran half the suite cut the panel to 4 of its 8 tasks. A policy completes a column when it has as
    many records in it as any policy has (a run cut inside the last column must not make every row partial)."""
    counts = Counter((r["policy"], r["column"]) for r in recs)
    most: dict[str, int] = {}
    for (_, column), n in counts.items():
        most[column] = max(most.get(column, 0), n)
    by_policy: dict[str, set[str]] = {}
    for (policy, column), n in counts.items():
        if n == most[column]:
            by_policy.setdefault(policy, set()).add(column)
    if not by_policy:
        return set()
    every = set.union(*by_policy.values())
    cols = set.intersection(*(c for c in by_policy.values() if len(c) >= share * len(every)))
    types = {c.split("@")[1] for c in every}
    per_task: dict[str, set[str]] = {}
    for c in cols:
        per_task.setdefault(c.split("@")[0], set()).add(c.split("@")[1])
    return {c for c in cols if per_task[c.split("@")[0]] == types}


def panel_summary(recs: list[dict[str, Any]], suite: str, length: int) -> dict[str, Any]:
    """The summary one panel draws: the :func:`drawn` rows of ``suite`` at ``length``, on the columns they all ran
    (every column, for RULER's default mix: partial rows are then left out by the drawing, not by this)."""
    rs = [r for r in recs if drawn(r["policy"]) and r.get("model") == MODEL and r.get("suite") == suite
          and r.get("length") == length and r.get("question") == "agnostic"]
    if suite == "ruler-variants":
        cols = shared_columns(rs)
        rs = [r for r in rs if r["column"] in cols]
    return summary(rs, suite, length)


def point_groups(summ: dict[str, Any]) -> list[tuple[float, float, list[str]]]:
    """The drawn points (complete rows but full attention) that sit together as ``(x, y, [policy names])``, to name
    each group once beside it (``chess ×3``: three readings). A point joins a group when its KV kept is within 10%
    of the group's first and its score within 5 points of any member's (a chain: two groups 6 points apart would
    otherwise print their multi-line labels over each other)."""
    pts = sorted((report.kv_kept(r), r["ci"]["average"][0], r["policy"])
                 for r in summ["rows"] if report.is_complete(r) and r["family"] != "fullkv" and r.get("ci")
                 and report.kv_kept(r) is not None)
    groups: list[list[tuple[float, float, str]]] = []
    for p in pts:
        linked = [g for g in groups if abs(g[0][0] - p[0]) <= 0.1 * p[0] and any(abs(q[1] - p[1]) <= 5 for q in g)]
        groups = [g for g in groups if g not in linked] + [[q for g in linked for q in g] + [p]]  # p may join two
    out = []
    for g in groups:
        # a policy alone in its family is named as its record spells it (an opt-in rule, e.g. SemantiCache's
        # digit rule, must not pass for the default); several readings of one family that sit together, once
        families = [report.family_name(q[2]) for q in g]
        counts = {f: families.count(f) for f in dict.fromkeys(families)}
        names = [f"{f} ×{k}" if k > 1 else short_name(next(q[2] for q in g if report.family_name(q[2]) == f))
                 for f, k in counts.items()]
        out.append((max(q[0] for q in g), sum(q[1] for q in g) / len(g), names))
    return out


def main(argv: list[str] | None = None) -> None:
    """Draw and save the plot (``--out``, default docs/results/readme_frontier.png)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=RESULTS / "readme_frontier.png", help="the PNG to write")
    out = p.parse_args(argv).out
    recs = records()
    styles = report.policy_styles([r["policy"] for r in recs if drawn(r["policy"])])  # the report's colours
    plt = report.pyplot()
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5.8 * len(PANELS), 6.2), layout="constrained", squeeze=False)
    handles: dict[str, Any] = {}
    for ax, (suite, length, title) in zip(axes[0], PANELS, strict=True):
        summ = panel_summary(recs, suite, length)
        report.draw_kv_panel(ax, summ, styles, handles)
        tasks = len({c.split("@")[0] for c in summ["columns"]})
        ax.set_title(title.format(tasks=tasks), fontsize="medium")
        ax.set_xlabel("KV kept (compressors) or read per decode step (Quest, CHESS)", fontsize="small")
        for x, y, names in point_groups(summ):
            if names == ["stem"]:
                ax.annotate("stem: at 1, it saves prefill\ncompute, not KV", (x, y), xytext=(0.45, y - 22),
                            fontsize="small", color="0.25", arrowprops={"arrowstyle": "->", "color": "0.5"})
            else:
                ax.annotate(",\n".join(names), (x, y), xytext=(9, 0), textcoords="offset points", va="center",
                            fontsize="x-small", color="0.25")
        partial = sum(not report.is_complete(r) for r in summ["rows"])
        if partial:
            ax.text(0.01, 0.01, f"{partial} partial rows not drawn", transform=ax.transAxes, fontsize="x-small",
                    color="0.4", va="bottom")
    labels = sorted(handles, key=lambda x: (report.family_name(x) != "fullkv", list(styles).index(x)))
    fig.legend([handles[x] for x in labels],
               ["fullkv (dashed; band: its 95% CI)" if x == "fullkv" else short_name(x) for x in labels],
               loc="outside lower center", ncols=6, fontsize=9, frameon=False)
    fig.suptitle("Qwen2.5-Coder-1.5B-Instruct, question-agnostic, n = 25 per task, average score with 95% CI; "
                 "each method as its paper sets it (H200, 2026-11-27 to 29)", fontsize="medium")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    print(out)


if __name__ == "__main__":
    main()
