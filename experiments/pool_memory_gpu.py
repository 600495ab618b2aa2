"""Issue 38's Memory and Speed rows on a GPU: the cache a policy holds, and its decode speed, on the uniform
layout against the page pool (``Options(pool=True)``, docs/PAGE_POOL.md).

    python experiments/pool_memory_gpu.py --out $OUT/pool_memory.json            # Llama-3.1-8B shapes, 32k, batch 8
    python experiments/pool_memory_gpu.py --tiny                                 # CPU smoke test (toy model)

Random bf16 weights of Llama-3.1-8B's shapes (`bench.e2e.random_weights`), random prompt tokens of
``--context`` (32k) × ``--batch`` (8). Per policy (``--policies``, default FullKV, SnapKV(0.25) and
AdaKV(SnapKV(0.25))) one child process (``--in-process`` runs one in this one), which for each layout,
uniform then pool, runs the session's steps as separate programs (`engine.Session`: prefill, then compress),
drops the prefill cache and records:

* ``cache_bytes``: the compressed cache's pytree bytes (`KVCache.nbytes` / `PoolCache.nbytes`: the whole
  pool with its tables; ``held_bytes``: the pages its heads hold);
* ``in_use_after_prefill`` / ``in_use_after_compress``: ``memory_stats()["bytes_in_use"]`` less what was in
  use before the layout started (the weights, and the other layout's cache when it is the second): the
  prefill cache (and observations) alive, then only the compressed cache;
* ``peak_bytes_in_use``: the process's high-water mark after the layout's compress step. The pool runs
  first, so its peak is its own; the uniform layout's is the larger of the two (its own when it is the
  larger, as it is for the compressors: its prefill cache is the same as the pool's plus the room for the
  decode);
* then both layouts decode ``--decode-tokens`` (512) greedy tokens with `bench.e2e.decode_fn` (``--steps``
  per call, the cache donated): two warm-up calls each, then calls interleaved uniform, pool, pool, uniform;
  ``decode_ms_per_token`` is the median call over ``--steps`` (`bench.timing.timed_call`: to
  ``block_until_ready``), ``decode_program_bytes`` XLA's memory analysis of the compiled call
  (`bench.e2e.memory_bytes`), and ``in_use_after_decode`` / ``cache_bytes_after_decode`` /
  ``held_bytes_after_decode`` the memory after the 512 tokens (bytes in use: both layouts' caches).

A short table is printed last; ``--out`` writes every row as JSON.

Expected time on one H200 (not yet run; an estimate): per policy one process, ~15 s to start and draw the
weights, two prefills of 8 × 32k tokens (~10 s each) and their compiles (~20 s each), two decode compiles
(~15 s each) and 2 × 512 decode steps (FullKV ~10 ms a step at 32k × 8, the compressors ~3 ms): ~1.5-2 min a
policy, ~5 min in all (``--policies`` splits it over two calls if a command's limit is near). Memory: FullKV
holds both layouts' caches at once while timing (~35 GB each at 32k × 8) beside the 16 GB of weights and the
prefill's activations: H200 (141 GB); on an H100 pass ``--batch 4``. Each child runs with
``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95`` unless the environment sets it.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import subprocess
import sys
import tempfile

DEFAULT_POLICIES = "fullkv, snapkv(0.25), adakv(snapkv(0.25))"
LAYOUTS = ("pool", "uniform")  # the pool first: its peak is then its own


def split_specs(specs: str) -> list[str]:
    """The policy specs of a comma-separated ``specs``, each as written (commas inside calls kept)."""
    text = f"({specs},)"
    return [ast.get_source_segment(text, node) for node in ast.parse(text, mode="eval").body.elts]


def tiny_config():
    """A toy Llama for the CPU smoke test."""
    from sparsekv_jax.models.config import ModelConfig

    return ModelConfig(family="llama", vocab_size=128, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=96, max_position_embeddings=4096, eos_token_ids=(0,))


def memory() -> tuple[int | None, int | None]:
    """``(bytes_in_use, peak_bytes_in_use)`` of the first device (``None`` where it keeps no statistics)."""
    import jax

    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")


def _less(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else a - b


def held_bytes(cache) -> int | None:
    """Bytes of the pages a pool's heads hold (``None`` for a uniform cache)."""
    import jax

    from sparsekv_jax.cache_pooled import PoolCache

    if not isinstance(cache, PoolCache):
        return None
    page = sum(x[0].size * x.dtype.itemsize for x in jax.tree.leaves(cache.pages))
    return int(cache.alloc.held.sum()) * page


