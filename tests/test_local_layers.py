"""Gemma 3's local layers keep a ring buffer of their window (`sparsekv_jax.local_layers`).

The ring path against transformers' `Gemma3ForCausalLM` and against the full-cache masked path
(``Backend(local_cache="full")``) on prompts several windows long, ragged rows, prefill in one pass,
in chunks and with a suffix read after it, decode past the window; the cache really holds the window
only; what each kind of policy does with the two kinds of layers, against oracles built from the
masked path's global layers; the stats; CHESS's rewinds, which need the ring's slack.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers as tf
from conftest import seeded_rng
from flax import struct

from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache, init_cache
from sparsekv_jax.generate import generate, prefill, teacher_force
from sparsekv_jax.models.config import gemma3_270m_config, gemma3_config
from sparsekv_jax.models.loading import load_hf_dir
from sparsekv_jax.models.params import random_params
from sparsekv_jax.models.transformer import interleaving
from sparsekv_jax.policies import CHESS, Policy, Quest, Setup, SnapKV, StreamingLLM
from sparsekv_jax.policies.base import Prompt
from sparsekv_jax.policies.common import budget_tokens, row_budgets

TOL = 1e-4
RING, FULL = Backend(), Backend(local_cache="full")


@pytest.fixture(scope="module")
def tiny(hf_tiny_dir):
    """(params, transformers model, fresh random prompts [2, 40] with lengths [40, 29]); window 8,
    layers 5 local, 1 global, 1 local."""
    path = hf_tiny_dir("gemma3")
    params, cfg = load_hf_dir(path, dtype=jnp.float32)
    model = tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rng = seeded_rng()
    return params, model, rng.integers(0, cfg.vocab_size, (2, 40)), np.array([40, 29])


def _transformers_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids[None])).logits[0].numpy()


@pytest.fixture(scope="module")
def runs(tiny):
    """Full attention through both paths: prefill (40 and 29 tokens: 5 and 3.6 windows), then 24 greedy
    tokens, three windows past it; and the ring path's logits along its own tokens."""
    params, _, tokens, lengths = tiny
    ring = generate(params, None, tokens, lengths=lengths, max_new_tokens=24, stop_tokens=(), backend=RING)
    full = generate(params, None, tokens, lengths=lengths, max_new_tokens=24, stop_tokens=(), backend=FULL)
    forced = np.asarray(ring.tokens)
    logits = np.asarray(teacher_force(params, None, tokens, forced, lengths=lengths, backend=RING)[0])
    return ring, full, forced, logits


def test_greedy_generation_matches_transformers_and_the_masked_path(tiny, runs):
    _, model, tokens, lengths = tiny
    ring, full, forced, ours = runs
    np.testing.assert_array_equal(np.asarray(ring.tokens), np.asarray(full.tokens))
    for b, n in enumerate(lengths):
        ref = _transformers_logits(model, np.concatenate([tokens[b, :n], forced[b]]))[n - 1:-1]
        assert np.abs(ours[b] - ref).max() <= TOL, (b, np.abs(ours[b] - ref).max())
        assert (forced[b] == ref.argmax(-1)).all()  # the ring path's greedy tokens are transformers' too


@pytest.mark.parametrize("mode", ["chunked", "suffix"])
def test_chunked_prefill_and_a_suffix_match_the_masked_path(tiny, mode):
    """Chunks of 6 (< the window: the chunk's queries need the ring and the chunk together) and a
    12-token suffix read against the rings after the prompt (`extend`)."""
    params, _, tokens, lengths = tiny
    forced = seeded_rng().integers(0, params.config.vocab_size, (2, 12))
    kw = dict(prefill_chunk=6) if mode == "chunked" else dict(suffix=forced, suffix_lengths=np.array([12, 7]))
    ring = np.asarray(teacher_force(params, None, tokens, forced, lengths=lengths, backend=RING, **kw)[0])
    full = np.asarray(teacher_force(params, None, tokens, forced, lengths=lengths, backend=FULL, **kw)[0])
    assert np.abs(ring - full).max() <= TOL, np.abs(ring - full).max()


