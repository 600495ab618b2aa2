"""The decode kernel's ways of dequantising an int8 / fp8 cache (``dequant=``, issue 39), interpreted
on the CPU: each against the jnp reference, the exact (float64-dequantised) attention, and where the
numbers are the same by construction, the default ``"tile_f32"`` path bit for bit.

Inputs are built here from numpy, not by `sparsekv_jax.cache`: codes drawn directly, power-of-two
scales (bf16, as the cache stores them), key zero points with +-50 offsets in two channels (Qwen2's key
biases), junk codes past each length (127 / NaN) and NaN scales and zero points on pages not read.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.pallas.decode import DEQUANT, decode_attention, decode_attention_reference, magic_int8_to_f32
from sparsekv_jax.pallas.testing import random_page_lists, rel_err

VARIANTS = tuple(d for d in DEQUANT if d != "tile_f32")
NP_CODE = {"int8": np.int8, "float8_e4m3fn": ml_dtypes.float8_e4m3fn}


def _inputs(rng, kv_dtype, B, Hq, Hkv, D, P, ps, q_dtype, zero):
    """q, codes k/v ``[B, Hkv, S, D]``, k_scale ``[B, Hkv, P, D]``, v_scale ``[B, Hkv, P]``, k_zero (or
    None), lengths, and the float64 dequantised k, v (0 past the length)."""
    S = P * ps
    lengths = np.asarray([S - int(rng.integers(1, ps)), int(rng.integers(1, S))] + [S] * (B - 2), np.int32)
    valid = np.arange(S)[None, None, :, None] < lengths[:, None, None, None]
    used = np.arange(P)[None, None] < -(-lengths[:, None, None] // ps)
    if kv_dtype == "int8":
        kc, vc = (rng.integers(-127, 128, (B, Hkv, S, D)).astype(np.int8) for _ in range(2))
    else:
        kc, vc = ((rng.standard_normal((B, Hkv, S, D)) * 100).clip(-448, 448).astype(ml_dtypes.float8_e4m3fn)
                  for _ in range(2))
    junk = np.asarray(127 if kv_dtype == "int8" else np.nan).astype(NP_CODE[kv_dtype])
    kc, vc = np.where(valid, kc, junk), np.where(valid, vc, junk)
    bf = ml_dtypes.bfloat16
    ks = np.exp2(rng.integers(-9, -4, (B, Hkv, P, D))).astype(bf)
    vs = np.exp2(rng.integers(-9, -4, (B, Hkv, P))).astype(bf)
    kz = None
    if zero:
        kz = (rng.standard_normal((B, Hkv, P, D)) * 4).astype(np.float32)
        kz[..., :2] += np.array([50.0, -50.0], np.float32)
        kz = kz.astype(bf)
    rep = lambda x: np.repeat(np.asarray(x, np.float64), ps, axis=2)  # noqa: E731
    k64 = np.where(valid, np.nan_to_num(kc.astype(np.float64)) * rep(ks) + (0.0 if kz is None else rep(kz)), 0.0)
    v64 = np.where(valid, np.nan_to_num(vc.astype(np.float64)) * rep(vs)[..., None], 0.0)
    ks, vs = np.where(used[..., None], ks, np.nan).astype(bf), np.where(used, vs, np.nan).astype(bf)
    if zero:
        kz = np.where(used[..., None], kz, np.nan).astype(bf)
    q = jnp.asarray(rng.standard_normal((B, Hq, D)), q_dtype)
    return q, kc, vc, ks, vs, kz, lengths, k64, v64


def _exact_probs(q, k64, lengths, ids, counts, bias, ps):
    """float64 attention probabilities ``[B, Hq, S]`` over the listed pages' slots below each length, with the
    exactly dequantised keys ``k64`` ``[B, Hkv, S, D]`` and the natural-log ``bias`` ``[B, Hkv, S]`` (0 elsewhere)."""
    q64 = np.asarray(q, np.float64)
    B, Hq, D = q64.shape
    Hkv, S = k64.shape[1], k64.shape[2]
    G = Hq // Hkv
    out = np.zeros((B, Hq, S))
    for b in range(B):
        for h in range(Hkv):
            read = np.zeros(S, bool)
            for page in ids[b, h, :counts[b, h]]:
                read[page * ps:(page + 1) * ps] = True
            read &= np.arange(S) < lengths[b]
            if not read.any():
                continue
            logits = q64[b, h * G:(h + 1) * G] @ k64[b, h].T / np.sqrt(D) + bias[b, h][None, :]
            logits = np.where(read[None, :], logits, -np.inf)
            w = np.exp(logits - logits.max(-1, keepdims=True))
            out[b, h * G:(h + 1) * G] = w / w.sum(-1, keepdims=True)
    return out


def _poison_unselected(ks, vs, kz, ids, counts):
    """NaN scales (and zero points) on every page not in a list: a read of one shows."""
    B, Hkv, P = vs.shape
    sel = np.zeros((B, Hkv, P), bool)
    for b in range(B):
        for h in range(Hkv):
            sel[b, h, ids[b, h, :counts[b, h]]] = True
    nan = lambda x, m: None if x is None else np.where(m, x, np.nan).astype(x.dtype)  # noqa: E731
    return nan(ks, sel[..., None]), nan(vs, sel), nan(kz, sel[..., None])


CASES = [  # kv dtype, page-sparse, stacked, q dtype, zero points, block_k (page_size 16)
    ("int8", False, False, jnp.bfloat16, True, 32),
    ("float8_e4m3fn", True, True, jnp.bfloat16, True, 64),
    ("int8", True, False, jnp.float32, True, 16),
    ("float8_e4m3fn", False, True, jnp.float32, False, 32),
]


# page_magic: int8 in test_page_magic_is_page_f32_bit_for_bit (page_f32's output bit for bit, so tile_f32's), fp8
# in test_page_magic_on_fp8_is_page_lowp (page_lowp's very program)
CHECKED = [d for d in VARIANTS if d != "page_magic"]
# one draw per run (made at collection, so the same for every case and on every xdist worker)
_OFFSET = int(seeded_rng().integers(len(CHECKED)))


@pytest.mark.share(2)
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"case{i}" for i in range(len(CASES))])
def test_variant_matches_reference(rng, case):
    """Each case (kv dtype, sparse, stacked, q dtype, zero points, tile: a kernel program per variant, the cost)
    with one of the three checked variants, rotated by an offset drawn from the run's seed: every variant runs in
    every run (4 cases over 3 variants), every (variant, case) pair comes up across runs, and a failure replays
    from the printed seed. Before, every case ran with every variant (12 tests)."""
    dequant = CHECKED[(case + _OFFSET) % len(CHECKED)]
    print(f"dequant={dequant!r}")  # shown with a failure
    kv_dtype, sparse, stacked, q_dtype, zero, block_k = CASES[case]
    B, Hq, Hkv, D, P, ps = 3, 8, 2, 32, 6, 16
    q, kc, vc, ks, vs, kz, lengths, k64, v64 = _inputs(rng, kv_dtype, B, Hq, Hkv, D, P, ps, q_dtype, zero)
    kw = {}
    if sparse:
        ids, counts = random_page_lists(rng, lengths, Hkv, P, ps, list_len=P - 1)
        counts[1, 0] = 0  # an empty selection
        ks, vs, kz = _poison_unselected(ks, vs, kz, ids, counts)
        kw = dict(page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts))
    args = [jnp.asarray(x) for x in (kc, vc, ks, vs)] + [None if kz is None else jnp.asarray(kz)]
    call_args = args
    if stacked:  # layer 1 of a 2-layer stack; layer 0: all-NaN scales
        call_args = [None if x is None else jnp.stack([jnp.full_like(x, jnp.nan) if x.dtype == jnp.bfloat16 else x, x])
                     for x in args]

    def run(d):
        return decode_attention(q, call_args[0], call_args[1], jnp.asarray(lengths), page_size=ps, interpret=True,
                                block_k=block_k, k_scale=call_args[2], v_scale=call_args[3], k_zero=call_args[4],
                                layer=1 if stacked else None, dequant=d, **kw)
    out = np.asarray(run(dequant), np.float32)
    assert out.shape == q.shape and np.isfinite(out).all(), "NaN in the output: a masked slot or page was read"
    ref = decode_attention_reference(q, *args[:2], jnp.asarray(lengths), page_size=ps, k_scale=args[2],
                                     v_scale=args[3], k_zero=args[4], **kw)
    exact = decode_attention_reference(q.astype(jnp.float32), jnp.asarray(k64, jnp.float32),
                                       jnp.asarray(v64, jnp.float32), jnp.asarray(lengths), page_size=ps, **kw)
    f32 = q_dtype == jnp.float32
    if dequant in ("page_f32", "page_lowp"):
        # the same dequantised keys as the default path (code*scale exact, one rounding of the zero
        # point's sum): the same output bit for bit
        np.testing.assert_array_equal(out, np.asarray(run("tile_f32"), np.float32))
        assert rel_err(out, np.asarray(ref, np.float32)) <= (1e-5 if f32 else 2e-2)
    else:  # page_q: the exact keys' logits (no rounding of a key to q's dtype): nearer the exact attention
        assert rel_err(out, np.asarray(exact)) <= (1e-5 if f32 else 1e-2)
        assert rel_err(out, np.asarray(ref, np.float32)) <= (1e-5 if f32 else 4e-2)


@pytest.mark.share(2)
@pytest.mark.parametrize("dequant", VARIANTS)
def test_variant_probs_bias_and_page_pool(rng, dequant):
    """``return_probs`` with a bias, against the reference; then the same cache as a page pool (pages
    scattered by a random table) gives the uniform call's output bit for bit and its probabilities to 1e-5."""
    B, Hq, Hkv, D, P, ps = 2, 8, 2, 32, 5, 16
    q, kc, vc, ks, vs, kz, lengths, k64, _ = _inputs(rng, "int8", B, Hq, Hkv, D, P, ps, jnp.bfloat16, True)
    ids, counts = random_page_lists(rng, lengths, Hkv, P, ps, list_len=P - 1)
    ks, vs, kz = _poison_unselected(ks, vs, kz, ids, counts)
    bias = rng.standard_normal((B, Hkv, P * ps)).astype(np.float32)
    kw = dict(page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts), bias=jnp.asarray(bias), return_probs=True)
    a = [jnp.asarray(x) for x in (kc, vc, ks, vs, kz)]
    out, probs = decode_attention(q, a[0], a[1], jnp.asarray(lengths), page_size=ps, interpret=True, block_k=32,
                                  k_scale=a[2], v_scale=a[3], k_zero=a[4], dequant=dequant, **kw)
    ref, ref_p = decode_attention_reference(q, a[0], a[1], jnp.asarray(lengths), page_size=ps, k_scale=a[2],
                                            v_scale=a[3], k_zero=a[4], **kw)
    assert rel_err(np.asarray(out, np.float32), np.asarray(ref, np.float32)) <= 4e-2
    # probabilities: where the reference has none, none (exactly 0); elsewhere near it
    np.testing.assert_array_equal(np.asarray(probs) == 0, np.asarray(ref_p) == 0)
    if dequant == "page_q":
        # page_q's logits are those of the exact dequantised keys, the reference's those of keys rounded to bf16
        # (zero points of +-50: a bf16 step of 0.25 per key element), so its probabilities are held to the exact
        # float64 ones, and closer to them than the reference's (seed 1763673106: 0.024 from the reference)
        exact = _exact_probs(q, k64, lengths, ids, counts, bias, ps)
        err, ref_err = np.abs(np.asarray(probs) - exact).max(), np.abs(np.asarray(ref_p) - exact).max()
        assert err <= 1e-2 and err <= ref_err, (err, ref_err)
    else:
        np.testing.assert_allclose(np.asarray(probs), np.asarray(ref_p), atol=2e-2)

    N = B * Hkv * P
    perm = rng.permutation(N)  # logical page i (flat order) lives at pool page perm[i]
    pooled = []
    for x in (kc.reshape(B, Hkv, P, ps, D), vc.reshape(B, Hkv, P, ps, D), ks, vs, kz, bias.reshape(B, Hkv, P, ps)):
        flat = x.reshape(N, *x.shape[3:])
        y = np.empty_like(flat)
        y[perm] = flat
        pooled.append(jnp.asarray(y))
    table = jnp.asarray(perm.reshape(B, Hkv, P), jnp.int32)
    lengths2 = jnp.asarray(np.broadcast_to(lengths[:, None], (B, Hkv)))
    out_p, probs_p = decode_attention(q, pooled[0], pooled[1], lengths2, page_size=ps, interpret=True, block_k=32,
                                      k_scale=pooled[2], v_scale=pooled[3], k_zero=pooled[4], dequant=dequant,
                                      page_table=table, **{**kw, "bias": pooled[5]})
    np.testing.assert_array_equal(np.asarray(out_p, np.float32), np.asarray(out, np.float32))
    # the probabilities within a few float32 ulps, not bit for bit: the two calls are different programs, and the
    # interpreter's XLA:CPU code for them (this suite's XLA_FLAGS) may round a logit's dot or an exp2 differently.
    # Seen when `listed_chunk` replaced a static split start (2026-11-28): the uniform call's probabilities moved by
    # up to 2.6e-6 relative on every draw, the pool's not at all, each as far from the reference as before. A page
    # read through a wrong table entry is wrong by far more (its keys are another page's).
    probs_p, probs = np.asarray(probs_p), np.asarray(probs)
    np.testing.assert_array_equal(probs_p == 0, probs == 0)
    np.testing.assert_allclose(probs_p, probs, rtol=1e-5, atol=0)


