"""The paper's SAE run configs (sae_training/configs/paper_*.yaml, issue 37) and their command.

Each config must state the paper's run for its model: width 128 x head_dim, k = head_dim, Adam at
1e-3, AuxK on, 30k steps of 4,096-token batches (x the model's KV heads), checkpoints, the training
corpus, rows of >= 4k tokens, target layers inside the model (Gemma 3: its global layers only). The
model shapes are written here from the models' published configs, not read through the code under
test. Each config then runs 3 steps on the CPU on a tiny slice (a small random model with the real
head_dim, KV heads and layer pattern; short rows; a small batch; the deepest target layer only, so the
whole forward runs) through `run`, with the config's own SAE width and k, and writes checkpoints,
curves and the exported SAEs; `run_paper.sh` refuses an
unknown model by name.
"""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import seeded_rng

from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.sae.config import RunConfig
from sparsekv_jax.sae.export import load_saes
from sparsekv_jax.sae.run import run

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "sae_training" / "configs"
# (layers, KV heads, head_dim, global layers or None) from each model's published config
SHAPES = {
    "smollm2": (30, 3, 64, None),  # SmolLM2-135M-Instruct
    "qwen2.5-coder-1.5b": (28, 2, 128, None),  # Qwen2.5-Coder-1.5B-Instruct
    "gemma3-270m": (18, 1, 256, (5, 11, 17)),  # Gemma 3 270M: sliding_window_pattern 6
}


class CharTokenizer:
    """Characters as token ids below 250; id 0 is 'special'."""

    all_special_ids = [0]

    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": [min(ord(c), 249) for c in text]}


def _tiny_model(model: str) -> ModelConfig:
    """A small config with the real model's layer count, KV heads, head_dim and layer pattern."""
    n_layers, kv, head_dim, global_layers = SHAPES[model]
    types = None
    if global_layers is not None:
        types = tuple("full_attention" if i in global_layers else "sliding_attention" for i in range(n_layers))
    return ModelConfig(family="gemma3" if types else "llama", vocab_size=250, hidden_size=32, num_layers=n_layers,
                       num_heads=2 * kv, num_kv_heads=kv, head_dim=head_dim, intermediate_size=32,
                       max_position_embeddings=512, sliding_window=16 if types else None, layer_types=types,
                       rope_local_theta=1e4 if types else None)


def test_there_is_one_paper_config_per_shipped_model():
    assert sorted(p.stem for p in CONFIGS.glob("paper_*.yaml")) == sorted(f"paper_{m}" for m in SHAPES)


@pytest.mark.parametrize("model", sorted(SHAPES))
def test_paper_config_states_the_papers_run(model):
    cfg = RunConfig.from_yaml(CONFIGS / f"paper_{model}.yaml")
    n_layers, kv, head_dim, global_layers = SHAPES[model]
    assert cfg.model == model and cfg.name == f"paper_{model}"
    assert cfg.width == 128 * head_dim and cfg.k == head_dim
    assert cfg.lr == 1e-3 and cfg.aux_coef > 0 and cfg.steps == 30_000
    assert cfg.batch_size == 4096 * kv  # 4,096 tokens, every KV head's key a vector
    assert cfg.corpus == RunConfig().corpus == "kjv"  # the training text (tests/test_sae_corpus.py)
    assert cfg.seq_len - cfg.drop_first >= 4096  # long-context positions
    assert cfg.checkpoint_every <= 1000 and cfg.keep_checkpoints >= 1
    vectors = cfg.rows_per_chunk * (cfg.seq_len - cfg.drop_first) * kv
    assert vectors >= cfg.batch_size and cfg.buffer_chunks * vectors >= 8 * cfg.batch_size
    assert all(0 <= i < n_layers for i in cfg.layers)
    if global_layers is not None:
        assert cfg.layers == global_layers


