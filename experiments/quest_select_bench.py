"""Quest's page selection alone, per decode step, with two top-k implementations (issue 40: Quest decodes 1.48×
slower than full attention at batch 1 on Qwen2.5-Coder-1.5B's shapes, and the decode kernel's page walk is not
the cause: docs/BENCHMARKS.md, "Page lists split by count in the decode kernel").

What a decode step of ``Quest(0.25)`` adds to full attention, besides reading fewer pages: per layer, the Quest
pages' bounds from the min/max key summaries (``[B, Hkv, G, P, D]`` products), a top-k over the ``P`` page scores
(`policies.common.top_k`: a stable descending ``argsort``, chosen because XLA partitions a sort of a sharded
operand but gathers ``lax.top_k``'s), and the page list. This times, on random summaries of a model's shapes at a
context length, all layers' selections as one program (``lax.scan`` over the layers, as a decode step runs them):

- ``select[argsort]``: `Quest.decode_select` with the sort (an unbound Quest, as on a mesh);
- ``select[lax.top_k]``: the same with `jax.lax.top_k` in place of the sort (traced with
  `policies.common.top_k` swapped; the ids are checked equal first): what a Quest bound off a mesh runs since
  2026-11-28 (`Quest.backend`; end to end in docs/BENCHMARKS.md, `PART=12`);
- ``top_k[argsort]`` / ``top_k[lax.top_k]``: the top-k alone on ``[B, Hkv, P]`` scores, every layer;
- ``bounds``: the selection without its top-k (the scores' sum, so nothing is dead code);
- ``select[split-sign]``, ``select[split-sign, lax.top_k]``, ``bounds[split-sign]``: the same with the bound
  computed as two matrix products, ``relu(q)·max + min(q, 0)·min`` (for each ``d``, ``max(q_d·min_d, q_d·max_d)``
  is ``q_d·max_d`` when ``q_d ≥ 0`` and ``q_d·min_d`` otherwise: the same sum in another order), instead of the
  elementwise ``[G, P, D]`` product and its reduction (`QuestSplitSign`; its page lists are checked equal first).

Variants are interleaved and the whole set repeated (``--repeats``); each number is the median of ``--iters``
calls after a warm-up (`bench.timing.median_time`). Prints a table last and writes ``quest_select.json``.

    python experiments/quest_select_bench.py --out $OUT                  # Qwen2.5-Coder-1.5B and Llama-3.1-8B
    python experiments/quest_select_bench.py --models qwen --batches 1 --length 2048 --iters 3   # a CPU check
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import struct  # noqa: E402

from sparsekv_jax.bench.timing import median_time  # noqa: E402
from sparsekv_jax.cache import LayerKV  # noqa: E402
from sparsekv_jax.policies import common  # noqa: E402
from sparsekv_jax.policies.quest import Quest  # noqa: E402

# name -> (layers, query heads, KV heads, head_dim)
MODELS = {"qwen": ("Qwen2.5-Coder-1.5B", 28, 12, 2, 128), "llama": ("Llama-3.1-8B", 32, 32, 8, 128)}
CACHE_PAGE = 16


def lax_top_k(x: jax.Array, k: int, by_sort: bool = True) -> tuple[jax.Array, jax.Array]:
    """`jax.lax.top_k` with `policies.common.top_k`'s signature (ties: the lower index first in both), whatever
    ``by_sort`` asks."""
    values, ids = jax.lax.top_k(x, k)
    return values, ids.astype(jnp.int32)


@contextlib.contextmanager
def top_k_as(impl: Callable[[jax.Array, int], tuple[jax.Array, jax.Array]] | None) -> Iterator[None]:
    """`policies.common.top_k` replaced by ``impl`` while a program traces (``None``: as shipped)."""
    shipped = common.top_k
    if impl is not None:
        common.top_k = impl
    try:
        yield
    finally:
        common.top_k = shipped


@struct.dataclass
class QuestSplitSign(Quest):
    """Quest with the bound as two matrix products (the experiment's variant; the shipped policy is `Quest`)."""

    def page_bound(self, qg: jax.Array, lo: jax.Array, hi: jax.Array) -> jax.Array:
        hp = jax.lax.Precision.HIGHEST
        pos, neg = jnp.maximum(qg, 0.0), jnp.minimum(qg, 0.0)
        return (jnp.einsum("bhgd,bhpd->bhgp", pos, hi.astype(jnp.float32), precision=hp)
                + jnp.einsum("bhgd,bhpd->bhgp", neg, lo.astype(jnp.float32), precision=hp))


def summaries(key: jax.Array, layers: int, batch: int, kv_heads: int, pages: int, head_dim: int,
              dtype: Any) -> LayerKV:
    """All layers' Quest summaries of random keys: per page the min and max of 16 normal keys' entries (drawn as
    a sorted pair of normals scaled like a page's extremes), a zero bias. K/V themselves are not read."""
    k1, k2 = jax.random.split(key)
    a = jax.random.normal(k1, (layers, batch, kv_heads, pages, head_dim), jnp.float32)
    b = jax.random.normal(k2, a.shape, jnp.float32)
    lo, hi = jnp.minimum(a, b) - 1.0, jnp.maximum(a, b) + 1.0
    empty = jnp.zeros((layers, 1), dtype)
    return LayerKV(k=empty, v=empty, positions=empty, bias=empty, page_min=lo.astype(dtype), page_max=hi.astype(dtype),
                   page_max_bias=jnp.zeros((layers, batch, kv_heads, pages), jnp.float32))


def programs(policy: Quest, kv: LayerKV, q: jax.Array, length: jax.Array) -> dict[str, Callable[[], Any]]:
    """The timed programs (each jitted under its top-k, every layer in one ``lax.scan``); ``policy`` a `Quest`,
    whose `QuestSplitSign` twin gives the split-sign variants."""
    split = QuestSplitSign(policy.budget, policy.page_size, policy.dense_layers, policy.prompt_len)

    def per_layer(fn):
        def step(carry, xs):
            layer_kv, layer_q, index = xs
            return carry, fn(layer_q, layer_kv, index)
        return lambda kv_, q_: jax.lax.scan(step, 0, (kv_, q_, jnp.arange(q_.shape[0])))[1]

    def selecting(pol):
        return lambda layer_q, layer_kv, index: pol.decode_select(layer_q, layer_kv, length, None, None, index,
                                                                   CACHE_PAGE)

    def bounding(pol):  # the bound as decode_select computes it, reduced (no top-k)
        def bounds(layer_q, layer_kv, index):
            B, Hkv, P, D = layer_kv.page_min.shape
            qg = layer_q.reshape(B, Hkv, -1, D).astype(jnp.float32)
            bound = pol.page_bound(qg, layer_kv.page_min, layer_kv.page_max)
            return (bound.max(2) + layer_kv.page_max_bias).sum()
        return bounds

    k = policy.pages_read(policy.prompt_len) - 1
    scores = jax.random.normal(jax.random.key(3), kv.page_max_bias.shape, jnp.float32)
    out: dict[str, Callable[[], Any]] = {}
    for name, impl in (("argsort", None), ("lax.top_k", lax_top_k)):
        with top_k_as(impl):
            fn = jax.jit(per_layer(selecting(policy)))
            fn(kv, q)  # traced (and compiled) while the swap holds
            out[f"select[{name}]"] = (lambda f: lambda: f(kv, q))(fn)
            tk = jax.jit(lambda s: common.top_k(s, k)[1])
            tk(scores)
            out[f"top_k[{name}]"] = (lambda f: lambda: f(scores))(tk)
    bnd = jax.jit(per_layer(bounding(policy)))
    out["bounds"] = lambda: bnd(kv, q)
    for name, impl in (("split-sign", None), ("split-sign, lax.top_k", lax_top_k)):
        with top_k_as(impl):
            fn = jax.jit(per_layer(selecting(split)))
            fn(kv, q)
            out[f"select[{name}]"] = (lambda f: lambda: f(kv, q))(fn)
    bnd_split = jax.jit(per_layer(bounding(split)))
    out["bounds[split-sign]"] = lambda: bnd_split(kv, q)
    return out


def check_same_selection(policy: Quest, kv: LayerKV, q: jax.Array, length: jax.Array) -> None:
    """The two top-k implementations, and the split-sign bound, give the shipped page lists and counts (random
    scores: no ties)."""
    split = QuestSplitSign(policy.budget, policy.page_size, policy.dense_layers, policy.prompt_len)
    lists = {}
    for name, pol, impl in (("argsort", policy, None), ("lax.top_k", policy, lax_top_k),
                            ("split-sign", split, None)):
        with top_k_as(impl):
            ids, counts = jax.jit(lambda kv_, q_, p=pol: p.decode_select(q_[2], jax.tree.map(lambda x: x[2], kv_),
                                                                         length, None, None, jnp.int32(2),
                                                                         CACHE_PAGE))(kv, q)
        lists[name] = (np.asarray(ids), np.asarray(counts))
    ids_a, n_a = lists["argsort"]
    for name in ("lax.top_k", "split-sign"):
        ids_b, n_b = lists[name]
        if not np.array_equal(n_a, n_b):
            raise AssertionError(f"page counts differ between the shipped selection and {name}")
        for row in np.ndindex(n_a.shape):  # the listed entries (past the count the ids are filler)
            if not np.array_equal(np.sort(ids_a[row][: n_a[row]]), np.sort(ids_b[row][: n_b[row]])):
                raise AssertionError(f"page lists differ between the shipped selection and {name} at (row, head) "
                                     f"{row}")


def run(models: list[str], batches: list[int], length: int, budget: float, iters: int, repeats: int,
        dtype: Any) -> list[dict[str, Any]]:
    rows = []
    for m in models:
        label, layers, heads, kv_heads, head_dim = MODELS[m]
        for batch in batches:
            pages = length // CACHE_PAGE
            kv = summaries(jax.random.key(0), layers, batch, kv_heads, pages, head_dim, dtype)
            q = jax.random.normal(jax.random.key(1), (layers, batch, heads, head_dim), jnp.float32).astype(dtype)
            lengths = jnp.full((batch,), length, jnp.int32)
            policy = Quest(budget).replace(prompt_len=length)
            check_same_selection(policy, kv, q, lengths)
            progs = programs(policy, kv, q, lengths)
            times: dict[str, list[float]] = {name: [] for name in progs}
            for _ in range(repeats):  # interleaved: every variant once per repeat
                for name, fn in progs.items():
                    times[name].append(median_time(fn, iters=iters) * 1e6)
            for name, ts in times.items():
                rows.append({"model": label, "batch": batch, "length": length, "layers": layers, "variant": name,
                             "us_per_step": statistics.median(ts), "repeats_us": ts})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| model | batch | variant | µs per step (all layers), median of repeats | repeats |",
             "|---|---:|---|---:|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {r['variant']} | {r['us_per_step']:.1f} | "
                     + ", ".join(f"{t:.1f}" for t in r["repeats_us"]) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="qwen,llama", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--batches", default="1,8", help="comma-separated batch sizes")
    p.add_argument("--length", type=int, default=32768, help="tokens in the cache (a multiple of 16)")
    p.add_argument("--budget", type=float, default=0.25, help="Quest's budget (fraction of the prompt)")
    p.add_argument("--iters", type=int, default=50, help="calls per median")
    p.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every variant")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="the keys' (summaries') dtype")
    p.add_argument("--out", default=None, help="folder for quest_select.json")
    a = p.parse_args(argv)
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    bad = [m for m in models if m not in MODELS]
    if bad or not models:
        p.error(f"--models {a.models!r}: each one of {', '.join(MODELS)}")
    try:
        batches = [int(b) for b in a.batches.split(",")]
    except ValueError:
        p.error(f"--batches {a.batches!r}: comma-separated integers")
    if any(b < 1 for b in batches):
        p.error(f"--batches {a.batches!r}: each >= 1")
    if a.length < 64 or a.length % CACHE_PAGE:
        p.error(f"--length {a.length}: a multiple of {CACHE_PAGE}, at least 64")
    if not 0 < a.budget < 1:
        p.error(f"--budget {a.budget}: a fraction in (0, 1)")
    if a.iters < 1 or a.repeats < 1:
        p.error("--iters and --repeats must be >= 1")
    rows = run(models, batches, a.length, a.budget, a.iters, a.repeats, jnp.dtype(a.dtype))
    meta = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "args": vars(a)}
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "quest_select.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"{meta['device']}, jax {meta['jax']}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
