"""A suffix read into a page pool after compression, ``Options(pool=True)`` (issue 38, docs/PAGE_POOL.md, Lifecycle →
Extend; experimental): the question-agnostic case. The context is compressed first, then `engine.prefill.extend`
(`extend_pool`) grows every (layer, row, KV head) by its row's suffix length from the pool's free pages
(`cache_pooled.grow_tokens`), writes the suffix's K/V at each head's own logical slots after the entries it kept
(`cache_pooled.write_tokens_pool`) and attends to the pool through its tables, causally over the suffix.

Against the default uniform layout, for FullKV, SnapKV(0.5), AdaKV(SnapKV(0.5)) (heads keep different counts: the
uniform cache writes the suffix after the row's largest count, the pool after each head's own) and a SnapKV→Quest
pipeline, batch 2 with different prompt (40, 29) and suffix (5, 11) lengths, pages of 8: `generate`'s greedy tokens
equal and `teacher_force`'s logits within 1e-5 (fp32, jnp path; int8 on the interpreted kernel: the shuffled pool below,
FullKV or SnapKV drawn from the run's seed); after the suffix each head's length is its compressed length plus the row's
suffix length, the suffix's K/V and positions sit at those logical slots (equal to the uniform cache's at the row's
slots), each head holds exactly ``ceil(length / ps)`` pages (full attention: at least its prompt's), no page twice, the
rest free; a pool whose pages were moved at random with junk (NaN, random codes) in every free page gives the same; a
pool one page short of what the suffix and the decode need raises after the run; `Session.ask` answers two questions
from one compressed pool as the uniform path does and leaves it as it was; StreamingLLM, PyramidKV and SemantiCache with
a suffix give the uniform logits; bad input to the helpers is refused by name. A suffix before H2O and CHESS:
tests/test_engine_pool_suffix_h2o_chess.py.

Tiny random models; the prompts and suffixes are drawn from the run's seed (tests/conftest.py: printed in the
header, ``pytest --seed N`` replays it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import decode_forced, seeded_rng

from sparsekv_jax import engine
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import pages_for
from sparsekv_jax.cache_pool import owned
from sparsekv_jax.cache_pooled import PoolCache, grow_tokens, init_pool, layer_kv, shuffle_pages, write_tokens_pool
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import expected_shapes, params_from_arrays
from sparsekv_jax.pallas.testing import junk_like
from sparsekv_jax.policies import parse_policy

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=512, eos_token_ids=(0,))
T, LENGTHS, TQ, SUFFIX, NEW, PS = 40, np.array([40, 29]), 11, np.array([5, 11]), 6, 8
POLICIES = {"fullkv": "fullkv", "snapkv": "snapkv(0.5, window=4)", "adakv": "adakv(snapkv(0.5, window=4))",
            "snapkv_quest": "pipeline(compress=snapkv(0.5, window=4), decode=quest(0.25))"}
CASES = {"jnp-fp32": Backend(), "kernel-int8": dataclasses.replace(Backend.kernels(), kv_dtype="int8")}
# each policy once on the jnp path in fp32; the interpreted kernel in int8 (every compile of it is slow) once a run, in
# the shuffled-pool test (tokens and the logits step by step from a pool with junk), with FullKV or SnapKV drawn from
# the run's seed (each over runs, a failure replays with ``--seed``)
INT8_POLICY = ("fullkv", "snapkv")[int(seeded_rng().integers(2))]
# the other compressors whose write is common.write_entries (their logits only)
OTHERS = {"streaming_llm": "streaming_llm(0.25, sinks=2)", "pyramidkv": "pyramidkv(snapkv(0.25, window=4))",
          "semanticache": "semanticache(0.5, sinks=2, window=4, chunking='fixed', chunk_size=16)"}


@pytest.fixture(scope="module")
def params():
    """`random_params`' weights (norms near 1, the rest normal at scale 0.3) drawn with NumPy: drawn by JAX eagerly,
    each weight's shape compiled programs of its own (~2 s a module)."""
    rng = seeded_rng()
    return params_from_arrays(CFG, {name: jnp.asarray(1 + 0.1 * rng.standard_normal(shape) if name.endswith("norm")
                                                      else 0.3 * rng.standard_normal(shape), jnp.float32)
                                    for name, shape in expected_shapes(CFG).items()})


def _prompt(rng: np.random.Generator) -> dict:
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    suffix = rng.integers(1, CFG.vocab_size, (2, TQ))
    return dict(tokens=tokens, lengths=LENGTHS, suffix=suffix, suffix_lengths=SUFFIX)


