"""Per-token SAE features of key (or query) projections: the terms of S³'s index.

A token's key has one vector per KV head. Each is encoded by the layer's Top-K SAE (k ids), and
the token's feature set is the ``k`` features of largest activation summed over its heads
(`sparsekv_jax.sae.model.merge_heads`, docs/SAE.md). Two ways to compute the same set:

* ``"lax"``: `encode` (``lax.top_k`` per head) then `merge_heads` (a sort of the ``H·k`` pairs).
* ``"threshold"``: exact k-th values found by bisection over the float bits, no sort. XLA's GPU
  top-k is a full sort of every 16,384-wide row for k > 16 (docs/SAE.md). On a GPU the bisection is
  the Pallas kernel `sparsekv_jax.pallas.topk.threshold_top_k` (one read of each row, the passes in
  registers); elsewhere it is written in jnp and reads the pre-activations 31 times. Per (token, head)
  the k-th value τ of ``ReLU(pre)`` marks the head's active latents; their activations are summed
  over the heads; the token's k-th summed value σ picks its features (ties at σ broken by lower
  id, exactly ``k`` slots).

Both return ``(ids, acts)`` ``[..., k]``; a slot with activation 0 is no feature (a row with fewer
than k positive sums). The sets agree whenever no two positive values tie (tests).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsekv_jax.backend import Backend
from sparsekv_jax.pallas import dispatch
from sparsekv_jax.sae.model import TopKSAE, encode, merge_heads, pre_activations

FEATURE_METHODS = ("lax", "threshold")


def kth_largest(x: jax.Array, k: int, backend: Backend | None = None) -> jax.Array:
    """The k-th largest value of each row of non-negative ``x`` ``[..., W]`` (fp32), by bisection.

    Non-negative floats order like their bit patterns read as int32, so the answer is the largest
    bit pattern ``t`` with at least ``k`` entries ``>= t``: 31 halvings of ``[0, 2**31)``. The Pallas
    kernel on a GPU (``backend``'s platform; ``None``: this process's default), the jnp bisection
    elsewhere (interpreted Pallas is for tests): `dispatch.threshold_top_k_method`.
    """
    if dispatch.threshold_top_k_method(backend, x.shape[-1], k):
        return dispatch.threshold_top_k(backend, x, k)[2]
    return kth_largest_jnp(x, k)


def kth_largest_jnp(x: jax.Array, k: int) -> jax.Array:
    """`kth_largest` in jnp (any backend): 31 compare-and-count passes over ``x``."""
    bits = jax.lax.bitcast_convert_type(jnp.maximum(x.astype(jnp.float32), 0.0), jnp.int32)

    def halve(_, lo_hi):
        lo, hi = lo_hi
        mid = lo + (hi - lo) // 2
        enough = (bits >= mid[..., None]).sum(-1) >= k
        return jnp.where(enough, mid, lo), jnp.where(enough, hi, mid)

    lo = jnp.zeros(x.shape[:-1], jnp.int32)
    hi = jnp.full(x.shape[:-1], jnp.iinfo(jnp.int32).max, jnp.int32)
    lo, _ = jax.lax.fori_loop(0, 31, halve, (lo, hi))
    return jax.lax.bitcast_convert_type(lo, jnp.float32)


def select_k(x: jax.Array, k: int, backend: Backend | None = None) -> tuple[jax.Array, jax.Array]:
    """Exactly ``k`` entries of each row of non-negative ``x`` ``[..., W]`` with the largest values
    (ties at the k-th value: lower index first), as ``(ids int32 ascending, values)``; the kernel
    as in `kth_largest`."""
    W = x.shape[-1]
    if dispatch.threshold_top_k_method(backend, W, k):
        vals, ids, _ = dispatch.threshold_top_k(backend, x, k)
        return ids, vals
    sigma = kth_largest(x, k, backend)[..., None]
    above = x > sigma
    tie = x == sigma
    room = k - above.sum(-1, keepdims=True)
    take = above | (tie & (jnp.cumsum(tie, axis=-1) <= room))  # exactly k per row
    # compaction without a scatter: the j-th taken entry is where the running count first reaches j
    count = jnp.cumsum(take, axis=-1, dtype=jnp.int32).reshape(-1, W)
    want = jnp.arange(1, k + 1, dtype=jnp.int32)
    ids = jax.vmap(lambda c: jnp.searchsorted(c, want, side="left"))(count).astype(jnp.int32)
    ids = ids.reshape(*x.shape[:-1], k)
    return ids, jnp.take_along_axis(x, ids, axis=-1)


def _threshold_features(sae: TopKSAE, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    pre = pre_activations(sae, x)  # [..., H, W]
    # `kth_largest` counts entries <= 0 as 0, so it reads `pre` itself: no ReLU written to memory for
    # the kernel; the masked sum below fuses the ReLU
    tau = kth_largest(pre, sae.k)[..., None]
    summed = jnp.where(pre >= tau, jnp.maximum(pre, 0.0), 0.0).sum(-2)  # [..., W]: each head's top-k, summed
    return select_k(summed, k)


def token_features(sae: TopKSAE, x: jax.Array, k: int, method: str = "lax") -> tuple[jax.Array, jax.Array]:
    """``(ids int32, acts fp32)`` ``[..., k]``: the features of each token of ``x`` ``[..., H, D]``
    (one SAE, not a stack; pre-RoPE keys or queries, ``H`` heads), ``method`` in `FEATURE_METHODS`."""
    if method not in FEATURE_METHODS:
        raise ValueError(f"feature method {method!r} is not one of {FEATURE_METHODS}")
    if method == "threshold":
        return _threshold_features(sae, x, k)
    ids, acts = encode(sae, x)
    return merge_heads(ids, acts, k)


def stacked_token_features(saes: TopKSAE, x: jax.Array, k: int, method: str = "lax") -> tuple[jax.Array, jax.Array]:
    """`token_features` for a stack of SAEs (one per target layer) and ``x`` ``[n, ..., H, D]``,
    one layer at a time (`lax.map`: the dense pre-activations of one layer live at once)."""
    return jax.lax.map(lambda sx: token_features(sx[0], sx[1], k, method), (saes, x))
