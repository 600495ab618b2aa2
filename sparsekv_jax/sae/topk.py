"""Exact top-k of non-negative latent pre-activations, fast on GPUs for the SAE's k.

Why it looks like this: ``jax.lax.top_k`` is exact everywhere, but XLA's GPU compiler has a fast
top-k kernel only for ``k <= 16`` (and rows of 1,024 to 1M elements); a larger k — an S³ SAE uses
``k = d_head``, 64 to 128 — becomes a full sort of every row (openxla/xla#25487), which is slower
than the SAE's matmuls by far. ``blocked_top_k`` keeps exactness but only uses the small-k kernel:

1. split each row into blocks of ``block`` (1,024) latents and take each block's top ``per_round``
   (16) — ``rounds`` times, masking what was taken, so each block offers ``rounds * per_round``
   candidates;
2. the row's top k among the candidates (a sort of a few hundred elements);
3. check that no block could hide an element of the top k: a block whose smallest offered value
   is still >= the k-th value (or a tie cut at a round boundary) might have more. Then the whole
   batch falls back to ``lax.top_k`` under a `lax.cond` (only the taken branch runs).

With a learned SAE the top-k latents of a row are spread over the blocks like a random subset
(latent order carries no meaning): at k = 64 of 8,192 a block expects 8 of them; holding more than
32 has probability 4e-14 (hypergeometric; 2e-12 at k = 128 of 16,384), so the fallback is a safety
net, not a path. One round of 16 would not do: a block holds more than 16 with probability 2e-3,
i.e. in nearly every batch.

The inputs are ReLU outputs (``TopK(ReLU(.))``, the S³ paper's Eq. 3): values are >= 0 and a 0
contributes nothing, so ties and hiding are only checked among positive values; which zero
entries fill the last slots of a row with fewer than k positive values is unspecified (the ids
of a row are always distinct).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsekv_jax.backend import Backend
from sparsekv_jax.pallas import dispatch
from sparsekv_jax.pallas.topk import threshold_top_k_applies
from sparsekv_jax.sae.config import TOPK_METHODS


def blocked_applies(width: int, k: int, block: int = 1024, per_round: int = 16, rounds: int = 2) -> bool:
    """Whether `blocked_top_k` can run on rows of ``width`` (whole blocks, >= 2 of them, enough candidates)."""
    return width % block == 0 and width // block >= 2 and k <= (width // block) * per_round * rounds


def resolve_method(method: str, width: int, k: int, backend: Backend | None = None) -> str:
    """``"auto"`` → ``"threshold"`` on a GPU (``backend``'s platform; ``None``: this process's default)
    where it applies (a power-of-two width), else ``"lax"`` (`dispatch.threshold_top_k_method`).

    Measured on an H200 (experiments/diary/BENCHMARKS_DIARY.md, "SAE training throughput"): XLA's sort-based top-k took
    30.7 ms of a 40.3 ms SmolLM2 SAE step at k 64; ``"blocked"`` was 2-3x slower than that on the GPU
    (it stays an explicit choice; it is faster than ``lax`` on a CPU). ``"threshold"`` is the Pallas
    kernel of `sparsekv_jax.pallas.topk` (Triton; on a CPU it runs interpreted, for tests only).
    ``"fused"`` fuses the encoder with its top-k (`sparsekv_jax.sae.model.resolve_select`); a top-k of
    values already computed takes ``"auto"``'s choice for it.
    """
    if method not in TOPK_METHODS:
        raise ValueError(f"top-k method {method!r} is not one of {TOPK_METHODS}")
    if method == "fused":  # a choice for the encoder + top-k (`sae.model.resolve_select`); of given values: auto's
        method = "auto"
    if method == "auto":
        return "threshold" if dispatch.threshold_top_k_method(backend, width, k) else "lax"
    if method == "blocked" and not blocked_applies(width, k):
        raise ValueError(f"blocked top-k needs a width that is a multiple of 1024 (>= 2048) and k <= "
                         f"width/1024 * 32; got width={width}, k={k}")
    if method == "threshold" and not threshold_top_k_applies(width, k):
        raise ValueError(f"threshold top-k needs a power-of-two width in [16, 65536]; got width={width}, k={k}")
    return method


# _NO_SLICES: XLA turns `lax.top_k` into a sort + slice and rewrites that pattern back into its
# TopK op (the small-k GPU kernel) only if every user of the sort is the [0:k] slice. Taking the
# k-th value as `v[:, -1]` adds a [k-1:k] slice of the sort and silently leaves a full sort
# (seen on CPU); a min-reduction over the top k reads the same value without a slice.


def blocked_candidates(x: jax.Array, k: int, *, block: int = 1024, per_round: int = 16,
                       rounds: int = 2) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Steps 1-3 on rows ``x`` ``[M, W]``: ``(values [M, k], ids [M, k], unsafe)``.

    The values/ids are the top k of the blocks' offers; they are exact wherever ``unsafe`` (a
    scalar) is False.
    """
    M, W = x.shape
    C = W // block
    cur = x.reshape(M * C, block)
    vals, idxs = [], []
    tie_cut = jnp.zeros((M * C,), bool)
    for r in range(rounds):  # static and tiny (2): unrolled on purpose
        v, i = jax.lax.top_k(cur, per_round)
        vals.append(v)
        idxs.append(i)
        if r + 1 < rounds:
            thr = jnp.min(v, axis=-1, keepdims=True)  # = v[:, -1:]; see _NO_SLICES
            # elements equal to the threshold that were not taken would be masked away below
            tie_cut |= (thr[:, 0] > 0) & (jnp.sum(cur >= thr, axis=-1) > per_round)
            cur = jnp.where(cur < thr, cur, -1)  # below every input: taken ones are never offered again
    v = jnp.concatenate(vals, -1)  # [M*C, R*m], each block's offer in descending order
    i = jnp.concatenate(idxs, -1) + (jnp.arange(M * C) % C * block)[:, None]
    smallest_offered = jnp.min(v, axis=-1).reshape(M, C)
    top_v, pos = jax.lax.top_k(v.reshape(M, -1), k)
    top_i = jnp.take_along_axis(i.reshape(M, -1), pos, axis=-1)
    kth = jnp.min(top_v, axis=-1, keepdims=True)
    hidden = (smallest_offered > 0) & (smallest_offered >= kth)
    return top_v, top_i.astype(jnp.int32), jnp.any(hidden) | jnp.any(tie_cut)


