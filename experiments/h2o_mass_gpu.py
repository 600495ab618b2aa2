"""H2O's prefill attention mass on a GPU: the dense path in causal segments against the whole square.

`sparsekv_jax.policies.h2o.attention_mass` with ``implementation="dense"`` scans 256-query blocks, each
against the keys it may see. ``segments=1`` is the path as it was before 2026-11-29 (every block against
every key: the whole T x T square in fp32 slabs); ``segments=S`` runs the blocks in S causal runs, each
against the keys up to its last query (about (1 + 1/S) / 2 of the square). For Qwen2.5-Coder-1.5B's shapes
(12 query / 2 KV heads, head_dim 128; one layer's q and k, bf16, random normals) at each length and batch:

1. check: every variant against ``segments=1`` (max relative difference of the per-key mass);
2. time: the variants interleaved round by round (``--rounds``), each call ``block_until_ready`` after a
   warm-up compile; the median per variant, and its ratio to ``segments=1`` measured in the same rounds.

    python experiments/h2o_mass_gpu.py --out $OUT

Prints a table last; writes ``h2o_mass_gpu.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sparsekv_jax.bench.timing import timed_call  # noqa: E402
from sparsekv_jax.policies.h2o import attention_mass  # noqa: E402

HQ, HKV, D = 12, 2, 128  # Qwen2.5-Coder-1.5B


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="8192,32768", help="prompt lengths (comma-separated)")
    p.add_argument("--batches", default="1,3", help="rows per call (3: the eval's rows at 32k)")
    p.add_argument("--segments", default="1,2,4,8,16", help="dense variants; 1 is the reference")
    p.add_argument("--blocked", action="store_true", help="also time the causal-tile path (the CPU's)")
    p.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    segments = [int(s) for s in args.segments.split(",")]
    if 1 not in segments:
        p.error("--segments must include 1 (the reference)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for T in (int(x) for x in args.lengths.split(",")):
        for B in (int(x) for x in args.batches.split(",")):
            kq, kk = jax.random.split(jax.random.key(T * 10 + B))
            q = jax.random.normal(kq, (B, T, HQ, D), jnp.bfloat16)
            k = jax.random.normal(kk, (B, T, HKV, D), jnp.bfloat16)
            lengths = jnp.array([T - 97 * b for b in range(B)], jnp.int32)  # ragged rows
            variants = {f"dense/{s}": jax.jit(lambda q, k, n, s=s: attention_mass(q, k, n, implementation="dense",
                                                                                   segments=s))
                        for s in segments}
            if args.blocked:
                variants["blocked"] = jax.jit(lambda q, k, n: attention_mass(q, k, n, implementation="blocked"))
            ref = np.asarray(variants["dense/1"](q, k, lengths))
            times: dict[str, list[float]] = {v: [] for v in variants}
            diffs = {}
            for name, fn in variants.items():  # warm-up (compile) and check
                got = np.asarray(fn(q, k, lengths))
                diffs[name] = float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))
            for _ in range(args.rounds):
                for name, fn in variants.items():
                    times[name].append(timed_call(fn, q, k, lengths)[1])
            base = statistics.median(times["dense/1"])
            for name in variants:
                med = statistics.median(times[name])
                rows.append({"T": T, "B": B, "variant": name, "median_ms": 1e3 * med, "ratio_to_square": med / base,
                             "max_rel_diff": diffs[name], "times_ms": [1e3 * t for t in times[name]]})
            print(f"T={T} B={B} done", flush=True)
    record = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rounds": args.rounds, "rows": rows}
    (out / "h2o_mass_gpu.json").write_text(json.dumps(record, indent=1))
    print(f"\n{'T':>6} {'B':>2} {'variant':<10} {'median ms':>10} {'/ square':>9} {'max rel diff':>13}")
    for r in rows:
        print(f"{r['T']:>6} {r['B']:>2} {r['variant']:<10} {r['median_ms']:>10.2f} {r['ratio_to_square']:>9.3f} "
              f"{r['max_rel_diff']:>13.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
