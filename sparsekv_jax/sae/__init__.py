"""Top-K sparse autoencoders on key projections (S³-Attention), trained with optax (docs/SAE.md).

    from sparsekv_jax.sae import load_shipped, encode, merge_heads
    saes, record = load_shipped("smollm2")          # {layer: TopKSAE}
    ids, acts = encode(saes[11], keys)              # keys [..., head_dim] (pre-RoPE)

Submodules: `model` (the SAE), `topk`, `optim` (optax transforms), `train` (the step), `keys`
(pre-RoPE projections), `data` / `stream` (corpus, shuffle buffer), `evaluate`, `export`, `run`.
Attributes are imported lazily so that the ``sparsekv`` command starts without JAX.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TopKSAE": "model", "init_sae": "model", "encode": "model", "decode": "model", "reconstruct": "model",
    "pre_activations": "model", "dense_latents": "model", "merge_heads": "model",
    "make_optimizer": "optim", "project_decoder_gradient": "optim", "unit_norm_decoder": "optim",
    "TrainConfig": "config", "RunConfig": "config", "TrainState": "train", "train_step": "train",
    "init_train_state": "train", "projections": "keys", "unrotate": "keys",
    "save_saes": "export", "load_saes": "export", "load_shipped": "export",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"sparsekv_jax.sae.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'sparsekv_jax.sae' has no attribute {name!r}")
