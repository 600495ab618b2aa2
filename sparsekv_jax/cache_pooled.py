"""The cache as a page pool (issue 38, docs/PAGE_POOL.md, migration step 2): `PoolCache`, its prefill
layout, and the jnp readers and the decode append through the page tables.

**Layout.** One pool for every layer, row and KV head; a page holds ``page_size`` tokens of one
(layer, row, head). `PoolCache.pages` is a `LayerKV` whose leaves are the pool's (`N` pages):

* ``k``, ``v`` ``[N, ps, D]`` (codes when quantised), ``positions`` ``[N, ps]`` int32, ``bias`` ``[N, ps]``
  float32;
* per page: ``page_sum``/``page_min``/``page_max``/``k_scale``/``k_zero`` ``[N, D]``, ``page_max_bias``/
  ``v_scale`` ``[N]`` (those the cache holds, as in `sparsekv_jax.cache`).

`PoolCache.alloc` (`PagePool`, `sparsekv_jax.cache_pool`) says which pages each (layer, row, head) owns:
its rows are (layer, row) pairs, layer-major, so ``alloc.table`` ``[L·B, Hkv, M]`` reshapes to
``[L, B, Hkv, M]`` and ``alloc.length`` to ``[L, B, Hkv]``, a length per head. Logical slot ``s`` of
(l, b, h) lives at pool page ``table[l, b, h, s // ps]``, offset ``s % ps``. Every reader here goes
through the table: nothing assumes where a page is.

**Prefill** (`init_pool`): a pool of ``N = L·B·Hkv·M`` pages by default (``M = pages_for(capacity)``:
today's cache size), whose (l, b, h) own the pages ``((l·B + b)·Hkv + h)·P + p`` (``P`` the prompt's
pages) by the allocator's prefix sum, so `stack_view` -- ``leaf[:L·B·Hkv·P].reshape(L, B, Hkv, P·ps, ...)``
-- *is* `init_cache`'s stacked layout up to the prompt, byte for byte. The prefill writes that view as
today (`write_chunk`, `summarize_pages`) and `with_stack` puts it back (a reshape when ``N = L·B·Hkv·P``);
`pool_from_stack` turns any stacked cache into such a pool.

**Readers.** `layer_pages` gathers a layer's pages, ``leaf[table[l]]`` -> ``[B, Hkv, M, ...]`` (pages a head
does not own read as an empty cache's: `mode="fill"`), `layer_kv` the same as a uniform layer
``[B, Hkv, M·ps, ...]`` so today's readers apply with the per-head lengths (`layer_lengths`);
`pool_page_mean`, `pool_page_counts`, `summarize_pool`; `decode_kernel_args` the decode kernel's pool
mode arguments.

**Decode append.** `reserve_token` (one allocator call per step, before the layer scan:
`cache_pool.append_slots` over every layer) gives each (layer, row, head) its ``(page, offset)``;
`append_token_pool` writes layer ``l``'s token there and refreshes that page's summaries and, quantised,
re-scales it with `append_token`'s math (`cache_write._rescale_append`). Freed pages are not cleared, so
an append writes its slot's bias (0), and a page it opens is treated as empty whatever it held.

**Compaction** (docs/PAGE_POOL.md, Lifecycle → Compaction; step 3): `decode_pool` is a fresh decode pool
whose (layer, row, head)s own ``ceil(count / ps)`` pages each (`cache_pool.allocate_after_compression`, prefix
sum), `put_pages` scatters heads' packed pages into their pages by the table (one scatter per leaf, the
sentinel dropped), `take_logical` reads a pool's leaves at logical slots (the gather of a compaction from a
pool). The per-page math (quantisation, summaries) is the policies' (`policies.common.write_entries_pool`,
`write_kept_pool`, which use these). `pool_nbytes` sizes a decode pool without allocating it;
`cache_pool.pool_pages_needed` counts the pages a compression occupies.

A rewind (CHESS's backtracking) is `rewind_pool`: lengths move back, pages stay held and are refilled.

An in-place overwrite (H2O's eviction) is `append_token_pool` with ``overwrite``: its slot below the head's
length, mapped through the table by the caller (`engine.pooled.decode_step_pool`), and no page reserved.

**Extend** (a question read after compression, `engine.prefill.extend`): `grow_tokens` (one allocator call for
every layer: `cache_pool.grow`, pages popped as a head's run of tokens needs them), then `write_tokens_pool` writes
layer ``l``'s tokens at each head's logical slots ``old length ..`` through its table and refreshes the pages
they touch (summaries; quantised, `cache_write.write_tokens`' re-scaling, per head).

Not here yet (docs/PAGE_POOL.md, step 2's entry): the group axes of a mesh.
The engine decodes from a pool with ``Options(pool=True)`` (experimental,
`sparsekv_jax.engine.pooled`): full attention from its prefill pool, the compressors whose write is
`policies.common.write_kept` from a decode pool that write makes; by default the policies use the uniform cache.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.cache import LayerKV, LocalKV, check_sizes, init_local
from sparsekv_jax.cache_pages import SUMMARIES, _key_summaries, check_summaries, empty_summaries, page_mean, pages_for
from sparsekv_jax.cache_pool import PagePool, allocate_after_compression, append_slots, grow, owned
from sparsekv_jax.cache_quant import SCALE_DTYPE, check_kv_dtype, is_quantized
from sparsekv_jax.cache_write import _page_key_summaries, _rescale_append, write_tokens
from sparsekv_jax.models.config import ModelConfig

__all__ = ["PoolCache", "append_token_pool", "decode_kernel_args", "decode_pool", "grow_tokens", "init_pool",
           "layer_kv", "layer_lengths", "layer_pages", "layer_tables", "logical_positions", "pool_from_stack",
           "pool_nbytes", "pool_page_counts", "pool_page_mean", "put_pages", "reserve_token", "rewind_pool",
           "shuffle_pages", "stack_view", "summarize_pool", "take_logical", "with_stack", "write_tokens_pool"]

# what a page nobody owns reads as (`layer_pages`): an empty cache's values (`init_cache`)
_FILL = {"positions": -1, "page_max_bias": -jnp.inf}
_SLOT_FIELDS = ("k", "v", "positions", "bias")  # a value per slot; the others one per page
_FIELDS = (*_SLOT_FIELDS, *SUMMARIES, "k_scale", "k_zero", "v_scale")


@struct.dataclass
class PoolCache:
    """The KV cache as one page pool (the module docstring gives the layout)."""

    pages: LayerKV  # the pool's leaves: k, v [N, ps, D]; positions, bias [N, ps]; per page [N, D] / [N]
    alloc: PagePool  # rows (layer, row) layer-major: table [L·B, Hkv, M], length [L·B, Hkv]
    next_position: jax.Array  # [B] int32 RoPE position of the next token
    local: LocalKV | None = None  # the local layers' rings (Gemma 3), never paged
    num_layers: int = struct.field(pytree_node=False, default=1)  # L (the paged layers)
    # P: pages per head of the prefill's view (0: no such view, a decode pool from `decode_pool`)
    prompt_pages: int = struct.field(pytree_node=False, default=1)

    @property
    def page_size(self) -> int:
        return self.alloc.page_size

    @property
    def num_pages(self) -> int:
        """Pages in the pool (``N``; the tables' "no page" sentinel)."""
        return self.alloc.num_pages

    @property
    def max_pages_per_head(self) -> int:
        """Table entries per (layer, row, head) (``M``)."""
        return self.alloc.max_pages_per_head

    @property
    def batch(self) -> int:
        return self.next_position.shape[0]

    @property
    def heads(self) -> int:
        return self.alloc.table.shape[1]

    @property
    def tables(self) -> jax.Array:
        """``[L, B, Hkv, M]`` pool page of each logical page (the sentinel ``N`` past ``held``)."""
        return self.alloc.table.reshape(self.num_layers, self.batch, self.heads, -1)

    @property
    def lengths(self) -> jax.Array:
        """``[L, B, Hkv]`` tokens each head holds."""
        return self.alloc.length.reshape(self.num_layers, self.batch, self.heads)

    def nbytes(self) -> int:
        """Device bytes held (all leaves: the pool, its tables, the rings)."""
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(self))


