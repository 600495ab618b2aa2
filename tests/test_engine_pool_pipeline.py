"""A compressor followed by Quest on a page pool, ``Options(pool=True)`` (issue 38, docs/PAGE_POOL.md; experimental):
``pipeline(compress=snapkv(0.5, window=4), decode=quest(0.25))`` and the same with ``adakv(snapkv(...))``, whose
heads keep different counts. The compressor writes each head's kept entries into a decode pool, then Quest
bounds each head's logical pages through the tables with that head's own length and lists the pages read.

Against what, for a ragged batch of 2 (40 and 29 tokens), on the jnp path and the interpreted kernel in fp32 (each
compressor on one of them a run, drawn from the seed):

- SnapKV keeps the same count in every head, so the pool and the default uniform layout hold the same entries
  at the same logical slots: the pool's tokens, `teacher_force` logits (1e-5), pages read and the Quest pages
  listed at every step and layer (logical ids) are the uniform path's.
- AdaKV's heads keep different counts. The uniform cache gives every head its row's largest length and appends
  the decoded tokens after the holes; the pool appends each head's tokens after its own entries. Quest's
  pages (and its always-read newest page) then differ by design, so the uniform path is not the reference.
  The reference is `_reference`, a plain jnp decode written here from Quest's definition (a per-head
  dense layout, each page's min/max over its live keys, the bound, the top pages with the newest forced,
  softmax attention over their live slots). Run from the uniform path's compressed cache with the decoded
  tokens appended after the row's length it must give the uniform path's tokens, logits and pages (so it is
  the engine's Quest); appended after each head's own count it must give the pool's. Its logits are held
  within 1e-4 (seen: at most 1.6e-5 over 14 seeds, on either layout; it sums in another order, and the
  differences grow over the steps); the pool's page mask one page off changed most greedy tokens already.
- A Quest budget whose pages cover every stored page (not `Quest.exact`: the list is built) gives the
  compressor alone on the default path.

Quest pages are cache pages here (``page_size=8``: Quest pages of several cache pages have a reshape bug being
fixed apart). Tiny random model (head_dim 16: the kernel's smallest); prompts drawn from the run's seed
(tests/conftest.py: printed in the header, ``pytest --seed N`` replays it)."""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng
from flax import struct

from sparsekv_jax import engine
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache_pooled import PoolCache
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.models.transformer import forward, logits_from_hidden
from sparsekv_jax.policies import Pipeline, parse_policy
from sparsekv_jax.policies.quest import Quest

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=256, eos_token_ids=(0,))
T, LENGTHS, NEW, PS = 40, np.array([40, 29]), 10, 8
BACKENDS = {"jnp": Backend(), "kernel": Backend.kernels()}  # the kernel interpreted on a CPU
COMPRESSORS = {"snapkv": "snapkv(0.5, window=4)", "adakv": "adakv(snapkv(0.5, window=4))"}
# which compressor runs on which backend: drawn from the run's seed (each pairing over runs, a failure replays with
# ``--seed``), the two backends each run
BACKEND_OF = dict(zip(COMPRESSORS, seeded_rng().permutation(list(BACKENDS)).tolist(), strict=True))
DENSE_LAYERS = 1  # layer 0 reads every page, layer 1 selects
QUEST_PAGES = 2  # Quest(0.25) of the 40-token prompt: 10 tokens, 2 pages of 8 (the newest forced)

_CALLS: list[tuple[int, np.ndarray, np.ndarray]] = []  # what `_Listed.decode_select` returned, in order


def _record(layer, ids, counts) -> None:
    _CALLS.append((int(layer), np.asarray(ids), np.asarray(counts)))


@struct.dataclass
class _Listed(Quest):
    """Quest that reports each page list it returns (layer, logical ids, counts) to the host, so a test sees
    the pages read at every step and layer of either layout."""

    def decode_select(self, q, kv, length, layer_state, shared_state, layer_index, page_size):
        selection = super().decode_select(q, kv, length, layer_state, shared_state, layer_index, page_size)
        if selection is not None:
            jax.debug.callback(_record, layer_index, *selection, ordered=True)
        return selection


