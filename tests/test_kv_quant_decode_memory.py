"""The decode step's write into a quantised cache (`cache_write.append_token` with ``layer=``, the
whole cache riding the decode layer scan's carry) writes one page in place (issue 39).

It did not: on an H200 an int8 decode step of Llama-3.1-8B at 32k took 109.6 ms against bf16's 6.2 ms,
and its program held a temporary the size of the codes. The write reshaped the carried stack
``[L, B, H, S, D]`` to pages ``[L, B, H, P, ps, D]``, read the page from it and scattered the
re-scaled page back into the reshaped array. XLA:GPU fused the page read into the scatter (the
reshape, a bitcast, hid that the scatter's in-place operand was the array the fusion read), so the
scatter could not run in place: it copied the whole stacked codes before the scatter and back into
the carry after it, for k and v, at every layer of every step (four copies of a 1 GB stack per layer;
seen in the program compiled for an H100 target without a device). XLA:CPU fuses nothing into a
scatter, so a CPU program never showed it. What is checked here, on the CPU:

* the written values follow the documented rule (`sparsekv_jax.cache_quant`), against a numpy
  simulation from the true values, for appends inside a jitted `lax.scan` over layers as the engine runs them;
* the traced program of that scan never reshapes, slices or copies a stack-sized codes array: the
  stack appears only as the carry, the one gather reading the page (whose result passes an
  `optimization_barrier` before anything computes from it) and the one scatter writing it, both on the stack's
  own shape (the old write fails this: it reshaped the stack and sliced a layer out of it);
* the compiled CPU program's temporaries stay far below the codes' size.

Every random input comes from the run's seed (``rng`` fixture; ``pytest --seed N`` replays it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from sparsekv_jax.cache import append_token, init_cache, layer_view, write_chunk
from sparsekv_jax.models.config import ModelConfig

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
L, B, H, D, PS, S = 3, 2, 2, 16, 8, 64
LENGTHS = np.array([5, 8])  # row 0: part of page 0; row 1: page 0 full, its first append opens page 1
STEPS = 3
CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=32, num_layers=L, num_heads=2, num_kv_heads=H,
                  head_dim=D, intermediate_size=48, max_position_embeddings=512)


def _np_scale(amax, qmax):
    with np.errstate(divide="ignore"):
        s = 2.0 ** np.ceil(np.log2(np.asarray(amax, np.float64) / qmax))
    return np.where(amax > 0, s, 0.0)


def _np_quant(x, s, kv_dtype, z=0.0):
    """Dequantised ``x`` under scale ``s`` and zero point ``z`` (``x - z`` in float32 as the cache computes it)."""
    d = (np.asarray(x, np.float32) - np.asarray(z, np.float32)).astype(np.float64)
    q = np.clip(np.where(s > 0, d / np.where(s > 0, s, 1.0), 0.0), -QMAX[kv_dtype], QMAX[kv_dtype])
    q = np.round(q) if kv_dtype == "int8" else q.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return q * s + np.asarray(z, np.float64)


def _np_mid(x):
    x = np.asarray(x, np.float32)
    return (x.max(0) * np.float32(0.5) + x.min(0) * np.float32(0.5)).astype(ml_dtypes.bfloat16).astype(np.float64)


def _prompt_cache(kv_dtype, k0, v0):
    """Every layer's prompt written (`write_chunk`), stacked ``[L, ...]`` as the engine holds it."""
    layers = init_cache(CFG, B, S, page_size=PS, dtype=jnp.float32, kv_dtype=kv_dtype, summaries=()).layers
    T = k0.shape[-2]
    out = [write_chunk(layer_view(layers, i), jnp.asarray(k0[i]), jnp.asarray(v0[i]), 0,
                       jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.asarray(LENGTHS)) for i in range(L)]
    return jax.tree.map(lambda *a: jnp.stack(a), *out)


