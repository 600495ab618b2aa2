"""Summaries of evaluation results: per-policy tables (JSON, markdown) and matplotlib plots.

Input is the list of result records :func:`sparsekv_jax.eval.runner.run_eval` appends to
``results.jsonl`` (one per task, length, policy and sample). :func:`summarize` aggregates them:
rows are policies, columns ``task@length`` (RULER's / LongBench's percentage, ``100 * mean``),
plus the average over columns, the share of the full-attention average kept (over the columns
both have), mean KV fractions stored/read, and mean fidelity metrics when present.
:func:`write_reports` writes ``summary.json``, ``summary.md``, ``score_vs_budget.png`` (one line
per policy family, budget on x) and ``score_vs_length.png`` (one line per policy).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["column_name", "load_results", "markdown_table", "plot_score_vs_budget", "plot_score_vs_length",
           "summarize", "write_reports"]

FIDELITY_KEYS = ("kl_first", "kl_mean", "top1_agreement", "layer_rel_error_mean")


def _length_label(length: int | None) -> str:
    if length is None:
        return ""
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def column_name(task: str, length: int | None) -> str:
    """``"niah_single_1@4k"``; just the task when there is no length."""
    return f"{task}@{_length_label(length)}" if length is not None else task


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``results.jsonl`` (the last one per ``key`` wins; broken lines are skipped)."""
    records: dict[str, dict[str, Any]] = {}
    anonymous: list[dict[str, Any]] = []
    with Path(path).open(encoding="utf-8") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "key" in rec:
                records[rec["key"]] = rec
            else:
                anonymous.append(rec)
    return list(records.values()) + anonymous


def _mean(values: Sequence[float]) -> float | None:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(vals) / len(vals) if vals else None


def _pct(scores: Sequence[float]) -> float:
    return round(100.0 * sum(scores) / len(scores), 2)


def _is_reference(row: dict[str, Any]) -> bool:
    return row["family"] == "fullkv"


