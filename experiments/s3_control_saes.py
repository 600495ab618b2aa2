"""A control SAE set for S³ (issue 37): the trained set's layers, width, k, dtype and centring, random directions.

Is S3Hybrid's gain over BM25 the SAEs' doing, or the structure's (half the budget to spans that are not
BM25's ranking, span shapes, lead/tail)? Run S3Pure / S3Hybrid once with the trained SAEs and once with this
control, at the same budget, on the same samples (``s3_retrieval_quality.py --saes A=... --saes B=...``).

What the control keeps and what it redraws, per layer:

* ``b_dec`` (the pre-encoder bias) is the trained set's: keys and queries are centred exactly as before, so
  only what the trained directions learned is taken away, not the centring of pre-RoPE keys' large offsets;
* decoder rows: random unit vectors (seeded, isotropic: ``init_sae``'s draw), unit-norm as trained rows are;
* encoder: tied to the decoder (``w_enc = w_decᵀ``, as a fresh SAE starts) and scaled by the trained
  encoder's median column norm of that layer, so query activations, which weight S³'s scores and thereby
  the layers against each other, keep the trained set's magnitude per layer;
* ``b_enc = 0``: no latent is favoured whatever the key. With random directions about half of a centred
  vector's ``width`` pre-activations are positive (``width`` / 2 ≫ k), so the top-k still picks k latents
  with positive activations for every key and query.

What this control is not: a set that ignores the keys. A random dictionary with a top-k is a random-projection
hash (SimHash-like): a query still shares features with keys of similar direction after centring. The
comparison with it asks what the *learned* dictionary adds over random features at equal cost and shapes.

    python experiments/s3_control_saes.py sparsekv_jax/sae/shipped/smollm2.safetensors \\
        /tmp/control_smollm2.safetensors --seed 0

The record (safetensors metadata and ``.json``) keeps the trained set's model, layers and key description,
drops its training statistics (they are not the control's) and adds ``control`` (source file name, its sha256,
seed; no directory, so the bytes written depend only on the source's bytes and the seed).
Prints the sha256 of both files written.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

KEEP = ("model", "model_config", "layers", "keys")  # record fields that still describe the control


def sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def resolve_source(spec: str) -> Path:
    """``shipped:NAME`` or a ``.safetensors`` path → the file (``FileNotFoundError`` / ``ValueError`` naming it)."""
    from sparsekv_jax.sae.export import SHIPPED_DIR

    path = SHIPPED_DIR / f"{spec.removeprefix('shipped:')}.safetensors" if spec.startswith("shipped:") else Path(spec)
    if path.suffix != ".safetensors":
        raise ValueError(f"source {spec!r} is not a .safetensors file (or shipped:NAME)")
    if not path.is_file():
        raise FileNotFoundError(f"no SAE file at {path}")
    return path


def control_saes(saes: dict[int, Any], seed: int) -> tuple[tuple[int, ...], Any]:
    """``(layers, stacked TopKSAE)``: random tied directions, the source's ``b_dec`` and per-layer encoder scale."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax.sae.export import stack_saes
    from sparsekv_jax.sae.model import init_sae

    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32)")
    layers, src = stack_saes(saes)
    ctl = init_sae(jax.random.key(seed), src.d_in, src.width, src.k, stack=src.stack_shape, b_dec=src.b_dec)
    scale = jnp.median(jnp.linalg.norm(src.w_enc, axis=-2), axis=-1)  # [L]: the median latent's encoder norm
    return layers, ctl.replace(w_enc=ctl.w_enc * scale[:, None, None])


def write_control(source: str | Path, out: str | Path, seed: int) -> tuple[Path, Path, dict[str, Any]]:
    """Write the control of SAE file ``source`` to ``out`` (``.safetensors``); returns both paths and the record."""
    from sparsekv_jax.sae.export import load_saes, save_saes

    source, out = Path(source), Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"output {out} must end in .safetensors")
    if out.exists() and out.resolve() == source.resolve():
        raise ValueError(f"output {out} is the source file: it would overwrite the trained SAEs")
    saes, rec = load_saes(source)
    layers, stack = control_saes(saes, seed)
    record = {**{k: rec[k] for k in KEEP if k in rec},
              "control": {"source": source.name, "source_sha256": sha256(source), "seed": seed,
                          "directions": "random unit decoder rows, tied encoder scaled to the source's median "
                                        "encoder column norm per layer, b_enc 0, source b_dec (experiments/"
                                        "s3_control_saes.py)"}}
    record["layers"] = list(layers)
    path, record_path = save_saes(out, stack, record, dtype=rec.get("dtype", "float32"))
    return path, record_path, {**record, "k": stack.k, "width": stack.width, "dtype": rec.get("dtype", "float32")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="trained SAEs: a .safetensors file written by sparsekv_jax.sae.export "
                                  "(or shipped:NAME, e.g. shipped:smollm2)")
    p.add_argument("out", help="where to write the control (.safetensors; its .json record beside it)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random directions (0 <= seed < 2**32)")
    a = p.parse_args(argv)
    from safetensors import SafetensorError

    if not 0 <= a.seed < 2**32:
        p.error(f"--seed {a.seed} must be in [0, 2**32)")
    try:
        source = resolve_source(a.source)
        path, record_path, rec = write_control(source, a.out, a.seed)
    except (FileNotFoundError, ValueError, SafetensorError) as e:
        p.error(f"{a.source}: {e}" if isinstance(e, SafetensorError) else str(e))
    print(f"control of {source} (sha256 {rec['control']['source_sha256']}), seed {a.seed}: layers {rec['layers']}, "
          f"width {rec['width']}, k {rec['k']}, {rec['dtype']}")
    print(f"sha256 {sha256(path)}  {path}")
    print(f"sha256 {sha256(record_path)}  {record_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
