"""CHESS speed against full attention (random bf16 weights of a real model's shapes).

Three measurements, each after a warm-up, median of ``--iters`` timed runs:

1. **Throughput** at a ``--context`` prompt and the largest batch whose cache fits next to the
   weights (both policies read the same cache: CHESS evicts nothing). ``--steps`` decode steps of
   `decode_step` run in one `lax.fori_loop` with the cache donated and fed back.
2. **Latency over a long generation**: from a ``--context`` prompt, ``--gen`` tokens at
   ``--latency-batch``, timed in chunks of ``--chunk`` steps; CHESS rebuilds its selection every
   ``--interval`` pages (the paper's average: ~10 pages between rebuilds).
3. **Selection cost**: one rebuild (anchor, scores of every page, grid → chunk → page masks, page
   list) and the per-step page-list refresh, each timed alone, as a share of a CHESS step; on a
   GPU the rebuild is also timed with its page sums in jnp (`chess.PAGE_SUMS_IMPL`). The
   per-step share inside the step is measured by difference: the throughput run also times CHESS
   with its per-step update removed (``[frozen]``: same pages every step, no entropy statistics,
   no page list upkeep), so ``1 - frozen / CHESS`` is what the selection upkeep costs in the step.

    python -m sparsekv_jax.bench.chess --context 32k --gen 6k --out chess.json
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

from sparsekv_jax.bench.e2e import MODELS, decode_cache, decode_fn, median_time, median_time_carry, parse_tokens
from sparsekv_jax.policies.base import Setup


def _weights_bytes(params) -> int:
    import jax

    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(params))


def largest_batch(cfg, params, policies, context: int, steps: int, page_size: int, limit: int = 64) -> int:
    """The largest batch whose compiled decode step fits every policy in device memory.

    Starts from what the cache alone allows next to the weights and steps down until XLA's memory
    analysis of the compiled step (arguments + outputs + temporaries, cache donated) fits in 95% of
    the device: the step's temporaries are not known otherwise (a first estimate from the cache
    alone ran out of memory on an 80 GB H100).
    """
    import jax
    import jax.numpy as jnp

    from sparsekv_jax.bench.e2e import memory_bytes
    from sparsekv_jax.cache import init_cache

    shapes = jax.eval_shape(lambda: init_cache(cfg, 1, context + steps, page_size=page_size, dtype=jnp.bfloat16))
    per_row = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))
    total = (jax.devices()[0].memory_stats() or {}).get("bytes_limit", 16 * 2**30)
    batch = max(1, min(limit, int((total * 0.95 - _weights_bytes(params)) // per_row)))
    while batch > 1:
        need = 0
        for policy in policies:
            pol = policy.bind(Setup(cfg, prompt_len=context))
            cache = jax.eval_shape(lambda b=batch, p=pol: decode_cache(cfg, p, context, b, steps, jax.random.key(0),
                                                                       page_size=page_size)[0])
            state = jax.eval_shape(lambda c, p=pol: p.decode_init(c, None), cache)
            token = jax.ShapeDtypeStruct((batch,), jnp.int32)
            compiled = decode_fn(params, pol, steps).lower(params, cache, state, token).compile()
            need = max(need, memory_bytes(compiled) or 0)
        if need <= total * 0.95:
            return batch
        batch = min(batch - 1, int(batch * total * 0.95 / need)) if need else batch - 1
    return 1


def frozen(policy):
    """``policy`` with `decode_update` removed: it reads the pages its `decode_init` chose at every
    step. Timed next to the policy, the difference is the in-step cost of its per-step upkeep."""
    import dataclasses

    from flax import struct

    @struct.dataclass
    class Frozen(type(policy)):
        def decode_update(self, shared_state, cache, logits):
            return shared_state

        @property
        def name(self) -> str:
            return super().name + "[frozen]"

    return Frozen(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)})


def _start(cfg, pol, context: int, batch: int, steps: int, seed: int, page_size: int):
    """A random cache holding ``context`` tokens (room for ``steps`` more), the policy's decode
    state on it and a first token."""
    import jax
    import jax.numpy as jnp

    cache, _ = decode_cache(cfg, pol, context, batch, steps, jax.random.key(seed), page_size=page_size)
    return cache, pol.decode_init(cache, None), jnp.ones((batch,), jnp.int32)


def throughput(cfg, params, policies, context: int, batch: int, steps: int, iters: int, page_size: int) -> list[dict]:
    rows = []
    for pol in policies:
        pol = pol.bind(Setup(cfg, prompt_len=context))
        cache, state, token = _start(cfg, pol, context, batch, steps, 2, page_size)
        fn = decode_fn(params, pol, steps, start=(cache.length, cache.next_position))
        sec, carry = median_time_carry(fn, params, (cache, state, token), iters=iters)
        rows.append({"kind": "throughput", "policy": pol.name, "context": context, "batch": batch,
                     "ms_per_step": sec * 1e3 / steps, "tokens_per_s": batch * steps / sec,
                     "cache_bytes": carry[0].nbytes()})
        del cache, state, carry
    return rows


def selection_cost(cfg, policy, context: int, batch: int, iters: int, page_size: int) -> dict:
    import jax

    from sparsekv_jax.backend import Backend

    pol = policy.bind(Setup(cfg, prompt_len=context))
    cache, _ = decode_cache(cfg, pol, context, batch, 1, jax.random.key(3), page_size=page_size)

    def rebuild_fn(p):
        return jax.jit(lambda c: p.page_list(p.select_pages(c, c.length), c.length + 1, c))

    rebuild = rebuild_fn(pol)
    selected = pol.select_pages(cache, cache.length)
    refresh = jax.jit(lambda c, s: pol.page_list(s, c.length + 1, c))
    # the per-step work CHESS adds (entropy statistics of the logits, trigger test, page list kept
    # or rebuilt): a step inside a page, and a step that starts a page (the page list is rebuilt)
    _, state = pol.decode_init(cache, None)
    logits = jax.random.normal(jax.random.key(4), (batch, cfg.vocab_size), jax.numpy.float32) * 3
    update = jax.jit(pol.decode_update)
    page_start = {**state, "used": state["used"] - 1}
    out = {"kind": "selection", "policy": pol.name, "context": context, "batch": batch,
           "rebuild_ms": median_time(rebuild, cache, iters=iters) * 1e3,
           "page_list_ms": median_time(refresh, cache, selected, iters=iters) * 1e3,
           "update_ms": median_time(update, state, cache, logits, iters=iters) * 1e3,
           "update_page_start_ms": median_time(update, page_start, cache, logits, iters=iters) * 1e3,
           "page_sums": pol.page_sums}
    if pol.page_sums != "jnp" and pol.keys == "pre_rope":
        # the same rebuild with the page sums in jnp (the layer sliced out of the stack: a copy)
        jnp_pol = policy.bind(Setup(cfg, prompt_len=context, backend=Backend(page_sums="jnp").resolve()))
        out["rebuild_jnp_ms"] = median_time(rebuild_fn(jnp_pol), cache, iters=iters) * 1e3
    del cache
    return out


def latency(cfg, params, policies, context: int, gen: int, chunk: int, batch: int, page_size: int) -> list[dict]:
    """ms/token of each chunk of ``chunk`` steps over ``gen`` generated tokens."""
    import jax
    import jax.numpy as jnp

    rows = []
    for pol in policies:
        pol = pol.bind(Setup(cfg, prompt_len=context))
        cache, state, token = _start(cfg, pol, context, batch, gen, 4, page_size)
        fn = decode_fn(params, pol, chunk)
        # warm-up on a throwaway copy: compile, and do not advance the real cache
        jax.block_until_ready(fn(params, *jax.tree.map(jnp.copy, (cache, state, token))))
        carry = (cache, state, token)
        per_chunk = []
        for _ in range(gen // chunk):
            t0 = time.perf_counter()
            carry = jax.block_until_ready(fn(params, *carry))
            per_chunk.append((time.perf_counter() - t0) * 1e3 / chunk)
        rows.append({"kind": "latency", "policy": pol.name, "context": context, "batch": batch, "chunk": chunk,
                     "ms_per_token": per_chunk, "mean": statistics.mean(per_chunk),
                     "spread": (max(per_chunk) - min(per_chunk)) / statistics.mean(per_chunk)})
        del cache, state, carry
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsekv_jax.bench.chess", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama3.1-8b", choices=sorted(MODELS), help="model shapes")
    p.add_argument("--context", default="32k", help="prompt tokens already in the cache (default 32k)")
    p.add_argument("--batch", type=int, default=0, help="throughput batch (default 0: the largest that fits)")
    p.add_argument("--steps", type=int, default=32, help="decode steps per timed run (default 32)")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions (default 5)")
    p.add_argument("--preset", default="aggressive", help="CHESS preset (default aggressive)")
    p.add_argument("--page-size", type=int, default=32, help="CHESS page size (default 32, the paper's)")
    p.add_argument("--cache-page-size", type=int, default=16,
                   help="the cache's page size (default 16, the library's; a CHESS page spans several cache "
                        "pages; 32-token cache pages measured 1.6 ms/step slower for both policies on an H200)")
    p.add_argument("--literal", action="store_true",
                   help="the paper-literal page vectors: stored post-RoPE keys, not centred (no key read per rebuild)")
    p.add_argument("--gen", default="6k", help="generated tokens of the latency run (default 6k; 0 = skip)")
    p.add_argument("--chunk", type=int, default=256, help="steps per latency sample (default 256)")
    p.add_argument("--latency-batch", type=int, default=1, help="batch of the latency run (default 1)")
    p.add_argument("--interval", type=int, default=10, help="pages between rebuilds in the latency run (default 10)")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from sparsekv_jax.backend import Backend
    from sparsekv_jax.models import config as mc
    from sparsekv_jax.models.params import random_params
    from sparsekv_jax.policies import CHESS, Dense

    cfg = getattr(mc, MODELS[args.model])()
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16)
    context, gen = parse_tokens(args.context)[0], parse_tokens(args.gen)[0] if args.gen != "0" else 0
    ps = args.page_size
    cps = args.cache_page_size
    if ps % cps:
        p.error(f"--page-size {ps} must be a multiple of --cache-page-size {cps}")
    variant = {"keys": "post_rope", "centred": False} if args.literal else {}
    chess = CHESS.preset(args.preset, page_size=ps, **variant)
    batch = args.batch or largest_batch(cfg, params, [Dense(), chess], context, args.steps, cps)
    base = {"model": args.model, "chess_page_size": ps, "cache_page_size": cps,
            "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "decode_matmul": Backend().resolve(params).decode_matmul}
    rows: list[dict] = []

    def save() -> None:  # after every stage: a run stopped at its time limit keeps what it measured
        if args.out:
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=2)

    while True:
        try:
            rows += [{**base, **r} for r in throughput(cfg, params, [Dense(), chess, frozen(chess)], context, batch,
                                                       args.steps, args.iters, cps)]
            break
        except jax.errors.JaxRuntimeError as e:
            # XLA's memory analysis of the compiled step does not see every run-time buffer: step
            # down until the batch really runs (the rows say which batch that was)
            if "RESOURCE_EXHAUSTED" not in str(e) or args.batch or batch == 1:
                raise
            print(f"batch {batch} ran out of device memory at run time; trying {batch - 1}", flush=True)
            rows.clear()
            batch -= 1
            jax.clear_caches()
            gc.collect()
    save()
    rows.append({**base, **selection_cost(cfg, chess, context, batch, args.iters, cps)})
    save()
    if gen:
        periodic = CHESS.preset(args.preset, page_size=ps, trigger="interval", interval=args.interval, **variant)
        rows += [{**base, **r} for r in latency(cfg, params, [periodic, Dense()], context, gen, args.chunk,
                                                args.latency_batch, cps)]
        save()
    thr = {r["policy"]: r for r in rows if r["kind"] == "throughput"}
    sel = next(r for r in rows if r["kind"] == "selection")
    dense, sparse = thr["Dense"], thr[chess.name]
    print(f"\nthroughput  {args.model} ctx {context} B {batch}: FullKV {dense['ms_per_step']:.2f} ms/step "
          f"({dense['tokens_per_s']:,.0f} tok/s), {chess.name} {sparse['ms_per_step']:.2f} ms/step "
          f"({sparse['tokens_per_s']:,.0f} tok/s) -> {sparse['tokens_per_s'] / dense['tokens_per_s']:.2f}x")
    step = sparse["ms_per_step"]
    still = thr[frozen(chess).name]["ms_per_step"]
    print(f"in-step     {chess.name} {step:.3f} ms/step, without its per-step update {still:.3f} ms/step: "
          f"the update costs {step - still:.3f} ms = {(step - still) / step:.2%} of a step")
    per_step = sel["update_ms"] + (sel["update_page_start_ms"] - sel["update_ms"]) / ps  # rows in lockstep
    if "rebuild_jnp_ms" in sel:
        print(f"rebuild     page sums {sel['page_sums']}: {sel['rebuild_ms']:.3f} ms; "
              f"with them in jnp: {sel['rebuild_jnp_ms']:.3f} ms")
    print(f"selection   rebuild {sel['rebuild_ms']:.3f} ms = {sel['rebuild_ms'] / step:.1%} of a step "
          f"({sel['rebuild_ms'] / step / (args.interval * ps):.2%} amortised over {args.interval} pages); "
          f"per step {sel['update_ms']:.3f} ms, at a page start {sel['update_page_start_ms']:.3f} ms "
          f"(page list {sel['page_list_ms']:.3f} ms); mean per step {per_step:.3f} ms = {per_step / step:.2%}; "
          f"total with rebuilds {per_step / step + sel['rebuild_ms'] / step / (args.interval * ps):.2%}")
    for r in rows:
        if r["kind"] == "latency":
            lat = r["ms_per_token"]
            print(f"latency     {r['policy']:<18} B {r['batch']}: first {lat[0]:.2f}, last {lat[-1]:.2f}, "
                  f"min {min(lat):.2f}, max {max(lat):.2f} ms/token (spread {r['spread']:.1%} of the mean)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
