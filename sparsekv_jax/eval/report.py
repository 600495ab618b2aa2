"""Summaries of evaluation results: per-policy tables (JSON, markdown) and matplotlib plots.

Input is the list of result records :func:`sparsekv_jax.eval.runner.run_eval` appends to
``results.jsonl`` (one per task, length, policy and sample). :func:`summarize` aggregates them:
rows are policies, columns ``task@length`` (RULER's / LongBench's percentage, ``100 * mean``),
plus the average over columns, the share of the full-attention average kept (on the samples
both ran), mean KV fractions stored/read, and mean fidelity metrics when present. A row with fewer
columns or samples than full attention (a run stopped at its deadline) is *partial*: the tables
mark it and keep its average apart from complete rows', and the plots leave it out.
:func:`write_reports` writes ``summary.json``, ``summary.md``, ``score_vs_budget.png`` (one line
per policy family, budget on x) and ``score_vs_length.png`` (one line per policy).
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import re
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["BOOTSTRAP_RESAMPLES", "BOOTSTRAP_SEED", "column_name", "column_order", "draw_kv_panel", "family_name",
           "is_complete", "load_results", "markdown_table", "paired_bootstrap", "plot_needle_types",
           "plot_score_vs_budget", "plot_score_vs_kv", "plot_score_vs_length", "policy_styles", "pyplot",
           "regenerate", "row_order", "sample_key", "summarize", "with_agnostic_reference", "write_reports"]

FIDELITY_KEYS = ("kl_first", "kl_mean", "top1_agreement", "layer_rel_error_mean")
BOOTSTRAP_RESAMPLES = 2000  # resamples of every interval
BOOTSTRAP_SEED = 0


def _length_label(length: int | None) -> str:
    if length is None:
        return ""
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


def column_name(task: str, length: int | None) -> str:
    """``"niah_single_1@4k"``; just the task when there is no length."""
    return f"{task}@{_length_label(length)}" if length is not None else task


def load_results(path: str | Path) -> list[dict[str, Any]]:
    """Records of a ``results.jsonl`` or gzip'd ``results.jsonl.gz`` (the last one per ``key`` wins;
    broken lines are skipped)."""
    records: dict[str, dict[str, Any]] = {}
    anonymous: list[dict[str, Any]] = []
    path = Path(path)
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
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


def _reference_row(rows: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The full-attention row the others are measured against: the one on the model's own cache
    dtype where a table mixes cache dtypes (``fullkv [kv=int8]`` is a policy like any other then),
    else the first full-attention row."""
    refs = [r for r in rows if _is_reference(r)]
    return min(refs, key=lambda r: r.get("kv_dtype") is not None) if refs else None


def paired_bootstrap(policy: Mapping[str, Sequence[float]], reference: Mapping[str, Sequence[float]] | None = None,
                     *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED,
                     level: float = 0.95) -> dict[str, Any]:
    """Paired (stratified) bootstrap of a policy's average score against full attention's.

    ``policy[c]`` and ``reference[c]`` are the per-sample scores (in ``[0, 1]``) of column ``c``
    (a task at a length) on the same samples, in the same order. The average is the one of the
    summary tables: ``A = mean over columns of 100 * mean(scores of the column)``. Each resample
    draws, per column, ``n_c`` sample indices with replacement and takes the same indices for the
    policy and the reference (paired), so the interval reflects the samples both ran on rather
    than two independent draws. Draw order (for a replayable reference): ``rng =
    numpy.random.default_rng(seed)``; for each column in ``policy``'s order, ``rng.integers(0,
    n_c, size=(resamples, n_c))``. Intervals are percentile intervals (``numpy.percentile``, linear).

    Returns ``{"average": [A, lo, hi]}`` and, with a ``reference``, also ``"reference"`` (its
    average), ``"difference"`` (``A_policy - A_full``, in points) and ``"ratio"`` (``100 *
    A_policy / A_full``: the "% of full kept"; ``None`` when full attention's average is 0;
    resamples where it is 0 are left out and counted in ``"ratio_undefined"``); ``"n"`` samples
    per column; ``"resamples"``, ``"seed"``, ``"level"``. Raises ``ValueError`` for columns whose
    lengths differ or are empty.
    """
    import numpy as np

    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"resamples={resamples} must be >= 1 and level={level} in (0, 1)")
    cols = list(policy)
    if not cols:
        raise ValueError("no columns to bootstrap")
    if reference is not None and set(reference) != set(cols):
        raise ValueError(f"policy columns {sorted(cols)} differ from the reference's {sorted(reference)}")
    rng = np.random.default_rng(seed)
    q = [50 * (1 - level), 50 * (1 + level)]
    pol_avg = np.zeros(resamples)
    ref_avg = np.zeros(resamples)
    n = {}
    for c in cols:
        x = np.asarray(policy[c], np.float64)
        if x.ndim != 1 or x.size == 0:
            raise ValueError(f"column {c!r}: expected a non-empty list of scores")
        y = None if reference is None else np.asarray(reference[c], np.float64)
        if y is not None and y.shape != x.shape:
            raise ValueError(f"column {c!r}: {x.size} policy scores but {y.size} reference scores")
        n[c] = int(x.size)
        idx = rng.integers(0, x.size, size=(resamples, x.size))
        pol_avg += 100.0 * x[idx].mean(axis=1)
        if y is not None:
            ref_avg += 100.0 * y[idx].mean(axis=1)
    pol_avg /= len(cols)

    def interval(est: float, draws: Any) -> list[float]:
        lo, hi = np.percentile(draws, q)
        return [round(float(est), 3), round(float(lo), 3), round(float(hi), 3)]

    a = sum(100.0 * float(np.mean(policy[c])) for c in cols) / len(cols)
    out: dict[str, Any] = {"average": interval(a, pol_avg), "n": n, "resamples": resamples, "seed": seed,
                           "level": level}
    if reference is None:
        return out
    ref_avg /= len(cols)
    f = sum(100.0 * float(np.mean(reference[c])) for c in cols) / len(cols)
    out["reference"] = interval(f, ref_avg)
    out["difference"] = interval(a - f, pol_avg - ref_avg)
    ok = ref_avg > 0
    out["ratio_undefined"] = int((~ok).sum())
    out["ratio"] = interval(100.0 * a / f, 100.0 * pol_avg[ok] / ref_avg[ok]) if f > 0 and ok.any() else None
    return out


