"""The page pool's allocator (issue 38, docs/PAGE_POOL.md): which pool page each (row, head) owns.

This module decides *ownership* only; it moves no K/V. A pool of ``N`` pages of ``page_size`` tokens
is shared by every (row, head) of a batch; each (row, head) owns a page table of pool ids and a
length. The caller (the engine, once the pool is wired in: docs/PAGE_POOL.md, "Migration") writes
K/V into the pages these functions hand out. A "row" and a "head" here are whatever owns one page
list: the engine's rows are (layer, batch row) pairs, layer-major (``[L * B, Hkv]``, so the tables
reshape to ``[L, B, Hkv, M]`` for free), and a finished request frees its row in every layer.

`PagePool` holds, for a batch of ``B`` rows and ``H`` heads:

* ``table`` ``[B, H, M]`` int32: entry ``m`` of a (row, head) is the pool page holding its tokens
  ``m * page_size .. (m + 1) * page_size - 1``; entries at or past ``held`` are ``num_pages`` (no
  page). The sentinel is one past the last page, not ``-1``: a gather or scatter with
  ``mode="fill"``/``"drop"`` leaves it out, where ``-1`` would wrap silently to the last page.
* ``held`` ``[B, H]`` int32: pages owned; ``length`` ``[B, H]`` int32: tokens held.
* ``free`` ``[N]`` int32: a stack of the free pages, ``free[:num_free]`` (the top at
  ``num_free - 1``), the rest ``num_pages``; ``num_free`` a scalar.
* ``overflow`` ``[B]`` bool: a row asked for a page it could not get (the pool was empty, or a head
  wanted more than ``M`` pages). Sticky until the row is freed or allocated again; the caller checks
  ``pool.overflow.any()`` outside jit (no host round trip per step).

Invariants every function keeps (the tests check them against a Python reference):

* no page is owned twice, and no owned page is on the free stack: the owned pages and
  ``free[:num_free]`` are ``N`` distinct ids in ``[0, N)``;
* ``ceil(length / page_size) <= held <= M``, with equality on the left after an allocation; more
  only where a caller shortened ``length`` (CHESS's rewind, a padded prompt row): those pages are
  kept and refilled before any is popped;
* a row without overflow holds ``ceil(length / page_size)`` pages for the lengths it asked for.

The functions: `empty_pool`; `allocate_after_compression` (a fresh pool, prefix-sum allocation) and
`allocate_rows` (new requests in rows of a live pool); `append_slots` (one token per (row, head): a
page for each head whose last page is full) and `grow` (a run of tokens); `free_rows` (finished
requests).

Every function is pure, of static shapes and vectorised over rows and heads (a cumulative sum ranks
the requests, no Python loop over heads), so it runs under `jax.jit` and `jax.vmap` (on a mesh, one
pool per device: run per device or vmapped over the pool groups, docs/PAGE_POOL.md). Requests are
served in row-major order of ``(row, head, page)``, each popping the stack's top: on a fresh pool that
is a prefix-sum allocation, the pages of (row, head) ``i`` being ``offset_i .. offset_i + n_i - 1``
with ``offset`` the exclusive cumulative sum of the ``n``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.pallas.validation import is_concrete

__all__ = ["PagePool", "allocate_after_compression", "allocate_rows", "append_slots", "empty_pool", "free_rows",
           "grow", "owned", "pages_needed", "pool_pages_needed"]


@struct.dataclass
class PagePool:
    """Page ownership of a batch (the module docstring gives the layout and the invariants)."""

    table: jax.Array  # [B, H, M] int32 pool ids, `num_pages` past `held`
    held: jax.Array  # [B, H] int32 pages owned
    length: jax.Array  # [B, H] int32 tokens held
    free: jax.Array  # [N] int32 free stack: free[:num_free], the rest `num_pages`
    num_free: jax.Array  # [] int32
    overflow: jax.Array  # [B] bool, sticky until the row is freed or allocated again
    page_size: int = struct.field(pytree_node=False, default=16)

    @property
    def num_pages(self) -> int:
        """Pages in the pool (``N``; also the table's "no page" sentinel)."""
        return self.free.shape[-1]

    @property
    def max_pages_per_head(self) -> int:
        """Table entries per (row, head) (``M``)."""
        return self.table.shape[-1]


def pages_needed(lengths: jax.Array, page_size: int) -> jax.Array:
    """``ceil(lengths / page_size)``: pages holding ``lengths`` tokens (int32, any shape)."""
    return ((jnp.asarray(lengths, jnp.int32) + page_size - 1) // page_size).astype(jnp.int32)


def pool_pages_needed(counts: jax.Array, page_size: int) -> jax.Array:
    """Pages a compression occupies: ``sum(ceil(counts / page_size))`` over every entry of ``counts`` (any
    shape, e.g. ``[L, B, Hkv]`` tokens kept per (layer, row, head)), an int32 scalar (traceable). A pool of
    exactly that many pages holds the compression with no page to spare (`allocate_after_compression`
    leaves the stack empty); for ``n`` more tokens per head afterwards, pass ``counts + n``. ``ValueError``
    for a negative count or a bad ``page_size`` (concrete values)."""
    if isinstance(page_size, bool) or not isinstance(page_size, (int, np.integer)) or page_size <= 0:
        raise ValueError(f"page_size={page_size!r} must be a positive int")
    c = jnp.asarray(counts)
    if not jnp.issubdtype(c.dtype, jnp.integer):
        raise ValueError(f"counts must be an int array, got {c.dtype}")
    if is_concrete(c) and c.size and int(c.min()) < 0:
        raise ValueError(f"counts must be >= 0, got a minimum of {int(c.min())}")
    return pages_needed(c, page_size).sum(dtype=jnp.int32)


def owned(pool: PagePool) -> jax.Array:
    """``[B, H, M]`` bool: the table entries that name a page the (row, head) owns (below ``held``)."""
    return jnp.arange(pool.max_pages_per_head, dtype=jnp.int32) < pool.held[..., None]


def _check_sizes(page_size: int, num_pages: int, max_pages_per_head: int) -> None:
    for name, value in (("page_size", page_size), ("num_pages", num_pages),
                        ("max_pages_per_head", max_pages_per_head)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a power of two (as the cache's)")
    if num_pages >= 2**31 - 1:
        raise ValueError(f"num_pages={num_pages} does not fit an int32 page id with its sentinel")


def _check_lengths(kept_lengths: jax.Array, shape: tuple[int, ...] | None = None) -> jax.Array:
    x = jnp.asarray(kept_lengths)
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"kept_lengths must be an int array [B, H], got {x.dtype} of shape {tuple(x.shape)}")
    if shape is not None and tuple(x.shape) != shape:
        raise ValueError(f"kept_lengths shape {tuple(x.shape)} is not the pool's [B, H] = {shape}")
    if is_concrete(x) and x.size and int(x.min()) < 0:
        raise ValueError(f"kept_lengths must be >= 0, got a minimum of {int(x.min())}")
    return x.astype(jnp.int32)


def _check_rows(rows: jax.Array, batch: int, name: str = "rows") -> jax.Array:
    r = jnp.asarray(rows)
    if r.dtype != jnp.bool_ or tuple(r.shape) != (batch,):
        raise ValueError(f"{name} must be a bool mask [B={batch}], got {r.dtype} of shape {tuple(r.shape)}")
    return r


def empty_pool(batch: int, heads: int, *, num_pages: int, max_pages_per_head: int, page_size: int) -> PagePool:
    """A pool of ``num_pages`` free pages for ``batch`` rows of ``heads`` heads owning none.

    The stack is ordered so that pops hand out pages ``0, 1, 2, ...`` (prefix-sum allocation)."""
    _check_sizes(page_size, num_pages, max_pages_per_head)
    for name, value in (("batch", batch), ("heads", heads)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    return PagePool(table=jnp.full((batch, heads, max_pages_per_head), num_pages, jnp.int32),
                    held=jnp.zeros((batch, heads), jnp.int32), length=jnp.zeros((batch, heads), jnp.int32),
                    free=jnp.arange(num_pages - 1, -1, -1, dtype=jnp.int32), num_free=jnp.int32(num_pages),
                    overflow=jnp.zeros((batch,), bool), page_size=page_size)


def _pop(free: jax.Array, num_free: jax.Array, want: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pop a page for every true entry of ``want`` (any shape), in row-major order, while pages last:
    ``(pages, granted, free, num_free)``, ``pages`` the sentinel where not ``granted``."""
    N = free.shape[0]
    flat = want.reshape(-1)
    rank = jnp.cumsum(flat.astype(jnp.int32)) - 1  # [n] position of each request in the queue
    granted = flat & (rank < num_free)
    src = jnp.clip(num_free - 1 - rank, 0, N - 1)
    pages = jnp.where(granted, free[src], N)
    left = num_free - granted.sum(dtype=jnp.int32)
    free = jnp.where(jnp.arange(N) < left, free, N)  # popped slots no longer name a page
    return pages.reshape(want.shape), granted.reshape(want.shape), free, left


def free_rows(pool: PagePool, rows: jax.Array) -> PagePool:
    """Return every page of the rows marked in ``rows`` ``[B]`` bool (finished requests) to the pool.

    Their tables become empty (the sentinel), ``held``/``length`` 0 and ``overflow`` false; the
    pages are pushed on the stack in row-major order of (row, head, table entry). Other rows are
    left as they are."""
    rows = _check_rows(rows, pool.table.shape[0])
    N = pool.num_pages
    give = (rows[:, None, None] & owned(pool)).reshape(-1)
    rank = jnp.cumsum(give.astype(jnp.int32)) - 1
    dst = jnp.where(give, pool.num_free + rank, N)  # fits: owned pages and free ones are N distinct ids
    free = pool.free.at[dst].set(pool.table.reshape(-1), mode="drop")
    keep = ~rows[:, None]
    return pool.replace(table=jnp.where(keep[..., None], pool.table, N), held=jnp.where(keep, pool.held, 0),
                        length=jnp.where(keep, pool.length, 0), free=free,
                        num_free=pool.num_free + give.sum(dtype=jnp.int32), overflow=pool.overflow & ~rows)


def allocate_rows(pool: PagePool, kept_lengths: jax.Array, rows: jax.Array) -> PagePool:
    """Give each (row, head) of the rows marked in ``rows`` ``[B]`` bool the pages for
    ``kept_lengths`` ``[B, H]`` tokens (what compression kept, or a prompt), from the free stack.

    The marked rows' earlier pages are returned first (`free_rows`); unmarked rows are untouched and
    their ``kept_lengths`` ignored. Requests are served in row-major order of (row, head, page) while
    pages last. A marked row whose request is not met in full (the pool ran out, or a head needs more
    than ``max_pages_per_head`` pages) gets ``overflow`` set; it keeps the pages it got, each head a
    prefix of its request, with ``length`` cut to what they hold, so the invariants hold either way.
    """
    kept = _check_lengths(kept_lengths, tuple(pool.held.shape))
    rows = _check_rows(rows, pool.table.shape[0])
    pool = free_rows(pool, rows)
    M, ps = pool.max_pages_per_head, pool.page_size
    need = jnp.where(rows[:, None], pages_needed(kept, ps), 0)
    want = jnp.arange(M, dtype=jnp.int32) < need[..., None]  # [B, H, M]
    pages, granted, free, num_free = _pop(pool.free, pool.num_free, want)
    held = jnp.where(rows[:, None], granted.sum(-1, dtype=jnp.int32), pool.held)
    short = (granted.sum(-1) < need) | (need > M)  # [B, H]
    return pool.replace(table=jnp.where(rows[:, None, None], pages, pool.table), held=held,
                        length=jnp.where(rows[:, None], jnp.minimum(kept, held * ps), pool.length),
                        free=free, num_free=num_free, overflow=pool.overflow | (rows & short.any(-1)))


def allocate_after_compression(kept_lengths: jax.Array, page_size: int, num_pages: int, *,
                               max_pages_per_head: int) -> PagePool:
    """A fresh pool of ``num_pages`` pages whose (row, head)s own the pages for ``kept_lengths``
    ``[B, H]`` int tokens: ``ceil(kept / page_size)`` pages each, handed out by prefix sum (the pages of
    (row, head) ``i`` in row-major order are ``offset_i ..``, ``offset`` the exclusive cumulative sum),
    the rest on the free stack for later appends and rows.

    ``max_pages_per_head`` (static) is the table's width ``M``: the most pages any (row, head) may
    ever hold, appends included (the engine's ``pages_for(capacity, page_size)``). When the pool is
    too small, or a head needs more than ``M`` pages, the rows concerned get ``overflow`` (see
    `allocate_rows`): check ``pool.overflow.any()`` outside jit before using the pool.
    """
    kept = _check_lengths(kept_lengths)
    B, H = kept.shape
    pool = empty_pool(B, H, num_pages=num_pages, max_pages_per_head=max_pages_per_head, page_size=page_size)
    return allocate_rows(pool, kept, jnp.ones((B,), bool))


def append_slots(pool: PagePool, active: jax.Array) -> tuple[PagePool, jax.Array, jax.Array]:
    """Make room for one token in each (row, head) marked in ``active`` (``[B, H]`` or ``[B]`` bool):
    ``(pool, page [B, H], offset [B, H])``, the pool page and the slot in it where that token goes.

    A head whose pages are full (``length == held * page_size``, none held included) takes one page
    from the stack (pops in row-major order of (row, head)); the others write into the page they
    hold. Then ``length`` grows by one. A head that needed a page and got none (the stack is empty,
    or it already holds ``max_pages_per_head``) does not grow; its ``page`` is the sentinel (a write
    there with ``mode="drop"`` is dropped) and its row's ``overflow`` is set. Inactive heads (a
    stopped row; a head that overwrites a slot in place instead of appending) get the sentinel and
    are left as they are.
    """
    B, H = pool.held.shape
    act = jnp.asarray(active)
    if act.dtype != jnp.bool_ or tuple(act.shape) not in ((B,), (B, H)):
        raise ValueError(f"active must be a bool mask [B={B}] or [B, H]={[B, H]}, got {act.dtype} of shape "
                         f"{tuple(act.shape)}")
    act = jnp.broadcast_to(act[:, None] if act.ndim == 1 else act, (B, H))
    N, M, ps = pool.num_pages, pool.max_pages_per_head, pool.page_size
    need = act & (pool.length >= pool.held * ps)  # last page full (or none held)
    new, granted, free, num_free = _pop(pool.free, pool.num_free, need & (pool.held < M))
    at = (jnp.arange(M, dtype=jnp.int32) == pool.held[..., None]) & granted[..., None]
    table = jnp.where(at, new[..., None], pool.table)
    held = pool.held + granted
    ok = act & (~need | granted)
    entry = jnp.clip(pool.length // ps, 0, M - 1)
    page = jnp.where(ok, jnp.take_along_axis(table, entry[..., None], axis=-1)[..., 0], N)
    offset = pool.length % ps
    pool = pool.replace(table=table, held=held, length=pool.length + ok, free=free, num_free=num_free,
                        overflow=pool.overflow | (act & ~ok).any(-1))
    return pool, page, offset


def grow(pool: PagePool, tokens: jax.Array) -> PagePool:
    """Make room for ``tokens`` (``[B, H]`` or ``[B]`` int, ``>= 0``) more tokens in each (row, head):
    pages are popped until it holds ``ceil((length + tokens) / page_size)`` (row-major order of (row,
    head, page), while pages last) and ``length`` grows by ``tokens``. A run of tokens at once (a
    question read after compression, `engine.prefill.extend`); the new tokens' logical slots are
    ``old length ..``, their pages ``table[slot // page_size]``.

    A (row, head) that cannot get every page (the stack ran out, or more than ``max_pages_per_head``)
    keeps those it got, its ``length`` grows only as far as they hold, and its row gets ``overflow``.
    """
    B, H = pool.held.shape
    t = jnp.asarray(tokens)
    if not jnp.issubdtype(t.dtype, jnp.integer) or tuple(t.shape) not in ((B,), (B, H)):
        raise ValueError(f"tokens must be an int array [B={B}] or [B, H]={[B, H]}, got {t.dtype} of shape "
                         f"{tuple(t.shape)}")
    if is_concrete(t) and t.size and int(t.min()) < 0:
        raise ValueError(f"tokens must be >= 0, got a minimum of {int(t.min())}")
    t = jnp.broadcast_to(t[:, None] if t.ndim == 1 else t, (B, H)).astype(jnp.int32)
    M, ps = pool.max_pages_per_head, pool.page_size
    want_len = pool.length + t
    need = pages_needed(want_len, ps)
    entry = jnp.arange(M, dtype=jnp.int32)
    want = (entry >= pool.held[..., None]) & (entry < need[..., None])  # [B, H, M]
    new, granted, free, num_free = _pop(pool.free, pool.num_free, want)
    held = pool.held + granted.sum(-1, dtype=jnp.int32)
    return pool.replace(table=jnp.where(granted, new, pool.table), held=held,
                        length=jnp.minimum(want_len, held * ps), free=free,
                        num_free=num_free, overflow=pool.overflow | (held < need).any(-1))
