"""Random inputs for kernel tests and benchmarks (page lists, block lists, shuffled page pools, error metric).

Lives beside the kernels so the CPU tests, the GPU ``--check`` mode of the benchmark and
any later caller draw inputs the same way.
"""

from __future__ import annotations

import numpy as np

from sparsekv_jax.pallas._common import cdiv


def rel_err(out: np.ndarray, ref: np.ndarray) -> float:
    """``||out - ref|| / ||ref||`` in float64; NaN anywhere gives inf (never passes)."""
    o = np.asarray(out, np.float64)
    r = np.asarray(ref, np.float64)
    if not np.isfinite(o).all():
        return float("inf")
    den = np.linalg.norm(r)
    return float(np.linalg.norm(o - r) / (den if den > 0 else 1.0))


def random_page_lists(rng: np.random.Generator, lengths: np.ndarray, kv_heads: int, num_pages: int,
                      page_size: int, list_len: int, *, fill: float | None = None,
                      allow_empty: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Unsorted, duplicate-free page lists ``[B, Hkv, list_len]`` with counts ``[B, Hkv]``.

    Pages are drawn from those below each row's length (plus, occasionally, pages past it,
    which the kernel must mask). ``fill`` fixes the fraction of ``list_len`` used;
    otherwise counts are random in ``[0 or 1, list_len]``.
    """
    B = len(lengths)
    ids = np.zeros((B, kv_heads, list_len), np.int32)
    counts = np.zeros((B, kv_heads), np.int32)
    for b in range(B):
        used = max(1, cdiv(int(lengths[b]), page_size))
        pool_size = min(num_pages, used + (1 if rng.random() < 0.3 else 0))
        for h in range(kv_heads):
            cap = min(list_len, pool_size)
            if fill is not None:
                c = min(cap, max(0 if allow_empty else 1, round(fill * list_len)))
            else:
                c = int(rng.integers(0 if allow_empty else 1, cap + 1))
            ids[b, h, :c] = rng.permutation(pool_size)[:c]
            ids[b, h, c:] = rng.integers(0, num_pages, list_len - c)  # junk past the count
            counts[b, h] = c
    return ids, counts


def random_block_lists(rng: np.random.Generator, batch: int, kv_heads: int, T: int, block_size: int,
                       q_offset: int, list_len: int, *, density: float | None = None,
                       diag: str = "random", allow_empty: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Causal, unsorted, duplicate-free KV block lists ``[B, Hkv, nQ, list_len]`` + counts.

    ``diag``: "always" lists the diagonal block, "never" leaves it out, "random" either.
    ``density`` (fraction of the query block's causal blocks) fixes the counts, the
    diagonal counted in; otherwise counts are random.
    """
    nQ = cdiv(T, block_size)
    qb0 = q_offset // block_size
    ids = np.zeros((batch, kv_heads, nQ, list_len), np.int32)
    counts = np.zeros((batch, kv_heads, nQ), np.int32)
    for b in range(batch):
        for h in range(kv_heads):
            for i in range(nQ):
                qb = qb0 + i
                with_diag = diag == "always" or (diag == "random" and rng.random() < 0.7)
                past = rng.permutation(qb)  # strictly causal blocks
                if density is not None:
                    want = max(1, round(density * (qb + 1)))
                    n_past = min(len(past), list_len - int(with_diag), want - int(with_diag))
                else:
                    lo = 0 if allow_empty or with_diag else 1
                    n_past = int(rng.integers(lo, min(len(past), list_len - int(with_diag)) + 1))
                sel = list(past[:max(n_past, 0)])
                if with_diag:
                    sel.append(qb)
                sel = rng.permutation(np.asarray(sel, np.int64)) if sel else np.zeros(0, np.int64)
                c = len(sel)
                ids[b, h, i, :c] = sel
                ids[b, h, i, c:] = rng.integers(0, qb + 1, list_len - c)  # junk past the count
                counts[b, h, i] = c
    return ids, counts


def random_head_lengths(rng: np.random.Generator, batch: int, heads: int, max_pages: int,
                        page_size: int) -> np.ndarray:
    """``[batch, heads]`` int32 token counts in ``[0, max_pages·page_size]``, one per (row, head) of a
    page pool: random, with the corner cases set (``page_size >= 2``; with one row or head some coincide):
    ``[0, 0]`` ends on a partial page, ``[0, -1]`` is full, ``[-1, 0]`` holds part of one page and
    ``[-1, -1]`` is empty."""
    S = max_pages * page_size
    lengths = rng.integers(1, S + 1, (batch, heads))
    lengths[0, 0] = S - int(rng.integers(1, page_size))
    lengths[0, -1] = S
    lengths[-1, 0] = int(rng.integers(1, page_size))
    lengths[-1, -1] = 0
    return lengths.astype(np.int32)