def sample_key(record: Mapping[str, Any]) -> tuple[Any, ...]:
    """What identifies a record's sample across policies: suite, seed, question mode, task, length, index."""
    return (record.get("suite"), record.get("seed"), record.get("question"), record["task"], record.get("length"),
            record.get("index"))


def with_agnostic_reference(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """``records`` plus, for every question-aware sample without a full-attention record, a copy of
    the question-agnostic full-attention record of the same sample, marked ``"reference_from":
    "agnostic"`` and placed in question-aware mode.

    Dense attention reads the same prompt tokens wherever the question is placed (nothing is
    dropped), so question-agnostic full attention is the question-aware reference too. The same
    sample: model, suite, seed, task, length, sample index; a record whose ``prompt_tokens``
    differ from a question-aware record's of that sample is not borrowed. A question-aware table
    then gets a full-attention row (``summarize`` pairs its policies with it by :func:`sample_key`)
    even when only the question-agnostic run recorded one.
    """
    def same_sample(r: Mapping[str, Any]) -> tuple[Any, ...]:
        return (r.get("model"), r.get("suite"), r.get("seed"), r["task"], r.get("length"), r.get("index"))

    aware = [r for r in records if r.get("question") == "aware"]
    have = {same_sample(r) for r in aware if r.get("family") == "fullkv"}
    prompts: dict[tuple[Any, ...], set[Any]] = defaultdict(set)
    for r in aware:
        if r.get("prompt_tokens") is not None:
            prompts[same_sample(r)].add(r["prompt_tokens"])
    groups = {(r.get("model"), r.get("suite"), r.get("length")) for r in aware}
    out = list(records)
    for r in records:
        k = same_sample(r)
        if (r.get("question") != "agnostic" or r.get("family") != "fullkv" or k in have
                or (r.get("model"), r.get("suite"), r.get("length")) not in groups):
            continue
        if r.get("prompt_tokens") is not None and prompts[k] - {r["prompt_tokens"]}:
            continue  # another prompt: not the same computation
        copy = dict(r, question="aware", reference_from="agnostic")
        if "key" in copy:
            copy["key"] = json.dumps(["reference_from", "agnostic", copy["key"]])
        out.append(copy)
    return out


def _paired_scores(recs: Sequence[dict[str, Any]], ref: Mapping[tuple[Any, ...], dict[str, Any]] | None
                   ) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Per column, the scores of ``recs`` that have a reference record of the same sample, and those."""
    pol: dict[str, list[float]] = defaultdict(list)
    full: dict[str, list[float]] = defaultdict(list)
    for r in sorted(recs, key=lambda r: (str(sample_key(r)))):
        c = r.get("column") or column_name(r["task"], r.get("length"))
        if ref is None:
            pol[c].append(float(r["score"]))
            continue
        other = ref.get(sample_key(r))
        if other is not None:
            pol[c].append(float(r["score"]))
            full[c].append(float(other["score"]))
    return dict(pol), dict(full)


def _coverage(have: Mapping[str, int], scores: Mapping[str, float], expected: Mapping[str, int],
              col_length: Mapping[str, int | None]) -> dict[str, Any]:
    """How much of ``expected`` (column → samples) a row covers with ``have`` (column → samples)."""
    missing = [c for c in expected if not have.get(c)]
    short = [c for c in expected if 0 < have.get(c, 0) < expected[c]]
    lengths: dict[str, bool] = {}
    for c, n in expected.items():
        ln = _length_label(col_length.get(c))
        lengths[ln] = lengths.get(ln, True) and have.get(c, 0) >= n
    return {"complete": not missing and not short, "columns": len(expected) - len(missing), "of": len(expected),
            "samples": sum(min(have.get(c, 0), n) for c, n in expected.items()), "of_samples": sum(expected.values()),
            "missing": missing, "short": short, "extra": [c for c in scores if c not in expected],
            "lengths": lengths}


def _overlap(a: Sequence[float] | None, b: Sequence[float] | None) -> bool:
    return a is not None and b is not None and a[1] <= b[2] and b[1] <= a[2]


def summarize(records: Sequence[dict[str, Any]], policy_order: Sequence[str] | None = None,
              column_order: Sequence[str] | None = None, *, resamples: int = BOOTSTRAP_RESAMPLES,
              seed: int = BOOTSTRAP_SEED) -> dict[str, Any]:
    """Aggregate result records into ``{"columns", "rows", "reference", "lengths"}``.

    Each row: ``policy`` (label), ``family``, ``budget``, ``scores`` ``{column: pct}``, ``n``
    ``{column: samples}``, ``average`` (mean over its columns), ``kept_pct`` (its average over
    the full-attention row's on the samples both ran: the paired estimate of ``ci["ratio"]``;
    ``None`` without a full-attention row), ``coverage`` (``complete``: the row has every column
    full attention has, with as many samples, or without a full-attention row every column of the
    table with the most samples any row has there; ``columns`` / ``of``, ``samples`` /
    ``of_samples``, ``missing`` and ``short`` columns, ``extra`` columns full attention lacks,
    ``lengths`` ``{length: complete there}``), ``reference_from`` (the question modes whose
    records a borrowed full-attention row holds, see :func:`with_agnostic_reference`, or ``None``),
    ``by_length`` ``{length: average over tasks}``, ``budget_fraction`` ``{length: budget as a
    fraction of the mean prompt}``, ``kv_stored_fraction``, ``kv_read_fraction``,
    ``seconds_per_sample`` and ``fidelity`` (means of :data:`FIDELITY_KEYS`, or ``None``);
    ``ci``: :func:`paired_bootstrap` of the row against full attention on the samples both have
    (matched by :func:`sample_key`; ``average``, ``difference`` in points, ``ratio`` = % of full
    kept, each ``[estimate, lo, hi]``), or of the row alone without a full-attention row;
    ``overlaps``: the other policies over the same columns and samples (and full attention) whose
    95% intervals of the % of full kept overlap this row's (of the average, without a
    full-attention row).
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
            "kv_dtype": recs[0].get("kv_dtype"),
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
    ref = _reference_row(rows)
    ref_records = None if ref is None else {sample_key(r): r for r in by_policy[ref["policy"]]}
    paired_n = {}
    for row in rows:
        pol, full = _paired_scores(by_policy[row["policy"]], ref_records)
        paired_n[row["policy"]] = {c: len(v) for c, v in pol.items()}
        # with a reference: the samples both ran on; without one: the row's own samples
        row["ci"] = (paired_bootstrap(pol, None if ref_records is None else full, resamples=resamples, seed=seed)
                     if pol else None)
        row["reference_from"] = sorted({r["reference_from"] for r in by_policy[row["policy"]]
                                        if r.get("reference_from")}) or None
    # what a complete row covers: full attention's columns and samples (without it, every column of the
    # table with the most samples any row has there)
    expected = dict(ref["n"]) if ref is not None else {
        c: max(r["n"].get(c, 0) for r in rows) for c in columns}
    for row in rows:
        row["coverage"] = _coverage(paired_n[row["policy"]], row["scores"], expected, col_length)
    # "≈": rows whose intervals of the % of full kept (their average's, without a reference) overlap, among
    # rows over the same columns and samples (a ratio over other columns is another quantity); full
    # attention's own is the point 100, so a row whose interval holds 100 lists it
    stat = "ratio" if ref is not None else "average"
    for row in rows:
        mine = row["ci"] or {}
        row["overlaps"] = [o["policy"] for o in rows if o is not row and _overlap(mine.get(stat), (o["ci"] or {}).get(
            stat)) and (_is_reference(o) or _is_reference(row) or mine.get("n") == (o["ci"] or {}).get("n"))]
    for row in rows:
        # the paired estimate: the row's average over full attention's on the samples both ran
        ratio = (row["ci"] or {}).get("ratio") if ref is not None else None
        row["kept_pct"] = None if ratio is None else round(ratio[0], 1)
    uniq = sorted(set(col_length.values()), key=lambda x: math.inf if x is None else x)
    return {"columns": columns, "rows": rows, "reference": ref["policy"] if ref else None,
            "lengths": {_length_label(x): x for x in uniq}, "length_order": [_length_label(x) for x in uniq]}


