"""Gemma 3 270M end to end on one GPU: prefill and decode speed at a long context, per policy and cache path.

Each point times `generate` on random prompt tokens of the real model (the weights' values do not change
the speed): ``max_new_tokens=1`` is the prefill (+ compression, + the first token), ``1 + steps`` adds
``steps`` decode steps, so decode ms/token = (t(1 + steps) - t(1)) / steps (no stop token: every row
decodes every step). Medians of ``--iters`` runs after a compiling run. ``path=full`` is the full-cache
masked path (``Backend(local_cache="full")``: every layer stores every token, the window as a mask),
``ring`` the default (docs/GEMMA3.md). Points already in ``--out`` are skipped (resumable), and the
script stops starting points at ``--deadline`` seconds.

    python experiments/gemma3_speed.py --model /tmp/gemma-3-270m-q4_k_m.gguf --out $OUT/speed.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

POINTS = (  # (path, batch, policy spec), most wanted first
    ("ring", 1, "fullkv"), ("full", 1, "fullkv"), ("ring", 1, "quest(0.25, dense_layers=0)"),
    ("ring", 1, "chess('moderate')"), ("ring", 1, "stem"), ("ring", 8, "fullkv"),
)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="gemma3-270m or a .gguf path")
    p.add_argument("--context", type=int, default=32768 - 128, help="prompt tokens (default 32k - 128)")
    p.add_argument("--steps", type=int, default=64, help="decode steps timed")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--deadline", type=float, default=1e9, help="seconds after which no new point starts")
    p.add_argument("--out", default="gemma3_speed.json")
    args = p.parse_args(argv)
    start = time.perf_counter()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from sparsekv_jax.backend import Backend
    from sparsekv_jax.bench.timing import median_time
    from sparsekv_jax.generate import generate
    from sparsekv_jax.models.embedded import load
    from sparsekv_jax.policies import parse_policy

    rows = json.load(open(args.out)) if os.path.exists(args.out) else []
    done = {(r["path"], r["batch"], r["policy"]) for r in rows}
    params, _ = load(args.model, dtype=jnp.bfloat16, progress=False)
    cfg = params.config
    for path, batch, spec in POINTS:
        if (path, batch, spec) in done:
            continue
        if time.perf_counter() - start > args.deadline:
            print(f"deadline: {path} B={batch} {spec} left for the next call", flush=True)
            break
        backend = Backend(local_cache=path)
        policy = parse_policy(spec)
        tokens = np.random.default_rng(0).integers(10, cfg.vocab_size, (batch, args.context))
        row = {"path": path, "batch": batch, "policy": spec, "context": args.context, "steps": args.steps,
               "device": jax.devices()[0].device_kind, "jax": jax.__version__}
        try:
            def run(n, policy=policy, tokens=tokens, backend=backend):
                out = generate(params, policy, tokens, max_new_tokens=n, stop_tokens=(), backend=backend)
                jax.block_until_ready(out.tokens)
                return out

            t1 = median_time(lambda: run(1), iters=args.iters)
            out = run(1)
            row.update(prefill_s=t1, prefill_tokens_per_s=batch * args.context / t1,
                       cache_bytes=out.stats["cache_bytes"],
                       kv_stored_fraction=float(np.mean(out.stats["kv_stored_fraction"])),
                       prefill_block_fraction=float(out.stats["prefill_block_fraction"]))
            if spec != "stem":  # Stem changes the prefill only
                t2 = median_time(lambda: run(1 + args.steps), iters=args.iters)
                row.update(decode_ms_per_token=1e3 * (t2 - t1) / args.steps,
                           kv_read_fraction=float(np.nanmean(run(1 + args.steps).stats["kv_read_fraction"])))
        except Exception as e:  # noqa: BLE001 - record the point and go on
            text = str(e)
            row["error"] = ("does not fit in device memory" if "RESOURCE_EXHAUSTED" in text
                            else f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}")
        rows.append(row)
        print(json.dumps(row), flush=True)
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)

    print(f"\n{'path':<6}{'B':>3}  {'policy':<30}{'prefill s':>10}{'tok/s':>10}{'decode ms/tok':>15}"
          f"{'cache MB':>10}{'stored':>8}{'read':>7}")
    for r in rows:
        head = f"{r['path']:<6}{r['batch']:>3}  {r['policy']:<30}"
        if "error" in r:
            print(head + r["error"])
            continue
        print(f"{head}{r['prefill_s']:>10.3f}{r['prefill_tokens_per_s']:>10,.0f}"
              f"{r.get('decode_ms_per_token', float('nan')):>15.2f}{r['cache_bytes'] / 1e6:>10.0f}"
              f"{r['kv_stored_fraction']:>8.3f}{r.get('kv_read_fraction', float('nan')):>7.3f}")


if __name__ == "__main__":
    main()
