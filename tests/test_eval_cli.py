"""``sparsekv eval`` end to end on the real SmolLM2 (CPU, short prompts) and the RULER-format path on a tiny
random model with its tokenizer, plus the runner's pieces."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import seeded_rng

from sparsekv_jax import cli
from sparsekv_jax.eval import metrics, report, runner
from sparsekv_jax.policies import Dense, Pipeline, Quest, SnapKV


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture
def smol_load(smol, monkeypatch):
    """`load("smollm2")` returns the session's already converted model (no second conversion)."""
    import sparsekv_jax.models.embedded as embedded

    _, params, tok, _ = smol
    monkeypatch.setattr(embedded, "load", lambda *a, **k: (params, tok))
    return params, tok


@pytest.fixture
def tiny_load(smol, monkeypatch):
    """`load("smollm2")` returns a 3-layer random model over SmolLM2's vocabulary with SmolLM2's
    tokenizer (real prompts and metrics; the model's answers are not what the test reads)."""
    import jax
    import jax.numpy as jnp

    import sparsekv_jax.models.embedded as embedded
    from sparsekv_jax.models.config import ModelConfig
    from sparsekv_jax.models.params import random_params

    real, tok = smol[1], smol[2]
    cfg = ModelConfig(family="llama", vocab_size=real.config.vocab_size, hidden_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=2048,
                      eos_token_ids=real.config.eos_token_ids)
    tiny = random_params(cfg, jax.random.key(0), jnp.float32, scale=0.3), tok
    monkeypatch.setattr(embedded, "load", lambda *a, **k: tiny)
    return tiny


# ------------------------------------------------------------------------------ pure helpers


def test_parse_lengths():
    assert runner.parse_lengths("2k,4K, 1000,1.5k") == [2048, 4096, 1000, 1536]
    assert runner.parse_lengths(None) is None
    assert runner.parse_lengths([512, "1k"]) == [512, 1024]
    for bad in ("abc", "0", "1.3k", ""):
        with pytest.raises(ValueError):
            runner.parse_lengths(bad)
    assert runner.format_length(4096) == "4k" and runner.format_length(1000) == "1000"


def test_policy_specs_labels_families_budgets():
    specs = runner.policy_specs("fullkv, snapkv(budget=0.1), SnapKV(0.2, window=16), quest(2048), "
                                "pipeline(compress=snapkv(0.25), decode=quest(0.5)), dense")
    assert [s.label for s in specs] == ["fullkv", "snapkv(budget=0.1)", "SnapKV(0.2, window=16)", "quest(2048)",
                                        "pipeline(compress=snapkv(0.25), decode=quest(0.5))"]  # dense == fullkv
    assert [s.family for s in specs] == ["fullkv", "snapkv", "snapkv(window=16)", "quest",
                                         "pipeline(compress=snapkv, decode=quest)"]
    assert [s.budget for s in specs] == [1.0, 0.1, 0.2, 2048, 0.25]
    assert specs[1].key == SnapKV(budget=0.1).spec_key()
    objs = runner.policy_specs([Dense(), Pipeline(decode=Quest(0.5))])
    assert objs[1].family == "pipeline(decode=quest)" and objs[1].budget == 0.5
    with pytest.raises(ValueError, match="unknown policy"):
        runner.policy_specs("snapkv(0.1), nosuch(3)")


def test_summarize_kept_and_markdown(tmp_path):
    def rec(policy, family, budget, task, score, length=1024):
        return {"key": f"{policy}{task}{score}{length}", "policy": policy, "family": family, "budget": budget,
                "task": task, "length": length, "score": score, "question": "aware", "prompt_tokens": 1000,
                "stats": {"kv_stored_fraction": budget if isinstance(budget, float) else 1.0,
                          "kv_read_fraction": 1.0}}

    recs = [rec("fullkv", "fullkv", 1.0, "a", 1.0), rec("fullkv", "fullkv", 1.0, "b", 0.5),
            rec("snapkv(0.1)", "snapkv", 0.1, "a", 0.5), rec("snapkv(0.1)", "snapkv", 0.1, "b", 0.25),
            rec("snapkv(0.5)", "snapkv", 0.5, "a", 1.0), rec("snapkv(0.5)", "snapkv", 0.5, "b", 0.5),
            rec("quest(100)", "quest", 100, "a", 0.0)]
    s = report.summarize(recs, policy_order=["fullkv"])
    rows = {r["policy"]: r for r in s["rows"]}
    assert s["columns"] == ["a@1k", "b@1k"] and s["reference"] == "fullkv"
    assert rows["fullkv"]["average"] == 75.0 and rows["fullkv"]["kept_pct"] == 100.0
    assert rows["snapkv(0.1)"]["average"] == 37.5 and rows["snapkv(0.1)"]["kept_pct"] == 50.0
    assert rows["quest(100)"]["kept_pct"] == 0.0  # over the column it has
    assert rows["quest(100)"]["budget_fraction"] == {"1k": 0.1}  # 100 tokens of a 1000-token prompt
    md = report.markdown_table(s)
    # one sample a column: every resample is the sample itself, so each interval is a point
    assert ("| 3 | snapkv(0.1) | complete | 50.00 | 25.00 | 37.50 | [37.50, 37.50] | – | 50.0 | [50.0, 50.0] | "
            "-37.50 [-37.50, -37.50] | – | 0.100 | 1.000 |") in md
    # quest(100) ran one of full attention's two columns: partial, its average apart, its % of full named
    assert ("| 2 | quest(100) | **partial**: 1 of 2 columns, 1 of 2 samples | 0.00 | – | – | – | 0.00 [0.00, 0.00] | "
            "0.0 (on its 1 of 2 columns) |") in md
    assert rows["snapkv(0.5)"]["overlaps"] == ["fullkv"]  # the same scores: both intervals are the point 100
    paths = report.write_reports(s, tmp_path)
    assert paths["budget_plot"].stat().st_size > 1000 and paths["length_plot"].stat().st_size > 1000