def _fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


def is_complete(row: Mapping[str, Any]) -> bool:
    """Whether a summary row covers every column and sample full attention has (not a partial row)."""
    return (row.get("coverage") or {}).get("complete", True)


def _complete_at(row: Mapping[str, Any], length: str) -> bool:
    return (row.get("coverage") or {}).get("lengths", {}).get(length, True)


def _coverage_text(row: Mapping[str, Any]) -> str:
    """``"complete"``, or ``"partial: 5 of 13 columns, 112 of 325 samples"``."""
    cov = row.get("coverage")
    if not cov:
        return "–"
    text = "complete" if cov["complete"] else (f"**partial**: {cov['columns']} of {cov['of']} columns, "
                                               f"{cov['samples']} of {cov['of_samples']} samples")
    if cov["extra"]:
        text += f"; +{len(cov['extra'])} columns full attention lacks"
    return text


def _display(row: Mapping[str, Any]) -> str:
    """The row's policy label (a borrowed full-attention row says whose records it holds)."""
    label = row["policy"]
    if row.get("reference_from"):
        label += f" (question-{', '.join(row['reference_from'])} records)"
    return label.replace("|", "\\|")


def markdown_table(summary: dict[str, Any]) -> str:
    """The summary as markdown: a header line and one table (rows policies, columns task@length).

    When a row is partial (fewer columns or samples than full attention, e.g. a run stopped at its
    deadline), a "coverage" column says how much it covers, its average moves out of "average"
    into "partial row: average over its columns" (an average over other columns is not comparable),
    and its "% of full kept" names the columns it is computed on.
    """
    cols = summary["columns"]
    rows = summary["rows"]
    has_fid = any(r["fidelity"] for r in rows)
    has_ref = summary.get("reference") is not None
    partial = any(not is_complete(r) for r in rows)
    head = ["#", "policy", *(["coverage"] if partial else []), *cols, "average", "95% CI",
            *(["partial row: average over its columns [95% CI]"] if partial else []), "% of full kept", "95% CI",
            "Δ vs full (points)", "≈ (intervals overlap)", "KV stored", "KV read"]
    number = {r["policy"]: i + 1 for i, r in enumerate(rows)}
    if has_fid:
        head += ["KL first", "KL mean", "top-1 agree", "attn rel err"]
    lines = []
    meta = [f"{k}: `{summary[k]}`" for k in ("model", "suite", "question", "seed", "n") if k in summary]
    if meta:
        lines += ["# Evaluation summary", "", ", ".join(meta), ""]
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---:", "---"] + ["---:"] * (len(head) - 2)) + "|"]
    for r in rows:
        ci = r.get("ci") or {}
        done = is_complete(r)
        cells = [str(number[r["policy"]]), _display(r), *([_coverage_text(r)] if partial else [])]
        cells += [_fmt(r["scores"].get(c)) for c in cols]
        cells += [_fmt(r["average"]) if done else "–", _interval(ci.get("average")) if done else "–"]
        if partial:
            cells.append("–" if done else f"{_fmt(r['average'])} {_interval(ci.get('average'))}")
        kept = _fmt(r["kept_pct"], 1)
        if not done and r["kept_pct"] is not None:
            cov = r["coverage"]
            kept += (f" (on its {cov['columns']} of {cov['of']} columns)" if cov["missing"] else
                     f" (on its {cov['samples']} of {cov['of_samples']} samples)")
        cells += [kept, _interval(ci.get("ratio"), 1), _signed(ci.get("difference")),
                  ", ".join(str(number[o]) for o in r.get("overlaps", [])) or "–",
                  _fmt(r["kv_stored_fraction"], 3), _fmt(r["kv_read_fraction"], 3)]
        if has_fid:
            f = r["fidelity"] or {}
            cells += [_fmt(f.get("kl_first"), 4), _fmt(f.get("kl_mean"), 4), _fmt(f.get("top1_agreement"), 3),
                      _fmt(f.get("layer_rel_error_mean"), 4)]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "Scores are RULER / LongBench percentages (100 × mean per-sample score). "
              "\"% of full kept\" is the policy's average over the full-attention (fullkv) average on "
              "the samples both ran. KV stored: entries kept after compression / prompt length; KV read: "
              "pages read per decode step / pages in use.", "", _ci_note(summary, has_ref)]
    if partial:
        lines += ["", _partial_note(has_ref)]
    borrowed = next((r for r in rows if r.get("reference_from")), None)
    if borrowed is not None:
        lines += ["", _borrowed_note(borrowed)]
    if has_fid:
        lines.append("Fidelity (against full attention on the same prompt): KL(full ‖ policy) at the first "
                     "answer token and mean along full attention's greedy answer, top-1 agreement, and "
                     "‖o_policy − o_full‖ / ‖o_full‖ of the attention outputs averaged over layers and steps.")
    return "\n".join(lines) + "\n"


