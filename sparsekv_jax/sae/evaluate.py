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


@partial(jax.jit, static_argnames=("layers", "drop_first", "method", "attention"))
def _batch_stats(sae: TopKSAE, params: Params, tokens: jax.Array, weight: jax.Array, layers: tuple[int, ...],
                 drop_first: int, method: str, attention: str) -> dict[str, jax.Array]:
    keys, queries = projections(params, tokens, layers, queries=True, attention=attention)
    out = {}
    for name, v in (("k", keys), ("q", queries)):
        v = v[:, :, drop_first:]  # [L, B, T', H, D]
        L, B, T, H, D = v.shape
        x = v.reshape(L, B * T * H, D)
        w = jnp.repeat(weight, T * H)  # padded rows weigh 0
        ids, acts = encode(sae, x, method=method)
        err = jnp.sum(jnp.square(x - decode(sae, ids, acts)), axis=-1)
        out[name] = {
            "sse": jnp.sum(err * w, axis=-1), "sum": jnp.einsum("n,lnd->ld", w, x),
            "sumsq": jnp.einsum("n,ln->l", w, jnp.sum(x * x, axis=-1)), "n": jnp.sum(w),
            "active": jnp.einsum("n,ln->l", w, jnp.sum(acts > 0, axis=-1).astype(jnp.float32)),
        }
        if name == "k":
            hits = (acts > 0) & (w[None, :, None] > 0)
            out[name]["fired"] = jax.vmap(lambda i, h: jnp.zeros((sae.width,), bool).at[i.reshape(-1)].max(
                h.reshape(-1)))(ids, hits)
    return out


def evaluate(sae: TopKSAE, params: Params, rows: np.ndarray, layers: tuple[int, ...], *, drop_first: int,
             batch_rows: int = 8, method: str = "auto", attention: str = "xla") -> list[dict[str, Any]]:
    """Per-layer held-out metrics of the stacked ``sae`` (one per entry of ``layers``) on token ``rows`` ``[N, T]``.

    Returns one dict per layer: ``layer``, ``fvu``, ``l0``, ``dead_fraction``, ``fvu_queries``,
    ``l0_queries``, ``vectors`` (held-out keys), ``vectors_queries``.
    """
    if sae.stack_shape != (len(layers),):
        raise ValueError(f"SAE stack {sae.stack_shape} does not match layers {layers}")
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
                                            drop_first, method, attention))
        fired |= stats["k"].pop("fired")
        for name, s in stats.items():
            a = acc.setdefault(name, {})
            for key, value in s.items():
                a[key] = a.get(key, 0) + np.asarray(value, np.float64)
    out = []
    for i, layer in enumerate(layers):
        rec: dict[str, Any] = {"layer": int(layer)}
        for name, suffix in (("k", ""), ("q", "_queries")):
            a = acc[name]
            n = float(a["n"])
            var = a["sumsq"][i] - np.sum(np.square(a["sum"][i])) / n
            rec["fvu" + suffix] = float(a["sse"][i] / max(var, 1e-30))
            rec["l0" + suffix] = float(a["active"][i] / n)
            rec["vectors" + suffix] = int(round(n))
        rec["dead_fraction"] = float(1 - fired[i].mean())
        out.append(rec)
    return out
