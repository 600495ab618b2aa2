"""Jitted generation: prefill (one-shot or chunked) then a `lax.while_loop` decode.

``generate(params, policy, tokens)`` is one `jax.jit` (two on an x86 CPU with fp32 weights: the
prefill compiled with oneDNN dots, the decode loop without, `Backend.prefill_dots`): prompts are
right-padded ``[B, T]`` with per-row ``lengths``; each row stops on its own at a stop token. The policy's stages
(`sparsekv_jax.policies.base.Policy`) decide the prefill pattern, the compression after
prefill and the pages each decode step reads.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax import attention, local_layers, sharding
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import (
    KVCache,
    append_token,
    init_cache,
    layer_view,
    pages_for,
    summarize_pages,
    write_chunk,
)
from sparsekv_jax.models.params import Params
from sparsekv_jax.models.transformer import (
    attention_window,
    forward,
    forward_interleaved,
    last_token_logits,
    logits_from_hidden,
)
from sparsekv_jax.pallas.validation import is_concrete
from sparsekv_jax.policies.base import Dense, Policy, Prompt, Setup


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
PAD_TOKEN = -1  # written after a row has stopped


@struct.dataclass
class GenerateOutput:
    """``tokens`` ``[B, max_new_tokens]`` (``PAD_TOKEN`` after a row stopped, the stop token
    included before it); ``num_generated`` ``[B]``; ``cache`` the final KV cache; ``stats``
    what the policy did (fractions of full attention) and what the cache holds:
    ``kv_stored_fraction`` [B] (entries kept / prompt length), ``kv_read_fraction`` [B] (pages
    read / pages in use, mean over decode steps; NaN for a row that stopped at its first token),
    ``prefill_block_fraction`` (blocks computed / causal blocks), ``cache_bytes``,
    ``cache_capacity``."""

    tokens: jax.Array
    num_generated: jax.Array
    cache: KVCache
    stats: dict[str, Any]

    def sequences(self) -> list[list[int]]:
        """Generated ids per row, on the host, without padding."""
        toks = np.asarray(self.tokens)
        return [toks[i, : int(n)].tolist() for i, n in enumerate(np.asarray(self.num_generated))]


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next token ``[B]`` from fp32 ``logits`` ``[B, V]``."""
    if sampling.temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits / sampling.temperature
    if sampling.top_k:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
        cum = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
        # drop a token once the mass *before* it already reaches top_p (the first always stays)
        drop_sorted = (cum - jax.nn.softmax(sorted_logits, axis=-1)) >= sampling.top_p
        drop = jnp.zeros_like(drop_sorted).at[jnp.arange(logits.shape[0])[:, None], order].set(drop_sorted)
        logits = jnp.where(drop, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def _transpose_heads(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 1, 2)  # [B, T, H, D] <-> [B, H, T, D]


def _window(cfg: Any, cache: KVCache):
    """``layer index -> sliding window`` of the layers in ``cache.layers``: none when the local layers
    keep rings (``cache.layers`` holds the global layers, indexed by rank; `local_layers`)."""
    return (lambda idx: None) if cache.local is not None else (lambda idx: attention_window(cfg, idx))


def _observers(policy: Policy) -> dict[str, Policy]:
    """``{stage: policy}`` of the compress and decode stages that observe the prefill; a stage run
    by the same policy as an earlier one (H2O compresses and decodes) maps to that one's name."""
    out: dict[str, Policy] = {}
    for name in ("compress", "decode"):
        stage = policy.stage(name)
        if stage.needs_observations:
            out[name] = stage
    return out


def _unique(observers: dict[Any, Policy]) -> dict[Any, Any]:
    """``{key: key whose observation it shares}`` (the same policy observes once)."""
    first: dict[Any, Any] = {}
    for name, pol in observers.items():
        same = [n for n in first.values() if observers[n] is pol or (
            type(observers[n]) is type(pol) and not jax.tree.leaves(pol) and observers[n] == pol)]
        first[name] = same[0] if same else name
    return first


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
    return _prefill(params, policy.stage("prefill"), _observers(policy), tokens, lengths, cache, chunk=chunk,
                    question_start=question_start, backend=backend)


def prefill_shared(params: Params, policies: list[Policy], tokens: jax.Array, lengths: jax.Array, cache: KVCache,
                   *, chunk: int | None = None, question_start: jax.Array | None = None,
                   backend: Backend | None = None):
    """One dense prefill serving several policies, each observing what it needs during it.

    Prefill and compression are separate stages: policies whose prefill is dense (no prefill pattern)
    see the same prefill cache, so comparing several of them needs the prompt's forward pass once
    (`sparsekv_jax.demo` does). The observers of every policy (its compress and decode stages that
    ``needs_observations``) observe in that one pass; an observer equal to another policy's observes
    once. Returns ``(logits, cache, [observations of each policy], block_fraction)``: ``observations[i]``
    is what `prefill` would return for ``policies[i]``; hand it to `compress_prefilled` (which leaves
    ``cache`` as it is: each policy compresses its own copy).
    """
    bad = [p.name for p in policies if type(p.stage("prefill")) is not Dense or type(p.stage("context")) is not Dense]
    if bad:
        raise ValueError(f"prefill_shared: {', '.join(bad)} have a prefill pattern or a context stage of their own; "
                         "prefill them with `prefill`")
    observers = {(i, stage): pol for i, p in enumerate(policies) for stage, pol in _observers(p).items()}
    logits, cache, seen, block_fraction = _prefill(params, Dense(), observers, tokens, lengths, cache,
                                                   chunk=chunk, question_start=question_start, backend=backend)
    per_policy = [{stage: obs for (j, stage), obs in seen.items() if j == i} for i in range(len(policies))]
    return logits, cache, per_policy, block_fraction


def _prefill(params: Params, pattern_stage: Policy, observers: dict[Any, Policy], tokens: jax.Array,
             lengths: jax.Array, cache: KVCache, *, chunk: int | None, question_start: jax.Array | None,
             backend: Backend | None):
    """`prefill` with ``pattern_stage`` choosing the attention pattern and each of ``observers``
    (``{key: policy}``) observing; returns the observations keyed like ``observers``."""
    backend = (Backend() if backend is None else backend)
    backend = backend if backend.resolved else backend.resolve(params)
    cfg = params.config
    B, T = tokens.shape
    shares = _unique(observers)
    observing = {n: observers[n] for n in dict.fromkeys(shares.values())}
    window = _window(cfg, cache)
    local = cache.local

    if chunk is None or chunk >= T:
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        prompt = Prompt(tokens=tokens, lengths=lengths, question_start=question_start, offset=0)

        def attend(q, k, v, kv, idx, hidden):
            pattern = pattern_stage.prefill_pattern(q, k, v, idx, prompt)
            out = attention.prefill(q, k, v, pattern, sliding_window=window(idx), backend=backend)
            kv = write_chunk(kv, _transpose_heads(k), _transpose_heads(v), 0, positions)
            fraction = jnp.float32(1.0) if pattern is None else attention.block_fraction(pattern, T)
            seen = [p.observe(q, k, v, hidden, idx, prompt) for p in observing.values()]
            return out, kv, (seen, fraction)

        if local is None:
            hidden, layers, (seen, fractions) = forward(params, tokens, positions, cache.layers, attend,
                                                        unroll=backend.prefill_unroll)
        else:  # the prefill pattern and the observers run in the global layers only
            hidden, (layers, local), ((seen, fractions), _) = forward_interleaved(
                params, tokens, positions, cache.layers, local, attend, local_layers.prefill_attend(lengths, backend),
                unroll=backend.prefill_unroll)
        block_fraction = fractions.mean()
    else:
        n_chunks = pages_for(T, chunk)
        padded = jnp.pad(tokens, ((0, 0), (0, n_chunks * chunk - T)))
        chunks = padded.reshape(B, n_chunks, chunk).transpose(1, 0, 2)
        S = cache.capacity
        if n_chunks * chunk > S:
            raise ValueError(f"chunked prefill needs capacity {n_chunks * chunk} (prompt {T} rounded up "
                             f"to chunk={chunk}), cache holds {S}")

        def run_chunk(caches, xs):
            layers, local = caches
            chunk_tokens, c = xs
            start = c * chunk
            positions = start + jnp.broadcast_to(jnp.arange(chunk, dtype=jnp.int32), (B, chunk))
            slot_ok = (jnp.arange(S) < start + chunk)[None, None, None, :]
            prompt = Prompt(tokens=chunk_tokens, lengths=lengths, question_start=question_start, offset=start)

            def attend(q, k, v, kv, idx, hidden):
                kv = write_chunk(kv, _transpose_heads(k), _transpose_heads(v), start, positions)
                out = attention.cached_attention(
                    _transpose_heads(q), kv.k, kv.v, positions, kv.positions, slot_ok,
                    bias=None, sliding_window=window(idx))
                seen = [p.observe(q, k, v, hidden, idx, prompt) for p in observing.values()]
                return _transpose_heads(out), kv, seen

            if local is None:
                hidden, layers, seen = forward(params, chunk_tokens, positions, layers, attend,
                                               unroll=backend.prefill_unroll)
            else:
                ring_attend = local_layers.chunk_attend(positions, positions < lengths[:, None])
                hidden, (layers, local), (seen, _) = forward_interleaved(
                    params, chunk_tokens, positions, layers, local, attend, ring_attend, unroll=backend.prefill_unroll)
            return (layers, local), (hidden, seen)

        (layers, local), (hiddens, seen) = jax.lax.scan(run_chunk, (cache.layers, local),
                                                        (chunks, jnp.arange(n_chunks)))
        hidden = hiddens.transpose(1, 0, 2, 3).reshape(B, n_chunks * chunk, -1)[:, :T]
        block_fraction = jnp.float32(1.0)
    seen = dict(zip(observing, seen, strict=True))  # (a list inside jit: keys may be tuples, not pytree-sortable)
    observations = {n: seen[shares[n]] for n in observers}
    logits = last_token_logits(params, hidden, lengths, norm_every_position=backend.prefill_dots == "onednn")
    slot_used = jnp.arange(cache.capacity)[None, None, None, :] < lengths[None, :, None, None]
    layers = layers.replace(positions=jnp.where(slot_used, layers.positions, -1))
    layers = summarize_pages(layers, lengths, cache.page_size)
    cache = sharding.constrain_cache(cache.replace(layers=layers, local=local, length=lengths, next_position=lengths),
                                     backend.mesh)
    return logits, cache, observations, block_fraction


def extend(params: Params, cache: KVCache, tokens: jax.Array, lengths: jax.Array):
    """Append a right-padded chunk ``tokens`` ``[B, Tq]`` (``lengths`` ``[B]`` valid) to a filled cache.

    Each row's chunk goes to slots ``length[b] ..`` at positions ``next_position[b] ..`` and
    attends to every entry the cache holds (dense, with the cache's per-slot bias): this is how a
    question is read after the context was compressed without it (question-agnostic compression).
    Returns ``(logits [B, V] at each row's last chunk token, cache)``.
    """
    cfg = params.config
    B, Tq = tokens.shape
    S = cache.capacity
    offs = jnp.arange(Tq, dtype=jnp.int32)
    slots = cache.length[:, None] + offs  # [B, Tq]
    positions = cache.next_position[:, None] + offs
    written = jnp.where(offs[None, :] < lengths[:, None], positions, -1)  # padding is never a key
    new_length = cache.length + lengths
    slot_ok = (jnp.arange(S)[None, :] < new_length[:, None])[:, None, None, :]  # [B, 1, 1, S]
    rows = jnp.arange(B)[:, None]

    def attend(q, k, v, kv, idx, hidden):
        kv = kv.replace(k=kv.k.at[rows, :, slots].set(k.astype(kv.k.dtype), mode="drop"),
                        v=kv.v.at[rows, :, slots].set(v.astype(kv.v.dtype), mode="drop"),
                        positions=kv.positions.at[rows, :, slots].set(written[:, :, None], mode="drop"),
                        bias=kv.bias.at[rows, :, slots].set(0.0, mode="drop"))
        out = attention.cached_attention(_transpose_heads(q), kv.k, kv.v, positions, kv.positions, slot_ok,
                                         bias=kv.bias, sliding_window=window(idx))
        return _transpose_heads(out), kv, None

    window, local = _window(cfg, cache), cache.local
    if local is None:
        hidden, layers, _ = forward(params, tokens, positions, cache.layers, attend)
    else:
        ring_attend = local_layers.chunk_attend(positions, offs[None, :] < lengths[:, None])
        hidden, (layers, local), _ = forward_interleaved(params, tokens, positions, cache.layers, local, attend,
                                                         ring_attend)
    layers = summarize_pages(layers, new_length, cache.page_size)
    cache = cache.replace(layers=layers, local=local, length=new_length,
                          next_position=cache.next_position + lengths)
    # a suffix is short: norming all of it costs nothing and keeps a oneDNN prefill program runnable
    return last_token_logits(params, hidden, lengths, norm_every_position=True), cache


def decode_step(params: Params, policy: Policy, cache: KVCache, token: jax.Array, state: tuple[Any, Any],
                *, backend: Backend | None = None, collect_attention: bool = False):
    """Feed one token per row ``[B]``.

    ``state`` is the decode stage's ``(layer_state, shared_state)``. Returns
    ``(logits [B, V], cache, state, pages_read [B])`` (fraction of in-use pages read, layer mean);
    with ``collect_attention`` also the attention outputs of every layer ``[L, B, Hq, D]``.
    """
    backend = (Backend() if backend is None else backend)
    backend = backend if backend.resolved else backend.resolve(params)
    cfg = params.config
    ps = cache.page_size
    pos = cache.next_position
    layer_state, shared_state = state
    dec = policy.stage("decode")
    probs_needed = dec.needs_decode_probs
    window = _window(cfg, cache)

    # By default the cache (and the policy's per-layer state, which can be as large, e.g. H2O's
    # scores) rides the layer scan's carry: each layer writes its token in place and attention
    # reads the layer from the stack. Scanned as xs/ys they would be copied whole at every step.
    # ``decode_carry=False`` scans them as xs/ys (the reference program): the same code, with
    # ``at=None`` meaning "one layer's arrays".
    carry = backend.decode_carry

    def attend(q, k, v, layer, idx, hidden):
        if carry:
            _, (layers, lstate_all) = layer
            lstate, at = layer_view(lstate_all, idx), idx
        else:
            (layers, lstate), at = layer, None
        view = (lambda t: layer_view(t, idx)) if carry else (lambda t: t)
        slot, new_length = dec.decode_write(view(layers), cache.length, lstate)
        layers = append_token(layers, k[:, 0], v[:, 0], slot, pos, new_length, ps, layer=at)
        kv = view(layers)
        selection = dec.decode_select(q[:, 0], kv, new_length, lstate, shared_state, idx, ps)
        res = attention.decode(q[:, 0], pos, layers, new_length, ps, selection, sliding_window=window(idx),
                               return_probs=probs_needed, layer=at, backend=backend)
        if probs_needed:
            out, pages, probs = res
            lstate = dec.decode_observe(lstate, probs, kv)
            if carry:
                lstate_all = jax.tree.map(lambda a, x: a.at[idx].set(x), lstate_all, lstate)
        else:
            out, pages = res
        new = (None, (layers, lstate_all)) if carry else (layers, lstate)
        return out[:, None], new, (pages, new_length, out if collect_attention else None)

    by_index = backend.decode_matmul == "pallas"
    common = dict(unroll=backend.decode_unroll, weights_by_index=by_index, interpret=backend.interpret,
                  mesh=backend.mesh)
    local = cache.local
    if local is not None:  # global layers as above (indexed by rank), local layers read their rings
        ring_attend = local_layers.decode_attend(pos, collect_attention)
        if carry:
            hidden, (_, local, (layers, layer_state)), ((pages, new_length, outs), (ring_read, ring_outs)) = (
                forward_interleaved(params, token[:, None], pos[:, None], None, local, attend, ring_attend,
                                    carried=(cache.layers, layer_state), **common))
        else:
            hidden, ((layers, layer_state), local), ((pages, new_length, outs), (ring_read, ring_outs)) = (
                forward_interleaved(params, token[:, None], pos[:, None], (cache.layers, layer_state), local, attend,
                                    ring_attend, **common))
        # entries read / entries in use, over every layer (a local layer reads its whole window)
        in_use = new_length.astype(jnp.float32)
        pages = ((pages * in_use).sum(0) + ring_read.sum(0)) / jnp.maximum(in_use.sum(0) + ring_read.sum(0), 1.0)
        pages = pages[None]
        outs = local_layers.merge_layers(cfg, outs, ring_outs) if collect_attention else None
    elif carry:
        hidden, (_, (layers, layer_state)), (pages, new_length, outs) = forward(
            params, token[:, None], pos[:, None], None, attend, carried=(cache.layers, layer_state), **common)
    else:
        hidden, (layers, layer_state), (pages, new_length, outs) = forward(
            params, token[:, None], pos[:, None], (cache.layers, layer_state), attend, **common)
    logits = logits_from_hidden(params, hidden[:, 0])
    cache = sharding.constrain_cache(
        cache.replace(layers=layers, local=local, length=new_length[0], next_position=pos + 1), backend.mesh)
    shared_state = dec.decode_update(shared_state, cache, logits)
    layer_state, shared_state = sharding.constrain_state((layer_state, shared_state), cache, backend.mesh)
    if collect_attention:
        return logits, cache, (layer_state, shared_state), pages.mean(0), outs
    return logits, cache, (layer_state, shared_state), pages.mean(0)


def stored_entries(cache: KVCache) -> tuple[jax.Array, int]:
    """``([B] live KV entries per row summed over layers and KV heads, the number of (layer, head)
    pairs summed)``: their ratio is the row's mean (holes not counted). A local layer's ring counts
    the entries inside the window of the next token (`local_layers`), once per layer. Integer sums,
    so a full cache's fraction of the prompt is exactly 1 (a float mean came out 1.0000001)."""
    live = (cache.layers.positions >= 0) & (jnp.arange(cache.capacity) < cache.length[None, :, None, None])
    L, _, H = live.shape[:3]
    total, pairs = live.sum((0, 2, 3), dtype=jnp.int32), L * H
    if cache.local is None:
        return total, pairs
    ring = local_layers.window_entries(cache.local.positions, cache.next_position, cache.local.window)  # [Ll, B]
    # a ring's count is per layer (its heads hold the same window): weigh it as H heads
    return total + H * ring.sum(0).astype(jnp.int32), pairs + H * ring.shape[0]


def prepare(params: Params, policy: Policy, tokens: jax.Array, lengths: jax.Array, suffix: jax.Array | None,
            suffix_lengths: jax.Array | None, *, extra_tokens: int, page_size: int, prefill_chunk: int | None,
            capacity: int, question_start: jax.Array | None = None, prompt_lengths: jax.Array | None = None,
            backend: Backend | None = None):
    """Prefill, compress, read the suffix (if any) and set up the decode state.

    ``extra_tokens`` is how many tokens the cache must still take after this (decode steps);
    ``prompt_lengths`` the user's prompt lengths before a context stage rewrote it (stats are
    fractions of those). Returns ``(logits [B, V], cache, state, stats)``.
    """
    backend = (Backend() if backend is None else backend)
    backend = backend if backend.resolved else backend.resolve(params)
    ring = local_layers.ring_slots(params.config, backend, policy.stage("decode").max_rewind_tokens)
    cache = init_cache(params.config, tokens.shape[0], capacity, page_size=page_size, dtype=params.dtype, ring=ring)
    cache = sharding.constrain_cache(cache, backend.mesh)
    logits, cache, observations, block_fraction = prefill(params, policy, tokens, lengths, cache,
                                                          chunk=prefill_chunk, question_start=question_start,
                                                          backend=backend)
    return compress_prefilled(params, policy, logits, cache, observations, block_fraction, tokens, lengths, suffix,
                              suffix_lengths, extra_tokens=extra_tokens, question_start=question_start,
                              prompt_lengths=prompt_lengths, mesh=backend.mesh)


def compress_prefilled(params: Params, policy: Policy, logits: jax.Array, cache: KVCache, observations: dict,
                       block_fraction: jax.Array, tokens: jax.Array, lengths: jax.Array, suffix: jax.Array | None,
                       suffix_lengths: jax.Array | None, *, extra_tokens: int,
                       question_start: jax.Array | None = None, prompt_lengths: jax.Array | None = None,
                       mesh: Any = None):
    """What `prepare` does after the prefill: compress (a new, smaller cache: the prefill ``cache``
    is left as it is), read the suffix, set up the decode state. ``logits``, ``cache``,
    ``observations`` and ``block_fraction`` come from `prefill` (or `prefill_shared`) of ``policy``;
    ``mesh`` (`Backend.mesh`) pins the compressed cache to its split. Returns
    ``(logits [B, V], cache, state, stats)``."""
    T = tokens.shape[1]
    tq = 0 if suffix is None else suffix.shape[1]
    squeezer = policy.stage("compress")
    compressed = squeezer.compressed_capacity(T, extra_tokens + tq, suffix_tokens=tq)
    if compressed is not None:
        prompt = Prompt(tokens=tokens, lengths=lengths, question_start=question_start, offset=0)
        cache = sharding.constrain_cache(squeezer.compress(cache, observations.get("compress"), compressed, prompt),
                                         mesh)
    reference = lengths if prompt_lengths is None else prompt_lengths
    total, pairs = stored_entries(cache)
    stored = total.astype(jnp.float32) / (pairs * reference).astype(jnp.float32)
    if suffix is not None:
        logits, cache = extend(params, cache, suffix, suffix_lengths)
    state = sharding.constrain_state(policy.stage("decode").decode_init(cache, observations.get("decode")), cache,
                                     mesh)
    return logits, cache, state, {"kv_stored_fraction": stored, "prefill_block_fraction": block_fraction}


def decode_loop(params: Params, policy: Policy, logits: jax.Array, cache: KVCache, state: Any, key: jax.Array, *,
                max_new_tokens: int, sampling: Sampling, stop_tokens: tuple[int, ...], backend: Backend | None = None):
    """Sample the first token from ``logits`` then decode until every row stopped.

    Each row keeps its own output count, so a policy may take back a row's last tokens
    (`Policy.decode_rewind`, CHESS's backtracking): they are dropped from the output and the cache
    and generated again; the loop then runs up to ``policy.max_rewind_tokens`` extra steps.
    Returns ``(tokens [B, max_new_tokens], num_generated [B], cache, kv_read_fraction [B],
    policy stats)``.
    """
    dec = policy.stage("decode")
    B = logits.shape[0]
    rows = jnp.arange(B)
    cols = jnp.arange(max_new_tokens)
    stops = jnp.asarray(stop_tokens if stop_tokens else (-2,), jnp.int32)
    key, sub = jax.random.split(key)
    first = sample(logits, sub, sampling)
    out = jnp.full((B, max_new_tokens), PAD_TOKEN, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stops) | (max_new_tokens <= 1)
    zero = jnp.zeros((B,), jnp.float32)
    max_steps = max_new_tokens - 1 + dec.max_rewind_tokens

    def cond(carry):
        step, done = carry[0], carry[3]
        return (step < max_steps) & ~jnp.all(done)

    def body(carry):
        step, cache, n, done, out, key, state, read, steps = carry
        logits, cache, state, pages = decode_step(params, policy, cache, out[rows, n - 1], state, backend=backend)
        key, sub = jax.random.split(key)
        nxt = sample(logits, sub, sampling)
        active = ~done
        out = out.at[rows, jnp.where(active, n, max_new_tokens)].set(nxt, mode="drop")
        read = read + jnp.where(active, pages, 0.0)
        steps = steps + active
        n = n + active
        stopped = active & jnp.isin(nxt, stops)
        rewind = dec.decode_rewind(state[1])
        if rewind is not None:
            # take back `rewind` tokens of active rows; a stopped row stays put (its cache does not
            # grow while the others run on, so extra steps never overflow the capacity)
            back = jnp.where(active, rewind, 1).astype(jnp.int32)
            n = n - jnp.where(active, rewind, 0)
            out = jnp.where((cols[None] >= n[:, None]) & (rewind > 0)[:, None] & active[:, None], PAD_TOKEN, out)
            cache = cache.replace(length=cache.length - back, next_position=cache.next_position - back)
            stopped = stopped & (rewind == 0)
        done = done | stopped | (n >= max_new_tokens)
        return step + 1, cache, n, done, out, key, state, read, steps

    init = (jnp.int32(0), cache, jnp.ones((B,), jnp.int32), done, out, key, state, zero, zero)
    _, cache, _, _, out, _, state, read, steps = jax.lax.while_loop(cond, body, init)
    num_generated = jnp.sum(out != PAD_TOKEN, axis=1)
    # a row that stopped at its first token read nothing while decoding: NaN, not 0 (means skip it)
    read_fraction = jnp.where(steps > 0, read / jnp.maximum(steps, 1.0), jnp.nan)
    return out, num_generated, cache, read_fraction, dec.decode_stats(state[1])


def _generate(params: Params, policy: Policy, tokens: jax.Array, lengths: jax.Array,
              question_start: jax.Array | None, prompt_lengths: jax.Array, suffix: jax.Array | None,
              suffix_lengths: jax.Array | None, key: jax.Array, *, max_new_tokens: int, sampling: Sampling,
              stop_tokens: tuple[int, ...], page_size: int, prefill_chunk: int | None,
              capacity: int, backend: Backend) -> GenerateOutput:
    logits, cache, state, pre_stats = prepare(params, policy, tokens, lengths, suffix, suffix_lengths,
                                              extra_tokens=max_new_tokens, page_size=page_size,
                                              prefill_chunk=prefill_chunk, capacity=capacity,
                                              question_start=question_start, prompt_lengths=prompt_lengths,
                                              backend=backend)
    return _output(pre_stats, decode_loop(params, policy, logits, cache, state, key, max_new_tokens=max_new_tokens,
                                          sampling=sampling, stop_tokens=stop_tokens, backend=backend))


def _output(pre_stats: dict[str, Any], decoded: tuple) -> GenerateOutput:
    """`GenerateOutput` from `prepare`'s stats and `decode_loop`'s results."""
    out, num_generated, cache, read, policy_stats = decoded
    stats = {
        **pre_stats,  # kv_stored_fraction: live entries / the user's prompt; prefill_block_fraction
        "kv_read_fraction": read,  # mean over steps of pages read / pages in use
        **policy_stats,  # e.g. CHESS's reselections / backtracks per row
    }
    return GenerateOutput(tokens=out, num_generated=num_generated, cache=cache, stats=stats)


_generate_jit = jax.jit(
    _generate,
    static_argnames=("max_new_tokens", "sampling", "stop_tokens", "page_size", "prefill_chunk", "capacity",
                     "backend"))


_prepare_jit = jax.jit(prepare, static_argnames=("extra_tokens", "page_size", "prefill_chunk", "capacity", "backend"))
_decode_loop_jit = jax.jit(decode_loop, static_argnames=("max_new_tokens", "sampling", "stop_tokens", "backend"))


def _generate_split(params, policy, tokens, lengths, question_start, prompt_lengths, suffix, suffix_lengths, key, *,
                    max_new_tokens, sampling, stop_tokens, page_size, prefill_chunk, capacity,
                    backend) -> GenerateOutput:
    """`_generate` as two programs: the prefill compiled by `Backend.compile_prefill` (oneDNN's
    dots), the decode loop with XLA's (`Backend.prefill_dots`). The same values as the one
    program; the cache passes between them on the device. Lowering and compiling are cached by
    JAX, so a repeated call only checks the compiled program's text again."""
    dynamic = (params, policy, tokens, lengths, suffix, suffix_lengths)
    lowered = _prepare_jit.lower(*dynamic, extra_tokens=max_new_tokens, page_size=page_size,
                                 prefill_chunk=prefill_chunk, capacity=capacity, question_start=question_start,
                                 prompt_lengths=prompt_lengths, backend=backend)
    logits, cache, state, pre_stats = backend.compile_prefill(lowered)(
        *dynamic, question_start=question_start, prompt_lengths=prompt_lengths)
    return _output(pre_stats, _decode_loop_jit(params, policy, logits, cache, state, key,
                                               max_new_tokens=max_new_tokens, sampling=sampling,
                                               stop_tokens=stop_tokens, backend=backend))


def validate_prompt(params: Params, tokens: Any, lengths: Any, max_new_tokens: int,
                    capacity: int | None) -> tuple[jax.Array, jax.Array, int]:
    """Checks done before jit; returns ``(tokens [B, T] int32, lengths [B] int32, capacity)``."""
    cfg = params.config
    if not hasattr(tokens, "shape"):
        tokens = np.asarray(tokens)
    if tokens.ndim == 1:
        tokens = tokens[None]
    if tokens.ndim != 2:
        raise ValueError(f"tokens must have rank 1 or 2 ([T] or [B, T]), got shape {tuple(tokens.shape)}")
    if not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be integers, got dtype {tokens.dtype}")
    B, T = tokens.shape
    if T == 0 or B == 0:
        raise ValueError(f"empty prompt: tokens has shape {tuple(tokens.shape)}")
    if is_concrete(tokens):
        t = np.asarray(tokens)
        if t.min() < 0 or t.max() >= cfg.vocab_size:
            bad = int(t.min()) if t.min() < 0 else int(t.max())
            raise ValueError(f"token id {bad} out of range [0, {cfg.vocab_size})")
    if lengths is None:
        lengths = np.full((B,), T, np.int32)
    if not hasattr(lengths, "shape"):
        lengths = np.asarray(lengths)
    if lengths.shape != (B,):
        raise ValueError(f"lengths must have shape ({B},), got {tuple(lengths.shape)}")
    if is_concrete(lengths):
        ln = np.asarray(lengths)
        if ln.min() < 1 or ln.max() > T:
            raise ValueError(f"lengths must be in [1, {T}] (prompt width), got min {ln.min()} max {ln.max()}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if T + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompt length {T} + max_new_tokens {max_new_tokens} = {T + max_new_tokens} exceeds "
                         f"the model's max_position_embeddings {cfg.max_position_embeddings}")
    needed = T + max_new_tokens
    if capacity is None:
        capacity = needed
    elif capacity < needed:
        raise ValueError(f"prompt length {T} + max_new_tokens {max_new_tokens} = {needed} exceeds the "
                         f"cache capacity {capacity}")
    return jnp.asarray(tokens, jnp.int32), jnp.asarray(lengths, jnp.int32), capacity


def _validate_question_start(question_start: Any, lengths: jax.Array) -> jax.Array | None:
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


def _validate_suffix(params: Params, suffix: Any, suffix_lengths: Any, batch: int):
    if suffix is None:
        if suffix_lengths is not None:
            raise ValueError("suffix_lengths given without suffix")
        return None, None
    suffix, suffix_lengths, _ = validate_prompt(params, suffix, suffix_lengths, 1, None)
    if suffix.shape[0] != batch:
        raise ValueError(f"suffix has batch {suffix.shape[0]}, tokens has batch {batch}")
    return suffix, suffix_lengths


@dataclasses.dataclass(frozen=True)
class Inputs:
    """Everything `generate` checked and sized before jit (shared with `teacher_force`, the demo
    and the benchmarks): the bound policy, the prompt the prefill sees (after the context stage),
    the user's prompt lengths, the suffix, the cache capacity, the resolved backend and the
    context stage's host-side ``context_info``."""

    policy: Policy
    tokens: jax.Array
    lengths: jax.Array
    question_start: jax.Array | None
    prompt_lengths: jax.Array
    suffix: jax.Array | None
    suffix_lengths: jax.Array | None
    capacity: int
    backend: Backend
    context_info: dict[str, Any]


def _setup(params: Params, policy: Policy | None, tokens: Any, lengths: Any, suffix: Any, suffix_lengths: Any,
           extra_tokens: int, page_size: int, prefill_chunk: int | None, capacity: int | None, *,
           question_start: Any = None, backend: Backend | None = None) -> Inputs:
    """Everything checked and sized before jit; the context stage runs here (on the host)."""
    if tokens is None:
        raise ValueError("tokens is required")
    policy = Dense() if policy is None else policy
    if not isinstance(policy, Policy):
        raise ValueError(f"policy must be a Policy, got {type(policy).__name__}")
    if backend is not None and not isinstance(backend, Backend):
        raise ValueError(f"backend must be a sparsekv_jax.Backend, got {type(backend).__name__}")
    backend = (Backend() if backend is None else backend).resolve(params)
    if not hasattr(tokens, "shape"):
        tokens = np.asarray(tokens)
    batch = tokens.shape[0] if tokens.ndim == 2 else 1
    suffix, suffix_lengths = _validate_suffix(params, suffix, suffix_lengths, batch)
    tq = 0 if suffix is None else suffix.shape[1]
    tokens, lengths, _ = validate_prompt(params, tokens, lengths, extra_tokens + tq, None)
    question_start = _validate_question_start(question_start, lengths)
    prompt_lengths = lengths
    info: dict[str, Any] = {}
    context_stage = policy.stage("context")
    if type(context_stage) is not Dense:
        res = context_stage.context(params, np.asarray(tokens), np.asarray(lengths),
                                    None if question_start is None else np.asarray(question_start))
        tokens, lengths, _ = validate_prompt(params, res.tokens, res.lengths, extra_tokens + tq, None)
        question_start = _validate_question_start(res.question_start, lengths)
        info = dict(res.info)
        capacity = None if capacity is None else max(capacity, tokens.shape[1] + extra_tokens + tq)
    tokens, lengths, capacity = validate_prompt(params, tokens, lengths, extra_tokens + tq, capacity)
    if page_size <= 0 or page_size & (page_size - 1):
        raise ValueError(f"page_size={page_size} must be a positive power of two")
    if prefill_chunk is not None and prefill_chunk <= 0:
        raise ValueError(f"prefill_chunk={prefill_chunk} must be positive or None")
    capacity = pages_for(capacity, page_size) * page_size
    if prefill_chunk is not None and prefill_chunk < tokens.shape[1] and policy.needs_whole_prefill:
        whole = [policy.stage(s).name for s in ("prefill", "compress", "decode")
                 if policy.stage(s).needs_whole_prefill]
        raise ValueError(f"prefill_chunk={prefill_chunk}: {', '.join(dict.fromkeys(whole))} need(s) the whole "
                         f"prompt in one prefill pass (a prefill block pattern or observations of the whole "
                         f"prompt); use prefill_chunk=None")
    if prefill_chunk is not None:
        capacity = max(capacity, pages_for(tokens.shape[1], prefill_chunk) * prefill_chunk)
    # a model whose local layers keep rings is, to the policy, the model of its global layers
    setup = Setup(config=local_layers.policy_config(params.config, backend), prompt_len=tokens.shape[1],
                  max_new_tokens=extra_tokens + tq, page_size=page_size, backend=backend)
    return Inputs(policy=policy.bind(setup), tokens=tokens, lengths=lengths, question_start=question_start,
                  prompt_lengths=prompt_lengths, suffix=suffix, suffix_lengths=suffix_lengths, capacity=capacity,
                  backend=backend, context_info=info)


def generate(params: Params, policy: Policy | None = None, tokens: Any = None, *, lengths: Any = None,
             question_start: Any = None, max_new_tokens: int = 64, sampling: Sampling = GREEDY,
             seed: int | jax.Array = 0, stop_tokens: tuple[int, ...] | None = None, page_size: int = 16,
             prefill_chunk: int | None = None, capacity: int | None = None, suffix: Any = None,
             suffix_lengths: Any = None, backend: Backend | None = None, mesh: Any = None) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` per row with ``policy`` choosing the KV entries used.

    Args:
      params: model weights (carry their `ModelConfig`).
      policy: a `Policy` (or `Pipeline`); ``None`` means `Dense()`.
      tokens: ``[B, T]`` right-padded prompt ids (or ``[T]``).
      lengths: ``[B]`` true prompt lengths (default: all ``T``).
      question_start: ``[B]`` where each row's question starts inside ``tokens`` (question-aware
        compression: the compress stage scores the context with the question in view and may keep
        the question). ``None``: no split is known (policies that need one use their fallback).
      max_new_tokens: tokens generated per row at most (the first stop token included).
      sampling: greedy by default; `Sampling(temperature, top_k, top_p)`.
      seed: PRNG seed (int) or key.
      stop_tokens: ids that end a row (default: the model's EOS ids).
      page_size: KV cache page size in tokens.
      prefill_chunk: process the prompt in chunks of this many tokens (``None``: one pass).
      capacity: cache capacity in tokens (default: what the prompt and generation need).
      suffix: ``[B, Tq]`` right-padded tokens read *after* compression (e.g. the question, for
        question-agnostic compression: the policy compresses ``tokens`` without seeing it).
      suffix_lengths: ``[B]`` true suffix lengths.
      backend: implementation choices (`sparsekv_jax.Backend`; default ``auto`` per platform).
      mesh: a ``data`` × ``model`` `jax.sharding.Mesh` (`sparsekv_jax.sharding.make_mesh`) to run on:
        rows split over ``data``, heads / MLP / vocabulary over ``model`` (the same tokens as
        unsharded; ``ValueError`` before jit where heads or the batch do not divide it).

    The context stage (if the policy has one) runs first, on the host; everything after it is one
    `jax.jit`. All checks on the inputs happen before tracing, with errors naming the bad value.
    ``stats`` fractions are of the user's prompt (before a context stage rewrote it).
    """
    params, backend = sharding.on_mesh(params, tokens, mesh, backend)
    run = sharding.place_rows(_setup(params, policy, tokens, lengths, suffix, suffix_lengths, max_new_tokens,
                                     page_size, prefill_chunk, capacity, question_start=question_start,
                                     backend=backend))
    if stop_tokens is None:
        stop_tokens = params.config.eos_token_ids
    key = jax.random.key(seed) if isinstance(seed, int) else seed
    # under a caller's jit the program is the caller's: compiler options cannot apply there
    inputs = jax.tree.leaves((params, run.policy, run.tokens, run.lengths, run.suffix, run.question_start, key))
    split = run.backend.prefill_compiler_options() is not None and is_concrete(*inputs)
    program = _generate_split if split else _generate_jit
    out = program(params, run.policy, run.tokens, run.lengths, run.question_start, run.prompt_lengths,
                  run.suffix, run.suffix_lengths, key, max_new_tokens=max_new_tokens, sampling=sampling,
                  stop_tokens=tuple(int(t) for t in stop_tokens), page_size=page_size,
                  prefill_chunk=prefill_chunk, capacity=run.capacity, backend=run.backend)
    # sizes are static: Python ints here (inside jit they would overflow int32 past 2 GiB)
    out.stats["cache_bytes"] = out.cache.nbytes()
    out.stats["cache_capacity"] = out.cache.capacity
    if run.context_info:
        out.stats["context"] = run.context_info
    return out


@functools.partial(jax.jit, static_argnames=("page_size", "prefill_chunk", "capacity", "collect_attention",
                                             "backend"))
def _teacher_force(params, policy, tokens, lengths, question_start, prompt_lengths, suffix, suffix_lengths, forced,
                   *, page_size, prefill_chunk, capacity, collect_attention, backend):
    N = forced.shape[1]
    logits, cache, state, _ = prepare(params, policy, tokens, lengths, suffix, suffix_lengths, extra_tokens=N,
                                      page_size=page_size, prefill_chunk=prefill_chunk, capacity=capacity,
                                      question_start=question_start, prompt_lengths=prompt_lengths, backend=backend)

    def step(carry, token):
        cache, state = carry
        res = decode_step(params, policy, cache, token, state, backend=backend, collect_attention=collect_attention)
        logits, cache, state = res[:3]
        return (cache, state), (logits, res[4] if collect_attention else None)

    _, (rest, outs) = jax.lax.scan(step, (cache, state), forced[:, :-1].T)
    all_logits = jnp.concatenate([logits[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)
    return all_logits, outs


def teacher_force(params: Params, policy: Policy | None, tokens: Any, forced: Any, *, lengths: Any = None,
                  question_start: Any = None, suffix: Any = None, suffix_lengths: Any = None, page_size: int = 16,
                  prefill_chunk: int | None = None, collect_attention: bool = False,
                  backend: Backend | None = None, mesh: Any = None):
    """Logits of ``policy`` along a given continuation ``forced`` ``[B, N]`` (teacher forcing).

    Returns ``logits [B, N, V]`` where ``logits[:, i]`` predicts ``forced[:, i]`` (``i = 0`` from
    the prompt), and with ``collect_attention`` the attention outputs of every layer at each
    decode step, ``[N - 1, L, B, Hq, D]``. Used by the fidelity metrics to compare a policy with
    full attention on the same tokens. ``mesh``: as for `generate`.
    """
    forced = np.asarray(forced) if not hasattr(forced, "shape") else forced
    if forced.ndim != 2 or forced.shape[1] < 1:
        raise ValueError(f"forced must be [B, N] with N >= 1, got shape {tuple(forced.shape)}")
    params, backend = sharding.on_mesh(params, tokens, mesh, backend)
    run = sharding.place_rows(_setup(params, policy, tokens, lengths, suffix, suffix_lengths, forced.shape[1],
                                     page_size, prefill_chunk, None, question_start=question_start, backend=backend))
    if forced.shape[0] != run.tokens.shape[0]:
        raise ValueError(f"forced has batch {forced.shape[0]}, tokens has batch {run.tokens.shape[0]}")
    return _teacher_force(params, run.policy, run.tokens, run.lengths, run.question_start, run.prompt_lengths,
                          run.suffix, run.suffix_lengths, jnp.asarray(forced, jnp.int32), page_size=page_size,
                          prefill_chunk=prefill_chunk, capacity=run.capacity, collect_attention=collect_attention,
                          backend=run.backend)


@functools.partial(jax.jit, static_argnames=("page_size",))
def _full_logits(params: Params, tokens: jax.Array, page_size: int = 16) -> jax.Array:
    cfg = params.config
    B, T = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))

    def attend(q, k, v, kv, idx, hidden):
        return attention.dense_causal_attention(q, k, v, sliding_window=attention_window(cfg, idx)), kv, None

    hidden, _, _ = forward(params, tokens, positions, jnp.zeros((cfg.num_layers,)), attend)
    return logits_from_hidden(params, hidden)


def full_logits(params: Params, tokens: Any) -> jax.Array:
    """``[B, T, V]`` fp32 logits of a plain causal forward pass (no cache): the reference."""
    tokens, _, _ = validate_prompt(params, tokens, None, 1, None)
    return _full_logits(params, tokens)
