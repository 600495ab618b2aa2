"""PyramidKV (Cai et al., 2024, *PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling*): budgets that shrink linearly from the bottom layer to the top.

Attention spreads over the whole prompt in the lower layers and concentrates on a few tokens in the
upper ones, so the lower layers get more of the budget. Per row, with ``n`` the inner's per-head
budget and ``w`` the entries it always keeps (sinks + observation window, kept in every layer), the
scored part ``m = n - w`` is scheduled as the paper does: the top layer keeps ``floor(m/beta)``
(``total/(beta·L)`` of the layers' total ``L·m``; paper ``beta=20``), the bottom layer
``2m - floor(m/beta)``, the layers between on the straight line, so the mean over layers is ``m``.
When the bottom layer would need more than the prompt holds (``length - w``), it keeps the whole
prompt and the top layer gets ``2m - (length - w)`` (the paper's clip, the mean still ``m``).

Integer counts: the line's values are ``(max·(L-1) - l·(max - min)) / (L-1)``; each layer gets its
floor and the layers with the largest remainders one more (lower layers first on ties), so the
layers' total is exactly ``L·m``, every count lies between its line value's floor and ceiling and the
counts never increase upwards. (The paper's code divides the step by ``L`` with integer division,
which leaves the total a little under the budget; the step over ``L - 1`` gives the top layer its
``total/(beta·L)`` exactly, as kvpress does.) Every head of a layer keeps the same count, its own
best by the inner's scores.

Memory: today's cache has one capacity for every layer, so the compressed cache is sized for the
bottom layer, ``min(prompt, n + m - floor(m/beta))`` entries (plus the tokens still to come), and the
upper layers leave holes (bias −∞): the attention is PyramidKV's, the memory the bottom layer's,
until the per-head page pool (issue #38, item 1) lands.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.cache import pages_for
from sparsekv_jax.policies.adakv import BudgetAllocation, as_fraction
from sparsekv_jax.policies.common import budget_tokens, row_budgets


def pyramid_counts(m: jax.Array, avail: jax.Array, num_layers: int, beta: float) -> jax.Array:
    """``[L, B]`` scored entries per layer (layer 0 at the bottom) for rows whose mean is ``m`` ``[B]``
    and which hold ``avail`` ``[B]`` (>= ``m``) scorable entries (the module docstring's schedule)."""
    m = m.astype(jnp.int32)
    if num_layers == 1:
        return m[None]
    b = as_fraction(beta)
    low = (m * b.denominator) // b.numerator  # floor(m / beta)
    high = 2 * m - low
    over = high > avail
    high = jnp.where(over, avail, high)
    low = jnp.where(over, 2 * m - avail, low)
    steps = num_layers - 1
    line = high[None] * steps - jnp.arange(num_layers)[:, None] * (high - low)[None]  # [L, B], × (L-1)
    base, rem = line // steps, line % steps
    short = num_layers * m - base.sum(0)  # [B], in [0, L): the remainders' sum / (L-1)
    # rank of each layer by remainder (largest first, lower layer first on ties)
    rank = jnp.argsort(jnp.argsort(-rem, axis=0, stable=True), axis=0)
    return base + (rank < short[None]).astype(jnp.int32)


@struct.dataclass
class PyramidKV(BudgetAllocation):
    """PyramidKV's per-layer schedule over a scored compressor: ``PyramidKV(SnapKV(0.25))``.

    Per row: layer ``l`` of ``L`` keeps ``w + k_l`` entries per KV head, ``k_l`` falling linearly from
    ``2m - floor(m/beta)`` (bottom) to ``floor(m/beta)`` (top) with mean ``m = n - w`` (``n``: the
    inner's per-head budget for the row, ``w``: its sinks + window). With Gemma 3's interleaved
    layers the schedule runs over the global layers (the cache the policy compresses).

    Memory is the bottom layer's (one capacity for every layer until the page pool of issue #38
    lands): ``min(prompt, n + m - floor(m/beta))`` entries per head.

    Args:
      inner: the scored compressor whose scores and budget are used (default ``SnapKV(0.25)``).
      beta: the top layer keeps ``1/beta`` of the mean (paper: 20; ``beta=1`` is the inner's uniform
        allocation). At least 1.
    """

    beta: float = struct.field(pytree_node=False, default=20.0)

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.beta, bool) or not isinstance(self.beta, (int, float)) or not self.beta >= 1:
            raise ValueError(f"PyramidKV beta={self.beta!r} must be a number >= 1 (paper: 20): the top layer keeps "
                             "1/beta of the mean budget")

    def max_kept(self, prompt_len: int) -> int:
        n = budget_tokens(self.inner.budget, prompt_len)
        sinks, window = self.inner.forced_counts(None)
        m = n - min(n, sinks + window)  # the largest scored share a row can have (H2O's recent: 0 here)
        b = as_fraction(self.beta)
        return n + m - (m * b.denominator) // b.numerator

    def compressed_pages(self, lengths: np.ndarray, prompt_len: int, max_new_tokens: int, page_size: int,
                         num_layers: int, num_kv_heads: int, suffix_tokens: int = 0) -> int | None:
        """Each head of layer ``l`` keeps that layer's count (`allocate`'s, for each row's length) and the
        tokens to come: ``Hkv·Σ_b Σ_l pages_for(n_lb + max_new_tokens)``."""
        if self.compressed_capacity(prompt_len, max_new_tokens) is None:
            return None
        length = jnp.asarray(lengths, jnp.int32)
        keep = row_budgets(self.inner.budget, length)
        sinks, window = self.inner.forced_counts(keep)
        floor = jnp.minimum(sinks + jnp.asarray(window, jnp.int32), keep)
        counts = np.asarray(self.allocate(jnp.zeros((num_layers, len(lengths), 1, 1)), length, keep, floor))
        return num_kv_heads * sum(pages_for(int(c) + max_new_tokens, page_size) for c in counts.ravel())

    def allocate(self, scores: jax.Array, length: jax.Array, keep: jax.Array, floor: jax.Array) -> jax.Array:
        L, B, H, _ = scores.shape
        counts = floor[None] + pyramid_counts(keep - floor, length - floor, L, self.beta)  # [L, B]
        return jnp.broadcast_to(counts[:, :, None], (L, B, H))
