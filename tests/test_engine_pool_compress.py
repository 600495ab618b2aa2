"""The scored compressors on a page pool, ``Options(pool=True)`` (issue 38, docs/PAGE_POOL.md, migration step
4's second slice; experimental): SnapKV, StreamingLLM, AdaKV(SnapKV) and PyramidKV(SnapKV) prefill into the
prefill pool, write each head's kept entries into a fresh decode pool (no holes) and decode from it. Against
the default uniform path: the same tokens (`generate`) and `teacher_force` logits within 1e-5 on the jnp
path and the interpreted kernel, fp32 and int8 (where the layouts quantise the same pages: below); the
decode pool owns exactly ``Σ ceil(count / ps)`` pages after compression; AdaKV's pool is SnapKV's memory
within a page per head while its uniform cache is several times larger; a pool one page short raises after
the run; HeadSplit or BSER (drawn from the seed), the other compressors admitted, run too; policies that cannot
run on a pool are refused by name before jit.

int8 with per-head counts (AdaKV, PyramidKV): the uniform cache appends every head's token at its row's
length (after the holes), the pool at the head's own count, in the page of its last kept entries, so the
pages int8 scales are taken over hold other entries and the logits differ at int8's rounding, not at
1e-5 (docs/PAGE_POOL.md). There the pool's int8 logits are held to the fp32 logits as closely as the
uniform int8 logits are (and AdaKV's exact agreement on the kernel is checked in fp32).

Tiny random models; the prompts are drawn from the run's seed (tests/conftest.py: printed in the header,
``pytest --seed N`` replays it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax import engine
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import pages_for
from sparsekv_jax.cache_pool import owned
from sparsekv_jax.cache_pooled import PoolCache
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import expected_shapes, params_from_arrays
from sparsekv_jax.policies import FullKV, SnapKV, parse_policy
from sparsekv_jax.policies.base import Policy
from sparsekv_jax.policies.bser import BSER
from sparsekv_jax.policies.headsplit import HeadSplit

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=512, eos_token_ids=(0,))
T, LENGTHS, NEW, PS = 40, np.array([40, 29]), 6, 8
POLICIES = {"snapkv": "snapkv(0.25, window=4)", "streaming_llm": "streaming_llm(0.25, sinks=2)",
            "adakv": "adakv(snapkv(0.25, window=4))", "pyramidkv": "pyramidkv(snapkv(0.25, window=4))",
            # merges (its write is common.write_entries itself): fixed blocks, no tokenizer's delimiters needed
            "semanticache": "semanticache(0.5, sinks=2, window=4, chunking='fixed', chunk_size=16)"}
PER_HEAD = ("adakv", "pyramidkv", "semanticache")  # heads (or layers) keep different counts
CASES = {"jnp-fp32": Backend(), "jnp-int8": dataclasses.replace(Backend(), kv_dtype="int8"),
         "kernel-fp32": Backend.kernels(), "kernel-int8": dataclasses.replace(Backend.kernels(), kv_dtype="int8")}
# each policy on the jnp path in fp32 but two: one whose heads keep equal counts in int8 on the jnp path (the logits
# within 1e-5), and one whose heads do not on the interpreted kernel (every compile of it is slow), in int8 (held to
# fp32 as closely as the uniform int8 logits are) and in fp32 (its exact agreement on the kernel; its int8 reference
# is that run's uniform program, compiled once). Which two: drawn from the run's seed, so every policy runs in each
# of its cases over runs and a failing draw replays with ``--seed``. (Equal counts in int8 on the kernel: the
# shuffled-pool test of tests/test_engine_pool_extend.py, FullKV or SnapKV, each run.)
_DRAW = seeded_rng()
EQUAL_INT8 = str(_DRAW.choice([p for p in POLICIES if p not in PER_HEAD]))
PER_HEAD_KERNEL = str(_DRAW.choice(PER_HEAD))
RUNS = ([(p, "jnp-fp32") for p in POLICIES if p not in (EQUAL_INT8, PER_HEAD_KERNEL)]
        + [(EQUAL_INT8, "jnp-int8"), (PER_HEAD_KERNEL, "kernel-fp32"), (PER_HEAD_KERNEL, "kernel-int8")])


def _random_params(cfg: ModelConfig, rng: np.random.Generator):
    """`random_params`' weights (norms near 1, the rest normal at scale 0.3) drawn with NumPy: drawn by JAX eagerly,
    each weight's shape compiled programs of its own (~2 s a model)."""
    return params_from_arrays(cfg, {name: jnp.asarray(1 + 0.1 * rng.standard_normal(shape) if name.endswith("norm")
                                                      else 0.3 * rng.standard_normal(shape), jnp.float32)
                                    for name, shape in expected_shapes(cfg).items()})


