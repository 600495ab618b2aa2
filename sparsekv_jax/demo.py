"""`make demo`: the embedded SmolLM2 answers a needle-in-a-haystack prompt under the library's
methods, full attention and the baselines; prints one table row per policy.

    python -m sparsekv_jax.demo [--length 4096] [--budget 0.25] [--policies SPEC] [--seed 0]

Question-aware (SnapKV's protocol: the question is part of the prompt each policy compresses).
Prefill and compression are separate stages, so every policy whose prefill is dense (the
compressors and the decode-time selectors) shares ONE dense prefill, observed at once by every
policy that needs observations (`engine.share_prefill`); each compresses its own copy of that
cache (`engine.compress`) and decodes. A policy with its own prefill (Stem's block-sparse
pattern, a context stage) prefills alone. Times exclude compilation (reported apart); compiled
programs are kept in a persistent cache (``$SPARSEKV_CACHE/xla``), so a second run starts faster,
except a prefill compiled with oneDNN's dots (fp32 on an x86 CPU, `Backend.prefill_dots`): this
XLA cannot serialise a oneDNN fusion, so `Backend.compile_prefill` compiles it afresh each run.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import time
from typing import Any

import jax
import numpy as np

from sparsekv_jax._progress import bar_disabled
from sparsekv_jax.bench.timing import timed_call

# The demo's policies, in table order: full attention, the library's methods, the baselines.
# ``{b}`` is the budget (--budget). A name not registered yet is skipped with a note: adding a method
# to the demo is one line here.
DEMO_POLICIES: tuple[str, ...] = (
    "fullkv",
    "stem",  # the paper's 54-block floor covers the demo's 4k prompt: dense, as the paper would be
    "stem(min_blocks=32)",  # the sparser floor, where Stem's block routing saves prefill at 4k
    "chess('moderate', calibration='smollm2')",
    "semanticache({b})",
    "bser({b})",
    "s3hybrid({b})",
    "streamingllm({b})",
    "snapkv({b})",
    "h2o({b})",
    "quest({b})",
)
PAGE_SIZE = 16


@dataclasses.dataclass
class Row:
    """One policy's line of the table (times in seconds; ``None`` = not run by this policy)."""

    label: str
    answer: str = ""
    right: bool = False
    stored: float = float("nan")
    read: float = float("nan")
    blocks: float = 1.0
    prefill_s: float = 0.0
    shared_prefill: bool = False
    compress_s: float = 0.0
    decode_ms: float = float("nan")


def resolve_policies(specs: list[str], budget: float, tokenizer: Any) -> tuple[list[tuple[str, Any]], list[str]]:
    """``([(label, policy bound to the tokenizer)], notes)``: specs naming an unregistered policy are
    skipped with a note (SemantiCache, BSER and S³ join the demo as they are registered)."""
    from sparsekv_jax.policies import parse_policy
    from sparsekv_jax.policies.spec import REGISTRY

    out, notes = [], []
    for spec in specs:
        text = spec.format(b=budget)
        node = ast.parse(text.strip(), mode="eval").body
        head = node.func if isinstance(node, ast.Call) else node
        name = head.id if isinstance(head, ast.Name) else text
        if name.lower() not in REGISTRY:
            notes.append(f"{text}: not registered yet, skipped")
            continue
        policy = parse_policy(text).with_tokenizer(tokenizer)
        budget_field = getattr(policy, "budget", None)
        label = policy.name if budget_field is None or "(" in policy.name else f"{policy.name}({budget_field:g})"
        out.append((label, policy))
    return out, notes


def _needle(tokenizer: Any, length: int, seed: int):
    """``(sample, tokens [1, T], question_start [1])`` of a single-needle RULER prompt."""
    from sparsekv_jax.eval.batching import encode
    from sparsekv_jax.eval.ruler import generate_samples

    sample = generate_samples("niah_single_1", length, 1, seed, tokenizer, chat=True)[0]
    ctx, question = encode(tokenizer, sample)
    return sample, np.asarray([ctx + question], np.int32), np.asarray([len(ctx)], np.int32)


