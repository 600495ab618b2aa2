"""After the prefill: the compress stage makes a new, smaller cache; then the suffix (the question,
when it is read after compression) and the decode stage's starting state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax import local_layers, sharding
from sparsekv_jax.cache import KVCache
from sparsekv_jax.cache_pooled import PoolCache
from sparsekv_jax.engine import pooled
from sparsekv_jax.engine.prefill import Prefilled, extend, prefill_run
from sparsekv_jax.engine.run import Run, compressed_size
from sparsekv_jax.models.params import Params
from sparsekv_jax.policies.base import Prompt


@struct.dataclass
class Compressed:
    """The compressed context: ``logits`` ``[B, V]`` at the prompt's last token, the ``cache`` the
    compress stage left (the prefill cache itself when it keeps everything), the decode stage's
    ``observations`` of the prefill (``None`` if it has none) and ``stats``
    (``kv_stored_fraction`` [B], ``prefill_block_fraction``)."""

    logits: jax.Array
    cache: KVCache
    observations: Any
    stats: dict[str, Any]


@struct.dataclass
class Ready:
    """Where the decode loop starts: ``logits`` ``[B, V]`` of the last token read, the ``cache``,
    the decode stage's ``state`` ``(layer_state, shared_state)`` and the ``stats`` so far."""

    logits: jax.Array
    cache: KVCache
    state: Any
    stats: dict[str, Any]


def stored_entries(cache: KVCache) -> tuple[jax.Array, int]:
    """``([B] live KV entries per row summed over layers and KV heads, the number of (layer, head)
    pairs summed)``: their ratio is the row's mean (holes not counted). A local layer's ring counts
    the entries inside the window of the next token (`local_layers`), once per layer. Integer sums,
    so a full cache's fraction of the prompt is exactly 1 (a float mean came out 1.0000001). A `PoolCache`
    (``Options(pool=True)``, experimental) holds no holes: its heads' lengths summed."""
    if isinstance(cache, PoolCache):
        return cache.lengths.sum((0, 2), dtype=jnp.int32), cache.num_layers * cache.heads
    live = (cache.layers.positions >= 0) & (jnp.arange(cache.capacity) < cache.length[None, :, None, None])
    L, _, H = live.shape[:3]
    total, pairs = live.sum((0, 2, 3), dtype=jnp.int32), L * H
    if cache.local is None:
        return total, pairs
    ring = local_layers.window_entries(cache.local.positions, cache.next_position, cache.local.window)  # [Ll, B]
    # a ring's count is per layer (its heads hold the same window): weigh it as H heads
    return total + H * ring.sum(0).astype(jnp.int32), pairs + H * ring.shape[0]


def compress(params: Params, run: Run, prefilled: Prefilled) -> Compressed:
    """The compress stage of ``run`` on ``prefilled`` (from `prefill_run` or `share_prefill`): a new
    cache sized for the prompt's kept entries plus ``run.extra_tokens`` (the prefill cache is left as
    it is). ``kv_stored_fraction`` is against the user's prompt lengths. On a page pool (``Options(pool=True)``,
    experimental) the policy compresses the prefill pool's uniform view and its write makes a fresh decode
    pool of ``run.pool_pages`` pages, each head in its own pages (`pooled.compress_target`)."""
    del params  # the compress stages read the cache and their observations only
    squeezer = run.policy.stage("compress")
    cache = prefilled.cache
    compressed = compressed_size(run)
    if compressed is not None:
        prompt = Prompt(tokens=run.tokens, lengths=run.lengths, question_start=run.question_start, offset=0)
        if isinstance(cache, PoolCache):  # into a fresh decode pool (`pooled.compress_target`)
            cache = pooled.compress_target(cache, run.pool_pages)
        cache = squeezer.compress(cache, prefilled.observations.get("compress"), compressed, prompt)
        if run.pool:
            pooled.check_compressed(cache, squeezer)
        cache = sharding.constrain_cache(cache, run.backend.mesh)
    total, pairs = stored_entries(cache)
    stored = total.astype(jnp.float32) / (pairs * run.prompt_lengths).astype(jnp.float32)
    stats = {"kv_stored_fraction": stored, "prefill_block_fraction": prefilled.block_fraction}
    return Compressed(prefilled.logits, cache, prefilled.observations.get("decode"), stats)


def begin(params: Params, run: Run, compressed: Compressed, suffix: jax.Array | None = None,
          suffix_lengths: jax.Array | None = None) -> Ready:
    """Read ``suffix`` ``[B, Tq]`` (``suffix_lengths`` valid; none: nothing to read) into the
    compressed cache and set up the decode stage's state: where `decode_loop` starts. ``compressed``
    is left as it is, so several suffixes (questions) can each begin from it. On a page pool
    (``Options(pool=True)``, experimental) the suffix grows each head from the pool's free pages and is written
    after the entries that head kept (`prefill.extend_pool`)."""
    logits, cache = compressed.logits, compressed.cache
    if suffix is not None:
        logits, cache = extend(params, cache, suffix, suffix_lengths)
    state = run.policy.stage("decode").decode_init(cache, compressed.observations)
    state = sharding.constrain_state(state, cache, run.backend.mesh)
    return Ready(logits, cache, state, compressed.stats)


def prepare(params: Params, run: Run) -> Ready:
    """Prefill, compress, read the run's suffix (if any) and set up the decode state: the part of
    `generate` before the decode loop (traceable: call it under `jax.jit`)."""
    return begin(params, run, compress(params, run, prefill_run(params, run)), run.suffix, run.suffix_lengths)
