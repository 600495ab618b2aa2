"""`experiments/s3_retrieval_quality.py` (issue 37's retrieval table): its measures against hand-computed
values, and a CPU run at toy size on SmolLM2 (one 160-token RULER needle sample, seed 0, two copies of the shipped
SAE set: their rows must agree) checked row by row."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import load_script

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return load_script(ROOT / "experiments" / "s3_retrieval_quality.py", "experiments_s3_retrieval_quality")


def test_recall_kl_and_arguments():
    mod = _module()
    ctx = "The special magic number for jolly-cat is: 4810273. Other text."
    assert mod.answer_recall(ctx, ["4810273"], all_needed=False) == 1.0
    assert mod.answer_recall(ctx.replace("4810273", ""), ["4810273"], all_needed=False) == 0.0
    assert mod.answer_recall(ctx, ["nope", "JOLLY-CAT"], all_needed=False) == 1.0  # alternatives, any case
    assert mod.answer_recall(ctx, ["4810273", "9999"], all_needed=True) == 0.5  # several needle values
    with pytest.raises(ValueError, match="no non-empty gold answer"):
        mod.answer_recall(ctx, [" "], all_needed=False)
    p, q = np.log([0.5, 0.5]), np.log([0.9, 0.1])
    assert mod.kl_divergence(p, p) == 0.0
    assert mod.kl_divergence(p, q) == pytest.approx(0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1), rel=1e-12)
    assert np.allclose(np.exp(mod.log_softmax(np.array([[1.0, 2.0, 3.0]]))).sum(-1), 1.0)
    assert [mod.group_of(t) for t in ("niah_single_2@words", "niah_multikey_1", "qa_2", "hotpotqa")] == [
        "niah@words", "niah@numbers", "ruler_qa", "longbench_qa"]
    assert mod.parse_saes("shipped=shipped:smollm2") == ("shipped", "smollm2")
    for bad, msg in (("nosep", "NAME=SPEC"), ("a=model.bin", "neither"), ("a=/no/such.safetensors", "no file")):
        with pytest.raises(argparse.ArgumentTypeError, match=msg):
            mod.parse_saes(bad)
    with pytest.raises(SystemExit) as exit_:  # refused by the parser, before any model is loaded
        mod.main(["--saes", "a=model.bin"])
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        mod.main(["--model", "qwen2.5-coder-1.5b"])  # no shipped SAEs for it: --saes is required
    assert exit_.value.code == 2
    assert "--model qwen2.5-coder-1.5b" in mod.gpu_command() and "--length 32768" in mod.gpu_command()


@pytest.mark.usefixtures("optimized_xla")  # a real model: its programs compiled optimized
def test_toy_run_on_smollm2(tmp_path, smol, monkeypatch):
    """One RULER needle sample (160 tokens, seed 0: 120 of context) with a 48-token budget, two names for the
    shipped SAEs. Every prompt is padded to one width (``--pad 160``): each program compiles once. The budget
    keeps well under half of the context (every method must choose), and 32-token passages (four, the last
    partial) give BM25 and S3Hybrid passages to choose among. The run is bound by SmolLM2's forward passes
    (two S3 scans, seven generate + teacher-forcing pairs). What keeps them short (the checks are of the
    mechanics, not of quality): ``--chunk 128`` (the script's default chunk, 2,048, padded each scan's 120
    context tokens to 2,048: 40 of the test's 92 s; one chunk of 128 holds the whole context as one of 2,048
    does, the same chunk-only scan), 4 generated tokens (8 before) and the gold answer teacher-forced over 8
    tokens (``GOLD_TOKENS``, 32 in the script: 31 decode steps a row; the needle's answer, a hyphenated word,
    is fewer tokens than 8, asserted below, so its NLL is over the same tokens). The model is the session's
    (`smol`), not loaded again; the full-context row of the covering-budget check below is the run's own
    `Prepared` (recorded as main makes it), not computed a second time."""
    import sparsekv_jax.models.embedded as embedded

    _, params, tok, _ = smol
    monkeypatch.setattr(embedded, "load", lambda *a, **k: (params, tok))
    mod = _module()
    made = []  # every Prepared (a sample's prompt and full-context row) the runs make

    class Recorded(mod.Prepared):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(mod, "Prepared", Recorded)
    monkeypatch.setattr(mod, "GOLD_TOKENS", 8)
    out = tmp_path / "run"
    args = ["--longbench", "", "--ruler", "niah_single_1@words", "--length", "160", "--n", "1", "--seed", "0",
            "--budget", "48", "--passage", "32", "--max-new", "4", "--saes", "a=shipped:smollm2",
            "--saes", "b=shipped:smollm2", "--rag-passage", "0", "--pad", "160", "--chunk", "128", "--no-progress",
            "--out", str(out)]
    assert mod.main(args) == 0
    (prep,) = made
    assert 0 < prep.gold_n < mod.GOLD_TOKENS  # the whole gold answer is teacher-forced
    (rec,) = [json.loads(line) for line in (out / "records.jsonl").open()]
    assert rec["task"] == "niah_single_1@words" and rec["full"]["recall"] == 1.0  # the needle is in the prompt
    methods = ["s3pure[a]", "s3hybrid[a]", "s3pure[b]", "s3hybrid[b]", "bm25"]
    assert [k for k in rec if k in methods] == methods and "rag" not in rec
    for m in methods:
        row = rec[m]
        assert 0 < row["kept_tokens"] <= 48 and row["recall"] in (0.0, 1.0)
        assert row["kl"] >= 0 and math.isfinite(row["nll"]) and row["nll"] > 0
    for m in ("s3pure", "s3hybrid"):  # the same SAEs under two names: the same rows (timings aside)
        a, b = (dict(rec[f"{m}[{n}]"]) for n in "ab")
        a.pop("seconds"), b.pop("seconds")
        assert a == b
    summary = json.loads((out / "summary.json").read_text())["summary"]
    for grp in ("niah@words", "all"):
        row = summary[grp]
        assert row["n"] == 1 and row["bm25"]["recall"] == rec["bm25"]["recall"]
        diff = row["intervals"]["s3hybrid[a] - bm25"]["difference"]
        expected = 100 * (rec["s3hybrid[a]"]["recall"] - rec["bm25"]["recall"])
        assert diff == [pytest.approx(expected)] * 3  # one sample: the interval is a point
        assert row["intervals"]["s3pure[b] - s3pure[a]"]["difference"] == [0.0] * 3
    assert "| s3hybrid[b] - bm25 |" in (out / "summary.md").read_text()
    assert mod.main(args) == 0  # resumed: nothing left to run, nothing appended
    assert len((out / "records.jsonl").read_text().splitlines()) == 1 and len(made) == 1

    # a budget covering the context keeps the prompt as it is: recall of full, KL 0, full's NLL and score
    from sparsekv_jax.policies import BM25Retrieval

    setting = mod.Setting(params, tok, 160, 4)
    assert prep.full == rec["full"] and prep.full["context_tokens"] > 2 * 48 and prep.tokens.shape == (1, 160)
    row = mod.method_row(setting, prep, BM25Retrieval(budget=10**6).with_tokenizer(tok))
    assert row["kl"] == 0.0 and row["nll"] == prep.full["nll"] and row["recall"] == 1.0
    assert row["score"] == prep.full["score"] and row["kept_tokens"] == prep.full["context_tokens"]


def test_recall_interval_against_a_numpy_replay():
    """The summary's interval is the report's paired bootstrap on one column: replayed here with numpy."""
    mod = _module()
    pol, ref = [1.0, 1.0, 0.0, 1.0, 0.0], [1.0, 0.0, 0.0, 1.0, 1.0]
    recs = [{"x": {"recall": p}, "y": {"recall": r}} for p, r in zip(pol, ref, strict=True)]
    got = mod.recall_interval(recs, "x", "y", resamples=500, seed=3)
    idx = np.random.default_rng(3).integers(0, 5, size=(500, 5))
    draws = 100 * (np.asarray(pol)[idx].mean(1) - np.asarray(ref)[idx].mean(1))
    lo, hi = np.percentile(draws, [2.5, 97.5])
    assert got["difference"] == [pytest.approx(0.0), pytest.approx(lo, abs=1e-3), pytest.approx(hi, abs=1e-3)]
    assert got["policy"][0] == pytest.approx(60.0) and got["reference"][0] == pytest.approx(60.0)


def test_summarize_from_records_alone(tmp_path, rng):
    """``--summarize``: a run its deadline stopped is summarized from records.jsonl alone (no model), with the
    methods and SAE set names read from the records; the means are the records' own, recomputed here."""
    mod = _module()
    methods = ["s3pure[a]", "s3hybrid[a]", "s3pure[b]", "s3hybrid[b]", "bm25"]
    tasks = ["niah_single_1@words", "niah_single_1@uuids", "qa_1", "hotpotqa"]
    records = []
    for i in range(12):
        def row():
            return {"prediction": "x", "score": float(rng.random()), "recall": float(rng.integers(0, 2)),
                    "kl": float(rng.random()), "nll": float(rng.random() * 4), "kept_tokens": int(rng.integers(1, 99))}
        records.append({"task": tasks[i % 4], "index": i // 4, "answers": ["x"], "scan_seconds": {"a": 1.0, "b": 2.0},
                        "full": {**row(), "context_tokens": 100}, **{m: row() for m in methods}})
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert mod.main(["--summarize", "--out", str(tmp_path), "--note", "stopped early"]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())["summary"]
    assert set(summary) == {"all", "longbench_qa", "ruler_qa", "niah@words", "niah@uuids", "niah"}
    for m in methods:
        for k in ("score", "recall", "kl", "nll", "kept_tokens"):
            assert summary["all"][m][k] == pytest.approx(np.mean([r[m][k] for r in records]), rel=1e-12)
        words = [r[m]["recall"] for r in records if r["task"] == tasks[0]]
        assert summary["niah@words"][m]["recall"] == pytest.approx(np.mean(words), rel=1e-12)
    # the hybrid of each set against BM25, and set b against set a (the first named)
    assert set(summary["all"]["intervals"]) == {"s3hybrid[a] - bm25", "s3hybrid[b] - bm25",
                                                "s3pure[b] - s3pure[a]", "s3hybrid[b] - s3hybrid[a]"}
    md = (tmp_path / "summary.md").read_text()
    assert md.startswith("stopped early") and "| s3hybrid[b] |" in md
    (tmp_path / "records.jsonl").write_text("")
    with pytest.raises(SystemExit, match="is empty"):
        mod.main(["--summarize", "--out", str(tmp_path)])