class _Programs:
    """Compiled programs kept by what they compute: a name and the arguments' structure and shapes.

    Policies whose decode stage is the same (every compressor decodes densely) and whose caches have
    the same shape after compression run one compiled decode loop, so the demo compiles it once."""

    def __init__(self) -> None:
        self.compiled: dict[Any, Any] = {}
        self.compile_s = 0.0  # compile seconds summed by the caller

    def get(self, name: str, fn, *args, prefill_of: Any = None) -> tuple[Any, float]:
        """``(compiled fn, compile seconds)``: 0 seconds when an equal program was compiled before.
        ``prefill_of``: the `Backend` whose `Backend.compile_prefill` compiles this (a prefill)."""
        leaves, tree = jax.tree.flatten(args)
        key = (name, tree, tuple((np.shape(x), str(getattr(x, "dtype", type(x)))) for x in leaves))
        if key in self.compiled:
            return self.compiled[key], 0.0
        t0 = time.perf_counter()
        lowered = jax.jit(fn).lower(*args)
        self.compiled[key] = lowered.compile() if prefill_of is None else prefill_of.compile_prefill(lowered)
        return self.compiled[key], time.perf_counter() - t0


def persistent_cache(path: Any, min_compile_seconds: float = 0.5) -> None:
    """Keep this process's compiled programs in ``path`` (those compiling for at least
    ``min_compile_seconds``; a oneDNN prefill never: `Backend.compile_prefill`). Call it before
    anything compiles: JAX sets the cache up at the process's first compilation."""
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)


def run(params: Any, tokenizer: Any, policies: list[tuple[str, Any]], tokens: np.ndarray,
        question_start: np.ndarray, *, max_new_tokens: int, stop_tokens: tuple[int, ...],
        progress: bool = True) -> tuple[list[Row], float]:
    """Every policy on one prompt: one shared dense prefill for the policies whose prefill is dense,
    then each one's compression and decode loop (the engine's steps, `sparsekv_jax.engine`).
    Returns ``(rows, compile seconds)``; `Row.right` is left for the caller to score."""
    from tqdm.auto import tqdm

    from sparsekv_jax import engine
    from sparsekv_jax.policies import Dense

    runs = [(label, engine.setup(params, pol, tokens, question_start=question_start, max_new_tokens=max_new_tokens,
                                 stop_tokens=stop_tokens, page_size=PAGE_SIZE)) for label, pol in policies]
    shared = [i for i, (_, r) in enumerate(runs)
              if type(r.policy.stage("prefill")) is Dense and type(r.policy.stage("context")) is Dense]
    bar = tqdm(total=len(runs) + bool(shared), desc="demo", unit="step", disable=bar_disabled(progress), leave=False)
    programs = _Programs()
    rows = [Row(label) for label, _ in runs]
    prefilled: dict[int, Any] = {}
    if shared:
        bar.set_postfix_str(f"one dense prefill for {len(shared)} policies")
        shared_runs = [runs[i][1] for i in shared]
        fn, c = programs.get("shared prefill", engine.share_prefill, params, shared_runs,
                             prefill_of=shared_runs[0].backend)
        outs, seconds = timed_call(fn, params, shared_runs)
        programs.compile_s += c
        for i, pre in zip(shared, outs, strict=True):
            prefilled[i] = pre
            rows[i].prefill_s, rows[i].shared_prefill = seconds, True
        bar.update()
    for i, (label, r) in enumerate(runs):
        bar.set_postfix_str(label)
        new = _run_one(programs, params, label, r, prefilled.get(i), rows[i])
        rows[i].answer = tokenizer.decode([t for t in new if t not in stop_tokens], skip_special_tokens=True).strip()
        bar.update()
        tqdm.write(f"  {label}: {rows[i].answer!r}")
    bar.close()
    return rows, programs.compile_s


def _compress_and_begin(params: Any, run: Any, prefilled: Any) -> Any:
    from sparsekv_jax import engine

    return engine.begin(params, run, engine.compress(params, run, prefilled))


def _run_one(programs: _Programs, params: Any, label: str, r: Any, prefilled: Any, row: Row) -> list[int]:
    """One policy's compression (of the shared prefill, or its own prefill and compression) and
    decode loop, timed apart into ``row``; returns the generated ids."""
    import jax.numpy as jnp

    from sparsekv_jax import engine

    if prefilled is not None:
        fn, c = programs.get(f"compress {label}", _compress_and_begin, params, r, prefilled)
        ready, row.compress_s = timed_call(fn, params, r, prefilled)
    else:  # its own prefill (a prefill pattern or a context stage); stats against the user's prompt
        fn, c = programs.get(f"prefill {label}", engine.prepare, params, r, prefill_of=r.backend)
        ready, row.prefill_s = timed_call(fn, params, r)
    # the decode loop sees only the decode stage: equal stages on equal caches share a program
    args = (params, r.for_decode(), ready, jax.random.key(0))
    fn, c2 = programs.get(f"decode {r.backend}", engine.decode_ready, *args)
    programs.compile_s += c + c2
    out, decode_s = timed_call(fn, *args)
    new = np.asarray(out.tokens[0, : int(out.num_generated[0])]).tolist()
    row.stored, row.read = float(out.stats["kv_stored_fraction"][0]), float(out.stats["kv_read_fraction"][0])
    row.blocks = float(jnp.asarray(out.stats["prefill_block_fraction"]))
    row.decode_ms = 1e3 * decode_s / max(len(new) - 1, 1)
    return new