def test_bad_dequant_raises():
    q = jnp.zeros((1, 2, 16), jnp.bfloat16)
    k = jnp.zeros((1, 1, 32, 16), jnp.int8)
    for kw in ({}, dict(page_table=jnp.zeros((1, 1, 2), jnp.int32))):
        k_ = k.reshape(2, 16, 16) if kw else k
        ks, vs = (jnp.ones((2, 16)), jnp.ones((2,))) if kw else (jnp.ones((1, 1, 2, 16)), jnp.ones((1, 1, 2)))
        with pytest.raises(ValueError, match="dequant='tile'"):
            decode_attention(q, k_, k_, jnp.full((1, 1), 3) if kw else jnp.array([3]), page_size=16, interpret=True,
                             k_scale=ks, v_scale=vs, dequant="tile", **kw)


def test_dequant_leaves_an_unquantised_call_alone():
    """A bf16 cache never consults ``dequant``: every value traces the default call's program exactly."""
    q = jnp.zeros((2, 8, 32), jnp.bfloat16)
    k = jnp.zeros((2, 2, 64, 32), jnp.bfloat16)
    ids = jnp.broadcast_to(jnp.array([2, 0, 1], jnp.int32), (2, 2, 3))
    for kw in ({}, dict(page_ids=ids, return_probs=True)):
        def text(d, kw=kw):
            return str(jax.make_jaxpr(lambda q, k: decode_attention(
                q, k, k, jnp.array([50, 64]), page_size=16, interpret=True, block_k=32, dequant=d, **kw))(q, k))
        base = text("tile_f32")
        assert all(text(d) == base for d in VARIANTS)


