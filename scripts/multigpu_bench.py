"""Decode on one GPU against two (JAX's SPMD, `sparsekv_jax.sharding`): throughput and the longest
context that fits, full attention and CHESS, on Llama-3.1-8B and a 32B-class shape (Qwen2.5-32B's
config), random bf16 weights.

Each model runs in its own process (clean device memory), on each layout in turn: one GPU (no mesh,
what a single-GPU user runs today) and the mesh ``model=2`` (heads, MLP and vocabulary split over
two GPUs; ``--meshes`` adds e.g. ``data=2``). For each policy:

1. **throughput** at ``--context`` × ``--batch`` (per model): a cache holding the context, built on
   the layout (`sparsekv_jax.bench.e2e._decode_cache`, random K/V), ``--steps`` greedy decode steps
   in one jitted loop with the cache donated (`e2e.decode_fn`), median of ``--iters`` after a warm-up.
   ms/step, tokens/s, the speedup over one GPU and the scaling efficiency (speedup / GPUs); XLA's
   memory analysis of the step per device (weights + cache + temporaries); and how many copies of a
   device's whole stacked K the compiled step holds (compare the layouts: a copy in the step costs a
   cache's worth of bandwidth).
2. **longest context** at the same batch: the step's memory is affine in the context (the cache
   grows by a known number of bytes per token; the rest is fixed), so the throughput point's memory
   analysis and the cache's bytes per token predict the longest context whose step fits the device
   (``bytes_limit``, after the weights); that context, rounded down to 1k, is compiled and run
   (one call), stepping down 10% while it does not fit (at most ``--tries``). Decode only: the
   prefill of such a context is not part of it (a chunked prefill fills the cache).

    python scripts/multigpu_bench.py --models llama3.1-8b --out $OUT     # 2 GPUs; at most ~8 minutes
    python scripts/multigpu_bench.py --models qwen2.5-32b --out $OUT     # (new points stop at 420 s)
    python scripts/multigpu_bench.py --cpu-smoke --out out               # tiny shapes, 2 forced CPU devices

Stops starting new points after ``--deadline`` seconds (the points left are listed as skipped).
Writes ``$OUT/multigpu_<models>.json`` and prints one table last.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

GIB = 2.0**30
DEFAULTS = {  # (context, batch) of the throughput point: full attention fits one H200 at both
    "llama3.1-8b": (32768, 8),  # 16 GB weights + 34 GB cache
    "qwen2.5-32b": (16384, 8),  # 65 GB weights + 34 GB cache
    "smoke": (256, 4),
}


def qwen25_32b_config():
    """Qwen2.5-32B's shapes (its config.json), the context extended to 128k (YaRN in the real model;
    speed does not depend on the RoPE variant)."""
    from sparsekv_jax.models.config import ModelConfig

    return ModelConfig(family="qwen2", vocab_size=152064, hidden_size=5120, num_layers=64, num_heads=40,
                       num_kv_heads=8, head_dim=128, intermediate_size=27648, rope_theta=1e6, rms_norm_eps=1e-6,
                       qkv_bias=True, max_position_embeddings=131072, eos_token_ids=(151645,))


def model_config(name: str):
    from sparsekv_jax.models import config as mc

    if name == "llama3.1-8b":
        return mc.llama31_8b_config()
    if name == "qwen2.5-32b":
        return qwen25_32b_config()
    if name == "smoke":
        return mc.ModelConfig(family="qwen2", vocab_size=512, hidden_size=128, num_layers=4, num_heads=8,
                              num_kv_heads=4, head_dim=32, intermediate_size=256, qkv_bias=True,
                              max_position_embeddings=1 << 20, eos_token_ids=(0,))
    raise SystemExit(f"unknown model {name!r}: llama3.1-8b, qwen2.5-32b or smoke")


def stack_copies(hlo: str, shape: tuple[int, ...]) -> int:
    """Copies in a compiled program whose result has ``shape`` (a device's stacked K)."""
    dims = ",".join(map(str, shape))
    return sum(1 for line in hlo.splitlines()
               if re.search(rf"=\s*\(?bf16\[{dims}\][^=]*? copy(-start)?\(", line))


def _why(e: Exception) -> str:
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "does not fit"
    return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}"


