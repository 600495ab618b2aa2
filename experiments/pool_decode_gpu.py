"""Decode kernel: uniform cache vs page-pool mode (issue 38, docs/PAGE_POOL.md step 1), same K/V bytes.

    python experiments/pool_decode_gpu.py --lengths 32768,131072 --batches 1,8 --rhos 0.1,0.25 --out $OUT/pool.json


Per (L, B, dense | rho): the uniform kernel on [B, Hkv, S, D]; pool mode on the same pages as a pool
[B*Hkv*P, ps, D] through (a) the identity table (the uniform caller's adapter) and (b) a shuffled table
(pages scattered over the pool, as the allocator's LIFO free stack leaves them). Outputs are checked equal
(identity: bit for bit; shuffled: same logical data, so equal too). Prints us/call and pool/uniform ratios.
"""
import argparse
import json

import jax
import jax.numpy as jnp

from sparsekv_jax.bench.kernels import HEADS, per_call_time
from sparsekv_jax.pallas.decode import decode_attention


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="32768,131072")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rhos", default="0.25")
    p.add_argument("--heads", default="llama", choices=sorted(HEADS))
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--trials", type=int, default=9)
    p.add_argument("--interpret", action="store_true", help="CPU smoke test of this script (tiny lengths only)")
    p.add_argument("--out", help="also write the rows as JSON here")
    a = p.parse_args(argv)
    rows = []
    Hq, Hkv, D = HEADS[a.heads]
    ps, dt = a.page_size, jnp.bfloat16
    tune = dict(interpret=True) if a.interpret else {}
    print(jax.devices()[0].device_kind, f"heads={a.heads} ps={ps}")
    for L in map(int, a.lengths.split(",")):
        for B in map(int, a.batches.split(",")):
            P = L // ps
            key = jax.random.key(L * 100 + B)
            k = jax.random.normal(jax.random.fold_in(key, 1), (B, Hkv, L, D), dt)
            v = jax.random.normal(jax.random.fold_in(key, 2), (B, Hkv, L, D), dt)
            lengths = jnp.full((B,), L, jnp.int32)
            lengths2 = jnp.full((B, Hkv), L, jnp.int32)
            ident = jnp.arange(B * Hkv * P, dtype=jnp.int32).reshape(B, Hkv, P)
            perm = jax.random.permutation(jax.random.fold_in(key, 3), B * Hkv * P).astype(jnp.int32)
            shuf = perm.reshape(B, Hkv, P)  # logical page i of the flat order lives at pool page perm[i]
            kp_id, vp_id = k.reshape(-1, ps, D), v.reshape(-1, ps, D)
            kp_sh = jnp.zeros_like(kp_id).at[perm].set(kp_id)
            vp_sh = jnp.zeros_like(vp_id).at[perm].set(vp_id)
            for rho in [None, *map(float, a.rhos.split(","))] if a.rhos else [None]:
                n = 8 if L * B >= 65536 else 32
                qs = [jax.random.normal(jax.random.fold_in(key, 100 + i), (B, Hq, D), dt) for i in range(2 * n)]
                if rho is None:
                    ids = [None] * (2 * n)
                else:
                    cnt = max(1, round(rho * P))
                    ids = [jnp.argsort(jax.random.uniform(jax.random.fold_in(key, 500 + i), (B, Hkv, P)), -1)[..., :cnt]
                           .astype(jnp.int32) for i in range(2 * n)]
                uni = lambda q, i, k, v: decode_attention(q, k, v, lengths, page_size=ps, page_ids=i, **tune)  # noqa
                pool = lambda q, i, k, v, t: decode_attention(q, k, v, lengths2, page_size=ps, page_ids=i,  # noqa
                                                             page_table=t, **tune)
                o_u = uni(qs[0], ids[0], k, v)
                o_i = pool(qs[0], ids[0], kp_id, vp_id, ident)
                o_s = pool(qs[0], ids[0], kp_sh, vp_sh, shuf)
                ok_i = bool(jnp.array_equal(o_u, o_i))
                err_s = float(jnp.max(jnp.abs(o_u.astype(jnp.float32) - o_s.astype(jnp.float32))))
                pc = list(zip(qs, ids, strict=True))
                t_u = per_call_time(uni, pc, [(k, v)], n=n, trials=a.trials)
                t_i = per_call_time(pool, pc, [(kp_id, vp_id, ident)], n=n, trials=a.trials)
                t_s = per_call_time(pool, pc, [(kp_sh, vp_sh, shuf)], n=n, trials=a.trials)
                mode = "dense" if rho is None else f"rho={rho:g}"
                print(f"L={L:>6} B={B:>2} {mode:>9}: uniform {t_u * 1e6:9.1f} us  pool/identity {t_i * 1e6:9.1f} us "
                      f"({t_i / t_u:.3f}x)  pool/shuffled {t_s * 1e6:9.1f} us ({t_s / t_u:.3f}x)  "
                      f"identity==uniform {ok_i}  shuffled max|diff| {err_s:.2e}", flush=True)
                rows.append({"device": jax.devices()[0].device_kind, "length": L, "batch": B, "mode": mode,
                             "uniform_us": t_u * 1e6, "pool_identity_us": t_i * 1e6, "pool_shuffled_us": t_s * 1e6,
                             "identity_equal": ok_i, "shuffled_max_abs_diff": err_s})
            del k, v, kp_id, vp_id, kp_sh, vp_sh
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
