"""A small grammar for naming policies on the command line.

    SPEC   := ITEM ("," ITEM)*
    ITEM   := NAME | NAME "(" [ARG ("," ARG)*] ")"
    ARG    := VALUE | KEY "=" VALUE          (positional arguments first, as in Python)
    VALUE  := number | 'string' | True | False | None | ITEM | "(" VALUE ("," VALUE)* ")"

A keyword given twice in one call is an error (as in Python), not the last value silently.
Names are case-insensitive (``fullkv``, ``streamingllm``, ``snapkv``, ``h2o``, ``quest``,
``pipeline`` and those later policies register). Example:
``"fullkv, snapkv(budget=0.1), quest(2048), pipeline(compress=snapkv(0.25), decode=quest(0.25))"``.
Python's own parser reads the text; only the forms above are accepted.
"""

from __future__ import annotations

import ast
from collections.abc import Callable

from sparsekv_jax.policies.base import Policy

REGISTRY: dict[str, Callable[..., Policy]] = {}


def register(name: str, factory: Callable[..., Policy]) -> None:
    """Make ``name`` usable in specs (lower-case)."""
    REGISTRY[name.lower()] = factory


def _value(node: ast.AST, text: str):
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str, bool, type(None))):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
        return -node.operand.value
    if isinstance(node, ast.Tuple):  # e.g. CHESS's custom ratios: chess((0.9, 0.8, 0.7))
        return tuple(_value(e, text) for e in node.elts)
    if isinstance(node, (ast.Name, ast.Call)):
        return _policy(node, text)
    raise ValueError(f"policy spec {text!r}: unsupported value {ast.unparse(node)!r}")


def _policy(node: ast.AST, text: str) -> Policy:
    if isinstance(node, ast.Name):
        name, args, kwargs = node.id, [], {}
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        name = node.func.id
        args = [_value(a, text) for a in node.args]
        kwargs = {}
        for kw in node.keywords:
            if kw.arg is None:  # f(**x): Python's own parser accepts it, the grammar does not
                raise ValueError(f"policy spec {text!r}: unsupported argument {ast.unparse(kw)!r} in {name}(...)")
            if kw.arg in kwargs:  # ast.parse accepts f(a=1, a=2); Python refuses it only when compiling
                raise ValueError(f"policy spec {text!r}: keyword {kw.arg!r} repeated in {name}(...)")
            kwargs[kw.arg] = _value(kw.value, text)
    else:
        raise ValueError(f"policy spec {text!r}: expected NAME or NAME(...), got {ast.unparse(node)!r}")
    factory = REGISTRY.get(name.lower())
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(sorted(REGISTRY))}")
    try:
        return factory(*args, **kwargs)
    except TypeError as e:
        raise ValueError(f"policy {name}: {e}") from None


def parse_policies(spec: str) -> list[Policy]:
    """Policies named in a comma-separated ``spec`` (see the module docstring)."""
    if not spec or not spec.strip():
        raise ValueError("empty policy spec")
    try:
        tree = ast.parse(f"({spec},)", mode="eval")
    except SyntaxError as e:
        raise ValueError(f"policy spec {spec!r} is not well formed: {e.msg}") from None
    return [_policy(node, spec) for node in tree.body.elts]


def split_spec(spec: str) -> list[str]:
    """The items of a comma-separated ``spec`` as text, one policy each (``"a, p(b=q(1), c=2)"`` → two), checked
    as `parse_policies` checks them: to hand each to another process (e.g. ``bench e2e``'s one process per policy)."""
    parse_policies(spec)  # the same errors, naming the spec
    return [ast.unparse(node) for node in ast.parse(f"({spec},)", mode="eval").body.elts]


def parse_policy(spec: str) -> Policy:
    """Exactly one policy from ``spec``."""
    policies = parse_policies(spec)
    if len(policies) != 1:
        raise ValueError(f"policy spec {spec!r} names {len(policies)} policies, expected one")
    return policies[0]