def _decode_writes(layers, k_new, v_new, length):
    """One decode step's writes: every layer's token, the stack carried through a layer scan."""
    def body(layers, xs):
        i, k, v = xs
        return append_token(layers, k, v, length, length, length + 1, PS, layer=i), None

    return jax.lax.scan(body, layers, (jnp.arange(L), k_new, v_new))[0]


def _expected(kv_dtype, x0, xs, length, per_channel):
    """The documented rule from the true values, for one (layer, row, head): the page the appends
    start in, ``{slot: dequantised value}`` of its live slots, its scale and its zero point."""
    qmax = QMAX[kv_dtype]
    page = length // PS
    slots = range(page * PS, page * PS + PS)
    vals = {s: x0[s] for s in slots if s < length}
    red = (lambda a: np.abs(a).max(0)) if per_channel else (lambda a: np.abs(a).max())
    scale, deq, zero = None, {}, np.zeros(())
    if vals:
        if per_channel:
            zero = _np_mid(np.stack(list(vals.values())))
        scale = _np_scale(red(np.stack(list(vals.values())).astype(np.float32) - np.float32(zero)), qmax)
        deq = {s: _np_quant(x, scale, kv_dtype, zero) for s, x in vals.items()}
    elif per_channel:  # the first append opens the page: the previous page's zero points
        zero = _np_mid(x0[(page - 1) * PS:page * PS])
    for i, x in enumerate(xs):
        need = _np_scale(red(np.asarray(x, np.float32)[None] - np.asarray(zero, np.float32)), qmax)
        scale = need if scale is None else np.maximum(scale, need)
        deq = {t: _np_quant(d, scale, kv_dtype, zero) for t, d in deq.items()}
        deq[length + i] = _np_quant(x, scale, kv_dtype, zero)
    return page, deq, scale, zero


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_stacked_quantized_append_in_a_layer_scan_follows_the_rule(rng, kv_dtype):
    """Three decode steps of writes (each a jitted layer scan carrying the stack, the cache donated)
    against the numpy simulation: scales exact, zero points exact, every live slot's dequantised value
    exact, positions written, and the layers and pages no write touched unchanged."""
    T0 = 8
    k0, v0 = (rng.standard_normal((L, B, H, T0, D)).astype(np.float32) for _ in range(2))
    k0[..., 3] += 20.0  # a key channel with an offset (what zero points are for)
    k_new, v_new = (rng.standard_normal((STEPS, L, B, H, D)).astype(np.float32) for _ in range(2))
    k_new[1] *= 30.0  # the second token needs larger scales: its page's entries are re-quantised
    v_new[1] *= 30.0
    layers = _prompt_cache(kv_dtype, k0, v0)
    untouched = np.asarray(layers.k)[:, :, :, 2 * PS:].copy()
    step = jax.jit(_decode_writes, donate_argnums=0)
    length = LENGTHS.copy()
    for i in range(STEPS):
        layers = step(layers, jnp.asarray(k_new[i]), jnp.asarray(v_new[i]), jnp.asarray(length, jnp.int32))
        length = length + 1
    got = {name: np.asarray(getattr(layers, name), np.float64) for name in ("k", "v", "k_scale", "k_zero", "v_scale")}
    for li in range(L):
        for b in range(B):
            for h in range(H):
                for name, x0, xs, per_channel in (("k", k0, k_new, True), ("v", v0, v_new, False)):
                    page, deq, scale, zero = _expected(kv_dtype, x0[li, b, h], xs[:, li, b, h], LENGTHS[b], per_channel)
                    sc = got[name + "_scale"][li, b, h, page]
                    np.testing.assert_array_equal(sc, scale, err_msg=f"{name} scale, layer {li} row {b} head {h}")
                    zr = got["k_zero"][li, b, h, page] if per_channel else 0.0
                    np.testing.assert_array_equal(zr, np.broadcast_to(zero, np.shape(zr)))
                    slots = sorted(deq)
                    sc_slot = sc if per_channel else np.asarray(sc)[..., None]
                    value = got[name][li, b, h, slots] * sc_slot + zr
                    np.testing.assert_array_equal(value, np.stack([deq[t] for t in slots]),
                                                  err_msg=f"{name} values, layer {li} row {b} head {h}")
    pos = np.asarray(layers.positions)
    for b in range(B):
        np.testing.assert_array_equal(pos[:, b, :, LENGTHS[b]:LENGTHS[b] + STEPS],
                                      np.broadcast_to(LENGTHS[b] + np.arange(STEPS), (L, H, STEPS)))
    np.testing.assert_array_equal(np.asarray(layers.k)[:, :, :, 2 * PS:], untouched)


