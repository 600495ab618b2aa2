"""`Backend` decides every platform question and `pallas.dispatch` which function runs.

The choices are checked for both platforms by naming one (``Backend(platform="gpu")``): no GPU is
needed to see which implementation a GPU run would take. Where a choice runs something here, a spy
on the kernel module shows that the kernel, not its reference, was reached (interpreted on a CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.backend import Backend, resolved
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.pallas import dispatch
from sparsekv_jax.policies import CHESS, H2O, SemantiCache
from sparsekv_jax.policies.base import Setup

GPU, CPU = Backend(platform="gpu"), Backend(platform="cpu")
CFG = ModelConfig(family="llama", vocab_size=71, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=1024)


def test_resolve_fixes_the_platform_and_every_auto():
    g, c = GPU.resolve(), CPU.resolve()
    assert (g.decode_attention, g.sparse_prefill, g.page_sums, g.interpret, g.platform) == (
        "pallas", "pallas", "pallas", False, "gpu")
    assert (c.decode_attention, c.sparse_prefill, c.page_sums, c.interpret, c.platform) == (
        "jnp", "jnp", "jnp", True, "cpu")
    assert g.resolved and c.resolved and not GPU.resolved
    assert g.gpu and not c.gpu
    assert Backend.kernels().resolve().platform == resolved().platform == jax.default_backend()
    assert resolved() is resolved(None)  # the process's default, resolved once
    with pytest.raises(ValueError, match="platform=3"):
        Backend(platform=3)


def test_nothing_reads_the_environment_but_from_env(monkeypatch):
    monkeypatch.setenv("SPARSEKV_DECODE_MATMUL", "pallas")
    assert Backend().decode_matmul == "auto"
    assert Backend.from_env().decode_matmul == "pallas"
    assert Backend.from_env(decode_matmul="xla").decode_matmul == "xla"
    monkeypatch.setenv("SPARSEKV_DECODE_MATMUL", "cublas")
    with pytest.raises(ValueError, match="SPARSEKV_DECODE_MATMUL='cublas'"):
        Backend.from_env()


@pytest.mark.parametrize("backend, want", [(GPU, True), (CPU, False)], ids=["gpu", "cpu"])
def test_auto_choices_follow_the_backends_platform(backend, want):
    kernel = "pallas" if want else "jnp"
    assert dispatch.gsc_method(backend, "auto", 64) == kernel
    assert dispatch.gsc_method(backend, "auto", 48) == "jnp"  # a band the kernel does not take
    assert dispatch.gsc_method(backend, "interpret", 64) == "interpret"
    assert dispatch.threshold_top_k_method(backend, 1024, 32) is want
    assert dispatch.threshold_top_k_method(backend, 1000, 32) is False  # not a power of two
    assert dispatch.sae_gather_method(backend, 64) == ("pallas" if want else "xla")
    assert dispatch.sae_gather_method(backend, 60) == "xla"
    assert dispatch.rope_page_sums_method(backend, 16) == kernel
    assert dispatch.rope_page_sums_method(backend, 24) == "jnp"  # half head dim 12: the kernel's tables want 2^n
    from sparsekv_jax.retrieval.scan import ScanConfig
    from sparsekv_jax.sae.model import resolve_decode
    from sparsekv_jax.sae.topk import resolve_method

    assert resolve_method("auto", 1024, 32, backend) == ("threshold" if want else "lax")
    assert resolve_decode("auto", 64, backend) == ("pallas" if want else "xla")
    params = type("P", (), {"dtype": jnp.bfloat16})()
    scan = ScanConfig(chunk=512).resolve(params, backend)
    assert (scan.features, scan.attention) == (("threshold", "cudnn") if want else ("lax", "blocked"))


def test_gsc_method_names_the_bad_value():
    with pytest.raises(ValueError, match="gsc='cuda'"):
        dispatch.gsc_method(None, "cuda", 16)
    with pytest.raises(ValueError, match="got 48"):
        dispatch.gsc_method(None, "pallas", 48)


def test_h2o_attention_mass_takes_the_bound_backends_implementation(monkeypatch, rng):
    """Bound to a GPU backend, H2O's observation is the dense scan (the blocked one is never called);
    bound to a CPU backend, the blocked one. Both give the same mass (the reference: numpy)."""
    from sparsekv_jax.policies import h2o as module

    calls = []
    blocked = module._blocked_mass
    monkeypatch.setattr(module, "_blocked_mass", lambda *a: calls.append(1) or blocked(*a))
    B, T, Hq, Hkv, D = 2, 20, 4, 2, 8
    q = rng.standard_normal((B, T, Hq, D)).astype(np.float32)
    k = rng.standard_normal((B, T, Hkv, D)).astype(np.float32)
    lengths = np.array([20, 13])
    s = np.einsum("bqhgd,bthd->bhgqt", q.reshape(B, T, Hkv, Hq // Hkv, D), k) / np.sqrt(D)
    t = np.arange(T)
    ok = (t[None, :] <= t[:, None])[None] & (t[None, :, None] < lengths[:, None, None])
    s = np.where(ok[:, None, None], s, -np.inf)
    with np.errstate(invalid="ignore"):  # a query past its row's length sees nothing: 0/0, counted as 0
        p = np.exp(s - s.max(-1, keepdims=True))
        want = np.nan_to_num(p / p.sum(-1, keepdims=True)).sum((2, 3))
    prompt = type("Prompt", (), {"lengths": jnp.asarray(lengths)})()
    for backend, blocked_calls in ((GPU, 0), (CPU, 1)):
        calls.clear()
        pol = H2O(budget=0.5).bind(Setup(CFG, prompt_len=T, backend=backend.resolve()))
        assert pol.backend.platform == backend.platform
        got = pol.observe(jnp.asarray(q), jnp.asarray(k), None, None, 0, prompt)
        assert len(calls) == blocked_calls
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_chess_holds_the_backend_and_reaches_the_kernel_through_dispatch(monkeypatch, rng):
    """Bound to the kernels' backend CHESS's rebuild calls the Pallas page sums (interpreted here);
    bound to the reference's, the jnp reference; the scores agree. No mesh or page_sums field: the
    backend is the one value asked."""
    from sparsekv_jax.cache import init_cache

    kernel_calls, reference_calls = [], []
    kernel, reference = dispatch._page_rope.rope_page_sums, dispatch._page_rope.rope_page_sums_reference
    monkeypatch.setattr(dispatch._page_rope, "rope_page_sums",
                        lambda *a, **k: kernel_calls.append(1) or kernel(*a, **k))
    monkeypatch.setattr(dispatch._page_rope, "rope_page_sums_reference",
                        lambda *a, **k: reference_calls.append(1) or reference(*a, **k))
    kernels = CHESS(page_size=32).bind(Setup(CFG, backend=Backend.kernels().resolve()))
    plain = CHESS(page_size=32).bind(Setup(CFG, backend=Backend.reference().resolve()))
    assert kernels.page_sums == "pallas" and plain.page_sums == "jnp" and CHESS().page_sums == "jnp"
    assert kernels.backend.page_sums == "pallas" and not hasattr(kernels, "mesh")
    assert kernels.spec_key() == plain.spec_key()  # where it runs is not what it is
    S = 128
    cache = init_cache(CFG, 1, S, page_size=16, dtype=jnp.float32)
    k = jnp.asarray(rng.standard_normal((CFG.num_layers, 1, CFG.num_kv_heads, S, CFG.head_dim)), jnp.float32)
    pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), k.shape[:-1])  # consecutive: the kernel's path
    cache = cache.replace(layers=cache.layers.replace(k=k, positions=pos), length=jnp.asarray([100], jnp.int32))
    got, _ = kernels._page_scores(cache, cache.length)
    assert kernel_calls and not reference_calls
    want, _ = plain._page_scores(cache, cache.length)
    assert reference_calls
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4 * float(np.abs(want).max()))


def test_semanticache_resolves_gsc_from_the_bound_backend():
    kw = dict(budget=0.5, chunking="fixed", chunk_size=64, keys="post_rope")
    pol = SemantiCache(**kw).bind(Setup(CFG, prompt_len=256, backend=CPU.resolve()))
    assert pol.backend.platform == "cpu" and pol.spec_key() == SemantiCache(**kw).spec_key()
    assert dispatch.gsc_method(pol.backend, pol.gsc, 64) == "jnp"
    assert dispatch.gsc_method(SemantiCache(**kw).bind(Setup(CFG, prompt_len=256, backend=GPU.resolve())).backend,
                               "auto", 64) == "pallas"
