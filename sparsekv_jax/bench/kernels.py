"""Kernel benchmarks and GPU correctness checks for `sparsekv_jax.pallas`.

``python -m sparsekv_jax.bench.kernels --help``

* decode: context L x batch B x {dense, page-sparse rho}: time, K/V bytes read, TB/s,
  speedup over our dense kernel, and the target ``t_sparse <= (rho + 0.05) t_dense``.
* prefill: T x {our dense, cuDNN ``jax.nn.dot_product_attention``, JAX's stock Pallas
  ``mha``, our block-sparse at given densities}: time, TFLOP/s, speedup over cuDNN.
* ``--check``: compiled kernels against the jnp references on the GPU (fresh random
  inputs, unused cache slots poisoned with NaN); nonzero exit status on any failure.
* ``--tune``: small grid over tiles / warps / stages / splits at the target points.

Timing: random data (never zeros); one jitted program runs ``N`` independent calls
back-to-back (distinct queries/selections, K/V rotated over enough copies to exceed L2),
and the per-call time is ``(median t(2N) - median t(N)) / N``, which cancels the fixed
dispatch and synchronisation overhead that would swamp microsecond-scale sparse steps.
Results print as a table and go to ``--out`` as JSON (written after every point, so a
run cut short keeps what it measured).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.backend import resolved
from sparsekv_jax.bench.timing import median_time
from sparsekv_jax.pallas.decode import decode_attention, decode_attention_reference, selected_slot_mask
from sparsekv_jax.pallas.prefill import prefill_attention, prefill_attention_reference
from sparsekv_jax.pallas.testing import random_block_lists, random_page_lists, rel_err

HEADS = {"llama": (32, 8, 128), "smollm": (9, 3, 64)}  # (Hq, Hkv, D): Llama-3.1-8B, SmolLM2-135M
L2_BYTES = 64 << 20


# --------------------------------------------------------------------------------- timing

def _timed(fn: Callable[[], Any], trials: int) -> float:
    """Median wall time of ``fn()`` over ``trials`` runs, after warm-up (`bench.timing.median_time`)."""
    return median_time(fn, iters=trials)


def per_call_time(call: Callable[..., Any], per_call_args: Sequence[tuple], shared: Sequence[tuple],
                  *, n: int, trials: int) -> float:
    """Seconds per ``call(*per_call_args[i], *shared[i % len(shared)])``, overhead cancelled.

    Runs one jitted program of ``n`` and one of ``2n`` back-to-back calls and returns the
    difference of their median times over ``n``.
    """
    def program(m: int) -> Callable[[], Any]:
        fn = jax.jit(lambda pc, sh: [call(*pc[i], *sh[i % len(sh)]) for i in range(m)])
        pc, sh = list(per_call_args[:m]), list(shared)
        return lambda: fn(pc, sh)

    t1 = _timed(program(n), trials)
    t2 = _timed(program(2 * n), trials)
    return max(t2 - t1, 1e-9) / n


def single_call_time(fn: Callable[[], Any], trials: int) -> float:
    """For calls long enough (>~2 ms) that dispatch overhead is noise."""
    return _timed(fn, trials)


def _mem_limit() -> int:
    try:
        return int(jax.devices()[0].memory_stats()["bytes_limit"])
    except Exception:  # CPU or no stats: assume plenty, the sweep is meant for GPUs
        return 1 << 40


def _free() -> None:
    gc.collect()


# --------------------------------------------------------------------------------- decode

def decode_point(L: int, B: int, heads: str, rhos: Sequence[float], *, page_size: int, trials: int,
                 tune: dict[str, Any], dtype: Any = jnp.bfloat16, seed: int = 0) -> list[dict[str, Any]]:
    """Dense + page-sparse decode at one (L, B, head layout)."""
    Hq, Hkv, D = HEADS[heads]
    S = L
    P = S // page_size
    kv_bytes = 2 * B * Hkv * S * D * jnp.dtype(dtype).itemsize
    if 1.3 * kv_bytes > _mem_limit():
        return [dict(kind="decode", heads=heads, L=L, B=B, mode="dense", skipped="does not fit memory")]
    n_copies = max(1, min(8, math.ceil(4 * L2_BYTES / kv_bytes)))
    if n_copies * kv_bytes * 1.3 > _mem_limit():
        n_copies = 1
    key = jax.random.key(seed)
    kvs = []
    for c in range(n_copies):
        kk, kv_ = jax.random.split(jax.random.fold_in(key, c))
        kvs.append((jax.random.normal(kk, (B, Hkv, S, D), dtype), jax.random.normal(kv_, (B, Hkv, S, D), dtype)))
    lengths = jnp.full((B,), L, jnp.int32)
    est_dense = kv_bytes / 3e12
    rows: list[dict[str, Any]] = []
    dense_t = None
    for rho in [None, *rhos]:
        est = est_dense * (1.0 if rho is None else rho) + 1e-5
        n = int(min(32, max(4, math.ceil(4e-3 / est))))  # more unrolled calls: slow XLA compiles
        qs = [jax.random.normal(jax.random.fold_in(key, 1000 + i), (B, Hq, D), dtype) for i in range(2 * n)]
        if rho is None:
            def call(q, k, v):
                return decode_attention(q, k, v, lengths, page_size=page_size, **tune)
            per_call = [(q,) for q in qs]
            read = kv_bytes
        else:
            count = max(1, round(rho * P))
            def call(q, ids, k, v):
                return decode_attention(q, k, v, lengths, page_size=page_size, page_ids=ids, **tune)
            per_call = []
            for i in range(2 * n):
                r = jax.random.uniform(jax.random.fold_in(key, 5000 + i), (B, Hkv, P))
                per_call.append((qs[i], jnp.argsort(r, axis=-1)[..., :count].astype(jnp.int32)))
            read = 2 * B * Hkv * count * page_size * D * jnp.dtype(dtype).itemsize
        t = per_call_time(call, per_call, kvs, n=n, trials=trials)
        row = dict(kind="decode", heads=heads, L=L, B=B, mode="dense" if rho is None else f"rho={rho:g}",
                   rho=rho, page_size=page_size, time_us=t * 1e6, bytes_read=read, tb_s=read / t / 1e12)
        if rho is None:
            dense_t = t
        else:
            row["speedup_vs_dense"] = dense_t / t
            row["target_time_us"] = (rho + 0.05) * dense_t * 1e6
            row["meets_target"] = t <= (rho + 0.05) * dense_t
        rows.append(row)
        del per_call, qs
    del kvs
    _free()
    return rows


def decode_baselines(L: int, B: int, heads: str, *, trials: int, dtype: Any = jnp.bfloat16) -> list[dict]:
    """cuDNN ``dot_product_attention`` used for decode (BTNH layout), for context."""
    Hq, Hkv, D = HEADS[heads]
    kv_bytes = 2 * B * Hkv * L * D * jnp.dtype(dtype).itemsize
    if 2.5 * kv_bytes > _mem_limit():
        return []
    key = jax.random.key(7)
    k = jax.random.normal(key, (B, L, Hkv, D), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 1), (B, L, Hkv, D), dtype)
    n = 16
    qs = [(jax.random.normal(jax.random.fold_in(key, 10 + i), (B, 1, Hq, D), dtype),) for i in range(2 * n)]
    out = []
    try:
        def call(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, implementation="cudnn")
        t = per_call_time(call, qs, [(k, v)], n=n, trials=trials)
        out.append(dict(kind="decode", heads=heads, L=L, B=B, mode="cudnn-dpa", time_us=t * 1e6,
                        bytes_read=kv_bytes, tb_s=kv_bytes / t / 1e12))
    except Exception as e:  # cuDNN may reject a shape; report and go on
        out.append(dict(kind="decode", heads=heads, L=L, B=B, mode="cudnn-dpa", skipped=repr(e)[:200]))
    del k, v, qs
    _free()
    return out


# -------------------------------------------------------------------------------- prefill

def causal_flops(B: int, Hq: int, T: int, D: int) -> float:
    """QK^T and PV over the causal half: 4 * B * Hq * D * T(T+1)/2."""
    return 4.0 * B * Hq * D * T * (T + 1) / 2


def _device_block_lists(key: jax.Array, B: int, Hkv: int, T: int, bs: int, density: float):
    """Random causal lists: diagonal always, plus random past blocks, ``density`` of causal."""
    nQ = T // bs
    i = jnp.arange(nQ)[:, None]
    j = jnp.arange(nQ)[None, :]
    r = jax.random.uniform(key, (B, Hkv, nQ, nQ))
    r = jnp.where(j > i, 2.0, jnp.where(j == i, -1.0, r))
    counts = np.clip(np.round(density * (np.arange(nQ) + 1)), 1, np.arange(nQ) + 1).astype(np.int32)
    K = int(counts.max())
    ids = jnp.argsort(r, axis=-1)[..., :K].astype(jnp.int32)
    counts_b = jnp.broadcast_to(jnp.asarray(counts), (B, Hkv, nQ))
    blocks = float(counts.sum())  # listed blocks per (b, kv head), diagonal included
    return ids, counts_b, blocks


def prefill_point(T: int, heads: str, densities: Sequence[float], *, block_size: int, trials: int,
                  tune: dict[str, Any], baselines: bool, dtype: Any = jnp.bfloat16,
                  B: int = 1) -> list[dict[str, Any]]:
    Hq, Hkv, D = HEADS[heads]
    G = Hq // Hkv
    item = jnp.dtype(dtype).itemsize
    need = (2 * B * Hq * T * D + 2 * B * Hkv * T * D) * item * (3 if baselines else 1.2)
    if need > _mem_limit():
        return [dict(kind="prefill", heads=heads, T=T, mode="dense", skipped="does not fit memory")]
    key = jax.random.key(3)
    q = jax.random.normal(key, (B, Hq, T, D), dtype)
    k = jax.random.normal(jax.random.fold_in(key, 1), (B, Hkv, T, D), dtype)
    v = jax.random.normal(jax.random.fold_in(key, 2), (B, Hkv, T, D), dtype)
    flops = causal_flops(B, Hq, T, D)
    rows: list[dict[str, Any]] = []

    def add(mode: str, t: float, fl: float, **extra: Any) -> None:
        rows.append(dict(kind="prefill", heads=heads, T=T, B=B, mode=mode, time_ms=t * 1e3,
                         tflop_s=fl / t / 1e12, **extra))

    ours = jax.jit(lambda q, k, v: prefill_attention(q, k, v, block_size=block_size, **tune))
    qkv = (q, k, v)
    del q, k, v  # only through qkv from here on (closures below)
    t_ours = single_call_time(lambda: ours(*qkv), trials)
    add("ours-dense", t_ours, flops)
    t_cudnn = None
    if baselines:
        qt, kt, vt = (jnp.swapaxes(x, 1, 2) for x in qkv)  # BTNH, untimed
        try:
            cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                                       implementation="cudnn"))
            t_cudnn = single_call_time(lambda: cud(qt, kt, vt), trials)
            add("cudnn", t_cudnn, flops)
        except Exception as e:
            rows.append(dict(kind="prefill", heads=heads, T=T, mode="cudnn", skipped=repr(e)[:200]))
        try:
            from jax.experimental.pallas.ops.gpu import attention as stock

            kr, vr = jnp.repeat(kt, G, axis=2), jnp.repeat(vt, G, axis=2)  # stock mha has no GQA
            mha = jax.jit(lambda q, k, v: stock.mha(q, k, v, None, sm_scale=1 / math.sqrt(D), causal=True))
            t_mha = single_call_time(lambda: mha(qt, kr, vr), trials)
            add("stock-pallas-mha", t_mha, flops)
            del kr, vr
        except Exception as e:
            rows.append(dict(kind="prefill", heads=heads, T=T, mode="stock-pallas-mha", skipped=repr(e)[:200]))
        del qt, kt, vt
        _free()
    for d in densities:
        ids, counts, blocks = _device_block_lists(jax.random.fold_in(key, 99), B, Hkv, T, block_size, d)
        sp = jax.jit(lambda q, k, v, i, c: prefill_attention(q, k, v, block_size=block_size, block_ids=i,
                                                             block_counts=c, **tune))
        t = single_call_time(lambda sp=sp, ids=ids, counts=counts: sp(*qkv, ids, counts), trials)
        nQ = T // block_size
        # executed work: off-diagonal blocks full, diagonal blocks half
        fl = 4.0 * B * Hq * D * block_size * block_size * (blocks - nQ / 2)
        dens = blocks / (nQ * (nQ + 1) / 2)
        extra: dict[str, Any] = dict(density=round(dens, 4), speedup_vs_ours_dense=t_ours / t)
        if t_cudnn is not None:
            extra["speedup_vs_cudnn"] = t_cudnn / t
        add(f"ours-sparse-{d:g}", t, fl, **extra)
        del ids, counts
    for r in rows:
        if t_cudnn is not None and "time_ms" in r and r["mode"] in ("ours-dense", "stock-pallas-mha"):
            r["vs_cudnn_tflops"] = r["tflop_s"] / (flops / t_cudnn / 1e12)
    return rows  # the arrays die with this frame; the caller's next point starts clean


# ---------------------------------------------------------------------------------- check

def run_checks(seed: int | None = None, interpret: bool = False) -> list[dict[str, Any]]:
    """Compiled kernels vs references on this device; returns one row per case.

    ``interpret`` runs the kernels in Pallas interpret mode at smaller sizes (a CPU smoke
    test of this code path; the real check is the compiled run on a GPU).
    """
    seed = int(np.random.SeedSequence().entropy % 2**32) if seed is None else seed
    rng = np.random.default_rng(seed)
    rows = []

    def record(name: str, out: Any, ref: Any, tol: float) -> None:
        err = rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32))
        rows.append(dict(kind="check", case=name, rel_err=err, tol=tol, ok=bool(err <= tol), seed=seed))
        print(f"  check {name:58s} rel_err={err:.2e} tol={tol:.0e} {'OK' if err <= tol else 'FAIL'}",
              flush=True)

    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    for (Hq, Hkv, D), ps, dtype in [((32, 8, 128), 16, jnp.bfloat16), ((9, 3, 64), 64, jnp.bfloat16),
                                    ((8, 8, 128), 128, jnp.float32), ((24, 8, 64), 32, jnp.float32)]:
        B, P = (2, 8) if interpret else (4, 64)
        S = P * ps
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        lengths = rng.integers(1, S + 1, B).astype(np.int32)
        lengths[0] = S - 3
        q = jnp.asarray(rng.standard_normal((B, Hq, D)), dtype)
        k = rng.standard_normal((B, Hkv, S, D))
        v = rng.standard_normal((B, Hkv, S, D))
        for sparse in (False, True):
            kw: dict[str, Any] = dict(page_size=ps)
            if sparse:
                ids, counts = random_page_lists(rng, lengths, Hkv, P, ps, list_len=P // 2)
                counts[1, 0] = 0
                kw.update(page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts),
                          bias=jnp.asarray(rng.standard_normal((B, Hkv, S)), jnp.float32))
            mask = np.asarray(selected_slot_mask(jnp.asarray(lengths), S, Hkv, **{
                a: kw[a] for a in ("page_size", "page_ids", "page_counts") if a in kw}))
            kp = jnp.asarray(np.where(mask[..., None], k, np.nan), dtype)  # poison unread slots
            vp = jnp.asarray(np.where(mask[..., None], v, np.nan), dtype)
            out = decode_attention(q, kp, vp, jnp.asarray(lengths), interpret=interpret, **kw)
            ref = decode_attention_reference(f32(q), f32(kp), f32(vp), jnp.asarray(lengths), **kw)
            record(f"decode {'sparse' if sparse else 'dense '} H{Hq}/{Hkv} D{D} ps{ps} {jnp.dtype(dtype).name}",
                   out, ref, tol)
    for (Hq, Hkv, D), dtype, bs in [((32, 8, 128), jnp.bfloat16, 128), ((9, 3, 64), jnp.bfloat16, 64),
                                    ((8, 2, 128), jnp.float32, 64)]:
        B, T, off = (1, 100, 64) if interpret else (2, 1000, 512)
        bs = min(bs, 64) if interpret else bs
        S = off + -(-T // bs) * bs + bs
        tol = 1e-5 if dtype == jnp.float32 else 1e-2
        q = jnp.asarray(rng.standard_normal((B, Hq, T, D)), dtype)
        k = rng.standard_normal((B, Hkv, S, D))
        v = rng.standard_normal((B, Hkv, S, D))
        k[:, :, off + T:] = np.nan
        v[:, :, off + T:] = np.nan
        k, v = jnp.asarray(k, dtype), jnp.asarray(v, dtype)
        for variant in ("dense", "sparse", "kv_lengths"):
            kw = dict(q_offset=off, block_size=bs, return_lse=True)
            if variant == "sparse":
                ids, counts = random_block_lists(rng, B, Hkv, T, bs, off, 6)
                kw.update(block_ids=jnp.asarray(ids), block_counts=jnp.asarray(counts))
            if variant == "kv_lengths":
                kw.update(kv_lengths=jnp.asarray([off + T, off + T // 3][:B], jnp.int32))
            out, lse = prefill_attention(q, k, v, interpret=interpret, **kw)
            ref, ref_lse = prefill_attention_reference(f32(q), f32(k), f32(v), **kw)
            name = f"prefill {variant:10s} H{Hq}/{Hkv} D{D} bs{bs} {jnp.dtype(dtype).name}"
            record(name, out, ref, tol)
            fin = np.isfinite(np.asarray(ref_lse))
            lse_np = np.asarray(lse)
            same_inf = np.array_equal(np.isneginf(lse_np), np.isneginf(np.asarray(ref_lse)))
            record(name + " lse", np.where(fin, lse_np, 0) if same_inf else np.full_like(lse_np, np.nan),
                   np.where(fin, np.asarray(ref_lse), 0), tol)
    return rows


# ----------------------------------------------------------------------------------- tune

def run_tune(trials: int, what: Sequence[str]) -> list[dict[str, Any]]:
    rows = []
    if "decode" in what:
        for L, B in [(32768, 8), (131072, 1)]:
            for bk in (64, 128, 256):
                for nw in (4, 8):
                    for st in (2, 3):
                        tune = dict(block_k=bk, num_warps=nw, num_stages=st)
                        try:
                            r = decode_point(L, B, "llama", [], page_size=16, trials=trials, tune=tune)[0]
                        except Exception as e:
                            r = dict(kind="decode", L=L, B=B, skipped=repr(e)[:200])
                        r["tune"] = tune
                        rows.append(r)
                        print(f"  tune decode L={L} B={B} {tune}: {r.get('tb_s', float('nan')):.2f} TB/s "
                              f"{r.get('time_us', float('nan')):.1f} us {r.get('skipped', '')}", flush=True)
    if "prefill" in what:
        for bq, bk, nw, st in [(128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 8, 2), (128, 128, 8, 3),
                               (128, 64, 8, 4), (64, 64, 4, 3), (128, 32, 4, 4), (128, 128, 4, 2)]:
            tune = dict(block_q=bq, block_k=bk, num_warps=nw, num_stages=st)
            try:
                r = prefill_point(32768, "llama", [], block_size=128, trials=trials, tune=tune,
                                  baselines=False)[0]
            except Exception as e:
                r = dict(kind="prefill", T=32768, skipped=repr(e)[:200])
            r["tune"] = tune
            rows.append(r)
            print(f"  tune prefill T=32k {tune}: {r.get('tflop_s', float('nan')):.0f} TFLOP/s "
                  f"{r.get('time_ms', float('nan')):.2f} ms {r.get('skipped', '')}", flush=True)
    return rows


# ------------------------------------------------------------------------------------ CLI

def _fmt_table(rows: list[dict[str, Any]]) -> str:
    lines = []
    dec = [r for r in rows if r.get("kind") == "decode" and "tune" not in r]
    if dec:
        lines.append("| heads | L | B | mode | time (us) | K/V read (MB) | TB/s | speedup vs dense | target (us) |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for r in dec:
            if "skipped" in r:
                lines.append(f"| {r['heads']} | {r['L']} | {r['B']} | {r['mode']} | skipped: {r['skipped']} |||||")
                continue
            sp = f"{r['speedup_vs_dense']:.1f}x" if "speedup_vs_dense" in r else ""
            tg = (f"{r['target_time_us']:.1f} {'met' if r['meets_target'] else 'MISSED'}"
                  if "target_time_us" in r else "")
            lines.append(f"| {r['heads']} | {r['L']} | {r['B']} | {r['mode']} | {r['time_us']:.1f} | "
                         f"{r['bytes_read'] / 1e6:.1f} | {r['tb_s']:.2f} | {sp} | {tg} |")
    pre = [r for r in rows if r.get("kind") == "prefill" and "tune" not in r]
    if pre:
        lines.append("")
        lines.append("| heads | T | mode | time (ms) | TFLOP/s | vs cuDNN TFLOP/s | speedup vs cuDNN | density |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for r in pre:
            if "skipped" in r:
                lines.append(f"| {r['heads']} | {r['T']} | {r['mode']} | skipped: {r['skipped']} |||||")
                continue
            vs = f"{r['vs_cudnn_tflops']:.2f}" if "vs_cudnn_tflops" in r else ""
            sp = f"{r['speedup_vs_cudnn']:.2f}x" if "speedup_vs_cudnn" in r else ""
            lines.append(f"| {r['heads']} | {r['T']} | {r['mode']} | {r['time_ms']:.2f} | {r['tflop_s']:.0f} | "
                         f"{vs} | {sp} | {r.get('density', '')} |")
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    out = []
    for x in s.split(","):
        x = x.strip().lower()
        out.append(int(x[:-1]) * 1024 if x.endswith("k") else int(x))
    return out


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsekv_jax.bench.kernels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=["decode", "prefill", "all", "none"], default="all",
                   help="which sweep to run (none: only --check/--tune)")
    p.add_argument("--quick", action="store_true", help="small sweep: L=32k,128k B=1,8; T=32k; llama heads")
    p.add_argument("--heads", default="llama,smollm", help="head layouts: llama (32/8, D128), smollm (9/3, D64)")
    p.add_argument("--lengths", default="8k,32k,128k", help="decode context lengths")
    p.add_argument("--batches", default="1,8,32", help="decode batch sizes")
    p.add_argument("--rhos", default="0.01,0.1,0.25", help="decode page-sparse fractions")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--prefill-lengths", default="8k,32k,128k")
    p.add_argument("--densities", default="0.25,0.1", help="prefill block-sparse densities")
    p.add_argument("--block-size", type=int, default=128, help="prefill list granularity")
    p.add_argument("--no-baselines", action="store_true", help="skip cuDNN / stock Pallas baselines")
    p.add_argument("--decode-baselines", action="store_true", help="also time cuDNN dpa as decode")
    p.add_argument("--trials", type=int, default=9, help="timed runs per measurement (median)")
    p.add_argument("--check", action="store_true", help="compare compiled kernels with the references")
    p.add_argument("--tune", default="", help="comma list of decode,prefill: grid-search tiles")
    p.add_argument("--decode-tune", default="", help="decode kwargs, e.g. block_k=128,num_warps=4")
    p.add_argument("--prefill-tune", default="", help="prefill kwargs, e.g. block_q=128,block_k=64")
    p.add_argument("--out", default="", help="write JSON results here")
    p.add_argument("--interpret", action="store_true",
                   help="Pallas interpret mode (CPU smoke test; use tiny --lengths)")
    a = p.parse_args(argv)

    def kw(s: str) -> dict[str, Any]:
        d: dict[str, Any] = {k: int(v) for k, v in (x.split("=") for x in s.split(",") if x)}
        if a.interpret:
            d["interpret"] = True
        return d

    meta = dict(date=datetime.date.today().isoformat(), jax=jax.__version__,
                device=str(jax.devices()[0].device_kind), backend=resolved().platform,
                argv=list(argv or sys.argv[1:]))
    print(f"# {meta}", flush=True)
    rows: list[dict[str, Any]] = []

    def dump() -> None:
        if a.out:
            with open(a.out, "w") as f:
                json.dump(dict(meta=meta, rows=rows), f, indent=1, default=str)

    failed = False
    if a.check:
        print("## check", flush=True)
        crow = run_checks(interpret=a.interpret)
        rows += crow
        failed = not all(r["ok"] for r in crow)
        print(f"## check: {sum(r['ok'] for r in crow)}/{len(crow)} passed", flush=True)
        dump()
    if a.tune:
        print("## tune", flush=True)
        rows += run_tune(max(3, a.trials // 2), a.tune.split(","))
        dump()
    heads = a.heads.split(",")
    lengths, batches = _ints(a.lengths), _ints(a.batches)
    plens = _ints(a.prefill_lengths)
    if a.quick:
        heads, lengths, batches, plens = ["llama"], [32768, 131072], [1, 8], [32768]
    if a.mode in ("decode", "all"):
        print("## decode", flush=True)
        for h in heads:
            for L in lengths:
                for B in batches:
                    try:
                        r = decode_point(L, B, h, _floats(a.rhos), page_size=a.page_size, trials=a.trials,
                                         tune=kw(a.decode_tune))
                        if a.decode_baselines:
                            r += decode_baselines(L, B, h, trials=a.trials)
                    except Exception as e:  # e.g. out of memory: record and go on
                        r = [dict(kind="decode", heads=h, L=L, B=B, mode="dense", skipped=repr(e)[:200])]
                    rows += r
                    for x in r:
                        print("  ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in x.items()},
                              flush=True)
                    dump()
    if a.mode in ("prefill", "all"):
        print("## prefill", flush=True)
        for h in heads:
            for T in plens:
                try:
                    r = prefill_point(T, h, _floats(a.densities), block_size=a.block_size, trials=max(3, a.trials // 2),
                                      tune=kw(a.prefill_tune), baselines=not a.no_baselines)
                except Exception as e:
                    r = [dict(kind="prefill", heads=h, T=T, mode="ours-dense", skipped=repr(e)[:200])]
                rows += r
                for x in r:
                    print("  ", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in x.items()}, flush=True)
                dump()
    print(_fmt_table(rows))
    dump()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
