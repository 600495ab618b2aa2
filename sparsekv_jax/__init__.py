"""sparsekv-jax: long-context inference where a jit-compiled policy picks the KV entries used."""

import sparsekv_jax._torch_notice  # noqa: F401  (first: before anything imports transformers)
from sparsekv_jax.backend import Backend
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.embedded import load
from sparsekv_jax.models.params import Params

__all__ = ["Backend", "ModelConfig", "Params", "load"]
__version__ = "0.1.0"
