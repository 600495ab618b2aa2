"""CHESS's reconstruction (`sparsekv_jax.policies.chess`, module doc "Reconstruction"): the decode
state that accumulates each generated page's entropy and varentropy, the uncertainty (or interval)
trigger that rebuilds the selection, and the backtracking that takes an uncertain page back to be
generated again (``rewind``), with the stats `CHESS.decode_stats` reports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from sparsekv_jax.cache import KVCache
from sparsekv_jax.policies.chess_select import forced_pages, used_pages
from sparsekv_jax.policies.common import entropy_stats

if TYPE_CHECKING:
    from sparsekv_jax.policies.chess import CHESS


def uncertain(mean_entropy: jax.Array, varentropy: jax.Array, entropy_threshold: Any, varentropy_threshold: Any,
              trigger_on: str) -> jax.Array:
    """``[B]`` bool: a page is uncertain when its mean entropy and its varentropy are strictly
    above their thresholds, ``"both"`` of them or ``"either"``."""
    high_h, high_v = mean_entropy > entropy_threshold, varentropy > varentropy_threshold
    return (high_h & high_v) if trigger_on == "both" else (high_h | high_v)


def init_state(pol: CHESS, cache: KVCache) -> dict[str, jax.Array]:
    """`CHESS.decode_init`'s shared state: the first selection (made for the prompt's end), its page
    lists, and the trigger's counters, all zero."""
    B = cache.batch
    selected = pol.select_pages(cache, cache.length)
    ids, counts = pol._page_list(selected, cache.length + 1, cache)
    # distinct buffers (a donated state may not hold one array twice)
    shared = {"selected": selected, "ids": ids, "counts": counts, "used": used_pages(pol, cache.length + 1),
              **{k: jnp.zeros((B,), jnp.float32) for k in ("ent_shift", "ent_sum", "ent_sq")},
              **{k: jnp.zeros((B,), jnp.int32) for k in ("in_page", "pages", "reselections", "backtracks",
                                                         "changed_backtracks", "rewind")},
              # the page's greedy tokens, and those of the page last taken back (compared once
              # its regeneration completes: `pending`)
              **{k: jnp.zeros((B, pol.page_size), jnp.int32) for k in ("page_tokens", "replaced")},
              "pending": jnp.zeros((B,), bool)}
    return shared


def update_state(pol: CHESS, shared_state: Any, cache: KVCache, logits: jax.Array) -> Any:
    """`CHESS.decode_update`: the step's entropy into its page's statistics; on a completed page, the
    trigger, the rebuilt selection (and the page taken back, ``rewind``) and the page lists."""
    st = dict(shared_state)
    h = entropy_stats(logits)
    slot = jnp.arange(pol.page_size)[None] == st["in_page"][:, None]  # [B, ps] this token's place
    st["page_tokens"] = jnp.where(slot, jnp.argmax(logits, axis=-1)[:, None].astype(jnp.int32),
                                  st["page_tokens"])
    # sums of the entropies less the page's first one: the varentropy is the difference of two
    # nearly equal sums otherwise (entropies of ~4 that vary by 1e-3 lose it all in fp32, and two
    # programs rounding differently would then disagree on whether it is above 0)
    st["ent_shift"] = jnp.where(st["in_page"] == 0, h, st["ent_shift"])
    d = h - st["ent_shift"]
    st["ent_sum"] = st["ent_sum"] + d
    st["ent_sq"] = st["ent_sq"] + d * d
    st["in_page"] = st["in_page"] + 1
    page_done = st["in_page"] >= pol.page_size
    st["pages"] = st["pages"] + page_done
    n = jnp.maximum(st["in_page"], 1).astype(jnp.float32)
    mean_d = st["ent_sum"] / n
    mean = st["ent_shift"] + mean_d
    varent = jnp.maximum(st["ent_sq"] / n - mean_d * mean_d, 0.0)
    if pol.trigger == "uncertainty":
        fire = page_done & uncertain(mean, varent, pol.entropy_threshold, pol.varentropy_threshold,
                                     pol.trigger_on)
        back = fire & (st["backtracks"] < pol.max_backtracks) if pol.regenerate else jnp.zeros_like(fire)
    else:
        fire = page_done & (st["pages"] % pol.interval == 0)
        back = jnp.zeros_like(fire)
    rewind = jnp.where(back, pol.page_size, 0).astype(jnp.int32)
    length = cache.length - rewind  # what the cache holds once the page is taken back
    st["reselections"] = st["reselections"] + fire
    st["backtracks"] = st["backtracks"] + back
    st["rewind"] = rewind
    # a regenerated page that completes: did it come out unlike the one it replaced?
    differs = (st["page_tokens"] != st["replaced"]).any(-1)
    st["changed_backtracks"] = st["changed_backtracks"] + (page_done & st["pending"] & differs)
    st["pending"] = jnp.where(page_done, back, st["pending"])
    st["replaced"] = jnp.where(back[:, None], st["page_tokens"], st["replaced"])
    for key in ("ent_sum", "ent_sq", "in_page"):
        st[key] = jnp.where(page_done, jnp.zeros_like(st[key]), st[key])
    # The page list is a function of the selection and of the pages in use (sinks and window):
    # rebuilt only when one of them changed for some row (a page starts, a rebuild, a rewind),
    # not every step (its sort and scatter cost ~0.3 ms at 32k x 11 on an H100, 4% of a step).
    # The selection is rebuilt only when some row fired (it reads every key); that cond sits
    # inside the first, so a step inside a page runs one conditional, not two (each costs the
    # GPU a round trip of its predicate to the host).
    used = used_pages(pol, length + 1)
    changed = fire.any() | (used != st["used"]).any()

    def rebuild():
        # the anchor is the window as it stands, the uncertain page included (module doc). A row
        # taking its page back keeps only the pages that stay, plus the window of the context it
        # regenerates from, read until the next rebuild (as `select_pages` keeps its window)
        P = st["selected"].shape[1]
        stays = jnp.arange(P)[None] < used_pages(pol, length)[:, None]
        return (pol.select_pages(cache, cache.length) & stays) | (forced_pages(pol, length, P) & back[:, None])

    def refresh():
        rebuilt = jax.lax.cond(fire.any(), rebuild, lambda: st["selected"])
        selected = jnp.where(fire[:, None], rebuilt, st["selected"])
        return (selected, *pol._page_list(selected, length + 1, cache))

    st["selected"], st["ids"], st["counts"] = jax.lax.cond(
        changed, refresh, lambda: (st["selected"], st["ids"], st["counts"]))
    st["used"] = used
    return st
