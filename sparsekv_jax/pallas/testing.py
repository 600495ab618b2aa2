"""Random inputs for kernel tests and benchmarks (page lists, block lists, error metric).

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
