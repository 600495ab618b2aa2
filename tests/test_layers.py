"""The package's import graph against docs/DESIGN.md's layer table, and facts checked by ``ast``.

The table is read from the document (its ``layers`` block), so the document and the test cannot
drift apart. Every import of every module of ``sparsekv_jax/`` counts, at module level or inside a
function; an import of a module from a higher layer fails the test with the file and line.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparsekv_jax"
DESIGN = ROOT / "docs" / "DESIGN.md"

# (importer, imported): imports that run up the layers today, each to be removed by its owner. The
# test fails if one of them is gone (take it off the list) as well as on any other upward import.
KNOWN_UPWARD: set[tuple[str, str]] = set()
# modules that still call jax.default_backend() to print or record the device (they should ask
# `sparsekv_jax.backend.resolved().platform`); the same rule: the list only shrinks
KNOWN_DEFAULT_BACKEND: set[str] = set()


def layer_table(text: str) -> list[tuple[int, str, list[str]]]:
    """``(number, name, patterns)`` of each line of the first fenced ``layers`` block of ``text``."""
    m = re.search(r"^```layers\n(.*?)^```", text, re.M | re.S)
    if m is None:
        raise ValueError("docs/DESIGN.md has no ```layers block")
    rows = []
    for line in m.group(1).splitlines():
        if line.strip():
            number, name, *patterns = line.split()
            rows.append((int(number), name, patterns))
    return rows


def layer_of(module: str, table: list[tuple[int, str, list[str]]]) -> int | None:
    """The layer of ``module``: that of the most specific pattern matching it (``a.*`` matches ``a``
    and everything under it; a bare name matches itself), or ``None``."""
    best = None
    for number, _, patterns in table:
        for p in patterns:
            base = p[:-2] if p.endswith(".*") else p
            hit = module == base or (p.endswith(".*") and module.startswith(base + "."))
            if hit and (best is None or len(base) > best[0]):
                best = (len(base), number)
    return None if best is None else best[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    rel = Path(*name.split("."))
    return (ROOT / rel).with_suffix(".py").exists() or (ROOT / rel / "__init__.py").exists()


def imports_of(path: Path) -> list[tuple[str, int]]:
    """``(module, line)`` of every ``sparsekv_jax`` module the file ``path`` imports (`imports_in`)."""
    return imports_in(path.read_text(), module_name(path), path.name == "__init__.py")


def imports_in(text: str, me: str, is_package: bool = False) -> list[tuple[str, int]]:
    """``(module, line)`` of every ``sparsekv_jax`` module that module ``me``'s source ``text`` imports:
    ``from a import b`` counts as ``a.b`` where ``b`` is a module, else as ``a``; relative imports
    are resolved against ``me`` (a package's ``__init__`` when ``is_package``)."""
    package = me if is_package else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                out.append((full if _is_module(full) else base, node.lineno))
    return [(m, line) for m, line in out if m == "sparsekv_jax" or m.startswith("sparsekv_jax.")]


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_layer_table_reads_and_matches_by_the_most_specific_pattern():
    table = layer_table("```layers\n1 low a.*\n2 mid a.b\n3 top c  d.*\n```\n")
    assert [(n, name) for n, name, _ in table] == [(1, "low"), (2, "mid"), (3, "top")]
    assert layer_of("a", table) == 1 and layer_of("a.x.y", table) == 1 and layer_of("a.b", table) == 2
    assert layer_of("a.bc", table) == 1 and layer_of("c", table) == 3 and layer_of("c.x", table) is None
    assert layer_of("d.e", table) == 3 and layer_of("e", table) is None


def test_every_module_has_a_layer():
    table = layer_table(DESIGN.read_text())
    numbers = [n for n, _, _ in table]
    assert numbers == sorted(set(numbers)), f"layer numbers must increase: {numbers}"
    missing = [module_name(p) for p in _modules() if layer_of(module_name(p), table) is None]
    assert not missing, f"modules in no layer of docs/DESIGN.md: {missing}"


def test_no_import_runs_up_the_layers():
    table = layer_table(DESIGN.read_text())
    upward, seen = [], set()
    for path in _modules():
        me = module_name(path)
        mine = layer_of(me, table)
        for target, line in imports_of(path):
            theirs = layer_of(target, table)
            assert theirs is not None, f"{path.relative_to(ROOT)}:{line} imports {target}, which is in no layer"
            if theirs > mine:
                seen.add((me, target))
                if (me, target) not in KNOWN_UPWARD:
                    upward.append(f"{path.relative_to(ROOT)}:{line}: {me} (layer {mine}) imports {target} "
                                  f"(layer {theirs})")
    assert not upward, "imports that run up docs/DESIGN.md's layers:\n" + "\n".join(upward)
    assert KNOWN_UPWARD <= seen, f"fixed, take off KNOWN_UPWARD: {KNOWN_UPWARD - seen}"


def test_the_checker_catches_an_upward_import():
    """The same reading on a source written for the purpose: a kernel module importing a policy (in a
    function), the engine and, relatively, a sibling kernel."""
    text = ("from . import decode\n"
            "def f():\n    from sparsekv_jax.policies import chess\n    import sparsekv_jax.generate\n")
    table = layer_table(DESIGN.read_text())
    found = imports_in(text, "sparsekv_jax.pallas.probe")
    assert found == [("sparsekv_jax.pallas.decode", 1), ("sparsekv_jax.policies.chess", 3),
                     ("sparsekv_jax.generate", 4)]
    assert [layer_of(m, table) for m, _ in found] == [1, 9, 10]
    assert layer_of("sparsekv_jax.pallas.probe", table) == 1


def _default_backend_calls(path: Path) -> list[int]:
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "default_backend"]


