"""Train Top-K SAEs on a model's pre-RoPE key projections (S³-Attention); docs/SAE.md.

    python sae_training/train.py --config sae_training/configs/smollm2.yaml
    python sae_training/train.py --config sae_training/configs/smollm2.yaml --resume

The same as ``sparsekv train-sae``; every option is listed by ``--help``.
"""

import sys
from pathlib import Path

# run from a clone without installing: the package is the repository's sparsekv_jax/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparsekv_jax.sae.cli import main  # noqa: E402

if __name__ == "__main__":
    raise SystemExit(main())
