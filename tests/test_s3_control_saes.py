"""experiments/s3_control_saes.py: the control SAE set of issue 37 (random directions, the trained set's shapes).

The control of the shipped SmolLM2 set keeps its layers, shapes, k, dtype and b_dec; its decoder rows are unit
vectors whose cosines to the trained rows follow the law of an isotropic draw (bounds below, from that law); S3Pure
runs with a control on the tiny model of tests/test_s3.py, and the control's features on that model's keys match a
data-aligned "trained" set's no more than chance. The control seeds are drawn from the run's seed (``--seed N``).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng
from scipy.special import betainc
from test_s3 import CFG, LAYERS, WordTokenizer, _tokens

from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import S3Pure
from sparsekv_jax.retrieval.features import stacked_token_features
from sparsekv_jax.sae.export import SHIPPED_DIR, load_saes, save_saes, stack_saes
from sparsekv_jax.sae.keys import projections
from sparsekv_jax.sae.model import TopKSAE

SCRIPT = Path(__file__).resolve().parents[1] / "experiments" / "s3_control_saes.py"
SHIPPED = SHIPPED_DIR / "smollm2.safetensors"


def _script():
    spec = importlib.util.spec_from_file_location("experiments_s3_control_saes", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _seed(rng: np.random.Generator) -> int:
    seed = int(rng.integers(1 << 31))
    print(f"control seed {seed}")
    return seed


def _stack(path: Path) -> tuple[tuple[int, ...], TopKSAE, dict]:
    saes, record = load_saes(path)
    return (*stack_saes(saes), record)


def test_control_of_the_shipped_set_keeps_its_shapes_and_centring_and_draws_new_unit_directions(tmp_path):
    """Cosine of an isotropic unit vector in R^d with any fixed unit vector: c² ~ Beta(1/2, (d-1)/2), so
    E c² = 1/d and Var c² = 2(d-1) / (d²(d+2)). Over the N = 4 x 8,192 rows, mean c² must lie within 6
    standard errors of 1/d (a trained row copied gives 1, half a trained row mixed in about 1/4); no |c| may
    exceed 0.75: P(|c| > t) = I_{1-t²}((d-1)/2, 1/2), times N rows (union bound) is < 1e-6 at d = 64."""
    mod = _script()
    seed = _seed(seeded_rng())
    out = tmp_path / "control.safetensors"
    path, record_path, _ = mod.write_control(SHIPPED, out, seed)
    assert path == out and record_path == out.with_suffix(".json")
    layers, src, src_rec = _stack(SHIPPED)
    c_layers, ctl, rec = _stack(out)
    assert c_layers == layers == (0, 11, 15, 27) and ctl.k == src.k == 64
    for name in ("w_enc", "b_enc", "w_dec", "b_dec"):
        assert getattr(ctl, name).shape == getattr(src, name).shape, name
    from safetensors import safe_open

    with safe_open(str(out), framework="numpy") as f:
        assert {f.get_tensor(n).dtype for n in f.keys()} == {np.dtype(np.float16)}  # the source's storage
    assert rec["dtype"] == src_rec["dtype"] == "float16" and rec["model"] == src_rec["model"]
    assert rec["control"]["seed"] == seed and rec["control"]["source_sha256"] == mod.sha256(SHIPPED)
    assert "heldout" not in rec  # the trained set's evaluation does not describe the control

    w_dec, w_enc = np.asarray(ctl.w_dec), np.asarray(ctl.w_enc)
    np.testing.assert_array_equal(np.asarray(ctl.b_dec), np.asarray(src.b_dec))  # same centring
    np.testing.assert_array_equal(np.asarray(ctl.b_enc), 0.0)
    np.testing.assert_allclose(np.linalg.norm(w_dec, axis=-1), 1.0, atol=2e-3)  # fp16 storage rounding
    scale = np.median(np.linalg.norm(np.asarray(src.w_enc), axis=-2), axis=-1)  # per layer
    np.testing.assert_allclose(w_enc, np.swapaxes(w_dec, -1, -2) * scale[:, None, None], rtol=2e-3, atol=1e-5)

    d = src.d_in
    unit = lambda a: a / np.linalg.norm(a, axis=-1, keepdims=True)  # noqa: E731
    for ours, theirs in ((w_dec, np.asarray(src.w_dec)), (np.swapaxes(w_enc, -1, -2), np.asarray(src.w_enc).swapaxes(
            -1, -2))):
        cos = np.sum(unit(ours) * unit(theirs), axis=-1).ravel()
        n = cos.size
        se = math.sqrt(2 * (d - 1) / (d * d * (d + 2)) / n)
        assert abs(np.mean(cos**2) - 1 / d) < 6 * se, (np.mean(cos**2), 1 / d, se)
        assert n * betainc((d - 1) / 2, 0.5, 1 - 0.75**2) < 1e-6
        assert np.abs(cos).max() < 0.75
    # --dead-like-source: the record's held-out dead count of latents per layer never fires (zero encoder column)
    path, _, dead_rec = mod.write_control(SHIPPED, tmp_path / "dead.safetensors", seed, dead_like_source=True)
    want = [round(h["dead_fraction"] * src.width) for h in sorted(src_rec["heldout"], key=lambda h: h["layer"])]
    assert dead_rec["control"]["dead_latents"] == want and min(want) > 0
    dead_enc = np.asarray(_stack(path)[1].w_enc)
    zero = (dead_enc == 0).all(-2)  # [L, W]
    assert zero.sum(-1).tolist() == want
    np.testing.assert_array_equal(dead_enc[~np.broadcast_to(zero[:, None], dead_enc.shape)],
                                  w_enc[~np.broadcast_to(zero[:, None], w_enc.shape)])  # the live ones: the same draw
    # the same seed writes the same bytes (whatever the output directory); another seed other directions
    again = tmp_path / "again" / "control.safetensors"
    mod.write_control(SHIPPED, again, seed)
    assert mod.sha256(again) == mod.sha256(out)
    mod.write_control(SHIPPED, tmp_path / "other.safetensors", seed + 1)
    other = np.asarray(_stack(tmp_path / "other.safetensors")[1].w_dec)
    assert abs(np.mean(np.sum(other * w_dec, -1) ** 2) - 1 / d) < 6 * se


@pytest.fixture(scope="module")
def tiny():
    """The tiny model of tests/test_s3.py and a "trained" set for it written to disk: decoder rows are the
    model's own centred keys (a dictionary aligned with the data, as a trained one is), b_dec their mean."""
    rng = seeded_rng()
    seed = int(rng.integers(1 << 30))
    params = random_params(CFG, jax.random.key(seed), jnp.float32, 0.3)
    keys = np.asarray(projections(params, jnp.asarray(_tokens(rng, T=200)), LAYERS)[0])  # [n, B, T, Hkv, D]
    keys = keys.reshape(len(LAYERS), -1, CFG.head_dim)
    width, k = 256, 4
    b_dec = keys.mean(1)
    picks = np.stack([rng.choice(keys.shape[1], width, replace=False) for _ in LAYERS])
    rows = np.take_along_axis(keys, picks[..., None], 1) - b_dec[:, None]
    w_dec = rows / np.linalg.norm(rows, axis=-1, keepdims=True)
    src = TopKSAE(w_enc=jnp.asarray(np.swapaxes(w_dec, 1, 2) * 0.5), b_enc=jnp.asarray(rng.normal(0, 0.05, (2, width))),
                  w_dec=jnp.asarray(w_dec), b_dec=jnp.asarray(b_dec), k=k)
    return params, src


