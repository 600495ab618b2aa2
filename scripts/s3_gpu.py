"""S³-Hybrid speed and memory against full attention, Llama-3.1-8B shapes (docs/S3.md, BENCHMARKS).

Random bf16 Llama-3.1-8B weights and random SAEs of the paper's shape (4 target layers
{0, 12, 16, 29}, 16,384 latents, k 128): speed does not depend on the values. For each context
length L (prompt = L - 128 context tokens + a 64-token question, then 64 generated tokens):

1. the streaming scan alone (chunks of 2048): seconds, peak device memory after it
   (``peak_bytes_in_use``; every scan runs before anything larger, so a flat scan shows the same
   peak at every L) and the most live device bytes seen between chunks;
2. S3Hybrid end to end: scan + index + retrieval (scores, peaks, spans, BM25) + re-prefill of the
   ~1k-token prompt + 64 generated tokens, with its parts;
3. full attention: prefill of the whole prompt + 64 generated tokens (one pass, cuDNN).

Every program is compiled before it is timed (scan step, scoring per L, generate per shape).
Also: one chunk's SAE features by ``lax.top_k`` vs bisection (`retrieval.features`) and one
chunk's index build (`chunk_postings`). Prints a table last; JSON in ``$OUT/s3_gpu.json``.

    python scripts/s3_gpu.py                     # H100/H200, ~4 min
    python scripts/s3_gpu.py --lengths 8k,32k    # without the 128k point
    python scripts/s3_gpu.py --cpu-smoke         # tiny shapes, a few minutes on a CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np


class SyntheticTokenizer:
    """Token ``i`` is the word ``w<i>``; every 23rd id ends a sentence (BM25 and spans need text)."""

    all_special_ids: list[int] = []

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab

    def __len__(self) -> int:
        return self.vocab

    def batch_decode(self, seqs, skip_special_tokens=False):
        return [" ".join(f"w{i}." if i % 23 == 0 else f"w{i}" for i in s) for s in seqs]


def _lengths(text: str) -> list[int]:
    return [int(float(x[:-1]) * 1024) if x.lower().endswith("k") else int(x) for x in text.split(",") if x]


def _median(fn, iters: int = 3) -> float:
    import jax

    jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _mem(device) -> dict[str, int | None]:
    stats = device.memory_stats() or {}
    return {"peak_bytes": stats.get("peak_bytes_in_use"), "bytes": stats.get("bytes_in_use")}


def _compiled_generate(params, tokens, lengths, qs, new):
    """AOT-compiled `generate` of a prompt (no stop tokens): ``(run() -> output, compile seconds)``."""
    import jax

    from sparsekv_jax.generate import GREEDY, _generate_jit, _setup
    from sparsekv_jax.policies import Dense

    run = _setup(params, Dense(), tokens, lengths, None, None, new, 16, None, None, question_start=qs)
    args = (params, run.policy, run.tokens, run.lengths, run.question_start, run.prompt_lengths, None, None,
            jax.random.key(0))
    kw = dict(max_new_tokens=new, sampling=GREEDY, stop_tokens=(), page_size=16, prefill_chunk=None,
              capacity=run.capacity, backend=run.backend)
    t0 = time.perf_counter()
    compiled = _generate_jit.lower(*args, **kw).compile()
    return (lambda: compiled(*args)), time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="8k,32k,128k")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--features", default="auto", help="scan's feature method: auto, lax, threshold")
    p.add_argument("--max-seconds", type=float, default=230, help="skip the remaining lengths past this")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model and SAEs (CPU check of the script)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = p.parse_args(argv)
    t_start = time.perf_counter()

    import jax
    import jax.numpy as jnp

    from sparsekv_jax.models.config import ModelConfig, llama31_8b_config
    from sparsekv_jax.models.params import random_params
    from sparsekv_jax.policies import S3Hybrid
    from sparsekv_jax.retrieval.features import stacked_token_features
    from sparsekv_jax.retrieval.index import chunk_postings
    from sparsekv_jax.retrieval.scan import ScanConfig, scan_context
    from sparsekv_jax.retrieval.scoring import retrieve_centres
    from sparsekv_jax.sae.model import init_sae

    if a.cpu_smoke:
        cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
                          head_dim=32, intermediate_size=256, max_position_embeddings=4096, eos_token_ids=(0,))
        layers, width, k = (0, 2, 3, 5), 1024, 32
        a.lengths, a.chunk, a.budget, a.new = "1k,2k,4k", 256, 256, 8
    else:
        cfg = llama31_8b_config()
        layers, width, k = (0, 12, 16, 29), 16384, 128
    dev = jax.devices()[0]
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    saes = init_sae(jax.random.key(1), cfg.head_dim, width, k, stack=(len(layers),))
    jax.block_until_ready((params, saes))
    tok = SyntheticTokenizer(cfg.vocab_size)
    policy = S3Hybrid(budget=a.budget, weights=saes, layers=layers, chunk=a.chunk, kernel=8,
                      features=a.features).with_tokenizer(tok)
    scan_cfg = ScanConfig(chunk=a.chunk, features=a.features).resolve(params)
    rng = np.random.default_rng(0)
    base = {"device": dev.device_kind, "jax": jax.__version__, "layers": layers, "width": width, "k": k,
            "chunk": a.chunk, "budget": a.budget, "new": a.new, "features": scan_cfg.features,
            "attention": scan_cfg.attention, "weights_bytes": _mem(dev)["bytes"]}
    rows: list[dict] = []

    # one chunk: features by lax.top_k vs bisection, and the index build (per-chunk sort)
    keys = jax.random.normal(jax.random.key(2), (len(layers), 1, a.chunk, cfg.num_kv_heads, cfg.head_dim))
    for method in ("lax", "threshold"):
        fn = jax.jit(lambda x, m=method: stacked_token_features(saes, x, k, m))
        rows.append({"kind": "chunk_features", "method": method, "ms": 1e3 * _median(lambda fn=fn: fn(keys))})
    ids, acts = jax.jit(lambda x: stacked_token_features(saes, x, k, "lax"))(keys)
    pos = jnp.arange(a.chunk, dtype=jnp.int32)[None]
    build = jax.jit(lambda i, s: chunk_postings(i, s, pos, jnp.array([a.chunk]), width))
    rows.append({"kind": "chunk_index_build", "ms": 1e3 * _median(lambda: build(ids, acts))})
    print(json.dumps(rows[-3:]), flush=True)

    def prompt(L: int):
        T = L - 2 * a.new  # context; the question is `new` tokens and `new` more are generated
        toks = rng.integers(1, min(cfg.vocab_size, 100_000), (1, T + a.new)).astype(np.int32)
        return toks, np.array([T + a.new], np.int32), np.array([T], np.int32)

    def s3_end_to_end(L: int, warm: bool = False) -> dict:
        toks, lengths, qs = prompt(L)
        width_t = -(-int(qs[0]) // a.chunk) * a.chunk
        n = len(layers)
        # compile the scoring program for this length on zeros (not timed)
        retrieve_centres(np.zeros((n, 1, width_t // a.chunk, a.chunk * k), np.int32),
                         np.zeros((n, 1, width_t // a.chunk, width), np.int32), jnp.zeros((n, 1, width)),
                         jnp.asarray(qs), jnp.ones(1, jnp.int32), width=width_t, kernel=8, n_centres=40,
                         stop_df=0.5)[0].block_until_ready()
        t0 = time.perf_counter()
        res = policy.context(params, toks, lengths, qs)
        t1 = time.perf_counter()
        run, compile_s = _compiled_generate(params, res.tokens, res.lengths, res.question_start, a.new)
        t2 = time.perf_counter()
        jax.block_until_ready(run().tokens)
        t3 = time.perf_counter()
        sec = res.info["seconds"]
        return {"kind": "s3hybrid", "L": L, "context": int(qs[0]), "kept": int(res.info["kept_tokens"][0]),
                "new_prompt": int(res.lengths[0]), "context_stage_s": t1 - t0, "generate_s": t3 - t2,
                "total_s": (t1 - t0) + (t3 - t2), "scan_s": sec["scan"], "index_copy_s": sec["index_copy"],
                "question_s": sec["question"], "score_s": sec["score"], "bm25_s": sec["bm25"],
                "assemble_s": sec["assemble"], "generate_compile_s": compile_s, "warmup": warm}

    lengths_list = _lengths(a.lengths)
    # warm-up at the smallest length: compiles the scan step, the question step and the re-prefill
    rows.append(s3_end_to_end(lengths_list[0], warm=True))
    print(json.dumps(rows[-1]), flush=True)

    # 1. scans alone, smallest first, before anything larger runs (peak memory)
    done = []
    for L in lengths_list:
        if time.perf_counter() - t_start > a.max_seconds * 0.45:
            print(f"skipping {L} and longer: time", flush=True)
            break
        toks, lengths, qs = prompt(L)
        live: list[int] = []
        t0 = time.perf_counter()
        res = scan_context(params, saes, layers, toks, qs, qs, lengths - qs, scan_cfg,
                           on_chunk=lambda c, live=live: live.append(sum(x.nbytes for x in jax.live_arrays())))
        rows.append({"kind": "scan", "L": L, "seconds": time.perf_counter() - t0, **_mem(dev),
                     "max_live_bytes": max(live), "index_host_bytes": res.index.nbytes(), **res.seconds})
        print(json.dumps(rows[-1]), flush=True)
        done.append(L)
        del res

    # 2. S3Hybrid end to end, 3. full attention
    for L in done:
        if time.perf_counter() - t_start > a.max_seconds:
            print(f"skipping {L}: time", flush=True)
            break
        rows.append(s3_end_to_end(L))
        print(json.dumps(rows[-1]), flush=True)
        toks, lengths, qs = prompt(L)
        try:
            run, compile_s = _compiled_generate(params, toks, lengths, qs, a.new)
            t0 = time.perf_counter()
            jax.block_until_ready(run().tokens)
            rows.append({"kind": "full", "L": L, "total_s": time.perf_counter() - t0, "compile_s": compile_s,
                         **_mem(dev)})
        except Exception as e:  # noqa: BLE001 - report the point and go on
            rows.append({"kind": "full", "L": L, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        print(json.dumps(rows[-1]), flush=True)

    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "s3_gpu.json"), "w") as f:
        json.dump({"meta": {**base, "seconds": time.perf_counter() - t_start}, "rows": rows}, f, indent=1)
    print(table(base, rows))
    return 0


def table(base: dict, rows: list[dict]) -> str:
    gib = 1 / 2**30
    feats = {r["method"]: r["ms"] for r in rows if r["kind"] == "chunk_features"}
    build = next(r["ms"] for r in rows if r["kind"] == "chunk_index_build")
    out = [f"\n{base['device']}, jax {base['jax']}; features={base['features']} attention={base['attention']}; "
           f"one chunk of {base['chunk']}: features lax {feats['lax']:.1f} ms / threshold {feats['threshold']:.1f} ms, "
           f"index build {build:.2f} ms",
           "| L | scan s | scan peak GiB | max live GiB | index+scoring s (% of scan) | S3Hybrid e2e s "
           "(context stage + generate) | full attention s | S3 / full |",
           "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for scan in (r for r in rows if r["kind"] == "scan"):
        L = scan["L"]
        s3 = next((r for r in rows if r["kind"] == "s3hybrid" and r["L"] == L and not r["warmup"]), None)
        full = next((r for r in rows if r["kind"] == "full" and r["L"] == L), None)
        peak = "—" if scan["peak_bytes"] is None else f"{scan['peak_bytes'] * gib:.2f}"
        idx = "—" if s3 is None else (f"{s3['index_copy_s'] + s3['score_s']:.3f} "
                                      f"({100 * (s3['index_copy_s'] + s3['score_s']) / s3['scan_s']:.1f}%)")
        e2e = "—" if s3 is None else f"{s3['total_s']:.2f} ({s3['context_stage_s']:.2f} + {s3['generate_s']:.2f})"
        ft = "—" if full is None else (full.get("error") or f"{full['total_s']:.2f}")
        ratio = "—" if s3 is None or full is None or "total_s" not in full else f"{s3['total_s'] / full['total_s']:.2f}"
        out.append(f"| {L} | {scan['seconds']:.2f} | {peak} | {scan['max_live_bytes'] * gib:.2f} | {idx} | {e2e} | "
                   f"{ft} | {ratio} |")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
