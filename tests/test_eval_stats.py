"""Paired bootstrap intervals against full attention, and the results regeneration command."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import matplotlib.colors
import numpy as np
import pytest

from sparsekv_jax.eval import report


def _reference_bootstrap(policy: dict, reference: dict, resamples: int, seed: int) -> dict:
    """Plain loops over resamples and columns, with the draw order `paired_bootstrap` documents."""
    rng = np.random.default_rng(seed)
    cols = list(policy)
    draws = {c: rng.integers(0, len(policy[c]), size=(resamples, len(policy[c]))) for c in cols}
    pol, full = [], []
    for b in range(resamples):
        p = [100.0 * sum(policy[c][i] for i in draws[c][b]) / len(policy[c]) for c in cols]
        f = [100.0 * sum(reference[c][i] for i in draws[c][b]) / len(reference[c]) for c in cols]
        pol.append(sum(p) / len(cols))
        full.append(sum(f) / len(cols))
    pol, full = np.asarray(pol), np.asarray(full)
    ok = full > 0
    return {"average": np.percentile(pol, [2.5, 97.5]), "difference": np.percentile(pol - full, [2.5, 97.5]),
            "ratio": np.percentile(100 * pol[ok] / full[ok], [2.5, 97.5]), "undefined": int((~ok).sum())}


def test_bootstrap_matches_a_numpy_reference(rng):
    seed = int(rng.integers(2**31))  # the bootstrap's own seed, drawn from the run's (pytest --seed N)
    policy, reference = {}, {}
    for c, n in (("a@4k", 7), ("b@4k", 12), ("c@8k", 5)):
        reference[c] = rng.integers(0, 2, n).astype(float).tolist()
        policy[c] = (rng.random(n) * np.asarray(reference[c])).round(2).tolist()  # graded scores, e.g. ROUGE
    got = report.paired_bootstrap(policy, reference, resamples=300, seed=seed)
    want = _reference_bootstrap(policy, reference, 300, seed)
    for k in ("average", "difference", "ratio"):
        np.testing.assert_allclose(got[k][1:], want[k], atol=1e-3, err_msg=k)  # rounded to 3 decimals
    assert got["ratio_undefined"] == want["undefined"]
    a = np.mean([100 * np.mean(policy[c]) for c in policy])
    f = np.mean([100 * np.mean(reference[c]) for c in reference])
    assert got["average"][0] == pytest.approx(a, abs=1e-3) and got["difference"][0] == pytest.approx(a - f, abs=1e-3)
    assert got["ratio"][0] == pytest.approx(100 * a / f, abs=1e-3)
    assert got["n"] == {"a@4k": 7, "b@4k": 12, "c@8k": 5}
    # replayable: the same seed gives the same intervals, another seed others
    assert report.paired_bootstrap(policy, reference, resamples=300, seed=seed) == got
    assert report.paired_bootstrap(policy, reference, resamples=300, seed=seed + 1)["difference"] != got["difference"]


def test_bootstrap_known_answers():
    # identical scores: every resample gives the same averages, the intervals are points
    same = {"a": [1.0, 0.0, 1.0, 1.0], "b": [0.5, 0.25, 1.0]}
    got = report.paired_bootstrap(same, same, resamples=500, seed=0)
    assert got["ratio"] == [100.0, 100.0, 100.0] and got["difference"] == [0.0, 0.0, 0.0]
    # full attention right on all 400 samples, the policy on 300: the difference is -25 points and its
    # interval the normal one, -25 ± 1.96 * 100 * sqrt(0.25 * 0.75 / 400) = -25 ± 4.24 (CLT)
    pol = {"a": [1.0] * 300 + [0.0] * 100}
    full = {"a": [1.0] * 400}
    got = report.paired_bootstrap(pol, full, resamples=4000, seed=1)
    half = 1.96 * 100 * math.sqrt(0.25 * 0.75 / 400)
    assert got["difference"][0] == -25.0
    assert got["difference"][1] == pytest.approx(-25 - half, abs=0.6)
    assert got["difference"][2] == pytest.approx(-25 + half, abs=0.6)
    assert got["ratio"][1] == pytest.approx(75 - half, abs=0.6) and got["ratio"][2] == pytest.approx(75 + half, abs=0.6)
    # pairing matters: the same scores unpaired (full attention wrong where the policy is right) would
    # spread wider; here the policy fails exactly where full attention also fails on 100 of 400
    pol = {"a": [1.0] * 200 + [0.0] * 200}
    full = {"a": [1.0] * 300 + [0.0] * 100}  # the policy's 200 successes are full attention's too
    got = report.paired_bootstrap(pol, full, resamples=4000, seed=2)
    se = 100 * math.sqrt(0.25 * 0.75 / 400)  # d = -1 on 100 of 400 samples, 0 elsewhere
    assert got["difference"][1] == pytest.approx(-25 - 1.96 * se, abs=0.6)


def test_bootstrap_bad_input():
    with pytest.raises(ValueError, match="differ"):
        report.paired_bootstrap({"a": [1.0]}, {"b": [1.0]})
    with pytest.raises(ValueError, match="1 policy scores but 2"):
        report.paired_bootstrap({"a": [1.0]}, {"a": [1.0, 0.0]})
    with pytest.raises(ValueError, match="non-empty"):
        report.paired_bootstrap({"a": []}, None)


def _rec(policy, family, budget, task, index, score, length=4096, question="agnostic", model="m", suite="ruler",
         stored=None):
    return {"key": json.dumps([model, suite, question, 0, task, length, policy, index]), "model": model,
            "suite": suite, "question": question, "seed": 0, "task": task, "length": length, "policy": policy,
            "family": family, "budget": budget, "index": index, "score": score, "prompt_tokens": length,
            "context_tokens": length - 20,
            "stats": {"kv_stored_fraction": stored if stored is not None else budget, "kv_read_fraction": 1.0}}


def _records(rng: np.random.Generator, length: int, question: str, tasks=("niah_single_1", "vt"), n=20):
    recs = []
    for task in tasks:
        full = rng.integers(0, 2, n)
        for i in range(n):
            recs.append(_rec("fullkv", "fullkv", 1.0, task, i, float(full[i]), length, question))
            recs.append(_rec("snapkv(0.1)", "snapkv", 0.1, task, i, float(full[i] * (i % 3 != 0)), length, question))
            recs.append(_rec("snapkv(0.5)", "snapkv", 0.5, task, i, float(full[i]), length, question))
            recs.append(_rec("h2o(0.1)", "h2o", 0.1, task, i, 0.0, length, question))
    return recs


def test_summary_pairs_by_sample_and_flags_overlaps():
    seed = 11
    rng = np.random.default_rng(seed)
    recs = _records(rng, 4096, "agnostic")
    # a policy row with a sample full attention does not have: left out of its paired interval
    recs.append(_rec("snapkv(0.5)", "snapkv", 0.5, "vt", 99, 1.0))
    s = report.summarize(recs, policy_order=["fullkv"])
    rows = {r["policy"]: r for r in s["rows"]}
    assert rows["snapkv(0.5)"]["ci"]["n"] == {"niah_single_1@4k": 20, "vt@4k": 20}
    assert rows["snapkv(0.5)"]["ci"]["ratio"] == [100.0, 100.0, 100.0]  # the same scores as full attention
    assert "fullkv" in rows["snapkv(0.5)"]["overlaps"]
    assert rows["h2o(0.1)"]["ci"]["ratio"] == [0.0, 0.0, 0.0]
    assert "h2o(0.1)" not in rows["snapkv(0.1)"]["overlaps"] and "fullkv" not in rows["snapkv(0.1)"]["overlaps"]
    lo, hi = rows["snapkv(0.1)"]["ci"]["ratio"][1:]
    assert lo < rows["snapkv(0.1)"]["ci"]["ratio"][0] < hi < 100
    md = report.markdown_table(s)
    assert "paired percentile bootstrap" in md and "ratio of the two averages" in md


def test_a_table_mixing_cache_dtypes_measures_against_the_model_dtypes_full_attention(rng):
    """Runs at two cache dtypes share an out dir (records keyed by kv_dtype): full attention on an
    int8 cache is a row like any other, and the reference is full attention on the model's dtype,
    whichever comes first in the table."""
    recs = _records(rng, 4096, "agnostic")
    for r in [r for r in recs if r["family"] == "fullkv"]:  # int8 full attention: one answer in two lost
        recs.append(dict(r, policy="fullkv [kv=int8]", kv_dtype="int8", score=r["score"] * (r["index"] % 2),
                         key=r["key"] + "int8"))
    s = report.summarize(recs, policy_order=["fullkv [kv=int8]", "fullkv"])
    rows = {r["policy"]: r for r in s["rows"]}
    assert rows["snapkv(0.5)"]["ci"]["ratio"][0] == 100.0  # snapkv(0.5) answers as full attention does
    assert rows["fullkv [kv=int8]"]["kv_dtype"] == "int8" and rows["fullkv"]["kv_dtype"] is None
    full = np.mean([r["score"] for r in recs if r["policy"] == "fullkv"])
    int8 = np.mean([r["score"] for r in recs if r["policy"] == "fullkv [kv=int8]"])
    assert int8 < full and rows["fullkv [kv=int8]"]["kept_pct"] < 100


def test_regenerate_tables_and_plots(tmp_path: Path, capsys):
    rng = np.random.default_rng(3)
    a, b = tmp_path / "runs" / "a", tmp_path / "runs" / "b"
    a.mkdir(parents=True)
    b.mkdir(parents=True)
    recs_a = _records(rng, 4096, "agnostic") + _records(rng, 8192, "agnostic")
    typed = [r for t in ("numbers", "words", "uuids")
             for r in _records(rng, 16384, "aware", tasks=(f"niah_single_2@{t}", f"niah_multikey_1@{t}"), n=6)]
    for r in typed:
        r["suite"] = "ruler-variants"
    (a / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs_a) + '{"cut sh')  # a broken tail
    with gzip.open(b / "results.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in typed))
    out = tmp_path / "out"
    assert report.main([str(tmp_path / "runs"), "--out", str(out)]) == 0
    md = (out / "RESULTS.md").read_text()
    assert "### m · ruler · 4k · question-agnostic" in md and "### m · ruler · 8k · question-agnostic" in md
    assert "### m · ruler-variants · 16k · question-aware" in md
    # columns in RULER's task order, value types as listed (numbers, words, uuids)
    assert md.index("niah_single_2@numbers@16k") < md.index("niah_single_2@words@16k") < \
        md.index("niah_single_2@uuids@16k") < md.index("niah_multikey_1@numbers@16k")
    # a row's numbers are the records' own: average of the two task percentages, by hand
    full4 = [r for r in recs_a if r["policy"] == "fullkv" and r["length"] == 4096]
    per_task = [100 * np.mean([r["score"] for r in full4 if r["task"] == t]) for t in ("niah_single_1", "vt")]
    row = next(line for line in md.splitlines() if line.startswith("| 1 | fullkv | ") and "[" in line)
    assert f"| {np.mean(per_task):.2f} |" in row
    assert "Needle value types, m · 16k · question-aware" in md
    summaries = json.loads((out / "results.json").read_text())
    typed_summary = next(x for x in summaries if "needle_types" in x)
    assert list(typed_summary["needle_types"]) == ["numbers", "words", "uuids"]
    words = {r["policy"]: r for r in typed_summary["needle_types"]["words"]["rows"]}
    wfull = [r["score"] for r in typed if r["policy"] == "fullkv" and "@words" in r["task"]]
    assert words["fullkv"]["ci"]["average"][0] == pytest.approx(100 * np.mean(wfull), abs=1e-3)  # equal n per task
    for name in ("score_vs_kv_m_ruler.png", "score_vs_kv_m_ruler-variants.png",
                 "needle_types_m_ruler-variants_16k_aware.png"):
        assert (out / name).stat().st_size > 5000, name
        assert f"]({name})" in md
    assert report.main([str(tmp_path / "nothing"), "--out", str(out)]) == 2
    assert "no such file" in capsys.readouterr().err


def _capture_figures(monkeypatch) -> list:
    """The figures the report functions close (kept instead), to read what they drew."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs: list = []
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    return figs


