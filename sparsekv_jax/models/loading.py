"""Weight loading: Hugging Face safetensors directories and llama.cpp GGUF files → `Params`.

Both loaders validate everything cheap first (architecture, file integrity, tensor names and
shapes) and only then read weights. Weights are gathered as numpy arrays, layer tensors are
stacked on the host with a leading ``[num_layers]`` axis, and each field is converted to a
JAX array exactly once.

Hugging Face stores projections ``[out, in]``; `Params` stores them ``[in, out]`` (``x @ w``),
so projections are transposed here.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors' numpy reader reads bf16)
import numpy as np
from tqdm.auto import tqdm

from sparsekv_jax._progress import bar_disabled
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import LayerParams, Params, expected_shapes, params_from_arrays

__all__ = ["load_hf_dir", "load_gguf", "load_tokenizer", "read_hf_arrays", "read_gguf_arrays",
           "arrays_to_params", "gguf_config", "read_hf_config"]

# Field name → (HF tensor name template, transpose to [in, out]). Layer templates take `{i}`.
_HF_GLOBAL: dict[str, tuple[str, bool]] = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
_HF_LAYER: dict[str, tuple[str, bool]] = {
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

# Gemma 3: four norms per layer. HF's `post_attention_layernorm` is the norm *after* attention
# (`post_attn_norm`), and the pre-MLP norm (our `mlp_norm`) is `pre_feedforward_layernorm`.
_HF_LAYER_GEMMA3: dict[str, tuple[str, bool]] = {
    **{k: v for k, v in _HF_LAYER.items() if k not in ("bq", "bk", "bv")},
    "mlp_norm": ("model.layers.{i}.pre_feedforward_layernorm.weight", False),
    "post_attn_norm": ("model.layers.{i}.post_attention_layernorm.weight", False),
    "post_mlp_norm": ("model.layers.{i}.post_feedforward_layernorm.weight", False),
}


def _hf_layer_map(cfg: ModelConfig) -> dict[str, tuple[str, bool]]:
    return _HF_LAYER_GEMMA3 if cfg.family == "gemma3" else _HF_LAYER


# llama.cpp tensor names of the llama architecture, same layout as above. Per-layer weights
# are `blk.{i}.*`. GGUF's numpy view is [out, in] like HF's, so the same transposes apply.
_GGUF_GLOBAL: dict[str, tuple[str, bool]] = {
    "embed": ("token_embd.weight", False),
    "final_norm": ("output_norm.weight", False),
    "lm_head": ("output.weight", True),
}
_GGUF_LAYER: dict[str, tuple[str, bool]] = {
    "attn_norm": ("blk.{i}.attn_norm.weight", False),
    "wq": ("blk.{i}.attn_q.weight", True),
    "wk": ("blk.{i}.attn_k.weight", True),
    "wv": ("blk.{i}.attn_v.weight", True),
    "wo": ("blk.{i}.attn_output.weight", True),
    "mlp_norm": ("blk.{i}.ffn_norm.weight", False),
    "w_gate": ("blk.{i}.ffn_gate.weight", True),
    "w_up": ("blk.{i}.ffn_up.weight", True),
    "w_down": ("blk.{i}.ffn_down.weight", True),
}
# llama.cpp's gemma3 names: the same plus q/k norms and the sandwich norms (`ffn_norm` is the
# pre-MLP norm). llama.cpp stores Gemma's norm weights as ``1 + w`` and does not permute q/k rows.
_GGUF_LAYER_GEMMA3: dict[str, tuple[str, bool]] = {
    **_GGUF_LAYER,
    "q_norm": ("blk.{i}.attn_q_norm.weight", False),
    "k_norm": ("blk.{i}.attn_k_norm.weight", False),
    "post_attn_norm": ("blk.{i}.post_attention_norm.weight", False),
    "post_mlp_norm": ("blk.{i}.post_ffw_norm.weight", False),
}
# llama.cpp's qwen2 names: llama's plus the q/k/v biases; q/k rows are not permuted (llama.cpp's
# converter permutes only the llama family's).
_GGUF_LAYER_QWEN2: dict[str, tuple[str, bool]] = {
    **_GGUF_LAYER,
    "bq": ("blk.{i}.attn_q.bias", False),
    "bk": ("blk.{i}.attn_k.bias", False),
    "bv": ("blk.{i}.attn_v.bias", False),
}
_GGUF_LAYER_MAPS = {"llama": _GGUF_LAYER, "gemma3": _GGUF_LAYER_GEMMA3, "qwen2": _GGUF_LAYER_QWEN2}
_GGUF_ARCHITECTURES = tuple(_GGUF_LAYER_MAPS)
# llama.cpp's fixed Gemma 3 facts that the GGUF metadata does not carry (llama-model.cpp): every
# 6th layer is global (5 local : 1 global), local layers' RoPE base is 10k.
_GEMMA3_SWA_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0

_LAYER_FIELDS = frozenset(LayerParams.__dataclass_fields__)


# --------------------------------------------------------------------------------------------
# shared helpers
# --------------------------------------------------------------------------------------------


def _source_shape(field: str, shape: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    """The shape a tensor has in the checkpoint (one layer, before our transpose)."""
    if field in _LAYER_FIELDS:
        shape = shape[1:]
    return tuple(reversed(shape)) if transpose else shape


def _plan(cfg: ModelConfig, global_map: dict[str, tuple[str, bool]],
          layer_map: dict[str, tuple[str, bool]]) -> dict[str, list[tuple[str, bool, tuple[int, ...]]]]:
    """For each `Params` field the config needs: [(checkpoint tensor name, transpose, shape)]."""
    plan = {}
    for field, shape in expected_shapes(cfg).items():
        if field in _LAYER_FIELDS:
            if field not in layer_map:
                raise ValueError(f"{cfg.family}: no checkpoint tensor maps to weight {field!r}")
            template, transpose = layer_map[field]
            names = [template.format(i=i) for i in range(cfg.num_layers)]
        else:
            name, transpose = global_map[field]
            names = [name]
        src = _source_shape(field, shape, transpose)
        plan[field] = [(n, transpose, src) for n in names]
    return plan


def _check_names_and_shapes(plan: dict[str, list[tuple[str, bool, tuple[int, ...]]]],
                            shapes: dict[str, tuple[int, ...]], where: str,
                            ignorable: Callable[[str], bool]) -> None:
    """Raise `ValueError` naming missing, mis-shaped or unexpected tensors."""
    wanted = {name: shape for entries in plan.values() for name, _, shape in entries}
    missing = [n for n in wanted if n not in shapes]
    if missing:
        shown = ", ".join(missing[:10]) + (f", … ({len(missing)} in all)" if len(missing) > 10 else "")
        raise ValueError(f"{where}: missing tensors: {shown}")
    bad = [f"{n} {shapes[n]} (expected {s})" for n, s in wanted.items() if tuple(shapes[n]) != s]
    if bad:
        raise ValueError(f"{where}: tensors of the wrong shape: " + "; ".join(bad[:10]))
    unexpected = sorted(n for n in shapes if n not in wanted and not ignorable(n))
    if unexpected:
        shown = ", ".join(unexpected[:10]) + (
            f", … ({len(unexpected)} in all)" if len(unexpected) > 10 else "")
        raise ValueError(
            f"{where}: tensors this port does not support (the model would be wrong without "
            f"them): {shown}")


def _check_finite(a: np.ndarray, name: str, where: str) -> None:
    """`ValueError` naming the tensor when ``a`` holds NaN or ±inf (a damaged file decodes to them)."""
    if np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
        bad = int(a.size - np.isfinite(a).sum())
        raise ValueError(f"{where}: tensor {name} has {bad} non-finite values (NaN/inf) of {a.size}; "
                         "the file is damaged")


def _gather(plan: dict[str, list[tuple[str, bool, tuple[int, ...]]]],
            read: Callable[[str], np.ndarray], bar: tqdm | None = None,
            where: str = "checkpoint") -> dict[str, np.ndarray]:
    """Read every planned tensor, transpose projections, stack layers (numpy, host); every tensor
    must be finite (`ValueError` naming the first that is not)."""
    out = {}
    for field, entries in plan.items():
        stacked = None  # layers are written into one preallocated array: no second copy of a field
        for i, (name, transpose, _) in enumerate(entries):
            a = read(name)
            _check_finite(a, name, where)
            a = a.T if transpose else a
            if field not in _LAYER_FIELDS:
                out[field] = np.ascontiguousarray(a)
            else:
                if stacked is None:
                    stacked = np.empty((len(entries), *a.shape), a.dtype)
                stacked[i] = a
            del a
            if bar is not None:
                bar.update(1)
        if stacked is not None:
            out[field] = stacked
    return out


def arrays_to_params(cfg: ModelConfig, arrays: dict[str, np.ndarray],
                     dtype: Any = jnp.float32, *, consume: bool = False) -> Params:
    """`Params` from a flat dict of field name → host array, each converted once to ``dtype``.

    With ``consume`` each host array is dropped from ``arrays`` once converted, so a model is never
    held twice in full (the loaders pass their own dicts this way).
    """
    dtype = jnp.dtype(dtype)
    if not consume:
        return params_from_arrays(cfg, {k: jnp.asarray(v, dtype=dtype) for k, v in arrays.items()})
    return params_from_arrays(cfg, {k: jnp.asarray(arrays.pop(k), dtype=dtype) for k in list(arrays)})


# --------------------------------------------------------------------------------------------
# Hugging Face directories (config.json + safetensors)
# --------------------------------------------------------------------------------------------


def _safetensors_files(path: Path) -> list[Path]:
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from e
        files = [path / f for f in dict.fromkeys(weight_map.values())]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index}: shard files missing: {', '.join(absent)}")
        return files
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{path}: no model.safetensors or model.safetensors.index.json (only safetensors "
        "checkpoints are supported)")


def read_hf_config(path: str | Path) -> ModelConfig:
    """Parse ``config.json`` of a Hugging Face model directory (raises on unsupported archs)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{path}: not a model directory (no config.json)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: not valid JSON ({e})") from e
    if raw.get("mlp_bias"):
        raise ValueError(f"{cfg_file}: mlp_bias=True is not supported")
    try:
        return ModelConfig.from_hf_dict(raw)
    except KeyError as e:
        raise ValueError(f"{cfg_file}: missing key {e}") from e


