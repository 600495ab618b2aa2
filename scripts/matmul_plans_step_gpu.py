"""Decode matmul tilings judged by the whole decode step (FullKV and CHESS) at a large batch.

The per-weight sweep of `scripts/decode_matmul_gpu.py` times one weight at a time, and its
single timings vary by about ±10%; this script swaps the tiling `transformer` uses for every
decode matmul and times whole steps instead, with `sparsekv_jax.bench.chess.throughput` (Llama-3.1-8B
shapes, random bf16 weights, a ``--context`` cache, ``--batch`` rows). Variants:

* ``plan``: `matmul_plan` as shipped;
* ``warps8-narrow``: 8 warps for the narrow K/V projections (``N <= 1024``);
* ``bn128-wide``: for ``M > 8`` rows, ``block_n`` 128 on the wide weights (``N >= 4096``) with the
  split count the plan gives ``block_n`` 64 (half the programs, the same K range each);
* ``both``: the two together.

    python scripts/matmul_plans_step_gpu.py --batch 24 --out plans.json

Prints a table last (ms per step, median of ``--iters`` runs of ``--steps`` steps).
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

from sparsekv_jax.bench.chess import throughput
from sparsekv_jax.bench.e2e import MODELS, _tokens
from sparsekv_jax.models import config as mc
from sparsekv_jax.models.params import random_params
from sparsekv_jax.pallas import matmul as matmul_module
from sparsekv_jax.policies import CHESS, Dense

VARIANTS = ("plan", "warps8-narrow", "bn128-wide", "both")


def tiled(variant: str):
    """`layer_matmul` with ``variant``'s overrides (see the module docstring)."""
    layer_matmul = matmul_module.layer_matmul

    def mm(x, w, layer, **kw):
        M, K, N = x.shape[0], w.shape[1], w.shape[2]
        if variant in ("warps8-narrow", "both") and N <= 1024:
            kw.setdefault("num_warps", 8)
        if variant in ("bn128-wide", "both") and M > 8 and N >= 4096 and N % 128 == 0:
            kw.setdefault("num_splits", matmul_module.matmul_plan(M, K, N, block_n=64)[3])
            kw.setdefault("block_n", 128)
        return layer_matmul(x, w, layer, **kw)

    return mm


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON rows")
    p.add_argument("--model", default="llama3.1-8b", choices=sorted(MODELS), help="model shapes")
    p.add_argument("--batch", type=int, default=24, help="rows (default 24)")
    p.add_argument("--context", default="32k", help="cache tokens per row (default 32k)")
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed run (default 32)")
    p.add_argument("--iters", type=int, default=3, help="timed runs (default 3)")
    args = p.parse_args()
    cfg = getattr(mc, MODELS[args.model])()
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    context = _tokens(args.context)[0]
    original = matmul_module.layer_matmul
    rows, table = [], []
    try:
        for variant in args.variants.split(","):
            if variant not in VARIANTS:
                raise SystemExit(f"unknown variant {variant!r}; choose from {', '.join(VARIANTS)}")
            matmul_module.layer_matmul = tiled(variant)  # transformer imports it at trace time
            jax.clear_caches()
            got = throughput(cfg, params, [Dense(), CHESS.aggressive(page_size=32)], context, args.batch,
                             args.steps, args.iters, 32)
            for r in got:
                rows.append({"variant": variant, "device": jax.devices()[0].device_kind, **r})
            dense, chess = (r["ms_per_step"] for r in got)
            table.append(f"{variant:<14} FullKV {dense:7.2f}  CHESS-aggressive {chess:6.2f} ms/step  "
                         f"ratio {dense / chess:.2f}x")
            print(table[-1], flush=True)
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=1)
    finally:
        matmul_module.layer_matmul = original
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
