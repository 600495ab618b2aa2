"""Quest on a page pool, ``Options(pool=True)`` (issue 38, docs/PAGE_POOL.md, migration step 4; experimental):
its decode stage reads the page summaries through the page tables (`cache_pooled.layer_kv`, each head's own
length) and lists *logical* pages, which the decode kernel's pool mode and the jnp path map through the
tables. Against the default uniform path: the same tokens, `teacher_force` logits within 1e-5 and the same
pages read (``kv_read_fraction``), on the jnp path in fp32 (Quest pages of one and two cache pages), for a ragged
batch of 2; the same tokens, pages read and step-by-step logits after the pool's pages are moved at random with junk
in every free page (jnp fp32, and the interpreted kernel in int8); and a budget whose page
list covers every page in use (not the exact shortcut: the list is built) gives full attention's pool run.

Tiny random model (head_dim 16: the kernel's smallest); prompts drawn from the run's seed
(tests/conftest.py: printed in the header, ``pytest --seed N`` replays it)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import decode_forced, seeded_rng

from sparsekv_jax import engine
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache_pooled import PoolCache, shuffle_pages
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.pallas.testing import junk_like
from sparsekv_jax.policies import FullKV
from sparsekv_jax.policies.quest import Quest

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=256, eos_token_ids=(0,))
# row 0 fills 5 pages and opens a 6th and 7th while decoding, row 1 (29 tokens) its 4th and 5th
T, LENGTHS, NEW, PS = 40, np.array([40, 29]), 10, 8
BACKENDS = {"jnp": Backend(), "kernel": Backend.kernels(),  # the kernel interpreted on a CPU
            "kernel-int8": dataclasses.replace(Backend.kernels(), kv_dtype="int8")}
# 10 of 40 tokens: 2 pages of 8 per KV head (the newest one forced) in layer 1; layer 0 reads every page
QUEST = Quest(0.25, page_size=PS, dense_layers=1)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, scale=0.3)


def _kw(backend: str) -> dict:
    return dict(lengths=LENGTHS, page_size=PS, backend=BACKENDS[backend], stop_tokens=())


# Quest pages of two cache pages: 8 new tokens, so the capacity (48) is whole Quest pages (a capacity that is not,
# e.g. 7 cache pages, is tested on both layouts in tests/test_quest_partial_pages.py)
# (the interpreted kernel, whose every compile is slow: in int8 the shuffled-pool test below, each run; in fp32 the
# page-listing test below when its draw says so, and Quest after a compressor on a pool each run,
# tests/test_engine_pool_pipeline.py)
RUNS = {"jnp": ("jnp", QUEST, NEW), "jnp-quest16": ("jnp", Quest(0.25, page_size=2 * PS, dense_layers=1), 8)}


@pytest.mark.share(2)
@pytest.mark.parametrize("case", list(RUNS))
def test_quest_on_the_pool_gives_the_uniform_tokens_logits_and_reads(params, rng, case):
    """`generate` and `teacher_force` with ``pool=True``: the default path's tokens, its logits within 1e-5
    and its pages read per row (Quest reads fewer than every page, so the selection is exercised); fp32 on
    the jnp path, Quest pages of one and of two cache pages (the kernel, int8: the shuffled-pool test)."""
    backend, quest, new = RUNS[case]
    kw = _kw(backend)
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    want = generate(params, quest, tokens, max_new_tokens=new, **kw)
    got = generate(params, quest, tokens, max_new_tokens=new, pool=True, **kw)
    assert isinstance(got.cache, PoolCache) and not isinstance(want.cache, PoolCache)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    read = np.asarray(want.stats["kv_read_fraction"])
    assert (read < 0.9).all(), read  # layer 1 reads 2 of 5-7 pages
    np.testing.assert_allclose(np.asarray(got.stats["kv_read_fraction"]), read, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(got.cache.lengths),
                                  np.broadcast_to((LENGTHS + new - 1)[None, :, None], (2, 2, 2)))
    forced = rng.integers(1, CFG.vocab_size, (2, new))
    want_logits, _ = teacher_force(params, quest, tokens, forced, **kw)
    got_logits, _ = teacher_force(params, quest, tokens, forced, pool=True, **kw)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)


@pytest.mark.share(2)
@pytest.mark.parametrize("backend", ["jnp", "kernel-int8"])
def test_quest_on_a_shuffled_pool_decodes_the_same(params, rng, backend):
    """After the prefill the pool's pages are moved by a random permutation and every free page filled with
    junk (NaN, random positions and codes): Quest's bound (summaries read through the tables), its logical page
    list and the attention over it still give the default path's tokens, pages read and step-by-step logits. fp32
    on the jnp path; int8 on the interpreted kernel, the module's one run of the int8 kernel (every compile of it
    is slow)."""
    kw = _kw(backend)
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    want = generate(params, QUEST, tokens, max_new_tokens=NEW, **kw)
    N = 48  # the prompt's 2·2·2·5 = 40 pages and 8 free ones, opened while decoding
    session = engine.Session.start(params, QUEST, tokens, max_new_tokens=NEW, pool=True, pool_pages=N, **kw)
    pre = session.prefill()
    assert pre.cache.num_pages == N and int(pre.cache.alloc.num_free) == N - 40
    session.prefilled = pre.replace(cache=shuffle_pages(pre.cache, rng.permutation(N), junk_like(rng)))
    got = session.decode()
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.stats["kv_read_fraction"]), np.asarray(want.stats["kv_read_fraction"]),
                               rtol=1e-6)
    # step by step along `forced`, each step the same jitted `decode_step` on either cache: logits and reads
    # (against the uniform cache's own steps: the uniform steps and its `teacher_force` program, compiled apart,
    # differed by 1.3e-5 in one logit with --seed 757531183, the pool not involved)
    uniform = engine.Session.start(params, QUEST, tokens, max_new_tokens=NEW, **kw)
    (got_logits, got_reads), (ref_logits, ref_reads) = (decode_forced(params, s, forced) for s in (session, uniform))
    np.testing.assert_allclose(got_logits, ref_logits, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(got_reads, ref_reads, rtol=1e-6)
    assert (ref_reads[1:] < 0.9).all(), ref_reads


def test_quest_listing_every_page_is_full_attention_on_the_pool(params, rng):
    """A budget one token short of the prompt (so not `Quest.exact`: the page list is built) whose pages
    cover every page in use over the whole run, no dense layer: on the pool it reads every page (read
    fraction 1) and gives FullKV's pool tokens and logits within 1e-5. On one backend, drawn from the run's seed
    (each over runs; a failure replays with ``--seed``): every compile of the interpreted kernel is slow."""
    backend = ("jnp", "kernel")[int(seeded_rng().integers(2))]
    print(f"on the {backend} backend")
    kw = {**_kw(backend), "lengths": np.array([36, 29])}
    tokens = rng.integers(1, CFG.vocab_size, (2, 36))
    quest = Quest(35, page_size=PS, dense_layers=0)  # ceil(35/8) = 5 pages; rows reach 40 and 33 tokens
    new = 5
    want = generate(params, FullKV(), tokens, max_new_tokens=new, pool=True, **kw)
    got = generate(params, quest, tokens, max_new_tokens=new, pool=True, **kw)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.stats["kv_read_fraction"]), 1.0)
    forced = rng.integers(1, CFG.vocab_size, (2, new))
    want_logits, _ = teacher_force(params, FullKV(), tokens, forced, pool=True, **kw)
    got_logits, _ = teacher_force(params, quest, tokens, forced, pool=True, **kw)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)