def _empty_pages(num_pages: int, page_size: int, head_dim: int, store: jnp.dtype, dtype: jnp.dtype,
                 summaries: frozenset[str]) -> LayerKV:
    """Pool leaves of ``num_pages`` empty pages, with the values `init_cache` gives an empty cache."""
    N, ps, D = num_pages, page_size, head_dim
    quantized = is_quantized(store)
    return LayerKV(k=jnp.zeros((N, ps, D), store), v=jnp.zeros((N, ps, D), store),
                   positions=jnp.full((N, ps), -1, jnp.int32), bias=jnp.zeros((N, ps), jnp.float32),
                   **empty_summaries(summaries, (N, D), dtype),
                   k_scale=jnp.zeros((N, D), SCALE_DTYPE) if quantized else None,
                   k_zero=jnp.zeros((N, D), SCALE_DTYPE) if quantized else None,
                   v_scale=jnp.zeros((N,), SCALE_DTYPE) if quantized else None)


def _identity_alloc(L: int, B: int, H: int, P: int, M: int, N: int, page_size: int) -> PagePool:
    """The prefill's ownership: (l, b, h) owns pages ``((l·B + b)·H + h)·P + p``, ``p < P``, length 0."""
    alloc = allocate_after_compression(jnp.full((L * B, H), P * page_size, jnp.int32), page_size, N,
                                       max_pages_per_head=M)
    return alloc.replace(length=jnp.zeros_like(alloc.length))


def _check_pool_sizes(L: int, B: int, H: int, P: int, M: int, N: int) -> None:
    if P > M:
        raise ValueError(f"the prompt's {P} pages per head exceed max_pages_per_head={M}")
    if N < L * B * H * P:
        raise ValueError(f"num_pages={N} is smaller than the prefill's L·B·Hkv·P = {L}·{B}·{H}·{P} = {L * B * H * P}")


def init_pool(cfg: ModelConfig, batch: int, capacity: int, *, prompt: int | None = None,
              num_pages: int | None = None, page_size: int = 16, dtype: jnp.dtype = jnp.bfloat16,
              ring: int | None = None, summaries: Iterable[str] = SUMMARIES,
              kv_dtype: str | None = None) -> PoolCache:
    """An empty prefill pool: ``max_pages_per_head = pages_for(capacity)`` (``M``, the most a head may ever
    hold), each (layer, row, head) owning the ``P = pages_for(prompt)`` pages (default ``prompt = capacity``)
    the prefill writes, laid out so that `stack_view` is `init_cache`'s stacked layout (``[L, B, Hkv, P·ps,
    ...]``); the other ``num_pages - L·B·Hkv·P`` pages are free for appends. ``num_pages`` defaults to
    ``L·B·Hkv·M``, today's cache size. Lengths start at 0 (`with_stack` sets them).

    ``dtype``, ``kv_dtype``, ``ring``, ``summaries``: as `init_cache`.
    """
    summaries = check_summaries(summaries)
    store = dtype if check_kv_dtype(kv_dtype) is None else jnp.dtype(kv_dtype)
    check_sizes(batch, capacity, page_size)
    if prompt is not None and prompt <= 0:
        raise ValueError(f"prompt={prompt} must be positive")
    local = init_local(cfg, batch, ring, dtype)
    L = cfg.num_layers if local is None else len(cfg.global_layer_ids())
    H, D = cfg.num_kv_heads, cfg.head_dim
    M = pages_for(capacity, page_size)
    P = pages_for(capacity if prompt is None else prompt, page_size)
    N = L * batch * H * M if num_pages is None else num_pages
    _check_pool_sizes(L, batch, H, P, M, N)
    return PoolCache(pages=_empty_pages(N, page_size, D, store, dtype, summaries),
                     alloc=_identity_alloc(L, batch, H, P, M, N, page_size),
                     next_position=jnp.zeros((batch,), jnp.int32), local=local, num_layers=L, prompt_pages=P)


