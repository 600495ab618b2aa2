"""Issue 39: the Pallas decode kernel on float8_e4m3fn / int8 pages holding Qwen2-like keys (GPU check).

    python experiments/kv_quant_fp8_gpu_check.py                    # on the GPU (Triton)
    python experiments/kv_quant_fp8_gpu_check.py --interpret --S 512  # a CPU dry run

Keys N(0, 1) with a few channels offset by +-20..80 (plus N(0, 0.5) noise: Qwen2's k_proj bias),
values N(0, 1); pages quantised by the cache's own functions (`sparsekv_jax.cache`), symmetric
(``zero=False``, the codes before zero points) or against the pages' mid-range zero points. For
each (dtype, zero, query dtype) it prints the kernel's relative error against its jnp reference on
the same codes (``kernel_vs_ref``: a kernel bug shows here, 1e-5 for fp32 queries, ~1e-2 for bf16)
and each one's against float32 attention over the unquantised keys and values
(``kernel_vs_exact`` / ``ref_vs_exact``: what quantisation costs). Exit status 1 when
``kernel_vs_ref`` misses its tolerance.
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.cache import page_scales, page_zeros, quantize
from sparsekv_jax.pallas.decode import decode_attention, decode_attention_reference
from sparsekv_jax.pallas.testing import rel_err


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--B", type=int, default=4)
    p.add_argument("--S", type=int, default=8192)
    p.add_argument("--page-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--interpret", action="store_true", help="run the kernel interpreted (CPU)")
    a = p.parse_args(argv)
    B, Hq, Hkv, D, S, ps = a.B, 12, 2, 128, a.S, a.page_size  # Qwen2.5-1.5B's heads
    rng = np.random.default_rng(a.seed)
    print(f"seed {a.seed}, device {jax.devices()[0].device_kind}", flush=True)
    k = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    chans = rng.choice(D, 8, replace=False)
    k[..., chans] = (rng.uniform(20, 80, 8) * rng.choice([-1, 1], 8)).astype(np.float32) \
        + 0.5 * rng.standard_normal((B, Hkv, S, 8)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    lengths = jnp.asarray(rng.integers(S // 2, S + 1, B), jnp.int32)
    valid = jnp.broadcast_to(jnp.arange(S)[None, None] < lengths[:, None, None], (B, Hkv, S))
    q32 = jnp.asarray(rng.standard_normal((B, Hq, D)) * 0.1, jnp.float32)
    exact = decode_attention_reference(q32, jnp.asarray(k), jnp.asarray(v), lengths, page_size=ps)
    bad = 0
    for kv_dtype in ("float8_e4m3fn", "int8"):
        dt = jnp.dtype(kv_dtype)
        for zero in (False, True):
            kz = page_zeros(jnp.asarray(k), valid, ps) if zero else None
            ks, vs = page_scales(jnp.asarray(k), jnp.asarray(v), valid, ps, dt, k_zero=kz)
            kq = quantize(jnp.asarray(k), jnp.repeat(ks, ps, axis=-2), dt,
                          None if kz is None else jnp.repeat(kz, ps, axis=-2))
            vq = quantize(jnp.asarray(v), jnp.repeat(vs, ps, axis=-1)[..., None], dt)
            for q_dtype, tol in ((jnp.float32, 1e-5), (jnp.bfloat16, 2e-2)):
                q = q32.astype(q_dtype)
                kw = dict(page_size=ps, k_scale=ks, v_scale=vs, k_zero=kz)
                out = decode_attention(q, kq, vq, lengths, interpret=a.interpret, **kw)
                ref = decode_attention_reference(q, kq, vq, lengths, **kw)
                o, r, e = (np.asarray(x, np.float32) for x in (out, ref, exact))
                row = {"kv_dtype": kv_dtype, "zero": zero, "q_dtype": jnp.dtype(q_dtype).name,
                       "kernel_vs_ref": rel_err(o, r), "max_abs_kernel_vs_ref": float(np.abs(o - r).max()),
                       "kernel_vs_exact": rel_err(o, e), "ref_vs_exact": rel_err(r, e)}
                row["ok"] = bool(row["kernel_vs_ref"] <= tol and np.isfinite(o).all())
                bad += not row["ok"]
                print(json.dumps(row), flush=True)
    print(f"{bad} kernel/reference mismatches", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
