"""The engine's public steps (`sparsekv_jax.engine`): `setup` checks once before jit, a `Session`
run step by step gives `generate`'s tokens, `Session.ask` answers questions in turn from one
compressed context, `decode_step` returns one `StepOut` shape. Tiny random model; the draws come
from the run's seed (tests/conftest.py: printed in the header, ``pytest --seed N`` replays it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax import engine
from sparsekv_jax.engine.run import HostNotes
from sparsekv_jax.generate import generate
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import Dense, parse_policy

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, max_position_embeddings=128, eos_token_ids=(0,))


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, scale=0.3)


@pytest.mark.share(2)
@pytest.mark.parametrize("spec", ["fullkv", "snapkv(0.5, window=8)", "h2o(0.5)", "quest(0.5)"])
def test_session_steps_give_generates_tokens(params, rng, spec):
    """prefill → compress → decode one at a time, ragged batch 2: the tokens and stats of `generate`."""
    tokens = rng.integers(1, CFG.vocab_size, (2, 40))
    kw = dict(lengths=np.array([40, 27]), question_start=np.array([33, 20]))
    policy = parse_policy(spec)
    want = generate(params, policy, tokens, max_new_tokens=5, stop_tokens=(), page_size=8, **kw)
    session = engine.Session.start(params, policy, tokens, max_new_tokens=5, stop_tokens=(), page_size=8, **kw)
    pre = session.prefill()
    assert pre.cache.capacity == want.cache.capacity or "compress" in policy.stages
    got = session.decode()
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    for key in ("kv_stored_fraction", "kv_read_fraction", "prefill_block_fraction"):
        np.testing.assert_allclose(np.asarray(got.stats[key]), np.asarray(want.stats[key]), rtol=1e-6, err_msg=key)
    assert got.stats["cache_bytes"] == want.stats["cache_bytes"]


@pytest.mark.parametrize("spec", ["fullkv", "snapkv(1.0, window=8)"])
def test_ask_answers_each_question_as_if_alone(params, rng, spec):
    """Compress the context once, then ask two questions of different widths in turn (and the first
    again): with a budget covering the prompt each answer is full attention's on context + question."""
    ctx = rng.integers(1, CFG.vocab_size, (2, 30))
    lengths = np.array([30, 21])
    questions = [(rng.integers(1, CFG.vocab_size, (2, 7)), np.array([7, 3])),
                 (rng.integers(1, CFG.vocab_size, (2, 4)), np.array([2, 4]))]
    session = engine.Session.start(params, parse_policy(spec), ctx, lengths=lengths, question_tokens=8,
                                   max_new_tokens=6, stop_tokens=(), page_size=8)
    compressed = session.compress()
    answers = [session.ask(q, ql) for q, ql in questions + questions[:1]]
    assert session.compressed is compressed  # compressed once
    for (q, ql), got in zip(questions + questions[:1], answers, strict=True):
        for b in range(2):
            whole = np.concatenate([ctx[b, : lengths[b]], q[b, : ql[b]]])[None]
            alone = generate(params, Dense(), whole, max_new_tokens=6, stop_tokens=(), page_size=8)
            assert got.sequences()[b] == alone.sequences()[0], (spec, b)
    np.testing.assert_array_equal(np.asarray(answers[0].tokens), np.asarray(answers[2].tokens))


def test_ask_refuses_what_does_not_fit(params, rng):
    ctx = rng.integers(1, CFG.vocab_size, (1, 20))
    session = engine.Session.start(params, None, ctx, question_tokens=4, max_new_tokens=3)
    with pytest.raises(ValueError, match="question of 5 tokens.*question_tokens=4"):
        session.ask(np.ones((1, 5), np.int32))
    with pytest.raises(ValueError, match="suffix has batch 2, tokens has batch 1"):
        session.ask(np.ones((2, 3), np.int32))
    with_suffix = engine.Session.start(params, None, ctx, suffix=np.ones((1, 3), np.int32), max_new_tokens=3)
    with pytest.raises(ValueError, match="has a suffix"):
        with_suffix.ask(np.ones((1, 3), np.int32))
    with pytest.raises(ValueError, match="question_tokens=2 with a suffix"):
        engine.setup(params, None, ctx, suffix=np.ones((1, 3), np.int32), question_tokens=2)


@pytest.mark.parametrize("lengths, match", [
    (np.asarray([11.5]), r"lengths must be integers, got dtype float64 \[11.5\]"),
    (np.asarray([11.0]), r"lengths must be integers, got dtype float64 \[11.0\]"),
    (np.asarray([13]), r"lengths must be in \[1, 12\]"),
])
def test_setup_refuses_bad_lengths_before_jit(params, lengths, match):
    with pytest.raises(ValueError, match=match):
        engine.setup(params, None, np.ones((1, 12), np.int32), lengths)
    with pytest.raises(ValueError, match=match):
        generate(params, None, np.ones((1, 12), np.int32), lengths=lengths, max_new_tokens=2)


def test_setup_refuses_unknown_options_by_name(params):
    with pytest.raises(TypeError, match="unknown option.*max_new"):
        engine.setup(params, None, np.ones((1, 4), np.int32), max_new=3)
    with pytest.raises(ValueError, match="page_size=12 must be a positive power of two"):
        engine.setup(params, None, np.ones((1, 4), np.int32), page_size=12)


