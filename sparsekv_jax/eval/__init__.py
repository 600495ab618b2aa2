"""Evaluation harness: RULER / LongBench tasks and metrics, fidelity to full attention, the
resumable runner behind ``sparsekv eval`` and its reports.

Submodules are imported on use (``from sparsekv_jax.eval import runner``) so that the metrics
and loaders stay importable without JAX; :func:`run_eval` and its `EvalOptions` are re-exported lazily.
"""

from __future__ import annotations

from typing import Any

__all__ = ["EvalOptions", "batching", "calibrate", "data", "fidelity", "longbench", "metrics", "report", "ruler",
           "run_eval", "runner", "specs", "suites", "tasks"]


def __getattr__(name: str) -> Any:
    import importlib

    if name in ("run_eval", "EvalOptions"):
        return getattr(importlib.import_module("sparsekv_jax.eval.runner"), name)
    if name in __all__:
        return importlib.import_module(f"sparsekv_jax.eval.{name}")
    raise AttributeError(f"module 'sparsekv_jax.eval' has no attribute {name!r}")
