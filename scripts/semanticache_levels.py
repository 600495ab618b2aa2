"""Why SemantiCache's RULER score can fall as its budget grows (docs/SEMANTICACHE.md): per budget,
the chunk layout level each row gets, the threshold the budget search picks per (layer, KV head),
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
from sparsekv_jax.policies import Dense, SemantiCache, clustering
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.common import row_budgets

SPECS = (dict(budget=0.2), dict(budget=0.35), dict(budget=0.5),
         dict(budget=0.35, chunking="fixed"), dict(budget=0.5, chunking="fixed"))


def chosen_taus(pol, prompt, k, pos):
    """``[H]`` the threshold `clustering.largest_fitting_clustering` picks for one layer (its two passes,
    replayed to return the threshold rather than the clustering)."""
    T = prompt.tokens.shape[1]
    keep = row_budgets(pol.budget, prompt.lengths)
    forced, anchor, member, place, _ = pol._layout(prompt, keep, T)
    content = k.astype(jnp.float32)
    if pol.keys == "pre_rope":
        content = clustering.rotate(content, -pos, np.asarray(pol.inv_freq))
    band = clustering.similarity_band(content, pol._width(T))
    B, H = band.shape[:2]
    fixed = (forced | anchor).sum(1)[:, None]

    def first_fit(taus):
        back = clustering.greedy_seed_clustering(band, member, place, taus)
        n = fixed + (member[:, None] & (back == 0)).sum(-1)
        return jnp.argmax(n <= keep[:, None], axis=0)

    steps = pol.search_steps
    grid = jnp.asarray(clustering.search_grid(1.0, steps))
    k1 = first_fit(jnp.broadcast_to(grid[:, None, None], (steps, B, H)))
    lo, hi = grid[k1], grid[jnp.maximum(k1 - 1, 0)]
    taus = jnp.concatenate([hi[None] + (lo - hi)[None] * (jnp.arange(1, steps) / steps)[:, None, None], lo[None]])
    return np.asarray(jnp.take_along_axis(taus, first_fit(taus)[None], 0)[0, 0])


def main(argv: list[str] | None = None) -> int:
    from sparsekv_jax.eval.ruler import generate_samples
    from sparsekv_jax.models.embedded import load

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="niah_single_1")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--index", type=int, default=0)
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
    for spec in SPECS:
        pol = SemantiCache.from_tokenizer(tok, **spec).bind(Setup(cfg, prompt_len=T, max_new_tokens=64))
        comp = jax.jit(lambda c, p, pol=pol: pol.compress(c, None, T + 64, p))(cache, prompt)
        forced, anchor, member, place, level = map(np.asarray, pol.layout(prompt))
        keep = int(row_budgets(pol.budget, lengths)[0])
        least = int((forced | anchor | (place == 0)).sum())
        pos, bias = np.asarray(comp.layers.positions)[:, 0], np.asarray(comp.layers.bias)[:, 0]
        taus = np.stack([chosen_taus(pol, prompt, cache.layers.k[i, :, :, :T], cache.layers.positions[i, :, :, :T])
                         for i in range(pos.shape[0])])
        single = [set(pos[i, h][(pos[i, h] >= 0) & (bias[i, h] == 0)].tolist())
                  for i in range(pos.shape[0]) for h in range(pos.shape[1])]
        kept_answer = np.mean([t in s1 for s1 in single for t in answer])
        ends_kept = all(t in s1 for s1 in single for t in [*range(4), *range(T - 32, T)])
        counts = (pos >= 0).sum(-1)
        print(f"{pol.name:38s} level {int(level[0])}  budget {keep}  least {least} (anchors {int(anchor.sum())}, "
              f"chunks {int((place == 0).sum())})  kept max {counts.max()}  tau median {np.median(taus):.3f} "
              f"q10 {np.quantile(taus, 0.1):.3f}  answer tokens unmerged {kept_answer:.3f}  sinks+window kept "
              f"{ends_kept}")
        print(f"    answer slots (place in chunk): {[int(place[0, t]) for t in answer]}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
