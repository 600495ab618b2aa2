"""Issue 39: the decode kernel's ways of dequantising int8 / fp8 caches (``dequant=``) x tiles, on a GPU.

    python experiments/kvq_kernel_sweep_gpu.py --out $OUT/kvq_sweep.json            # 32k, batch 8 and 1
    python experiments/kvq_kernel_sweep_gpu.py --long --out $OUT/kvq_sweep_128k.json  # + 128k

Llama-3.1-8B heads (Hq 32, Hkv 8, D 128), page_size 16, bf16 queries, random codes with power-of-two key
scales and key zero points per page and channel and a value scale per page (as scripts/kv_quant_show.py
``kernel`` builds them; zero points up to a few dozen code steps).

1. **Screen** (first batch, each context): every ``dequant`` x ``block_k`` x ``num_warps`` x ``num_stages``
   on int8 dense (then fp8 dense on each variant's ``--fp8-top`` best int8 configs; not ``page_magic``, whose
   fp8 program is ``page_lowp``'s). A config that fails to
   compile is printed with why and skipped; one that compiles is checked against
   `decode_attention_reference` on the GPU (max |error| and relative error printed; ``--tol``), and only a
   passing one is timed: one jitted program of ``n`` calls, median over ``--screen-trials``, divided by
   ``n`` (dispatch included: a ranking, not the record).
2. **Confirm** (every batch, each context), A B B A: A = the baselines (our bf16 kernel dense and
   page-sparse ``rho``, cuDNN bf16, `bench.kernels.decode_baselines`), B = each variant's best screened
   config per code dtype (int8 dense, fp8 dense, int8 page-sparse ``rho``), all with
   `bench.kernels.per_call_time` (programs of ``n`` and ``2n`` calls, overhead cancelled). The two passes'
   medians are reported; a persistent compilation cache in a temporary directory makes the second pass
   cheap to compile.

Targets (issue 39): int8 and fp8 dense >= 1.8x faster than the bf16 kernel and than cuDNN; int8 rho=0.1
>= 1.6x faster than bf16 rho=0.1. Prints a table last; ``--out`` gets every row as JSON (rewritten as it
goes). ``--interpret`` runs the kernels interpreted (a CPU dry run: pass tiny ``--contexts`` and a small grid).
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import tempfile
import time
from typing import Any

import jax
import jax.numpy as jnp

from sparsekv_jax.bench.kernels import HEADS, L2_BYTES, decode_baselines, per_call_time
from sparsekv_jax.bench.timing import median_time
from sparsekv_jax.cache import SCALE_DTYPE
from sparsekv_jax.pallas.decode import DEQUANT, decode_attention, decode_attention_reference
from sparsekv_jax.pallas.testing import rel_err

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
PS = 16


def random_cache(key: jax.Array, shape: tuple[int, ...], kv_dtype: str) -> tuple[jax.Array, ...]:
    """``(k, v, k_scale, k_zero, v_scale)`` of ``shape`` ``[B, Hkv, S, D]``; bf16: normals and Nones."""
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    if kv_dtype == "bfloat16":
        return jax.random.normal(k1, shape, jnp.bfloat16), jax.random.normal(k2, shape, jnp.bfloat16), None, None, None
    qmax = QMAX[kv_dtype]
    codes = [jnp.clip(jax.random.normal(k, shape, jnp.float32) * qmax / 4, -qmax, qmax) for k in (k1, k2)]
    codes = [jnp.round(c).astype(jnp.int8) if kv_dtype == "int8" else c.astype(kv_dtype) for c in codes]
    *lead, S, D = shape
    P = S // PS
    ks = jnp.exp2(jax.random.randint(k3, (*lead, P, D), -9, -4).astype(jnp.float32)).astype(SCALE_DTYPE)
    vs = jnp.exp2(jax.random.randint(k4, (*lead, P), -9, -4).astype(jnp.float32)).astype(SCALE_DTYPE)
    kz = (jax.random.normal(k5, (*lead, P, D), jnp.float32) * 32 * ks.astype(jnp.float32)).astype(SCALE_DTYPE)
    return codes[0], codes[1], ks, kz, vs


class Sweep:
    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.rows: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self.device = jax.devices()[0].device_kind

    def emit(self, row: dict[str, Any]) -> dict[str, Any]:
        row = {"device": self.device, **row}
        self.rows.append(row)
        print(json.dumps(row), flush=True)
        if self.a.out:
            with open(self.a.out, "w") as f:
                json.dump(self.rows, f, indent=1)
        return row

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def _tune(cfg: tuple) -> dict[str, Any]:
    dequant, block_k, warps, stages = cfg
    return dict(dequant=dequant, block_k=block_k, num_warps=warps, num_stages=stages)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", default="32768", help="comma-separated context lengths")
    p.add_argument("--long", action="store_true", help="add 131072 to --contexts")
    p.add_argument("--batches", default="8,1", help="the first is screened; all are confirmed")
    p.add_argument("--variants", default=",".join(DEQUANT))
    p.add_argument("--block-ks", default="32,64,128")
    p.add_argument("--warps", default="4,8")
    p.add_argument("--stages", default="2,3")
    p.add_argument("--no-page-q-16", dest="page_q_16", action="store_false",
                   help="do not add block_k 16 (one page per step) for page_q")
    p.add_argument("--fp8-top", type=int, default=2, help="fp8 screens each variant's best int8 configs only")
    p.add_argument("--rho", type=float, default=0.1, help="page-sparse fraction (0: dense only)")
    p.add_argument("--trials", type=int, default=7, help="per_call_time trials (confirm)")
    p.add_argument("--screen-trials", type=int, default=5)
    p.add_argument("--n", type=int, default=8, help="calls per timed program")
    p.add_argument("--tol", type=float, default=4e-2, help="relative error vs the reference to pass the check")
    p.add_argument("--budget-s", type=float, default=110.0,
                   help="a context's int8 screen starts no new config after this many seconds (fp8's short "
                        "screen and the confirm phase still run)")
    p.add_argument("--interpret", action="store_true", help="interpreted kernels: a CPU dry run at tiny shapes")
    p.add_argument("--out", help="write every row here as JSON")
    a = p.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",") if x] + ([131072] if a.long else [])
    batches = [int(x) for x in a.batches.split(",") if x]
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in DEQUANT]
    if bad:
        p.error(f"--variants: {bad} not in {DEQUANT}")
    # largest tiles first (the kernel's default, 128/8/3, leads) and variants innermost: a screen cut short by
    # --budget-s loses whole tile configs, never a whole variant; page_q also tries one page per step (16)
    ints = lambda x: sorted({int(y) for y in x.split(",") if y}, reverse=True)  # noqa: E731
    tiles = list(itertools.product(ints(a.block_ks), ints(a.warps), ints(a.stages)))
    grid = [(v, *t) for t in tiles for v in variants]
    if "page_q" in variants and a.page_q_16 and PS not in ints(a.block_ks):
        grid[len(variants):len(variants)] = [("page_q", PS, w, st) for w, st in itertools.product(ints(a.warps),
                                                                                                ints(a.stages))]
    jax.config.update("jax_compilation_cache_dir", tempfile.mkdtemp(prefix="kvq_sweep_cache_"))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    sw = Sweep(a)
    Hq, Hkv, D = HEADS["llama"]
    print(f"{sw.device}: Llama heads {Hq}/{Hkv}/{D}, ps {PS}, contexts {contexts}, batches {batches}, "
          f"{len(grid)} configs", flush=True)
    summary: list[dict[str, Any]] = []
    for L in contexts:
        best: dict[tuple[str, str], tuple] = {}  # (variant, kv dtype) -> config, from the first batch's screen
        for bi, B in enumerate(batches):
            pt = Point(sw, a, L, B)
            if bi == 0:
                best = pt.screen(grid, variants)
            summary += pt.confirm(best)
            del pt
    for row in summary:
        sw.emit({"phase": "summary", **row})
    print(f"\nsummary ({sw.device}; median of the two passes; targets: dense >= 1.8x the bf16 kernel and cuDNN, "
          f"int8 rho >= 1.6x bf16 rho) -- {sw.elapsed():.0f} s")
    print(f"{'L':>7} {'B':>2}  {'name':<32} {'us':>8} {'x bf16':>7} {'x cudnn':>7} {'x rho':>6}  config")
    for r in summary:
        x = [f"{r[k]:.2f}" if k in r else "-" for k in ("x_vs_bf16_kernel", "x_vs_cudnn", "x_vs_bf16_rho")]
        cfg = f"bk{r['block_k']} w{r['num_warps']} s{r['num_stages']}" if "block_k" in r else ""
        print(f"{r['L']:>7} {r['B']:>2}  {r['name']:<32} {r['time_us']:8.1f} {x[0]:>7} {x[1]:>7} {x[2]:>6}  {cfg}")
    return 0


class Point:
    """One (context L, batch B): its caches, queries and page lists; the screen and the confirm phase."""

    def __init__(self, sw: Sweep, a: argparse.Namespace, L: int, B: int):
        self.sw, self.a, self.L, self.B = sw, a, L, B
        Hq, Hkv, D = HEADS["llama"]
        P = L // PS
        self.count = max(1, round(a.rho * P)) if a.rho > 0 else 0
        self.rho = f"rho={a.rho:g}"
        n = a.n
        key = jax.random.key(L + B)
        self.lengths = jnp.full((B,), L, jnp.int32)
        self.qs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (B, Hq, D), jnp.bfloat16) for i in range(2 * n)]
        self.ids = [jnp.argsort(jax.random.uniform(jax.random.fold_in(key, 500 + i), (B, Hkv, P)), axis=-1)
                    [..., :self.count].astype(jnp.int32) for i in range(2 * n)] if self.count else []
        self.caches: dict[str, list[tuple]] = {}
        for c, kv_dtype in enumerate(("bfloat16", "int8", "float8_e4m3fn")):
            item = 2 if kv_dtype == "bfloat16" else 1
            copies = max(1, min(4, math.ceil(4 * L2_BYTES / (2 * B * Hkv * L * D * item))))  # past L2
            self.caches[kv_dtype] = [random_cache(jax.random.fold_in(key, 1000 * i + c), (B, Hkv, L, D), kv_dtype)
                                     for i in range(copies)]
        self.base = {"L": L, "B": B}
        self.times: dict[str, list[float]] = {}
        self.cfg_of: dict[str, dict[str, Any]] = {}

    def dense(self, q, k, v, ks, kz, vs, tune):
        interp = {"interpret": True} if self.a.interpret else {}
        return decode_attention(q, k, v, self.lengths, page_size=PS, k_scale=ks, k_zero=kz, v_scale=vs, **tune,
                                **interp)

    def sparse(self, q, i, k, v, ks, kz, vs, tune):
        interp = {"interpret": True} if self.a.interpret else {}
        return decode_attention(q, k, v, self.lengths, page_size=PS, page_ids=i, k_scale=ks, k_zero=kz, v_scale=vs,
                                **tune, **interp)

    def screen(self, grid: list[tuple], variants: list[str]) -> dict[tuple[str, str], tuple]:
        """int8 dense over ``grid``, then fp8 dense over each variant's best int8 configs: check, then time."""
        a, sw, n = self.a, self.sw, self.a.n
        ranked: dict[tuple[str, str], list[tuple[float, tuple]]] = {}
        t_start = sw.elapsed()
        for kv_dtype in ("int8", "float8_e4m3fn"):
            kvs = self.caches[kv_dtype]
            ref = decode_attention_reference(self.qs[0], *kvs[0][:2], self.lengths, page_size=PS, k_scale=kvs[0][2],
                                             k_zero=kvs[0][3], v_scale=kvs[0][4]).astype(jnp.float32)
            todo = grid if kv_dtype == "int8" else [  # page_magic on fp8 is page_lowp's very program: not timed twice
                c for v in variants if v != "page_magic" for _, c in sorted(ranked.get((v, "int8"), []))[:a.fp8_top]]
            for cfg in todo:
                tune = _tune(cfg)
                row = {**self.base, "phase": "screen", "kv_dtype": kv_dtype, "mode": "dense", **tune}
                if kv_dtype == "int8" and sw.elapsed() - t_start > a.budget_s:
                    sw.emit({**row, "skipped": "over --budget-s"})
                    continue
                prog = jax.jit(lambda qs, sh, tune=tune: [self.dense(q, *sh[j % len(sh)], tune)
                                                          for j, q in enumerate(qs)])
                try:
                    out = jax.block_until_ready(prog(self.qs[:n], kvs))
                except Exception as e:  # a config Triton cannot compile: say why, go on
                    sw.emit({**row, "compile_error": repr(e)[:300]})
                    continue
                got = out[0].astype(jnp.float32)
                rel = rel_err(got, ref)
                row.update(max_abs_err=float(jnp.max(jnp.abs(got - ref))), rel_err=rel, ok=bool(rel <= a.tol))
                if row["ok"]:
                    row["time_us"] = median_time(prog, self.qs[:n], kvs, iters=a.screen_trials) / n * 1e6
                    ranked.setdefault((cfg[0], kv_dtype), []).append((row["time_us"], cfg))
                sw.emit(row)
        best = {k: min(v)[1] for k, v in ranked.items()}
        print(f"[{sw.elapsed():.0f} s] screen done; best: "
              + ", ".join(f"{v}/{d}: {c[1:]}" for (v, d), c in best.items()), flush=True)
        return best

    def measure(self, name: str, fn, per_call: list[tuple], kvs: list[tuple], row: dict[str, Any], pass_: int) -> None:
        row = {**self.base, "phase": "confirm", "pass": pass_, "name": name, **row}
        try:
            t = per_call_time(fn, per_call, kvs, n=self.a.n, trials=self.a.trials)
        except Exception as e:  # noqa: BLE001 -- report and go on
            self.sw.emit({**row, "error": repr(e)[:300]})
            return
        self.times.setdefault(name, []).append(t * 1e6)
        self.sw.emit({**row, "time_us": t * 1e6})

    def baselines(self, pass_: int) -> None:
        for r in decode_baselines(self.L, self.B, "llama", trials=self.a.trials):
            self.sw.emit({**self.base, "phase": "confirm", "pass": pass_, "name": "cudnn bf16", **r})
            if "time_us" in r:
                self.times.setdefault("cudnn bf16", []).append(r["time_us"])
        bf = self.caches["bfloat16"]
        self.measure("bf16 dense", lambda q, *kv: self.dense(q, *kv, {}), [(q,) for q in self.qs], bf,
                     {"kv_dtype": "bfloat16", "mode": "dense"}, pass_)
        if self.count:
            self.measure(f"bf16 {self.rho}", lambda q, i, *kv: self.sparse(q, i, *kv, {}),
                         list(zip(self.qs, self.ids, strict=True)), bf, {"kv_dtype": "bfloat16", "mode": self.rho},
                         pass_)

    def variants(self, best: dict[tuple[str, str], tuple], pass_: int) -> None:
        for (v, kv_dtype), cfg in best.items():
            tune = _tune(cfg)
            kvs = self.caches[kv_dtype]
            name = f"{v} {kv_dtype} dense"
            self.cfg_of[name] = tune
            self.measure(name, lambda q, *kv, tune=tune: self.dense(q, *kv, tune), [(q,) for q in self.qs], kvs,
                         {"kv_dtype": kv_dtype, "mode": "dense", **tune}, pass_)
            if self.count and kv_dtype == "int8":
                name = f"{v} int8 {self.rho}"
                self.cfg_of[name] = tune
                self.measure(name, lambda q, i, *kv, tune=tune: self.sparse(q, i, *kv, tune),
                             list(zip(self.qs, self.ids, strict=True)), kvs,
                             {"kv_dtype": kv_dtype, "mode": self.rho, **tune}, pass_)

    def confirm(self, best: dict[tuple[str, str], tuple]) -> list[dict[str, Any]]:
        """A B B A: baselines, variants, variants, baselines; returns the medians with the speedups."""
        self.baselines(1)
        self.variants(best, 1)
        self.variants(best, 2)
        self.baselines(2)
        print(f"[{self.sw.elapsed():.0f} s] L={self.L} B={self.B} confirmed", flush=True)
        med = {k: statistics.median(v) for k, v in self.times.items()}
        out = []
        for name, t in med.items():
            row = {**self.base, "name": name, "time_us": t, "passes_us": self.times[name], **self.cfg_of.get(name, {})}
            if name.endswith("dense") and name != "bf16 dense" and "bf16 dense" in med:
                row["x_vs_bf16_kernel"] = med["bf16 dense"] / t
                if "cudnn bf16" in med:
                    row["x_vs_cudnn"] = med["cudnn bf16"] / t
            if name.endswith(self.rho) and not name.startswith("bf16") and f"bf16 {self.rho}" in med:
                row["x_vs_bf16_rho"] = med[f"bf16 {self.rho}"] / t
            out.append(row)
        return out


if __name__ == "__main__":
    raise SystemExit(main())
