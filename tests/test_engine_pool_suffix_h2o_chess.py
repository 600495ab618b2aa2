"""A suffix (the question read after the prompt, question-agnostic) before H2O's and CHESS's decode on a page pool,
``Options(pool=True)`` (issue 38, docs/PAGE_POOL.md; experimental). `engine.prefill.extend_pool` reads the suffix into
the pool (each head grows by its row's suffix length from the free pages, written at its own logical slots); then
H2O's running eviction keeps each head at its size, its budget plus its row's suffix (its decode pool sized for the
budget and the widest suffix, `H2O.compressed_pages`' ``suffix_tokens``), and CHESS selects, rebuilds and takes pages
back from the prefill pool the suffix grew (a backtrack takes back only decoded tokens: never the question).

Against the default uniform layout, batch 2 with prompts of 40 and 29 tokens and suffixes of 5 and 11 (width 11),
fp32 on the jnp path:

* H2O(0.25) (pages of 4): `generate`'s tokens; the per-head lengths (budget + suffix) and the positions kept at
  every logical slot after the run; the pool exactly the bound's pages, those past the heads' pages free; step by
  step on a pool whose pages were moved at random after compression with junk in every free page (the suffix opens
  some): the logits (1e-5), the positions kept and the accumulated scores (1e-5) after the suffix and after every
  step, the suffix's slots starting at score 0; `Session.ask`, two questions of one compressed pool.
* CHESS (pages of 8, thresholds 0: every generated page is uncertain, each row takes its first page back twice):
  `generate`'s tokens, backtracks, rebuilds, changed regenerations, pages read and final lengths; step by step on a
  shuffled prefill pool with junk: logits (1e-5), pages read, rewinds and the lengths after every rewind, never
  below the prompt and its suffix; `Session.ask`, two questions, CHESS as a `Pipeline`'s decode stage.

Tiny random model (head_dim 16); weights, prompts and suffixes drawn from the run's seed (tests/conftest.py: printed
in the header, ``pytest --seed N`` replays it)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import decode_rewinding, seeded_rng

from sparsekv_jax import engine
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import pages_for
from sparsekv_jax.cache_pooled import PoolCache, logical_positions, shuffle_pages
from sparsekv_jax.generate import generate
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import expected_shapes, params_from_arrays
from sparsekv_jax.pallas.testing import junk_like
from sparsekv_jax.policies import H2O, Pipeline
from sparsekv_jax.policies.chess import CHESS
from sparsekv_jax.policies.spec import parse_policy

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=256, eos_token_ids=(0,))
T, LENGTHS, TQ, SUFFIX = 40, np.array([40, 29]), 11, np.array([5, 11])
# H2O(0.25) keeps 10 and 7 entries, so each head's size is 15 and 18 after the suffix (4 and 5 pages of 4; the
# bound, budget + the widest suffix, is 6 and 5 pages); 12 new tokens: 11 writes per head, each an eviction
H2O_PS, H2O_NEW = 4, 12
H2O_POLICY = H2O(0.25, recent_ratio=0.25)  # a short recent window: the scores pick most victims
# CHESS: 20 new tokens in pages of 8, each row's first generated page taken back twice (thresholds 0)
CHESS_PS, CHESS_NEW = 8, 20
CHESS8 = CHESS(page_size=CHESS_PS, ratios="aggressive", chunk_pages=2, grid_chunks=2, entropy_threshold=0.0,
               varentropy_threshold=0.0, max_backtracks=2)


@pytest.fixture(scope="module")
def params():
    """`random_params`' weights (norms near 1, the rest normal at scale 0.3) drawn with NumPy: drawn by JAX eagerly,
    each weight's shape compiled programs of its own (~2 s a module)."""
    rng = seeded_rng()
    return params_from_arrays(CFG, {name: jnp.asarray(1 + 0.1 * rng.standard_normal(shape) if name.endswith("norm")
                                                      else 0.3 * rng.standard_normal(shape), jnp.float32)
                                    for name, shape in expected_shapes(CFG).items()})


def _prompt(rng: np.random.Generator) -> dict:
    return dict(tokens=rng.integers(1, CFG.vocab_size, (2, T)), suffix=rng.integers(1, CFG.vocab_size, (2, TQ)),
                suffix_lengths=SUFFIX)


