"""The one timing helper of the benchmarks, the demo and `experiments/`: wall time of a JAX call,
measured to the end of its device work (`jax.block_until_ready`).

- `timed_call`: one call, its output and seconds (a first call includes compilation);
- `median_time`: the median of ``iters`` calls after one warm-up call;
- `median_time_carry`: the same for a step whose carry is donated, each call consuming the last
  one's output.

JAX is imported on first use, so importing this module (as `bench.e2e`'s parent process does) loads
no JAX.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def timed_call(fn: Callable[..., Any], *args: Any) -> tuple[Any, float]:
    """``(fn(*args), seconds)``, the seconds measured until the output is ready on the device."""
    import jax

    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return out, time.perf_counter() - t0


def median_time(fn: Callable[..., Any], *args: Any, iters: int) -> float:
    """Median seconds of ``fn(*args)`` over ``iters`` calls (at least one), after one warm-up call."""
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    timed_call(fn, *args)  # warm-up (and compilation)
    return statistics.median(timed_call(fn, *args)[1] for _ in range(iters))


def median_time_carry(fn: Callable[..., Any], params: Any, carry: tuple, *, iters: int) -> tuple[float, tuple]:
    """Like `median_time` for ``fn(params, *carry) -> carry`` whose carry is donated: each call
    consumes the last one's output. Returns ``(median seconds, the last carry)``."""
    if iters < 1:
        raise ValueError(f"iters must be at least 1, got {iters}")
    carry, _ = timed_call(fn, params, *carry)  # warm-up
    times = []
    for _ in range(iters):
        carry, seconds = timed_call(fn, params, *carry)
        times.append(seconds)
    return statistics.median(times), carry
