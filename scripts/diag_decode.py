"""Where does a decode step's time go? (diagnostic, Llama-3.1-8B shapes, random weights)

Times: the full `decode_step` (B=1, 8k cache), the same layer scan with matmuls only, and a
per-layer Python-unrolled matmul chain (weights as separate arrays); dumps optimized HLO.
"""
import os
import sys
import time

import jax
import jax.numpy as jnp

from sparsekv_jax.bench.e2e import _decode_cache, _median_time_carry, decode_fn
from sparsekv_jax.models import config as mc
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import Dense


def timeit(f, *a, n=20):
    jax.block_until_ready(f(*a))
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        jax.block_until_ready(f(*a))
        ts.append(time.perf_counter() - t)
    ts.sort()
    return ts[len(ts) // 2] * 1e3


out = sys.argv[1]
cfg = mc.llama31_8b_config()
params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
steps = 8
cache, obs = _decode_cache(cfg, Dense(), 8192, 1, steps, jax.random.key(2))
tok = jnp.ones((1,), jnp.int32)


if not os.environ.get("SKIP_DECODE"):
    state = (None, None)
    comp = decode_fn(params, Dense(), steps, start=(cache.length, cache.next_position)).lower(
        params, cache, state, tok).compile()
    open(os.path.join(out, "decode_hlo.txt"), "w").write(comp.as_text())
    sec, _ = _median_time_carry(comp, params, (cache, state, tok), iters=10)
    print(f"decode_step B=1 8k: {sec * 1e3 / steps:.2f} ms/token")
del cache


def mm_scan(params, x, unroll=1):
    def layer(x, lw):
        h = x @ lw.wq
        h2 = x @ lw.wk + x @ lw.wv
        x = x + (h[:, : cfg.hidden_size]) @ lw.wo[: cfg.hidden_size] * 0 + h2.sum() * 0
        g = jax.nn.silu(x @ lw.w_gate) * (x @ lw.w_up)
        return x + g @ lw.w_down, None
    return jax.lax.scan(layer, x, params.layers, unroll=unroll)[0]


x = jax.random.normal(jax.random.key(3), (1, cfg.hidden_size), jnp.bfloat16)
print(f"matmul-only scan (rolled): {timeit(jax.jit(mm_scan), params, x):.2f} ms")
unrolled = jax.jit(lambda p, x: mm_scan(p, x, unroll=True))
print(f"matmul-only scan (unrolled): {timeit(unrolled, params, x):.2f} ms")
x32 = jax.random.normal(jax.random.key(3), (32, cfg.hidden_size), jnp.bfloat16)
print(f"B=32 matmul-only scan (rolled): {timeit(jax.jit(mm_scan), params, x32):.2f} ms")
layers = [jax.tree.map(lambda a, i=i: a[i], params.layers) for i in range(cfg.num_layers)]


def mm_list(layers, x):
    for lw in layers:
        h = x @ lw.wq
        h2 = x @ lw.wk + x @ lw.wv
        x = x + (h[:, : cfg.hidden_size]) @ lw.wo[: cfg.hidden_size] * 0 + h2.sum() * 0
        g = jax.nn.silu(x @ lw.w_gate) * (x @ lw.w_up)
        x = x + g @ lw.w_down
    return x


print(f"matmul-only, separate arrays: {timeit(jax.jit(mm_list), layers, x):.2f} ms")


def mm_scan_pallas(params, x):
    from sparsekv_jax.models.transformer import stacked_matmul

    def layer(x, idx):
        mm = stacked_matmul(params, idx)
        h = mm(x, "wq")
        h2 = mm(x, "wk") + mm(x, "wv")
        x = x + mm(h, "wo") * 0 + h2.sum() * 0
        g = jax.nn.silu(mm(x, "w_gate")) * mm(x, "w_up")
        return x + mm(g, "w_down"), None
    return jax.lax.scan(layer, x, jnp.arange(cfg.num_layers))[0]


print(f"matmul-only scan, Pallas layer_matmul (rolled): {timeit(jax.jit(mm_scan_pallas), params, x):.2f} ms")
print(f"B=32 matmul-only, separate arrays: {timeit(jax.jit(mm_list), layers, x32):.2f} ms")
nbytes = sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(params.layers))
print(f"layer weights {nbytes / 1e9:.2f} GB")
