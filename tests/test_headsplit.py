"""HeadSplit (issue #38, item 2: a head-type split in the spirit of DuoAttention) and its head
calibration (`sparsekv calibrate --heads`).

The kept entries of every (layer, row, head) are checked against a numpy reference of the rule in
`sparsekv_jax.policies.headsplit` (a loop per layer, row and head; no code of the policy): streaming
heads keep sinks + their most recent entries, retrieval heads the inner's best, the counts moved as
documented, clipped at the prompt. The calibration's attention shares are checked against the
attention probabilities of transformers' own model (eager attention) on a tiny random Llama.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from test_budget_allocation import (
    CFG,
    LENGTHS,
    Given,
    _compress,
    _forced,
    _kept,
    _uniform,
    tiny,  # noqa: F401  (the module fixture, shared)
)

from sparsekv_jax.generate import teacher_force
from sparsekv_jax.models.config import smollm2_135m_config
from sparsekv_jax.policies import HeadSplit, SnapKV, parse_policy
from sparsekv_jax.policies.base import Setup
from sparsekv_jax.policies.headsplit import CALIBRATION_DIR, retrieval_heads

L, H = CFG.num_layers, CFG.num_kv_heads


# -- numpy reference of the rule ----------------------------------------------------------------------
def split_reference(head_scores: np.ndarray, n: int, length: int, share: float, streaming: int) -> list[int]:
    """One (layer, row)'s counts per head: streaming heads min(n, sinks + window), retrieval heads an
    equal share of the rest (higher head scores first for the remainder) clipped at the prompt, what
    the clip leaves spread over the streaming heads the same way."""
    heads = len(head_scores)
    R = int(np.floor(share * heads + 0.5 + 1e-9))
    order = sorted(range(heads), key=lambda h: (-head_scores[h], h))
    if R == 0:
        return [n] * heads
    s = min(n, streaming)
    rest = heads * n - (heads - R) * s
    counts = [0] * heads
    for i, h in enumerate(order[:R]):
        counts[h] = min(length, rest // R + (i < rest % R))
    left = heads * n - sum(counts) - (heads - R) * s
    for i, h in enumerate(order[R:]):
        counts[h] = s + left // (heads - R) + (i < left % (heads - R))
    return counts


def kept_reference(scores, head_scores, budget, inner, share, sinks, window):
    kept = {}
    for b, ln in enumerate(LENGTHS.tolist()):
        n = _uniform(budget, ln)
        forced = _forced(ln, inner.sinks, inner.window)
        for l in range(L):
            counts = split_reference(head_scores[l], n, ln, share, sinks + window)
            R = int(np.floor(share * H + 0.5 + 1e-9))
            order = sorted(range(H), key=lambda h: (-head_scores[l, h], h))
            for h in range(H):
                c = counts[h]
                if h in order[:R]:  # the inner's forced entries, then its best
                    rest = [int(t) for t in np.argsort(-scores[l, b, h, :ln], kind="stable") if t not in forced]
                    kept[l, b, h] = forced | set(rest[:c - len(forced)])
                else:  # sinks, then the most recent
                    first = min(sinks, c)
                    kept[l, b, h] = set(range(first)) | set(range(ln - (c - first), ln))
    return kept


@pytest.mark.parametrize("share", [0.0, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("budget", [0.25, 0.75])  # 0.75: retrieval heads would need more than the prompt
def test_headsplit_keeps_the_documented_split(share, budget, rng):
    inner = Given(budget=budget)
    head_scores = rng.random((L, H)).astype(np.float32)
    policy = HeadSplit(inner, retrieval_share=share, sinks=2, window=6, head_scores=head_scores)
    scores, out, k, v, capacity = _compress(policy, rng)
    kept = _kept(out, k, v)
    assert kept == kept_reference(scores, head_scores, budget, inner, share, 2, 6)
    clipped = False
    for b, ln in enumerate(LENGTHS.tolist()):
        n = _uniform(budget, ln)
        for l in range(L):
            sizes = [len(kept[l, b, h]) for h in range(H)]
            assert sum(sizes) == H * n  # the uniform total, exactly
            assert max(sizes) <= ln
            clipped |= max(sizes) == ln and share not in (0.0, 1.0)
    assert clipped == (budget == 0.75 and share in (0.25, 0.5))  # the clip was exercised
    R = retrieval_heads(share, H)
    n0 = _uniform(budget, 60)
    largest = n0 if R == 0 else -(-(H * n0 - (H - R) * min(n0, 8)) // R)
    assert capacity == min(60, largest) + 3
    assert max(len(s) for s in kept.values()) <= capacity - 3


def test_full_share_is_the_inner(rng):
    """retrieval_share=1: every head is a retrieval head keeping n, the inner's own compression."""
    inner = Given(budget=0.3)
    head_scores = rng.random((L, H)).astype(np.float32)
    scores, out, k, v, _ = _compress(HeadSplit(inner, retrieval_share=1.0, head_scores=head_scores), rng)
    kept = _kept(out, k, v)
    for b, ln in enumerate(LENGTHS.tolist()):
        forced = _forced(ln, inner.sinks, inner.window)
        for l in range(L):
            for h in range(H):
                rest = [int(t) for t in np.argsort(-scores[l, b, h, :ln], kind="stable") if t not in forced]
                assert kept[l, b, h] == forced | set(rest[:_uniform(0.3, ln) - len(forced)])


