"""Held-out quality of a stack of SAEs: FVU, L0 and dead fraction per layer, on keys and queries.

Run over text the SAEs never saw (the held-out documents of `sparsekv_jax.sae.data`), cut into
rows like the training rows, with the same first positions dropped. Keys are what the SAEs were
trained on; queries are what S³ also encodes with them (the shared codebook of the paper's A.3),
so their FVU measures that distribution shift.

* ``fvu`` — ``Σ‖x − x̂‖² / Σ‖x − x̄‖²`` over all held-out vectors of the layer;
* ``l0`` — mean number of non-zero activations per vector (``k`` unless fewer are positive);
* ``dead_fraction`` — latents that never fire on any held-out key.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.models.params import Params
from sparsekv_jax.sae.keys import projections
from sparsekv_jax.sae.model import TopKSAE, decode, encode

# A chunk's encoder temporaries: the fp32 pre-activations ``[L, chunk, width]`` and about as much again
# for the top-k (an H200 OOM of the unchunked evaluation asked 97.13 GiB for 48 GiB of query pre-activations;
# XLA's CPU top-k, memory_analysis: ~3x). `default_chunk` keeps ``4 x`` that under `EVAL_CHUNK_BYTES`.
EVAL_CHUNK_BYTES = 1 << 30
_TEMP_FACTOR = 4


def default_chunk(n_layers: int, width: int, budget_bytes: int = EVAL_CHUNK_BYTES) -> int:
    """Vectors per layer encoded at once by `evaluate`: the most whose ``[n_layers, chunk, width]`` fp32
    pre-activations, times a factor for the top-k's temporaries, fit ``budget_bytes`` (at least 1).
    Qwen2.5-Coder-1.5B's paper SAEs (4 layers, width 16,384): 1,024 vectors (~0.5 GiB of scores and top-k)."""
    return max(1, budget_bytes // (n_layers * width * 4 * _TEMP_FACTOR))


def _encoded_stats(sae: TopKSAE, x: jax.Array, w: jax.Array, chunk: int, method: str,
                   fired: bool) -> dict[str, jax.Array]:
    """``sse`` [L] and ``active`` [L] (weighted by ``w`` [N]) of ``x`` [L, N, D] through the SAEs, and with
    ``fired`` the latents ``[L, width]`` active on a vector of weight > 0: ``chunk`` vectors per layer at a
    time (`lax.scan`; the last chunk padded with zero vectors of weight 0), so the ``[L, chunk, width]``
    scores are the largest temporaries whatever N."""
    L, N, D = x.shape
    c = min(chunk, N)
    n_chunks = -(-N // c)
    pad = n_chunks * c - N
    xs = jnp.pad(x, ((0, 0), (0, pad), (0, 0))).reshape(L, n_chunks, c, D).swapaxes(0, 1)
    ws = jnp.pad(w, (0, pad)).reshape(n_chunks, c)

    def body(acc, xw):
        xc, wc = xw  # [L, c, D], [c]
        ids, acts = encode(sae, xc, method=method)
        err = jnp.sum(jnp.square(xc - decode(sae, ids, acts)), axis=-1)
        new = {"sse": acc["sse"] + err @ wc,
               "active": acc["active"] + jnp.sum(acts > 0, axis=-1).astype(jnp.float32) @ wc}
        if fired:
            hits = (acts > 0) & (wc[None, :, None] > 0)
            new["fired"] = jax.vmap(lambda f, i, h: f.at[i.reshape(-1)].max(h.reshape(-1)))(acc["fired"], ids, hits)
        return new, None

    init = {"sse": jnp.zeros((L,), jnp.float32), "active": jnp.zeros((L,), jnp.float32)}
    if fired:
        init["fired"] = jnp.zeros((L, sae.width), bool)
    return jax.lax.scan(body, init, (xs, ws))[0]


@partial(jax.jit, static_argnames=("layers", "drop_first", "method", "attention", "chunk"))
def _batch_stats(sae: TopKSAE, params: Params, tokens: jax.Array, weight: jax.Array, layers: tuple[int, ...],
                 drop_first: int, method: str, attention: str, chunk: int) -> dict[str, jax.Array]:
    keys, queries = projections(params, tokens, layers, queries=True, attention=attention)
    out = {}
    for name, v in (("k", keys), ("q", queries)):
        v = v[:, :, drop_first:]  # [L, B, T', H, D]
        L, B, T, H, D = v.shape
        x = v.reshape(L, B * T * H, D)
        w = jnp.repeat(weight, T * H)  # padded rows weigh 0
        out[name] = {**batch_moments(x, w), **_encoded_stats(sae, x, w, chunk, method, fired=name == "k")}
    return out


def batch_moments(x: jax.Array, w: jax.Array) -> dict[str, jax.Array]:
    """``n``, per-layer ``mean`` ``[L, D]`` and centred sum of squares ``m2`` ``[L]`` of ``x`` ``[L, N, D]``
    weighted by ``w`` ``[N]`` (of which some are > 0). Centred within the batch, not a sum of squares minus a
    squared sum, whose difference cancels in float32 where a channel's mean is large against its spread (real
    keys); batches are combined in float64 by `merge_moments`."""
    n = jnp.sum(w)
    mean = jnp.einsum("n,lnd->ld", w, x) / n
    m2 = jnp.einsum("n,ln->l", w, jnp.sum(jnp.square(x - mean[:, None]), axis=-1))
    return {"n": n, "mean": mean, "m2": m2}


def merge_moments(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """`batch_moments` of two disjoint sets combined (Chan, Golub and LeVeque's pairwise update, float64):
    ``M2 = M2_a + M2_b + |mean_b - mean_a|² n_a n_b / n``."""
    n_a, n_b = np.float64(a["n"]), np.float64(b["n"])
    delta = np.asarray(b["mean"], np.float64) - np.asarray(a["mean"], np.float64)
    n = n_a + n_b
    return {"n": n, "mean": a["mean"] + delta * n_b / n,
            "m2": np.asarray(a["m2"], np.float64) + b["m2"] + np.sum(np.square(delta), axis=-1) * n_a * n_b / n}


def evaluate(sae: TopKSAE, params: Params, rows: np.ndarray, layers: tuple[int, ...], *, drop_first: int,
             batch_rows: int = 8, method: str = "auto", attention: str = "xla",
             chunk: int | None = None) -> list[dict[str, Any]]:
    """Per-layer held-out metrics of the stacked ``sae`` (one per entry of ``layers``) on token ``rows`` ``[N, T]``.

    ``batch_rows`` rows go through the model at once; their keys and queries are encoded ``chunk``
    vectors per layer at a time (default `default_chunk`: about 1 GiB of encoder temporaries), so
    memory does not grow with rows, heads or sequence length beyond the model's forward.

    Returns one dict per layer: ``layer``, ``fvu``, ``l0``, ``dead_fraction``, ``fvu_queries``,
    ``l0_queries``, ``vectors`` (held-out keys), ``vectors_queries``.
    """
    if sae.stack_shape != (len(layers),):
        raise ValueError(f"SAE stack {sae.stack_shape} does not match layers {layers}")
    if batch_rows < 1:
        raise ValueError(f"batch_rows={batch_rows} must be >= 1")
    chunk = default_chunk(len(layers), sae.width) if chunk is None else chunk
    if chunk < 1:
        raise ValueError(f"chunk={chunk} must be >= 1 (vectors per layer encoded at once)")
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] <= drop_first:
        raise ValueError(f"rows of shape {rows.shape} leave nothing after dropping {drop_first} positions")
    acc: dict[str, dict[str, np.ndarray]] = {}
    fired = np.zeros((len(layers), sae.width), bool)
    for start in range(0, len(rows), batch_rows):
        part = rows[start:start + batch_rows]
        weight = np.zeros(batch_rows, np.float32)
        weight[: len(part)] = 1
        if len(part) < batch_rows:  # keep one compiled shape: pad with copies that weigh 0
            part = np.concatenate([part, np.repeat(part[:1], batch_rows - len(part), axis=0)])
        stats = jax.device_get(_batch_stats(sae, params, jnp.asarray(part), jnp.asarray(weight), layers,
                                            drop_first, method, attention, chunk))
        fired |= stats["k"].pop("fired")
        for name, s in stats.items():
            s = {key: np.asarray(value, np.float64) for key, value in s.items()}
            a = acc.setdefault(name, {})
            if a:
                a.update(merge_moments(a, s), sse=a["sse"] + s["sse"], active=a["active"] + s["active"])
            else:
                a.update(s)
    out = []
    for i, layer in enumerate(layers):
        rec: dict[str, Any] = {"layer": int(layer)}
        for name, suffix in (("k", ""), ("q", "_queries")):
            a = acc[name]
            n = float(a["n"])
            rec["fvu" + suffix] = float(a["sse"][i] / max(a["m2"][i], 1e-30))
            rec["l0" + suffix] = float(a["active"][i] / n)
            rec["vectors" + suffix] = int(round(n))
        rec["dead_fraction"] = float(1 - fired[i].mean())
        out.append(rec)
    return out
