"""S³'s inverted index: feature id → context positions, as contiguous int32 arrays (CSR).

The streaming scan hands over one chunk at a time, so the index is *segmented* the way a Lucene
index is: each chunk is a segment with its own CSR (postings sorted by feature, then position;
``offsets[f]:offsets[f+1]`` are feature f's positions), built on the device by one sort per
chunk (`chunk_postings`) and copied into preallocated host arrays (`SegmentedIndex`). A feature's
postings are the concatenation of its runs in every segment (chunks are in position order, so
the result is sorted). Nothing is merged on the critical path: scoring reads the segments
directly (`sparsekv_jax.retrieval.scoring`); `SegmentedIndex.merged` builds the single CSR of a
layer for inspection (one stable sort of all postings).

Layout of one `SegmentedIndex` (``n`` target layers, ``B`` rows, ``S`` segments of ``P = C·k``
slots, ``W`` features): ``postings [n, B, S, P]`` (the first ``counts[n, B, s].sum()`` slots of a
segment are used) and ``counts [n, B, S, W]``.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


def chunk_postings(ids: jax.Array, acts: jax.Array, positions: jax.Array, limit: jax.Array,
                   width: int) -> tuple[jax.Array, jax.Array]:
    """One chunk's CSR segment per (layer, row), on the device.

    ``ids``/``acts`` ``[n, B, C, k]`` token features, ``positions`` ``[B, C]`` their context
    positions, ``limit`` ``[B]``: positions ``>= limit`` (padding, the question) and slots of
    activation 0 are not indexed. Returns ``postings [n, B, C·k]`` (positions sorted by feature,
    then position; unused slots at the end hold ``-1``) and ``counts [n, B, width]`` int32.
    """
    n, B, C, k = ids.shape
    valid = (acts > 0) & (positions < limit[:, None])[None, :, :, None]
    feat = jnp.where(valid, ids, width).reshape(n, B, C * k)  # `width` sorts after every feature
    pos = jnp.broadcast_to(positions[None, :, :, None], ids.shape).reshape(n, B, C * k).astype(jnp.int32)
    # entries are in (token, slot) order, i.e. by position: a stable sort by feature keeps that
    feat, pos = jax.lax.sort((feat, pos), dimension=-1, num_keys=1, is_stable=True)
    counts = jax.vmap(jax.vmap(lambda f: jnp.bincount(f, length=width + 1)))(feat)[..., :width]
    return jnp.where(feat < width, pos, -1), counts.astype(jnp.int32)


@dataclasses.dataclass
class SegmentedIndex:
    """Host-side inverted index of ``B`` rows over ``n`` target layers (see the module docstring).

    ``lengths`` ``[B]``: indexed context length of each row (positions ``0 .. lengths[b]-1``).
    """

    postings: np.ndarray  # [n, B, S, P] int32
    counts: np.ndarray  # [n, B, S, W] int32
    lengths: np.ndarray  # [B] int32
    chunk: int

    @classmethod
    def allocate(cls, n: int, batch: int, segments: int, chunk: int, k: int, width: int,
                 lengths: np.ndarray) -> SegmentedIndex:
        """Empty arrays for ``segments`` chunks of ``chunk`` tokens (filled by `put`)."""
        return cls(postings=np.full((n, batch, segments, chunk * k), -1, np.int32),
                   counts=np.zeros((n, batch, segments, width), np.int32),
                   lengths=np.asarray(lengths, np.int32), chunk=chunk)

    def put(self, segment: int, postings: np.ndarray, counts: np.ndarray) -> None:
        """Copy one chunk's `chunk_postings` output into segment ``segment`` (a copy: the device
        buffers can be freed)."""
        self.postings[:, :, segment] = postings
        self.counts[:, :, segment] = counts

    @property
    def width(self) -> int:
        return self.counts.shape[-1]

    @property
    def num_segments(self) -> int:
        return self.counts.shape[2]

    def df(self) -> np.ndarray:
        """``[n, B, W]`` document frequency: positions at which each feature is active."""
        return self.counts.sum(2)

    def offsets(self) -> np.ndarray:
        """``[n, B, S, W + 1]`` int64 segment-local CSR offsets."""
        c = self.counts.astype(np.int64)
        return np.concatenate([np.zeros((*c.shape[:-1], 1), np.int64), np.cumsum(c, -1)], -1)

    def feature_postings(self, layer: int, row: int, feature: int) -> np.ndarray:
        """Sorted positions of ``feature`` in target layer ``layer`` (index into the stack) of ``row``."""
        off = self.offsets()[layer, row]
        parts = [self.postings[layer, row, s, off[s, feature]:off[s, feature + 1]] for s in range(self.num_segments)]
        return np.concatenate(parts)

    def merged(self, layer: int, row: int) -> tuple[np.ndarray, np.ndarray]:
        """The single CSR ``(offsets [W+1] int64, postings int32)`` of one layer and row."""
        off = self.offsets()[layer, row]
        seg, feat = [], []
        for s in range(self.num_segments):
            used = int(off[s, -1])
            seg.append(self.postings[layer, row, s, :used])
            feat.append(np.repeat(np.arange(self.width, dtype=np.int32), self.counts[layer, row, s]))
        postings, feats = np.concatenate(seg), np.concatenate(feat)
        order = np.argsort(feats, kind="stable")  # segments are in position order: stays sorted
        total = self.df()[layer, row].astype(np.int64)
        return np.concatenate([[0], np.cumsum(total)]), postings[order]

    def nbytes(self) -> int:
        return int(self.postings.nbytes + self.counts.nbytes)
