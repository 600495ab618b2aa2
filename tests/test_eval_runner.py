"""The eval runner's plan / run / record on a tiny random model that reads SmolLM2's tokenizer:
question placement (``question_start``), every stat a policy reports recorded, resume keys from
``spec_key``, and ``--suite longbench`` on the shipped data with nothing beside the package."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng
from flax import struct

from sparsekv_jax import cli
from sparsekv_jax.datasets import LONGBENCH_MINI_DIR
from sparsekv_jax.eval import runner
from sparsekv_jax.eval.specs import is_dense, policy_budget, policy_family
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import expected_shapes, params_from_arrays
from sparsekv_jax.policies import ContextResult, Dense, Pipeline, Policy, Quest, SnapKV


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tiny(smol) -> tuple[Any, Any]:
    """A 3-layer random model over SmolLM2's vocabulary, with SmolLM2's tokenizer: real prompts
    (chat template, LongBench truncation), model cost next to nothing (compiling each program,
    ~10 s on 2 CPU cores, is what these tests pay: they keep the programs few)."""
    real, tok = smol[1], smol[2]
    cfg = ModelConfig(family="llama", vocab_size=real.config.vocab_size, hidden_size=64, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, intermediate_size=96, max_position_embeddings=2048,
                      eos_token_ids=real.config.eos_token_ids)
    # `random_params`' weights (norms near 1, the rest normal at scale 0.3) drawn with NumPy: drawn by JAX
    # eagerly, each weight's shape compiled programs of its own (~2.5 s for the 49k-row embeddings). One fixed
    # draw, as the JAX key 0 was: the tests below need a model whose answers run long and differ by question
    rng = np.random.default_rng(0)
    params = params_from_arrays(cfg, {name: jnp.asarray(1 + 0.1 * rng.standard_normal(shape, np.float32)
                                                        if name.endswith("norm")
                                                        else 0.3 * rng.standard_normal(shape, np.float32))
                                      for name, shape in sorted(expected_shapes(cfg).items())})
    return params, tok


@pytest.fixture
def tiny_load(tiny, monkeypatch):
    """`load("smollm2")` returns the tiny model (so the CLI runs on it)."""
    import sparsekv_jax.models.embedded as embedded

    monkeypatch.setattr(embedded, "load", lambda *a, **k: tiny)
    return tiny


# --------------------------------------------------------------------- policies that report what they saw


@struct.dataclass
class SeesQuestion(Policy):
    """Reports, per row, the ``question_start`` its prefill observation saw (-1: none given), the
    decode steps it was called for, and a scalar; holds an array leaf (like SAE weights)."""

    stages = ("decode",)
    needs_observations = True
    weights: jax.Array = None

    def observe(self, q, k, v, hidden, layer_index, prompt):
        qs = prompt.question_start
        return jnp.full(prompt.lengths.shape, -1, jnp.int32) if qs is None else qs

    def decode_init(self, cache, observations):
        return None, {"seen": observations[0], "steps": jnp.zeros_like(observations[0])}

    def decode_update(self, shared_state, cache, logits):
        return {**shared_state, "steps": shared_state["steps"] + 1}

    def decode_stats(self, shared_state):
        return {"seen_question_start": shared_state["seen"], "decode_calls": shared_state["steps"],
                "weights_sum": jnp.sum(self.weights)}


@struct.dataclass
class ContextInfo(Policy):
    """A context stage that keeps the prompt and reports host-side info (per-row array, scalars, a list)."""

    stages = ("context",)

    def context(self, params, tokens, lengths, question_start):
        info = {"lengths": lengths.copy(), "question_start": question_start, "seconds": np.float64(0.25),
                "spans": [[0, 1], [2, 3]], "method": "identity"}
        return ContextResult(tokens, lengths, question_start, info)


def _ruler_file(root: Path) -> Path:
    """Three RULER-format records of different lengths (one task folder)."""
    d = root / "qa_1"
    d.mkdir(parents=True)
    recs = []
    for i, words in enumerate((30, 70, 50)):
        doc = " ".join(f"Document {j}: the river of town {j} is called R{j}." for j in range(words // 10))
        recs.append({"index": i, "input": f"{doc}\n\nQuestion: What is the river of town 1 called? Answer:",
                     "outputs": ["R1"]})
    (d / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return root


# --------------------------------------------------------------------- pure pieces


def test_row_stats_takes_each_rows_value_and_keeps_the_rest():
    rng = seeded_rng()
    per_row = rng.standard_normal(3).astype(np.float32)
    counts = rng.integers(0, 9, (3, 2)).astype(np.int32)
    stats = {"kv_stored_fraction": jnp.asarray(per_row), "prefill_block_fraction": jnp.float32(0.5),
             "cache_bytes": 4096, "my_counter": jnp.asarray(counts), "half": jnp.ones((3,), jnp.bfloat16) * 1.5,
             "context": {"spans": np.arange(6).reshape(3, 2), "seconds": np.float64(1.5), "names": ["a", "b", "c"],
                         "per_layer": np.arange(4.0), "none": None}}
    for row in range(3):
        got = runner.row_stats(stats, row, 3)
        json.dumps(got)  # JSON-ready
        assert got["kv_stored_fraction"] == float(per_row[row])
        assert got["prefill_block_fraction"] == 0.5 and got["cache_bytes"] == 4096
        assert got["my_counter"] == counts[row].tolist() and isinstance(got["my_counter"][0], int)
        assert got["half"] == 1.5
        assert got["context"] == {"spans": [2 * row, 2 * row + 1], "seconds": 1.5, "names": ["a", "b", "c"],
                                  "per_layer": [0.0, 1.0, 2.0, 3.0], "none": None}


def test_policy_helpers_read_declared_stages():
    assert is_dense(Dense()) and is_dense(Pipeline()) and not is_dense(Pipeline(context=ContextInfo()))
    assert policy_budget(Pipeline(context=ContextInfo())) is None
    assert policy_budget(Pipeline(compress=SnapKV(0.2), decode=Quest(0.5))) == 0.2
    assert policy_budget(Pipeline(decode=Quest(0.5))) == 0.5
    big = SeesQuestion(weights=jnp.arange(5000.0))
    assert policy_family(big) == "seesquestion(weights=array[5000])"  # not the array's contents
    assert policy_family(Pipeline(context=ContextInfo(), decode=big)) == \
        "pipeline(context=contextinfo, decode=seesquestion(weights=array[5000]))"


# --------------------------------------------------------------------- end to end on the tiny model


@pytest.mark.parametrize("question", ["aware", "agnostic"])
def test_question_start_reaches_the_policy_and_every_stat_is_recorded(tiny, tmp_path, question):
    """Aware: the context stage and the prefill observation see ``question_start`` = each row's
    context length; agnostic: none. Every ``decode_stats`` key and ``stats["context"]`` is recorded."""
    data = _ruler_file(tmp_path / "data")
    weights = jnp.asarray(seeded_rng().standard_normal(300), jnp.float32)
    pol = Pipeline(context=ContextInfo(), decode=SeesQuestion(weights=weights))
    out = tmp_path / "run"
    # one padded width for every batch, no full-attention run: one compiled program
    runner.run_eval(tiny, suite=str(data), policies=[pol], n=3, batch_size=2, out_dir=out, question=question,
                    progress=False, pad_multiple=256, add_fullkv=False)
    recs = _lines(out / "results.jsonl")
    assert len(recs) == 3 and {r["policy"] for r in recs} == {"Pipeline(context=ContextInfo, decode=SeesQuestion)"}
    assert len({r["context_tokens"] for r in recs}) == 3  # three different splits: each row got its own value
    for r in recs:
        assert r["question"] == question and json.loads(r["key"])[6] == r["policy_key"] == pol.spec_key()
        s = r["stats"]
        assert set(s) == {"kv_stored_fraction", "kv_read_fraction", "prefill_block_fraction", "cache_bytes",
                          "cache_capacity", "seen_question_start", "decode_calls", "weights_sum", "context"}
        assert s["seen_question_start"] == (r["context_tokens"] if question == "aware" else -1)
        assert isinstance(s["decode_calls"], int) and s["decode_calls"] >= r["generated_tokens"] - 1
        assert s["weights_sum"] == pytest.approx(float(jnp.sum(weights)), rel=1e-5)
        c = s["context"]
        assert c["lengths"] == (r["prompt_tokens"] if question == "aware" else r["context_tokens"])
        assert c["question_start"] == (r["context_tokens"] if question == "aware" else None)
        assert c["seconds"] == 0.25 and c["spans"] == [[0, 1], [2, 3]] and c["method"] == "identity"


def test_resume_keys_come_from_spec_key(tiny, tmp_path, monkeypatch):
    """A policy holding an array: an equal array (another object) resumes, a different one whose
    repr is the same (numpy elides the middle) runs again."""
    data = _ruler_file(tmp_path / "data")
    a = np.arange(2000, dtype=np.float32)
    b = a.copy()
    b[1000] = -1.0
    assert repr(SeesQuestion(weights=jnp.asarray(a))) == repr(SeesQuestion(weights=jnp.asarray(b)))
    out = tmp_path / "run"
    kw = dict(suite=str(data), n=2, batch_size=2, out_dir=out, question="aware", progress=False, pad_multiple=256,
              add_fullkv=False)
    runner.run_eval(tiny, policies=[SeesQuestion(weights=jnp.asarray(a))], **kw)
    recs = _lines(out / "results.jsonl")
    assert len(recs) == 2
    assert {r["policy_key"] for r in recs} == {SeesQuestion(weights=jnp.asarray(a)).spec_key()}
    assert "seesquestion(weights=array[2000])" == recs[0]["family"]

    import sparsekv_jax.generate as gen

    def boom(*a, **k):
        raise AssertionError("a finished sample was recomputed")

    monkeypatch.setattr(gen, "generate", boom)
    summary = runner.run_eval(tiny, policies=[SeesQuestion(weights=jnp.asarray(a.copy()))], **kw)
    assert len(_lines(out / "results.jsonl")) == 2 and len(summary["rows"]) == 1
    with pytest.raises(AssertionError, match="recomputed"):
        runner.run_eval(tiny, policies=[SeesQuestion(weights=jnp.asarray(b))], **kw)


def test_plan_batches_pending_and_records(tiny, tmp_path):
    """The three steps one by one: the plan names what is pending, a run generates it, a record
    scores it; records already written are no longer pending."""
    from sparsekv_jax.eval.suites import build_groups

    params, tok = tiny
    data = _ruler_file(tmp_path / "data")
    specs = runner.policy_specs(["fullkv", "streamingllm(budget=16, sinks=4)"])
    suite_id, groups = build_groups(str(data), None, None, 3, 0, tok, 2048, None, None)
    plan = runner.plan_eval(groups, specs, tok, 2048, model="tiny", suite=suite_id, question="aware", seed=0)
    batches = list(plan.batches(batch_size=2, pad_multiple=16))
    assert [len(b.items) for b in batches] == [2, 1] and [b.rows for b in batches] == [2, 2]  # filled to 2
    b = batches[1]
    np.testing.assert_array_equal(b.inputs["question_start"], [len(b.items[0].context_ids)] * 2)
    assert b.inputs["suffix"] is None and b.width % 16 == 0
    pending = plan.pending(b, {}, fidelity=False)
    assert pending == {specs[0].key: [0], specs[1].key: [0]}
    stop = tuple(params.config.eos_token_ids)
    run = runner.run_batch(params, tok, specs[1], b, stop_tokens=stop)
    rec = runner.make_record(plan, specs[1], b, 0, run)
    assert rec["key"] == plan.key(b.items[0], specs[1]) and rec["policy"] == "streamingllm(budget=16, sinks=4)"
    assert rec["prediction"] == run.predictions[0] and rec["score"] in (0.0, 1.0)
    assert rec["stats"]["kv_stored_fraction"] == pytest.approx(16 / b.items[0].num_tokens, abs=1e-6)
    assert plan.pending(b, {rec["key"]: rec}, fidelity=False) == {specs[0].key: [0], specs[1].key: []}
    assert plan.pending(b, {rec["key"]: rec}, fidelity=True)[specs[1].key] == [0]  # no fidelity measured yet


# --------------------------------------------------------------------- the CLI on the shipped data


def test_longbench_default_is_the_shipped_data(tiny_load, tmp_path, monkeypatch):
    """``--suite longbench`` from another directory with another HOME: the package's own data."""
    assert runner.DEFAULT_LONGBENCH_PATH == LONGBENCH_MINI_DIR
    assert LONGBENCH_MINI_DIR.is_relative_to(Path(runner.__file__).resolve().parents[1])
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out = tmp_path / "lb"
    assert cli.main(["eval", "--suite", "longbench", "--tasks", "passage_count", "--lengths", "512",
                     "--policies", "fullkv", "--n", "2", "--out", str(out), "-q"]) == 0
    recs = _lines(out / "results.jsonl")
    assert len(recs) == 2 and {r["metric"] for r in recs} == {"count"}
    assert {r["sample_id"] for r in recs} == {"passage_count-0", "passage_count-1"}
    assert all(512 < r["prompt_tokens"] <= 512 + 64 for r in recs)  # truncated to 512, chat template added
    assert all(r["suite"] == "longbench" and r["column"] == "passage_count@512" for r in recs)


