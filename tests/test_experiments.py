"""Smoke tests of `experiments/`: each kept experiment runs at toy size on the CPU, or, where it can
only run on a GPU (kernel timings at real shapes), is imported and its argument parser exercised.
experiments/README.md lists them; this file fails if one is added there without a test here."""

from __future__ import annotations

import argparse
import gzip
import importlib.util
import json
import os
import re
from functools import partial
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / "experiments"
RECORD = ROOT / "docs" / "results" / "ruler4k"  # a committed `sparsekv eval` record
GPU_ONLY = ("gemma3_speed", "gsc_gpu", "h2o_mass_gpu", "page_rope_gpu", "pool_decode_gpu", "sae_decode_gpu",
            "stem_routing_gpu", "topk_gpu", "kvq_kernel_sweep_gpu", "kvq_ptx_check",
            "kvpress_adakv_memory_gpu")  # PyTorch + kvpress; its --tiny runs in the kvpress venv (test below)
REAL_MODEL = ("bser_qwen_diagnosis", "kv_quant_fp8_diagnosis")  # a real model's numerics: arguments parsed only
RUN_ON_CPU = ("compare_eval_runs", "cpu_speed", "e2e_speed_table", "kv_quant_fp8_gpu_check", "kvq_quality_table",
              "policy_pairs", "pool_memory_gpu", "readme_plot", "sae_dead_arms", "semanticache_audit")
TESTED_ELSEWHERE = {"stem_ablation": "tests/test_stem.py::test_ablation_script_core (toy model, CPU)",
                    "s3_retrieval_quality": "tests/test_s3_retrieval_quality.py (SmolLM2, one RULER sample, CPU)",
                    "s3_control_saes": "tests/test_s3_control_saes.py (the shipped set's control; tiny model, CPU)",
                    "quest_select_bench": "tests/test_quest_select_bench.py (toy shapes, CPU)",
                    "issue35_coverage": "tests/test_issue35_coverage.py (a toy report and the committed one, CPU)"}


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"experiments_{name}", EXPERIMENTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_experiment_is_indexed_and_tested():
    files = {p.stem for p in EXPERIMENTS.glob("*.py")}
    assert files == set(GPU_ONLY) | set(REAL_MODEL) | set(RUN_ON_CPU) | set(TESTED_ELSEWHERE)
    index = (EXPERIMENTS / "README.md").read_text()
    for name in files:
        assert f"`{name}.py`" in index, f"{name}.py is not in experiments/README.md"


def test_experiments_import_no_private_names():
    private = re.compile(r"from sparsekv_jax[\w.]* import[^\n]*\b_[a-z]\w*|sparsekv_jax(\.\w+)*\._[a-z]")
    for path in EXPERIMENTS.glob("*.py"):
        assert not private.search(path.read_text()), f"{path.name} imports a private name"


@pytest.mark.parametrize("name", GPU_ONLY + REAL_MODEL)
def test_gpu_experiment_parses_its_arguments(name, capsys):
    mod = _module(name)
    with pytest.raises(SystemExit) as exit_:
        mod.main(["--help"])
    assert exit_.value.code == 0
    assert "usage:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_:  # an unknown option is refused by the parser, before any work
        mod.main(["--no-such-option"])
    assert exit_.value.code == 2