def test_bad_policy_spec_exits_2(capsys):
    assert cli.main(["eval", "--policies", "snapkv(budget=2.0)"]) == 2
    assert "budget=2.0 must be a fraction" in capsys.readouterr().err
    assert cli.main(["eval", "--policies", "snapkv(0.1"]) == 2
    assert "not well formed" in capsys.readouterr().err
    assert cli.main(["eval", "--lengths", "4q"]) == 2
    assert "--lengths" in capsys.readouterr().err


def test_help_explains_the_grammar(capsys):
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    out = capsys.readouterr().out
    for word in ("SPEC", "snapkv(budget=0.1)", "agnostic", "results.jsonl", "--fidelity", "--batch-size"):
        assert word in out


def test_load_ruler_dir_layouts(tmp_path):
    rec = {"index": 0, "input": "ctx ctx\nWhat are all the special magic numbers for x mentioned?", "outputs": ["1"]}
    for d in (tmp_path / "flat" / "niah_single_1", tmp_path / "bylen" / "4096" / "data" / "qa_2"):
        d.mkdir(parents=True)
        (d / "validation.jsonl").write_text(json.dumps(rec) + "\n")
    flat = runner.load_ruler_dir(tmp_path / "flat")
    (s,) = flat[("niah_single_1", None)]
    assert s.context == "ctx ctx" and s.question.startswith("\nWhat are all") and s.metric == "string_match_all"
    bylen = runner.load_ruler_dir(tmp_path / "bylen")
    assert bylen[("qa_2", 4096)][0].metric == "string_match_part"
    with pytest.raises(FileNotFoundError):
        runner.load_ruler_dir(tmp_path / "bylen", lengths=[8192])


# ------------------------------------------------------------------------------ end to end


@pytest.mark.usefixtures("optimized_xla")  # a real model: its programs compiled optimized
def test_eval_ruler_end_to_end_and_resume(smol_load, tmp_path, monkeypatch):
    """512-token prompts (1k before: each prefill and decode step on twice the cache); StreamingLLM's budget
    32 keeps it evicting most of the prompt (< 10% stored, as 64 of 1k did). One task (niah_single_1; vt
    beside it doubled the optimized SmolLM2 programs): a summary of two columns, vt's among them, is
    `test_eval_ruler_format_path_metrics_and_fidelity`'s."""
    # keep one compiled program alive at a time: the cache-dropping path runs and changes nothing
    import jax

    cleared = []
    real_clear = jax.clear_caches
    monkeypatch.setattr(runner, "MAX_LIVE_PROGRAMS", 1)
    monkeypatch.setattr(jax, "clear_caches", lambda: (cleared.append(1), real_clear()))
    out = tmp_path / "run"
    argv = ["eval", "--model", "smollm2", "--suite", "ruler", "--tasks", "niah_single_1", "--lengths", "512",
            "--policies", "streamingllm(budget=32)", "--n", "1", "--batch-size", "2", "--out", str(out), "-q"]
    assert cli.main(argv) == 0
    recs = _lines(out / "results.jsonl")
    # fullkv was added automatically: 1 task x 2 policies x 1 sample
    assert len(recs) == 2
    assert {r["policy"] for r in recs} == {"fullkv", "streamingllm(budget=32)"}
    for r in recs:
        assert r["question"] == "agnostic" and r["model"] == "smollm2" and r["seed"] == 0
        assert r["length"] == 512 and 450 < r["prompt_tokens"] <= 512 and r["question_tokens"] > 0
        assert r["score"] == metrics.score(r["metric"], r["prediction"], r["answers"])
        assert 0 < r["stats"]["kv_stored_fraction"] <= 1 and r["timing"]["batch_seconds"] > 0
    by = {(r["task"], r["policy"]): r for r in recs}
    assert by[("niah_single_1", "fullkv")]["score"] == 1.0  # SmolLM2 finds a 512-token needle with full attention
    assert len(cleared) >= 1
    assert by[("niah_single_1", "streamingllm(budget=32)")]["stats"]["kv_stored_fraction"] < 0.1
    summary = json.loads((out / "summary.json").read_text())
    assert summary["columns"] == ["niah_single_1@512"]
    assert [r["policy"] for r in summary["rows"]] == ["fullkv", "streamingllm(budget=32)"]
    md = (out / "summary.md").read_text()
    assert "% of full kept" in md and "streamingllm(budget=32)" in md
    pngs = list(out.glob("*.png"))
    assert pngs and all(p.stat().st_size > 1000 for p in pngs)

    # rerun: nothing is generated again, nothing appended
    import sparsekv_jax.generate as gen

    def boom(*a, **k):
        raise AssertionError("a finished sample was recomputed")

    monkeypatch.setattr(gen, "generate", boom)
    assert cli.main(argv) == 0
    assert len(_lines(out / "results.jsonl")) == 2
    # another question mode is a different key: it runs (and would call generate)
    with pytest.raises(AssertionError, match="recomputed"):
        cli.main([*argv, "--question", "aware"])


