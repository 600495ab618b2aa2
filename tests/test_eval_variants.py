"""RULER needle-type variants (``TASK@words``, ``TASK@uuids:numbers``), the shared-context split
(``TASK@split``) and the suites that run them, on SmolLM2's tokenizer."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from sparsekv_jax.eval import ruler
from sparsekv_jax.eval.data import ruler_data_file
from sparsekv_jax.eval.ruler import NEEDLE, NEEDLE_TYPES, generate_samples, ruler_config
from sparsekv_jax.eval.suites import ruler_suite_tasks

UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-4[0-9a-f]{3}-[89ab][0-9a-f]{3}-[0-9a-f]{12}$")
NUMBER = re.compile(r"^\d{7}$")
WORDS = re.compile(r"^[a-z]+-[a-z]+$")
# (task, length): the needle-only haystack (niah_multikey_2) needs 2k to fit its distractor needles
CASES = [("niah_single_1", 1024), ("niah_single_2", 1024), ("niah_multivalue", 1024), ("niah_multikey_2", 2048)]


@pytest.fixture(scope="module")
def tokenizer(smol) -> Any:
    return smol[2]


@pytest.fixture(scope="module")
def essay_text() -> str:
    """RULER's essays as raw text: where word values must come from (checked apart from the generator)."""
    return json.loads(ruler_data_file("PaulGrahamEssays.json").read_text())["text"]


@pytest.fixture(scope="module")
def variants(tokenizer: Any) -> dict[tuple[str, str], list[Any]]:
    return {(task, t): generate_samples(f"{task}@{t}", length, 2, 5, tokenizer)
            for task, length in CASES for t in NEEDLE_TYPES}


def _check_value(value: str, kind: str, essay_text: str) -> None:
    if kind == "numbers":
        assert NUMBER.match(value), value
    elif kind == "uuids":
        assert UUID.match(value), value
    else:
        assert WORDS.match(value), value
        for w in value.split("-"):  # real words: each occurs in the essays as a whole word
            assert re.search(rf"(?<![A-Za-z]){w}(?![A-Za-z])", essay_text), w


def _haystack_without_needles(s: Any) -> list[str]:
    start, end = s.meta["haystack_span"]
    text, at = [], start
    for a, b in s.meta["needle_spans"]:
        text.append(s.prompt[at:a])
        at = b
    text.append(s.prompt[at:end])
    return " ".join(text).split()


@pytest.mark.filterwarnings("ignore:niah_multikey_2@uuids")  # UUID distractors are coarse units at 2k
@pytest.mark.parametrize("task,length", CASES)
def test_value_types_answers_and_haystack(task: str, length: int, variants: dict, essay_text: str) -> None:
    base = ruler.RULER_CONFIGS[task]
    for t in NEEDLE_TYPES:
        for s in variants[(task, t)]:
            assert s.task == f"{task}@{t}" and s.meta["type_needle_v"] == t
            assert 0.95 * length <= s.num_tokens <= length
            assert len(s.answers) == base.num_needle_v * base.num_needle_q
            for key in s.meta["queries"]:
                for value in s.meta["values"][key]:
                    _check_value(value, t, essay_text)
                    # the answer sits in the context, in its needle, once
                    needle = NEEDLE.format(type_needle_v=t, key=key, value=value)
                    assert s.context.count(needle) == 1 and s.question.count(value) == 0
                    assert value in s.answers
            label = t[:-1] if len(s.answers) == 1 else t
            assert f"special magic {label} for" in s.question
            assert s.score(" ".join(s.answers)) == 1.0 and s.score("") == 0.0
            if base.type_haystack == "needle":  # the distractor needles carry values of the same type
                found = re.findall(rf"special magic {t} for \S+ is: (\S+)\.", s.context)
                assert len(found) > 10
                for v in found:
                    _check_value(v, t, essay_text)
    # keys and query are the task's whatever the value type; the haystack is the same text, only
    # as long as the prompt length allows (one a prefix of the other)
    for i in range(2):
        row = [variants[(task, t)][i] for t in NEEDLE_TYPES]
        assert len({json.dumps(s.meta["keys"]) for s in row}) == 1
        assert len({s.meta["query"] for s in row}) == 1
        if base.type_haystack != "needle":
            hays = sorted((_haystack_without_needles(s) for s in row), key=len)
            for shorter in hays[:-1]:
                assert hays[-1][: len(shorter)] == shorter
        assert len({tuple(s.answers) for s in row}) == 3  # ... and the values differ


def test_the_tasks_own_type_is_the_task(tokenizer: Any) -> None:
    for task, t in (("niah_single_2", "numbers"), ("niah_single_3", "uuids"), ("niah_multikey_3", "uuids:uuids")):
        length = 6144 if task == "niah_multikey_3" else 1024
        a = generate_samples(task, length, 2, 1, tokenizer)
        b = generate_samples(f"{task}@{t}", length, 2, 1, tokenizer)
        assert [x.prompt for x in a] == [y.prompt for y in b]
        assert [x.answers for x in a] == [y.answers for y in b]


