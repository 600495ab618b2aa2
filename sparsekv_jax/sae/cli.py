"""``sparsekv train-sae`` and ``python sae_training/train.py``: train Top-K SAEs on key projections.

Every field of `sparsekv_jax.sae.run.RunConfig` is an option (``--batch-size``, ``--layers 0,11``);
values given on the command line override the ``--config`` YAML file, which overrides the defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import typing
from pathlib import Path

from sparsekv_jax.sae.config import RESUMABLE_FIELDS, RunConfig

EPILOG = """\
examples:
  sparsekv train-sae --config sae_training/configs/smollm2.yaml --out runs/sae
  sparsekv train-sae --out runs/sae --resume                      # after an interruption
  sparsekv train-sae --out runs/sae --resume --steps 12000 --change steps
  python sae_training/train.py --config sae_training/configs/smollm2.yaml --model /tmp/smollm2.gguf \\
      --max-minutes 5 --out $OUT/sae

writes to --out: config.yaml, checkpoints/ (orbax), curves.csv, curves.png, NAME.safetensors and
NAME.json (model, layers, corpus, steps, k, width, held-out FVU / L0 / dead fraction per layer).
"""

HELP = {
    "config": "YAML file of config keys (the option names with '_' for '-')",
    "out": "output folder (checkpoints, curves, exported SAEs)",
    "name": "stem of the exported NAME.safetensors / NAME.json",
    "model": "'smollm2' (embedded), a HF model directory or a .gguf file",
    "layers": "target layers, comma-separated (one SAE each)",
    "corpus": "'kjv' (the training text), 'wikitext2' (its test split), .txt files / folders; comma-separated",
    "steps": "optimizer steps (the schedule's length)",
    "max_minutes": "fit the run into this many minutes: fewer steps if they do not fit",
    "batch_size": "key vectors per layer per step (tokens x KV heads)",
    "width": "latents per SAE",
    "k": "active latents per vector",
    "topk": "top-k algorithm: auto | lax | blocked | threshold | fused (encoder + top-k in one GPU kernel)",
    "decode": "decoder gather: auto | xla | pallas",
    "cache_dir": "cache of embedded models and fetched data",
    "checkpoint_dir": "where orbax checkpoints go (default OUT/checkpoints)",
}


def _parse_layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers {text!r}: expected comma-separated integers") from None


def _option_type(field: dataclasses.Field, hints: dict[str, typing.Any]):
    if field.name == "layers":
        return _parse_layers
    hint = hints[field.name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return args[0]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The train-sae options (one per `RunConfig` field, plus --config, --resume, --stop-at, -q)."""
    parser.add_argument("--config", default=None, metavar="FILE", help=HELP["config"])
    hints = typing.get_type_hints(RunConfig)
    for field in dataclasses.fields(RunConfig):
        default = field.default
        shown = ",".join(map(str, default)) if isinstance(default, tuple) else default
        parser.add_argument(f"--{field.name.replace('_', '-')}", dest=field.name, type=_option_type(field, hints),
                            default=None, metavar=field.name.upper(),
                            help=f"{HELP.get(field.name, '')} (default {shown})".strip())
    parser.add_argument("--resume", action="store_true",
                        help="continue the run in --out from its newest checkpoint; options not given are taken "
                             "from its config.yaml, and those given must equal it (see --change)")
    parser.add_argument("--overwrite", action="store_true",
                        help="start over in a non-empty --out: delete its checkpoints, curves and exported SAEs "
                             "(without --resume or --overwrite a non-empty --out is refused)")
    parser.add_argument("--change", type=_parse_fields, default=(), metavar="FIELD[,FIELD]",
                        help="with --resume: let these fields differ from the run's config.yaml; only "
                             f"{', '.join(RESUMABLE_FIELDS)} may (docs/INTERRUPTION.md)")
    parser.add_argument("--stop-at", type=int, default=None, metavar="STEP",
                        help="stop after STEP (checkpointed); a later --resume continues the same run")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar or table")


def _parse_fields(text: str) -> tuple[str, ...]:
    return tuple(x.strip().replace("-", "_") for x in text.split(",") if x.strip())


def config_from_args(args: argparse.Namespace) -> RunConfig:
    """The run's config: defaults < ``--config`` file (or, on ``--resume`` without one, the run's
    ``config.yaml``) < options given."""
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(RunConfig)}
    if args.config is not None:
        return RunConfig.from_yaml(args.config, **overrides)
    saved = Path(args.out or RunConfig.out) / "config.yaml"
    if getattr(args, "resume", False) and saved.is_file():
        return RunConfig.from_yaml(saved, **overrides)
    return RunConfig.from_dict({k: v for k, v in overrides.items() if v is not None})


def cmd_train_sae(args: argparse.Namespace) -> int:
    """Run the training and print the held-out table."""
    from sparsekv_jax.sae.run import run

    try:
        cfg = config_from_args(args)
        record = run(cfg, resume=args.resume, overwrite=args.overwrite, change=args.change, stop_at=args.stop_at,
                     progress=not args.quiet)
    except (ValueError, FileNotFoundError) as e:
        print(f"sparsekv train-sae: error: {e}", file=sys.stderr)
        return 2
    if "heldout" not in record:
        if not args.quiet:
            print(f"stopped at step {record['stopped_at']} of {record['total_steps']}; continue with --resume",
                  file=sys.stderr)
        return 0
    if not args.quiet:
        print(f"{'layer':>5} {'FVU keys':>9} {'FVU queries':>11} {'L0':>6} {'dead':>6}   (held-out, "
              f"{record['steps']} steps, k={record['k']}, width={record['width']})")
        for r in record["heldout"]:
            print(f"{r['layer']:>5} {r['fvu']:>9.4f} {r['fvu_queries']:>11.4f} {r['l0']:>6.1f} "
                  f"{r['dead_fraction']:>6.3f}")
        print(f"[{cfg.out}: {cfg.name}.safetensors, {cfg.name}.json, curves.csv, curves.png, checkpoints/]",
              file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="train-sae", description=DESCRIPTION, epilog=EPILOG,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return parser


DESCRIPTION = ("Train one Top-K sparse autoencoder per target layer on the model's pre-RoPE key projections "
               "(S³-Attention), streamed from a text corpus through a shuffle buffer.")


def register(subparsers) -> None:
    """Add ``train-sae`` to the ``sparsekv`` command's subparsers."""
    p = subparsers.add_parser("train-sae", help="train Top-K SAEs on key projections (S³)", description=DESCRIPTION,
                              epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    p.set_defaults(func=cmd_train_sae)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return cmd_train_sae(args)