def _write_records(path: Path, records: list[dict]) -> None:
    path.mkdir(parents=True)
    with gzip.open(path / "results.jsonl.gz", "wt", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def test_compare_eval_runs_on_a_committed_record(tmp_path, capsys):
    mod = _module("compare_eval_runs")
    old = mod.read_records(RECORD)
    policy = old[0]["policy"]
    mine = [r for r in old if r["policy"] == policy]
    changed = [dict(r) for r in mine]
    changed[0]["prediction"] += " (changed)"
    changed[0]["score"] = changed[0]["score"] + 100.0
    _write_records(tmp_path / "new", changed)
    assert mod.main([str(RECORD), str(tmp_path / "new"), "--out", str(tmp_path / "cmp.md")]) == 0
    row = next(line for line in (tmp_path / "cmp.md").read_text().splitlines() if line.startswith(f"| {policy} |"))
    n = len(mine)
    mean = sum(r["score"] for r in mine) / n
    expected = (f"| {policy} | {n} | {mean:.2f} | {mean + 100.0 / n:.2f} | "
                f"{100 * (n - 1) / n:.1f}% | 100.0% |")
    assert row == expected
    assert row in capsys.readouterr().out


def test_compare_eval_runs_pairs_a_renamed_spec_and_counts_other_prompts(tmp_path):
    """--pair matches an old label with a new one (a default changed between versions); a sample whose
    answers differ is counted as another prompt, not silently as the same one."""
    mod = _module("compare_eval_runs")
    old = mod.read_records(RECORD)
    policy = old[0]["policy"]
    mine = [dict(r, policy="x(0.25, a=1)") for r in old if r["policy"] == policy]
    _write_records(tmp_path / "old", mine)
    renamed = [dict(r, policy="x(0.25)") for r in mine]
    renamed[1]["answers"] = ["not the same task"]
    _write_records(tmp_path / "new", renamed)
    assert mod.parse_pair("x(0.25, a=1)=x(0.25)") == ("x(0.25, a=1)", "x(0.25)")
    with pytest.raises(argparse.ArgumentTypeError, match="OLD_SPEC=NEW_SPEC"):
        mod.parse_pair("x(a=1)")
    with pytest.raises(SystemExit, match="no sample"):
        mod.main([str(tmp_path / "old"), str(tmp_path / "new")])
    rows = mod.compare(mine, renamed, {"x(0.25, a=1)": "x(0.25)"})
    n = len(mine)
    assert [(r["policy"], r["old_policy"], r["samples"], r["identical_predictions"]) for r in rows] == [
        ("x(0.25)", "x(0.25, a=1)", n, 1.0)]
    assert rows[0]["same_prompts"] == (n - 1) / n


def test_readme_plot_draws_the_recorded_rows(tmp_path, monkeypatch):
    """The README's plot reads the Qwen records through the report's functions: on RULER's panels each drawn row
    is the committed report's (results.json, written by `python -m sparsekv_jax.eval.report`), interval for
    interval. ``main`` then draws from the records and panel summaries checked here (read and bootstrapped once:
    each took ~5 CPU s more when main did them again)."""
    mod = _module("readme_plot")
    committed = json.loads((mod.RECORDS / "report" / "results.json").read_text())
    recs = mod.records()
    panels, panel_summary = {}, mod.panel_summary

    def once(rs, suite, length):
        assert rs is recs
        if (suite, length) not in panels:
            panels[suite, length] = panel_summary(rs, suite, length)
        return panels[suite, length]

    monkeypatch.setattr(mod, "records", lambda *a, **k: recs)
    monkeypatch.setattr(mod, "panel_summary", once)
    for suite, length, _ in mod.PANELS:
        mine = mod.panel_summary(recs, suite, length)
        if suite == "ruler-variants":
            continue  # averaged on the columns every drawn row ran: checked below
        theirs = {r["policy"]: r for s in committed if "rows" in s and s["model"] == mod.MODEL
                  and s["suite"] == suite and s["length"] == length and s["question"] == "agnostic"
                  for r in s["rows"]}
        assert [r["policy"] for r in mine["rows"]] == [p for p in theirs if mod.drawn(p)]
        assert [(r["ci"], r["coverage"]["complete"]) for r in mine["rows"]] == [
            (theirs[r["policy"]]["ci"], theirs[r["policy"]]["coverage"]["complete"]) for r in mine["rows"]]
    # drawn: each method as its paper sets it; an opt-in rule, an ablation or a quantised cache is not (the
    # digit rule must not pass for SemantiCache's default), what a method needs (CHESS's calibration) is
    chess = "chess('moderate', calibration='qwen2.5-coder-1.5b')"
    assert mod.drawn(chess) and mod.drawn("adakv(snapkv(0.25))") and mod.drawn("fullkv")
    for opt_in in ("semanticache(0.25, protect='digit_sentences')", "stem(routing='full')", f"{chess[:-1]}, "
                   "regenerate=False)", "snapkv(0.25) [kv=int8]", "pyramidkv(snapkv(0.25))"):
        assert not mod.drawn(opt_in), opt_in
    groups = {tuple(g[2]) for g in mod.point_groups(mod.panel_summary(recs, "ruler", 8192))}
    assert ("chess('moderate')",) in groups and not any("digit" in n for g in groups for n in g)
    # the value-type panel: the columns the nearly complete drawn rows all ran, each task with its three value
    # types; those rows are complete on them, a row that ran half the suite is partial (and not drawn)
    variants = mod.panel_summary(recs, "ruler-variants", 16384)
    complete = [r for r in variants["rows"] if r["coverage"]["complete"]]
    assert len(complete) >= 6 and len(variants["columns"]) >= 18 and len(variants["columns"]) % 3 == 0
    assert {c.split("@")[1] for c in variants["columns"]} == {"numbers", "words", "uuids"}
    toy = [{"policy": p, "column": f"{t}@{v}@16k"} for p, tasks in (("a", "xyz"), ("b", "xy"), ("c", "x"))
           for t in tasks for v in ("numbers", "words")] + [{"policy": "a", "column": "w@numbers@16k"}]
    assert mod.shared_columns(toy, share=0.5) == {"x@numbers@16k", "x@words@16k", "y@numbers@16k", "y@words@16k"}
    mod.main(["--out", str(tmp_path / "plot.png")])
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cpu_speed_toy(tmp_path, optimized_xla, smol, monkeypatch):
    """SmolLM2 on a 256-token prompt, our default configuration only: runs, writes its record, decodes the
    tokens asked for. The model is the session's (`smol`: the same `load("smollm2")`, fp32), not read again from
    the default cache (~5 CPU s; a conversion where that cache is empty)."""
    import sparsekv_jax

    monkeypatch.setattr(sparsekv_jax, "load", lambda *a, **k: smol[1:3])
    mod = _module("cpu_speed")
    assert mod.main(["--length", "256", "--decode-tokens", "3", "--repeats", "1", "--ours", "auto",
                     "--no-transformers", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "cpu_speed.json").read_text())
    assert 200 <= result["prompt_tokens"] <= 300
    assert len(result["generated"]["ours:auto"]) == 3
    med = result["median"]["ours:auto"]
    assert med["prefill_s"] > 0 and med["decode_ms_per_token"] > 0


def test_semanticache_audit_toy(tmp_path, optimized_xla, smol, monkeypatch):
    """SmolLM2 on one 256-token uuid needle prompt (214 tokens, the uuid 33 of them) at half the budget: the
    audit reads the clusters the compress step made, so what it reports must obey the policy's contract (never
    more entries than the budget; shares in [0, 1]; every merged answer piece sits in a cluster of two or more).
    256 tokens, not 512: the answer is as long, and about 97% of its tokens still merge (a median cluster of
    11). The model is the session's (`smol`), not read again from the default cache."""
    import sparsekv_jax.models.embedded as embedded

    monkeypatch.setattr(embedded, "load", lambda *a, **k: smol[1:3])
    mod = _module("semanticache_audit")
    out = tmp_path / "audit.jsonl"
    assert mod.main(["--model", "smollm2", "--length", "256", "--n", "1", "--out", str(out)]) in (0, None)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["policy"] == "SemantiCache(0.5)" and row["budget"] == row["tokens"] // 2
    assert 0 < row["kept_fraction"] <= row["budget"] / row["tokens"] + 1e-6
    for key in ("middle_unmerged", "answer_unmerged", "answer_unmerged_worst_layer"):
        assert 0.0 <= row[key] <= 1.0, key
    assert row["merged_answer_cluster_size_median"] >= 2


def test_kv_quant_fp8_gpu_check_interpreted():
    """The GPU check's own comparison, the decode kernel interpreted on the CPU at toy size: int8 and fp8
    pages with key zero points (offsets of dozens of steps) equal the jnp reference (exit 0)."""
    assert _module("kv_quant_fp8_gpu_check").main(["--B", "2", "--S", "256", "--interpret"]) == 0


def test_kvq_quality_table_pairs_each_quantised_row_with_its_bf16_row(tmp_path):
    """Means by hand: bf16 (3/4, 1/2) -> 62.5, int8 (2/4, 1/2) -> 50.0: 80% of bf16, -12.5 points; a row with a
    further note stays apart, and a quantised row without its bf16 policy is left out."""
    mod = _module("kvq_quality_table")

    def rec(policy, task, index, score):
        return {"policy": policy, "task": task, "length": 8192, "question": "agnostic", "seed": 0, "index": index,
                "score": score}

    bf16 = {"a": [1, 1, 0, 1], "b": [1, 0]}
    int8 = {"a": [1, 0, 0, 1], "b": [1, 0]}
    rows = [rec("snapkv(0.25)", t, i, s) for t, v in bf16.items() for i, s in enumerate(v)]
    rows += [rec("snapkv(0.25) [kv=int8]", t, i, s) for t, v in int8.items() for i, s in enumerate(v)]
    rows += [rec("snapkv(0.25) [kv=int8, symmetric keys]", "a", i, 1.0) for i in range(4)]
    rows += [rec("quest(0.25) [kv=int8]", "a", 0, 1.0)]  # no bf16 quest row
    _write_records(tmp_path / "run", rows)
    table = mod.table(tmp_path)
    by = {r["kv_dtype"]: r for r in table}
    assert set(by) == {"int8", "int8, symmetric keys"} and all(r["policy"] == "snapkv(0.25)" for r in table)
    r = by["int8"]
    assert (r["tasks"], r["samples"]) == (2, 6)
    assert r["bf16"] == pytest.approx(62.5) and r["quantised"] == pytest.approx(50.0)
    assert r["ratio"][0] == pytest.approx(80.0) and r["difference"][0] == pytest.approx(-12.5)
    assert r["difference"][1] <= -12.5 <= r["difference"][2]
    sym = by["int8, symmetric keys"]
    assert (sym["tasks"], sym["samples"], sym["quantised"], sym["bf16"]) == (1, 4, 100.0, 75.0)
    assert mod.main([str(tmp_path), "--out", str(tmp_path / "t.md")]) == 0
    assert "| snapkv(0.25) | int8 | 8k | 2 | 6 | 62.50 | 50.00 | 80.0 [" in (tmp_path / "t.md").read_text()


def test_e2e_speed_table_divides_by_full_attention_of_the_same_run(tmp_path):
    """By hand: run a's Dense is timed twice (4 and 6 ms at batch 1: median 5), SnapKV 4 ms -> 0.80x; run b's Dense
    8 ms, SnapKV 2 ms -> 0.25x (b's own reference, not a's); a point that did not fit shows its error and no ratio;
    a batch with no Dense point shows its time without a ratio; prefill rows divide by prefill rows."""
    mod = _module("e2e_speed_table")

    def dec(policy, batch, ms):
        return {"kind": "decode", "policy": policy, "context": 32768, "batch": batch, "ms_per_token": ms,
                "tokens_per_s": batch * 1000 / ms, "cache_bytes": 2**30, "memory_bytes": 2**31}

    a = [dec("Dense", 1, 4.0), dec("SnapKV", 1, 4.0), dec("SnapKV", 8, 3.0), dec("Dense", 1, 6.0),
         {"kind": "decode", "policy": "Quest", "context": 32768, "batch": 1, "error": "does not fit in device memory"},
         {"kind": "prefill", "policy": "Dense", "context": 32768, "batch": 1, "ms": 300.0, "prefill_block_fraction": 1},
         {"kind": "prefill", "policy": "Stem", "context": 32768, "batch": 1, "ms": 330.0, "prefill_block_fraction": .3}]
    b = [dec("Dense", 1, 8.0), dec("SnapKV", 1, 2.0)]
    for name, rows in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(rows))
    out = tmp_path / "speed.md"
    assert mod.main(["--run", f"a={tmp_path / 'a.json'}", "--run", f"b={tmp_path / 'b.json'}", "--out", str(out)]) == 0
    lines = {tuple(c.strip() for c in line.strip("|").split("|"))[:3]: [c.strip() for c in line.strip("|").split("|")]
             for line in out.read_text().splitlines() if line.startswith("| ") and "---" not in line}
    assert lines[("SnapKV", "32k", "1")][3:5] == ["4.00 · 0.80×", "2.00 · 0.25×"]
    assert lines[("Dense", "32k", "1")][3:5] == ["4.00 · 0.80×", "8.00 · 1.00×"]  # a's first reading over the median
    assert lines[("SnapKV", "32k", "8")][3:5] == ["3.00", "–"]
    assert lines[("Quest", "32k", "1")][3] == "does not fit in device memory"
    assert lines[("Stem", "32k", "1")][3] == "330.00 · 1.10×" and lines[("Stem", "32k", "1")][-1] == "0.30"
    with pytest.raises(SystemExit):
        mod.main(["--run", "nofile"])


