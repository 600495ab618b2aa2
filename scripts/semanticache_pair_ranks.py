"""Where a RULER needle's digit pairs rank among neighbouring token pairs, by several similarities
(docs/SEMANTICACHE.md): if a number's digits are among the most similar pairs of the prompt, any
merge ordered by that similarity merges the number before the text around it.

One prompt is prefilled with full attention (SmolLM2, fp32). Pairs: every two prompt slots inside
the same 64-token block (sinks and window left out): the pairs GSC compares in fixed blocks. For
each (layer, KV head), the rank of each pair of the needle's digits among all pairs (1.0 = the most
similar), as a median over digit pairs and heads, per layer and overall.

    PYTHONPATH=. python scripts/semanticache_pair_ranks.py --task niah_single_2 --length 2048
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.cache import init_cache
from sparsekv_jax.generate import prefill
from sparsekv_jax.models.rope import inverse_frequencies
from sparsekv_jax.policies import Dense
from sparsekv_jax.policies.clustering import rotate


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def cosines(x: np.ndarray, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    u = unit(x)
    return (u[..., i, :] * u[..., j, :]).sum(-1)


def main(argv: list[str] | None = None) -> int:
    from sparsekv_jax.eval.ruler import generate_samples
    from sparsekv_jax.models.embedded import load

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="niah_single_2")
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
    tokens, lengths = jnp.asarray([ids], jnp.int32), jnp.asarray([T], jnp.int32)
    cache = init_cache(cfg, 1, T + 64, page_size=16, dtype=jnp.float32)
    _, cache, _, _ = jax.jit(lambda p, t, n, c: prefill(p, Dense(), t, n, c))(params, tokens, lengths, cache)
    k, v = np.asarray(cache.layers.k[:, 0, :, :T]), np.asarray(cache.layers.v[:, 0, :, :T])  # [L, H, T, D]
    pos = cache.layers.positions[:, 0, :, :T]
    content = np.asarray(rotate(jnp.asarray(k), -pos, np.asarray(inverse_frequencies(cfg))))  # pre-RoPE

    sinks, window, width = 4, 32, 64
    i, j = np.array([(t, t + o) for t in range(sinks, T - window) for o in range(1, width)
                     if t + o < T - window and (t - sinks) // width == (t + o - sinks) // width]).T
    digits = np.isin(i, answer) & np.isin(j, answer)
    print(f"{args.task} #{args.index}: {T} tokens, answer {s.answers[0]!r} = {[pieces[t] for t in answer]}; "
          f"{len(i)} pairs, {int(digits.sum())} of them inside the answer")

    def centred(x):
        return x - x.mean(-2, keepdims=True)

    measures = {
        "key cosine (pre-RoPE; the policy's)": lambda l: cosines(content[l], i, j),
        "key cosine, post-RoPE": lambda l: cosines(k[l], i, j),
        "key cosine, mean key removed": lambda l: cosines(centred(content[l]), i, j),
        "-key distance (pre-RoPE)": lambda l: -np.linalg.norm(content[l][:, i] - content[l][:, j], axis=-1),
        "value cosine": lambda l: cosines(v[l], i, j),
        "value cosine, mean value removed": lambda l: cosines(centred(v[l]), i, j),
    }
    L = k.shape[0]
    shown = list(range(0, L, max(1, L // 10)))
    print(f"{'rank of the answer pairs (median)':40s} {'all':>5s}  by layer " + " ".join(f"{x:>4d}" for x in shown))
    for name, measure in measures.items():
        ranks = []
        for layer in range(L):  # [H, P] each: one layer at a time bounds the memory
            m = measure(layer)
            ranks.append(np.stack([np.searchsorted(np.sort(m[h]), m[h][digits]) / m.shape[1]
                                   for h in range(m.shape[0])]))
        ranks = np.stack(ranks)  # [L, H, answer pairs]
        print(f"{name:40s} {np.median(ranks):5.3f}  by layer " + " ".join(f"{np.median(ranks[x]):4.2f}"
                                                                        for x in shown), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