def read_hf_arrays(path: str | Path, progress: bool = False) -> tuple[dict[str, np.ndarray], ModelConfig]:
    """Host (numpy) weights of a Hugging Face directory, in their stored dtype, plus its config.

    Everything cheap is checked before any weight is read: ``config.json`` (the architecture is
    named when unsupported), every safetensors header (a truncated or corrupted file raises
    `ValueError` naming it), and the presence and shape of every tensor the family needs.
    """
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path}: not a directory")
    cfg = read_hf_config(path)
    files = _safetensors_files(path)
    plan = _plan(cfg, _HF_GLOBAL, _hf_layer_map(cfg))

    with contextlib.ExitStack() as stack:
        handles: dict[str, Any] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for f in files:
            try:
                h = stack.enter_context(safe_open(str(f), framework="numpy"))
                for name in h.keys():
                    shapes[name] = tuple(h.get_slice(name).get_shape())
                    handles[name] = h
            except SafetensorError as e:
                raise ValueError(f"{f}: truncated or corrupted safetensors file ({e})") from e

        def ignorable(name: str) -> bool:
            return name.endswith("rotary_emb.inv_freq") or (
                name == "lm_head.weight" and cfg.tie_word_embeddings)

        _check_names_and_shapes(plan, shapes, str(path), ignorable)

        def read(name: str) -> np.ndarray:
            try:
                return handles[name].get_tensor(name)
            except SafetensorError as e:
                raise ValueError(f"{path}: cannot read tensor {name} ({e})") from e

        total = sum(len(v) for v in plan.values())
        with tqdm(total=total, desc="loading weights", unit="tensor", disable=bar_disabled(progress)) as bar:
            arrays = _gather(plan, read, bar, str(path))
    return arrays, cfg