def _kw(page_size: int) -> dict:
    return dict(lengths=LENGTHS, page_size=page_size, backend=Backend(), stop_tokens=())


def _kept() -> np.ndarray:
    """``[B]`` H2O(0.25)'s budget of each row: ``floor(0.25 · length)``."""
    return np.floor(0.25 * LENGTHS + 1e-6).astype(int)


def _heads(x: np.ndarray) -> np.ndarray:
    """A row's ``[B]`` as every layer's and head's ``[L, B, Hkv]``."""
    return np.broadcast_to(np.asarray(x)[None, :, None], (CFG.num_layers, 2, CFG.num_kv_heads))


_logical_positions = jax.jit(logical_positions)  # one program (eagerly: one per op)


def _uniform_positions(cache) -> np.ndarray:
    """``[L, B, Hkv, S]`` a uniform cache's positions, -1 at and past each row's length."""
    pos = np.asarray(cache.layers.positions)
    return np.where(np.arange(pos.shape[-1]) < np.asarray(cache.length)[None, :, None, None], pos, -1)


def _positions(cache) -> np.ndarray:
    """Positions per slot, -1 past each head's (a pool) or row's (uniform) length."""
    return np.asarray(_logical_positions(cache)) if isinstance(cache, PoolCache) else _uniform_positions(cache)


def _check_positions(got: np.ndarray, want: np.ndarray, msg: str = "") -> None:
    """The pool's logical slots hold the uniform slots' positions; the uniform slots past them are empty."""
    S = min(got.shape[-1], want.shape[-1])
    np.testing.assert_array_equal(got[..., :S], want[..., :S], err_msg=msg)
    assert (got[..., S:] == -1).all() and (want[..., S:] == -1).all(), msg


def test_h2o_reads_a_suffix_on_the_pool_as_the_uniform_layout(params, rng):
    """`generate` with a suffix: the uniform layout's tokens; every head ends at its row's size (budget + suffix),
    holding the uniform cache's positions at its logical slots (the same victims, decoded tokens and the question
    included); the pool is the bound's pages (budget + the widest suffix), each head holding the pages of its size
    and the rest free (an overwrite takes no page)."""
    prompt, kw = _prompt(rng), _kw(H2O_PS)
    tokens = prompt.pop("tokens")
    want = generate(params, H2O_POLICY, tokens, max_new_tokens=H2O_NEW, **prompt, **kw)
    got = generate(params, H2O_POLICY, tokens, max_new_tokens=H2O_NEW, pool=True, **prompt, **kw)
    assert isinstance(got.cache, PoolCache)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    size = _kept() + SUFFIX
    np.testing.assert_array_equal(np.asarray(want.cache.length), size)
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), _heads(size))
    _check_positions(_positions(got.cache), _positions(want.cache))
    assert (_positions(got.cache).max(-1) == _heads(LENGTHS + SUFFIX + H2O_NEW - 2)).all()  # the last token fed
    bound = CFG.num_layers * CFG.num_kv_heads * sum(pages_for(int(n) + TQ, H2O_PS) for n in _kept())
    assert got.cache.num_pages == bound == engine.setup(params, H2O_POLICY, tokens, pool=True, **prompt,
                                                        **kw).pool_pages
    held = pages_for(size, H2O_PS)
    np.testing.assert_array_equal(np.asarray(got.cache.alloc.held).reshape(2, 2, 2), _heads(held))
    assert int(got.cache.alloc.num_free) == bound - CFG.num_layers * CFG.num_kv_heads * held.sum() > 0


