"""LongBench loader on the real mini data shipped with the package (`sparsekv_jax.datasets`):
task/metric map, context/question split, truncation, plain and gzip'd jsonl."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest

from sparsekv_jax.datasets import LONGBENCH_MINI_DIR, longbench_mini_files
from sparsekv_jax.eval import longbench as lb
from sparsekv_jax.eval.tasks import Sample

MINI_TASKS = ["2wikimqa", "gov_report", "hotpotqa", "lcc", "multifieldqa_en", "narrativeqa", "passage_count",
              "qasper", "samsum", "trec"]


@pytest.fixture(scope="module")
def tokenizer(smol) -> Any:
    """SmolLM2's tokenizer (the session's embedded-model fixture, tests/conftest.py)."""
    return smol[2]


@pytest.fixture(scope="module")
def mini() -> dict[str, list[Sample]]:
    return lb.load_longbench(LONGBENCH_MINI_DIR)


def raw_records(task: str) -> list[dict[str, Any]]:
    with gzip.open(longbench_mini_files()[task], "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_default_path_and_plain_jsonl_give_the_same_samples(mini: dict[str, list[Sample]], tmp_path: Path) -> None:
    assert sorted(longbench_mini_files()) == MINI_TASKS
    assert lb.load_longbench() == mini  # no path: the shipped data
    plain = tmp_path / "trec.jsonl"  # a user's own data, uncompressed
    plain.write_text("".join(json.dumps(r) + "\n" for r in raw_records("trec")))
    from_plain = lb.load_longbench(tmp_path)["trec"]
    assert [(s.context, s.question, s.answers, s.all_classes) for s in from_plain] == \
        [(s.context, s.question, s.answers, s.all_classes) for s in mini["trec"]]
    gz = tmp_path / "gz" / "hotpotqa.jsonl.gz"  # no task field: the task is the file name
    gz.parent.mkdir()
    with gzip.open(gz, "wt", encoding="utf-8") as f:
        f.write(json.dumps({"context": "Passage 1:\nA.", "input": "Who?", "answers": ["A"]}) + "\n")
    (s,) = lb.load_longbench(gz.parent)["hotpotqa"]
    assert s.task == "hotpotqa" and s.prompt == lb.DATASET2PROMPT["hotpotqa"].replace(
        "{context}", "Passage 1:\nA.").replace("{input}", "Who?")
    (tmp_path / "trec.jsonl.gz").write_bytes(longbench_mini_files()["trec"].read_bytes())
    with pytest.raises(ValueError, match="keep one of them"):  # both forms: records would count twice
        lb.load_longbench(tmp_path)


def test_loads_all_ten_tasks(mini: dict[str, list[Sample]]) -> None:
    assert sorted(mini) == MINI_TASKS
    assert sum(len(v) for v in mini.values()) == 113
    for task, samples in mini.items():
        assert len(samples) == len(raw_records(task))
        for i, s in enumerate(samples):
            assert (s.task, s.index) == (task, i)
            assert s.metric == lb.DATASET2METRIC[task]
            assert s.max_new_tokens == lb.DATASET2MAXGEN[task]
            assert s.answers and all(isinstance(a, str) and a for a in s.answers)
            assert s.sample_id == f"{task}-{i}"
            assert s.first_line_only == (task in {"trec", "samsum"})
    assert {lb.DATASET2METRIC[t] for t in MINI_TASKS} == {"qa_f1", "rouge", "classification", "count", "code_sim"}
    trec = mini["trec"][0]
    assert trec.answers == ("Individual",) and trec.all_classes is not None and len(trec.all_classes) == 50


def test_metric_map_matches_longbench() -> None:
    expected = {
        "qa_f1": {"narrativeqa", "qasper", "multifieldqa_en", "hotpotqa", "2wikimqa", "musique", "triviaqa"},
        "rouge": {"gov_report", "qmsum", "multi_news", "samsum"},
        "classification": {"trec", "lsht"},
        "retrieval": {"passage_retrieval_en"},
        "count": {"passage_count"},
        "code_sim": {"lcc", "repobench-p"},
    }
    for metric, tasks in expected.items():
        assert {t for t, m in lb.DATASET2METRIC.items() if m == metric} == tasks


@pytest.mark.parametrize("task", MINI_TASKS)
def test_split_reassembles_prompt(task: str, mini: dict[str, list[Sample]]) -> None:
    for s, rec in zip(mini[task], raw_records(task), strict=True):
        assert s.context + s.question == rec["prompt"]
        assert s.context and s.question
        assert len(s.question) < len(s.context)
        assert s.question.startswith(lb.QUESTION_MARKERS[task])
    s = mini[task][0]
    if task in {"hotpotqa", "2wikimqa", "qasper", "multifieldqa_en", "narrativeqa"}:
        # QA: the whole question is on the question side; the documents are not.
        assert "\nQuestion: " in s.question and s.question.rstrip().endswith("Answer:")
        assert "Question: " not in s.context[-200:]
    if task == "trec":
        assert s.question.startswith("\nQuestion: ") and s.question.endswith("Type:")
        assert s.context.count("\nQuestion:") > 10  # the few-shot examples stay in the context
    if task == "samsum":
        assert s.question.startswith("\n\nDialogue: ") and s.question.endswith("Summary: ")


def test_context_input_records(tmp_path: Path) -> None:
    recs = [
        {"context": "Passage 1:\nA {brace} text.", "input": "Who?", "answers": ["A"], "_id": "x1"},
        {"context": "Passage 1:\nB.", "input": "What?", "answers": ["B"], "_id": "x2", "length": 3},
    ]
    (tmp_path / "hotpotqa.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    (tmp_path / "trec.jsonl").write_text(json.dumps(
        {"context": "Question: Q1\nType: Date", "input": "Question: Q2\nType:", "answers": ["Date"],
         "all_classes": ["Date", "Country"]}) + "\n")
    (tmp_path / "passage_count.jsonl").write_text(json.dumps(
        {"context": "Paragraph 1: x", "input": "", "answers": ["1"]}) + "\n")
    data = lb.load_longbench(tmp_path)
    assert sorted(data) == ["hotpotqa", "passage_count", "trec"]
    s = data["hotpotqa"][0]
    template = lb.DATASET2PROMPT["hotpotqa"]
    assert s.prompt == template.replace("{context}", recs[0]["context"]).replace("{input}", "Who?")
    assert s.context.endswith("A {brace} text.") and s.question.startswith("\n\nAnswer the question")
    assert s.sample_id == "x1" and data["hotpotqa"][1].meta["length"] == 3
    assert lb.split_prompt("hotpotqa", s.prompt) == (s.context, s.question)
    t = data["trec"][0]
    assert t.all_classes == ("Date", "Country") and t.question == "\nQuestion: Q2\nType:"
    assert t.score("Date\nCountry") == 1.0
    p = data["passage_count"][0]
    assert p.question.startswith("\n\nPlease enter the final count") and p.context.endswith("Paragraph 1: x")
    assert lb.load_longbench(tmp_path, tasks=["trec"]).keys() == {"trec"}
    assert len(lb.read_jsonl(tmp_path / "hotpotqa.jsonl", limit=1)) == 1


def test_bad_records(tmp_path: Path) -> None:
    f = tmp_path / "hotpotqa.jsonl"
    f.write_text(json.dumps({"answers": ["x"]}) + "\n")
    with pytest.raises(ValueError, match="prompt"):
        lb.read_jsonl(f)
    f.write_text(json.dumps({"context": "c", "input": "i", "answers": ["x"]}) + "\n")
    with pytest.raises(ValueError, match="unknown LongBench task"):
        lb.read_jsonl(f, task="nonsense")
    with pytest.raises(ValueError):
        lb.split_prompt("hotpotqa", "no marker here")


def test_truncate_middle_keeps_head_and_tail(mini: dict[str, list[Sample]], tokenizer: Any) -> None:
    prompt = mini["gov_report"][0].prompt
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    budget = 1001
    assert len(ids) > 3 * budget
    out = lb.truncate_middle(prompt, tokenizer, budget)
    half = budget // 2
    head = tokenizer.decode(ids[:half], clean_up_tokenization_spaces=False)
    tail = tokenizer.decode(ids[-half:], clean_up_tokenization_spaces=False)
    assert out == head + tail
    assert prompt.startswith(head) and prompt.endswith(tail)
    assert len(head) > 500 and len(tail) > 500
    got = len(tokenizer(out, add_special_tokens=False)["input_ids"])
    assert abs(got - 2 * half) <= 3  # re-tokenising across the seam may merge a token or two
    assert lb.truncate_middle("short text", tokenizer, budget) == "short text"


@pytest.mark.parametrize("task", MINI_TASKS)
def test_prepare_truncates_and_keeps_question(task: str, mini: dict[str, list[Sample]], tokenizer: Any) -> None:
    budget = 1500
    for s in mini[task][:3]:
        n_raw = len(tokenizer(s.prompt, add_special_tokens=False)["input_ids"])
        plain = lb.prepare(s, tokenizer, max_tokens=budget, chat=False)
        assert plain.meta["truncated"] == (n_raw > budget)
        assert plain.question == s.question  # the question survives truncation whole
        assert plain.prompt == plain.context + plain.question
        if n_raw > budget:
            assert abs(len(tokenizer(plain.prompt, add_special_tokens=False)["input_ids"]) - budget) <= 3
            assert s.prompt.startswith(plain.context[:200]) and s.prompt.endswith(plain.prompt[-200:])
        else:
            assert plain.prompt == s.prompt
        chat = lb.prepare(s, tokenizer, max_tokens=budget, chat=True)
        assert chat.meta["chat"] == (task not in lb.NO_CHAT_TASKS)
        if chat.meta["chat"]:
            assert chat.context.startswith("<|im_start|>") and chat.question.endswith("<|im_start|>assistant\n")
            assert chat.question.startswith(s.question)
            if plain.meta["truncated"]:
                assert budget < chat.num_tokens <= budget + 64  # the template adds a few dozen tokens
        else:
            assert chat.prompt == plain.prompt
        recount = tokenizer(chat.prompt, add_special_tokens=not chat.meta["chat"])["input_ids"]
        assert chat.num_tokens == len(recount)


def test_evaluate_with_gold_predictions(mini: dict[str, list[Sample]]) -> None:
    samples = [s for task in MINI_TASKS for s in mini[task]]
    scores = lb.evaluate(samples, [s.answers[0] for s in samples])
    assert set(scores) == set(MINI_TASKS)
    assert all(v == 100.0 for v in scores.values()), scores
    wrong = lb.evaluate(mini["passage_count"], ["I count 0 and 99999"] * len(mini["passage_count"]))
    assert wrong == {"passage_count": 0.0}
    # samsum keeps only the first line of a prediction, as LongBench does.
    s = mini["samsum"][0]
    assert lb.evaluate([s], ["\n" + s.answers[0] + "\nextra words here"]) == {"samsum": 100.0}
    with pytest.raises(ValueError):
        lb.evaluate(samples, [])