def _ops(op):
    """Every operation nested in ``op`` (an MLIR module or operation), depth first."""
    for region in op.regions:
        for block in region.blocks:
            for o in block.operations:
                yield o
                yield from _ops(o)


@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3fn"])
def test_stacked_quantized_append_touches_the_stack_only_through_one_gather_and_one_scatter(kv_dtype):
    """The traced layer scan of the decode writes (StableHLO): every op with a stack-sized codes operand
    or result is the loop's or a call's plumbing, the page's gather (its result used by an
    optimization barrier alone) or the page's scatter, all on the stack's own ``[L, B, H, S, D]``; none
    reshapes, slices or converts it (the old write reshaped the stack to pages and sliced a layer
    out of it, and XLA:GPU then copied the stack four times per layer). For int8 the compiled CPU
    program's temporaries stay below a quarter of the codes (XLA:CPU has no float8 scatter: it widens
    a float8 stack to f16 around the write, a CPU-only temporary the GPU program does not have)."""
    from jax._src.lib.mlir import ir

    ps, capacity = 32, 256  # scales (widened to f32 by XLA:CPU around their scatters) are 4/ps of the codes
    layers = init_cache(CFG, B, capacity, page_size=ps, dtype=jnp.float32, kv_dtype=kv_dtype, summaries=()).layers
    stack = list(layers.k.shape)
    per_layer = int(np.prod(stack[1:]))

    def writes(layers, k_new, v_new, length):
        def body(layers, xs):
            i, k, v = xs
            return append_token(layers, k, v, length, length, length + 1, ps, layer=i), None

        return jax.lax.scan(body, layers, (jnp.arange(L), k_new, v_new))[0]

    lowered = jax.jit(writes, donate_argnums=0).lower(layers, jnp.zeros((L, B, H, D)), jnp.zeros((L, B, H, D)),
                                                     jnp.zeros((B,), jnp.int32))
    code = {"int8": "i8", "float8_e4m3fn": "f8E4M3FN"}[kv_dtype]  # MLIR's name of the codes' type
    plumbing = {"stablehlo.while", "func.call", "stablehlo.return", "func.return"}
    seen = []
    for op in _ops(lowered.compiler_ir("stablehlo").operation):
        values = list(op.operands) + list(op.results)
        big = [list(v.type.shape) for v in values if isinstance(v.type, ir.RankedTensorType)
               and str(v.type.element_type) == code and np.prod(v.type.shape) >= per_layer]
        if not big:
            continue
        seen.append(op.name)
        assert all(shape == stack for shape in big), f"{op.name} makes {big} of the {stack} stack"
        assert op.name in plumbing | {"stablehlo.gather", "stablehlo.scatter"}, f"the stack goes through {op.name}"
        if op.name == "stablehlo.gather":
            users = {use.owner.name for use in op.results[0].uses}
            assert users == {"stablehlo.optimization_barrier"}, f"the page read from the stack feeds {users}"
    assert seen.count("stablehlo.gather") == 2 and seen.count("stablehlo.scatter") == 2, seen  # k's page, v's
    if kv_dtype == "int8":
        temp = lowered.compile().memory_analysis().temp_size_in_bytes
        codes = 2 * layers.k.size * layers.k.dtype.itemsize
        assert temp < codes / 4, (temp, codes)
