"""The embedded SmolLM2 GGUF: our port against transformers loading the same file."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers as tf
from conftest import seeded_rng

from sparsekv_jax.datasets import wikitext2_text
from sparsekv_jax.generate import full_logits, generate
from sparsekv_jax.models.embedded import embedded_gguf_path

# a real model: its programs compiled optimized (conftest.optimized_xla: decoding ~5x cheaper)
pytestmark = pytest.mark.usefixtures("optimized_xla")


def _prompt_ids(tokenizer, n: int) -> np.ndarray:
    text = wikitext2_text()
    start = seeded_rng().integers(0, len(text) - 20 * n)  # a fresh passage each run
    ids = tokenizer(text[start: start + 20 * n])["input_ids"][:n]
    assert len(ids) == n
    return np.asarray([ids])


@pytest.fixture
def one_torch_thread():
    """Torch on one thread for the test (restored after it): see the test below."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_logits_and_greedy_match_transformers_gguf(smol, monkeypatch, one_torch_thread):
    """Logits of a fresh 256-token passage, then 16 greedy tokens after its first 64, equal transformers'.

    (Was 512 tokens and 32 after 128: the parity is the same check at half the length, as the 0.5B
    Qwen2.5 test does it; the 4k-token Quest test below covers long prompts.)

    Cost (2-core CPU, 2026-11-28): transformers' GGUF load was 28 CPU s, ~12 of them rebuilding one
    tensor-name table per tensor (`gguf.get_tensor_name_map`, a pure function of the architecture and
    layer count: memoized here) and ~5 parsing the file's fields a second time (the config's pass and the
    weights' pass each open a `gguf.GGUFReader` of the same file: the reader is shared here). Torch's
    forward and generate ran on every core and spun against XLA's threads and the other pytest worker:
    9.5 + 13.3 CPU s at torch's default threads, 1.4 + 2.4 at one thread. What transformers reads from the
    file, and so what is compared, is unchanged."""
    import functools

    import gguf as gguf_lib

    monkeypatch.setattr(gguf_lib, "get_tensor_name_map", functools.lru_cache(None)(gguf_lib.get_tensor_name_map))
    monkeypatch.setattr(gguf_lib, "GGUFReader", functools.lru_cache(None)(gguf_lib.GGUFReader))
    cache_dir, params, tokenizer, _ = smol
    gguf = embedded_gguf_path(cache_dir=cache_dir)
    model = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, torch_dtype=torch.float32)
    model.eval()
    ids = _prompt_ids(tokenizer, 256)
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)).logits.numpy()
    ours = np.asarray(full_logits(params, ids))
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    assert rel <= 1e-3, rel

    prompt = ids[:, :64]
    with torch.no_grad():
        hf = model.generate(torch.as_tensor(prompt), max_new_tokens=16, do_sample=False, min_new_tokens=16,
                            attention_mask=torch.ones_like(torch.as_tensor(prompt)))[0, 64:].tolist()
    out = generate(params, None, prompt, max_new_tokens=16, stop_tokens=())
    assert out.sequences()[0] == hf


def test_quest_at_quarter_budget_still_finds_the_needle(smol):
    """Issue 4: SmolLM2 on a 4k-token single-needle prompt, Quest reading 25% of the pages.

    The prompt is RULER niah_single_1's seed 0 (the needle value comes from the generator). It is
    one prompt, not a rate: on seeds 0-3 Quest(0.25) answered 3 of 4 (docs/RESULTS.md), so a fresh
    seed each run would make this test fail by design about one run in four.
    """
    from sparsekv_jax.eval.ruler import generate_samples
    from sparsekv_jax.policies import Quest

    _, params, tokenizer, _ = smol
    seed = 0
    sample = generate_samples("niah_single_1", 4096, 1, seed, tokenizer, chat=True)[0]
    ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    stops = (2, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    out = generate(params, Quest(budget=0.25), np.asarray([ids]), max_new_tokens=16, stop_tokens=stops)
    answer = tokenizer.decode(out.sequences()[0], skip_special_tokens=True)
    assert float(out.stats["kv_read_fraction"][0]) < 0.35  # it really read about a quarter
    assert sample.score(answer) == 1.0, (seed, sample.answers, answer)
