"""Same tokens before and after an engine change: every registered policy through `generate`
(question-aware, question-agnostic suffix, no split) and `teacher_force` on a tiny random model
with fixed seeds; run it under two checkouts, then compare the two files.

    PYTHONPATH=<old checkout> python scripts/engine_equivalence.py run old.pkl
    PYTHONPATH=<new checkout> python scripts/engine_equivalence.py run new.pkl
    python scripts/engine_equivalence.py compare old.pkl new.pkl

On a CPU (2 cores) each run takes about 10 minutes; on a GPU a few. The engine refactor of issue
41 gave 60 cases, 0 different (tokens, stats and teacher-forced logits bit-identical, x86 CPU).
"""

from __future__ import annotations

import pickle
import sys

import numpy as np


def run(path: str) -> None:
    import jax
    import jax.numpy as jnp

    from sparsekv_jax import load
    from sparsekv_jax.generate import generate, teacher_force
    from sparsekv_jax.models.config import ModelConfig
    from sparsekv_jax.models.params import random_params
    from sparsekv_jax.policies import Pipeline
    from sparsekv_jax.policies.spec import REGISTRY

    cfg = ModelConfig(family="llama", vocab_size=61, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                      head_dim=16, intermediate_size=48, max_position_embeddings=512, eos_token_ids=(0,))
    _, tok = load("smollm2")
    params = random_params(cfg, jax.random.key(7), jnp.float32, 0.3)
    rng = np.random.default_rng(3)
    tokens = rng.integers(1, cfg.vocab_size, (2, 160))
    lengths = np.array([160, 130])
    variants = ({}, {"question_start": np.array([150, 120])},
                {"suffix": tokens[:, :9], "suffix_lengths": np.array([9, 4])})
    res = {}
    for name, factory in sorted(REGISTRY.items()):
        policy = factory()
        if isinstance(policy, Pipeline):
            continue
        policy = policy.with_tokenizer(tok)
        for kw in variants:
            try:
                out = generate(params, policy, tokens, lengths=lengths, max_new_tokens=6, stop_tokens=(), **kw)
                res[(name, tuple(kw))] = (np.asarray(out.tokens), {k: np.asarray(v) for k, v in out.stats.items()
                                                                   if k != "context"})
            except Exception as e:  # noqa: BLE001 - an error is a result to compare too
                res[(name, tuple(kw))] = repr(e)[:200]
        try:
            res[(name, "teacher_force")] = np.asarray(teacher_force(params, policy, tokens, tokens[:, :4],
                                                                    lengths=lengths)[0])
        except Exception as e:  # noqa: BLE001
            res[(name, "teacher_force")] = repr(e)[:200]
        print(name, flush=True)
    with open(path, "wb") as f:
        pickle.dump(res, f)


def _same(x, y) -> bool:
    if isinstance(x, str) or isinstance(y, str):
        return x == y
    if isinstance(x, tuple):
        return np.array_equal(x[0], y[0]) and x[1].keys() == y[1].keys() and all(
            np.array_equal(x[1][s], y[1][s], equal_nan=True) for s in x[1])
    return np.array_equal(x, y)


def compare(old: str, new: str) -> int:
    with open(old, "rb") as f, open(new, "rb") as g:
        a, b = pickle.load(f), pickle.load(g)
    if a.keys() != b.keys():
        print("cases differ:", sorted(map(str, set(a) ^ set(b))))
        return 1
    bad = [k for k in a if not _same(a[k], b[k])]
    for k in bad:
        print("DIFF", k)
    print(f"{len(a)} cases, {len(bad)} different")
    return 1 if bad else 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["run"] and len(sys.argv) == 3:
        run(sys.argv[2])
    elif sys.argv[1:2] == ["compare"] and len(sys.argv) == 4:
        raise SystemExit(compare(sys.argv[2], sys.argv[3]))
    else:
        raise SystemExit(__doc__)