def decode_point(cfg, params, policy, backend, mesh, T: int, batch: int, steps: int, iters: int | None) -> dict:
    """One decode point: build the cache of ``T`` tokens on the layout, compile the ``steps``-step loop,
    run it (``iters`` timed calls after a warm-up; ``None``: the warm-up only, to show it fits)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    from sparsekv_jax import sharding
    from sparsekv_jax.bench.e2e import _decode_cache, _median_time_carry, _memory, decode_fn
    from sparsekv_jax.policies.base import Setup

    pol = policy.bind(Setup(cfg, prompt_len=T, max_new_tokens=steps, backend=backend))
    cache, obs = _decode_cache(cfg, pol, T, batch, steps, jax.random.key(2), mesh=mesh)
    state = sharding.place_state(pol.decode_init(cache, obs), cache, mesh)  # the split the step returns
    del obs
    token = jnp.ones((batch,), jnp.int32)
    if mesh is not None:
        token = jax.device_put(token, NamedSharding(mesh, PartitionSpec(sharding.DATA)))
    fn = decode_fn(params, pol, steps, start=(cache.length, cache.next_position), backend=backend)
    t0 = time.time()
    compiled = fn.lower(params, cache, state, token).compile()
    out = {"context": T, "policy": pol.name, "decode_matmul": backend.decode_matmul, "compile_s": time.time() - t0,
           "memory_bytes": _memory(compiled), "cache_bytes": cache.nbytes(),
           "cache_bytes_per_token": cache.nbytes() / cache.capacity,
           "stack_copies": stack_copies(compiled.as_text(), cache.layers.k.addressable_shards[0].data.shape)}
    if iters:
        sec, carry = _median_time_carry(compiled, params, (cache, state, token), iters=iters)
        out.update(ms_per_step=sec * 1e3 / steps, tokens_per_s=batch * steps / sec)
    else:
        carry = jax.block_until_ready(compiled(params, cache, state, token))
    del carry, cache, state
    return out


def longest_guess(row: dict, context: int, gpus: int, limit: int | None, max_positions: int, steps: int) -> int:
    """The longest context whose step should fit: the step's memory is affine in the context (a device
    holds 1/gpus of the cache's bytes per token; weights and temporaries are fixed). Without a device
    limit (the CPU smoke run) 4x the point's memory stands in for it."""
    per_token = row["cache_bytes_per_token"] / gpus
    fixed = row["memory_bytes"] - per_token * context
    cap = 0.98 * (limit if limit is not None else 4 * row["memory_bytes"])
    T = int((cap - fixed) / per_token)
    return min(T // 1024 * 1024 if T >= 4096 else T, max_positions - steps)


def run_model(model: str, meshes: list[str], policies: str, context: int, batch: int, steps: int, iters: int,
              tries: int, deadline: float) -> list[dict]:
    import gc

    import jax
    import jax.numpy as jnp

    from sparsekv_jax import sharding
    from sparsekv_jax.backend import Backend
    from sparsekv_jax.bench.e2e import random_weights
    from sparsekv_jax.policies import parse_policies

    cfg = model_config(model)
    rows: list[dict] = []
    base = {"model": model, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "batch": batch}

    def record(**row):
        rows.append({**base, **row})
        print(json.dumps(rows[-1]), flush=True)

    for layout in meshes:
        d, m = (1, 1) if layout == "1" else sharding.parse_mesh(layout)
        where = {"layout": layout, "gpus": d * m}
        if time.time() > deadline:
            record(**where, skipped="deadline")
            continue
        try:
            mesh = None if layout == "1" else sharding.make_mesh(d, m)
            if mesh is not None:
                sharding.check_mesh(cfg, batch, mesh)
            t0 = time.time()
            params = jax.block_until_ready(random_weights(cfg, mesh, jnp.bfloat16))
            where["init_s"] = time.time() - t0
        except Exception as e:  # noqa: BLE001 - report the layout and go on
            record(**where, error=_why(e))
            continue
        devices = list(mesh.devices.flat) if mesh is not None else jax.devices()[:1]
        limit = min(dev.memory_stats()["bytes_limit"] for dev in devices) if devices[0].platform == "gpu" else None
        backend = Backend(mesh=mesh).resolve(params)
        for policy in parse_policies(policies):
            if time.time() > deadline:
                record(**where, policy=policy.name, skipped="deadline")
                continue
            try:
                row = decode_point(cfg, params, policy, backend, mesh, context, batch, steps, iters)
                record(**where, **row, kind="throughput")
            except Exception as e:  # noqa: BLE001
                record(**where, kind="throughput", policy=policy.name, context=context, error=_why(e))
                continue
            finally:
                gc.collect()
            if row["memory_bytes"] is None:
                continue
            T = longest_guess(row, context, d * m, limit, cfg.max_position_embeddings, steps)
            for _ in range(tries):
                if time.time() > deadline:
                    record(**where, kind="longest", policy=policy.name, skipped="deadline")
                    break
                try:
                    fit = decode_point(cfg, params, policy, backend, mesh, T, batch, steps, None)
                    record(**where, **fit, kind="longest", predicted_from=context)
                    break
                except Exception as e:  # noqa: BLE001 - did not fit: 10% less
                    record(**where, kind="longest_try", policy=policy.name, context=T, error=_why(e))
                    T = int(T * 0.9) // 1024 * 1024 or T // 2
                finally:
                    gc.collect()
        del params
        gc.collect()
    return rows


def table(rows: list[dict]) -> str:
    lines = [f"{'model':<13}{'layout':<9}{'policy':<24}{'ctx':>8}{'B':>4}{'ms/step':>9}{'tok/s':>9}{'speedup':>8}"
             f"{'eff':>6}{'GiB/GPU':>9}{'copies':>7}{'longest ctx':>12}{'x1 GPU':>7}"]
    thr = {(r["model"], r["layout"], r["policy"]): r for r in rows
           if r.get("kind") == "throughput" and "error" not in r}
    lon = {(r["model"], r["layout"], r["policy"]): r for r in rows if r.get("kind") == "longest"}
    for (model, layout, policy), r in thr.items():
        one = thr.get((model, "1", policy))
        speed = one["ms_per_step"] / r["ms_per_step"] if one else float("nan")
        longest = lon.get((model, layout, policy))
        one_long = lon.get((model, "1", policy))
        ctx = longest["context"] if longest else None
        ratio = ctx / one_long["context"] if ctx and one_long else float("nan")
        lines.append(f"{model:<13}{layout:<9}{policy[:23]:<24}{r['context']:>8}{r['batch']:>4}{r['ms_per_step']:>9.2f}"
                     f"{r['tokens_per_s']:>9,.0f}{speed:>8.2f}{speed / r['gpus']:>6.2f}"
                     f"{(r['memory_bytes'] or 0) / GIB:>9.1f}{r['stack_copies']:>7}"
                     f"{(ctx if ctx else 0):>12,}{ratio:>7.2f}")
    for r in rows:
        if "error" in r or "skipped" in r:
            lines.append(f"{r['model']:<13}{r.get('layout', ''):<9}{r.get('policy', '')[:23]:<24}"
                         f"{r.get('context', ''):>8}  {r.get('kind', '')}: {r.get('error', r.get('skipped'))}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scripts/multigpu_bench.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="llama3.1-8b", help="comma list: llama3.1-8b, qwen2.5-32b")
    p.add_argument("--meshes", default="1;model=2",
                   help="layouts separated by ';': 1 (one GPU, no mesh) or data=D,model=M (default '1;model=2'; "
                        "e.g. '1;model=2;data=2')")
    p.add_argument("--policies", default="fullkv, chess('aggressive')", help="policy spec (sparsekv eval --help)")
    p.add_argument("--context", type=int, default=None, help="throughput context (default per model: 32k / 16k)")
    p.add_argument("--batch", type=int, default=None, help="batch (default 8)")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed call")
    p.add_argument("--iters", type=int, default=3, help="timed calls (median)")
    p.add_argument("--tries", type=int, default=3, help="attempts at the longest context (10%% less each)")
    p.add_argument("--deadline", type=float, default=420.0,
                   help="seconds after which no new point starts (420: a 600 s limit leaves room for the last one)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="output folder (default $OUT or ./out)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on 2 forced CPU devices")
    p.add_argument("--one-model", help=argparse.SUPPRESS)
    p.add_argument("--until", type=float, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    meshes = [m.strip() for m in args.meshes.split(";") if m.strip()]
    if args.one_model:
        context, batch = DEFAULTS.get(args.one_model, (32768, 8))
        rows = run_model(args.one_model, meshes, args.policies, args.context or context, args.batch or batch,
                         args.steps, args.iters, args.tries, args.until or time.time() + args.deadline)
        print("ROWS " + json.dumps(rows), flush=True)
        return 0
    start = time.time()
    env = dict(os.environ)
    models = ["smoke"] if args.cpu_smoke else [m.strip() for m in args.models.split(",") if m.strip()]
    if args.cpu_smoke:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
        env["JAX_PLATFORMS"] = "cpu"
    else:
        env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
    root = Path(__file__).resolve().parents[1]
    env["PYTHONPATH"] = os.pathsep.join([str(root), env.get("PYTHONPATH", "")])
    rows: list[dict] = []
    for model in models:
        cmd = [sys.executable, __file__, "--one-model", model, "--meshes", ";".join(meshes), "--policies",
               args.policies, "--steps", str(args.steps), "--iters", str(args.iters), "--tries", str(args.tries),
               "--until", str(start + args.deadline)]
        for flag in ("context", "batch"):
            if getattr(args, flag):
                cmd += [f"--{flag}", str(getattr(args, flag))]
        res = subprocess.run(cmd, capture_output=True, text=True, env=env)  # one process per model: clean memory
        found = [line for line in res.stdout.splitlines() if line.startswith("ROWS ")]
        if found:
            rows += json.loads(found[-1][5:])
        else:
            print(res.stdout[-3000:], res.stderr[-5000:], file=sys.stderr)
            rows.append({"model": model, "error": "process failed (stderr above)"})
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"multigpu_{'_'.join(models)}.json"
    path.write_text(json.dumps(rows, indent=2))
    print(f"\n[{len(rows)} rows in {path}; {time.time() - start:.0f} s]\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
