"""The embedded SmolLM2 GGUF: our port against transformers loading the same file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers as tf

from sparsekv_jax.generate import full_logits, generate
from sparsekv_jax.models.embedded import embedded_gguf_path

WIKITEXT = Path(__file__).resolve().parents[2] / "shared" / "data" / "wikitext2" / "wiki.test.raw"


def _prompt_ids(tokenizer, n: int) -> np.ndarray:
    text = WIKITEXT.read_text()
    start = np.random.default_rng().integers(0, len(text) - 20 * n)  # a fresh passage each run
    ids = tokenizer(text[start: start + 20 * n])["input_ids"][:n]
    assert len(ids) == n
    return np.asarray([ids])


def test_logits_and_greedy_match_transformers_gguf(smol):
    cache_dir, params, tokenizer, _ = smol
    gguf = embedded_gguf_path(cache_dir=cache_dir)
    model = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    model.eval()
    ids = _prompt_ids(tokenizer, 512)
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)).logits.numpy()
    ours = np.asarray(full_logits(params, ids))
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel <= 1e-3, rel

    prompt = ids[:, :128]
    with torch.no_grad():
        hf = model.generate(torch.as_tensor(prompt), max_new_tokens=32, do_sample=False, min_new_tokens=32,
                            attention_mask=torch.ones_like(torch.as_tensor(prompt)))[0, 128:].tolist()
    out = generate(params, None, prompt, max_new_tokens=32, stop_tokens=())
    assert out.sequences()[0] == hf