def _partial_note(has_ref: bool) -> str:
    whole = "every column and sample full attention has" if has_ref else \
        "every column of the table with the most samples any row has there"
    return ("**Partial rows** (coverage \"partial\": the run stopped before the row had " + whole + "): their "
            "average is over their own columns only, often the first and easiest tasks, so it is not comparable "
            "with a complete row's and is shown apart, under \"partial row: average over its columns\", not under "
            "\"average\". Their \"% of full kept\" and Δ compare them with full attention on the columns and "
            "samples both ran, which the cell names. ≈ compares rows over the same columns and samples only. "
            "Plots leave partial rows out.")


def _borrowed_note(row: Mapping[str, Any]) -> str:
    modes = ", ".join(f"question-{m}" for m in row["reference_from"])
    return (f"Full attention in this table is the {modes} run's records of the same samples (model, suite, seed, "
            "task, length, sample index and prompt length): no full-attention run in this mode was recorded, "
            "and dense attention reads the same prompt tokens wherever the question is placed (nothing is "
            "dropped), so the two are the same computation. \"% of full kept\", Δ and the paired intervals pair "
            "each policy sample with that record.")


def _interval(ci: Sequence[float] | None, digits: int = 2) -> str:
    return "–" if ci is None else f"[{ci[1]:.{digits}f}, {ci[2]:.{digits}f}]"


def _signed(ci: Sequence[float] | None) -> str:
    return "–" if ci is None else f"{ci[0]:+.2f} [{ci[1]:+.2f}, {ci[2]:+.2f}]"


def _ci_note(summary: dict[str, Any], has_ref: bool) -> str:
    ci = next((r["ci"] for r in summary["rows"] if r.get("ci")), None)
    b, seed = (ci["resamples"], ci["seed"]) if ci else (BOOTSTRAP_RESAMPLES, BOOTSTRAP_SEED)
    if not has_ref:
        return (f"95% CI: percentile bootstrap of the average ({b} resamples of the samples within each column, "
                f"seed {seed}); no full-attention row, so no paired intervals. ≈ lists the rows over the same columns "
                "and samples whose average intervals overlap.")
    return (f"95% CI: paired percentile bootstrap against full attention ({b} resamples of the samples within each "
            f"column, the same resampled samples for the policy and for full attention, seed {seed}), on the samples "
            "both ran. \"average\": the policy's average; \"% of full kept\": the ratio of the two averages × 100; "
            "Δ: their difference in points. ≈ lists the rows (by #) over the same columns and samples (and full "
            "attention) whose \"% of full kept\" intervals overlap this "
            "row's: overlapping intervals do not separate the two policies at this sample size (non-overlap is "
            "the conservative reading; it is not a paired test of the two policies against each other).")


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (imported on first use: the tables need no matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


# ----------------------------------------------------------------------------------------------
# Plot styles: one colour per policy family, one marker (bar hatch) per policy within it, fixed for every
# panel and every plot of a report; labels are the records' own policy text.
# ----------------------------------------------------------------------------------------------

_MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">", "h", "p")
_HATCHES = ("", "//", "..", "xx", "\\\\", "++", "oo", "--", "||", "**", "O", "/.")
_REFERENCE_COLOUR = "0.2"


def family_name(label: str) -> str:
    """The policy's name, the record's label up to its first ``(`` or space (``chess('moderate', ...)`` →
    ``chess``, ``fullkv [kv=int8]`` → ``fullkv``)."""
    m = re.match(r"[^\s(\[]+", label)
    return m.group(0) if m else label


def policy_styles(labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``{policy label: {"color", "marker", "hatch"}}``: full attention dark grey, every other family a colour
    of its own (tab20, families in sorted order), every policy of a family a marker and bar hatch of its own
    (labels in sorted order). Pass the same map to every plot of a report so a policy looks the same in all."""
    plt = pyplot()
    uniq = sorted(dict.fromkeys(labels))
    families = sorted({family_name(x) for x in uniq} - {"fullkv"})
    cmap = plt.get_cmap("tab20")
    palette = [cmap(i) for i in (*range(0, 14, 2), 16, 18, *range(1, 14, 2), 17, 19)]  # tab20 less its greys
    colour = {f: palette[i % len(palette)] for i, f in enumerate(families)}
    colour["fullkv"] = _REFERENCE_COLOUR
    styles, seen = {}, defaultdict(int)
    for label in uniq:
        fam = family_name(label)
        k = seen[fam]
        seen[fam] += 1
        styles[label] = {"color": colour[fam], "marker": _MARKERS[k % len(_MARKERS)],
                         "hatch": _HATCHES[k % len(_HATCHES)]}
    return styles


def _styles_for(styles: Mapping[str, dict[str, Any]] | None, labels: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``styles`` where it names every label, else :func:`policy_styles` of ``labels``."""
    if styles is not None and all(x in styles for x in labels):
        return dict(styles)
    return policy_styles(list(styles or []) + list(labels))


def _ordered(styles: Mapping[str, Any], handles: Mapping[str, Any]) -> tuple[list[Any], list[str]]:
    """Legend handles in the style map's order (full attention first)."""
    labels = sorted(handles, key=lambda x: (family_name(x) != "fullkv", list(styles).index(x) if x in styles else 0))
    return [handles[x] for x in labels], labels


def _figure_legend(fig: Any, handles: Mapping[str, Any], styles: Mapping[str, Any], ncols: int,
                   note: str = "") -> Any:
    """One legend for the whole figure, below the panels (the constrained layout keeps it off every axes);
    ``note`` (what was left out and why) is its title, so the two never overlap."""
    if not handles and not note:
        return None
    h, labels = _ordered(styles, handles)
    leg = fig.legend(h, labels, loc="outside lower center", ncols=max(1, min(ncols, len(labels))),
                     fontsize="small", frameon=False, title_fontsize="small",
                     title=_wrap(note, int(fig.get_figwidth() * 14)) if note else None)
    if note:
        leg.get_title().set_color("0.3")
    return leg


def _grid(plt: Any, n: int, width: float = 5.6, height: float = 4.0, extra: float = 0.0) -> tuple[Any, list[Any]]:
    """A figure of ``n`` panels, at most two per row, with a constrained layout; spare grid cells removed."""
    ncols = 1 if n <= 1 else 2
    nrows = max(1, math.ceil(n / ncols))
    fig, axes = plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows + extra), squeeze=False,
                             layout="constrained")
    flat = list(axes.flat)
    for ax in flat[n:]:
        ax.remove()
    return fig, flat[:max(n, 1)]


