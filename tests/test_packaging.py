"""A user's install: the built wheel, without extras, in a clean venv (issue 42, item 10).

The test extra pulls torch, and torch pulls jinja2, which transformers' ``apply_chat_template``
needs: a dependency missing from ``pyproject.toml`` is hidden in the development venv. Here the
wheel is built from the package's files, installed into a fresh venv (no system site-packages, no
extras: what ``pip install sparsekv-jax`` gives), and ``sparsekv generate --chat`` and a one-sample
``sparsekv eval --suite longbench`` (hotpotqa, a chat prompt) run on the embedded SmolLM2 from the
session's model cache. Both must exit 0 and not print transformers' "PyTorch was not found" notice;
``generate`` must print what the development install prints (greedy: the same tokens), ``eval`` one
scored record.

Time, with the dependencies' wheels in pip's cache, on 2 cores shared with other jobs (load 7-8):
wheel 7 s, install 55 s (``--no-compile``), generate in both installs 65 s, eval 126 s with trec
(64 tokens of few-shot labels), 37 s with hotpotqa (load 8-9; the test's process 105 -> 82 CPU s);
3-5 min in all. The first run downloads the dependencies (~200 MB, jax and jaxlib the largest).
The venv has no pip of its own (the outer pip installs into it with ``--python``: ensurepip's few
seconds saved), and one child of the venv's python reports where the package is imported from and
runs ``generate`` and ``eval`` through ``sparsekv_jax.cli.main`` (one JAX import and model load, not
three processes'); the console script is checked by its text (the venv's interpreter, the CLI's
``main``), not run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Name the capital of France in one word."
# hotpotqa: a chat prompt (the template through jinja2 in eval too) asking for the answer alone (<= 32 tokens,
# stopped at EOS); trec's few-shot prompt ran all its 64 tokens, ~0.5 CPU s a decode step under the cheap XLA flags
EVAL_ARGS = ["--suite", "longbench", "--tasks", "hotpotqa", "--lengths", "512", "--n", "1", "--batch-size", "1", "-q"]


# Run by the venv's python: where the package was imported from and whether torch is there (a JSON line), then
# ``sparsekv_jax.cli.main`` on each command of argv[1] (a JSON list), each output after a \x1e, its exit status
# after a \x1f.
CHILD = """import importlib.util, json, sys
import sparsekv_jax
print(json.dumps([sparsekv_jax.__file__, importlib.util.find_spec("torch") is None]))
from sparsekv_jax.cli import main
for args in json.loads(sys.argv[1]):
    sys.stdout.write("\\x1e")
    sys.stdout.flush()
    rc = main(args)
    sys.stdout.flush()
    sys.stdout.write(f"\\x1f{rc}")
"""


def _run(cmd: list[str], env: dict[str, str], cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    res = subprocess.run([str(c) for c in cmd], env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, f"{cmd[:4]} exited {res.returncode}:\n{res.stderr[-4000:]}"
    return res


def test_the_wheel_installed_without_extras_runs_chat_generate_and_eval(smol, tmp_path, monkeypatch, capsys,
                                                                        optimized_xla):
    """A real model: the wheel's child and the development install's ``generate`` both compile with XLA:CPU's
    optimizing settings (`conftest.OPTIMIZED_XLA`: the child through ``XLA_FLAGS``, this process through the
    ``optimized_xla`` fixture), so both run the same programs; eval's 512-token prefill and decode run ~5x
    cheaper than under the suite's cheap settings."""
    from conftest import OPTIMIZED_XLA

    from sparsekv_jax.cli import main

    cache = smol[0]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["SPARSEKV_CACHE"] = str(cache)
    env["XLA_FLAGS"] = " ".join(f"--{k}={str(v).lower()}" for k, v in OPTIMIZED_XLA.items())
    t0 = time.perf_counter()
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "sparsekv_jax", src / "sparsekv_jax", ignore=shutil.ignore_patterns("__pycache__"))
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", tmp_path / "dist", src], env, tmp_path)
    (wheel,) = (tmp_path / "dist").glob("sparsekv_jax-*.whl")
    t_wheel = time.perf_counter() - t0
    venv = tmp_path / "venv"
    # no pip in the venv (ensurepip's ~5 s): the outer pip installs into it, run by the venv's interpreter
    _run([sys.executable, "-m", "venv", "--without-pip", venv], env, tmp_path)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-compile", wheel], env, tmp_path)
    t_install = time.perf_counter() - t0 - t_wheel
    with capsys.disabled():
        print(f"\nwheel built in {t_wheel:.0f} s, installed in {t_install:.0f} s")
    script = (venv / "bin" / "sparsekv").read_text()  # the console script: the venv's python, the CLI's main
    assert script.startswith(f"#!{py}\n") and "from sparsekv_jax.cli import main" in script, script

    # one child for where the package is, generate and eval (one JAX import and model load, not three)
    commands = [["generate", "--chat", "--max-new-tokens", "8", "-q", PROMPT],
                ["eval", *EVAL_ARGS, "--out", str(tmp_path / "eval_wheel")]]
    child = _run([py, "-c", CHILD, json.dumps(commands)], env, tmp_path)
    assert "PyTorch was not found" not in child.stderr and "Traceback" not in child.stderr, child.stderr
    where, *outs = child.stdout.split("\x1e")
    assert json.loads(where) == [str(venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
                                     / "site-packages" / "sparsekv_jax" / "__init__.py"), True]  # the wheel, no torch
    (gen, gen_rc), (_, ev_rc) = (o.rsplit("\x1f", 1) for o in outs)
    assert (gen_rc, ev_rc) == ("0", "0"), child.stdout
    t1 = time.perf_counter()
    monkeypatch.setenv("SPARSEKV_CACHE", str(cache))
    capsys.readouterr()
    assert main(["generate", "--chat", "--max-new-tokens", "8", "-q", PROMPT]) == 0
    assert gen.strip() and gen == capsys.readouterr().out  # the development install's answer
    with capsys.disabled():
        print(f"generate --chat and eval in the wheel's venv {t1 - t0 - t_wheel - t_install:.0f} s, "
              f"generate here {time.perf_counter() - t1:.0f} s")
    (rec,) = [json.loads(line) for line in (tmp_path / "eval_wheel" / "results.jsonl").read_text().splitlines()]
    assert rec["task"] == "hotpotqa" and rec["policy"] == "fullkv" and rec["prediction"].strip()
    assert 0 <= rec["score"] <= 1


def test_transformers_torch_notice_is_dropped_and_nothing_else():
    """Without torch (blocked here by ``sys.modules['torch'] = None``), importing transformers prints
    its "PyTorch was not found" notice; after ``import sparsekv_jax`` it does not, and transformers'
    other messages still do."""
    block = "import sys; sys.modules['torch'] = None; "
    other = "; transformers.logging.get_logger('transformers').warning('another message')"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    plain = _run([sys.executable, "-c", block + "import transformers" + other], env, REPO).stderr
    ours = _run([sys.executable, "-c", block + "import sparsekv_jax, transformers" + other], env, REPO).stderr
    assert "PyTorch was not found" in plain and "another message" in plain  # the control: the notice is there
    assert "PyTorch was not found" not in ours and "another message" in ours
