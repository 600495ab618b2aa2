"""A quantised uniform cache after a rewind (issue 39; CHESS's backtracking, issue 38): the tokens taken back
leave their codes and scales in the page, the length moves back (`engine.decode.decode_loop`:
``cache.replace(length=length - back, ...)``), and the regenerated tokens refill the same slots. A page the
rewind emptied is *fresh* again when the refill opens it: its scales and key zero points must be those of a
cache that never held the tokens taken back (`cache_quant._rescale_pages`), which is also what the page pool
gives (its refilled page starts empty: `cache_pooled.append_token_pool`). A page the rewind cut inside keeps
live entries quantised with its grown scale, and so that scale (documented here, in both layouts).

Against numpy references of the quantisation (the rule `tests/test_kv_quant.py` checks: power-of-two scales,
``max(old, new)`` as a page fills, key zero points the previous page's) and against a cache filled with the
surviving tokens alone. Random inputs from the run's seed (tests/conftest.py: printed in the header,
``pytest --seed N`` replays it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_kv_quant import KV_DTYPES, QMAX, _np_mid, _np_quant, _np_scale

from sparsekv_jax.cache import append_token, init_cache, layer_view, write_chunk, write_tokens
from sparsekv_jax.models.config import ModelConfig

B, H, D, PS = 2, 2, 16, 8
CFG = ModelConfig(family="llama", vocab_size=61, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=H,
                  head_dim=D, intermediate_size=48, max_position_embeddings=512)
# row 0's prompt fills page 0: the page taken back is page 1, whole (CHESS's page starts on a cache page);
# row 1's ends inside page 1: the rewind cuts page 1 (slots 13..15 taken back) and empties page 2 (16..20)
LENGTHS, REFILL = np.array([8, 13]), 5


def _prefill(rng: np.random.Generator, kv_dtype: str):
    """A one-layer stacked cache holding the rows' prompts (the same for every cache of a test) and the keys
    and values written ``[B, H, 16, D]``."""
    cache = init_cache(CFG, B, 40, page_size=PS, dtype=jnp.float32, kv_dtype=kv_dtype)
    k0, v0 = (rng.standard_normal((B, H, 16, D)).astype(np.float32) for _ in range(2))
    kv = write_chunk(layer_view(cache.layers, 0), jnp.asarray(k0), jnp.asarray(v0), 0,
                     jnp.broadcast_to(jnp.arange(16), (B, 16)), jnp.asarray(LENGTHS))
    return jax.tree.map(lambda a, x: a.at[0].set(x), cache.layers, kv), k0, v0


def _append(layers, k: np.ndarray, v: np.ndarray, length: np.ndarray):
    """Decode's appends (`append_token` on the stack, ``layer`` 0): token ``i`` of ``k``/``v``
    ``[n, B, H, D]`` at slot ``length + i``; -> (layers, length after)."""
    for i in range(k.shape[0]):
        at = jnp.asarray(length, jnp.int32)
        layers = append_token(layers, jnp.asarray(k[i]), jnp.asarray(v[i]), at, at, at + 1, PS, layer=jnp.int32(0))
        length = length + 1
    return layers, length


def _refill(layers, k: np.ndarray, v: np.ndarray, length: np.ndarray, how: str):
    """The regenerated tokens ``[n, B, H, D]`` from ``length``: appended one by one, or written as one run
    (`write_tokens`, `extend`'s write)."""
    if how == "append":
        return _append(layers, k, v, length)[0]
    n = k.shape[0]
    slots = jnp.asarray(length[:, None] + np.arange(n), jnp.int32)
    kv = layer_view(layers, 0)
    kv = kv.replace(positions=kv.positions.at[jnp.arange(B)[:, None], :, slots].set(slots[:, :, None]))
    kv = write_tokens(kv, jnp.asarray(np.moveaxis(k, 0, 1)), jnp.asarray(np.moveaxis(v, 0, 1)), slots,
                      jnp.ones((B, n), bool), jnp.asarray(length + n, jnp.int32))
    return jax.tree.map(lambda a, x: a.at[0].set(x), layers, kv)


def _np_fill(x: np.ndarray, zero: np.ndarray | float, kv_dtype: str, per_channel: bool, at_once: bool,
             scale: np.ndarray | float = 0.0, deq: list | None = None):
    """numpy: entries ``x`` ``[n, D]`` written into one page in turn (appends) or ``at_once`` (a run), after its
    earlier entries ``deq`` (dequantised, under ``scale``), as the documented rule says: the page's scale is
    ``max(old, what the new entries need)`` and every entry is (re-)quantised with it -> (scale, dequantised)."""
    qmax = QMAX[kv_dtype]

    def need(a):
        off = np.abs(np.asarray(a, np.float32) - np.asarray(zero, np.float32))
        return _np_scale(off.max(0) if per_channel else off.max(), qmax)

    deq = list(deq or [])
    for chunk in ([x] if at_once else [x[i:i + 1] for i in range(len(x))]):
        scale = np.maximum(scale, need(chunk))
        deq = [_np_quant(d, scale, kv_dtype, zero) for d in deq] + [_np_quant(t, scale, kv_dtype, zero) for t in chunk]
    return scale, np.stack(deq)


@pytest.mark.share(2)
@pytest.mark.parametrize("how", ["append", "write_tokens"])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_a_page_refilled_after_a_rewind_is_quantised_as_if_never_taken_back(rng, kv_dtype, how):
    """Each row appends a page of 8 tokens whose values and keys are 20x larger than the rest, takes them back
    (the length moves back by 8, as `decode_loop` does for CHESS) and refills 5 tokens, appended (the decode
    step) or as one run (`write_tokens`). The page the rewind emptied (row 0's page 1, row 1's page 2) then
    holds what a cache filled with the surviving tokens alone holds: the same value scale (the defect: it kept
    the taken-back tokens' scale), key scales and zero points (the previous page's), codes and dequantised
    values of its live slots, all equal to the numpy rule. Row 1's page 1, which the rewind cut (5 prompt
    entries stay), keeps the scale the taken-back tokens grew it to (in the pool as here), its entries
    re-quantised by the numpy rule with that scale; the prompt's page 0 is untouched."""
    layers, k0, v0 = _prefill(rng, kv_dtype)
    k_back, v_back = (rng.standard_normal((PS, B, H, D)).astype(np.float32) * 20 for _ in range(2))
    k_new, v_new = (rng.standard_normal((REFILL, B, H, D)).astype(np.float32) for _ in range(2))
    taken, length = _append(layers, k_back, v_back, LENGTHS.copy())
    np.testing.assert_array_equal(length, LENGTHS + PS)
    rewound = _refill(taken, k_new, v_new, length - PS, how)  # the rewind: the length back by PS, slots kept
    direct = _refill(layers, k_new, v_new, LENGTHS.copy(), how)
    got, ref = layer_view(rewound, 0), layer_view(direct, 0)
    fields = ("k_scale", "k_zero", "v_scale", "k", "v")
    at_once = how == "write_tokens"
    for b in range(B):
        end = LENGTHS[b] + REFILL  # the row's length after the refill
        for h in range(H):
            a = {f: np.asarray(getattr(got, f), np.float64)[b, h] for f in fields}
            r = {f: np.asarray(getattr(ref, f), np.float64)[b, h] for f in fields}
            for page in range(LENGTHS[b] // PS, (end - 1) // PS + 1):
                live = slice(page * PS, min(end, page * PS + PS))
                first = max(page * PS, LENGTHS[b])  # the page's first refilled slot
                new = slice(first - LENGTHS[b], live.stop - LENGTHS[b])  # its refilled tokens
                earlier = slice(page * PS, first)  # its prompt entries (live through the rewind)
                if first == page * PS:  # a page the rewind emptied: fresh again
                    assert page > 0  # both prompts hold page 0
                    # an append opening a page: the previous page's zero points, the mid-range of its prompt
                    # entries (whole page 0 of row 0, slots 8..12 of row 1); a run: its own keys' mid-range
                    zero = (_np_mid(k_new[new, b, h]) if at_once
                            else _np_mid(k0[b, h, (page - 1) * PS:min(page * PS, LENGTHS[b])]))
                    ks, kd = _np_fill(k_new[new, b, h], zero, kv_dtype, True, at_once)
                    vs, vd = _np_fill(v_new[new, b, h], 0.0, kv_dtype, False, at_once)
                    for f in fields:  # as the cache that never held the tokens taken back
                        want = r[f][live] if f in ("k", "v") else r[f][page]
                        gotf = a[f][live] if f in ("k", "v") else a[f][page]
                        np.testing.assert_array_equal(gotf, want, err_msg=f"{f} of row {b} head {h} page {page}")
                else:  # cut inside: its prompt entries, the tokens taken back, then the refill (numpy rule)
                    zero = _np_mid(k0[b, h, earlier])
                    ks, kd = _np_fill(k0[b, h, earlier], zero, kv_dtype, True, True)
                    vs, vd = _np_fill(v0[b, h, earlier], 0.0, kv_dtype, False, True)
                    back = slice(first - LENGTHS[b], PS * (page + 1) - LENGTHS[b])  # taken back in this page
                    ks, kd = _np_fill(k_back[back, b, h], zero, kv_dtype, True, False, ks, list(kd))
                    vs, vd = _np_fill(v_back[back, b, h], 0.0, kv_dtype, False, False, vs, list(vd))
                    n_earlier = first - page * PS
                    ks, kd = _np_fill(k_new[new, b, h], zero, kv_dtype, True, at_once, ks, list(kd[:n_earlier]))
                    vs, vd = _np_fill(v_new[new, b, h], 0.0, kv_dtype, False, at_once, vs, list(vd[:n_earlier]))
                    assert (vs > r["v_scale"][page]).all()  # coarser than the direct cache's: the known cost
                np.testing.assert_array_equal(a["k_scale"][page], ks, err_msg=f"key scales, row {b} page {page}")
                np.testing.assert_array_equal(a["k_zero"][page], np.broadcast_to(zero, (D,)))
                np.testing.assert_array_equal(a["v_scale"][page], vs, err_msg=f"value scale, row {b} page {page}")
                np.testing.assert_array_equal(a["k"][live] * ks + zero, kd, err_msg=f"keys, row {b} page {page}")
                np.testing.assert_array_equal(a["v"][live] * vs, vd, err_msg=f"values, row {b} page {page}")
            for f in fields:  # the prompt's page 0 is untouched
                want = r[f][:PS] if f in ("k", "v") else r[f][0]
                np.testing.assert_array_equal(a[f][:PS] if f in ("k", "v") else a[f][0], want, err_msg=f)
