"""Bad evaluation data is reported by file, line and missing field (issue 42, item 9), and a
results.jsonl cut short is set aside before a run appends to it (issue 42, item 4)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from sparsekv_jax.eval import longbench, runner
from sparsekv_jax.eval.suites import build_groups, load_ruler_dir, record_format

RULER_REC = {"index": 0, "input": "ctx\nWhat are all the special magic numbers for x mentioned?", "outputs": ["1"]}
LB_REC = {"context": "a long document", "input": "what?", "answers": ["yes"]}


def _write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(line + "\n" for line in lines))
    return path


def _groups(suite: Path):
    return build_groups(str(suite), None, None, 5, 0, None, 2048, None, None)


def test_invalid_json_names_file_and_line(tmp_path: Path) -> None:
    # line 1 fine, line 2 blank (counted), line 3 broken
    f = _write(tmp_path / "lb" / "hotpotqa.jsonl", [json.dumps(LB_REC), "", '{"context": "x", "input": ', "{}"])
    with pytest.raises(ValueError, match=rf"^{f} line 3: invalid JSON \(.* column \d+\)$"):
        longbench.load_longbench(f)
    with pytest.raises(ValueError, match=rf"^{f} line 3: invalid JSON"):
        _groups(tmp_path / "lb")
    g = tmp_path / "gz" / "hotpotqa.jsonl.gz"
    g.parent.mkdir()
    with gzip.open(g, "wt") as h:
        h.write(json.dumps(LB_REC) + "\n[1, 2]\n")
    with pytest.raises(ValueError, match=rf"^{g} line 2: a record must be a JSON object, not list$"):
        longbench.load_longbench(g)


def test_ruler_record_without_outputs_is_named_as_ruler(tmp_path: Path) -> None:
    bad = {k: v for k, v in RULER_REC.items() if k != "outputs"}
    # first record: the format is told by its fields, not taken for LongBench
    f = _write(tmp_path / "r1" / "niah_single_1" / "validation.jsonl", [json.dumps(bad)])
    with pytest.raises(ValueError, match=rf"^{f} line 1: RULER record without 'outputs' \(a RULER record needs "):
        _groups(tmp_path / "r1")
    # a later record, after a blank line: its own line number
    f = _write(tmp_path / "r2" / "niah_single_1" / "validation.jsonl",
               [json.dumps(RULER_REC), "", json.dumps({**bad, "index": 1})])
    with pytest.raises(ValueError, match=rf"^{f} line 3: RULER record without 'outputs'"):
        _groups(tmp_path / "r2")
    with pytest.raises(ValueError, match=rf"^{f} line 3: RULER record without 'outputs'"):
        load_ruler_dir(tmp_path / "r2")
    f = _write(tmp_path / "r3" / "qa_1.jsonl", [json.dumps(RULER_REC), json.dumps({"outputs": ["1"]})])
    with pytest.raises(ValueError, match=rf"^{f} line 2: RULER record without 'input'"):
        _groups(tmp_path / "r3")


def test_longbench_records_name_the_missing_field(tmp_path: Path) -> None:
    cases = [({"context": "d", "input": "q"}, "LongBench record without 'answers'"),
             ({"context": "d", "answers": ["a"]}, "LongBench record without 'input'"),
             ({"answers": ["a"]}, "LongBench record without 'prompt'; it needs 'prompt' or 'context' \\+ 'input'")]
    for i, (rec, msg) in enumerate(cases):
        f = _write(tmp_path / f"lb{i}" / "hotpotqa.jsonl", [json.dumps(LB_REC), json.dumps(rec)])
        with pytest.raises(ValueError, match=rf"^{f} line 2: {msg}"):
            _groups(tmp_path / f"lb{i}")
    # a RULER record among LongBench records
    f = _write(tmp_path / "mixed" / "hotpotqa.jsonl", [json.dumps(LB_REC), json.dumps(RULER_REC)])
    with pytest.raises(ValueError, match=rf"^{f} line 2: a RULER record"):
        _groups(tmp_path / "mixed")
    # an unknown task names the record too
    f = _write(tmp_path / "unk" / "nosuch.jsonl", [json.dumps(LB_REC)])
    with pytest.raises(ValueError, match=rf"^{f} line 1: unknown LongBench task 'nosuch'"):
        _groups(tmp_path / "unk")


def test_record_format() -> None:
    assert record_format(RULER_REC, "f", 1) == "ruler"
    assert record_format(LB_REC, "f", 1) == "longbench"
    assert record_format({"prompt": "p\n\nQuestion: q", "answers": ["a"]}, "f", 1) == "longbench"
    with pytest.raises(ValueError, match="f line 4: LongBench record without 'answers' and 'prompt'"):
        record_format({"text": "x"}, "f", 4)


# --------------------------------------------------------------------- results.jsonl cut short


def test_repair_results_sets_aside_damaged_lines(tmp_path: Path) -> None:
    path = tmp_path / "results.jsonl"
    assert runner.repair_results(path) == []  # missing: nothing to do
    good = [json.dumps({"key": str(i), "score": 1.0}) for i in range(3)]
    path.write_text(good[0] + "\n" + good[1] + "\n")
    assert runner.repair_results(path) == [] and path.read_text() == good[0] + "\n" + good[1] + "\n"
    cut = good[2][: len(good[2]) // 2]
    path.write_text(good[0] + "\n" + '{"key": "x", "sc\n' + good[1] + "\n" + cut)
    assert runner.repair_results(path) == ['{"key": "x", "sc', cut]
    assert path.read_text() == good[0] + "\n" + good[1] + "\n"
    assert (tmp_path / "results.jsonl.damaged").read_text() == '{"key": "x", "sc\n' + cut + "\n"
    assert not (tmp_path / "results.jsonl.tmp").exists()
    path.write_text(good[0] + "\n" + good[1])  # the last line whole, its newline lost: kept, newline added
    assert runner.repair_results(path) == [] and path.read_text() == good[0] + "\n" + good[1] + "\n"
