"""Local (sliding-window) layers of an interleaved model keep a ring buffer of their window.

Gemma 3 interleaves five local layers (window 512) with one global layer. A local layer's query at
position ``p`` sees keys at ``p - W < k <= p`` only, so storing the layer's whole prefix and masking
it would hold 64x more KV than it can use at 32k tokens. Under ``Backend(local_cache="ring")`` (the
default) each local layer keeps ``R >= W`` slots, position ``p`` in slot ``p % R`` (`cache.LocalKV`),
and only the global layers keep the paged cache the policy manages. ``R = W`` plus the tokens the
decode policy may take back (CHESS regenerates up to ``max_backtracks`` pages): a rewind moves
``next_position`` back, and the keys its regenerated tokens need must not have been overwritten.

How each mode reads and writes a ring (the window mask ``k > q - W`` and causality by position do
the rest, so stale slots never count):

* one-pass prefill: the layer's attention is the dense sliding-window attention of the prompt
  (cuDNN's on the GPU, the blocked CPU path: a *static* window), then each row's last ``W`` valid
  tokens go to the ring;
* chunked prefill and `extend` (a question read after compression): the chunk's queries attend to
  the ring and the chunk's own keys together (``[R + T]`` keys), then the chunk's last ``W`` valid
  tokens are written (writing first would overwrite keys the chunk's earlier queries still see);
* decode: the token is written first (it evicts position ``p - R``, outside the window), then the
  query reads the ring.

What policies see (docs/GEMMA3.md): the model's global layers, as a model of its own
(`ModelConfig.global_view` in `Setup.config`; ``layer_index`` is the rank among global layers;
``cache.layers``, observations and decode layer state are stacked over global layers). Their hooks
never run in a local layer, so compressors leave the rings alone and decode-time selection reads the
global layers sparsely; stats count a local layer's live window entries (`window_entries`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from sparsekv_jax import attention
from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import LocalKV
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.transformer import interleaving


def uses_ring(cfg: ModelConfig, backend: Backend) -> bool:
    """Whether a run keeps ring buffers for the local layers (an interleaved model, ``local_cache="ring"``);
    ``ValueError`` for local and global layers not arranged as Gemma 3's (`interleaving`)."""
    if not (cfg.interleaved and backend.local_cache == "ring"):
        return False
    try:
        interleaving(cfg)
    except ValueError as e:
        raise ValueError(f"{e}: use Backend(local_cache='full') for this model") from None
    return True


def policy_config(cfg: ModelConfig, backend: Backend) -> ModelConfig:
    """The config a policy is bound with: the global layers' when the local layers keep rings."""
    return cfg.global_view() if uses_ring(cfg, backend) else cfg


def ring_slots(cfg: ModelConfig, backend: Backend, rewind_tokens: int = 0) -> int | None:
    """Slots of each local layer's ring (the window + ``rewind_tokens``), or ``None`` without rings."""
    return cfg.sliding_window + rewind_tokens if uses_ring(cfg, backend) else None


def ring_write(ring: LocalKV, k: jax.Array, v: jax.Array, positions: jax.Array, valid: jax.Array) -> LocalKV:
    """Write each row's last ``window`` valid tokens of a chunk into one layer's ring.

    ``k``/``v`` ``[B, T, Hkv, D]``, ``positions`` ``[B, T]``, ``valid`` ``[B, T]`` (padding is never
    written: it would evict live keys). Older tokens of the chunk are skipped, so no two writes of
    one call share a slot.
    """
    R = ring.k.shape[-2]
    last = jnp.max(jnp.where(valid, positions, -1), axis=1)  # [B] newest valid position
    write = valid & (positions > (last - ring.window)[:, None])
    slot = jnp.where(write, positions % R, R)  # R: out of range, dropped
    rows = jnp.arange(k.shape[0])[:, None]
    return ring.replace(k=ring.k.at[rows, :, slot].set(k.astype(ring.k.dtype), mode="drop"),
                        v=ring.v.at[rows, :, slot].set(v.astype(ring.v.dtype), mode="drop"),
                        positions=ring.positions.at[rows, slot].set(positions.astype(jnp.int32), mode="drop"))


