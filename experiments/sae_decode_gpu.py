"""The Pallas SAE gather kernels (`sparsekv_jax.pallas.sae_decode`) on a GPU: exactness, then time against XLA.

At the SAE step's real shapes (SmolLM2: 4 layers x 12,288 vectors, 8,192 latents of 64, k 64;
Llama-3.1-8B: 1 x 32,768, 16,384 of 128, k 128), random tables and top-k ids drawn like an SAE's:

1. check: `gather_decode` (the decoder) and `gather_dot` (the encoder at the selected latents) and
   their gradients equal the jnp references' to fp32 rounding;
2. time (median of ``--iters`` after a warm-up, ``block_until_ready``): each forward, XLA's vs the
   kernel's at several ``block_rows`` x ``num_warps`` x ``unroll``; and each forward + backward of a
   squared error (XLA's autodiff vs the kernels' VJPs).

    python experiments/sae_decode_gpu.py --out $OUT

Prints a table last; writes ``sae_decode_gpu.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from sparsekv_jax.bench.timing import median_time  # noqa: E402
from sparsekv_jax.pallas.sae_decode import (  # noqa: E402
    gather_decode,
    gather_decode_reference,
    gather_dot,
    gather_dot_reference,
)

SHAPES = {  # name: (layers, vectors, width, d_in, k)
    "smollm2 (4 x 12,288, 8,192 x 64, k 64)": (4, 12288, 8192, 64, 64),
    "llama8b (1 x 32,768, 16,384 x 128, k 128)": (1, 32768, 16384, 128, 128),
}


def inputs(key, S: int, N: int, W: int, D: int, k: int):
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    w = jax.random.normal(k1, (S, W, D), jnp.float32)
    w = w / jnp.linalg.norm(w, axis=-1, keepdims=True)
    b = jax.random.normal(k2, (S, D), jnp.float32)
    # k distinct ids per row, as top-k gives: the k largest of random scores
    ids = jax.lax.top_k(jax.random.uniform(k3, (S, N, W)), k)[1].astype(jnp.int32)
    acts = jax.nn.relu(jax.random.normal(k4, (S, N, k), jnp.float32)) * 3
    target = jax.random.normal(k5, (S, N, D), jnp.float32)
    return w, b, ids, acts, target


def gather_ops(b, ids, acts, target) -> dict:
    """op: (kernel(table, other, **cfg), reference(table, other), other, target of the squared error)."""
    return {
        "decode": (lambda t, c, **kw: gather_decode(t, b, ids, c, **kw),
                   lambda t, c: gather_decode_reference(t, b, ids, c), acts, target),
        "dot": (lambda t, v, **kw: gather_dot(t, ids, v, **kw),
                lambda t, v: gather_dot_reference(t, ids, v), target, acts),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "shapes": {}}
    table = ["| shape | op | XLA fwd ms | kernel fwd ms, default (best: rows, warps, unroll) | XLA fwd+bwd ms | "
             "kernel fwd+bwd ms | max rel. error |", "|---|---|---:|---|---:|---:|---:|"]
    for name, (S, N, W, D, k) in SHAPES.items():
        w, b, ids, acts, target = inputs(jax.random.key(N + W), S, N, W, D, k)
        ops = gather_ops(b, ids, acts, target)
        results["shapes"][name] = {}
        for op, (kern, ref, other, tgt) in ops.items():
            row = {}

            def sq(f, tgt=tgt):
                return lambda t, o: jnp.sum(jnp.square(f(t, o) - tgt))

            r_out = jax.jit(ref)(w, other)
            r_grads = jax.jit(jax.grad(sq(ref), argnums=(0, 1)))(w, other)
            k_out = jax.jit(kern)(w, other)
            k_grads = jax.jit(jax.grad(sq(kern), argnums=(0, 1)))(w, other)
            errs = {"fwd": float(jnp.max(jnp.abs(k_out - r_out)) / jnp.max(jnp.abs(r_out)))}
            for tag, g, r in zip(("table", "other"), k_grads, r_grads, strict=True):
                errs[tag] = float(jnp.max(jnp.abs(g - r)) / jnp.max(jnp.abs(r)))
            row["max_rel_errors"] = errs
            print(name, op, errs, flush=True)
            assert all(v < 1e-5 for v in errs.values()), errs
            row["xla_fwd_s"] = median_time(jax.jit(ref), w, other, iters=args.iters)
            tunes = {}
            for br, nw, un in itertools.product((32, 64, 128), (4, 8), (1, 4, 8)):
                f = jax.jit(lambda w, o, br=br, nw=nw, un=un, kern=kern: kern(w, o, block_rows=br, num_warps=nw,
                                                                            unroll=un))
                try:
                    tunes[f"{br},{nw},{un}"] = median_time(f, w, other, iters=args.iters)
                except Exception as e:  # a config Triton cannot compile: report and go on
                    print(f"{br},{nw},{un}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            row["kernel_fwd_s"] = tunes
            best = min(tunes, key=tunes.get)
            row["xla_fwd_bwd_s"] = median_time(jax.jit(jax.value_and_grad(sq(ref), argnums=(0, 1))), w, other,
                                               iters=args.iters)
            row["kernel_fwd_bwd_s"] = median_time(jax.jit(jax.value_and_grad(sq(kern), argnums=(0, 1))), w, other,
                                                  iters=args.iters)
            results["shapes"][name][op] = row
            table.append(f"| {name} | {op} | {row['xla_fwd_s'] * 1e3:.3f} | "
                         f"{tunes.get('32,8,4', float('nan')) * 1e3:.3f} ({best}: {tunes[best] * 1e3:.3f}) | "
                         f"{row['xla_fwd_bwd_s'] * 1e3:.3f} | {row['kernel_fwd_bwd_s'] * 1e3:.3f} | "
                         f"{max(errs.values()):.1e} |")
            (out / "sae_decode_gpu.json").write_text(json.dumps(results, indent=1))
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
