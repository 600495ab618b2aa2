"""The page pool's allocator (`sparsekv_jax.cache_pool`) against a plain Python one written here.

The reference keeps each (row, head)'s pages as a list and the free pages as a Python list used as a
stack, and serves requests with loops in row-major order of (row, head, page): the allocator must
give the same pages (its documented order), and, checked apart from the reference, keep its
invariants: no page owned twice or both owned and free, every page in range, ``held =
ceil(length / page_size)`` where nothing overflowed, overflow flagged exactly where the reference
ran out. Every draw comes from the ``rng`` fixture (the run's seed is printed; ``--seed N`` replays).
The allocator runs under `jax.jit` throughout (and a `lax.scan` of appends, as a decode loop would).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax import cache_pool as pp


class RefPool:
    """The reference: lists, a stack, loops."""

    def __init__(self, B: int, H: int, N: int, M: int, ps: int):
        self.B, self.H, self.N, self.M, self.ps = B, H, N, M, ps
        self.stack = list(range(N - 1, -1, -1))  # the top is the end: pops give 0, 1, 2, ...
        self.pages = [[[] for _ in range(H)] for _ in range(B)]
        self.length = np.zeros((B, H), np.int64)
        self.overflow = np.zeros(B, bool)

    def free(self, rows) -> None:
        for b in range(self.B):
            if rows[b]:
                for h in range(self.H):
                    self.stack.extend(self.pages[b][h])
                    self.pages[b][h] = []
                    self.length[b, h] = 0
                self.overflow[b] = False

    def allocate(self, kept: np.ndarray, rows) -> None:
        self.free(rows)
        for b in range(self.B):
            if not rows[b]:
                continue
            for h in range(self.H):
                need = -(-int(kept[b, h]) // self.ps)
                for _ in range(min(need, self.M)):
                    if self.stack:
                        self.pages[b][h].append(self.stack.pop())
                got = len(self.pages[b][h])
                self.overflow[b] |= got < need
                self.length[b, h] = min(int(kept[b, h]), got * self.ps)

    def append(self, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        page = np.full((self.B, self.H), self.N)
        offset = self.length % self.ps
        for b in range(self.B):
            for h in range(self.H):
                if not active[b, h]:
                    continue
                mine = self.pages[b][h]
                if self.length[b, h] == len(mine) * self.ps:  # last page full (or none)
                    if len(mine) == self.M or not self.stack:
                        self.overflow[b] = True
                        continue
                    mine.append(self.stack.pop())
                page[b, h] = mine[self.length[b, h] // self.ps]
                self.length[b, h] += 1
        return page, offset

    def grow(self, tokens: np.ndarray) -> None:
        for b in range(self.B):
            for h in range(self.H):
                target = -(-int(self.length[b, h] + tokens[b, h]) // self.ps)
                mine = self.pages[b][h]
                while len(mine) < min(target, self.M) and self.stack:
                    mine.append(self.stack.pop())
                self.overflow[b] |= len(mine) < target
                self.length[b, h] = min(self.length[b, h] + tokens[b, h], len(mine) * self.ps)

    def table(self) -> np.ndarray:
        t = np.full((self.B, self.H, self.M), self.N)
        for b in range(self.B):
            for h in range(self.H):
                t[b, h, :len(self.pages[b][h])] = self.pages[b][h]
        return t

    def assert_same(self, pool: pp.PagePool) -> None:
        np.testing.assert_array_equal(np.asarray(pool.table), self.table())
        np.testing.assert_array_equal(np.asarray(pool.held), [[len(p) for p in row] for row in self.pages])
        np.testing.assert_array_equal(np.asarray(pool.length), self.length)
        np.testing.assert_array_equal(np.asarray(pool.overflow), self.overflow)
        n = int(pool.num_free)
        assert n == len(self.stack)
        np.testing.assert_array_equal(np.asarray(pool.free)[:n], self.stack)


def check_invariants(pool: pp.PagePool) -> None:
    """What must hold of any pool, from its arrays alone."""
    N, M, ps = pool.num_pages, pool.max_pages_per_head, pool.page_size
    table, held, length = np.asarray(pool.table), np.asarray(pool.held), np.asarray(pool.length)
    n_free = int(pool.num_free)
    mine = np.arange(M) < held[..., None]
    owned_pages = table[mine]
    free_pages = np.asarray(pool.free)[:n_free]
    assert ((owned_pages >= 0) & (owned_pages < N)).all(), "an owned page out of range"
    assert ((free_pages >= 0) & (free_pages < N)).all(), "a free page out of range"
    every = np.concatenate([owned_pages, free_pages])
    assert len(np.unique(every)) == len(every) == N, "a page owned twice, owned and free, or lost"
    assert (table[~mine] == N).all(), "an entry past `held` names a page"
    assert (np.asarray(pool.free)[n_free:] == N).all()
    assert (held <= M).all() and (held >= -(-length // ps)).all(), "tokens without pages"


def jitted():
    """The allocator's functions under `jax.jit` (sizes static)."""
    return (jax.jit(pp.allocate_after_compression, static_argnums=(1, 2), static_argnames="max_pages_per_head"),
            jax.jit(pp.allocate_rows), jax.jit(pp.append_slots), jax.jit(pp.free_rows), jax.jit(pp.grow))