def test_s3pure_runs_with_a_control_on_the_tiny_model_and_its_features_match_the_trained_ones_by_chance(tiny, tmp_path):
    """The control's top-k ids are exchangeable over latents (rows drawn i.i.d.), so for any key a trained
    latent is among the control's k with probability exactly k/W. The share of a key's k trained ids also in the
    control's, averaged over keys, lies in [0, 1] with variance at most k/W / k per seed (tokens may be as alike
    as they like); over 100 seeds Bernstein's inequality puts it above k/W + 0.1 with probability < 1e-5. Every
    key gets k positive activations (b_enc = 0: about half the pre-activations are positive)."""
    params, src = tiny
    mod = _script()
    source = tmp_path / "trained.safetensors"
    save_saes(source, src, {"model": "tiny", "layers": list(LAYERS),
                            "heldout": [{"layer": i, "dead_fraction": 0.5} for i in LAYERS]})
    rng = seeded_rng()
    tok = _tokens(rng, T=170)
    lengths, qs = np.array([170, 150]), np.array([140, 131])
    keys = projections(params, jnp.asarray(tok), LAYERS)[0]  # [n, B, T, Hkv, D]
    features = jax.jit(lambda s, x: stacked_token_features(s, x, s.k))
    src_ids = np.asarray(features(src, keys)[0])  # [n, B, T, k]
    seeds = [int(s) for s in rng.integers(1 << 31, size=100)]
    print(f"control seeds {seeds}")
    mod.write_control(source, tmp_path / "control.safetensors", seeds[0])  # S3Pure reads this one below
    _, dead, _ = _stack(mod.write_control(source, tmp_path / "dead.safetensors", seeds[0], dead_like_source=True)[0])
    ids, acts = map(np.asarray, features(dead, keys))
    live = (np.asarray(dead.w_enc) != 0).any(-2)  # [n, W]: half of them (the record below says 0.5 dead)
    assert live.sum(-1).tolist() == [src.width // 2] * len(LAYERS) and (acts > 0).all()
    assert all(live[i][ids[i]].all() for i in range(len(LAYERS)))  # only live latents fire
    trained = load_saes(source)[0]
    shares = []
    for seed in seeds:
        ctl = mod.control_saes(trained, seed)[1]
        ids, acts = map(np.asarray, features(ctl, keys))
        assert (acts > 0).all()  # every key's k features are active (their activations summed over heads)
        hits = (ids[..., :, None] == src_ids[..., None, :]).any(-1)  # [n, B, T, k]: a control id among the trained
        shares.append(hits.mean())
    chance = src.k / src.width
    var, eps, n = chance / src.k, 0.1, len(shares)
    assert math.exp(-n * eps**2 / (2 * var + 2 * eps / 3)) < 1e-5
    print(f"mean share {np.mean(shares):.4f}, chance {chance:.4f}")
    assert np.mean(shares) < chance + eps, (np.mean(shares), chance)
    # the trained set itself shares all: the measure sees a copy
    ids = np.asarray(features(_stack(source)[1], keys)[0])
    np.testing.assert_array_equal(np.sort(ids, -1), np.sort(src_ids, -1))

    pol = S3Pure(saes=str(tmp_path / "control.safetensors"), budget=40, lead=6, tail=3, chunk=32, kernel=4)
    res = pol.with_tokenizer(WordTokenizer()).context(params, tok, lengths, qs)
    for b in range(2):
        n_ctx = int(res.question_start[b])
        assert n_ctx == 40 == res.info["kept_tokens"][b]
        new = res.tokens[b, : res.lengths[b]]
        np.testing.assert_array_equal(new[n_ctx:], tok[b, qs[b]: lengths[b]])  # the question, whole
        it = iter(tok[b, : qs[b]].tolist())  # the kept context: a subsequence in the original order
        assert all(any(x == y for y in it) for x in new[:n_ctx].tolist())


def test_cli_prints_the_sha256_and_refuses_bad_input(tmp_path, capsys):
    mod = _script()
    with pytest.raises(SystemExit) as e:
        mod.main(["--help"])
    assert e.value.code == 0 and "usage:" in capsys.readouterr().out
    out = tmp_path / "c.safetensors"
    assert mod.main(["shipped:smollm2", str(out), "--seed", "3"]) == 0
    printed = capsys.readouterr().out
    assert f"sha256 {mod.sha256(out)}  {out}" in printed and mod.sha256(SHIPPED) in printed
    garbage = tmp_path / "g.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    nodead = tmp_path / "nodead.safetensors"
    save_saes(nodead, _stack(SHIPPED)[1], {"layers": [0, 11, 15, 27]})  # a record without a held-out evaluation
    for argv, says in [([str(tmp_path / "none.safetensors"), str(out)], "no SAE file at"),
                       (["shipped:nosuch", str(out)], "nosuch.safetensors"),
                       ([str(tmp_path), str(out)], "is not a .safetensors file"),
                       (["shipped:smollm2", str(out), "--seed", "-1"], "--seed -1 must be in"),
                       (["shipped:smollm2", str(out), "--seed", str(2**32)], "must be in"),
                       (["shipped:smollm2", str(tmp_path / "c.bin")], "must end in .safetensors"),
                       ([str(out), str(out)], "is the source file"),
                       ([str(garbage), str(out)], str(garbage)),
                       ([str(nodead), str(out), "--dead-like-source"], "held-out dead fractions for layers []")]:
        with pytest.raises(SystemExit) as e:
            mod.main(argv)
        assert e.value.code == 2 and says in capsys.readouterr().err, argv