def stack_view(cache: PoolCache) -> LayerKV:
    """The prefill pool's pages as `init_cache`'s stacked layout: every leaf ``[:L·B·Hkv·P]`` reshaped to
    ``[L, B, Hkv, P·ps, ...]`` (slots) or ``[L, B, Hkv, P, ...]`` (page summaries and scales). A view of the
    *identity* layout `init_pool` and `pool_from_stack` make; after a decode step opened pages or pages
    were moved it no longer shows what the heads hold (read through the tables then: `layer_pages`). A
    decode pool (`decode_pool`, ``prompt_pages == 0``) has no such view: ``ValueError``."""
    if cache.prompt_pages < 1:
        raise ValueError("stack_view: this pool has no prefill view (prompt_pages=0: a decode pool from compaction); "
                         "read it through its tables (layer_pages, layer_kv)")
    L, B, H, P, ps = cache.num_layers, cache.batch, cache.heads, cache.prompt_pages, cache.page_size
    n = L * B * H * P

    def view(name: str, a: jax.Array | None) -> jax.Array | None:
        if a is None:
            return None
        if name in _SLOT_FIELDS:  # [N, ps, ...] -> [L, B, H, P·ps, ...]
            return a[:n].reshape(L, B, H, P * ps, *a.shape[2:])
        return a[:n].reshape(L, B, H, P, *a.shape[1:])

    return cache.pages.replace(**{f: view(f, getattr(cache.pages, f)) for f in _FIELDS})


def _check_stack(cache: PoolCache, layers: LayerKV, length: jax.Array) -> None:
    want = stack_view(cache)
    for f in _FIELDS:
        a, w = getattr(layers, f), getattr(want, f)
        if (a is None) != (w is None) or (a is not None and (a.shape != w.shape or a.dtype != w.dtype)):
            raise ValueError(f"layers.{f} is {None if a is None else (a.dtype, tuple(a.shape))}; the pool's "
                             f"stacked view holds {None if w is None else (w.dtype, tuple(w.shape))}")
    if tuple(jnp.shape(length)) != (cache.batch,):
        raise ValueError(f"length must be [B={cache.batch}], got shape {tuple(jnp.shape(length))}")


def _flat_stack(layers: LayerKV, n: int) -> dict[str, jax.Array | None]:
    """A stack's leaves as the first ``n`` pool pages: slots ``[n, ps, ...]``, per page ``[n, ...]``."""
    def flat(name: str) -> jax.Array | None:
        a = getattr(layers, name)
        if a is None:
            return None
        if name in _SLOT_FIELDS:  # [L, B, H, P·ps, ...] -> [n, ps, ...]
            return a.reshape(n, -1, *a.shape[4:])
        return a.reshape(n, *a.shape[4:])

    return {f: flat(f) for f in _FIELDS}


def with_stack(cache: PoolCache, layers: LayerKV, length: jax.Array) -> PoolCache:
    """Put a written stacked view (`stack_view`'s shapes; the prefill's `write_chunk`/`summarize_pages` output)
    back into the identity pool, and set every head's length to its row's ``length`` ``[B]`` (the prompt's:
    a shorter row keeps its ``P`` pages and its appends fill them first). A reshape when the pool is exactly
    the view (``N = L·B·Hkv·P``), else one update of the first ``L·B·Hkv·P`` pages."""
    _check_stack(cache, layers, length)
    N, n = cache.num_pages, cache.num_layers * cache.batch * cache.heads * cache.prompt_pages
    flat = _flat_stack(layers, n)
    if n < N:
        flat = {f: None if a is None else jax.lax.dynamic_update_slice_in_dim(getattr(cache.pages, f), a, 0, axis=0)
                for f, a in flat.items()}
    L, B, H = cache.num_layers, cache.batch, cache.heads
    lengths = jnp.broadcast_to(jnp.asarray(length, jnp.int32)[None, :, None], (L, B, H)).reshape(L * B, H)
    return cache.replace(pages=cache.pages.replace(**flat), alloc=cache.alloc.replace(length=lengths))


def pool_from_stack(layers: LayerKV, length: jax.Array, next_position: jax.Array, *, page_size: int,
                    num_pages: int | None = None, max_pages_per_head: int | None = None,
                    local: LocalKV | None = None) -> PoolCache:
    """The identity pool of a stacked cache (`KVCache.layers`, ``[L, B, Hkv, S, D]`` with ``S = P·page_size``)
    and its row lengths ``[B]``: `stack_view` of the result is ``layers``. ``num_pages`` (default
    ``L·B·Hkv·P``: no free page, and the conversion is a reshape) and ``max_pages_per_head`` (default ``P``)
    leave room for appends; the extra pages are empty.

    The stack's holes (a compressed uniform cache's position -1, bias -inf slots below a length) carry over
    as slots every reader masks by their bias and position; the pool itself never makes holes."""
    L, B, H, S, D = layers.k.shape
    if S % page_size:
        raise ValueError(f"the stack's {S} slots are not whole pages of page_size={page_size}")
    P = S // page_size
    M = P if max_pages_per_head is None else max_pages_per_head
    n = L * B * H * P
    N = n if num_pages is None else num_pages
    _check_pool_sizes(L, B, H, P, M, N)
    if N == n:
        pages = layers.replace(**_flat_stack(layers, n))
    else:
        pages = _empty_pages(N, page_size, D, layers.k.dtype, layers.k.dtype, layers.summaries)
        pages = pages.replace(**{f: None if getattr(pages, f) is None else getattr(pages, f).astype(
            getattr(layers, f).dtype) for f in _FIELDS})
    cache = PoolCache(pages=pages, alloc=_identity_alloc(L, B, H, P, M, N, page_size),
                      next_position=jnp.asarray(next_position, jnp.int32), local=local, num_layers=L, prompt_pages=P)
    return with_stack(cache, layers, length)


def layer_tables(cache: PoolCache, layer: int | jax.Array) -> tuple[jax.Array, jax.Array]:
    """Layer ``layer``'s ``(table [B, Hkv, M], length [B, Hkv])`` (``layer`` may be traced)."""
    pick = lambda a: jax.lax.dynamic_index_in_dim(a, layer, keepdims=False)  # noqa: E731
    return pick(cache.tables), pick(cache.lengths)


