"""How close the streaming scan's keys are to full-context keys (the S³ paper's Table 9), SmolLM2.

One text of ``--length`` tokens (WikiText-2's held-out tail) is run once with full causal
attention (`sparsekv_jax.sae.projections`) and once per scan configuration: chunk-only attention
(the paper's "chunk-independent" prefill) and a carried sink (4) + window (one chunk), at several
chunk sizes. Per target layer, over every position and KV head:

* K cosine similarity and relative L2 error of the pre-RoPE keys;
* feature Jaccard similarity of each token's SAE feature set (shipped SmolLM2 SAEs);
* retrieval IoU: positions kept by S³'s score (IDF-weighted co-activation with the queries of the
  text's last 64 tokens, full-context queries for both; smoothed, kernel 8), top 10% of positions.

Prints a table last; JSON under ``--out``.

    python scripts/s3_key_agreement.py --length 4096 --chunks 512,1024,2048 --out docs/results/s3_key_agreement
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2")
    p.add_argument("--length", type=int, default=4096)
    p.add_argument("--chunks", default="512,1024,2048")
    p.add_argument("--out", default="out/s3_key_agreement")
    a = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from sparsekv_jax.datasets import wikitext2_text
    from sparsekv_jax.models.embedded import load
    from sparsekv_jax.retrieval.features import token_features
    from sparsekv_jax.retrieval.scan import ScanConfig, _init_carry, scan_step
    from sparsekv_jax.retrieval.scoring import smooth
    from sparsekv_jax.sae import load_shipped, projections
    from sparsekv_jax.sae.export import stack_saes

    t_start = time.time()
    params, tok = load(a.model, dtype=jnp.float32, progress=False)
    layers, saes = stack_saes(load_shipped("smollm2")[0])
    text = wikitext2_text()
    ids = tok(text[-len(text) // 8:], add_special_tokens=False)["input_ids"][: a.length]
    T = len(ids)
    tokens = jnp.asarray([ids], jnp.int32)
    full_k, full_q = map(np.asarray, projections(params, tokens, layers, queries=True))  # [n, 1, T, H, D]
    qtok = slice(T - 64, T)

    def features(keys):
        return [tuple(map(np.asarray, token_features(saes.layer(i), jnp.asarray(keys[i, 0]), saes.k)))
                for i in range(len(layers))]

    def kept_positions(feats):
        score = np.zeros(T)
        for i, (fid, act) in enumerate(feats):
            q_ids, q_act = map(np.asarray, token_features(saes.layer(i), jnp.asarray(full_q[i, 0, qtok]), saes.k))
            w = np.zeros(saes.width)
            np.add.at(w, q_ids.ravel(), q_act.ravel())
            df = np.zeros(saes.width)
            for t in range(T):
                df[fid[t][act[t] > 0]] += 1
            w = w / (np.log1p(df) + 1) * (df <= 0.5 * T)
            score += np.where(act > 0, w[fid], 0).sum(-1)
        s = np.asarray(smooth(jnp.asarray(score[None]), 8))[0][: T - 64]
        return set(np.argsort(-s, kind="stable")[: (T - 64) // 10].tolist())

    ref_feats = features(full_k)
    ref_kept = kept_positions(ref_feats)
    rows = []
    for C in [int(c) for c in a.chunks.split(",")]:
        for mode, scan in (("chunk only", ScanConfig(chunk=C)), ("sink 4 + window", ScanConfig(chunk=C, sinks=4,
                                                                                               window=C))):
            scan = scan.resolve(params)
            carry = _init_carry(params, 1, scan.carried)
            n_chunks = -(-T // C)
            padded = np.zeros((1, n_chunks * C), np.int32)
            padded[0, :T] = ids
            parts = []
            for c in range(n_chunks):
                pos = jnp.arange(c * C, (c + 1) * C, dtype=jnp.int32)[None]
                carry, _, _, keys = scan_step(params, saes, carry, jnp.asarray(padded[:, c * C:(c + 1) * C]), pos,
                                              jnp.array([T]), layers=layers, scan=scan, return_keys=True)
                parts.append(np.asarray(keys))
            keys = np.concatenate(parts, axis=2)[:, :, :T]
            feats = features(keys)
            row = {"chunk": C, "mode": mode, "layers": {}}
            for i, layer in enumerate(layers):
                x, y = keys[i, 0].reshape(-1, keys.shape[-1]), full_k[i, 0].reshape(-1, keys.shape[-1])
                cos = (x * y).sum(-1) / (np.linalg.norm(x, axis=-1) * np.linalg.norm(y, axis=-1) + 1e-30)
                rel = np.linalg.norm(x - y, axis=-1) / (np.linalg.norm(y, axis=-1) + 1e-30)
                jac = []
                for t in range(T):
                    u = set(feats[i][0][t][feats[i][1][t] > 0].tolist())
                    v = set(ref_feats[i][0][t][ref_feats[i][1][t] > 0].tolist())
                    jac.append(len(u & v) / max(1, len(u | v)))
                row["layers"][layer] = {"cosine": float(cos.mean()), "rel_l2": float(rel.mean()),
                                        "jaccard": float(np.mean(jac))}
            kept = kept_positions(feats)
            row["retrieval_iou"] = len(kept & ref_kept) / len(kept | ref_kept)
            for m in ("cosine", "rel_l2", "jaccard"):
                vals = [v[m] for v in row["layers"].values()]
                row[m] = float(np.mean(vals))
                row[m + "_worst"] = float(max(vals) if m == "rel_l2" else min(vals))
            rows.append(row)
            print(json.dumps(row), flush=True)
    meta = {"model": a.model, "length": T, "layers": list(layers), "device": jax.devices()[0].device_kind,
            "date": time.strftime("%Y-%m-%d"), "seconds": time.time() - t_start}
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "agreement.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    lines = [f"SmolLM2, {T} tokens, layers {list(layers)} (mean over layers; worst layer in parentheses)",
             "| chunk | attends to | K cosine | relative L2 | feature Jaccard | retrieval IoU (top 10%) |",
             "|---:|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['chunk']} | {r['mode']} | {r['cosine']:.3f} ({r['cosine_worst']:.3f}) | "
                     f"{r['rel_l2']:.3f} ({r['rel_l2_worst']:.3f}) | {r['jaccard']:.3f} ({r['jaccard_worst']:.3f}) | "
                     f"{r['retrieval_iou']:.3f} |")
    print("\n".join(lines))
    (out / "agreement.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