def _pipeline(compressor: str, quest: Quest) -> Pipeline:
    return Pipeline(compress=parse_policy(COMPRESSORS[compressor]), decode=quest)


QUEST = _Listed(0.25, page_size=PS, dense_layers=DENSE_LAYERS)


@pytest.fixture(scope="module")
def params():
    return random_params(CFG, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, scale=0.3)


def _kw(backend: str) -> dict:
    return dict(lengths=LENGTHS, page_size=PS, backend=BACKENDS[backend], stop_tokens=())


def _listed_pages(run, steps: int, pages: int) -> np.ndarray:
    """Run ``run()`` and return the pages its Quest listed, ``[steps, L, B, Hkv, pages]`` bool, from the
    `_Listed` reports (one per layer per decode step, in order)."""
    _CALLS.clear()
    out = run()
    jax.effects_barrier()
    assert [layer for layer, _, _ in _CALLS] == list(range(CFG.num_layers)) * steps, [c[0] for c in _CALLS]
    listed = np.zeros((steps * CFG.num_layers, 2, CFG.num_kv_heads, pages), bool)
    for i, (_, ids, counts) in enumerate(_CALLS):
        for b in range(ids.shape[0]):
            for h in range(ids.shape[1]):
                chosen = ids[b, h, :counts[b, h]]
                assert (chosen < pages).all() and np.unique(chosen).size == chosen.size, (i, b, h, chosen)
                listed[i, b, h, chosen] = True
    return out, listed.reshape(steps, CFG.num_layers, 2, CFG.num_kv_heads, pages)


