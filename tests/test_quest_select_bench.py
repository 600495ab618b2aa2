"""`experiments/quest_select_bench.py` (issue 40: Quest's selection alone, two top-k implementations): both top-k
implementations against a numpy reference, and a CPU run at toy size whose record has every variant."""

from __future__ import annotations

import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_script

from sparsekv_jax.policies import common

ROOT = Path(__file__).resolve().parents[1]


def _module():
    return load_script(ROOT / "experiments" / "quest_select_bench.py", "experiments_quest_select_bench")


def test_both_top_ks_match_a_stable_numpy_sort(rng):
    """Ties included (values drawn from a few levels): the k largest, the lower index first among equals."""
    mod = _module()
    x = rng.integers(0, 6, size=(3, 2, 40)).astype(np.float32)
    x[0, 0, 5:9] = -np.inf  # pages not in use
    k = int(rng.integers(1, 40))
    want = np.argsort(-x, axis=-1, kind="stable")[..., :k]
    for impl in (common.top_k, mod.lax_top_k):
        values, ids = impl(jnp.asarray(x), k)
        np.testing.assert_array_equal(np.asarray(ids), want, err_msg=f"{impl.__name__}, k={k}")
        np.testing.assert_array_equal(np.asarray(values), np.take_along_axis(x, want, -1))
    with mod.top_k_as(mod.lax_top_k):
        assert common.top_k is mod.lax_top_k
    assert common.top_k.__module__ == "sparsekv_jax.policies.common"  # restored


def test_both_page_bounds_match_a_float64_reference(rng):
    """Quest's elementwise bound and the bench's split-sign form (two matrix products) against numpy in float64:
    ``sum_d max(q_d * min_d, q_d * max_d)``, with zeros in q and pages whose min equals their max."""
    mod = _module()
    B, H, G, P, D = 2, 2, 3, 7, 16
    q = rng.normal(size=(B, H, G, D)).astype(np.float32)
    q[0, 0, 0, :4] = 0.0
    a, b = rng.normal(size=(2, B, H, P, D)).astype(np.float32)
    lo, hi = np.minimum(a, b), np.maximum(a, b)
    hi[1, 1, 3] = lo[1, 1, 3]  # a page of one key
    want = np.maximum(q[:, :, :, None].astype(np.float64) * lo[:, :, None], q[:, :, :, None] * hi[:, :, None]).sum(-1)
    for policy in (mod.Quest(0.25), mod.QuestSplitSign(0.25)):
        got = policy.page_bound(jnp.asarray(q), jnp.asarray(lo), jnp.asarray(hi))
        assert got.shape == (B, H, G, P) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5, err_msg=type(policy).__name__)


def test_a_toy_run_records_every_variant(tmp_path, capsys):
    mod = _module()
    assert mod.main(["--models", "qwen", "--batches", "2", "--length", "256", "--iters", "1", "--repeats", "1",
                     "--dtype", "float32", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "quest_select.json").read_text())["rows"]
    assert {r["variant"] for r in rows} == {"select[argsort]", "select[lax.top_k]", "top_k[argsort]",
                                            "top_k[lax.top_k]", "bounds", "select[split-sign]",
                                            "select[split-sign, lax.top_k]", "bounds[split-sign]"}
    assert all(r["model"] == "Qwen2.5-Coder-1.5B" and r["batch"] == 2 and r["us_per_step"] > 0 for r in rows)
    assert "| Qwen2.5-Coder-1.5B | 2 | select[lax.top_k] |" in capsys.readouterr().out
    for bad in (["--models", "gpt"], ["--length", "100"], ["--budget", "1.5"], ["--batches", "0"]):
        with pytest.raises(SystemExit) as exit_:  # refused by the parser, before anything runs
            mod.main(bad)
        assert exit_.value.code == 2
