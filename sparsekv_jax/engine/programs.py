"""The compiled programs: `generate` (one `jax.jit`, or two where the backend compiles the prefill
apart: `Backend.prefill_dots`), `teacher_force` (one, or, split likewise, the steps before decoding as
`Session` runs them, `prepare_apart`, then the forced steps) and the reference `full_logits`."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax import attention
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache
from sparsekv_jax.cache_pooled import PoolCache
from sparsekv_jax.engine.compress import Ready, begin, compress, prepare
from sparsekv_jax.engine.decode import Decoded, decode_loop, decode_step
from sparsekv_jax.engine.pooled import check_overflow
from sparsekv_jax.engine.prefill import prefill_run
from sparsekv_jax.engine.run import Run, _open, options_of, validate_prompt
from sparsekv_jax.models.params import Params
from sparsekv_jax.models.transformer import attention_window, forward, logits_from_hidden
from sparsekv_jax.pallas.validation import is_concrete
from sparsekv_jax.policies.base import Policy


@struct.dataclass
class GenerateOutput:
    """``tokens`` ``[B, max_new_tokens]`` (``PAD_TOKEN`` after a row stopped, the stop token
    included before it); ``num_generated`` ``[B]``; ``cache`` the final KV cache; ``stats``
    what the policy did (fractions of full attention) and what the cache holds:
    ``kv_stored_fraction`` [B] (entries kept / prompt length), ``kv_read_fraction`` [B] (pages
    read / pages in use, mean over decode steps; NaN for a row that stopped at its first token),
    ``prefill_block_fraction`` (blocks computed / causal blocks), ``cache_bytes``,
    ``cache_capacity``. With ``Options(pool=True)`` (experimental) ``cache`` is the `PoolCache`,
    ``cache_capacity`` its tokens per head (``max_pages_per_head · page_size``) and ``cache_pages`` its
    pages."""

    tokens: jax.Array
    num_generated: jax.Array
    cache: KVCache | PoolCache
    stats: dict[str, Any]

    def sequences(self) -> list[list[int]]:
        """Generated ids per row, on the host, without padding."""
        toks = np.asarray(self.tokens)
        return [toks[i, : int(n)].tolist() for i, n in enumerate(np.asarray(self.num_generated))]


def output(stats: dict[str, Any], decoded: Decoded) -> GenerateOutput:
    """`GenerateOutput` from the stats before decoding and the decode loop's results."""
    stats = {
        **stats,  # kv_stored_fraction: live entries / the user's prompt; prefill_block_fraction
        "kv_read_fraction": decoded.read_fraction,  # mean over steps of pages read / pages in use
        **decoded.policy_stats,  # e.g. CHESS's reselections / backtracks per row
    }
    return GenerateOutput(tokens=decoded.tokens, num_generated=decoded.num_generated, cache=decoded.cache,
                          stats=stats)


def finish(run: Run, out: GenerateOutput) -> GenerateOutput:
    """The host-side stats: sizes as Python ints (inside jit they would overflow int32 past 2 GiB)
    and the context stage's notes. A pooled run whose pool ran out raises `ValueError` (`pooled.check_overflow`)."""
    out.stats["cache_bytes"] = out.cache.nbytes()
    if isinstance(out.cache, PoolCache):
        check_overflow(run, out.cache)
        out.stats["cache_capacity"] = out.cache.max_pages_per_head * out.cache.page_size
        out.stats["cache_pages"] = out.cache.num_pages
    else:
        out.stats["cache_capacity"] = out.cache.capacity
    if run.context_info:
        out.stats["context"] = dict(run.context_info)
    return out


def decode_ready(params: Params, run: Run, ready: Ready, key: jax.Array) -> GenerateOutput:
    """The decode loop of ``run`` from ``ready`` (traceable)."""
    return output(ready.stats, decode_loop(params, run.policy, ready, key, run.decoding, run.backend))


def _generate(params: Params, run: Run, key: jax.Array) -> GenerateOutput:
    return decode_ready(params, run, prepare(params, run), key)


generate_program = jax.jit(_generate)
prepare_program = jax.jit(prepare)
decode_program = jax.jit(decode_ready)


def split_programs(run: Run, *args: Any) -> bool:
    """Whether ``run`` compiles its prefill apart (`Backend.prefill_compiler_options`; not under a
    caller's jit, where the program is the caller's and compiler options cannot apply)."""
    return run.backend.prefill_compiler_options() is not None and is_concrete(*jax.tree.leaves((run, *args)))


def compiled_prepare(params: Params, run: Run):
    """`prepare_program` compiled by `Backend.compile_prefill` (oneDNN's dots where it says).
    Lowering and compiling are cached by JAX, so a repeated call only checks the program's text."""
    return run.backend.compile_prefill(prepare_program.lower(params, run))