def test_eval_records_chess_counters_and_runs_stem(tiny, tmp_path):
    out = tmp_path / "lb"
    chess = "chess('aggressive', entropy_threshold=0.0, varentropy_threshold=0.0)"
    runner.run_eval(tiny, suite="longbench", tasks=["samsum"], lengths="512", policies=f"{chess}, stem", n=1,
                    out_dir=out, progress=False, add_fullkv=False)
    recs = {r["policy"]: r for r in _lines(out / "results.jsonl")}
    assert set(recs) == {chess, "stem"}
    c = recs[chess]
    assert c["generated_tokens"] <= 128  # exactly samsum's limit, no bucket, despite backtracking
    # thresholds 0: every complete page of 32 generated tokens triggers a rebuild
    assert c["stats"]["reselections"] >= (c["generated_tokens"] - 1) // 32 >= 1
    assert c["stats"]["backtracks"] >= 0
    assert "reselections" not in recs["stem"]["stats"]


def test_eval_prefill_chunk(tiny_load, tmp_path, capsys):
    """--prefill-chunk runs decode-stage policies in chunks and refuses one that observes the prefill."""
    out = tmp_path / "chunked"
    assert cli.main(["eval", "--suite", "longbench", "--tasks", "passage_count", "--lengths", "512",
                     "--prefill-chunk", "128", "--policies", "snapkv(0.5)", "--out", str(out), "-q"]) == 2
    assert "snapkv(0.5)" in capsys.readouterr().err
    runner.run_eval(tiny_load, suite="longbench", tasks=["passage_count"], lengths="512", policies="quest(0.5)",
                    prefill_chunk=128, n=1, out_dir=out, progress=False, add_fullkv=False)
    (rec,) = _lines(out / "results.jsonl")
    assert rec["policy"] == "quest(0.5)" and rec["prompt_tokens"] > 128  # more than one chunk
    assert 0 < rec["stats"]["kv_read_fraction"] < 1


