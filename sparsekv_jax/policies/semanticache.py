"""SemantiCache (Wu et al., 2025): delimiter chunking, greedy seed-based clustering (GSC), merged
semantic cores with proportional attention. A compressor that *merges* KV entries.

The paper (``../shared/papers/002_*``), per (layer, KV head), on the prompt's entries:

* **Semantic chunking.** The prompt is cut at delimiter tokens into chunks; delimiters are kept
  unmerged as anchors (Eq. 1).
* **GSC** (Algorithm 1) inside each chunk: the first unassigned token seeds a cluster that absorbs
  every *later* unassigned token whose key cosine with the seed exceeds ``tau`` (Eq. 2).
* **Merging.** A cluster becomes one entry: the mean key and mean value (Eq. 3), with bias
  ``log |S|`` in the cache's per-slot bias, so every decode path computes
  ``softmax(q·k/√d + log s)·V`` (proportional attention, Eq. 4) — the Pallas decode kernel included.

Choices where the paper is silent (docs/SEMANTICACHE.md shows them in ablations):

* **Delimiter tokens.** A token is a delimiter when its decoded text is non-empty and consists only
  of the paper's characters ``. , ? ! ; :`` space, tab, newline (SmolLM2: 177 of 49,152 tokens, e.g.
  ``"."``, ``" "``, ``"\\n\\n"``, ``" ."``). "Space" is read as a token that *is* whitespace, not one
  that starts with a space: SmolLM2's BPE glues the leading space to 65% of its vocabulary (every
  word after the first), so that reading would make nearly every word an unmerged anchor. The mask
  over the vocabulary is computed once (`delimiter_mask`) and held as a leaf.
* **Sinks and window.** The first ``sinks`` (4) and last ``window`` (32) prompt entries are kept as
  they are, counted inside the budget (as every compressor here).
* **Bounded chunks.** A run of more than ``chunk_size`` (64) tokens without a delimiter is split, so
  GSC is a loop over the places in a chunk (to the longest chunk present, at most ``chunk_size``
  steps), vectorised over all chunks, heads, rows and thresholds (one band of ``chunk_size``
  cosines per token, computed once; one gather per step).
* **Keys.** Similarity and merging use *pre-RoPE* keys by default (each cached key is rotated back
  by its position): the cosine of contents, without RoPE's position phase. A cluster's key is the
  mean content rotated to the cluster's *mean position* (rounded); a singleton keeps its stored key
  bit for bit. ``keys="post_rope"`` compares and averages the stored keys (position: the mean too).
* **Budget mode** (``tau=None``): per (layer, row, KV head) the *largest* ``tau`` whose clusters fit
  the budget: a pass of ``search_steps`` thresholds log-spaced below the top (`search_grid`), then
  a linear pass between the last that did not fit and the first that did; each pass evaluates all
  its thresholds at once. When even one cluster per chunk does not fit (dense punctuation: about a
  quarter of RULER's noise haystack is delimiters), the row falls back, in order: delimiters stop
  being anchors and close their chunk (a chunk = a clause and its delimiters); then fixed
  ``chunk_size`` blocks (`SemantiCache.layout` reports the level). The kept count never exceeds
  the budget.
* **Threshold mode** (``tau=x``): GSC at ``x`` (the paper's); ``budget`` is then a cap (the static
  cache capacity): heads that would keep more merge at the largest lower threshold that fits.
  ``SemantiCache(budget=1.0, tau=x)`` is the paper's pure threshold (room for the whole prompt).

On SmolLM2 the digits of RULER's needles (one token each) have more similar keys than a clause's
words, so GSC merges a needle's number before the haystack around it (docs/SEMANTICACHE.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.cache import KVCache
from sparsekv_jax.models.rope import apply_rope, inverse_frequencies
from sparsekv_jax.policies.base import Policy, Prompt, Setup
from sparsekv_jax.policies.common import budget_tokens, check_budget, check_sinks_window, row_budgets, write_entries

DELIMITERS = ".,?!;: \t\n"  # the paper's set: . , ? ! ; : space tab newline
CHUNKINGS = ("delimiters", "fixed", "none")
KEYS = ("pre_rope", "post_rope")
MERGE_ALL = -2.0  # below every cosine: one cluster per chunk


def delimiter_mask(tokenizer: Any, delimiters: str = DELIMITERS) -> np.ndarray:
    """``[V]`` bool over the tokenizer's ids: the decoded token is non-empty and made only of
    ``delimiters`` characters."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], clean_up_tokenization_spaces=False)
    chars = set(delimiters)
    return np.array([bool(s) and set(s) <= chars for s in texts], bool)


