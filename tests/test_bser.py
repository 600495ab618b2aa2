"""BSER: probing, gating and local expansion against numpy brute force; planted blocks; exactness
with thresholds that keep everything; budget mode never over its budget; the tail fallback."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import BSER, Dense, parse_policy
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.bser_probe import embedding_stats, probe_queries, question_start
from sparsekv_jax.policies.common import budget_tokens

# the tiny random model has no calibrated hidden-state thresholds: SmolLM2's, with a warning (tested below)
pytestmark = pytest.mark.filterwarnings("ignore:BSER. no hidden-state thresholds:UserWarning")

CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=32, num_layers=3, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, max_position_embeddings=256, eos_token_ids=(0,))


def _bound(**kw) -> BSER:
    return BSER(**{"window": 8, "min_question": 1, **kw}).bind(Setup(CFG, prompt_len=64))


# -- numpy references ---------------------------------------------------------------------------
def np_question_attention(q, k, lengths, qs, m):
    """ā [B, T]: softmax rows of the last <= m question queries, mean over query heads and queries."""
    B, T, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = np.zeros((B, T))
    for b in range(B):
        probe = list(range(qs[b], lengths[b]))[-m:]
        for p in probe:
            for h in range(Hq):
                s = k[b, : p + 1, h // G] @ q[b, p, h] / math.sqrt(D)
                e = np.exp(s - s.max())
                out[b, : p + 1] += e / e.sum()
        out[b] /= Hq * len(probe)
    return out


def np_relevance(a, E, lengths, qs, m, bs, sinks, salience, centred, unit_rms):
    """s [B, nb] by Eqs. 3-5 and a cosine, one block at a time."""
    B, T = a.shape
    nb = -(-T // bs)
    s = np.full((B, nb), -np.inf)
    for b in range(B):
        x = E[b].astype(np.float64)
        if unit_rms:
            x = x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
        ctx = [j for j in range(T) if sinks <= j < qs[b]]
        if centred:
            x = x - x[ctx].mean(0)
        q_mean = x[list(range(qs[b], lengths[b]))[-m:]].mean(0)
        for i in range(nb):
            tok = [j for j in ctx if i * bs <= j < (i + 1) * bs]
            if not tok:
                continue
            if salience == "attention":
                w = a[b, tok] / a[b, tok].sum()
            elif salience == "softmax":
                w = np.exp(a[b, tok]) / np.exp(a[b, tok]).sum()
            else:
                w = np.full(len(tok), 1 / len(tok))
            r = w @ x[tok]
            s[b, i] = r @ q_mean / (np.linalg.norm(r) * np.linalg.norm(q_mean))
    return s


def np_refined(a_row, tok, policy):
    """Stage III on one block's context tokens ``tok``. ``fill``: anchors in ā order, each with its
    neighbours within r, until round(ρ·len(tok)) tokens (ties: own ā, then position). Otherwise the
    fixed p = policy.anchors top-ā anchors and every token within r of one."""
    r = policy.radius
    if not policy.fill:
        top = sorted(tok, key=lambda j: (-a_row[j], j))[: policy.anchors]
        return {j for j in tok if any(abs(j - t) <= r for t in top)}
    near = {j: max(a_row[i] for i in tok if abs(i - j) <= r) for j in tok}
    share = math.floor(policy.expansion * len(tok) + 0.5)
    return set(sorted(tok, key=lambda j: (-near[j], -a_row[j], j))[:share])


def np_order(policy, a, s, lengths, qs, T):
    """Every used slot of each row, most wanted first: sinks, window, question, then retained blocks
    (by block s, then ā), refined tokens (by the largest ā within r in their block, then ā; with
    ``refine_order="block"`` by block s, then ā), the rest (by block s, then ā)."""
    bs, r = policy.block_size, policy.radius
    orders = []
    for b in range(len(lengths)):
        ln = lengths[b]
        prio = {}
        for t in range(ln):
            ctx = policy.sinks <= t < qs[b]
            blk = t // bs
            tok = [j for j in range(blk * bs, min(blk * bs + bs, T)) if policy.sinks <= j < qs[b]]
            tier, rank = 0, (s[b, blk], a[b, t])
            if ctx and s[b, blk] > policy.gates[0]:
                if s[b, blk] >= policy.gates[1]:
                    tier = 2
                elif t in np_refined(a[b], tok, policy):
                    tier = 1
                    if policy.refine_order == "salience":
                        rank = (max(a[b, i] for i in tok if abs(i - t) <= r), a[b, t])
            forced = 3 if t < policy.sinks else 2 if t >= ln - policy.window else 1 if t >= qs[b] else 0
            prio[t] = (forced, -t if forced == 3 else t if forced else 0, tier, *rank, -t)  # sinks tie: by slot
        orders.append(sorted(prio, key=lambda t: prio[t], reverse=True))
    return orders


def _obs(policy, a, E, qpos, valid, centred_ctx):
    """Stacked observations with ā in every probed layer and E's statistics in E's layer."""
    n, e = policy.num_layers, policy.embedding_layer
    stats = embedding_stats(jnp.asarray(E), qpos, valid, policy.block_size, policy.embedding == "hidden", centred_ctx)
    first = n - policy.probed
    attn = jnp.stack([jnp.asarray(a, jnp.float32) if i >= first else jnp.zeros(a.shape) for i in range(n)])
    return {"attn": attn, **{k: jnp.stack([v if i == e else jnp.zeros_like(v) for i in range(n)])
                             for k, v in stats.items()}}


def _prompt(lengths, qs, T):
    return Prompt(tokens=jnp.zeros((len(lengths), T), jnp.int32), lengths=jnp.asarray(lengths, jnp.int32),
                  question_start=None if qs is None else jnp.asarray(qs, jnp.int32))


def _random_observation(policy, lengths, qs, hidden_shift, rng):
    """``(obs, q, k, hid, prompt)``: ``policy.observe`` run layer by layer (as the engine's layer loop
    does) on random queries, keys and hidden states of a batch-2, 64-token prompt, stacked by layer."""
    B, T, Hq, Hkv, D, H = len(lengths), 64, 4, 2, 8, 32
    q = rng.normal(size=(CFG.num_layers, B, T, Hq, D)).astype(np.float32)
    k = rng.normal(size=(CFG.num_layers, B, T, Hkv, D)).astype(np.float32)
    hid = (rng.normal(size=(CFG.num_layers, B, T, H)) + hidden_shift).astype(np.float32)
    prompt = _prompt(lengths, qs, T)
    observe = jax.jit(lambda q, k, h, i: policy.observe(q, k, None, h, i, prompt))
    obs = [observe(q[i], k[i], hid[i], jnp.int32(i)) for i in range(CFG.num_layers)]
    return jax.tree.map(lambda *x: jnp.stack(x), *obs), q, k, hid, prompt


# -- Stage II -----------------------------------------------------------------------------------
@pytest.mark.parametrize("salience, embedding, centred", [("attention", "input", True), ("softmax", "hidden", False),
                                                          ("mean", "hidden", True)])
def test_observe_and_relevance_match_brute_force(salience, embedding, centred):
    """observe (per layer, inside a layer loop) + select's s against Eqs. 3-5 computed in numpy from
    the raw queries, keys and hidden states; non-probed layers contribute nothing."""
    policy = _bound(block_size=8, probe_layers=2, salience=salience, embedding=embedding, centred=centred,
                    max_question=16, sinks=2)
    lengths, qs = np.array([64, 50]), np.array([52, 31])
    obs, q, k, hid, prompt = _random_observation(policy, lengths, qs, 0.5, seeded_rng())
    assert not np.asarray(obs["attn"][0]).any(), "layer 0 is not probed"
    a = np.mean([np_question_attention(q[i], k[i], lengths, qs, 16) for i in (1, 2)], axis=0)
    np.testing.assert_allclose(np.asarray(obs["attn"]).sum(0) / 2, a, rtol=1e-4, atol=1e-7)
    E = hid[policy.embedding_layer]
    want = np_relevance(a, E, lengths, qs, 16, 8, 2, salience, centred, embedding == "hidden")
    got = np.asarray(policy.select(obs, prompt)["s"])
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("embedding, e_layer", [("input", 0), ("hidden", 2)])
def test_mask_gate_observes_the_same(embedding, e_layer):
    """Top layer probed; E's statistics in layer 0 (token embeddings) or in the probed layer's input
    (hidden states); the other layers observe nothing, with either gate."""
    rng = seeded_rng()
    q, k = rng.normal(size=(2, 32, 4, 8)).astype(np.float32), rng.normal(size=(2, 32, 2, 8)).astype(np.float32)
    h = rng.normal(size=(2, 32, 32)).astype(np.float32)
    prompt = _prompt([32, 30], [20, 25], 32)
    both = jax.jit(lambda i: [_bound(block_size=8, probe_layers=1, gate=g, embedding=embedding).observe(
        q, k, None, h, i, prompt) for g in ("cond", "mask")])
    for i in range(3):
        a, b = both(jnp.int32(i))
        assert bool(np.asarray(a["attn"]).any()) == (i == 2) and bool(np.asarray(a["gram"]).any()) == (i == e_layer)
        jax.tree.map(lambda x, y: np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-6), a, b)


def test_without_a_split_the_tail_stands_in_for_the_question():
    lengths = jnp.asarray([40, 40, 12], jnp.int32)
    np.testing.assert_array_equal(question_start(_prompt(lengths, None, 48), 16), [24, 24, 0])
    # an empty question (split at the row's end) falls back too
    np.testing.assert_array_equal(question_start(_prompt(lengths, [30, 40, 5], 48), 16), [30, 24, 5])
    pos, valid = probe_queries(_prompt(lengths, [30, 40, 5], 48), 16, 16, 48)
    np.testing.assert_array_equal(np.asarray(pos)[valid], np.r_[30:40, 24:40, 5:12])


def test_a_short_question_reaches_back_into_the_context():
    """A question shorter than min_question tokens (an instruction such as lcc's "Next line of
    code:") starts min_question tokens before the prompt's end; longer ones are left alone."""
    lengths = jnp.asarray([40, 40, 12, 40], jnp.int32)
    prompt = _prompt(lengths, [36, 20, 10, 40], 48)
    np.testing.assert_array_equal(question_start(prompt, 16, 8), [32, 20, 4, 24])
    pos, valid = probe_queries(prompt, 16, 16, 48, 8)
    np.testing.assert_array_equal(np.asarray(pos)[valid], np.r_[32:40, 24:40, 4:12, 24:40])


# -- gating and Stage III -----------------------------------------------------------------------
def _random_case(rng, policy, lengths, qs, T):
    a = rng.uniform(0, 1, (len(lengths), T)).astype(np.float32) / T
    E = rng.normal(size=(len(lengths), T, 16)).astype(np.float32) + rng.normal(size=16).astype(np.float32)
    prompt = _prompt(lengths, qs, T)
    qpos, valid = probe_queries(prompt, policy.tail, policy.max_question, T)
    ctx = (jnp.arange(T) < jnp.asarray(qs)[:, None]) & (jnp.arange(T) >= policy.sinks)
    return a, _obs(policy, a, E, qpos, valid, ctx), prompt


@pytest.mark.parametrize("radius, fill", [(0, True), (1, True), (3, True), (1, False), (3, False)])
def test_anchors_and_radius_at_block_edges(radius, fill):
    """Every block refined (α < s < β): the kept set is the forced tokens plus, per block, the
    anchors and their neighbours within the block (``fill``: as many as ρ of the block's tokens hold;
    else the fixed p); anchors planted on block edges (and next to the question and the sinks) must
    not spill into the neighbouring block."""
    rng = seeded_rng()
    T, bs = 64, 8
    lengths, qs = np.array([64, 61]), np.array([50, 45])
    policy = _bound(block_size=bs, alpha=-2.0, beta=2.0, radius=radius, expansion=0.5, max_kept=1.0, sinks=3,
                    window=4, max_question=16, fill=fill)
    a, obs, prompt = _random_case(rng, policy, lengths, qs, T)
    a[:, [8, 15, 16, 23, 3, 47, 44]] += 1.0  # edges of blocks 1, 2; after the sinks; before the questions
    obs["attn"] = jnp.broadcast_to(jnp.asarray(a), obs["attn"].shape)  # every layer is probed (3 < 4)
    sel = policy.select(obs, prompt)
    scores = np.asarray(sel["scores"])
    for b in range(2):
        want = set(range(3)) | set(range(lengths[b] - 4, lengths[b])) | set(range(qs[b], lengths[b]))
        for i in range(T // bs):
            tok = [j for j in range(i * bs, i * bs + bs) if 3 <= j < qs[b]]
            if tok:
                want |= np_refined(a[b], tok, policy)
        kept = set(np.argsort(-scores[b, : lengths[b]], kind="stable")[: int(sel["keep"][b])].tolist())
        assert int(sel["gated"][b]) == len(want)
        assert kept == want


@pytest.mark.parametrize("budget, fill, order", [(0.2, True, "salience"), (0.5, True, "salience"),
                                                 (23, True, "salience"), (0.35, False, "block"),
                                                 (0.35, True, "block")])
def test_budget_mode_takes_retain_then_refine_then_the_rest(budget, fill, order):
    """Budget mode keeps exactly the budget (never more), and its whole order of the slots is the
    brute force's; thresholds chosen so that some blocks retain, some refine and some are discarded."""
    rng = seeded_rng()
    T, bs = 128, 8
    lengths, qs = np.array([128, 113]), np.array([112, 90])
    base = _bound(block_size=bs, budget=budget, radius=1, sinks=2, window=4, max_question=16, fill=fill,
                  refine_order=order)
    a, obs, prompt = _random_case(rng, base, lengths, qs, T)
    s = np.asarray(base.select(obs, prompt)["s"])
    lo, hi = np.quantile(s[np.isfinite(s)], [0.3, 0.7])
    policy = base.replace(alpha=float(lo), beta=float(hi))
    sel = policy.select(obs, prompt)
    orders = np_order(policy, a, s, lengths, qs, T)
    for b in range(2):
        assert int(sel["keep"][b]) == budget_tokens(budget, int(lengths[b]))
        order = np.argsort(-np.asarray(sel["scores"][b, : lengths[b]]), kind="stable")
        np.testing.assert_array_equal(order, orders[b])


def test_defaults_are_the_papers():
    """The defaults are the paper's (token embeddings, (0.3, 0.7) on any model, B = 128; docs/BSER.md
    "Defaults are the paper's since 2026-11-27"); hidden states and B = 64 stay as options. Budget
    mode at the default B against the brute force's order (three 128-token blocks; thresholds at the
    s quantiles so that some blocks retain, some refine, some are discarded)."""
    import types

    policy = BSER(0.25)
    assert (policy.embedding, policy.block_size, policy.gates) == ("input", 128, (0.3, 0.7))
    assert policy.anchors == 13  # round(0.5 · 128 / 5), the fixed count of fill=False
    qwen = types.SimpleNamespace(family="qwen2", num_layers=28, hidden_size=1536, num_heads=12, num_kv_heads=2,
                                 vocab_size=151936)
    assert policy.bind(Setup(qwen, prompt_len=8192)).gates == (0.3, 0.7)
    assert policy.bind(Setup(qwen, prompt_len=8192)).embedding_layer == 0
    old = BSER(0.25, embedding="hidden", block_size=64).bind(Setup(qwen, prompt_len=8192))
    assert (old.gates, old.block_size, old.embedding_layer) == (QWEN, 64, 24)
    rng = seeded_rng()
    T = 3 * policy.block_size
    lengths, qs = np.array([T, T - 37]), np.array([T - 30, T - 80])
    base = _bound(budget=0.35, radius=1, sinks=2, window=4, max_question=16)
    assert base.block_size == 128 and base.embedding == "input"
    a, obs, prompt = _random_case(rng, base, lengths, qs, T)
    s = np.asarray(base.select(obs, prompt)["s"])
    assert s.shape == (2, 3)
    fin = np.sort(s[np.isfinite(s)])
    policy = base.replace(alpha=float((fin[0] + fin[1]) / 2), beta=float((fin[-2] + fin[-1]) / 2))
    sel = policy.select(obs, prompt)
    assert set(np.asarray(sel["tier"]).ravel().tolist()) == {0, 1, 2}
    orders = np_order(policy, a, s, lengths, qs, T)
    for b in range(2):
        assert int(sel["keep"][b]) == budget_tokens(0.35, int(lengths[b]))
        order = np.argsort(-np.asarray(sel["scores"][b, : lengths[b]]), kind="stable")
        np.testing.assert_array_equal(order, orders[b])


def _blocks_with_cosines(cosines, bs, a, qs, T):
    """Observations whose block s are exactly ``cosines``: every token of block i has the unit
    embedding cos_i·u + sin_i·v_i (v_i ⟂ u), the question's is u; ``a`` is ā."""
    H = 2 + len(cosines)
    E = np.zeros((T, H), np.float32)
    E[qs:, 0] = 1.0
    for i, c in enumerate(cosines):
        E[i * bs: min((i + 1) * bs, qs), 0] = c
        E[i * bs: min((i + 1) * bs, qs), 2 + i] = math.sqrt(1 - c * c)
    return np.stack([E, E]), np.stack([a, a]).astype(np.float32)


def test_refined_tokens_compete_by_salience_across_blocks():
    """The needle cut at a block edge: its key words fill retained block 2 and its value (tokens
    24-26, ā 20x the background) opens block 3, whose s (0.35) is the lowest of the refined blocks.
    A budget with room for one refined block's share keeps the value (refined tokens ranked by
    salience); ranked by their block's s it kept block 1's background instead."""
    T, bs, qs = 64, 8, 56
    a = np.ones(T)
    a[16:24], a[24:27] = 100.0, 20.0
    E, a2 = _blocks_with_cosines([0.6, 0.6, 0.9, 0.35, 0.5, 0.5, 0.5], bs, a, qs, T)
    for order, value_kept in (("salience", True), ("block", False)):
        # forced: 2 sinks + 8 question tokens (the window inside them); block 2: 8; then 4 = ρ·8
        policy = _bound(budget=22, block_size=bs, radius=1, sinks=2, window=4, refine_order=order, alpha=0.3, beta=0.7)
        prompt = _prompt([T, T], [qs, qs], T)
        qpos, valid = probe_queries(prompt, policy.tail, policy.max_question, T)
        sel = policy.select(_obs(policy, a2, E, qpos, valid, None), prompt)
        np.testing.assert_allclose(np.asarray(sel["s"])[0, 1:7], [0.6, 0.9, 0.35, 0.5, 0.5, 0.5], atol=1e-5)
        kept = set(np.argsort(-np.asarray(sel["scores"])[0], kind="stable")[:22].tolist())
        assert set(range(16, 24)) <= kept
        assert ({24, 25, 26} <= kept) == value_kept, (order, sorted(kept))


def test_refinement_keeps_its_share_past_clustered_anchors():
    """A refined block whose most salient tokens sit together (the question's key words, 3-6) keeps
    ρ = half of its tokens: the words after them (the value, 7-9) too. Three fixed anchors with
    radius 1 kept the key words alone."""
    T, bs, qs = 64, 16, 48
    a = np.ones(T)
    a[19:23], a[23:26] = 100.0, 10.0  # block 1 (16..31): key words 3-6, value 7-9
    E, a2 = _blocks_with_cosines([0.5, 0.5, 0.5], bs, a, qs, T)
    prompt = _prompt([T, T], [qs, qs], T)
    for fill, value_kept in ((True, True), (False, False)):
        policy = _bound(block_size=bs, radius=1, sinks=2, window=4, max_kept=1.0, fill=fill, alpha=0.3, beta=0.7)
        qpos, valid = probe_queries(prompt, policy.tail, policy.max_question, T)
        sel = policy.select(_obs(policy, a2, E, qpos, valid, None), prompt)
        assert (np.asarray(sel["tier"])[:, 1] == 1).all()
        kept = set(np.argsort(-np.asarray(sel["scores"])[0], kind="stable")[: int(sel["keep"][0])].tolist())
        block = kept & set(range(16, 32))
        assert set(range(19, 23)) <= block
        assert ({23, 24, 25} <= block) == value_kept, (fill, sorted(block))
        assert len(block) == (8 if fill else 5)


# -- default thresholds, their derivation, and the "w/o Stage I" ablation ---------------------
def np_tiers(cosines, alpha, beta):
    """The gates by hand: 0 discard (s <= α), 2 retain (s >= β), 1 refine."""
    return [0 if c <= alpha else 2 if c >= beta else 1 for c in cosines]


QWEN = (0.601, 0.877)


@pytest.mark.parametrize("embedding, model_gates, gates", [("hidden", None, (0.853, 0.942)),
                                                           ("input", None, (0.3, 0.7)), ("hidden", QWEN, QWEN),
                                                           ("input", QWEN, (0.3, 0.7))])
def test_default_thresholds_gate_hand_made_cosines(embedding, model_gates, gates):
    """Default (α, β): hidden states with SmolLM2's re-derived (0.853, 0.942) (a model not in the
    table) or the bound model's (Qwen2.5-Coder-1.5B's here); token embeddings the paper's (0.3, 0.7)
    on any model. Blocks with exactly known cosines on both sides of each pair are discarded,
    refined and retained as the gates by hand say."""
    assert BSER(embedding="hidden").gates == (0.853, 0.942)  # unbound: SmolLM2's
    T, bs, qs = 128, 4, 112
    cosines = [0.1, 0.29, 0.31, 0.5, 0.59, 0.61, 0.69, 0.71, 0.84, 0.86, 0.87, 0.88, 0.9, 0.935, 0.95, 0.99]
    a = np.ones(T)
    E, a2 = _blocks_with_cosines(cosines, bs, a, qs, T)
    policy = _bound(block_size=bs, sinks=0, window=4, embedding=embedding).replace(model_gates=model_gates)
    assert policy.gates == gates
    prompt = _prompt([T, T], [qs, qs], T)
    qpos, valid = probe_queries(prompt, policy.tail, policy.max_question, T)
    sel = policy.select(_obs(policy, a2, E, qpos, valid, None), prompt)
    n = len(cosines)
    np.testing.assert_allclose(np.asarray(sel["s"])[0, :n], cosines, atol=1e-5)
    want = np_tiers(cosines, *gates)
    assert 0 in want and 1 in want and 2 in want
    np.testing.assert_array_equal(np.asarray(sel["tier"])[:, :n], [want, want])


@pytest.mark.parametrize("key, gates", [(("llama", 30, 576, 9, 3, 49152), (0.853, 0.942)),  # SmolLM2-135M
                                        (("qwen2", 28, 1536, 12, 2, 151936), QWEN),  # Qwen2.5-Coder-1.5B
                                        (("gemma3", 3, 640, 4, 1, 262144), (0.706, 0.951))])  # Gemma 3 270M
def test_hidden_thresholds_follow_the_bound_model(key, gates):
    """`bind` picks the model's calibrated hidden-state pair (docs/BSER.md's table); token embeddings
    keep (0.3, 0.7); a given alpha or beta wins; a model not in the table gets SmolLM2's pair with
    a warning naming it (none for token embeddings or given thresholds)."""
    import types
    import warnings

    names = ("family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "vocab_size")
    bind = lambda p, cfg: p.bind(Setup(cfg, prompt_len=256))  # noqa: E731
    cfg = types.SimpleNamespace(**dict(zip(names, key, strict=True)))
    hidden = BSER(0.25, embedding="hidden")
    assert bind(hidden, cfg).gates == gates
    assert bind(BSER(0.25), cfg).gates == (0.3, 0.7)  # the default: token embeddings
    assert bind(hidden.replace(alpha=0.5), cfg).gates == (0.5, gates[1])
    assert bind(hidden.replace(alpha=0.1, beta=0.2), cfg).gates == (0.1, 0.2)
    other = types.SimpleNamespace(**dict(zip(names, key, strict=True)))
    other.hidden_size += 64
    with pytest.warns(UserWarning, match=r"no hidden-state thresholds .*" + str(other.hidden_size)):
        assert bind(hidden, other).gates == (0.853, 0.942)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert bind(BSER(0.25), other).gates == (0.3, 0.7)
        assert bind(BSER(0.25, embedding="input"), other).gates == (0.3, 0.7)
        assert bind(hidden.replace(alpha=0.1, beta=0.2), other).gates == (0.1, 0.2)
    qwen = types.SimpleNamespace(**dict(zip(names, ("qwen2", 28, 1536, 12, 2, 151936), strict=True)))
    with pytest.raises(ValueError, match="alpha=0.9 must be <= beta=0.877"):  # a given α above the model's β
        bind(BSER(0.25, embedding="hidden", alpha=0.9), qwen)
    with pytest.raises(ValueError, match="alpha=0.9 must be <= beta=0.7"):  # token embeddings: the paper's β
        BSER(0.25, alpha=0.9)


def test_threshold_derivation_matches_block_shares():
    """scripts/bser_thresholds.derive: the hidden-state (α, β) discard and retain as many blocks as
    (0.3, 0.7) do on token embeddings; checked on a monotone map of the embedding cosines (where
    the right thresholds are the map of 0.3 and 0.7) and on unrelated draws (by count)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "scripts" / "bser_thresholds.py"
    spec = importlib.util.spec_from_file_location("bser_thresholds", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    rng = seeded_rng()
    s_in = rng.uniform(0.0, 1.0, 2000)
    f = lambda x: 0.85 + 0.1 * x  # noqa: E731
    d = mod.derive(s_in, f(s_in))
    assert np.isclose(d["p_alpha"], np.mean(s_in <= 0.3)) and np.isclose(d["p_beta"], np.mean(s_in < 0.7))
    assert abs(d["alpha"] - f(0.3)) < 2e-3 and abs(d["beta"] - f(0.7)) < 2e-3, d
    s_hid = rng.normal(0.93, 0.02, 2000)
    d = mod.derive(s_in, s_hid)
    for got, want in ((np.sum(s_hid <= d["alpha"]), np.sum(s_in <= 0.3)),
                      (np.sum(s_hid >= d["beta"]), np.sum(s_in >= 0.7))):
        assert abs(int(got) - int(want)) <= 50, (got, want)  # 3-decimal rounding moves some of 2000
    d = mod.derive(np.full(50, 0.5), s_hid[:50])  # nothing under 0.3 or over 0.7: nothing discarded or retained
    assert d["alpha"] < s_hid[:50].min() and d["beta"] > s_hid[:50].max()


@pytest.mark.parametrize("embedding", ["hidden", "input"])
def test_without_stage1_gates_each_token(embedding):
    """stage1="tokens" (the paper's "w/o Stage I"): relevance per token (s_t = cos(E_t, ē), ā
    weights nothing in a one-token block) from observe on random queries, keys and hidden states;
    threshold mode keeps the forced tokens and every context token with s > α; budget mode orders
    the slots as the numpy brute force with one-token blocks (retained by s then ā, refined by ā,
    the rest by s then ā)."""
    base = _bound(stage1="tokens", block_size=16, probe_layers=2, embedding=embedding, max_question=16, sinks=2,
                  window=4, radius=1, max_kept=1.0)
    lengths, qs = np.array([64, 57]), np.array([50, 41])
    obs, q, k, hid, prompt = _random_observation(base, lengths, qs, 0.3, seeded_rng())
    B, T = 2, 64
    assert obs["gram"].shape == (3, B, T, 1, 1)
    a = np.mean([np_question_attention(q[i], k[i], lengths, qs, 16) for i in (1, 2)], axis=0)
    E = hid[base.embedding_layer]
    want_s = np_relevance(a, E, lengths, qs, 16, 1, 2, "attention", False, embedding == "hidden")
    s = np.asarray(base.select(obs, prompt)["s"])
    np.testing.assert_allclose(s, want_s, rtol=2e-4, atol=2e-5)
    lo, hi = np.quantile(s[np.isfinite(s)], [0.3, 0.7])
    policy = base.replace(alpha=float(lo), beta=float(hi))
    sel = policy.select(obs, prompt)
    for b in range(B):
        forced = set(range(2)) | set(range(lengths[b] - 4, lengths[b])) | set(range(qs[b], lengths[b]))
        want = forced | {t for t in range(2, qs[b]) if want_s[b, t] > lo}
        order = np.argsort(-np.asarray(sel["scores"][b, : lengths[b]]), kind="stable")
        assert int(sel["gated"][b]) == len(want) and set(order[: int(sel["keep"][b])].tolist()) == want
    budget = policy.replace(budget=0.4)
    sel = budget.select(obs, prompt)
    orders = np_order(budget.replace(block_size=1), a, s, lengths, qs, T)
    for b in range(B):
        assert int(sel["keep"][b]) == budget_tokens(0.4, int(lengths[b]))
        order = np.argsort(-np.asarray(sel["scores"][b, : lengths[b]]), kind="stable")
        np.testing.assert_array_equal(order, orders[b])


# -- planted blocks -----------------------------------------------------------------------------
def _planted(attend_quarter: bool):
    """Queries/keys/embeddings by hand: the question (tokens 56..63) has embedding u and its queries
    look along key direction d. Block 2 (16..23): keys along d, embeddings u (with
    ``attend_quarter``: only tokens 16, 17 have both, the other six have embedding v and plain keys).
    Block 4 (32..39): embedding v ⟂ u, keys not along d. Everything else: random background."""
    rng = seeded_rng()
    T, H, D = 64, 32, 8
    u, v = np.eye(H)[0], np.eye(H)[1]
    E = rng.normal(0, 0.3, (T, H)) * (np.arange(H) >= 2)  # background ⟂ u, v
    E[56:] += 4 * u
    E[16:24] = 4 * u + rng.normal(0, 0.1, (8, H))
    if attend_quarter:
        E[18:24] = 4 * v + rng.normal(0, 0.1, (6, H))
    E[32:40] = 4 * v + rng.normal(0, 0.1, (8, H))
    d = np.eye(D)[0]
    k = rng.normal(0, 0.3, (T, 2, D))
    k[16:18 if attend_quarter else 24] += 3 * d
    q = rng.normal(0, 0.3, (T, 4, D))
    q[56:] += 3 * d
    stack = lambda x: np.broadcast_to(x, (2,) + x.shape).astype(np.float32)  # noqa: E731  two rows
    return stack(q), stack(k), stack(E)


def _select_planted(policy, q, k, E):
    prompt = _prompt([64, 64], [56, 56], 64)
    observe = jax.jit(lambda i: policy.observe(q, k, None, E, i, prompt))
    obs = [observe(jnp.int32(i)) for i in range(CFG.num_layers)]
    obs = jax.tree.map(lambda *x: jnp.stack(x), *obs)
    return policy.select(obs, prompt), obs, prompt


@pytest.mark.parametrize("embedding", ["hidden", "input"])
def test_planted_relevant_block_is_retained_and_irrelevant_block_discarded(embedding):
    """Both ``E`` at their default thresholds (``"input"``: the paper's (0.3, 0.7) on layer 0's
    input, the old default; ``"hidden"``: layer 1's input, the top 2 of 3 layers probed)."""
    q, k, E = _planted(attend_quarter=False)
    policy = _bound(block_size=8, sinks=2, window=4, probe_layers=2, embedding=embedding)
    assert policy.embedding_layer == {"hidden": 1, "input": 0}[embedding]
    assert policy.gates == {"hidden": (0.853, 0.942), "input": (0.3, 0.7)}[embedding]
    sel, obs, prompt = _select_planted(policy, q, k, E)
    assert np.asarray(obs["gram"][policy.embedding_layer]).any() and not np.asarray(obs["gram"][2]).any()
    tier = np.asarray(sel["tier"])
    assert (tier[:, 2] == 2).all() and (tier[:, 4] == 0).all(), np.asarray(sel["s"])
    # through compress: the planted block's entries are in the smaller cache, the irrelevant ones not
    from sparsekv_jax.cache import init_cache, summarize_pages

    cache = init_cache(CFG, 2, 80, page_size=8, dtype=jnp.float32)
    pos = jnp.where(jnp.arange(80) < 64, jnp.arange(80), -1)
    layers = cache.layers.replace(positions=jnp.broadcast_to(pos, cache.layers.positions.shape))
    length = jnp.full((2,), 64, jnp.int32)
    cache = cache.replace(layers=summarize_pages(layers, length, 8), length=length, next_position=length)
    out = policy.compress(cache, obs, policy.compressed_capacity(64, 16), prompt)
    kept = np.asarray(out.layers.positions)[:, :, :, : int(out.length[0])]
    assert out.capacity < cache.capacity
    assert np.isin(np.arange(16, 24), kept).all() and not np.isin(np.arange(32, 40), kept).any()


def test_attention_weighting_lifts_a_block_whose_attended_tokens_match():
    """Stage II matters: in block 2 only the two attended tokens have the question's embedding;
    attention-weighted the block is retained, mean-pooled it is not (token embeddings, the paper's β)."""
    q, k, E = _planted(attend_quarter=True)
    kw = dict(block_size=8, sinks=2, window=4, embedding="input")
    s_att = np.asarray(_select_planted(_bound(**kw), q, k, E)[0]["s"])
    s_mean = np.asarray(_select_planted(_bound(**kw, salience="mean"), q, k, E)[0]["s"])
    assert (s_att[:, 2] >= 0.7).all() and (s_mean[:, 2] < 0.7).all() and (s_att[:, 2] > s_mean[:, 2] + 0.1).all()


# -- through generate ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model():
    params = random_params(CFG, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, 0.3)
    tokens = seeded_rng().integers(1, CFG.vocab_size, (2, 96))
    return params, tokens, np.array([96, 77]), np.array([80, 60])


def test_infinite_thresholds_keep_everything_identical_logits(model):
    params, tokens, lengths, qs = model
    forced = seeded_rng().integers(1, CFG.vocab_size, (2, 4))
    ref = teacher_force(params, Dense(), tokens, forced, lengths=lengths)[0]
    policy = BSER(alpha=-math.inf, beta=-math.inf, max_kept=1.0, block_size=16)
    assert policy.compressed_capacity(96, 4) is not None  # compression really runs
    got = teacher_force(params, policy, tokens, forced, lengths=lengths, question_start=qs)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


@pytest.mark.parametrize("stage1", ["blocks", "tokens"])
def test_budget_mode_through_generate_keeps_question_sinks_window(model, stage1):
    params, tokens, lengths, qs = model
    policy = parse_policy(f"bser(0.3, block_size=16, window=8, stage1={stage1!r})")
    out = generate(params, policy, tokens, lengths=lengths, question_start=qs, max_new_tokens=3, stop_tokens=())
    stored = np.asarray(out.stats["kv_stored_fraction"])
    for b in range(2):
        assert round(stored[b] * lengths[b]) == budget_tokens(0.3, int(lengths[b]))
        pos = np.asarray(out.cache.layers.positions)[:, b]  # [L, H, S]
        for t in [*range(4), *range(qs[b], lengths[b])]:
            assert (pos == t).any(-1).all(), t  # in every layer and head
    assert out.cache.capacity < 96


def test_bad_settings_are_refused():
    for kw in (dict(alpha=0.8, beta=0.2), dict(alpha=0.95), dict(stage1="words"),
               dict(salience="max"), dict(embedding="keys"), dict(refine="all"),
               dict(budget=1.5), dict(expansion=0.0), dict(block_size=0), dict(radius=-1), dict(max_kept=0.0),
               dict(budget=16, sinks=8, window=16)):
        with pytest.raises(ValueError):
            BSER(**kw)
    with pytest.raises(ValueError, match="bind"):
        BSER().observe(jnp.zeros((1, 8, 4, 8)), jnp.zeros((1, 8, 2, 8)), None, jnp.zeros((1, 8, 32)), 0,
                       _prompt([8], None, 8))