@pytest.mark.share(2)
@pytest.mark.parametrize("model", sorted(SHAPES))
def test_paper_config_runs_three_steps_on_a_tiny_slice(model, tmp_path):
    seed = int(seeded_rng().integers(1 << 30))
    mcfg = _tiny_model(model)
    params = random_params(mcfg, jax.random.key(seed), jnp.float32, 0.3)
    paper = RunConfig.from_yaml(CONFIGS / f"paper_{model}.yaml")
    layer = max(paper.layers)
    cfg = dataclasses.replace(paper, out=str(tmp_path / "run"), dtype="float32", attention="xla", layers=(layer,),
                              seq_len=36, rows_per_chunk=4, buffer_chunks=2, batch_size=64, init_vectors=128, steps=3,
                              warmup_steps=1, checkpoint_every=2, log_every=1, eval_max_rows=2, seed=seed)
    record = run(cfg, progress=False, params=params, tokenizer=CharTokenizer())
    assert record["steps"] == 3 and record["layers"] == [layer] and record["corpus"] == "kjv"
    assert [r["layer"] for r in record["heldout"]] == [layer]
    assert all(r["l0"] <= paper.k and 0 <= r["dead_fraction"] <= 1 for r in record["heldout"])
    out = Path(cfg.out)
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["2", "3"]
    assert (out / "curves.csv").read_text().count("\n") == 1 + 3
    saes, _ = load_saes(out / f"{paper.name}.safetensors")
    assert sorted(saes) == [layer]
    assert all((s.d_in, s.width, s.k) == (mcfg.head_dim, paper.width, paper.k) for s in saes.values())


def test_run_paper_script_refuses_an_unknown_model():
    res = subprocess.run(["bash", str(REPO / "sae_training" / "run_paper.sh"), "llama-70b"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2 and "paper_llama-70b.yaml" in res.stderr and "gemma3-270m" in res.stderr


def test_compare_script_scores_every_set_on_the_same_held_out_keys():
    """`sae_training/compare.py`'s `compare`: every set is scored on the same held-out rows; a layer's
    numbers do not depend on the set it is stacked in; key FVU and L0 equal a numpy TopK(ReLU) reference
    on the model's pre-RoPE keys (`projections`, tested against transformers)."""
    import importlib.util

    import numpy as np

    from sparsekv_jax.sae.data import load_corpus, sequential_rows, tokenize
    from sparsekv_jax.sae.keys import projections
    from sparsekv_jax.sae.model import init_sae

    spec = importlib.util.spec_from_file_location("compare", REPO / "sae_training" / "compare.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    seed = int(seeded_rng().integers(1 << 30))
    mcfg = ModelConfig(family="llama", vocab_size=250, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=32, max_position_embeddings=512)
    params = random_params(mcfg, jax.random.key(seed), jnp.float32, 0.3)
    stack = init_sae(jax.random.key(seed + 1), 16, 64, 4, stack=(2,))
    both = {0: stack.layer(0), 2: stack.layer(1)}
    rows = mod.compare(params, CharTokenizer(), {"both": both, "one": {2: stack.layer(1)}}, ["kjv"], seq_len=36,
                       max_rows=3)
    assert [(r["saes"], r["layer"], r["rows"]) for r in rows] == [("both", 0, 3), ("both", 2, 3), ("one", 2, 3)]
    for key, value in rows[2].items():  # layer 2 alone = layer 2 stacked with layer 0 (float rounding aside)
        if isinstance(value, float):
            assert rows[1][key] == pytest.approx(value, rel=1e-6), key
        elif key != "saes":
            assert rows[1][key] == value, key
    tokens = sequential_rows(tokenize(CharTokenizer(), load_corpus("kjv").heldout), 36)[:3]
    keys = np.asarray(projections(params, jnp.asarray(tokens), (2,))[0][0, :, 4:]).reshape(-1, 16)
    sae = jax.tree.map(np.asarray, stack.layer(1))
    pre = np.maximum((keys - sae.b_dec) @ sae.w_enc + sae.b_enc, 0)
    top = np.argsort(-pre, axis=1)[:, :4]
    z = np.zeros_like(pre)
    np.put_along_axis(z, top, np.take_along_axis(pre, top, 1), 1)
    fvu = np.sum((keys - (z @ sae.w_dec + sae.b_dec)) ** 2) / np.sum((keys - keys.mean(0)) ** 2)
    np.testing.assert_allclose(rows[2]["fvu"], fvu, rtol=1e-4)
    assert rows[2]["l0"] == np.mean(np.sum(z > 0, axis=1))
    assert rows[2]["dead_fraction"] == 1 - np.mean(np.isin(np.arange(64), top[z[np.arange(len(z))[:, None], top] > 0]))
