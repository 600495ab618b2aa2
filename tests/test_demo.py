"""`make demo`'s machinery on a tiny random model: unregistered policies are skipped with a note,
policies with a dense prefill share one prefill, and each answers what `generate` answers alone."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax import demo
from sparsekv_jax.generate import generate
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params

CFG = ModelConfig(family="llama", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=8, intermediate_size=48, max_position_embeddings=128, eos_token_ids=(0,))


class _Tokenizer:
    """Just what the demo calls: ``decode`` of ids (as text of the ids)."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_demo_policy_list_skips_unregistered_and_labels_budgets():
    policies, notes = demo.resolve_policies(["fullkv", "snapkv({b})", "nosuchpolicy({b})"], 0.25, _Tokenizer())
    assert [label for label, _ in policies] == ["Dense", "SnapKV(0.25)"]
    assert len(notes) == 1 and "nosuchpolicy" in notes[0]
    assert demo._split("fullkv, pipeline(compress=snapkv(0.2), decode=quest(0.25))") == [
        "fullkv", "pipeline(compress=snapkv(0.2), decode=quest(0.25))"]


def test_demo_shared_prefill_answers_like_generate():
    params = random_params(CFG, jax.random.key(3), jnp.float32, scale=0.3)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, CFG.vocab_size, (1, 64)).astype(np.int32)
    qs = np.array([56], np.int32)
    policies, _ = demo.resolve_policies(["fullkv", "snapkv(0.5, window=8)", "quest(0.5)", "stem(block_size=16)"],
                                        0.5, _Tokenizer())
    rows, _ = demo.run(params, _Tokenizer(), policies, tokens, qs, max_new_tokens=5, stop_tokens=(), progress=False)
    assert [r.shared_prefill for r in rows] == [True, True, True, False]
    for (label, policy), row in zip(policies, rows, strict=True):
        alone = generate(params, policy, tokens, question_start=qs, max_new_tokens=5, stop_tokens=(),
                         page_size=demo.PAGE_SIZE)
        assert row.answer == _Tokenizer().decode(alone.sequences()[0]), label
    print(demo.table(rows))


def test_demo_table_columns_fit_long_policy_names():
    """Every column is as wide as its longest entry: a long pipeline label pushes the columns right
    for every line alike, so each value ends where its header does."""
    rows = [demo.Row("Dense", "Paris", True, 1.0, 1.0, 1.0, 3.5, True, 0.0, 12.25),
            demo.Row("Pipeline(context=S3Hybrid(0.25), decode=Quest(0.25))", "x" * 60, False, 0.25, 0.125, 0.5,
                     1.0, False, 0.5, 1234.5)]
    head, *lines = demo.table(rows).splitlines()
    names = ["right", "KV stored", "KV read", "prefill blocks", "prefill s", "compress s", "decode ms/tok"]
    ends = [head.index(n) + len(n) for n in names]
    want = [["yes", "100%", "100%", "100%", "=3.50", "0.00", "12.2"], ["NO", "25%", "12%", "50%", "1.00", "0.50",
                                                                       "1234.5"]]
    for line, values in zip(lines, want, strict=True):
        for end, value in zip(ends, values, strict=True):
            assert line[end - len(value): end] == value and line[end: end + 2] == "  ", (line, value)
    assert lines[1].startswith(rows[1].label + "  ") and lines[1].endswith(repr("x" * 40))
    assert head.index("answer") == lines[0].index("'Paris'") == lines[1].index("'xxx")


def test_demo_leaves_onednn_prefills_out_of_the_persistent_cache(tmp_path):
    """XLA:CPU cannot serialise a oneDNN fusion: `Backend.compile_prefill` (and its oneDNN probe)
    compile such a program without trying to store it (no 'Error writing persistent compilation
    cache entry' warning), and the demo's other programs are still stored. A fresh process: the
    persistent cache is set up at a process's first compile."""
    import subprocess
    import sys

    code = f"""
import warnings, jax, jax.numpy as jnp
warnings.simplefilter("error")
from sparsekv_jax import demo
from sparsekv_jax.backend import Backend, onednn_dots_available
demo.persistent_cache({str(tmp_path)!r}, min_compile_seconds=0)
x = jnp.ones((64, 64), jnp.float32)
progs = demo._Programs()
backend = Backend(prefill_dots="onednn" if onednn_dots_available() else "xla").resolve()
progs.get("prefill", lambda a: jnp.tanh(a @ a) @ a + 1, x, prefill_of=backend)
progs.get("plain", lambda a: a @ a + 2, x)
print("onednn" if backend.prefill_compiler_options() else "xla")
"""
    from sparsekv_jax.backend import onednn_dots_available

    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-3000:]
    # the probe too compiled without a warning (one would make it report oneDNN unavailable)
    assert res.stdout.split()[-1] == ("onednn" if onednn_dots_available() else "xla")
    stored = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
    # the plain program is stored; the prefill only where it has no oneDNN fusion to serialise
    assert stored.count("jit__lambda") == (1 if res.stdout.split()[-1] == "onednn" else 2), (stored, res.stdout)
