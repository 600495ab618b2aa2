"""Compaction into a page pool (issue 38, docs/PAGE_POOL.md, migration step 3: `write_entries_pool`,
`write_kept_pool`, `cache_pooled.decode_pool`/`put_pages`/`pool_nbytes`, `cache_pool.pool_pages_needed`).

The reference is today's uniform compaction (`write_entries`, `write_kept`), which puts each head's kept
entries in its first ``count`` slots and leaves holes up to the row's largest count. The pooled compaction
must put the same entries, byte for byte (K/V or codes, positions, biases, page summaries, scales and zero
points), in the same logical slots of pages the head owns alone, read back through the tables
(`layer_kv`): random per-head counts with an empty head, a full head and rows of different lengths, bf16
and int8, from a uniform cache and from a shuffled pool. The decode kernel's pool mode on the compacted
pool gives the uniform kernel's output on the uniformly compacted cache. And the issue's memory claim in
miniature: AdaKV(SnapKV(0.25)) and SnapKV(0.25) at the same average budget need pools within one page per
(layer, row, head) of each other, where the uniform layout gives AdaKV its largest head's capacity for
every head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.cache import init_cache, layer_view, pages_for, summarize_pages, write_chunk
from sparsekv_jax.cache_pool import owned, pool_pages_needed
from sparsekv_jax.cache_pooled import (
    PoolCache,
    decode_kernel_args,
    layer_kv,
    layer_lengths,
    pool_from_stack,
    pool_nbytes,
    put_pages,
    shuffle_pages,
    stack_view,
)
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.pallas.decode import decode_attention
from sparsekv_jax.pallas.testing import junk_like
from sparsekv_jax.policies import AdaKV, SnapKV
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.common import write_entries, write_entries_pool, write_kept, write_kept_pool

L, B, H, D, ps = 2, 2, 3, 16, 8
T = 48  # prompt slots (6 pages)
LENGTHS = np.array([T, 30])  # ragged rows
K = 20  # entries per head handed to the compaction (3 pages: the packed width)
CAPACITY = 32  # the most a head may hold (M = 4 pages)
M = CAPACITY // ps
SPARE = 2  # pool pages past what the compaction needs (they must stay free and untouched)
CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=64, num_layers=L, num_heads=2 * H, num_kv_heads=H,
                  head_dim=D, intermediate_size=48, max_position_embeddings=512, eos_token_ids=(0,))
SLOT_LEAVES = ("k", "v", "positions", "bias")
PAGE_LEAVES = ("page_sum", "page_min", "page_max", "page_max_bias", "k_scale", "k_zero", "v_scale")


def _prefilled(rng: np.random.Generator, kv_dtype: str | None, dtype=jnp.bfloat16):
    """A uniform cache holding a random prompt (rows of `LENGTHS`), written as the prefill writes it."""
    cache = init_cache(CFG, B, T, page_size=ps, dtype=dtype, kv_dtype=kv_dtype)
    k, v = (jnp.asarray(rng.standard_normal((L, B, H, T, D)) * rng.uniform(0.5, 4.0, (L, B, H, 1, D)), dtype)
            for _ in range(2))
    pos, ln = jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.asarray(LENGTHS, jnp.int32)
    layers = [write_chunk(layer_view(cache.layers, l), k[l], v[l], 0, pos, ln) for l in range(L)]
    layers = summarize_pages(jax.tree.map(lambda *a: jnp.stack(a), *layers), ln, ps)
    return cache.replace(layers=layers, length=ln, next_position=ln)


def _counts(rng: np.random.Generator) -> np.ndarray:
    """``[L, B, H]`` random kept counts in ``[0, K]``: an empty head, a full head, a head of whole pages, and
    row 1 keeping fewer than row 0 (the rows' lengths differ)."""
    c = rng.integers(0, K + 1, (L, B, H))
    c[:, 1] = rng.integers(0, K // 2 + 1, (L, H))
    c[0, 0, 0], c[0, 0, 1], c[1, 0, 2], c[1, 1, 0] = 0, K, 2 * ps, 0
    return c.astype(np.int32)


def _idx(rng: np.random.Generator) -> np.ndarray:
    """``[L, B, H, K]`` kept slots in slot order, distinct, below each row's length (as `keep_slots` gives)."""
    idx = np.stack([np.sort(rng.choice(LENGTHS[b], K, replace=False)) for _ in range(L) for b in range(B)
                    for _ in range(H)])
    return idx.reshape(L, B, H, K).astype(np.int32)


def _shuffled(cache, rng: np.random.Generator) -> PoolCache:
    """The uniform prefill cache as a pool whose pages sit at random places, NaN / junk in the unowned ones."""
    pool = pool_from_stack(cache.layers, cache.length, cache.next_position, page_size=ps,
                           num_pages=L * B * H * (T // ps) + 3)
    shuffled = shuffle_pages(pool, rng.permutation(pool.num_pages), junk_like(rng))
    assert pool.num_pages - np.asarray(owned(shuffled.alloc)).sum() == 3
    return shuffled


def _compactions(rng: np.random.Generator, kv_dtype: str | None, source: str, dtype=jnp.bfloat16):
    """``(uniform compaction, pooled compaction, counts)`` of the same entries: random new entries
    (`write_entries`) or kept slots gathered from the prefill cache (`write_kept`), that cache given to the
    pooled path as it is or as a shuffled pool."""
    cache = _prefilled(rng, kv_dtype, dtype)
    counts = _counts(rng)
    n = int(np.sum(-(-counts // ps))) + SPARE
    if source == "entries":
        k, v = (jnp.asarray(rng.standard_normal((L, B, H, K, D)), jnp.float32) for _ in range(2))
        pos = jnp.asarray(rng.integers(0, 1000, (L, B, H, K)), jnp.int32)
        bias = jnp.asarray(rng.standard_normal((L, B, H, K)), jnp.float32)
        want = write_entries(cache, k, v, pos, bias, jnp.asarray(counts), CAPACITY)
        got = jax.jit(write_entries_pool, static_argnums=(6, 7))(cache, k, v, pos, bias, jnp.asarray(counts),
                                                                 CAPACITY, n)
    else:
        idx = jnp.asarray(_idx(rng))
        want = write_kept(cache, idx, jnp.asarray(counts), CAPACITY)
        src = cache if source == "kept" else _shuffled(cache, rng)
        got = jax.jit(write_kept_pool, static_argnums=(3, 4))(src, idx, jnp.asarray(counts), CAPACITY, n)
    return want, got, counts


SOURCES = ("entries", "kept", "kept_from_pool")
# each source in one store, bf16 or int8, drawn from the run's seed with both stores drawn each run: every pairing
# over runs, a failing draw replays with ``--seed`` (each case compiles its own programs)
_DRAW = seeded_rng()
KV_DTYPE_OF = dict(zip(SOURCES, [(None, "int8")[i] for i in _DRAW.permutation([0, 1, _DRAW.integers(2)])], strict=True))


@pytest.mark.share(2)
@pytest.mark.parametrize("source", SOURCES)
def test_pooled_compaction_is_write_entries_per_head(rng, source):
    """Per (layer, row, head), the pool read back through its table holds exactly the first ``count`` entries
    and the first ``ceil(count / ps)`` pages' summaries, scales and zero points `write_entries`/`write_kept`
    give on the uniform cache; each head's length is its count; the pool has no page owned twice, exactly
    ``sum(ceil(count / ps))`` pages in use (`pool_pages_needed`), and its spare pages free and empty. In the
    store `KV_DTYPE_OF` draws for the source (None: bf16)."""
    kv_dtype = KV_DTYPE_OF[source]
    print(f"{source} in {kv_dtype or 'bf16'}")
    want, got, counts = _compactions(rng, kv_dtype, source)
    need = int(np.sum(-(-counts // ps)))
    assert int(pool_pages_needed(jnp.asarray(counts), ps)) == need
    alloc = got.alloc
    assert not bool(alloc.overflow.any())
    np.testing.assert_array_equal(np.asarray(got.lengths), counts)
    ids = np.asarray(alloc.table)[np.asarray(owned(alloc))]
    assert ids.size == need and len(set(ids.tolist())) == need and ids.max() < got.num_pages
    assert int(alloc.num_free) == SPARE
    free = np.asarray(alloc.free)[:SPARE]
    assert not set(free.tolist()) & set(ids.tolist())
    assert (np.asarray(got.pages.positions)[free] == -1).all() and (np.asarray(got.pages.k)[free] == 0).all()
    assert want.layers.quantized == (kv_dtype is not None) and got.pages.quantized == want.layers.quantized
    for l in range(L):
        read = layer_kv(got, l)
        uni = layer_view(want.layers, l)
        np.testing.assert_array_equal(np.asarray(layer_lengths(got, l)), counts[l])
        for b in range(B):
            for h in range(H):
                c = int(counts[l, b, h])
                at = f"{source} {kv_dtype}: layer {l} row {b} head {h} (count {c})"
                for name in SLOT_LEAVES:
                    np.testing.assert_array_equal(np.asarray(getattr(read, name)[b, h, :c], np.float32),
                                                  np.asarray(getattr(uni, name)[b, h, :c], np.float32),
                                                  err_msg=f"{at}: {name}")
                for name in PAGE_LEAVES:
                    x, y = getattr(read, name), getattr(uni, name)
                    assert (x is None) == (y is None), name
                    if x is not None:
                        np.testing.assert_array_equal(np.asarray(x[b, h, :-(-c // ps)], np.float32),
                                                      np.asarray(y[b, h, :-(-c // ps)], np.float32),
                                                      err_msg=f"{at}: {name}")
    # the live entries are real ones (no hole inside a head's count), and the uniform cache did leave holes
    pos = np.stack([np.asarray(layer_kv(got, l).positions) for l in range(L)])
    live = np.arange(M * ps) < counts[..., None]
    assert (pos[live] >= 0).all()
    assert (np.asarray(want.layers.bias) == -np.inf).any(), "the uniform reference has holes to compare against"


@pytest.mark.parametrize("kv_dtype", [None, "int8"])
def test_decode_kernel_on_the_compacted_pool_is_the_uniform_kernel(rng, kv_dtype):
    """The decode kernel's pool mode (interpret, per-head lengths = counts, fed by `decode_kernel_args`) on the
    pooled compaction equals the uniform kernel (``layer=l``, row lengths, holes masked by their -inf bias)
    on the uniform compaction of the same kept slots. A head that kept nothing attends to nothing in both."""
    want, got, counts = _compactions(rng, kv_dtype, "kept", dtype=jnp.float32)
    q = jnp.asarray(rng.standard_normal((B, 2 * H, D)), jnp.float32)
    tune = dict(interpret=True, block_k=16, num_splits=2)
    u = want.layers
    for l in range(L):
        out = decode_attention(q, page_size=ps, **decode_kernel_args(got, l), **tune)
        ref = decode_attention(q, u.k, u.v, want.length, page_size=ps, layer=l, bias=u.bias, k_scale=u.k_scale,
                               v_scale=u.v_scale, k_zero=u.k_zero, **tune)
        out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
        assert np.isfinite(out).all()
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6, err_msg=f"layer {l}")
        empty = np.repeat(counts[l] == 0, 2, axis=1)  # [B, Hq] the query heads of a KV head that kept nothing
        assert empty.any() and (out[empty] == 0).all() and (np.abs(out[~empty]).max(-1) > 0).all()


def _snapkv_prompt(rng: np.random.Generator, cfg: ModelConfig, lengths: np.ndarray, window: int):
    """A random prompt's uniform prefill cache and SnapKV's observations of it (its own `observe`): queries of
    each KV head at their own temperature, so some heads attend sharply and some broadly."""
    Ln, Hkv, Dh, Tp = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, int(lengths.max())
    Bn = len(lengths)
    cache = init_cache(cfg, Bn, Tp, page_size=ps, dtype=jnp.float32)
    temp = np.repeat(np.geomspace(0.3, 8.0, Hkv), cfg.num_heads // Hkv)[None, None, :, None]
    prompt = Prompt(tokens=jnp.zeros((Bn, Tp), jnp.int32), lengths=jnp.asarray(lengths, jnp.int32))
    snap = SnapKV(0.25, window=window)
    ks, vs, obs = [], [], []
    for _ in range(Ln):
        q = jnp.asarray(rng.standard_normal((Bn, Tp, cfg.num_heads, Dh)) * temp, jnp.float32)
        k, v = (jnp.asarray(rng.standard_normal((Bn, Tp, Hkv, Dh)), jnp.float32) for _ in range(2))
        obs.append(snap.observe(q, k, v, None, 0, prompt))
        ks.append(k.transpose(0, 2, 1, 3))
        vs.append(v.transpose(0, 2, 1, 3))
    ln = jnp.asarray(lengths, jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(Tp), (Bn, Tp))
    layers = [write_chunk(layer_view(cache.layers, l), ks[l], vs[l], 0, pos, ln) for l in range(Ln)]
    layers = summarize_pages(jax.tree.map(lambda *a: jnp.stack(a), *layers), ln, ps)
    return cache.replace(layers=layers, length=ln, next_position=ln), jnp.stack(obs), prompt


def test_adakv_pool_is_snapkv_memory_in_miniature(rng):
    """The issue's memory claim on a CPU-sized prompt: AdaKV(SnapKV(0.25)) and SnapKV(0.25) run their own
    `compress` (AdaKV's allocation code path) on the same random prompt; each head's kept count is read off
    the compressed cache. Both keep the same total per (layer, row) (the same average budget), AdaKV's heads
    very differently. Their pools (`write_kept_pool`, sized exactly by `pool_pages_needed`) differ by at most
    one page per (layer, row, head); the uniform layout gives AdaKV its largest head's capacity for every
    head, and its bytes are larger than AdaKV's pool by the factor the page counts give."""
    cfg = ModelConfig(family="llama", vocab_size=61, hidden_size=64, num_layers=2, num_heads=8, num_kv_heads=4,
                      head_dim=16, intermediate_size=48, max_position_embeddings=1024, eos_token_ids=(0,))
    lengths = np.array([512, 400])
    Ln, Bn, Hkv, Tp = cfg.num_layers, len(lengths), cfg.num_kv_heads, int(lengths.max())
    cache, obs, prompt = _snapkv_prompt(rng, cfg, lengths, window=8)
    setup = Setup(config=cfg, prompt_len=Tp, max_new_tokens=0, page_size=ps)
    policies = {"snapkv": SnapKV(0.25, window=8).bind(setup), "adakv": AdaKV(SnapKV(0.25, window=8)).bind(setup)}
    counts, pools, uniform = {}, {}, {}
    for name, policy in policies.items():
        cap = policy.compressed_capacity(Tp, 0)
        out = jax.jit(lambda c, o, p=policy, cap=cap: p.compress(c, o, cap, prompt))(cache, obs)
        c = (np.asarray(out.layers.positions) >= 0).sum(-1).astype(np.int32)  # [L, B, H] what each head kept
        n = int(pool_pages_needed(jnp.asarray(c), ps))
        S = out.capacity
        idx = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (Ln, Bn, Hkv, S))
        # one jitted program (eagerly, each of its operations compiles on its own)
        pool = jax.jit(write_kept_pool, static_argnums=(3,), static_argnames=("num_pages",))(
            out, idx, jnp.asarray(c), cap, num_pages=n)
        assert not bool(pool.alloc.overflow.any()) and int(pool.alloc.num_free) == 0
        assert pool.nbytes() == pool_nbytes(out.layers, Ln, Bn, Hkv, page_size=ps,
                                            max_pages_per_head=pool.max_pages_per_head, num_pages=n)
        for l in range(Ln):  # the pool holds what the policy kept
            live = np.arange(pool.max_pages_per_head * ps) < c[l][..., None]
            np.testing.assert_array_equal(np.asarray(layer_kv(pool, l).positions)[live],
                                          np.asarray(out.layers.positions[l])[:, :, :live.shape[-1]][live])
        counts[name], pools[name], uniform[name] = c, pool, out
    n_row = np.floor(0.25 * lengths + 1e-6).astype(int)  # SnapKV's per-head budget of each row
    np.testing.assert_array_equal(counts["snapkv"], np.broadcast_to(n_row[None, :, None], (Ln, Bn, Hkv)))
    np.testing.assert_array_equal(counts["adakv"].sum(-1), counts["snapkv"].sum(-1))  # the same budget
    # the premise of the comparison: AdaKV's largest head keeps well over the uniform budget (1.98-2.45x over
    # seeds; a 2x bound failed at seed 800230632, 1.98x)
    assert (counts["adakv"].max(-1) >= 1.5 * n_row).any(), "AdaKV moved budget between heads"
    pages = {name: -(-c // ps) for name, c in counts.items()}  # [L, B, H] pages each head occupies
    diff = pages["adakv"].sum(-1) - pages["snapkv"].sum(-1)  # per (layer, row)
    assert (np.abs(diff) <= Hkv).all(), f"more than a page per head apart: {diff}"
    # in bytes: at most a page per head more, and AdaKV's wider tables (its M covers its largest head)
    Ma, Ms = pools["adakv"].max_pages_per_head, pools["snapkv"].max_pages_per_head
    size = lambda n, m: pool_nbytes(uniform["adakv"].layers, Ln, Bn, Hkv, page_size=ps,  # noqa: E731
                                    max_pages_per_head=m, num_pages=n)
    per_page = size(2, Ma) - size(1, Ma)
    assert pools["adakv"].nbytes() - pools["snapkv"].nbytes() == (
        (pages["adakv"].sum() - pages["snapkv"].sum()) * per_page + size(1, Ma) - size(1, Ms))
    page_bytes = {name: p.pages.k.nbytes // p.num_pages for name, p in pools.items()}
    ada_pool, snap_pool = pools["adakv"].nbytes(), pools["snapkv"].nbytes()
    ada_uniform = uniform["adakv"].nbytes()
    largest = int(counts["adakv"].max())
    # the uniform cache holds the static capacity (AdaKV's bound on its largest head) in every head
    assert uniform["adakv"].capacity == pages_for(policies["adakv"].max_kept(Tp), ps) * ps >= largest
    factor = Ln * Bn * Hkv * uniform["adakv"].num_pages / pages["adakv"].sum()  # page slots, uniform / pool
    assert uniform["adakv"].kv_nbytes() == 2 * factor * pools["adakv"].pages.k.nbytes
    assert ada_uniform / ada_pool == pytest.approx(factor, rel=0.02)
    assert ada_uniform > 2 * ada_pool
    print(f"\nmemory in miniature (L={Ln}, B={Bn}, Hkv={Hkv}, D={cfg.head_dim}, prompts {lengths.tolist()}, ps={ps}, "
          f"fp32 K/V, all summaries; {page_bytes['adakv']} B of K per page):\n"
          f"  SnapKV(0.25) pool: {pages['snapkv'].sum()} pages, {snap_pool} B\n"
          f"  AdaKV(SnapKV(0.25)) pool: {pages['adakv'].sum()} pages, {ada_pool} B "
          f"({ada_pool / snap_pool:.4f}x SnapKV's; per (layer, row) page difference {diff.ravel().tolist()})\n"
          f"  AdaKV uniform cache: every head {uniform['adakv'].capacity} slots (largest head kept {largest}), "
          f"{ada_uniform} B = {ada_uniform / ada_pool:.3f}x its pool (page slots: {factor:.3f}x); sized to the "
          f"largest head it actually kept, {Ln * Bn * Hkv * -(-largest // ps)} pages = "
          f"{Ln * Bn * Hkv * -(-largest // ps) / pages['adakv'].sum():.3f}x its pool's")


def test_bad_input_is_refused(rng):
    """Clear errors before any work: more entries than a head may hold, counts of the wrong shape, negative
    counts to size, a decode pool asked for its prefill view, packed pages of the wrong shape."""
    cache = _prefilled(rng, None)
    k = jnp.zeros((L, B, H, K, D), jnp.float32)
    pos, bias = jnp.zeros((L, B, H, K), jnp.int32), jnp.zeros((L, B, H, K), jnp.float32)
    with pytest.raises(ValueError, match="20 entries per head do not fit a head of capacity 16"):
        write_entries_pool(cache, k, k, pos, bias, jnp.full((B,), 4), 16)
    with pytest.raises(ValueError, match="counts must be"):
        write_entries_pool(cache, k, k, pos, bias, jnp.full((L, B), 4), CAPACITY)
    with pytest.raises(ValueError, match="idx must be"):
        write_kept_pool(cache, jnp.zeros((L, B + 1, H, K), jnp.int32), jnp.full((B,), 4), CAPACITY)
    with pytest.raises(ValueError, match="counts must be >= 0, got a minimum of -1"):
        pool_pages_needed(jnp.asarray([3, -1]), ps)
    pool = write_entries_pool(cache, k, k, pos, bias, jnp.full((B,), 4), CAPACITY)
    with pytest.raises(ValueError, match="no prefill view"):
        stack_view(pool)
    with pytest.raises(ValueError, match="packed.k must be"):
        put_pages(pool, cache.layers)