def table(rows: list[Row]) -> str:
    """The demo's table as text (``=`` marks the one prefill the dense-prefill policies share); each
    column as wide as its longest entry, so long policy names keep the columns aligned."""
    head = ["policy", "right", "KV stored", "KV read", "prefill blocks", "prefill s", "compress s", "decode ms/tok",
            "answer"]
    cells = [[r.label, "yes" if r.right else "NO", f"{r.stored:.0%}", f"{r.read:.0%}", f"{r.blocks:.0%}",
              f"{'=' if r.shared_prefill else ' '}{r.prefill_s:.2f}", f"{r.compress_s:.2f}", f"{r.decode_ms:.1f}",
              repr(r.answer[:40])] for r in rows]
    widths = [max(len(line[i]) for line in [head, *cells]) for i in range(len(head))]

    def line(values: list[str]) -> str:
        first, *middle, last = values
        return "  ".join([first.ljust(widths[0]), *(v.rjust(w) for v, w in zip(middle, widths[1:-1], strict=True)),
                          last]).rstrip()

    return "\n".join(line(v) for v in [head, *cells])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparsekv_jax.demo", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--length", type=int, default=4096, help="prompt length in tokens (chat template included)")
    ap.add_argument("--budget", type=float, default=0.25, help="KV budget of the compressors and selectors (fraction)")
    ap.add_argument("--policies", default=None,
                    help="comma-separated policy specs ({b} = --budget); default: " + ", ".join(DEMO_POLICIES))
    ap.add_argument("--seed", type=int, default=0, help="seed of the needle prompt")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="answer length cap")
    ap.add_argument("--no-compile-cache", action="store_true", help="do not keep compiled programs on disk")
    args = ap.parse_args(argv)

    from sparsekv_jax import load
    from sparsekv_jax.backend import resolved
    from sparsekv_jax.models.embedded import cache_root

    t_start = time.perf_counter()
    if not args.no_compile_cache:
        persistent_cache(cache_root() / "xla")
    print(f"device: {jax.devices()[0].device_kind} ({resolved().platform}), jax {jax.__version__}")
    params, tokenizer = load("smollm2")
    specs = DEMO_POLICIES if args.policies is None else [s for s in _split(args.policies) if s]
    policies, notes = resolve_policies(list(specs), args.budget, tokenizer)
    for note in notes:
        print(f"note: {note}")
    sample, tokens, question_start = _needle(tokenizer, args.length, args.seed)
    stops = tuple(params.config.eos_token_ids) + tuple(
        t for t in (tokenizer.convert_tokens_to_ids("<|im_end|>"),) if isinstance(t, int) and t >= 0)
    print(f"prompt: {tokens.shape[1]} tokens, needle value {sample.answers[0]!r} at depth {sample.depth:.0%}, "
          f"budget {args.budget:g}\n")
    rows, compile_s = run(params, tokenizer, policies, tokens, question_start, max_new_tokens=args.max_new_tokens,
                          stop_tokens=stops)
    for row in rows:
        row.right = sample.score(row.answer) >= 1.0
    print()
    print(table(rows))
    print(f"\n= one dense prefill shared by these policies (they compress a copy of its cache); "
          f"compilation {compile_s:.0f} s (not in the times above); total {time.perf_counter() - t_start:.0f} s")
    if any(type(pol.stage("context")).__name__ != "Dense" for _, pol in policies):
        print("  a context stage (S3, BM25, RAG) runs on the host before its prefill: its time is not in "
              "'prefill s', which is the prefill of the shortened prompt; 'KV stored' is against the full prompt")
    return 0


def _split(spec: str) -> list[str]:
    """Top-level comma split of a policy spec (commas inside parentheses stay)."""
    parts, depth, cur = [], 0, ""
    for ch in spec:
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return parts + [cur.strip()]


if __name__ == "__main__":
    raise SystemExit(main())