def layer_lengths(cache: PoolCache, layer: int | jax.Array) -> jax.Array:
    """``[B, Hkv]`` tokens each head of layer ``layer`` holds."""
    return layer_tables(cache, layer)[1]


def logical_positions(cache: PoolCache) -> jax.Array:
    """``[L, B, Hkv, M·ps]`` the position held at each logical slot of every (layer, row, head), read through the
    tables (`take_logical`); -1 at and past the head's length, as a uniform cache's empty slots."""
    L, B, H, S = cache.num_layers, cache.batch, cache.heads, cache.max_pages_per_head * cache.page_size
    at = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (L, B, H, S))
    return jnp.where(at < cache.lengths[..., None], take_logical(cache, cache.pages.positions, at), -1)


def layer_pages(cache: PoolCache, layer: int | jax.Array) -> LayerKV:
    """Layer ``layer``'s pages gathered through its table: each leaf ``leaf[table[layer]]`` (``mode="fill"``),
    ``k``/``v`` ``[B, Hkv, M, ps, D]``, ``positions``/``bias`` ``[B, Hkv, M, ps]``, page summaries and scales
    ``[B, Hkv, M, D]`` / ``[B, Hkv, M]``, logical page ``m`` of each head at ``[b, h, m]``. A page the head does
    not own (the sentinel) reads as an empty cache's (zeros, position -1, max bias -inf); slots past a head's
    length hold whatever the page held (mask by `layer_lengths`)."""
    table, _ = layer_tables(cache, layer)

    def gather(name: str) -> jax.Array | None:
        a = getattr(cache.pages, name)
        return None if a is None else a.at[table].get(mode="fill", fill_value=_FILL.get(name, 0))

    return cache.pages.replace(**{f: gather(f) for f in _FIELDS})


def layer_kv(cache: PoolCache, layer: int | jax.Array) -> LayerKV:
    """`layer_pages` in a uniform layer's shapes, ``k``/``v`` ``[B, Hkv, M·ps, D]``, ``positions``/``bias``
    ``[B, Hkv, M·ps]`` (logical slots), per-page leaves ``[B, Hkv, M, ...]``: the uniform jnp readers
    (`page_mean`, `dequantize_kv`, attention) apply with `layer_lengths`' per-head lengths."""
    pages = layer_pages(cache, layer)

    def flat(name: str) -> jax.Array | None:
        a = getattr(pages, name)
        return None if a is None else a.reshape(*a.shape[:2], -1, *a.shape[4:])

    return pages.replace(**{f: flat(f) for f in ("k", "v", "positions", "bias")})


def pool_page_counts(cache: PoolCache) -> jax.Array:
    """``[N]`` live slots of each pool page: for a page (l, b, h) owns as its logical page ``m``,
    ``clip(length - m·ps, 0, ps)``; 0 for a free page."""
    ps, M = cache.page_size, cache.max_pages_per_head
    alloc = cache.alloc
    counts = jnp.clip(alloc.length[..., None] - jnp.arange(M, dtype=jnp.int32) * ps, 0, ps)
    counts = jnp.where(owned(alloc), counts, 0)
    return jnp.zeros((cache.num_pages,), jnp.int32).at[alloc.table].set(counts, mode="drop")


def summarize_pool(cache: PoolCache, keys: jax.Array | None = None) -> PoolCache:
    """`summarize_pages` on a pool: the page summaries the cache holds, recomputed for every pool page from
    its live slots (`pool_page_counts`, position ``>= 0``); a free page gets an empty page's (zeros, max bias
    -inf). ``keys`` ``[N, ps, D]``: the keys to summarise instead of the stored ones (a quantised pool's
    before quantisation); a quantised pool without them keeps its key summaries and recomputes
    ``page_max_bias`` only."""
    kv = cache.pages
    held = kv.summaries
    if kv.quantized and keys is None:
        held = held & {"page_max_bias"}
    if not held:
        return cache
    ps = cache.page_size
    valid = (jnp.arange(ps) < pool_page_counts(cache)[:, None]) & (kv.positions >= 0)  # [N, ps]
    new = {}
    if held - {"page_max_bias"}:
        new = {name: value[:, 0] for name, value in
               _key_summaries(kv, kv.k if keys is None else keys, valid, ps).items()}
    if "page_max_bias" in held:
        new["page_max_bias"] = jnp.where(valid, kv.bias, -jnp.inf).max(-1)
    return cache.replace(pages=kv.replace(**new))


def pool_page_mean(cache: PoolCache, layer: int | jax.Array) -> jax.Array:
    """``[B, Hkv, M, D]`` mean key of each logical page of layer ``layer`` (zero for an empty or unowned page;
    CHESS's and the page readers' `page_mean` through the table, per-head lengths)."""
    table, length = layer_tables(cache, layer)
    if cache.pages.page_sum is None:
        raise ValueError("pool_page_mean: this pool holds no page_sum (init_pool(summaries=...) naming 'page_sum')")
    sums = cache.pages.page_sum.at[table].get(mode="fill", fill_value=0)
    return page_mean(cache.pages.replace(page_sum=sums), length, cache.page_size)


def decode_kernel_args(cache: PoolCache, layer: int | jax.Array) -> dict[str, jax.Array | None]:
    """Layer ``layer``'s arguments of the decode kernel's pool mode (`pallas.decode.decode_attention` with
    ``page_table=``): ``k``, ``v``, ``lengths`` ``[B, Hkv]``, ``page_table`` ``[B, Hkv, M]``, ``bias``,
    ``k_scale``, ``k_zero``, ``v_scale`` (the pool leaves as stored; ``None`` where the pool holds none).
    ``page_size`` is `PoolCache.page_size`."""
    table, length = layer_tables(cache, layer)
    p = cache.pages
    return dict(k=p.k, v=p.v, lengths=length, page_table=table, bias=p.bias, k_scale=p.k_scale, k_zero=p.k_zero,
                v_scale=p.v_scale)


