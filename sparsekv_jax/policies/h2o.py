"""H2O (Zhang et al., 2023): heavy hitters + recent tokens, with running eviction.

Score of a KV entry = the attention mass it has received, summed over queries (the paper's
accumulated attention score; summed, not normalised by how many queries could see it, as in
the paper), summed over the query heads of its GQA group. After prefill the cache keeps the
``recent`` most recent tokens plus the heaviest hitters, ``budget`` in all (paper: half and
half). During decode the cache stays at that size: each new token overwrites the entry with the
lowest accumulated score outside the recent window, and every step's attention adds to the
scores. The prefill mass is computed blockwise over query blocks (no T×T matrix; on a GPU in 16
causal segments, about half the square; on a CPU only the causal tiles: `attention_mass`).
When the budget covers the whole prompt the policy is exact dense: no compression, no eviction.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.backend import Backend, resolved
from sparsekv_jax.cache import KVCache, LayerKV
from sparsekv_jax.cache_pooled import PoolCache, logical_positions
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.common import budget_tokens, check_budget, prompt_scores_to_slots
from sparsekv_jax.policies.scored import ScoredCompression


def attention_mass(q: jax.Array, k: jax.Array, lengths: jax.Array, block: int = 256,
                   implementation: str | None = None, backend: Backend | None = None,
                   segments: int = 16) -> jax.Array:
    """Attention mass each key receives from all valid causal queries: ``[B, Hkv, T]`` fp32.

    ``q`` ``[B, T, Hq, D]``, ``k`` ``[B, T, Hkv, D]``. Query blocks are scanned so that no ``T×T``
    score matrix exists. ``implementation``: ``"dense"`` (each query block against every key it may see, a
    slab of scores: few large ops, what a GPU wants), ``"blocked"`` (only the causal
    ``[block, block]`` tiles, in two passes: the row normalisers, then the column sums; half the
    tiles, each in cache: 3x less CPU time than ``"dense"`` at 4k on a CPU) or ``None``: blocked on a
    CPU, dense on a GPU (``backend``'s platform; ``None``: this process's default).

    ``segments`` (dense only): the query blocks in that many causal runs, each against the keys up to its
    last query (static slices), so the slabs cover about ``(1 + 1/segments) / 2`` of the ``T×T`` square
    (53% at 16; 1 is the whole square). 16 because it was the fastest of 1, 2, 4, 8, 16 in every case timed on an
    H200 (Qwen2.5-Coder-1.5B's heads, 8k and 32k, batch 1 and 3): 0.55-0.57x the square's time at 32k, 0.70-0.75x
    at 8k (docs/BENCHMARKS.md, "H2O's prefill mass in causal segments").
    """
    if implementation is None:
        implementation = "dense" if resolved(backend).gpu else "blocked"
    if implementation not in ("dense", "blocked"):
        raise ValueError(f"attention_mass implementation={implementation!r}: expected 'dense', 'blocked' or None")
    if segments < 1:
        raise ValueError(f"attention_mass segments={segments}: expected at least 1")
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    n = -(-T // block)
    pad = ((0, 0), (0, n * block - T), (0, 0), (0, 0))  # padded keys sit after every real query
    if implementation == "blocked":
        return _blocked_mass(jnp.pad(q, pad), jnp.pad(k, pad), lengths, block)[:, :, :T]
    qb = jnp.pad(q, pad).reshape(B, n, block, Hkv, Hq // Hkv, D).transpose(1, 0, 2, 3, 4, 5)
    kp = jnp.pad(k, pad)
    edges = np.linspace(0, n, min(n, segments) + 1).round().astype(int)
    acc = jnp.zeros((B, Hkv, n * block), jnp.float32)
    for first, end in zip(edges[:-1], edges[1:], strict=True):
        if end > first:
            seen = _dense_mass(qb[first:end], kp[:, : end * block], lengths, first, block)
            acc = acc.at[:, :, : end * block].add(seen)
    return acc[:, :, :T]


def _dense_mass(qb: jax.Array, k: jax.Array, lengths: jax.Array, first: int, block: int) -> jax.Array:
    """Attention mass of the query blocks ``qb`` (``[n, B, block, Hkv, G, D]``, the first being block ``first``)
    on the keys ``k`` (``[B, Tk, Hkv, D]``, every key those queries may see): ``[B, Hkv, Tk]`` fp32."""
    B, Tk, Hkv, D = k.shape
    t = jnp.arange(Tk)

    def step(acc, xs):
        qblk, i = xs
        qpos = i * block + jnp.arange(block)  # [block]
        s = jnp.einsum("bqhgd,bthd->bhgqt", qblk, k, preferred_element_type=jnp.float32) / jnp.sqrt(D)
        ok = (t[None, :] <= qpos[:, None])[None] & (qpos[None, :, None] < lengths[:, None, None])  # [B, q, Tk]
        s = jnp.where(ok[:, None, None], s, -jnp.inf)
        p = jnp.where(ok[:, None, None], jax.nn.softmax(s, axis=-1), 0.0)
        return acc + p.sum((2, 3)), None

    acc, _ = jax.lax.scan(step, jnp.zeros((B, Hkv, Tk), jnp.float32), (qb, first + jnp.arange(qb.shape[0])))
    return acc


def _blocked_mass(q: jax.Array, k: jax.Array, lengths: jax.Array, block: int) -> jax.Array:
    """`attention_mass` over causal tiles only; ``q``/``k`` padded to whole blocks. Query block ``i``
    visits key blocks ``0..i`` twice: first for each row's max and normaliser (online, as flash
    attention does), then for the normalised probabilities, summed into the keys' columns."""
    B, Tp, Hq, D = q.shape
    Hkv = k.shape[2]
    n = Tp // block
    qb = q.reshape(B, n, block, Hkv, Hq // Hkv, D).transpose(1, 0, 3, 4, 2, 5)  # [n, B, Hkv, G, block, D]
    kb = k.reshape(B, n, block, Hkv, D).transpose(1, 0, 3, 2, 4)  # [n, B, Hkv, block, D]
    scale = 1.0 / float(D) ** 0.5
    offs = jnp.arange(block)

    def query_block(acc, xs):
        qi, i = xs
        qpos = i * block + offs
        live = (qpos[None, :] < lengths[:, None])[:, None, None, :, None]  # [B, 1, 1, q, 1]

        def scores(j):  # [B, Hkv, G, q, key]: -inf-like above the diagonal (key 0 is always visible)
            kj = jax.lax.dynamic_index_in_dim(kb, j, keepdims=False)
            s = jnp.einsum("bhgqd,bhkd->bhgqk", qi, kj, preferred_element_type=jnp.float32) * scale
            return jnp.where(j * block + offs[None, :] <= qpos[:, None], s, _NEG)

        def normaliser(j, carry):
            m, l = carry
            s = scores(j)
            m_new = jnp.maximum(m, s.max(-1))
            return m_new, l * jnp.exp(m - m_new) + jnp.exp(s - m_new[..., None]).sum(-1)

        init = (jnp.full(qi.shape[:-1], _NEG, jnp.float32), jnp.zeros(qi.shape[:-1], jnp.float32))
        m, l = jax.lax.fori_loop(0, i + 1, normaliser, init)
        log_norm = (m + jnp.log(l))[..., None]

        def columns(j, acc):
            mass = jnp.where(live, jnp.exp(scores(j) - log_norm), 0.0).sum((2, 3))  # [B, Hkv, key]
            seen = jax.lax.dynamic_slice_in_dim(acc, j * block, block, axis=2)
            return jax.lax.dynamic_update_slice_in_dim(acc, seen + mass, j * block, axis=2)

        return jax.lax.fori_loop(0, i + 1, columns, acc), None

    acc, _ = jax.lax.scan(query_block, jnp.zeros((B, Hkv, Tp), jnp.float32), (qb, jnp.arange(n)))
    return acc


_NEG = -1e30  # finite: exp(_NEG - m) is 0 and never NaN


@struct.dataclass
class H2O(ScoredCompression):
    """Heavy-hitter oracle.

    Args:
      budget: fraction of the prompt or token count: the cache size kept during decode too.
      recent_ratio: share of the budget reserved for the most recent tokens (paper: 0.5).
      evict_during_decode: keep the cache at ``budget`` while decoding (the paper's algorithm);
        ``False`` appends decoded tokens after prefill compression instead.
      backend: the run's `Backend`, set by `bind` (`attention_mass`'s implementation is its platform's).
    """

    budget: float | int = struct.field(pytree_node=False, default=0.25)
    recent_ratio: float = struct.field(pytree_node=False, default=0.5)
    evict_during_decode: bool = struct.field(pytree_node=False, default=True)
    backend: Backend | None = struct.field(pytree_node=False, default=None)

    stages = ("compress", "decode")
    writes_in_place = True  # decode_write overwrites at the budget (decode_appends says where): runs on a page pool

    def __post_init__(self) -> None:
        check_budget(self.budget)
        if not 0.0 <= self.recent_ratio <= 1.0:
            raise ValueError(f"recent_ratio={self.recent_ratio} must be in [0, 1]")

    @property
    def needs_decode_probs(self) -> bool:  # type: ignore[override]
        return self.evict_during_decode

    def _recent(self, kept: jax.Array) -> jax.Array:
        return jnp.floor(self.recent_ratio * kept).astype(jnp.int32)

    def forced_counts(self, keep: jax.Array | None) -> tuple[int, int | jax.Array]:
        return 0, (0 if keep is None else self._recent(keep))

    def bind(self, setup: Setup) -> H2O:
        return super().bind(setup).replace(backend=setup.backend)

    def observe(self, q, k, v, hidden, layer_index, prompt: Prompt) -> jax.Array:
        return attention_mass(q, k, prompt.lengths, backend=self.backend)

    def score(self, cache: KVCache, observations: Any, prompt: Prompt) -> jax.Array:
        return prompt_scores_to_slots(observations, cache.capacity)

    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        kept = budget_tokens(self.budget, prompt_len)
        if kept >= prompt_len:
            return None
        # evicting: room for the kept entries and a suffix read after compression (the question,
        # question-agnostic); decoding then stays at that size
        return kept + suffix_tokens if self.evict_during_decode else kept + max_new_tokens

    def compressed_pages(self, lengths: np.ndarray, prompt_len: int, max_new_tokens: int, page_size: int,
                         num_layers: int, num_kv_heads: int, suffix_tokens: int = 0) -> int | None:
        """Evicting (the default), a head never holds more than its row's budget and the suffix read after
        compression (``suffix_tokens``: the widest, so a row's size ``n_b + q_b`` fits), decoded tokens overwrite:
        ``L·Hkv·Σ_b pages_for(n_b + suffix_tokens)``. Not evicting, the scored compressors' bound (the budget
        and every token to come, the suffix's included)."""
        return super().compressed_pages(lengths, prompt_len, suffix_tokens if self.evict_during_decode
                                        else max_new_tokens, page_size, num_layers, num_kv_heads, suffix_tokens)

    # -- running eviction -----------------------------------------------------------------
    def decode_init(self, cache: KVCache, observations: Any) -> tuple[Any, Any]:
        if not self.evict_during_decode or observations is None:
            return None, None
        T = observations.shape[-1]
        if budget_tokens(self.budget, T) >= T:  # the budget covers the prompt: exact dense, no eviction
            return None, None
        # scores of the entries the compressed cache kept, found by their original position
        if isinstance(cache, PoolCache):  # a page pool (Options(pool=True)): each head's logical slots
            pos = logical_positions(cache)
        else:
            pos = cache.layers.positions
        scores = jnp.take_along_axis(observations, jnp.clip(pos, 0, T - 1), axis=-1)
        scores = jnp.where((pos >= 0) & (pos < T), scores, 0.0)  # suffix tokens start at 0
        # each row stays at its own size (its budget + its suffix), not at the batch's capacity:
        # a short row in a batch evicts exactly as it would alone; on a pool each head at its own
        size = cache.lengths if isinstance(cache, PoolCache) else jnp.broadcast_to(cache.length, pos.shape[:2])
        return {"scores": scores, "size": size}, None  # size [L, B], or [L, B, Hkv] on a pool

    def decode_write(self, kv: LayerKV, length: jax.Array, layer_state: Any) -> tuple[jax.Array, jax.Array]:
        """``(slot [B, Hkv], new_length)``: at its size a head overwrites its lowest-scored entry outside the recent
        window, below it appends. ``length`` is a row's ``[B]`` (the uniform cache) or each head's ``[B, Hkv]``
        (a page pool, whose ``layer_state["size"]`` is per head too); ``new_length`` has its shape."""
        if layer_state is None:
            return length, length + 1
        row = length.ndim == 1  # static: a row's length [B], or each head's [B, Hkv]
        heads = (lambda x: x[:, None]) if row else (lambda x: x)  # noqa: E731 -- [B] or [B, Hkv] -> per head
        slots = (lambda x: x[:, None, None]) if row else (lambda x: x[..., None])  # noqa: E731 -- -> per slot
        size = jnp.minimum(layer_state["size"], kv.k.shape[2])  # [B] or [B, Hkv]
        newest = jnp.max(kv.positions, axis=(1, 2))  # [B] position of the last token written
        protected = kv.positions > slots((newest if row else newest[:, None]) - self._recent(jnp.minimum(length, size)))
        # a hole (a slot below the length that this head leaves empty after a merging compressor)
        # is the cheapest victim: nothing is lost by writing there
        hole = (kv.positions < 0) & (jnp.arange(kv.positions.shape[-1]) < slots(length))
        s = jnp.where(protected | (kv.positions < 0), jnp.inf, layer_state["scores"])
        s = jnp.where(hole, -jnp.inf, s)
        victim = jnp.argmin(s, axis=-1).astype(jnp.int32)  # [B, H]
        full = heads(length >= size)
        slot = jnp.where(full, victim, heads(length))
        return slot, jnp.minimum(length + 1, size)

    def decode_appends(self, layer_state: Any, lengths: jax.Array) -> jax.Array:
        """``[L, B, Hkv]``: a head below its size appends, one at its size overwrites (`decode_write`)."""
        if layer_state is None:
            return jnp.ones(lengths.shape, jnp.bool_)
        size = layer_state["size"]
        return lengths < (size[..., None] if size.ndim == 2 else size)

    def decode_observe(self, layer_state: Any, probs: jax.Array, kv: LayerKV) -> Any:
        if layer_state is None:
            return None
        B, Hq, S = probs.shape
        Hkv = kv.k.shape[1]
        # the slot written this step (the newest position) starts its score afresh
        fresh = kv.positions == kv.positions.max(axis=-1, keepdims=True)
        scores = jnp.where(fresh, 0.0, layer_state["scores"]) + probs.reshape(B, Hkv, Hq // Hkv, S).sum(2)
        return {**layer_state, "scores": scores}
