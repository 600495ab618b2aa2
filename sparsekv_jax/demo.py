"""`make demo`: the embedded SmolLM2 answers a ~4k-token needle-in-a-haystack prompt under each
baseline policy; prints the answers, whether they are right, what each policy stored and read,
and prefill/decode timings (compile time excluded).

    python -m sparsekv_jax.demo [--length 4096] [--budget 0.25] [--policies SPEC] [--seed 0]
"""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

DEFAULT_POLICIES = "fullkv, streamingllm({b}), snapkv({b}), h2o({b}), quest({b})"


def _timed_generate(params, policy, tokens, max_new_tokens: int, stop_tokens: tuple[int, ...]):
    """Generate with the prefill stage (prefill + compression) and the decode loop compiled
    ahead of time and timed apart; returns ``(tokens, stats, prefill_s, decode_s)``."""
    from sparsekv_jax.generate import GREEDY, _setup, decode_loop, prepare

    run = _setup(params, policy, tokens, None, None, None, max_new_tokens, 16, None, None)
    pol, toks, lens = run.policy, run.tokens, run.lengths
    pre = jax.jit(lambda p, pol, t, ln: prepare(p, pol, t, ln, None, None, extra_tokens=max_new_tokens,
                                                page_size=16, prefill_chunk=None, capacity=run.capacity,
                                                backend=run.backend))
    pre = pre.lower(params, pol, toks, lens).compile()
    t0 = time.perf_counter()
    logits, cache, state, stats = jax.block_until_ready(pre(params, pol, toks, lens))
    prefill_s = time.perf_counter() - t0
    dec = jax.jit(lambda p, pol, lg, c, st, k: decode_loop(p, pol, lg, c, st, k, max_new_tokens=max_new_tokens,
                                                           sampling=GREEDY, stop_tokens=stop_tokens,
                                                           backend=run.backend))
    key = jax.random.key(0)
    dec = dec.lower(params, pol, logits, cache, state, key).compile()
    t0 = time.perf_counter()
    out, n, _, read, _ = jax.block_until_ready(dec(params, pol, logits, cache, state, key))
    decode_s = time.perf_counter() - t0
    return np.asarray(out[0, : int(n[0])]).tolist(), {**stats, "kv_read_fraction": read}, prefill_s, decode_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsekv_jax.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096, help="prompt length in tokens (chat template included)")
    ap.add_argument("--budget", type=float, default=0.25, help="KV budget of the baselines (fraction)")
    ap.add_argument("--policies", default=None, help=f"policy spec (default: {DEFAULT_POLICIES})")
    ap.add_argument("--seed", type=int, default=0, help="seed of the needle prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="answer length cap")
    args = ap.parse_args(argv)

    from sparsekv_jax import load
    from sparsekv_jax.eval.ruler import generate_samples
    from sparsekv_jax.policies import parse_policies

    policies = parse_policies(args.policies or DEFAULT_POLICIES.format(b=args.budget))
    print(f"device: {jax.devices()[0].device_kind} ({jax.default_backend()}), jax {jax.__version__}")
    params, tokenizer = load("smollm2")
    sample = generate_samples("niah_single_1", args.length, 1, args.seed, tokenizer, chat=True)[0]
    ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
    tokens = np.asarray([ids])
    stops = tuple(params.config.eos_token_ids) + tuple(
        t for t in (tokenizer.convert_tokens_to_ids("<|im_end|>"),) if isinstance(t, int) and t >= 0)
    print(f"prompt: {len(ids)} tokens, needle value {sample.answers[0]!r} at depth {sample.depth:.0%}\n")

    rows = []
    for policy in policies:
        new, stats, prefill_s, decode_s = _timed_generate(params, policy, tokens, args.max_new_tokens, stops)
        answer = tokenizer.decode(new, skip_special_tokens=True).strip()
        decode_ms = 1e3 * decode_s / max(len(new) - 1, 1)
        rows.append((policy.name, answer, sample.score(answer) >= 1.0, float(stats["kv_stored_fraction"][0]),
                     float(stats["kv_read_fraction"][0]), prefill_s, decode_ms))
        print(f"  {policy.name}: {answer!r}", flush=True)

    print(f"\n{'policy':<14}{'right':>6}{'KV stored':>11}{'KV read':>9}{'prefill s':>11}{'decode ms/tok':>15}  answer")
    for name, answer, ok, stored, read, pre, dec in rows:
        print(f"{name:<14}{'yes' if ok else 'NO':>6}{stored:>10.0%}{read:>9.0%}{pre:>11.2f}{dec:>15.1f}"
              f"  {answer[:40]!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
