"""`sparsekv calibrate`: page statistics against a hand computation, entropy against its definition,
and an end-to-end run on SmolLM2 whose JSON CHESS loads."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.datasets import wikitext2_text
from sparsekv_jax.eval.calibrate import calibrate, calibration_text, page_statistics
from sparsekv_jax.policies import parse_policy
from sparsekv_jax.policies.common import entropy_stats


def test_entropy_matches_definition():
    rng = seeded_rng()
    logits = rng.standard_normal((3, 50)) * 3
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    want = -(p * np.log(p)).sum(1)
    np.testing.assert_allclose(np.asarray(entropy_stats(jnp.asarray(logits))), want, rtol=1e-5)
    uniform = np.asarray(entropy_stats(jnp.zeros((1, 64))))
    np.testing.assert_allclose(uniform, [np.log(64)], rtol=1e-6)


def test_calibrate_imports_no_policy_module():
    """The harness measures the statistics through `policies.common`; it knows no policy's file."""
    import sparsekv_jax.eval.calibrate as module

    tree = ast.parse(Path(module.__file__).read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert "sparsekv_jax.policies.common" in imported
    assert not {m for m in imported if m.startswith("sparsekv_jax.policies.")} - {"sparsekv_jax.policies.common"}


def test_page_statistics_by_hand():
    rng = seeded_rng()
    ent = rng.uniform(0, 5, (2, 20))
    means, variances = page_statistics(ent, np.array([20, 9]), page_size=4)
    # row 0: columns 1-4, 5-8, 9-12, 13-16 (17-19 incomplete); row 1: 1-4, 5-8 (valid columns 0..8)
    pages = [ent[0, 1:5], ent[0, 5:9], ent[0, 9:13], ent[0, 13:17], ent[1, 1:5], ent[1, 5:9]]
    np.testing.assert_allclose(means, [p.mean() for p in pages])
    np.testing.assert_allclose(variances, [p.var() for p in pages])
    none = page_statistics(ent, np.array([4, 0]), page_size=4)
    assert none[0].size == 0


def test_calibration_text_sources(tmp_path):
    text, name = calibration_text("wikitext")  # default: the WikiText-2 test split shipped with the package
    assert text == wikitext2_text() and name == "wiki.test.raw.gz"
    assert text.startswith(" = Robert Boulter = \n") and len(text) > 1_000_000
    f = tmp_path / "mine.txt"
    f.write_text("some text of mine")
    assert calibration_text("wikitext", f) == ("some text of mine", "mine.txt")
    assert calibration_text(str(f)) == ("some text of mine", "mine.txt")
    assert calibration_text("longbench") is None  # an eval suite: its prompts are used
    with pytest.raises(FileNotFoundError, match="nope.txt"):
        calibration_text("wikitext", tmp_path / "nope.txt")


@pytest.mark.usefixtures("optimized_xla")  # a real model: its programs compiled optimized
def test_calibrate_end_to_end_smollm2(smol, tmp_path, monkeypatch):
    """The default calibration text, from another directory with another HOME (nothing beside the package).

    40 new tokens: two complete pages of 16 a row (columns 1-32) unless a row stops early. A decode
    step of SmolLM2 costs ~0.5 CPU s under the suite's cheap XLA flags, and 72 tokens (four pages a
    row) checked nothing more."""
    _, params, tokenizer, _ = smol
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    out, plot = tmp_path / "cal.json", tmp_path / "cal.png"
    res = calibrate((params, tokenizer), length=200, n=2, max_new_tokens=40, batch_size=2,
                    page_size=16, out=out, plot=plot, progress=False)
    saved = json.loads(out.read_text())
    assert saved == res and res["pages"] >= 2 and res["samples"] == 2
    assert res["suite"] == "wikitext" and res["data"] == "wiki.test.raw.gz"
    assert res["mean_entropy"]["median"] <= res["entropy_threshold"] <= res["mean_entropy"]["max"]
    assert res["varentropy"]["median"] <= res["varentropy_threshold"] <= res["varentropy"]["max"]
    assert plot.stat().st_size > 1000
    pol = parse_policy(f"chess('moderate', calibration='{out}')")
    assert float(pol.entropy_threshold) == res["entropy_threshold"]
