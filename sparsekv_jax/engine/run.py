"""`Run`: everything about one generation that is checked and sized before jit, made once by `setup`.

The prompt arrays (tokens, lengths, question start, suffix) and the bound policy are the pytree's
leaves; the sizes (cache capacity, page and chunk sizes, the room kept for tokens after the prompt),
the decoding rule and the resolved `Backend` are static fields, so a `Run` is the whole description
of a compiled program: ``jax.jit(f)(params, run, ...)`` recompiles only when one of those changes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax import local_layers, sharding
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import pages_for
from sparsekv_jax.models.params import Params
from sparsekv_jax.pallas.validation import is_concrete
from sparsekv_jax.policies.base import Dense, Policy, Setup
from sparsekv_jax.policies.chess import CHESS


@dataclasses.dataclass(frozen=True)
class Sampling:
    """Decoding rule. ``temperature == 0`` is greedy; ``top_k == 0`` and ``top_p == 1`` disable
    those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature={self.temperature} must be >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")


GREEDY = Sampling()


@dataclasses.dataclass(frozen=True)
class Decoding:
    """What the decode loop needs besides the cache: at most ``max_new_tokens`` per row (the stop
    token included), the ``sampling`` rule, the ``stop_tokens`` ending a row. Static (hashable)."""

    max_new_tokens: int
    sampling: Sampling = GREEDY
    stop_tokens: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of `setup` (and `generate`, `Session.start`) besides the prompt.

    Attributes:
      max_new_tokens: tokens generated per row at most (the first stop token included).
      sampling: greedy by default; `Sampling(temperature, top_k, top_p)`.
      seed: PRNG seed (int) or key of the sampling.
      stop_tokens: ids that end a row (default: the model's EOS ids).
      page_size: KV cache page size in tokens (a power of two).
      prefill_chunk: process the prompt in chunks of this many tokens (``None``: one pass).
      capacity: cache capacity in tokens (default: what the prompt and generation need).
      question_tokens: room kept after compression for questions read later (`Session.ask`): the
        widest question, in tokens. A ``suffix`` given to `setup` takes its own width.
      backend: implementation choices (`sparsekv_jax.Backend`; default ``auto`` per platform).
      mesh: a ``data`` × ``model`` `jax.sharding.Mesh` (`sparsekv_jax.sharding.make_mesh`) to run on.
      pool: **experimental** (issue 38, docs/PAGE_POOL.md, migration step 4): decode from a page pool
        (`sparsekv_jax.cache_pooled.PoolCache`: head-free pages, a page table and a length per layer, row and
        KV head) instead of the uniform cache, with the same tokens and logits (but for Quest after a compressor
        whose heads keep different counts: below). Supported so far: full attention (`FullKV`, i.e. `Dense`),
        and the compressors whose compress stage writes through `policies.common.write_entries`
        (``Policy.writes_entries``: `SnapKV`, `StreamingLLM`, `AdaKV`, `PyramidKV`, `HeadSplit`, `BSER` through
        `write_kept`, `SemantiCache` directly) with full attention's prefill and decode stages, and `Quest`
        (``Policy.selects_pages``: its page selection reads the summaries through the page tables and lists
        logical pages), alone or after one of those compressors (its decode pool's heads keep their own
        counts; where heads or layers keep different counts, e.g. AdaKV, PyramidKV, SemantiCache, Quest bounds
        each head's own pages and always reads the page of its own newest token, whereas the uniform cache
        appends every head's tokens after its row's largest count: the pages read, and so the tokens, may
        differ from the uniform path's), and `H2O` (``Policy.writes_in_place``: each token overwrites the
        slot its running eviction names, through the tables; the pool holds its budget's pages), and `CHESS`
        with pre-RoPE keys (the default) after full attention's compress stage, alone or as a `Pipeline`'s
        decode stage, from the prefill pool (its page lists are logical pages; a backtrack moves the
        allocator's lengths back and the regenerated tokens refill the pages kept,
        `cache_pooled.rewind_pool`). Any other policy is refused by name, among them post-RoPE CHESS
        (``keys="post_rope"``: its page sums are read from the uniform stack) and CHESS after a compressor (its
        row-level selection over heads that keep different counts), and so are a ``mesh`` and a model whose
        local layers keep rings (Gemma 3 with ``Backend(local_cache="ring")``): a `ValueError` before jit. A
        ``suffix`` (or a `Session.ask` question, within ``question_tokens``) is read into the pool after compression
        (`engine.prefill.extend_pool`: each head grows by the row's suffix length from the pool's free pages, written
        at its own logical slots after the entries it kept) before any of those decode stages: H2O's decode pool
        then holds its budget and the widest suffix (``Policy.compressed_pages``' ``suffix_tokens``), CHESS's
        backtracks take back decoded tokens only, never the question. The
        prefill writes a prefill pool's identity layout (`cache_pooled.stack_view`); a compressor writes each
        head's kept entries into a fresh decode pool (`policies.common.PoolTarget`, no holes) and the prefill
        pool is dropped; each decode step takes its pages from the pool's free stack. ``GenerateOutput.cache`` is
        then the `PoolCache`.
      pool_pages: with ``pool``: pages of the pool the decode reads. Full attention decodes from its prefill
        pool: ``None`` is ``L·B·Hkv·pages_for(capacity)``, today's cache size, and it must hold the prefill's
        ``L·B·Hkv·pages_for(prompt)``. A compressor decodes from its decode pool (its prefill pool is exactly
        the prompt's pages): ``None`` is the policy's bound, ``Policy.compressed_pages`` (docs/PAGE_POOL.md,
        Sizing), which never runs out. A pool that runs out raises a `ValueError` after the run, naming the
        pages the run needs (`engine.pooled`).
    """

    max_new_tokens: int = 64
    sampling: Sampling = GREEDY
    seed: int | jax.Array = 0
    stop_tokens: tuple[int, ...] | None = None
    page_size: int = 16
    prefill_chunk: int | None = None
    capacity: int | None = None
    question_tokens: int = 0
    backend: Backend | None = None
    mesh: Any = None
    pool: bool = False
    pool_pages: int | None = None


class HostNotes(dict):
    """Host-side notes of a run (a context stage's timings and spans): a static field of `Run` that
    is no part of any program, so any two compare equal and hash alike (no recompilation)."""

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HostNotes)

    def __ne__(self, other: object) -> bool:
        return not isinstance(other, HostNotes)

    def __hash__(self) -> int:
        return 0


@struct.dataclass
class Run:
    """One checked, sized generation (made by `setup`).

    Leaves: ``policy`` (bound to this run), ``tokens`` ``[B, T]`` and ``lengths`` ``[B]`` as the prefill
    sees them (after a context stage), ``question_start`` ``[B]`` or ``None``, ``prompt_lengths`` the
    user's lengths (stats are fractions of those), ``suffix`` ``[B, Tq]`` / ``suffix_lengths`` or ``None``.
    Static: ``capacity`` (tokens the cache holds), ``page_size``, ``prefill_chunk``,
    ``question_tokens`` (room kept after compression for the suffix or later questions),
    ``decoding`` (`Decoding`), ``backend`` (resolved), ``context_info`` (host notes) and
    ``policy_classes`` (`node_classes` of ``policy``: jax 0.10's tree structures of two
    ``register_dataclass`` nodes compare equal when their static fields do, whatever their classes,
    so without it ``jax.jit`` may run a program traced for another policy class). ``pool``, ``pool_pages``:
    `Options`' (experimental), ``pool_pages`` resolved for a compressor (its decode pool's pages).
    """

    policy: Policy
    tokens: jax.Array
    lengths: jax.Array
    question_start: jax.Array | None
    prompt_lengths: jax.Array
    suffix: jax.Array | None
    suffix_lengths: jax.Array | None
    capacity: int = struct.field(pytree_node=False)
    page_size: int = struct.field(pytree_node=False)
    prefill_chunk: int | None = struct.field(pytree_node=False)
    question_tokens: int = struct.field(pytree_node=False)
    decoding: Decoding = struct.field(pytree_node=False)
    backend: Backend = struct.field(pytree_node=False)
    context_info: HostNotes = struct.field(pytree_node=False)
    policy_classes: tuple[type, ...] = struct.field(pytree_node=False)
    pool: bool = struct.field(pytree_node=False, default=False)  # experimental: decode from a page pool
    # the decode pool's pages (full attention: None is today's cache size; a compressor's: resolved by setup)
    pool_pages: int | None = struct.field(pytree_node=False, default=None)

    @property
    def extra_tokens(self) -> int:
        """Tokens the cache takes after compression: the suffix (or question room) and the decode."""
        return self.decoding.max_new_tokens + self.question_tokens

    def for_decode(self) -> Run:
        """This run as the decode loop sees it: the policy reduced to its decode stage and no prompt
        arrays, so runs whose decode stages are equal share one compiled decode program."""
        decode = self.policy.stage("decode")
        return self.replace(policy=decode, policy_classes=node_classes(decode), tokens=None, lengths=None,
                            question_start=None, prompt_lengths=None, suffix=None, suffix_lengths=None)


def node_classes(tree: Any) -> tuple[type, ...]:
    """The classes of every dataclass in ``tree`` (a policy: its members, its bound settings), in
    order: a static field that tells apart pytrees whose structures jax compares equal."""
    found: list[type] = []

    def walk(node: Any) -> None:
        if dataclasses.is_dataclass(node) and not isinstance(node, type):
            found.append(type(node))
            for f in dataclasses.fields(node):
                walk(getattr(node, f.name))
        elif isinstance(node, (tuple, list)):
            for item in node:
                walk(item)
        elif isinstance(node, dict):
            for item in node.values():
                walk(item)

    walk(tree)
    return tuple(found)


def validate_prompt(params: Params, tokens: Any, lengths: Any, max_new_tokens: int,
                    capacity: int | None) -> tuple[jax.Array, jax.Array, int]:
    """Checks done before jit; returns ``(tokens [B, T] int32, lengths [B] int32, capacity)``."""
    tokens = _tokens(params, tokens)
    B, T = tokens.shape
    lengths = _lengths(lengths, B, T)
    cfg = params.config
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    needed = T + max_new_tokens
    if needed > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {T} + max_new_tokens {max_new_tokens} = {needed} exceeds "
                         f"the model's max_position_embeddings {cfg.max_position_embeddings}")
    if capacity is None:
        capacity = needed
    elif capacity < needed:
        raise ValueError(f"prompt length {T} + max_new_tokens {max_new_tokens} = {needed} exceeds the "
                         f"cache capacity {capacity}")
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32), capacity


def _tokens(params: Params, tokens: Any) -> Any:
    if not hasattr(tokens, "shape"):
        tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have rank 1 or 2 ([T] or [B, T]), got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    if 0 in tokens.shape:
        raise ValueError(f"empty prompt: tokens has shape {tuple(tokens.shape)}")
    if is_concrete(tokens):
        t, vocab = np.asarray(tokens), params.config.vocab_size
        if t.min() < 0 or t.max() >= vocab:
            bad = int(t.min()) if t.min() < 0 else int(t.max())
            raise ValueError(f"token id {bad} out of range [0, {vocab})")
    return tokens


def _lengths(lengths: Any, B: int, T: int) -> Any:
    if lengths is None:
        return np.full((B,), T, np.int32)
    if not hasattr(lengths, "shape"):
        lengths = np.asarray(lengths)
    if lengths.shape != (B,):
        raise ValueError(f"lengths must have shape ({B},), got {tuple(lengths.shape)}")
    if not jnp.issubdtype(lengths.dtype, jnp.integer):
        shown = f" {np.asarray(lengths).tolist()}" if is_concrete(lengths) else ""
        raise ValueError(f"lengths must be integers, got dtype {lengths.dtype}{shown}")
    if is_concrete(lengths):
        ln = np.asarray(lengths)
        if ln.min() < 1 or ln.max() > T:
            raise ValueError(f"lengths must be in [1, {T}] (prompt width), got min {ln.min()} max {ln.max()}")
    return lengths


def validate_question_start(question_start: Any, lengths: jax.Array) -> jax.Array | None:
    """``question_start`` ``[B]`` int32 in ``[0, lengths]`` (or ``None``), checked before jit."""
    if question_start is None:
        return None
    if not hasattr(question_start, "shape"):
        question_start = np.asarray(question_start)
    if question_start.shape != lengths.shape:
        raise ValueError(f"question_start must have shape {tuple(lengths.shape)} (one per row), "
                         f"got {tuple(question_start.shape)}")
    if not jnp.issubdtype(question_start.dtype, jnp.integer):
        raise ValueError(f"question_start must be integers, got dtype {question_start.dtype}")
    if is_concrete(question_start) and is_concrete(lengths):
        qs, ln = np.asarray(question_start), np.asarray(lengths)
        bad = np.nonzero((qs < 0) | (qs > ln))[0]
        if bad.size:
            b = int(bad[0])
            raise ValueError(f"question_start[{b}]={int(qs[b])} must be in [0, lengths[{b}]={int(ln[b])}]")
    return jnp.asarray(question_start, jnp.int32)


def validate_suffix(params: Params, suffix: Any, suffix_lengths: Any, batch: int):
    """``(suffix [B, Tq] int32, suffix_lengths [B] int32)`` or ``(None, None)``, checked before jit."""
    if suffix is None:
        if suffix_lengths is not None:
            raise ValueError("suffix_lengths given without suffix")
        return None, None
    suffix, suffix_lengths, _ = validate_prompt(params, suffix, suffix_lengths, 1, None)
    if suffix.shape[0] != batch:
        raise ValueError(f"suffix has batch {suffix.shape[0]}, tokens has batch {batch}")
    return suffix, suffix_lengths


def options_of(options: dict[str, Any], kind: type[Any] = Options) -> Any:
    """A ``kind`` (default `Options`; any frozen options dataclass, e.g. `EvalOptions`) from keyword
    arguments; an ``options=kind(...)`` among them is taken whole. An unknown keyword raises
    `TypeError` naming it and listing the valid ones."""
    names = [f.name for f in dataclasses.fields(kind)]
    if "options" in options:
        if len(options) > 1:
            raise ValueError(f"give options= or keyword options, not both ({', '.join(sorted(options))})")
        if not isinstance(options["options"], kind):
            raise TypeError(f"options= must be a {kind.__name__}, got {type(options['options']).__name__}")
        return options["options"]
    unknown = sorted(set(options) - set(names))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; options are {', '.join(names)}")
    return kind(**options)


def setup(params: Params, policy: Policy | None = None, tokens: Any = None, lengths: Any = None, *,
          question_start: Any = None, suffix: Any = None, suffix_lengths: Any = None, **options: Any) -> Run:
    """Check and size one generation before jit; the context stage (if any) runs here, on the host.

    Args:
      params: model weights (carry their `ModelConfig`).
      policy: a `Policy` (or `Pipeline`); ``None`` means `Dense()`.
      tokens: ``[B, T]`` right-padded prompt ids (or ``[T]``).
      lengths: ``[B]`` true prompt lengths, integers (default: all ``T``).
      question_start: ``[B]`` where each row's question starts inside ``tokens`` (question-aware
        compression). ``None``: no split is known (policies that need one use their fallback).
      suffix: ``[B, Tq]`` right-padded tokens read *after* compression (question-agnostic).
      suffix_lengths: ``[B]`` true suffix lengths.
      **options: the fields of `Options` (or ``options=Options(...)``).

    Every error names the bad value. With a mesh (``mesh=`` or ``backend.mesh``) the rows are placed
    on it; the weights must be placed too (`place_params`: `Session` and `generate` do it).
    """
    return _open(params, policy, tokens, lengths, question_start, suffix, suffix_lengths, options_of(options))[1]


def place_params(params: Params, tokens: Any, options: Options) -> tuple[Params, Backend | None]:
    """``(params on the options' mesh, the backend carrying it)``; unchanged without a mesh."""
    return sharding.on_mesh(params, tokens, options.mesh, options.backend)


def _open(params: Params, policy: Any, tokens: Any, lengths: Any, question_start: Any, suffix: Any,
          suffix_lengths: Any, opts: Options) -> tuple[Params, Run]:
    """``(params placed on the mesh, the Run with its rows placed)``: `setup` for the programs."""
    if tokens is None:
        raise ValueError("tokens is required")
    policy = Dense() if policy is None else policy
    if not isinstance(policy, Policy):
        raise ValueError(f"policy must be a Policy, got {type(policy).__name__}")
    if opts.backend is not None and not isinstance(opts.backend, Backend):
        raise ValueError(f"backend must be a sparsekv_jax.Backend, got {type(opts.backend).__name__}")
    params, backend = place_params(params, tokens, opts)
    backend = (Backend() if backend is None else backend).resolve(params)
    if not hasattr(tokens, "shape"):
        tokens = np.asarray(tokens)
    suffix, suffix_lengths = validate_suffix(params, suffix, suffix_lengths, tokens.shape[0] if tokens.ndim == 2 else 1)
    if suffix is not None and opts.question_tokens:
        raise ValueError(f"question_tokens={opts.question_tokens} with a suffix: the suffix is the question "
                         "(give one or the other)")
    if opts.question_tokens < 0:
        raise ValueError(f"question_tokens={opts.question_tokens} must be >= 0")
    room = opts.question_tokens if suffix is None else suffix.shape[1]
    prompt, info = _prompt(params, policy, tokens, lengths, question_start, opts.max_new_tokens + room, opts, backend)
    tokens, lengths, question_start, prompt_lengths, capacity = prompt
    capacity = _sized(policy, tokens.shape[1], capacity, opts)
    stops = params.config.eos_token_ids if opts.stop_tokens is None else opts.stop_tokens
    decoding = Decoding(opts.max_new_tokens, opts.sampling, tuple(int(t) for t in stops))
    _check_pool(params, policy, opts, backend)  # before bind: a refused policy is named first
    # a model whose local layers keep rings is, to the policy, the model of its global layers
    bound = policy.bind(Setup(config=local_layers.policy_config(params.config, backend), prompt_len=tokens.shape[1],
                              max_new_tokens=opts.max_new_tokens + room, page_size=opts.page_size, backend=backend))
    pool_pages = _pool_pages(params, bound, tokens, lengths, opts, room) if opts.pool else None
    run = Run(policy=bound, tokens=tokens, lengths=lengths, question_start=question_start,
              prompt_lengths=prompt_lengths, suffix=suffix, suffix_lengths=suffix_lengths, capacity=capacity,
              page_size=opts.page_size, prefill_chunk=opts.prefill_chunk, question_tokens=room, decoding=decoding,
              backend=backend, context_info=HostNotes(info), policy_classes=node_classes(bound),
              pool=bool(opts.pool), pool_pages=pool_pages)
    return params, sharding.place_rows(run)


def _prompt(params: Params, policy: Policy, tokens: Any, lengths: Any, question_start: Any, extra: int,
            opts: Options, backend: Backend):
    """``((tokens, lengths, question_start, prompt_lengths, capacity), context info)``: the user's
    prompt checked, then the context stage's rewrite of it (if the policy has one) checked. The
    context stage runs bound to the run (its `Setup` sees the user's prompt width and the run's
    ``backend``), as every stage after it is."""
    capacity = opts.capacity
    tokens, lengths, _ = validate_prompt(params, tokens, lengths, extra, None)
    question_start = validate_question_start(question_start, lengths)
    prompt_lengths, info = lengths, {}
    context_stage = policy.stage("context")
    if type(context_stage) is not Dense:
        context_stage = context_stage.bind(Setup(config=local_layers.policy_config(params.config, backend),
                                                 prompt_len=tokens.shape[1], max_new_tokens=extra,
                                                 page_size=opts.page_size, backend=backend))
        res = context_stage.context(params, np.asarray(tokens), np.asarray(lengths),
                                    None if question_start is None else np.asarray(question_start))
        tokens, lengths, _ = validate_prompt(params, res.tokens, res.lengths, extra, None)
        question_start = validate_question_start(res.question_start, lengths)
        info = dict(res.info)
        capacity = None if capacity is None else max(capacity, tokens.shape[1] + extra)
    tokens, lengths, capacity = validate_prompt(params, tokens, lengths, extra, capacity)
    return (tokens, lengths, question_start, prompt_lengths, capacity), info


def _sized(policy: Policy, T: int, capacity: int, opts: Options) -> int:
    """The cache capacity rounded up to whole pages (and whole prefill chunks); page and chunk
    sizes checked."""
    page_size, chunk = opts.page_size, opts.prefill_chunk
    if not isinstance(page_size, int) or page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a positive power of two")
    if chunk is not None and chunk <= 0:
        raise ValueError(f"prefill_chunk={chunk} must be positive or None")
    capacity = pages_for(capacity, page_size) * page_size
    if chunk is not None and chunk < T and policy.needs_whole_prefill:
        whole = [policy.stage(s).name for s in ("prefill", "compress", "decode") if policy.stage(s).needs_whole_prefill]
        raise ValueError(f"prefill_chunk={chunk}: {', '.join(dict.fromkeys(whole))} need(s) the whole "
                         f"prompt in one prefill pass (a prefill block pattern or observations of the whole "
                         f"prompt); use prefill_chunk=None")
    if chunk is not None:
        capacity = max(capacity, pages_for(T, chunk) * chunk)
    return capacity


def prefill_width(T: int, chunk: int | None) -> int:
    """Slots the prefill writes: the prompt width ``T``, rounded up to whole chunks when chunked."""
    return T if chunk is None or chunk >= T else pages_for(T, chunk) * chunk


def compressed_size(run: Run) -> int | None:
    """The compress stage's `Policy.compressed_capacity` for ``run`` (``None``: it keeps the prefill cache)."""
    return run.policy.stage("compress").compressed_capacity(run.tokens.shape[1], run.extra_tokens,
                                                            suffix_tokens=run.question_tokens)


def pool_refusal(policy: Policy) -> str | None:
    """Why ``policy`` cannot run on a page pool yet (``None``: it can): full attention's context and prefill
    stages; a compress stage that is full attention's or declares ``writes_entries`` (its one write is
    `policies.common.write_entries`, directly or through `write_kept`, so it goes into a decode pool:
    `policies.common.PoolTarget`); and a decode stage that is full attention's (append, read every page) or
    declares ``selects_pages`` (its one hook is ``decode_select``, read through the tables: Quest). Any pair of
    the two runs, a compressor followed by Quest included: the decode pool's heads keep their own counts and
    Quest bounds and lists each head's own logical pages (tests/test_engine_pool_pipeline.py). And a decode stage
    that declares ``writes_in_place`` (H2O's running eviction: ``decode_write`` names the slot each token
    overwrites, written through the tables) after its own compaction (tests/test_engine_pool_h2o.py)."""
    if type(policy) is Dense:
        return None
    for name in ("context", "prefill"):
        stage = policy.stage(name)
        if type(stage) is not Dense:
            return f"its {name} stage ({stage.name}) is not full attention's"
    squeezer, dec = policy.stage("compress"), policy.stage("decode")
    if dec.writes_in_place:  # H2O's running eviction: after its own compaction only (its size is what that kept)
        return None if squeezer is dec and dec.writes_entries else (
            f"its decode stage ({dec.name}) writes in place (Policy.writes_in_place) after a compress stage "
            f"({squeezer.name}) other than its own, not tested on a pool yet")
    if isinstance(dec, CHESS):  # its page lists and rewinds read the pool's rows (`policies.chess_pool`)
        if type(squeezer) is not Dense:
            return (f"its decode stage ({dec.name}) rewinds and selects a row's pages after a compress stage "
                    f"({squeezer.name}), not tested on a pool yet")
        if dec.keys != "pre_rope":
            return f"its decode stage ({dec.name}) reads post-RoPE page sums, not read from a pool yet"
        return None
    if type(dec) is not Dense and not dec.selects_pages:
        return (f"its decode stage ({dec.name}) is not full attention's nor one that only selects pages "
                "(Policy.selects_pages) or writes in place after its own compaction (Policy.writes_in_place) "
                "nor CHESS")
    if type(squeezer) is not Dense and not squeezer.writes_entries:
        return (f"its compress stage ({squeezer.name}) does not write through policies.common.write_entries "
                "(Policy.writes_entries)")
    return None


def _check_pool(params: Params, policy: Policy, opts: Options, backend: Backend) -> None:
    """`Options.pool` checked before jit (``ValueError`` naming what is not supported yet); ``pool_pages`` is
    checked and resolved by `_pool_pages`."""
    if not isinstance(opts.pool, bool):
        raise ValueError(f"pool={opts.pool!r} must be True or False")
    if not opts.pool:
        if opts.pool_pages is not None:
            raise ValueError(f"pool_pages={opts.pool_pages} without pool=True (the pages of a page pool)")
        return
    why = pool_refusal(policy)
    if why is not None:
        raise ValueError(f"pool=True is experimental and policy {policy.name} does not decode from a page pool "
                         f"yet: {why}. Supported: FullKV, and SnapKV, StreamingLLM, AdaKV, PyramidKV, HeadSplit, "
                         "BSER, SemantiCache, Quest, a pipeline of one of these compressors followed by Quest, "
                         "H2O, and CHESS (pre-RoPE keys, after full attention) (leave pool unset)")
    if backend.mesh is not None:
        raise ValueError("pool=True does not run on a mesh yet (the pool's group axes: docs/PAGE_POOL.md, Sharding)")
    cfg = params.config
    if local_layers.ring_slots(cfg, backend) is not None:
        raise ValueError(f"pool=True does not page the rings of {cfg.family}'s local layers yet; use "
                         "Backend(local_cache='full')")


def _pool_pages(params: Params, bound: Policy, tokens: jax.Array, lengths: jax.Array, opts: Options,
                room: int = 0) -> int | None:
    """`Run.pool_pages` of a pooled run (docs/PAGE_POOL.md, Sizing), ``opts.pool_pages`` checked: as given, or
    for a compressor its decode pool's pages from the policy (``bound``'s `Policy.compressed_pages` with the
    ``room`` a suffix or question takes beside the decode's tokens) when unset; ``None`` (unset) for full
    attention, whose prefill pool then takes today's cache size."""
    cfg, given = params.config, opts.pool_pages
    B, T = tokens.shape
    # rows of unknown lengths (setup under a trace) are sized as full rows
    rows = np.asarray(lengths) if is_concrete(lengths) else np.full((B,), T)
    policy_pages = bound.stage("compress").compressed_pages(rows, T, opts.max_new_tokens + room, opts.page_size,
                                                             cfg.num_layers, cfg.num_kv_heads, suffix_tokens=room)
    if given is not None and (not isinstance(given, int) or isinstance(given, bool)):
        raise ValueError(f"pool_pages={given!r} must be an int")
    if policy_pages is not None:  # a compressor: its decode pool
        if given is not None and given < 1:
            raise ValueError(f"pool_pages={given} must be >= 1 (the decode pool's pages; unset: the policy's "
                             f"bound, {policy_pages})")
        return policy_pages if given is None else given
    if given is not None:  # full attention decodes from its prefill pool
        need = cfg.num_layers * B * cfg.num_kv_heads * pages_for(prefill_width(T, opts.prefill_chunk), opts.page_size)
        if given < need:
            raise ValueError(f"pool_pages={given!r} must be an int >= the prefill's pages L·B·Hkv·"
                             f"pages_for(prompt) = {cfg.num_layers}·{B}·{cfg.num_kv_heads}·"
                             f"{need // (cfg.num_layers * B * cfg.num_kv_heads)} = {need}")
    return given