def reserve_token(cache: PoolCache, active: jax.Array) -> tuple[PoolCache, jax.Array, jax.Array]:
    """A decode step's one allocator call (before the layer scan): room for one token in each (layer, row,
    head) marked in ``active`` (``[B]`` bool: every layer and head of a row; or ``[L, B, Hkv]``), through
    `cache_pool.append_slots` -> ``(cache, page [L, B, Hkv], offset [L, B, Hkv])``, the sentinel page ``N``
    where nothing is written (inactive, or the pool ran out: ``alloc.overflow``)."""
    L, B, H = cache.num_layers, cache.batch, cache.heads
    act = jnp.asarray(active)
    if act.dtype != jnp.bool_ or tuple(act.shape) not in ((B,), (L, B, H)):
        raise ValueError(f"active must be a bool mask [B={B}] or [L, B, Hkv]={[L, B, H]}, got {act.dtype} of "
                         f"shape {tuple(act.shape)}")
    act = jnp.broadcast_to(act[None, :, None] if act.ndim == 1 else act, (L, B, H)).reshape(L * B, H)
    alloc, page, offset = append_slots(cache.alloc, act)
    return cache.replace(alloc=alloc), page.reshape(L, B, H), offset.reshape(L, B, H)


def rewind_pool(cache: PoolCache, tokens: jax.Array, positions: jax.Array | None = None) -> PoolCache:
    """Take back the last ``tokens`` ``[B]`` int of each row, in every layer and head (docs/PAGE_POOL.md, Lifecycle →
    Decode step: a rewind, CHESS's backtracking): the allocator's lengths move back (not below 0) and the pages stay
    held (``held`` unchanged), so the next appends (`reserve_token`) refill them at the same logical slots before
    any page is popped, and nothing is written or freed. ``next_position`` moves back by ``positions`` ``[B]``
    (default ``tokens``: a row that wrote nothing while the others decoded steps its position back alone)."""
    L, B, H = cache.num_layers, cache.batch, cache.heads
    back = jnp.asarray(tokens)
    step = back if positions is None else jnp.asarray(positions)
    for name, x in (("tokens", back), ("positions", step)):
        if tuple(x.shape) != (B,) or not jnp.issubdtype(x.dtype, jnp.integer):
            raise ValueError(f"{name} must be an int array [B={B}], got {x.dtype} of shape {tuple(x.shape)}")
    per_head = jnp.broadcast_to(back.astype(jnp.int32)[None, :, None], (L, B, H)).reshape(L * B, H)
    alloc = cache.alloc.replace(length=jnp.maximum(cache.alloc.length - per_head, 0))
    return cache.replace(alloc=alloc, next_position=cache.next_position - step.astype(jnp.int32))


def append_token_pool(cache: PoolCache, layer: int | jax.Array, k_new: jax.Array, v_new: jax.Array,
                      position: jax.Array, page: jax.Array, offset: jax.Array,
                      overwrite: jax.Array | None = None) -> PoolCache:
    """Write layer ``layer``'s token of each (row, head) at pool ``page``/``offset`` ``[B, Hkv]`` (`reserve_token`'s
    ``[layer]``: ``cache.alloc`` already counts it) and refresh that page's summaries, as `append_token` does
    for the uniform cache. ``k_new``/``v_new`` ``[B, Hkv, D]``; ``position`` ``[B]``. Heads whose page is the
    sentinel write nothing.

    The slot's bias is written (0): freed pages are not cleared. A page the token opens (offset 0) counts as
    empty whatever it held: its max bias is set to 0 (else raised to 0), and, quantised, its old codes and
    scales are dropped and it takes the zero points of the head's previous logical page
    (``table[layer, b, h, m - 1]``; on page 0 the token's own key). Quantised writes re-scale the whole page
    with `append_token`'s math (`cache_write._rescale_append`).

    ``overwrite`` ``[B, Hkv]`` bool (``None``: every head appends; the program is then the append's alone):
    the heads whose ``page``/``offset`` is a slot below their length, mapped through their table (H2O's
    eviction, `Policy.writes_in_place`), as `append_token`'s in-place write: the page is not fresh whatever
    the offset, its summaries and max bias are recomputed from its slots below the head's length, and a
    quantised page is re-scaled keeping its other entries.
    """
    kv = cache.pages
    N, ps = cache.num_pages, cache.page_size
    B, H = cache.batch, cache.heads
    D = kv.k.shape[-1]
    if tuple(k_new.shape) != (B, H, D) or tuple(v_new.shape) != (B, H, D):
        raise ValueError(f"k_new/v_new must be [B, Hkv, D]={[B, H, D]}, got {tuple(k_new.shape)}, {tuple(v_new.shape)}")
    for name, x in (("page", page), ("offset", offset)):
        if tuple(jnp.shape(x)) != (B, H):
            raise ValueError(f"{name} must be [B, Hkv]={[B, H]}, got shape {tuple(jnp.shape(x))}")
    if tuple(jnp.shape(position)) != (B,):
        raise ValueError(f"position must be [B={B}], got shape {tuple(jnp.shape(position))}")
    table, length = layer_tables(cache, layer)
    wrote = page < N
    m = jnp.maximum(length - 1, 0) // ps  # the token's logical page (length counts it)
    fresh = wrote & (offset == 0)
    slots = jnp.arange(ps)
    live = slots <= offset[..., None]  # [B, H, ps] the page's slots below the head's length
    if overwrite is not None:  # a slot inside a held page: the page keeps its other entries
        fresh = fresh & ~overwrite
        own = jnp.take_along_axis(table, jnp.minimum(m, table.shape[-1] - 1)[..., None], axis=-1)[..., 0]
        # the written page's slots below the length: all of them unless it is the head's last page
        live = jnp.where((overwrite & (page != own))[..., None], True, slots < (length - m * ps)[..., None])
    pos = kv.positions.at[page, offset].set(jnp.broadcast_to(position[:, None], (B, H)).astype(jnp.int32),
                                            mode="drop")
    bias = kv.bias.at[page, offset].set(0.0, mode="drop")
    read = lambda a: a.at[page].get(mode="fill", fill_value=0)  # noqa: E731 -- the sentinel's page is dropped
    new = {}
    if kv.quantized:
        prev = jnp.take_along_axis(table, jnp.maximum(m - 1, 0)[..., None], axis=-1)[..., 0]
        empty = lambda a: jnp.where(fresh.reshape(B, H, *(1,) * (a.ndim - 2)), jnp.zeros_like(a), a)  # noqa: E731
        old = (*(empty(read(a)) for a in (kv.k, kv.v, kv.k_scale, kv.k_zero, kv.v_scale)),
               kv.k_zero.at[prev].get(mode="fill", fill_value=0))
        keys, kq, vq, ks, kz, vs = _rescale_append(old, m > 0, k_new, v_new, slots == offset[..., None], fresh)
        k, v = kv.k.at[page].set(kq, mode="drop"), kv.v.at[page].set(vq, mode="drop")
        new.update(k_scale=kv.k_scale.at[page].set(ks, mode="drop"), k_zero=kv.k_zero.at[page].set(kz, mode="drop"),
                   v_scale=kv.v_scale.at[page].set(vs, mode="drop"))
        key_dtype = None
    else:
        k = kv.k.at[page, offset].set(k_new.astype(kv.k.dtype), mode="drop")
        v = kv.v.at[page, offset].set(v_new.astype(kv.v.dtype), mode="drop")
        keys, key_dtype = None, k.dtype
    held = kv.summaries
    if "page_max_bias" in held:
        page_bias = jnp.where(fresh, 0.0, jnp.maximum(read(kv.page_max_bias), 0.0))
        if overwrite is not None:  # the overwritten slot's old bias may have been the page's max
            page_bias = jnp.where(overwrite, jnp.where(live, read(bias), -jnp.inf).max(-1), page_bias)
        new["page_max_bias"] = kv.page_max_bias.at[page].set(page_bias, mode="drop")
    if held - {"page_max_bias"}:
        if keys is None:
            keys = k.at[page].get(mode="fill", fill_value=0).astype(jnp.float32)  # [B, H, ps, D]

        def put(name: str, value: jax.Array) -> None:
            new[name] = getattr(kv, name).at[page].set(value.astype(getattr(kv, name).dtype), mode="drop")

        _page_key_summaries(kv, keys, live, key_dtype, put)
    return cache.replace(pages=kv.replace(k=k, v=v, positions=pos, bias=bias, **new))