def test_h2o_scores_after_a_suffix_on_a_shuffled_pool_follow_the_uniform_cache(params, rng):
    """After compression the pool's pages are moved at random and every free page filled with junk (NaN, random
    positions); the suffix opens some of them. Then along forced tokens, one jitted `decode_step` at a time on
    either layout: after the suffix and after every step the logits (1e-5), each head's length, the positions kept
    at every logical slot and their accumulated scores (1e-5) equal the uniform cache's; right after the suffix its
    slots score 0 (`H2O.decode_init`) and it changed the logits. The sessions keep the suffix's room
    (``question_tokens``) and `begin` reads it, as `Session.ask` reads a question: the ask test's sessions, so the
    prefill, compress and suffix programs compiled once serve both (`generate` reads a run's own ``suffix``: the
    test above)."""
    prompt, kw = _prompt(rng), _kw(H2O_PS)
    tokens = prompt.pop("tokens")
    forced = rng.integers(1, CFG.vocab_size, (2, H2O_NEW))
    uniform, pooled = (engine.Session.start(params, H2O_POLICY, tokens, max_new_tokens=H2O_NEW, question_tokens=TQ,
                                            pool=pool, **kw) for pool in (False, True))
    compressed = pooled.compress()
    pool, free = compressed.cache, int(compressed.cache.alloc.num_free)
    pooled.compressed = compressed.replace(cache=shuffle_pages(pool, rng.permutation(pool.num_pages), junk_like(rng)))
    got, want = (_h2o_steps(params, session, forced, prompt) for session in (pooled, uniform))
    assert got["free"] < free  # the suffix took some of the junk pages
    assert np.abs(got["logits"][0] - np.asarray(compressed.logits)).max() > 1e-2  # the suffix changes the answer
    size, kept = _kept() + SUFFIX, _kept()
    for i in range(len(forced[0])):
        np.testing.assert_allclose(got["logits"][i], want["logits"][i], atol=1e-5, rtol=1e-5, err_msg=f"step {i}")
        np.testing.assert_array_equal(got["lengths"][i], _heads(want["lengths"][i]), err_msg=f"step {i}")
        np.testing.assert_array_equal(want["lengths"][i], size, err_msg=f"step {i}")
        g_pos, w_pos = got["positions"][i], want["positions"][i]
        _check_positions(g_pos, w_pos, f"step {i}")
        S, live = g_pos.shape[-1], g_pos >= 0
        np.testing.assert_allclose(np.where(live, got["scores"][i], 0), np.where(live, want["scores"][i][..., :S], 0),
                                   atol=1e-5, rtol=1e-5, err_msg=f"step {i}")
    for b in range(2):  # after the suffix: its entries at slots kept .. size, scored 0 until the decode attends
        question = slice(int(kept[b]), int(size[b]))
        np.testing.assert_array_equal(got["positions"][0][:, b, :, question],
                                      np.broadcast_to(LENGTHS[b] + np.arange(SUFFIX[b]), (2, 2, SUFFIX[b])))
        assert (got["scores"][0][:, b, :, question] == 0).all()
        assert (got["scores"][-1][:, b, :, :int(size[b])] != got["scores"][0][:, b, :, :int(size[b])]).any()


def _h2o_steps(params, session, forced: np.ndarray, prompt: dict) -> dict[str, list[np.ndarray]]:
    """``session`` from `begin` (``prompt``'s suffix read) fed ``forced``'s tokens but the last one `decode_step` at a
    time: after the suffix and after each step the logits, lengths (a row's; a pool's per head), positions (-1 past
    them) and H2O's scores; and the pool's free pages after the suffix."""
    ready = session.begin(prompt["suffix"], prompt["suffix_lengths"])
    step = jax.jit(lambda cache, token, state: engine.decode_step(params, session.run.policy, cache, token, state,
                                                                  backend=session.run.backend))
    rec: dict = {"logits": [], "lengths": [], "positions": [], "scores": []}

    def seen(logits, cache, state):
        pool = isinstance(cache, PoolCache)
        for key, x in (("logits", logits), ("lengths", cache.lengths if pool else cache.length),
                       ("positions", _positions(cache)), ("scores", state[0]["scores"])):
            rec[key].append(np.asarray(x))

    cache, state = ready.cache, ready.state
    seen(ready.logits, cache, state)
    rec["free"] = int(cache.alloc.num_free) if isinstance(cache, PoolCache) else None
    for i in range(forced.shape[1] - 1):
        out = step(cache, jnp.asarray(forced[:, i], jnp.int32), state)
        cache, state = out.cache, out.state
        seen(out.logits, cache, state)
    return rec


