"""conftest's seeded draws: a fresh seed per run, printed with a failure, and ``--seed N`` replays
the same draws (an inner pytest run in a subprocess, on conftest.py copied beside a probe file)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

pytest_plugins = ["pytester"]

PROBE = '''
from conftest import seeded_rng


def test_draws(rng):
    print("DRAWS", int(seeded_rng().integers(1 << 30)), int(seeded_rng().integers(1 << 30)), int(rng.integers(1 << 30)))
    assert False
'''


def _run(pytester, *args: str) -> tuple[int, tuple[str, ...], str]:
    res = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-s", *args)
    out = res.stdout.str()
    assert res.ret == 1, out  # the probe fails on purpose
    draws = tuple(re.search(r"DRAWS (\d+) (\d+) (\d+)", out).groups())
    seed = int(re.search(r"random seed: (\d+)", out).group(1))
    return seed, draws, out


def test_the_seed_is_printed_on_failure_and_replays_the_draws(pytester):
    shutil.copy(Path(__file__).with_name("conftest.py"), pytester.path / "conftest.py")
    pytester.makepyfile(test_probe=PROBE)
    seed, draws, out = _run(pytester)
    assert f"replay: pytest test_probe.py::test_draws --seed {seed}" in out  # the failure's own section
    again, replayed, _ = _run(pytester, "--seed", str(seed))
    assert again == seed and replayed == draws
    other, fresh, _ = _run(pytester)
    assert other != seed and fresh != draws  # a fresh seed each run (2^-31 to collide)
    assert len(set(draws)) == 3  # two calls on one line differ; the fixture's generator is its own
