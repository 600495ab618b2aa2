"""The qwen2 GGUF architecture (Qwen2.5-Coder): a tiny qwen2 GGUF written here and the real
Qwen2.5-Coder-0.5B-Instruct Q4_K_M file, each against transformers loading the same file.

The tiny file carries q/k/v biases, unpermuted q/k rows (as llama.cpp writes qwen2), some Q8_0
tensors, a byte-level BPE tokenizer and a ChatML template, so every qwen2-specific piece of the
loader is exercised in a second. The real-model test converts into the user's cache
(`cache_root()`), as a user's first `load` does, and keeps transformers' own reading of the GGUF
there as a saved reference, so only the first run on a machine pays for dequantising twice.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers as tf
from conftest import seeded_rng

from sparsekv_jax.datasets import wikitext2_text
from sparsekv_jax.generate import full_logits, generate
from sparsekv_jax.models.embedded import EMBEDDED_MODELS, cache_root, embedded_gguf_path, load
from sparsekv_jax.models.loading import gguf_config, load_gguf, load_tokenizer

CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + "
          "'<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
          "{% endif %}")
SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
MERGES = ("h e", "l l", "Ġ t", "Ġt he")


def _byte_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet, in byte order (the base of a byte-level BPE vocabulary)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


def tiny_qwen2_model(seed: int):
    """A random tiny Qwen2 (biases, GQA, untied head) whose vocabulary is `write_qwen2_gguf`'s."""
    vocab = 256 + len(MERGES) + len(SPECIALS)
    cfg = tf.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:  # biases too: large enough that a dropped bias changes the logits
                p.normal_(0, 0.08 if p.ndim == 2 else 0.5)
    return model.eval()


def write_qwen2_gguf(path: Path, model, q8: bool = True) -> None:
    """``model`` as llama.cpp writes a qwen2 GGUF: its tensor names, q/k rows as they are (no permute),
    the feed-forward weights as Q8_0 when ``q8``, and a byte-level BPE tokenizer with a ChatML template."""
    c = model.config
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(1e6)  # the config's (transformers 5 keeps it in rope_parameters)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    tokens = _byte_tokens() + [m.replace(" ", "") for m in MERGES] + list(SPECIALS)
    assert len(tokens) == c.vocab_size
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(SPECIALS)) + [3] * len(SPECIALS))
    w.add_token_merges(list(MERGES))
    w.add_bos_token_id(tokens.index("<|endoftext|>"))
    w.add_eos_token_id(tokens.index("<|im_end|>"))
    w.add_add_bos_token(False)
    w.add_chat_template(CHATML)
    names = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
             "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj.weight", "ffn_gate": "mlp.gate_proj.weight",
             "ffn_up": "mlp.up_proj.weight", "ffn_down": "mlp.down_proj.weight"}
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
               "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        for g, h in names.items():
            if g in ("attn_q", "attn_k", "attn_v"):
                tensors[f"blk.{i}.{g}.weight"] = sd[f"model.layers.{i}.{h}.weight"]
                tensors[f"blk.{i}.{g}.bias"] = sd[f"model.layers.{i}.{h}.bias"]
            else:
                tensors[f"blk.{i}.{g}.weight"] = sd[f"model.layers.{i}.{h}"]
    for name, a in tensors.items():
        a = np.ascontiguousarray(a, dtype=np.float32)
        if q8 and ".ffn_" in name and name.endswith(".weight") and "norm" not in name:
            q = gguf.quants.quantize(a, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_tiny_qwen2_gguf_matches_transformers(tmp_path, rng):
    seed = int(rng.integers(2**31))  # from the run's seed (pytest --seed N replays it)
    model = tiny_qwen2_model(seed)
    path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(path, model)
    ref_model = tf.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32).eval()
    assert type(ref_model).__name__ == "Qwen2ForCausalLM"

    params, cfg = load_gguf(path)
    assert cfg.family == "qwen2" and cfg.qkv_bias and cfg.rope_theta == 1e6 and cfg.num_kv_heads == 2
    assert cfg == gguf_config(path)  # metadata alone (what `sparsekv info` reads) gives the same config
    for i in range(cfg.num_layers):  # biases as written (F32), q/k rows in HF order
        sa = model.model.layers[i].self_attn
        np.testing.assert_array_equal(np.asarray(params.layers.bq[i]), sa.q_proj.bias.detach().numpy())
        np.testing.assert_array_equal(np.asarray(params.layers.bk[i]), sa.k_proj.bias.detach().numpy())
        np.testing.assert_array_equal(np.asarray(params.layers.wk[i]), sa.k_proj.weight.detach().numpy().T)

    ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (2, 40))
    with torch.no_grad():
        ref = ref_model(torch.as_tensor(ids)).logits.numpy()
    ours = np.asarray(full_logits(params, ids))
    err = np.abs(ours - ref).max()
    print(f"tiny qwen2 GGUF: max |logit difference| {err:.2e} (logits up to {np.abs(ref).max():.1f})")
    assert err <= 1e-4, err
    with torch.no_grad():  # the biases matter: without them transformers' logits move far past the bound
        for layer in ref_model.model.layers:
            layer.self_attn.q_proj.bias.zero_()
        unbiased = ref_model(torch.as_tensor(ids)).logits.numpy()
    assert np.abs(unbiased - ref).max() > 100 * 1e-4