@jax.jit
def _reference_step(params, state, token, position):
    """One greedy step of `_reference`'s decode (at module level: one program for the runs of both layouts,
    whose caches have one shape)."""
    def attend(q, k, v, kv, layer, hidden):
        K, V, positions, bias, w = kv
        B, H, S, D = K.shape
        P, G = S // PS, q.shape[2] // H
        at = jnp.arange(S) == w[..., None]  # [B, H, S]: each head's next slot
        K = jnp.where(at[..., None], k[:, 0, :, None, :], K)
        V = jnp.where(at[..., None], v[:, 0, :, None, :], V)
        positions = jnp.where(at, position[:, None, None], positions)
        bias = jnp.where(at, 0.0, bias)
        w = w + 1
        live = ((jnp.arange(S) < w[..., None]) & (positions >= 0)).reshape(B, H, P, PS)
        keys = K.reshape(B, H, P, PS, D)
        lo = jnp.where(live[..., None], keys, jnp.inf).min(3)  # [B, H, P, D]
        hi = jnp.where(live[..., None], keys, -jnp.inf).max(3)
        qg = q[:, 0].reshape(B, H, G, 1, D)
        bound = jnp.maximum(qg * lo[:, :, None], qg * hi[:, :, None]).sum(-1).max(2) / np.sqrt(D)  # [B, H, P]
        top_bias = jnp.where(live, bias.reshape(B, H, P, PS), -jnp.inf).max(-1)
        score = jnp.where(live.any(-1), bound + top_bias, -jnp.inf)
        used = -(-w // PS)  # [B, H]
        in_use = jnp.arange(P) < used[..., None]
        score = jnp.where(jnp.arange(P) == used[..., None] - 1, jnp.inf, jnp.where(in_use, score, -jnp.inf))
        rank = jnp.argsort(jnp.argsort(-score, stable=True), stable=True)  # 0: the best page
        chosen = in_use & ((rank < QUEST_PAGES) | (layer < DENSE_LAYERS))  # [B, H, P]
        read = live.reshape(B, H, S) & jnp.repeat(chosen, PS, axis=-1)
        logit = jnp.einsum("bhgd,bhsd->bhgs", q[:, 0].reshape(B, H, G, D), K) / np.sqrt(D) + bias[:, :, None]
        logit = jnp.where(read[:, :, None], logit, -jnp.inf)
        out = jnp.einsum("bhgs,bhsd->bhgd", jax.nn.softmax(logit, -1), V).reshape(B, 1, H * G, D)
        return out, (K, V, positions, bias, w), (chosen, used)

    hidden, state, listed = forward(params, token[:, None], position[:, None], state, attend)
    return logits_from_hidden(params, hidden[:, 0]), state, listed


def _reference(params, cache, first_logits: np.ndarray, per_head: bool, new: int):
    """A plain jnp decode of Quest from the uniform path's compressed ``cache``, greedy for ``new`` tokens:
    ``(tokens [B, new], logits [B, new, V], pages [new - 1, L, B, Hkv, P] bool, used [new - 1, L, B, Hkv])``: the
    pages listed and the pages in use at each step.

    Each (layer, row, head) keeps its live entries (position >= 0, below the row's length) in its slots, and
    writes each decoded token at slot ``w``, then ``w + 1``: ``w`` is the row's length for every head
    (``per_head`` false: the uniform cache, the holes stay between) or the head's own count of live entries
    (true: the pool's logical slots). A head's pages in use are ``ceil(w / ps)``; a page's bound is
    ``max over the head's query heads of sum_d max(q_d·min_d, q_d·max_d) / sqrt(D)`` (min and max over its live
    keys) plus its largest live bias, ``-inf`` for a page with no live entry; the newest page always, then the
    best up to `QUEST_PAGES` (ties: the lower page), every page in use in the first `DENSE_LAYERS` layers;
    softmax over the live slots of the listed pages."""
    L, B, H, S, D = cache.layers.k.shape
    pos = np.asarray(cache.layers.positions)
    live = (pos >= 0) & (np.arange(S) < np.asarray(cache.length)[None, :, None, None])
    count = live.sum(-1)  # [L, B, H]
    np.testing.assert_array_equal(live, np.arange(S) < count[..., None])  # kept entries first, then holes
    write = count if per_head else np.broadcast_to(np.asarray(cache.length)[None, :, None], (L, B, H))
    state = (cache.layers.k, cache.layers.v, cache.layers.positions, cache.layers.bias,
             jnp.asarray(write, jnp.int32))

    position = jnp.asarray(cache.next_position)
    logits, tokens, pages, used = [np.asarray(first_logits)], [np.argmax(first_logits, -1)], [], []
    for _ in range(new - 1):
        out, state, (chosen, in_use) = _reference_step(params, state, jnp.asarray(tokens[-1], jnp.int32), position)
        position = position + 1
        logits.append(np.asarray(out))
        tokens.append(np.argmax(logits[-1], -1))
        pages.append(np.asarray(chosen))
        used.append(np.asarray(in_use))
    return np.stack(tokens, 1), np.stack(logits, 1), np.stack(pages), np.stack(used)


@pytest.mark.share(2)
@pytest.mark.parametrize("compressor", list(COMPRESSORS))
def test_compressor_then_quest_on_the_pool(params, rng, compressor):
    """`generate` and `teacher_force` with ``pool=True`` for a compressor followed by Quest give the tokens,
    logits and the Quest pages listed at every step and layer of `_reference` with each head's own count; the
    default path gives those of `_reference` with the row's length (so the reference is the engine's Quest).
    For SnapKV (equal heads) the pool gives the default path's own tokens, logits (1e-5), pages listed and
    pages read; for AdaKV the pages listed differ from the default path's (the layouts differ there). Each
    compressor on one backend, `BACKEND_OF` (every compile of the interpreted kernel is slow)."""
    backend = BACKEND_OF[compressor]
    print(f"{compressor} on the {backend} backend")
    kw = _kw(backend)
    policy = _pipeline(compressor, QUEST)
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    compressed = engine.Session.start(params, policy, tokens, max_new_tokens=NEW, **kw).compress()
    counts = np.asarray((compressed.cache.layers.positions >= 0).sum(-1))
    print(f"{compressor}: kept per (layer, row, head) {counts.tolist()}, row lengths "
          f"{np.asarray(compressed.cache.length).tolist()}")
    if compressor == "adakv":  # some head keeps fewer than its row's length: the layouts differ there
        assert (counts < np.asarray(compressed.cache.length)[None, :, None]).any(), counts
    P = compressed.cache.layers.k.shape[3] // PS
    runs = {}
    for per_head, pool in [(False, False), (True, True)]:
        ref_tokens, ref_logits, ref_pages, used = _reference(params, compressed.cache, compressed.logits, per_head, NEW)
        out = generate(params, policy, tokens, max_new_tokens=NEW, pool=pool, **kw)
        assert isinstance(out.cache, PoolCache) == pool
        np.testing.assert_array_equal(np.asarray(out.tokens), ref_tokens)
        (logits, _), pages = _listed_pages(partial(teacher_force, params, policy, tokens, ref_tokens, pool=pool, **kw),
                                           NEW - 1, P)
        err = np.abs(np.asarray(logits) - ref_logits).max()
        print(f"{'pool' if pool else 'uniform'}: max |logit - reference| {err:.2e}")
        np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=1e-4, rtol=1e-5)  # module docstring
        np.testing.assert_array_equal(pages, ref_pages)
        dense = (np.arange(CFG.num_layers) < DENSE_LAYERS)[:, None, None]
        np.testing.assert_array_equal(ref_pages.sum(-1), np.where(dense, used, np.minimum(used, QUEST_PAGES)))
        assert (used[:, DENSE_LAYERS:] > QUEST_PAGES).any((0, 1, 3)).all()  # each row's selection leaves pages out
        # pages read per row: over its heads' pages in use, the layers' mean, the steps' mean
        read = (ref_pages.sum((-1, -2)) / used.sum(-1)).mean((0, 1))
        np.testing.assert_allclose(np.asarray(out.stats["kv_read_fraction"]), read, rtol=1e-6)
        runs[pool] = out, logits, pages
    (uniform, uniform_logits, uniform_pages), (got, got_logits, got_pages) = runs[False], runs[True]
    if compressor == "snapkv":  # equal heads: the pool is the default layout
        np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(uniform.tokens))
        np.testing.assert_allclose(np.asarray(got_logits), np.asarray(uniform_logits), atol=1e-5, rtol=1e-5)
        np.testing.assert_array_equal(got_pages, uniform_pages)
        np.testing.assert_allclose(np.asarray(got.stats["kv_read_fraction"]),
                                   np.asarray(uniform.stats["kv_read_fraction"]), rtol=1e-6)
    else:  # AdaKV: each head's decoded tokens follow its own entries, so the pages listed differ (by design)
        assert not np.array_equal(got_pages, uniform_pages)