def test_the_cache_holds_only_the_window(tiny, runs):
    params, _, tokens, lengths = tiny
    cfg = params.config
    ring, full = runs[:2]
    n_local, n_global = len(cfg.local_layer_ids()), len(cfg.global_layer_ids())
    assert ring.cache.local.k.shape == (n_local, 2, cfg.num_kv_heads, cfg.sliding_window, cfg.head_dim)
    assert ring.cache.layers.k.shape[0] == n_global and full.cache.layers.k.shape[0] == cfg.num_layers
    assert ring.stats["cache_bytes"] < 0.5 * full.stats["cache_bytes"]
    # stored: the global layer's prompt + each local layer's window, over every layer's prompt
    want = (n_global * lengths + n_local * np.minimum(cfg.sliding_window, lengths)) / (cfg.num_layers * lengths)
    np.testing.assert_allclose(np.asarray(ring.stats["kv_stored_fraction"]), want, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(full.stats["kv_stored_fraction"]), 1.0, rtol=1e-6)


def _global_only(cache: KVCache, cfg) -> KVCache:
    ids = np.asarray(cfg.global_layer_ids())
    return KVCache(layers=jax.tree.map(lambda a: a[ids], cache.layers), length=cache.length,
                   next_position=cache.next_position, page_size=cache.page_size)


