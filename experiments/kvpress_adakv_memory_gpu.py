"""Issue 38's kvpress row beside the page pool's Memory row: kvpress's AdaKV (PyTorch) on a random-weight
Llama-3.1-8B, whose peak memory does not drop (it masks evicted keys instead of freeing them).

    python experiments/kvpress_adakv_memory_gpu.py --out $OUT/kvpress_adakv.json     # one GPU, 32k, batch 1
    python experiments/kvpress_adakv_memory_gpu.py --tiny                            # CPU smoke test (toy model)

Runs in a PyTorch environment with kvpress (not the project's JAX venv): a random-weight
``transformers.LlamaForCausalLM`` built from Llama-3.1-8B's config (``--tiny``: a toy config, fp32, CPU),
bf16 on cuda, ``sdpa`` attention (kvpress's AdaKV refuses eager). A random prompt of ``--context`` (32k) tokens,
batch 1 (kvpress compresses batch 1 prompts; its pipeline takes one context). For each press -- none,
``SnapKVPress(compression_ratio=0.75)`` (keeps 25%) and ``AdaKVPress(SnapKVPress(compression_ratio=0.75))``
(``alpha_safeguard`` 0.2, kvpress's default and the paper's) -- inside ``with press(model)``: one forward of
the prompt into a ``DynamicCache`` (prefill, the press compressing each layer in its forward hook;
``logits_to_keep=1``), then ``--new-tokens`` (512) greedy tokens one forward each, positions continuing
from the prompt's as kvpress's pipeline passes them. Recorded after the prefill+compression and after the
decode: ``torch.cuda.memory_allocated`` and ``max_memory_allocated`` (peak since the press started; the
weights included, ``weights_bytes`` given), the cache's key/value bytes (``cache_bytes``: every layer's
tensors), and for AdaKV the entries it masks (``masked_entries``: kvpress overwrites them with a key whose
attention underflows to zero, in place; the tensors keep their size). A short table is printed last.

kvpress 0.5.5 declares ``transformers<5.3`` and ``import kvpress`` pulls in datasets, pandas and more; this
script loads only the modules it uses (``kvpress.presses.{snapkv,adakv}_press`` and
``kvpress.attention_patch``, which need torch and transformers alone) from the installed package without
running its ``__init__``, and applies kvpress's attention patch itself. kvpress 0.5.5 does not run on
transformers 5.17 (checked on a CPU: its forward hook reads ``kwargs["cache_position"]``, which 5.17 no longer
passes: ``KeyError``), so on the GPU machine (torch 2.11, transformers 5.17 preinstalled, no network) kvpress
runs with its own pin, transformers 5.2.0, which wants tokenizers <= 0.23.0: carry three wheels (13.8 MB) in
the working tree and install them, without dependencies, into a folder put first on ``PYTHONPATH`` (it shadows
5.17 for this process only; checked the same way on a CPU, over transformers 5.17 and tokenizers 0.23):

    pip download --no-deps kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2 -d wheels/kvpress   # here
    # there:
    python -m pip install --no-deps --target /tmp/kvp wheels/kvpress/*.whl
    PYTHONPATH=/tmp/kvp python experiments/kvpress_adakv_memory_gpu.py --out $OUT/kvpress_adakv.json

Do not commit ``wheels/``: an untracked folder travels to the device machine with the working tree (name it
in ``carry`` if git ignores it). ``prefill_s``/``decode_s`` are wall seconds of one pass each, for orientation
only (no warm-up, not a timing).

Expected time on one H200 (not yet run; an estimate): ~10 s to build the random 8B model on the GPU, three
32k prefills (~3 s each), 3 × 512 decode steps through transformers' eager Python loop (~20-30 ms each at
batch 1): ~60-90 s in all. Memory: 16 GB of weights plus a 4 GiB bf16 32k cache; well inside 80 GB.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import os
import sys
import time
import types

PRESSES = ("none", "snapkv", "adakv")


def load_kvpress():
    """``(SnapKVPress, AdaKVPress, patch_attention_functions)`` from the installed kvpress, without running its
    package ``__init__`` (which imports every press and kvpress's pipeline: datasets, pandas, ...)."""
    if "kvpress" not in sys.modules:
        spec = importlib.util.find_spec("kvpress")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("kvpress is not installed in this environment (see the docstring: pip install --no-deps "
                             "--target DIR kvpress-0.5.5-py3-none-any.whl, then PYTHONPATH=DIR)")
        pkg = types.ModuleType("kvpress")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["kvpress"] = pkg
        presses = types.ModuleType("kvpress.presses")
        presses.__path__ = [os.path.join(pkg.__path__[0], "presses")]
        sys.modules["kvpress.presses"] = presses
    snap = importlib.import_module("kvpress.presses.snapkv_press").SnapKVPress
    ada = importlib.import_module("kvpress.presses.adakv_press").AdaKVPress
    patch = importlib.import_module("kvpress.attention_patch").patch_attention_functions
    return snap, ada, patch


def llama_config(tiny: bool):
    """Llama-3.1-8B's config (``--tiny``: a toy Llama)."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                           attn_implementation="sdpa")
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
                       rope_theta=500000.0, rms_norm_eps=1e-5,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                       attn_implementation="sdpa")


def make_press(name: str, kv):
    snap, ada, _ = kv
    if name == "none":
        return None
    inner = snap(compression_ratio=0.75)
    return inner if name == "snapkv" else ada(press=inner, alpha_safeguard=0.2)


def cache_bytes(cache) -> int:
    """Bytes of every layer's key and value tensors in a transformers ``DynamicCache``."""
    return int(sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
                   if t is not None))