def chunk_layout(is_delim: jax.Array, lengths: jax.Array, sinks: jax.Array, window: jax.Array, level: jax.Array,
                 chunk_size: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Where each prompt slot goes, per row (``[B, T]`` each): ``(forced, anchor, member, place)``.

    ``forced``: sinks and window (kept as they are); ``anchor``: delimiters kept unmerged;
    ``member``: clustered; ``place``: its index in its chunk (``-1`` off members). ``level`` ``[B]``:
    0 = the paper (chunks between delimiters, delimiters anchors), 1 = a chunk is a run of words and
    the delimiters after it (no anchors), 2 = ``chunk_size`` blocks of the middle. Chunks longer
    than ``chunk_size`` are split.
    """
    T = is_delim.shape[1]
    t = jnp.arange(T)[None]
    live = t < lengths[:, None]
    forced = live & ((t < sinks[:, None]) | (t >= (lengths - window)[:, None]))
    middle = live & ~forced
    delim = is_delim & middle
    lvl = level[:, None]
    anchor = delim & (lvl == 0)
    member = middle & ~anchor

    def prev(x):
        return jnp.pad(x[:, :-1], ((0, 0), (1, 0)))

    clause = ~prev(middle) | (prev(delim) & ~delim)  # level 1: words, then the delimiters closing them
    block = (t - sinks[:, None]) % chunk_size == 0
    start = jnp.where(lvl == 0, ~prev(member), jnp.where(lvl == 1, clause, block))
    run_start = jax.lax.cummax(jnp.where(member & start, t, -1), axis=1)
    place = jnp.where(member, (t - run_start) % chunk_size, -1)
    return forced, anchor, member, place


def similarity_band(keys: jax.Array, width: int) -> jax.Array:
    """``[..., T, width]`` cosines ``band[t, o] = cos(k_t, k_{t-o})`` of ``keys`` ``[..., T, D]``
    (one matmul per block of ``width`` tokens against itself and the block before)."""
    *lead, T, D = keys.shape
    u = keys.astype(jnp.float32)
    u = u / jnp.maximum(jnp.linalg.norm(u, axis=-1, keepdims=True), 1e-12)
    n = -(-T // width)
    blocks = jnp.pad(u, [(0, 0)] * len(lead) + [(0, n * width - T), (0, 0)]).reshape(*lead, n, width, D)
    before = jnp.pad(blocks, [(0, 0)] * len(lead) + [(1, 0), (0, 0), (0, 0)])[..., :n, :, :]
    both = jnp.concatenate([before, blocks], axis=-2)  # [..., n, 2w, D]
    sims = jnp.einsum("...ad,...cd->...ac", blocks, both, preferred_element_type=jnp.float32)  # [..., n, w, 2w]
    a, o = np.arange(width)[:, None], np.arange(width)[None, :]
    index = jnp.broadcast_to(jnp.asarray(width + a - o), sims.shape[:-1] + (width,))
    band = jnp.take_along_axis(sims, index, axis=-1).reshape(*lead, n * width, width)[..., :T, :]
    return jnp.clip(band, -1.0, 1.0)  # a cosine never exceeds 1: tau = 1 merges nothing, not even duplicates


def greedy_seed_clustering(band: jax.Array, member: jax.Array, place: jax.Array, taus: jax.Array) -> jax.Array:
    """Algorithm 1 in every chunk at once: ``[K, B, H, T]`` each member's distance back to its
    cluster's seed (0 for a seed and off members), for ``K`` thresholds ``taus`` ``[K, B, H]``.

    ``band`` ``[B, H, T, width]`` (`similarity_band`), ``member``/``place`` ``[B, T]``
    (`chunk_layout`). Step ``s`` makes every still unassigned member at place ``s`` a seed, and
    each seed absorbs the later unassigned members of its chunk whose cosine with it exceeds tau.
    At step ``s`` a member at a later place is unassigned exactly when its distance is still 0, so
    that distance (1 byte for chunks up to 127 tokens) is the loop's whole state; the loop runs to
    the longest chunk present, not to ``width``.
    """
    T, width = band.shape[2:]
    slot = jnp.arange(T)
    dtype = jnp.int8 if width <= 127 else jnp.int16 if width <= 32767 else jnp.int32
    member, place = member[:, None], place[:, None]  # [B, 1, T]
    taus = taus[..., None]

    def step(s, back):
        is_seed = member & (place == s) & (back == 0)
        delta = place - s  # how far back this member's candidate seed sits
        src = jnp.clip(slot - delta, 0, T - 1)
        cos = jnp.take_along_axis(band, jnp.clip(delta, 0, width - 1)[..., None], axis=-1)[..., 0]
        from_seed = jnp.take_along_axis(is_seed, jnp.broadcast_to(src, is_seed.shape), axis=-1)
        absorb = member & (delta > 0) & (back == 0) & from_seed & (cos > taus)
        return jnp.where(absorb, delta.astype(dtype), back)

    init = jnp.zeros(taus.shape[:-1] + (T,), dtype)
    return jax.lax.fori_loop(0, place.max() + 1, step, init)


def search_grid(top: float, steps: int) -> np.ndarray:
    """The first pass's thresholds, descending: ``top``, then ``steps - 1`` more whose distance
    below ``top`` grows geometrically from ``3e-4`` to ``top - MERGE_ALL`` (the last merges every
    chunk into one cluster). Near-duplicate keys (cosines of 0.99+, e.g. a repeated haystack
    sentence) need the fine steps near 1; a second, linear pass refines between two points."""
    gaps = (top - MERGE_ALL) * np.geomspace(1e-4, 1.0, steps - 1)
    return np.concatenate([[top], top - gaps]).astype(np.float32)


def seeds_of(back: jax.Array, member: jax.Array) -> jax.Array:
    """``[..., B, H, T]`` bool: the members that seeded a cluster (``back`` from GSC)."""
    return member[:, None] & (back == 0)


@struct.dataclass
class SemantiCache(Policy):
    """SemantiCache compression after prefill (module docstring for the choices).

    Args:
      budget: entries kept per (layer, row, KV head): fraction of the prompt or token count, sinks
        and window included. In threshold mode, the cap (the cache's static capacity).
      tau: ``None`` = budget mode (the largest threshold that fits, per head); a float = GSC at
        that threshold (paper: 0.5-0.9), capped by ``budget``.
      sinks, window: first / last prompt entries kept unmerged (4 / 32).
      chunking: ``"delimiters"`` (the paper), ``"fixed"`` (``chunk_size`` blocks, no anchors) or
        ``"none"`` (one chunk: global clustering) — the paper's Table 4 variants.
      chunk_size: longest chunk (longer delimiter-free runs are split); the fixed block size.
      keys: ``"pre_rope"`` (content similarity, merged at the mean position) or ``"post_rope"``.
      search_steps: thresholds tried per grid pass in budget mode (two passes).
      layer_batch: layers compressed together (`jax.lax.map` batch: memory against launches).
      delimiter_mask: ``[V]`` bool leaf (`from_tokenizer` / `with_tokenizer`).
      inv_freq: RoPE frequencies, set by `bind` for ``keys="pre_rope"``.
    """

    budget: float | int = struct.field(pytree_node=False, default=0.25)
    tau: float | None = struct.field(pytree_node=False, default=None)
    sinks: int = struct.field(pytree_node=False, default=4)
    window: int = struct.field(pytree_node=False, default=32)
    chunking: str = struct.field(pytree_node=False, default="delimiters")
    chunk_size: int = struct.field(pytree_node=False, default=64)
    keys: str = struct.field(pytree_node=False, default="pre_rope")
    search_steps: int = struct.field(pytree_node=False, default=16)
    layer_batch: int = struct.field(pytree_node=False, default=4)
    delimiter_mask: jax.Array | None = None
    inv_freq: tuple[float, ...] | None = struct.field(pytree_node=False, default=None)

    stages = ("compress",)
    # the delimiters come from the prompt's ids: nothing observed, chunked prefill works
    needs_whole_prefill = False
    needs_observations = False

    def __post_init__(self) -> None:
        check_budget(self.budget)
        check_sinks_window(self.budget, self.sinks, self.window)
        if self.tau is not None and (isinstance(self.tau, bool) or not -1.0 <= self.tau <= 1.0):
            raise ValueError(f"tau={self.tau!r} must be None (budget mode) or a cosine threshold in [-1, 1]")
        if self.chunking not in CHUNKINGS:
            raise ValueError(f"chunking={self.chunking!r} must be one of {CHUNKINGS}")
        if self.keys not in KEYS:
            raise ValueError(f"keys={self.keys!r} must be one of {KEYS}")
        if self.chunk_size < 2:
            raise ValueError(f"chunk_size={self.chunk_size} must be >= 2")
        if self.search_steps < 3:
            raise ValueError(f"search_steps={self.search_steps} must be >= 3")
        if self.layer_batch < 1:
            raise ValueError(f"layer_batch={self.layer_batch} must be >= 1")
        if self.chunking != "none" and isinstance(self.budget, float) and self.budget < 2 / self.chunk_size:
            raise ValueError(f"budget={self.budget} is below 2/chunk_size={2 / self.chunk_size:.4f}: one entry per "
                             f"{self.chunk_size}-token block would not fit; raise chunk_size or use chunking='none'")

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, *args: Any, **kwargs: Any) -> SemantiCache:
        """``SemantiCache(*args, **kwargs)`` with the delimiter mask of ``tokenizer``."""
        return cls(*args, **kwargs).with_tokenizer(tokenizer)

    def with_tokenizer(self, tokenizer: Any) -> SemantiCache:
        return self.replace(delimiter_mask=jnp.asarray(delimiter_mask(tokenizer)))

    def bind(self, setup: Setup) -> SemantiCache:
        if self.chunking == "delimiters" and self.delimiter_mask is None:
            raise ValueError("SemantiCache(chunking='delimiters') needs the tokenizer's delimiter mask: build it with "
                             "SemantiCache.from_tokenizer(tokenizer, ...) or call policy.with_tokenizer(tokenizer)")
        T = setup.prompt_len
        check_sinks_window(self.budget, self.sinks, self.window, T)
        if T and self.chunking != "none" and budget_tokens(self.budget, T) < -(-T // self.chunk_size):
            raise ValueError(f"budget={self.budget} keeps {budget_tokens(self.budget, T)} entries of a {T}-token "
                             f"prompt, fewer than its {-(-T // self.chunk_size)} blocks of chunk_size="
                             f"{self.chunk_size}")
        if self.keys == "pre_rope":
            return self.replace(inv_freq=tuple(float(f) for f in inverse_frequencies(setup.config)))
        return self

    @property
    def name(self) -> str:
        defaults = {f.name: f.default for f in dataclasses.fields(SemantiCache)}
        shown = [f"{n}={getattr(self, n)!r}" for n in ("tau", "sinks", "window", "chunking", "chunk_size", "keys")
                 if getattr(self, n) != defaults[n]]
        return f"SemantiCache({', '.join([repr(self.budget), *shown])})"

    @property
    def threshold_mode(self) -> bool:
        return self.tau is not None

    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        kept = budget_tokens(self.budget, prompt_len)
        if kept >= prompt_len and not self.threshold_mode:
            return None  # the budget covers the prompt: nothing merges (tau = 1 fits)
        return kept + max_new_tokens

    # -- compress -----------------------------------------------------------------------
    def _width(self, T: int) -> int:
        return T if self.chunking == "none" else min(self.chunk_size, T)

    def _forced_counts(self, keep: jax.Array, lengths: jax.Array, width: int) -> tuple[jax.Array, jax.Array]:
        """Per-row sinks and window: as many as asked, fewer where the budget then could not hold
        one entry per block of the rest (short rows under a fraction budget); sinks first."""
        def blocks(n):
            return -(-n // width)

        n, keep = lengths[:, None], keep[:, None]
        s = jnp.arange(self.sinks + 1)[None]
        s_ok = (s <= n) & (s + blocks(jnp.maximum(n - s, 0)) <= keep)
        sinks = jnp.max(jnp.where(s_ok, s, 0), axis=1)
        w = jnp.arange(self.window + 1)[None]
        rest = n - sinks[:, None] - w
        w_ok = (rest >= 0) & (sinks[:, None] + w + blocks(jnp.maximum(rest, 0)) <= keep)
        return sinks, jnp.max(jnp.where(w_ok, w, 0), axis=1)

    def layout(self, prompt: Prompt) -> tuple[jax.Array, ...]:
        """``(forced, anchor, member, place, level)`` of each prompt slot (`chunk_layout`) and each
        row's level (0 = the paper's layout; 1, 2 = the fallbacks) under this policy's budget."""
        return self._layout(prompt, row_budgets(self.budget, prompt.lengths), prompt.tokens.shape[1])

    def _layout(self, prompt: Prompt, keep: jax.Array, T: int):
        width = self._width(T)
        lengths = prompt.lengths
        sinks, window = self._forced_counts(keep, lengths, width)
        if self.chunking == "delimiters":
            mask = self.delimiter_mask
            is_delim = jnp.take(mask, prompt.tokens[:, :T], mode="fill", fill_value=False)
            levels = (0, 1, 2)
        else:
            is_delim = jnp.zeros(prompt.tokens[:, :T].shape, bool)
            levels = (2,)
        # the first level whose coarsest clustering (one cluster per chunk) fits each row's budget
        level = jnp.full(lengths.shape, levels[-1], jnp.int32)
        for lv in reversed(levels[:-1]):
            forced, anchor, _, place = chunk_layout(is_delim, lengths, sinks, window, jnp.full_like(level, lv), width)
            least = (forced | anchor | (place == 0)).sum(1)
            level = jnp.where(least <= keep, lv, level)
        return (*chunk_layout(is_delim, lengths, sinks, window, level, width), level)

    def compress(self, cache: KVCache, observations: Any, capacity: int, prompt: Prompt) -> KVCache:
        if self.chunking == "delimiters" and self.delimiter_mask is None:
            raise ValueError("SemantiCache needs the tokenizer's delimiter mask: SemantiCache.from_tokenizer(tok) "
                             "or policy.with_tokenizer(tok)")
        T = prompt.tokens.shape[1]
        keep = row_budgets(self.budget, prompt.lengths)
        n_out = min(T, budget_tokens(self.budget, T))
        width = self._width(T)
        forced, anchor, member, place, _ = self._layout(prompt, keep, T)
        kept_as_is = forced | anchor  # [B, T]
        search = not self.threshold_mode or n_out < T  # a cap that binds needs the search
        top = 1.0 if self.tau is None else float(self.tau)
        K = self.search_steps

        def first_fit(back):  # the clustering of the largest fitting threshold (taus descending)
            n = kept_as_is.sum(1)[:, None] + seeds_of(back, member).sum(-1)  # [K, B, H] entries kept
            k = jnp.argmax(n <= keep[:, None], axis=0)  # [B, H]
            return jnp.take_along_axis(back, k[None, ..., None], axis=0)[0], k

        inv_freq = None if self.inv_freq is None else np.asarray(self.inv_freq)
        if self.keys == "pre_rope" and inv_freq is None:
            raise ValueError("SemantiCache(keys='pre_rope') needs the RoPE frequencies: policy.bind(Setup(config)) "
                             "first (generate and sparsekv eval do)")

        def layer(xs):
            k, v, pos = xs  # [B, H, S, D], [B, H, S]
            k, v, pos = k[:, :, :T], v[:, :, :T], pos[:, :, :T]
            content = k.astype(jnp.float32)
            if self.keys == "pre_rope":
                content = _rotate(content, -pos, inv_freq)
            band = similarity_band(content, width)
            B, H = k.shape[:2]
            if search:
                taus = jnp.asarray(search_grid(top, K))
                taus1 = jnp.broadcast_to(taus[:, None, None], (K, B, H))
                _, k1 = first_fit(greedy_seed_clustering(band, member, place, taus1))
                # second pass between the last threshold that did not fit and the first that did;
                # it ends on that one exactly, so a fitting clustering is always among its results
                lo, hi = taus[k1], taus[jnp.maximum(k1 - 1, 0)]
                between = hi[None] + (lo - hi)[None] * (jnp.arange(1, K) / K)[:, None, None]
                taus2 = jnp.concatenate([between, lo[None]])
                back, _ = first_fit(greedy_seed_clustering(band, member, place, taus2))
            else:
                back = greedy_seed_clustering(band, member, place, jnp.full((1, B, H), top))[0]
            seed_of = jnp.where(member[:, None], jnp.arange(T) - back.astype(jnp.int32), -1)
            return _merge(k, v, pos, content, seed_of, kept_as_is, prompt.lengths, n_out, self.keys, inv_freq)

        layers = cache.layers
        k, v, pos, bias, counts = jax.lax.map(layer, (layers.k, layers.v, layers.positions),
                                              batch_size=min(self.layer_batch, layers.k.shape[0]))
        return write_entries(cache, k, v, pos, bias, counts, capacity)


def _rotate(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """RoPE ``x`` ``[..., T, D]`` by ``positions`` ``[..., T]`` (negative: rotate back), fp32."""
    return apply_rope(x[..., None, :], positions, inv_freq)[..., 0, :]


def _merge(k, v, pos, content, seed_of, kept_as_is, lengths, n_out: int, keys: str, inv_freq):
    """One layer's entries: ``(k, v [B, H, n_out, D], positions, bias [B, H, n_out], counts [B, H])``.

    Each kept-as-is slot and each cluster is an entry, in the order of its first slot; a cluster's
    key/value are the means (keys: of ``content``, rotated to the mean position for pre-RoPE), its
    position the rounded mean, its bias ``log size``. Singletons keep their stored key bit for bit.
    """
    B, H, T, D = k.shape
    slot = jnp.arange(T)
    live = slot[None] < lengths[:, None]
    head_of = jnp.where(kept_as_is[:, None] | (seed_of < 0), slot, seed_of)  # [B, H, T] its entry's first slot
    head_of = jnp.where(live[:, None], head_of, T)  # padding goes to a spill row
    is_head = live[:, None] & (head_of == slot)
    b, h = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]

    def total(x):  # per-first-slot sums [B, H, T(+spill), ...]
        return jnp.zeros((B, H, T + 1) + x.shape[3:], jnp.float32).at[b, h, head_of].add(x)[:, :, :T]

    size = total(jnp.ones((B, H, T), jnp.float32))
    mean_pos = jnp.floor(total(pos.astype(jnp.float32)) / jnp.maximum(size, 1.0) + 0.5).astype(jnp.int32)
    mean_key = total(content) / jnp.maximum(size, 1.0)[..., None]
    if keys == "pre_rope":
        mean_key = _rotate(mean_key, mean_pos, inv_freq)
    mean_val = total(v.astype(jnp.float32)) / jnp.maximum(size, 1.0)[..., None]
    single = (size == 1.0)[..., None]
    # the entries' first slots in order (as `common.keep_slots`: padded with T past the count)
    firsts = jnp.sort(jnp.where(is_head, slot, T), axis=-1)[..., :n_out]
    at = jnp.minimum(firsts, T - 1)

    def take(x):
        return jnp.take_along_axis(x, at.reshape(at.shape + (1,) * (x.ndim - 3)), axis=2)

    key = take(jnp.where(single, k.astype(jnp.float32), mean_key)).astype(k.dtype)
    val = take(jnp.where(single, v.astype(jnp.float32), mean_val)).astype(v.dtype)
    position = take(jnp.where(size == 1.0, pos, mean_pos))
    bias = take(jnp.log(jnp.maximum(size, 1.0)))
    return key, val, position, bias, jnp.minimum(is_head.sum(-1), n_out).astype(jnp.int32)