def load_hf_dir(path: str | Path, dtype: Any = jnp.float32, *,
                progress: bool = False) -> tuple[Params, ModelConfig]:
    """Load a Hugging Face model directory (Llama / Mistral / Qwen2 / Qwen3).

    Args:
      path: directory with ``config.json`` and ``model.safetensors`` or a sharded
        ``model.safetensors.index.json``.
      dtype: dtype of the returned weights (the stored dtype is converted once).
      progress: show a tqdm bar while reading tensors.

    Returns:
      ``(params, config)``; ``params.config is config``.

    Raises:
      ValueError: unsupported architecture, truncated/corrupted safetensors, missing, mis-shaped
        or unsupported tensors (each named).
      FileNotFoundError: no config.json / no safetensors files.
    """
    arrays, cfg = read_hf_arrays(path, progress=progress)
    params = arrays_to_params(cfg, arrays, dtype, consume=True)
    return params, cfg


# --------------------------------------------------------------------------------------------
# GGUF (llama.cpp)
# --------------------------------------------------------------------------------------------


def _field_value(field: Any) -> Any:
    """Python value of a `gguf.ReaderField` (scalar, string, or list of those)."""
    from gguf import GGUFValueType

    def one(vtype: Any, part: np.ndarray) -> Any:
        if vtype == GGUFValueType.STRING:
            return bytes(part).decode("utf-8", errors="replace")
        return part[0].item()

    if field.types and field.types[0] == GGUFValueType.ARRAY:
        return [one(field.types[-1], field.parts[i]) for i in field.data]
    return one(field.types[0], field.parts[field.data[0]])


