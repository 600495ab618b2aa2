"""Stem (Niu et al., 2026): block-sparse prefill with a position-decaying budget and an
output-aware block metric. Decode stays dense (compose with `Pipeline` for a sparse decode).

Per layer, from the RoPE'd ``q``/``k``/``v`` of the prompt (paper Algorithm 1):

1. **Block metric** (OAM, Eq. 7). Queries and keys are cut into blocks of ``block_size``. The
   routing term of (query block ``I``, key block ``J``) is XAttention's anti-diagonal estimate
   of the attention mass, in log units: inside every ``stride x stride`` tile of ``QK^T`` only
   the anti-diagonal is summed (one matmul over ``[T/stride, stride*D]`` reshapes), each strided
   query row takes a softmax over its causal tiles' mean logits ``q.k / sqrt(D)``, the
   probabilities are summed over the key block and averaged over the query block's rows, and the
   log is taken: ``log P(J | I)``. Then ``metric = log P(J | I) + beta * max(0, log ||V||_J)``
   with ``log ||V||_J`` the max over the key block's tokens (per KV head): Eq. 6's
   ``log(P_ij ||V_j||)`` at block level, with Eq. 7's ``beta`` and truncation. Why log-mass and
   not the block's mean logit (what "Q-bar K-bar^T" in Algorithm 1 reads like): on SmolLM2 at 2k
   with the same budget the mean logit picked blocks that gave 2.8x the final-token KL of the
   mass estimate (0.155 vs 0.056; exact block masses: 0.019), and the log of a probability is
   what Eq. 6 adds ``log ||V||`` to. Tiles after the diagonal are masked at tile level (the
   diagonal tile counts whole: a few future logits that touch only the diagonal block, which is
   always kept). Query rows past a row's length are left out of the average.
2. **Budget** (TPD, Eq. 3, at block granularity): query block ``i = 1..N`` (``N`` = the row's
   own block count, not the padded width) gets ``k(i) = ceil(k_start - k_start (1 - mu) i / N)``
   key blocks, with ``k_start = max(k_start_ratio * N, floor)``. ``schedule="uniform"`` is the
   paper's ablation baseline: ``k_uni = (1 + mu) / 2 * k_start`` (``0.85 k_start``) for every
   block -- equal total budget only where ``k_start << N`` (the causal triangle cuts the decay's
   large early budgets more), so compare block fractions too.
3. **Selection** per KV head (the kernel reads one list per KV head), on the max over the GQA
   group's query heads of the routing term (``gqa="max"``; ``"mean"`` also offered): a block
   that any head of the group needs is ranked by that head. ``sink_blocks`` initial and
   ``local_blocks`` most recent blocks (the diagonal among them) are always listed and *count
   inside* ``k(i)``; the rest of the list is the top-scored causal blocks. Count of query block
   ``i`` (0-based) = ``min(max(k(i+1), forced), i + 1)``. Query blocks past a row's length
   (right padding) list only their forced blocks.

Paper defaults (section 3.1) and the choices made where it is vague or aimed at 8B models. The
numbers: SmolLM2-135M, RULER question-agnostic (`sparsekv eval`, seed 0), bf16, one H100:

* ``mu = 0.7``, ``beta = 0.2``, 4 initial + 4 local blocks, ``stride = 8`` (XAttention's): as
  the paper. ``k_start_ratio=None``: 0.2 up to 16k tokens, 0.1 beyond (paper: 0.2 for 8k-16k,
  0.1 beyond 16k; nothing below 8k, where the floor takes over).
* ``min_blocks=None``: the floor is the paper's "minimum total budget of 54 blocks" kept in
  *tokens* (6912), i.e. 108 blocks of 64 (``Stem(block_size=128)`` gets the paper's 54). So
  prompts up to ~4.8k tokens are exactly dense, 8k computes 87% of the causal blocks, 16k 56%,
  32k 32%. Sparser floors were tried because the target is >= 99% of dense RULER at 4k and 8k:
  a 2048-token floor (64% of the blocks at 4k, 37% at 8k) kept 100.7% at 4k but 80% at 8k;
  4096 tokens (64% at 8k) 82% (GQA mean) / 92% (max); 5120 tokens 92%; 6912 tokens 97% (n=10
  per task) and 100.1% at n=25 (21.82 vs 21.79). A 135M model at its 8k window loses RULER
  points under any real prefill sparsity, so the default is the paper's floor and
  ``stem(min_blocks=32)`` the sparser setting.
* ``gqa="max"`` (the paper, written for per-head selection, does not say): same budget, 8k,
  4096-token floor: 92% vs 82% of dense RULER for the group mean; logit KL against dense 0.20
  vs 0.25 (2048-token floor, ``experiments/stem_ablation.py``).
* ``block_size = 64`` (paper: 128): at a 2048-token floor and 8k, blocks of 128 / 64 / 32 gave a
  last-128-token KL against dense of 0.25 / 0.21 / 0.17 (3 prompts): finer blocks spend the
  same tokens more precisely; 64 keeps the kernel's tiles efficient for head_dim 64.
* When every row of a prompt width is covered by its budget (short prompts under the floor)
  ``prefill_pattern`` returns ``None``: the dense (cuDNN) path, exactly `FullKV`'s prefill.

The list width ``K`` comes from the padded width ``T = q.shape[1]``, static inside the trace, so
Stem needs no ``bind``. The routing (`sparsekv_jax.policies.stem_routing`) runs Algorithm 1's loop
over query blocks as a `lax.map` over tiles of them: each step scores its blocks and keeps only their
lists, so neither the ``[T/stride]^2`` strided scores nor the ``[nQ, nK]`` block metric is ever
written whole (``routing="full"``, the reference, builds the metric, then one top-k).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.policies.base import Policy, Prompt
from sparsekv_jax.policies.stem_routing import (  # noqa: F401 (select_blocks re-exported)
    antidiagonal_routing,
    block_counts,
    dense_from,
    routed_blocks,
    select_blocks,
    value_magnitude,
)

LONG_CONTEXT = 16384  # tokens: above this the automatic k_start ratio drops from 0.2 to 0.1 (paper 3.1)
PAPER_MIN_TOKENS = 54 * 128  # the paper's minimum budget: 54 blocks of 128 (3.1), the default floor in tokens
_EPS = 1e-9  # ceil(x - eps): float64 rounding never adds a block (exact decimal settings are >= 1e-8 apart)


def _is_number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_pow2(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1 and not x & (x - 1)


@functools.lru_cache(maxsize=32)
def budget_table(n_blocks: int, block_size: int, *, k_start_ratio: float | None, mu: float, min_blocks: int,
                 schedule: str) -> np.ndarray:
    """``k(i)`` of Eq. 3 for every row size: ``[n_blocks + 1, n_blocks]`` int32, row ``N`` = a prompt of
    ``N`` blocks, column ``i - 1`` = its query block ``i`` (columns past ``N`` continue the formula).

    Built on the host in float64 (exact for decimal settings: ``ceil`` of a value that lies a hair
    above an integer must not drop a block, which float32 on the device cannot promise for large
    ``N``) and gathered by each row's block count inside the trace. The automatic ratio depends
    on the length only through ``N``: ``block_size`` divides ``LONG_CONTEXT``. Cached (read-only):
    every layer's trace and the static checks ask for the same table.
    """
    N = np.arange(n_blocks + 1, dtype=np.float64)[:, None]
    if k_start_ratio is None:
        ratio = np.where(N * block_size > LONG_CONTEXT, 0.1, 0.2)
    else:
        ratio = float(k_start_ratio)
    k_start = np.maximum(ratio * N, float(min_blocks))
    i = np.arange(1, n_blocks + 1, dtype=np.float64)[None, :]
    if schedule == "uniform":
        k = np.broadcast_to((1.0 + mu) / 2.0 * k_start, (n_blocks + 1, n_blocks))
    else:
        k = k_start - k_start * (1.0 - mu) / np.maximum(N, 1.0) * i
    table = np.ceil(k - _EPS).astype(np.int32)
    table.flags.writeable = False
    return table


@struct.dataclass
class Stem(Policy):
    """Stem block-sparse prefill (dense decode).

    Args:
      block_size: query/key block in tokens (paper: 128; default 64, see the module docstring).
      k_start_ratio: ``k_start`` as a fraction of the row's blocks; ``None`` = 0.2 up to 16k
        tokens, 0.1 beyond (paper). Values > 1 are allowed (``>= 1 / mu`` is dense).
      mu: ``k_end / k_start`` (paper: 0.7).
      beta: weight of the value-magnitude term (paper: 0.2; 0 = routing only, the paper's SAM).
      sink_blocks, local_blocks: initial / most recent blocks always computed (paper: 4 and 4;
        the local ones include the diagonal, so at least 1).
      min_blocks: floor on ``k_start`` in blocks; ``None`` = the paper's 54 blocks of 128 (6912
        tokens) in blocks of ``block_size``.
      schedule: ``"decay"`` (TPD, Eq. 3) or ``"uniform"`` (``k_uni = (1 + mu) / 2 * k_start``).
      stride: anti-diagonal stride of the routing estimate (XAttention: 8); divides block_size.
      gqa: how the query heads of a GQA group combine their routing: ``"max"`` or ``"mean"``.
      routing: ``"tiled"`` (one tile of query blocks at a time, only the lists kept:
        `stem_routing.routed_blocks`), ``"full"`` (the whole ``[nQ, nK]`` metric, then one top-k:
        the reference; same lists as ``"tiled"``, kept for comparison and timing) or ``"kernel"``
        (``"tiled"`` with each tile's metric from the Pallas kernel `sparsekv_jax.pallas.stem_route`,
        interpreted off a GPU: equal up to rounding, so a list cut at a near-tie may differ; not yet
        checked on a GPU, hence not the default).
      route_tile: query blocks per step of the tiled routing; ``None`` = as many as keep a step's
        largest buffer within `stem_routing.TILE_ELEMENTS` (256 MiB of fp32; `route_tile`). Memory
        and speed only.
      dense_question: opt-in, not in the paper (default ``False``). With a ``question_start`` (the
        harness' question-aware mode) the query blocks from the one holding the question's first
        token on compute every causal block, so the question reads the context densely, as it
        does question-agnostic, where it comes after the prefill. Why: on Qwen2.5-Coder-1.5B at
        32k, 25%, Stem with the question in the prompt kept 5.85 [2.42, 9.35] RULER points less
        than without it (docs/RESULTS.md, stage 23). Costs one dense row of blocks per question
        block and lists ``nQ`` wide. Without a ``question_start`` it changes nothing.
    """

    block_size: int = struct.field(pytree_node=False, default=64)
    k_start_ratio: float | None = struct.field(pytree_node=False, default=None)
    mu: float = struct.field(pytree_node=False, default=0.7)
    beta: float = struct.field(pytree_node=False, default=0.2)
    sink_blocks: int = struct.field(pytree_node=False, default=4)
    local_blocks: int = struct.field(pytree_node=False, default=4)
    min_blocks: int | None = struct.field(pytree_node=False, default=None)
    schedule: str = struct.field(pytree_node=False, default="decay")
    stride: int = struct.field(pytree_node=False, default=8)
    gqa: str = struct.field(pytree_node=False, default="max")
    routing: str = struct.field(pytree_node=False, default="tiled")
    route_tile: int | None = struct.field(pytree_node=False, default=None)
    dense_question: bool = struct.field(pytree_node=False, default=False)

    stages = ("prefill",)
    needs_whole_prefill = True

    @property
    def name(self) -> str:
        """``Stem`` with every field set away from its default (``Stem(min_blocks=32)``)."""
        shown = [f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(Stem)
                 if getattr(self, f.name) != f.default]
        return f"Stem({', '.join(shown)})" if shown else "Stem"

    def __post_init__(self) -> None:
        if not _is_pow2(self.block_size) or not 16 <= self.block_size <= 4096:
            raise ValueError(f"block_size={self.block_size!r} must be a power of two in [16, 4096] (the prefill "
                             "kernel's granularity)")
        if self.k_start_ratio is not None and not (_is_number(self.k_start_ratio) and self.k_start_ratio > 0):
            raise ValueError(f"k_start_ratio={self.k_start_ratio!r} must be a positive number or None (automatic)")
        if not (_is_number(self.mu) and 0 < self.mu <= 1):
            raise ValueError(f"mu={self.mu!r} must lie in (0, 1]")
        if not (_is_number(self.beta) and self.beta >= 0):
            raise ValueError(f"beta={self.beta!r} must be a number >= 0")
        for name in ("sink_blocks", "min_blocks"):
            value = getattr(self, name)
            if (name == "sink_blocks" or value is not None) and not (
                    isinstance(value, int) and not isinstance(value, bool) and value >= 0):
                raise ValueError(f"{name}={value!r} must be an integer >= 0" + (" or None" * (name == "min_blocks")))
        if not (isinstance(self.local_blocks, int) and not isinstance(self.local_blocks, bool)
                and self.local_blocks >= 1):
            raise ValueError(f"local_blocks={self.local_blocks!r} must be an integer >= 1 (it includes the diagonal)")
        if self.schedule not in ("decay", "uniform"):
            raise ValueError(f"schedule={self.schedule!r} must be 'decay' or 'uniform'")
        if not _is_pow2(self.stride) or self.stride > self.block_size:
            raise ValueError(f"stride={self.stride!r} must be a power of two <= block_size={self.block_size}")
        if self.gqa not in ("mean", "max"):
            raise ValueError(f"gqa={self.gqa!r} must be 'mean' or 'max'")
        if self.routing not in ("tiled", "full", "kernel"):
            raise ValueError(f"routing={self.routing!r} must be 'tiled', 'full' or 'kernel'")
        if self.route_tile is not None and not (isinstance(self.route_tile, int) and not isinstance(
                self.route_tile, bool) and self.route_tile >= 1):
            raise ValueError(f"route_tile={self.route_tile!r} must be an integer >= 1 or None (automatic)")
        if not isinstance(self.dense_question, bool):
            raise ValueError(f"dense_question={self.dense_question!r} must be True or False")

    @classmethod
    def covering(cls) -> Stem:
        return cls(k_start_ratio=2.0)  # >= 1 / mu: every block of every row

    @property
    def floor_blocks(self) -> int:
        """The floor on ``k_start`` in blocks: ``min_blocks``, or the paper's 6912 tokens in blocks."""
        return PAPER_MIN_TOKENS // self.block_size if self.min_blocks is None else self.min_blocks

    def table(self, n_blocks: int) -> np.ndarray:
        """`budget_table` of this policy (host, static)."""
        return budget_table(n_blocks, self.block_size, k_start_ratio=self.k_start_ratio, mu=self.mu,
                            min_blocks=self.floor_blocks, schedule=self.schedule)

    def schedule_for(self, lengths: Any, n_blocks: int, xp: Any = jnp) -> Any:
        """``k(i)`` ``[B, n_blocks]`` for query blocks ``i = 1..n_blocks`` of rows of ``lengths`` tokens
        (``xp``: ``jnp`` for traced lengths, ``np`` on the host)."""
        rows = xp.clip((xp.asarray(lengths) + self.block_size - 1) // self.block_size, 0, n_blocks)
        return xp.asarray(self.table(n_blocks))[rows]

    def list_width(self, T: int) -> int:
        """Static list width ``K`` for a padded prompt width ``T``: the largest count any row can get."""
        n = -(-T // self.block_size)
        peak = int(self.table(n)[:, 0].max())  # k(i) of a row peaks at its first block
        return max(1, min(n, max(peak, self.sink_blocks + self.local_blocks)))

    def is_dense(self, T: int) -> bool:
        """Whether every row of a padded width ``T`` computes every causal block (static).

        A row of ``N`` blocks is dense iff its last block is: ``k(i)`` falls while ``i`` grows.
        """
        n = -(-T // self.block_size)
        N = np.arange(1, n + 1)
        last = np.maximum(self.table(n)[N, N - 1], self.sink_blocks + self.local_blocks)
        return bool((last >= N).all())

    def block_metric(self, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array) -> jax.Array:
        """OAM (Eq. 7) per KV head: ``[B, Hkv, nQ, nK]`` fp32 (future blocks not masked)."""
        B, _, Hq, _ = q.shape
        Hkv = k.shape[2]
        routing = antidiagonal_routing(q, k, lengths, self.block_size, self.stride)
        routing = routing.reshape(B, Hkv, Hq // Hkv, *routing.shape[2:])
        routing = routing.mean(2) if self.gqa == "mean" else routing.max(2)
        if self.beta == 0:  # routing only (SAM): V never read
            return routing
        magnitude = value_magnitude(v, lengths, self.block_size)  # [B, Hkv, nK]
        return routing + self.beta * jnp.maximum(magnitude, 0.0)[:, :, None, :]

    def prefill_pattern(self, q: jax.Array, k: jax.Array, v: jax.Array, layer_index: jax.Array,
                        prompt: Prompt) -> Any:
        lengths = prompt.lengths
        T = q.shape[1]
        if self.is_dense(T):
            return None
        n = -(-T // self.block_size)
        budget = self.schedule_for(lengths, n)
        width, Hkv = self.list_width(T), k.shape[2]
        if self.routing == "full":
            ids, counts = select_blocks(self.block_metric(q, k, v, lengths), budget, lengths, self.block_size,
                                        self.sink_blocks, self.local_blocks, width)
        else:
            ids = routed_blocks(q, k, v, lengths, block_size=self.block_size, stride=self.stride, beta=self.beta,
                                gqa=self.gqa, sink_blocks=self.sink_blocks, local_blocks=self.local_blocks,
                                width=width, tile=self.route_tile,
                                method="pallas" if self.routing == "kernel" else "jnp")
            counts = block_counts(budget, lengths, self.block_size, self.sink_blocks, self.local_blocks, width, Hkv)
        if self.dense_question and prompt.question_start is not None:
            ids, counts = dense_from(ids, counts, prompt.question_start - prompt.offset, lengths, self.block_size)
        return ids, counts, self.block_size
