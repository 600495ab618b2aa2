"""Decoding: one step (`decode_step`, a `StepOut` whatever is collected) and the loop that samples
until every row stopped (`decode_loop`, a `lax.while_loop`)."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax import attention, local_layers, sharding
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache, append_token, layer_view
from sparsekv_jax.cache_pooled import PoolCache, rewind_pool
from sparsekv_jax.engine import pooled
from sparsekv_jax.engine.compress import Ready
from sparsekv_jax.engine.prefill import _resolved, window_of
from sparsekv_jax.engine.run import Decoding, Sampling
from sparsekv_jax.models.params import Params
from sparsekv_jax.models.transformer import LayerStack, logits_from_hidden
from sparsekv_jax.policies.base import Policy

PAD_TOKEN = -1  # written after a row has stopped


@struct.dataclass
class StepOut:
    """One decode step: ``logits`` ``[B, V]`` fp32, the ``cache`` and decode ``state`` after it,
    ``pages_read`` ``[B]`` (fraction of in-use pages read, layer mean) and ``attention`` (every
    layer's attention output ``[L, B, Hq, D]`` when collected, else ``None``). Unpacks as the
    4-tuple ``(logits, cache, state, pages_read)``."""

    logits: jax.Array
    cache: KVCache
    state: Any
    pages_read: jax.Array
    attention: jax.Array | None = None

    def __iter__(self):
        return iter((self.logits, self.cache, self.state, self.pages_read))

    def __getitem__(self, i: int) -> Any:
        return (self.logits, self.cache, self.state, self.pages_read)[i]


@struct.dataclass
class Decoded:
    """What the decode loop returns: ``tokens`` ``[B, max_new_tokens]`` (``PAD_TOKEN`` after a row
    stopped), ``num_generated`` ``[B]``, the final ``cache``, ``read_fraction`` ``[B]`` (pages read /
    pages in use, mean over steps; NaN for a row that stopped at its first token) and the decode
    stage's ``policy_stats``."""

    tokens: jax.Array
    num_generated: jax.Array
    cache: KVCache
    read_fraction: jax.Array
    policy_stats: dict[str, Any]


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


def _attend(dec: Policy, cache: KVCache, shared_state: Any, window, carry: bool, collect: bool, backend: Backend):
    """The decode step's attention of one layer (global layers, indexed by rank with rings).

    By default the cache (and the policy's per-layer state, which can be as large, e.g. H2O's
    scores) rides the layer scan's carry: each layer writes its token in place and attention
    reads the layer from the stack. Scanned as xs/ys they would be copied whole at every step.
    ``carry=False`` scans them as xs/ys (the reference program): the same code, with ``at=None``
    meaning "one layer's arrays"."""
    ps, pos, probs_needed = cache.page_size, cache.next_position, dec.needs_decode_probs

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
        return out[:, None], new, (pages, new_length, out if collect else None)

    return attend


def _layers(params: Params, cache: KVCache, token: jax.Array, layer_state: Any, attend, collect: bool,
            backend: Backend):
    """The layer stack of one decode step: ``(hidden, layers, layer_state, local, pages, new_length, outs)``."""
    pos = cache.next_position
    stack = LayerStack(carry=backend.decode_carry, unroll=backend.decode_unroll, interpret=backend.interpret,
                       weights_by_index=backend.decode_matmul == "pallas", mesh=backend.mesh)
    ring_attend = None if cache.local is None else local_layers.decode_attend(pos, collect)  # local layers: rings
    hidden, (layers, layer_state), local, (pages, new_length, outs), ring = stack(
        params, token[:, None], pos[:, None], (cache.layers, layer_state), cache.local, attend, ring_attend)
    if local is None:
        return hidden, layers, layer_state, local, pages, new_length, outs
    ring_read, ring_outs = ring
    # entries read / entries in use, over every layer (a local layer reads its whole window)
    in_use = new_length.astype(jnp.float32)
    pages = ((pages * in_use).sum(0) + ring_read.sum(0)) / jnp.maximum(in_use.sum(0) + ring_read.sum(0), 1.0)
    outs = local_layers.merge_layers(params.config, outs, ring_outs) if collect else None
    return hidden, layers, layer_state, local, pages[None], new_length, outs


def decode_step(params: Params, policy: Policy, cache: KVCache | PoolCache, token: jax.Array, state: tuple[Any, Any],
                *, backend: Backend | None = None, collect_attention: bool = False,
                active: jax.Array | None = None) -> StepOut:
    """Feed one token per row ``[B]``; ``state`` is the decode stage's ``(layer_state, shared_state)``.

    Returns a `StepOut` (its ``attention`` filled with ``collect_attention``). A `PoolCache`
    (``Options(pool=True)``, experimental; full attention's decode stage only) decodes from the page pool
    (`pooled.decode_step_pool`); there ``active`` ``[B]`` bool (``None``: all) marks the rows that write
    their token (a stopped row writes nothing). The uniform cache ignores ``active``: every row writes."""
    backend = _resolved(backend, params)
    if isinstance(cache, PoolCache):
        logits, cache, state, pages, outs = pooled.decode_step_pool(params, policy, cache, token, state, backend,
                                                                    active, collect_attention)
        return StepOut(logits, cache, state, pages, outs if collect_attention else None)
    dec = policy.stage("decode")
    layer_state, shared_state = state
    attend = _attend(dec, cache, shared_state, window_of(params.config, cache), backend.decode_carry,
                     collect_attention, backend)
    hidden, layers, layer_state, local, pages, new_length, outs = _layers(params, cache, token, layer_state, attend,
                                                                         collect_attention, backend)
    logits = logits_from_hidden(params, hidden[:, 0])
    cache = sharding.constrain_cache(
        cache.replace(layers=layers, local=local, length=new_length[0], next_position=cache.next_position + 1),
        backend.mesh)
    shared_state = dec.decode_update(shared_state, cache, logits)
    state = sharding.constrain_state((layer_state, shared_state), cache, backend.mesh)
    return StepOut(logits, cache, state, pages.mean(0), outs if collect_attention else None)


def hold_stopped_rows(before: Any, after: Any, active: jax.Array) -> Any:
    """The decode stage's shared state ``after`` a step with each stopped row's (``~active`` ``[B]``)
    as it was ``before`` it: a row that stopped decodes no more, so its counters, selection and
    triggers (CHESS's pages, rebuilds, backtracks) stay where its last token left them, as they
    would had it run alone. Shared-state leaves are per row, ``[B, ...]`` (`Policy.decode_init`);
    ``ValueError`` at trace time for one that is not."""
    B = active.shape[0]

    def hold(old: jax.Array, new: jax.Array) -> jax.Array:
        if new.ndim == 0 or new.shape[0] != B:
            raise ValueError(f"decode shared state leaf of shape {tuple(new.shape)}: shared-state leaves must be "
                             f"per row, [B={B}, ...], so a stopped row's can be held")
        return jnp.where(active.reshape((B,) + (1,) * (new.ndim - 1)), new, old)

    return jax.tree.map(hold, before, after)


def _loop_step(params: Params, policy: Policy, cache: KVCache | PoolCache, token: jax.Array, state: Any,
               backend: Backend | None, active: jax.Array):
    """`decode_step` as `decode_loop` runs it: ``(logits, cache, state, pages_read, lost)``. On a page pool
    (experimental) a stopped row (``~active``) writes nothing and ``lost`` ``[B]`` marks the active rows whose
    pool ran out (`pooled.row_overflow`); on the uniform cache ``lost`` is ``None``."""
    if not isinstance(cache, PoolCache):
        return (*decode_step(params, policy, cache, token, state, backend=backend), None)
    out = decode_step(params, policy, cache, token, state, backend=backend, active=active)
    return (*out, active & pooled.row_overflow(out.cache))


def _take_back(cache: KVCache | PoolCache, rewind: jax.Array, active: jax.Array) -> KVCache | PoolCache:
    """``cache`` with ``rewind`` ``[B]`` tokens of the active rows taken back. A stopped row stays put (its cache
    does not grow while the others run on, so extra steps never overflow the capacity): it only steps its
    position back by the one token it was fed. On a pool the lengths go back through the allocator
    (`cache_pooled.rewind_pool`); a stopped row wrote nothing there."""
    back = jnp.where(active, rewind, 1).astype(jnp.int32)
    if isinstance(cache, PoolCache):
        return rewind_pool(cache, jnp.where(active, rewind, 0).astype(jnp.int32), back)
    return cache.replace(length=cache.length - back, next_position=cache.next_position - back)


def decode_loop(params: Params, policy: Policy, ready: Ready, key: jax.Array, decoding: Decoding,
                backend: Backend | None = None) -> Decoded:
    """Sample the first token from ``ready.logits`` then decode until every row stopped.

    A stopped row's token is still fed through the model while other rows run (static shapes),
    but the decode stage's shared state keeps that row as it was (`hold_stopped_rows`).
    Each row keeps its own output count, so a policy may take back a row's last tokens
    (the `Policy.decode_rewind` hook of any decode policy): they are dropped from the output and the cache
    and generated again; the loop then runs up to ``policy.max_rewind_tokens`` extra steps.

    On a page pool (``Options(pool=True)``, experimental) a stopped row writes nothing, a row whose
    pool ran out stops without recording the token of the step that lacked a page (`pooled`), and a rewind
    moves the allocator's lengths back, the pages kept for the regenerated tokens (`cache_pooled.rewind_pool`).
    """
    dec, n_new, stops = policy.stage("decode"), decoding.max_new_tokens, decoding.stop_tokens
    B = ready.logits.shape[0]
    rows, cols = jnp.arange(B), jnp.arange(n_new)
    stops = jnp.asarray(stops if stops else (-2,), jnp.int32)
    key, sub = jax.random.split(key)
    first = sample(ready.logits, sub, decoding.sampling)
    out = jnp.full((B, n_new), PAD_TOKEN, jnp.int32).at[:, 0].set(first)
    done = jnp.isin(first, stops) | (n_new <= 1)
    zero = jnp.zeros((B,), jnp.float32)
    max_steps = n_new - 1 + dec.max_rewind_tokens

    def cond(carry):
        step, done = carry[0], carry[3]
        return (step < max_steps) & ~jnp.all(done)

    def body(carry):
        step, cache, n, done, out, key, state, read, steps = carry
        active = ~done
        logits, cache, after, pages, lost = _loop_step(params, policy, cache, out[rows, n - 1], state, backend, active)
        if lost is not None:  # a row whose pool ran out stops without this step's token
            done, active = done | lost, active & ~lost
        state = (after[0], hold_stopped_rows(state[1], after[1], active))
        key, sub = jax.random.split(key)
        nxt = sample(logits, sub, decoding.sampling)
        out = out.at[rows, jnp.where(active, n, n_new)].set(nxt, mode="drop")
        read, steps, n = read + jnp.where(active, pages, 0.0), steps + active, n + active
        stopped = active & jnp.isin(nxt, stops)
        rewind = dec.decode_rewind(state[1])
        if rewind is not None:
            n = n - jnp.where(active, rewind, 0)
            out = jnp.where((cols[None] >= n[:, None]) & (rewind > 0)[:, None] & active[:, None], PAD_TOKEN, out)
            cache = _take_back(cache, rewind, active)
            stopped = stopped & (rewind == 0)
        done = done | stopped | (n >= n_new)
        return step + 1, cache, n, done, out, key, state, read, steps

    init = (jnp.int32(0), ready.cache, jnp.ones((B,), jnp.int32), done, out, key, ready.state, zero, zero)
    _, cache, _, _, out, _, state, read, steps = jax.lax.while_loop(cond, body, init)
    # a row that stopped at its first token read nothing while decoding: NaN, not 0 (means skip it)
    read_fraction = jnp.where(steps > 0, read / jnp.maximum(steps, 1.0), jnp.nan)
    return Decoded(out, jnp.sum(out != PAD_TOKEN, axis=1), cache, read_fraction, dec.decode_stats(state[1]))
