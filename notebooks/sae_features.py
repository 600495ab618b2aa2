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
# # SAE features of SmolLM2's keys
#
# The Top-K sparse autoencoders shipped with the package (`sparsekv_jax.sae.load_shipped("smollm2")`,
# trained on SmolLM2-135M-Instruct's pre-RoPE key projections; docs/SAE.md) turn each key vector into
# `k` active features out of 8,192. This notebook shows, on WikiText-2 text: the tokens whose keys
# activate a feature most, and how often each feature fires (the density curve).
#
# S³-Attention retrieves spans of the prompt by these features; the section at the end is where
# its retrieved spans for a needle question are shown at the end.

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
import jax.numpy as jnp
import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

TINY = os.environ.get("SPARSEKV_NOTEBOOK_TINY") == "1"  # CI: tiny sizes on a CPU
OUT = Path(os.environ.get("SPARSEKV_NOTEBOOK_OUT", "notebook_out"))
OUT.mkdir(parents=True, exist_ok=True)
ROWS, SEQ = (2, 128) if TINY else (8, 1024)  # text rows x tokens per row

# %% [markdown]
# ## The model, the SAEs and some text

# %%
import sparsekv_jax as skv
from sparsekv_jax.sae import encode, load_shipped, projections
from sparsekv_jax.sae.data import load_corpus, tokenize

params, tokenizer = skv.load("smollm2", progress=False)
saes, record = load_shipped("smollm2")
LAYERS = tuple(sorted(saes))[:2] if TINY else tuple(sorted(saes))
print(f"SAEs for layers {sorted(saes)}: width {saes[LAYERS[0]].width}, k {saes[LAYERS[0]].k}; showing {LAYERS}")
corpus = load_corpus("wikitext2")
ids = tokenize(tokenizer, corpus.heldout)  # held-out text: not what the SAEs trained on
tokens = np.asarray(ids[: ROWS * SEQ]).reshape(ROWS, SEQ)

# %% [markdown]
# ## Encode the keys
#
# `projections` runs the model and returns the pre-RoPE keys `[layers, B, T, H_kv, D]` of the
# requested layers; `encode(sae, keys)` gives the `k` active feature ids and their activations per
# key vector (one SAE per layer, shared by the KV heads).

# %%
keys, _ = projections(params, jnp.asarray(tokens), LAYERS)
codes = {layer: tuple(np.asarray(a) for a in encode(saes[layer], keys[i])) for i, layer in enumerate(LAYERS)}
ids0, acts0 = codes[LAYERS[-1]]
print("ids", ids0.shape, "activations", acts0.shape)  # [B, T, H_kv, k]

# %% [markdown]
# ## Top-activating tokens per feature
#
# For the most frequent features of the last layer shown: the tokens whose key (any KV head) gives
# the feature its largest activations, with a little context (the token in brackets).

# %%


def top_tokens(layer: int, feature: int, n: int = 5, context: int = 4) -> list[str]:
    """The ``n`` token contexts where ``feature`` of ``layer``'s SAE is most active."""
    ids, acts = codes[layer]
    a = np.where(ids == feature, acts, 0).max(axis=(2, 3))  # [B, T]: its activation at each token
    order = np.argsort(a, axis=None)[::-1][:n]
    out = []
    for b, t in zip(*np.unravel_index(order, a.shape), strict=True):
        if a[b, t] <= 0:
            break
        left = tokenizer.decode(tokens[b, max(0, t - context):t])
        right = tokenizer.decode(tokens[b, t + 1:t + 1 + context])
        out.append(f"{a[b, t]:6.2f}  {left}[{tokenizer.decode(tokens[b, t:t + 1])}]{right}".replace("\n", " "))
    return out


layer = LAYERS[-1]
ids, acts = codes[layer]
counts = np.bincount(ids[acts > 0].ravel(), minlength=saes[layer].width)
for feature in np.argsort(counts)[::-1][: 3 if TINY else 8]:
    print(f"layer {layer}, feature {feature} (fires on {counts[feature] / ids[..., 0].size:.1%} of key vectors)")
    for line in top_tokens(layer, int(feature)):
        print("   ", line)

