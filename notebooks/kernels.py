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
# # Kernels: what sparsity buys in time
#
# Plots the benchmark JSON recorded in `docs/results/` (GPU runs of `sparsekv_jax.bench.e2e` and
# `sparsekv_jax.bench.kernels`; docs/BENCHMARKS.md has the commands and the machines). On a GPU
# runtime the last section measures the page-sparse decode kernel live and plots it beside them.

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
import gzip
import json

import jax
import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt

import sparsekv_jax

TINY = os.environ.get("SPARSEKV_NOTEBOOK_TINY") == "1"  # CI: tiny sizes on a CPU
OUT = Path(os.environ.get("SPARSEKV_NOTEBOOK_OUT", "notebook_out"))
OUT.mkdir(parents=True, exist_ok=True)
RESULTS = Path(sparsekv_jax.__file__).resolve().parents[1] / "docs" / "results"
GPU = jax.default_backend() == "gpu"
print(jax.devices()[0].device_kind, "GPU" if GPU else "no GPU: recorded results only")


def rows_of(path):
    """Benchmark rows of a ``.json`` (a list, or ``{"rows": [...]}``) or ``.jsonl.gz`` file."""
    path = Path(path)
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            return [json.loads(line) for line in f if line.strip()]
    data = json.loads(path.read_text())
    return data["rows"] if isinstance(data, dict) else data


# %% [markdown]
# ## Decode: ms per token, full attention against CHESS and Quest (Llama-3.1-8B, H100 / H200)
#
# End-to-end decode steps of the whole model (`bench.e2e`): a decode-time selector reads a fraction
# of the pages, so its step time falls with the context while full attention's grows.

# %%
decode = [r for f in (RESULTS / "h200_2026-11-22d" / "e2e_1k_32k.json", RESULTS / "h100_2026-11-22" / "zc.json")
          for r in rows_of(f) if "ms_per_token" in r]
fig, ax = plt.subplots(figsize=(6, 3.5))
groups = {}
for r in decode:
    groups.setdefault((r["policy"], r["batch"], r["device"]), []).append((r["context"], r["ms_per_token"]))
for (policy, batch, device), pts in sorted(groups.items()):
    pts.sort()
    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
            label=f"{policy}, batch {batch} ({device.replace('NVIDIA ', '')})")
ax.set_xscale("log", base=2)
ax.set_xlabel("context (tokens)")
ax.set_ylabel("ms per decode step")
ax.set_title("Llama-3.1-8B decode step", fontsize=9)
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(OUT / "kernels_decode.png", dpi=120)

# %% [markdown]
# ## Prefill: Stem's block-sparse prefill against dense (Llama-3.1-8B, 128k, H100)

# %%
prefill = rows_of(RESULTS / "h100_2026-11-22" / "stem_prefill.jsonl.gz")
fig, ax = plt.subplots(figsize=(5, 3))
ax.bar([r["policy"] for r in prefill], [r["ms"] / 1e3 for r in prefill], color=["gray", "tab:blue"][: len(prefill)])
for i, r in enumerate(prefill):
    ax.text(i, r["ms"] / 1e3, f"{r['ms'] / 1e3:.1f} s\nblocks {r['prefill_block_fraction']:.0%}", ha="center",
            va="bottom", fontsize=8)
ax.set_ylabel("prefill seconds")
ax.set_title(f"prefill of {prefill[0]['context'] // 1024}k tokens, {prefill[0]['device']}", fontsize=9)
ax.margins(y=0.25)
fig.tight_layout()
fig.savefig(OUT / "kernels_prefill.png", dpi=120)

# %% [markdown]
# ## Live, on a GPU runtime: the page-sparse decode kernel
#
# `python -m sparsekv_jax.bench.kernels --mode decode` times our dense and page-sparse decode
# attention at a few densities and writes JSON rows; this cell runs it (SmolLM2's heads, 32k) and
# plots time against the fraction of pages read. Skipped without a GPU (Pallas runs interpreted on
# a CPU: far too slow to mean anything).

# %%
if GPU and not TINY:
    live = OUT / "kernels_live.json"
    subprocess.run([sys.executable, "-m", "sparsekv_jax.bench.kernels", "--mode", "decode", "--heads", "smollm",
                    "--lengths", "32k", "--out", str(live)], check=True)
    rows = [r for r in rows_of(live) if r.get("kind") == "decode" and "time_us" in r]
    fig, ax = plt.subplots(figsize=(5, 3.2))
    for B in sorted({r["B"] for r in rows}):
        pts = [r for r in rows if r["B"] == B and r["mode"].startswith(("rho=", "dense"))]
        xs = [1.0 if r["mode"] == "dense" else float(r["mode"][4:]) for r in pts]
        ax.plot(xs, [r["time_us"] for r in pts], marker="o", ls="", label=f"batch {B}")
    ax.set_xlabel("fraction of pages read (dense = 1)")
    ax.set_ylabel("decode attention, us")
    ax.set_title(f"{jax.devices()[0].device_kind}, SmolLM2 heads, 32k (live)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(OUT / "kernels_live.png", dpi=120)
else:
    print("no GPU runtime (or tiny mode): live kernel benchmark skipped")