def test_tiny_qwen2_gguf_tokenizer_and_chat_template(tmp_path):
    path = tmp_path / "tiny-qwen2.gguf"
    write_qwen2_gguf(path, tiny_qwen2_model(0), q8=False)
    tok = load_tokenizer(path)
    params, tok2 = load(path, progress=False)
    text = "hello the world"
    # byte-level BPE with the file's merges: "he", "ll", " t" + "he" -> " the"
    assert tok.convert_ids_to_tokens(tok(text)["input_ids"]) == ["he", "ll", "o", "Ġthe", "Ġ", "w", "o", "r", "l", "d"]
    assert tok2(text)["input_ids"] == tok(text)["input_ids"]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.convert_tokens_to_ids("<|im_end|>") in params.config.eos_token_ids


# ------------------------------------------------------------------------------------------
# the real Qwen2.5-Coder-0.5B-Instruct Q4_K_M file
# ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen05():
    """(params, tokenizer, transformers model) of the real 0.5B file; both read from the cache after the first run."""
    spec = EMBEDDED_MODELS["qwen2.5-coder-0.5b"]
    root = cache_root()
    params, tok = load("qwen2.5-coder-0.5b", cache_dir=root, progress=False)
    ref_dir = root / "reference" / f"qwen2.5-coder-0.5b-{spec.file_sha256[:12]}-transformers-{tf.__version__}"
    if not (ref_dir / "config.json").is_file():
        path = embedded_gguf_path("qwen2.5-coder-0.5b", root)
        model = tf.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        ref_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{ref_dir.name}.", dir=ref_dir.parent))
        try:  # transformers refuses save_pretrained on a GGUF-loaded model: its weights, as read
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(staging / "model.safetensors"),
                      metadata={"format": "pt"})
            model.config.to_json_file(str(staging / "config.json"))
            os.rename(staging, ref_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    model = tf.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    return params, tok, model


@pytest.mark.usefixtures("optimized_xla")  # a real model: its programs compiled optimized
def test_qwen25_coder_05b_logits_and_greedy_match_transformers(qwen05):
    """Logits of a fresh 128-token passage, then 8 greedy tokens after its first 32, equal transformers'.

    (Was 192 tokens and 16 after 64: decoding the 0.5B model is most of the cost, on both sides; the
    parity checked is the same.)"""
    params, tok, model = qwen05
    cfg = params.config
    assert (cfg.family, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == ("qwen2", 24, 14, 2, 64)
    assert cfg.qkv_bias and cfg.rope_theta == 1e6 and cfg.max_position_embeddings == 32768
    assert type(model).__name__ == "Qwen2ForCausalLM"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")  # ChatML from the file
    assert tok.convert_tokens_to_ids("<|im_end|>") in cfg.eos_token_ids

    text = wikitext2_text()
    start = seeded_rng().integers(0, len(text) - 20 * 128)  # a fresh passage each run (the run's seed)
    ids = np.asarray([tok(text[start: start + 20 * 128])["input_ids"][:128]])
    assert ids.shape == (1, 128)
    with torch.no_grad():
        ref = model(torch.as_tensor(ids)).logits.numpy()
    ours = np.asarray(full_logits(params, ids))
    rel = np.linalg.norm(ours - ref) / np.linalg.norm(ref)
    print(f"qwen2.5-coder-0.5b GGUF: relative logit difference {rel:.2e}, max abs {np.abs(ours - ref).max():.2e}")
    assert rel <= 1e-3, rel  # the bound the Gemma 3 and SmolLM2 GGUF tests accept

    prompt = ids[:, :32]
    with torch.no_grad():
        hf = model.generate(torch.as_tensor(prompt), max_new_tokens=8, do_sample=False, min_new_tokens=8,
                            attention_mask=torch.ones_like(torch.as_tensor(prompt)))[0, 32:].tolist()
    out = generate(params, None, prompt, max_new_tokens=8, stop_tokens=())
    assert out.sequences()[0] == hf


def test_info_of_qwen25_coder_05b(qwen05, capsys):
    """`sparsekv info` on the embedded name: the loaded config and transformers' parameter count."""
    import dataclasses
    import json

    from sparsekv_jax import cli

    params, _, model = qwen05
    assert cli.main(["info", "--model", "qwen2.5-coder-0.5b", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"] == json.loads(json.dumps(dataclasses.asdict(params.config)))
    # 630,167,424: Qwen2.5-0.5B's published 494M plus the LM head, which this file stores apart (Q8_0)
    assert info["parameters"] == model.num_parameters() == 494_032_768 + 151_936 * 896