# %% [markdown]
# ## Feature density
#
# The fraction of key vectors on which each feature fires, sorted, per layer. A healthy Top-K SAE
# has few dead features (density 0) and no feature that fires on nearly everything.

# %%
fig, ax = plt.subplots(figsize=(6, 3.5))
for layer in LAYERS:
    ids, acts = codes[layer]
    density = np.bincount(ids[acts > 0].ravel(), minlength=saes[layer].width) / ids[..., 0].size
    ax.plot(np.sort(density)[::-1], label=f"layer {layer} ({(density == 0).mean():.0%} silent here)")
ax.set_yscale("log")
ax.set_xlabel("feature rank")
ax.set_ylabel("firing density")
ax.set_title(f"SmolLM2 key SAEs on {tokens.size} held-out WikiText-2 tokens", fontsize=9)
ax.legend(fontsize=7)
fig.tight_layout()
fig.savefig(OUT / "sae_density.png", dpi=120)

# %% [markdown]
# ## Spans retrieved for a question (S³)
#
# S³-Attention (`S3Hybrid`, a `context`-stage policy) scans the context in chunks, indexes each
# token's key features, scores every position by the features it shares with the question's
# queries, and keeps sentence spans around the best centres, BM25's best passages and a little lead
# and tail, within a token budget. Here: held-out WikiText as the context, a needle sentence planted
# in it, and a question about the needle. The strip shows which context tokens each source keeps.

# %%
from sparsekv_jax.policies import S3Hybrid
from sparsekv_jax.retrieval import spans as s3_spans

CONTEXT = 512 if TINY else 4096
needle = tokenizer.encode(" The secret ingredient of the lighthouse keeper's soup is saffron.")
question = tokenizer.encode(" Question: what is the secret ingredient of the lighthouse keeper's soup? Answer:")
corpus_ids = np.asarray(tokenize(tokenizer, corpus.heldout))  # (`ids` was reused above)
text = corpus_ids[ROWS * SEQ: ROWS * SEQ + CONTEXT - len(needle)]  # text not shown above
depth = len(text) * 2 // 3
context = np.concatenate([text[:depth], needle, text[depth:]])
prompt = np.concatenate([context, question])[None].astype(np.int32)
lengths, question_start = np.array([prompt.shape[1]]), np.array([len(context)])
policy = S3Hybrid(budget=CONTEXT // 8, chunk=min(CONTEXT, 2048)).with_tokenizer(tokenizer)  # one chunk at tiny sizes
ctx, ql = policy.split(lengths, question_start)
scan = policy.scan(params, prompt, ctx, ql)  # the streaming scan, kept for the plot below
result = policy.context(params, prompt, lengths, question_start, scan=scan)
print(f"kept {result.info['kept_tokens'][0]} of {len(context)} context tokens; new prompt {result.lengths[0]} tokens")
print("the needle kept:", tokenizer.decode(needle) in tokenizer.decode(result.tokens[0, : result.lengths[0]]))

# %%
budgets = np.array([CONTEXT // 8])
sources, _ = policy.rank(params, prompt, ctx, ql, budgets, scan=scan)
fig, ax = plt.subplots(figsize=(7, 1.8))
for row, source in enumerate(sources):  # S³ spans, then BM25 passages
    for start, end, _centre in source[0]:
        ax.broken_barh([(start, end - start)], (row + 0.1, 0.8), color=f"C{row}", alpha=0.6)
kept = s3_spans.assemble(len(context), int(budgets[0]), policy.lead, policy.tail, [s[0] for s in sources])
ax.broken_barh([(int(t), 1) for t in np.flatnonzero(kept)], (2.1, 0.8), color="C2")
ax.axvspan(depth, depth + len(needle), color="red", alpha=0.25, label="needle")
ax.set_yticks([0.5, 1.5, 2.5], ["S³ ranked", "BM25 ranked", "kept (budget)"], fontsize=8)
ax.set_xlabel("context position")
ax.legend(fontsize=7, loc="upper left")
fig.tight_layout()
fig.savefig(OUT / "s3_spans.png", dpi=120)