def test_e2e_speed_table_keeps_models_apart(tmp_path):
    """A file timing two models: each model's points divide by its own Dense (by hand: llama Quest 7 / Dense 6 ->
    1.17x, qwen Quest 3 / Dense 2 -> 1.50x), never by a median over both, and the table gets a model column."""
    mod = _module("e2e_speed_table")

    def dec(model, policy, ms):
        return {"model": model, "kind": "decode", "policy": policy, "context": 32768, "batch": 1, "ms_per_token": ms,
                "tokens_per_s": 1000 / ms, "cache_bytes": 2**30, "memory_bytes": 2**31}

    rows = [dec("llama", "Dense", 6.0), dec("qwen", "Dense", 2.0), dec("llama", "Quest", 7.0),
            dec("qwen", "Quest", 3.0)]
    (tmp_path / "a.json").write_text(json.dumps(rows))
    text = mod.table({"a": json.loads((tmp_path / "a.json").read_text())})
    lines = {tuple(c.strip() for c in line.strip("|").split("|"))[:4]: [c.strip() for c in line.strip("|").split("|")]
             for line in text.splitlines() if line.startswith("| ") and "---" not in line}
    assert lines[("model", "policy", "context", "batch")][4].startswith("ms/token (a)")
    assert lines[("llama", "Quest", "32k", "1")][4] == "7.00 · 1.17×"
    assert lines[("qwen", "Quest", "32k", "1")][4] == "3.00 · 1.50×"
    assert lines[("qwen", "Dense", "32k", "1")][4] == "2.00 · 1.00×"


