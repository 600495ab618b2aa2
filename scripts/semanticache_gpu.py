"""SemantiCache speed on Llama-3.1-8B shapes (random bf16 weights), all in one process.

1. **Compression time against the prefill.** A 32k-token prompt (batch 1) is prefilled with full
   attention (cuDNN), then compressed to 20% by SemantiCache; both are timed (median of ``--iters``
   runs after a warm-up). Variants: the default (budget mode: two grid passes of the threshold
   search), the paper's threshold mode (one GSC pass, ``tau=0.7``), and ``layer_batch`` values.
   Token ids are random and every 7th id is a delimiter (about 14% of the prompt, as in prose);
   chunks run up to ``chunk_size`` = 64 tokens, so the GSC loop takes its longest path.
2. **Decode against FullKV at 32k**, batch 1 and the largest batch FullKV's cache fits
   (device memory minus the weights, less 6 GiB): ms per token over ``--steps`` steps and the
   cache's bytes. The SemantiCache cache is the real compressed cache of step 1 (holes, biases),
   repeated over the batch.
3. **The merged cache's decode step against SnapKV's at the same kept count** (a SnapKV cache of
   the same capacity holding the full budget, random entries; the merged cache's length is its
   largest per-head count, at most that). Both are read through the Pallas decode kernel, which
   always applies the per-slot bias, and by *one* compiled step (same shapes: one compile).

Every time is the median of ``--iters`` runs after a warm-up, each ended by ``block_until_ready``.
Writes ``semanticache_gpu.json`` (every row) to ``--out`` and prints a table last.

    python scripts/semanticache_gpu.py --out $OUT              # GPU: Llama-3.1-8B shapes, 32k
    python scripts/semanticache_gpu.py --cpu-smoke --out /tmp/x  # tiny shapes, any machine
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.backend import Backend
from sparsekv_jax.bench.e2e import _decode_cache, _median_time, _why
from sparsekv_jax.cache import init_cache
from sparsekv_jax.generate import decode_step, prefill, stored_entries
from sparsekv_jax.models.config import ModelConfig, llama31_8b_config
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import Dense, SemantiCache, SnapKV
from sparsekv_jax.policies.base import Prompt, Setup

GIB = 2.0**30


def _kept_fraction(cache, prompt_len: int) -> float:
    """Row 0's live entries per (layer, KV head) over the prompt length (`stored_entries` returns the
    per-row sum over layers and heads and the number of pairs)."""
    total, pairs = stored_entries(cache)
    return float(total[0]) / pairs / prompt_len


def smoke_config() -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2,
                       head_dim=64, intermediate_size=512, max_position_embeddings=4096, rope_theta=5e5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model and context (checks the script)")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--budget", type=float, default=0.2)
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed run")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--layer-batches", default="4,32", help="layer_batch values timed for compression")
    p.add_argument("--gsc", default="auto,jnp",
                   help="where GSC runs, each timed: auto (the Pallas kernel on a GPU), jnp, pallas; the first is "
                        "the reference the others' caches are checked equal to")
    p.add_argument("--compress-only", action="store_true", help="stop after the compression rows (no decode)")
    p.add_argument("--max-batch", type=int, default=0, help="FullKV's largest batch (0: from device memory)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"), help="directory for semanticache_gpu.json")
    args = p.parse_args(argv)
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    if args.cpu_smoke:
        cfg, T, layer_batches = smoke_config(), 512, [2, 4]
    else:
        cfg, T, layer_batches = llama31_8b_config(), args.context, [int(x) for x in args.layer_batches.split(",")]
    steps, iters = args.steps, args.iters
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    backend = Backend().resolve(params)
    device = jax.devices()[0].device_kind
    rows: list[dict] = []

    def record(row: dict) -> None:
        rows.append({"device": device, "jax": jax.__version__, "context": T, **row})
        print(json.dumps(rows[-1]), flush=True)

    # -- 1. prefill and compression -------------------------------------------------------------
    tokens = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.vocab_size, jnp.int32)
    lengths = jnp.full((1,), T, jnp.int32)
    mask = jnp.arange(cfg.vocab_size) % 7 == 0  # synthetic delimiter ids (no tokenizer on the GPU box)
    digits = jnp.arange(cfg.vocab_size) % 50 == 1  # synthetic digit ids: 2% of the prompt, kept unmerged
    starts = jnp.arange(cfg.vocab_size) % 3 != 2  # synthetic word starts: 2 of 3 tokens (SmolLM2: 65%)
    ends = jnp.arange(cfg.vocab_size) % 21 == 0  # synthetic sentence ends: 1 of 3 delimiters

    @jax.jit
    def run_prefill(params, tokens):
        cache = init_cache(cfg, 1, T + steps, page_size=16, dtype=jnp.bfloat16)
        logits, cache, _, _ = prefill(params, Dense(), tokens, lengths, cache, backend=backend)
        return logits, cache

    prefill_s = _median_time(run_prefill, params, tokens, iters=iters)
    _, full_cache = run_prefill(params, tokens)
    record({"kind": "prefill", "batch": 1, "ms": prefill_s * 1e3})

    prompt = Prompt(tokens=tokens, lengths=lengths)
    gscs = [g.strip() for g in args.gsc.split(",") if g.strip()]
    variants = []
    for g in gscs:
        variants += [(f"budget {args.budget}, layer_batch={lb}, gsc={g}", SemantiCache(args.budget, layer_batch=lb,
                                                                                       gsc=g))
                     for lb in layer_batches]
        variants.append((f"budget {args.budget}, previous layout rule, layer_batch={layer_batches[-1]}, gsc={g}",
                         SemantiCache(args.budget, layer_batch=layer_batches[-1], level_rule="finest", gsc=g)))
        variants.append((f"threshold tau=0.7 (cap = budget), gsc={g}", SemantiCache(args.budget, tau=0.7, gsc=g)))
        variants.append((f"budget {args.budget}, words only (number_sentences=0), layer_batch={layer_batches[-1]}, "
                         f"gsc={g}",
                         SemantiCache(args.budget, layer_batch=layer_batches[-1], number_sentences=0, gsc=g)))
        variants.append((f"budget {args.budget}, digits only (number_words=False), layer_batch={layer_batches[-1]}, "
                         f"gsc={g}",
                         SemantiCache(args.budget, layer_batch=layer_batches[-1], number_words=False, gsc=g)))
        variants.append((f"budget {args.budget}, digits merged (the paper), layer_batch={layer_batches[-1]}, gsc={g}",
                         SemantiCache(args.budget, layer_batch=layer_batches[-1], keep_numbers=False, gsc=g)))
    merged = None
    firsts: dict[str, object] = {}  # per setting (the label without gsc): the first gsc's cache
    for label, pol in variants:
        pol = pol.replace(delimiter_mask=mask, number_mask=digits, word_start_mask=starts, sentence_end_mask=ends).bind(
            Setup(cfg, prompt_len=T, max_new_tokens=steps, backend=backend))
        cap = pol.compressed_capacity(T, steps)
        try:
            fn = jax.jit(lambda cache, prompt, pol=pol, cap=cap: pol.compress(cache, None, cap, prompt))
            sec = _median_time(fn, full_cache, prompt, iters=iters)
            comp = fn(full_cache, prompt)
            setting = label.rsplit(", gsc=", 1)[0]
            same = None
            if setting in firsts:  # share of entries whose position differs from the first gsc path's
                same = float(jnp.mean(firsts[setting].positions != comp.layers.positions))
            else:
                firsts[setting] = comp.layers
            record({"kind": "compress", "variant": label, "ms": sec * 1e3, "share_of_prefill": sec / prefill_s,
                    "kept_fraction": _kept_fraction(comp, T), "length": int(comp.length[0]),
                    "capacity": comp.capacity, "cache_bytes": comp.nbytes(),
                    "positions_differing_from_first_gsc": same})
            if merged is None:
                merged = comp
        except Exception as e:  # noqa: BLE001 - report the point and go on
            record({"kind": "compress", "variant": label, "error": _why(e)})
    del full_cache
    firsts.clear()
    if args.compress_only:
        _write(out_dir, rows, prefill_s)
        return 0

    # -- 2./3. decode ---------------------------------------------------------------------------
    shapes = jax.eval_shape(lambda: init_cache(cfg, 1, T + steps, page_size=16, dtype=jnp.bfloat16))
    per_row = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    stats = jax.devices()[0].memory_stats() or {}
    weights = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))
    if args.max_batch:
        max_batch = args.max_batch
    elif args.cpu_smoke or "bytes_limit" not in stats:
        max_batch = 4
    else:
        max_batch = max(1, int((stats["bytes_limit"] - weights - 6 * GIB) // per_row))
    snap = SnapKV(args.budget).bind(Setup(cfg, prompt_len=T, max_new_tokens=steps, backend=backend))

    # one jitted step for every cache: caches of equal shapes (the merged and SnapKV's) share a compile
    @functools.partial(jax.jit, donate_argnums=(1,))
    def decode(params, cache, length, next_position, token):
        cache = cache.replace(length=length, next_position=next_position)  # every call decodes from the start

        def body(i, carry):
            cache, token = carry
            logits, cache, _, _ = decode_step(params, Dense(), cache, token, (None, None), backend=backend)
            return cache, jnp.argmax(logits, -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, (cache, token))

    def time_decode(label: str, cache, B: int) -> None:
        try:
            sizes = (cache.nbytes(), cache.kv_nbytes(), cache.capacity, int(cache.length.max()))
            # copies: the cache's own buffers are donated
            start, token = (jnp.copy(cache.length), jnp.copy(cache.next_position)), jnp.ones((B,), jnp.int32)
            cache, _ = jax.block_until_ready(decode(params, cache, *start, token))  # warm-up (and compile)
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                cache, _ = jax.block_until_ready(decode(params, cache, *start, token))
                times.append(time.perf_counter() - t0)
            ms = statistics.median(times) * 1e3 / steps
            record({"kind": "decode", "policy": label, "batch": B, "ms_per_token": ms, "cache_bytes": sizes[0],
                    "kv_bytes": sizes[1], "capacity": sizes[2], "length": sizes[3]})
        except Exception as e:  # noqa: BLE001 - report the point and go on
            record({"kind": "decode", "policy": label, "batch": B, "error": _why(e)})

    for B in sorted({1, max_batch}):
        cache, _ = _decode_cache(cfg, Dense(), T, B, steps, jax.random.key(2))
        time_decode("fullkv", cache, B)
        del cache
        if merged is not None:
            # fresh buffers: the decode step donates its cache, and `merged` serves every batch
            def tile(x, B=B):
                return jnp.copy(jnp.repeat(x, B, axis=1 if x.ndim >= 4 else 0))

            tiled = jax.tree.map(tile, merged)
            time_decode(f"semanticache({args.budget})", tiled, B)
            del tiled
        cache, _ = _decode_cache(cfg, snap, T, B, steps, jax.random.key(3))
        time_decode(f"snapkv({args.budget}) same capacity", cache, B)
        del cache

    _write(out_dir, rows, prefill_s)
    return 0


def _write(out_dir: str, rows: list[dict], prefill_s: float) -> None:
    with open(os.path.join(out_dir, "semanticache_gpu.json"), "w") as f:
        json.dump(rows, f, indent=2)
    print_table(rows, prefill_s)


def print_table(rows: list[dict], prefill_s: float) -> None:
    print(f"\nSemantiCache speed ({rows[0]['device']}, jax {rows[0]['jax']}, context {rows[0]['context']})")
    print(f"{'what':<74}{'ms':>10}{'share / speedup':>17}{'cache GiB':>11}")
    print(f"{'prefill (full attention, batch 1)':<74}{prefill_s * 1e3:>10.1f}")
    for r in rows:
        if r["kind"] == "compress":
            if "error" in r:
                print(f"{'compress ' + r['variant']:<74}  {r['error']}")
                continue
            diff = r.get("positions_differing_from_first_gsc")
            print(f"{'compress ' + r['variant']:<74}{r['ms']:>10.1f}{100 * r['share_of_prefill']:>16.1f}%"
                  f"{r['cache_bytes'] / GIB:>11.2f}   kept {r['kept_fraction']:.3f}"
                  + ("" if diff is None else f"   entries at other positions than the first gsc's: {diff:.2e}"))
    full = {r["batch"]: r for r in rows if r["kind"] == "decode" and r["policy"] == "fullkv" and "error" not in r}
    for r in rows:
        if r["kind"] != "decode":
            continue
        label = f"decode {r['policy']}, batch {r['batch']} (ms/token)"
        if "error" in r:
            print(f"{label:<74}  {r['error']}")
            continue
        ref = full.get(r["batch"])
        speed = f"{ref['ms_per_token'] / r['ms_per_token']:.2f}x" if ref else ""
        print(f"{label:<74}{r['ms_per_token']:>10.2f}{speed:>17}{r['cache_bytes'] / GIB:>11.2f}   length {r['length']}")


if __name__ == "__main__":
    sys.exit(main())
