"""A control SAE set for S³ (issue 37): the trained set's layers, width, k, dtype and centring, random directions.

Is S3Hybrid's gain over BM25 the SAEs' doing, or the structure's (half the budget to spans that are not BM25's
ranking, span shapes, lead/tail)? Run S3Pure / S3Hybrid with the trained SAEs and with this control on the same
samples at the same budget (``s3_retrieval_quality.py --saes A=... --saes B=...``). Per layer the control has:

* the trained ``b_dec`` (pre-encoder bias): keys and queries are centred as before (pre-RoPE keys have large
  offsets), so only what the directions learned is taken away;
* random unit decoder rows (seeded, isotropic: ``init_sae``'s draw), the encoder tied to them (``w_enc = w_decᵀ``)
  and scaled to the trained encoder's median column norm, so query activations, which weight S³'s scores and
  thereby the layers against each other, keep the trained set's magnitude per layer;
* ``b_enc = 0``: no latent is favoured whatever the key; about half of a centred vector's ``width``
  pre-activations are positive (``width`` / 2 ≫ k), so the top-k still picks k active latents;
* with ``--dead-like-source``, as many latents as the source's record counts dead on held-out keys get a zero
  encoder column (never active): the trained set's number of live latents (3% of 16,384 in Qwen's paper run). A
  key then has fewer than k features where fewer than k live latents are positive.

It is not a set that ignores the keys: a random dictionary with a top-k is a random-projection hash (SimHash-like),
so a query still shares features with keys of similar centred direction. It asks what the *learned* dictionary
adds over random features of the same shapes and cost.

    python experiments/s3_control_saes.py shipped:smollm2 /tmp/control_smollm2.safetensors --seed 0

The record (metadata and ``.json``) keeps the source's model, layers and key description, drops its training
statistics and adds ``control``: the source's file name (no directory: the bytes written depend only on the
source's bytes and the options) and sha256, the seed. Prints the sha256 of both files written.
"""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any

import numpy as np

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


def control_saes(saes: dict[int, Any], seed: int, dead: dict[int, float] | None = None) -> tuple[tuple[int, ...], Any]:
    """``(layers, stacked TopKSAE)``: random tied directions, the source's ``b_dec`` and per-layer encoder scale;
    ``dead`` ``{layer: fraction}``: that share of latents (a seeded random choice) gets a zero encoder column."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax.sae.export import stack_saes
    from sparsekv_jax.sae.model import init_sae

    if not 0 <= seed < 2**32:
        raise ValueError(f"seed={seed} must be in [0, 2**32)")
    layers, src = stack_saes(saes)
    ctl = init_sae(jax.random.key(seed), src.d_in, src.width, src.k, stack=src.stack_shape, b_dec=src.b_dec)
    scale = jnp.median(jnp.linalg.norm(src.w_enc, axis=-2), axis=-1)  # [L]: the median latent's encoder norm
    w_enc = np.array(ctl.w_enc * scale[:, None, None])
    for i, layer in enumerate(layers if dead else ()):
        n = round(dead[layer] * src.width)
        if not 0 <= n <= src.width - src.k:
            raise ValueError(f"dead fraction {dead[layer]} of layer {layer} leaves fewer than k={src.k} latents")
        w_enc[i, :, np.random.default_rng([seed, layer]).permutation(src.width)[:n]] = 0.0
    return layers, ctl.replace(w_enc=jnp.asarray(w_enc))


def write_control(source: str | Path, out: str | Path, seed: int,
                  dead_like_source: bool = False) -> tuple[Path, Path, dict[str, Any]]:
    """Write the control of SAE file ``source`` to ``out`` (``.safetensors``); returns both paths and the record.
    ``dead_like_source``: as many dead latents per layer as the source's record says (its held-out evaluation)."""
    from sparsekv_jax.sae.export import load_saes, save_saes

    source, out = Path(source), Path(out)
    if out.suffix != ".safetensors":
        raise ValueError(f"output {out} must end in .safetensors")
    if out.exists() and out.resolve() == source.resolve():
        raise ValueError(f"output {out} is the source file: it would overwrite the trained SAEs")
    saes, rec = load_saes(source)
    dead = {int(h["layer"]): float(h["dead_fraction"]) for h in rec.get("heldout", []) if "dead_fraction" in h}
    if dead_like_source and set(dead) != set(saes):
        raise ValueError(f"{source}: its record has held-out dead fractions for layers {sorted(dead)}, not "
                         f"{sorted(saes)}")
    layers, stack = control_saes(saes, seed, dead if dead_like_source else None)
    record = {**{k: rec[k] for k in KEEP if k in rec},
              "control": {"source": source.name, "source_sha256": sha256(source), "seed": seed,
                          "directions": "random unit decoder rows, tied encoder scaled to the source's median "
                                        "encoder column norm per layer, b_enc 0, source b_dec (experiments/"
                                        "s3_control_saes.py)"}}
    record["layers"] = list(layers)
    if dead_like_source:  # only then: the plain control's bytes stay those of earlier runs
        record["control"]["dead_latents"] = [round(dead[i] * stack.width) for i in layers]
    path, record_path = save_saes(out, stack, record, dtype=rec.get("dtype", "float32"))
    return path, record_path, {**record, "k": stack.k, "width": stack.width, "dtype": rec.get("dtype", "float32")}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="trained SAEs: a .safetensors file written by sparsekv_jax.sae.export "
                                  "(or shipped:NAME, e.g. shipped:smollm2)")
    p.add_argument("out", help="where to write the control (.safetensors; its .json record beside it)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random directions (0 <= seed < 2**32)")
    p.add_argument("--dead-like-source", action="store_true", help="zero the encoder of as many latents per layer "
                   "as the source's record counts dead (held-out): the same number of live latents")
    a = p.parse_args(argv)
    from safetensors import SafetensorError

    if not 0 <= a.seed < 2**32:
        p.error(f"--seed {a.seed} must be in [0, 2**32)")
    try:
        source = resolve_source(a.source)
        path, record_path, rec = write_control(source, a.out, a.seed, a.dead_like_source)
    except (FileNotFoundError, ValueError, SafetensorError) as e:
        p.error(f"{a.source}: {e}" if isinstance(e, SafetensorError) else str(e))
    print(f"control of {source} (sha256 {rec['control']['source_sha256']}), seed {a.seed}: layers {rec['layers']}, "
          f"width {rec['width']}, k {rec['k']}, {rec['dtype']}, dead latents {rec['control'].get('dead_latents', 0)}")
    print(f"sha256 {sha256(path)}  {path}")
    print(f"sha256 {sha256(record_path)}  {record_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