def ring_attention(q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, valid: jax.Array,
                   ring: LocalKV) -> jax.Array:
    """A chunk's queries ``q`` ``[B, T, Hq, D]`` at ``positions`` ``[B, T]`` against one layer's ring and
    the chunk's own keys ``k``/``v`` ``[B, T, Hkv, D]`` (``valid`` ``[B, T]``), inside the window."""
    B, T = positions.shape
    keys = jnp.concatenate([ring.k, jnp.swapaxes(k, 1, 2).astype(ring.k.dtype)], axis=2)
    values = jnp.concatenate([ring.v, jnp.swapaxes(v, 1, 2).astype(ring.v.dtype)], axis=2)
    key_pos = jnp.concatenate([ring.positions, jnp.where(valid, positions, -1)], axis=1)
    ok = jnp.ones((B, 1, 1, key_pos.shape[1]), bool)
    out = attention.cached_attention(jnp.swapaxes(q, 1, 2), keys, values, positions, key_pos[:, None], ok,
                                     sliding_window=ring.window)
    return jnp.swapaxes(out, 1, 2)


def window_entries(positions: jax.Array, next_position: jax.Array, window: int) -> jax.Array:
    """``[..., B]`` entries of rings ``positions`` ``[..., B, R]`` inside the window of the token at
    ``next_position`` ``[B]`` (what a local layer keeps for it; stale slots past it not counted)."""
    p = next_position[:, None]
    live = (positions >= 0) & (positions < p) & (positions > p - 1 - window)
    return live.sum(-1).astype(jnp.float32)


def prefill_attend(lengths: jax.Array, backend: Backend):
    """The local layers' ``attend`` of a one-pass prefill of right-padded prompts of ``lengths``."""

    def attend(q, k, v, ring, j, hidden):
        B, T = q.shape[:2]
        out = attention.prefill(q, k, v, None, sliding_window=ring.window, backend=backend)
        positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        return out, ring_write(ring, k, v, positions, positions < lengths[:, None]), None

    return attend


def chunk_attend(positions: jax.Array, valid: jax.Array):
    """The local layers' ``attend`` of a chunk at ``positions`` ``[B, T]`` (``valid`` ``[B, T]``) read
    against the rings: chunked prefill and `extend`."""

    def attend(q, k, v, ring, j, hidden):
        out = ring_attention(q, k, v, positions, valid, ring)
        return out, ring_write(ring, k, v, positions, valid), None

    return attend


def decode_attend(position: jax.Array, collect_attention: bool = False):
    """The local layers' ``attend`` of a decode step at ``position`` ``[B]``. Extras: the entries read
    ``[B]`` (the live window) and, with ``collect_attention``, the output ``[B, Hq, D]``."""

    def attend(q, k, v, ring, j, hidden):
        B = q.shape[0]
        ring = ring_write(ring, k, v, position[:, None], jnp.ones((B, 1), bool))
        ok = jnp.ones((B, 1, 1, ring.k.shape[-2]), bool)
        out = attention.cached_attention(jnp.swapaxes(q, 1, 2), ring.k, ring.v, position[:, None],
                                         ring.positions[:, None], ok, sliding_window=ring.window)
        out = jnp.swapaxes(out, 1, 2)
        read = window_entries(ring.positions, position + 1, ring.window)
        return out, ring, (read, out[:, 0] if collect_attention else None)

    return attend


def merge_layers(cfg: ModelConfig, global_part: Any, local_part: Any) -> Any:
    """Stacks over the global and the local layers → one stack in model layer order."""
    g_ids, l_ids = jnp.asarray(cfg.global_layer_ids()), jnp.asarray(cfg.local_layer_ids())

    def merge(g, lo):
        out = jnp.zeros((cfg.num_layers, *g.shape[1:]), g.dtype)
        return out.at[g_ids].set(g).at[l_ids].set(lo.astype(g.dtype))

    return jax.tree.map(merge, global_part, local_part)
