"""`scripts/regenerate_reports.py`: one command regenerates every report the docs link to from the
committed records (issue 41, "docs a user reads"), and `--check` notices a report whose numbers the
records no longer give."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _module():
    spec = importlib.util.spec_from_file_location("regenerate_reports", ROOT / "scripts" / "regenerate_reports.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_linked_report_is_regenerated_and_its_records_exist():
    mod = _module()
    linked = set()
    for doc in (ROOT / "docs" / "RESULTS.md", ROOT / "README.md"):
        linked |= set(re.findall(r"results/([A-Za-z0-9_.\-]+)/report", doc.read_text()))
    assert linked, "the docs link no report: the pattern is stale"
    assert linked <= set(mod.REPORTS), linked - set(mod.REPORTS)
    for run, sources in mod.REPORTS.items():
        for source in sources:
            assert any((mod.RESULTS / source).rglob("results.jsonl*")), (run, source)


def test_check_reproduces_a_committed_report(capsys):
    mod = _module()
    assert mod.main(["--check", "--only", "ruler4k"]) == 0
    assert "ruler4k: same numbers" in capsys.readouterr().out


def test_check_fails_on_a_report_the_records_do_not_give(tmp_path, monkeypatch, capsys):
    mod = _module()
    root = tmp_path / "repo"
    results = root / "docs" / "results"
    for source in mod.REPORTS["ruler4k"]:
        shutil.copytree(mod.RESULTS / source, results / source)
    committed = results / "ruler4k" / "report" / "results.json"
    summaries = json.loads(committed.read_text())
    summaries[0]["rows"][0]["average"] += 1.0  # a hand-edited number
    committed.write_text(json.dumps(summaries))
    monkeypatch.setattr(mod, "ROOT", root)
    monkeypatch.setattr(mod, "RESULTS", results)
    assert mod.main(["--check", "--only", "ruler4k"]) == 1
    assert "ruler4k: DIFFERENT numbers" in capsys.readouterr().out