def test_partial_rows_marked_apart_and_not_plotted(tmp_path: Path, monkeypatch):
    """A row that stopped early (one of full attention's two columns, half its samples there) is marked
    partial, its average leaves the "average" column, its % of full is the paired ratio on the samples
    it shares, ≈ does not compare it with complete rows, and no plot draws it."""
    seed = 5
    rng = np.random.default_rng(seed)
    recs = _records(rng, 4096, "agnostic", n=10)  # fullkv, snapkv(0.1), snapkv(0.5), h2o(0.1): complete
    full = {(r["task"], r["index"]): r["score"] for r in recs if r["policy"] == "fullkv"}
    quest = [(i, float(full[("niah_single_1", i)])) for i in range(5)]  # full attention's scores: ratio 100
    recs += [_rec("quest(0.1)", "quest", 0.1, "niah_single_1", i, s) for i, s in quest]
    s = report.summarize(recs, policy_order=["fullkv"])
    rows = {r["policy"]: r for r in s["rows"]}
    cov = rows["quest(0.1)"]["coverage"]
    assert not cov["complete"] and (cov["columns"], cov["of"], cov["samples"], cov["of_samples"]) == (1, 2, 5, 20)
    assert cov["missing"] == ["vt@4k"] and cov["short"] == ["niah_single_1@4k"] and cov["lengths"] == {"4k": False}
    assert all(rows[p]["coverage"]["complete"] for p in ("fullkv", "snapkv(0.1)", "snapkv(0.5)", "h2o(0.1)"))
    # % of full kept: the paired ratio on the 5 shared samples, by hand
    q = np.array([sc for _, sc in quest])
    f = np.array([full[("niah_single_1", i)] for i in range(5)])
    assert rows["quest(0.1)"]["kept_pct"] == pytest.approx(round(100 * q.mean() / f.mean(), 1))
    # snapkv(0.5) has full attention's scores too (ratio interval the point 100): over other columns, no ≈
    assert "snapkv(0.5)" not in rows["quest(0.1)"]["overlaps"] and "quest(0.1)" not in rows["snapkv(0.5)"]["overlaps"]
    assert "fullkv" in rows["quest(0.1)"]["overlaps"]
    md = report.markdown_table(s)
    line = next(x for x in md.splitlines() if "| quest(0.1) |" in x)
    cells = [c.strip() for c in line.strip("|").split("|")]
    head = [c.strip() for c in md.splitlines()[0].strip("|").split("|")]
    cell = dict(zip(head, cells, strict=True))
    assert cell["coverage"] == "**partial**: 1 of 2 columns, 5 of 20 samples"
    assert cell["average"] == "–" and cell["partial row: average over its columns [95% CI]"].startswith(
        f"{100 * q.mean():.2f} [")
    assert cell["% of full kept"] == f"{100 * q.mean() / f.mean():.1f} (on its 1 of 2 columns)"
    snap = dict(zip(head, [c.strip() for c in next(x for x in md.splitlines() if "| snapkv(0.5) |" in x)
                           .strip("|").split("|")], strict=True))
    assert snap["coverage"] == "complete" and snap["partial row: average over its columns [95% CI]"] == "–"
    assert "**Partial rows**" in md
    # plots: the partial row is not drawn
    figs = _capture_figures(monkeypatch)
    s_kv = dict(s, title="4k")
    report.plot_score_vs_kv([s_kv], tmp_path / "kv.png")
    def legend(fig):
        (leg,) = fig.legends  # one legend for the figure
        return [t.get_text() for t in leg.get_texts()]

    assert legend(figs[-1]) == ["fullkv", "h2o(0.1)", "snapkv(0.1)", "snapkv(0.5)"]  # the records' policy text
    assert "1 partial rows not drawn" in figs[-1].axes[0].get_title()
    report.plot_score_vs_length(s, tmp_path / "len.png")
    assert legend(figs[-1]) == ["fullkv", "h2o(0.1)", "snapkv(0.1)", "snapkv(0.5)"]
    report.plot_score_vs_budget(s, tmp_path / "budget.png")
    assert legend(figs[-1]) == ["fullkv", "h2o(0.1)", "snapkv(·)"]  # a line per family, the budget on x
    assert "1 partial rows not drawn" in figs[-1].axes[0].get_title()


