"""Issue 37, "why the latents die": the arms of `PHASE=dead bash scripts/sae_paper_gpu.sh`, side by side.

Each arm is a short `train-sae` run (layers 0 and 25, --dead-after 2000000) whose `curves.csv` came back in
``ROOT/dead_<arm>/``. This prints, per arm and layer, the dead fraction (training's window) and FVU at the last step
that every arm reached, and draws the dead fraction and FVU along the run (one panel per layer).

    python experiments/sae_dead_arms.py docs/results/sae_dead_qwen_h200 [--out docs/results/sae_dead_qwen_h200]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

# what each arm changes against the baseline (scripts/sae_paper_gpu.sh, PHASE=dead's ARMS)
ARMS = {
    "base": "the paper's config (AuxK on)",
    "aux0": "--aux-coef 0 (AuxK off)",
    "bias3": "--dead-bias-step 1e-3",
    "bias2": "--dead-bias-step 1e-2",
    "data": "--w-dec-init data",
    "k32": "--k 32",
    "lr": "--lr 2e-4",
}


def read_arms(root: Path) -> dict[str, list[dict[str, float]]]:
    """Every ``dead_<arm>/curves.csv`` under ``root``, as float rows, in `ARMS` order."""
    arms = {}
    for name in ARMS:
        path = root / f"dead_{name}" / "curves.csv"
        if path.is_file():
            with path.open() as f:
                arms[name] = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    if not arms:
        raise SystemExit(f"{root}: no dead_<arm>/curves.csv (arms: {', '.join(ARMS)})")
    return arms


def table(arms: dict[str, list[dict[str, float]]]) -> tuple[int, str]:
    """A markdown table at the last step all arms logged, and that step."""
    step = int(min(max(r["step"] for r in rows) for rows in arms.values()))
    layers = sorted({int(r["layer"]) for rows in arms.values() for r in rows})
    head = "| arm | change | " + " | ".join(f"layer {la} dead | layer {la} FVU" for la in layers) + " |"
    lines = [head, "|---|---|" + "---:|---:|" * len(layers)]
    for name, rows in arms.items():
        at = {int(r["layer"]): r for r in rows if int(r["step"]) == step}
        cells = [f"{at[la]['dead_fraction']:.3f} | {at[la]['fvu']:.2e}" if la in at else "– | –" for la in layers]
        lines.append(f"| {name} | {ARMS[name]} | " + " | ".join(cells) + " |")
    return step, "\n".join(lines)


def plot(arms: dict[str, list[dict[str, float]]], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = sorted({int(r["layer"]) for rows in arms.values() for r in rows})
    fig, axes = plt.subplots(2, len(layers), figsize=(5.5 * len(layers), 7), sharex=True, squeeze=False)
    for col, la in enumerate(layers):
        for name, rows in arms.items():
            pts = [(r["step"], r["dead_fraction"], r["fvu"]) for r in rows if int(r["layer"]) == la]
            steps, dead, fvu = zip(*pts, strict=True)
            axes[0][col].plot(steps, dead, label=f"{name}: {ARMS[name]}")
            axes[1][col].plot(steps, fvu, label=name)
        axes[0][col].set_title(f"layer {la}")
        axes[0][col].set_ylabel("dead fraction (training window)")
        axes[0][col].axhline(0.05, color="grey", lw=0.8, ls=":")
        axes[1][col].set_ylabel("FVU")
        axes[1][col].set_yscale("log")
        axes[1][col].set_xlabel("step")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Qwen2.5-Coder-1.5B key SAEs: why the latents die (issue 37)")
    fig.tight_layout()
    path = out / "dead_arms.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="folder holding dead_<arm>/curves.csv")
    parser.add_argument("--out", type=Path, default=None, help="where dead_arms.png goes (default: root)")
    args = parser.parse_args(argv)
    arms = read_arms(args.root)
    step, text = table(arms)
    print(f"at step {step} (the last step every arm logged):\n{text}")
    print(plot(arms, args.out or args.root))


if __name__ == "__main__":
    main()
