"""Protocol v2: declared stages and needs, generic composition, the question split, the context
stage, writes that merge, and the backend as a static value. Each former defect has a test here."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng
from flax import struct

from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import append_token, init_cache, summarize_pages
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import H2O, ContextResult, Dense, Pipeline, Policy, Quest, Setup, SnapKV, StreamingLLM
from sparsekv_jax.policies.common import write_entries

CFG = ModelConfig(family="llama", vocab_size=71, hidden_size=48, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=16, intermediate_size=40, max_position_embeddings=512, eos_token_ids=(0,))


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, 0.3)


def _tokens(b: int, t: int) -> np.ndarray:
    return seeded_rng().integers(1, CFG.vocab_size, (b, t))


# -- former defects ----------------------------------------------------------------------------

def test_decode_stage_gets_its_observations_whatever_the_compressor(params):
    """Pipeline(compress=SnapKV, decode=H2O) runs H2O's running eviction: the cache stays at the
    size SnapKV left (formerly H2O got no observations unless it was also the compressor, and the
    cache grew by one entry per generated token)."""
    tokens, lengths = _tokens(2, 64), np.array([64, 50])
    pol = Pipeline(compress=SnapKV(0.5, window=8), decode=H2O(0.25))
    out = generate(params, pol, tokens, lengths=lengths, max_new_tokens=9, stop_tokens=())
    np.testing.assert_array_equal(np.asarray(out.cache.length), [32, 25])
    # the evicting decode really ran: the newest tokens are in the cache, some kept prompt entries left
    pos = np.asarray(out.cache.layers.positions)
    for b, n in enumerate(lengths):
        assert {n + 7} <= set(pos[0, b, 0].tolist())
    alone = generate(params, SnapKV(0.5, window=8), tokens, lengths=lengths, max_new_tokens=9, stop_tokens=())
    np.testing.assert_array_equal(np.asarray(alone.cache.length), [32 + 8, 25 + 8])


def test_streaming_llm_prefills_in_chunks():
    """StreamingLLM needs nothing of the prefill (it was refused because it overrode `observe`)."""
    assert not StreamingLLM(0.5).needs_whole_prefill and not StreamingLLM(0.5).needs_observations
    assert SnapKV(0.5).needs_whole_prefill and H2O(0.5).needs_observations


def test_overwriting_a_slot_resets_its_bias():
    """A merged entry's log-size bias must not carry over to the token that overwrites its slot;
    the page's max bias follows."""
    rng = seeded_rng()
    cache = init_cache(CFG, 2, 32, page_size=8, dtype=jnp.float32)
    layer = jax.tree.map(lambda x: x[0], cache.layers)
    bias = jnp.asarray(rng.uniform(0.5, 2.0, layer.bias.shape), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(32), layer.positions.shape)
    layer = layer.replace(k=jnp.asarray(rng.normal(size=layer.k.shape), jnp.float32), bias=bias, positions=pos)
    length = jnp.asarray([20, 20])
    layer = summarize_pages(layer, length, 8)
    slot = jnp.asarray([[5, 9], [17, 3]])  # one slot per (row, head): in-place eviction
    new = append_token(layer, jnp.ones((2, 2, 16)), jnp.ones((2, 2, 16)), slot, jnp.asarray([40, 41]), length, 8)
    got = np.asarray(new.bias)
    for b in range(2):
        for h in range(2):
            assert got[b, h, int(slot[b, h])] == 0.0
            page = int(slot[b, h]) // 8
            live = np.arange(page * 8, min(page * 8 + 8, 20))
            assert np.asarray(new.page_max_bias)[b, h, page] == pytest.approx(got[b, h, live].max())
    untouched = np.ones_like(got, bool)
    untouched[[0, 0, 1, 1], [0, 1, 0, 1], [5, 9, 17, 3]] = False
    np.testing.assert_array_equal(got[untouched], np.asarray(bias)[untouched])


