"""The Pallas threshold top-k on a GPU: exactness at the SAE's real shapes, then its time against XLA's.

For each shape (rows x width, k) of the SAE step and of S³'s scan, on random ReLU'd normals with a
few adversarial rows (large ties at the k-th place, rows with fewer than k positive values):

1. check: `threshold_top_k` equals its jnp reference (``lax.top_k``) exactly: ids, values, k-th value;
   and S³'s ``token_features(method="threshold")`` (kernel path) equals ``method="lax"`` on a random SAE;
2. time (median of ``--iters`` after a warm-up, ``block_until_ready``): ``lax.top_k`` (XLA: a sort
   per row at k > 16), the kernel with and without its early exit and at several ``block_rows`` x
   ``num_warps``, and the jnp bisection S³ used before
   (`sparsekv_jax.retrieval.features.kth_largest_jnp`, threshold only); plus one read of the input
   (``jnp.max`` over rows) as the memory floor.

    python experiments/topk_gpu.py --out $OUT

Prints a table last; writes ``topk_gpu.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sparsekv_jax.bench.timing import median_time  # noqa: E402
from sparsekv_jax.pallas.topk import threshold_top_k, threshold_top_k_reference  # noqa: E402
from sparsekv_jax.retrieval.features import kth_largest_jnp, token_features  # noqa: E402
from sparsekv_jax.sae.model import init_sae  # noqa: E402

SHAPES = {
    "sae_smollm2 (4 x 12,288 x 8,192, k 64)": (4 * 12288, 8192, 64),
    "sae_llama8b (32,768 x 16,384, k 128)": (32768, 16384, 128),
    "s3_scan_llama8b (2,048 tok x 8 heads x 16,384, k 128)": (2048 * 8, 16384, 128),
    "s3_merged_llama8b (2,048 tok x 16,384, k 128)": (2048, 16384, 128),
}


def rows(key, M: int, W: int, k: int) -> jax.Array:
    x = jax.nn.relu(jax.random.normal(key, (M, W), jnp.float32))
    x = x.at[1].set(jnp.where(jnp.arange(W) < W - k // 2, 0.0, x[1]))  # fewer than k positive
    x = x.at[2].set(jnp.where(jnp.arange(W) % 3 == 0, 0.75, x[2]))  # a tie far wider than k
    return x


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warps", default="4,8")
    p.add_argument("--block-rows", default="1", help="rows per program to try (2 and 4 measured slower)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    warps = [int(w) for w in args.warps.split(",")]
    block_rows = [int(b) for b in args.block_rows.split(",")]
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "shapes": {}}

    # S³'s feature path on the kernel vs lax (a small random SAE at Llama's head dim and width)
    sae = init_sae(jax.random.key(0), 128, 16384, 128)
    keys = jax.random.normal(jax.random.key(1), (256, 8, 128), jnp.float32)
    ids_t, acts_t = jax.jit(lambda s, x: token_features(s, x, 128, "threshold"))(sae, keys)
    ids_l, acts_l = jax.jit(lambda s, x: token_features(s, x, 128, "lax"))(sae, keys)
    same = [set(a[b > 0].tolist()) == set(c[d > 0].tolist())
            for a, b, c, d in zip(np.asarray(ids_t), np.asarray(acts_t), np.asarray(ids_l), np.asarray(acts_l),
                                  strict=True)]
    results["token_features_threshold_equals_lax"] = float(np.mean(same))
    print(f"token_features threshold == lax on {np.mean(same):.4f} of tokens", flush=True)

    table = []
    for name, (M, W, k) in SHAPES.items():
        x = rows(jax.random.key(M + W + k), M, W, k)
        rv, ri, rt = jax.jit(threshold_top_k_reference, static_argnums=1)(x, k)
        exact = {}
        for early in (True, False):
            v, i, t = threshold_top_k(x, k, early_exit=early)
            tag = "" if early else "_31_passes"
            exact.update({"ids" + tag: bool(jnp.array_equal(i, ri)), "values" + tag: bool(jnp.array_equal(v, rv)),
                          "kth" + tag: bool(jnp.array_equal(t, rt))})
        row = {"rows": M, "width": W, "k": k, "exact": exact}
        row["lax_top_k_s"] = median_time(jax.jit(lambda x, k=k: jax.lax.top_k(x, k)), x, iters=args.iters)
        row["jnp_bisection_s"] = median_time(jax.jit(lambda x, k=k: kth_largest_jnp(x, k)), x, iters=args.iters)
        row["one_read_s"] = median_time(jax.jit(lambda x: jnp.max(x, axis=-1)), x, iters=args.iters)
        row["kernel_s"] = {}
        for br in block_rows:
            for w in warps:
                tag = f"{br}x{w}"
                try:
                    row["kernel_s"][tag] = median_time(
                        jax.jit(lambda x, w=w, br=br, k=k: threshold_top_k(x, k, block_rows=br, num_warps=w)), x,
                        iters=args.iters)
                except Exception as e:  # e.g. too many registers at this shape
                    row["kernel_s"][tag] = None
                    row[f"error_{tag}"] = f"{type(e).__name__}: {str(e)[:300]}"
        row["kernel_default_s"] = median_time(jax.jit(lambda x, k=k: threshold_top_k(x, k)), x, iters=args.iters)
        row["kernel_31_passes_s"] = median_time(jax.jit(lambda x, k=k: threshold_top_k(x, k, early_exit=False)), x,
                                                iters=args.iters)
        results["shapes"][name] = row
        print(json.dumps({name: row}), flush=True)
        best = min((s, w) for w, s in row["kernel_s"].items() if s is not None)
        table.append(f"| {name} | {all(exact.values())} | {row['lax_top_k_s'] * 1e3:.2f} | "
                     f"{row['jnp_bisection_s'] * 1e3:.2f} | {row['kernel_31_passes_s'] * 1e3:.3f} | "
                     f"{row['kernel_default_s'] * 1e3:.3f} | "
                     f"{best[0] * 1e3:.3f} ({best[1]}) | {row['one_read_s'] * 1e3:.3f} | "
                     f"{row['lax_top_k_s'] / row['kernel_default_s']:.1f}x |")
        del x
    (out / "topk_gpu.json").write_text(json.dumps(results, indent=1))
    print(f"\n{results['device']}, jax {results['jax']}, ms (median of {args.iters})")
    print("| shape | exact | lax.top_k | jnp bisection | kernel, 31 passes | kernel (default: early exit) | "
          "best (rows x warps) | one read | lax / kernel |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