def _legend_clear_of_axes(fig) -> list:
    """The figure's one legend, after checking (on a fresh draw) that it lies outside every axes' data area."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (leg,) = fig.legends
    assert not any(ax.get_legend() for ax in fig.axes)  # no legend inside a panel
    box = leg.get_window_extent(renderer)
    for ax in fig.axes:
        assert not box.overlaps(ax.get_window_extent(renderer)), (box, ax.get_title())
    return [t.get_text() for t in leg.get_texts()]


def test_plots_label_by_policy_text_keep_one_style_and_legend_off_the_data(rng, tmp_path: Path, monkeypatch):
    """The labels are the records' policy text (not the key's family, which spells CHESS's thresholds), a
    policy has one colour and marker in every panel and plot, the one figure legend lies outside every
    axes, and a panel with nothing but full attention is left out with a line naming it."""
    chess_label, chess_key = "chess('moderate', calibration='m')", "chess(entropy_threshold=1.81415, var=2.06)"
    recs = []
    for length in (4096, 8192, 16384):
        for task in ("niah_single_1", "vt"):
            for i in range(6):
                score = float(rng.integers(0, 2))
                recs.append(_rec("fullkv", "fullkv", 1.0, task, i, score, length))
                if length > 4096:  # the 4k table has full attention only
                    recs.append(_rec(chess_label, chess_key, None, task, i, score, length))
                    recs.append(_rec("snapkv(0.25) [kv=int8]", "snapkv", 0.25, task, i, score * (i % 2), length))
    summaries = [dict(report.summarize([r for r in recs if r["length"] == n], policy_order=["fullkv"]),
                      title=f"{n // 1024}k · question-agnostic") for n in (4096, 8192, 16384)]
    styles = report.policy_styles([r["policy"] for r in recs])
    figs = _capture_figures(monkeypatch)
    report.plot_score_vs_kv(summaries, tmp_path / "kv.png", "m · ruler", styles=styles)
    fig = figs[-1]
    labels = _legend_clear_of_axes(fig)
    assert labels == ["fullkv", chess_label, "snapkv(0.25) [kv=int8]"]
    assert [ax.get_title() for ax in fig.axes] == ["8k · question-agnostic", "16k · question-agnostic"]
    assert "4k · question-agnostic (only full attention)" in fig.legends[0].get_title().get_text()
    for ax in fig.axes:  # one style per policy in every panel: the errorbar's line is the point
        drawn = {c.get_label(): c.lines[0] for c in ax.containers}
        assert set(drawn) == {chess_label, "snapkv(0.25) [kv=int8]"}
        for label, line in drawn.items():
            assert line.get_marker() == styles[label]["marker"]
            assert matplotlib.colors.same_color(line.get_color(), styles[label]["color"])
    assert styles[chess_label]["color"] != styles["snapkv(0.25) [kv=int8]"]["color"]
    # the needle value-type bars: the same colours, the same legend rules
    report.plot_needle_types({"numbers": summaries[1], "words": summaries[2]}, tmp_path / "types.png", "t",
                             styles=styles)
    fig = figs[-1]
    assert _legend_clear_of_axes(fig) == ["fullkv", chess_label, "snapkv(0.25) [kv=int8]"]
    bars = {c.get_label(): c for c in fig.axes[0].containers if hasattr(c, "patches")}
    assert matplotlib.colors.same_color(bars[chess_label].patches[0].get_facecolor(), styles[chess_label]["color"])
    for path in ("kv.png", "types.png"):
        assert (tmp_path / path).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_aware_rows_pair_with_agnostic_full_attention(tmp_path: Path, rng):
    """No question-aware full-attention run: the question-aware policies are paired, sample by sample,
    with question-agnostic full attention (dense attention reads the same tokens in both modes)."""
    seed = int(rng.integers(2**31))
    tasks, n = ("niah_single_1", "vt"), 8  # indices 0..7: the report's sample order is the index order
    full = {(t, i): float(rng.integers(0, 2)) for t in tasks for i in range(n)}
    pol = {(t, i): float(full[(t, i)] * rng.integers(0, 2)) for t in tasks for i in range(n)}
    recs = [_rec("fullkv", "fullkv", 1.0, t, i, s) for (t, i), s in full.items() if (t, i) != ("vt", 7)]
    recs += [_rec("snapkv(0.25)", "snapkv", 0.25, t, i, s, question="aware") for (t, i), s in pol.items()]
    recs += [_rec("snapkv(0.25)", "snapkv", 0.25, t, i, 0.0) for t in tasks for i in range(n)]  # agnostic too
    # another prompt for one sample (not the same computation): not borrowed
    next(r for r in recs if r["policy"] == "fullkv" and (r["task"], r["index"]) == ("niah_single_1", 2)
         )["prompt_tokens"] = 4000
    borrowed = [r for r in report.with_agnostic_reference(recs) if r.get("reference_from")]
    assert sorted((r["task"], r["index"]) for r in borrowed) == sorted(
        k for k in full if k not in (("vt", 7), ("niah_single_1", 2)))
    assert {r["question"] for r in borrowed} == {"aware"}
    # a sample with its own question-aware full-attention record keeps it
    own = _rec("fullkv", "fullkv", 1.0, "vt", 0, 1.0 - full[("vt", 0)], question="aware")
    again = [r for r in report.with_agnostic_reference([*recs, own]) if r.get("reference_from")]
    assert ("vt", 0) not in {(r["task"], r["index"]) for r in again} and len(again) == len(borrowed) - 1

    runs = tmp_path / "runs"
    runs.mkdir()
    (runs / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    report.regenerate([runs], tmp_path / "out", resamples=300, seed=seed)
    aware = next(x for x in json.loads((tmp_path / "out" / "results.json").read_text())
                 if x.get("question") == "aware" and "rows" in x)
    rows = {r["policy"]: r for r in aware["rows"]}
    assert aware["reference"] == "fullkv" and rows["fullkv"]["reference_from"] == ["agnostic"]
    # the numpy reference: per column, the policy's and full attention's scores of the samples both have
    keep = [k for k in pol if k not in (("vt", 7), ("niah_single_1", 2))]
    p_cols = {f"{t}@4k": [pol[k] for k in keep if k[0] == t] for t in tasks}
    f_cols = {f"{t}@4k": [full[k] for k in keep if k[0] == t] for t in tasks}
    want = _reference_bootstrap(p_cols, f_cols, 300, seed)
    got = rows["snapkv(0.25)"]["ci"]
    assert got["n"] == {"niah_single_1@4k": 7, "vt@4k": 7}
    for k in ("average", "difference") + (("ratio",) if got["ratio"] is not None else ()):
        np.testing.assert_allclose(got[k][1:], want[k], atol=1e-3, err_msg=k)
    a = np.mean([100 * np.mean(v) for v in p_cols.values()])
    f = np.mean([100 * np.mean(v) for v in f_cols.values()])
    assert got["difference"][0] == pytest.approx(a - f, abs=1e-3)
    md = (tmp_path / "out" / "RESULTS.md").read_text()
    assert "| 1 | fullkv (question-agnostic records) |" in md
    assert "Full attention in this table is the question-agnostic run's records of the same samples" in md
    # the question-agnostic table keeps its own full-attention row
    agn = next(x for x in json.loads((tmp_path / "out" / "results.json").read_text())
               if x.get("question") == "agnostic" and "rows" in x)
    assert next(r for r in agn["rows"] if r["policy"] == "fullkv")["reference_from"] is None
