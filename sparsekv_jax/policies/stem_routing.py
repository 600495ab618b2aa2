"""Stem's routing (`sparsekv_jax.policies.stem`): which key blocks each query block computes.

Two paths that give the same block lists (the same ties):

* `routed_blocks` (the default, ``Stem(routing="tiled")``): paper Algorithm 1's loop over query
  blocks, as a `lax.map` over tiles of ``tile`` query blocks. Each step scores its query blocks
  against every key block (the anti-diagonal estimate, the GQA combine, the value-norm term) and
  keeps only their top-``width`` lists, so the largest buffer is one tile's strided scores,
  ``[B, Hq, tile * block_size / stride, T / stride]`` fp32: O(T/stride * tile), never the
  ``[nQ, nK]`` block metric nor a sort over it.
* ``select_blocks(block_metric)`` (``Stem(routing="full")``, the reference): the whole
  ``[B, Hq, nQ, nK]`` routing and ``[B, Hkv, nQ, nK]`` metric, then one top-k over them.

``Stem(routing="kernel")`` runs `routed_blocks`'s loop with each tile's metric from the Pallas
kernel of `sparsekv_jax.pallas.stem_route` (its jnp reference: `tile_metric`), which never writes the
strided scores at all; equal up to rounding, and not yet run on a GPU, so not the default.

The two jnp paths run the same per-query-block arithmetic (`_block_log_mass`, `_block_scores`), so the tiled
lists equal the reference's bit for bit wherever XLA computes a query block's scores the same way
at either tile width (tests/test_stem.py checks it on CPU).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sparsekv_jax.backend import Backend
from sparsekv_jax.pallas import dispatch
from sparsekv_jax.policies.common import KEEP, top_k

TILE_ELEMENTS = 1 << 26  # strided tile scores per lax.map step (256 MiB of float32)


def _strided(q: jax.Array, k: jax.Array, lengths: jax.Array, block_size: int,
             stride: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The anti-diagonal reshapes: ``qs [nQ, B, Hkv, G, t, S*D]`` (query rows reversed inside each
    stride), ``ks [B, Hkv, m, S*D]`` and ``rows_in [nQ, B, t]`` (strided query rows holding a query of
    the row); ``t = block_size / S`` rows per block, ``m = nQ * t``."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    n = -(-T // block_size)
    pad = ((0, 0), (0, n * block_size - T), (0, 0), (0, 0))
    q, k = jnp.pad(q, pad), jnp.pad(k, pad)
    t, m = block_size // stride, n * block_size // stride
    qs = q.reshape(B, n, t, stride, Hkv, Hq // Hkv, D)[:, :, :, ::-1]
    qs = qs.transpose(1, 0, 4, 5, 2, 3, 6).reshape(n, B, Hkv, Hq // Hkv, t, stride * D)
    ks = k.reshape(B, m, stride, Hkv, D).transpose(0, 3, 1, 2, 4).reshape(B, Hkv, m, stride * D)
    rows_in = (jnp.arange(m) * stride < lengths[:, None]).reshape(B, n, t).transpose(1, 0, 2)
    return qs, ks, rows_in


def _block_log_mass(qb: jax.Array, i: jax.Array, inside: jax.Array, ks: jax.Array, scale: float) -> jax.Array:
    """``log P(key block | query block i)`` per query head: ``[B, Hkv, G, nK]`` fp32 (finite for causal blocks).

    ``qb [B, Hkv, G, t, S*D]`` are query block ``i``'s strided rows, ``inside [B, t]`` which of them
    hold a query of the row. Row ``a`` of the query reshape holds queries ``a*S + S-1 .. a*S``, row
    ``b`` of the key reshape keys ``b*S .. b*S + S-1``: their dot product is the anti-diagonal sum of
    tile ``(a, b)``, times ``scale = 1 / (S sqrt(D))`` its mean logit. Each row takes a softmax over
    its causal tiles (``b <= a``), the probabilities are summed per key block and averaged over the
    rows inside, and the log is taken.
    """
    B, Hkv, _, t, _ = qb.shape
    m = ks.shape[2]
    s = jnp.einsum("bhgrf,bhnf->bhgrn", qb, ks, preferred_element_type=jnp.float32) * scale
    causal = jnp.arange(m)[None, :] <= (i * t + jnp.arange(t))[:, None]
    p = jax.nn.softmax(jnp.where(causal, s, -jnp.inf), axis=-1)  # every row has tile 0: no NaN
    p = jnp.where(inside[:, None, None, :, None], p, 0.0)
    mass = p.reshape(B, Hkv, -1, t, m // t, t).sum((3, 5)) / jnp.maximum(inside.sum(-1), 1)[:, None, None, None]
    return jnp.log(mass + 1e-30)


def antidiagonal_routing(q: jax.Array, k: jax.Array, lengths: jax.Array, block_size: int, stride: int) -> jax.Array:
    """Log attention mass of each key block for each query block (XAttention's estimate): ``[B, Hq, nQ, nK]`` fp32.

    ``q`` ``[B, T, Hq, D]``, ``k`` ``[B, T, Hkv, D]``; ``T`` is zero-padded to whole blocks. See
    `_block_log_mass` for one query block; query rows past a row's length are left out of the
    average. The strided scores are computed `TILE_ELEMENTS` at a time (`lax.map`), but the result
    holds every (query block, key block) pair: `routed_blocks` keeps only the lists.
    """
    B, T, Hq, D = q.shape
    qs, ks, rows_in = _strided(q, k, lengths, block_size, stride)
    n, t, m = qs.shape[0], block_size // stride, ks.shape[2]
    scale = 1.0 / (stride * math.sqrt(D))
    routing = jax.lax.map(lambda a: _block_log_mass(a[0], a[1], a[2], ks, scale), (qs, jnp.arange(n), rows_in),
                          batch_size=max(1, min(n, TILE_ELEMENTS // (B * Hq * t * m))))  # [nQ, B, Hkv, G, nK]
    return routing.transpose(1, 2, 3, 0, 4).reshape(B, Hq, n, n)


def value_magnitude(v: jax.Array, lengths: jax.Array, block_size: int) -> jax.Array:
    """Max over each key block's tokens (those inside the row) of ``log ||v||``: ``[B, Hkv, nK]`` fp32
    (``-inf`` for blocks with no token of the row)."""
    B, T, Hkv, _ = v.shape
    n = -(-T // block_size)
    log_norm = 0.5 * jnp.log(jnp.sum(jnp.square(v.astype(jnp.float32)), -1))  # [B, T, Hkv]
    inside = (jnp.arange(T)[None, :] < lengths[:, None])[..., None]
    log_norm = jnp.where(inside, log_norm, -jnp.inf)
    log_norm = jnp.pad(log_norm, ((0, 0), (0, n * block_size - T), (0, 0)), constant_values=-jnp.inf)
    return log_norm.reshape(B, n, block_size, Hkv).max(2).transpose(0, 2, 1)


def _block_scores(metric: jax.Array, qi: jax.Array, sink_blocks: int, local_blocks: int) -> jax.Array:
    """Selection scores ``[..., nK]`` of query block(s) ``qi`` (broadcast against the metric's
    second-last axis): forced (sink and local) blocks ``KEEP``, causal blocks their metric (floored at
    ``-KEEP``), future blocks ``-inf``."""
    kj = jnp.arange(metric.shape[-1])
    causal = kj <= qi
    forced = causal & ((kj < sink_blocks) | (kj > qi - local_blocks))
    return jnp.where(forced, KEEP, jnp.where(causal, jnp.maximum(metric, -KEEP), -jnp.inf))


def block_counts(budget: jax.Array, lengths: jax.Array, block_size: int, sink_blocks: int, local_blocks: int,
                 width: int, n_kv_heads: int) -> jax.Array:
    """List lengths ``[B, Hkv, nQ]`` int32 from the budgets ``k(i)`` ``[B, nQ]``: ``min(max(k(i),
    forced), i + 1)``, only the forced blocks past a row's length, at most ``width``."""
    B, n = budget.shape
    n_forced = jnp.minimum(jnp.arange(n) + 1, sink_blocks + local_blocks)  # [nQ]
    counts = jnp.minimum(jnp.maximum(budget, n_forced), jnp.arange(n) + 1)
    inside = jnp.arange(n)[None, :] < (-(-lengths // block_size))[:, None]  # [B, nQ]
    counts = jnp.minimum(jnp.where(inside, counts, n_forced), width)
    return jnp.broadcast_to(counts[:, None], (B, n_kv_heads, n)).astype(jnp.int32)


def select_blocks(metric: jax.Array, budget: jax.Array, lengths: jax.Array, block_size: int, sink_blocks: int,
                  local_blocks: int, width: int) -> tuple[jax.Array, jax.Array]:
    """Block lists from a ``[B, Hkv, nQ, nK]`` metric and ``[B, nQ]`` budgets ``k(i)``.

    Forced (sink and local) blocks rank first, then causal blocks by metric, future blocks never
    (ties: the lower block first). Returns ``(block_ids [B, Hkv, nQ, width], block_counts [B, Hkv, nQ])``
    int32.
    """
    n = metric.shape[2]
    _, ids = top_k(_block_scores(metric, jnp.arange(n)[:, None], sink_blocks, local_blocks), width)
    counts = block_counts(budget, lengths, block_size, sink_blocks, local_blocks, width, metric.shape[1])
    return ids.astype(jnp.int32), counts


def dense_from(ids: jax.Array, counts: jax.Array, start: jax.Array, lengths: jax.Array,
               block_size: int) -> tuple[jax.Array, jax.Array]:
    """Widen to every causal block the lists of the query blocks that hold a token in
    ``[start[b], lengths[b])``: ``ids`` ``[B, Hkv, nQ, K]`` → ``[B, Hkv, nQ, nQ]`` (those lists
    ``0 .. i``, the others padded), ``counts`` → ``i + 1`` there (``Stem(dense_question=True)``)."""
    n, width = ids.shape[2], ids.shape[3]
    blocks = jnp.arange(n, dtype=jnp.int32)
    dense = (blocks[None] >= (start // block_size)[:, None]) & (blocks[None] < (-(-lengths // block_size))[:, None])
    wide = jnp.pad(ids, ((0, 0), (0, 0), (0, 0), (0, n - width)))
    ids = jnp.where(dense[:, None, :, None], blocks, wide).astype(jnp.int32)
    return ids, jnp.where(dense[:, None, :], blocks + 1, counts).astype(jnp.int32)


def route_tile(T: int, Hq: int, Hkv: int, block_size: int, stride: int, batch: int, method: str = "jnp") -> int:
    """Query blocks per `lax.map` step: as many as keep one step's largest buffer within
    `TILE_ELEMENTS` (at least 1, at most all). That buffer is the strided scores
    ``[B, Hq, tile * t, m]`` on the jnp path, and the metric ``[B, Hkv, tile, nK]`` on the kernel's
    (its scores never leave the chip), so the kernel takes tiles ``Hq t^2`` times larger."""
    n = -(-T // block_size)
    t = block_size // stride
    per_block = batch * (Hq * t * n * t if method == "jnp" else Hkv * n)
    return max(1, min(n, TILE_ELEMENTS // per_block))


def routed_blocks(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, block_size: int, stride: int,
                  beta: float, gqa: str, sink_blocks: int, local_blocks: int, width: int,
                  tile: int | None = None, method: str = "jnp", backend: Backend | None = None) -> jax.Array:
    """Stem's block lists, one tile of query blocks at a time: ``block_ids [B, Hkv, nQ, width]`` int32.

    Equal to ``select_blocks(metric)[0]`` for the OAM ``metric`` (`Stem.block_metric`): per query
    block, `_block_log_mass` per query head, the GQA combine (``gqa``: ``"max"`` or ``"mean"``), plus
    ``beta * max(0, value_magnitude)`` when ``beta > 0``, `_block_scores`, top-``width`` -- but the
    `lax.map` keeps only each query block's list. ``tile``: query blocks per step (default
    `route_tile`); on the jnp path the step's strided scores ``[B, Hq, tile * block_size / stride,
    T / stride]`` fp32 are the largest buffer. Counts come from `block_counts`. ``method``: ``"jnp"``
    (exact: the lists of the whole-metric path) or ``"pallas"`` (the metric of each tile from the
    kernel of `sparsekv_jax.pallas.stem_route`, interpreted where ``backend`` says so; equal up to
    rounding).
    """
    B, T, Hq, D = q.shape
    if tile is not None and (isinstance(tile, bool) or not isinstance(tile, int) or tile < 1):
        raise ValueError(f"tile={tile!r} must be a positive number of query blocks")
    if gqa not in ("max", "mean"):
        raise ValueError(f"gqa={gqa!r} must be 'max' or 'mean'")
    if method not in ("jnp", "pallas"):
        raise ValueError(f"method={method!r} must be 'jnp' or 'pallas'")
    qs, ks, rows_in = _strided(q, k, lengths, block_size, stride)
    n = qs.shape[0]
    scale = 1.0 / (stride * math.sqrt(D))
    bonus = None if beta == 0 else beta * jnp.maximum(value_magnitude(v, lengths, block_size), 0.0)  # [B, Hkv, nK]

    tile = route_tile(T, Hq, k.shape[2], block_size, stride, B, method) if tile is None else min(tile, n)
    if method == "jnp":
        def one_block(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
            metric = _block_metric(*args, ks, bonus, gqa, scale)  # [B, Hkv, nK]
            return top_k(_block_scores(metric, args[1], sink_blocks, local_blocks), width)[1]  # [B, Hkv, width]

        ids = jax.lax.map(one_block, (qs, jnp.arange(n), rows_in), batch_size=tile)  # [nQ, B, Hkv, width]
        return ids.transpose(1, 2, 0, 3).astype(jnp.int32)

    # the kernel (`sparsekv_jax.pallas.stem_route`) scores whole tiles: pad the query blocks to whole tiles
    steps = -(-n // tile)
    pad = steps * tile - n
    qs = jnp.pad(qs, ((0, pad),) + ((0, 0),) * 5).reshape(steps, tile, *qs.shape[1:])
    rows_in = jnp.pad(rows_in, ((0, pad), (0, 0), (0, 0))).reshape(steps, tile, *rows_in.shape[1:])
    qi = jnp.minimum(jnp.arange(steps * tile), n - 1).reshape(steps, tile)
    bonus = jnp.zeros((B, ks.shape[1], n), jnp.float32) if bonus is None else bonus

    def one_tile(args: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:
        qb, qi_t, inside = args
        metric = dispatch.stem_tile_metric(backend, qb, qi_t, inside, ks, bonus, gqa=gqa, scale=scale)
        return top_k(_block_scores(metric, qi_t[:, None], sink_blocks, local_blocks), width)[1]  # [B, Hkv, tile, w]

    ids = jax.lax.map(one_tile, (qs, qi, rows_in))  # [steps, B, Hkv, tile, width]
    ids = ids.transpose(1, 2, 0, 3, 4).reshape(B, ks.shape[1], steps * tile, width)[:, :, :n]
    return ids.astype(jnp.int32)


def _block_metric(qb: jax.Array, i: jax.Array, inside: jax.Array, ks: jax.Array, bonus: jax.Array | None, gqa: str,
                  scale: float) -> jax.Array:
    """OAM metric ``[B, Hkv, nK]`` of query block ``i``: `_block_log_mass`, the GQA combine, the bonus."""
    routing = _block_log_mass(qb, i, inside, ks, scale)  # [B, Hkv, G, nK]
    metric = routing.mean(2) if gqa == "mean" else routing.max(2)
    return metric if bonus is None else metric + bonus


def tile_metric(qb: jax.Array, qi: jax.Array, inside: jax.Array, ks: jax.Array, bonus: jax.Array, *, gqa: str,
                scale: float) -> jax.Array:
    """The OAM metric ``[B, Hkv, tile, nK]`` fp32 of a tile of query blocks: the jnp reference of
    `sparsekv_jax.pallas.stem_route.stem_tile_metric_kernel` (same arguments: ``qb [tile, B, Hkv, G, t,
    S*D]``, ``qi [tile]``, ``inside [tile, B, t]``, ``ks [B, Hkv, m, S*D]``, ``bonus [B, Hkv, nK]``)."""
    return jax.vmap(lambda q, i, ins: _block_metric(q, i, ins, ks, bonus, gqa, scale), out_axes=2)(qb, qi, inside)


def strided(q: jax.Array, k: jax.Array, lengths: jax.Array, block_size: int,
            stride: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The anti-diagonal reshapes of ``q`` and ``k`` (`_strided`): ``(qs [nQ, B, Hkv, G, t, S*D], ks [B, Hkv,
    m, S*D], rows_in [nQ, B, t])``, the inputs of `tile_metric` and its kernel."""
    return _strided(q, k, lengths, block_size, stride)
