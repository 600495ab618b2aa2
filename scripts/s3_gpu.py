"""S³-Hybrid speed and memory against full attention, Llama-3.1-8B shapes (docs/S3.md).

Random bf16 Llama-3.1-8B weights and random SAEs of the paper's shape (4 target layers
{0, 12, 16, 29}, 16,384 latents, k 128): speed does not depend on the values. A prompt of length L
is L - 128 context tokens + a 64-token question; 64 tokens are generated.

1. One chunk: SAE features by ``lax.top_k`` vs bisection (`retrieval.features`; the faster one is
   used below) and the chunk's index build (`chunk_postings`).
2. The streaming scan alone (chunks of 2048) at every ``--lengths`` point, smallest first and
   before anything else big has run: seconds (median of ``--runs``), peak device memory after it
   (``peak_bytes_in_use`` is a high-water mark: a flat scan shows the same peak at every L), the
   most live device bytes seen between chunks, and XLA's memory analysis of the compiled step.
3. At every ``--e2e`` point, after every program is compiled and warmed up, medians of ``--runs``
   (each ended by ``block_until_ready``): S3Hybrid end to end = scan + index copy + question +
   scoring/NMS/spans + BM25 + assembly + re-prefill of the ~1k-token prompt + 64 generated
   tokens; full attention = prefill of the whole prompt (one pass, cuDNN) + 64 generated tokens.
   A point that does not fit is reported as an error row. ``--model-layers N`` runs both with the
   first N layers' shapes (target layers scaled to N) if 128k full attention does not fit.

Prints a table last; JSON in ``--out``/s3_gpu.json.

    python scripts/s3_gpu.py --out $OUT          # H100 80GB: ~4-5 min
    python scripts/s3_gpu.py --e2e 32k           # without the 128k end-to-end point
    python scripts/s3_gpu.py --cpu-smoke         # tiny shapes, ~1-2 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

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
    """AOT-compiled `generate` (no stop tokens) for prompts shaped like ``tokens``:
    ``(run(tokens, lengths, qs) -> output, compile seconds)``."""
    import jax

    from sparsekv_jax import engine
    from sparsekv_jax.policies import Dense

    def args(tokens, lengths, qs):
        run = engine.setup(params, Dense(), tokens, lengths, question_start=qs, max_new_tokens=new, stop_tokens=())
        return (params, run, jax.random.key(0)), {}

    a, kw = args(tokens, lengths, qs)
    t0 = time.perf_counter()
    compiled = engine.generate_program.lower(*a, **kw).compile()
    return (lambda tokens, lengths, qs: compiled(*args(tokens, lengths, qs)[0])), time.perf_counter() - t0


def _chunk_bench(saes, cfg, n: int, chunk: int, k: int, width: int) -> list[dict]:
    """One chunk's token features (``lax`` vs ``threshold``) and index build, ms (median of 3)."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax.retrieval.features import stacked_token_features
    from sparsekv_jax.retrieval.index import chunk_postings

    rows = []
    keys = jax.random.normal(jax.random.key(2), (n, 1, chunk, cfg.num_kv_heads, cfg.head_dim))
    for method in ("lax", "threshold"):
        fn = jax.jit(lambda x, m=method: stacked_token_features(saes, x, k, m))
        rows.append({"kind": "chunk_features", "method": method, "ms": 1e3 * _median(lambda fn=fn: fn(keys))})
    ids, acts = jax.jit(lambda x: stacked_token_features(saes, x, k, "lax"))(keys)
    pos = jnp.arange(chunk, dtype=jnp.int32)[None]
    build = jax.jit(lambda i, s: chunk_postings(i, s, pos, jnp.array([chunk]), width))
    rows.append({"kind": "chunk_index_build", "ms": 1e3 * _median(lambda: build(ids, acts))})
    return rows


