"""`@pytest.mark.share(k)` (tests/conftest.py): a run keeps a seeded ceil(n / k) of a test's cases, the same
ones for the same ``--seed``, every case across seeds; ``--every-case`` and a case picked by ``-k`` always run."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

CASES = 7
TEST_FILE = f"""
import pytest

@pytest.mark.share(3)
@pytest.mark.parametrize("case", range({CASES}))
def test_case(case):
    print(f"RAN {{case}}")

@pytest.mark.parametrize("other", range(2))
def test_unmarked(other):
    pass
"""


@pytest.fixture
def project(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(test_shared=TEST_FILE)
    return pytester


def _ran(result: pytest.RunResult) -> set[int]:
    return {int(m) for m in re.findall(r"RAN (\d+)", result.stdout.str())}


def _run(project: pytest.Pytester, *args: str) -> pytest.RunResult:
    return project.runpytest_subprocess("-s", "-p", "no:cacheprovider", *args)


def test_a_run_keeps_a_seeded_share_a_seed_replays_it_and_a_named_case_always_runs(project, rng):
    seeds = [int(s) for s in rng.choice(1 << 30, size=3, replace=False)]
    kept = []
    for seed in seeds:
        result = _run(project, "--seed", str(seed))
        result.assert_outcomes(passed=3 + 2, deselected=CASES - 3)  # ceil(7 / 3) of 7, the unmarked test whole
        kept.append(_ran(result))
        assert len(kept[-1]) == 3, (seed, kept[-1])
    assert _ran(_run(project, "--seed", str(seeds[0]))) == kept[0], seeds[0]
    assert len({frozenset(k) for k in kept}) > 1, (seeds, kept)  # 35 draws of 3 from 7: three alike is ~1e-3
    dropped = int(rng.choice(sorted(set(range(CASES)) - kept[0])))
    picked = _run(project, "--seed", str(seeds[0]), "-k", f"test_case and {dropped}]")  # -k names a dropped case
    assert _ran(picked) == {dropped}, (seeds[0], dropped, picked.stdout.str()[-400:])


def test_every_case_runs_them_all(project, rng):
    result = _run(project, "--seed", str(int(rng.integers(1 << 30))), "--every-case")
    result.assert_outcomes(passed=CASES + 2)
    assert _ran(result) == set(range(CASES))


def test_a_bad_share_is_a_usage_error(pytester: pytest.Pytester):
    pytester.makeconftest(Path(__file__).with_name("conftest.py").read_text())
    pytester.makepyfile(test_bad=TEST_FILE.replace("share(3)", "share(0)"))
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()[-400:]
    result.stderr.fnmatch_lines(["*share(k) takes an integer k >= 1, got 0*"])