def _summary_dtype(like: LayerKV) -> jnp.dtype:
    """The dtype of ``like``'s page min/max (a quantised cache's model dtype; else its K dtype)."""
    held = [x.dtype for x in (like.page_min, like.page_max) if x is not None]
    return held[0] if held else (jnp.dtype(jnp.float32) if like.quantized else like.k.dtype)


def decode_pool(like: LayerKV, counts: jax.Array, *, page_size: int, max_pages_per_head: int, num_pages: int,
                next_position: jax.Array, local: LocalKV | None = None) -> PoolCache:
    """A fresh decode pool (docs/PAGE_POOL.md, Lifecycle → Compaction step 1) of ``num_pages`` empty pages with
    ``like``'s leaves (its K/V dtype or codes, summaries, scales: a uniform cache's `LayerKV` or a pool's
    pages), each (layer, row, head) owning the ``ceil(counts / page_size)`` pages for its ``counts``
    ``[L, B, Hkv]`` tokens (`cache_pool.allocate_after_compression` over the ``[L·B, Hkv]`` rows: prefix-sum
    ids, the rest on the free stack), ``length = counts``. ``max_pages_per_head`` (``M``) bounds a head for
    good, appends included. Nothing is written yet (`put_pages`). A pool too small, or a count over
    ``M·page_size``, sets ``alloc.overflow`` for the rows concerned and cuts their lengths to the pages they
    got: check ``alloc.overflow.any()`` outside jit. ``prompt_pages`` is 0 (no prefill view)."""
    c = jnp.asarray(counts)
    if c.ndim != 3 or not jnp.issubdtype(c.dtype, jnp.integer):
        raise ValueError(f"counts must be an int array [L, B, Hkv], got {c.dtype} of shape {tuple(c.shape)}")
    L, B, H = c.shape
    if tuple(jnp.shape(next_position)) != (B,):
        raise ValueError(f"next_position must be [B={B}], got shape {tuple(jnp.shape(next_position))}")
    alloc = allocate_after_compression(c.reshape(L * B, H).astype(jnp.int32), page_size, num_pages,
                                       max_pages_per_head=max_pages_per_head)
    pages = _empty_pages(num_pages, page_size, like.k.shape[-1], like.k.dtype, _summary_dtype(like), like.summaries)
    return PoolCache(pages=pages, alloc=alloc, next_position=jnp.asarray(next_position, jnp.int32), local=local,
                     num_layers=L, prompt_pages=0)


def pool_nbytes(like: LayerKV, num_layers: int, batch: int, heads: int, *, page_size: int, max_pages_per_head: int,
                num_pages: int, local: LocalKV | None = None) -> int:
    """Device bytes of the `decode_pool` of ``num_pages`` pages for ``[num_layers, batch, heads]`` (layer, row,
    head)s and ``like``'s leaves (`PoolCache.nbytes`: pages, tables, allocator, ``next_position``, the rings of
    ``local``), computed from shapes alone (`jax.eval_shape`, nothing allocated). With ``num_pages =
    cache_pool.pool_pages_needed(counts, page_size)``: the memory a compression keeping ``counts`` occupies."""
    def build() -> PoolCache:
        return decode_pool(like, jnp.zeros((num_layers, batch, heads), jnp.int32), page_size=page_size,
                           max_pages_per_head=max_pages_per_head, num_pages=num_pages,
                           next_position=jnp.zeros((batch,), jnp.int32), local=local)

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(build)))


