"""CPU speed of the main job against Hugging Face transformers, in one run, same machine.

SmolLM2-135M-Instruct from the embedded GGUF, loaded by both sides in the same dtype (fp32: the
Q4_1 weights dequantised), on a ~4k-token needle prompt (chat template, as `make demo` builds it).
Ours: the jitted prefill (`engine.prepare` with full attention) and the jitted decode loop
(`engine.decode_ready`), each compiled ahead of time (compile time excluded). Theirs: one
``model(ids, use_cache=True)`` call, then one call per token with the KV cache. Both decode the
same number of tokens greedily, stop tokens ignored. The sides run interleaved, ``--repeats``
times, and the medians are reported, with the machine's load average before and after (other
processes on a shared machine slow both sides: compare within one run only).

``--ours`` names configurations of `sparsekv_jax.Backend` to time side by side:

    auto    the defaults (what `generate` does on this machine)
    before  the CPU's configuration before issue 18: XLA's dense attention in prefill, the decode
            cache scanned as xs/ys (``Backend(dense_prefill="xla", decode_carry=False)``), on
            today's code (the single-query decode attention included)
    xla     XLA's dense prefill attention, otherwise the defaults
    xs      the decode cache scanned as xs/ys, otherwise the defaults
    carry   the decode cache carried through the layer scan, otherwise the defaults (= auto)
    xladots the prefill compiled with XLA's own dots (``Backend(prefill_dots="xla")``), otherwise the
            defaults (which compile it with oneDNN's dots on an x86 CPU, `Backend.prefill_dots`)
    heads3  the defaults on a mesh of 3 host devices splitting the 3 KV heads (``model=3``,
            `sparsekv_jax.sharding`): the CPU's cores work on three independent attention loops
            (XLA:CPU runs one loop's small matmuls on about 1.3 of 2 cores). The script then starts
            JAX with ``--xla_force_host_platform_device_count=3``; the other configurations run
            on the first of those devices.

Each run's line gives the 1-minute load average when it started: measure on an idle machine.

    python experiments/cpu_speed.py --length 4096 --decode-tokens 32 --repeats 3 --ours auto,xs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's sparsekv_jax, not an installed one

CONFIGS = {
    "auto": {},
    "before": {"dense_prefill": "xla", "decode_carry": False},
    "xla": {"dense_prefill": "xla"},
    "xs": {"decode_carry": False},
    "carry": {"decode_carry": True},
    "heads3": {"mesh_model": 3},
    "xladots": {"prefill_dots": "xla"},
}


def _ours(params, backend, tokens, n_new):
    """AOT-compiled (prefill, decode) callables of full attention for ``tokens`` [1, T]."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax import engine, sharding
    from sparsekv_jax.policies import Dense

    params, backend = sharding.on_mesh(params, tokens, backend.mesh, backend)

    T = tokens.shape[1]
    lengths = jnp.asarray([T], jnp.int32)
    capacity = -(-(T + n_new) // 16) * 16
    pol = Dense()
    run = engine.setup(params, pol, tokens, lengths, max_new_tokens=n_new, stop_tokens=(), capacity=capacity,
                       backend=backend)
    pre = engine.compiled_prepare(params, run)  # oneDNN's dots where prefill_dots says
    ready = pre(params, run)
    dec = jax.jit(lambda p, r, k: (lambda o: (o.tokens, o.num_generated))(engine.decode_ready(p, run, r, k)))
    dec = dec.lower(params, ready, jax.random.key(0)).compile()

    def prefill():
        return jax.block_until_ready(pre(params, run))

    def decode(ready):
        out, n = jax.block_until_ready(dec(params, ready, jax.random.key(0)))
        return np.asarray(out[0, : int(n[0])]).tolist()

    return prefill, decode


def _theirs(model, ids, n_new, threads):
    import torch

    def prefill():
        torch.set_num_threads(threads)
        with torch.no_grad():
            return model(ids, use_cache=True, logits_to_keep=1)

    def decode(prefilled):
        torch.set_num_threads(threads)
        out, cache = [int(prefilled.logits[0, -1].argmax())], prefilled.past_key_values
        with torch.no_grad():
            for _ in range(n_new - 1):
                step = model(torch.tensor([[out[-1]]]), past_key_values=cache, use_cache=True)
                cache = step.past_key_values
                out.append(int(step.logits[0, -1].argmax()))
        return out

    return prefill, decode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096, help="prompt length in tokens (chat template included)")
    ap.add_argument("--decode-tokens", type=int, default=32, help="tokens decoded per run (the first from prefill)")
    ap.add_argument("--repeats", type=int, default=3, help="interleaved runs per side; medians are reported")
    ap.add_argument("--ours", default="auto,xs", help=f"Backend configurations: {', '.join(CONFIGS)}")
    ap.add_argument("--no-transformers", action="store_true", help="time our configurations only")
    ap.add_argument("--torch-threads", default="",
                    help="also time transformers with these torch thread counts (e.g. '1': on a loaded machine "
                         "torch's spinning OpenMP threads can lose more than single-threaded torch)")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"), help="folder for cpu_speed.json ($OUT)")
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.ours.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        raise SystemExit(f"--ours: unknown configuration(s) {bad}; known: {list(CONFIGS)}")

    devices = max([CONFIGS[n].get("mesh_model", 1) for n in names])
    if devices > 1:  # host devices exist only if asked for before JAX starts
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                                   f" --xla_force_host_platform_device_count={devices}").strip()
    import jax
    import jax.numpy as jnp

    from sparsekv_jax import Backend, load, sharding
    from sparsekv_jax.bench.timing import timed_call
    from sparsekv_jax.eval.ruler import generate_samples
    from sparsekv_jax.models.embedded import embedded_gguf_path

    load_before = os.getloadavg()
    params, tok = load("smollm2", dtype=jnp.float32, progress=False)
    sample = generate_samples("niah_single_1", args.length, 1, 0, tok, chat=True)[0]
    ids = tok(sample.prompt, add_special_tokens=False)["input_ids"]
    tokens = jnp.asarray([ids], jnp.int32)
    sides = {}
    for name in names:
        t0 = time.perf_counter()
        kwargs = dict(CONFIGS[name])
        model = kwargs.pop("mesh_model", 1)
        mesh = sharding.make_mesh(data=1, model=model) if model > 1 else None
        backend = Backend(**kwargs, mesh=mesh).resolve(params)
        sides[f"ours:{name}"] = _ours(params, backend, tokens, args.decode_tokens)
        print(f"ours:{name}: compiled in {time.perf_counter() - t0:.1f} s ({backend})", flush=True)
    if not args.no_transformers:
        import torch
        import transformers

        gguf = embedded_gguf_path()
        model = transformers.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                                  dtype=torch.float32).eval()
        default_threads = torch.get_num_threads()
        for threads in [default_threads] + [int(t) for t in args.torch_threads.split(",") if t.strip()]:
            prefill, decode = _theirs(model, torch.tensor([ids]), args.decode_tokens, threads)
            sides["transformers" if threads == default_threads else f"transformers:{threads}thr"] = prefill, decode
            prefill()  # warm-up (first-call allocations)
        theirs_info = {"transformers": transformers.__version__, "torch": torch.__version__,
                       "torch_threads": default_threads, "attention": model.config._attn_implementation}
    else:
        theirs_info = {}

    times = {side: {"prefill_s": [], "decode_ms_per_token": [], "load1": []} for side in sides}
    generated = {}
    for r in range(args.repeats):
        for side, (prefill, decode) in sides.items():
            load1 = os.getloadavg()[0]
            pre, t_pre = timed_call(prefill)
            out, t_dec = timed_call(decode, pre)
            times[side]["prefill_s"].append(t_pre)
            times[side]["decode_ms_per_token"].append(1e3 * t_dec / max(args.decode_tokens - 1, 1))
            times[side]["load1"].append(load1)
            generated[side] = out
            print(f"run {r + 1}/{args.repeats} {side}: prefill {t_pre:.2f} s, decode "
                  f"{times[side]['decode_ms_per_token'][-1]:.1f} ms/token (load {load1:.2f} at its start)", flush=True)
    load_after = os.getloadavg()

    result = {
        "prompt_tokens": len(ids), "decode_tokens": args.decode_tokens, "repeats": args.repeats, "dtype": "float32",
        "model": "SmolLM2-135M-Instruct (embedded GGUF, Q4_1 dequantised)", "cpu_count": os.cpu_count(),
        "load_average_before": load_before, "load_average_after": load_after,
        "jax": jax.__version__, **theirs_info,
        "configs": {n: CONFIGS[n] for n in names},
        "median": {s: {k: statistics.median(v) for k, v in t.items() if k != "load1"} for s, t in times.items()},
        "runs": times, "generated": generated,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cpu_speed.json").write_text(json.dumps(result, indent=1))
    first = next(iter(generated.values()))
    agree = {s: sum(a == b for a, b in zip(g, first, strict=False)) for s, g in generated.items()}
    print(f"\nSmolLM2 fp32, {len(ids)}-token prompt, {args.decode_tokens} tokens decoded, median of {args.repeats}; "
          f"load average {load_before[0]:.1f} before, {load_after[0]:.1f} after, {os.cpu_count()} cores")
    print(f"{'side':<18}{'prefill s':>11}{'decode ms/token':>17}{'same tokens':>13}")
    for side, med in result["median"].items():
        print(f"{side:<18}{med['prefill_s']:>11.2f}{med['decode_ms_per_token']:>17.1f}"
              f"{agree[side]:>8}/{len(generated[side])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