def compress_layout(params, spec: str, layout: str, tokens, a, backend):
    """One layout's prefill and compress steps: ``(run, cache, first token, row)``, the prefill cache dropped."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax import engine
    from sparsekv_jax.engine.run import compressed_size
    from sparsekv_jax.policies import parse_policy

    before, _ = memory()
    session = engine.Session.start(params, parse_policy(spec), tokens, max_new_tokens=a.decode_tokens + 1,
                                   page_size=a.page_size, stop_tokens=(), backend=backend, pool=layout == "pool")
    prefilled = jax.block_until_ready(session.prefill())
    row = {"layout": layout, "prefill_cache_bytes": prefilled.cache.nbytes(),
           "in_use_after_prefill": _less(memory()[0], before)}
    if compressed_size(session.run) is None:  # full attention keeps its prefill cache (no copy by a program)
        cache, logits, fraction = prefilled.cache, prefilled.logits, 1.0
    else:
        compressed = jax.block_until_ready(session.compress())
        cache, logits = compressed.cache, compressed.logits
        fraction = float(jnp.mean(compressed.stats["kv_stored_fraction"]))
    session.prefilled = session.compressed = prefilled = compressed = None  # the prefill cache is gone
    in_use, peak = memory()
    row.update(cache_bytes=cache.nbytes(), held_bytes=held_bytes(cache), in_use_after_compress=_less(in_use, before),
               peak_bytes_in_use=peak, kv_stored_fraction=fraction,
               pool_pages=getattr(cache, "num_pages", None) if layout == "pool" else None)
    token = jnp.argmax(logits, -1).astype(jnp.int32)
    return session.run, cache, token, row


def run_policy(spec: str, a) -> list[dict]:
    """Both layouts of one policy in this process: memory after each step, then the interleaved decode."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax.backend import Backend
    from sparsekv_jax.bench.e2e import decode_fn, memory_bytes, random_weights, why
    from sparsekv_jax.models.config import llama31_8b_config

    cfg = tiny_config() if a.tiny else llama31_8b_config()
    params = random_weights(cfg, None, jnp.bfloat16)
    backend = Backend.kernels() if a.interpret else Backend()
    tokens = jax.random.randint(jax.random.key(1), (a.batch, a.context), 1, cfg.vocab_size)
    base = {"policy": spec, "context": a.context, "batch": a.batch, "device": jax.devices()[0].device_kind,
            "model": "tiny" if a.tiny else "llama3.1-8b (random bf16)", "page_size": a.page_size}
    rows, carries, fns = {}, {}, {}
    for layout in LAYOUTS:
        try:
            run, cache, token, row = compress_layout(params, spec, layout, tokens, a, backend)
            state = run.policy.stage("decode").decode_init(cache, None)
            fns[layout] = decode_fn(params, run.policy, a.steps, backend=run.backend).lower(
                params, cache, state, token).compile()
            row["decode_program_bytes"] = memory_bytes(fns[layout])
            rows[layout], carries[layout] = {**base, **row}, (cache, state, token)
        except Exception as e:  # noqa: BLE001 - report the layout and time the other one alone
            rows[layout] = {**base, "layout": layout, "error": why(e)}
    try:
        decode_both(params, fns, carries, rows, a)
    except Exception as e:  # noqa: BLE001
        for layout in carries:
            rows[layout]["error"] = f"decode: {why(e)}"
    return [rows["uniform"], rows["pool"]]