@pytest.mark.parametrize("heads", [1, 2, 3, 8])
def test_split_counts_on_many_rows(heads, rng):
    """The rule alone over many random rows: exact total, bounded by the prompt, the reference."""
    from sparsekv_jax.policies.headsplit import split_counts

    layers, rows = 3, 40
    length = rng.integers(1, 3000, size=rows)
    keep = np.maximum(1, (rng.random(rows) * length).astype(np.int64))
    hs = rng.random((layers, heads)).astype(np.float32)
    share, streaming = float(rng.choice([0.25, 0.5, 0.75])), int(rng.integers(1, 400))
    R = retrieval_heads(share, heads)
    got = np.asarray(split_counts(jnp.asarray(hs), jnp.asarray(keep, jnp.int32), jnp.asarray(length, jnp.int32),
                                  R, streaming))
    np.testing.assert_array_equal(got.sum(-1), np.broadcast_to(heads * keep, (layers, rows)))
    assert (got <= length[None, :, None]).all() and (got >= 1).all()
    want = [[split_reference(hs[l], int(keep[b]), int(length[b]), share, streaming) for b in range(rows)]
            for l in range(layers)]
    np.testing.assert_array_equal(got, np.array(want))


def test_a_budget_covering_the_prompt_is_full_attention(tiny):  # noqa: F811
    """70 tokens cover row 1 (70 long), not row 0: row 1 gives full attention's logits; 1.0 covers
    both (no compression, no head scores needed)."""
    params, tokens, forced, lengths, dense = tiny
    head_scores = np.array([[0.3, 0.9], [0.8, 0.1], [0.5, 0.2]], np.float32)
    policy = HeadSplit(SnapKV(70, window=8), sinks=4, window=8, head_scores=head_scores)
    got = np.asarray(teacher_force(params, policy, tokens, forced, lengths=lengths)[0])
    np.testing.assert_allclose(got[1], dense[1], rtol=1e-5, atol=1e-5)
    assert np.abs(got[0] - dense[0]).max() > 1e-3  # row 0 really was compressed
    covering = np.asarray(teacher_force(params, parse_policy("headsplit(snapkv(1.0))"), tokens, forced,
                                        lengths=lengths)[0])
    np.testing.assert_array_equal(covering, dense)