def _save(plt: Any, fig: Any, path: str | Path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _wrap(text: str, width: int = 140) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text, width))


def _budget_free(label: str) -> str:
    """A policy label with its budget argument as ``·`` (the budget is the plot's x): ``snapkv(0.25)`` →
    ``snapkv(·)``, ``semanticache(0.25, protect='digit_sentences')`` → ``semanticache(·, protect=...)``."""
    return re.sub(r"\((\d+(\.\d+)?|\.\d+)(?=[,)])", "(·", label, count=1)


def plot_score_vs_budget(summary: dict[str, Any], path: str | Path,
                         styles: Mapping[str, dict[str, Any]] | None = None) -> Path:
    """Average score vs budget, one line per policy family (labelled by its policies' text with the budget as
    ``·``, or by the one policy's text), one panel per length (two per row); full attention dashed; one
    legend below the panels. A row partial at a length (see :func:`summarize`'s ``coverage``) has no point
    there; the panel title counts them. A length with no policy line to draw is left out, and the legend's
    title names it."""
    plt = pyplot()
    lengths = summary.get("length_order") or [""]
    rows = summary["rows"]
    styles = _styles_for(styles, [r["policy"] for r in rows])
    ref = _reference_row(rows)
    others = [r for r in rows if not _is_reference(r) and r["budget"] is not None]
    tokens_axis = bool(others) and all(isinstance(r["budget"], int) for r in others)
    panels, left_out = [], []
    for ln in lengths:
        families: dict[str, list[tuple[float, float, str]]] = defaultdict(list)
        partial = 0
        for r in others:
            if not _complete_at(r, ln):
                partial += r["by_length"].get(ln) is not None
                continue  # partial at this length: not drawn
            y = r["by_length"].get(ln)
            x = r["budget"] if tokens_axis else r["budget_fraction"].get(ln)
            if y is not None and x is not None:
                families[r["family"]].append((float(x), y, r["policy"]))
        name = f"length {ln}" if ln else "all samples"
        if families:
            panels.append((ln, name, families, partial))
        else:
            left_out.append(name + (f" ({partial} partial rows)" if partial else ""))
    title = f"{summary.get('suite', '')} · question-{summary.get('question', '')}".strip(" ·")
    note = ("Panels left out, no policy with a budget to show: " + "; ".join(left_out) + ".") if left_out else ""
    if not panels:  # nothing to draw: a strip that says so
        fig = plt.figure(figsize=(7.0, 1.3), layout="constrained")
        fig.text(0.5, 0.4, _wrap(note, 100), ha="center", va="center", fontsize="small", color="0.3")
        fig.suptitle(title)
        return _save(plt, fig, path)
    fig, axes = _grid(plt, len(panels))
    handles: dict[str, Any] = {}
    for ax, (ln, name, families, partial) in zip(axes, panels, strict=True):
        for _fam, pts in sorted(families.items()):
            pts.sort()
            label = pts[0][2] if len(pts) == 1 else " / ".join(dict.fromkeys(_budget_free(p[2]) for p in pts))
            st = styles[pts[0][2]]
            (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=st["marker"], color=st["color"],
                              markerfacecolor="none", markeredgewidth=1.5, label=label)
            handles.setdefault(label, line)
            styles.setdefault(label, st)
        if ref is not None and ref["by_length"].get(ln) is not None:
            handles.setdefault(ref["policy"], ax.axhline(ref["by_length"][ln], color=_REFERENCE_COLOUR,
                                                         linestyle="--", label=ref["policy"]))
        if tokens_axis:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("budget (tokens)")
        else:
            ax.set_xlim(0.0, 1.02)
            ax.set_xlabel("budget (fraction of the context)")
        ax.set_ylabel("average score")
        ax.set_title(name + (f"\n({partial} partial rows not drawn)" if partial else ""), fontsize="medium")
        ax.grid(alpha=0.3)
    _figure_legend(fig, handles, styles, 2, note)
    fig.suptitle(title)
    return _save(plt, fig, path)


def plot_score_vs_length(summary: dict[str, Any], path: str | Path,
                         styles: Mapping[str, dict[str, Any]] | None = None) -> Path:
    """Average score vs context length, one line per policy (a bar chart when there are no lengths), labelled
    by the records' policy text, one legend below the axes; a row partial at a length has no point there (no
    bar when there are no lengths)."""
    plt = pyplot()
    numeric = [(summary["lengths"][ln], ln) for ln in summary.get("length_order", []) if summary["lengths"].get(ln)]
    styles = _styles_for(styles, [r["policy"] for r in summary["rows"]])
    fig, (ax,) = _grid(plt, 1, width=7.0, height=4.2)
    handles: dict[str, Any] = {}
    if numeric:
        for r in summary["rows"]:
            pts = [(x, r["by_length"][ln]) for x, ln in numeric if ln in r["by_length"] and _complete_at(r, ln)]
            if pts:
                st = styles[r["policy"]]
                (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], "--" if _is_reference(r) else "-",
                                  marker=st["marker"], color=st["color"], markerfacecolor="none",
                                  markeredgewidth=1.5, label=r["policy"])
                handles[r["policy"]] = line
        ax.set_xscale("log", base=2)
        ax.set_xticks([x for x, _ in numeric], [ln for _, ln in numeric])
        ax.set_xlabel("context length (tokens)")
    else:
        drawn = [r for r in summary["rows"] if is_complete(r)]
        labels = [r["policy"] for r in drawn]
        ax.bar(range(len(labels)), [r["average"] or 0.0 for r in drawn],
               color=[styles[x]["color"] for x in labels], hatch=None)
        ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize="small")
    ax.set_ylabel("average score")
    ax.grid(alpha=0.3)
    _figure_legend(fig, handles, styles, 2)
    return _save(plt, fig, path)


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


# ----------------------------------------------------------------------------------------------
# Regenerating the results tables and plots from committed records (``python -m ...report``).
# ----------------------------------------------------------------------------------------------

RESULTS_FILES = ("results.jsonl", "results.jsonl.gz")


def find_results(sources: Sequence[str | Path]) -> list[Path]:
    """The ``results.jsonl`` / ``results.jsonl.gz`` files of ``sources`` (files as given, folders
    searched recursively), sorted. Raises ``FileNotFoundError`` naming a source with none."""
    out: list[Path] = []
    for src in sources:
        src = Path(src)
        if src.is_file():
            out.append(src)
            continue
        if not src.is_dir():
            raise FileNotFoundError(f"{src}: no such file or folder")
        found = sorted(p for name in RESULTS_FILES for p in src.rglob(name))
        if not found:
            raise FileNotFoundError(f"{src}: no {' or '.join(RESULTS_FILES)} in it or below it")
        out += found
    return list(dict.fromkeys(out))


