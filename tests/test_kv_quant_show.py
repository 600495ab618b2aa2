"""`scripts/kv_quant_show.py` (issue 39's GPU measurements): the pieces that run before any timing -- the
policy-spec split its isolated e2e search passes to each process, its argument checks, and the random
quantised cache it times decode on (built layer by layer in place)."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.cache import init_cache
from sparsekv_jax.models import config as mc
from sparsekv_jax.policies import parse_policies
from sparsekv_jax.policies.base import Setup

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "kv_quant_show.py"


@pytest.fixture(scope="module")
def show():
    spec = importlib.util.spec_from_file_location("kv_quant_show", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_split_specs_keeps_each_spec_as_written(show):
    specs = "fullkv, snapkv(0.25),chess('aggressive', calibration='qwen2.5-coder-1.5b'), adakv(snapkv(0.1, window=8))"
    parts = show.split_specs(specs)
    assert parts == ["fullkv", "snapkv(0.25)", "chess('aggressive', calibration='qwen2.5-coder-1.5b')",
                     "adakv(snapkv(0.1, window=8))"]
    assert [repr(p) for p in parse_policies(", ".join(parts))] == [repr(p) for p in parse_policies(specs)]


def test_e2e_refuses_an_unknown_cache_dtype_by_name(show, capsys):
    with pytest.raises(SystemExit) as exit_:
        show.main(["e2e", "--kv-dtypes", "int8,int4", "--in-process"])
    assert exit_.value.code == 2
    assert "'int8,int4'" in capsys.readouterr().err


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8"])
def test_random_decode_cache_holds_the_context_as_the_policy_leaves_it(show, kv_dtype):
    cfg = dataclasses.replace(mc.smollm2_135m_config(), num_layers=2)
    context, steps, batch, ps = 256, 4, 2, 16
    for policy in parse_policies("fullkv, snapkv(0.25)"):
        pol = policy.bind(Setup(cfg, prompt_len=context, max_new_tokens=steps))
        cache, scores = show.quant_decode_cache(cfg, pol, context, batch, steps, jax.random.key(3), kv_dtype,
                                                page_size=ps)
        cap = pol.compressed_capacity(context, steps)
        kept = context if cap is None else cap - steps
        like = init_cache(cfg, batch, context + steps if cap is None else cap, page_size=ps, dtype=jnp.bfloat16,
                          summaries=pol.page_summaries, kv_dtype=None if kv_dtype == "bfloat16" else kv_dtype)
        assert jax.tree.map(lambda a: (a.shape, a.dtype), cache) == jax.tree.map(lambda a: (a.shape, a.dtype), like)
        np.testing.assert_array_equal(np.asarray(cache.length), kept)
        np.testing.assert_array_equal(np.asarray(cache.next_position), context)
        pos = np.asarray(cache.layers.positions)
        assert (pos[..., :kept] >= 0).all() and (pos[..., kept:] == -1).all()
        k = np.asarray(cache.layers.k.astype(jnp.float32))
        assert np.isfinite(k).all() and (k.std(axis=(1, 2, 3, 4)) > 0).all()  # every layer filled, none left 0
        assert not np.array_equal(k[0], k[1])  # each layer its own draw
        if kv_dtype == "int8":
            scales = np.asarray(cache.layers.k_scale, np.float32)
            np.testing.assert_array_equal(np.exp2(np.round(np.log2(scales))), scales)  # powers of two
        assert scores.shape == (cfg.num_layers, batch, cfg.num_kv_heads, context)