def run_program(params: Params, run: Run, key: jax.Array) -> GenerateOutput:
    """`generate` of a `Run`: one program, or two (`split_programs`: the prefill compiled with
    oneDNN's dots, the decode loop with XLA's; the cache passes between them on the device)."""
    if not split_programs(run, params, key):
        return finish(run, generate_program(params, run, key))
    ready = compiled_prepare(params, run)(params, run)
    return finish(run, decode_program(params, run, ready, key))


# the steps before the decode loop as programs of their own: `Session`'s steps, and `teacher_force`'s where
# the prefill compiles apart (`prepare_apart`)
prefill_program = jax.jit(prefill_run)
compress_program = jax.jit(compress)
begin_program = jax.jit(begin)


def run_apart(run: Run, program: Any, *args: Any) -> Any:
    """``program(*args)``, a step before the decode loop: compiled by `Backend.compile_prefill` where ``run``
    compiles its prefill apart (`split_programs`), else as it is."""
    if split_programs(run, *args):
        program = run.backend.compile_prefill(program.lower(*args))
    return program(*args)


def prepare_apart(params: Params, run: Run) -> Ready:
    """`prepare` as three programs, prefill, compress and begin (the run's suffix), each compiled by
    `run_apart`: what `Session` runs step by step, and `teacher_force` where the prefill compiles apart.
    One path for both matters because `Backend.compile_prefill` decides per program: oneDNN's dots where
    every oneDNN fusion of that program would run, XLA's otherwise. So the prefill alone and the whole of
    `prepare` as one program (`compiled_prepare`, `generate`'s) can compute the prompt's K/V with different
    dots (equal to ~1e-6, but an int8 cache's code, scale or zero point on a rounding boundary then rounds
    the other way: `teacher_force`'s logits were 4.4e-4 from the `Session`'s on a CI draw,
    tests/test_teacher_force_programs.py)."""
    prefilled = run_apart(run, prefill_program, params, run)
    compressed = run_apart(run, compress_program, params, run, prefilled)
    return run_apart(run, begin_program, params, run, compressed, run.suffix, run.suffix_lengths)