def test_snapkv_then_quest_on_an_int8_pool_is_the_uniform_layout(params, rng):
    """int8 on the jnp path, SnapKV (equal heads: both layouts quantise the same pages): the pool gives the default
    path's tokens, `teacher_force` logits (1e-5), pages read and Quest pages listed at every step and layer. (The
    interpreted kernel reads a pool after a compressor in `test_compressor_then_quest_on_the_pool` each run, fp32;
    Quest on an int8 pool on that kernel: tests/test_engine_pool_quest.py. Every compile of it is slow.)"""
    kw = {**_kw("jnp"), "backend": dataclasses.replace(Backend(), kv_dtype="int8")}
    policy = _pipeline("snapkv", QUEST)
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    want = generate(params, policy, tokens, max_new_tokens=NEW, **kw)
    got = generate(params, policy, tokens, max_new_tokens=NEW, pool=True, **kw)
    assert isinstance(got.cache, PoolCache) and got.cache.pages.quantized
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_allclose(np.asarray(got.stats["kv_read_fraction"]), np.asarray(want.stats["kv_read_fraction"]),
                               rtol=1e-6)
    forced = np.asarray(want.tokens)
    P = want.cache.layers.k.shape[3] // PS
    (want_logits, _), want_pages = _listed_pages(partial(teacher_force, params, policy, tokens, forced, **kw),
                                                 NEW - 1, P)
    (got_logits, _), got_pages = _listed_pages(partial(teacher_force, params, policy, tokens, forced, pool=True, **kw),
                                               NEW - 1, P)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)
    np.testing.assert_array_equal(got_pages, want_pages)
    assert (want_pages[:, DENSE_LAYERS:].sum(-1) < want_pages[:, :DENSE_LAYERS].sum(-1)).any()  # pages left out


