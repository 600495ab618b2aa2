"""The decode kernel's ``return_probs`` on a GPU: correctness, then its cost against the plain kernel
and against the jnp path H2O used before it.

1. **check** (bf16, Llama-3.1-8B heads, a few thousand slots, unread cache slots NaN-poisoned):
   `decode_attention(..., return_probs=True)` against `decode_attention_reference` -- dense; page
   lists (ragged, one empty) with a bias holding -inf holes; and the stacked-cache ``layer=`` mode
   at a traced layer. Reports the relative errors of out and probs, the largest |prob| off the
   read slots (must be 0), the largest |row sum - 1|, and whether out is bit-identical to the
   ``return_probs=False`` output.
2. **timing** at Hq=32, Hkv=8, D=128, 16-token pages, random bf16 data, full caches: (B=32,
   S=8192: H2O's 25 % budget of a 32k prompt) and (B=1, S=32768), dense and with a random 25 %
   page selection; per call: the kernel without probs, with probs, and ``cached_attention(...,
   return_weights=True)`` (the jnp path H2O fell back to) on the same data. Timed with
   `sparsekv_jax.bench.kernels.per_call_time`: one jitted program of N and one of 2N calls on
   distinct queries / selections (K/V rotated over copies that exceed L2), medians after a
   warm-up with ``block_until_ready``, per-call time = difference / N.

    OUT=/tmp/out python scripts/decode_probs_gpu.py          # GPU, well under 2 min
    python scripts/decode_probs_gpu.py --cpu-smoke            # CPU, tiny shapes, interpret mode

Prints a table last; writes ``$OUT/decode_probs.json`` (``OUT`` defaults to ./out). Exit status 1
when a check fails.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.attention import cached_attention, page_mask
from sparsekv_jax.bench.kernels import HEADS, L2_BYTES, per_call_time
from sparsekv_jax.pallas.decode import decode_attention, decode_attention_reference, selected_slot_mask
from sparsekv_jax.pallas.testing import random_page_lists, rel_err

TOL = 1e-2  # bf16 inputs, as the kernel tests


# ------------------------------------------------------------------------------------------ check

def _check_case(name: str, q, k, v, lengths, *, interpret: bool, layer: int | None = None,
                **kw: Any) -> dict[str, Any]:
    """One comparison; ``k``/``v``/``bias`` are stacked ``[L, ...]`` when ``layer`` is given."""
    if layer is None:
        call = jax.jit(lambda q, k, v, n, rp: decode_attention(q, k, v, n, interpret=interpret, return_probs=rp, **kw),
                       static_argnums=4)
        got_out, probs = call(q, k, v, lengths, True)
        plain = call(q, k, v, lengths, False)
        k1, v1, kw1 = k, v, kw
    else:
        call = jax.jit(lambda i, rp: decode_attention(q, k, v, lengths, layer=i, interpret=interpret,
                                                      return_probs=rp, **kw), static_argnums=1)
        got_out, probs = call(jnp.int32(layer), True)
        plain = call(jnp.int32(layer), False)
        k1, v1 = k[layer], v[layer]
        kw1 = dict(kw, bias=kw["bias"][layer]) if "bias" in kw else kw
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    ref_out, ref_p = decode_attention_reference(f32(q), f32(k1), f32(v1), lengths, return_probs=True, **kw1)
    B, Hq, _ = q.shape
    Hkv, S = k1.shape[1], k1.shape[2]
    sel = {a: kw1[a] for a in ("page_size", "page_ids", "page_counts") if a in kw1}
    read = np.repeat(np.asarray(selected_slot_mask(lengths, S, Hkv, **sel)), Hq // Hkv, axis=1)
    p, r = np.asarray(probs), np.asarray(ref_p)
    live = r.sum(-1) > 0.5
    o, o_plain = np.asarray(got_out, np.float32), np.asarray(plain, np.float32)
    row = dict(
        kind="check", case=name, shape=[B, Hq, Hkv, S, q.shape[-1]],
        out_rel_err=rel_err(o, np.asarray(ref_out)), probs_rel_err=rel_err(p, r),
        off_read_max=float(np.abs(p[~read]).max()) if (~read).any() else 0.0,
        row_sum_err=float(np.abs(p.sum(-1)[live] - 1).max()) if live.any() else 0.0,
        empty_rows_zero=bool(np.all(p[~live] == 0)),
        out_bitwise_equal=bool(np.array_equal(o, o_plain)),
        out_vs_plain_max=float(np.abs(o - o_plain).max()),
    )
    row["ok"] = bool(row["out_rel_err"] <= TOL and row["probs_rel_err"] <= TOL and row["off_read_max"] == 0
                     and row["row_sum_err"] <= 1e-4 and row["empty_rows_zero"] and row["out_vs_plain_max"] <= TOL)
    return row


def run_checks(rng: np.random.Generator, *, smoke: bool) -> list[dict[str, Any]]:
    Hq, Hkv, D = (4, 2, 64) if smoke else HEADS["llama"]
    B, P, ps = (2, 6, 16) if smoke else (4, 256, 16)
    S = P * ps
    lengths = rng.integers(S // 2, S + 1, B).astype(np.int32)
    lengths[0] = S - int(rng.integers(1, ps))  # partial last page
    n = jnp.asarray(lengths)
    q = jnp.asarray(rng.standard_normal((B, Hq, D)), jnp.bfloat16)
    k = rng.standard_normal((B, Hkv, S, D))
    v = rng.standard_normal((B, Hkv, S, D))
    ids, counts = random_page_lists(rng, lengths, Hkv, P, ps, list_len=max(2, P // 4))
    counts[1, 0] = 0  # one empty selection
    bias = rng.standard_normal((B, Hkv, S))
    bias[rng.random(bias.shape) < 0.1] = -np.inf  # evicted-slot holes
    sparse = dict(page_size=ps, page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts),
                  bias=jnp.asarray(bias, jnp.float32))

    def poisoned(**sel):
        m = np.asarray(selected_slot_mask(n, S, Hkv, **sel))[..., None]
        return (jnp.asarray(np.where(m, k, np.nan), jnp.bfloat16), jnp.asarray(np.where(m, v, np.nan), jnp.bfloat16))

    rows = []
    kd, vd = poisoned(page_size=ps)
    rows.append(_check_case("dense", q, kd, vd, n, interpret=smoke, page_size=ps))
    ks, vs = poisoned(page_size=ps, page_ids=sparse["page_ids"], page_counts=sparse["page_counts"])
    rows.append(_check_case("sparse+bias", q, ks, vs, n, interpret=smoke, **sparse))
    L, layer = 3, 1  # other layers all NaN: reading one shows
    stack = lambda x: jnp.stack([x if i == layer else jnp.full_like(x, jnp.nan) for i in range(L)])  # noqa: E731
    rows.append(_check_case("stacked layer", q, stack(ks), stack(vs), n, interpret=smoke, layer=layer,
                            **dict(sparse, bias=stack(sparse["bias"]))))
    return rows


# ----------------------------------------------------------------------------------------- timing

def time_point(B: int, S: int, rho: float | None, *, smoke: bool, trials: int, seed: int = 0) -> dict[str, Any]:
    """Per-call times of the three implementations at one (B, S, selection)."""
    Hq, Hkv, D = (4, 2, 64) if smoke else HEADS["llama"]
    ps = 16
    P = S // ps
    dtype = jnp.bfloat16
    kv_bytes = 2 * B * Hkv * S * D * 2
    n_copies = max(1, min(8, math.ceil(4 * L2_BYTES / kv_bytes)))
    key = jax.random.key(seed)
    kvs = []
    for c in range(n_copies):
        kk, kv_ = jax.random.split(jax.random.fold_in(key, c))
        kvs.append((jax.random.normal(kk, (B, Hkv, S, D), dtype), jax.random.normal(kv_, (B, Hkv, S, D), dtype)))
    lengths = jnp.full((B,), S, jnp.int32)
    count = max(1, round((rho or 1.0) * P))
    est = kv_bytes * (rho or 1.0) / 3e12 + 1e-5
    n = 2 if smoke else int(min(8, max(4, math.ceil(3e-3 / est))))  # few calls per program: short compiles
    per_call = []
    for i in range(2 * n):
        q = jax.random.normal(jax.random.fold_in(key, 1000 + i), (B, Hq, D), dtype)
        if rho is None:
            per_call.append((q,))
        else:
            r = jax.random.uniform(jax.random.fold_in(key, 5000 + i), (B, Hkv, P))
            per_call.append((q, jnp.argsort(r, axis=-1)[..., :count].astype(jnp.int32)))

    def kernel(probs: bool):
        def call(q, *rest):
            *ids, k, v = rest
            return decode_attention(q, k, v, lengths, page_size=ps, page_ids=ids[0] if ids else None,
                                    interpret=smoke, return_probs=probs)
        return call

    def jnp_path(q, *rest):  # what attention.decode did for return_probs: mask, then cached_attention
        *ids, k, v = rest
        valid = jnp.arange(S)[None, None, :] < lengths[:, None, None]
        if ids:
            valid = valid & jnp.repeat(page_mask(ids[0], jnp.full((B, Hkv), count), P), ps, axis=-1)
        valid = jnp.broadcast_to(valid, (B, Hkv, S))[:, :, None, :]
        kv_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, Hkv, S))
        out, probs = cached_attention(q[:, :, None], k, v, lengths[:, None], kv_pos, valid, return_weights=True)
        return out[:, :, 0], probs[:, :, 0]

    row: dict[str, Any] = dict(kind="time", B=B, S=S, Hq=Hq, Hkv=Hkv, D=D, page_size=ps,
                               mode="dense" if rho is None else f"rho={rho:g}", rho=rho, n=n, kv_copies=n_copies,
                               kv_bytes_read=int(kv_bytes * count / P))
    for name, fn in (("kernel_us", kernel(False)), ("kernel_probs_us", kernel(True)), ("jnp_probs_us", jnp_path)):
        t0 = time.perf_counter()
        try:
            row[name] = per_call_time(fn, per_call, kvs, n=n, trials=trials) * 1e6
        except Exception as e:  # report and go on: the other columns still mean something
            row[name] = None
            row[name.replace("_us", "_error")] = repr(e)[:300]
        row[name.replace("_us", "_wall_s")] = time.perf_counter() - t0
    if row.get("kernel_us") and row.get("kernel_probs_us"):
        row["probs_over_plain"] = row["kernel_probs_us"] / row["kernel_us"]
    if row.get("jnp_probs_us") and row.get("kernel_probs_us"):
        row["jnp_over_probs"] = row["jnp_probs_us"] / row["kernel_probs_us"]
    return row


# ------------------------------------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, kernels interpreted (CPU)")
    p.add_argument("--trials", type=int, default=20, help="timed runs per program (median; default 20)")
    args = p.parse_args()
    smoke = args.cpu_smoke
    if not smoke and jax.default_backend() != "gpu":
        p.error("no GPU: run with --cpu-smoke")
    out_dir = os.environ.get("OUT", "out")
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "decode_probs.json")
    seed = int(np.random.SeedSequence().entropy % 2**32)
    rows: list[dict[str, Any]] = []
    t_start = time.perf_counter()

    def save() -> None:
        with open(path, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "seed": seed,
                       "smoke": smoke, "elapsed_s": time.perf_counter() - t_start, "rows": rows}, f, indent=1)

    rows += run_checks(np.random.default_rng(seed), smoke=smoke)
    save()
    points = [(2, 256), (1, 512)] if smoke else [(32, 8192), (1, 32768)]
    for B, S in points:
        for rho in (None, 0.25):
            rows.append(time_point(B, S, rho, smoke=smoke, trials=2 if smoke else args.trials))
            save()

    lines = [f"device {jax.devices()[0].device_kind}, jax {jax.__version__}, seed {seed}, "
             f"{time.perf_counter() - t_start:.0f} s"]
    for r in rows:
        if r["kind"] == "check":
            lines.append(f"check {r['case']:<14} {'OK  ' if r['ok'] else 'FAIL'} out err {r['out_rel_err']:.1e}, "
                         f"probs err {r['probs_rel_err']:.1e}, off-read max {r['off_read_max']:.1e}, "
                         f"|row sum-1| {r['row_sum_err']:.1e}, out==plain {r['out_bitwise_equal']} "
                         f"(max diff {r['out_vs_plain_max']:.1e})")
    fmt = lambda x: f"{x:10.1f}" if x is not None else f"{'failed':>10}"  # noqa: E731
    lines.append(f"{'B':>3} {'S':>6} {'mode':<8} {'kernel us':>10} {'+probs us':>10} {'jnp us':>10} "
                 f"{'probs/plain':>11} {'jnp/probs':>9}")
    for r in rows:
        if r["kind"] == "time":
            lines.append(f"{r['B']:>3} {r['S']:>6} {r['mode']:<8} {fmt(r['kernel_us'])} {fmt(r['kernel_probs_us'])} "
                         f"{fmt(r['jnp_probs_us'])} {r.get('probs_over_plain', float('nan')):>11.3f} "
                         f"{r.get('jnp_over_probs', float('nan')):>9.2f}")
    save()
    print("\n".join(lines))
    print(f"wrote {path}")
    return 0 if all(r["ok"] for r in rows if r["kind"] == "check") else 1


if __name__ == "__main__":
    raise SystemExit(main())