# -- head scores: shipped, missing, bad --------------------------------------------------------------
def test_the_shipped_smollm2_calibration_is_found_by_the_model():
    cfg = smollm2_135m_config()
    with open(os.path.join(CALIBRATION_DIR, "smollm2_heads.json")) as f:
        shipped = np.asarray(json.load(f)["head_scores"], np.float32)
    assert shipped.shape == (cfg.num_layers, cfg.num_kv_heads) and ((shipped >= 0) & (shipped <= 1)).all()
    bound = HeadSplit(SnapKV(0.25)).bind(Setup(config=cfg, prompt_len=4096))
    np.testing.assert_array_equal(np.asarray(bound.head_scores), shipped)
    named = HeadSplit(SnapKV(0.25), calibration="smollm2").bind(Setup(config=cfg, prompt_len=4096))
    np.testing.assert_array_equal(np.asarray(named.head_scores), shipped)
    assert bound.num_kv_heads == 3 and bound.retrieval == 2  # round(0.5 · 3), halves up


def test_every_shipped_head_calibration_fits_its_model_and_is_found_alone():
    """Each shipped ``*_heads.json``: scores ``[layers, KV heads]`` of the config it records, shares in
    [0, 1], and no two files record one config (the lookup by shapes is unambiguous)."""
    import glob

    from sparsekv_jax.policies.headsplit import FINGERPRINT, shipped_head_calibration

    paths = sorted(glob.glob(os.path.join(CALIBRATION_DIR, "*_heads.json")))
    assert os.path.join(CALIBRATION_DIR, "smollm2_heads.json") in paths
    seen = set()
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        cfg, scores = data["config"], np.asarray(data["head_scores"])
        assert scores.shape == (cfg["num_layers"], cfg["num_kv_heads"]), path
        assert ((scores >= 0) & (scores <= 1)).all(), path
        key = tuple(cfg[k] for k in FINGERPRINT)
        assert key not in seen, path
        seen.add(key)
        assert shipped_head_calibration(type("Cfg", (), cfg)) == path


def test_a_model_without_head_scores_is_refused_naming_the_fix():
    with pytest.raises(ValueError, match=r"no head calibration is shipped .*sparsekv calibrate --heads"):
        HeadSplit(SnapKV(0.25)).bind(Setup(config=CFG, prompt_len=400))
    with pytest.raises(ValueError, match=r"shape \(2, 4\) do not match .*\[3, 4\]"):
        HeadSplit(SnapKV(0.25), head_scores=np.zeros((2, 4))).bind(Setup(config=CFG, prompt_len=400))
    with pytest.raises(ValueError, match="finite"):
        HeadSplit(SnapKV(0.25), head_scores=np.full((L, H), np.nan)).bind(Setup(config=CFG, prompt_len=400))
    with pytest.raises(ValueError, match=r"calibration='nope'.*shipped: \[.*'smollm2'"):
        HeadSplit(SnapKV(0.25), calibration="nope").bind(Setup(config=CFG, prompt_len=400))
    with pytest.raises(ValueError, match="bind the policy"):
        HeadSplit(SnapKV(0.25)).compressed_capacity(1000, 10)


@pytest.mark.parametrize("spec, match", [
    ("headsplit(quest(0.25))", r"HeadSplit\(inner=Quest\).*scored compressor"),
    ("headsplit(snapkv(0.25), retrieval_share=1.5)", r"retrieval_share=1.5 must be a fraction in \[0, 1\]"),
    ("headsplit(snapkv(0.25), sinks=-1)", r"sinks=-1 must be an integer >= 0"),
    ("headsplit(snapkv(0.25), window=2.5)", r"window=2.5 must be an integer"),
    ("headsplit(snapkv(0.25), sinks=0, window=0)", r"sinks=0, window=0: a streaming head must keep"),
    ("headsplit(snapkv(0.25), calibration=3)", r"calibration=3 must be a file path"),
])
def test_bad_values_are_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        parse_policy(spec)


