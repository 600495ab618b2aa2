"""Issue #39's "Show": quantised KV caches (int8, float8_e4m3fn) on a GPU.

    python scripts/kv_quant_show.py check                      # compiled kernel vs reference (exit 1 on a miss)
    python scripts/kv_quant_show.py kernel --out kvq_kernel.json
    python scripts/kv_quant_show.py e2e --out kvq_e2e.json
    python scripts/kv_quant_show.py fidelity --model qwen2.5-coder-1.5b --lengths 8k,32k --out kvq_fid.jsonl

* ``check``: the Pallas decode kernel compiled for the GPU (Triton; the CPU tests run it interpreted)
  on int8 and fp8 caches -- dense, page-sparse, stacked layers, bf16 and fp32 queries -- against
  its jnp reference on the same codes; junk codes and NaN scales wherever nothing may be read.
* ``kernel``: Llama-3.1-8B heads (Hq 32, Hkv 8, D 128), batch 8, contexts 32k and 128k, one run:
  dense decode with a bf16 / int8 / fp8 cache and cuDNN's bf16 decode (`jax.nn.dot_product_attention`),
  and page-sparse decode at rho = 0.1 with bf16 / int8. Times per call with the dispatch overhead
  cancelled (`sparsekv_jax.bench.kernels.per_call_time`); bytes read count codes and scales.
  Targets: int8 and fp8 dense >= 1.8x faster than the bf16 kernel and than cuDNN; int8 rho=0.1 >=
  1.6x faster than bf16 rho=0.1.
* ``e2e``: Llama-3.1-8B shapes (random bf16 weights), for each cache dtype and policy the largest batch
  (of ``--batches``) whose decode program fits the device (XLA's memory analysis, then a timed run)
  at each context, and its decode throughput (tokens/s over ``--decode-steps`` steps). The cache is
  built holding the context as the policy leaves it (SnapKV(0.25): a quarter), as
  `sparsekv_jax.bench.e2e` does for bf16. ``--layouts uniform,pool`` searches the page pool too
  (``Options(pool=True)``, bf16: `bench.e2e.pool_decode_cache`, the engine's decode pool and pooled decode
  step; issue 38's batching row, docs/PAGE_POOL.md step 4), e.g. on one H200 (~4 min, estimated)::

      XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 python scripts/kv_quant_show.py e2e --contexts 32k \
          --kv-dtypes bfloat16 --layouts uniform,pool --policies "fullkv, snapkv(0.25), adakv(snapkv(0.25))" \
          --batches 24,64,96,128 --out $OUT/pool_batch.json
* ``fidelity``: RULER prompts on a real model, teacher-forced along full attention's greedy answer on
  the bf16 cache: KL and top-1 agreement of each (policy, cache dtype) against full attention on
  the bf16 cache (`sparsekv_jax.eval.fidelity`). The scores come from ``sparsekv eval --kv-dtype``
  (commands in the lead's report; one ``--out`` per cache dtype).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import gc
import json
import math
import os
import subprocess
import sys
import tempfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.cache import SCALE_DTYPE, init_cache, summarize_pages
from sparsekv_jax.pallas.decode import decode_attention, decode_attention_reference
from sparsekv_jax.pallas.testing import random_page_lists, rel_err

KV = ("bfloat16", "int8", "float8_e4m3fn")
QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}


def _emit(rows: list[dict[str, Any]], row: dict[str, Any], out: str | None) -> None:
    rows.append(row)
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "w") as f:
            json.dump(rows, f, indent=1)


def _random_cache(key: jax.Array, shape: tuple[int, ...], kv_dtype: str, page_size: int):
    """``(k, v, k_scale, k_zero, v_scale)``: random codes of ``shape`` ``[..., S, D]``, power-of-two scales
    and key zero points per page and channel (offsets up to a few dozen steps, as Qwen2's key biases give;
    None for bf16, whose values are plain normals)."""
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    if kv_dtype == "bfloat16":
        return (jax.random.normal(k1, shape, jnp.bfloat16), jax.random.normal(k2, shape, jnp.bfloat16), None, None,
                None)
    dt = jnp.dtype(kv_dtype)
    codes = [jnp.clip(jax.random.normal(k, shape, jnp.float32) * QMAX[kv_dtype] / 4, -QMAX[kv_dtype],
                      QMAX[kv_dtype]) for k in (k1, k2)]
    codes = [jnp.round(c).astype(dt) if kv_dtype == "int8" else c.astype(dt) for c in codes]
    *lead, S, D = shape
    P = S // page_size
    ks = jnp.exp2(jax.random.randint(k3, (*lead, P, D), -9, -4).astype(jnp.float32)).astype(SCALE_DTYPE)
    vs = jnp.exp2(jax.random.randint(k4, (*lead, P), -9, -4).astype(jnp.float32)).astype(SCALE_DTYPE)
    kz = (jax.random.normal(k5, (*lead, P, D), jnp.float32) * 32 * ks.astype(jnp.float32)).astype(SCALE_DTYPE)
    return codes[0], codes[1], ks, kz, vs


# -------------------------------------------------------------------------------------------- check

def run_check(seed: int, interpret: bool = False) -> list[dict[str, Any]]:
    rng = np.random.default_rng(seed)
    rows = []
    for kv_dtype in ("int8", "float8_e4m3fn"):
        for q_dtype in (jnp.bfloat16, jnp.float32):
            for sparse in (False, True):
                for stacked in (False, True):
                    B, Hq, Hkv, D, ps, P = 3, 32, 8, 128, 16, 24
                    S = P * ps
                    k, v, ks, kz, vs = _random_cache(jax.random.key(int(rng.integers(1 << 30))), (B, Hkv, S, D),
                                                 kv_dtype, ps)
                    lengths = np.asarray([S - 5, int(rng.integers(1, S)), S], np.int32)
                    valid = jnp.asarray(np.arange(S)[None, None, :, None] < lengths[:, None, None, None])
                    junk = jnp.asarray(127 if kv_dtype == "int8" else jnp.nan).astype(k.dtype)
                    k, v = jnp.where(valid, k, junk), jnp.where(valid, v, junk)
                    used = jnp.asarray(np.arange(P)[None, None] < -(-lengths[:, None, None] // ps))
                    ks = jnp.where(used[..., None], ks, jnp.nan).astype(SCALE_DTYPE)
                    kz = jnp.where(used[..., None], kz, jnp.nan).astype(SCALE_DTYPE)
                    vs = jnp.where(used, vs, jnp.nan).astype(SCALE_DTYPE)
                    kw: dict[str, Any] = {}
                    if sparse:
                        ids, counts = random_page_lists(rng, lengths, Hkv, P, ps, list_len=P // 3)
                        kw = {"page_ids": jnp.asarray(ids), "page_counts": jnp.asarray(counts)}
                    q = jnp.asarray(rng.standard_normal((B, Hq, D)), q_dtype)
                    lens = jnp.asarray(lengths)
                    args = (k, v, ks, kz, vs)
                    if stacked:
                        args = tuple(jnp.stack([x, x]) for x in args)
                    out = decode_attention(q, args[0], args[1], lens, page_size=ps, k_scale=args[2], k_zero=args[3],
                                           v_scale=args[4], layer=1 if stacked else None, interpret=interpret, **kw)
                    ref = decode_attention_reference(q, k, v, lens, page_size=ps, k_scale=ks, k_zero=kz, v_scale=vs,
                                                     **kw)
                    err = rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32))
                    tol = 1e-5 if q_dtype == jnp.float32 else 2e-2
                    rows.append({"kind": "check", "kv_dtype": kv_dtype, "q_dtype": jnp.dtype(q_dtype).name,
                                 "sparse": sparse, "stacked": stacked, "rel_err": err, "ok": err <= tol})
                    print(json.dumps(rows[-1]), flush=True)
    return rows


# ------------------------------------------------------------------------------------------- kernel

def run_kernel(contexts: list[int], batch: int, rhos: list[float], trials: int, out: str | None,
               tune: dict[str, Any] | None = None) -> list[dict]:
    """The kernel timings; ``tune`` (block_k, num_warps, num_stages) is passed to every quantised call
    (the bf16 kernel keeps its tuned defaults)."""
    from sparsekv_jax.bench.kernels import L2_BYTES, decode_baselines, per_call_time

    Hq, Hkv, D = 32, 8, 128
    ps = 16
    rows: list[dict[str, Any]] = []
    for L in contexts:
        P = L // ps
        base = {"kind": "decode", "heads": "llama", "L": L, "B": batch, "device": jax.devices()[0].device_kind}
        for r in decode_baselines(L, batch, "llama", trials=trials):
            _emit(rows, {**base, **r, "kv_dtype": "bfloat16"}, out)
        times: dict[tuple[str, float | None], float] = {}
        for kv_dtype in KV:
            key = jax.random.key(KV.index(kv_dtype))
            item = 2 if kv_dtype == "bfloat16" else 1
            code_bytes = 2 * batch * Hkv * L * D * item
            scale_bytes = 0 if kv_dtype == "bfloat16" else batch * Hkv * P * (2 * D + 1) * 2  # k scale, k zero, v
            copies = max(1, min(4, math.ceil(4 * L2_BYTES / code_bytes)))
            kvs = [_random_cache(jax.random.fold_in(key, c), (batch, Hkv, L, D), kv_dtype, ps) for c in range(copies)]
            lengths = jnp.full((batch,), L, jnp.int32)
            for rho in [None, *rhos]:
                if rho is not None and kv_dtype == "float8_e4m3fn":
                    continue  # the issue asks page-sparse for bf16 and int8
                n = 8
                qs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (batch, Hq, D), jnp.bfloat16)
                      for i in range(2 * n)]
                kw = {} if kv_dtype == "bfloat16" else dict(tune or {})
                if rho is None:
                    def call(q, k, v, ks, kz, vs, lengths=lengths, kw=kw):
                        return decode_attention(q, k, v, lengths, page_size=ps, k_scale=ks, k_zero=kz, v_scale=vs,
                                                **kw)
                    per_call, frac = [(q,) for q in qs], 1.0
                else:
                    count = max(1, round(rho * P))

                    def call(q, ids, k, v, ks, kz, vs, lengths=lengths, kw=kw):
                        return decode_attention(q, k, v, lengths, page_size=ps, page_ids=ids, k_scale=ks, k_zero=kz,
                                                v_scale=vs, **kw)
                    per_call = [(q, jnp.argsort(jax.random.uniform(jax.random.fold_in(key, 500 + i), (batch, Hkv, P)),
                                                axis=-1)[..., :count].astype(jnp.int32)) for i, q in enumerate(qs)]
                    frac = count / P
                t = per_call_time(call, per_call, kvs, n=n, trials=trials)
                times[(kv_dtype, rho)] = t
                read = (code_bytes + scale_bytes) * frac
                row = {**base, "mode": "dense" if rho is None else f"rho={rho:g}", "kv_dtype": kv_dtype, **kw,
                       "time_us": t * 1e6, "bytes_read": read, "tb_s": read / t / 1e12}
                if kv_dtype != "bfloat16" and ("bfloat16", rho) in times:
                    row["speedup_vs_bf16_kernel"] = times[("bfloat16", rho)] / t
                cudnn = [r for r in rows if r.get("mode") == "cudnn-dpa" and r["L"] == L and "time_us" in r]
                if rho is None and cudnn:
                    row["speedup_vs_cudnn_bf16"] = cudnn[0]["time_us"] / (t * 1e6)
                _emit(rows, row, out)
            del kvs
    return rows


# ---------------------------------------------------------------------------------------------- e2e

def quant_decode_cache(cfg: Any, policy: Any, context: int, batch: int, steps: int, key: jax.Array,
                       kv_dtype: str, page_size: int = 16):
    """`sparsekv_jax.bench.e2e.decode_cache` with a ``kv_dtype`` cache: random codes and scales
    holding ``context`` tokens as ``policy`` leaves them. The cache is allocated once and filled one
    layer at a time in place (each fill donates the stack), so the peak is the cache plus one layer's
    draw -- the largest batch found is the decode program's, not this builder's."""
    cap = policy.compressed_capacity(context, steps)
    kept = context if cap is None else cap - steps
    capacity = context + steps if cap is None else cap
    quantized = kv_dtype != "bfloat16"

    @jax.jit
    def allocate():
        return init_cache(cfg, batch, capacity, page_size=page_size, dtype=jnp.bfloat16,
                          summaries=policy.page_summaries, kv_dtype=kv_dtype if quantized else None)

    @functools.partial(jax.jit, donate_argnums=0)
    def fill(layers, key, layer):
        _, B, H, S, D = layers.k.shape
        k, v, ks, kz, vs = _random_cache(key, (B, H, S, D), kv_dtype, page_size)
        new = {"k": layers.k.at[layer].set(k), "v": layers.v.at[layer].set(v)}
        if quantized:
            new.update(k_scale=layers.k_scale.at[layer].set(ks), k_zero=layers.k_zero.at[layer].set(kz),
                       v_scale=layers.v_scale.at[layer].set(vs))
        return layers.replace(**new)

    @functools.partial(jax.jit, donate_argnums=0)
    def finish(cache):
        layers = cache.layers
        S = layers.k.shape[-2]
        used = jnp.arange(S) < kept
        positions = jnp.where(used, jnp.arange(S) * max(1, context // kept), -1).astype(jnp.int32)
        layers = layers.replace(positions=jnp.broadcast_to(positions, layers.positions.shape))
        length = jnp.full((batch,), kept, jnp.int32)
        keys = None
        if quantized and policy.page_summaries - {"page_max_bias"}:
            # a quantised cache's key summaries are written with the keys: here the random codes' values
            keys = jax.lax.map(lambda a: (a[0].astype(jnp.float32) * jnp.repeat(a[1], page_size, axis=-2)
                                          + jnp.repeat(a[2], page_size, axis=-2)).astype(jnp.bfloat16),
                               (layers.k, layers.k_scale, layers.k_zero))
        layers = summarize_pages(layers, length, page_size, keys=keys)
        return cache.replace(layers=layers, length=length, next_position=jnp.full((batch,), context, jnp.int32))

    cache = allocate()
    layers = cache.layers
    for layer, k in enumerate(jax.random.split(key, layers.k.shape[0])):
        layers = fill(layers, k, layer)
    cache = finish(cache.replace(layers=layers))
    L, B, H = cache.layers.k.shape[:3]
    return cache, jax.random.uniform(key, (L, B, H, context), jnp.float32)


def split_specs(specs: str) -> list[str]:
    """The policy specs of a comma-separated ``specs``, each as written (commas inside calls kept)."""
    text = f"({specs},)"
    return [ast.get_source_segment(text, node) for node in ast.parse(text, mode="eval").body.elts]


def run_e2e_isolated(model: str, contexts: list[int], batches: list[int], specs: str, steps: int, iters: int,
                     out: str | None, kv_dtypes: tuple[str, ...] = KV, layouts: tuple[str, ...] = ("uniform",)) -> list:
    """`run_e2e` with each (context, cache dtype, layout, policy) search in its own process: a search that ends
    in an allocation failure (on a GPU, after near-full allocations) leaves the allocator fragmented, and
    on 2026-11-27 an H200 then refused batch 1 of the next search (docs/results/kvq_e2e_h200_2026-11-27)."""
    rows: list[dict[str, Any]] = []
    for T in contexts:
        for kv_dtype in kv_dtypes:
            for layout in layouts:
                for spec in split_specs(specs):
                    with tempfile.TemporaryDirectory() as tmp:
                        part = os.path.join(tmp, "rows.json")
                        cmd = [sys.executable, os.path.abspath(__file__), "e2e", "--in-process", "--model", model,
                               "--contexts", str(T), "--kv-dtypes", kv_dtype, "--layouts", layout,
                               "--policies", spec, "--batches", ",".join(map(str, batches)),
                               "--decode-steps", str(steps), "--iters", str(iters), "--out", part]
                        subprocess.run(cmd, check=False)
                        if os.path.exists(part):
                            with open(part) as fh:
                                for row in json.load(fh):
                                    _emit(rows, row, out)
                        else:
                            _emit(rows, {"kind": "e2e", "model": model, "policy": spec, "kv_dtype": kv_dtype,
                                         "layout": layout, "context": T, "error": "the search's process failed"}, out)
    return rows


def run_e2e(model: str, contexts: list[int], batches: list[int], specs: str, steps: int, iters: int,
            out: str | None, kv_dtypes: tuple[str, ...] = KV, layouts: tuple[str, ...] = ("uniform",)) -> list:
    """The largest-batch search: for each context, cache dtype, layout (``uniform``: today's cache,
    `quant_decode_cache`; ``pool``: the page pool of ``Options(pool=True)``, `bench.e2e.pool_decode_cache`,
    bf16 only) and policy, the batches in increasing order until the first whose cache, program (XLA's
    memory analysis against the device's limit) or timed run does not fit; one row per search, the largest
    batch that fitted with its decode ms/step and tokens/s (`bench.e2e.decode_fn`: the engine's decode step,
    the pooled one on a pool), cache bytes and program bytes, and the batch that stopped it and why."""
    from sparsekv_jax.backend import Backend
    from sparsekv_jax.bench.e2e import (
        decode_fn,
        median_time_carry,
        memory_bytes,
        pool_decode_cache,
        restart_point,
        why,
    )
    from sparsekv_jax.engine.run import pool_refusal
    from sparsekv_jax.models import config as mc
    from sparsekv_jax.models.params import random_params
    from sparsekv_jax.policies import parse_policies
    from sparsekv_jax.policies.base import Setup

    check_layouts(layouts, kv_dtypes)
    cfg = {"llama3.1-8b": mc.llama31_8b_config, "smollm2": mc.smollm2_135m_config}[model]()
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    try:
        limit = int(jax.devices()[0].memory_stats()["bytes_limit"])
    except Exception:  # noqa: BLE001 - a CPU reports none
        limit = 1 << 62
    rows: list[dict[str, Any]] = []
    for T in contexts:
        for kv_dtype in kv_dtypes:
            backend = Backend(kv_dtype=None if kv_dtype == "bfloat16" else kv_dtype).resolve(params)
            for layout in layouts:
                for policy in parse_policies(specs):
                    pol = policy.bind(Setup(cfg, prompt_len=T, max_new_tokens=steps, backend=backend))
                    refused = pool_refusal(pol) if layout == "pool" else None
                    if refused is not None:
                        _emit(rows, {"kind": "e2e", "model": model, "policy": pol.name, "kv_dtype": kv_dtype,
                                     "layout": layout, "context": T, "error": f"not on a pool: {refused}"}, out)
                        continue
                    best, stopped = None, None
                    for B in sorted(batches):
                        cache = state = obs = fn = compiled = carry = None
                        try:
                            if layout == "pool":
                                cache, obs = pool_decode_cache(cfg, pol, T, B, steps, jax.random.key(2))
                                state = pol.stage("decode").decode_init(cache, None)
                                kv_bytes = cache.pages.k.nbytes + cache.pages.v.nbytes
                            else:
                                cache, obs = quant_decode_cache(cfg, pol, T, B, steps, jax.random.key(2), kv_dtype)
                                state = pol.decode_init(cache, obs)
                                kv_bytes = cache.kv_nbytes()
                            obs = None
                            token = jnp.ones((B,), jnp.int32)
                            fn = decode_fn(params, pol, steps, start=restart_point(cache), backend=backend)
                            compiled = fn.lower(params, cache, state, token).compile()
                            mem = memory_bytes(compiled)
                            if mem is not None and mem > limit:
                                raise MemoryError(f"out of memory: {mem} > {limit}")
                            size = cache.nbytes()
                            sec, carry = median_time_carry(compiled, params, (cache, state, token), iters=iters)
                            best = {"kind": "e2e", "model": model, "policy": pol.name, "spec": repr(policy),
                                    "kv_dtype": kv_dtype, "layout": layout, "context": T, "batch": B,
                                    "ms_per_step": sec * 1e3 / steps, "tokens_per_s": B * steps / sec,
                                    "cache_bytes": size, "kv_bytes": int(kv_bytes), "memory_bytes": mem,
                                    "device": jax.devices()[0].device_kind}
                            print(json.dumps(best), flush=True)
                        except Exception as e:  # noqa: BLE001 - the first batch that does not fit ends the search
                            stopped = {"stopped_at_batch": B, "stopped": why(e) if not isinstance(e, MemoryError)
                                       else str(e)}
                        finally:
                            # the failed point's cache, state, program and the exception's frames (which hold
                            # them) must go before the next search builds its cache, or every later point,
                            # batch 1 included, "does not fit" in what this one left behind
                            del cache, state, obs, fn, compiled, carry
                            gc.collect()
                        if stopped is not None:
                            print(json.dumps({"kv_dtype": kv_dtype, "layout": layout, "policy": pol.name,
                                              "context": T, "batch": B, "stopped": stopped["stopped"]}), flush=True)
                            jax.clear_caches()
                            gc.collect()
                            break
                    if best is not None:
                        _emit(rows, {**best, "largest_batch_tried": max(batches), **(stopped or {})}, out)
                    else:
                        _emit(rows, {"kind": "e2e", "model": model, "policy": pol.name, "kv_dtype": kv_dtype,
                                     "layout": layout, "context": T, "error": "no batch fits",
                                     **(stopped or {})}, out)
    return rows


LAYOUTS = ("uniform", "pool")


def check_layouts(layouts: tuple[str, ...], kv_dtypes: tuple[str, ...]) -> None:
    """``ValueError`` naming a bad layout, or the page pool asked of a quantised cache (the pool's builder
    draws bf16 K/V only)."""
    bad = [x for x in layouts if x not in LAYOUTS]
    if not layouts or bad:
        raise ValueError(f"layouts {','.join(layouts)!r}: {', '.join(map(repr, bad)) or 'none given'}; "
                         f"expected some of {', '.join(LAYOUTS)}")
    if "pool" in layouts and set(kv_dtypes) - {"bfloat16"}:
        raise ValueError(f"the pool layout is searched with a bfloat16 cache only, not {', '.join(kv_dtypes)}: "
                         "pass --kv-dtypes bfloat16")


def e2e_table(rows: list[dict[str, Any]]) -> str:
    """The search's short table: per context, dtype, policy and layout the largest batch, ms/step, tokens/s,
    GiB of the cache and of the decode program, and what stopped the search."""
    gib = 2.0**30
    lines = ["| context | kv dtype | policy | layout | largest batch | ms/step | tokens/s | cache GiB | "
             "program GiB | stopped at |", "|---" * 10 + "|"]
    for r in rows:
        if r.get("kind") != "e2e":
            continue
        head = f"| {r.get('context')} | {r.get('kv_dtype')} | {r.get('policy')} | {r.get('layout', 'uniform')} |"
        stop = f"{r.get('stopped_at_batch', '-')}: {r.get('stopped', '')}" if "stopped_at_batch" in r else "-"
        if "error" in r:
            lines.append(f"{head} error: {r['error']} | | | | | {stop} |")
            continue
        mem = "-" if r.get("memory_bytes") is None else f"{r['memory_bytes'] / gib:.2f}"
        lines.append(f"{head} {r['batch']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['cache_bytes'] / gib:.2f} | {mem} | {stop} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------- fidelity

def run_fidelity(model: str, lengths: list[int], specs: str, n: int, tasks: list[str] | None, batch_size: int,
                 out: str | None) -> list[dict]:
    from sparsekv_jax.backend import Backend
    from sparsekv_jax.eval import fidelity as fid
    from sparsekv_jax.eval.batching import Item, batch_inputs, bucket, encode
    from sparsekv_jax.eval.suites import build_groups
    from sparsekv_jax.models.embedded import load
    from sparsekv_jax.policies import parse_policies

    params, tokenizer = load(model, dtype=jnp.bfloat16)
    limit = params.config.max_position_embeddings
    _, groups = build_groups("ruler", tasks, lengths, n, 0, tokenizer, limit, None, None)
    policies = parse_policies(specs)
    rows: list[dict[str, Any]] = []
    for group in groups:
        items = []
        for s in group.samples:
            ctx, q = encode(tokenizer, s)
            items.append(Item(group=group, sample=s, context_ids=ctx, question_ids=q, max_new_tokens=s.max_new_tokens))
        for i in range(0, len(items), batch_size):
            chunk = items[i:i + batch_size]
            inputs = batch_inputs(chunk, "agnostic", limit, 1024, len(chunk))
            new = bucket(max(it.max_new_tokens for it in chunk))
            ref = fid.reference(params, inputs["tokens"], lengths=inputs["lengths"], suffix=inputs["suffix"],
                                suffix_lengths=inputs["suffix_lengths"], max_new_tokens=new)  # the bf16 cache
            for kv_dtype in KV:  # a policy on the bf16 cache too, so quantisation's own share is visible
                on = dataclasses.replace(ref, inputs={**ref.inputs, "backend": Backend(kv_dtype=kv_dtype)})
                for policy in policies:
                    if kv_dtype == "bfloat16" and policy.name == "Dense":
                        continue  # the reference itself
                    for j, m in enumerate(fid.compare(params, policy, on)):
                        _emit(rows, {"kind": "fidelity", "model": model, "task": group.task, "length": group.length,
                                     "sample": chunk[j].sample.index, "policy": repr(policy), "kv_dtype": kv_dtype,
                                     "reference": "fullkv on the bfloat16 cache", **m}, out)
    return rows


def _tokens(text: str) -> list[int]:
    return [int(float(p[:-1]) * 1024) if p.lower().endswith("k") else int(p) for p in text.split(",") if p.strip()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="what", required=True)
    c = sub.add_parser("check")
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--interpret", action="store_true", help="run the kernel interpreted (a CPU dry run)")
    k = sub.add_parser("kernel")
    k.add_argument("--contexts", default="32k,128k")
    k.add_argument("--batch", type=int, default=8)
    k.add_argument("--rhos", default="0.1")
    k.add_argument("--trials", type=int, default=7)
    k.add_argument("--block-k", type=int, default=None, help="quantised calls: slots per tile (kernel default 128)")
    k.add_argument("--num-warps", type=int, default=None, help="quantised calls: Triton warps (default 8)")
    k.add_argument("--num-stages", type=int, default=None, help="quantised calls: pipeline stages (default 3)")
    k.add_argument("--dequant", default=None, help="quantised calls: decode_attention's dequant= (default tile_f32)")
    e = sub.add_parser("e2e")
    e.add_argument("--model", default="llama3.1-8b", choices=("llama3.1-8b", "smollm2"))
    e.add_argument("--contexts", default="32k,128k")
    e.add_argument("--batches", default="1,2,4,8,12,16,24,32,48,64,96,128")
    e.add_argument("--policies", default="fullkv, snapkv(0.25)")
    e.add_argument("--decode-steps", type=int, default=16)
    e.add_argument("--iters", type=int, default=3)
    e.add_argument("--kv-dtypes", default=",".join(KV), help="cache dtypes to search (comma-separated)")
    e.add_argument("--layouts", default="uniform", help="cache layouts to search (comma-separated): uniform "
                   "(today's [B, Hkv, S, D] per layer), pool (the page pool of Options(pool=True); bfloat16 only)")
    e.add_argument("--in-process", action="store_true",
                   help="every search in this process (default: one process per context, dtype, layout and policy)")
    f = sub.add_parser("fidelity")
    f.add_argument("--model", default="qwen2.5-coder-1.5b")
    f.add_argument("--lengths", default="8k,32k")
    f.add_argument("--policies", default="fullkv, snapkv(0.25), quest(0.25)")
    f.add_argument("--tasks", default=None)
    f.add_argument("--n", type=int, default=10)
    f.add_argument("--batch-size", type=int, default=4)
    for s in (c, k, e, f):
        s.add_argument("--out", default=None, help="JSON (JSON lines for fidelity: one list) to write as it goes")
    a = p.parse_args(argv)
    if a.what == "check":
        rows = run_check(a.seed, a.interpret)
        if a.out:
            with open(a.out, "w") as fh:
                json.dump(rows, fh, indent=1)
        bad = [r for r in rows if not r["ok"]]
        print(f"{len(rows) - len(bad)}/{len(rows)} checks passed", file=sys.stderr)
        return 1 if bad else 0
    if a.what == "kernel":
        tune = {name: getattr(a, name) for name in ("block_k", "num_warps", "num_stages", "dequant")
                if getattr(a, name)}
        run_kernel(_tokens(a.contexts), a.batch, [float(x) for x in a.rhos.split(",") if x], a.trials, a.out, tune)
    elif a.what == "e2e":
        dtypes = tuple(d.strip() for d in a.kv_dtypes.split(",") if d.strip())
        if not dtypes or set(dtypes) - set(KV):
            p.error(f"--kv-dtypes {a.kv_dtypes!r}: expected some of {', '.join(KV)}")
        layouts = tuple(x.strip() for x in a.layouts.split(",") if x.strip())
        try:
            check_layouts(layouts, dtypes)
        except ValueError as err:
            p.error(f"--layouts: {err}")
        run = run_e2e if a.in_process else run_e2e_isolated
        rows = run(a.model, _tokens(a.contexts), [int(x) for x in a.batches.split(",")], a.policies, a.decode_steps,
                   a.iters, a.out, dtypes, layouts)
        if not a.in_process:
            print(e2e_table(rows))
    else:
        run_fidelity(a.model, _tokens(a.lengths), a.policies, a.n,
                     [t.strip() for t in a.tasks.split(",")] if a.tasks else None, a.batch_size, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