def generate(params: Params, policy: Policy | None = None, tokens: Any = None, lengths: Any = None, *,
             question_start: Any = None, suffix: Any = None, suffix_lengths: Any = None,
             **options: Any) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` per row with ``policy`` choosing the KV entries used.

    Args:
      params: model weights (carry their `ModelConfig`).
      policy: a `Policy` (or `Pipeline`); ``None`` means `Dense()`.
      tokens: ``[B, T]`` right-padded prompt ids (or ``[T]``).
      lengths: ``[B]`` true prompt lengths, integers (default: all ``T``).
      question_start: ``[B]`` where each row's question starts inside ``tokens`` (question-aware
        compression: the compress stage scores the context with the question in view and may keep
        the question). ``None``: no split is known (policies that need one use their fallback).
      suffix: ``[B, Tq]`` right-padded tokens read *after* compression (e.g. the question, for
        question-agnostic compression: the policy compresses ``tokens`` without seeing it).
      suffix_lengths: ``[B]`` true suffix lengths.
      **options: the fields of `sparsekv_jax.engine.Options`: ``max_new_tokens`` (64),
        ``sampling`` (greedy), ``seed`` (int or key), ``stop_tokens`` (the model's EOS ids),
        ``page_size`` (16), ``prefill_chunk``, ``capacity``, ``backend``, ``mesh`` (a ``data`` ×
        ``model`` mesh: rows over ``data``, heads / MLP / vocabulary over ``model``, the same
        tokens as unsharded), ``pool``/``pool_pages`` (experimental: decode from a page pool,
        `sparsekv_jax.engine.pooled`; full attention, and the compressors whose compress stage writes
        through `policies.common.write_entries` with full attention's decode: SnapKV, StreamingLLM,
        AdaKV, PyramidKV, HeadSplit, BSER, SemantiCache; and Quest, whose decode stage selects logical
        pages from summaries read through the page tables. A compressor writes each head's kept or merged
        entries into a fresh decode pool sized by the policy, ``Policy.compressed_pages``; other policies
        are refused).

    The context stage (if the policy has one) runs first, on the host; everything after it is one
    `jax.jit`. All checks on the inputs happen before tracing, with errors naming the bad value.
    ``stats`` fractions are of the user's prompt (before a context stage rewrote it).
    """
    opts = options_of(options)
    params, run = _open(params, policy, tokens, lengths, question_start, suffix, suffix_lengths, opts)
    key = jax.random.key(opts.seed) if isinstance(opts.seed, int) else opts.seed
    return run_program(params, run, key)


def _teacher_force_from(params: Params, run: Run, ready: Ready, forced: jax.Array, collect_attention: bool):
    """`teacher_force` from ``ready``: one `decode_step` per forced token (all but the last), scanned."""

    def step(carry, token):
        cache, state = carry
        res = decode_step(params, run.policy, cache, token, state, backend=run.backend,
                          collect_attention=collect_attention)
        return (res.cache, res.state), (res.logits, res.attention)

    (cache, _), (rest, outs) = jax.lax.scan(step, (ready.cache, ready.state), forced[:, :-1].T)
    logits = jnp.concatenate([ready.logits[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
    if run.pool:  # the pool's final cache, for its overflow flags (`pooled.check_overflow`)
        return logits, outs, cache
    return logits, outs


def _teacher_force(params: Params, run: Run, forced: jax.Array, collect_attention: bool):
    return _teacher_force_from(params, run, prepare(params, run), forced, collect_attention)


teacher_force_program = jax.jit(_teacher_force, static_argnames=("collect_attention",))
teacher_force_decode_program = jax.jit(_teacher_force_from, static_argnames=("collect_attention",))


def teacher_force(params: Params, policy: Policy | None, tokens: Any, forced: Any, *,
                  collect_attention: bool = False, **kwargs: Any):
    """Logits of ``policy`` along a given continuation ``forced`` ``[B, N]`` (teacher forcing).

    Returns ``logits [B, N, V]`` where ``logits[:, i]`` predicts ``forced[:, i]`` (``i = 0`` from
    the prompt), and with ``collect_attention`` the attention outputs of every layer at each
    decode step, ``[N - 1, L, B, Hq, D]``. Used by the fidelity metrics to compare a policy with
    full attention on the same tokens. ``kwargs``: the prompt's ``lengths``, ``question_start``,
    ``suffix``, ``suffix_lengths`` and the options of `generate` (``page_size``, ``prefill_chunk``,
    ``backend``, ``mesh``; the cache takes ``N`` tokens after the prompt).

    The same numbers as a `Session` fed ``forced`` one `decode_step` at a time: where the backend
    compiles its prefill apart (oneDNN's dots on an x86 CPU), the steps before decoding run as its
    programs (`prepare_apart`), then the forced steps as one scan.
    """
    forced = np.asarray(forced) if not hasattr(forced, "shape") else forced
    if forced.ndim != 2 or forced.shape[1] < 1:
        raise ValueError(f"forced must be [B, N] with N >= 1, got shape {tuple(forced.shape)}")
    prompt = {k: kwargs.pop(k, None) for k in ("lengths", "question_start", "suffix", "suffix_lengths")}
    opts = options_of({**kwargs, "max_new_tokens": forced.shape[1]})
    params, run = _open(params, policy, tokens, prompt["lengths"], prompt["question_start"], prompt["suffix"],
                        prompt["suffix_lengths"], opts)
    if forced.shape[0] != run.tokens.shape[0]:
        raise ValueError(f"forced has batch {forced.shape[0]}, tokens has batch {run.tokens.shape[0]}")
    forced = jnp.asarray(forced, jnp.int32)
    if split_programs(run, params, forced):  # the steps before decoding as `generate` and `Session` run them
        res = teacher_force_decode_program(params, run, prepare_apart(params, run), forced,
                                           collect_attention=collect_attention)
    else:
        res = teacher_force_program(params, run, forced, collect_attention=collect_attention)
    if run.pool:
        check_overflow(run, res[2])
        res = res[:2]
    return res


@functools.partial(jax.jit, static_argnames=("backend",))
def _full_logits(params: Params, tokens: jax.Array, backend: Backend) -> jax.Array:
    cfg = params.config
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def attend(q, k, v, kv, idx, hidden):
        out = attention.dense_causal_attention(q, k, v, sliding_window=attention_window(cfg, idx),
                                               implementation=backend.dense_prefill, backend=backend)
        return out, kv, None

    hidden, _, _ = forward(params, tokens, positions, jnp.zeros((cfg.num_layers,)), attend)
    return logits_from_hidden(params, hidden)


def full_logits(params: Params, tokens: Any, *, backend: Backend | None = None) -> jax.Array:
    """``[B, T, V]`` fp32 logits of a plain causal forward pass (no cache): the reference.
    ``backend`` decides the dense attention's implementation (``dense_prefill``; default: ``Backend()``,
    the platform's choice)."""
    tokens, _, _ = validate_prompt(params, tokens, None, 1, None)
    if backend is not None and not isinstance(backend, Backend):
        raise ValueError(f"backend must be a sparsekv_jax.Backend, got {type(backend).__name__}")
    return _full_logits(params, tokens, (Backend() if backend is None else backend).resolve(params))
