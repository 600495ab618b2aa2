"""Dense end-to-end baseline: prefill tokens/s, decode ms/token, peak device memory.

Random bf16 weights of real model shapes (SmolLM2-135M, Llama-3.1-8B). Every measurement
point runs in its own subprocess so the device's peak-memory counter belongs to that point.

    python -m sparsekv_jax.bench.e2e --out bench_e2e.json            # the full sweep
    python -m sparsekv_jax.bench.e2e --models smollm2 --contexts 4096 --batches 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MODELS = {"smollm2": "smollm2_135m_config", "llama3.1-8b": "llama31_8b_config"}


def _timed(fn, *args, warmup: int = 2, iters: int = 10) -> list[float]:
    import jax

    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return times


def _peak_bytes() -> int | None:
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def run_point(model: str, kind: str, context: int, batch: int, decode_steps: int, iters: int) -> dict:
    """One measurement in this process: ``kind`` is ``prefill`` or ``decode``."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax.cache import init_cache
    from sparsekv_jax.generate import decode_step, prefill
    from sparsekv_jax.models import config as mc
    from sparsekv_jax.models.params import random_params
    from sparsekv_jax.policies.base import Dense

    cfg = getattr(mc, MODELS[model])()
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    policy = Dense()
    tokens = jax.random.randint(jax.random.key(1), (batch, context), 0, cfg.vocab_size)
    lengths = jnp.full((batch,), context, jnp.int32)
    row = {"model": model, "kind": kind, "context": context, "batch": batch,
           "device": jax.devices()[0].device_kind, "jax": jax.__version__}
    if kind == "prefill":
        @jax.jit
        def run(params, tokens):
            cache = init_cache(cfg, batch, context, page_size=16, dtype=jnp.bfloat16)
            logits, cache, _, _ = prefill(params, policy, tokens, lengths, cache)
            return logits, cache.length

        times = _timed(run, params, tokens, iters=iters)
        med = statistics.median(times)
        row.update(ms=med * 1e3, tokens_per_s=batch * context / med)
    else:
        # a cache filled with random K/V (what prefill would leave), then `decode_steps` steps
        capacity = context + decode_steps

        @jax.jit
        def fill(key):
            cache = init_cache(cfg, batch, capacity, page_size=16, dtype=jnp.bfloat16)
            k1, k2 = jax.random.split(key)
            layers = cache.layers.replace(
                k=jax.random.normal(k1, cache.layers.k.shape, jnp.bfloat16),
                v=jax.random.normal(k2, cache.layers.v.shape, jnp.bfloat16),
                positions=jnp.broadcast_to(jnp.arange(cache.capacity, dtype=jnp.int32),
                                          cache.layers.positions.shape))
            ctx = jnp.full((batch,), context, jnp.int32)
            return cache.replace(layers=layers, length=ctx, next_position=ctx)

        cache = fill(jax.random.key(2))

        @jax.jit
        def run(params, cache, token):
            def body(i, carry):
                cache, token = carry
                logits, cache, _, _ = decode_step(params, policy, cache, token, (None, None))
                return cache, jnp.argmax(logits, -1).astype(jnp.int32)
            return jax.lax.fori_loop(0, decode_steps, body, (cache, token))[1]

        token = tokens[:, -1].astype(jnp.int32)
        times = _timed(run, params, cache, token, warmup=1, iters=iters)
        med = statistics.median(times)
        row.update(ms_per_token=med * 1e3 / decode_steps, tokens_per_s=batch * decode_steps / med)
    row["peak_bytes"] = _peak_bytes()
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsekv_jax.bench.e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,llama3.1-8b", help="comma list of " + ", ".join(MODELS))
    p.add_argument("--prefill-contexts", default="4096,32768", help="prefill prompt lengths")
    p.add_argument("--decode-contexts", default="4096,32768", help="decode context lengths")
    p.add_argument("--batches", default="1,32", help="decode batch sizes (prefill runs batch 1)")
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps timed per run")
    p.add_argument("--iters", type=int, default=10, help="timed repetitions (median reported)")
    p.add_argument("--timeout", type=int, default=240, help="seconds per point")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--point", help=argparse.SUPPRESS)  # internal: one point in this process
    args = p.parse_args(argv)
    if args.point:
        model, kind, ctx, batch = args.point.split(":")
        print(json.dumps(run_point(model, kind, int(ctx), int(batch), args.decode_steps, args.iters)))
        return 0
    points = []
    for model in args.models.split(","):
        if model not in MODELS:
            p.error(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
        points += [(model, "prefill", int(c), 1) for c in args.prefill_contexts.split(",")]
        points += [(model, "decode", int(c), int(b)) for c in args.decode_contexts.split(",")
                   for b in args.batches.split(",")]
    rows = []
    for model, kind, ctx, batch in points:
        cmd = [sys.executable, "-m", "sparsekv_jax.bench.e2e", "--point", f"{model}:{kind}:{ctx}:{batch}",
               "--decode-steps", str(args.decode_steps), "--iters", str(args.iters)]
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            if res.returncode == 0:
                rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
            else:
                err = [line for line in res.stderr.strip().splitlines()
                       if line.strip() and not line.startswith(("For simplicity", "-----", " "))]
                oom = any("RESOURCE_EXHAUSTED" in line or "out of memory" in line.lower() for line in err)
                rows.append({"model": model, "kind": kind, "context": ctx, "batch": batch,
                             "error": "does not fit in device memory" if oom else (err[-1] if err else "failed")})
        except subprocess.TimeoutExpired:
            rows.append({"model": model, "kind": kind, "context": ctx, "batch": batch, "error": "timeout"})
        print(json.dumps(rows[-1]), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    print(f"\n{'model':<12}{'kind':<8}{'context':>8}{'batch':>6}{'ms':>10}{'ms/tok':>9}{'tok/s':>12}{'peak GiB':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['model']:<12}{r['kind']:<8}{r['context']:>8}{r['batch']:>6}   {r['error']}")
            continue
        peak = r.get("peak_bytes")
        print(f"{r['model']:<12}{r['kind']:<8}{r['context']:>8}{r['batch']:>6}"
              f"{r.get('ms', float('nan')):>10.1f}{r.get('ms_per_token', float('nan')):>9.2f}"
              f"{r['tokens_per_s']:>12,.0f}{(peak or 0) / 2**30:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