def summarize(records: Sequence[dict[str, Any]], policy_order: Sequence[str] | None = None,
              column_order: Sequence[str] | None = None) -> dict[str, Any]:
    """Aggregate result records into ``{"columns", "rows", "reference", "lengths"}``.

    Each row: ``policy`` (label), ``family``, ``budget``, ``scores`` ``{column: pct}``, ``n``
    ``{column: samples}``, ``average`` (mean over its columns), ``kept_pct`` (its average over
    the full-attention row's, on the columns both have; ``None`` without a full-attention row),
    ``by_length`` ``{length: average over tasks}``, ``budget_fraction`` ``{length: budget as a
    fraction of the mean prompt}``, ``kv_stored_fraction``, ``kv_read_fraction``,
    ``seconds_per_sample`` and ``fidelity`` (means of :data:`FIDELITY_KEYS`, or ``None``).
    """
    by_policy: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_policy[r["policy"]].append(r)
    labels = [p for p in (policy_order or []) if p in by_policy] + sorted(p for p in by_policy
                                                                          if p not in (policy_order or []))
    cols_seen: list[str] = []
    col_length: dict[str, int | None] = {}
    for r in sorted(records, key=lambda r: (r.get("length") or 0, r["task"])):
        c = r.get("column") or column_name(r["task"], r.get("length"))
        col_length[c] = r.get("length")
        if c not in cols_seen:
            cols_seen.append(c)
    columns = [c for c in (column_order or []) if c in cols_seen] + [c for c in cols_seen
                                                                     if c not in (column_order or [])]
    rows = []
    for label in labels:
        recs = by_policy[label]
        per_col: dict[str, list[float]] = defaultdict(list)
        prompt_by_len: dict[str, list[int]] = defaultdict(list)
        for r in recs:
            c = r.get("column") or column_name(r["task"], r.get("length"))
            per_col[c].append(float(r["score"]))
            base = r.get("context_tokens") if r.get("question") == "agnostic" else r.get("prompt_tokens")
            if base:
                prompt_by_len[_length_label(r.get("length"))].append(int(base))
        scores = {c: _pct(per_col[c]) for c in columns if per_col.get(c)}
        by_length: dict[str, list[float]] = defaultdict(list)
        for c, s in scores.items():
            by_length[_length_label(col_length[c])].append(s)
        budget = recs[0].get("budget")
        fractions = {}
        for ln, toks in prompt_by_len.items():
            if isinstance(budget, float):
                fractions[ln] = budget
            elif isinstance(budget, int):
                fractions[ln] = min(1.0, budget / (sum(toks) / len(toks)))
        fid_recs = [r["fidelity"] for r in recs if r.get("fidelity")]
        rows.append({
            "policy": label,
            "family": recs[0].get("family", label),
            "budget": budget,
            "scores": scores,
            "n": {c: len(per_col[c]) for c in scores},
            "average": round(_mean(list(scores.values())), 2) if scores else None,
            "by_length": {ln: round(sum(v) / len(v), 2) for ln, v in by_length.items()},
            "budget_fraction": fractions,
            "kv_stored_fraction": _mean([r.get("stats", {}).get("kv_stored_fraction") for r in recs]),
            "kv_read_fraction": _mean([r.get("stats", {}).get("kv_read_fraction") for r in recs]),
            "seconds_per_sample": _mean([r.get("timing", {}).get("seconds_per_sample") for r in recs]),
            "fidelity": ({k: _mean([f.get(k) for f in fid_recs]) for k in FIDELITY_KEYS} if fid_recs else None),
        })
    ref = next((r for r in rows if _is_reference(r)), None)
    for row in rows:
        row["kept_pct"] = None
        if ref is None:
            continue
        common = [c for c in row["scores"] if c in ref["scores"]]
        ref_avg = _mean([ref["scores"][c] for c in common])
        if common and ref_avg:
            row["kept_pct"] = round(100.0 * _mean([row["scores"][c] for c in common]) / ref_avg, 1)
    uniq = sorted(set(col_length.values()), key=lambda x: math.inf if x is None else x)
    return {"columns": columns, "rows": rows, "reference": ref["policy"] if ref else None,
            "lengths": {_length_label(x): x for x in uniq}, "length_order": [_length_label(x) for x in uniq]}


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def markdown_table(summary: dict[str, Any]) -> str:
    """The summary as markdown: a header line and one table (rows policies, columns task@length)."""
    cols = summary["columns"]
    has_fid = any(r["fidelity"] for r in summary["rows"])
    head = ["policy", *cols, "average", "% of full kept", "KV stored", "KV read"]
    if has_fid:
        head += ["KL first", "KL mean", "top-1 agree", "attn rel err"]
    lines = []
    meta = [f"{k}: `{summary[k]}`" for k in ("model", "suite", "question", "seed", "n") if k in summary]
    if meta:
        lines += ["# Evaluation summary", "", ", ".join(meta), ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * (len(head) - 1)) + "|"]
    for r in summary["rows"]:
        cells = [r["policy"].replace("|", "\\|")] + [_fmt(r["scores"].get(c)) for c in cols]
        cells += [_fmt(r["average"]), _fmt(r["kept_pct"], 1), _fmt(r["kv_stored_fraction"], 3),
                  _fmt(r["kv_read_fraction"], 3)]
        if has_fid:
            f = r["fidelity"] or {}
            cells += [_fmt(f.get("kl_first"), 4), _fmt(f.get("kl_mean"), 4), _fmt(f.get("top1_agreement"), 3),
                      _fmt(f.get("layer_rel_error_mean"), 4)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Scores are RULER / LongBench percentages (100 × mean per-sample score). "
              "\"% of full kept\" is the policy's average over the full-attention (fullkv) average on "
              "the same columns. KV stored: entries kept after compression / prompt length; KV read: "
              "pages read per decode step / pages in use."]
    if has_fid:
        lines.append("Fidelity (against full attention on the same prompt): KL(full ‖ policy) at the first "
                     "answer token and mean along full attention's greedy answer, top-1 agreement, and "
                     "‖o_policy − o_full‖ / ‖o_full‖ of the attention outputs averaged over layers and steps.")
    return "\n".join(lines) + "\n"


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_score_vs_budget(summary: dict[str, Any], path: str | Path) -> Path:
    """Average score vs budget, one line per policy family, one panel per length; full attention dashed."""
    plt = _plt()
    lengths = summary.get("length_order") or [""]
    rows = summary["rows"]
    ref = next((r for r in rows if _is_reference(r)), None)
    others = [r for r in rows if not _is_reference(r) and r["budget"] is not None]
    tokens_axis = bool(others) and all(isinstance(r["budget"], int) for r in others)
    fig, axes = plt.subplots(1, len(lengths), figsize=(5 * len(lengths), 4), squeeze=False)
    for ax, ln in zip(axes[0], lengths, strict=True):
        families: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for r in others:
            y = r["by_length"].get(ln)
            x = r["budget"] if tokens_axis else r["budget_fraction"].get(ln)
            if y is not None and x is not None:
                families[r["family"]].append((float(x), y))
        for fam, pts in sorted(families.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=fam)
        if ref is not None and ref["by_length"].get(ln) is not None:
            ax.axhline(ref["by_length"][ln], color="black", linestyle="--", label="fullkv")
        if tokens_axis:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (tokens)")
        else:
            ax.set_xlim(0.0, 1.02)
            ax.set_xlabel("budget (fraction of the context)")
        ax.set_ylabel("average score")
        ax.set_title(f"length {ln}" if ln else "all samples")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # nothing to plot when no policy has a budget
            ax.legend(fontsize="small")
    fig.suptitle(f"{summary.get('suite', '')} · question-{summary.get('question', '')}".strip(" ·"))
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_score_vs_length(summary: dict[str, Any], path: str | Path) -> Path:
    """Average score vs context length, one line per policy (a bar chart when there are no lengths)."""
    plt = _plt()
    numeric = [(summary["lengths"][ln], ln) for ln in summary.get("length_order", []) if summary["lengths"].get(ln)]
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if numeric:
        for r in summary["rows"]:
            pts = [(x, r["by_length"][ln]) for x, ln in numeric if ln in r["by_length"]]
            if pts:
                style = "--" if _is_reference(r) else "-"
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", label=r["policy"])
        ax.set_xscale("log", base=2)
        ax.set_xticks([x for x, _ in numeric], [ln for _, ln in numeric])
        ax.set_xlabel("context length (tokens)")
    else:
        labels = [r["policy"] for r in summary["rows"]]
        ax.bar(range(len(labels)), [r["average"] or 0.0 for r in summary["rows"]])
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize="small")
    ax.set_ylabel("average score")
    ax.grid(alpha=0.3)
    if numeric:
        ax.legend(fontsize="small")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_reports(summary: dict[str, Any], out_dir: str | Path) -> dict[str, Path]:
    """Write ``summary.json``, ``summary.md``, ``score_vs_budget.png``, ``score_vs_length.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "summary.json", "md": out / "summary.md"}
    paths["json"].write_text(json.dumps(summary, indent=2, default=str) + "\n")
    paths["md"].write_text(markdown_table(summary))
    if summary["rows"]:
        paths["budget_plot"] = plot_score_vs_budget(summary, out / "score_vs_budget.png")
        paths["length_plot"] = plot_score_vs_length(summary, out / "score_vs_length.png")
    return paths
