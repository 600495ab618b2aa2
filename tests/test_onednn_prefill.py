"""The CPU prefill compiled with oneDNN's dots (`Backend.prefill_dots`): the runnable-fusion check
on the shapes oneDNN is known to fail, the fallback, and prefill values against XLA's own dots.

A fusion the check wrongly let through would kill this process with SIGILL when it first runs, so
`test_compile_prefill_runs_every_shape` fails loudly if the check misses a shape XLA forms."""

from __future__ import annotations

import platform

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.backend import Backend, onednn_dots_available, onednn_fusions_runnable
from sparsekv_jax.engine import prepare_program, setup
from sparsekv_jax.generate import generate
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import Dense, SnapKV

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=64, num_layers=2, num_heads=6, num_kv_heads=2,
                  head_dim=16, intermediate_size=96, max_position_embeddings=1024, eos_token_ids=(0,))
X86 = platform.machine().lower() in ("x86_64", "amd64")
# oneDNN's dots in use: x86 and oneDNN's values right on this CPU (`onednn_dots_available`'s probe; not on an AMD
# EPYC with AVX2 only, where a dot's post-op chain came back inf)
ONEDNN_RUNS = onednn_dots_available()
ONEDNN = Backend(prefill_dots="onednn", interpret=True).resolve()


def _rand(*shape: int) -> np.ndarray:
    return seeded_rng().standard_normal(shape).astype(np.float32)


# (name, f(a [64, 96], w [96, 128], c [64, 128]), numpy reference, a fusion oneDNN runs as XLA forms it)
PATTERNS = [
    ("dot alone", lambda a, w, c: a @ w, lambda a, w, c: a @ w, True),
    ("post-op chain", lambda a, w, c: jnp.exp(0.1 * (a @ w) - c), lambda a, w, c: np.exp(0.1 * (a @ w) - c), True),
    ("gather before the dot", lambda a, w, c: (a * a)[3:9] @ w, lambda a, w, c: (a * a)[3:9] @ w, True),
    # jaxlib 0.10.2 puts the work before the dot into the fusion (SIGILL when run); 0.11.2 leaves it out
    ("elementwise producer", lambda a, w, c: (a * a) @ w, lambda a, w, c: (a * a) @ w, None),
    ("dot feeding a dot", lambda a, w, c: (a @ w) @ w.T, lambda a, w, c: (a @ w) @ w.T, None),
    ("post-op of an inner product", lambda a, w, c: a @ w + c * c, lambda a, w, c: a @ w + c * c, None),
]


def _onednn_right_here() -> bool:
    """Whether this CPU's oneDNN computes a dot with a post-op chain and a bias as XLA does, on other shapes and
    data than the library's probe: the probe has to agree with it."""
    if not X86:
        return False
    rng = np.random.default_rng(1)
    a, w, c = (rng.standard_normal(shape).astype(np.float32) for shape in ((40, 72), (72, 56), (40, 56)))
    lowered = jax.jit(lambda a, w, c: jnp.tanh(0.5 * (a @ w) + c) * 2.0).lower(a, w, c)
    got = np.asarray(lowered.compile(compiler_options=ONEDNN.prefill_compiler_options())(a, w, c))
    return bool(np.isfinite(got).all() and np.allclose(got, np.tanh(0.5 * (a @ w) + c) * 2.0, rtol=1e-4, atol=1e-4))


def test_onednn_is_used_exactly_on_x86_where_it_computes_right():
    """On x86 the probe's answer is oneDNN's own correctness on this CPU (checked apart here); elsewhere no oneDNN."""
    assert onednn_dots_available() == _onednn_right_here()
    if not X86:
        assert not onednn_dots_available()
    assert ONEDNN.prefill_compiler_options() is not None
    assert Backend(prefill_dots="xla").prefill_compiler_options() is None


