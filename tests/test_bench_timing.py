"""`sparsekv_jax.bench.timing`: the one timing helper of the benchmarks, the demo and experiments/."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from sparsekv_jax.bench.timing import median_time, median_time_carry, timed_call


def test_timed_call_returns_the_output_and_its_seconds():
    out, seconds = timed_call(lambda x: x * 2, jnp.arange(3))
    assert out.tolist() == [0, 2, 4] and seconds >= 0.0


def test_median_time_warms_up_once_then_times_iters_calls():
    calls = []
    seconds = median_time(lambda x: calls.append(x) or x, jnp.ones(2), iters=3)
    assert len(calls) == 4 and seconds >= 0.0


def test_median_time_carry_feeds_each_call_the_last_output():
    seconds, carry = median_time_carry(lambda p, a, b: (a + p, b + 1), 10, (0, 0), iters=4)
    assert carry == (50, 5) and seconds >= 0.0  # one warm-up call, then 4 timed ones


@pytest.mark.parametrize("fn", [lambda: median_time(lambda: 0, iters=0),
                                lambda: median_time_carry(lambda p: (), 0, (), iters=0)])
def test_iters_below_one_is_refused(fn):
    with pytest.raises(ValueError, match="iters must be at least 1, got 0"):
        fn()
