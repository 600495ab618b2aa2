"""CHESS's rebuild page sums on a GPU: the Pallas `rope_page_sums` against its jnp reference.

Random bf16 keys of Llama-3.1-8B's cache shape (8 KV heads × 128 dims, its RoPE frequencies,
32-token pages):

1. **check** — `rope_page_sums` against `rope_page_sums_reference` (fp32) at a random layer, and
   once on a stack of more than 2^31 elements at its last layer (64-bit offsets), max relative
   error;
2. **timing** — a `lax.map` over every layer of a ``[L, B, 8, S, 128]`` stack computing the page
   sums: jnp (slices the layer, a copy, then elementwise) against the kernel, for a few
   ``block_p`` and warp counts; ms per pass and the key bytes per second it implies.

    python experiments/page_rope_gpu.py --batch 4 --context 32k --out page_rope.json

Prints a table last; timings are medians after a warm-up, each run `block_until_ready`.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.bench.e2e import parse_tokens
from sparsekv_jax.bench.timing import median_time
from sparsekv_jax.models.config import llama31_8b_config
from sparsekv_jax.models.rope import inverse_frequencies
from sparsekv_jax.pallas.page_rope import rope_page_sums, rope_page_sums_reference


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON rows")
    p.add_argument("--batch", type=int, default=4, help="rows of the timed stack (default 4)")
    p.add_argument("--context", default="32k", help="slots per row of the timed stack (default 32k)")
    p.add_argument("--block-p", default="32,64,128", help="kernel pages per program to time (default 32,64,128)")
    p.add_argument("--warps", default="4,8", help="kernel warps per program to time (default 4,8)")
    p.add_argument("--iters", type=int, default=10, help="timed runs (default 10)")
    args = p.parse_args(argv)
    cfg = llama31_8b_config()
    H, D, ps = cfg.num_kv_heads, cfg.head_dim, 32
    interpret = jax.default_backend() != "gpu"  # CPU smoke runs only
    inv_freq = np.asarray(inverse_frequencies(cfg))
    rows, lines = [], []

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows}, f, indent=1)

    # 1. correctness: a small stack at a random layer, then past 2^31 elements at its last layer
    checks = [(4, 2, 8200), (10, 8, 33024)] if not interpret else [(2, 1, 200)]
    for i, (L, B, S) in enumerate(checks):
        k = jax.random.normal(jax.random.key(10 + i), (L, B, H, S, D), jnp.bfloat16)
        layer = L - 1 if i else int(np.random.default_rng().integers(L))
        got = jax.jit(lambda k, i: rope_page_sums(k, inv_freq, i, page_size=ps, interpret=interpret))(
            k, jnp.int32(layer))
        ref = rope_page_sums_reference(k, inv_freq, layer, page_size=ps)
        err = float(jnp.max(jnp.abs(got - ref)) / jnp.max(jnp.abs(ref)))
        rows.append({"kind": "check", "shape": [L, B, H, S, D], "elements": k.size, "layer": layer, "rel_err": err,
                     "finite": bool(jnp.all(jnp.isfinite(got)))})
        lines.append(f"check {L}x{B}x{H}x{S}x{D} ({k.size / 2**31:.2f} x 2^31 elements) layer {layer}: "
                     f"rel. err {err:.2e}, finite {rows[-1]['finite']}")
        del k, got, ref
    save()

    # 2. one pass over the layers, as in a rebuild
    S = parse_tokens(args.context)[0] + 1024
    L = cfg.num_layers if not interpret else 2
    k = jax.random.normal(jax.random.key(1), (L, args.batch, H, S, D), jnp.bfloat16)
    gb = k.size * 2 / 1e9
    impls = {"jnp": lambda k: jax.lax.map(lambda i: rope_page_sums_reference(k, inv_freq, i, page_size=ps),
                                          jnp.arange(L))}
    for bp in [int(b) for b in args.block_p.split(",")]:
        for nw in [int(w) for w in args.warps.split(",")]:
            impls[f"pallas block_p={bp} warps={nw}"] = lambda k, bp=bp, nw=nw: jax.lax.map(
                lambda i: rope_page_sums(k, inv_freq, i, page_size=ps, block_p=bp, num_warps=nw,
                                         interpret=interpret), jnp.arange(L))
    for name, fn in impls.items():
        try:
            ms = median_time(jax.jit(fn), k, iters=args.iters) * 1e3
            rows.append({"kind": "time", "impl": name, "shape": list(k.shape), "ms": ms, "key_gb": gb})
            lines.append(f"time  {name:<30} {ms:8.2f} ms per pass over {L} layers, {gb / ms:.2f} TB/s of keys")
        except Exception as e:  # a tiling Triton rejects is a finding, not a crash
            rows.append({"kind": "time", "impl": name, "error": str(e)[:300]})
            lines.append(f"time  {name:<30} failed: {str(e)[:100]}")
        save()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
