# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Budget frontier: score against KV budget, every policy
#
# Reads the JSON that `sparsekv eval` writes (`summary.json` in its `--out` folder) and plots each
# policy's average score against what it keeps (*KV stored*: entries kept after compression over the
# prompt) and what it reads per decode step (*KV read*). By default it plots the runs recorded in
# `docs/results/` (SmolLM2-135M-Instruct, RULER at 4k and 8k, 25 samples per task); point `RUNS` at
# your own `--out` folders to add yours. One command makes such a folder, e.g.
#
#     sparsekv eval --model smollm2 --suite ruler --lengths 4k --n 25 \
#         --policies "fullkv, snapkv(0.1), snapkv(0.25), snapkv(0.5), quest(0.25), \
#                     chess('moderate', calibration='smollm2')" \
#         --out runs/frontier4k

# %%
# Install the project when it is not importable: inside a checkout, that checkout; on Colab, a clone
# of $SPARSEKV_REPO (set it to the project's git URL first). The CUDA build of JAX on a GPU runtime.
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

if importlib.util.find_spec("sparsekv_jax") is None:
    root = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "pyproject.toml").is_file()), None)
    if root is None:  # Colab: clone the project first
        repo = os.environ.get("SPARSEKV_REPO") or input("git URL of sparsekv-jax: ")
        subprocess.run(["git", "clone", "--depth", "1", repo, "sparsekv-jax"], check=True)
        root = Path("sparsekv-jax").resolve()
    extra = "[cuda12]" if shutil.which("nvidia-smi") else ""
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{root}{extra}"], check=True)
    sys.path.insert(0, str(root))

# %%
import json

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

import sparsekv_jax

TINY = os.environ.get("SPARSEKV_NOTEBOOK_TINY") == "1"  # CI: tiny sizes on a CPU
OUT = Path(os.environ.get("SPARSEKV_NOTEBOOK_OUT", "notebook_out"))
OUT.mkdir(parents=True, exist_ok=True)
# the recorded runs: docs/results beside the package in a checkout (a clone on Colab)
RESULTS = Path(sparsekv_jax.__file__).resolve().parents[1] / "docs" / "results"
RUNS = {
    "4k": [RESULTS / "ruler4k", RESULTS / "ruler4k_chess_stem"],
    "8k": [RESULTS / "ruler8k", RESULTS / "ruler8k_chess_stem"],
}
if TINY:
    RUNS = {"4k": RUNS["4k"]}

# %% [markdown]
# ## Load the summaries
#
# Each row of `summary.json` is one policy: its `average` over the task columns, `kept_pct` (its
# average over full attention's), `kv_stored_fraction` and `kv_read_fraction` (means over samples).

# %%


def load_rows(folders):
    """Rows of every ``summary.json`` in ``folders`` (full attention once)."""
    rows, seen = [], set()
    for folder in folders:
        summary = json.loads((Path(folder) / "summary.json").read_text())
        for row in summary["rows"]:
            if row["policy"] not in seen:
                seen.add(row["policy"])
                rows.append(row)
    return rows


tables = {length: load_rows(folders) for length, folders in RUNS.items()}
for length, rows in tables.items():
    print(f"RULER {length}")
    for r in rows:
        print(f"  {r['policy']:<52}{r['average']:>7.2f}  stored {r['kv_stored_fraction']:.2f}"
              f"  read {r['kv_read_fraction']:.2f}")

# %% [markdown]
# ## The frontier
#
# Up and to the left is better: the same score for less memory (left panel) or less reading per
# decode step (right panel). Full attention sits at (1, its score); a compressor moves left in the
# left panel, a decode-time selector (Quest, CHESS) in the right one.

# %%


def family(policy: str) -> str:
    return policy.split("(")[0]


fig, axes = plt.subplots(len(tables), 2, figsize=(10, 3.6 * len(tables)), squeeze=False)
colors = {}
for (length, rows), (ax_stored, ax_read) in zip(tables.items(), axes, strict=True):
    for r in rows:
        c = colors.setdefault(family(r["policy"]), f"C{len(colors)}")
        for ax, x in ((ax_stored, r["kv_stored_fraction"]), (ax_read, r["kv_read_fraction"])):
            ax.scatter(x, r["average"], color=c, s=30)
            ax.annotate(r["policy"].replace(", calibration='smollm2'", ""), (x, r["average"]), fontsize=6,
                        xytext=(3, 2), textcoords="offset points")
    for ax, what in ((ax_stored, "KV stored"), (ax_read, "KV read per decode step")):
        ax.set_xlim(0, 1.1)
        ax.set_xlabel(f"{what} (fraction of full attention)")
        ax.set_ylabel("RULER average")
        ax.set_title(f"SmolLM2, RULER {length}: score against {what}", fontsize=9)
        ax.grid(alpha=0.3)
fig.tight_layout()
fig.savefig(OUT / "frontier.png", dpi=120)

# %% [markdown]
# ## Per task
#
# The average hides where a policy loses: retrieval tasks (`niah_*`) punish a policy that drops
# the needle, aggregation tasks (`cwe`, `fwe`) much less.

# %%
rows = tables["4k"]
columns = list(rows[0]["scores"])
fig, ax = plt.subplots(figsize=(10, 3.8))
width = 0.8 / len(rows)
for i, r in enumerate(rows):
    ax.bar([j + i * width for j in range(len(columns))], [r["scores"].get(c, 0) for c in columns], width,
           label=r["policy"].replace(", calibration='smollm2'", ""))
ax.set_xticks([j + 0.4 - width / 2 for j in range(len(columns))], [c.split("@")[0] for c in columns], rotation=30,
              ha="right", fontsize=8)
ax.set_ylabel("score")
ax.legend(fontsize=6, ncol=3)
fig.tight_layout()
fig.savefig(OUT / "frontier_tasks.png", dpi=120)
