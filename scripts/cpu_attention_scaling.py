"""Why our CPU prefill trails transformers': the attention's scaling from one core to two.

SmolLM2-135M's attention shapes at a 4k prompt (9 query heads, 3 KV heads, head dim 64, fp32,
random inputs), one layer: our `attention.blocked_causal_attention` (the CPU prefill's attention,
jitted) against torch's `scaled_dot_product_attention` (causal; keys repeated per query head, as
transformers' sdpa path does), each in a child process pinned with ``taskset`` to one core and to
two (torch gets as many threads as cores). A third probe asks whether XLA:CPU runs two independent
loops at once: one jitted function holding two independent `fori_loop`s of small matmuls, against
one such loop. Ours is timed twice: compiled with XLA's own dots and with oneDNN's
(`Backend.prefill_dots`, what the CPU prefill uses since 2026-11-26). Medians of ``--repeats`` runs
after a warm-up, each ended by ``block_until_ready``.

    python scripts/cpu_attention_scaling.py --out docs/results/cpu_attention_scaling
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _median(fn, repeats: int) -> float:
    fn()
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t0)
    return statistics.median(runs) * 1e3


def child(cores: int, repeats: int, length: int) -> dict:
    sys.path.insert(0, str(ROOT))
    import jax
    import jax.numpy as jnp
    import numpy as np
    import torch

    from sparsekv_jax.attention import blocked_causal_attention
    from sparsekv_jax.backend import Backend

    B, Hq, Hkv, D = 1, 9, 3, 64
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((B, length, h, D), np.float32) for h in (Hq, Hkv, Hkv))
    ours = jax.jit(blocked_causal_attention)
    qj, kj, vj = map(jnp.asarray, (q, k, v))
    out_ours = np.asarray(ours(qj, kj, vj))
    ms_ours = _median(lambda: jax.block_until_ready(ours(qj, kj, vj)), repeats)
    # the same program compiled with oneDNN's dots (what the CPU prefill uses, `Backend.prefill_dots`)
    onednn = Backend(prefill_dots="onednn").resolve()
    ours_onednn = onednn.compile_prefill(jax.jit(blocked_causal_attention).lower(qj, kj, vj))
    on_onednn = '"__onednn_fusion"' in ours_onednn.as_text()
    out_onednn = np.asarray(ours_onednn(qj, kj, vj))
    ms_onednn = _median(lambda: jax.block_until_ready(ours_onednn(qj, kj, vj)), repeats)

    torch.set_num_threads(cores)
    G = Hq // Hkv
    tq = torch.from_numpy(q).transpose(1, 2).contiguous()
    tk = torch.from_numpy(k).transpose(1, 2).repeat_interleave(G, 1).contiguous()
    tv = torch.from_numpy(v).transpose(1, 2).repeat_interleave(G, 1).contiguous()
    with torch.no_grad():
        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
        out_torch = sdpa().transpose(1, 2).numpy()
        ms_torch = _median(sdpa, repeats)

    x = jnp.asarray(rng.standard_normal((768, 64), np.float32))
    w = jnp.asarray(0.1 * rng.standard_normal((64, 64), np.float32))

    def chain(x):
        return jax.lax.fori_loop(0, 400, lambda i, c: jnp.tanh(c @ w), x)
    one = jax.jit(chain)
    two = jax.jit(lambda x: (chain(x), chain(x + 1.0)))
    ms_one = _median(lambda: jax.block_until_ready(one(x)), repeats)
    ms_two = _median(lambda: jax.block_until_ready(two(x)), repeats)
    return {"cores": cores, "ours_ms": ms_ours, "ours_onednn_ms": ms_onednn, "onednn_fusions": on_onednn,
            "max_abs_diff_onednn_vs_xla": float(np.abs(out_onednn - out_ours).max()), "torch_ms": ms_torch,
            "one_loop_ms": ms_one, "two_loops_ms": ms_two,
            "max_abs_diff_vs_torch": float(np.abs(out_ours - out_torch).max()), "jax": jax.__version__,
            "torch": torch.__version__}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.repeats, args.length)))
        return 0
    if shutil.which("taskset") is None:
        raise SystemExit("needs taskset (util-linux) to pin the child processes to cores")
    n = os.cpu_count() or 1
    rows = []
    for cores in sorted({1, min(2, n)}):
        cpus = ",".join(str(c) for c in range(cores))
        cmd = ["taskset", "-c", cpus, sys.executable, __file__, "--child", str(cores), "--repeats",
               str(args.repeats), "--length", str(args.length)]
        res = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        rows[-1]["load1_after"] = os.getloadavg()[0]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "cpu_attention_scaling.json"), "w") as f:
        json.dump({"length": args.length, "repeats": args.repeats, "cpu_count": n, "rows": rows}, f, indent=2)
    print(f"one layer's attention, {args.length} tokens, SmolLM2 shapes, fp32 (medians of {args.repeats}, ms)")
    print(f"{'cores':>5} {'ours':>9} {'ours, oneDNN':>13} {'torch sdpa':>11} {'oneDNN/torch':>13} {'1 loop':>8} "
          f"{'2 indep. loops':>15}")
    for r in rows:
        print(f"{r['cores']:>5} {r['ours_ms']:>9.1f} {r['ours_onednn_ms']:>13.1f} {r['torch_ms']:>11.1f} "
              f"{r['ours_onednn_ms'] / r['torch_ms']:>13.2f} {r['one_loop_ms']:>8.1f} {r['two_loops_ms']:>15.1f}")
    if len(rows) == 2:
        a, b = rows
        print(f"scaling 1 -> 2 cores: ours {a['ours_ms'] / b['ours_ms']:.2f}x, ours on oneDNN "
              f"{a['ours_onednn_ms'] / b['ours_onednn_ms']:.2f}x, torch {a['torch_ms'] / b['torch_ms']:.2f}x; "
              f"largest difference vs torch {max(r['max_abs_diff_vs_torch'] for r in rows):.1e}, oneDNN vs XLA dots "
              f"{max(r['max_abs_diff_onednn_vs_xla'] for r in rows):.1e}; oneDNN fusions used: "
              f"{all(r['onednn_fusions'] for r in rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
