"""Quest pages of several cache pages over a cache whose capacity is not a whole number of Quest pages: the
last Quest page is partial (here Quest pages of 16 tokens over cache pages of 8 and an odd number of cache
pages). Formerly `Quest.decode_select` reshaped the P cache pages' summaries into ``P // m`` Quest pages and
failed at trace time; every test here hit that error before the fix.

Checked: the page list against a brute-force bound from the raw keys; decode logits, tokens and pages read
against the same selection written independently in jnp from the raw keys (`_QuestReference`); a budget
listing every page against FullKV; the page pool (``Options(pool=True)``) against the uniform cache.

Tiny random model (head_dim 16: the decode kernel's smallest); draws from the run's seed (tests/conftest.py:
printed in the header, ``pytest --seed N`` replays it)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng
from flax import struct

from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import init_cache
from sparsekv_jax.cache_pooled import PoolCache
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import FullKV, Setup
from sparsekv_jax.policies.common import write_entries
from sparsekv_jax.policies.quest import Quest

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=256, eos_token_ids=(0,))
PS, QPS = 8, 16  # cache page, Quest page: m = 2
# prompt width 40 and 10 tokens after it: capacity 50 -> 7 cache pages -> 4 Quest pages, the last one a single
# cache page. Row 0 (40 tokens) reaches 49 tokens, so its newest Quest page ends up the partial one; row 1 (27)
# reaches 36. Layer 0 is dense, layer 1 reads 2 Quest pages (32 tokens) of 2-4.
T, LENGTHS, NEW = 40, np.array([40, 27]), 10
BACKENDS = {"jnp": Backend(), "kernel": Backend.kernels()}  # the kernel interpreted on a CPU


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, scale=0.3)


@struct.dataclass
class _QuestReference(Quest):
    """Quest's selection written from scratch from the raw keys, as the paper states it: each Quest page's
    bound from the elementwise min/max of the keys of its live tokens (slots below the length, position
    >= 0; a partial last Quest page has only the slots the cache has), the max over the KV head's query
    heads plus the page's largest bias; the newest Quest page and the ``k - 1`` best earlier ones are read
    (ties: the lower page); the first ``dense_layers`` layers read every page. Returns the cache pages
    holding a live token of a read Quest page (no page summaries, no Quest code)."""

    def decode_select(self, q, kv, length, layer_state, shared_state, layer_index, page_size):
        B, Hkv, S, D = kv.k.shape
        Pq = -(-S // self.page_size)
        pad = Pq * self.page_size - S
        slot = jnp.arange(Pq * self.page_size)
        live = (slot[None, None] < length[:, None, None]) & jnp.pad(kv.positions >= 0, ((0, 0), (0, 0), (0, pad)))
        keys = jnp.pad(kv.k.astype(jnp.float32), ((0, 0), (0, 0), (0, pad), (0, 0)))
        keys = keys.reshape(B, Hkv, Pq, self.page_size, D)
        live_q = live.reshape(B, Hkv, Pq, self.page_size)
        lo = jnp.where(live_q[..., None], keys, jnp.inf).min(3)
        hi = jnp.where(live_q[..., None], keys, -jnp.inf).max(3)
        has = live_q.any(-1)  # [B, Hkv, Pq]
        lo, hi = jnp.where(has[..., None], lo, 0.0), jnp.where(has[..., None], hi, 0.0)
        qg = q.reshape(B, Hkv, -1, 1, D).astype(jnp.float32)
        ub = jnp.maximum(qg * lo[:, :, None], qg * hi[:, :, None]).sum(-1).max(2) / math.sqrt(D)
        ub = ub + jnp.where(live_q, jnp.pad(kv.bias, ((0, 0), (0, 0), (0, pad))).reshape(live_q.shape),
                            -jnp.inf).max(-1)
        page = jnp.arange(Pq)
        newest = (-(-length // self.page_size) - 1)[:, None, None]  # [B, 1, 1]
        earlier = jnp.where(page < newest, ub, -jnp.inf)
        order = jnp.argsort(-earlier, axis=-1, stable=True)
        rank = jnp.argsort(order, axis=-1)  # each page's place in the order
        k = min(-(-min(self.budget, self.prompt_len) // self.page_size), Pq)  # Quest pages (an int budget)
        read_q = (page == newest) | ((page < newest) & (rank < k - 1))
        read_q = jnp.where(layer_index < self.dense_layers, page <= newest, read_q)  # [B, Hkv, Pq]
        # cache pages: those holding a live slot of a read Quest page
        slot_read = (jnp.repeat(read_q, self.page_size, axis=-1) & live)[..., :S]
        pages = slot_read.reshape(B, Hkv, S // page_size, page_size).any(-1)
        ids = jnp.argsort(~pages, axis=-1, stable=True).astype(jnp.int32)
        return ids, pages.sum(-1).astype(jnp.int32)


def _kw(backend: str = "jnp", lengths: np.ndarray = LENGTHS) -> dict:
    return dict(lengths=lengths, page_size=PS, backend=BACKENDS[backend], stop_tokens=())


def _reads(lengths: np.ndarray, k: int, new: int = NEW) -> np.ndarray:
    """`generate`'s ``kv_read_fraction`` per row, counted by hand: at each of the ``new - 1`` decode steps
    (the first token comes from the prefill) layer 0 reads every cache page in use and layer 1 the cache
    pages in use of the newest Quest page and of ``k - 1`` earlier (whole) ones, over the pages in use."""
    want = []
    for n in lengths:
        steps = []
        for s in range(new - 1):
            in_use = n + s + 1
            newest, used = math.ceil(in_use / QPS) - 1, math.ceil(in_use / PS)
            read = min(newest, k - 1) * (QPS // PS) + used - newest * (QPS // PS)
            steps.append((1.0 + read / used) / 2)
        want.append(np.mean(steps))
    return np.array(want)


def test_quest_page_list_on_a_partial_last_quest_page_is_the_bruteforce_top_pages():
    """`decode_select` on a 5-cache-page layer (Quest pages of 2, the third partial) for a batch of 2
    (37 and 20 tokens): the listed cache pages are the newest Quest page's pages in use and those of the best
    earlier Quest page by the bound from the raw keys; every id below P, no cache page past the length; a
    dense layer lists exactly the pages in use."""
    rng = seeded_rng()
    L, B, H, S, D = 1, 2, 2, 40, 16  # P = 5 cache pages, Quest pages of 2 cache pages
    P, m = S // PS, QPS // PS
    lengths = np.array([37, 20])
    k = rng.normal(size=(L, B, H, S, D)).astype(np.float32)
    cfg = ModelConfig(**{**CFG.__dict__, "num_layers": 1})
    cache = init_cache(cfg, B, S, page_size=PS, dtype=jnp.float32)
    cache = write_entries(cache, jnp.asarray(k), jnp.asarray(k), jnp.broadcast_to(jnp.arange(S), (L, B, H, S)),
                          jnp.zeros((L, B, H, S), jnp.float32), jnp.asarray(lengths), S)
    pol = Quest(budget=32, page_size=QPS, dense_layers=1).bind(Setup(cfg, prompt_len=S, page_size=PS))
    q = rng.normal(size=(B, CFG.num_heads, D)).astype(np.float32)
    kv = jax.tree.map(lambda x: x[0], cache.layers)
    select = jax.jit(lambda q, kv, n, layer: pol.decode_select(q, kv, n, None, None, layer, PS))
    sparse = [np.asarray(x) for x in select(jnp.asarray(q), kv, jnp.asarray(lengths), jnp.int32(1))]
    dense = [np.asarray(x) for x in select(jnp.asarray(q), kv, jnp.asarray(lengths), jnp.int32(0))]
    G = CFG.num_heads // H
    for b, n in enumerate(lengths):
        used_q, used_c = -(-n // QPS), -(-n // PS)
        for h in range(H):
            qg = q[b, G * h: G * h + G]
            bounds = []
            for p in range(used_q):
                kp = k[0, b, h, p * QPS: min(n, p * QPS + QPS)]
                ub = np.maximum(qg * kp.min(0), qg * kp.max(0)).sum(-1)
                assert (qg @ kp.T <= ub[:, None] + 1e-5).all()
                bounds.append(ub.max())
            best = [p for p in np.argsort(-np.asarray(bounds), kind="stable") if p != used_q - 1][0]
            want = {c for p in (best, used_q - 1) for c in range(p * m, (p + 1) * m) if c < used_c}
            ids, counts = sparse[0][b, h], sparse[1][b, h]
            assert ids.shape == (P,) and (ids >= 0).all() and (ids < P).all(), ids
            assert counts == len(want) and set(ids[:counts].tolist()) == want, (b, h, ids, counts, want)
            ids, counts = dense[0][b, h], dense[1][b, h]
            assert counts == used_c and sorted(ids[:counts].tolist()) == list(range(used_c)), (b, h, ids, counts)


@pytest.mark.share(2)
@pytest.mark.parametrize("budget", [16, 32])
def test_quest_with_a_partial_last_quest_page_is_the_reference_selection(params, rng, budget):
    """Uniform cache, batch 2 of different lengths, capacity 7 cache pages: `teacher_force` logits within
    1e-5, `generate` tokens and pages read of Quest equal those of `_QuestReference` (the selection from the
    raw keys); budget 16 reads the newest Quest page alone, 32 one more. The selection matters: the logits
    are off FullKV's, and the pages read are those counted by hand (`_reads`: fewer than every page)."""
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    quest = Quest(budget, page_size=QPS, dense_layers=1)
    ref = _QuestReference(budget, page_size=QPS, dense_layers=1)
    got = np.asarray(teacher_force(params, quest, tokens, forced, **_kw())[0])
    want = np.asarray(teacher_force(params, ref, tokens, forced, **_kw())[0])
    full = np.asarray(teacher_force(params, FullKV(), tokens, forced, **_kw())[0])
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
    assert np.abs(got - full).max() > 1e-3, np.abs(got - full).max()
    out = generate(params, quest, tokens, max_new_tokens=NEW, **_kw())
    assert out.cache.layers.k.shape[-2] == 7 * PS  # an odd number of cache pages
    ref_out = generate(params, ref, tokens, max_new_tokens=NEW, **_kw())
    np.testing.assert_array_equal(np.asarray(out.tokens), np.asarray(ref_out.tokens))
    reads = np.asarray(out.stats["kv_read_fraction"])
    np.testing.assert_allclose(reads, np.asarray(ref_out.stats["kv_read_fraction"]), rtol=1e-6)
    np.testing.assert_allclose(reads, _reads(LENGTHS, budget // QPS), rtol=1e-6)


@pytest.mark.share(2)
@pytest.mark.parametrize("backend", ["jnp", "kernel"])
def test_quest_listing_every_page_with_a_partial_last_quest_page_is_full_attention(params, rng, backend):
    """Prompt width 36 and 4 tokens after it: capacity 5 cache pages, 3 Quest pages, the last partial and in
    use by row 0 (36-39 tokens; row 1 23-26). A budget of 35 tokens (not `Quest.exact`: the list is built)
    is 3 Quest pages, every page: FullKV's tokens, logits within 1e-5 and a read fraction of exactly 1."""
    kw = _kw(backend, np.array([36, 23]))
    tokens = rng.integers(1, CFG.vocab_size, (2, 36))
    forced = rng.integers(1, CFG.vocab_size, (2, 4))
    quest = Quest(35, page_size=QPS, dense_layers=0)
    got = generate(params, quest, tokens, max_new_tokens=4, **kw)
    want = generate(params, FullKV(), tokens, max_new_tokens=4, **kw)
    assert got.cache.layers.k.shape[-2] == 5 * PS
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.stats["kv_read_fraction"]), 1.0)
    got_logits, _ = teacher_force(params, quest, tokens, forced, **kw)
    want_logits, _ = teacher_force(params, FullKV(), tokens, forced, **kw)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)


@pytest.mark.share(2)
@pytest.mark.parametrize("backend", ["jnp", "kernel"])
def test_quest_with_a_partial_last_quest_page_on_the_pool_is_the_uniform_path(params, rng, backend):
    """``pool=True`` (each head's length, logical pages read through the tables) with the 7-cache-page
    capacity: the uniform path's tokens, pages read per row and `teacher_force` logits within 1e-5."""
    kw = _kw(backend)
    quest = Quest(32, page_size=QPS, dense_layers=1)
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    want = generate(params, quest, tokens, max_new_tokens=NEW, **kw)
    got = generate(params, quest, tokens, max_new_tokens=NEW, pool=True, **kw)
    assert isinstance(got.cache, PoolCache) and not isinstance(want.cache, PoolCache)
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    read = np.asarray(want.stats["kv_read_fraction"])
    np.testing.assert_allclose(read, _reads(LENGTHS, 2), rtol=1e-6)  # fewer than every page
    np.testing.assert_allclose(np.asarray(got.stats["kv_read_fraction"]), read, rtol=1e-6)
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    want_logits, _ = teacher_force(params, quest, tokens, forced, **kw)
    got_logits, _ = teacher_force(params, quest, tokens, forced, pool=True, **kw)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)