def test_policy_pairs_pairs_two_policies_on_their_shared_samples(tmp_path):
    """Means by hand on the shared samples: A (1, 0, 1 | 1) -> task means 2/3 and 1 -> 83.33; B (0, 0, 1 | 0) -> 1/3
    and 0 -> 16.67; A − B = +66.67 points, A = 500% of B. A's extra sample (index 3) has no B and is left out; a
    LongBench record with A's label stays in its own suite; a pair with no shared sample says so."""
    mod = _module("policy_pairs")

    def rec(policy, task, index, score, suite="ruler"):
        return {"policy": policy, "suite": suite, "task": task, "length": 32768, "question": "agnostic", "seed": 0,
                "index": index, "score": score}

    rows = [rec("adakv(snapkv(0.25))", "a", i, s) for i, s in enumerate([1, 0, 1, 1])]
    rows += [rec("snapkv(0.25)", "a", i, s) for i, s in enumerate([0, 0, 1])]
    rows += [rec("adakv(snapkv(0.25))", "b", 0, 1.0), rec("snapkv(0.25)", "b", 0, 0.0)]
    rows += [rec("adakv(snapkv(0.25))", "qasper", 0, 0.5, "longbench"), rec("snapkv(0.25)", "qasper", 0, 0.25,
                                                                            "longbench")]
    _write_records(tmp_path / "run", rows)
    table = mod.table(tmp_path, [("adakv(snapkv(0.25))", "snapkv(0.25)"), ("quest(0.25)", "snapkv(0.25)")])
    by = {(r.get("suite"), r["a"]): r for r in table}
    r = by["ruler", "adakv(snapkv(0.25))"]
    assert (r["tasks"], r["samples"]) == (2, 4)
    near = partial(pytest.approx, abs=1e-3)  # the report's bootstrap rounds to 3 decimals
    assert r["a_average"] == near(250 / 3) and r["b_average"] == near(50 / 3)
    assert r["difference"][0] == near(200 / 3) and r["ratio"][0] == near(500.0)
    assert r["difference"][1] <= 200 / 3 <= r["difference"][2]
    lb = by["longbench", "adakv(snapkv(0.25))"]
    assert (lb["samples"], lb["a_average"], lb["difference"][0]) == (1, 50.0, pytest.approx(25.0))
    assert by[None, "quest(0.25)"]["samples"] == 0
    with pytest.raises(argparse.ArgumentTypeError, match="POLICY_A::POLICY_B"):
        mod.parse_pair("snapkv(0.25)")
    out = tmp_path / "p.md"
    assert mod.main([str(tmp_path), "--pair", "adakv(snapkv(0.25))::snapkv(0.25)", "--out", str(out)]) == 0
    assert "| adakv(snapkv(0.25)) | snapkv(0.25) | ruler | agnostic | 32k | 2 | 4 | 83.33 | 16.67 | +66.67 [" in (
        out.read_text())