def _scan_step_memory(params, saes, layers, scan_cfg, chunk: int) -> dict[str, int]:
    """XLA's memory analysis of the compiled scan step (one chunk; independent of the context)."""
    import jax.numpy as jnp

    from sparsekv_jax.retrieval.scan import _init_carry, scan_step

    pos = jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (1, chunk))
    m = scan_step.lower(params, saes, _init_carry(params, 1, scan_cfg.carried), jnp.zeros((1, chunk), jnp.int32), pos,
                        jnp.array([chunk]), layers=layers, scan=scan_cfg).compile().memory_analysis()
    if m is None:
        return {}
    return {k: int(getattr(m, k)) for k in ("argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes")
            if hasattr(m, k)}


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="8k,32k,128k", help="scan points (time, peak memory)")
    p.add_argument("--e2e", default="32k,128k", help="end-to-end points: S3Hybrid vs full attention")
    p.add_argument("--runs", type=int, default=3, help="timed runs per point (median), after a warm-up run")
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--model-layers", type=int, default=None, help="use the first N layers (both methods)")
    p.add_argument("--features", default="auto", help="scan's feature method: lax, threshold, or auto (the one "
                   "measured faster on a chunk here)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model and SAEs (CPU check of the script)")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    a = p.parse_args(argv)
    t_start = time.perf_counter()

    import dataclasses

    import jax
    import jax.numpy as jnp

    from sparsekv_jax.models.config import ModelConfig, llama31_8b_config
    from sparsekv_jax.models.params import random_params
    from sparsekv_jax.policies import S3Hybrid
    from sparsekv_jax.retrieval.scan import ScanConfig, scan_context
    from sparsekv_jax.sae.model import init_sae

    if a.cpu_smoke:
        cfg = ModelConfig(family="llama", vocab_size=512, hidden_size=128, num_layers=6, num_heads=4, num_kv_heads=2,
                          head_dim=32, intermediate_size=256, max_position_embeddings=4096, eos_token_ids=(0,))
        targets, width, k = (0, 2, 3, 5), 1024, 32
        a.lengths, a.e2e, a.chunk, a.budget, a.new, a.runs = "1k,2k,4k", "2k,4k", 256, 256, 8, 2
    else:
        cfg = llama31_8b_config()
        targets, width, k = (0, 12, 16, 29), 16384, 128
    if a.model_layers:
        targets = tuple(sorted({t * a.model_layers // cfg.num_layers for t in targets}))
        cfg = dataclasses.replace(cfg, num_layers=a.model_layers)
    layers = targets
    dev = jax.devices()[0]
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    saes = init_sae(jax.random.key(1), cfg.head_dim, width, k, stack=(len(layers),))
    jax.block_until_ready((params, saes))
    tok = SyntheticTokenizer(cfg.vocab_size)
    rng = np.random.default_rng(0)
    rows: list[dict] = []

    def emit(row: dict) -> None:
        rows.append(row)
        print(json.dumps(row), flush=True)

    # 1. one chunk: features by lax.top_k vs bisection, and the index build (per-chunk sort)
    for row in _chunk_bench(saes, cfg, len(layers), a.chunk, k, width):
        emit(row)
    features = a.features
    if features == "auto":
        features = min(("lax", "threshold"), key=lambda m: next(r["ms"] for r in rows if r.get("method") == m))
    policy = S3Hybrid(budget=a.budget, weights=saes, layers=layers, chunk=a.chunk, kernel=8,
                      features=features).with_tokenizer(tok)
    scan_cfg = ScanConfig(chunk=a.chunk, features=features).resolve(params)
    base = {"device": dev.device_kind, "jax": jax.__version__, "model_layers": cfg.num_layers, "layers": layers,
            "width": width, "k": k, "chunk": a.chunk, "budget": a.budget, "new": a.new, "runs": a.runs,
            "features": scan_cfg.features, "attention": scan_cfg.attention,
            "weights_bytes": sum(x.nbytes for x in jax.tree.leaves(params)),
            "scan_step_memory": _scan_step_memory(params, saes, layers, scan_cfg, a.chunk)}

    def prompt(L: int):
        T = L - 2 * a.new  # context; the question is `new` tokens and `new` more are generated
        toks = rng.integers(1, min(cfg.vocab_size, 100_000), (1, T + a.new)).astype(np.int32)
        return toks, np.array([T + a.new], np.int32), np.array([T], np.int32)

    scan_lengths, e2e_lengths = _lengths(a.lengths), _lengths(a.e2e)
    prompts = {L: prompt(L) for L in sorted(set(scan_lengths) | set(e2e_lengths))}

    # 2. scans alone, smallest first (the first one compiles the step), before anything larger runs
    def scan(L: int, live: list[int] | None = None):
        toks, lengths, qs = prompts[L]
        hook = None if live is None else (lambda c: live.append(sum(x.nbytes for x in jax.live_arrays())))
        return scan_context(params, saes, layers, toks, qs, qs, lengths - qs, scan_cfg, on_chunk=hook)

    scan(min(scan_lengths))
    for L in sorted(scan_lengths):
        live: list[int] = []
        t0 = time.perf_counter()
        res = scan(L, live)
        first = time.perf_counter() - t0
        mem = _mem(dev)
        seconds = statistics.median([first] + [_timed(lambda L=L: scan(L)) for _ in range(a.runs - 1)])
        emit({"kind": "scan", "L": L, "seconds": seconds, **mem, "max_live_bytes": max(live),
              "index_host_bytes": res.index.nbytes(), **res.seconds})
        del res

    # 3. compile every generate program on threads (host work) while the device warms the context stage up
    width3 = -(-(a.budget + a.new) // 64) * 64
    dummy = (np.ones((1, width3), np.int32), np.array([width3], np.int32), np.array([width3 - a.new], np.int32))
    with ThreadPoolExecutor(max_workers=1 + len(e2e_lengths)) as pool:
        s3_job = pool.submit(_compiled_generate, params, *dummy, a.new)
        full_jobs = {L: pool.submit(_compiled_generate, params, *prompts[L], a.new) for L in e2e_lengths}
        for L in e2e_lengths:  # compiles the question step and the scoring program of this length
            policy.context(params, *prompts[L])
        programs = {"s3": _result(s3_job), **{L: _result(j) for L, j in full_jobs.items()}}
    emit({"kind": "compile", "s3_generate_s": _compile_s(programs["s3"]),
          **{f"full_{L}_s": _compile_s(programs[L]) for L in e2e_lengths}})

    # 4. end to end, every program warm: medians of `runs`
    def s3_once(L: int) -> dict[str, float]:
        t0 = time.perf_counter()
        res = policy.context(params, *prompts[L])
        t1 = time.perf_counter()
        if res.tokens.shape[1] == width3 and not isinstance(programs["s3"], str):
            run = programs["s3"][0]
        else:  # an unexpected width: compiled here, outside the timed window
            run = _compiled_generate(params, res.tokens, res.lengths, res.question_start, a.new)[0]
        t2 = time.perf_counter()
        jax.block_until_ready(run(res.tokens, res.lengths, res.question_start).tokens)
        t3 = time.perf_counter()
        sec = res.info["seconds"]
        return {"total_s": (t1 - t0) + (t3 - t2), "context_stage_s": t1 - t0, "generate_s": t3 - t2,
                "scan_s": sec["scan"], "index_copy_s": sec["index_copy"], "question_s": sec["question"],
                "score_s": sec["score"], "bm25_s": sec["bm25"], "assemble_s": sec["assemble"],
                "kept": int(res.info["kept_tokens"][0]), "new_prompt": int(res.lengths[0])}

    for L in e2e_lengths:
        try:
            s3_once(L)  # warm-up
            runs = [s3_once(L) for _ in range(a.runs)]
            emit({"kind": "s3hybrid", "L": L, "context": int(prompts[L][2][0]),
                  **{key: statistics.median(r[key] for r in runs) for key in runs[0]}, **_mem(dev)})
        except Exception as e:  # noqa: BLE001 - report the point and go on
            emit({"kind": "s3hybrid", "L": L, "error": _error(e)})
        try:
            if isinstance(programs[L], str):
                raise RuntimeError(programs[L])
            run = programs[L][0]
            toks, lengths, qs = prompts[L]
            total = _median(lambda run=run, t=toks, n=lengths, q=qs: run(t, n, q).tokens, a.runs)
            emit({"kind": "full", "L": L, "total_s": total, **_mem(dev)})
        except Exception as e:  # noqa: BLE001 - report the point and go on
            emit({"kind": "full", "L": L, "error": _error(e)})

    base["seconds"] = time.perf_counter() - t_start
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "s3_gpu.json"), "w") as f:
        json.dump({"meta": base, "rows": rows}, f, indent=1)
    print(table(base, rows))
    return 0


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _result(job):
    """A compile job's ``(run, seconds)``, or its error as a string (a point that does not fit)."""
    try:
        return job.result()
    except Exception as e:  # noqa: BLE001
        return _error(e)


def _compile_s(program) -> float | str:
    return program if isinstance(program, str) else program[1]


def table(base: dict, rows: list[dict]) -> str:
    """The short table printed last (markdown)."""
    gib = 1 / 2**30
    feats = {r["method"]: r["ms"] for r in rows if r["kind"] == "chunk_features"}
    build = next(r["ms"] for r in rows if r["kind"] == "chunk_index_build")
    out = [f"\n{base['device']}, jax {base['jax']}, {base['model_layers']} layers, target layers {base['layers']}; "
           f"features={base['features']} attention={base['attention']}; median of {base['runs']}; one chunk of "
           f"{base['chunk']}: features lax {feats['lax']:.1f} ms / threshold {feats['threshold']:.1f} ms, "
           f"index build {build:.2f} ms; weights {base['weights_bytes'] * gib:.2f} GiB",
           "", "| L | scan s | scan peak GiB | max live GiB | host index MiB |", "|---:|---:|---:|---:|---:|"]
    for r in (r for r in rows if r["kind"] == "scan"):
        peak = "—" if r["peak_bytes"] is None else f"{r['peak_bytes'] * gib:.2f}"
        out.append(f"| {r['L']} | {r['seconds']:.3f} | {peak} | {r['max_live_bytes'] * gib:.2f} | "
                   f"{r['index_host_bytes'] / 2**20:.0f} |")
    out += ["", "| L | S3Hybrid e2e s (context stage + generate) | scan s | index copy + scoring s (% of scan) | "
            "BM25 s | full attention s | S3 / full |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for L in dict.fromkeys(r["L"] for r in rows if r["kind"] in ("s3hybrid", "full")):
        s3 = next(r for r in rows if r["kind"] == "s3hybrid" and r["L"] == L)
        full = next((r for r in rows if r["kind"] == "full" and r["L"] == L), {"error": "—"})
        ft = full.get("error") or f"{full['total_s']:.3f}"
        if "error" in s3:
            out.append(f"| {L} | {s3['error']} | | | | {ft} | |")
            continue
        idx = s3["index_copy_s"] + s3["score_s"]
        ratio = "—" if "error" in full else f"{s3['total_s'] / full['total_s']:.2f}"
        out.append(f"| {L} | {s3['total_s']:.3f} ({s3['context_stage_s']:.3f} + {s3['generate_s']:.3f}) | "
                   f"{s3['scan_s']:.3f} | {idx:.3f} ({100 * idx / s3['scan_s']:.1f}%) | {s3['bm25_s']:.3f} | {ft} | "
                   f"{ratio} |")
    return "\n".join(out)


if __name__ == "__main__":
    raise SystemExit(main())
