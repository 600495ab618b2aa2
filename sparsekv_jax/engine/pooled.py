"""Decoding from a page pool: ``Options(pool=True)``, **experimental** (issue 38, docs/PAGE_POOL.md,
migration step 4's first slices: full attention, the compressors whose compress stage writes through
`policies.common.write_entries` with full attention's decode stage, Quest, H2O and CHESS, `run.pool_refusal`).

The prefill writes the pool's identity layout (`prefill.prefill_pool`). A compressor then compresses the
prefill pool's uniform view (`compress_target`: a `policies.common.PoolTarget`, whose `write_entries` writes
a fresh decode pool, each head in pages of its own, sized by the policy: `policy_pages`), and the prefill pool
is dropped; full attention decodes from the prefill pool itself. Then each decode step
(`decode_step_pool`) makes one allocator call for every layer before the layer scan
(`cache_pooled.reserve_token`: a page from the free stack for each head whose last page is full),
and each layer writes its token at its ``(page, offset)`` (`cache_pooled.append_token_pool`) and
attends through its page tables (`attention.decode_pool`: the decode kernel's pool mode, or the jnp
path through `cache_pooled.layer_kv`). The pool rides the layer scan's carry (whatever
``Backend.decode_carry`` says); the step's pages and offsets are the scan's xs.

A decode stage that writes in place (``Policy.writes_in_place``: H2O's running eviction, after its own
compaction) runs `_decode_step_in_place`: the allocator call reserves pages only for the heads its
``decode_appends`` names; the others overwrite the logical slot its ``decode_write`` names, through their
tables, and the step's probabilities at logical slots reach its ``decode_observe``.

CHESS (after full attention's compress stage) lists logical pages from its state (`lists_pages`); its
``decode_update`` reads the pool through the tables (`policies.chess_pool`), and when it takes a page back
(``decode_rewind``) `decode.decode_loop` moves the allocator's lengths back (`cache_pooled.rewind_pool`): the
pages stay held and the regenerated tokens refill the same logical slots, no page popped again.

A stopped row is inactive: it writes nothing more. A pool that runs out sets the allocator's sticky
``overflow`` of the rows concerned (no host round trip in the loop): `decode_loop` stops such a row
without recording the token of the step that lacked a page, and `check_overflow` (called by `generate`,
`Session.decode` and `teacher_force` after their program) raises a `ValueError` naming the pages the run
needs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax import attention
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import LayerKV, layer_view, pages_for
from sparsekv_jax.cache_pooled import (
    PoolCache,
    append_token_pool,
    layer_kv,
    layer_lengths,
    layer_tables,
    reserve_token,
    stack_view,
)
from sparsekv_jax.engine.prefill import window_of
from sparsekv_jax.engine.run import Run, prefill_width
from sparsekv_jax.models.params import Params
from sparsekv_jax.models.transformer import forward, logits_from_hidden
from sparsekv_jax.pallas.validation import is_concrete
from sparsekv_jax.policies.base import Policy
from sparsekv_jax.policies.chess import CHESS
from sparsekv_jax.policies.common import PoolTarget

__all__ = ["check_compressed", "check_overflow", "compress_target", "decode_step_pool", "lists_pages", "pages_needed",
           "policy_pages", "row_overflow"]


def lists_pages(dec: Policy) -> bool:
    """Whether a decode stage on a pool lists the logical pages each step reads (its ``decode_select``): one that
    declares ``selects_pages`` (Quest: read from the layer's summaries through its tables), or `CHESS` (the page
    lists its state keeps, rebuilt by ``decode_update`` from the pool: `policies.chess_pool`). Full attention's
    reads every page in use (its program is built without the hook)."""
    return dec.selects_pages or isinstance(dec, CHESS)


def decode_step_pool(params: Params, policy: Policy, cache: PoolCache, token: jax.Array, state: tuple[Any, Any],
                     backend: Backend, active: jax.Array | None, collect: bool):
    """One decode step on a pool: ``(logits [B, V], cache, state, pages_read [B], outs or None)``, the
    parts of `decode.StepOut`. ``active`` ``[B]`` bool (``None``: every row) marks the rows that write
    their token. The decode stage appends (``decode_write`` is `Dense`'s) and reads every page in use, or
    the logical pages its ``decode_select`` lists from the layer read through its tables
    (`cache_pooled.layer_kv`) and each head's length (``Policy.selects_pages``: Quest), or from its state (`CHESS`,
    whose ``decode_update`` reads the pool through its tables: `policies.chess_pool`; its rewinds are
    `decode.decode_loop`'s, `cache_pooled.rewind_pool`: `lists_pages`); any other decode stage is refused by
    `run.pool_refusal`; a decode stage that writes in place (``Policy.writes_in_place``: H2O) runs
    `_decode_step_in_place`. ``pages_read`` is the layers' mean, as on the uniform cache."""
    B = token.shape[0]
    pos = cache.next_position
    dec = policy.stage("decode")
    if dec.writes_in_place:
        return _decode_step_in_place(params, dec, cache, token, state, backend, active, collect)
    layer_state, shared_state = state
    act = jnp.ones((B,), jnp.bool_) if active is None else active
    cache, page, offset = reserve_token(cache, act)  # [L, B, Hkv] each: the one allocator call of the step
    window = window_of(params.config, cache)

    def attend(q, k, v, layer, idx, hidden):
        (pg, off), pages = layer
        c = append_token_pool(cache.replace(pages=pages), idx, k[:, 0], v[:, 0], pos, pg, off)
        selection = None
        if lists_pages(dec):
            selection = dec.decode_select(q[:, 0], layer_kv(c, idx), layer_lengths(c, idx),
                                          layer_view(layer_state, idx), shared_state, idx, c.page_size)
        out, read = attention.decode_pool(q[:, 0], pos, c, idx, selection, sliding_window=window(idx),
                                          backend=backend)
        return out[:, None], ((pg, off), c.pages), (read, out if collect else None)

    hidden, (_, pages), (reads, outs) = forward(params, token[:, None], pos[:, None], (page, offset), attend,
                                                carried=cache.pages, unroll=backend.decode_unroll,
                                                weights_by_index=backend.decode_matmul == "pallas",
                                                interpret=backend.interpret, mesh=backend.mesh)
    logits = logits_from_hidden(params, hidden[:, 0])
    cache = cache.replace(pages=pages, next_position=pos + 1)
    shared_state = dec.decode_update(shared_state, cache, logits)
    return logits, cache, (layer_state, shared_state), reads.mean(0), outs


def _decode_step_in_place(params: Params, dec: Policy, cache: PoolCache, token: jax.Array, state: tuple[Any, Any],
                          backend: Backend, active: jax.Array | None, collect: bool):
    """`decode_step_pool` for a decode stage that declares ``writes_in_place`` (H2O's running eviction): before the
    layer scan ``dec.decode_appends`` names the heads that append, and the step's one allocator call
    (`reserve_token`) reserves pages for those only; in each layer ``dec.decode_write`` names every head's logical
    slot (on the layer read through its tables with each head's length, `_live_kv`), an appending head writes at
    its reserved ``(page, offset)`` and an overwriting one at its slot mapped through the layer's table
    (``table[slot // ps]``, ``slot % ps``: a page it holds, none reserved; `append_token_pool`'s ``overwrite``),
    and with ``needs_decode_probs`` the step's probabilities at logical slots (`attention.decode_pool`) reach
    ``dec.decode_observe``, as on the uniform path. Per-head lengths are the allocator's: an overwrite leaves a
    head's length as it was. The decode stage's layer state rides the layer scan's carry with the pool."""
    pos = cache.next_position
    layer_state, shared_state = state
    act = jnp.ones((token.shape[0],), jnp.bool_) if active is None else active
    before = cache.lengths  # [L, B, Hkv] each head's length before the step
    appends = dec.decode_appends(layer_state, before)
    cache, page, offset = reserve_token(cache, act[None, :, None] & appends)  # pages for the appending heads only
    window = window_of(params.config, cache)
    N, ps, M = cache.num_pages, cache.page_size, cache.max_pages_per_head
    probs_needed = dec.needs_decode_probs

    def attend(q, k, v, layer, idx, hidden):
        (pg, off, n0, app), (pages, lstate_all) = layer
        c = cache.replace(pages=pages)
        lstate = layer_view(lstate_all, idx)
        slot, _ = dec.decode_write(_live_kv(c, idx, n0), n0, lstate)
        slot = jnp.broadcast_to(slot[:, None] if slot.ndim == 1 else slot, n0.shape).astype(jnp.int32)
        table = layer_tables(c, idx)[0]
        phys = jnp.take_along_axis(table, jnp.clip(slot // ps, 0, M - 1)[..., None], axis=-1)[..., 0]
        # an overwrite stays below the head's length, in a page it holds; a stopped row writes nothing
        phys = jnp.where(act[:, None] & (slot >= 0) & (slot < n0), phys, N)
        c = append_token_pool(c, idx, k[:, 0], v[:, 0], pos, jnp.where(app, pg, phys), jnp.where(app, off, slot % ps),
                              overwrite=~app)
        selection = None
        if dec.selects_pages:
            selection = dec.decode_select(q[:, 0], layer_kv(c, idx), layer_lengths(c, idx), lstate, shared_state,
                                          idx, ps)
        res = attention.decode_pool(q[:, 0], pos, c, idx, selection, sliding_window=window(idx),
                                    return_probs=probs_needed, backend=backend)
        if probs_needed:
            out, read, probs = res
            lstate = dec.decode_observe(lstate, probs, _live_kv(c, idx, layer_lengths(c, idx)))
            lstate_all = jax.tree.map(lambda a, x: a.at[idx].set(x), lstate_all, lstate)
        else:
            out, read = res
        return out[:, None], ((pg, off, n0, app), (c.pages, lstate_all)), (read, out if collect else None)

    hidden, (_, (pages, layer_state)), (reads, outs) = forward(
        params, token[:, None], pos[:, None], (page, offset, before, appends), attend,
        carried=(cache.pages, layer_state), unroll=backend.decode_unroll,
        weights_by_index=backend.decode_matmul == "pallas", interpret=backend.interpret, mesh=backend.mesh)
    logits = logits_from_hidden(params, hidden[:, 0])
    cache = cache.replace(pages=pages, next_position=pos + 1)
    shared_state = dec.decode_update(shared_state, cache, logits)
    return logits, cache, (layer_state, shared_state), reads.mean(0), outs


def _live_kv(cache: PoolCache, layer: int | jax.Array, lengths: jax.Array) -> LayerKV:
    """Layer ``layer`` read through its tables (`cache_pooled.layer_kv`, logical slots) with position -1 at and past
    each head's ``lengths`` ``[B, Hkv]``, as a uniform layer's empty slots (a pool page is not cleared when it is
    opened): what a decode stage's ``decode_write``/``decode_observe`` read on the uniform cache."""
    kv = layer_kv(cache, layer)
    live = jnp.arange(kv.positions.shape[-1]) < lengths[..., None]
    return kv.replace(positions=jnp.where(live, kv.positions, -1))


def compress_target(pool: PoolCache, pool_pages: int) -> PoolTarget:
    """What a compress stage is handed on a page pool: the prefill pool's uniform view (`stack_view`, a
    reshape of the pool's leaves, no copy; row lengths, next positions as the prefill left them) as a
    `policies.common.PoolTarget`, so the policy's `common.write_entries` writes its entries into a fresh
    decode pool of ``pool_pages`` pages (`common.write_entries_pool`) and the prefill pool can be dropped."""
    return PoolTarget(layers=stack_view(pool), length=pool.lengths[0, :, 0], next_position=pool.next_position,
                      local=pool.local, page_size=pool.page_size, pool_pages=pool_pages)


def check_compressed(cache: Any, squeezer: Policy) -> None:
    """At trace time: a pooled compress stage must return a `PoolCache` (its write went through
    `common.write_entries`), else ``TypeError`` naming the policy (`run.pool_refusal` admits only such)."""
    if not isinstance(cache, PoolCache):
        raise TypeError(f"{squeezer.name}'s compress stage declares writes_entries but returned a "
                        f"{type(cache).__name__}, not a PoolCache: its write did not go through "
                        "common.write_entries")


def row_overflow(cache: PoolCache) -> jax.Array:
    """``[B]`` bool: a row whose (layer, row) allocator rows ran out of pages (sticky)."""
    return cache.alloc.overflow.reshape(cache.num_layers, cache.batch).any(0)


def policy_pages(run: Run, heads: int, num_layers: int) -> int | None:
    """The decode pool's size from the policy (docs/PAGE_POOL.md, Sizing): the compress stage's
    `Policy.compressed_pages` for ``run``'s rows, or ``None`` if it does not compress (full attention)."""
    lengths = np.asarray(run.lengths) if is_concrete(run.lengths) else np.full(run.lengths.shape, run.tokens.shape[1])
    return run.policy.stage("compress").compressed_pages(lengths, run.tokens.shape[1], run.extra_tokens,
                                                         run.page_size, num_layers, heads,
                                                         suffix_tokens=run.question_tokens)


def pages_needed(run: Run, heads: int, num_layers: int) -> int:
    """Pages a pool needs for ``run`` to decode every row to ``max_new_tokens`` without a stop (host
    arithmetic). Full attention: ``L·Hkv·Σ_b max(P, pages_for(length_b + q_b + max_new_tokens - 1))``, ``P`` the
    prompt's pages every head holds after the prefill, ``q_b`` the row's suffix length (a `Session.ask` question:
    ``question_tokens``, its widest; the decode writes ``max_new_tokens - 1`` tokens: the last one sampled is
    never fed back). A compressor: its bound, `policy_pages`."""
    bound = policy_pages(run, heads, num_layers)
    if bound is not None:
        return bound
    ps = run.page_size
    P = pages_for(prefill_width(run.tokens.shape[1], run.prefill_chunk), ps)
    rows = np.asarray(run.lengths)
    asked = (np.asarray(run.suffix_lengths) if run.suffix is not None and is_concrete(run.suffix_lengths)
             else np.full(rows.shape, run.question_tokens))
    grown = [max(P, pages_for(int(n) + int(q) + run.decoding.max_new_tokens - 1, ps))
             for n, q in zip(rows, asked, strict=True)]
    return num_layers * heads * sum(grown)


def check_overflow(run: Run, cache: PoolCache) -> None:
    """After a pooled run (on the host): ``ValueError`` if the pool ran out of pages, naming the rows, the
    pool's size and the pages the run needs (`pages_needed`)."""
    over = np.asarray(row_overflow(cache))
    if not over.any():
        return
    need = pages_needed(run, cache.heads, cache.num_layers)
    if policy_pages(run, cache.heads, cache.num_layers) is None:
        how = (f"L·Hkv·Σ_rows max(prompt pages, pages_for(length + suffix + max_new_tokens - 1)) = {cache.num_layers}·"
               f"{cache.heads}·{need // (cache.num_layers * cache.heads)}")
        unset = "today's cache size"
    else:
        how = (f"{run.policy.stage('compress').name}.compressed_pages: the pages every head's kept entries and the "
               f"tokens it decodes can occupy, over {cache.num_layers} layers, {cache.batch} rows and {cache.heads} "
               "KV heads")
        unset = "that bound"
    raise ValueError(f"the page pool ran out: rows {np.nonzero(over)[0].tolist()} needed a page that the pool of "
                     f"pool_pages={cache.num_pages} pages ({cache.page_size} tokens of one layer, row and KV head "
                     f"each) did not have, and stopped early. This run needs up to {need} pages ({how}): pass "
                     f"pool_pages >= {need}, or leave it unset ({unset})")
