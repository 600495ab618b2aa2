"""The README's "write your own policy" example runs as written and its test passes."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def _blocks(section: str) -> list[str]:
    text = README.read_text()
    body = text[text.index(f"## {section}"):]
    body = body[: body.index("\n## ", 3)]
    return re.findall(r"```python\n(.*?)```", body, flags=re.S)


def test_write_your_own_policy_example_runs_and_its_test_passes():
    policy, test = _blocks("Write your own policy")
    assert len(policy.strip().splitlines()) < 40
    scope: dict = {}
    exec(compile(policy, "README:policy", "exec"), scope)
    exec(compile(test, "README:test", "exec"), scope)
    scope["test_keynorm_keeps_the_smallest_keys"]()
    from sparsekv_jax.policies import parse_policy

    assert type(parse_policy("keynorm(0.1)")).__name__ == "KeyNorm"
