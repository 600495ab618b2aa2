"""Key vectors streamed from the model through a device-resident shuffle buffer.

Nothing is dumped to disk: each chunk of token rows goes through one forward pass
(`sparsekv_jax.sae.keys.projections`), its first ``drop_first`` positions per row (attention
sinks: position 0's key is an outlier, e.g. norm 4 against a median of 17 in SmolLM2's layer 12)
are dropped, and every remaining (token, KV head) key becomes one training vector per layer.

Keys of neighbouring tokens are correlated, so batches are drawn from a shuffle buffer of
``capacity`` vectors per layer (tf.data's scheme): each step draws ``batch`` distinct random
slots and refills exactly those slots with the next ``batch`` vectors of the current chunk. Every
streamed vector is used once, in an order decorrelated over ``capacity`` vectors. The buffer, the
chunk being consumed and the RNG key are one pytree (`ShuffleBuffer`), checkpointed with the SAEs,
so a resumed run draws the same batches.
"""

from __future__ import annotations

from functools import partial

import jax
from flax import struct

from sparsekv_jax.models.params import Params
from sparsekv_jax.sae.keys import projections


@struct.dataclass
class ShuffleBuffer:
    """``data`` ``[L, capacity, D]``, ``chunk`` ``[L, V, D]`` (the chunk being consumed), ``key`` (raw uint32)."""

    data: jax.Array
    chunk: jax.Array
    key: jax.Array


@partial(jax.jit, static_argnames=("layers", "drop_first", "attention"))
def chunk_vectors(params: Params, tokens: jax.Array, layers: tuple[int, ...], drop_first: int,
                  attention: str = "xla") -> jax.Array:
    """Training vectors ``[L, B * (T - drop_first) * Hkv, D]`` of the token rows ``[B, T]``."""
    keys, _ = projections(params, tokens, layers, attention=attention)
    keys = keys[:, :, drop_first:]
    return keys.reshape(len(layers), -1, keys.shape[-1])


def draw(buf: ShuffleBuffer, cursor: jax.Array, batch: int) -> tuple[jax.Array, ShuffleBuffer]:
    """``batch`` vectors per layer from distinct random slots, refilled from ``chunk[:, cursor:cursor+batch]``."""
    capacity = buf.data.shape[1]
    key, sub = jax.random.split(buf.key)
    slots = jax.random.choice(sub, capacity, (batch,), replace=False)
    x = buf.data[:, slots]
    fresh = jax.lax.dynamic_slice_in_dim(buf.chunk, cursor, batch, axis=1)
    return x, buf.replace(data=buf.data.at[:, slots].set(fresh), key=key)
