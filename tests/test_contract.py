"""The contract every registered policy keeps, run through `generate` on a tiny random model.

Iterates the spec registry (`sparsekv_jax.policies.spec.REGISTRY`), so a new policy is checked as
soon as it is registered: stats are fractions in [0, 1]; a compressor stores no more than its
budget and its cache is really smaller; the policy's `covering()` instance (a budget covering the
prompt) gives logits *identical* to full attention. Each policy runs on an fp32 or an int8 KV cache
(`Backend(kv_dtype="int8")`, issue #39; CHESS and SemantiCache read the cache's K/V themselves,
dequantised), dealt from the run's seed (`REGISTERED`: half on each cache every run, every policy on both
across runs); on int8 the covering instance must give the logits of full attention on the same int8 cache.

The same for compress × decode `Pipeline` pairs, drawn each run (`DRAWN`): every compressor in one pair,
with a decoder and a cache (fp32 or int8) dealt from the run's seed so that every decoder meets both
caches every run; across runs every pair meets both caches, and a failing draw replays from the printed
seed. All 23 pairs on both caches (46 tests, each compiling its own two programs) were 200 of this
file's 326 s; the pairs' contract is the same code path whichever compressor meets whichever decoder.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.backend import Backend
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig, gemma3_config
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import Dense, HeadSplit, Pipeline, Policy
from sparsekv_jax.policies.common import budget_tokens
from sparsekv_jax.policies.spec import REGISTRY

CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=512, eos_token_ids=(0,))
T, LENGTHS, NEW = 160, np.array([160, 130]), 5  # SnapKV's default window (32) fits 25% of both


def _registered() -> dict[str, Policy]:
    """One default instance per registered policy class (aliases collapsed; `Pipeline` is checked
    through the pairs below)."""
    out: dict[str, Policy] = {}
    for name, factory in sorted(REGISTRY.items()):
        policy = factory()
        if isinstance(policy, Pipeline) or any(type(p) is type(policy) for p in out.values()):
            continue
        if isinstance(policy, HeadSplit):  # a calibration per model; the tiny model has none: seeded random scores
            policy = policy.replace(head_scores=seeded_rng().random((CFG.num_layers, CFG.num_kv_heads)))
        out[name] = policy
    return out


POLICIES = _registered()
COMPRESS = {n: p for n, p in POLICIES.items() if "compress" in p.stages}
DECODE = {n: p for n, p in POLICIES.items() if "decode" in p.stages}
PAIRS = {f"{c}+{d}": Pipeline(compress=POLICIES[c], decode=POLICIES[d])
         for c, d in itertools.product(COMPRESS, DECODE) if POLICIES[c] is not POLICIES[d]}


def _deal(rng: np.random.Generator) -> dict[str, list[str]]:
    """This run's pairs per cache, ``{"fp32": [...], "int8": [...]}``: the compressors in a drawn order,
    each dealt the next of the (decoder, cache) cells in a drawn order (8 compressors over 6 cells: every
    cell at least once), drawn again while a policy would meet itself (H2O compresses and decodes)."""
    cells = [(d, cache) for d in DECODE for cache in ("fp32", "int8")]
    while True:
        comps, order = rng.permutation(sorted(COMPRESS)), rng.permutation(len(cells))
        dealt = [(str(c), *cells[order[i % len(cells)]]) for i, c in enumerate(comps)]
        if all(f"{c}+{d}" in PAIRS for c, d, _ in dealt):
            return {cache: sorted(f"{c}+{d}" for c, d, k in dealt if k == cache) for cache in ("fp32", "int8")}


DRAWN = _deal(seeded_rng())  # at collection: the same draw on every pytest-xdist worker (the run's seed)


def _deal_registered(rng: np.random.Generator) -> dict[str, list[str]]:
    """This run's registered policies per cache, ``{"fp32": [...], "int8": [...]}``: the policies in a drawn
    order, dealt to the two caches in turn (each cache gets half of them every run; across runs every policy
    meets both, and a failing draw replays from the printed seed). Every policy on both caches every run
    (32 tests, each compiling its own `generate` and `teacher_force` programs) was about half of this
    file's time; one cache's contract is the other's code path with the cache's codes read dequantised."""
    order = rng.permutation(sorted(POLICIES))
    return {cache: sorted(str(n) for n in order[i::2]) for i, cache in enumerate(("fp32", "int8"))}


REGISTERED = _deal_registered(np.random.default_rng([int(seeded_rng().integers(1 << 30)), 0xCAC4E]))


def _setup(cfg: ModelConfig, tokenizer, backend: Backend | None = None):
    params = random_params(cfg, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, 0.3)
    tokens = seeded_rng().integers(1, cfg.vocab_size, (2, T))
    dense = generate(params, Dense(), tokens, lengths=LENGTHS, max_new_tokens=NEW, stop_tokens=(), backend=backend)
    forced = np.asarray(dense.tokens)
    dense_logits = np.asarray(teacher_force(params, Dense(), tokens, forced, lengths=LENGTHS, backend=backend)[0])
    return params, tokenizer, tokens, dense, forced, dense_logits, backend


@pytest.fixture(scope="module")
def setup(smol):
    return _setup(CFG, smol[2])


def _check_run(policy: Policy, setup) -> None:
    params, tokenizer, tokens, dense, _, _, backend = setup
    policy = policy.with_tokenizer(tokenizer)
    out = generate(params, policy, tokens, lengths=LENGTHS, max_new_tokens=NEW, stop_tokens=(), backend=backend)
    assert np.asarray(out.num_generated).tolist() == [NEW, NEW]
    # the cache holds the page summaries the policy declares and no other (one it reads undeclared
    # is None: the run above fails)
    assert out.cache.layers.summaries == policy.page_summaries, (policy.name, out.cache.layers.summaries)
    for key in ("kv_stored_fraction", "kv_read_fraction", "prefill_block_fraction"):
        value = np.asarray(out.stats[key], np.float64)
        assert np.isfinite(value).all() and (value >= 0).all() and (value <= 1 + 1e-6).all(), (key, value)
    squeezer = policy.stage("compress")
    budget = getattr(squeezer, "budget", None)
    stored = np.asarray(out.stats["kv_stored_fraction"])
    if isinstance(budget, (int, float)) and not isinstance(budget, bool):
        for b, n in enumerate(LENGTHS):
            assert stored[b] * n <= budget_tokens(budget, int(n)) + 1e-4, (policy.name, b, stored[b])
    if (stored < 1).all() and "compress" in policy.stages:
        assert out.stats["cache_bytes"] < dense.stats["cache_bytes"], "compression must free memory"
        assert out.cache.capacity < dense.cache.capacity


def _check_covering(policy: Policy, setup) -> None:
    params, tokenizer, tokens, _, forced, dense_logits, backend = setup
    got = teacher_force(params, policy.with_tokenizer(tokenizer), tokens, forced, lengths=LENGTHS, backend=backend)[0]
    np.testing.assert_array_equal(np.asarray(got), dense_logits)


@pytest.mark.parametrize("name", REGISTERED["fp32"])
def test_registered_policy_keeps_the_contract(name, setup):
    _check_run(POLICIES[name], setup)
    _check_covering(type(POLICIES[name]).covering(), setup)


@pytest.mark.parametrize("pair", DRAWN["fp32"])
def test_compress_decode_pair_keeps_the_contract(pair, setup):
    _check_run(PAIRS[pair], setup)
    compress, decode = PAIRS[pair].stage("compress"), PAIRS[pair].stage("decode")
    _check_covering(Pipeline(compress=type(compress).covering(), decode=type(decode).covering()), setup)


@pytest.fixture(scope="module")
def int8_setup(smol):
    return _setup(CFG, smol[2], Backend(kv_dtype="int8"))


def _check_int8(policy: Policy, covering: Policy, setup) -> None:
    """The contract on an int8 cache: the run's checks, and the covering instance equal to full
    attention on the same int8 cache."""
    assert setup[3].cache.layers.k.dtype == jnp.int8 and setup[3].cache.layers.quantized
    _check_run(policy, setup)
    _check_covering(covering, setup)


@pytest.mark.share(2)
@pytest.mark.parametrize("name", REGISTERED["int8"])
def test_registered_policy_keeps_the_contract_on_an_int8_cache(name, int8_setup):
    _check_int8(POLICIES[name], type(POLICIES[name]).covering(), int8_setup)


@pytest.mark.parametrize("pair", DRAWN["int8"])
def test_compress_decode_pair_keeps_the_contract_on_an_int8_cache(pair, int8_setup):
    compress, decode = PAIRS[pair].stage("compress"), PAIRS[pair].stage("decode")
    _check_int8(PAIRS[pair], Pipeline(compress=type(compress).covering(), decode=type(decode).covering()),
                int8_setup)


def test_registry_covers_every_stage():
    """The matrix is not vacuous: there are compressors, decoders and pairs to check; this run's pairs
    take every compressor once and every decoder on both caches; every registered policy runs on one cache
    (half of them on each)."""
    assert len(COMPRESS) >= 3 and len(DECODE) >= 2 and len(PAIRS) >= 5
    assert sorted(REGISTERED["fp32"] + REGISTERED["int8"]) == sorted(POLICIES), REGISTERED
    assert abs(len(REGISTERED["fp32"]) - len(REGISTERED["int8"])) <= 1, REGISTERED
    drawn = [(pair, cache) for cache, pairs in DRAWN.items() for pair in pairs]
    assert sorted(p.split("+")[0] for p, _ in drawn) == sorted(COMPRESS), DRAWN
    assert {(p.split("+")[1], cache) for p, cache in drawn} == {(d, c) for d in DECODE for c in DRAWN}, DRAWN


# Gemma 3's interleaved layers (docs/GEMMA3.md): local layers keep ring buffers, the policy manages the
# global layers' cache. The policies whose hooks meet the per-layer stacks in ways the others do not:
# observations and layer state per global layer (H2O), layer gating and bind (BSER), shared state and the
# ring's slack for rewinds (CHESS). Compression and page selection are checked against the masked path's
# global layers in tests/test_local_layers.py (every registered policy passes this contract on the ring
# path; the rest are left out to keep the suite short).
GEMMA = gemma3_config(vocab_size=61, hidden_size=64, num_layers=7, num_heads=4, num_kv_heads=2, head_dim=16,
                      intermediate_size=48, sliding_window=16, max_position_embeddings=512, eos_token_ids=(0,))
GEMMA_POLICIES = ("bser", "chess", "h2o")


@pytest.fixture(scope="module")
def gemma_setup(smol):
    return _setup(GEMMA, smol[2])


@pytest.mark.share(2)
@pytest.mark.parametrize("name", GEMMA_POLICIES)
def test_registered_policy_keeps_the_contract_on_interleaved_layers(name, gemma_setup):
    assert gemma_setup[3].cache.local is not None  # the ring path
    _check_run(POLICIES[name], gemma_setup)
    _check_covering(type(POLICIES[name]).covering(), gemma_setup)
