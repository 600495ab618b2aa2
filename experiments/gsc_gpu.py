"""The GSC kernel on a GPU: checked equal to its jnp reference and timed at Llama-3.1-8B's shapes.

One layer's budget search input at a 32k prompt: a band of 64 cosines per slot for 8 KV heads
(random keys with planted clusters), the three chunk layouts of budget mode (random ids, every 7th a
delimiter, as the retired `semanticache_gpu.py`, experiments/README.md), 16 thresholds per layout. The kernel
(`sparsekv_jax.pallas.gsc.greedy_seed_clustering_kernel`) runs for each ``--tiles`` x ``--warps``
setting; its output must equal `clustering.clusterings(..., "jnp")` exactly, the reference is timed
beside it. Times are medians of ``--iters`` runs after a warm-up, each ended by
``block_until_ready``. Prints a table last; ``--out`` gets ``gsc_gpu.json``.

    python experiments/gsc_gpu.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's sparsekv_jax

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from sparsekv_jax.bench.timing import median_time as timed  # noqa: E402
from sparsekv_jax.pallas.gsc import greedy_seed_clustering_kernel  # noqa: E402
from sparsekv_jax.policies import clustering  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=8, help="KV heads (Llama-3.1-8B: 8)")
    ap.add_argument("--width", type=int, default=64, help="band width = chunk_size")
    ap.add_argument("--thresholds", type=int, default=16)
    ap.add_argument("--tiles", default="128,256,512,1024")
    ap.add_argument("--warps", default="1,2,4")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args(argv)
    T, H, W, K = args.context, args.heads, args.width, args.thresholds
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((1, H, 64, 128)).astype(np.float32)
    which = rng.integers(0, 64, (1, H, T))
    keys = np.take_along_axis(centres, which[..., None], axis=2) + 0.5 * rng.standard_normal((1, H, T, 128))
    band = jax.jit(clustering.similarity_band, static_argnums=1)(jnp.asarray(keys, jnp.float32), W)
    tokens = rng.integers(0, 1 << 16, (1, T))
    is_delim = jnp.asarray(tokens % 7 == 0)
    lengths = jnp.asarray([T], jnp.int32)
    keep = jnp.asarray([T // 5], jnp.int32)
    _, _, member, place, _ = clustering.candidate_layouts(is_delim, lengths, keep, 4, 32, W, (0, 1, 2))
    grid = jnp.asarray(clustering.search_grid(1.0, K))
    taus = jnp.broadcast_to(grid[None, :, None, None], (3, K, 1, H))

    ref_fn = jax.jit(lambda b, m, p, t: clustering.clusterings(b, m, p, t, "jnp"))
    ref = ref_fn(band, member, place, taus)
    rows = [{"variant": "jnp reference", "ms": timed(ref_fn, band, member, place, taus, iters=args.iters) * 1e3,
             "merged_share": float((ref != 0).mean())}]
    device = jax.devices()[0].device_kind
    for tile in [int(x) for x in args.tiles.split(",")]:
        for warps in [int(x) for x in args.warps.split(",")]:
            fn = jax.jit(lambda b, m, p, t, tile=tile, warps=warps: greedy_seed_clustering_kernel(
                b, m, p, t, tile=tile, num_warps=warps))
            try:
                same = bool(jnp.array_equal(fn(band, member, place, taus), ref))
                rows.append({"variant": f"kernel tile={tile} warps={warps}", "tile": tile, "warps": warps,
                             "ms": timed(fn, band, member, place, taus, iters=args.iters) * 1e3, "equal": same})
            except Exception as e:  # noqa: BLE001 - report the point and go on
                rows.append({"variant": f"kernel tile={tile} warps={warps}", "error": f"{type(e).__name__}: {e}"[:300]})
            print(json.dumps(rows[-1]), flush=True)
    os.makedirs(args.out, exist_ok=True)
    meta = {"device": device, "jax": jax.__version__, "context": T, "heads": H, "width": W, "thresholds": K,
            "layouts": 3, "iters": args.iters}
    with open(os.path.join(args.out, "gsc_gpu.json"), "w") as f:
        json.dump({**meta, "rows": rows}, f, indent=2)
    print(f"\nGSC, one layer: {H} KV heads x 3 layouts x {K} thresholds, {T} slots, width {W} ({device}, "
          f"jax {jax.__version__}); merged share {rows[0]['merged_share']:.3f}")
    print(f"{'variant':<32}{'ms':>10}  equal to jnp")
    for r in rows:
        note = r["error"] if "error" in r else r.get("equal", "")
        print(f"{r['variant']:<32}{r.get('ms', float('nan')):>10.3f}  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
