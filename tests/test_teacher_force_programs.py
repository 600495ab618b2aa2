"""`teacher_force` runs the steps before decoding as `Session` and `generate` do (`engine.programs.prepare_apart`).

Where a backend compiles its prefill apart (`Backend.prefill_dots`: oneDNN's dots on an x86 CPU with fp32 weights),
`Backend.compile_prefill` decides per program whether oneDNN's dots run or XLA's; `teacher_force` used to compute the
prompt's K/V in its own single program with XLA's dots while `Session` used oneDNN's for its prefill program. The
values agreed to ~1e-6, but on an int8 cache a value within that of a rounding boundary got another code: the logits
differed by 4.4e-4 on a CI draw (tests/test_engine_pool_extend.py, seed 388345640), by up to 1.7e-3 on draws of
this file's shapes with the stand-in below (3 of 8 draws of FullKV; on the worst, one value code: -0.2187502 in one
program, -0.2187491 in the other, at the page's scale 1/16 -3.5000033 and -3.49998 steps: code -4 against -3).
Now `teacher_force`'s logits equal those of the `Session` fed the same tokens step by step (`decode_forced`),
exactly.

The prefill compiler options: oneDNN's dots where this XLA takes them, and a stand-in for them that runs everywhere,
XLA:CPU's optimizing settings for the steps before decoding only (another compilation of the same program, as
oneDNN's dots are, with its own rounding; the tests' programs otherwise compile with the cheapest settings,
tests/conftest.py). Tiny random models, prompts drawn from the run's seed."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import OPTIMIZED_XLA, decode_forced

from sparsekv_jax import engine
from sparsekv_jax.backend import Backend, onednn_dots_available
from sparsekv_jax.generate import teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import parse_policy

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=512, eos_token_ids=(0,))
T, LENGTHS, TQ, SUFFIX, NEW, PS = 40, np.array([40, 29]), 11, np.array([5, 11]), 6, 8
CASES = {"kernel-int8": ("fullkv", dataclasses.replace(Backend.kernels(), kv_dtype="int8")),
         "jnp-fp32": ("snapkv(0.5, window=4)", Backend())}
# the stand-in (XLA's optimizing settings for the prefill's programs) everywhere; oneDNN's dots themselves where this
# CPU runs them right (`onednn_dots_available`: x86, and its probe agrees with XLA's dots)
RUNS = [("kernel-int8", "xla-optimized"), ("jnp-fp32", "xla-optimized")]
RUNS += [("kernel-int8", "onednn")] if onednn_dots_available() else []


def _prefill_options(monkeypatch, options: str) -> str:
    """The prefill's compiler options: ``"onednn"`` the backend's own (a case only where oneDNN runs: `RUNS`),
    ``"xla-optimized"`` XLA:CPU's optimizing settings in their place. The ``prefill_dots`` to set."""
    if options == "onednn":
        return "onednn"
    monkeypatch.setattr(Backend, "prefill_compiler_options", lambda self: dict(OPTIMIZED_XLA))
    monkeypatch.setattr(Backend, "compile_prefill",
                        lambda self, lowered: lowered.compile(compiler_options=dict(OPTIMIZED_XLA)))
    return "xla"


@pytest.mark.share(2)
@pytest.mark.parametrize("case, options", RUNS, ids=[f"{c}-{o}" for c, o in RUNS])
def test_teacher_force_equals_the_session_step_by_step(rng, monkeypatch, case, options):
    """With a suffix, pages of 8, batch 2 of different lengths: `teacher_force`'s logits equal the `Session`'s
    fed the same tokens one `decode_step` at a time, exactly (the same programs before decoding, then the same
    decode step); without the prefill's options the first logits differ (the options matter: without them
    `teacher_force` and the `Session` would agree anyway)."""
    spec, backend = CASES[case]
    backend = dataclasses.replace(backend, prefill_dots=_prefill_options(monkeypatch, options))
    params = random_params(CFG, jax.random.key(int(rng.integers(1 << 30))), jnp.float32, scale=0.3)
    tokens = rng.integers(1, CFG.vocab_size, (2, T))
    prompt = dict(lengths=LENGTHS, suffix=rng.integers(1, CFG.vocab_size, (2, TQ)), suffix_lengths=SUFFIX)
    forced = rng.integers(1, CFG.vocab_size, (2, NEW))
    kw = dict(page_size=PS, stop_tokens=(), backend=backend)
    got, _ = teacher_force(params, parse_policy(spec), tokens, forced, **prompt, **kw)
    session = engine.Session.start(params, parse_policy(spec), tokens, max_new_tokens=NEW, **prompt, **kw)
    want, _ = decode_forced(params, session, forced)
    np.testing.assert_array_equal(np.asarray(got), want)
    if options != "onednn":  # (oneDNN's dots may not run on every program: then none differs)
        monkeypatch.undo()  # prefill_dots="xla": the cheap settings, one program
        plain, _ = teacher_force(params, parse_policy(spec), tokens, forced, **prompt, **kw)
        assert np.abs(np.asarray(plain)[:, 0] - want[:, 0]).max() > 0
