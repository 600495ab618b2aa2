"""Stem's routing on a GPU: the tiled routing (default) against the whole-metric one, alone and end to end.

Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128, 32 layers), random bf16 values and
weights, batch 1, default `Stem` (blocks of 64, stride 8):

1. routing alone, one layer: ``Stem(routing="full")`` (the ``[nQ, nK]`` metric, one top-k) against
   ``Stem()`` (`stem_routing.routed_blocks`, a `lax.map` over tiles of query blocks keeping only the
   lists) and ``Stem(routing="kernel")`` (the same loop, each tile's metric from the Pallas kernel
   `sparsekv_jax.pallas.stem_route`, first run on a GPU here: a variant that does not compile is
   reported and left out), each at the default tile and each ``--tiles``; the share of lists the GPU
   gives identically to the full routing (ids in order) and as the same sets (first ``count`` ids) is
   printed first;
2. end to end: `engine.prefill` of dense (`FullKV`, cuDNN) and Stem with the full, the tiled and the
   kernel routing (``--e2e`` picks among them), compiled ahead.

Every variant of a length is timed interleaved (one call of each per round, the order rotated), the
median of ``--iters`` rounds after a warm-up, and the whole repeated ``--repeats`` times. Each
command must end within the device's 10 minutes: run the lengths one at a time, e.g.

    python experiments/stem_routing_gpu.py --lengths 32k --out $OUT
    python experiments/stem_routing_gpu.py --lengths 128k --skip-e2e --out $OUT
    python experiments/stem_routing_gpu.py --lengths 128k --skip-routing --repeats 1 --out $OUT   # twice

Prints a table per length; writes ``stem_routing_gpu_<length>.json`` under ``--out``.
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

from sparsekv_jax.backend import Backend  # noqa: E402
from sparsekv_jax.bench.e2e import parse_tokens, random_weights  # noqa: E402
from sparsekv_jax.bench.timing import timed_call  # noqa: E402
from sparsekv_jax.cache import init_cache  # noqa: E402
from sparsekv_jax.engine import prefill  # noqa: E402
from sparsekv_jax.models.config import llama31_8b_config  # noqa: E402
from sparsekv_jax.policies import FullKV, Stem, parse_policy  # noqa: E402
from sparsekv_jax.policies.base import Prompt, Setup  # noqa: E402

E2E = ("dense", "full", "tiled", "kernel")  # the end-to-end variants (Stem's routing, or dense)


def interleaved(fns: dict, args: tuple, iters: int) -> dict[str, float]:
    """Median seconds of each of ``fns`` (called on ``args``) over ``iters`` rounds, one call of each per
    round in a rotated order, after one warm-up call of each."""
    names = list(fns)
    for name in names:
        timed_call(fns[name], *args)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(iters):
        for name in names[r % len(names):] + names[:r % len(names)]:
            times[name].append(timed_call(fns[name], *args)[1])
    return {name: statistics.median(t) for name, t in times.items()}


def routing_variants(stem: Stem, tiles: list[int]) -> dict[str, Stem]:
    out = {"full": stem.replace(routing="full"), "tiled (default tile)": stem.replace(routing="tiled")}
    out.update({f"tiled, tile {t}": stem.replace(routing="tiled", route_tile=t) for t in tiles})
    out["kernel (default tile)"] = stem.replace(routing="kernel")
    out.update({f"kernel, tile {t}": stem.replace(routing="kernel", route_tile=t) for t in tiles})
    return out


def compile_all(make: dict, args: tuple) -> tuple[dict, dict]:
    """``({name: compiled}, {name: error})``: a variant that fails to compile (the Pallas kernel has not
    run on a GPU before this script) is reported and left out."""
    fns, errors = {}, {}
    for name, fn in make.items():
        try:
            fns[name] = fn.lower(*args).compile()
        except Exception as e:  # noqa: BLE001 - report the variant and go on
            errors[name] = f"{type(e).__name__}: {str(e)[:2000]}"
            print(f"{name}: does not compile: {errors[name][:300]}", flush=True)
    return fns, errors


def routing_fn(pol: Stem, T: int):
    def run(q, k, v, lengths):
        ids, counts, _ = pol.prefill_pattern(q, k, v, jnp.int32(0), Prompt(jnp.zeros((1, T), jnp.int32), lengths))
        return ids, counts

    return jax.jit(run)


def same_lists(ref: tuple, got: tuple) -> dict[str, float]:
    """Share of (row, head, query block) lists equal to the reference's: ids in order, and as sets of
    the first ``count`` ids."""
    (ri, rc), (gi, gc) = (tuple(np.asarray(x) for x in p) for p in (ref, got))
    ordered = (ri == gi).all(-1)
    width = np.arange(ri.shape[-1])
    kept = width < rc[..., None]
    as_sets = (np.sort(np.where(kept, ri, -1), -1) == np.sort(np.where(kept, gi, -1), -1)).all(-1)
    return {"ids_identical": float(ordered.mean()), "sets_equal": float((as_sets & (rc == gc)).mean())}


def routing_point(stem: Stem, T: int, tiles: list[int], iters: int, repeats: int, cfg) -> dict:
    if stem.is_dense(T):
        raise ValueError(f"{stem.name} is dense at {T} tokens (no routing): pass a longer length")
    keys = jax.random.split(jax.random.key(T), 3)
    q = jax.random.normal(keys[0], (1, T, cfg.num_heads, cfg.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], (1, T, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    v = jax.random.normal(keys[2], (1, T, cfg.num_kv_heads, cfg.head_dim), jnp.bfloat16)
    lengths = jnp.full((1,), T, jnp.int32)
    pols = routing_variants(stem, tiles)
    fns, errors = compile_all({name: routing_fn(p, T) for name, p in pols.items()}, (q, k, v, lengths))
    temp = {name: int(f.memory_analysis().temp_size_in_bytes) for name, f in fns.items()}
    ref = fns["full"](q, k, v, lengths)
    agree = {name: same_lists(ref, f(q, k, v, lengths)) for name, f in fns.items() if name != "full"}
    print(f"{T}: lists against the full routing: {json.dumps(agree)}", flush=True)
    runs = [interleaved(fns, (q, k, v, lengths), iters) for _ in range(repeats)]
    return {"agreement": agree, "temp_bytes": temp, "errors": errors,
            "ms": [{n: s * 1e3 for n, s in r.items()} for r in runs]}


def e2e_point(stem: Stem, T: int, iters: int, repeats: int, cfg, params, backend: Backend,
              variants: tuple[str, ...] = E2E) -> dict:
    tokens = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.vocab_size)
    lengths = jnp.full((1,), T, jnp.int32)
    pols = {"dense": FullKV(), "stem, full routing": stem.replace(routing="full"),
            "stem, tiled routing": stem.replace(routing="tiled"),
            "stem, kernel routing": stem.replace(routing="kernel")}
    pols = {name: pol for name, pol in pols.items() if name.split(", ")[-1].split()[0] in variants}
    make = {}
    for name, pol in pols.items():
        pol = pol.bind(Setup(cfg, prompt_len=T, backend=backend))

        def run(params, tokens, pol=pol):
            cache = init_cache(cfg, 1, T, page_size=16, dtype=jnp.bfloat16, summaries=pol.page_summaries)
            logits, cache, _, frac = prefill(params, pol, tokens, lengths, cache, backend=backend)
            return logits, cache.length, frac

        make[name] = jax.jit(run)
    fns, errors = compile_all(make, (params, tokens))
    fraction = {name: float(fn(params, tokens)[2]) for name, fn in fns.items()}
    runs = [interleaved(fns, (params, tokens), iters) for _ in range(repeats)]
    return {"prefill_block_fraction": fraction, "errors": errors,
            "ms": [{n: s * 1e3 for n, s in r.items()} for r in runs]}


def table(T: int, result: dict) -> str:
    lines = [f"### {T} tokens", "", "| variant | ms (each repeat) | vs first row |", "|---|---|---|"]
    for part in ("routing", "e2e"):
        if part not in result:
            continue
        runs = result[part]["ms"]
        first = next(iter(runs[0]))
        for name in runs[0]:
            ms = ", ".join(f"{r[name]:.1f}" for r in runs)
            ratio = ", ".join(f"{r[first] / r[name]:.2f}x" for r in runs)
            lines.append(f"| {part}: {name} | {ms} | {ratio} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="32k,128k", help="prompt lengths (e.g. 32k,128k)")
    p.add_argument("--tiles", default="4,8,32", help="route_tile values timed beside the default (query blocks a step)")
    p.add_argument("--iters", type=int, default=9, help="interleaved rounds per repeat (median)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--stem", default="stem", help="the Stem policy spec (routing and route_tile are set per variant)")
    p.add_argument("--e2e", default=",".join(E2E), help="end-to-end variants: " + ", ".join(E2E))
    p.add_argument("--skip-routing", action="store_true")
    p.add_argument("--skip-e2e", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    if args.iters < 9:
        p.error(f"--iters={args.iters}: at least 9 rounds (medians of >= 9 trials)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tiles = [int(t) for t in filter(None, args.tiles.split(","))]
    variants = tuple(v.strip() for v in args.e2e.split(",") if v.strip())
    if not set(variants) <= set(E2E):
        p.error(f"--e2e={args.e2e!r}: pick among {', '.join(E2E)}")
    stem = parse_policy(args.stem)
    if not isinstance(stem, Stem):
        p.error(f"--stem={args.stem!r} is not a Stem policy")
    cfg, params, backend = llama31_8b_config(), None, None
    for T in parse_tokens(args.lengths):
        result = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "T": T, "stem": stem.name}
        if not args.skip_routing:
            result["routing"] = routing_point(stem, T, tiles, args.iters, args.repeats, cfg)
        if not args.skip_e2e:
            if params is None:
                params = random_weights(cfg, None, jnp.bfloat16)
                backend = Backend().resolve(params)
            result["e2e"] = e2e_point(stem, T, args.iters, args.repeats, cfg, params, backend, variants)
        (out / f"stem_routing_gpu_{T // 1024}k.json").write_text(json.dumps(result, indent=1))
        print(table(T, result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
