"""BSER's cost on a GPU: the probe and the selection after a 32k prefill, and decode over the cache
it leaves, against full attention. Llama-3.1-8B shapes, random bf16 weights, one process.

1. **check** — on the 32k prompt: the probe gated by ``lax.cond`` (default) and computed in every
   layer then masked (``gate="mask"``) choose the same entries; the compressed cache holds the
   sinks, the question and the window, positions strictly increasing, no more than its capacity.
2. **prefill** (batch 1, 32k, a 64-token question at the end, question-aware): full attention's
   prefill; the same prefill with BSER's observations (the question's attention in the top 4 layers,
   the block Gram matrices of ``E``); the selection + compaction alone; and both in one program.
   "probe + selection" = (prefill with observations − prefill) + selection, as a share of the
   prefill (target ≤ 5%).
3. **decode** — ms/token at 32k and 128k, batch 1 and a large batch, with the cache BSER's default
   leaves: threshold mode sizes it for ``max_kept`` = 50% of the prompt (random weights make the
   thresholds meaningless, so the timed budget is that cap, the most a default BSER cache holds),
   against FullKV; the cache bytes and XLA's memory analysis of the decode step (arguments +
   outputs + temporaries, weights included). Timed like `sparsekv_jax.bench.e2e` (its helpers).

Block size 128 here (the paper's, for 8B-sized models; the library default 64 is for SmolLM2).

    python scripts/bser_gpu.py --out $OUT/bser_gpu.json          # H100: about 5 minutes
    python scripts/bser_gpu.py --cpu-smoke --out out/bser_smoke.json

Prints one table last.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.bench.e2e import _decode_cache, _median_time, _median_time_carry, _memory, _tokens, decode_fn
from sparsekv_jax.cache import init_cache
from sparsekv_jax.generate import prefill
from sparsekv_jax.models.config import ModelConfig, llama31_8b_config
from sparsekv_jax.models.params import random_params
from sparsekv_jax.policies import BSER, Dense
from sparsekv_jax.policies.base import Prompt, Setup

GIB = 2.0**30


def smoke_config() -> ModelConfig:
    return ModelConfig(family="llama", vocab_size=256, hidden_size=64, num_layers=6, num_heads=4, num_kv_heads=2,
                       head_dim=16, intermediate_size=128, max_position_embeddings=4096, eos_token_ids=(0,))


def prefill_section(params, policy: BSER, T: int, question: int, steps: int, iters: int, rows: list) -> None:
    cfg = params.config
    tokens = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.vocab_size)
    lengths = jnp.full((1,), T, jnp.int32)
    qs = jnp.full((1,), T - question, jnp.int32)
    prompt = Prompt(tokens=tokens, lengths=lengths, question_start=qs)
    capacity = policy.compressed_capacity(T, steps)
    variants = {"cond": policy, "mask": policy.replace(gate="mask")}

    def run_dense(params, tokens):
        cache = init_cache(cfg, 1, T + steps, dtype=jnp.bfloat16)
        logits, cache, _, _ = prefill(params, Dense(), tokens, lengths, cache)
        return logits, cache

    def run_observe(pol):
        def run(params, tokens):
            cache = init_cache(cfg, 1, T + steps, dtype=jnp.bfloat16)
            logits, cache, obs, _ = prefill(params, pol, tokens, lengths, cache, question_start=qs)
            return logits, cache, obs["compress"]
        return run

    def run_select(cache, obs):
        return policy.compress(cache, obs, capacity, prompt)

    def run_both(params, tokens):
        logits, cache, obs = run_observe(policy)(params, tokens)
        return logits, policy.compress(cache, obs, capacity, prompt)

    observe = {gate: jax.jit(run_observe(pol)).lower(params, tokens).compile() for gate, pol in variants.items()}
    _, cache, obs = observe["cond"](params, tokens)
    select = jax.jit(run_select).lower(cache, obs).compile()  # the gate does not change the selection's code

    # check: both gates choose the same entries; the compressed cache keeps what it must
    kept = {}
    for gate in variants:
        _, cache, obs = observe[gate](params, tokens)
        out = select(cache, obs)
        kept[gate] = np.asarray(out.layers.positions[0, 0, 0, : int(out.length[0])])
        del cache, obs, out
    pos = kept["cond"]
    must = np.r_[0:policy.sinks, T - question:T]
    checks = {"gates_agree": bool(np.array_equal(kept["cond"], kept["mask"])),
              "increasing": bool((np.diff(pos) > 0).all()), "fits": int(len(pos)) <= capacity,
              "keeps_sinks_question": bool(np.isin(must, pos).all()), "kept": int(len(pos))}
    rows.append({"kind": "check", **checks})
    print(json.dumps(rows[-1]), flush=True)

    times = {}
    programs = (("prefill (FullKV)", jax.jit(run_dense).lower(params, tokens).compile()),
                ("prefill + observe (cond)", observe["cond"]), ("prefill + observe (mask)", observe["mask"]),
                ("prefill + observe + select", jax.jit(run_both).lower(params, tokens).compile()))
    for name, compiled in programs:
        times[name] = _median_time(compiled, params, tokens, iters=iters)
        rows.append({"kind": "prefill", "what": name, "context": T, "ms": times[name] * 1e3,
                     "memory_bytes": _memory(compiled)})
        print(json.dumps(rows[-1]), flush=True)
    del programs, observe
    _, cache, obs = jax.jit(run_observe(policy))(params, tokens)
    times["select"] = _median_time(select, cache, obs, iters=iters)
    rows.append({"kind": "prefill", "what": "select + compact alone", "context": T, "ms": times["select"] * 1e3,
                 "memory_bytes": _memory(select),
                 "observation_bytes": int(sum(x.nbytes for x in jax.tree.leaves(obs)))})
    print(json.dumps(rows[-1]), flush=True)
    del cache, obs, select
    base = times["prefill (FullKV)"]
    for gate in ("cond", "mask"):
        probe = times[f"prefill + observe ({gate})"] - base + times["select"]
        rows.append({"kind": "share", "what": f"probe + selection ({gate})", "context": T, "ms": probe * 1e3,
                     "share_of_prefill": probe / base})
        print(json.dumps(rows[-1]), flush=True)


def decode_section(params, policy: BSER, contexts: list[int], batches: dict[int, list[int]], steps: int,
                   iters: int, rows: list) -> None:
    cfg = params.config
    for T in contexts:
        for B in batches[T]:
            for name, pol in (("FullKV", Dense()), (policy.name, policy)):
                pol = pol.bind(Setup(cfg, prompt_len=T, max_new_tokens=steps))
                row = {"kind": "decode", "policy": name, "context": T, "batch": B}
                try:
                    cache, obs = _decode_cache(cfg, pol, T, B, steps, jax.random.key(2))
                    del obs
                    token = jnp.ones((B,), jnp.int32)
                    fn = decode_fn(params, pol, steps, start=(cache.length, cache.next_position))
                    state = pol.decode_init(cache, None)  # BSER decodes densely over what it kept
                    compiled = fn.lower(params, cache, state, token).compile()
                    row.update(cache_bytes=cache.nbytes(), kept=int(cache.length[0]), memory_bytes=_memory(compiled))
                    sec, _ = _median_time_carry(compiled, params, (cache, state, token), iters=iters)
                    row.update(ms_per_token=sec * 1e3 / steps, tokens_per_s=B * steps / sec)
                    del cache, compiled
                except Exception as e:  # noqa: BLE001 - report the point and go on
                    text = str(e)
                    row["error"] = ("does not fit" if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower()
                                    else f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}")
                rows.append(row)
                print(json.dumps(rows[-1]), flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON rows")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny model and lengths (checks the script runs)")
    p.add_argument("--prefill-context", default="32k")
    p.add_argument("--contexts", default="32k,128k", help="decode contexts")
    p.add_argument("--batches", default="32k:1,8;128k:1,2", help="decode batches per context ('32k:1,8;128k:1,2')")
    p.add_argument("--question", type=int, default=64, help="question tokens at the end of the prompt")
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--steps", type=int, default=8, help="decode steps per timed run")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--skip", default="", help="comma list of sections to skip: prefill, decode")
    args = p.parse_args(argv)
    if args.cpu_smoke:
        cfg, dtype = smoke_config(), jnp.float32
        args.prefill_context, args.contexts, args.batches, args.block_size = "512", "512,1k", "512:1,2;1k:1", 32
        args.question, args.iters, args.steps = 32, 1, 4
    else:
        cfg, dtype = llama31_8b_config(), jnp.bfloat16
    t0 = time.time()
    params = random_params(cfg, jax.random.key(0), dtype)
    policy = BSER(block_size=args.block_size)
    T = _tokens(args.prefill_context)[0]
    batches = {}
    for part in args.batches.split(";"):
        ctx, bs = part.split(":")
        batches[_tokens(ctx)[0]] = _tokens(bs)
    rows: list[dict] = [{"kind": "meta", "device": jax.devices()[0].device_kind, "jax": jax.__version__,
                         "model": "smoke" if args.cpu_smoke else "llama3.1-8b (random bf16)",
                         "policy": repr(policy), "argv": sys.argv[1:]}]
    skip = set(args.skip.split(","))
    if "prefill" not in skip:
        prefill_section(params, policy.bind(Setup(cfg, prompt_len=T, max_new_tokens=args.steps)), T, args.question,
                        args.steps, args.iters, rows)
    if "decode" not in skip:
        decode_section(params, policy, _tokens(args.contexts), batches, args.steps, args.iters, rows)
    rows.append({"kind": "meta", "seconds": round(time.time() - t0, 1)})
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=1)

    print(f"\n{'what':<34}{'ctx':>8}{'B':>4}{'ms':>10}{'ms/tok':>9}{'share':>8}{'kept':>8}{'cache GiB':>10}"
          f"{'mem GiB':>9}")
    for r in rows:
        if r["kind"] == "check":
            print(f"check: {', '.join(f'{k}={v}' for k, v in r.items() if k != 'kind')}")
        elif r["kind"] in ("prefill", "share"):
            mem = f"{r['memory_bytes'] / GIB:9.2f}" if r.get("memory_bytes") else f"{'':>9}"
            share = f"{100 * r['share_of_prefill']:7.2f}%" if "share_of_prefill" in r else f"{'':>8}"
            print(f"{r['what']:<34}{r['context']:>8}{1:>4}{r['ms']:>10.1f}{'':>9}{share}{'':>8}{'':>10}{mem}")
        elif r["kind"] == "decode":
            head = f"{'decode ' + r['policy']:<34}{r['context']:>8}{r['batch']:>4}"
            if "error" in r:
                print(f"{head}  {r['error']}")
                continue
            print(f"{head}{'':>10}{r['ms_per_token']:>9.2f}{'':>8}{r['kept']:>8}{r['cache_bytes'] / GIB:>10.2f}"
                  f"{(r['memory_bytes'] or 0) / GIB:>9.2f}")
    print(f"total {rows[-1]['seconds']} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