@pytest.mark.parametrize("name,fn,ref,runnable", PATTERNS, ids=[p[0] for p in PATTERNS])
def test_compile_prefill_runs_every_shape(name, fn, ref, runnable):
    """`compile_prefill` runs each of these programs (a oneDNN fusion the check wrongly passed would
    kill the process here) and keeps oneDNN's dots for the shapes oneDNN runs."""
    a, w, c = _rand(64, 96), _rand(96, 128), _rand(64, 128)
    lowered = jax.jit(fn).lower(a, w, c)
    if X86:  # the options take: oneDNN fusions in the program
        assert '"__onednn_fusion"' in lowered.compile(compiler_options=ONEDNN.prefill_compiler_options()).as_text()
    compiled = ONEDNN.compile_prefill(lowered)
    if runnable:
        assert ('"__onednn_fusion"' in compiled.as_text()) == ONEDNN_RUNS
    np.testing.assert_allclose(np.asarray(compiled(a, w, c)), ref(a, w, c), rtol=2e-4, atol=2e-4)


def _module(*body: str) -> str:
    """A compiled program's text (the format of ``Compiled.as_text()``) with one oneDNN fusion of ``body``."""
    return "\n".join([
        "HloModule m, is_scheduled=true", "",
        "%fused_computation (param_0: f32[4,8], param_1: f32[8,2], param_2: f32[4,2]) -> f32[4,2] {", *body, "}", "",
        "ENTRY %main.1 (a.1: f32[4,8], w.1: f32[8,2], c.1: f32[4,2]) -> f32[4,2] {",
        "  %a.1 = f32[4,8]{1,0} parameter(0)", "  %w.1 = f32[8,2]{1,0} parameter(1)",
        "  %c.1 = f32[4,2]{1,0} parameter(2)",
        '  ROOT %onednn_fusion = f32[4,2]{1,0} fusion(%a.1, %w.1, %c.1), kind=kCustom, calls=%fused_computation, '
        'backend_config={"fusion_config":{"kind":"__onednn_fusion"},"outer_dimension_partitions":[]}', "}", ""])


PARAMS = ["  %param_0 = f32[4,8]{1,0} parameter(0)", "  %param_1 = f32[8,2]{1,0} parameter(1)",
          "  %param_2 = f32[4,2]{1,0} parameter(2)"]
DOT = "dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}"


@pytest.mark.parametrize("body,runnable", [
    ([f"  ROOT %dot.1 = f32[4,2]{{1,0}} {DOT}"], True),
    ([f"  %dot.1 = f32[4,2]{{1,0}} {DOT}", "  %constant.1 = f32[] constant(0.5)",
      "  %multiply.1 = f32[4,2]{1,0} multiply(%dot.1, %param_2)",
      "  %add.1 = f32[4,2]{1,0} add(%multiply.1, %constant.1)",
      "  ROOT %exponential.1 = f32[4,2]{1,0} exponential(%add.1)"], True),
    (["  %multiply.0 = f32[4,8]{1,0} multiply(%param_0, %param_0)",
      "  ROOT %dot.1 = f32[4,2]{1,0} dot(%multiply.0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}"],
     False),  # work before the dot
    ([f"  %dot.1 = f32[4,2]{{1,0}} {DOT}", "  %multiply.0 = f32[4,2]{1,0} multiply(%param_2, %param_2)",
      "  ROOT %add.1 = f32[4,2]{1,0} add(%dot.1, %multiply.0)"], False),  # a post-op of an inner product
    ([f"  %dot.1 = f32[4,2]{{1,0}} {DOT}",
      "  ROOT %dot.2 = f32[4,2]{1,0} dot(%dot.1, %param_2), lhs_contracting_dims={1}, rhs_contracting_dims={0}"],
     False),  # two dots
    ([f"  %dot.1 = f32[4,2]{{1,0}} {DOT}", "  %constant.1 = f32[] constant(0.5)",
      "  %broadcast.1 = f32[4,2]{1,0} broadcast(%constant.1), dimensions={}",
      "  ROOT %multiply.1 = f32[4,2]{1,0} multiply(%dot.1, %broadcast.1)"], False),  # a broadcast made inside
], ids=["dot", "post-op chain", "pre-op", "inner post-op", "two dots", "inner broadcast"])
def test_check_on_fusion_shapes(body, runnable):
    """The check on each fusion shape, in the text format of jaxlib 0.10.2 and 0.11.2."""
    assert onednn_fusions_runnable(_module(*PARAMS, *body)) == runnable


