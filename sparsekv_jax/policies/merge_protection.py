"""Format-blind rules that keep SemantiCache entries out of clusters (issue #36), and the cluster cap.

Unlike the token rules of `policies/clustering.py` (digits, their words and sentences, rare ids:
one mask per row, the same in every layer and head, made anchors that cut the chunks), these are
per (layer, row, KV head): the entries the observation window attends to most (``"attended"``) and
the keys farthest from their chunk's mean (``"outlier_keys"``). A chunk layout is one per row, so
they are not anchors: a protected slot stays a member of its chunk whose cosines with every other
member are set below every threshold (`unmergeable`). GSC then makes it a cluster of one (kept bit
for bit) and clusters the rest of the chunk as if it were not there, as it already skips any
dissimilar member between a seed and what the seed absorbs. Both are our additions, opt-in
(`SemantiCache`'s ``protect``), and format-blind: neither looks at what the answer looks like.

* ``protect="attended"``: the slots the observation window attends to most, SnapKV's scores (the
  last ``window`` prompt queries' softmax over the earlier keys, averaged over the window and the
  GQA group, max-pooled over 7 slots: SnapKV's paper settings, `policies.snapkv`), highest first
  (ties: the earlier slot), among every slot outside sinks and window. What the prompt's end asks
  about is kept whole, whatever its format. It observes the prefill, so it needs the whole prompt
  in one pass (`needs_whole_prefill`; chunked prefill is refused before jit).
* ``protect="outlier_keys"``: the keys of lowest cosine with their chunk's mean key, on the paper's
  chunk layout (delimiter chunks; the only layout of ``chunking="fixed"``/``"none"``), lowest first,
  among its members. A key unlike its chunk is what a cluster's mean would blur most; a singleton
  chunk's key is its own mean (cosine 1) and never protected.

The count: per (layer, row, head) ``min(floor(share * keep), room)`` (``share``: ``sentence_share``),
where ``room`` is what the reference layout's coarsest clustering (one cluster per chunk, or
``ceil(size / cap)`` under a cluster cap) leaves of the row's budget ``keep``; the reference layout
is, in budget mode, the last (``chunk_size`` blocks) and, in threshold mode, the row's. Each
protected slot adds at most one entry to that clustering (it leaves its chunk: the chunk's clusters
do not grow), so the reference layout still fits; a layout that does not is not chosen (its search
reaches no threshold).

Shapes: ``N`` chunk layouts, ``B`` rows, ``H`` KV heads, ``T`` prompt slots, ``D`` head dim.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from sparsekv_jax.policies.clustering import MERGE_ALL

NEVER = 2 * MERGE_ALL  # below every threshold the search tries (MERGE_ALL included): never merged
PROTECT_PER_HEAD = ("attended", "outlier_keys")


def plan(protect: str, layouts: tuple[jax.Array, ...], caps: jax.Array | None, width: int, keep: jax.Array,
         lengths: jax.Array, share: float, first: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """``(count [B], eligible [B, T])``: how many slots each row's heads protect and among which.

    ``layouts``: ``(forced, anchor, member, place)`` ``[N, B, T]`` (`clustering.candidate_layouts`),
    ``caps`` ``[N, B]`` (`fitting_caps`; ``None``: unbounded), ``first`` ``[B]``: each row's layout
    in threshold mode (``None``: budget mode, whose reference is the last layout). Eligible:
    ``"attended"``, every live slot outside sinks and window (a slot some layout may merge);
    ``"outlier_keys"``, the members of the first (the paper's) layout."""
    forced, anchor, member, place = layouts
    coarsest = coarsest_counts(forced | anchor, member, place, width if caps is None else caps)  # [N, B]
    reference = coarsest[-1] if first is None else jnp.take_along_axis(coarsest, first[None], 0)[0]
    count = protected_count(keep, reference, share)
    live = jnp.arange(forced.shape[-1])[None] < lengths[:, None]
    return count, (live & ~forced[0]) if protect == "attended" else member[0]


def guard(band: jax.Array, protect: str, seen: jax.Array | None, content: jax.Array, layouts: tuple[jax.Array, ...],
          eligible: jax.Array, count: jax.Array) -> jax.Array:
    """One layer's ``band`` ``[B, H, T, W]`` with its protected slots `unmergeable`: the ``count``
    ``[B]`` eligible slots per (row, head) with the highest observed attention ``seen`` ``[B, H, >=T]``
    (``"attended"``) or the lowest cosine with their chunk's mean key on the first layout
    (``"outlier_keys"``; ``content`` ``[B, H, T, D]``: the keys GSC compares)."""
    T = band.shape[-2]
    if protect == "attended":
        scores = seen[:, :, :T]
    else:
        scores = -chunk_mean_cosine(content, layouts[2][0], layouts[3][0])
    return unmergeable(band, top_slots(scores, eligible, count))


def chunk_ids(member: jax.Array, place: jax.Array) -> jax.Array:
    """``[..., T]``: each member's chunk, numbered from 0 in slot order; ``T`` (a spill segment for
    `jax.ops.segment_sum`) off members. ``member``/``place`` ``[..., T]`` (`clustering.chunk_layout`)."""
    chunk = jnp.cumsum(member & (place == 0), axis=-1) - 1  # a member's chunk starts at its place 0
    return jnp.where(member, chunk, member.shape[-1])


def chunk_sizes(member: jax.Array, place: jax.Array) -> jax.Array:
    """``[..., T]``: the member count of the chunk starting at each slot (a member at place 0; 0
    elsewhere) of ``member``/``place`` ``[..., T]`` (`clustering.chunk_layout`)."""
    T = member.shape[-1]
    chunk = chunk_ids(member, place)

    def one(m, c):
        return jax.ops.segment_sum(m.astype(jnp.int32), c, num_segments=T + 1)[:T]

    flat = jax.vmap(one)(member.reshape(-1, T), chunk.reshape(-1, T))
    return flat.reshape(member.shape)


def coarsest_counts(kept_as_is: jax.Array, member: jax.Array, place: jax.Array, cap: jax.Array | int) -> jax.Array:
    """``[N, B]``: entries of each layout's coarsest clustering: the slots kept as they are plus
    ``ceil(size / cap)`` per chunk (one per chunk when ``cap`` is at least the longest chunk).
    ``kept_as_is``/``member``/``place`` ``[N, B, T]``; ``cap`` ``[N, B]`` or an int."""
    sizes = chunk_sizes(member, place)
    cap = jnp.broadcast_to(jnp.asarray(cap, jnp.int32), sizes.shape[:2])[..., None]
    return kept_as_is.sum(-1) + (-(-sizes // cap)).sum(-1)


def fitting_caps(kept_as_is: jax.Array, member: jax.Array, place: jax.Array, keep: jax.Array, cap: int,
                 width: int) -> jax.Array:
    """``[N, B]``: per layout and row the smallest cluster cap ``>= cap`` whose coarsest clustering
    fits the row's budget ``keep`` ``[B]``: ``cap`` where the budget holds it, larger where it
    would not (``width``, i.e. unbounded, where the layout does not fit at all)."""
    caps = jnp.arange(cap, max(cap, width) + 1, dtype=jnp.int32)  # static: at most the chunk size
    sizes = chunk_sizes(member, place)  # [N, B, T]
    counts = kept_as_is.sum(-1) + (-(-sizes[None] // caps[:, None, None, None])).sum(-1)  # [C, N, B]
    fits = counts <= keep[None, None]
    return jnp.where(fits.any(0), caps[jnp.argmax(fits, axis=0)], caps[-1])


def protected_count(keep: jax.Array, coarsest: jax.Array, share: float) -> jax.Array:
    """``[B]``: slots each row may protect: ``share`` of its budget ``keep``, fewer where the
    reference layout's coarsest clustering (``coarsest`` entries) leaves less room."""
    wanted = jnp.floor(share * keep.astype(jnp.float32) + 1e-6).astype(jnp.int32)
    return jnp.clip(jnp.minimum(wanted, keep - coarsest), 0, None)


def top_slots(scores: jax.Array, eligible: jax.Array, count: jax.Array) -> jax.Array:
    """``[B, H, T]`` bool: per (row, head) the ``count`` ``[B]`` eligible slots with the highest
    ``scores`` ``[B, H, T]`` (ties: the earlier slot); ``eligible`` ``[B, T]`` or ``[B, H, T]``."""
    eligible = jnp.broadcast_to(eligible if eligible.ndim == 3 else eligible[:, None], scores.shape)
    order = jnp.argsort(jnp.where(eligible, -scores.astype(jnp.float32), jnp.inf), axis=-1, stable=True)
    rank = jnp.argsort(order, axis=-1)  # each slot's place in that order
    return eligible & (rank < count[:, None, None])


def chunk_mean_cosine(content: jax.Array, member: jax.Array, place: jax.Array) -> jax.Array:
    """``[B, H, T]``: each member's cosine with the mean key of its chunk (``content`` ``[B, H, T, D]``,
    ``member``/``place`` ``[B, T]``: one layout); ``+inf`` off members (never an outlier)."""
    T = member.shape[-1]
    chunk = chunk_ids(member, place)  # [B, T]

    def one(x, c):  # [T, D], [T] -> each slot's chunk mean [T, D]
        total = jax.ops.segment_sum(x, c, num_segments=T + 1)
        size = jax.ops.segment_sum(jnp.ones(c.shape, x.dtype), c, num_segments=T + 1)
        return (total / jnp.maximum(size, 1.0)[:, None])[c]

    x = content.astype(jnp.float32)
    mean = jax.vmap(jax.vmap(one, in_axes=(0, None)))(x, chunk)
    cos = (x * mean).sum(-1) / jnp.maximum(jnp.linalg.norm(x, axis=-1) * jnp.linalg.norm(mean, axis=-1), 1e-12)
    return jnp.where(member[:, None], cos, jnp.inf)


def unmergeable(band: jax.Array, protected: jax.Array) -> jax.Array:
    """``band`` ``[B, H, T, W]`` (`clustering.similarity_band`) with every cosine of a ``protected``
    ``[B, H, T]`` slot, to an earlier slot or from a later one, set to `NEVER`: GSC leaves it alone."""
    T, W = band.shape[-2:]
    earlier = jnp.arange(T)[:, None] - jnp.arange(W)[None, :]  # [T, W]: the slot each cosine compares with
    theirs = jnp.where(earlier[None, None] >= 0, protected[..., jnp.clip(earlier, 0, T - 1)], False)
    return jnp.where(protected[..., None] | theirs, NEVER, band)