def test_magic_int8_to_f32_every_code():
    """The bit trick maps each of the 256 int8 codes to exactly ``float32(code)`` (compared as bits: -0.0
    or a rounding would show), eagerly and under jit; other dtypes are refused."""
    codes = np.arange(-128, 128).astype(np.int8).reshape(16, 16)
    want = codes.astype(np.float32).view(np.uint32)
    for f in (magic_int8_to_f32, jax.jit(magic_int8_to_f32)):
        got = np.asarray(f(jnp.asarray(codes)))
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got.view(np.uint32), want)
    with pytest.raises(ValueError, match="int8 codes, got uint8"):
        magic_int8_to_f32(jnp.zeros((2,), jnp.uint8))


# one query dtype per run, drawn from the run's seed (both across runs; a failure replays from the printed seed)
_MAGIC_Q_DTYPE = (jnp.bfloat16, jnp.float32)[int(seeded_rng().integers(2))]


def test_page_magic_is_page_f32_bit_for_bit(rng):
    """int8 ``page_magic`` against ``page_f32`` (the same float32 codes, the same arithmetic after) bit for bit:
    dense, page-sparse with probabilities, and a stacked cache (layer 1; layer 0's scales NaN), with zero
    points, NaN scales on unread pages, every code -128..127 in use and random junk codes past each length.
    Scales here are *not* powers of two: the identity does not depend on an exact ``code·scale``. The query dtype
    (bf16 or fp32: six kernel programs each) is drawn from the run's seed."""
    q_dtype = _MAGIC_Q_DTYPE
    print(f"q_dtype={q_dtype.__name__}")  # shown with a failure
    B, Hq, Hkv, D, P, ps = 2, 8, 2, 32, 4, 16
    q, kc, vc, ks, vs, kz, lengths, _, _ = _inputs(rng, "int8", B, Hq, Hkv, D, P, ps, q_dtype, True)
    S = P * ps
    past = np.arange(S)[None, None, :, None] >= lengths[:, None, None, None]
    kc, vc = (np.where(past, rng.integers(-128, 128, c.shape), c).astype(np.int8) for c in (kc, vc))
    kc[0, 0, :8, :] = np.arange(-128, 128, dtype=np.int8).reshape(8, D)  # every code, in a slot that is read
    vc[0, 1, :8, :] = np.arange(-128, 128, dtype=np.int8).reshape(8, D)
    wobble = lambda x: (np.asarray(x, np.float32) * rng.uniform(0.6, 1.4, x.shape)).astype(x.dtype)  # noqa: E731
    ks, vs = wobble(ks), wobble(vs)  # NaN stays NaN on unread pages
    ids, counts = random_page_lists(rng, lengths, Hkv, P, ps, list_len=P - 1)
    counts[1, 0] = 0
    ks_s, vs_s, kz_s = _poison_unselected(ks, vs, kz, ids, counts)
    ln = jnp.asarray(lengths)

    def both(**kw):
        return [jax.tree.map(lambda x: np.asarray(x, np.float32), decode_attention(
            q, page_size=ps, interpret=True, block_k=32, dequant=d, **kw)) for d in ("page_magic", "page_f32")]
    a = lambda *x: [None if y is None else jnp.asarray(y) for y in x]  # noqa: E731
    k, v, k_scale, v_scale, k_zero = a(kc, vc, ks, vs, kz)
    magic, f32 = both(k=k, v=v, lengths=ln, k_scale=k_scale, v_scale=v_scale, k_zero=k_zero)
    np.testing.assert_array_equal(magic, f32)
    ref = decode_attention_reference(q, k, v, ln, page_size=ps, k_scale=k_scale, v_scale=v_scale, k_zero=k_zero)
    assert np.isfinite(magic).all() and rel_err(magic, np.asarray(ref, np.float32)) <= (
        1e-5 if q_dtype == jnp.float32 else 2e-2)
    sk, sv, sz = a(ks_s, vs_s, kz_s)
    (mo, mp), (fo, fp) = both(k=k, v=v, lengths=ln, page_ids=jnp.asarray(ids), page_counts=jnp.asarray(counts),
                              return_probs=True, k_scale=sk, v_scale=sv, k_zero=sz)
    np.testing.assert_array_equal(mo, fo)
    np.testing.assert_array_equal(mp, fp)
    assert np.isfinite(mo).all() and not mo[1, :Hq // Hkv].any()  # the empty selection: zeros
    stack = lambda x: jnp.stack([jnp.full_like(x, jnp.nan), x]) if x.dtype == jnp.bfloat16 else jnp.stack([x, x])  # noqa
    magic, f32 = both(k=stack(k), v=stack(v), lengths=ln, layer=1, k_scale=stack(k_scale), v_scale=stack(v_scale),
                      k_zero=stack(k_zero))
    np.testing.assert_array_equal(magic, f32)
    assert np.isfinite(magic).all()


def test_page_magic_on_fp8_is_page_lowp():
    """float8 codes have no bit trick: ``page_magic`` traces ``page_lowp``'s very program (dense and sparse);
    the numbers are checked with the other variants in `test_variant_matches_reference`."""
    q = jnp.zeros((2, 8, 32), jnp.bfloat16)
    k = jnp.zeros((2, 2, 64, 32), jnp.float8_e4m3fn)
    ks, vs = jnp.ones((2, 2, 4, 32), jnp.bfloat16), jnp.ones((2, 2, 4), jnp.bfloat16)
    ids = jnp.broadcast_to(jnp.array([2, 0, 1], jnp.int32), (2, 2, 3))
    for kw in ({}, dict(page_ids=ids, return_probs=True, k_zero=ks)):
        def text(d, kw=kw):
            return str(jax.make_jaxpr(lambda q, k: decode_attention(
                q, k, k, jnp.array([50, 64]), page_size=16, interpret=True, block_k=32, k_scale=ks, v_scale=vs,
                dequant=d, **kw))(q, k))
        assert text("page_magic") == text("page_lowp")
        assert text("page_magic") != text("page_f32")  # the comparison can tell programs apart
    k8 = k.astype(jnp.int8)  # int8: a program of its own

    def text8(d):
        return str(jax.make_jaxpr(lambda q, k: decode_attention(
            q, k, k, jnp.array([50, 64]), page_size=16, interpret=True, k_scale=ks, v_scale=vs, dequant=d))(q, k8))
    assert text8("page_magic") != text8("page_lowp")
