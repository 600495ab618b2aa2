"""SmolLM2 on 4k-token single-needle prompts: what each baseline answers, next to kvpress.

Question-aware (the question is inside the compressed prompt, SnapKV's protocol). Our policies
run through `generate`; kvpress' SnapKVPress (its defaults: window 64, avg-pool 5) runs in the
peer environment `.venv-kvpress` (`make peer-venv`) on the same token ids, greedy.

    python scripts/needle_baselines.py --n 5 --out needle_baselines.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OURS = "fullkv, quest(0.25), snapkv(0.25), snapkv(0.5), h2o(0.25), h2o(0.5), streamingllm(0.25)"
PEER = [("kvpress SnapKVPress(0.75)", "snapkv:0.75"), ("kvpress SnapKVPress(0.5)", "snapkv:0.5")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=5, help="prompts (seeds 0..n-1)")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--policies", default=OURS)
    ap.add_argument("--out", default="needle_baselines.json")
    ap.add_argument("--no-peer", action="store_true", help="skip kvpress")
    args = ap.parse_args()

    from sparsekv_jax import load
    from sparsekv_jax.eval.ruler import generate_samples
    from sparsekv_jax.generate import generate
    from sparsekv_jax.models.embedded import embedded_gguf_path
    from sparsekv_jax.policies import parse_policies

    params, tok = load("smollm2", progress=False)
    stops = (2, tok.convert_tokens_to_ids("<|im_end|>"))
    rows = []
    for seed in range(args.n):
        sample = generate_samples("niah_single_1", args.length, 1, seed, tok, chat=True)[0]
        ids = tok(sample.prompt, add_special_tokens=False)["input_ids"]
        row = {"seed": seed, "tokens": len(ids), "needle": sample.answers[0], "depth": sample.depth, "answers": {}}
        for policy in parse_policies(args.policies):
            out = generate(params, policy, np.asarray([ids]), max_new_tokens=24, stop_tokens=stops)
            text = tok.decode([t for t in out.sequences()[0] if t not in stops]).strip()
            row["answers"][repr(policy) if "(" in repr(policy) else policy.name] = (text, sample.score(text) >= 1)
            print(seed, policy, repr(text), flush=True)
        if not args.no_peer:
            for label, spec in PEER:
                with tempfile.TemporaryDirectory() as tmp:
                    np.save(Path(tmp) / "ids.npy", np.asarray([ids]))
                    subprocess.run([str(ROOT / ".venv-kvpress/bin/python"), str(ROOT / "tests/peer/kvpress_kept.py"),
                                    str(embedded_gguf_path()), str(Path(tmp) / "ids.npy"), str(Path(tmp) / "o.npz"),
                                    spec, "--generate", "24"], capture_output=True, text=True, check=True)
                    gen = np.load(Path(tmp) / "o.npz")["generated_snapkv"].tolist()
                    text = tok.decode([t for t in gen if t not in stops]).strip()
                    row["answers"][label] = (text, sample.score(text) >= 1)
                    print(seed, label, repr(text), flush=True)
        rows.append(row)
    Path(args.out).write_text(json.dumps(rows, indent=2))
    names = list(rows[0]["answers"])
    print(f"\n{'policy':<58}{'right':>7}")
    for name in names:
        right = sum(r["answers"][name][1] for r in rows)
        print(f"{name:<58}{right:>4}/{len(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