# -- the calibration ---------------------------------------------------------------------------------
def test_head_share_scores_match_transformers_attention(hf_tiny_dir, rng):
    """The calibration's per-head share, against the attention probabilities transformers returns
    (eager attention, ``output_attentions``) on a tiny random Llama, reduced in numpy."""
    import torch
    import transformers as tf

    from sparsekv_jax.eval.head_calibration import head_share_scores
    from sparsekv_jax.models.loading import load_hf_dir

    path = hf_tiny_dir("llama")
    params, cfg = load_hf_dir(path)
    sinks, recent, queries = 2, 5, 4
    prompts = [rng.integers(1, cfg.vocab_size, size=n).tolist() for n in (40, 31, 36)]  # 2 batches, one padded
    got = head_share_scores(params, prompts, sinks=sinks, recent=recent, queries=queries, batch_size=2,
                            progress=False)
    model = tf.AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    G = cfg.num_heads // cfg.num_kv_heads
    want = np.zeros((cfg.num_layers, cfg.num_kv_heads))
    for p in prompts:
        with torch.no_grad():
            att = model(torch.tensor([p]), output_attentions=True).attentions  # per layer [1, Hq, T, T]
        T = len(p)
        for l, a in enumerate(att):
            a = a[0].double().numpy()
            for i in range(T - queries, T):
                far = a[:, i, sinks:max(sinks, i - recent + 1)].sum(-1)  # [Hq]
                want[l] += far.reshape(cfg.num_kv_heads, G).mean(-1) / queries
    want /= len(prompts)
    assert want.max() > 0.1  # a random model spreads its attention: the shares are far from zero
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_head_calibration_refuses_short_prompts(hf_tiny_dir):
    from sparsekv_jax.eval.head_calibration import head_share_scores
    from sparsekv_jax.models.loading import load_hf_dir

    params, _ = load_hf_dir(hf_tiny_dir("llama"))
    with pytest.raises(ValueError, match=r"20 tokens is too short for sinks=4 \+ recent=16 \+ queries=8"):
        head_share_scores(params, [[1] * 20], sinks=4, recent=16, queries=8, progress=False)
    with pytest.raises(ValueError, match="queries=0 must be >= 1"):
        head_share_scores(params, [[1] * 20], sinks=4, recent=4, queries=0, progress=False)


def test_calibrate_heads_end_to_end_smollm2(smol, tmp_path):
    """RULER needle prompts → the JSON HeadSplit loads: the shares recomputed from the same prompts,
    the model's shapes recorded (so the file is found by the model), and the CLI's refusals."""
    from sparsekv_jax.eval.calibrate import suite_prompts
    from sparsekv_jax.eval.head_calibration import calibrate_heads, head_share_scores

    _, params, tokenizer, _ = smol
    kw = dict(sinks=4, recent=32, queries=16)
    out = tmp_path / "heads.json"
    res = calibrate_heads((params, tokenizer), out=out, tasks=["niah_single_1"], length=320, n=1, seed=7,
                          progress=False, model_name="smollm2", **kw)
    assert json.loads(out.read_text()) == res and res["samples"] == 1 and res["model"] == "smollm2"
    prompts = suite_prompts("ruler", tokenizer, params.config, ["niah_single_1"], 320, 1, 7, None)
    want = head_share_scores(params, prompts, batch_size=2, progress=False, **kw)
    np.testing.assert_allclose(np.asarray(res["head_scores"]), want, atol=1e-6)
    assert 0.0 < want.min() and want.max() < 1.0
    bound = HeadSplit(SnapKV(0.25), calibration=str(out)).bind(Setup(config=params.config, prompt_len=1024))
    np.testing.assert_allclose(np.asarray(bound.head_scores), want, atol=1e-6)
    assert res["config"] == {k: getattr(smollm2_135m_config(), k) for k in res["config"]}


@pytest.mark.parametrize("extra", [["--suite", "wikitext"], ["--plot", "x.png"], ["--data", "x.txt"]])
def test_calibrate_heads_cli_refuses_chess_options(extra, capsys):
    from sparsekv_jax import cli

    assert cli.main(["calibrate", "--heads", "--model", "/nonexistent", *extra]) == 2
    assert "--heads measures RULER needle prompts" in capsys.readouterr().err
