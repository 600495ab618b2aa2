"""What the compiled decode step does with large arrays, per cache page size (a diagnostic).

Compiles (does not run) `bench.e2e.decode_fn` for full attention and for CHESS-aggressive with its
per-step update removed, on abstract Llama-3.1-8B-shaped weights and a ``--context`` cache of
``--batch`` rows, once per ``--cache-page-sizes``. For each it prints XLA's temporary bytes, every
instruction with at least ``--min-elements`` elements that is not a parameter, tuple or bitcast
(so a copy of a cache-sized array would show), and the count of each op; then which op counts
differ between the page sizes. The compiled HLO text is written to ``--out``.

    python scripts/decode_step_hlo.py --batch 24 --cache-page-sizes 32,16 --out hlo/

Run it on the GPU: the CPU compiles the other decode path (the cache is not carried through the
layer scan there).
"""

from __future__ import annotations

import argparse
import collections
import os
import re

import jax
import jax.numpy as jnp

from sparsekv_jax.bench.chess import frozen
from sparsekv_jax.bench.e2e import MODELS, _tokens, decode_fn
from sparsekv_jax.cache import init_cache
from sparsekv_jax.models import config as mc
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import CHESS, Dense
from sparsekv_jax.policies.base import Setup

INSTRUCTION = re.compile(r"\s*(?:ROOT )?(%?[\w.\-]+) = ([a-z0-9]+)\[([0-9,]*)\]\S* ([a-z][\w\-]*)\(")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for the HLO text")
    p.add_argument("--model", default="llama3.1-8b", choices=sorted(MODELS), help="model shapes")
    p.add_argument("--batch", type=int, default=24, help="rows (default 24)")
    p.add_argument("--context", default="32k", help="cache tokens per row (default 32k)")
    p.add_argument("--cache-page-sizes", default="32,16", help="comma list (default 32,16)")
    p.add_argument("--min-elements", type=int, default=50_000_000, help="listing threshold (default 5e7)")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    cfg = getattr(mc, MODELS[args.model])()
    B, ctx = args.batch, _tokens(args.context)[0]
    params = jax.eval_shape(lambda: random_params(cfg, jax.random.key(0), jnp.bfloat16))
    counts: dict[tuple[str, int], collections.Counter] = {}
    for cps in [int(c) for c in args.cache_page_sizes.split(",")]:
        for pol in (Dense(), frozen(CHESS.aggressive(page_size=max(32, cps)))):
            pol = pol.bind(Setup(cfg, prompt_len=ctx))
            cache = jax.eval_shape(lambda cps=cps: init_cache(cfg, B, ctx + 64, page_size=cps, dtype=jnp.bfloat16))
            rows = jax.ShapeDtypeStruct((B,), jnp.int32)
            cache = cache.replace(length=rows, next_position=rows)
            state = jax.eval_shape(lambda c, pol=pol: pol.decode_init(c, None), cache)
            compiled = decode_fn(params, pol, 4).lower(params, cache, state, rows).compile()
            text = compiled.as_text()
            name = f"{pol.name.replace('[', '_').replace(']', '')}_b{B}_cps{cps}"
            with open(os.path.join(args.out, f"{name}.hlo.txt"), "w") as f:
                f.write(text)
            ops = collections.Counter()
            print(f"{name}: temp {compiled.memory_analysis().temp_size_in_bytes / 2**30:.3f} GiB")
            for line in text.splitlines():
                m = INSTRUCTION.match(line)
                if not m:
                    continue
                ops[m.group(4)] += 1
                elements = 1
                for d in filter(None, m.group(3).split(",")):
                    elements *= int(d)
                if elements >= args.min_elements and m.group(4) not in ("parameter", "get-tuple-element", "tuple",
                                                                          "bitcast"):
                    print(f"   {m.group(4):<22} {m.group(2)}[{m.group(3)}]  {m.group(1)}")
            counts[(pol.name, cps)] = ops
    for pol_name in {k[0] for k in counts}:
        sizes = sorted(c for n, c in counts if n == pol_name)
        first = counts[(pol_name, sizes[0])]
        for cps in sizes[1:]:
            other = counts[(pol_name, cps)]
            diff = {op: (first[op], other[op]) for op in first.keys() | other.keys() if first[op] != other[op]}
            print(f"{pol_name}: op counts differing between cache pages {sizes[0]} and {cps}: {diff or 'none'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