def shuffled_page_table(rng: np.random.Generator, lengths: np.ndarray, max_pages: int, page_size: int, *,
                        spare: int = 3) -> tuple[np.ndarray, np.ndarray, int]:
    """A page pool's tables laid out at random: ``(table [..., max_pages] int32, held [...], N)``.

    Each head (an entry of ``lengths``) holds its ``ceil(length / page_size)`` pages, now and then one
    more (a page past its length, as after a rewind), capped at ``max_pages``; the held pages of all
    heads are a random permutation of the pool's ``N`` pages but ``spare`` that nobody holds. The table
    maps a head's logical page ``m < held`` to its pool page; the rest is the sentinel ``N``.
    """
    held = np.minimum(max_pages, -(-lengths // page_size) + (rng.random(lengths.shape) < 0.4))
    N = int(held.sum()) + spare
    perm = iter(rng.permutation(N))
    table = np.full((*lengths.shape, max_pages), N, np.int32)
    for idx, n in np.ndenumerate(held):
        table[idx][:n] = [next(perm) for _ in range(n)]
    return table, held, N


def place_pages(x: np.ndarray, table: np.ndarray, held: np.ndarray, junk: np.ndarray) -> np.ndarray:
    """Per-page values ``x [..., M, *rest]`` (``table``'s ``[..., M]`` leading) put in a pool ``[N, *rest]``
    at their table's pool pages, for the ``held`` pages of each head; ``junk`` (copied, ``[N, *rest]``)
    everywhere else: the spare pages and any page the table does not give."""
    pool = junk.copy()
    own = np.arange(table.shape[-1]) < held[..., None]
    pool[table[own]] = x[own]
    return pool


def poisoned_pool(x: np.ndarray, lengths: np.ndarray, table: np.ndarray, held: np.ndarray,
                  num_pages: int) -> np.ndarray:
    """Per-token values ``x [B, H, M·ps, *rest]`` as a float64 pool ``[N, ps, *rest]`` that is NaN wherever a
    reader must not look: each head's tokens at or past its length (the rest of a partial page, a held
    page past the length), and the pages nobody holds. ``ps`` is ``x.shape[2] // M``."""
    B, H, S = x.shape[:3]
    M = table.shape[-1]
    ps = S // M
    inside = (np.arange(S) < lengths[..., None]).reshape(B, H, S, *(1,) * (x.ndim - 3))
    per_page = np.where(inside, x, np.nan).reshape(B, H, M, ps, *x.shape[3:])
    return place_pages(per_page, table, held, np.full((num_pages, ps, *x.shape[3:]), np.nan))


def junk_like(rng: np.random.Generator):
    """A function ``a -> junk`` shaped and typed as ``a``: random codes for integer arrays (int8 codes, int32
    positions), NaN for float ones -- what a page nobody owns may hold, so a reader that uses it shows."""
    def junk(a: np.ndarray) -> np.ndarray:
        if np.issubdtype(a.dtype, np.integer):
            return rng.integers(-127, 128, a.shape).astype(a.dtype)
        return np.full(a.shape, np.nan, a.dtype)
    return junk


def loop_literal_yields(fn, *args, **kwargs) -> list[str]:
    """The loops inside the Pallas kernels of ``fn(*args, **kwargs)`` (traced, not run) whose body returns a literal
    (e.g. ``lax.fori_loop(..., body, 0)`` with ``return 0``): jax 0.11's Triton lowering yields such a literal as a
    non-Value and fails (``scf.yield``: "Operand 0 ... must be a Value"), while jax 0.10 and interpret mode accept
    it, so only this structural check catches it on a CPU. Returns one description per offending loop."""
    import jax
    from jax.extend import core as jcore

    found: list[str] = []

    def subjaxprs(eqn):
        for value in eqn.params.values():
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, jcore.ClosedJaxpr):
                    yield v.jaxpr
                elif isinstance(v, jcore.Jaxpr):
                    yield v

    def walk(jaxpr, in_kernel: bool):
        for eqn in jaxpr.eqns:
            kernel = in_kernel or eqn.primitive.name == "pallas_call"
            if kernel and eqn.primitive.name in ("while", "scan"):
                body = eqn.params["body_jaxpr" if eqn.primitive.name == "while" else "jaxpr"].jaxpr
                lits = [i for i, v in enumerate(body.outvars) if isinstance(v, jcore.Literal)]
                if lits:
                    found.append(f"{eqn.primitive.name} loop yields literal output(s) {lits}: {body.outvars}")
            for sub in subjaxprs(eqn):
                walk(sub, kernel)

    walk(jax.make_jaxpr(lambda *a: fn(*a, **kwargs))(*args).jaxpr, False)
    return found