def put_pages(cache: PoolCache, packed: LayerKV) -> PoolCache:
    """Write each (layer, row, head)'s packed pages into the pool pages its table names (docs/PAGE_POOL.md,
    Lifecycle → Compaction step 3): ``packed`` holds the pool's leaves stacked per head, slot leaves
    ``[L, B, Hkv, Mk·ps, ...]`` (logical slot ``s`` of the head at ``[..., s, ...]``) and per-page leaves
    ``[L, B, Hkv, Mk, ...]``, ``Mk <= M``; logical page ``m`` goes to ``table[l, b, h, m]``, one scatter per
    leaf (``mode="drop"``: pages a head does not own carry the sentinel and are dropped). Ownership and
    lengths are left as they are (`decode_pool` set them); the pages nobody owns are not touched."""
    L, B, H, ps = cache.num_layers, cache.batch, cache.heads, cache.page_size
    S = packed.k.shape[3] if packed.k.ndim == 5 else -1
    if packed.k.ndim != 5 or tuple(packed.k.shape[:3]) != (L, B, H) or S % ps or S // ps > cache.max_pages_per_head:
        raise ValueError(f"packed.k must be [L, B, Hkv, Mk·ps, D] with L, B, Hkv = {L}, {B}, {H} and Mk <= "
                         f"max_pages_per_head={cache.max_pages_per_head} pages of {ps}, got {tuple(packed.k.shape)}")
    for f in _FIELDS:
        if (getattr(packed, f) is None) != (getattr(cache.pages, f) is None):
            raise ValueError(f"packed.{f} is {'absent' if getattr(packed, f) is None else 'given'}; the pool "
                             f"{'holds' if getattr(cache.pages, f) is not None else 'does not hold'} it")
    Mk = S // ps
    table = cache.tables[..., :Mk]  # [L, B, H, Mk]

    def put(name: str) -> jax.Array | None:
        a, x = getattr(cache.pages, name), getattr(packed, name)
        if a is None:
            return None
        if name in _SLOT_FIELDS:  # [L, B, H, Mk·ps, ...] -> [L, B, H, Mk, ps, ...]
            x = x.reshape(L, B, H, Mk, ps, *x.shape[4:])
        return a.at[table].set(x.astype(a.dtype), mode="drop")

    return cache.replace(pages=cache.pages.replace(**{f: put(f) for f in _FIELDS}))


def take_logical(cache: PoolCache, leaf: jax.Array, at: jax.Array, per_page: bool = False) -> jax.Array:
    """A pool leaf (one of ``cache.pages``') read at logical slots ``at`` ``[L, B, Hkv, K]`` of each (layer, row,
    head) (``per_page``: at logical pages, for the per-page leaves): slot ``s`` is pool page
    ``table[l, b, h, s // ps]``, offset ``s % ps``. An index past the table or on a page the head does not
    own reads as an empty cache's (position -1, zeros). ``[L, B, Hkv, K, ...]``: the gather of a compaction
    from a pool (`policies.common.write_kept_pool`)."""
    ps, M = cache.page_size, cache.max_pages_per_head
    page = at if per_page else at // ps
    phys = jnp.take_along_axis(cache.tables, jnp.clip(page, 0, M - 1), axis=-1)
    phys = jnp.where((page >= 0) & (page < M), phys, cache.num_pages)
    fill = -1 if leaf.dtype == jnp.int32 and not per_page else 0
    if per_page:
        return leaf.at[phys].get(mode="fill", fill_value=fill)
    return leaf.at[phys, at % ps].get(mode="fill", fill_value=fill)


def shuffle_pages(cache: PoolCache, perm: np.ndarray,
                  junk: Callable[[np.ndarray], np.ndarray] | None = None) -> PoolCache:
    """The same pool with page ``i`` moved to ``perm[i]`` (a permutation of ``[0, N)``), its tables and free
    stack relabelled: it holds the same tokens, so every reader through the tables gives what it gave before.
    ``junk(leaf)``: an array shaped as the (moved, host) ``leaf`` that replaces every page no (layer, row,
    head) owns -- NaN or random codes, so that a reader that looks past the tables shows it (tests). On the
    host; not for use inside ``jit``."""
    N = cache.num_pages
    perm = np.asarray(perm)
    if sorted(perm.tolist()) != list(range(N)):
        raise ValueError(f"perm must be a permutation of range({N}), got shape {perm.shape}")
    to = jnp.asarray(perm, jnp.int32)
    relabel = lambda t: jnp.where(t < N, to[jnp.minimum(t, N - 1)], N)  # noqa: E731 -- the sentinel N stays
    alloc = cache.alloc.replace(table=relabel(cache.alloc.table), free=relabel(cache.alloc.free))
    own = np.zeros(N, bool)
    own[np.asarray(alloc.table)[np.asarray(owned(alloc))]] = True
    inv = np.argsort(perm)

    def move(a: jax.Array) -> jax.Array:
        a = np.asarray(a)[inv]
        if junk is None:
            return jnp.asarray(a)
        return jnp.asarray(np.where(~own.reshape(-1, *(1,) * (a.ndim - 1)), junk(a), a))

    return cache.replace(pages=jax.tree.map(move, cache.pages), alloc=alloc)


def grow_tokens(cache: PoolCache, tokens: jax.Array) -> PoolCache:
    """Room for ``tokens`` ``[B]`` int more tokens of each row in every layer and KV head (`extend`'s one allocator
    call, before its layer scan): `cache_pool.grow` over the ``[L·B, Hkv]`` rows, each head popping the pages its
    run of tokens needs past the ones it holds (a head whose last page has room fills it first) and its length
    growing by the row's ``tokens``. The new tokens' logical slots are each head's old length ``..`` (heads that
    keep different counts start at different slots). A pool that runs out sets ``alloc.overflow`` for the rows
    concerned and cuts their lengths to the pages they got (`write_tokens_pool` then drops the tokens past them)."""
    L, B, H = cache.num_layers, cache.batch, cache.heads
    t = jnp.asarray(tokens)
    if tuple(t.shape) != (B,) or not jnp.issubdtype(t.dtype, jnp.integer):
        raise ValueError(f"tokens must be an int array [B={B}], got {t.dtype} of shape {tuple(t.shape)}")
    per_head = jnp.broadcast_to(t.astype(jnp.int32)[None, :, None], (L, B, H)).reshape(L * B, H)
    return cache.replace(alloc=grow(cache.alloc, per_head))