def test_quest_covering_every_stored_page_is_the_compressor_alone(params, rng):
    """A Quest budget one token short of the prompt (not `Quest.exact`: its page lists are built, as the
    reports show) whose 5 pages cover every page any head holds over the run (AdaKV's largest head keeps at
    most 2·20 - 4 = 36 of row 0's 40 tokens, and 4 are appended), no dense layer: on the pool it reads every
    page and gives the compressor alone on the default path (tokens; logits within 1e-5). SnapKV or AdaKV, drawn
    from the run's seed (each over runs, a failure replays with ``--seed``; both meet Quest on a pool each run in
    `test_compressor_then_quest_on_the_pool`)."""
    compressor = str(seeded_rng().choice(list(COMPRESSORS)))
    print(f"compressor: {compressor}")
    kw = _kw("jnp")
    new = 5
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    alone = parse_policy(COMPRESSORS[compressor])
    policy = _pipeline(compressor, _Listed(T - 1, page_size=PS, dense_layers=0))
    want = generate(params, alone, tokens, max_new_tokens=new, **kw)
    got = generate(params, policy, tokens, max_new_tokens=new, pool=True, **kw)
    assert isinstance(got.cache, PoolCache) and -(-int(np.asarray(got.cache.lengths).max()) // PS) <= 5  # covered
    np.testing.assert_array_equal(np.asarray(got.tokens), np.asarray(want.tokens))
    np.testing.assert_array_equal(np.asarray(got.stats["kv_read_fraction"]), 1.0)
    forced = rng.integers(1, CFG.vocab_size, (2, new))
    want_logits, _ = teacher_force(params, alone, tokens, forced, **kw)
    _CALLS.clear()
    got_logits, _ = teacher_force(params, policy, tokens, forced, pool=True, **kw)
    jax.effects_barrier()
    assert len(_CALLS) == CFG.num_layers * (new - 1)  # a page list at every layer and step
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), atol=1e-5, rtol=1e-5)


def test_the_pipeline_is_admitted_and_sized_as_its_compressor(params, rng):
    """Spelled as the spec parser reads it, a compressor followed by Quest is admitted on a pool (before, it was
    refused as not tested) and its decode pool is the compressor's bound: SnapKV's by hand, ``L·Hkv·Σ_rows
    pages_for(floor(0.5·length) + max_new_tokens)``; a decode stage that writes (H2O) is still refused."""
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    spec = "pipeline(compress=snapkv(0.5, window=4), decode=quest(0.25, page_size=8))"
    run = engine.setup(params, parse_policy(spec), tokens, pool=True, page_size=PS, max_new_tokens=NEW,
                       lengths=LENGTHS)
    assert run.pool
    by_hand = CFG.num_layers * CFG.num_kv_heads * sum(-(-(int(0.5 * n) + NEW) // PS) for n in LENGTHS)
    assert run.pool_pages == by_hand
    with pytest.raises(ValueError, match=r"its decode stage \(H2O\) writes in place .* after a compress stage "
                                         r"\(SnapKV\) other than its own.*Supported: .*a pipeline of one of these "
                                         r"compressors followed by Quest"):
        engine.setup(params, parse_policy("pipeline(compress=snapkv(0.5, window=4), decode=h2o(0.5))"), tokens,
                     pool=True)