def masked_entries(model) -> int:
    """Entries kvpress's AdaKV masks (``module.masked_key_indices``, set on each attention module)."""
    total = 0
    for layer in model.model.layers:
        idx = getattr(layer.self_attn, "masked_key_indices", None)
        total += 0 if idx is None else int(idx[0].numel())
    return total


def memory(torch, device) -> dict:
    if device.type != "cuda":
        return {"memory_allocated": None, "max_memory_allocated": None}
    torch.cuda.synchronize()
    return {"memory_allocated": torch.cuda.memory_allocated(),
            "max_memory_allocated": torch.cuda.max_memory_allocated()}


def run_press(model, name: str, kv, ids, new_tokens: int, torch, device) -> dict:
    """One press: prefill+compression, then ``new_tokens`` greedy tokens; memory after each."""
    from transformers import DynamicCache

    for layer in model.model.layers:  # a previous AdaKV's masks must not carry over
        if hasattr(layer.self_attn, "masked_key_indices"):
            layer.self_attn.masked_key_indices = None
    press = make_press(name, kv)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    T = ids.shape[1]
    row = {"press": name, "spec": repr(press), "context": T, "batch": ids.shape[0], "new_tokens": new_tokens}
    cache = DynamicCache()
    t0 = time.perf_counter()
    with torch.no_grad(), (press(model) if press is not None else contextlib.nullcontext()):
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        row.update({f"{k}_after_compress": v for k, v in memory(torch, device).items()},
                   cache_bytes_after_compress=cache_bytes(cache), masked_entries=masked_entries(model),
                   prefill_s=time.perf_counter() - t0)
        position = torch.full((ids.shape[0], 1), T, dtype=torch.long, device=device)
        t0 = time.perf_counter()
        for i in range(new_tokens):
            out = model(input_ids=token, past_key_values=cache, use_cache=True, position_ids=position + i)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
        row.update({f"{k}_after_decode": v for k, v in memory(torch, device).items()},
                   cache_bytes_after_decode=cache_bytes(cache), decode_s=time.perf_counter() - t0,
                   last_token=int(token[0, 0]))
    del cache, out
    return row


def gib(x) -> str:
    return "-" if x is None else f"{x / 2**30:.3f}"


def table(rows: list[dict]) -> str:
    lines = ["| press | cache GiB after compress | after decode | allocated GiB after compress | peak GiB | "
             "allocated GiB after decode | peak GiB | masked entries |", "|---" * 8 + "|"]
    for r in rows:
        lines.append(f"| {r['spec']} | {gib(r['cache_bytes_after_compress'])} | {gib(r['cache_bytes_after_decode'])} | "
                     f"{gib(r['memory_allocated_after_compress'])} | {gib(r['max_memory_allocated_after_compress'])} | "
                     f"{gib(r['memory_allocated_after_decode'])} | {gib(r['max_memory_allocated_after_decode'])} | "
                     f"{r['masked_entries']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--presses", default=",".join(PRESSES), help=f"comma-separated, of {', '.join(PRESSES)}")
    p.add_argument("--context", type=int, default=None, help="prompt tokens (default 32768; --tiny 256)")
    p.add_argument("--new-tokens", type=int, default=None, help="greedy tokens after the prompt (default 512; "
                   "--tiny 8)")
    p.add_argument("--seed", type=int, default=0, help="seed of the weights and the prompt")
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: a toy Llama, fp32")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args(argv)
    names = [x.strip() for x in a.presses.split(",") if x.strip()]
    if not names or set(names) - set(PRESSES):
        p.error(f"--presses {a.presses!r}: expected some of {', '.join(PRESSES)}")
    context = a.context if a.context is not None else (256 if a.tiny else 32768)
    new_tokens = a.new_tokens if a.new_tokens is not None else (8 if a.tiny else 512)
    if context <= 64:  # SnapKVPress's observation window
        p.error(f"--context {context} must exceed SnapKVPress's window of 64 tokens")
    if new_tokens < 0:
        p.error(f"--new-tokens {new_tokens} must be >= 0")

    import torch
    from transformers import LlamaForCausalLM

    kv = load_kvpress()
    kv[2]()  # kvpress's attention patch: masked keys (AdaKV) replaced before attention
    device = torch.device("cpu" if a.tiny or not torch.cuda.is_available() else "cuda")
    if not a.tiny and device.type != "cuda":
        p.error("no CUDA device: this measures GPU memory (use --tiny for the CPU smoke test)")
    dtype = torch.float32 if a.tiny else torch.bfloat16
    torch.manual_seed(a.seed)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(llama_config(a.tiny)).eval()
    finally:
        torch.set_default_dtype(default)
    weights = int(sum(t.numel() * t.element_size() for t in model.parameters()))
    ids = torch.randint(1, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(a.seed))
    ids = ids.to(device)
    import transformers

    base = {"model": "tiny" if a.tiny else "llama3.1-8b (random bf16)", "device": str(torch.cuda.get_device_name())
            if device.type == "cuda" else "cpu", "weights_bytes": weights, "torch": torch.__version__,
            "transformers": transformers.__version__}
    rows = [{**base, **run_press(model, name, kv, ids, new_tokens, torch, device)} for name in names]
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
