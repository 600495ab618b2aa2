"""Run a kvpress press on SmolLM2 (transformers, PyTorch, CPU) and save the kept indices.

Runs in the peer environment (`.venv-kvpress`: kvpress 0.5.5, transformers 5.2.0, tokenizers
0.22.2, torch 2.13.0 CPU — kvpress 0.5.5 needs transformers < 5.3), not in the project's venv.

    python tests/peer/kvpress_kept.py GGUF IDS.npy OUT.npz PRESS:RATIO [PRESS:RATIO ...] [--window W --kernel K]

PRESS is ``snapkv`` or ``streamingllm``; RATIO kvpress' compression_ratio (fraction removed).
Writes ``kept_<PRESS>`` ``[L, Hkv, n_kept]`` (sorted positions per layer and KV head) and, with
``--generate N``, ``generated_<PRESS>`` (N greedy tokens, the press applied to the whole input).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers
from kvpress import SnapKVPress, StreamingLLMPress
from kvpress.presses.scorer_press import ScorerPress
from kvpress.utils import compute_n_kept


def _parse_gguf_once() -> None:
    """Have transformers parse the GGUF once, not twice, and build gguf's tensor-name map once, not ~400 times.

    ``from_pretrained(gguf_file=...)`` reads the file twice (`AutoConfig`, then the weights), and each
    `GGUFReader` walks every metadata field, the ~49k tokenizer strings included; the weights pass then
    calls `get_tensor_name_map(arch, n_layers)` once per module of the model (~400), each building the
    same table. Both are pure functions of their arguments (the reader is only read), so they are
    memoized here: the peer loaded the same weights, ~40% faster, and kvpress is asked the same things.
    """
    readers: dict[str, gguf.GGUFReader] = {}
    reader_cls = gguf.GGUFReader

    def reader(path, *args, **kwargs):
        key = str(Path(path).resolve())
        if args or kwargs or key not in readers:
            readers[key] = reader_cls(path, *args, **kwargs)
        return readers[key]

    gguf.GGUFReader = reader  # transformers imports both names from `gguf` at call time
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf")
    ap.add_argument("ids")
    ap.add_argument("out")
    ap.add_argument("presses", nargs="+", help="PRESS:RATIO")
    ap.add_argument("--window", type=int, default=64)
    ap.add_argument("--kernel", type=int, default=5)
    ap.add_argument("--generate", type=int, default=0)
    args = ap.parse_args()

    _parse_gguf_once()
    path = Path(args.gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                              torch_dtype=torch.float32)
    model.eval()
    kept: dict[int, np.ndarray] = {}
    original = ScorerPress.compress

    def recording(self, module, hidden_states, keys, values, attentions, kwargs):
        scores = self.score(module, hidden_states, keys, values, attentions, kwargs)
        n_kept = compute_n_kept(keys.shape[2], self.compression_ratio)
        idx = scores.topk(n_kept, dim=-1).indices[0]  # [Hkv, n_kept]
        kept[module.layer_idx] = np.sort(idx.numpy(), axis=-1)
        return original(self, module, hidden_states, keys, values, attentions, kwargs)

    ScorerPress.compress = recording
    ids = torch.as_tensor(np.load(args.ids))
    result = {"transformers": transformers.__version__}
    for spec in args.presses:
        name, ratio = spec.split(":")
        if name == "snapkv":
            press = SnapKVPress(compression_ratio=float(ratio), window_size=args.window, kernel_size=args.kernel)
        elif name == "streamingllm":
            press = StreamingLLMPress(compression_ratio=float(ratio), n_sink=4)
        else:
            raise SystemExit(f"unknown press {name!r}")
        kept.clear()
        with torch.no_grad(), press(model):
            if args.generate:
                out = model.generate(ids, max_new_tokens=args.generate, do_sample=False,
                                     attention_mask=torch.ones_like(ids))
                result[f"generated_{name}"] = out[0, ids.shape[1]:].numpy()
            else:
                model(ids)
        result[f"kept_{name}"] = np.stack([kept[i] for i in sorted(kept)])
    np.savez(args.out, **result)


if __name__ == "__main__":
    main()