def needle_type(task: str) -> str | None:
    """The needle value type of a RULER variant task (``niah_single_2@words`` → ``"words"``), else ``None``."""
    parts = task.partition("@")[2].split("+")
    if not [p for p in parts if p and p != "split"]:  # not a value-type variant
        return None
    from sparsekv_jax.eval.ruler import ruler_config

    try:
        return ruler_config(task).type_needle_v
    except ValueError:
        return None


def _slug(*parts: Any) -> str:
    return "_".join(re.sub(r"[^A-Za-z0-9_.+-]+", "-", str(p)).strip("-") for p in parts if p not in (None, ""))


def row_order(records: Sequence[dict[str, Any]]) -> list[str]:
    """Full attention first, then by family and budget."""
    first: dict[str, dict[str, Any]] = {}
    for r in records:
        first.setdefault(r["policy"], r)

    def key(label: str) -> tuple[Any, ...]:
        r = first[label]
        b = r.get("budget")
        return (r.get("family") != "fullkv", str(r.get("family")), isinstance(b, int), b if b is not None else 0,
                label)

    return sorted(first, key=key)


def column_order(records: Sequence[dict[str, Any]]) -> list[str]:
    """Columns by length, then RULER's task order (variants by value type), then name."""
    from sparsekv_jax.eval.ruler import NEEDLE_TYPES, RULER_CONFIGS

    tasks = list(RULER_CONFIGS)
    cols = {}
    for r in records:
        base = r["task"].partition("@")[0]
        t = needle_type(r["task"])
        cols[r.get("column") or column_name(r["task"], r.get("length"))] = (
            r.get("length") or 0, tasks.index(base) if base in tasks else len(tasks),
            NEEDLE_TYPES.index(t) if t in NEEDLE_TYPES else -1, r["task"])
    return sorted(cols, key=lambda c: cols[c])


def kv_kept(row: dict[str, Any]) -> float | None:
    """Fraction of the prompt's KV a decode step reads: stored fraction × read fraction (a compressor
    stores less and reads all it stores; Quest / CHESS store all and read a share)."""
    parts = [row.get("kv_stored_fraction"), row.get("kv_read_fraction")]
    parts = [p for p in parts if p is not None and not (isinstance(p, float) and math.isnan(p))]
    return math.prod(parts) if parts else None


def _kv_panel(summ: Mapping[str, Any]) -> tuple[Mapping[str, Any] | None, list[Mapping[str, Any]], int]:
    """(the full-attention row drawn as a line, the rows drawn as points, the partial rows not drawn)."""
    ref, points, partial = None, [], 0
    for r in summ["rows"]:
        if not is_complete(r):
            partial += 1
            continue
        if (r.get("ci") or {}).get("average") is None or kv_kept(r) is None:
            continue
        if _is_reference(r) and ref is None and r.get("kv_dtype") is None:
            ref = r
        else:
            points.append(r)
    return ref, points, partial


def draw_kv_panel(ax: Any, summ: Mapping[str, Any], styles: Mapping[str, dict[str, Any]],
                  handles: dict[str, Any] | None = None) -> None:
    """Draw one summary on ``ax``: each complete row's average with its 95% interval against the KV kept
    (:func:`kv_kept`, log x), in its :func:`policy_styles` style, labelled by its policy text; full attention
    as a dashed line with its interval shaded. ``handles`` collects ``{label: artist}`` for a figure legend."""
    handles = {} if handles is None else handles
    ref, points, _ = _kv_panel(summ)
    if ref is not None:
        ci = ref["ci"]["average"]
        handles.setdefault(ref["policy"], ax.axhline(ci[0], color=_REFERENCE_COLOUR, linestyle="--",
                                                     label=ref["policy"]))
        ax.axhspan(ci[1], ci[2], color=_REFERENCE_COLOUR, alpha=0.1, linewidth=0)
    for r in points:
        ci, st = r["ci"]["average"], styles[r["policy"]]
        art = ax.errorbar([kv_kept(r)], [ci[0]], yerr=[[ci[0] - ci[1]], [ci[2] - ci[0]]], marker=st["marker"],
                          color=st["color"], markerfacecolor="none", markeredgewidth=1.6, markersize=8, capsize=3,
                          linestyle="none", label=r["policy"])
        handles.setdefault(r["policy"], art)
    xs = [kv_kept(r) for r in points]
    ax.set_xscale("log")
    ticks = [0.02, 0.05, 0.1, 0.25, 0.5, 1.0]
    lo = min([0.08] + [x * 0.8 for x in xs])
    ax.set_xticks([t for t in ticks if t >= lo], [f"{t:g}" for t in ticks if t >= lo])
    ax.set_xlim(lo, 1.25)
    ax.set_xlabel("KV kept (stored × read fraction of the prompt)")
    ax.set_ylabel("average score (95% CI)")
    ax.grid(alpha=0.3)


def plot_score_vs_kv(summaries: Sequence[dict[str, Any]], path: str | Path, title: str = "",
                     styles: Mapping[str, dict[str, Any]] | None = None) -> Path:
    """Average score (with its 95% interval) against the KV kept (:func:`kv_kept`), a panel per summary
    (``summaries``: one per length and question mode, in order; two panels per row), a point per complete
    row labelled by the records' policy text, in its :func:`policy_styles` style (``styles``: the report's
    map, so a policy looks the same in every plot); full attention as a dashed line with its interval
    shaded. One legend for the figure, below the panels. Partial rows (see :func:`summarize`'s
    ``coverage``) are not drawn: the panel's title counts them. A panel that would show nothing but full
    attention is left out, and the figure's bottom line names it and why."""
    plt = pyplot()
    styles = _styles_for(styles, [r["policy"] for s in summaries for r in s["rows"]])
    kept, left_out = [], []
    for summ in summaries:
        _, points, partial = _kv_panel(summ)
        if points:
            kept.append((summ, partial))
        else:
            no_kv = [r["policy"] for r in summ["rows"] if is_complete(r) and kv_kept(r) is None]
            why = "only full attention" + (f"; no KV measure: {', '.join(no_kv)}" if no_kv else "")
            left_out.append(f"{summ.get('title', '')} ({why}" + (f"; {partial} partial rows" if partial else "") + ")")
    note = "Panels left out, nothing but full attention to show: " + "; ".join(left_out) + "." if left_out else ""
    if not kept:  # nothing to draw: a strip that says so (the report links the file)
        fig = plt.figure(figsize=(7.0, 1.3), layout="constrained")
        fig.text(0.5, 0.4, _wrap(note, 100), ha="center", va="center", fontsize="small", color="0.3")
        if title:
            fig.suptitle(title)
        return _save(plt, fig, path)
    fig, axes = _grid(plt, len(kept), extra=0.9)
    handles: dict[str, Any] = {}
    for ax, (summ, partial) in zip(axes, kept, strict=False):
        draw_kv_panel(ax, summ, styles, handles)
        ref = _reference_row(summ["rows"])
        sub = []
        if ref is not None and ref.get("reference_from"):
            sub.append(f"fullkv: question-{', '.join(ref['reference_from'])} records")
        if partial:
            sub.append(f"{partial} partial rows not drawn")
        ax.set_title(summ.get("title", "") + (f"\n({'; '.join(sub)})" if sub else ""), fontsize="medium")
    _figure_legend(fig, handles, styles, 2, note)
    if title:
        fig.suptitle(title)
    return _save(plt, fig, path)


