"""Issue #41: no public entry point takes more than 8 parameters; the rest are the fields of a frozen
options dataclass (`Options`, `EvalOptions`, `CalibrateOptions`) given as keywords or ``options=``,
and an unknown keyword is refused, named, before anything loads. No model is loaded here."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

from sparsekv_jax.eval.calibrate import CalibrateOptions, calibrate, calibrate_options
from sparsekv_jax.eval.runner import EvalOptions, eval_options, run_eval

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparsekv_jax"
MAX_PARAMETERS = 8
# a model path that does not exist: reaching the loader would raise FileNotFoundError, not TypeError
NO_MODEL = "/nonexistent/sparsekv-model-dir"


def parameter_count(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Every named parameter of ``node``: positional, keyword-only, ``*args`` and ``**kwargs`` each count one."""
    a = node.args
    return len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs) + (a.vararg is not None) + (a.kwarg is not None)


def public_functions(path: Path) -> dict[str, int]:
    """``{qualified name: parameter count}`` of the public functions and methods of ``path``."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and not child.name.startswith("_"):
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and not child.name.startswith("_"):
                found[prefix + child.name] = parameter_count(child)

    visit(ast.parse(path.read_text()), "")
    return found


def test_the_counter_sees_every_kind_of_parameter(tmp_path):
    fn = ast.parse("def f(a, /, b, c=1, *args, d, e=2, **kw): pass").body[0]
    assert parameter_count(fn) == 7
    src = "class A:\n    def m(self, a, b, c, d, e, f, g, h): pass\n    def _p(self, *a): pass\ndef g(): pass\n"
    path = tmp_path / "probe.py"
    path.write_text(src)
    assert public_functions(path) == {"A.m": 9, "g": 0}


def test_no_public_entry_point_takes_more_than_8_parameters():
    paths = sorted((PACKAGE / "engine").glob("*.py"))
    assert PACKAGE / "engine" / "session.py" in paths and len(paths) >= 5
    over = {f"{p.relative_to(ROOT)}::{name}": n for p in paths for name, n in public_functions(p).items()
            if n > MAX_PARAMETERS}
    for rel, name in [("eval/runner.py", "run_eval"), ("eval/calibrate.py", "calibrate")]:
        counts = public_functions(PACKAGE / rel)
        assert name in counts, (rel, name)
        if counts[name] > MAX_PARAMETERS:
            over[f"sparsekv_jax/{rel}::{name}"] = counts[name]
    assert over == {}, over


@pytest.mark.parametrize("entry", [run_eval, calibrate])
def test_an_unknown_keyword_is_refused_by_name_before_the_model_loads(entry):
    kind = EvalOptions if entry is run_eval else CalibrateOptions
    with pytest.raises(TypeError, match=r"unknown option\(s\) batchsize; options are ") as e:
        entry(NO_MODEL, batchsize=2)
    assert all(f.name in str(e.value) for f in dataclasses.fields(kind))  # the valid ones are listed
    with pytest.raises(TypeError, match="positional"):  # a third positional argument (once `tasks`) is refused
        entry(NO_MODEL, "ruler", "fullkv")
    with pytest.raises(ValueError, match="not both"):
        entry(NO_MODEL, options=kind(), n=2)
    with pytest.raises(TypeError, match=f"options= must be a {kind.__name__}"):
        entry(NO_MODEL, options={"n": 2})


def test_options_by_keyword_and_by_options_value_are_the_same():
    kw = {"tasks": ["niah_single_1"], "lengths": "1k", "n": 3, "seed": 7, "question": "aware", "batch_size": 2,
          "fidelity": True, "progress": False, "pad_multiple": 32, "add_fullkv": False}
    by_keyword = eval_options(**kw)
    assert by_keyword == eval_options(options=EvalOptions(**kw)) == EvalOptions(**kw)
    assert by_keyword != eval_options()
    ckw = {"length": 200, "n": 2, "max_new_tokens": 72, "batch_size": 2, "page_size": 16, "progress": False}
    assert calibrate_options(**ckw) == calibrate_options(options=CalibrateOptions(**ckw))


def test_defaults_are_those_of_the_former_signatures():
    """The defaults of the keyword parameters ``run_eval`` / ``calibrate`` had before issue #41."""
    assert dataclasses.asdict(EvalOptions()) == {
        "tasks": None, "lengths": None, "n": 10, "seed": 0, "question": "agnostic", "batch_size": 4,
        "fidelity": False, "progress": True, "dtype": None, "model_name": None, "longbench_path": None,
        "cache_dir": None, "page_size": 16, "pad_multiple": 64, "add_fullkv": True, "prefill_chunk": None,
        "mesh": None, "backend": None}
    assert dataclasses.asdict(CalibrateOptions()) == {
        "data": None, "tasks": None, "length": 2048, "n": 32, "seed": 1234, "page_size": 32, "percentile": 99.0,
        "max_new_tokens": 256, "batch_size": 4, "plot": None, "progress": True, "dtype": None, "cache_dir": None}


@pytest.mark.parametrize("how", ["keyword", "options"])
def test_options_reach_the_checks_either_way(how):
    """A bad value given either way is refused by the same check, before the model loads."""
    bad = {"question": "sideways"}
    kw = bad if how == "keyword" else {"options": EvalOptions(**bad)}
    with pytest.raises(ValueError, match="question='sideways' must be one of"):
        run_eval(NO_MODEL, **kw)
    cbad = {"percentile": 100.0}
    ckw = cbad if how == "keyword" else {"options": CalibrateOptions(**cbad)}
    with pytest.raises(ValueError, match="percentile=100.0 must be in"):
        calibrate(NO_MODEL, **ckw)


MAX_ENGINE_FUNCTION_LINES = 60


def long_functions(source: str, limit: int = MAX_ENGINE_FUNCTION_LINES) -> dict[str, int]:
    """``{name: lines}`` of the functions (methods and nested ones included) in ``source`` longer than
    ``limit`` lines, decorators and docstring included (``def`` line to last line)."""
    return {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.end_lineno - n.lineno + 1 > limit}


def test_no_function_in_the_engine_is_over_60_lines():
    """Issue #41's reviewer fact: the engine (`sparsekv_jax/engine/`) reads as short functions."""
    paths = sorted((PACKAGE / "engine").glob("*.py"))
    assert len(paths) >= 5, paths  # the package is where this test thinks it is
    over = {f"{p.name}:{name}": lines for p in paths for name, lines in long_functions(p.read_text()).items()}
    assert not over, over


def test_the_line_count_catches_a_long_function():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_ENGINE_FUNCTION_LINES))
    assert long_functions(f"def f():\n{body}\n") == {"f": MAX_ENGINE_FUNCTION_LINES + 1}
    assert long_functions("def g():\n    return 1\n") == {}