@pytest.mark.parametrize("policy", ["h2o", "chess"])
def test_session_asks_two_questions_before_h2o_and_chess_on_one_pool(params, rng, policy):
    """`Session.ask` with ``question_tokens`` room: two questions of different lengths, each read into the compressed
    (H2O) or prefill (CHESS, here as a `Pipeline`'s decode stage) pool and answered, give the uniform session's
    tokens (CHESS: and backtracks, which fire), each head ends at the uniform cache's length (H2O: the positions it
    kept too), and the pool the questions start from is left as it was."""
    pol, ps, new = (H2O_POLICY, H2O_PS, H2O_NEW) if policy == "h2o" else (Pipeline(decode=CHESS8), CHESS_PS,
                                                                           CHESS_NEW)
    tokens, kw = rng.integers(1, CFG.vocab_size, (2, T)), _kw(ps)
    questions = [(rng.integers(1, CFG.vocab_size, (2, TQ)), np.array(q)) for q in ([TQ, 3], [7, TQ])]
    uniform, pooled = (engine.Session.start(params, pol, tokens, max_new_tokens=new, question_tokens=TQ, pool=pool,
                                            **kw) for pool in (False, True))
    start = np.asarray(pooled.compress().cache.lengths)
    answers = []
    for question, lengths in questions:
        want, got = uniform.ask(question, lengths), pooled.ask(question, lengths)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        np.testing.assert_array_equal(np.asarray(got.cache.lengths), _heads(want.cache.length))
        if policy == "h2o":
            np.testing.assert_array_equal(np.asarray(want.cache.length), _kept() + lengths)
            _check_positions(_positions(got.cache), _positions(want.cache))
        else:
            np.testing.assert_array_equal(np.asarray(want.stats["backtracks"]), [2, 2])
            np.testing.assert_array_equal(np.asarray(got.stats["backtracks"]), [2, 2])
            np.testing.assert_array_equal(np.asarray(want.cache.length), LENGTHS + lengths + new - 1)
        np.testing.assert_array_equal(np.asarray(pooled.compressed.cache.lengths), start)
        answers.append(np.asarray(got.tokens))
    assert not np.array_equal(*answers)  # the questions matter


def test_chess_reads_a_suffix_on_the_pool_and_backtracks_as_the_uniform_layout(params, rng):
    """`generate` with a suffix: the uniform layout's tokens, backtracks
    (every row takes its first generated page back twice), rebuilds, changed regenerations and pages read (fewer
    than every page); at the end each head holds the uniform cache's length (prompt + suffix + decoded tokens) in
    exactly the pages of that length (the rewound pages were refilled, none popped again)."""
    prompt, kw = _prompt(rng), _kw(CHESS_PS)
    tokens = prompt.pop("tokens")
    want = generate(params, CHESS8, tokens, max_new_tokens=CHESS_NEW, **prompt, **kw)
    got = generate(params, CHESS8, tokens, max_new_tokens=CHESS_NEW, pool=True, **prompt, **kw)
    assert isinstance(got.cache, PoolCache)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(want.stats["backtracks"]), [2, 2])  # the rewinds fired, in both rows
    for key in ("backtracks", "reselections", "changed_backtracks"):
        np.testing.assert_array_equal(np.asarray(got.stats[key]), np.asarray(want.stats[key]), err_msg=key)
    read = np.asarray(want.stats["kv_read_fraction"])
    assert (read < 0.95).any(), read
    np.testing.assert_allclose(np.asarray(got.stats["kv_read_fraction"]), read, rtol=1e-6)
    length = LENGTHS + SUFFIX + CHESS_NEW - 1
    np.testing.assert_array_equal(np.asarray(want.cache.length), length)
    np.testing.assert_array_equal(np.asarray(got.cache.lengths), _heads(length))
    np.testing.assert_array_equal(np.asarray(got.cache.alloc.held).reshape(2, 2, 2), _heads(pages_for(length,
                                                                                                      CHESS_PS)))