def plot_needle_types(by_type: Mapping[str, dict[str, Any]], path: str | Path, title: str = "",
                      styles: Mapping[str, dict[str, Any]] | None = None) -> Path:
    """Average score (95% interval) per needle value type (``by_type``: type → summary): a group of bars
    per type, a bar per policy complete there, coloured and hatched by :func:`policy_styles` (``styles``: the
    report's map), one legend below the axes; a partial row of a type (fewer needle tasks or samples than
    full attention's) is not drawn, and the figure's bottom line names it."""
    plt = pyplot()
    types = list(by_type)
    labels = list(dict.fromkeys(r["policy"] for summ in by_type.values() for r in summ["rows"]))
    styles = _styles_for(styles, labels)
    cells: dict[str, dict[int, Sequence[float]]] = defaultdict(dict)
    left_out: dict[str, list[str]] = defaultdict(list)
    for i, t in enumerate(types):
        for row in by_type[t]["rows"]:
            ci = (row.get("ci") or {}).get("average")
            if not is_complete(row):
                left_out[row["policy"]].append(t)
            elif ci is not None:
                cells[row["policy"]][i] = ci
    drawn = [x for x in labels if x in cells]
    fig, (ax,) = _grid(plt, 1, width=max(7.0, 1.1 + 0.45 * len(drawn) * len(types)), height=4.2, extra=0.6)
    width = 0.84 / max(len(drawn), 1)
    handles: dict[str, Any] = {}
    for k, label in enumerate(drawn):
        st = styles[label]
        xs = sorted(cells[label])
        ci = [cells[label][i] for i in xs]
        handles[label] = ax.bar([i - 0.42 + width * (k + 0.5) for i in xs], [c[0] for c in ci], width=width * 0.92,
                                yerr=[[c[0] - c[1] for c in ci], [c[2] - c[0] for c in ci]], capsize=2,
                                color=st["color"], hatch=st["hatch"], edgecolor="white", linewidth=0.5,
                                error_kw={"ecolor": "black", "elinewidth": 1}, label=label)
    ax.set_xticks(range(len(types)), types)
    ax.set_xlabel("needle value type")
    ax.set_ylabel("average score (95% CI)")
    ax.set_ylim(0, 105)
    ax.grid(alpha=0.3, axis="y")
    _figure_legend(fig, handles, styles, 2, "Partial, not drawn: " + "; ".join(
        f"{p} ({', '.join(ts)})" for p, ts in left_out.items()) + "." if left_out else "")
    if title:
        ax.set_title(title)
    return _save(plt, fig, path)


