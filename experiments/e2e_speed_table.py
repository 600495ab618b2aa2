"""Markdown tables of `bench e2e` runs: each policy's time as a ratio to full attention **in the same run**.

Each ``--run NAME=FILE`` is one `python -m sparsekv_jax.bench.e2e --out FILE` run (its rows, a JSON list). A point's
ratio divides by full attention's (``Dense``) point of the same model, kind, context and batch in that file (the
median where the file holds it twice, e.g. a run that times full attention first and last); a point with no such
reference, or one that did not fit, has no ratio. Rows are points, columns runs, so repeats sit side by side; a file
that times several models (``--models a,b``) gets a model column::

    python experiments/e2e_speed_table.py --run a=qwen_e2e_a.json --run b=qwen_e2e_b.json \\
        --run isolated=qwen_e2e_isolated.json --out speed.md
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

GIB = 2.0**30
REFERENCE = "Dense"


def _point(row: dict) -> tuple:
    return row.get("model"), row.get("kind"), row.get("context"), row.get("batch")


def _time(row: dict) -> float | None:
    """The point's time: ms per decode step, or ms per prefill; ``None`` where it failed."""
    return None if "error" in row else row.get("ms_per_token", row.get("ms"))


def ratios(rows: list[dict]) -> list[tuple[dict, float | None]]:
    """Each row with its time over full attention's at the same point in ``rows`` (median of its repeats)."""
    reference: dict[tuple, list[float]] = {}
    for row in rows:
        if row.get("policy") == REFERENCE and _time(row) is not None:
            reference.setdefault(_point(row), []).append(_time(row))
    out = []
    for row in rows:
        ref, t = reference.get(_point(row)), _time(row)
        out.append((row, None if ref is None or t is None else t / statistics.median(ref)))
    return out


def table(runs: dict[str, list[dict]]) -> str:
    """One markdown table per kind (prefill, decode): a row per (policy, context, batch), a column group per run."""
    cells: dict[tuple, dict[str, tuple[dict, float | None]]] = {}
    for name, rows in runs.items():
        for row, ratio in ratios(rows):
            key = (row.get("kind"), row.get("model"), row.get("policy"), row.get("context"), row.get("batch"))
            if name in cells.setdefault(key, {}) and _time(cells[key][name][0]) is not None:
                continue  # a repeated point (full attention first and last): its first reading
            cells[key][name] = (row, ratio)
    models = {k[1] for k in cells}
    order = {p: i for i, p in enumerate(dict.fromkeys(k[2] for k in cells))}
    model_order = {m: i for i, m in enumerate(dict.fromkeys(k[1] for k in cells))}
    parts = []
    for kind, unit in (("prefill", "ms"), ("decode", "ms/token")):
        keys = sorted((k for k in cells if k[0] == kind), key=lambda k: (model_order[k[1]], order[k[2]], k[3], k[4]))
        if not keys:
            continue
        point = ["model"] * (len(models) > 1) + ["policy", "context", "batch"]
        head = point + [f"{unit} ({n}) · × full" for n in runs]
        head += ["tokens/s (first run)", "KV cache GiB", "peak GiB (XLA)"] if kind == "decode" else \
            ["blocks computed"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(point) + "---:|" * (len(head) - len(point))]
        for key in keys:
            row_cells, first = [], None
            for name in runs:
                row, ratio = cells[key].get(name, ({}, None))
                if not row:
                    row_cells.append("–")
                elif "error" in row:
                    row_cells.append(row["error"])
                else:
                    first = first or row
                    row_cells.append(f"{_time(row):.2f}" + (f" · {ratio:.2f}×" if ratio is not None else ""))
            if kind == "decode":
                extra = [f"{first['tokens_per_s']:,.0f}", f"{first['cache_bytes'] / GIB:.2f}",
                         f"{(first.get('memory_bytes') or 0) / GIB:.2f}"] if first else ["–"] * 3
            else:
                extra = [f"{first['prefill_block_fraction']:.2f}"] if first else ["–"]
            names = [str(key[1])] * (len(models) > 1) + [key[2], f"{key[3] // 1024}k", str(key[4])]
            lines.append("| " + " | ".join([*names, *row_cells, *extra]) + " |")
        parts.append("\n".join(lines))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run", action="append", required=True, metavar="NAME=FILE",
                    help="a bench e2e --out file, named for the table's column (repeat, in order)")
    ap.add_argument("--out", help="write the markdown here (default: print)")
    args = ap.parse_args(argv)
    runs = {}
    for spec in args.run:
        name, sep, path = spec.partition("=")
        if not sep or not name or not Path(path).is_file():
            ap.error(f"--run {spec!r}: expected NAME=FILE with an existing file")
        runs[name] = json.loads(Path(path).read_text())
    text = table(runs)
    if args.out:
        Path(args.out).write_text(text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