def _float32_clean(x: float) -> float:
    """The shortest decimal that rounds to the same float32 (GGUF stores 1e-5 as 9.99999975e-6)."""
    return float(str(np.float32(x)))


def _open_gguf(path: Path) -> Any:
    from gguf import GGUFReader

    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        return GGUFReader(str(path))
    except Exception as e:  # the reader raises ValueError/IndexError/struct errors on bad files
        raise ValueError(f"{path}: truncated or corrupted GGUF file ({type(e).__name__}: {e})") from e


def _gguf_config(reader: Any, path: Path, vocab_size: int, tied: bool) -> ModelConfig:
    fields = {name: f for name, f in reader.fields.items()}

    def get(key: str, default: Any = ...) -> Any:
        if key in fields:
            try:
                return _field_value(fields[key])
            except Exception as e:
                raise ValueError(f"{path}: unreadable metadata {key} ({e})") from e
        if default is ...:
            raise ValueError(f"{path}: GGUF metadata {key!r} missing")
        return default

    arch = get("general.architecture", None)
    if arch not in _GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture general.architecture={arch!r}: "
            f"supported are {list(_GGUF_ARCHITECTURES)}")
    p = f"{arch}."
    hidden = int(get(p + "embedding_length"))
    heads = int(get(p + "attention.head_count"))
    kv = get(p + "attention.head_count_kv", heads)
    if isinstance(kv, list):  # per-layer counts; only uniform ones are supported
        if len(set(kv)) != 1:
            raise ValueError(f"{path}: per-layer KV head counts {sorted(set(kv))} are not supported")
        kv = kv[0]
    head_dim = int(get(p + "attention.key_length", hidden // heads))
    if int(get(p + "attention.value_length", head_dim)) != head_dim:
        raise ValueError(f"{path}: key_length != value_length is not supported")
    rope_dim = int(get(p + "rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise ValueError(f"{path}: partial RoPE (rope.dimension_count={rope_dim}, head_dim={head_dim}) "
                         "is not supported")
    scaling = get(p + "rope.scaling.type", "none")
    if scaling not in ("none", None, ""):
        raise ValueError(f"{path}: GGUF rope scaling type {scaling!r} is not supported")
    eos = get("tokenizer.ggml.eos_token_id", None)
    bos = get("tokenizer.ggml.bos_token_id", None)
    n_layers = int(get(p + "block_count"))
    family_fields: dict[str, Any] = {}
    if arch == "gemma3":
        if get(p + "attn_logit_softcapping", None) is not None:
            raise ValueError(f"{path}: attention logit softcapping is not supported")
        cap = get(p + "final_logit_softcapping", None)
        family_fields = dict(
            qk_norm=True, hidden_act="gelu_tanh", norm_weight_offset=1.0, sandwich_norms=True,
            scale_embeddings=True,
            # llama.cpp scales scores by 1/sqrt(key_length) for every Gemma 3 size but 27B
            query_pre_attn_scalar=float(head_dim),
            sliding_window=int(get(p + "attention.sliding_window")),
            layer_types=tuple("sliding_attention" if (i + 1) % _GEMMA3_SWA_PATTERN else "full_attention"
                              for i in range(n_layers)),
            rope_local_theta=_GEMMA3_LOCAL_ROPE_THETA,
            final_logit_softcapping=None if cap is None else _float32_clean(cap),
        )
    if arch == "qwen2":
        family_fields = dict(qkv_bias=True)
    return ModelConfig(
        family=arch,
        vocab_size=vocab_size,
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=heads,
        num_kv_heads=int(kv),
        head_dim=head_dim,
        intermediate_size=int(get(p + "feed_forward_length")),
        rope_theta=_float32_clean(get(p + "rope.freq_base", 10000.0)),
        rms_norm_eps=_float32_clean(get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        tie_word_embeddings=tied,
        max_position_embeddings=int(get(p + "context_length", 4096)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=() if eos is None else (int(eos),),
        **family_fields,
    )


def gguf_config(path: str | Path) -> ModelConfig:
    """The `ModelConfig` of a GGUF file from its metadata and tensor shapes, without reading weights.

    Raises:
      FileNotFoundError: no such file.
      ValueError: not a GGUF file (or truncated), unsupported architecture, missing metadata.
    """
    path = Path(path)
    reader = _open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        _gguf_config(reader, path, 1, True)  # the architecture first: the more useful message
        raise ValueError(f"{path}: missing tensors: token_embd.weight")
    vocab = int(tensors["token_embd.weight"].shape.tolist()[-1])  # GGUF dims innermost first
    return _gguf_config(reader, path, vocab, tied="output.weight" not in tensors)


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter reorders each head's rows from HF's rotate-half layout (first half of
    the head, then second half) to interleaved pairs: GGUF row ``2*j + p`` of a head is HF row
    ``p*(d/2) + j``. This restores HF's order.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _dequantize_rows(data: np.ndarray, qtype: Any, shape: tuple[int, ...],
                     chunk_bytes: int = 1 << 26) -> np.ndarray:
    """float32 ``shape`` array of a GGUF tensor, dequantised ~64 MiB of output at a time (the ``gguf``
    dequantisers make several temporaries the size of their output: whole, a 150k-row embedding's
    would be gigabytes)."""
    from gguf.quants import dequantize

    out = np.empty(shape, np.float32)
    flat = out.reshape(-1, shape[-1]) if len(shape) > 1 else out.reshape(1, -1)
    rows = np.asarray(data).reshape(flat.shape[0], -1)  # one row of blocks per output row
    step = max(1, chunk_bytes // (4 * flat.shape[1]))
    for r in range(0, flat.shape[0], step):
        flat[r: r + step] = np.asarray(dequantize(rows[r: r + step], qtype), np.float32).reshape(-1, flat.shape[1])
    return out


def read_gguf_arrays(path: str | Path, progress: bool = False) -> tuple[dict[str, np.ndarray], ModelConfig]:
    """Dequantised float32 host weights of a llama-, qwen2- or gemma3-architecture GGUF, plus its config.

    Quantised tensors (Q4_0/Q4_1/Q5_0/Q8_0, the K-quants Q4_K/Q5_K/Q6_K of a Q4_K_M file, …) are
    dequantised by the ``gguf`` package's `gguf.quants.dequantize`. Gemma 3's norm weights are
    stored by llama.cpp as ``1 + w``; the ``1`` is taken off so the port's ``(1 + w)`` convention
    (and transformers' ``Gemma3RMSNorm``) applies to the same numbers.

    Checked before any weight is dequantised: the file parses (truncated/corrupted → `ValueError`
    naming it), ``general.architecture`` is supported (named otherwise), required metadata and
    tensors exist with the right shapes (missing ones named), and every tensor's quantisation
    type can be dequantised by the installed ``gguf`` package.
    """
    from gguf.quants import dequantize

    path = Path(path)
    reader = _open_gguf(path)
    tensors = {t.name: t for t in reader.tensors}
    # GGUF lists dims innermost first; numpy order is the reverse.
    shapes = {n: tuple(int(d) for d in reversed(t.shape.tolist())) for n, t in tensors.items()}

    if "rope_freqs.weight" in tensors:
        raise ValueError(f"{path}: rope_freqs.weight (Llama-3 frequency scaling) is not supported "
                         "in GGUF files; load the Hugging Face checkpoint instead")
    if "token_embd.weight" not in shapes:
        # Check the architecture first: it is the more useful message on foreign files.
        _gguf_config(reader, path, 1, True)
        raise ValueError(f"{path}: missing tensors: token_embd.weight")
    vocab = shapes["token_embd.weight"][0]
    cfg = _gguf_config(reader, path, vocab, tied="output.weight" not in tensors)
    plan = _plan(cfg, _GGUF_GLOBAL, _GGUF_LAYER_MAPS[cfg.family])
    _check_names_and_shapes(plan, shapes, str(path), ignorable=lambda n: False)

    # Every quantisation type present must be supported: try one row of each before the work.
    for qtype in {t.tensor_type for t in tensors.values()}:
        sample = next(t for t in tensors.values() if t.tensor_type == qtype)
        try:
            dequantize(np.asarray(sample.data).reshape(-1, sample.data.shape[-1])[:1], qtype)
        except NotImplementedError as e:
            raise ValueError(f"{path}: tensor {sample.name} has quantisation type "
                             f"{getattr(qtype, 'name', qtype)}, which gguf cannot dequantise") from e

    def read(name: str) -> np.ndarray:
        t = tensors[name]
        try:
            w = _dequantize_rows(t.data, t.tensor_type, shapes[name])
        except Exception as e:
            raise ValueError(f"{path}: cannot dequantise {name} ({e})") from e
        if cfg.family == "gemma3":  # stored as 1 + w; q/k rows are in HF order already
            return w - 1.0 if name.endswith("norm.weight") else w
        if cfg.family != "llama":  # qwen2: q/k rows (and biases) are in HF order already
            return w
        if ".attn_q." in name:
            w = _unpermute_rope_rows(w, cfg.num_heads)
        elif ".attn_k." in name:
            w = _unpermute_rope_rows(w, cfg.num_kv_heads)
        return w

    total = sum(len(v) for v in plan.values())
    with tqdm(total=total, desc="dequantising GGUF", unit="tensor", disable=bar_disabled(progress)) as bar:
        arrays = _gather(plan, read, bar, str(path))
    return arrays, cfg


def load_gguf(path: str | Path, dtype: Any = jnp.float32, *,
              progress: bool = False) -> tuple[Params, ModelConfig]:
    """Load a llama-, qwen2- or gemma3-architecture GGUF file (F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q4_K/Q6_K/… via
    ``gguf``).

    For llama, q/k projection rows are un-permuted from llama.cpp's rope layout back to Hugging Face's, so
    the result matches what ``transformers`` loads from the same file (qwen2's and gemma3's are stored
    unpermuted); qwen2's q/k/v biases are read too. Every weight must be finite.

    Args:
      path: the ``.gguf`` file.
      dtype: dtype of the returned weights (dequantised values are float32 before the cast).
      progress: show a tqdm bar while dequantising.

    Returns:
      ``(params, config)``; the config comes from the GGUF metadata.

    Raises:
      ValueError: truncated/corrupted file, unsupported ``general.architecture`` (named),
        missing metadata or tensors (named), unsupported quantisation types, non-finite weights
        (the tensor named).
    """
    arrays, cfg = read_gguf_arrays(path, progress=progress)
    return arrays_to_params(cfg, arrays, dtype, consume=True), cfg


# --------------------------------------------------------------------------------------------
# tokenizers
# --------------------------------------------------------------------------------------------


def load_tokenizer(path_or_dir: str | Path, gguf_file: str | None = None) -> Any:
    """A ``transformers`` tokenizer from a model directory or a GGUF file.

    ``path_or_dir`` may be a directory (optionally with ``gguf_file`` naming a GGUF inside it)
    or the path of a ``.gguf`` file itself.
    """
    from transformers import AutoTokenizer

    p = Path(path_or_dir)
    if p.is_file() and p.suffix == ".gguf":
        if gguf_file is not None and gguf_file != p.name:
            raise ValueError(f"gguf_file={gguf_file!r} given with a GGUF path {p}")
        p, gguf_file = p.parent, p.name
    if not p.is_dir():
        raise FileNotFoundError(f"{path_or_dir}: no such model directory or GGUF file")
    if gguf_file is not None:
        if not (p / gguf_file).is_file():
            raise FileNotFoundError(f"{p / gguf_file}: no such GGUF file")
        tokenizer = AutoTokenizer.from_pretrained(str(p), gguf_file=gguf_file)
        check_gguf_tokenizer(tokenizer, p / gguf_file)
        return tokenizer
    return AutoTokenizer.from_pretrained(str(p))


def check_gguf_tokenizer(tokenizer: Any, gguf_path: str | Path) -> None:
    """Refuse a tokenizer that ``transformers`` built from a GGUF with the wrong algorithm.

    A GGUF whose ``tokenizer.ggml.model`` is ``"llama"`` holds a SentencePiece BPE vocabulary, merged
    by score (llama.cpp's SPM tokenizer; Unigram models are ``"t5"``). transformers 5.17 built
    Gemma 3's as a ``Unigram`` model. That model cuts common words into pieces: "the provided
    text" became ' t', 'he', ' prov', 'id', 'ed', ' t', 'ext'. A RULER run on a GPU with it scored
    as if the model could not read (experiments/diary/RESULTS_DIARY.md). transformers 5.23 builds a BPE
    model and matches the model's own tokenizer.
    """
    import gguf
    import transformers

    field = gguf.GGUFReader(str(gguf_path)).fields.get("tokenizer.ggml.model")
    kind = bytes(field.parts[field.data[0]]).decode() if field is not None else None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    built = type(backend.model).__name__ if backend is not None else None
    if kind == "llama" and built == "Unigram":
        raise ValueError(f"{gguf_path}: its tokenizer is SentencePiece BPE (tokenizer.ggml.model='llama'), but "
                         f"transformers {transformers.__version__} built a Unigram model from it, which splits words "
                         "into fragments; use transformers >= 5.23 (or a tokenizer saved from it)")