def test_eval_ruler_format_path_metrics_and_fidelity(tiny_load, tmp_path):
    """RULER-format jsonl (input/outputs per task folder): qa_* scored with string_match_part, others with
    string_match_all. The references "" (found in any prediction) and "zqxj" (never) make the two differ.
    None of it reads what the answers say: the CLI runs a tiny random model with SmolLM2's tokenizer
    (`tiny_load`; SmolLM2 itself made this test 37 s of optimized compiles, its answers are
    `test_eval_ruler_end_to_end_and_resume`'s).

    The other task is vt (RULER answers it in 30 tokens, as qa_1 in 32): both decode 32 tokens, so the
    two tasks' prompts (61 and 47 tokens, padded to 64) run the same programs, compiled once (a needle task's 128-token
    answers took this test 125 s, this check needs neither their length nor a second set of programs)."""
    data = tmp_path / "ruler_data"
    records = {
        "qa_1": "Answer the question based on the given documents.\n\nDocument 1:\nParis is the capital of "
                "France.\n\nAnswer the question based on the given documents.\n\nQuestion: What is the capital "
                "of France? Answer:",
        "vt": "Track the chain of variable assignments in the text.\n\nVAR QPL = 4242. The grass is green. "
              "VAR RTX = VAR QPL.\nQuestion: Find all variables that are assigned the value 4242 in the text "
              "above. Answer:",
    }
    for task, text in records.items():
        (data / task).mkdir(parents=True)
        (data / task / "validation.jsonl").write_text(
            json.dumps({"index": 0, "input": text, "outputs": ["", "zqxj"], "length": 40}) + "\n")
    out = tmp_path / "run"
    assert cli.main(["eval", "--suite", str(data), "--policies", "snapkv(budget=8, window=4)", "--n", "1",
                     "--question", "aware", "--fidelity", "--out", str(out), "-q"]) == 0
    recs = _lines(out / "results.jsonl")
    assert len(recs) == 4
    for r in recs:
        assert r["metric"] == ("string_match_part" if r["task"] == "qa_1" else "string_match_all")
        assert r["score"] == (1.0 if r["task"] == "qa_1" else 0.5)
        assert r["question"] == "aware" and r["length"] is None and r["question_tokens"] > 3
        f = r["fidelity"]
        assert f is not None and 0.0 <= f["top1_agreement"] <= 1.0 and f["kl_mean"] >= 0.0
        if r["policy"] == "fullkv":
            assert f["kl_mean"] == 0.0 and f["top1_agreement"] == 1.0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["columns"] == ["qa_1", "vt"]
    assert all(row["fidelity"] is not None for row in summary["rows"])
    assert "KL mean" in (out / "summary.md").read_text()


def test_batches_never_pad_past_the_model_positions():
    """A long context and a long question from different rows must not share a batch."""
    from types import SimpleNamespace

    from sparsekv_jax.eval.batching import Item, batch_inputs, batches, bucket

    rng = seeded_rng()
    items = []
    for i in range(12):
        ctx, q = int(rng.integers(100, 900)), int(rng.integers(5, 200))
        items.append(Item(None, SimpleNamespace(index=i), [1] * ctx, [1] * q, int(rng.integers(8, 70))))
    max_positions = 1000
    items = [it for it in items if it.num_tokens + bucket(it.max_new_tokens) <= max_positions]
    seen = 0
    for batch in batches(items, 4, max_positions):
        assert 1 <= len(batch) <= 4
        kw = batch_inputs(batch, "agnostic", max_positions, 64, len(batch))
        assert kw["tokens"].shape[1] + kw["suffix"].shape[1] + bucket(max(it.max_new_tokens for it in batch)) \
            <= max_positions
        seen += len(batch)
    assert seen == len(items)