def regenerate(sources: Sequence[str | Path], out_dir: str | Path, *, resamples: int = BOOTSTRAP_RESAMPLES,
               seed: int = BOOTSTRAP_SEED) -> dict[str, Path]:
    """Rebuild the results tables and plots from committed records (nothing typed by hand).

    Reads every ``results.jsonl(.gz)`` of ``sources`` (the last record per ``key`` wins), gives
    question-aware samples without a full-attention record the question-agnostic one of the same
    sample (:func:`with_agnostic_reference`; the table says so), and writes to ``out_dir``:

    * ``RESULTS.md``: per model, suite and length, one table per question mode (rows policies,
      columns tasks, averages with paired bootstrap 95% intervals against full attention, see
      :func:`markdown_table`); where both question modes ran, a table of the two side by side
      (question-agnostic: what a context compressed once and asked several questions gives); for
      needle value-type variants, a table per model, length and question mode: the average over
      the needle tasks per value type, with intervals;
    * ``results.json``: every summary behind those tables;
    * ``score_vs_kv_<model>_<suite>.png``: average (95% CI) against the KV kept, a panel per length;
    * ``needle_types_<model>_<suite>_<length>_<question>.png``: average (95% CI) per needle value type.

    Returns ``{name: path}`` of the files written.
    """
    files = find_results(sources)
    records: dict[str, dict[str, Any]] = {}
    anonymous: list[dict[str, Any]] = []
    for f in files:
        for r in load_results(f):
            if "key" in r:
                records[r["key"]] = r
            else:
                anonymous.append(r)
    recs = list(records.values()) + anonymous
    if not recs:
        raise ValueError(f"no readable records in {', '.join(map(str, files))}")
    read = len(recs)
    recs = with_agnostic_reference(recs)
    styles = policy_styles([r["policy"] for r in recs])  # one look per policy in every plot of the report
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    groups: dict[tuple[str, str], dict[int | None, dict[str, list[dict[str, Any]]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(list)))
    for r in recs:
        model_suite = (str(r.get("model", "?")), str(r.get("suite", "?")))
        groups[model_suite][r.get("length")][str(r.get("question", ""))].append(r)

    def summary_of(rs: list[dict[str, Any]], title: str) -> dict[str, Any]:
        summ = summarize(rs, policy_order=row_order(rs), column_order=column_order(rs), resamples=resamples,
                         seed=seed)
        summ["title"] = title
        return summ

    md = ["# Results", "", f"Regenerated by `python -m sparsekv_jax.eval.report` from {read} records in:", ""]
    md += [f"- `{f}`" for f in files]
    md.append("")
    everything: list[dict[str, Any]] = []
    paths: dict[str, Path] = {}
    for (model, suite), by_length in sorted(groups.items()):
        md += [f"## {model} · {suite}", ""]
        panels = []
        for length in sorted(by_length, key=lambda x: math.inf if x is None else x):
            for question, rs in sorted(by_length[length].items()):
                title = f"{_length_label(length) or 'all'} · question-{question}"
                summ = summary_of(rs, title)
                summ.update(model=model, suite=suite, length=length, question=question,
                            n=max((max(r["n"].values(), default=0) for r in summ["rows"]), default=0))
                everything.append(summ)
                panels.append(summ)
                md += [f"### {model} · {suite} · {_length_label(length) or 'all lengths'} · question-{question}", ""]
                table = markdown_table({k: v for k, v in summ.items() if k not in ("model", "suite", "question", "n",
                                                                                   "seed")})
                md += [*table.strip().splitlines(), ""]
                typed = [r for r in rs if needle_type(r["task"])]
                if len({needle_type(r["task"]) for r in typed}) > 1:
                    present = {needle_type(r["task"]) for r in typed}
                    by_type = {t: summary_of([r for r in typed if needle_type(r["task"]) == t], t)
                               for t in ("numbers", "words", "uuids") if t in present}
                    md += _needle_type_table(by_type, f"{model} · {_length_label(length)} · question-{question}")
                    name = _slug("needle_types", model, suite, _length_label(length), question) + ".png"
                    paths[name] = plot_needle_types(by_type, out / name, f"{model} · {suite} · "
                                                    f"{_length_label(length)} · question-{question}", styles=styles)
                    md += [f"![needle types]({name})", ""]
                    everything.append({"model": model, "suite": suite, "length": length, "question": question,
                                       "needle_types": by_type})
            if len(by_length[length]) > 1:
                md += _question_modes_table(panels[-len(by_length[length]):],
                                            f"{model} · {suite} · {_length_label(length) or 'all lengths'}")
        name = _slug("score_vs_kv", model, suite) + ".png"
        paths[name] = plot_score_vs_kv(panels, out / name, f"{model} · {suite}", styles=styles)
        md += [f"![score vs KV kept]({name})", ""]
    paths["RESULTS.md"] = out / "RESULTS.md"
    paths["RESULTS.md"].write_text("\n".join(md).rstrip() + "\n")
    paths["results.json"] = out / "results.json"
    paths["results.json"].write_text(json.dumps(everything, indent=1, default=str) + "\n")
    return paths


def _question_modes_table(summaries: Sequence[dict[str, Any]], title: str) -> list[str]:
    """Markdown: rows policies, a column per question mode (average [95% CI] · % of full [95% CI]):
    question-agnostic (one compressed context serving any question) beside question-aware."""
    labels = list(dict.fromkeys(r["policy"] for summ in summaries for r in summ["rows"]))
    head = ["policy"] + [f"question-{summ['question']}: average [95% CI] · % of full [95% CI]" for summ in summaries]
    lines = [f"Question-agnostic beside question-aware, {title}:", "", "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] + ["---:"] * len(summaries)) + "|"]
    for label in labels:
        cells = [label.replace("|", "\\|")]
        for summ in summaries:
            cells.append(_avg_and_kept(next((r for r in summ["rows"] if r["policy"] == label), None)))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + ["", _modes_note(summaries), ""]


def _modes_note(summaries: Sequence[dict[str, Any]]) -> str:
    note = ("A cell marked partial covers fewer columns or samples than full attention (see the coverage column "
            "above): its average is over its own columns and not comparable with a complete cell's; its % of full "
            "is on the samples both ran.")
    if any(r.get("reference_from") for summ in summaries for r in summ["rows"]):
        note += (" Where no question-aware full-attention run was recorded, full attention's question-aware cells "
                 "are its question-agnostic records (dense attention reads the same tokens in both modes), paired "
                 "sample by sample.")
    return note


def _avg_and_kept(row: Mapping[str, Any] | None) -> str:
    """``"average [CI] · % of full [CI]"`` of a row's intervals, marked when the row is partial."""
    ci = (row or {}).get("ci") or {}
    avg = ci.get("average")
    kept = "–" if ci.get("ratio") is None else f"{ci['ratio'][0]:.1f} {_interval(ci['ratio'], 1)}"
    if avg is None:
        return "–"
    text = f"{avg[0]:.2f} {_interval(avg)} · {kept}"
    if row is not None and not is_complete(row):
        cov = row["coverage"]
        text = f"**partial** ({cov['columns']} of {cov['of']} columns, {cov['samples']} of {cov['of_samples']} " \
               f"samples): {text}"
    return text


def _needle_type_table(by_type: Mapping[str, dict[str, Any]], title: str) -> list[str]:
    """Markdown: rows policies, columns value types (average over the needle tasks, 95% CI, % of full)."""
    types = list(by_type)
    labels = list(dict.fromkeys(r["policy"] for summ in by_type.values() for r in summ["rows"]))
    head = ["policy"] + [f"{t}: average [95% CI] · % of full [95% CI]" for t in types]
    lines = [f"Needle value types, {title} (average over the needle tasks of each type):", "",
             "| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(types)) + "|"]
    for label in labels:
        cells = [label.replace("|", "\\|")]
        for t in types:
            cells.append(_avg_and_kept(next((r for r in by_type[t]["rows"] if r["policy"] == label), None)))
        lines.append("| " + " | ".join(cells) + " |")
    return lines + ["", _modes_note(list(by_type.values())), ""]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m sparsekv_jax.eval.report RECORDS... --out DIR``: see :func:`regenerate`."""
    ap = argparse.ArgumentParser(prog="python -m sparsekv_jax.eval.report",
                                 description="Regenerate the results tables (with paired bootstrap 95%% intervals "
                                             "against full attention) and plots from results.jsonl(.gz) records.")
    ap.add_argument("sources", nargs="+", metavar="RECORDS",
                    help="results.jsonl / results.jsonl.gz files, or folders searched for them")
    ap.add_argument("--out", required=True, metavar="DIR", help="where RESULTS.md, results.json and the plots go")
    ap.add_argument("--resamples", type=int, default=BOOTSTRAP_RESAMPLES, help="bootstrap resamples (default 2000)")
    ap.add_argument("--seed", type=int, default=BOOTSTRAP_SEED, help="bootstrap seed (default 0)")
    args = ap.parse_args(argv)
    try:
        paths = regenerate(args.sources, args.out, resamples=args.resamples, seed=args.seed)
    except (FileNotFoundError, ValueError) as e:
        print(f"report: error: {e}", file=sys.stderr)
        return 2
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
