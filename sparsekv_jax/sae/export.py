"""Trained SAEs as files: safetensors weights + a JSON record; the shipped SmolLM2 SAEs.

``NAME.safetensors`` holds the stacked weights of every target layer — ``w_enc [L, D, W]``,
``b_enc [L, W]``, ``w_dec [L, W, D]``, ``b_dec [L, D]`` — and ``NAME.json`` the record: model,
layers (in stack order), k, width, corpus, steps, and the held-out evaluation (FVU, L0, dead
fraction per layer). The record is also stored in the safetensors metadata, so the weights file
alone is self-describing.

`load_shipped` reads the SAEs shipped for an embedded model from ``sparsekv_jax/sae/shipped/``
(SmolLM2: trained on the GPU with ``sae_training/configs/smollm2.yaml``, docs/SAE.md).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from sparsekv_jax.sae.model import TopKSAE

SHIPPED_DIR = Path(__file__).resolve().parent / "shipped"
FORMAT = "sparsekv-topk-sae/1"
_FIELDS = ("w_enc", "b_enc", "w_dec", "b_dec")
_DTYPES = {"float32": np.float32, "float16": np.float16}


def save_saes(path: str | Path, sae: TopKSAE, record: dict[str, Any], dtype: str = "float32") -> tuple[Path, Path]:
    """Write a stack of SAEs (one per entry of ``record["layers"]``) to ``path`` (+ ``.json``).

    ``dtype``: ``"float32"`` or ``"float16"`` storage (float16 halves the file; loading upcasts).
    Returns the paths of the safetensors file and of the JSON record.
    """
    from safetensors.numpy import save_file

    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {sorted(_DTYPES)}")
    layers = list(record.get("layers", []))
    if len(sae.stack_shape) != 1 or sae.stack_shape[0] != len(layers):
        raise ValueError(f"SAE stack {sae.stack_shape} does not match record layers {layers}")
    path = Path(path)
    if path.suffix != ".safetensors":
        path = path.with_suffix(".safetensors")
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**record, "format": FORMAT, "k": sae.k, "width": sae.width, "d_in": sae.d_in, "dtype": dtype}
    tensors = {f: np.ascontiguousarray(np.asarray(getattr(sae, f), np.float32).astype(_DTYPES[dtype]))
               for f in _FIELDS}
    save_file(tensors, str(path), metadata={"record": json.dumps(record)})
    record_path = path.with_suffix(".json")
    record_path.write_text(json.dumps(record, indent=2) + "\n")
    return path, record_path


def load_saes(path: str | Path) -> tuple[dict[int, TopKSAE], dict[str, Any]]:
    """``({layer: TopKSAE (fp32)}, record)`` from a file written by `save_saes`."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no SAE file at {path}")
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata() or {}
        if "record" not in meta:
            raise ValueError(f"{path} has no SAE record in its metadata (not written by save_saes)")
        record = json.loads(meta["record"])
        arrays = {name: f.get_tensor(name).astype(np.float32) for name in _FIELDS}
    if record.get("format") != FORMAT:
        raise ValueError(f"{path}: format {record.get('format')!r}, expected {FORMAT!r}")
    stack = TopKSAE(**{n: jnp.asarray(a) for n, a in arrays.items()}, k=int(record["k"])).validate()
    layers = [int(i) for i in record["layers"]]
    if stack.stack_shape != (len(layers),):
        raise ValueError(f"{path}: weights stacked {stack.stack_shape} for layers {layers}")
    return {layer: stack.layer(i) for i, layer in enumerate(layers)}, record


def stack_saes(saes: dict[int, TopKSAE]) -> tuple[tuple[int, ...], TopKSAE]:
    """``(layers, stacked TopKSAE)`` from ``{layer: TopKSAE}`` (sorted by layer)."""
    import jax

    layers = tuple(sorted(saes))
    return layers, jax.tree.map(lambda *a: jnp.stack(a), *[saes[i] for i in layers])


def load_shipped(name: str = "smollm2", directory: str | Path | None = None) -> tuple[dict[int, TopKSAE], dict]:
    """The SAEs shipped for embedded model ``name``: ``({layer: TopKSAE}, record)``.

    ``directory`` overrides the package's ``shipped/`` folder (tests, or your own trained set
    laid out the same way: ``NAME.safetensors`` + ``NAME.json``).
    """
    folder = SHIPPED_DIR if directory is None else Path(directory)
    path = folder / f"{name}.safetensors"
    if not path.exists():
        have = sorted(p.stem for p in folder.glob("*.safetensors")) if folder.exists() else []
        raise FileNotFoundError(f"no shipped SAEs named {name!r} in {folder} (have: {have}); train them with "
                                "`sparsekv train-sae` (docs/SAE.md)")
    return load_saes(path)