def test_only_the_backend_module_asks_the_platform():
    found = {module_name(p): lines for p in _modules() if (lines := _default_backend_calls(p))}
    assert set(found) - {"sparsekv_jax.backend"} - KNOWN_DEFAULT_BACKEND == set(), found
    assert KNOWN_DEFAULT_BACKEND <= set(found), f"fixed, take off the list: {KNOWN_DEFAULT_BACKEND - set(found)}"
    assert not any("on_gpu" in p.read_text() for p in _modules()), "on_gpu() is gone: ask a Backend"


def test_no_policy_holds_a_mesh_or_copies_of_the_backend():
    """A policy that runs a kernel-level choice holds the run's `Backend` (``backend``, set by ``bind``),
    never copies of its fields."""
    import sparsekv_jax.policies as P
    from sparsekv_jax.policies.spec import REGISTRY

    classes = {f.__self__ if hasattr(f, "__self__") else f for f in REGISTRY.values()}
    assert P.CHESS in classes and P.H2O in classes and len(classes) >= 12
    for cls in classes:
        names = {f.name for f in dataclasses.fields(cls)}
        assert not names & {"mesh", "page_sums", "interpret"}, (cls.__name__, names)


def test_no_mesh_branch_imports_sharding():
    """The per-device wrappers are `pallas.dispatch`'s: no caller imports `sharding` to run a kernel
    (every policy module, CHESS's page-score module included, the attention and the transformer)."""
    paths = sorted((PACKAGE / "policies").glob("*.py")) + [PACKAGE / "attention.py",
                                                           PACKAGE / "models" / "transformer.py"]
    assert PACKAGE / "policies" / "chess_scores.py" in paths
    found = [p.relative_to(ROOT) for p in paths if "sparsekv_jax.sharding" in {m for m, _ in imports_of(p)}]
    assert found == [], found



def private_imports(source: str, module: str) -> list[tuple[int, str, str]]:
    """``(line, module, name)`` of every ``from sparsekv_jax.X import _name`` in ``source`` (the text of
    ``module``) where X is in another package than ``module``'s own: a package's private names are
    its own business."""
    own = module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("sparsekv_jax"):
            if node.module.rsplit(".", 1)[0] == own or node.module == own:
                continue
            found += [(node.lineno, node.module, a.name) for a in node.names
                      if a.name.startswith("_") and not a.name.startswith("__")]
    return found


def test_no_module_imports_another_packages_private_names():
    """Issue #41: no ``from sparsekv_jax… import _private`` outside its own package."""
    found = {module_name(p): hits for p in _modules() if (hits := private_imports(p.read_text(), module_name(p)))}
    assert found == {}, found
    # the checker sees one, and lets a package's own private imports pass
    probe = "from sparsekv_jax.models.transformer import _norm\nfrom sparsekv_jax.retrieval.scan import _x, y\n"
    assert private_imports(probe, "sparsekv_jax.retrieval.probe") == [(1, "sparsekv_jax.models.transformer", "_norm")]
