"""What ``sparsekv eval`` is asked to run: prompt lengths and policies, with what results call them.

A policy is known to the harness only through the protocol (`sparsekv_jax.policies.base.Policy`):
its declared ``stages``, ``stage(name)`` and ``spec_key()``. Nothing here names a policy class.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from sparsekv_jax.policies import Policy, parse_policies

__all__ = [
    "PolicySpec",
    "format_length",
    "is_dense",
    "parse_length",
    "parse_lengths",
    "policy_budget",
    "policy_family",
    "policy_specs",
]

# where a composed policy's budget is read first (the stage that decides what is kept)
BUDGET_STAGES = ("compress", "decode", "prefill", "context")
# fields a family leaves out: the budget (the plot's x axis) and sizes fixed per run
FAMILY_SKIPS = ("budget", "prompt_len", "page_size")


def parse_length(text: str | int) -> int:
    """``"4k"`` → 4096, ``"1.5k"`` → 1536, ``"2000"`` → 2000 (``k`` = 1024)."""
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kK]?)\s*", text)
        if not m:
            raise ValueError(f"length {text!r} is not a token count like 2048, 2k or 1.5k")
        value = float(m.group(1)) * (1024 if m.group(2) else 1)
        if value != int(value):
            raise ValueError(f"length {text!r} is not a whole number of tokens")
        value = int(value)
    if value < 1:
        raise ValueError(f"length {text!r} must be at least 1 token")
    return value


def parse_lengths(text: str | Sequence[str | int] | None) -> list[int] | None:
    """Comma-separated lengths (``"2k,4k,8k"``) or a list of them; ``None`` stays ``None``."""
    if text is None:
        return None
    items = [t for t in text.split(",") if t.strip()] if isinstance(text, str) else list(text)
    if not items:
        raise ValueError("no lengths given")
    return [parse_length(t) for t in items]


def format_length(length: int | None) -> str:
    """``4096`` → ``"4k"``, ``1000`` → ``"1000"``, ``None`` → ``""``."""
    if length is None:
        return ""
    return f"{length // 1024}k" if length % 1024 == 0 else str(length)


@dataclasses.dataclass(frozen=True)
class PolicySpec:
    """A policy with what the results and plots call it.

    Attributes:
      label: the spec text (``"snapkv(budget=0.1)"``), as the table shows it.
      policy: the `Policy`.
      key: ``policy.spec_key()`` (every field, defaults included; arrays by shape, dtype and a
        hash of their bytes): what the resume key uses.
      family: the policy with its budget left out (``"snapkv"``, ``"snapkv(window=16)"``); one
        line per family in the score-vs-budget plot.
      budget: the budget (fraction of the context if a float, token count if an int); ``1.0``
        for full attention, ``None`` when the policy has none.
    """

    label: str
    policy: Policy
    key: str
    family: str
    budget: float | int | None


def is_dense(policy: Policy) -> bool:
    """Full attention: the policy runs no stage of its own (`Dense`, or a `Pipeline` of `Dense`)."""
    return not policy.stages


def _is_composite(policy: Policy) -> bool:
    """A policy that hands its stages to others (a `Pipeline`)."""
    return any(policy.stage(s) is not policy for s in policy.stages)


def policy_budget(policy: Policy) -> float | int | None:
    """The budget a policy is run at: the ``budget`` of the policy running its compress stage,
    else its decode, prefill, context stage (``1.0`` for full attention, ``None`` if none has one)."""
    if is_dense(policy):
        return 1.0
    for name in BUDGET_STAGES:
        if name in policy.stages:
            b = getattr(policy.stage(name), "budget", None)
            if isinstance(b, (int, float)) and not isinstance(b, bool):
                return b
    return None


def policy_family(policy: Policy) -> str:
    """Name of the policy without its budget, with the fields that differ from their defaults
    (a composed policy: ``pipeline(compress=snapkv, decode=quest)``)."""
    if is_dense(policy):
        return "fullkv"
    name = type(policy).__name__.lower()
    if _is_composite(policy):
        return f"{name}(" + ", ".join(f"{s}={policy_family(policy.stage(s))}" for s in policy.stages) + ")"
    extras = []
    for f in dataclasses.fields(policy):
        if f.name in FAMILY_SKIPS or not f.init:
            continue
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            continue
        value = getattr(policy, f.name)
        if f.default is not dataclasses.MISSING and _same(value, f.default):
            continue
        extras.append(f"{f.name}={_short(value)}")
    return f"{name}({', '.join(extras)})" if extras else name


def _short(value: Any) -> str:
    """``repr`` of a field, but an array by its shape (a leaf may be megabytes of weights)."""
    if isinstance(value, Policy):
        return policy_family(value)
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        a = np.asarray(value)
        return repr(float(a.reshape(()))) if a.size == 1 else f"array{list(a.shape)}"
    return repr(value)


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # arrays and the like
        return False


def policy_specs(policies: str | Sequence[str | Policy]) -> list[PolicySpec]:
    """Policies from a spec string (``"fullkv, snapkv(budget=0.1)"``, grammar in
    `sparsekv_jax.policies.spec`) or a list of spec strings / `Policy` objects; duplicates (same
    ``spec_key``) once.

    Raises ``ValueError`` with the parser's message on a bad spec.
    """
    items: list[str | Policy] = [policies] if isinstance(policies, str) else list(policies)
    specs: list[PolicySpec] = []
    for item in items:
        if isinstance(item, Policy):
            pairs = [(item.name, item)]
        else:
            parsed = parse_policies(item)
            nodes = ast.parse(f"({item},)", mode="eval").body.elts  # type: ignore[attr-defined]
            pairs = list(zip((ast.unparse(n) for n in nodes), parsed, strict=True))
        for label, pol in pairs:
            specs.append(PolicySpec(label=label, policy=pol, key=pol.spec_key(), family=policy_family(pol),
                                    budget=policy_budget(pol)))
    seen: set[str] = set()
    unique = []
    for s in specs:
        if s.key not in seen:
            seen.add(s.key)
            unique.append(s)
    if not unique:
        raise ValueError("no policies given")
    return unique