def _kw(case: str) -> dict:
    return dict(page_size=PS, stop_tokens=(), backend=CASES[case])


def _sessions(params, spec: str, prompt: dict, case: str, **extra) -> tuple[engine.Session, engine.Session]:
    """The uniform and the pooled session of one run."""
    p = dict(prompt)
    tokens = p.pop("tokens")
    return tuple(engine.Session.start(params, parse_policy(spec), tokens, max_new_tokens=NEW, pool=pool, **p,
                                      **_kw(case), **extra) for pool in (False, True))


_layer_kv = jax.jit(layer_kv, static_argnums=1)  # one program (eagerly: one per gather and reshape)


def _check_pages(pool: PoolCache, lengths: np.ndarray, at_least: int = 0) -> None:
    """Each head holds ``max(at_least, ceil(length / ps))`` pages, no page twice, every other page free."""
    held = np.asarray(pool.alloc.held).reshape(lengths.shape)
    np.testing.assert_array_equal(held, np.maximum(-(-lengths // PS), at_least))
    ids = np.asarray(pool.alloc.table)[np.asarray(owned(pool.alloc))]
    assert ids.size == held.sum() and np.unique(ids).size == ids.size and ids.max() < pool.num_pages
    assert int(pool.alloc.num_free) == pool.num_pages - ids.size


@pytest.mark.share(2)
@pytest.mark.parametrize("policy", list(POLICIES))
def test_suffix_on_the_pool_gives_the_uniform_tokens_and_logits(params, rng, policy):
    """A pooled `Session` whose pool, after compression, has its pages moved by a random permutation and every free
    page filled with junk (NaN, random codes and positions); the suffix then opens some of them, so it is written and
    read only through the tables. Its greedy tokens equal the uniform layout's (`generate`), its logits after the suffix
    and step by step (`decode_forced`) the uniform `teacher_force`'s (1e-5); the suffix matters (the logits without it
    differ); after `begin` each head's length is its compressed length plus its row's suffix length, the suffix's K/V
    and positions are at those logical slots, and the pool holds no page more than the heads need. The session keeps
    the suffix's room (``question_tokens``) and `begin` reads it, as `Session.ask` reads a question: FullKV's and
    AdaKV's are the ask test's sessions, their programs compiled once for both. (A run's own ``suffix`` on the pool:
    `generate` and `teacher_force`, the programs that fuse these steps, and the int8 sessions: the tests below.)"""
    spec, prompt = POLICIES[policy], _prompt(rng)
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    want = generate(params, parse_policy(spec), max_new_tokens=NEW, **prompt, **_kw("jnp-fp32"))
    want_logits, _ = teacher_force(params, parse_policy(spec), forced=forced, **prompt, **_kw("jnp-fp32"))
    want_logits = np.asarray(want_logits)

    pooled = engine.Session.start(params, parse_policy(spec), prompt["tokens"], lengths=LENGTHS, max_new_tokens=NEW,
                                  question_tokens=TQ, pool=True, **_kw("jnp-fp32"))
    compressed = pooled.compress()
    before = compressed.cache
    free = int(before.alloc.num_free)
    assert free > 0
    pooled.compressed = compressed.replace(cache=shuffle_pages(before, rng.permutation(before.num_pages),
                                                               junk_like(rng)))
    after = pooled.begin(prompt["suffix"], prompt["suffix_lengths"])
    assert int(after.cache.alloc.num_free) < free  # the suffix took some of the junk pages
    np.testing.assert_allclose(np.asarray(after.logits), want_logits[:, 0], atol=1e-5, rtol=1e-5)
    # the suffix changes the answer: the logits after it are not the prompt's last token's
    assert np.abs(np.asarray(compressed.logits) - np.asarray(after.logits)).max() > 1e-2
    n0 = np.asarray(before.lengths)  # [L, B, Hkv] what each head kept
    grown = np.asarray(after.cache.lengths)
    np.testing.assert_array_equal(grown, n0 + SUFFIX[None, :, None])
    _check_pages(after.cache, grown, at_least=pages_for(T, PS) if policy == "fullkv" else 0)
    # the suffix's entries: at each head's slots n0 .. n0 + q on the pool, at the row's slots on the uniform cache
    # on the uniform cache `generate` left: its decode appended after the suffix and wrote no earlier slot (none of
    # these policies evicts while decoding), so the row's compressed length is its length less the suffix and decode
    row = np.asarray(want.cache.length) - SUFFIX - (NEW - 1)
    nxt = np.asarray(before.next_position)
    # on the host (sliced on the device, each slice's shape compiled a program of its own)
    ulayers = {name: np.asarray(getattr(want.cache.layers, name)) for name in ("positions", "k", "v")}
    for layer in range(CFG.num_layers):
        kv = _layer_kv(after.cache, layer)
        pooled_layer = {name: np.asarray(getattr(kv, name)) for name in ("positions", "k", "v")}
        for b in range(2):
            q = SUFFIX[b]
            for h in range(CFG.num_kv_heads):
                s = n0[layer, b, h]
                np.testing.assert_array_equal(pooled_layer["positions"][b, h, s:s + q], nxt[b] + np.arange(q))
                np.testing.assert_array_equal(ulayers["positions"][layer, b, h, row[b]:row[b] + q],
                                              nxt[b] + np.arange(q))
                if not kv.quantized:
                    for name in ("k", "v"):
                        np.testing.assert_allclose(pooled_layer[name][b, h, s:s + q],
                                                   ulayers[name][layer, b, h, row[b]:row[b] + q],
                                                   atol=1e-5, rtol=1e-5)  # layer 1: layer 0 summed in another order
    got = pooled.decode(after)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(decode_forced(params, pooled, forced, after)[0], want_logits, atol=1e-5, rtol=1e-5)
    if policy != "fullkv":
        _check_pages(got.cache, np.asarray(got.cache.lengths))  # after the decode too


@pytest.mark.parametrize("policy, case", [(INT8_POLICY, "kernel-int8")], ids=["kernel-int8"])
def test_a_shuffled_pool_with_junk_reads_the_suffix_the_same(params, rng, policy, case):
    """The shuffled pool of the test above on the interpreted kernel in int8, the module's one run of it, FullKV or
    SnapKV (`INT8_POLICY`, drawn from the run's seed): tokens and the logits after the suffix and step by step equal
    the uniform layout's."""
    spec, prompt = POLICIES[policy], _prompt(rng)
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    uniform, pooled = _sessions(params, spec, prompt, case)
    # the reference logits: the uniform session fed `forced` step by step, the pool's own kind of program. (int8:
    # `teacher_force` differed by 4.4e-4 on the CI draw of seed 388345640, where the pool's codes and scales equal
    # the uniform session's exactly. Established: `teacher_force` computed the prompt's K/V in one program with
    # XLA's dots, the sessions in their prefill program with oneDNN's (`Backend.prefill_dots`), ~1e-6 apart, and
    # an int8 code on a rounding boundary went the other way; its scanned decode steps equal these exactly. Now
    # `teacher_force` runs the sessions' programs before decoding, `programs.prepare_apart`, and gives these
    # logits exactly: tests/test_teacher_force_programs.py.)
    ready = uniform.begin()
    want_logits, _ = decode_forced(params, uniform, forced, ready)
    want = uniform.decode(ready)  # the uniform session's tokens (its steps' programs: `generate`'s, step by step)
    compressed = pooled.compress()
    pool = compressed.cache
    free = int(pool.alloc.num_free)
    assert free > 0
    pooled.compressed = compressed.replace(cache=shuffle_pages(pool, rng.permutation(pool.num_pages), junk_like(rng)))
    ready = pooled.begin()
    assert int(ready.cache.alloc.num_free) < free  # the suffix took some of the junk pages
    got = pooled.decode(ready)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(decode_forced(params, pooled, forced, ready)[0], want_logits, atol=1e-5, rtol=1e-5)


def test_a_pool_one_page_short_of_the_suffix_raises_after_the_run(params, rng):
    """Full attention with a suffix: a pool of exactly ``L·Hkv·Σ_b pages_for(length_b + suffix_b + new - 1)`` pages
    decodes as the default-sized one and ends with none free; one page fewer raises, naming that number."""
    prompt = _prompt(rng)
    need = CFG.num_layers * CFG.num_kv_heads * sum(pages_for(int(n + q) + NEW - 1, PS) for n, q in zip(
        LENGTHS, SUFFIX, strict=True))
    want = generate(params, parse_policy("fullkv"), max_new_tokens=NEW, **prompt, **_kw("jnp-fp32"))
    got = generate(params, parse_policy("fullkv"), max_new_tokens=NEW, pool=True, pool_pages=need, **prompt,
                   **_kw("jnp-fp32"))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    assert int(got.cache.alloc.num_free) == 0
    with pytest.raises(ValueError, match=rf"pool_pages={need - 1} pages .* needs up to {need} pages"):
        generate(params, parse_policy("fullkv"), max_new_tokens=NEW, pool=True, pool_pages=need - 1, **prompt,
                 **_kw("jnp-fp32"))


@pytest.mark.parametrize("policy", ["fullkv", "adakv"])
def test_session_asks_two_questions_of_one_compressed_pool(params, rng, policy):
    """`Session.ask` on the pool: two questions of different lengths, each read into the compressed pool and
    answered, give the uniform session's answers, and the compressed pool is left as it was."""
    prompt = {k: v for k, v in _prompt(rng).items() if not k.startswith("suffix")}
    questions = [(rng.integers(1, CFG.vocab_size, (2, TQ)), np.array(q)) for q in ([TQ, 3], [7, TQ])]
    uniform, pooled = _sessions(params, POLICIES[policy], prompt, "jnp-fp32", question_tokens=TQ)
    kept = np.asarray(pooled.compress().cache.lengths)
    answers = []
    for question, lengths in questions:
        want, got = uniform.ask(question, lengths), pooled.ask(question, lengths)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        np.testing.assert_array_equal(np.asarray(got.cache.lengths),
                                      kept + (lengths + NEW - 1)[None, :, None])
        answers.append(np.asarray(got.tokens))
        np.testing.assert_array_equal(np.asarray(pooled.compressed.cache.lengths), kept)
    assert not np.array_equal(*answers)  # the questions matter


@pytest.mark.share(2)
@pytest.mark.parametrize("policy", list(OTHERS))
def test_the_other_compressors_read_a_suffix_as_the_uniform_path(params, rng, policy):
    """StreamingLLM, PyramidKV(SnapKV) (layers keep different counts) and SemantiCache (its merge writes
    `common.write_entries` itself) with a suffix: `teacher_force`'s logits on the pool equal the uniform layout's
    (1e-5); after the suffix each head holds its compressed length plus its row's suffix, in exactly the pages it
    needs."""
    prompt = _prompt(rng)
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    want, _ = teacher_force(params, parse_policy(OTHERS[policy]), forced=forced, **prompt, **_kw("jnp-fp32"))
    got, _ = teacher_force(params, parse_policy(OTHERS[policy]), forced=forced, pool=True, **prompt,
                           **_kw("jnp-fp32"))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    _, pooled = _sessions(params, OTHERS[policy], prompt, "jnp-fp32")
    kept, ready = np.asarray(pooled.compress().cache.lengths), pooled.begin()
    np.testing.assert_array_equal(np.asarray(ready.cache.lengths), kept + SUFFIX[None, :, None])
    _check_pages(ready.cache, kept + SUFFIX[None, :, None])


def test_bad_input_to_the_pool_extend_helpers_is_refused():
    """`grow_tokens` and `write_tokens_pool` name the bad value: shapes, dtypes, a negative count."""
    # the pool and the valid growth as one program each (eagerly, each op compiled on its own); the refusals run
    # eagerly, as a caller's would (the negative count is a check on the values)
    pool = jax.jit(lambda: init_pool(CFG, 2, 32, prompt=16, page_size=PS, dtype=jnp.float32))()
    with pytest.raises(ValueError, match=r"tokens must be an int array \[B=2\], got float32 of shape \(2,\)"):
        grow_tokens(pool, jnp.ones((2,), jnp.float32))
    with pytest.raises(ValueError, match=r"tokens must be an int array \[B=2\], got int32 of shape \(3,\)"):
        grow_tokens(pool, jnp.ones((3,), jnp.int32))
    with pytest.raises(ValueError, match="tokens must be >= 0, got a minimum of -1"):
        grow_tokens(pool, jnp.array([1, -1], jnp.int32))
    grown = jax.jit(grow_tokens)(pool, jnp.array([3, 5], jnp.int32))
    np.testing.assert_array_equal(np.asarray(grown.lengths), np.broadcast_to(np.array([3, 5])[None, :, None],
                                                                              (2, 2, 2)))
    k = jnp.zeros((2, 5, CFG.num_kv_heads, CFG.head_dim))
    start, written, pos = jnp.zeros((2, 2), jnp.int32), jnp.ones((2, 5), bool), jnp.zeros((2, 5), jnp.int32)
    with pytest.raises(ValueError, match=r"k_new/v_new must be \[B, T, Hkv, D\] with B, Hkv, D = 2, 2, 16"):
        write_tokens_pool(grown, 0, k[:, :, :1], k[:, :, :1], start, written, pos)
    with pytest.raises(ValueError, match=r"start must be \[B, Hkv\]=\[2, 2\], got shape \(2,\)"):
        write_tokens_pool(grown, 0, k, k, start[:, 0], written, pos)
    with pytest.raises(ValueError, match=r"written must be \[B, T\]=\[2, 5\], got shape \(2, 4\)"):
        write_tokens_pool(grown, 0, k, k, start, written[:, :4], pos)