def test_policy_pairs_pairs_one_policy_across_question_modes(tmp_path):
    """``aware:P::agnostic:P`` matches P's samples across the two modes. By hand: aware (1, 1 | 0) -> task means 1
    and 0 -> 50; agnostic (0, 1 | 0) -> 1/2 and 0 -> 25; +25 points, 200%. The aware sample with no agnostic twin
    (index 2) is left out; a plain pair still pairs within one mode; a mode on one side only is refused."""
    mod = _module("policy_pairs")

    def rec(question, task, index, score, policy="quest(0.25)"):
        return {"policy": policy, "suite": "ruler", "task": task, "length": 8192, "question": question, "seed": 0,
                "index": index, "score": score}

    rows = [rec("aware", "a", 0, 1.0), rec("aware", "a", 1, 1.0), rec("aware", "a", 2, 1.0), rec("aware", "b", 0, 0.0)]
    rows += [rec("agnostic", "a", 0, 0.0), rec("agnostic", "a", 1, 1.0), rec("agnostic", "b", 0, 0.0)]
    rows += [rec("agnostic", "a", 0, 1.0, "snapkv(0.25)")]
    _write_records(tmp_path / "run", rows)
    pair = mod.parse_pair("aware:quest(0.25)::agnostic:quest(0.25)")
    (r,) = mod.table(tmp_path, [pair])
    near = partial(pytest.approx, abs=1e-3)
    assert (r["question"], r["tasks"], r["samples"]) == ("aware − agnostic", 2, 3)
    assert (r["a_average"], r["b_average"], r["difference"][0]) == (near(50.0), near(25.0), near(25.0))
    assert r["ratio"][0] == near(200.0)
    (plain,) = mod.table(tmp_path, [("quest(0.25)", "snapkv(0.25)")])
    assert (plain["question"], plain["samples"], plain["difference"][0]) == ("agnostic", 1, near(-100.0))
    with pytest.raises(argparse.ArgumentTypeError, match="on both sides"):
        mod.parse_pair("aware:quest(0.25)::quest(0.25)")


