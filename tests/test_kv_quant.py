"""Quantised KV caches (issue #39): int8 / float8_e4m3fn codes with power-of-two scales per page
(keys per page and channel, values per page and KV head), against numpy references.

Every random input is drawn from the run's seed (`seeded_rng`, the ``rng`` fixture; printed, and
replayable with ``pytest --seed N``).
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import seeded_rng
from test_semanticache import CFG as SC_CFG
from test_semanticache import masked as sc_masked
from test_semanticache import planted as sc_planted
from test_semanticache import ref_compress as sc_ref_compress

from sparsekv_jax import cli
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import (
    SCALE_DTYPE,
    append_token,
    dequantize,
    dequantize_kv,
    init_cache,
    layer_view,
    page_scales,
    page_zeros,
    quantize,
    write_chunk,
    write_tokens,
)
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import expected_shapes, params_from_arrays
from sparsekv_jax.models.rope import inverse_frequencies
from sparsekv_jax.pallas.decode import decode_attention, decode_attention_reference
from sparsekv_jax.pallas.testing import random_page_lists, rel_err
from sparsekv_jax.policies import CHESS, Dense, SemantiCache, parse_policy
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.common import write_entries, write_kept

QMAX = {"int8": 127.0, "float8_e4m3fn": 448.0}
NP_CODE = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}
KV_DTYPES = ("int8", "float8_e4m3fn")

# The cache writes the unit tests below call, jitted: one program each per shape and code dtype (eagerly,
# each of their many small ops compiled on its own: 8 CPU s for one `write_tokens` test, 2.7 s jitted).
# `generate` runs them inside its one program; the checks compare with numpy exactly all the same.
write_chunk_jit = jax.jit(write_chunk)
write_tokens_jit = jax.jit(write_tokens)
append_token_jit = jax.jit(append_token, static_argnums=6)  # page_size
write_kept_jit = jax.jit(write_kept, static_argnums=3)  # capacity
dequantize_f32 = jax.jit(lambda kv: dequantize_kv(kv, jnp.float32))
write_entries_jit = jax.jit(write_entries, static_argnums=6)  # capacity


def _np_scale(amax: np.ndarray, qmax: float) -> np.ndarray:
    """The smallest power of two s with amax / s <= qmax (0 for amax 0), in float64."""
    with np.errstate(divide="ignore"):
        s = 2.0 ** np.ceil(np.log2(amax.astype(np.float64) / qmax))
    return np.where(amax > 0, s, 0.0)


def _np_quant(x: np.ndarray, s: np.ndarray, kv_dtype: str, z: np.ndarray | float = 0.0) -> np.ndarray:
    """Dequantised ``x`` under scale ``s`` and zero point ``z`` (numpy; ``x - z`` in float32 as the
    cache computes it; fp8 through ml_dtypes' own cast)."""
    d = (np.asarray(x, np.float32) - np.asarray(z, np.float32)).astype(np.float64)
    q = np.clip(np.where(s > 0, d / np.where(s > 0, s, 1.0), 0.0), -QMAX[kv_dtype], QMAX[kv_dtype])
    q = np.round(q) if kv_dtype == "int8" else q.astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return q * s + np.asarray(z, np.float64)


def _np_mid(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """A key zero point: the mid-range over ``axis`` (float32), rounded to bf16."""
    x = np.asarray(x, np.float32)
    mid = x.max(axis) * np.float32(0.5) + x.min(axis) * np.float32(0.5)
    return mid.astype(ml_dtypes.bfloat16).astype(np.float64)


def _outliers(rng: np.random.Generator, shape: tuple[int, ...], D: int) -> np.ndarray:
    """Normal draws with a few channels 30x larger (KIVI's key outliers)."""
    x = rng.standard_normal(shape).astype(np.float32)
    x[..., rng.choice(D, 2, replace=False)] *= 30.0
    return x


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_round_trip_matches_numpy_and_error_bounds(rng, kv_dtype):
    B, H, P, ps, D = 2, 3, 5, 8, 16
    S = P * ps
    k = _outliers(rng, (B, H, S, D), D)
    v = rng.standard_normal((B, H, S, D)).astype(np.float32) * rng.uniform(0.1, 5, (B, H, 1, 1)).astype(np.float32)
    lengths = np.array([S - 5, 13])
    valid = np.broadcast_to(np.arange(S)[None, None] < lengths[:, None, None], (B, H, S))
    ks, vs = page_scales(jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid), ps, jnp.dtype(kv_dtype))
    assert ks.shape == (B, H, P, D) and vs.shape == (B, H, P) and ks.dtype == vs.dtype == SCALE_DTYPE
    # numpy: per page and channel for keys, per page for values, over the live slots only
    live = valid[..., None]
    ka = np.where(live, np.abs(k), 0).reshape(B, H, P, ps, D).max(3)
    va = np.where(live, np.abs(v), 0).reshape(B, H, P, ps * D).max(3)
    ks_np, vs_np = _np_scale(ka, QMAX[kv_dtype]), _np_scale(va, QMAX[kv_dtype])
    np.testing.assert_array_equal(np.asarray(ks, np.float64), ks_np)
    np.testing.assert_array_equal(np.asarray(vs, np.float64), vs_np)
    assert (ks_np[1, :, 2:] == 0).all() and (vs_np[1, :, 2:] == 0).all()  # row 1's pages past slot 13: empty
    assert (ks_np[0] > 0).all()
    k_slot, v_slot = np.repeat(ks_np, ps, axis=2), np.repeat(vs_np, ps, axis=2)[..., None]
    kq = quantize(jnp.asarray(k), jnp.asarray(k_slot, jnp.float32), jnp.dtype(kv_dtype))
    vq = quantize(jnp.asarray(v), jnp.asarray(v_slot, jnp.float32), jnp.dtype(kv_dtype))
    assert kq.dtype == jnp.dtype(kv_dtype)
    k_hat = np.asarray(dequantize(kq, jnp.asarray(k_slot, jnp.float32)), np.float64)
    v_hat = np.asarray(dequantize(vq, jnp.asarray(v_slot, jnp.float32)), np.float64)
    np.testing.assert_array_equal(np.where(live, k_hat, 0), np.where(live, _np_quant(k, k_slot, kv_dtype), 0))
    np.testing.assert_array_equal(np.where(live, v_hat, 0), np.where(live, _np_quant(v, v_slot, kv_dtype), 0))
    for x, x_hat, s in ((k, k_hat, k_slot), (v, v_hat, v_slot)):
        err = np.abs(np.where(live, x - x_hat, 0))
        if kv_dtype == "int8":  # half a step of the page's (channel's) scale
            assert (err <= s / 2 + 1e-12).all()
        else:  # half an fp8 ulp: 2^-4 relative, or half the smallest subnormal (2^-10 of the scale)
            assert (err <= np.abs(x) * 2.0 ** -4 + s * 2.0 ** -10 + 1e-12).all()
    # per-channel key scales: a channel's step follows its own largest entry (< 2 amax / qmax), not the
    # outlier channels' (30x larger)
    assert (ks_np <= 2 * ka / QMAX[kv_dtype] + 1e-30).all()
    # and every bf16 value of the dequantised codes is exact (powers of two, codes fit bf16)
    np.testing.assert_array_equal(np.asarray(dequantize(kq, jnp.asarray(k_slot, jnp.float32), jnp.bfloat16),
                                             np.float64), k_hat)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_key_channel_with_a_large_offset_keeps_its_variation(rng, kv_dtype):
    """Qwen2's k_proj bias puts near-constant offsets into some key channels: here channel 3 is
    50 + 0.5 noise. A symmetric scale spends the codes on the offset (fp8: a step of 4 at 50, 3
    mantissa bits; int8: 0.5), losing the variation; the page's zero point (the channel's
    mid-range, bf16) leaves the codes only the variation. The cache's keys written by
    `write_chunk` equal numpy's asymmetric round trip exactly, and their error in the offset channel
    is a small part of the noise, where numpy's symmetric round trip (the codes before zero points)
    is not."""
    B, H, P, ps, D = 2, 2, 3, 16, 16
    S = P * ps
    cfg = ModelConfig(family="llama", vocab_size=61, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=H,
                      head_dim=D, intermediate_size=48, max_position_embeddings=512)
    k = rng.standard_normal((B, H, S, D)).astype(np.float32)
    k[..., 3] = 50.0 + 0.5 * rng.standard_normal((B, H, S)).astype(np.float32)
    v = rng.standard_normal((B, H, S, D)).astype(np.float32)
    empty = layer_view(init_cache(cfg, B, S, page_size=ps, dtype=jnp.float32, kv_dtype=kv_dtype).layers, 0)
    kv = write_chunk_jit(empty, jnp.asarray(k), jnp.asarray(v), 0, jnp.broadcast_to(jnp.arange(S), (B, S)))
    got = np.asarray(dequantize_f32(kv)[0], np.float64)
    pages = k.reshape(B, H, P, ps, D)
    zero = _np_mid(pages, axis=3)  # [B, H, P, D]
    off = pages - zero[:, :, :, None].astype(np.float32)
    scale = _np_scale(np.abs(off).max(3), QMAX[kv_dtype])
    want = _np_quant(pages, scale[:, :, :, None], kv_dtype, zero[:, :, :, None]).reshape(B, H, S, D)
    np.testing.assert_array_equal(np.asarray(kv.k_zero, np.float64), zero)
    np.testing.assert_array_equal(np.asarray(kv.k_scale, np.float64), scale)
    np.testing.assert_array_equal(got, want)
    sym = _np_quant(pages, _np_scale(np.abs(pages).max(3), QMAX[kv_dtype])[:, :, :, None], kv_dtype).reshape(k.shape)
    err, err_sym = np.abs(got - k)[..., 3].max(), np.abs(sym - k)[..., 3].max()
    bar = {"int8": 0.02, "float8_e4m3fn": 0.15}[kv_dtype]  # of a channel whose noise has std 0.5
    assert err <= bar < err_sym, (err, err_sym)
    # every channel: int8 within half a step, fp8 within half an ulp of its code (2^-4 of |k - zero|)
    e = np.abs(got - k).reshape(B, H, P, ps, D)
    if kv_dtype == "int8":
        assert (e <= scale[:, :, :, None] / 2 + 1e-6).all()
    else:
        assert (e <= np.abs(off) * 2.0 ** -4 + scale[:, :, :, None] * 2.0 ** -10 + 1e-6).all()


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_compaction_moves_keys_with_zero_points_losslessly(rng, kv_dtype):
    """`write_kept` keeping every entry in place (a covering budget) writes the same keys, values
    and zero points (keys dequantised in float32, the pages' old zero points kept where a new page's
    entries share them); keeping a page's second half moves those keys to another page, each
    within half an fp8 ulp / int8 step of the new page of its true value."""
    L, B, H, D, ps, T = 1, 2, 2, 16, 8, 32
    cfg = ModelConfig(family="llama", vocab_size=61, hidden_size=32, num_layers=L, num_heads=2, num_kv_heads=H,
                      head_dim=D, intermediate_size=48, max_position_embeddings=512)
    k = rng.standard_normal((B, H, T, D)).astype(np.float32)
    k[..., 3] += 50.0
    v = rng.standard_normal((B, H, T, D)).astype(np.float32)
    cache = init_cache(cfg, B, T, page_size=ps, dtype=jnp.float32, kv_dtype=kv_dtype, summaries=())
    layer = write_chunk_jit(layer_view(cache.layers, 0), jnp.asarray(k), jnp.asarray(v), 0,
                        jnp.broadcast_to(jnp.arange(T), (B, T)))
    cache = cache.replace(layers=jax.tree.map(lambda x: x[None], layer), length=jnp.full((B,), T, jnp.int32),
                          next_position=jnp.full((B,), T, jnp.int32))
    same = write_kept_jit(cache, jnp.broadcast_to(jnp.arange(T), (L, B, H, T)), jnp.full((B,), T), T)
    # the same values and zero points (fp8 may store a page at half the scale and twice the codes: its
    # largest code rounded down to 224 or less)
    np.testing.assert_array_equal(np.asarray(same.layers.k_zero), np.asarray(cache.layers.k_zero))
    for x, y in zip(dequantize_f32(same.layers), dequantize_f32(cache.layers), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    half = write_kept_jit(cache, jnp.broadcast_to(jnp.arange(ps // 2, T, 2), (L, B, H, (T - ps // 2) // 2)),
                      jnp.full((B,), (T - ps // 2) // 2), T)
    got = np.asarray(dequantize_f32(layer_view(half.layers, 0))[0], np.float64)[:, :, :(T - ps // 2) // 2]
    true = k[:, :, ps // 2::2]
    step = np.repeat(np.asarray(half.layers.k_scale[0], np.float64), ps, axis=2)[:, :, :true.shape[2]]
    kz = np.repeat(np.asarray(half.layers.k_zero[0], np.float64), ps, axis=2)[:, :, :true.shape[2]]
    old = np.asarray(dequantize_f32(layer)[0], np.float64)[:, :, ps // 2::2]  # before the move
    bound = step / 2 if kv_dtype == "int8" else np.abs(old - kz) * 2.0 ** -4 + step * 2.0 ** -10
    assert (np.abs(got - old) <= bound + 1e-6).all()


def _quantized_inputs(rng, kv_dtype, B, Hq, Hkv, D, P, ps, q_dtype, zero=False):
    """q, codes, scales, lengths and key zero points (None unless ``zero``: then two channels carry
    offsets of +-50, Qwen2's k_proj bias) of a random quantised cache; slots past the length hold junk
    codes (NaN for fp8) and pages wholly past it NaN scales and zero points."""
    S = P * ps
    lengths = np.asarray([S - int(rng.integers(1, ps)), int(rng.integers(1, S))] + [S] * (B - 2), np.int32)
    k = _outliers(rng, (B, Hkv, S, D), D)
    if zero:
        k[..., :2] += np.array([50.0, -50.0], np.float32)
    v = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    valid = np.broadcast_to(np.arange(S)[None, None] < lengths[:, None, None], (B, Hkv, S))
    dt = jnp.dtype(kv_dtype)
    kz = page_zeros(jnp.asarray(k), jnp.asarray(valid), ps) if zero else None
    ks, vs = page_scales(jnp.asarray(k), jnp.asarray(v), jnp.asarray(valid), ps, dt, k_zero=kz)
    kq = np.asarray(quantize(jnp.asarray(k), jnp.repeat(ks, ps, axis=-2), dt,
                             None if kz is None else jnp.repeat(kz, ps, axis=-2)))
    vq = np.asarray(quantize(jnp.asarray(v), jnp.repeat(vs, ps, axis=-1)[..., None], dt))
    junk = np.asarray(127 if kv_dtype == "int8" else np.nan).astype(NP_CODE[kv_dtype])
    kq = np.where(valid[..., None], kq, junk)
    vq = np.where(valid[..., None], vq, junk)
    used = np.arange(P)[None, None] < -(-lengths[:, None, None] // ps)
    ks = np.where(used[..., None], np.asarray(ks, np.float32), np.nan)
    vs = np.where(used, np.asarray(vs, np.float32), np.nan)
    if zero:
        kz = jnp.asarray(np.where(used[..., None], np.asarray(kz, np.float32), np.nan), SCALE_DTYPE)
    q = rng.standard_normal((B, Hq, D)).astype(np.float32)
    return (jnp.asarray(q, q_dtype), jnp.asarray(kq), jnp.asarray(vq), jnp.asarray(ks, SCALE_DTYPE),
            jnp.asarray(vs, SCALE_DTYPE), jnp.asarray(lengths), kz)


def _np_dequant(codes, scales, ps, axis_channels: bool, zeros=None) -> np.ndarray:
    c = np.asarray(codes).astype(np.float64)
    s = np.repeat(np.asarray(scales, np.float64), ps, axis=2)
    z = 0.0 if zeros is None else np.repeat(np.asarray(zeros, np.float64), ps, axis=2)
    return c * (s if axis_channels else s[..., None]) + z


@pytest.mark.share(2)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("sparse,stacked,q_dtype,zero", [(False, False, jnp.float32, False),
                                                         (True, True, jnp.bfloat16, False),
                                                         (False, True, jnp.float32, True),
                                                         (True, False, jnp.bfloat16, True)])
def test_pallas_kernel_on_quantized_cache_matches_reference(rng, kv_dtype, sparse, stacked, q_dtype, zero):
    """The kernel (interpreted) against its jnp reference and numpy's dequantised cache; with
    ``zero``, keys with +-50 offsets in two channels stored against their pages' zero points."""
    B, Hq, Hkv, D, P, ps = 3, 8, 2, 32, 6, 16
    q, kq, vq, ks, vs, lengths, kz = _quantized_inputs(rng, kv_dtype, B, Hq, Hkv, D, P, ps, q_dtype, zero)
    kw = {}
    if sparse:
        ids, counts = random_page_lists(rng, np.asarray(lengths), Hkv, P, ps, list_len=P - 2)
        counts[1, 0] = 0  # an empty selection
        kw = dict(page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts))
        # pages not selected: NaN scales too, so a read of one shows
        sel = np.zeros((B, Hkv, P), bool)
        for b in range(B):
            for h in range(Hkv):
                sel[b, h, ids[b, h, :counts[b, h]]] = True
        ks = jnp.where(jnp.asarray(sel)[..., None], ks, jnp.nan).astype(SCALE_DTYPE)
        vs = jnp.where(jnp.asarray(sel), vs, jnp.nan).astype(SCALE_DTYPE)
        if zero:
            kz = jnp.where(jnp.asarray(sel)[..., None], kz, jnp.nan).astype(SCALE_DTYPE)
    args = (kq, vq, ks, vs) + ((kz,) if zero else ())
    if stacked:  # layer 1 of a 2-layer stack; layer 0 all NaN scales
        args = tuple(jnp.stack([jnp.full_like(x, jnp.nan) if x.dtype == SCALE_DTYPE else x, x]) for x in args)
    out = decode_attention(q, args[0], args[1], lengths, page_size=ps, interpret=True, block_k=32,
                           k_scale=args[2], v_scale=args[3], k_zero=args[4] if zero else None,
                           layer=1 if stacked else None, **kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert np.isfinite(np.asarray(out, np.float32)).all(), "NaN in the kernel's output: a masked slot was read"
    ref = decode_attention_reference(q, kq, vq, lengths, page_size=ps, k_scale=ks, v_scale=vs, k_zero=kz, **kw)
    tol = 1e-5 if q_dtype == jnp.float32 else 2e-2
    assert rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32)) <= tol
    # the same attention over numpy's dequantised cache (junk slots zeroed; the reference masks them)
    valid = (np.arange(P * ps)[None, None] < np.asarray(lengths)[:, None, None])[..., None]
    k_np = np.where(valid, np.nan_to_num(_np_dequant(kq, ks, ps, True, kz)), 0.0)
    v_np = np.where(valid, np.nan_to_num(_np_dequant(vq, vs, ps, False)), 0.0)
    want = decode_attention_reference(q.astype(jnp.float32), jnp.asarray(k_np, jnp.float32),
                                      jnp.asarray(v_np, jnp.float32), lengths, page_size=ps, **kw)
    # against exact fp32 arithmetic, bf16 queries meet keys whose dequantised values carry the +-50 offsets:
    # bf16's 3 significant digits there cost more (seed 268642678: 0.0202 with fp8 codes)
    exact_tol = tol if q_dtype == jnp.float32 or not zero else 4e-2
    assert rel_err(np.asarray(out, np.float32), np.asarray(want)) <= exact_tol


def test_kernel_refuses_mismatched_scales():
    q = jnp.zeros((1, 2, 16), jnp.float32)
    k = jnp.zeros((1, 1, 32, 16), jnp.int8)
    with pytest.raises(ValueError, match="k_scale must be"):
        decode_attention(q, k, k, jnp.array([3]), page_size=16, interpret=True,
                         k_scale=jnp.zeros((1, 1, 2, 8)), v_scale=jnp.zeros((1, 1, 2)))
    with pytest.raises(ValueError, match="int8 or float8_e4m3fn codes"):
        decode_attention(q, k.astype(jnp.float32), k.astype(jnp.float32), jnp.array([3]), page_size=16,
                         interpret=True, k_scale=jnp.zeros((1, 1, 2, 16)), v_scale=jnp.zeros((1, 1, 2)))


TINY = ModelConfig(family="llama", vocab_size=61, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=48, max_position_embeddings=512, eos_token_ids=(0,))


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_append_into_a_partly_filled_page_rescales_it(rng, kv_dtype):
    """A prompt leaves row 0's last page partly filled; appends (the third 40x larger than the
    rest) re-scale that page: its scale is max(old, new token's), its earlier entries re-quantised
    with it; its key zero points stay those of the prompt's entries (their mid-range), and a page an
    append opens (row 1's page 1) takes the previous page's. Checked against a numpy simulation of
    that rule, and the error against the true values stays below one step of the page's final scale."""
    B, H, D, ps = 2, 2, 16, 8
    cfg = ModelConfig(family="llama", vocab_size=61, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=H,
                      head_dim=D, intermediate_size=48, max_position_embeddings=512)
    cache = init_cache(cfg, B, 32, page_size=ps, dtype=jnp.float32, kv_dtype=kv_dtype)
    lengths = np.array([5, 8])  # row 0: 5 of page 0; row 1: page 0 full, appends open page 1
    T = 8
    k0 = rng.standard_normal((B, H, T, D)).astype(np.float32)
    v0 = rng.standard_normal((B, H, T, D)).astype(np.float32)
    kv = write_chunk_jit(layer_view(cache.layers, 0), jnp.asarray(k0), jnp.asarray(v0), 0,
                     jnp.broadcast_to(jnp.arange(T), (B, T)), jnp.asarray(lengths))
    n_new = 4
    k_new = rng.standard_normal((n_new, B, H, D)).astype(np.float32)
    v_new = rng.standard_normal((n_new, B, H, D)).astype(np.float32)
    k_new[2] *= 40.0
    v_new[2] *= 40.0
    length = lengths.copy()
    for i in range(n_new):
        if i == 2:
            before = kv  # row 0's page 0 before its last write (the outlier, slot 7)
        kv = append_token_jit(kv, jnp.asarray(k_new[i]), jnp.asarray(v_new[i]), jnp.asarray(length),
                          jnp.asarray(length), jnp.asarray(length + 1), ps)
        length = length + 1
    # numpy simulation of the documented rule, from the true values
    qmax = QMAX[kv_dtype]
    for b in range(B):
        for h in range(H):
            for name, x0, xs, per_channel in (("k", k0, k_new, True), ("v", v0, v_new, False)):
                page = lengths[b] // ps  # the page the appends start in
                slots = list(range(page * ps, page * ps + ps))
                vals = {s: x0[b, h, s] for s in slots if s < lengths[b]}
                scale, deq, zero = None, {}, np.zeros(())
                red = (lambda a: np.abs(a).max(0)) if per_channel else (lambda a: np.abs(a).max())

                def off(a, zero=None):  # x - zero in float32, as the cache computes it
                    return np.asarray(a, np.float32) - np.asarray(zero, np.float32)

                if vals:
                    if per_channel:
                        zero = _np_mid(np.stack(list(vals.values())))
                    scale = _np_scale(red(off(np.stack(list(vals.values())), zero)), qmax)
                    deq = {s: _np_quant(x, scale, kv_dtype, zero) for s, x in vals.items()}
                elif per_channel:  # the first append opens the page: the previous page's zero points
                    assert page > 0
                    zero = _np_mid(x0[b, h, (page - 1) * ps:page * ps])
                for i in range(n_new):
                    s = lengths[b] + i
                    if s >= page * ps + ps:
                        break
                    need = _np_scale(red(off(xs[i, b, h][None], zero)), qmax)
                    new_scale = need if scale is None else np.maximum(scale, need)
                    deq = {t: _np_quant(d, new_scale, kv_dtype, zero) for t, d in deq.items()}
                    deq[s] = _np_quant(xs[i, b, h], new_scale, kv_dtype, zero)
                    vals[s] = xs[i, b, h]
                    scale = new_scale
                stored = np.asarray(getattr(kv, name), np.float64)[b, h]
                sc = np.asarray(getattr(kv, name + "_scale"), np.float64)[b, h, page]
                np.testing.assert_array_equal(sc, scale)
                zr = np.asarray(kv.k_zero, np.float64)[b, h, page] if per_channel else 0.0
                np.testing.assert_array_equal(zr, np.broadcast_to(zero, np.shape(zr)))
                got = stored[sorted(deq)] * sc + zr
                np.testing.assert_array_equal(got, np.stack([deq[t] for t in sorted(deq)]))
                if kv_dtype == "int8":
                    err = np.abs(got - np.stack([vals[t] for t in sorted(deq)]))
                    assert (err < scale).all(), (name, b, h)
    # the summaries of row 0's page 0, last written by the outlier (slot 7): from its earlier entries
    # dequantised (with the scale they had) and the new key as given
    keys = (np.asarray(before.k, np.float64)[0, :, :ps] * np.asarray(before.k_scale, np.float64)[0, :, 0][:, None]
            + np.asarray(before.k_zero, np.float64)[0, :, 0][:, None])
    keys[:, 7] = k_new[2, 0]
    b, page, live = 0, 0, np.ones(ps, bool)
    np.testing.assert_allclose(np.asarray(kv.page_max)[b, :, page], np.where(live[:, None], keys, -np.inf).max(1),
                               rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.asarray(kv.page_sum)[b, :, page], np.where(live[:, None], keys, 0).sum(1),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_tokens_rescales_every_page_it_touches(rng, kv_dtype):
    """`write_tokens` (`extend`: a question read after compression) writes a run of tokens from
    each row's length across page boundaries: each touched page's scale is max(old, what its new
    tokens need) and its earlier entries are re-quantised with it (key zero points kept; a page
    the run opens gets its new keys' mid-range and a fresh scale), as a numpy simulation says;
    the pages' key maxima come from the entries as they were and the new keys as given."""
    B, H, D, ps, T = 2, 2, 16, 8, 11
    cfg = ModelConfig(family="llama", vocab_size=61, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=H,
                      head_dim=D, intermediate_size=48, max_position_embeddings=512)
    kv = layer_view(init_cache(cfg, B, 40, page_size=ps, dtype=jnp.float32, kv_dtype=kv_dtype).layers, 0)
    lengths = np.array([5, 16])  # row 0 starts mid-page 0 (touches pages 0-2), row 1 at page 2's start
    k0, v0 = (rng.standard_normal((B, H, 16, D)).astype(np.float32) for _ in range(2))
    kv = write_chunk_jit(kv, jnp.asarray(k0), jnp.asarray(v0), 0, jnp.broadcast_to(jnp.arange(16), (B, 16)),
                     jnp.asarray(lengths))
    k1, v1 = (rng.standard_normal((B, T, H, D)).astype(np.float32) * 3 for _ in range(2))
    written = np.arange(T)[None, :] < np.array([[T], [T - 2]])  # row 1's last two are padding
    slots = lengths[:, None] + np.arange(T)
    new_length = lengths + written.sum(1)
    pos = np.where(written, slots, -1)
    kv = kv.replace(positions=kv.positions.at[jnp.arange(B)[:, None], :, jnp.asarray(slots)].set(
        jnp.asarray(pos)[:, :, None]))
    before = kv
    kv = write_tokens_jit(kv, jnp.asarray(k1), jnp.asarray(v1), jnp.asarray(slots), jnp.asarray(written),
                      jnp.asarray(new_length))
    qmax = QMAX[kv_dtype]
    for b in range(B):
        for h in range(H):
            for name, new, per_channel in (("k", k1, True), ("v", v1, False)):
                codes = np.asarray(getattr(before, name), np.float64)[b, h]
                old_s = np.asarray(getattr(before, name + "_scale"), np.float64)[b, h]
                got = np.asarray(getattr(kv, name), np.float64)[b, h]
                got_s = np.asarray(getattr(kv, name + "_scale"), np.float64)[b, h]
                red = (lambda a: np.abs(a).max(0)) if per_channel else (lambda a: np.abs(a).max())
                for page in range(slots[b, 0] // ps, (slots[b, written[b]][-1]) // ps + 1):
                    mine = [t for t in range(T) if written[b, t] and slots[b, t] // ps == page]
                    old_z = np.asarray(before.k_zero, np.float64)[b, h, page] if per_channel else 0.0
                    fresh = per_channel and page * ps >= slots[b, 0]  # a page the run opens: new zero points
                    zero = _np_mid(np.stack([new[b, t, h] for t in mine])) if fresh else old_z
                    off = np.stack([new[b, t, h] for t in mine]).astype(np.float32) - np.asarray(zero, np.float32)
                    need = _np_scale(red(off), qmax)
                    scale = need if fresh else np.maximum(old_s[page], need)
                    np.testing.assert_array_equal(got_s[page], scale)
                    want = codes[page * ps:(page + 1) * ps] * old_s[page] + old_z
                    for t in mine:
                        want[slots[b, t] - page * ps] = new[b, t, h]
                    want = _np_quant(want, scale, kv_dtype, zero)
                    got_z = np.asarray(kv.k_zero, np.float64)[b, h, page] if per_channel else 0.0
                    np.testing.assert_array_equal(got_z, np.broadcast_to(zero, np.shape(got_z)))
                    np.testing.assert_array_equal(got[page * ps:(page + 1) * ps] * scale + got_z, want)
        # row 0's page 0: the prompt's 5 keys (dequantised) and 3 new ones
        keys = (np.asarray(before.k, np.float64)[b, :, :ps] * np.asarray(before.k_scale, np.float64)[b, :, 0][:, None]
                + np.asarray(before.k_zero, np.float64)[b, :, 0][:, None])
        if b == 0:
            keys[:, 5:8] = np.swapaxes(k1[0, :3], 0, 1)
            np.testing.assert_allclose(np.asarray(kv.page_max)[0, :, 0], keys.max(1), rtol=0, atol=1e-6)


def _random_params(cfg: ModelConfig, rng: np.random.Generator):
    """`random_params`' weights (norms near 1, the rest normal at scale 0.3) drawn with NumPy: drawn by JAX
    eagerly, each weight's shape compiled programs of its own."""
    return params_from_arrays(cfg, {
        name: jnp.asarray(1 - cfg.norm_weight_offset + 0.1 * rng.standard_normal(shape) if name.endswith("norm")
                          else 0.3 * rng.standard_normal(shape), jnp.float32)
        for name, shape in expected_shapes(cfg).items()})


@pytest.fixture(scope="module")
def tiny():
    params = _random_params(TINY, seeded_rng())
    tokens = seeded_rng().integers(1, TINY.vocab_size, (2, 40))
    return params, tokens


RAGGED_PATHS = ("jnp", "pallas")


def ragged_path(seed: int) -> str:
    """The decode path of this run's ragged-rows test, drawn from the run's ``seed``: the jnp
    attention or the (interpreted) Pallas kernel. Each is 5 programs (~20 CPU s); one a run covers
    both across runs, as tests/test_sharding.py's `int8_policy` does (a failure replays from the
    printed seed)."""
    return RAGGED_PATHS[int(np.random.default_rng([seed, 0x4A66]).integers(len(RAGGED_PATHS)))]


@pytest.mark.parametrize("kv_dtype", ["int8"])
def test_batch_of_two_ragged_rows_equals_each_row_alone(tiny, kv_dtype):
    """Scales come from each row's live slots only: row 1 (29 tokens, padded to 40 in the batch)
    gets the same cache codes and the same logits alone, through this run's decode path
    (`ragged_path`: the jnp path or the kernel, one of them a run)."""
    params, tokens = tiny
    lengths = np.array([40, 29])
    seed = int(seeded_rng().integers(1 << 30))
    path = ragged_path(seed)
    print(f"decode path {path!r} (drawn from {seed}: pytest --seed N replays it)")
    # the jnp path as the other tests here take it (the default "auto": jnp on a CPU)
    backends = {"jnp": Backend(kv_dtype=kv_dtype), "pallas": Backend(decode_attention="pallas", kv_dtype=kv_dtype)}
    for backend in (backends[path],):
        out = generate(params, Dense(), tokens, lengths=lengths, max_new_tokens=4, stop_tokens=(), backend=backend)
        forced = np.asarray(out.tokens)
        both = np.asarray(teacher_force(params, Dense(), tokens, forced, lengths=lengths, backend=backend)[0])
        for b in range(2):
            alone = np.asarray(teacher_force(params, Dense(), tokens[b:b + 1, :lengths[b]], forced[b:b + 1],
                                             backend=backend)[0])
            # the same codes up to a rounding tie the two programs' float keys may break differently: one key code
            # one step apart (--seed 424242, row 0, which has no padding; its scales equal) moved the logits 8.2e-3,
            # median 1.1e-5. A tie on the first forced token's key (--seed 150040923, row 0, both paths: 6e-6 at
            # step 0, then 5.7e-4 .. 1.6e-3, medians to 4.8e-4) moves every later step, so a row is held to 1e-3.
            # Row 1 ties too (--seed 699108900: 3 codes one step apart, equal scales; median 3.3e-4, max 2.8e-3).
            # Padding leaking into row 1's scales is caught exactly: its scales are compared below
            diff = np.abs(both[b] - alone[0])
            assert diff.max() < 2e-2 and np.median(diff) < 1e-3, (b, diff.max(), np.median(diff))
        solo = generate(params, Dense(), tokens[1:, :29], max_new_tokens=4, stop_tokens=(), backend=backend)
        n = 29 + 3  # the prompt and the appended tokens (the last one sampled is not written)
        pages = -(-n // 16)
        ks_batch = np.asarray(out.cache.layers.k_scale, np.float64)[:, 1, :, :pages]
        np.testing.assert_array_equal(ks_batch, np.asarray(solo.cache.layers.k_scale, np.float64)[:, 0, :, :pages])
        # codes equal up to a rounding tie the two programs' float keys may break differently
        step = np.repeat(ks_batch, 16, axis=2)[:, :, :n]
        codes = [np.asarray(c.cache.layers.k, np.float64)[:, r, :, :n] for c, r in ((out, 1), (solo, 0))]
        assert (np.abs(codes[0] - codes[1]) * step <= step + 1e-12).all()
        assert (codes[0] == codes[1]).mean() > 0.99


def test_quantized_cache_changes_logits_little_and_counts_its_bytes(tiny):
    """int8 / fp8 teacher-forced logits stay close to the float cache's; cache_bytes is the codes,
    the scales, the key zero points and the rest of the cache, byte for byte."""
    params, tokens = tiny
    lengths = np.array([40, 29])
    ref = generate(params, Dense(), tokens, lengths=lengths, max_new_tokens=4, stop_tokens=())
    forced = np.asarray(ref.tokens)
    ref_logits = np.asarray(teacher_force(params, Dense(), tokens, forced, lengths=lengths)[0])
    L, B, H, D = TINY.num_layers, 2, TINY.num_kv_heads, TINY.head_dim
    errs = {}
    # (this random model's logits move ~1-3% with a bf16 cache, 3-6% with int8, 9-19% with fp8: seeds 0-2)
    for kv_dtype, tol in (("int8", 0.15), ("float8_e4m3fn", 0.4)):
        backend = Backend(kv_dtype=kv_dtype)
        out = generate(params, Dense(), tokens, lengths=lengths, max_new_tokens=4, stop_tokens=(), backend=backend)
        got = np.asarray(teacher_force(params, Dense(), tokens, forced, lengths=lengths, backend=backend)[0])
        errs[kv_dtype] = rel_err(got, ref_logits)
        assert 0 < errs[kv_dtype] < tol, (kv_dtype, errs)
        S = out.cache.capacity
        P = S // 16
        codes = 2 * L * B * H * S * D * 1
        scales = 2 * L * B * H * P * D * 2 + L * B * H * P * 2  # key scales and zero points, value scales
        rest = L * B * H * S * (4 + 4) + 2 * B * 4  # positions, bias; length, next_position (Dense: no summaries)
        assert out.stats["cache_bytes"] == codes + scales + rest
        assert out.cache.kv_nbytes() == codes + scales
        assert ref.stats["cache_bytes"] == 2 * L * B * H * S * D * 4 + rest
    assert errs["int8"] < errs["float8_e4m3fn"]  # 7 bits and a sign per page against fp8's 3-bit significand


def test_compaction_and_pages_on_a_quantized_cache(tiny):
    """SnapKV's compaction and Quest's selection compose with int8: a budget covering the prompt
    gives exactly the logits of full attention on the same int8 cache (entries moved by
    compaction keep their values), and Quest's summaries are the float cache's (from the keys
    before quantisation), so it picks the same pages."""
    params, tokens = tiny
    lengths = np.array([40, 29])
    backend = Backend(kv_dtype="int8")
    dense = generate(params, Dense(), tokens, lengths=lengths, max_new_tokens=4, stop_tokens=(), backend=backend)
    forced = np.asarray(dense.tokens)
    want = np.asarray(teacher_force(params, Dense(), tokens, forced, lengths=lengths, backend=backend)[0])
    for spec in ("snapkv(budget=1.0, window=4)", "quest(budget=1.0)"):
        got = np.asarray(teacher_force(params, parse_policy(spec), tokens, forced, lengths=lengths,
                                       backend=backend)[0])
        np.testing.assert_array_equal(got, want, err_msg=spec)
    quest = parse_policy("quest(budget=16)")
    f = generate(params, quest, tokens, lengths=lengths, max_new_tokens=1, stop_tokens=())
    q = generate(params, quest, tokens, lengths=lengths, max_new_tokens=1, stop_tokens=(), backend=backend)
    for name in ("page_min", "page_max"):
        np.testing.assert_array_equal(np.asarray(getattr(q.cache.layers, name)),
                                      np.asarray(getattr(f.cache.layers, name)), err_msg=name)


def test_question_read_after_compression_on_a_quantized_cache(tiny):
    """The question-agnostic path (`extend` writes the suffix into a compressed int8 cache through
    `write_tokens`): a covering SnapKV equals full attention on the same int8 cache exactly, and
    both stay near the float cache's logits."""
    params, tokens = tiny
    lengths = np.array([40, 29])
    suffix = seeded_rng().integers(1, TINY.vocab_size, (2, 7))
    suffix_lengths = np.array([7, 4])
    kw = dict(lengths=lengths, suffix=suffix, suffix_lengths=suffix_lengths)
    backend = Backend(kv_dtype="int8")
    dense = generate(params, Dense(), tokens, max_new_tokens=4, stop_tokens=(), backend=backend, **kw)
    assert np.asarray(dense.cache.length).tolist() == [40 + 7 + 3, 29 + 4 + 3]
    forced = np.asarray(dense.tokens)
    want = np.asarray(teacher_force(params, Dense(), tokens, forced, backend=backend, **kw)[0])
    got = np.asarray(teacher_force(params, parse_policy("snapkv(budget=1.0, window=4)"), tokens, forced,
                                   backend=backend, **kw)[0])
    np.testing.assert_array_equal(got, want)
    exact = np.asarray(teacher_force(params, Dense(), tokens, forced, **kw)[0])
    assert 0 < rel_err(want, exact) < 0.15


def test_unknown_kv_dtype_is_refused_before_jit(tiny):
    with pytest.raises(ValueError, match="'int4'"):
        Backend(kv_dtype="int4")
    with pytest.raises(ValueError, match="'fp8'"):
        init_cache(TINY, 1, 16, kv_dtype="fp8")
    params, tokens = tiny
    with pytest.raises(ValueError, match="prefill_chunk=12 with a quantised cache"):
        generate(params, Dense(), tokens, max_new_tokens=2, prefill_chunk=12, backend=Backend(kv_dtype="int8"))
    with pytest.raises(SystemExit):
        cli.main(["info", "--kv-dtype", "int4"])


def test_info_counts_codes_and_scales(capsys):
    assert cli.main(["info", "--model", "llama3.1-8b", "--context", "1000", "--batch", "3", "--kv-dtype", "int8",
                     "--page-size", "16", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    L, H, D = 32, 8, 128
    pages = 63  # ceil(1000 / 16)
    assert info["kv_bytes_per_token"] == 2 * L * H * D
    assert info["kv_scale_bytes"] == 3 * L * H * pages * (2 * D + 1) * 2  # key scales and zero points, value scales
    assert info["kv_cache_bytes"] == 2 * L * H * D * 1000 * 3 + 3 * L * H * pages * (2 * D + 1) * 2
    assert cli.main(["info", "--model", "llama3.1-8b", "--context", "1000", "--batch", "3", "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert plain["kv_cache_bytes"] == 2 * L * H * D * 2 * 1000 * 3 and plain["kv_scale_bytes"] == 0


# The int8 cache on a device mesh (scales split as the cache, the decode kernel per device) is checked in
# tests/test_sharding.py (`test_int8_cache_on_a_device_mesh_equals_one_device`), in that file's child process on
# forced CPU devices: one process start, JAX import and set of meshes for both files.


# -- policies that read the cache's K/V themselves: CHESS's page vectors, SemantiCache's clustering ----

def _np_rotate(x: np.ndarray, pos: np.ndarray, inv_freq: np.ndarray) -> np.ndarray:
    """numpy RoPE (rotate-half layout) of ``x`` ``[..., D]`` by ``pos`` ``[...]`` (negative: back), float64."""
    ang = np.asarray(pos, np.float64)[..., None] * inv_freq
    x1, x2 = np.split(np.asarray(x, np.float64), 2, axis=-1)
    return np.concatenate([x1 * np.cos(ang) - x2 * np.sin(ang), x2 * np.cos(ang) + x1 * np.sin(ang)], axis=-1)


def _np_chess_scores(page_keys: np.ndarray, end: np.ndarray, ps: int, window: int,
                     extra: np.ndarray | None = None) -> list[np.ndarray]:
    """Per row, CHESS's centred scores of its pages in use: page vectors = the sum of ``page_keys``
    ``[L, B, H, S, D]`` over the page's slots before ``end[b]`` (plus ``extra`` ``[L, B, H, D]`` for the
    page holding slot ``end[b] - 1``) over those slots' count, flattened over layers and heads;
    anchor = the last ``window`` pages' mean less the mean page vector; score = vector · anchor."""
    out = []
    for b, n in enumerate(end):
        pages = -(-int(n) // ps)
        sums = [page_keys[:, b, :, p * ps:min((p + 1) * ps, n)].sum(2) for p in range(pages)]
        if extra is not None:
            sums[-1] = sums[-1] + extra[:, b]
        vec = np.stack([x.ravel() / (min((p + 1) * ps, n) - p * ps) for p, x in enumerate(sums)])
        out.append(vec @ (vec[max(0, pages - window):].mean(0) - vec.mean(0)))
    return out


@pytest.mark.parametrize("keys,consecutive,impl", [("pre_rope", True, "jnp"), ("pre_rope", True, "pallas"),
                                                   ("pre_rope", False, "jnp"), ("post_rope", True, "jnp")],
                         ids=["pre_rope-pages", "pre_rope-pages-pallas", "pre_rope-tokens", "post_rope"])
def test_chess_scores_on_an_int8_cache_are_those_of_its_dequantised_keys(rng, keys, consecutive, impl):
    """CHESS reads an int8 cache's keys as their values. Pre-RoPE: the page scores equal numpy's on
    the dequantised keys rotated back by their positions (by page sums and a rotation per page,
    jnp or the interpreted Pallas kernel, or key by key where positions have gaps). Post-RoPE: the
    cache's page sums (of the keys before quantisation, written with them) less the keys of the
    edge page taken back past the anchor's end, dequantised. Keys taken back (``end < length``)
    count in neither. The codes read as values would score otherwise (the check is not vacuous)."""
    L, H, D, B, S, cps, ps = TINY.num_layers, TINY.num_kv_heads, TINY.head_dim, 2, 192, 16, 32
    end = rng.integers(70, S - 24, B)  # the anchor's end: a page being taken back for regeneration
    end = end + (end % cps == 0)  # inside a cache page, so the page holding end - 1 holds keys taken back
    lengths = end + rng.integers(1, 20, B)
    inv_freq = inverse_frequencies(TINY)
    content = _outliers(rng, (L, B, H, S, D), D) + 0.5  # a common component, two outlier channels
    if consecutive:
        pos = rng.integers(0, 300, (B, H, 1)) + np.arange(S)
    else:
        pos = np.cumsum(rng.integers(1, 4, (B, H, S)), axis=-1) - 1
    pos = np.broadcast_to(pos, (L, B, H, S))
    k = _np_rotate(content, pos, inv_freq).astype(np.float32)
    pol = CHESS(page_size=ps, keys=keys).bind(Setup(TINY, backend=Backend(page_sums=impl).resolve()))
    cache = init_cache(TINY, B, S, page_size=cps, dtype=jnp.float32, kv_dtype="int8", summaries=pol.page_summaries)
    cache = write_entries_jit(cache, jnp.asarray(k), jnp.asarray(k), jnp.asarray(pos, jnp.int32),
                          jnp.zeros((L, B, H, S)), jnp.asarray(lengths, jnp.int32), S)
    assert cache.layers.k.dtype == jnp.int8 and np.asarray(cache.length).tolist() == lengths.tolist()
    got, used = (np.asarray(x, np.float64) for x in jax.jit(pol._page_scores)(cache, jnp.asarray(end, jnp.int32)))
    codes = np.asarray(cache.layers.k, np.float64)
    k_hat = _np_dequant(codes.reshape(L * B, H, S, D), np.asarray(cache.layers.k_scale).reshape(L * B, H, -1, D),
                        cps, True, np.asarray(cache.layers.k_zero).reshape(L * B, H, -1, D)).reshape(L, B, H, S, D)
    if keys == "pre_rope":  # a pre-RoPE rebuild reads the layer dequantised to bf16 (one rounding: zero points)
        k_bf16 = k_hat.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)
        want = _np_chess_scores(_np_rotate(k_bf16, -pos, inv_freq), end, ps, pol.window_pages)
        wrong = _np_chess_scores(_np_rotate(codes, -pos, inv_freq), end, ps, pol.window_pages)
    else:
        # the edge cache page's sum holds its keys below the length; those past the anchor's end leave it
        # as the cache holds them (dequantised)
        slot = np.arange(S)[None]
        stale = ((slot >= end[:, None]) & (slot < lengths[:, None])
                 & (slot // cps == ((end - 1) // cps)[:, None]))[None, :, None, :, None]
        want = _np_chess_scores(k, end, ps, pol.window_pages, np.where(stale, k - k_hat, 0).sum(3))
        wrong = _np_chess_scores(k, end, ps, pol.window_pages, np.where(stale, k - codes, 0).sum(3))
    apart = []
    for b in range(B):
        pages = len(want[b])
        np.testing.assert_array_equal(used[b], np.arange(used.shape[1]) < pages)
        scale = np.abs(want[b]).max()
        np.testing.assert_allclose(got[b, :pages], want[b], rtol=1e-4, atol=1e-3 * scale)
        apart.append(np.abs(wrong[b] / np.abs(wrong[b]).max() - want[b] / scale).max())
    # codes read as values would rank the pages otherwise (scaled alike, their shapes differ): by 10x
    # the tolerance above in some row (one row alone may come close: 0.045 and 0.007 in one CI draw)
    assert max(apart) > 1e-2, apart


@pytest.mark.parametrize("settings", [dict(budget=1.0, tau=0.6, chunk_size=8, window=4),
                                      dict(budget=0.3, chunk_size=8, sinks=2, window=2, search_steps=5)],
                         ids=["threshold", "budget"])
def test_semanticache_on_an_int8_cache_merges_its_dequantised_entries(rng, settings):
    """SemantiCache on an int8 cache = dequantise → compute → quantise, each step in numpy: the
    cache's codes times their scales, then tests/test_semanticache.py's numpy reference of chunking,
    GSC and merging (`ref_compress`) on those values, then the merged entries quantised into the
    new pages (power-of-two scales from each page's live entries). `compress` writes those scales,
    those codes (up to one step where a float32 and a float64 mean round apart), positions and
    log-size biases. (On the codes read as values, this fails: clusters and means are the codes'.)"""
    lengths, T = np.array([48, 40, 29]), 48
    pol = sc_masked(SemantiCache(**settings)).bind(Setup(SC_CFG, prompt_len=T))
    L, B, H, D = SC_CFG.num_layers, len(lengths), SC_CFG.num_kv_heads, SC_CFG.head_dim
    for _ in range(6):  # redraw when a cosine lies within rounding of a threshold
        _, keys, values, positions, tokens = sc_planted(int(rng.integers(1 << 30)), lengths, T, 0.15)
        cache = init_cache(SC_CFG, B, T + 8, page_size=8, dtype=jnp.float32, kv_dtype="int8", summaries=())
        cache = write_entries_jit(cache, jnp.asarray(keys), jnp.asarray(values), jnp.asarray(positions, jnp.int32),
                              jnp.zeros((L, B, H, T)), jnp.asarray(lengths, jnp.int32), T + 8)
        cache = cache.replace(next_position=cache.length)
        lay = jax.tree.map(np.asarray, cache.layers)
        live = (np.arange(T) < lengths[:, None])[None, :, None, :, None]
        k_hat = _np_dequant(lay.k.reshape(L * B, H, -1, D), lay.k_scale.reshape(L * B, H, -1, D), 8, True,
                            lay.k_zero.reshape(L * B, H, -1, D))
        k_hat = np.where(live, k_hat.reshape(L, B, H, -1, D)[:, :, :, :T], keys)
        v_hat = np.where(live, _np_dequant(lay.v.reshape(L * B, H, -1, D), lay.v_scale.reshape(L * B, H, -1), 8,
                                           False).reshape(L, B, H, -1, D)[:, :, :, :T], values)
        margins: list[float] = []
        ref, _ = sc_ref_compress(k_hat, v_hat, positions, tokens, lengths, pol, margins, [])
        if min(margins, default=1.0) > 2e-6:
            break
    else:
        pytest.fail("no draw without near-ties")
    prompt = Prompt(tokens=jnp.asarray(tokens, jnp.int32), lengths=jnp.asarray(lengths, jnp.int32))
    got = jax.jit(lambda c, p: pol.compress(c, None, pol.compressed_capacity(T, 4), p))(cache, prompt)
    out = jax.tree.map(np.asarray, got.layers)
    assert out.k.dtype == np.int8
    S, ps = got.capacity, got.page_size
    # the reference's entries, quantised page by page
    want_k, want_v = np.zeros((L, B, H, S, D)), np.zeros((L, B, H, S, D))
    n = np.zeros((L, B, H), int)
    for (l, b, h), entries in ref.items():
        n[l, b, h] = len(entries)
        want_k[l, b, h, :len(entries)] = np.stack([e[2] for e in entries])
        want_v[l, b, h, :len(entries)] = np.stack([e[3] for e in entries])
        np.testing.assert_array_equal(out.positions[l, b, h, :len(entries)], [e[0] for e in entries])
        np.testing.assert_allclose(out.bias[l, b, h, :len(entries)], [e[1] for e in entries], rtol=1e-6, atol=1e-6)
    assert n.min() < 40 and (out.bias > 0).any(), "clusters did merge"
    alive = np.arange(S) < n[..., None]  # [L, B, H, S]
    # key zero points: each page's mid-range per channel over its live entries, in bf16 (within one
    # bf16 step of numpy's: the means are float32 there, float64 here, and where a channel spans both
    # signs the mid-range nearly cancels, so float32's rounding of hi and lo, a few ulps of |hi| + |lo|,
    # is added: 2e-7 on a mid-range of 5e-5 in one CI draw); the codes are checked against the cache's
    # own zero points
    wk, al = want_k.reshape(L, B, H, S // ps, ps, D), alive.reshape(L, B, H, S // ps, ps, 1)
    hi, lo = np.where(al, wk, -np.inf).max(4), np.where(al, wk, np.inf).min(4)
    filled = hi >= lo
    hi, lo = np.where(filled, hi, 0.0), np.where(filled, lo, 0.0)
    kz_np = (hi + lo) / 2
    kz = np.asarray(out.k_zero, np.float64)
    assert (np.abs(kz - kz_np) <= np.abs(kz_np) * 2.0 ** -8 + (np.abs(hi) + np.abs(lo)) * 2.0 ** -19 + 1e-30).all()
    assert (kz == kz_np.astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)).mean() > 0.99
    kz_slot = np.repeat(kz, ps, axis=3)
    ks = _np_scale(np.where(alive[..., None], np.abs(want_k - kz_slot), 0).reshape(L, B, H, S // ps, ps, D).max(4),
                   127.0)
    vs = _np_scale(np.where(alive[..., None], np.abs(want_v), 0).reshape(L, B, H, S // ps, ps * D).max(4), 127.0)
    np.testing.assert_array_equal(np.asarray(out.k_scale, np.float64), ks)
    np.testing.assert_array_equal(np.asarray(out.v_scale, np.float64), vs)
    for got_codes, want_x, step, zero in ((out.k, want_k, np.repeat(ks, ps, axis=3), kz_slot),
                                          (out.v, want_v, np.repeat(vs, ps, axis=3)[..., None], 0.0)):
        got_x = np.where(alive[..., None], got_codes.astype(np.float64) * step + zero, 0.0)
        want_q = np.where(alive[..., None], _np_quant(want_x, step, "int8", zero), 0.0)
        assert (np.abs(got_x - want_q) <= step + 1e-12).all()
        assert (got_x == want_q).mean() > 0.99