def test_run_holds_the_prompt_as_leaves_and_the_sizes_as_static(params, rng):
    """Two prompts of one shape make equal tree structures (one compiled program); a different
    budget or page size makes another."""
    a, b = (engine.setup(params, parse_policy("snapkv(0.5, window=8)"), rng.integers(1, CFG.vocab_size, (2, 24)),
                         max_new_tokens=4, page_size=8) for _ in range(2))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    # a context stage's host notes (timings, spans) are no part of the program
    noted = a.replace(context_info=HostNotes({"seconds": 0.5, "kept_tokens": np.arange(3)}))
    assert jax.tree.structure(noted) == jax.tree.structure(a)
    assert not jax.tree.structure(noted) != jax.tree.structure(a)
    assert any(leaf is a.tokens for leaf in jax.tree.leaves(a))
    assert (a.capacity, a.page_size, a.decoding.max_new_tokens) == (32, 8, 4)  # 24 + 4 rounded up to pages of 8
    c = engine.setup(params, parse_policy("snapkv(0.5, window=8)"), np.asarray(a.tokens), max_new_tokens=4,
                     page_size=16)
    assert jax.tree.structure(a) != jax.tree.structure(c)


def test_decode_step_returns_one_shape_whatever_is_collected(params, rng):
    run = engine.setup(params, None, rng.integers(1, CFG.vocab_size, (2, 16)), max_new_tokens=3, page_size=8)
    ready = engine.prepare(params, run)
    token = jnp.argmax(ready.logits, -1).astype(jnp.int32)
    plain = engine.decode_step(params, run.policy, ready.cache, token, ready.state)
    full = engine.decode_step(params, run.policy, ready.cache, token, ready.state, collect_attention=True)
    assert type(plain) is type(full) is engine.StepOut
    assert plain.attention is None and full.attention.shape == (CFG.num_layers, 2, CFG.num_heads, CFG.head_dim)
    np.testing.assert_array_equal(np.asarray(plain.logits), np.asarray(full.logits))
    logits, cache, state, pages = plain  # unpacks as the old 4-tuple
    assert logits is plain.logits and pages.shape == (2,)


def test_full_logits_attends_with_the_given_backend(params, rng, monkeypatch):
    """`full_logits` hands its (resolved) backend to the dense attention, whose "auto" reads its
    platform; the logits do not depend on which implementation ran."""
    from sparsekv_jax import attention
    from sparsekv_jax.backend import Backend

    seen = []
    dense = attention.dense_causal_attention

    def spy(*args, **kwargs):
        seen.append((kwargs.get("backend"), kwargs.get("implementation")))
        return dense(*args, **kwargs)

    monkeypatch.setattr(attention, "dense_causal_attention", spy)
    tokens = rng.integers(1, CFG.vocab_size, (2, 12))
    mine = Backend(dense_prefill="blocked", decode_attention="pallas")
    got = engine.full_logits(params, tokens, backend=mine)
    assert seen and {b for b, _ in seen} == {mine.resolve(params)} and {i for _, i in seen} == {"blocked"}
    want = engine.full_logits(params, tokens)
    assert seen[-1] == (Backend().resolve(params), "auto")
    # two fp32 attention implementations sum in different orders: 1.9e-5 on one logit of 2,328 at seed
    # 1444115305; a wrong attention would be off by far more than 1e-4
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="backend must be a sparsekv_jax.Backend, got str"):
        engine.full_logits(params, tokens, backend="cpu")


def test_context_stage_runs_bound_to_the_run(params, rng):
    """The context stage is bound before it runs: it sees the run's resolved backend and the user's
    prompt width (S³'s scan makes its "auto" choices for that backend's platform)."""
    from flax import struct

    from sparsekv_jax.backend import Backend
    from sparsekv_jax.policies import ContextResult, Policy

    @struct.dataclass
    class Notes(Policy):
        stages = ("context",)
        backend: object = struct.field(pytree_node=False, default=None)
        width: int = struct.field(pytree_node=False, default=0)

        def bind(self, setup):
            return self.replace(backend=setup.backend, width=setup.prompt_len)

        def context(self, params, tokens, lengths, question_start):
            return ContextResult(tokens, lengths, question_start, {"backend": self.backend, "width": self.width})

    mine = Backend(decode_attention="pallas")
    run = engine.setup(params, Notes(), rng.integers(1, CFG.vocab_size, (2, 20)), backend=mine, max_new_tokens=2)
    assert run.context_info["backend"] == run.backend == mine.resolve(params) != Backend().resolve(params)
    assert run.context_info["width"] == 20


def test_jit_tells_apart_policy_classes_whose_fields_are_equal(params):
    """jax 0.10's tree structures of two flax dataclasses with equal static fields compare equal
    whatever their classes, so a cached program traced for one policy class could run for another
    (it did in CI: a full-attention cache came back with another test policy's page summaries).
    `Run.policy_classes` keeps them apart: 48 classes with no fields, each traced and run in turn
    by one jitted function, each gets its own program; the decode view names its own policy's."""
    from flax import struct

    classes = [struct.dataclass(type(f"Marked{i}", (Dense,), {"mark": i})) for i in range(48)]
    tokens = np.arange(1, 9)[None]
    marks = jax.jit(lambda run: jnp.int32(type(run.policy).mark))
    runs = [engine.setup(params, cls(), tokens, max_new_tokens=2) for cls in classes]
    assert [int(marks(run)) for run in runs] == list(range(48))
    snap = engine.setup(params, parse_policy("snapkv(0.5, window=4)"), tokens, max_new_tokens=2)
    assert runs[0].for_decode().policy_classes == (Dense,)  # a policy without a decode stage decodes densely
    assert snap.policy_classes[0].__name__ == "SnapKV" and snap.for_decode().policy_classes == (Dense,)
