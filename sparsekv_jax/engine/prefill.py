"""The prefill: the prompt into an empty cache (one pass or chunked), observed by the policy's
stages that need it; `extend` reads more tokens (a question) into a filled cache."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax import attention, local_layers, sharding
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import (
    KVCache,
    dequantize_kv,
    init_cache,
    pages_for,
    summarize_pages,
    write_chunk,
    write_tokens,
)
from sparsekv_jax.cache_pooled import (
    PoolCache,
    grow_tokens,
    init_pool,
    layer_kv,
    layer_lengths,
    stack_view,
    with_stack,
    write_tokens_pool,
)
from sparsekv_jax.engine.run import Run, compressed_size, prefill_width
from sparsekv_jax.models.params import Params
from sparsekv_jax.models.transformer import LayerStack, attention_window, forward, last_token_logits
from sparsekv_jax.policies.base import Dense, Policy, Prompt


@struct.dataclass
class Prefilled:
    """What the prefill leaves: ``logits`` ``[B, V]`` fp32 at each row's last prompt token, the
    filled ``cache``, ``observations`` (``{stage: what that stage's policy observed}``) and
    ``block_fraction`` (attention blocks computed / causal blocks). With ``Options(pool=True)``
    (experimental) ``cache`` is a `PoolCache` (`prefill_run`)."""

    logits: jax.Array
    cache: KVCache | PoolCache
    observations: dict[str, Any]
    block_fraction: jax.Array


def transpose_heads(x: jax.Array) -> jax.Array:
    """``[B, T, H, D] <-> [B, H, T, D]``."""
    return jnp.swapaxes(x, 1, 2)


def window_of(cfg: Any, cache: KVCache):
    """``layer index -> sliding window`` of the layers in ``cache.layers``: none when the local layers
    keep rings (``cache.layers`` holds the global layers, indexed by rank; `local_layers`)."""
    return (lambda idx: None) if cache.local is not None else (lambda idx: attention_window(cfg, idx))


def _resolved(backend: Backend | None, params: Params) -> Backend:
    backend = Backend() if backend is None else backend
    return backend if backend.resolved else backend.resolve(params)


def _observers(policy: Policy) -> dict[str, Policy]:
    """``{stage: policy}`` of the compress and decode stages that observe the prefill."""
    return {name: policy.stage(name) for name in ("compress", "decode") if policy.stage(name).needs_observations}


def _unique(observers: dict[Any, Policy]) -> dict[Any, Any]:
    """``{key: key whose observation it shares}`` (the same policy observes once)."""
    first: dict[Any, Any] = {}
    for name, pol in observers.items():
        same = [n for n in first.values() if observers[n] is pol or (
            type(observers[n]) is type(pol) and not jax.tree.leaves(pol) and observers[n] == pol)]
        first[name] = same[0] if same else name
    return first


def empty_cache(params: Params, run: Run, rewind: int | None = None,
                summaries: frozenset[str] | None = None) -> KVCache:
    """The empty cache of ``run`` (its capacity and page size; rings for local layers holding the
    window plus ``rewind`` tokens, default what the run's decode stage may take back; the page
    ``summaries`` to hold, default those the run's policy reads)."""
    rewind = run.policy.stage("decode").max_rewind_tokens if rewind is None else rewind
    summaries = run.policy.page_summaries if summaries is None else summaries
    ring = local_layers.ring_slots(params.config, run.backend, rewind)
    cache = init_cache(params.config, run.tokens.shape[0], run.capacity, page_size=run.page_size, dtype=params.dtype,
                       ring=ring, summaries=summaries, kv_dtype=run.backend.kv_dtype)
    return sharding.constrain_cache(cache, run.backend.mesh)


def prefill_run(params: Params, run: Run) -> Prefilled:
    """The prefill of ``run`` into a fresh cache (traceable: call it under `jax.jit`); with ``run.pool``
    into a fresh page pool (`prefill_pool`)."""
    if run.pool:
        return prefill_pool(params, run)
    logits, cache, observations, fraction = prefill(params, run.policy, run.tokens, run.lengths,
                                                    empty_cache(params, run), chunk=run.prefill_chunk,
                                                    question_start=run.question_start, backend=run.backend)
    return Prefilled(logits, cache, observations, fraction)


def prefill_pool(params: Params, run: Run) -> Prefilled:
    """The prefill of ``run`` into a fresh page pool (``Options(pool=True)``, experimental; docs/PAGE_POOL.md,
    Lifecycle → Prefill): `cache_pooled.init_pool` of ``run.pool_pages`` pages (default today's cache size)
    whose (layer, row, head)s own the prompt's ``P = pages_for(prompt)`` pages in the identity layout; the
    prefill writes its `stack_view` (``[L, B, Hkv, P·ps, ...]``, a `KVCache` of capacity ``P·ps``) exactly as
    it writes today's cache, and `with_stack` puts it back, every head's length its row's. No copy when the
    pool is exactly the prompt's pages (``pool_pages = L·B·Hkv·P``: the view and ``with_stack`` are reshapes);
    otherwise the view is a slice of the pool and ``with_stack`` writes the prompt's pages back into it
    once (a ``dynamic_update_slice`` of the first ``L·B·Hkv·P`` pages). A run that compresses decodes from a
    fresh decode pool (`compress.compress`), so its prefill pool is exactly the prompt's pages (no room
    for appends, no copy)."""
    width = prefill_width(run.tokens.shape[1], run.prefill_chunk)
    compressing = compressed_size(run) is not None
    pool = init_pool(params.config, run.tokens.shape[0], width if compressing else run.capacity, prompt=width,
                     num_pages=None if compressing else run.pool_pages,
                     page_size=run.page_size, dtype=params.dtype, summaries=run.policy.page_summaries,
                     kv_dtype=run.backend.kv_dtype)
    zero = jnp.zeros((run.tokens.shape[0],), jnp.int32)
    view = KVCache(layers=stack_view(pool), length=zero, next_position=zero, local=None, page_size=run.page_size)
    logits, cache, observations, fraction = prefill(params, run.policy, run.tokens, run.lengths, view,
                                                    chunk=run.prefill_chunk, question_start=run.question_start,
                                                    backend=run.backend)
    pool = with_stack(pool, cache.layers, cache.length).replace(next_position=cache.next_position)
    return Prefilled(logits, pool, observations, fraction)


def share_prefill(params: Params, runs: list[Run]) -> list[Prefilled]:
    """One dense prefill of the prompt of ``runs`` (the same prompt, each run's policy) observed
    at once by every policy that needs it; ``[Prefilled of each run]`` sharing one cache."""
    r0 = runs[0]
    rewind = max(r.policy.stage("decode").max_rewind_tokens for r in runs)
    summaries = frozenset().union(*(r.policy.page_summaries for r in runs))
    logits, cache, seen, fraction = prefill_shared(params, [r.policy for r in runs], r0.tokens, r0.lengths,
                                                   empty_cache(params, r0, rewind, summaries), chunk=r0.prefill_chunk,
                                                   question_start=r0.question_start, backend=r0.backend)
    return [Prefilled(logits, cache, obs, fraction) for obs in seen]


def prefill(params: Params, policy: Policy, tokens: jax.Array, lengths: jax.Array, cache: KVCache,
            *, chunk: int | None = None, question_start: jax.Array | None = None, backend: Backend | None = None):
    """Process right-padded prompts into an empty ``cache``.

    Returns ``(last_logits [B, V] fp32, cache, observations, prefill_block_fraction)`` where
    ``observations`` is ``{stage: what that stage's policy observed}`` for the compress and decode
    stages that ``needs_observations`` (stacked over layers; over chunks too when chunked).
    ``chunk`` processes the prompt in chunks of that many tokens against the cache (long prompts;
    policies that need the whole prompt in one pass are refused before jit); ``None`` runs it in one
    pass with dense (cuDNN on the GPU) or the prefill stage's block-sparse attention.
    """
    return _prefill(params, policy.stage("prefill"), _observers(policy), tokens, lengths, cache,
                    (chunk, question_start, _resolved(backend, params)))


def prefill_shared(params: Params, policies: list[Policy], tokens: jax.Array, lengths: jax.Array, cache: KVCache,
                   *, chunk: int | None = None, question_start: jax.Array | None = None,
                   backend: Backend | None = None):
    """One dense prefill serving several policies, each observing what it needs during it.

    Policies whose prefill is dense (no prefill pattern, no context stage) see the same prefill
    cache, so comparing several of them needs the prompt's forward pass once (`sparsekv_jax.demo`
    does). An observer equal to another policy's observes once. Returns ``(logits, cache,
    [observations of each policy], block_fraction)``: ``observations[i]`` is what `prefill` would
    return for ``policies[i]``; each policy then compresses its own copy of ``cache``.
    """
    bad = [p.name for p in policies if type(p.stage("prefill")) is not Dense or type(p.stage("context")) is not Dense]
    if bad:
        raise ValueError(f"prefill_shared: {', '.join(bad)} have a prefill pattern or a context stage of their own; "
                         "prefill them with `prefill`")
    observers = {(i, stage): pol for i, p in enumerate(policies) for stage, pol in _observers(p).items()}
    logits, cache, seen, block_fraction = _prefill(params, Dense(), observers, tokens, lengths, cache,
                                                   (chunk, question_start, _resolved(backend, params)))
    per_policy = [{stage: obs for (j, stage), obs in seen.items() if j == i} for i in range(len(policies))]
    return logits, cache, per_policy, block_fraction


def _prefill(params: Params, pattern_stage: Policy, observers: dict[Any, Policy], tokens: jax.Array,
             lengths: jax.Array, cache: KVCache, how: tuple):
    """`prefill` with ``pattern_stage`` choosing the attention pattern and each of ``observers``
    (``{key: policy}``) observing; ``how`` is ``(chunk, question_start, backend)``. Returns the
    observations keyed like ``observers``."""
    chunk, question_start, backend = how
    shares = _unique(observers)
    observing = list({n: observers[n] for n in dict.fromkeys(shares.values())}.values())
    T = tokens.shape[1]
    if chunk is None or chunk >= T:
        hidden, layers, local, seen, block_fraction = _one_pass(params, pattern_stage, observing, tokens, lengths,
                                                                cache, question_start, backend)
    else:
        hidden, layers, local, seen = _chunked(params, observing, tokens, lengths, cache, chunk, question_start,
                                               backend)
        block_fraction = jnp.float32(1.0)
    seen = dict(zip(dict.fromkeys(shares.values()), seen, strict=True))  # a list inside jit: keys may be tuples
    observations = {n: seen[shares[n]] for n in observers}
    logits = last_token_logits(params, hidden, lengths, norm_every_position=backend.prefill_dots == "onednn")
    slot_used = jnp.arange(cache.capacity)[None, None, None, :] < lengths[None, :, None, None]
    layers = layers.replace(positions=jnp.where(slot_used, layers.positions, -1))
    layers = summarize_pages(layers, lengths, cache.page_size)
    cache = sharding.constrain_cache(cache.replace(layers=layers, local=local, length=lengths, next_position=lengths),
                                     backend.mesh)
    return logits, cache, observations, block_fraction


def _one_pass(params, pattern_stage, observing, tokens, lengths, cache, question_start, backend):
    """The whole prompt in one forward pass: ``(hidden, layers, local, seen, block_fraction)``."""
    B, T = tokens.shape
    window = window_of(params.config, cache)
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    prompt = Prompt(tokens=tokens, lengths=lengths, question_start=question_start, offset=0)

    def attend(q, k, v, kv, idx, hidden):
        pattern = pattern_stage.prefill_pattern(q, k, v, idx, prompt)
        out = attention.prefill(q, k, v, pattern, sliding_window=window(idx), backend=backend)
        kv = write_chunk(kv, transpose_heads(k), transpose_heads(v), 0, positions, lengths)
        fraction = jnp.float32(1.0) if pattern is None else attention.block_fraction(pattern, T)
        seen = [p.observe(q, k, v, hidden, idx, prompt) for p in observing]
        return out, kv, (seen, fraction)

    # with rings, the prefill pattern and the observers run in the global layers only
    ring_attend = None if cache.local is None else local_layers.prefill_attend(lengths, backend)
    out = LayerStack(unroll=backend.prefill_unroll)(params, tokens, positions, cache.layers, cache.local, attend,
                                                    ring_attend)
    seen, fractions = out.extras
    return out.hidden, out.caches, out.local, seen, fractions.mean()


def _chunked(params, observing, tokens, lengths, cache, chunk, question_start, backend):
    """The prompt in chunks of ``chunk`` tokens, each against the cache: ``(hidden, layers, local, seen)``."""
    B, T = tokens.shape
    window = window_of(params.config, cache)
    n_chunks, S = pages_for(T, chunk), cache.capacity
    if cache.layers.quantized and chunk % cache.page_size:
        raise ValueError(f"prefill_chunk={chunk} with a quantised cache (kv_dtype={cache.layers.k.dtype.name}) must be "
                         f"a multiple of page_size={cache.page_size}: chunks are written in whole pages")
    if n_chunks * chunk > S:
        raise ValueError(f"chunked prefill needs capacity {n_chunks * chunk} (prompt {T} rounded up "
                         f"to chunk={chunk}), cache holds {S}")
    chunks = jnp.pad(tokens, ((0, 0), (0, n_chunks * chunk - T))).reshape(B, n_chunks, chunk).transpose(1, 0, 2)

    def run_chunk(caches, xs):
        layers, local = caches
        chunk_tokens, c = xs
        start = c * chunk
        positions = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
        slot_ok = (jnp.arange(S) < start + chunk)[None, None, None, :]
        prompt = Prompt(tokens=chunk_tokens, lengths=lengths, question_start=question_start, offset=start)

        def attend(q, k, v, kv, idx, hidden):
            kv = write_chunk(kv, transpose_heads(k), transpose_heads(v), start, positions, lengths)
            keys, values = dequantize_kv(kv, q.dtype)
            out = attention.cached_attention(transpose_heads(q), keys, values, positions, kv.positions, slot_ok,
                                             bias=None, sliding_window=window(idx))
            seen = [p.observe(q, k, v, hidden, idx, prompt) for p in observing]
            return transpose_heads(out), kv, seen

        ring_attend = None if local is None else local_layers.chunk_attend(positions, positions < lengths[:, None])
        out = LayerStack(unroll=backend.prefill_unroll)(params, chunk_tokens, positions, layers, local, attend,
                                                        ring_attend)
        return (out.caches, out.local), (out.hidden, out.extras)

    (layers, local), (hiddens, seen) = jax.lax.scan(run_chunk, (cache.layers, cache.local),
                                                    (chunks, jnp.arange(n_chunks)))
    hidden = hiddens.transpose(1, 0, 2, 3).reshape(B, n_chunks * chunk, -1)[:, :T]
    return hidden, layers, local, seen


def extend(params: Params, cache: KVCache | PoolCache, tokens: jax.Array, lengths: jax.Array):
    """Append a right-padded chunk ``tokens`` ``[B, Tq]`` (``lengths`` ``[B]`` valid) to a filled cache.

    Each row's chunk goes to slots ``length[b] ..`` at positions ``next_position[b] ..`` and
    attends to every entry the cache holds (dense, with the cache's per-slot bias): this is how a
    question is read after the context was compressed without it (question-agnostic compression).
    Returns ``(logits [B, V] at each row's last chunk token, cache)``. A page pool (``Options(pool=True)``,
    experimental) is extended by `extend_pool`.
    """
    if isinstance(cache, PoolCache):
        return extend_pool(params, cache, tokens, lengths)
    B, Tq = tokens.shape
    offs = jnp.arange(Tq, dtype=jnp.int32)
    slots = cache.length[:, None] + offs  # [B, Tq]
    positions = cache.next_position[:, None] + offs
    written = jnp.where(offs[None, :] < lengths[:, None], positions, -1)  # padding is never a key
    new_length = cache.length + lengths
    slot_ok = (jnp.arange(cache.capacity)[None, :] < new_length[:, None])[:, None, None, :]  # [B, 1, 1, S]
    rows = jnp.arange(B)[:, None]
    window, local = window_of(params.config, cache), cache.local

    def attend(q, k, v, kv, idx, hidden):
        kv = kv.replace(positions=kv.positions.at[rows, :, slots].set(written[:, :, None], mode="drop"),
                        bias=kv.bias.at[rows, :, slots].set(0.0, mode="drop"))
        if kv.quantized:  # the touched pages re-scaled, their key summaries from the keys as computed
            kv = write_tokens(kv, k, v, slots, offs[None, :] < lengths[:, None], new_length)
        else:
            kv = kv.replace(k=kv.k.at[rows, :, slots].set(k.astype(kv.k.dtype), mode="drop"),
                            v=kv.v.at[rows, :, slots].set(v.astype(kv.v.dtype), mode="drop"))
        keys, values = dequantize_kv(kv, q.dtype)
        out = attention.cached_attention(transpose_heads(q), keys, values, positions, kv.positions, slot_ok,
                                         bias=kv.bias, sliding_window=window(idx))
        return transpose_heads(out), kv, None

    ring_attend = None if local is None else local_layers.chunk_attend(positions, offs[None, :] < lengths[:, None])
    hidden, layers, local, _, _ = LayerStack()(params, tokens, positions, cache.layers, local, attend, ring_attend)
    layers = summarize_pages(layers, new_length, cache.page_size)
    cache = cache.replace(layers=layers, local=local, length=new_length, next_position=cache.next_position + lengths)
    # a suffix is short: norming all of it costs nothing and keeps a oneDNN prefill program runnable
    return last_token_logits(params, hidden, lengths, norm_every_position=True), cache


def extend_pool(params: Params, cache: PoolCache, tokens: jax.Array, lengths: jax.Array):
    """`extend` on a page pool (``Options(pool=True)``, experimental; docs/PAGE_POOL.md, Lifecycle → Extend): one
    allocator call for every layer before the layer scan (`cache_pooled.grow_tokens`: each (layer, row, KV head)
    grows by the row's ``lengths``, popping pages from the free stack as its run needs them), then in each layer
    the chunk's K/V are written at every head's own logical slots ``old length ..`` through its table
    (`cache_pooled.write_tokens_pool`; heads that keep different counts, as AdaKV's, start at different slots)
    and the chunk attends, causally by position, to the layer read through its tables (`cache_pooled.layer_kv`)
    up to each head's new length, with the cache's per-slot bias. Slots past a head's length are emptied before
    the products (a page the chunk opens is not cleared: without it a NaN in a freed page reaches the output).
    The pool rides the layer scan's carry. Returns ``(logits [B, V] at each row's last chunk token, cache)``; a
    pool that runs out sets ``alloc.overflow`` (`engine.pooled.check_overflow` raises after the run)."""
    if cache.local is not None:
        raise ValueError("extend_pool: a pool with local-layer rings is not supported (run.pool_refusal refuses it)")
    B, Tq = tokens.shape
    offs = jnp.arange(Tq, dtype=jnp.int32)
    positions = cache.next_position[:, None] + offs
    written = offs[None, :] < lengths[:, None]
    before = cache.lengths  # [L, B, Hkv] each head's length before the chunk: its first slot
    cache = grow_tokens(cache, lengths)
    window = window_of(params.config, cache)

    def attend(q, k, v, layer, idx, hidden):
        start, pages = layer
        c = write_tokens_pool(cache.replace(pages=pages), idx, k, v, start, written, positions)
        kv = layer_kv(c, idx)
        live = jnp.arange(kv.positions.shape[-1]) < layer_lengths(c, idx)[..., None]  # [B, Hkv, M·ps]
        keys, values = dequantize_kv(kv, q.dtype)
        keys, values = (jnp.where(live[..., None], x, jnp.zeros((), x.dtype)) for x in (keys, values))
        out = attention.cached_attention(transpose_heads(q), keys, values, positions,
                                         jnp.where(live, kv.positions, -1), live[:, :, None, :],
                                         bias=jnp.where(live, kv.bias, 0.0), sliding_window=window(idx))
        return transpose_heads(out), (start, c.pages), None

    hidden, (_, pages), _ = forward(params, tokens, positions, before, attend, carried=cache.pages)
    cache = cache.replace(pages=pages, next_position=cache.next_position + lengths)
    return last_token_logits(params, hidden, lengths, norm_every_position=True), cache
