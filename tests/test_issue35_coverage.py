"""`experiments/issue35_coverage.py`: issue 35's grid read from a run's report — which default rows are
complete, partial, borrowed or missing — and the committed `coverage.md` is what the committed report gives."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RUN = ROOT / "docs" / "results" / "qwen2.5-coder-1.5b_h200"


def _module():
    spec = importlib.util.spec_from_file_location("issue35_coverage", ROOT / "experiments" / "issue35_coverage.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("policy, expected", [
    ("snapkv(0.25)", ("snapkv", 0.25)),
    ("adakv(snapkv(0.1))", ("adakv", 0.1)),
    ("pyramidkv(snapkv(0.5))", ("pyramidkv", 0.5)),
    ("s3hybrid(0.25, saes='/tmp/qwen_sae_r4/paper_qwen2.5-coder-1.5b.safetensors')", ("s3hybrid", 0.25)),
    ("chess('moderate', calibration='qwen2.5-coder-1.5b')", ("chess", None)),
    ("stem", ("stem", None)),
    ("fullkv", ("fullkv", None)),
    ("bm25(0.1)", ("bm25", 0.1)),
    # ablations, quantised caches, other wrappers and budget-less specs of budgeted families are not defaults
    ("bser", None),
    ("snapkv", None),
    ("stem(routing='full')", None),
    ("quest(0.25) [kv=int8]", None),
    ("semanticache(0.25, protect='attended')", None),
    ("chess('moderate', calibration='qwen2.5-coder-1.5b', regenerate=False)", None),
    ("adakv(h2o(0.1))", None),
    ("snapkv(snapkv(0.1))", None),
])
def test_default_config(policy, expected):
    assert _module().default_config(policy) == expected


def test_grid_cells_from_a_report():
    cov = _module()
    complete = {"complete": True}
    partial = {"complete": False, "samples": 262, "of_samples": 325}
    report = [
        {"suite": "ruler", "length": 8192, "question": "aware", "rows": [
            {"policy": "fullkv", "kv_dtype": None, "reference_from": "agnostic", "coverage": complete},
            {"policy": "snapkv(0.1)", "kv_dtype": None, "coverage": complete},
            {"policy": "adakv(snapkv(0.5))", "kv_dtype": None, "coverage": partial},
            {"policy": "snapkv(0.5) [kv=int8]", "kv_dtype": "int8", "coverage": complete},
            {"policy": "bser(0.25, block_size=64)", "kv_dtype": None, "coverage": complete},
        ]},
        # two default rows of one family (two SAE files): the complete one wins whatever the order
        {"suite": "ruler", "length": 32768, "question": "agnostic", "rows": [
            {"policy": "s3hybrid(0.25, saes='/a.safetensors')", "kv_dtype": None, "coverage": complete},
            {"policy": "s3hybrid(0.25, saes='/b.safetensors')", "kv_dtype": None, "coverage": partial},
        ]},
    ]
    got = cov.grid(report)
    assert got[("ruler", 8192, "aware", 0.25)] == {"fullkv": "="}
    assert got[("ruler", 8192, "aware", 0.1)] == {"snapkv": "✓"}
    assert got[("ruler", 8192, "aware", 0.5)] == {"adakv": "262/325"}  # the int8 row is left out
    assert got[("ruler", 32768, "agnostic", 0.25)] == {"s3hybrid": "✓"}
    assert len(got) == 4  # the BSER ablation made no cell

    text = cov.markdown(report, "toy")
    rows = {line.split(" | ")[0].strip("| "): line for line in text.splitlines() if line.startswith("| ")}
    cells = rows["snapkv"].strip("| ").split(" | ")[1:]
    columns = [(*key, b) for key, budgets in cov.GRID for b in budgets]
    assert cells[columns.index(("ruler", 8192, "aware", 0.1))] == "✓"
    assert cells.count("·") == len(columns) - 1
    assert rows["fullkv"].count("–") == sum(b != 0.25 for _, budgets in cov.GRID for b in budgets)
    n_cells = len(columns) * len(cov.FAMILIES) - len(cov.BUDGETLESS) * sum(
        b != 0.25 for _, budgets in cov.GRID for b in budgets)
    # complete: fullkv (borrowed), snapkv at 10%, s3hybrid at 32k; adakv is partial
    assert text.rstrip().endswith(f"3 of {n_cells} cells complete (– : no such configuration).")


def test_committed_coverage_is_what_the_committed_report_gives(tmp_path):
    cov = _module()
    report = json.loads((RUN / "report" / "results.json").read_text())
    assert (RUN / "coverage.md").read_text() == cov.markdown(report, RUN.name)
