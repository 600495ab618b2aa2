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
# # Policy explorer: what each policy keeps and reads
#
# On one needle prompt: which positions each compressor keeps, per layer and KV head; which pages
# a decode-time selector reads at the first decode step; and how much of full attention's
# probability mass (at that step) the kept or read entries carry, against the budget.
# The first cell installs the project when it is not importable (on Colab set `SPARSEKV_REPO`).

# %%
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
    extra = "[cuda12]" if shutil.which("nvidia-smi") else ""  # the CUDA build of JAX on a GPU runtime
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "-e", f"{root}{extra}"], check=True)
    sys.path.insert(0, str(root))

# %%
import jax
import jax.numpy as jnp
import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

TINY = os.environ.get("SPARSEKV_NOTEBOOK_TINY") == "1"  # CI: tiny sizes on a CPU
OUT = Path(os.environ.get("SPARSEKV_NOTEBOOK_OUT", "notebook_out"))
OUT.mkdir(parents=True, exist_ok=True)
LENGTH = 256 if TINY else 2048
BUDGETS = (0.25,) if TINY else (0.05, 0.1, 0.25, 0.5)
COMPRESSORS = ("snapkv",) if TINY else ("streamingllm", "snapkv", "h2o", "semanticache", "bser")

# %% [markdown]
# ## The prompt, and where the needle is

# %%
import sparsekv_jax as skv
from sparsekv_jax.eval.batching import encode
from sparsekv_jax.eval.ruler import generate_samples