def blocked_top_k(x: jax.Array, k: int, *, block: int = 1024, per_round: int = 16,
                  rounds: int = 2) -> tuple[jax.Array, jax.Array]:
    """Exact ``(values, indices)`` of the k largest entries of each row of non-negative ``x`` ``[..., W]``.

    Values are sorted in descending order; ``indices`` are int32. See the module docstring.
    """
    *lead, W = x.shape
    x2 = x.reshape(-1, W)
    top_v, top_i, unsafe = blocked_candidates(x2, k, block=block, per_round=per_round, rounds=rounds)

    def exact():
        v, i = jax.lax.top_k(x2, k)
        return v, i.astype(jnp.int32)

    top_v, top_i = jax.lax.cond(unsafe, exact, lambda: (top_v, top_i))
    return top_v.reshape(*lead, k), top_i.reshape(*lead, k)


def top_k(x: jax.Array, k: int, method: str = "auto", *, ordered: bool = True,
          backend: Backend | None = None) -> tuple[jax.Array, jax.Array]:
    """``(values, int32 indices)`` of the k largest entries along the last axis of non-negative ``x``.

    ``ordered=False`` lets ``"threshold"`` skip the final sort of the k values (its ids are then
    ascending); the other methods are always in descending value order. The threshold kernel runs
    interpreted where ``backend`` says (off a GPU, for tests).
    """
    method = resolve_method(method, x.shape[-1], k, backend)
    if method == "blocked":
        return blocked_top_k(x, k)
    if method == "threshold":
        v, i, _ = dispatch.threshold_top_k(backend, x, k)
        if ordered:
            neg, i = jax.lax.sort((-v, i), dimension=-1, is_stable=True, num_keys=1)
            v = -neg
        return v, i
    v, i = jax.lax.top_k(x, k)
    return v, i.astype(jnp.int32)


def relu_top_k(pre: jax.Array, k: int, method: str = "auto", *, ordered: bool = True,
               backend: Backend | None = None) -> tuple[jax.Array, jax.Array]:
    """`top_k` of ``ReLU(pre)``. The threshold kernel reads ``pre`` itself (it counts entries <= 0 as
    0), which saves the ReLU's write and read of a ``[rows, width]`` array on the GPU."""
    if resolve_method(method, pre.shape[-1], k, backend) == "threshold":
        return top_k(pre, k, "threshold", ordered=ordered, backend=backend)
    return top_k(jax.nn.relu(pre), k, method, ordered=ordered, backend=backend)