def decode_both(params, fns: dict, carries: dict, rows: dict, a) -> None:
    """``--decode-tokens`` tokens for each layout that compressed: two warm-up calls each, then calls
    interleaved uniform, pool, pool, uniform; ms/token and memory after into ``rows``."""
    from sparsekv_jax.bench.timing import timed_call

    times = {layout: [] for layout in carries}
    calls = a.decode_tokens // a.steps
    for layout in carries:  # warm-up: two calls each
        for _ in range(2):
            carries[layout], _ = timed_call(fns[layout], params, *carries[layout])
    for _ in range(calls // 2 - 1):
        for layout in ("uniform", "pool", "pool", "uniform"):
            if layout in carries:
                carries[layout], sec = timed_call(fns[layout], params, *carries[layout])
                times[layout].append(sec)
    in_use, peak = memory()
    for layout, carry in carries.items():
        cache = carry[0]
        rows[layout].update(decode_tokens=calls * a.steps, decode_ms_per_token=1e3 * statistics.median(times[layout])
                            / a.steps, decode_call_s=times[layout], cache_bytes_after_decode=cache.nbytes(),
                            held_bytes_after_decode=held_bytes(cache), in_use_after_decode=in_use,
                            peak_bytes_in_use_after_decode=peak)


def run_isolated(a) -> list[dict]:
    """`run_policy` for each policy in its own process (a clean allocator and high-water mark each)."""
    rows = []
    for spec in split_specs(a.policies):
        with tempfile.TemporaryDirectory() as tmp:
            part = os.path.join(tmp, "rows.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--in-process", "--policies", spec, "--out", part,
                   *(f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
                     if k in ("context", "batch", "decode_tokens", "steps", "page_size")),
                   *(["--tiny"] if a.tiny else []), *(["--interpret"] if a.interpret else [])]
            env = dict(os.environ)  # FullKV holds two 32k x 8 caches at once: more than JAX's default 75%
            env.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")
            done = subprocess.run(cmd, check=False, env=env)
            if os.path.exists(part):
                with open(part) as fh:
                    rows += json.load(fh)
            else:
                rows.append({"policy": spec, "error": f"child process exited with {done.returncode}"})
    return rows


def gib(x: int | None) -> str:
    return "-" if x is None else f"{x / 2**30:.4g}"


def table(rows: list[dict]) -> str:
    """The short table: per policy and layout, GiB held and decode ms/token, pool against uniform."""
    lines = ["| policy | layout | prefill cache GiB | cache GiB | held GiB | in use GiB after compress | "
             "after decode: cache GiB | peak GiB | ms/token | pool/uniform ms |", "|---" * 10 + "|"]
    by = {(r.get("policy"), r.get("layout")): r for r in rows}
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['policy']} | {r.get('layout', '-')} | error: {r['error']} |")
            continue
        uni = by.get((r["policy"], "uniform"), {})
        ratio = r["decode_ms_per_token"] / uni["decode_ms_per_token"] if "error" not in uni and uni else None
        lines.append(f"| {r['policy']} | {r['layout']} | {gib(r['prefill_cache_bytes'])} | {gib(r['cache_bytes'])} | "
                     f"{gib(r['held_bytes'])} | "
                     f"{gib(r['in_use_after_compress'])} | {gib(r['cache_bytes_after_decode'])} | "
                     f"{gib(r['peak_bytes_in_use'])} | {r['decode_ms_per_token']:.3f} | "
                     f"{'-' if ratio is None else f'{ratio:.3f}'} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated policy specs")
    p.add_argument("--context", type=int, default=None, help="prompt tokens per row (default 32768; --tiny 256)")
    p.add_argument("--batch", type=int, default=None, help="rows (default 8; --tiny 2)")
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens decoded per layout (default 512; "
                   "--tiny 16): a multiple of 2·steps")
    p.add_argument("--steps", type=int, default=None, help="decode steps per timed call (default 16; --tiny 4)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--tiny", action="store_true", help="CPU smoke test: a toy model, small sizes")
    p.add_argument("--interpret", action="store_true", help="Backend.kernels() (the Pallas kernels; interpreted "
                   "off a GPU) instead of the platform's default")
    p.add_argument("--in-process", action="store_true", help="run in this process (one policy per child is the "
                   "default)")
    p.add_argument("--out", help="write the rows as JSON here")
    a = p.parse_args(argv)
    for name, full, tiny in (("context", 32768, 256), ("batch", 8, 2), ("decode_tokens", 512, 16), ("steps", 16, 4)):
        if getattr(a, name) is None:
            setattr(a, name, tiny if a.tiny else full)
    if a.decode_tokens % (2 * a.steps) or a.decode_tokens < 4 * a.steps:
        p.error(f"--decode-tokens={a.decode_tokens} must be a multiple of 2·steps={2 * a.steps}, at least 4·steps")
    if a.in_process:
        rows = [row for spec in split_specs(a.policies) for row in run_policy(spec, a)]
    else:
        rows = run_isolated(a)
    if a.out:
        with open(a.out, "w") as fh:
            json.dump(rows, fh, indent=1)
    if not a.in_process:
        print(table(rows))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