params, tokenizer = skv.load("smollm2", progress=False)
cfg = params.config
sample = generate_samples("niah_single_1", LENGTH, 1, 0, tokenizer, chat=True)[0]
context, question = encode(tokenizer, sample)
tokens = np.asarray([context + question])
question_start = np.asarray([len(context)])
T = tokens.shape[1]
start = sample.context.index(sample.answers[0])
offsets = tokenizer(sample.context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
needle = [i for i, (a, b) in enumerate(offsets) if a < start + len(sample.answers[0]) and b > start]
print(f"{T} tokens; needle {sample.answers[0]!r} at tokens {needle[0]}..{needle[-1]}")

# %% [markdown]
# ## Kept positions of each compressor
#
# `generate(...).cache` is the compressed cache itself: `cache.layers.positions` `[L, B, H_kv, S]`
# holds the RoPE position of every entry kept (−1 for an empty slot). One image per policy: a row
# per (layer, KV head), a column per prompt position, white = kept. The red line is the needle.
# Policies not registered in this version are skipped.

# %%
from sparsekv_jax.generate import generate
from sparsekv_jax.policies import parse_policy
from sparsekv_jax.policies.spec import REGISTRY


def kept_map(policy):
    """``[L * H_kv, T]`` bool: which prompt positions each (layer, KV head) kept."""
    out = generate(params, policy.with_tokenizer(tokenizer), tokens, question_start=question_start,
                   max_new_tokens=1)
    pos = np.asarray(out.cache.layers.positions)[:, 0]  # [L, H, S]
    kept = np.zeros(pos.shape[:2] + (T,), bool)
    l_idx, h_idx, s_idx = np.nonzero((pos >= 0) & (pos < T))
    kept[l_idx, h_idx, pos[l_idx, h_idx, s_idx]] = True
    return kept.reshape(-1, T)


names = [n for n in COMPRESSORS if n in REGISTRY]
maps = {n: kept_map(parse_policy(f"{n}(0.25)")) for n in names}
fig, axes = plt.subplots(len(maps), 1, figsize=(10, 1.6 * len(maps) + 0.6), squeeze=False)
for ax, (n, m) in zip(axes[:, 0], maps.items(), strict=True):
    ax.imshow(m, aspect="auto", cmap="gray", interpolation="nearest")
    ax.axvline(needle[0], color="red", lw=0.8)
    ax.set_ylabel(f"{n}\nlayer x head", fontsize=8)
    ax.set_yticks([])
axes[-1, 0].set_xlabel("prompt position")
fig.suptitle("kept at budget 0.25 (white), needle in red")
fig.tight_layout()
fig.savefig(OUT / "explorer_kept.png", dpi=110)

# %% [markdown]
# ## Recording what a decode step reads: a 10-line policy
#
# The protocol lets a decode policy see the attention probabilities of every step
# (`needs_decode_probs`, `decode_observe`). Subclassing a policy to *record* them is enough to see
# what it reads: the probabilities are zero outside the pages it selected. `decode_init` returns
# the per-layer state (leading `[L]` axis) the layer scan carries; `decode_step` hands it back.

# %%
from flax import struct

from sparsekv_jax.engine import decode_step, prepare, setup
from sparsekv_jax.policies import Dense, Quest


def recording(cls):
    """``cls`` that also sums each layer's attention probabilities over decode steps."""

    @struct.dataclass
    class Recording(cls):
        stages = tuple(dict.fromkeys((*cls.stages, "decode")))
        needs_decode_probs = True

        def decode_init(self, cache, observations):
            L, B, _, S = cache.layers.positions.shape
            return jnp.zeros((L, B, cfg.num_heads, S), jnp.float32), None

        def decode_observe(self, layer_state, probs, kv):
            return layer_state + probs

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


def first_step_probs(policy):
    """``[L, Hq, S]`` attention probabilities of the first decode step under ``policy``."""
    run = setup(params, policy, tokens, max_new_tokens=2, page_size=16, capacity=T + 16)

    @jax.jit
    def first_step(params, run):
        ready = prepare(params, run)
        token = jnp.argmax(ready.logits, -1).astype(jnp.int32)
        return decode_step(params, run.policy, ready.cache, token, ready.state).state[0]

    return np.asarray(first_step(params, run))[:, 0]


dense_probs = first_step_probs(recording(Dense)())
quest_probs = first_step_probs(recording(Quest)(budget=0.25))
read = (quest_probs > 0)[:, :, :T].reshape(-1, T)
fig, axes = plt.subplots(2, 1, figsize=(10, 4.5))
axes[0].imshow(np.log10(dense_probs[:, :, :T].reshape(-1, T) + 1e-6), aspect="auto", interpolation="nearest")
axes[0].set_title("full attention at the first decode step: log10 probability, row = (layer, query head)")
axes[1].imshow(read, aspect="auto", cmap="gray", interpolation="nearest")
axes[1].set_title("Quest(0.25): positions on the pages it read (white); first 2 layers are dense")
for ax in axes:
    ax.axvline(needle[0], color="red", lw=0.8)
    ax.set_yticks([])
fig.tight_layout()
fig.savefig(OUT / "explorer_reads.png", dpi=110)

# %% [markdown]
# ## Attention mass captured against budget
#
# For each compressor and budget, the share of full attention's probability mass (first decode
# step, mean over layers and query heads) that falls on the entries it kept; for Quest, on the
# pages it read. A policy that keeps what attention needs sits high at small budgets.

# %%
G = cfg.num_heads // cfg.num_kv_heads
dense = dense_probs[:, :, :T]  # [L, Hq, T]


def captured(kept):  # kept [L * H_kv, T] -> mean over layers and query heads of the mass on kept entries
    k = np.repeat(kept.reshape(cfg.num_layers, cfg.num_kv_heads, T), G, axis=1)
    return float((dense * k).sum(-1).mean() / dense.sum(-1).mean())


curves = {n: [captured(maps[n] if b == 0.25 else kept_map(parse_policy(f"{n}({b})"))) for b in BUDGETS]
          for n in names}


def quest_read(b):  # [L * H_kv, T]: positions on the pages Quest(b) read for any query head of the group
    probs = quest_probs if b == 0.25 else first_step_probs(recording(Quest)(budget=b))
    return (probs > 0)[:, :, :T].reshape(cfg.num_layers, cfg.num_kv_heads, G, T).any(2).reshape(-1, T)


curves["quest"] = [captured(quest_read(b)) for b in BUDGETS]
fig, ax = plt.subplots(figsize=(5, 3.5))
for n, ys in curves.items():
    ax.plot(BUDGETS, ys, marker="o", label=n)
ax.plot(BUDGETS, BUDGETS, ls=":", color="gray", label="uniform")
ax.set_xlabel("budget (fraction of the prompt)")
ax.set_ylabel("attention mass captured")
ax.set_ylim(0, 1.02)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "explorer_mass.png", dpi=110)
print({n: [round(y, 3) for y in ys] for n, ys in curves.items()})