def test_compressors_see_the_global_layers_and_leave_the_rings_alone(tiny):
    """SnapKV on the ring path = SnapKV run on the masked path's global layers alone (their prefill cache
    and observations); the rings are left as the prefill wrote them."""
    params, _, tokens, lengths = tiny
    cfg = params.config
    T, cap = tokens.shape[1], 48
    policy = SnapKV(0.25, window=4).bind(Setup(cfg.global_view(), prompt_len=T))
    prompt = Prompt(tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths))
    capacity = policy.compressed_capacity(T, 8)

    def prefilled(pol, backend, ring):  # jitted, as the library runs it (eagerly: each op compiled on its own)
        cache = init_cache(cfg, 2, cap, dtype=jnp.float32, ring=ring)
        run = jax.jit(lambda p, t, n, c: prefill(p, pol, t, n, c, backend=backend.resolve(params)))
        return run(params, jnp.asarray(tokens), jnp.asarray(lengths), cache)

    compress = jax.jit(lambda cache, obs: policy.compress(cache, obs, capacity, prompt))

    _, ring_cache, ring_obs, _ = prefilled(policy, RING, cfg.sliding_window)
    _, full_cache, full_obs, _ = prefilled(policy, FULL, None)
    ids = np.asarray(cfg.global_layer_ids())
    assert ring_obs["compress"].shape[0] == len(ids)
    got = compress(ring_cache, ring_obs["compress"])
    want = compress(_global_only(full_cache, cfg), full_obs["compress"][ids])
    np.testing.assert_array_equal(np.asarray(got.layers.positions), np.asarray(want.layers.positions))
    np.testing.assert_allclose(np.asarray(got.layers.k), np.asarray(want.layers.k), atol=TOL)
    assert got.capacity < ring_cache.capacity
    for a, b in zip(jax.tree.leaves(got.local), jax.tree.leaves(ring_cache.local), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@struct.dataclass
class _GlobalLayersOnly(Policy):
    """On the masked path: ``inner``'s page selection in the global layers, every page in the local ones."""

    inner: Policy = struct.field(pytree_node=False, default=None)
    local: tuple[bool, ...] = struct.field(pytree_node=False, default=())
    stages = ("decode",)

    def bind(self, setup):
        return self.replace(inner=self.inner.bind(setup))

    @property
    def page_summaries(self):  # a wrapper reads what its inner policy reads
        return self.inner.page_summaries

    def decode_select(self, q, kv, length, layer_state, shared_state, layer_index, page_size):
        ids, counts = self.inner.decode_select(q, kv, length, layer_state, shared_state, layer_index, page_size)
        every = jnp.broadcast_to(jnp.arange(ids.shape[-1], dtype=ids.dtype), ids.shape)
        used = jnp.broadcast_to((-(-length // page_size))[:, None], counts.shape).astype(counts.dtype)
        local = jnp.asarray(self.local)[layer_index]
        return jnp.where(local, every, ids), jnp.where(local, used, counts)


def test_decode_selection_reads_the_global_layers_sparsely(tiny, runs):
    """Quest on the ring path = Quest applied to the global layers of the masked path (local layers read
    their window); its read fraction counts every layer's entries: a local layer reads its window."""
    params, _, tokens, lengths = tiny
    cfg = params.config
    quest = Quest(budget=8, page_size=8, dense_layers=0)
    local = tuple(t == "sliding_attention" for t in cfg.layer_types)
    forced, dense = runs[2:]
    ring = np.asarray(teacher_force(params, quest, tokens, forced, lengths=lengths, page_size=8, backend=RING)[0])
    full = np.asarray(teacher_force(params, _GlobalLayersOnly(inner=quest, local=local), tokens, forced,
                                    lengths=lengths, page_size=8, backend=FULL)[0])
    assert np.abs(ring - full).max() <= TOL, np.abs(ring - full).max()
    assert np.abs(ring - dense).max() > 100 * TOL  # the selection is sparse enough to matter

    out = generate(params, quest, tokens, lengths=lengths, max_new_tokens=6, stop_tokens=(), page_size=8,
                   backend=RING)
    n_local, n_global, W = len(cfg.local_layer_ids()), len(cfg.global_layer_ids()), cfg.sliding_window
    k = quest.pages_read(tokens.shape[1])  # pages Quest reads in a global layer
    want = []
    for n in lengths:
        steps = []
        for s in range(5):  # the first token comes from the prefill; 5 decode steps write tokens n .. n+4
            in_use = n + s + 1
            used = math.ceil(in_use / 8)
            read_global = min(used, k) / used * in_use
            steps.append((n_global * read_global + n_local * W) / (n_global * in_use + n_local * W))
        want.append(np.mean(steps))
    np.testing.assert_allclose(np.asarray(out.stats["kv_read_fraction"]), want, rtol=1e-5)


def test_stored_fraction_counts_budget_and_windows(tiny):
    params, _, tokens, lengths = tiny
    cfg = params.config
    out = generate(params, StreamingLLM(budget=0.25, sinks=2), tokens, lengths=lengths, max_new_tokens=3,
                   stop_tokens=(), backend=RING)
    kept = np.asarray(row_budgets(0.25, jnp.asarray(lengths)))
    assert kept.tolist() == [budget_tokens(0.25, int(n)) for n in lengths]
    n_local, n_global = len(cfg.local_layer_ids()), len(cfg.global_layer_ids())
    want = (n_global * kept + n_local * np.minimum(cfg.sliding_window, lengths)) / (cfg.num_layers * lengths)
    np.testing.assert_allclose(np.asarray(out.stats["kv_stored_fraction"]), want, rtol=1e-6)


@struct.dataclass
class _StableCHESS(CHESS):
    """Re-selection returns the first selection again (anchor fixed at the prompt's end)."""

    prompt_end: int = struct.field(pytree_node=False, default=0)

    def select_pages(self, cache, anchor_end):
        return super().select_pages(cache, jnp.minimum(anchor_end, self.prompt_end))


def test_rewinds_past_the_window_keep_the_keys_it_needs(tiny):
    """CHESS taking back whole pages of 16 tokens (twice the window) three times, with an unchanged
    selection, must regenerate exactly the same tokens: the ring's slack keeps the keys a regenerated
    token's window reaches back to (a ring of the window alone would have overwritten them)."""
    params, _, tokens, lengths = tiny
    lengths = np.array([40, 40])
    kw = dict(ratios="aggressive", page_size=16, chunk_pages=1, grid_chunks=1, prompt_end=40, max_backtracks=3)
    gen = lambda pol: generate(params, pol, tokens, lengths=lengths, max_new_tokens=48, stop_tokens=(),  # noqa: E731
                               page_size=16, backend=RING)
    calm = gen(_StableCHESS(**kw))  # thresholds are leaves: one program for both
    shaky = gen(_StableCHESS(**kw, entropy_threshold=0.0, varentropy_threshold=0.0))
    np.testing.assert_array_equal(np.asarray(calm.stats["backtracks"]), [0, 0])
    np.testing.assert_array_equal(np.asarray(shaky.stats["backtracks"]), [3, 3])
    assert shaky.cache.local.k.shape[-2] == params.config.sliding_window + 3 * 16
    np.testing.assert_array_equal(np.asarray(shaky.tokens), np.asarray(calm.tokens))


def test_layer_arrangements():
    """Gemma 3's layer groups are found; another arrangement is refused before any tracing."""
    assert interleaving(gemma3_270m_config()) == (5, 3, 0)
    one_b = gemma3_config(vocab_size=8, hidden_size=8, num_layers=26, num_heads=2, num_kv_heads=1, head_dim=4,
                          intermediate_size=8)
    assert interleaving(one_b) == (5, 4, 2)  # Gemma 3 1B: 26 layers, two local layers after the last group
    odd = dataclasses.replace(one_b, num_layers=5, layer_types=("sliding_attention", "full_attention",
                                                                "sliding_attention", "sliding_attention",
                                                                "full_attention"))
    params = random_params(odd, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="local_cache='full'"):
        generate(params, None, np.ones((1, 4), np.int32), max_new_tokens=1, backend=RING)