def test_variants_are_deterministic_per_seed(tokenizer: Any) -> None:
    a = generate_samples("niah_single_2@words", 1024, 2, 7, tokenizer)
    b = generate_samples("niah_single_2@words", 1024, 2, 7, tokenizer)
    c = generate_samples("niah_single_2@words", 1024, 2, 8, tokenizer)
    assert [s.prompt for s in a] == [s.prompt for s in b] and [s.answers for s in a] == [s.answers for s in b]
    assert all(x.prompt != y.prompt and x.answers != y.answers for x, y in zip(a, c, strict=True))


def test_key_type_variant(tokenizer: Any, essay_text: str) -> None:
    (s,) = generate_samples("niah_multikey_2@uuids:words", 2048, 1, 0, tokenizer)
    assert s.meta["type_needle_k"] == "uuids" and s.meta["type_needle_v"] == "words"
    assert UUID.match(s.meta["query"])
    keys = re.findall(r"special magic words for (\S+) is: ", s.context)
    assert len(keys) > 10 and all(UUID.match(k) for k in keys) and len(set(keys)) == len(keys)
    _check_value(s.answers[0], "words", essay_text)


def test_bad_variant_names() -> None:
    with pytest.raises(ValueError, match="'letters'"):
        ruler_config("niah_single_2@letters")
    with pytest.raises(ValueError, match="needle tasks"):
        ruler_config("vt@words")
    with pytest.raises(ValueError, match="several keys"):
        ruler_config("niah_single_1@split")
    with pytest.raises(ValueError, match="twice"):
        ruler_config("niah_single_1@words+uuids")
    with pytest.raises(ValueError, match="unknown RULER task 'nosuch'"):
        ruler_config("nosuch@words")
    with pytest.raises(ValueError, match="nothing after"):
        ruler_config("niah_single_1@")
    assert ruler_config("niah_multiquery@uuids+split").split_questions
    assert ruler.ruler_task("niah_single_2@words").max_new_tokens == ruler.RULER_TASKS["niah_single_2"].max_new_tokens


def test_suites_expand_to_variants() -> None:
    niah = [n for n, c in ruler.RULER_CONFIGS.items() if c.kind == "niah"]
    assert len(niah) == 8
    assert ruler_suite_tasks("ruler-variants", None) == [f"{n}@{t}" for n in niah for t in NEEDLE_TYPES]
    assert ruler_suite_tasks("ruler-variants", ["niah_single_2", "niah_multikey_2@uuids:words"]) == [
        "niah_single_2@numbers", "niah_single_2@words", "niah_single_2@uuids", "niah_multikey_2@uuids:words"]
    assert ruler_suite_tasks("ruler", None) == list(ruler.RULER_TASKS)  # RULER's mix stays the default
    assert ruler_suite_tasks("ruler-shared", None) == ["niah_multikey_1@split", "niah_multiquery@split"]
    assert ruler_suite_tasks("ruler-shared", ["niah_multiquery@words"]) == ["niah_multiquery@words+split"]
    with pytest.raises(ValueError, match="no value-type variants"):
        ruler_suite_tasks("ruler-variants", ["vt"])
    with pytest.raises(ValueError, match="several keys"):
        ruler_suite_tasks("ruler-shared", ["niah_single_1"])


@pytest.mark.parametrize("task", ["niah_multiquery@split", "niah_multikey_1@words+split"])
def test_split_questions_share_one_context(task: str, tokenizer: Any) -> None:
    target = 1024
    samples = generate_samples(task, target, 2, 3, tokenizer)
    assert [s.index for s in samples] == list(range(8)) and len({s.sample_id for s in samples}) == 8
    kind = ruler_config(task).type_needle_v
    for ctx in range(2):
        group = samples[4 * ctx: 4 * ctx + 4]
        assert len({s.context for s in group}) == 1  # one context, compressed once, four questions
        assert sorted(s.meta["query"] for s in group) == sorted(group[0].meta["keys"])
        assert max(s.num_tokens for s in group) <= target and min(s.num_tokens for s in group) >= 0.95 * target
        for s in group:
            assert s.meta["context_index"] == ctx and len(s.answers) == 1
            assert s.num_tokens == len(tokenizer(s.prompt, add_special_tokens=False)["input_ids"])
            # the question asks for this key alone, and its value is the one in the key's needle
            assert s.question.count(s.meta["query"]) == 2  # the question and the answer prefix
            assert s.context.count(NEEDLE.format(type_needle_v=kind, key=s.meta["query"], value=s.answers[0])) == 1
            assert f"special magic {kind[:-1]} for {s.meta['query']} mentioned" in s.question
            assert s.score(s.answers[0]) == 1.0
            for other in group:
                if other is not s:
                    assert s.score(other.answers[0]) == 0.0