def write_tokens_pool(cache: PoolCache, layer: int | jax.Array, k_new: jax.Array, v_new: jax.Array,
                      start: jax.Array, written: jax.Array, positions: jax.Array) -> PoolCache:
    """Write layer ``layer``'s run of ``T`` tokens per row into a pool that `grow_tokens` made room for: token ``t``
    of (row ``b``, head ``h``) at logical slot ``start[b, h] + t`` (``start`` ``[B, Hkv]``: the head's length before
    the run), mapped through the layer's table, at RoPE position ``positions[b, t]``, bias 0. ``k_new``/``v_new``
    ``[B, T, Hkv, D]`` (the model's layout); only the tokens ``written`` ``[B, T]`` (a row's first ones) are
    written, and those past the pages a head holds (the pool ran out) are dropped.

    The pages the run touches (each head's ``(T - 1) // ps + 2`` logical pages from ``start // ps``) are gathered,
    written, and put back whole: their key summaries (non-quantised: from the stored keys over their live slots,
    as `cache.summarize_pages`) and max bias recomputed; quantised, every touched page re-scaled by
    `cache_write.write_tokens` itself, run per head (``jax.vmap`` over the heads), its key summaries from the keys
    as computed. A page the run opens is treated as empty whatever it held before (freed pages are not cleared).
    The allocator (lengths, tables) is left as it is: `grow_tokens` set it."""
    kv = cache.pages
    N, ps, M = cache.num_pages, cache.page_size, cache.max_pages_per_head
    B, H = cache.batch, cache.heads
    D = kv.k.shape[-1]
    if k_new.ndim != 4 or tuple(k_new.shape[:1]) + tuple(k_new.shape[2:]) != (B, H, D) or v_new.shape != k_new.shape:
        raise ValueError(f"k_new/v_new must be [B, T, Hkv, D] with B, Hkv, D = {B}, {H}, {D}, got "
                         f"{tuple(k_new.shape)}, {tuple(v_new.shape)}")
    T = k_new.shape[1]
    if tuple(jnp.shape(start)) != (B, H):
        raise ValueError(f"start must be [B, Hkv]={[B, H]}, got shape {tuple(jnp.shape(start))}")
    for name, x in (("written", written), ("positions", positions)):
        if tuple(jnp.shape(x)) != (B, T):
            raise ValueError(f"{name} must be [B, T]={[B, T]}, got shape {tuple(jnp.shape(x))}")
    table, _ = layer_tables(cache, layer)
    start = jnp.asarray(start, jnp.int32)
    n = (T - 1) // ps + 2  # logical pages a run of T slots can touch
    m0 = start // ps
    m = m0[..., None] + jnp.arange(n, dtype=jnp.int32)  # [B, H, n] the window's logical pages
    end = start + written.sum(-1, dtype=jnp.int32)[:, None]  # [B, H]
    touched = (m < M) & (m * ps < end[..., None]) & (end > start)[..., None]
    phys = jnp.where(touched, jnp.take_along_axis(table, jnp.clip(m, 0, M - 1), axis=-1), N)  # [B, H, n]
    win = {f: None if getattr(kv, f) is None else
           getattr(kv, f).at[phys].get(mode="fill", fill_value=_FILL.get(f, 0)) for f in _FIELDS}
    # the window as one uniform layer: slots [B, H, n·ps, ...], per page [B, H, n, ...]
    flat = {f: None if a is None else (a.reshape(B, H, n * ps, *a.shape[4:]) if f in _SLOT_FIELDS else a)
            for f, a in win.items()}
    slot = (start - m0 * ps)[..., None] + jnp.arange(T, dtype=jnp.int32)  # [B, H, T] in the window
    at = jnp.where(written[:, None, :], slot, n * ps)  # unwritten tokens drop
    b, h = jnp.arange(B)[:, None, None], jnp.arange(H)[None, :, None]
    pos = jnp.broadcast_to(positions[:, None, :], (B, H, T)).astype(jnp.int32)
    flat["positions"] = flat["positions"].at[b, h, at].set(pos, mode="drop")
    flat["bias"] = flat["bias"].at[b, h, at].set(0.0, mode="drop")
    w = kv.replace(**flat)
    end_w = end - m0 * ps  # [B, H] the window's live slots end here
    valid = (jnp.arange(n * ps) < end_w[..., None]) & (w.positions >= 0)
    if kv.quantized:
        def one_head(kv_h: LayerKV, k_h: jax.Array, v_h: jax.Array, slots_h: jax.Array, end_h: jax.Array) -> LayerKV:
            one = jax.tree.map(lambda a: a[:, None], kv_h)
            return jax.tree.map(lambda a: a[:, 0], write_tokens(one, k_h[:, :, None], v_h[:, :, None], slots_h,
                                                                 written, end_h))

        w = jax.vmap(one_head, in_axes=(1, 2, 2, 1, 1), out_axes=1)(w, k_new, v_new, slot, end_w)
    else:
        w = w.replace(k=w.k.at[b, h, at].set(jnp.swapaxes(k_new, 1, 2).astype(w.k.dtype), mode="drop"),
                      v=w.v.at[b, h, at].set(jnp.swapaxes(v_new, 1, 2).astype(w.v.dtype), mode="drop"))
        if kv.summaries - {"page_max_bias"}:
            w = w.replace(**_key_summaries(w, w.k, valid, ps))
    if "page_max_bias" in kv.summaries:
        w = w.replace(page_max_bias=jnp.where(valid, w.bias, -jnp.inf).reshape(B, H, n, ps).max(-1))

    def put(name: str) -> jax.Array | None:
        a, x = getattr(kv, name), getattr(w, name)
        if a is None:
            return None
        if name in _SLOT_FIELDS:  # [B, H, n·ps, ...] -> [B, H, n, ps, ...]
            x = x.reshape(B, H, n, ps, *x.shape[3:])
        return a.at[phys].set(x.astype(a.dtype), mode="drop")

    return cache.replace(pages=kv.replace(**{f: put(f) for f in _FIELDS}))
