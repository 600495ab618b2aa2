"""BSER's question probe and its block / token helpers (`sparsekv_jax.policies.bser`): where the question
starts, which of its queries probe, the question's attention over the prompt (Stage II), the statistics of ``E``
a block representation needs, and the rank / window filters of Stage III. Pure functions over arrays; the policy
and its documented choices are in `bser.py`."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from sparsekv_jax.policies.base import Prompt

QUERY_CHUNK = 16  # question queries per softmax slab: [B, Hq, 16, T] fp32 at a time


def question_start(prompt: Prompt, tail: int, min_question: int = 1) -> jax.Array:
    """``[B]`` where each row's question starts; the last ``tail`` tokens where no split is given;
    a question shorter than ``min_question`` tokens starts ``min_question`` tokens before the end."""
    fallback = jnp.maximum(prompt.lengths - tail, 0)
    if prompt.question_start is None:
        return fallback
    given = jnp.where(prompt.question_start < prompt.lengths, prompt.question_start, fallback)
    return jnp.minimum(given, jnp.maximum(prompt.lengths - min_question, 0))


def probe_queries(prompt: Prompt, tail: int, max_question: int, T: int,
                  min_question: int = 1) -> tuple[jax.Array, jax.Array]:
    """``(positions [B, M], valid [B, M])``: the last ``min(m, M)`` question tokens of each row."""
    M = -(-min(max_question, T) // QUERY_CHUNK) * QUERY_CHUNK
    pos = prompt.lengths[:, None] - M + jnp.arange(M)
    valid = pos >= question_start(prompt, tail, min_question)[:, None]
    return jnp.clip(pos, 0, T - 1), valid


def question_attention(q: jax.Array, k: jax.Array, qpos: jax.Array, valid: jax.Array) -> jax.Array:
    """``[B, T]``: the causal softmax rows of the queries at ``qpos`` over all keys, averaged over
    query heads and valid queries. ``q`` ``[B, T, Hq, D]``, ``k`` ``[B, T, Hkv, D]`` (GQA groups
    share their key head: no repeated keys)."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    M = qpos.shape[1]
    qq = jnp.take_along_axis(q, qpos[:, :, None, None], axis=1)  # [B, M, Hq, D]
    qq = qq.reshape(B, M // QUERY_CHUNK, QUERY_CHUNK, Hkv, Hq // Hkv, D).swapaxes(0, 1)
    pos = qpos.reshape(B, M // QUERY_CHUNK, QUERY_CHUNK).swapaxes(0, 1)
    weight = valid.astype(jnp.float32).reshape(B, M // QUERY_CHUNK, QUERY_CHUNK).swapaxes(0, 1)
    t = jnp.arange(T)

    def chunk(xs):
        qc, pc, wc = xs
        s = jnp.einsum("bchgd,bthd->bhgct", qc, k, preferred_element_type=jnp.float32) / math.sqrt(D)
        s = jnp.where(t <= pc[:, None, None, :, None], s, -jnp.inf)
        return jnp.einsum("bhgct,bc->bt", jax.nn.softmax(s, axis=-1), wc)

    total = jax.lax.map(chunk, (qq, pos, weight)).sum(0)
    return total / (Hq * jnp.maximum(valid.sum(1), 1))[:, None].astype(jnp.float32)


def embedding_stats(hidden: jax.Array, qpos: jax.Array, valid: jax.Array, block_size: int,
                    unit_rms: bool, context: jax.Array | None = None) -> dict[str, jax.Array]:
    """What ``cos(Σ w·E, ē)`` needs of ``E`` = ``hidden`` for any weights ``w`` chosen later:
    ``dot`` ``[B, T]`` = ``E·ē``, block Gram matrices ``gram`` ``[B, nb, bs, bs]`` and ``|ē|`` ``[B]``
    (``ē`` = the mean of ``E`` over the valid question tokens)."""
    B, T, H = hidden.shape
    x = hidden.astype(jnp.float32)
    if unit_rms:
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)
    if context is not None:  # centre on the context's mean: cosines of anisotropic embeddings all sit near 1
        c = context.astype(jnp.float32)
        x = x - jnp.einsum("bth,bt->bh", x, c)[:, None] / jnp.maximum(c.sum(1), 1)[:, None, None]
    xq = jnp.take_along_axis(x, qpos[:, :, None], axis=1)
    mean_q = jnp.einsum("bmh,bm->bh", xq, valid.astype(jnp.float32)) / jnp.maximum(valid.sum(1), 1)[:, None]
    x = x.astype(hidden.dtype)
    nb = -(-T // block_size)
    xb = jnp.pad(x, ((0, 0), (0, nb * block_size - T), (0, 0))).reshape(B, nb, block_size, H)
    return {"dot": jnp.einsum("bth,bh->bt", x, mean_q.astype(x.dtype), preferred_element_type=jnp.float32),
            "gram": jnp.einsum("bnih,bnjh->bnij", xb, xb, preferred_element_type=jnp.float32),
            "qnorm": jnp.linalg.norm(mean_q, axis=-1)}


def descending_rank(x: jax.Array) -> jax.Array:
    """Descending rank along the last axis (0 = largest)."""
    return jnp.argsort(jnp.argsort(-x, axis=-1, stable=True), axis=-1, stable=True)


def lex_rank(primary: jax.Array, secondary: jax.Array) -> jax.Array:
    """Descending rank along the last axis by ``primary``, ties by ``secondary`` (0 = first)."""
    return jnp.argsort(jnp.lexsort((-secondary, -primary), axis=-1), axis=-1)


def max_filter(x: jax.Array, radius: int) -> jax.Array:
    """The largest value within ``radius`` of each position along the last axis (not past its ends)."""
    if radius == 0:
        return x
    dims = (1,) * (x.ndim - 1) + (2 * radius + 1,)
    pad = ((0, 0),) * (x.ndim - 1) + ((radius, radius),)
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, dims, (1,) * x.ndim, pad)


def dilate(mask: jax.Array, radius: int) -> jax.Array:
    """Every position within ``radius`` of a marked one, along the last axis (not past its ends)."""
    if radius == 0:
        return mask
    dims = (1,) * (mask.ndim - 1) + (2 * radius + 1,)
    pad = ((0, 0),) * (mask.ndim - 1) + ((radius, radius),)
    return jax.lax.reduce_window(mask.astype(jnp.int32), 0, jax.lax.max, dims, (1,) * mask.ndim, pad) > 0
