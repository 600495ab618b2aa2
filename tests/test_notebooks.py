"""The notebooks: each executes at tiny sizes on a CPU without a cell raising, writes its plots, and
its ``.ipynb`` matches its jupytext ``.py`` source (outputs stripped)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import jupytext  # noqa: E402  (test extra)
import nbclient  # noqa: E402
import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.py"))
PLOTS = {  # what each notebook must write
    "quickstart": ["quickstart_stats.png"],
    "policy_explorer": ["explorer_kept.png", "explorer_reads.png", "explorer_mass.png"],
    "budget_frontier": ["frontier.png", "frontier_tasks.png"],
    "kernels": ["kernels_decode.png", "kernels_prefill.png"],
    "sae_features": ["sae_density.png", "s3_spans.png"],
}


def test_every_notebook_is_listed():
    assert sorted(p.stem for p in NOTEBOOKS) == sorted(PLOTS)


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_ipynb_matches_py_source(source):
    """The paired ``.ipynb`` has the ``.py``'s cells (``jupytext --sync notebooks/*.py`` after an edit)
    and no outputs."""
    paired = source.with_suffix(".ipynb")
    assert paired.is_file(), f"{paired.name} missing: jupytext --sync {source}"
    py, nb = jupytext.read(source), jupytext.read(paired)
    assert [(c.cell_type, c.source) for c in nb.cells] == [(c.cell_type, c.source) for c in py.cells], \
        f"{paired.name} differs from {source.name}: jupytext --sync {source}"
    assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")


@pytest.mark.parametrize("source", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes_tiny(source, tmp_path, monkeypatch):
    """Every cell runs (SPARSEKV_NOTEBOOK_TINY=1: tiny sizes, CPU) and the plots are written."""
    monkeypatch.setenv("SPARSEKV_NOTEBOOK_TINY", "1")
    monkeypatch.setenv("SPARSEKV_NOTEBOOK_OUT", str(tmp_path))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(source.parents[1]),
                                                                    os.environ.get("PYTHONPATH")])))
    nb = jupytext.read(source)
    t0 = time.perf_counter()
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(source.parent)}}).execute()
    print(f"{source.stem}: {time.perf_counter() - t0:.0f} s")
    missing = [p for p in PLOTS[source.stem] if not (tmp_path / p).is_file()]
    assert not missing, f"{source.stem} did not write {missing}"