def test_kvpress_adakv_memory_gpu_tiny(tmp_path):
    """The kvpress script's CPU smoke mode, run as tests/test_kvpress_peer.py runs kvpress (its own venv,
    ``$SPARSEKV_KVPRESS_PYTHON`` or ``.venv-kvpress``): a toy Llama (2 layers, 2 KV heads of 16, fp32), 256
    prompt tokens, 8 new. The cache's bytes against the shapes: no press holds every token; SnapKVPress(0.75
    removed) a quarter; kvpress's AdaKV the whole prompt (it masks 75% of each layer's entries, which stay in
    memory). The prompt and weights come from a fixed seed (0): nothing random is asserted."""
    import subprocess

    py = Path(os.environ.get("SPARSEKV_KVPRESS_PYTHON", ROOT / ".venv-kvpress" / "bin" / "python"))
    if not py.exists():
        pytest.fail(f"kvpress peer environment missing at {py}: run `make peer-venv` (or set SPARSEKV_KVPRESS_PYTHON)")
    out = tmp_path / "rows.json"
    res = subprocess.run([str(py), str(EXPERIMENTS / "kvpress_adakv_memory_gpu.py"), "--tiny", "--out", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = {r["press"]: r for r in json.loads(out.read_text())}
    L, Hkv, D, T, new, f32 = 2, 2, 16, 256, 8, 4
    full = L * 2 * Hkv * T * D * f32  # keys and values of every layer
    grown = L * 2 * Hkv * new * D * f32
    assert rows["none"]["cache_bytes_after_compress"] == full
    assert rows["snapkv"]["cache_bytes_after_compress"] == full // 4
    assert rows["adakv"]["cache_bytes_after_compress"] == full
    assert rows["adakv"]["masked_entries"] == L * Hkv * T * 3 // 4
    for r in rows.values():
        assert r["cache_bytes_after_decode"] == r["cache_bytes_after_compress"] + grown
        assert r["memory_allocated_after_compress"] is None  # no CUDA here
    assert rows["none"]["masked_entries"] == rows["snapkv"]["masked_entries"] == 0
    assert "| AdaKVPress(" in res.stdout  # the table printed


def test_pool_memory_gpu_tiny(tmp_path, capsys):
    """The GPU script's CPU smoke mode (a toy model, 256 tokens, batch 2) for AdaKV, in its child process: both
    layouts recorded; the same entries kept; the pool, every head in its own pages, smaller than the uniform
    cache (every head at the largest head's capacity) after the compress step and after the decode; the
    decode timed over the tokens asked for; the table printed."""
    mod = _module("pool_memory_gpu")
    out = tmp_path / "rows.json"
    assert mod.main(["--tiny", "--policies", "adakv(snapkv(0.25))", "--out", str(out)]) == 0
    rows = {r["layout"]: r for r in json.loads(out.read_text())}
    uni, pool = rows["uniform"], rows["pool"]
    assert uni["kv_stored_fraction"] == pool["kv_stored_fraction"] == 0.25
    assert pool["held_bytes"] <= pool["cache_bytes"] < uni["cache_bytes"]
    assert pool["cache_bytes_after_decode"] == pool["cache_bytes"] < uni["cache_bytes_after_decode"]
    assert pool["held_bytes"] < pool["held_bytes_after_decode"] <= pool["cache_bytes"]
    for r in (uni, pool):
        assert r["decode_tokens"] == 16 and len(r["decode_call_s"]) == 2 and r["decode_ms_per_token"] > 0
    assert "| adakv(snapkv(0.25)) | pool |" in capsys.readouterr().out


def test_pool_decode_gpu_interpreted(tmp_path):
    """The pool-decode timing script end to end on the CPU at toy size (interpreted kernels, one trial): every
    pool configuration's output is the uniform kernel's, bit for bit, and lands in the JSON rows."""
    out = tmp_path / "pool.json"
    assert _module("pool_decode_gpu").main(["--lengths", "32", "--batches", "2", "--rhos", "", "--trials", "1",
                                            "--calls", "1", "--variants", "lanes,ahead2", "--tables", "shuffled",
                                            "--interpret", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [(r["table"], r["variant"]) for r in rows] == [("shuffled", "lanes"), ("shuffled", "ahead2")]
    assert all(r["max_abs_diff"] == 0.0 for r in rows)


def test_kvq_ptx_check_finds_the_kernel_by_name_or_by_elimination(tmp_path):
    """`kernel_ptx` picks the decode kernel among one compile's dumped files: by its name where the jax version
    keeps it (0.10.2: ``sparsekv_decode``), else as the only PTX entry with ``mma`` (the name lookup failed under
    0.11.2); a file of several entries is cut at each; files that are not PTX are skipped; none or two such
    entries are an error naming what was found."""
    mod = _module("kvq_ptx_check")

    def write(name: str, *entries: str) -> str:
        (tmp_path / name).write_text(".version 8.0\n.target sm_90a\n" + "".join(
            f".visible .entry {e}(\n)\n{{\n\t{'mma.sync.aligned.m16n8k16 x;' if 'fusion' not in e else 'add.f32 a;'}"
            f"\n\tret;\n}}\n" for e in entries))
        return str(tmp_path / name)

    (tmp_path / "hlo.txt").write_text("HloModule m .entry sparsekv_decode mma.sync")  # not PTX: skipped
    hlo = str(tmp_path / "hlo.txt")
    fusion = write("a.ptx", "loop_add_fusion")
    named = write("b.ptx", "sparsekv_decode_pool")
    assert "sparsekv_decode_pool" in mod.kernel_ptx([hlo, fusion, named], "t")
    mixed = write("c.ptx", "loop_add_fusion_2", "triton_kernel_7")  # one module, two entries
    got = mod.kernel_ptx([hlo, fusion, mixed], "t")
    assert got.startswith(".visible .entry triton_kernel_7") and "add.f32" not in got
    with pytest.raises(RuntimeError, match="loop_add_fusion"):
        mod.kernel_ptx([hlo, fusion], "t")
    with pytest.raises(RuntimeError, match="triton_kernel_8"):
        mod.kernel_ptx([fusion, mixed, write("d.ptx", "triton_kernel_8")], "t")


def test_kvq_ptx_check_programs_per_sm():
    """Occupancy by hand (H100: 64K registers in per-warp units of 256, 228 KB shared memory + 1 KB per program):
    8 warps of 80 registers take 20480 -> 3 programs; 98 registers round to 104 -> 26624 -> 2; 160 -> 1;
    72 KB of shared memory allows 3 (3 x 73 KB <= 228 KB), 76 KB only 2; 4 warps of 32 registers hit the
    shared-memory bound (228 // 41 = 5) before the registers' (16)."""
    per_sm = _module("kvq_ptx_check").programs_per_sm
    assert [per_sm(r, 72 * 1024, 8) for r in (80, 98, 128, 160)] == [3, 2, 2, 1]
    assert per_sm(80, 76 * 1024, 8) == 2
    assert per_sm(32, 40 * 1024, 4) == 5


def test_pool_decode_gpu_records_a_failing_variant_and_times_the_rest(tmp_path, monkeypatch):
    """A pool variant that fails (as one that does not lower would on a GPU) becomes an error row and exit 1; the
    uniform kernel and the other variants are still checked and timed."""
    mod = _module("pool_decode_gpu")
    real = mod.decode_attention

    def flaky(*args, **kw):
        if kw.get("pool_variant") == "ahead1":
            raise RuntimeError("does not lower (test)")
        return real(*args, **kw)

    monkeypatch.setattr(mod, "decode_attention", flaky)
    out = tmp_path / "pool.json"
    assert mod.main(["--lengths", "32", "--batches", "2", "--rhos", "", "--trials", "1", "--calls", "1",
                     "--variants", "lanes,ahead1", "--tables", "identity", "--interpret", "--out", str(out)]) == 1
    rows = {r["variant"]: r for r in json.loads(out.read_text())}
    assert "does not lower (test)" in rows["ahead1"]["error"] and rows["ahead1"]["pool_us"] is None
    assert rows["lanes"]["error"] is None and rows["lanes"]["max_abs_diff"] == 0.0 and rows["lanes"]["pool_us"] > 0


def test_sae_dead_arms_reads_each_arm_at_the_last_step_all_reached(tmp_path, capsys, rng):
    """Two arms of random curves, one logged further than the other: the table is at the shorter one's last step,
    with each arm's own values there (compared with the rows written, formatted as the table formats them)."""
    mod = _module("sae_dead_arms")
    header = "step,layer,fvu,auxk,l0,dead_fraction,lr,vectors"
    written = {}
    for arm, last in (("base", 150), ("bias2", 100)):
        (tmp_path / f"dead_{arm}").mkdir()
        lines = [header]
        for step in range(50, last + 1, 50):
            for layer in (0, 25):
                fvu, dead = rng.uniform(1e-5, 1e-2), rng.uniform(0, 1)
                written[arm, step, layer] = (fvu, dead)
                lines.append(f"{step},{layer},{fvu},0.0,128.0,{dead},0.001,{step * 8192}")
        (tmp_path / f"dead_{arm}" / "curves.csv").write_text("\n".join(lines) + "\n")
    step, text = mod.table(mod.read_arms(tmp_path))
    assert step == 100
    for arm in ("base", "bias2"):
        row = next(line for line in text.splitlines() if line.startswith(f"| {arm} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        for i, layer in enumerate((0, 25)):
            fvu, dead = written[arm, 100, layer]
            assert cells[2 + 2 * i] == f"{dead:.3f}" and cells[3 + 2 * i] == f"{fvu:.2e}"
    mod.main([str(tmp_path)])
    assert (tmp_path / "dead_arms.png").stat().st_size > 10_000
    assert "at step 100" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="no dead_<arm>/curves.csv"):
        mod.read_arms(tmp_path / "nothing")