@pytest.fixture(scope="module")
def params():
    return _random_params(CFG, seeded_rng())


def _live_counts(cache) -> np.ndarray:
    """``[L, B, H]`` live entries of each head of a uniform cache (holes have position -1)."""
    pos = np.asarray(cache.layers.positions)
    return ((pos >= 0) & (np.arange(pos.shape[-1]) < np.asarray(cache.length)[None, :, None, None])).sum(-1)


def _check_decode_pool(pool: PoolCache, counts: np.ndarray) -> None:
    """The decode pool after compression: each head's length is its count, it owns exactly ``ceil(count/ps)``
    pages, no page twice, and the rest of the pool is free."""
    assert isinstance(pool, PoolCache) and pool.prompt_pages == 0
    np.testing.assert_array_equal(np.asarray(pool.lengths), counts)
    held = np.asarray(pool.alloc.held).reshape(counts.shape)
    np.testing.assert_array_equal(held, -(-counts // PS))
    ids = np.asarray(pool.alloc.table)[np.asarray(owned(pool.alloc))]
    assert ids.size == (-(-counts // PS)).sum() and np.unique(ids).size == ids.size and ids.max() < pool.num_pages
    assert int(pool.alloc.num_free) == pool.num_pages - ids.size


@pytest.mark.share(2)
@pytest.mark.parametrize("policy, case", RUNS)
def test_compressor_on_the_pool_gives_the_uniform_tokens_and_logits(params, rng, policy, case):
    """`generate` and `teacher_force` with ``pool=True``: the default path's tokens and logits (within 1e-5;
    int8 with per-head counts: the module docstring); on the jnp fp32 path, the decode pool after the
    compress stage holds each head's count of the uniform cache's live entries in exactly its pages (for
    SemantiCache, whose heads keep different counts of merged entries, also within its `compressed_pages`). int8 with
    per-head counts on the kernel: `teacher_force`'s logits only, along random tokens (its tokens and stats are the
    kernel-fp32 case's, the same policy's, in the same run)."""
    pol, backend = parse_policy(POLICIES[policy]), CASES[case]
    kw = dict(lengths=LENGTHS, page_size=PS, backend=backend, stop_tokens=())
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    if case == "kernel-int8" and policy in PER_HEAD:  # logits only (the module docstring), along random tokens: its
        # tokens, stats and pool on the kernel are the kernel-fp32 case's, run with it
        forced = rng.integers(1, CFG.vocab_size, (2, NEW))
        want_logits, _ = teacher_force(params, pol, tokens, forced, **kw)
        got_logits, _ = teacher_force(params, pol, tokens, forced, pool=True, **kw)
        ref, _ = teacher_force(params, pol, tokens, forced, **{**kw, "backend": CASES["kernel-fp32"]})
        np.testing.assert_array_equal(np.asarray(got_logits)[:, 0], np.asarray(want_logits)[:, 0])  # the prefill's
        pool_err = np.abs(np.asarray(got_logits) - np.asarray(ref)).max()
        uniform_err = np.abs(np.asarray(want_logits) - np.asarray(ref)).max()
        print(f"{policy} int8: max |logit - fp32 logit| pool {pool_err:.4f}, uniform {uniform_err:.4f}")
        assert pool_err <= 2 * uniform_err + 1e-3, (pool_err, uniform_err)
        return
    want = generate(params, pol, tokens, max_new_tokens=NEW, **kw)
    forced = np.asarray(want.tokens)
    want_logits, _ = teacher_force(params, pol, tokens, forced, **kw)
    if case == "jnp-fp32":  # the session's steps: the pool after the compress stage, then the decode
        session = engine.Session.start(params, pol, tokens, max_new_tokens=NEW, pool=True, **kw)
        counts = _live_counts(want.cache) - (NEW - 1)  # every head appended the NEW - 1 tokens fed back
        _check_decode_pool(session.compress().cache, counts)
        if policy == "semanticache":  # merged: heads keep different counts, some fewer than the budget
            assert len(np.unique(counts)) > 1, counts
            assert session.run.pool_pages >= (-(-(counts + NEW - 1) // PS)).sum()
        got = session.decode()
    else:
        got = generate(params, pol, tokens, max_new_tokens=NEW, pool=True, **kw)
    got_logits, _ = teacher_force(params, pol, tokens, forced, pool=True, **kw)
    assert isinstance(got.cache, PoolCache)
    np.testing.assert_array_equal(np.asarray(got.stats["kv_stored_fraction"]),
                                  np.asarray(want.stats["kv_stored_fraction"]))
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)


# 8 KV heads: AdaKV's uniform cache gives every head its largest head's bound, 8n - 7·floor(n/5) entries
def test_headsplit_and_bser_on_the_pool(params, rng):
    """The other two compressors `run.pool_refusal` admits (their write is `write_kept`, their decode full
    attention's): HeadSplit (random head scores: per-head counts) and BSER (one index set per row, from its
    blocks) on a longer prompt, jnp fp32: `generate`'s tokens equal and `teacher_force`'s logits within 1e-5. One of
    the two a run, drawn from the run's seed (each over runs, a failure replays with ``--seed``): each compiles its
    own four programs."""
    tokens = rng.integers(1, CFG.vocab_size, (2, 256))
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    kw = dict(lengths=np.array([256, 200]), page_size=PS, stop_tokens=())
    head_scores = jnp.asarray(rng.normal(size=(CFG.num_layers, CFG.num_kv_heads)), jnp.float32)
    policies = (HeadSplit(SnapKV(0.25, window=4), sinks=2, window=4, head_scores=head_scores),
                BSER(budget=0.25, block_size=16, window=4, tail=4, sinks=2, min_question=8, max_question=32))
    for pol in policies[int(rng.integers(2)):][:1]:
        print(f"policy: {type(pol).__name__}")
        want = generate(params, pol, tokens, max_new_tokens=NEW, **kw)
        got = generate(params, pol, tokens, max_new_tokens=NEW, pool=True, **kw)
        assert isinstance(got.cache, PoolCache)
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
        want_logits, _ = teacher_force(params, pol, tokens, forced, **kw)
        got_logits, _ = teacher_force(params, pol, tokens, forced, pool=True, **kw)
        np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)


MEM_CFG = dataclasses.replace(CFG, num_heads=8, num_kv_heads=8)


def test_adakv_pool_is_snapkv_memory(rng):
    """At the same budget AdaKV's decode pool (sized by its `compressed_pages`) is within a page per (layer,
    row, KV head) of SnapKV's, in pages and in `PoolCache.nbytes()` (plus its wider tables), and the pages
    its heads hold are too; its uniform cache, every head at the largest head's capacity, is several times
    its pool."""
    p = _random_params(MEM_CFG, rng)
    T2, ps = 128, 8
    tokens = rng.integers(1, MEM_CFG.vocab_size, (2, T2))
    kw = dict(lengths=np.array([128, 100]), page_size=ps, max_new_tokens=2, stop_tokens=())
    snap, ada = parse_policy("snapkv(0.25, window=4)"), parse_policy("adakv(snapkv(0.25, window=4))")
    s = generate(p, snap, tokens, pool=True, **kw).cache
    a = generate(p, ada, tokens, pool=True, **kw).cache
    uniform = generate(p, ada, tokens, **kw).cache
    L, B, H = MEM_CFG.num_layers, 2, MEM_CFG.num_kv_heads
    assert 0 <= a.num_pages - s.num_pages <= L * B * H, (a.num_pages, s.num_pages)
    # a page: its slots and summaries, and its entry on the allocator's free stack
    # (its leaves' sizes read from their shapes: x[0] of a device array was an eager slice, compiled)
    page_bytes = (sum(x.size // x.shape[0] * x.dtype.itemsize for x in jax.tree.leaves(s.pages))
                  + s.alloc.free.dtype.itemsize)
    table_bytes = (a.max_pages_per_head - s.max_pages_per_head) * L * B * H * 4
    assert a.nbytes() - s.nbytes() == (a.num_pages - s.num_pages) * page_bytes + table_bytes
    held_a, held_s = int(np.asarray(a.alloc.held).sum()), int(np.asarray(s.alloc.held).sum())
    assert abs(held_a - held_s) <= L * B * H, (held_a, held_s)  # either may waste a partial page per head
    np.testing.assert_array_equal(np.asarray(a.lengths).sum(-1), np.asarray(s.lengths).sum(-1))  # same totals
    print(f"SnapKV pool {s.num_pages} pages {s.nbytes()} B; AdaKV pool {a.num_pages} pages {a.nbytes()} B; "
          f"AdaKV uniform {uniform.nbytes()} B ({uniform.nbytes() / a.nbytes():.2f}x its pool)")
    assert uniform.nbytes() > 3 * a.nbytes()


def test_a_compressed_pool_one_page_short_raises_after_the_run(params, rng):
    """AdaKV's decode pool of exactly the pages its run holds at the end decodes as the default pool does
    and ends with no free page; one page fewer runs out while decoding, a pool smaller than the compression
    runs out at the compress stage: both raise after the run, naming the pool's size and the policy's bound."""
    pol = parse_policy(POLICIES["adakv"])
    kw = dict(lengths=LENGTHS, page_size=PS, max_new_tokens=NEW, stop_tokens=(), pool=True)
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    full = generate(params, pol, tokens, **kw)
    bound = engine.setup(params, pol, tokens, **kw).pool_pages
    assert full.cache.num_pages == bound
    need = int(np.asarray(full.cache.alloc.held).sum())  # pages are taken only as heads fill them
    assert need < bound
    exact = generate(params, pol, tokens, pool_pages=need, **kw)
    np.testing.assert_array_equal(np.asarray(exact.tokens), np.asarray(full.tokens))
    assert int(exact.cache.alloc.num_free) == 0
    for short in (need - 1, 3):  # 3 pages: too few for the compressed prompt itself
        with pytest.raises(ValueError, match=rf"pool_pages={short} pages .*needs up to {bound} pages "
                                             r"\(AdaKV\(SnapKV\)\.compressed_pages"):
            generate(params, pol, tokens, pool_pages=short, **kw)


class _OwnWrite(Policy):
    """A compress stage that writes its cache itself (no ``writes_entries``): the pool must refuse it."""

    stages = ("compress",)


def test_policies_that_cannot_run_on_a_pool_are_refused_by_name(params, rng):
    """Before jit: a decode stage that is not full attention's nor only selects pages (H2O, CHESS, a pipeline's),
    a prefill stage (Stem), a compress stage that does not declare its write is `write_entries` (every shipped
    compressor does: a stand-in), a bad pool_pages."""
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    for spec, why in [("chess(keys='post_rope')", r"policy CHESS.* .*its decode stage \(CHESS.*\) reads post-RoPE "
                                                   r"page sums"),  # pre-RoPE CHESS runs: test_engine_pool_chess.py
                      ("pipeline(compress=snapkv(0.5, window=4), decode=h2o(0.5))", r"its decode stage \(H2O\)"),
                      ("stem()", r"policy Stem .*its prefill stage \(Stem\)"),
                      (_OwnWrite(), r"policy _OwnWrite .*its compress stage \(_OwnWrite\) does not write through "
                                    r"policies.common.write_entries")]:
        with pytest.raises(ValueError, match=rf"pool=True is experimental and {why}" if why.startswith("policy")
                           else why):
            engine.setup(params, parse_policy(spec) if isinstance(spec, str) else spec, tokens, pool=True)
    snap = parse_policy(POLICIES["snapkv"])
    with pytest.raises(ValueError, match="pool_pages=0 must be >= 1"):
        engine.setup(params, snap, tokens, pool=True, pool_pages=0)
    with pytest.raises(ValueError, match="pool_pages=2.5 must be an int"):
        engine.setup(params, snap, tokens, pool=True, pool_pages=2.5)
    # the policy's bound, by hand: SnapKV keeps floor(0.25·length) per head, then NEW tokens more
    run = engine.setup(params, snap, tokens, pool=True, page_size=PS, max_new_tokens=NEW, lengths=LENGTHS)
    by_hand = CFG.num_layers * CFG.num_kv_heads * sum(pages_for(int(0.25 * n) + NEW, PS) for n in LENGTHS)
    assert run.pool_pages == by_hand
    assert engine.setup(params, FullKV(), tokens, pool=True).pool_pages is None  # full attention: today's size