def test_chess_after_a_suffix_on_a_shuffled_pool_rewinds_step_by_step_as_the_uniform_cache(params, rng):
    """After the prefill the pool's pages are moved at random and every free page filled with junk; the suffix then
    opens some. Decoding greedily one jitted `decode_step` at a time on either layout, each rewind applied as
    `decode_loop` applies it: after the suffix and every step the logits (1e-5), pages read and rewinds are the
    uniform cache's, and so are the lengths after every rewind, which never go below the prompt and its suffix
    (a backtrack takes back decoded tokens only); the suffix's positions are still at their slots at the end.
    CHESS as a `Pipeline`'s decode stage, the sessions keeping the suffix's room (``question_tokens``) and `begin`
    reading it as `Session.ask` reads a question: the ask test's sessions, so the prefill, compress and suffix programs
    compiled once serve both (`generate` reads a run's own ``suffix`` before CHESS alone: the test above)."""
    prompt, kw = _prompt(rng), _kw(CHESS_PS)
    tokens = prompt.pop("tokens")
    N = 72  # the default prefill pool: the prompt's 2·2·2·5 = 40 pages, 32 free (each head grows to 8 pages: 64)
    uniform, pooled = (engine.Session.start(params, Pipeline(decode=CHESS8), tokens, max_new_tokens=CHESS_NEW,
                                            question_tokens=TQ, pool=pool, **kw) for pool in (False, True))
    pre = pooled.prefill()
    assert pre.cache.num_pages == N and int(pre.cache.alloc.num_free) == N - 40
    pooled.prefilled = pre.replace(cache=shuffle_pages(pre.cache, rng.permutation(N), junk_like(rng)))
    got, ref = (decode_rewinding(params, _with_suffix(session, prompt), CHESS_NEW - 1) for session in (pooled, uniform))
    assert got["free_after_begin"] < N - 40  # the suffix opened junk pages
    np.testing.assert_allclose(got["logits"], ref["logits"], atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got["read"], ref["read"], rtol=1e-6)
    np.testing.assert_array_equal(got["rewind"], ref["rewind"])
    assert (ref["rewind"] == CHESS_PS).sum(0).tolist() == [2, 2], ref["rewind"]  # both rows rewound twice
    np.testing.assert_array_equal(got["lengths"], np.broadcast_to(ref["lengths"][:, None, :, None],
                                                                  got["lengths"].shape))
    floor = LENGTHS + SUFFIX
    assert (ref["lengths"] >= floor).all()
    back = ref["rewind"] > 0  # [steps, B]: each takes the first generated page back, down to the question's end
    np.testing.assert_array_equal(ref["lengths"][back], floor[np.nonzero(back)[1]])
    pos = np.asarray(_logical_positions(got["cache"]))
    for b in range(2):  # the question, never rewound, still at its slots in every layer and head
        np.testing.assert_array_equal(pos[:, b, :, LENGTHS[b]:floor[b]],
                                      np.broadcast_to(LENGTHS[b] + np.arange(SUFFIX[b]), (2, 2, SUFFIX[b])))


def _with_suffix(session: engine.Session, prompt: dict) -> SimpleNamespace:
    """``session`` as `conftest.decode_rewinding` reads it (``run``, ``begin()``), its `begin` reading ``prompt``'s
    suffix."""
    return SimpleNamespace(run=session.run, begin=lambda: session.begin(prompt["suffix"], prompt["suffix_lengths"]))


def test_a_suffix_before_h2o_and_chess_is_admitted_on_a_pool(params, rng):
    """Before jit: a suffix or question room on a pool before H2O (its decode pool sized for its budget and the widest
    suffix, `H2O.compressed_pages`' ``suffix_tokens``) and before CHESS, alone or as a pipeline's decode stage (its
    prefill pool of today's cache size: ``pool_pages`` unset); H2O after another compressor is still refused, suffix
    or not, naming why."""
    prompt = _prompt(rng)
    tokens = prompt.pop("tokens")
    kept = _kept()
    for room, extra in ((TQ, prompt), (7, {"question_tokens": 7})):
        run = engine.setup(params, H2O(0.25), tokens, lengths=LENGTHS, page_size=H2O_PS, pool=True, **extra)
        assert run.question_tokens == room
        assert run.pool_pages == CFG.num_layers * CFG.num_kv_heads * sum(pages_for(int(n) + room, H2O_PS)
                                                                         for n in kept)
        for chess in (CHESS8, Pipeline(decode=CHESS8), parse_policy("chess()")):
            assert engine.setup(params, chess, tokens, lengths=LENGTHS, page_size=CHESS_PS, pool=True,
                                **extra).pool_pages is None
    # without a suffix the bound is the budget's pages, as before
    assert engine.setup(params, H2O(0.25), tokens, lengths=LENGTHS, page_size=H2O_PS, pool=True).pool_pages == (
        CFG.num_layers * CFG.num_kv_heads * sum(pages_for(int(n), H2O_PS) for n in kept))
    with pytest.raises(ValueError, match=r"its decode stage \(H2O\) writes in place .* after a compress stage "
                                         r"\(SnapKV\) other than its own"):
        engine.setup(params, parse_policy("pipeline(compress=snapkv(0.5), decode=h2o(0.25))"), tokens, pool=True,
                     **prompt)