def test_quest_bound_holds_for_merged_entries():
    """With per-slot biases (log cluster sizes), Quest's page score still bounds every logit
    q·k/√d + bias in the page, and its choice is the brute-force top pages by that bound."""
    rng = seeded_rng()
    L, B, H, S, D, ps = 1, 2, 2, 64, 8, 8
    k = rng.normal(size=(L, B, H, S, D)).astype(np.float32)
    bias = np.log(rng.integers(1, 9, (L, B, H, S))).astype(np.float32)
    bias[..., 17] = 6.0  # one heavy merged entry in page 2: the bound must see it
    cache = init_cache(CFG.__class__(**{**CFG.__dict__, "num_layers": 1, "head_dim": D}), B, S, page_size=ps,
                       dtype=jnp.float32)
    counts = jnp.asarray([60, 45])
    cache = write_entries(cache, jnp.asarray(k), jnp.asarray(k), jnp.broadcast_to(jnp.arange(S), (L, B, H, S)),
                          jnp.asarray(bias), counts, S)
    pol = Quest(budget=16, page_size=ps, dense_layers=0).bind(Setup(CFG, prompt_len=S, page_size=ps))
    q = rng.normal(size=(B, 6, D)).astype(np.float32)
    kv = jax.tree.map(lambda x: x[0], cache.layers)
    ids, n = (np.asarray(x) for x in pol.decode_select(jnp.asarray(q), kv, counts, None, None, jnp.int32(0), ps))
    for b, length in enumerate([60, 45]):
        used = -(-length // ps)
        for h in range(H):
            qg = q[b, 3 * h: 3 * h + 3]
            bounds = []
            for p in range(used):
                sl = slice(p * ps, min(length, p * ps + ps))
                logits = qg @ k[0, b, h, sl].T / math.sqrt(D) + bias[0, b, h, sl]
                ub = (np.maximum(qg * k[0, b, h, sl].min(0), qg * k[0, b, h, sl].max(0)).sum(-1) / math.sqrt(D)
                      + bias[0, b, h, sl].max())
                assert (logits <= ub[:, None] + 1e-5).all()
                bounds.append(ub.max())
            best = [p for p in np.argsort(-np.asarray(bounds)) if p != used - 1][0]
            assert set(ids[b, h, : n[b, h]].tolist()) == {used - 1, best}


def test_h2o_runs_through_the_decode_kernel(params, monkeypatch):
    """With the kernels backend H2O's decode takes the Pallas kernel (which also returns the step's
    probabilities), not the jnp fallback, and gives the jnp path's tokens and cache."""
    from sparsekv_jax.pallas import decode as decode_module

    calls = []
    real = decode_module.decode_attention
    monkeypatch.setattr(decode_module, "decode_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    tokens, lengths = _tokens(2, 48), np.array([48, 40])
    ref = generate(params, H2O(0.5), tokens, lengths=lengths, max_new_tokens=5, stop_tokens=(),
                   backend=Backend.reference())
    got = generate(params, H2O(0.5), tokens, lengths=lengths, max_new_tokens=5, stop_tokens=(),
                   backend=Backend(decode_attention="pallas", decode_carry=True))
    assert calls and all(c.get("return_probs") for c in calls)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(ref.tokens))
    # fp32, the kernel's summation order: a relative bound too (a fresh-clone run saw 1.5e-5 on a key of 0.91)
    np.testing.assert_allclose(np.asarray(got.cache.layers.k), np.asarray(ref.cache.layers.k), rtol=2e-5, atol=2e-5)


def test_backend_is_a_static_value_that_takes_effect_after_a_compile(params, monkeypatch):
    """Switching the backend between calls recompiles with the new choice (no cache clearing)."""
    from sparsekv_jax.pallas import decode as decode_module

    calls = []
    real = decode_module.decode_attention
    monkeypatch.setattr(decode_module, "decode_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    tokens = _tokens(1, 40)
    a = generate(params, Dense(), tokens, max_new_tokens=4, stop_tokens=(), backend=Backend.reference())
    assert not calls
    b = generate(params, Dense(), tokens, max_new_tokens=4, stop_tokens=(), backend=Backend(decode_attention="pallas"))
    assert calls
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    assert hash(Backend()) == hash(Backend()) and Backend().resolve().resolved
    with pytest.raises(ValueError, match="decode_attention='cuda'"):
        Backend(decode_attention="cuda")


# -- the question split and the context stage -----------------------------------------------------

@struct.dataclass
class QuestionKeeper(Policy):
    """Test policy: keeps exactly the question tokens and the first `head` tokens; records the
    question start it saw in `observe` (as a per-layer observation)."""

    head: int = struct.field(pytree_node=False, default=4)
    stages = ("compress",)
    needs_whole_prefill = True
    needs_observations = True
    needs_question = True

    def observe(self, q, k, v, hidden, layer_index, prompt):
        return prompt.question_start

    def compressed_capacity(self, prompt_len, max_new_tokens, suffix_tokens=0):
        return prompt_len + max_new_tokens - 1  # smaller than the prefill cache: compress runs

    def compress(self, cache, observations, capacity, prompt):
        from sparsekv_jax.policies.common import compact

        assert observations.shape == (CFG.num_layers, cache.batch)
        slot = jnp.arange(cache.capacity)
        keep = (slot[None] >= prompt.question_start[:, None]) | (slot[None] < self.head)
        scores = jnp.broadcast_to(keep[None, :, None].astype(jnp.float32), cache.layers.positions.shape)
        count = self.head + prompt.lengths - prompt.question_start
        return compact(cache, scores, count, capacity)


def test_question_start_reaches_observe_and_compress(params):
    tokens, lengths, qs = _tokens(2, 40), np.array([40, 33]), np.array([30, 21])
    out = generate(params, QuestionKeeper(), tokens, lengths=lengths, question_start=qs, max_new_tokens=2,
                   stop_tokens=())
    pos = np.asarray(out.cache.layers.positions)
    for b in range(2):
        kept = sorted(set(pos[0, b, 0].tolist()) - {-1})
        assert kept[: 4 + lengths[b] - qs[b]] == [0, 1, 2, 3, *range(qs[b], lengths[b])]
    np.testing.assert_allclose(np.asarray(out.stats["kv_stored_fraction"]), (4 + lengths - qs) / lengths)
    for bad, match in ((np.array([41, 3]), r"question_start\[0\]=41"), (np.array([3]), "shape")):
        with pytest.raises(ValueError, match=match):
            generate(params, QuestionKeeper(), tokens, lengths=lengths, question_start=bad, max_new_tokens=2)


@struct.dataclass
class DropFirstHalf(Policy):
    """Test context stage: keeps the second half of each row's context (host-side) and the question."""

    stages = ("context",)

    def context(self, params, tokens, lengths, question_start):
        rows = [t[n // 2: n] for t, n in zip(tokens, lengths, strict=True)]
        width = max(len(r) for r in rows)
        new = np.zeros((len(rows), width), tokens.dtype)
        for i, r in enumerate(rows):
            new[i, : len(r)] = r
        qs = None if question_start is None else question_start - lengths // 2
        return ContextResult(new, np.array([len(r) for r in rows]), qs, {"dropped": (lengths // 2).tolist()})


def test_context_stage_rewrites_the_prompt_before_jit(params):
    tokens, lengths = _tokens(2, 60), np.array([60, 47])
    out = generate(params, Pipeline(context=DropFirstHalf(), compress=StreamingLLM(0.5, sinks=2)), tokens,
                   lengths=lengths, max_new_tokens=4, stop_tokens=())
    assert out.stats["context"] == {"dropped": [30, 23]}
    # the same as generating from the shortened prompt, but stats are fractions of the user's prompt
    short = np.zeros((2, 30), np.int64)
    short[0], short[1, :24] = tokens[0, 30:60], tokens[1, 23:47]
    ref = generate(params, StreamingLLM(0.5, sinks=2), short, lengths=np.array([30, 24]), max_new_tokens=4,
                   stop_tokens=())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref.tokens))
    np.testing.assert_allclose(np.asarray(out.stats["kv_stored_fraction"]), np.array([15 / 60, 12 / 47]), atol=1e-6)


@struct.dataclass
class ChunkSums(Policy):
    """Test compressor that observes chunks (needs no whole prefill): sums of each chunk's keys."""

    stages = ("compress",)
    needs_observations = True

    def observe(self, q, k, v, hidden, layer_index, prompt):
        return jnp.stack([k.sum((1, 2, 3)), jnp.full((k.shape[0],), prompt.offset, jnp.float32)], -1)


def test_chunked_prefill_observes_each_chunk(params):
    """Chunked prefill calls `observe` of a stage that needs no whole prefill, per chunk, with the
    chunk's offset; the stacked observations equal a one-pass prefill's keys summed per chunk."""
    from sparsekv_jax.generate import prefill

    tokens, lengths = jnp.asarray(_tokens(2, 48)), jnp.asarray([48, 48])
    cache = init_cache(CFG, 2, 48, page_size=16, dtype=jnp.float32)
    _, full_cache, _, _ = prefill(params, Dense(), tokens, lengths, cache)
    _, _, obs, _ = prefill(params, ChunkSums(), tokens, lengths, cache, chunk=16)
    got = np.asarray(obs["compress"])  # [chunks, L, B, 2]
    assert got.shape == (3, 2, 2, 2)
    np.testing.assert_array_equal(got[:, 0, 0, 1], [0, 16, 32])
    keys = np.asarray(full_cache.layers.k)  # [L, B, H, S, D]
    for c in range(3):
        np.testing.assert_allclose(got[c, :, :, 0], keys[:, :, :, 16 * c: 16 * c + 16].sum((2, 3, 4)), rtol=1e-4,
                                   atol=1e-4)


def test_pipeline_forwards_each_hook_to_its_stage_and_refuses_misplaced_policies():
    snap, quest = SnapKV(0.3), Quest(0.3)
    pipe = Pipeline(compress=snap, decode=quest)
    assert pipe.stage("compress") is snap and pipe.stage("decode") is quest and type(pipe.stage("prefill")) is Dense
    assert pipe.stages == ("compress", "decode") and pipe.needs_whole_prefill and not pipe.needs_decode_probs
    assert pipe.compressed_capacity(100, 10) == snap.compressed_capacity(100, 10)
    assert Pipeline(decode=H2O(0.3)).needs_decode_probs
    with pytest.raises(ValueError, match="implements .*decode.* not the compress stage"):
        Pipeline(compress=Quest(0.3))
    # a pytree round trip keeps the members (what jit does)
    leaves, tree = jax.tree.flatten(pipe)
    assert jax.tree.unflatten(tree, leaves) == pipe


def test_spec_key_names_arrays_by_content_not_repr():
    @struct.dataclass
    class Holds(Policy):
        table: jax.Array

    a = Holds(table=jnp.arange(10000.0))
    b = Holds(table=jnp.arange(10000.0) + 1)
    assert a.spec_key() == Holds(table=jnp.arange(10000.0)).spec_key() != b.spec_key()
    assert len(a.spec_key()) < 200
    assert SnapKV(0.3).spec_key() != SnapKV(0.4).spec_key()


def test_merged_duplicates_attend_like_the_originals(params):
    """`write_entries` with bias log n: one entry standing for n identical keys/values gives the
    attention output of the n copies (proportional attention) on both decode paths."""
    from sparsekv_jax import attention

    rng = seeded_rng()
    D, H = 16, 2
    keys = rng.normal(size=(5, D)).astype(np.float32)
    vals = rng.normal(size=(5, D)).astype(np.float32)
    sizes = np.array([1, 3, 1, 4, 2])
    q = jnp.asarray(rng.normal(size=(1, 6, D)), jnp.float32)
    cfg = CFG.__class__(**{**CFG.__dict__, "num_layers": 1})
    cache = init_cache(cfg, 1, 16, page_size=8, dtype=jnp.float32)
    expand = lambda x: jnp.broadcast_to(jnp.asarray(x), (1, 1, H, *np.shape(x)))  # noqa: E731
    full = write_entries(cache, expand(np.repeat(keys, sizes, 0)), expand(np.repeat(vals, sizes, 0)),
                         expand(np.arange(11)), expand(np.zeros(11, np.float32)), jnp.asarray([11]), 16)
    merged = write_entries(cache, expand(keys), expand(vals), expand(np.arange(5)), expand(np.log(sizes)),
                           jnp.asarray([5]), 16)
    for impl in ("jnp", "pallas"):
        backend = Backend(decode_attention=impl)
        ref = attention.decode(q, jnp.asarray([20]), jax.tree.map(lambda x: x[0], full.layers), full.length, 8, None,
                               backend=backend)[0]
        got = attention.decode(q, jnp.asarray([20]), jax.tree.map(lambda x: x[0], merged.layers), merged.length, 8,
                               None, backend=backend)[0]
        np.testing.assert_allclose(np.asarray(got), np.asarray(ref), rtol=1e-5, atol=1e-6)


def test_teacher_force_passes_the_question_split(params):
    tokens, lengths, qs = _tokens(1, 30), np.array([30]), np.array([24])
    forced = _tokens(1, 3)
    logits = teacher_force(params, QuestionKeeper(), tokens, forced, lengths=lengths, question_start=qs)[0]
    assert np.isfinite(np.asarray(logits)).all()


# -- the rewind hook: any decode policy, not CHESS alone ---------------------------------------

@struct.dataclass
class FirstPageThenRewind(Policy):
    """Reads only the first cache page for ``at`` steps, then every page; the first ``rows`` rows
    then take back the ``at`` tokens they decoded (a rewind through the protocol's hook alone)."""

    at: int = struct.field(pytree_node=False, default=4)
    rows: int = struct.field(pytree_node=False, default=0)
    stages = ("decode",)

    @property
    def max_rewind_tokens(self) -> int:
        return self.at if self.rows else 0

    def decode_init(self, cache, observations):
        B = cache.batch
        return None, {"step": jnp.zeros((B,), jnp.int32), "rewind": jnp.zeros((B,), jnp.int32),
                      "dense": jnp.zeros((B,), bool), "rewinds": jnp.zeros((B,), jnp.int32)}

    def decode_select(self, q, kv, length, layer_state, shared_state, layer_index, page_size):
        B, H, S, _ = kv.k.shape
        P = S // page_size
        ids = jnp.broadcast_to(jnp.arange(P, dtype=jnp.int32), (B, H, P))
        counts = jnp.where(shared_state["dense"], -(-length // page_size), 1)
        return ids, jnp.broadcast_to(counts[:, None], (B, H)).astype(jnp.int32)

    def decode_update(self, shared_state, cache, logits):
        step = shared_state["step"] + 1
        fire = step == self.at
        back = fire & (jnp.arange(step.shape[0]) < self.rows)
        rewind = jnp.where(back, self.at, 0).astype(jnp.int32)
        return {"step": step, "rewind": rewind, "dense": shared_state["dense"] | fire,
                "rewinds": shared_state["rewinds"] + back}

    def decode_rewind(self, shared_state):
        return shared_state["rewind"] if self.max_rewind_tokens else None

    def decode_stats(self, shared_state):
        return {"rewinds": shared_state["rewinds"]}


def test_any_policy_may_rewind_through_the_hook(params):
    """A policy that is not CHESS takes tokens back with `decode_rewind`: the decode loop drops them
    from the output and the cache and generates them again. Its first ``at`` steps read one page
    (tokens unlike full attention's); rows that take those steps back then decode with every page
    and so give exactly full attention's tokens and cache; the others keep what they decoded. The
    same through a `Pipeline`."""
    tokens = _tokens(4, 40)
    lengths = np.array([40, 29, 40, 33])
    run = dict(lengths=lengths, max_new_tokens=10, stop_tokens=(), page_size=8)
    dense = generate(params, Dense(), tokens, **run)
    kept = generate(params, FirstPageThenRewind(at=4, rows=0), tokens, **run)
    want = np.asarray(dense.tokens)
    assert (np.asarray(kept.tokens) != want).any(axis=1).all(), "one page read must change every row's tokens"
    for policy in (FirstPageThenRewind(at=4, rows=2), Pipeline(decode=FirstPageThenRewind(at=4, rows=2))):
        assert policy.max_rewind_tokens == 4
        out = generate(params, policy, tokens, **run)
        got = np.asarray(out.tokens)
        np.testing.assert_array_equal(got[:2], want[:2])  # taken back and regenerated with every page
        np.testing.assert_array_equal(got[2:], np.asarray(kept.tokens)[2:])  # never rewound
        np.testing.assert_array_equal(np.asarray(out.stats["rewinds"]), [1, 1, 0, 0])
        for field in ("length", "next_position"):
            np.testing.assert_array_equal(np.asarray(getattr(out.cache, field)),
                                          np.asarray(getattr(dense.cache, field)))