def test_check_refuses_what_it_cannot_read():
    text = 'ROOT %f = f32[2] fusion(%p), kind=kCustom, calls=%missing, backend_config={"kind":"__onednn_fusion"}'
    assert not onednn_fusions_runnable(text)
    assert onednn_fusions_runnable("HloModule m\n\nENTRY %main () -> f32[] {\n}\n")


def test_bad_settings_name_the_value():
    with pytest.raises(ValueError, match="prefill_dots='mkl'"):
        Backend(prefill_dots="mkl")
    with pytest.raises(ValueError, match="unresolved"):
        Backend().prefill_compiler_options()
    bf16 = random_params(CFG, jax.random.key(0), jnp.bfloat16, 0.3)
    assert Backend().resolve(bf16).prefill_dots == "xla"  # oneDNN is chosen for fp32 weights only
    fp32 = random_params(CFG, jax.random.key(0), jnp.float32, 0.3)
    assert Backend().resolve(fp32).prefill_dots == ("onednn" if ONEDNN_RUNS else "xla")


@pytest.mark.share(2)
@pytest.mark.parametrize("policy,suffix", [(Dense(), False), (SnapKV(0.4, window=8), False), (SnapKV(0.4, window=8),
                                                                                                   True)])
def test_prefill_on_onednn_matches_xla_dots(policy, suffix):
    """Ragged rows, batch 3, a prompt past one attention block (the blocked attention): the prefill
    program stays in the shape oneDNN runs (no fallback), and its logits and cache match XLA's."""
    params = random_params(CFG, jax.random.key(int(seeded_rng().integers(1 << 30))), jnp.float32, 0.3)
    rng = seeded_rng()
    tokens, lengths = rng.integers(1, CFG.vocab_size, (3, 300)), np.array([300, 271, 190])
    kw = dict(suffix=rng.integers(1, CFG.vocab_size, (3, 5)), suffix_lengths=np.array([5, 3, 4])) if suffix else {}
    outs = {}
    for dots in ("xla", "onednn"):
        run = setup(params, policy, tokens, lengths, suffix=kw.get("suffix"), suffix_lengths=kw.get("suffix_lengths"),
                    max_new_tokens=6, backend=Backend(prefill_dots=dots))
        lowered = prepare_program.lower(params, run)
        compiled = run.backend.compile_prefill(lowered)
        if dots == "onednn" and ONEDNN_RUNS:
            assert onednn_fusions_runnable(compiled.as_text()) and '"__onednn_fusion"' in compiled.as_text()
        ready = compiled(params, run)
        outs[dots] = (np.asarray(ready.logits), np.asarray(ready.cache.layers.k),
                      np.asarray(ready.stats["kv_stored_fraction"]))
    for x, o in zip(outs["xla"], outs["onednn"], strict=True):
        np.testing.assert_allclose(o, x, rtol=1e-4, atol=1e-4)
    # and generate (two programs with oneDNN, one without) decodes the same tokens
    a = generate(params, policy, tokens, lengths=lengths, max_new_tokens=6, stop_tokens=(),
                 backend=Backend(prefill_dots="xla"), **kw)
    b = generate(params, policy, tokens, lengths=lengths, max_new_tokens=6, stop_tokens=(),
                 backend=Backend(prefill_dots="onednn"), **kw)
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
