"""Context retrieval for the ``context`` stage: S³'s streaming SAE index, BM25, dense RAG.

    from sparsekv_jax.retrieval import scan_context, ScanConfig
    res = scan_context(params, saes, layers, tokens, ctx_lengths, q_starts, q_lengths)   # index + question

Submodules: `features` (per-token SAE features), `index` (the segmented CSR inverted index), `scan`
(the streaming scan), `scoring` (IDF-weighted co-activation, smoothing, non-maximum suppression on
the device), `spans` (sentence-aligned spans, budgets, the gathered prompt), `text` (what is needed
of a tokenizer), `bm25` (bm25s), `dense` (the optional all-MiniLM-L6-v2 RAG baseline).
Attributes are imported lazily so that importing the package does not import JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "token_features": "features", "FEATURE_METHODS": "features",
    "SegmentedIndex": "index", "chunk_postings": "index",
    "ScanConfig": "scan", "ScanResult": "scan", "scan_context": "scan", "scan_step": "scan",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"sparsekv_jax.retrieval.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'sparsekv_jax.retrieval' has no attribute {name!r}")