def test_a_results_file_cut_short_is_repaired_on_resume(tiny, tmp_path):
    """Issue 42.4: the last line of results.jsonl cut mid-record (a run killed while writing) is set
    aside on resume, its sample runs again on a line of its own, and the summary counts what reads."""
    data = _ruler_file(tmp_path / "data")
    out = tmp_path / "run"
    kw = dict(suite=str(data), policies=[Dense()], n=3, batch_size=3, out_dir=out, question="aware", progress=False,
              pad_multiple=256, add_fullkv=False)
    runner.run_eval(tiny, **kw)
    path = out / "results.jsonl"
    first = path.read_text()
    lines = first.splitlines(keepends=True)
    assert len(lines) == 3
    cut = lines[2][: len(lines[2]) // 2]
    path.write_text(lines[0] + lines[1] + cut)  # as a kill mid-write leaves it
    with pytest.warns(UserWarning, match="1 unreadable line"):
        summary = runner.run_eval(tiny, **kw)
    text = path.read_text()
    recs = [json.loads(line) for line in text.splitlines()]  # every line parses
    assert len(recs) == 3 and len({r["key"] for r in recs}) == 3 and text.endswith("\n")
    assert recs[2]["key"] == json.loads(lines[2])["key"]  # the lost sample, run again
    assert (out / "results.jsonl.damaged").read_text() == cut + "\n"
    (row,) = summary["rows"]
    assert sum(row["n"].values()) == 3 and sum(row["ci"]["n"].values()) == 3
    assert json.loads((out / "summary.json").read_text())["rows"][0]["n"] == row["n"]


def test_runs_at_two_cache_dtypes_share_an_out_dir_and_fidelity_uses_the_backend(tiny, tmp_path, monkeypatch):
    """A run in the model's dtype and one with ``backend=Backend(kv_dtype="int8")`` write to one
    ``out_dir``: the int8 run computes its own records (keys end with the cache dtype, labels with
    ``[kv=int8]``, ``kv_dtype`` recorded) instead of resuming the other's, its fidelity reference
    runs on its backend (tests/test_eval_fidelity.py checks the values), each summary holds its own
    dtype's rows, and a rerun of either resumes everything. Keys of a run without a cache dtype
    keep their old form (8 parts), so results written before still resume. One policy (full attention:
    its fidelity reference still runs, on the int8 backend); a second one (StreamingLLM) only added
    programs (~40% of this test), not a fact about dtypes or keys."""
    from sparsekv_jax.backend import Backend
    from sparsekv_jax.eval import fidelity as fid

    data = _ruler_file(tmp_path / "data")
    out = tmp_path / "run"
    kw = dict(suite=str(data), policies="fullkv", n=2, batch_size=2, out_dir=out,
              question="aware", progress=False, pad_multiple=256)
    seen: list[Any] = []
    reference = fid.reference
    monkeypatch.setattr(fid, "reference", lambda *a, **k: seen.append(k.get("backend")) or reference(*a, **k))
    int8 = Backend(kv_dtype="int8")
    runs = ((None, False), (int8, True))  # (backend, fidelity): the model's dtype, then int8 with fidelity
    plain, quant = (runner.run_eval(tiny, backend=backend, fidelity=f, **kw) for backend, f in runs)
    assert seen == [int8]  # the int8 run's reference, on its backend
    recs = _lines(out / "results.jsonl")
    assert len(recs) == 4 and len({r["key"] for r in recs}) == 4
    by = {(r["kv_dtype"], r["policy_key"], r["index"]): r for r in recs}
    for r in recs:
        key = json.loads(r["key"])
        if r["kv_dtype"] is None:
            assert len(key) == 8 and not r["policy"].endswith("]") and "fidelity" not in r
        else:
            plain_rec = by[None, r["policy_key"], r["index"]]
            assert r["kv_dtype"] == "int8" and key[8] == "int8" and key[:8] == json.loads(plain_rec["key"])
            assert r["policy"] == plain_rec["policy"] + " [kv=int8]" and r["fidelity"] is not None
    assert quant["kv_dtype"] == "int8" and plain["kv_dtype"] is None
    assert all(row["policy"].endswith(" [kv=int8]") for row in quant["rows"]) and len(quant["rows"]) == 1
    assert not any(row["policy"].endswith("]") for row in plain["rows"]) and len(plain["rows"]) == 1

    import sparsekv_jax.generate as gen

    def boom(*a, **k):
        raise AssertionError("a finished sample was recomputed")

    monkeypatch.setattr(gen, "generate", boom)
    monkeypatch.setattr(gen, "teacher_force", boom)
    for (backend, f), summary in zip(runs, (plain, quant), strict=True):
        assert runner.run_eval(tiny, backend=backend, fidelity=f, **kw)["rows"] == summary["rows"]
    assert len(_lines(out / "results.jsonl")) == 4


def test_shared_context_questions_read_one_compressed_context(tiny, tmp_path):
    """``ruler-shared``: a context's four one-key questions run on the same context tokens; question-
    agnostic compression (it never sees the question) keeps the same entries for all four. The context
    of `shared_plan` (512 tokens), its compressing SnapKV(0.5) and its batch of 2 rows: the programs that
    `test_shared_context_compressing_policy_equals_session_ask_by_hand` runs again."""
    out = tmp_path / "shared"
    summary = runner.run_eval(tiny, suite="ruler-shared", tasks=["niah_multiquery"], lengths=[512],
                              policies=[SnapKV(0.5)], n=1, batch_size=2, out_dir=out, question="agnostic",
                              progress=False, pad_multiple=256, add_fullkv=False)
    recs = _lines(out / "results.jsonl")
    assert sorted(r["index"] for r in recs) == [0, 1, 2, 3]
    assert {r["task"] for r in recs} == {"niah_multiquery@split"} and {r["suite"] for r in recs} == {"ruler-shared"}
    assert len({r["context_tokens"] for r in recs}) == 1  # one context
    assert len({tuple(r["answers"]) for r in recs}) == 4  # four questions
    assert len({r["stats"]["kv_stored_fraction"] for r in recs}) == 1
    assert summary["columns"] == ["niah_multiquery@split@512"]
    # compressed once, asked in turn: every record says so, with its question's place
    assert all(r["shared_context"] for r in recs)
    assert sorted(r["question_index"] for r in recs) == [0, 1, 2, 3]
    assert len({r["timing"]["context_seconds"] for r in recs}) == 1 and {r["timing"]["questions"] for r in recs} == {4}


@pytest.fixture(scope="module")
def shared_plan(tiny):
    """Two ``niah_multiquery@split`` contexts of 512 tokens, four questions each, planned question-
    agnostic for full attention, a SnapKV budget covering the prompt and a compressing SnapKV."""
    from sparsekv_jax.eval.suites import build_groups

    params, tok = tiny
    suite, groups = build_groups("ruler-shared", ["niah_multiquery"], [512], 2, 0, tok,
                                 params.config.max_position_embeddings, None, None)
    specs = [dataclasses.replace(s, policy=s.policy.with_tokenizer(tok))
             for s in runner.policy_specs("fullkv, snapkv(1.0), snapkv(0.5)")]
    return runner.plan_eval(groups, specs, tok, params.config.max_position_embeddings, model="tiny", suite=suite,
                            question="agnostic", seed=0)


def _shared_runs(tiny, plan, spec):
    """``{sample index: (generated ids, prediction)}`` of ``spec`` on the shared path (one batch of
    both contexts), and the `SharedBatch`."""
    (shared,) = [b for b in plan.batches(2, 256, shared=True)]
    assert isinstance(shared, runner.SharedBatch) and shared.rows == 2 and len(shared.turns) == 4
    stop = tuple(tiny[0].config.eos_token_ids)
    _, runs = runner.run_shared(*tiny, spec, shared, stop_tokens=stop)
    out = {}
    for turn, run, real in zip(shared.turns, runs, shared.real, strict=True):
        for i in real:
            out[turn.items[i].sample.index] = (run.tokens[i, : run.num_generated[i]].tolist(), run.predictions[i])
    return out, shared


def test_shared_context_answers_equal_each_question_run_alone(tiny, shared_plan):
    """Full attention, or SnapKV with a budget covering the prompt (one of the two a run, drawn from the
    run's seed and printed: every seed covers one, the seeds together both; each is ~17 s of programs of
    its own): compressing each context once and asking its four questions in turn (batch of 2 contexts)
    gives every question the answer the per-question path (`generate` with the question as suffix, rows
    batched by length) gives."""
    which = int(seeded_rng().integers(2))
    spec = shared_plan.specs[which]
    print(f"policy of this run: {spec.label}")
    shared, _ = _shared_runs(tiny, shared_plan, spec)
    stop = tuple(tiny[0].config.eos_token_ids)
    alone = {}
    for batch in shared_plan.batches(4, 256):
        assert isinstance(batch, runner.Batch)
        run = runner.run_batch(*tiny, spec, batch, stop_tokens=stop)
        for i, it in enumerate(batch.items):
            alone[it.sample.index] = (run.tokens[i, : run.num_generated[i]].tolist(), run.predictions[i])
    assert sorted(shared) == sorted(alone) == list(range(8))
    assert len({tuple(ids) for ids, _ in alone.values()}) > 1  # the questions lead to different answers
    assert shared == alone


def test_shared_context_compressing_policy_equals_session_ask_by_hand(tiny, shared_plan):
    """SnapKV(0.5) on the shared path equals, for a context alone (batch 1, its own length), a
    `Session` compressing it once and asked each question in turn (unpadded). The context is one of
    the batch's two, drawn from the run's seed and printed (each is a `Session` of its own length: its
    own programs); the seeds together check both rows of the shared batch."""
    from sparsekv_jax.engine import Session

    params, tok = tiny
    spec = shared_plan.specs[2]
    got, shared = _shared_runs(tiny, shared_plan, spec)
    first = shared.turns[0]
    new = max(runner.decode_length(t, spec.policy) for t in shared.turns)
    stop = tuple(params.config.eos_token_ids)
    row = int(seeded_rng().integers(2))
    print(f"context row of this run: {row}")
    n = int(first.inputs["lengths"][row])
    session = Session.start(params, spec.policy, first.inputs["tokens"][row: row + 1, :n],
                            question_tokens=int(first.inputs["suffix"].shape[1]), max_new_tokens=new,
                            stop_tokens=stop, page_size=16)
    for turn in shared.turns:
        it = turn.items[row]
        out = session.ask(np.asarray([it.question_ids], np.int32))
        ids = out.sequences()[0]
        assert got[it.sample.index][0] == ids, (row, it.sample.index)
    assert len({tuple(ids) for ids, _ in got.values()}) > 1  # the questions lead to different answers


def test_cli_ruler_variants_then_report(tiny_load, tmp_path, capsys):
    """``sparsekv eval --suite ruler-variants`` runs a needle task with each value type, its summary
    carries paired intervals, and the report command rebuilds the tables from the records."""
    from sparsekv_jax.eval import report

    out = tmp_path / "variants"
    assert cli.main(["eval", "--suite", "ruler-variants", "--tasks", "niah_single_1", "--lengths", "512", "--n", "1",
                     "--policies", "snapkv(0.5)", "--batch-size", "3", "--pad-multiple", "256", "--out", str(out),
                     "-q"]) == 0
    recs = _lines(out / "results.jsonl")
    assert sorted((r["policy"], r["task"]) for r in recs) == sorted(
        (p, f"niah_single_1@{t}") for p in ("fullkv", "snapkv(0.5)") for t in ("numbers", "words", "uuids"))
    assert {r["suite"] for r in recs} == {"ruler-variants"}
    summary = json.loads((out / "summary.json").read_text())
    snap = next(r for r in summary["rows"] if r["policy"] == "snapkv(0.5)")
    assert snap["ci"]["n"] == {f"niah_single_1@{t}@512": 1 for t in ("numbers", "words", "uuids")}
    assert "paired percentile bootstrap" in (out / "summary.md").read_text()
    assert report.main([str(out), "--out", str(tmp_path / "docs")]) == 0
    md = (tmp_path / "docs" / "RESULTS.md").read_text()
    assert "### smollm2 · ruler-variants · 512 · question-agnostic" in md
    assert "Needle value types, smollm2 · 512 · question-agnostic" in md
    assert (tmp_path / "docs" / "needle_types_smollm2_ruler-variants_512_agnostic.png").stat().st_size > 5000
