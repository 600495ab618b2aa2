"""Why SemantiCache's RULER score fell as its budget grew under the previous level rule
(docs/SEMANTICACHE.md): per budget and level rule, the chunk layout level each (layer, KV head)
gets, the threshold the budget search picks per (layer, KV head) (`SemantiCache.choices`),
and the share of the answer's tokens kept as their own (unmerged) entry; sinks, window and counts
checked against the budget.

    PYTHONPATH=. python scripts/semanticache_levels.py --task niah_single_1 --length 2048
    PYTHONPATH=. python scripts/semanticache_levels.py --task fwe --length 1024
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.cache import init_cache
from sparsekv_jax.generate import prefill
from sparsekv_jax.policies import Dense, SemantiCache, parse_policy
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.common import row_budgets

SPECS = (dict(budget=0.2), dict(budget=0.35), dict(budget=0.5),
         dict(budget=0.2, level_rule="finest"), dict(budget=0.35, level_rule="finest"),
         dict(budget=0.5, level_rule="finest"),
         dict(budget=0.35, chunking="fixed"), dict(budget=0.5, chunking="fixed"))


def main(argv: list[str] | None = None) -> int:
    from sparsekv_jax.eval.ruler import generate_samples
    from sparsekv_jax.models.embedded import load

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--specs", default="", help="';'-separated SemantiCache specs (default: SPECS)")
    args = p.parse_args(argv)
    params, tok = load("smollm2", progress=False)
    cfg = params.config
    s = generate_samples(args.task, args.length, args.index + 1, 0, tok, chat=True)[args.index]
    ids = list(tok(s.context, add_special_tokens=False)["input_ids"])
    T = len(ids)
    pieces = [tok.decode([i]) for i in ids]
    ends = np.cumsum([len(x) for x in pieces])
    at = "".join(pieces).find(s.answers[0])
    answer = [t for t in range(T) if ends[t] > at and ends[t] - len(pieces[t]) < at + len(s.answers[0])]
    print(f"{args.task} #{args.index}: {T} tokens; answer {s.answers[0]!r} = slots {answer} "
          f"{[pieces[t] for t in answer]}")
    tokens, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([T], jnp.int32)
    cache = init_cache(cfg, 1, T + 64, page_size=16, dtype=jnp.float32)
    _, cache, _, _ = jax.jit(lambda p, t, n, c: prefill(p, Dense(), t, n, c))(params, tokens, lengths, cache)
    prompt = Prompt(tokens=tokens, lengths=lengths)
    policies = ([parse_policy(x) for x in args.specs.split(";")] if args.specs
                else [SemantiCache(**spec) for spec in SPECS])
    for pol in policies:
        pol = pol.with_tokenizer(tok).bind(Setup(cfg, prompt_len=T, max_new_tokens=64))
        comp = jax.jit(lambda c, p, pol=pol: pol.compress(c, None, T + 64, p))(cache, prompt)
        keep = int(row_budgets(pol.budget, lengths)[0])
        level, taus = map(np.asarray, jax.jit(pol.choices)(cache, prompt))  # [L, 1, H]
        pos, bias = np.asarray(comp.layers.positions)[:, 0], np.asarray(comp.layers.bias)[:, 0]
        single = [set(pos[i, h][(pos[i, h] >= 0) & (bias[i, h] == 0)].tolist())
                  for i in range(pos.shape[0]) for h in range(pos.shape[1])]
        kept_answer = np.mean([t in s1 for s1 in single for t in answer])
        ends_kept = all(t in s1 for s1 in single for t in [*range(4), *range(T - 32, T)])
        counts = (pos >= 0).sum(-1)
        shares = "/".join(f"{np.mean(level == lv):.2f}" for lv in (0, 1, 2))
        print(f"{pol.name:52s} (layer, head)s at level 0/1/2 {shares}  budget {keep}  kept max {counts.max()}  "
              f"tau median {np.median(taus):.3f} q10 {np.quantile(taus, 0.1):.3f}  answer tokens unmerged "
              f"{kept_answer:.3f}  sinks+window kept {ends_kept}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