ALLOC, ALLOC_ROWS, APPEND, FREE, GROW = jitted()


def draw_lengths(rng: np.random.Generator, B: int, H: int, most: int) -> np.ndarray:
    kept = rng.integers(0, most + 1, size=(B, H))
    kept[rng.random((B, H)) < 0.15] = 0  # heads keeping nothing
    return kept


@pytest.mark.parametrize("page_size", [4, 16])
def test_allocate_after_compression_matches_reference(rng, page_size):
    B, H, M = 3, 5, 6
    for trial in range(12):
        kept = draw_lengths(rng, B, H, M * page_size + page_size)  # some heads need more than M pages
        need = -(-kept // page_size)
        total = int(np.minimum(need, M).sum())
        N = max(1, total + int(rng.integers(-4, 5)))  # around what is asked: pools short and long enough
        pool = ALLOC(jnp.asarray(kept, jnp.int32), page_size, N, max_pages_per_head=M)
        ref = RefPool(B, H, N, M, page_size)
        ref.allocate(kept, [True] * B)
        ref.assert_same(pool)
        check_invariants(pool)
        # overflow exactly where the reference (and plain arithmetic) says the request cannot be met
        ends = np.cumsum(np.minimum(need, M).reshape(-1)).reshape(B, H)
        short = (ends > N) | (need > M)
        np.testing.assert_array_equal(np.asarray(pool.overflow), short.any(1), err_msg=f"trial {trial}")
        held = np.asarray(pool.held)
        fine = ~short.any(1)
        np.testing.assert_array_equal(held[fine], need[fine])
        np.testing.assert_array_equal(np.asarray(pool.length)[fine], kept[fine])
        # on a fresh pool it is a prefix-sum allocation: (row, head) i holds offset_i .. offset_i + n_i - 1
        if total <= N:
            offset = (ends - np.minimum(need, M)).reshape(B, H)
            for b in range(B):
                for h in range(H):
                    np.testing.assert_array_equal(np.asarray(pool.table)[b, h, :held[b, h]],
                                                  offset[b, h] + np.arange(held[b, h]))


def test_append_takes_a_page_only_where_the_last_one_is_full(rng):
    B, H, M, ps, steps = 3, 4, 5, 4, 24
    kept = draw_lengths(rng, B, H, 3 * ps)
    N = int((-(-kept // ps)).sum()) + 14  # room for some appends, not for all of them: overflow late
    pool = ALLOC(jnp.asarray(kept, jnp.int32), ps, N, max_pages_per_head=M)
    ref = RefPool(B, H, N, M, ps)
    ref.allocate(kept, [True] * B)
    ref.assert_same(pool)
    actives = rng.random((steps, B, H)) < 0.7
    actives[:, 0, :] = rng.random((steps, 1)) < 0.7  # a row-wide mask too (a stopped row)

    def step(pool, active):
        new, page, offset = pp.append_slots(pool, active)
        return new, (page, offset, new.held, new.length, new.overflow, new.num_free)

    final, (pages, offsets, helds, lengths, overflows, frees) = jax.jit(lambda p, a: jax.lax.scan(step, p, a))(
        pool, jnp.asarray(actives))
    for t in range(steps):
        before_len = ref.length.copy()
        before_held = np.array([[len(p) for p in row] for row in ref.pages])
        page, offset = ref.append(actives[t])
        np.testing.assert_array_equal(np.asarray(pages[t]), page, err_msg=f"step {t}")
        np.testing.assert_array_equal(np.asarray(offsets[t]), offset, err_msg=f"step {t}")
        np.testing.assert_array_equal(np.asarray(lengths[t]), ref.length, err_msg=f"step {t}")
        np.testing.assert_array_equal(np.asarray(overflows[t]), ref.overflow, err_msg=f"step {t}")
        assert int(frees[t]) == len(ref.stack)
        # a page taken only by an active head whose pages were full; every other head keeps its count
        took = np.asarray(helds[t]) - before_held
        full = actives[t] & (before_len == before_held * ps)
        assert (took[~full] == 0).all() and ((took == 0) | (took == 1)).all()
        # a head that got a slot writes into its own page, at its entry length // ps
        got = np.asarray(pages[t]) < N
        for b, h in zip(*np.nonzero(got), strict=True):
            assert ref.pages[b][h][before_len[b, h] // ps] == page[b, h]
    assert ref.overflow.any(), "the pool was meant to run out: draw more steps"
    ref.assert_same(final)
    check_invariants(final)


def test_append_overflows_on_a_full_table_and_an_empty_pool():
    ps, M, N = 4, 3, 7
    kept = np.array([[12, 3], [0, 7]])  # 3 + 1 + 0 + 2 pages owned, 1 free; row 0 head 0's table is full
    pool = ALLOC(jnp.asarray(kept, jnp.int32), ps, N, max_pages_per_head=M)
    ref = RefPool(2, 2, N, M, ps)
    ref.allocate(kept, [True, True])
    steps = (([[True, False], [False, False]], [True, False]),  # a full table (M pages), a page still free
             ([[False, False], [False, True]], [True, False]),  # row 1 head 1 fills its 2nd page
             ([[False, False], [True, False]], [True, False]),  # row 1 head 0 takes the last free page
             ([[False, False], [False, True]], [True, True]))  # row 1 head 1 needs a 3rd: the pool is empty
    for active, overflow in steps:
        active = np.asarray(active)
        pool, page, offset = APPEND(pool, jnp.asarray(active))
        rpage, roffset = ref.append(active)
        np.testing.assert_array_equal(np.asarray(page), rpage)
        np.testing.assert_array_equal(np.asarray(offset), roffset)
        np.testing.assert_array_equal(np.asarray(pool.overflow), overflow)
        ref.assert_same(pool)
        check_invariants(pool)
    np.testing.assert_array_equal(np.asarray(pool.length), [[12, 3], [1, 8]])  # the refused tokens not counted
    np.testing.assert_array_equal(np.asarray(page), [[N, N], [N, N]])  # nowhere to write the last one
    assert int(pool.num_free) == 0


def test_free_returns_exactly_the_rows_pages(rng):
    B, H, M, ps = 4, 3, 6, 8
    kept = draw_lengths(rng, B, H, 4 * ps)
    N = int((-(-kept // ps)).sum()) + 10
    pool = ALLOC(jnp.asarray(kept, jnp.int32), ps, N, max_pages_per_head=M)
    ref = RefPool(B, H, N, M, ps)
    ref.allocate(kept, [True] * B)
    for _ in range(10):  # appends scatter the later pages over the pool
        active = rng.random((B, H)) < 0.8
        pool, _, _ = APPEND(pool, jnp.asarray(active))
        ref.append(active)
    rows = rng.random(B) < 0.5
    rows[int(rng.integers(B))] = True
    table, held = np.asarray(pool.table), np.asarray(pool.held)
    theirs = {int(p) for b in np.nonzero(rows)[0] for h in range(H) for p in table[b, h, :held[b, h]]}
    free_before = set(np.asarray(pool.free)[:int(pool.num_free)].tolist())
    freed = FREE(pool, jnp.asarray(rows))
    free_after = set(np.asarray(freed.free)[:int(freed.num_free)].tolist())
    assert free_after - free_before == theirs and free_before <= free_after
    assert int(freed.num_free) == int(pool.num_free) + len(theirs)
    kept_rows = ~rows
    for name in ("table", "held", "length"):
        np.testing.assert_array_equal(np.asarray(getattr(freed, name))[kept_rows],
                                      np.asarray(getattr(pool, name))[kept_rows])
    assert (np.asarray(freed.held)[rows] == 0).all() and (np.asarray(freed.table)[rows] == N).all()
    ref.free(rows)
    ref.assert_same(freed)
    check_invariants(freed)
    # the freed pages serve the next request (a new prompt in those rows)
    new = draw_lengths(rng, B, H, 3 * ps)
    again = ALLOC_ROWS(freed, jnp.asarray(new, jnp.int32), jnp.asarray(rows))
    ref.allocate(new, rows)
    ref.assert_same(again)
    check_invariants(again)


def test_grow_reserves_a_run_of_tokens(rng):
    """A run of tokens per (row, head) (a question read after compression): pages for the new length,
    overflow where the pool or the table runs out, in the reference's order."""
    B, H, M, ps = 3, 4, 5, 4
    kept = draw_lengths(rng, B, H, 2 * ps)
    N = int((-(-kept // ps)).sum()) + 12
    pool = ALLOC(jnp.asarray(kept, jnp.int32), ps, N, max_pages_per_head=M)
    ref = RefPool(B, H, N, M, ps)
    ref.allocate(kept, [True] * B)
    for _ in range(4):  # the pool runs out on the way
        tokens = rng.integers(0, 2 * ps + 1, size=(B, H))
        before_held = np.asarray(pool.held)
        pool = GROW(pool, jnp.asarray(tokens, jnp.int32))
        ref.grow(tokens)
        ref.assert_same(pool)
        check_invariants(pool)
        fine = ~np.asarray(pool.overflow)
        np.testing.assert_array_equal(np.asarray(pool.held)[fine], -(-np.asarray(pool.length)[fine] // ps))
        assert (np.asarray(pool.held) >= before_held).all()
    assert ref.overflow.any(), "the pool was meant to run out: draw more"
    # a row-wide count and nothing asked change nothing but what they must
    same = GROW(pool, jnp.zeros((B,), jnp.int32))
    for a, b in zip(jax.tree.leaves(same), jax.tree.leaves(pool), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_vmap_over_pool_groups(rng):
    """The engine maps the allocator over a mesh's pool groups (docs/PAGE_POOL.md): a vmapped call is
    each group's own call."""
    G, B, H, M, ps, N = 2, 2, 3, 4, 4, 20
    kept = np.stack([draw_lengths(rng, B, H, 3 * ps) for _ in range(G)])
    active = rng.random((G, B, H)) < 0.7
    alloc = functools.partial(pp.allocate_after_compression, page_size=ps, num_pages=N, max_pages_per_head=M)

    def both(k, a):
        return pp.append_slots(alloc(k), a)

    out = jax.jit(jax.vmap(both))(jnp.asarray(kept, jnp.int32), jnp.asarray(active))
    for g in range(G):
        one = both(jnp.asarray(kept[g], jnp.int32), jnp.asarray(active[g]))
        for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(out), strict=True):
            np.testing.assert_array_equal(np.asarray(b)[g], np.asarray(a))


def test_bad_input_is_refused_before_jit():
    kept = jnp.array([[3, 4]], jnp.int32)
    with pytest.raises(ValueError, match="page_size=12"):
        pp.allocate_after_compression(kept, 12, 8, max_pages_per_head=2)
    with pytest.raises(ValueError, match="num_pages=0"):
        pp.allocate_after_compression(kept, 4, 0, max_pages_per_head=2)
    with pytest.raises(ValueError, match="max_pages_per_head=0"):
        pp.allocate_after_compression(kept, 4, 8, max_pages_per_head=0)
    with pytest.raises(ValueError, match="minimum of -1"):
        pp.allocate_after_compression(jnp.array([[3, -1]]), 4, 8, max_pages_per_head=2)
    with pytest.raises(ValueError, match=r"\[B, H\]"):
        pp.allocate_after_compression(jnp.array([3, 1]), 4, 8, max_pages_per_head=2)
    pool = pp.allocate_after_compression(kept, 4, 8, max_pages_per_head=2)
    with pytest.raises(ValueError, match="active must be a bool mask"):
        pp.append_slots(pool, jnp.ones((1, 3), bool))
    with pytest.raises(ValueError, match="rows must be a bool mask"):
        pp.free_rows(pool, jnp.array([0]))
    with pytest.raises(ValueError, match="tokens must be >= 0"):
        pp.grow(pool, jnp.array([-2]))
    with pytest.raises(ValueError, match=r"kept_lengths shape \(1, 3\)"):
        pp.allocate_rows(pool, jnp.zeros((1, 3), jnp.int32), jnp.array([True]))


def test_uniform_lengths_on_a_fresh_pool_give_the_identity_layout(rng):
    """The prefill pool's fast path (docs/PAGE_POOL.md, "Prefill"): every (row, head) asking for the
    same length gets pages ``(row * H + head) * P + p``, so the pool's first pages, reshaped, are the
    uniform ``[rows, H, P * page_size, D]`` layout with no gather."""
    R, H, ps = 6, 4, 8  # R: (layer, row) pairs, layer-major
    T = int(rng.integers(1, 5 * ps))
    P = -(-T // ps)
    N = R * H * P + int(rng.integers(0, 20))  # room past the prompt stays free
    pool = ALLOC(jnp.full((R, H), T, jnp.int32), ps, N, max_pages_per_head=P + 3)
    want = np.arange(R * H * P).reshape(R, H, P)
    np.testing.assert_array_equal(np.asarray(pool.table)[..., :P], want)
    assert not np.asarray(pool.overflow).any() and int(pool.num_free) == N - R * H * P
    # slots written through the table (as the writes will) read back as the uniform layout by a reshape
    table = np.asarray(pool.table)[..., :P]
    slot = np.arange(P * ps)
    where = table[:, :, slot // ps] * ps + slot % ps  # [R, H, P * ps] pool slot of each (row, head, slot)
    keys = np.full((N * ps,), -1)
    keys[where] = (np.arange(R)[:, None, None] * H + np.arange(H)[None, :, None]) * P * ps + slot
    np.testing.assert_array_equal(keys[:R * H * P * ps].reshape(R, H, P * ps), np.arange(R * H * P * ps).reshape(
        R, H, P * ps))
