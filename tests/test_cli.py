"""The `sparsekv` command: help on every subcommand, `info` against transformers' own counts,
`generate` reading its prompt from an argument, a file or stdin."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest

from sparsekv_jax import cli

COMMANDS = ["generate", "info", "eval", "calibrate", "bench", "train-sae"]


@pytest.mark.parametrize("argv", [["--help"]] + [[c, "--help"] for c in COMMANDS])
def test_help_on_every_command(argv, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 0
    assert "usage: sparsekv" in capsys.readouterr().out


@pytest.mark.parametrize("which, option", [("e2e", "--mesh"), ("chess", "--iters"), ("kernels", "--lengths")])
def test_bench_hands_its_arguments_to_the_benchmark(which, option, capsys):
    """``sparsekv bench NAME ARGS`` is ``python -m sparsekv_jax.bench.NAME ARGS``; a name that is not a
    benchmark is refused by name."""
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", which, "--help"])
    assert e.value.code == 0
    assert option in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "e2f"])
    assert e.value.code == 2 and "invalid choice: 'e2f'" in capsys.readouterr().err


@pytest.mark.parametrize("command, data", [("eval", "datasets/longbench_mini"), ("calibrate", "datasets/wikitext2")])
def test_help_names_the_packaged_data(command, data, capsys):
    """The default data of ``eval --suite longbench`` / ``calibrate`` ships with the package."""
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps help lines
    # no path outside the package (a `shared/` folder beside the clone); "ruler-shared" is a suite's name
    assert "package data" in out and data in out and "shared/" not in out


def test_info_of_a_model_directory_matches_transformers(hf_tiny_dir, capsys):
    import transformers as tf

    for family in ("llama", "qwen2", "qwen3"):
        path = hf_tiny_dir(family)
        assert cli.main(["info", "--model", path, "--context", "1000", "--batch", "3", "--json"]) == 0
        info = json.loads(capsys.readouterr().out)
        model = tf.AutoModelForCausalLM.from_pretrained(path)
        assert info["parameters"] == model.num_parameters(), family
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * 2  # K and V, bf16
        assert info["kv_bytes_per_token"] == per_token
        assert info["kv_cache_bytes"] == per_token * 1000 * 3


def test_info_bad_input_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["info", "--batch", "0"])
    assert e.value.code == 2
    assert cli.main(["info", "--model", "no-such-model"]) == 2  # one line, no traceback (tests/test_model_errors.py)
    assert "'no-such-model': no such file or directory, and not an embedded model" in capsys.readouterr().err


def test_generate_reads_argument_file_and_stdin(smol, tmp_path, monkeypatch, capsys):
    cache_dir, _, _, _ = smol
    monkeypatch.setenv("SPARSEKV_CACHE", str(cache_dir))
    prompt = "The capital of France is"
    outs = []
    assert cli.main(["generate", prompt, "--max-new-tokens", "4", "-q"]) == 0
    outs.append(capsys.readouterr().out)
    f = tmp_path / "p.txt"
    f.write_text(prompt)
    assert cli.main(["generate", "--prompt-file", str(f), "--max-new-tokens", "4", "-q"]) == 0
    outs.append(capsys.readouterr().out)
    monkeypatch.setattr(sys, "stdin", io.StringIO(prompt))
    assert cli.main(["generate", "--max-new-tokens", "4", "-q"]) == 0
    outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] == outs[2] and "Paris" in outs[0]
    with pytest.raises(SystemExit, match="bad --policy"):
        cli.main(["generate", prompt, "--policy", "snapkv(budget=2.0)", "-q"])


def test_info_of_the_llama_preset_in_a_fresh_process():
    res = subprocess.run([sys.executable, "-m", "sparsekv_jax.cli", "info", "--model", "llama3.1-8b"],
                         capture_output=True, text=True)
    assert res.returncode == 0 and "8,030,261,248" in res.stdout  # Llama-3.1-8B's published size


@pytest.mark.parametrize("value", ["xla", "pallas"])
def test_decode_matmul_from_the_environment_reaches_every_entry_point(smol, value, monkeypatch, tmp_path):
    """``$SPARSEKV_DECODE_MATMUL`` is read by the command line only (`Backend.from_env`): `sparsekv
    generate` and `sparsekv eval` hand that backend to the engine, `bench e2e` to its runs (its
    --decode-matmul wins); a bad value is an error naming it."""
    import sparsekv_jax.generate as generate_module
    import sparsekv_jax.models.embedded as embedded
    from sparsekv_jax.bench import e2e
    from sparsekv_jax.eval import runner

    seen = {}

    class Out:
        def sequences(self):
            return [[]]

    def fake_generate(*args, **kwargs):
        seen["generate"] = kwargs["backend"]
        return Out()

    monkeypatch.setenv("SPARSEKV_DECODE_MATMUL", value)
    monkeypatch.setattr(embedded, "load", lambda *a, **k: (smol[1], smol[2]))
    monkeypatch.setattr(generate_module, "generate", fake_generate)
    monkeypatch.setattr(runner, "run_eval", lambda **kw: seen.setdefault("eval", kw["backend"]) and {})
    monkeypatch.setattr(e2e, "run_model", lambda model, grid, backend: seen.setdefault("e2e", backend) and [])
    assert cli.main(["generate", "hello", "--max-new-tokens", "2", "-q"]) == 0
    assert cli.main(["eval", "--out", str(tmp_path), "-q"]) == 0
    assert e2e.main(["--one-model", "smollm2"]) == 0
    assert {k: b.decode_matmul for k, b in seen.items()} == {"generate": value, "eval": value, "e2e": value}
    seen.clear()
    assert e2e.main(["--one-model", "smollm2", "--decode-matmul", "auto", "--unroll", "2"]) == 0
    assert (seen["e2e"].decode_matmul, seen["e2e"].decode_unroll) == ("auto", 2)
    monkeypatch.setenv("SPARSEKV_DECODE_MATMUL", "cublas")
    with pytest.raises(SystemExit, match="SPARSEKV_DECODE_MATMUL='cublas'"):
        cli.main(["generate", "hello", "-q"])


def test_eval_help_names_every_shipped_chess_calibration_and_each_loads(capsys):
    """The help's list of shipped calibrations is the folder's (a file added there is named and usable
    by its name), and each file holds the two thresholds CHESS reads."""
    import math
    from pathlib import Path

    from sparsekv_jax.policies.chess_config import CALIBRATION_DIR, load_thresholds

    names = sorted(f.stem for f in Path(CALIBRATION_DIR).glob("*.json") if not f.stem.endswith("_heads"))
    assert {"smollm2", "gemma3-270m", "qwen2.5-coder-1.5b"} <= set(names)
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name in names:
        assert repr(name) in text, name
        thresholds = load_thresholds(name)
        assert all(math.isfinite(v) and v > 0 for v in thresholds.values()), (name, thresholds)
