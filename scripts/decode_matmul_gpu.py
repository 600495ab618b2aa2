"""Decode matmuls on a GPU: the Pallas layer matmul against XLA's sliced cuBLAS matmul.

Llama-3.1-8B shapes, random bf16 weights (fresh normal draws, not zeros):

1. **check** — `layer_matmul` against its fp32 reference for every weight shape of the model and
   ``M`` (decode rows) in {1, 8, 32}, at a random layer index; max relative error (bf16 output).
2. **per weight** — a rolled `lax.scan` over all layers computing ``x @ w[l]``: XLA (the scan
   slices ``w``) against the kernel at a few tilings; ms per pass over the 32 layers and the weight
   bytes per second that implies.
3. **decode step** — FullKV `decode_step` at an 8k cache, B = 1, 8 and 32, with
   ``Backend(decode_matmul=...)`` "xla" and "pallas": ms per generated token.

    python scripts/decode_matmul_gpu.py --out results.json

Prints a table last; timings are medians after a warm-up, each run `block_until_ready`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import jax
import jax.numpy as jnp
from jax import lax

from sparsekv_jax.backend import Backend
from sparsekv_jax.bench.e2e import MODELS, _decode_cache, _median_time_carry, decode_fn
from sparsekv_jax.models import config as mc
from sparsekv_jax.models.params import random_params
from sparsekv_jax.pallas.matmul import layer_matmul, layer_matmul_reference, matmul_plan
from sparsekv_jax.policies import Dense

WEIGHTS = ("wq", "wk", "wo", "w_gate", "w_down")  # wv has wk's shape, w_up has w_gate's
TILINGS = {  # name -> layer_matmul keyword overrides
    "plan": {},
    "warps8": {"num_warps": 8},
    "bn64": {"block_n": 64},
    "bk64s4": {"block_k": 64, "num_stages": 4},
    "splits/2": "half_splits",
}


def median_ms(fn, *args, n: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def scan_xla(w, x):
    def body(acc, wl):
        return acc + (x @ wl).astype(jnp.float32), None
    return lax.scan(body, jnp.zeros((x.shape[0], w.shape[2]), jnp.float32), w)[0]


def stack_once(w, x):
    """cuBLAS reading the whole stack in one batched call: the rate a weight read can reach."""
    return jnp.einsum("mk,lkn->mn", x, w, preferred_element_type=jnp.float32)


def scan_pallas(w, x, **kw):
    def body(acc, layer):
        return acc + layer_matmul(x, w, layer, **kw).astype(jnp.float32), None
    return lax.scan(body, jnp.zeros((x.shape[0], w.shape[2]), jnp.float32), jnp.arange(w.shape[0]))[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON rows")
    p.add_argument("--batches", default="1,8,32", help="decode-step batches (default 1,8,32)")
    p.add_argument("--context", type=int, default=8192, help="decode-step cache length (default 8192)")
    p.add_argument("--model", default="llama3.1-8b", choices=sorted(MODELS), help="model shapes")
    p.add_argument("--iters", type=int, default=20, help="timed runs per point (default 20)")
    p.add_argument("--sections", default="check,weights,decode",
                   help="comma list of check, weights, decode (default all)")
    p.add_argument("--tilings", default=",".join(TILINGS),
                   help=f"kernel tilings timed per weight (default all: {','.join(TILINGS)})")
    p.add_argument("--modes", default="xla,pallas",
                   help="decode-step matmuls: xla, pallas (default xla,pallas)")
    args = p.parse_args()
    cfg = getattr(mc, MODELS[args.model])()
    interpret = jax.default_backend() != "gpu"  # CPU smoke runs only
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    rows, lines = [], []

    def save() -> None:  # after every section: a run stopped at its time limit keeps what it measured
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__,
                       "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": rows}, f, indent=1)
        print(lines[-1], flush=True)

    sections = set(args.sections.split(","))
    # 1. correctness
    worst = 0.0
    for i, name in enumerate(WEIGHTS if "check" in sections else ()):
        w = getattr(params.layers, name)
        for M in (1, 8, 32):
            x = jax.random.normal(jax.random.key(100 + 3 * i + M), (M, w.shape[1]), jnp.bfloat16)
            layer = int(jax.random.randint(jax.random.key(7 + i + M), (), 0, w.shape[0]))
            ref = layer_matmul_reference(x.astype(jnp.float32), w.astype(jnp.float32), layer).astype(jnp.float32)
            kernel = jax.jit(lambda x, w, i: layer_matmul(x, w, i, interpret=interpret))
            got = kernel(x, w, jnp.int32(layer)).astype(jnp.float32)
            err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
            worst = max(worst, err)
            rows.append({"kind": "check", "weight": name, "M": M, "layer": layer,
                         "rel_err": err, "finite": bool(jnp.all(jnp.isfinite(got)))})
    if "check" in sections:
        ok = worst < 1e-2 and all(r["finite"] for r in rows)
        lines.append(f"check: worst rel. err {worst:.2e} over {len(rows)} cases -> {'PASS' if ok else 'FAIL'}")
        save()

    # 2. per weight shape, a pass over all layers
    for name in WEIGHTS if "weights" in sections else ():
        w = getattr(params.layers, name)
        gb = w.size * w.dtype.itemsize / 1e9
        for M in (1, 32):
            x = jax.random.normal(jax.random.key(M), (M, w.shape[1]), jnp.bfloat16)
            times = {"xla": median_ms(jax.jit(scan_xla), w, x, n=args.iters),
                     "stack_once": median_ms(jax.jit(stack_once), w, x, n=args.iters)}
            for tname, kw in TILINGS.items():
                if tname not in args.tilings.split(","):
                    continue
                if kw == "half_splits":
                    splits = matmul_plan(M, w.shape[1], w.shape[2])[3]
                    if splits < 2:
                        continue
                    kw = {"num_splits": splits // 2}
                try:
                    fn = jax.jit(lambda w, x, kw=kw: scan_pallas(w, x, interpret=interpret, **kw))
                    times[tname] = median_ms(fn, w, x, n=args.iters)
                except Exception as e:  # a tiling Triton rejects is a finding, not a crash
                    rows.append({"kind": "weight", "weight": name, "M": M, "tiling": tname, "error": str(e)[:200]})
            for tname, ms in times.items():
                rows.append({"kind": "weight", "weight": name, "M": M, "tiling": tname, "ms": ms,
                             "GBps": gb / ms * 1e3})
            best = min((t for t in times if t not in ("xla", "stack_once")), key=times.get, default="xla")
            lines.append(f"{name:7s} {tuple(w.shape[1:])} M={M:2d}: "
                         f"xla {times['xla']:.3f} ms ({gb / times['xla']:.2f} TB/s)"
                         f" | stack_once {times['stack_once']:.3f} ms ({gb / times['stack_once']:.2f} TB/s)"
                         f" | pallas plan {times.get('plan', float('nan')):.3f} ms"
                         f" | best {best} {times[best]:.3f} ms")
            save()

    # 2b. tiling sweep: block_n x num_splits with 66..1056 programs (half a wave to 8 waves on 132 SMs)
    for name in WEIGHTS if "sweep" in sections else ():
        w = getattr(params.layers, name)
        L, K, N = w.shape
        for M in (1, 32):
            x = jax.random.normal(jax.random.key(M), (M, K), jnp.bfloat16)
            best = None
            for bn in (64, 128):
                bk = matmul_plan(M, K, N)[2]
                for splits in (d for d in range(1, K // bk + 1) if (K // bk) % d == 0 and 66 <= N // bn * d <= 1056):
                    for warps in (4, 8):
                        kw = {"block_n": bn, "num_splits": splits, "num_warps": warps}
                        try:
                            fn = jax.jit(lambda w, x, kw=kw: scan_pallas(w, x, interpret=interpret, **kw))
                            ms = median_ms(fn, w, x, n=args.iters)
                        except Exception as e:
                            rows.append({"kind": "sweep", "weight": name, "M": M, **kw, "error": str(e)[:200]})
                            continue
                        rows.append({"kind": "sweep", "weight": name, "M": M, **kw, "programs": N // bn * splits,
                                     "tiles_per_split": K // bk // splits, "ms": ms})
                        best = min(best or (ms, kw), (ms, kw), key=lambda t: t[0])
            lines.append(f"sweep {name:7s} M={M:2d}: best {best[0]:.3f} ms at {best[1]}")
            save()

    # 3. whole decode step
    steps = 8
    modes = args.modes.split(",")
    for batch in [int(b) for b in args.batches.split(",")] if "decode" in sections else ():
        res = {}
        for mode in modes:
            try:
                cache, _ = _decode_cache(cfg, Dense(), args.context, batch, steps, jax.random.key(2))
                state = (None, None)
                tok = jax.random.randint(jax.random.key(5), (batch,), 0, cfg.vocab_size, jnp.int32)
                backend = Backend(decode_matmul="xla" if mode == "xla" else "pallas").resolve(params)
                comp = decode_fn(params, Dense(), steps, start=(cache.length, cache.next_position),
                                 backend=backend).lower(
                    params, cache, state, tok).compile()
                sec, _ = _median_time_carry(comp, params, (cache, state, tok), iters=max(3, args.iters // 4))
                res[mode] = sec * 1e3 / steps
                rows.append({"kind": "decode", "batch": batch, "context": args.context, "matmul": mode,
                             "ms_per_token": res[mode]})
            except Exception as e:
                rows.append({"kind": "decode", "batch": batch, "context": args.context, "matmul": mode,
                             "error": str(e)[:300]})
                res[mode] = float("nan")
            finally:
                cache = comp = None
        lines.append(f"decode_step FullKV {args.context}x{batch}: "
                     + ", ".join(f"{m} {ms:.2f}" for m, ms in res.items()) + " ms/token")
        save()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
