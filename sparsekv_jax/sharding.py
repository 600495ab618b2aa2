"""Running on several devices with JAX's own SPMD: a ``data`` × ``model`` mesh.

One `jax.sharding.Mesh` with two axes: ``data`` splits the batch, ``model`` splits attention by
heads, the MLP by its hidden units and the embeddings and LM head by vocabulary (Megatron-style
tensor parallelism, written as `NamedSharding` placements, not as code). The KV cache and its page
summaries are split by batch (``data``) and KV heads (``model``): each device holds its rows'
entries of its heads, and a policy's per-head selection stays on the device that owns the head.

`generate` takes ``mesh=``; it checks the sizes here before jit, places the weights and the prompt
(`on_mesh`, `place_rows`) and carries the mesh inside the static `Backend`, so the jitted program
can pin the cache with `constrain_cache` (`jax.lax.with_sharding_constraint`) where it is created
or rewritten.
Everything between those points — the matmuls, the policies' scores that reduce over heads or
layers (CHESS's page vectors, Quest's bound, SemantiCache's clusters) — is partitioned by XLA
from these placements. The Pallas kernels, which XLA cannot partition, run per device under
`jax.shard_map` (`per_device`): each device calls the kernel on its own rows and heads.

A weight whose split dimension does not divide the ``model`` axis (an odd vocabulary or MLP width)
stays whole on every device; the head counts and the batch must divide (`check_mesh`).
Multi-host: call `jax.distributed.initialize()` first in every process; `make_mesh` then spans
every process's devices and the same code runs (docs/SHARDING.md).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsekv_jax.backend import Backend
from sparsekv_jax.cache import KVCache, LayerKV
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import LayerParams, Params

__all__ = ["DATA", "MODEL", "cache_specs", "check_mesh", "collectives", "constrain", "constrain_cache",
           "constrain_layers_rows_heads", "decode_attention", "layer_matmul", "make_mesh", "on_mesh", "param_specs",
           "parse_mesh", "per_device", "place_rows", "prefill_attention", "rope_page_sums", "shard_params"]

DATA, MODEL = "data", "model"

# The dimension of each weight split over ``model`` (None: replicated); layer weights carry [L] first.
_SPLIT_DIM = {"wq": 2, "wk": 2, "wv": 2, "bq": 1, "bk": 1, "bv": 1,  # by heads (output columns)
              "wo": 1,  # by heads (input rows): the attention output is head-split already
              "w_gate": 2, "w_up": 2, "w_down": 1,  # by the MLP's hidden units
              "embed": 0, "lm_head": 1}  # by vocabulary


def make_mesh(data: int = 1, model: int = 1, devices: Sequence[Any] | None = None) -> Mesh:
    """A ``data`` × ``model`` mesh over the first ``data * model`` of ``devices`` (default: every
    device of every process, `jax.devices()`).

    The axes are `AxisType.Auto`: shardings are placements and constraints that XLA propagates,
    so the unsharded code runs unchanged (no sharding in the types).
    """
    devices = list(jax.devices() if devices is None else devices)
    for name, size in ((DATA, data), (MODEL, model)):
        if not isinstance(size, (int, np.integer)) or size < 1:
            raise ValueError(f"mesh {name}={size!r} must be a positive int")
    if data * model > len(devices):
        raise ValueError(f"mesh data={data} x model={model} needs {data * model} devices, {len(devices)} available "
                         f"({devices[0].platform if devices else 'none'})")
    grid = np.asarray(devices[: data * model], dtype=object).reshape(data, model)
    return Mesh(grid, (DATA, MODEL), axis_types=(AxisType.Auto, AxisType.Auto))


def parse_mesh(text: str) -> tuple[int, int]:
    """``"data=2,model=4"`` → ``(2, 4)`` (either key may be left out: size 1)."""
    sizes = {DATA: 1, MODEL: 1}
    for part in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"(\w+)\s*=\s*(\d+)", part)
        if m is None or m.group(1) not in sizes:
            raise ValueError(f"mesh {text!r}: expected data=D,model=M (got {part!r})")
        if int(m.group(2)) < 1:
            raise ValueError(f"mesh {text!r}: {m.group(1)}={m.group(2)} must be >= 1")
        sizes[m.group(1)] = int(m.group(2))
    return sizes[DATA], sizes[MODEL]


def axis_size(mesh: Mesh, axis: str) -> int:
    return int(mesh.shape[axis])


def check_mesh(cfg: ModelConfig, batch: int, mesh: Mesh) -> None:
    """``ValueError`` (before jit) when the heads or the batch do not divide the mesh's axes."""
    if not isinstance(mesh, Mesh) or set(mesh.axis_names) != {DATA, MODEL}:
        raise ValueError(f"mesh must be a jax.sharding.Mesh with axes ('data', 'model') (sparsekv_jax.sharding."
                         f"make_mesh), got {mesh!r}")
    m, d = axis_size(mesh, MODEL), axis_size(mesh, DATA)
    for what, n in (("num_kv_heads", cfg.num_kv_heads), ("num_heads", cfg.num_heads)):
        if n % m:
            raise ValueError(f"the model's {what}={n} is not divisible by the mesh's model axis ({m}): "
                             f"heads are split over it; use a model axis that divides {n}")
    if batch % d:
        raise ValueError(f"batch={batch} is not divisible by the mesh's data axis ({d}): rows are split over it; "
                         f"pad the batch to a multiple of {d} or use a smaller data axis")


def _weight_spec(name: str, shape: tuple[int, ...], model: int) -> P:
    dim = _SPLIT_DIM.get(name)
    if dim is None or shape[dim] % model:
        return P()  # norms, and a dimension the model axis does not divide: whole on every device
    return P(*([None] * dim), MODEL)


def param_specs(params: Params, mesh: Mesh) -> Params:
    """`Params`-shaped pytree of `PartitionSpec` (see the module docstring)."""
    model = axis_size(mesh, MODEL)
    layer = {f: (None if getattr(params.layers, f) is None
                 else _weight_spec(f, getattr(params.layers, f).shape, model))
             for f in LayerParams.__dataclass_fields__}
    return Params(embed=_weight_spec("embed", params.embed.shape, model), layers=LayerParams(**layer),
                  final_norm=P(), lm_head=None if params.lm_head is None else
                  _weight_spec("lm_head", params.lm_head.shape, model), config=params.config)


def shard_params(params: Params, mesh: Mesh) -> Params:
    """``params`` placed on ``mesh`` (`jax.device_put` with `NamedSharding`; arrays already placed so
    are not copied)."""
    specs = param_specs(params, mesh)
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), params, specs)


def _kv_spec(x: jax.Array, stacked: bool) -> P:
    """A cache field: ``[L,] B, Hkv, ...`` split by rows and KV heads."""
    lead = (None,) if stacked else ()
    return P(*lead, DATA, MODEL) if x.ndim >= len(lead) + 2 else P(*lead, DATA)


def cache_specs(cache: KVCache | LayerKV) -> KVCache | LayerKV:
    """`PartitionSpec` of every leaf of a `KVCache` (stacked layers) or of one layer's `LayerKV`."""
    if isinstance(cache, LayerKV):
        stacked = cache.k.ndim == 5
        return jax.tree.map(lambda x: _kv_spec(x, stacked), cache)
    return cache.replace(layers=cache_specs(cache.layers), length=P(DATA), next_position=P(DATA))


def constrain(x: Any, mesh: Mesh | None, spec: Any) -> Any:
    """`jax.lax.with_sharding_constraint` of ``x`` (a pytree) to ``spec`` on ``mesh`` (a pytree of
    `PartitionSpec` matching ``x``, or one spec for every leaf); identity without a mesh."""
    if mesh is None:
        return x
    if isinstance(spec, P):
        return jax.tree.map(lambda a: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, spec)), x)
    return jax.tree.map(lambda a, s: jax.lax.with_sharding_constraint(a, NamedSharding(mesh, s)), x, spec)


def constrain_cache(cache: KVCache | LayerKV, mesh: Mesh | None) -> KVCache | LayerKV:
    """The cache pinned to its split by rows and KV heads (identity without a mesh): where it is
    created or rebuilt (prefill, compression, each decode step), so no step is free to gather it."""
    return cache if mesh is None else constrain(cache, mesh, cache_specs(cache))


def on_mesh(params: Params, tokens: Any, mesh: Mesh | None, backend: Backend | None) -> tuple[Params, Backend | None]:
    """What `generate` does first with ``mesh=`` (or a ``backend`` carrying one): check the heads and
    the batch of ``tokens`` against it (`check_mesh`, before anything runs), put the weights on it
    (`shard_params`) and return the backend carrying it. Unchanged without a mesh."""
    mesh = backend.mesh if mesh is None and backend is not None else mesh
    if mesh is None:
        return params, backend
    shape = np.shape(tokens)
    check_mesh(params.config, shape[0] if len(shape) == 2 else 1, mesh)
    backend = dataclasses.replace(Backend() if backend is None else backend, mesh=mesh)
    if params.config.layer_types and "sliding_attention" in params.config.layer_types and \
            backend.local_cache == "ring":
        raise ValueError("a mesh with Backend(local_cache='ring') (Gemma 3's local-layer rings) is not supported: "
                         "the rings are not split over devices; pass Backend(local_cache='full')")
    return shard_params(params, mesh), backend


def constrain_layers_rows_heads(x: Any, mesh: Mesh | None) -> Any:
    """Arrays ``[L, B, Hkv, ...]`` (a policy's per-head state or observations) split as the cache."""
    return constrain(x, mesh, P(None, DATA, MODEL))


def state_specs(state: Any, cache: KVCache) -> Any:
    """`PartitionSpec` of each leaf of a policy's decode state, read from its leading shape against
    the cache's: ``[L, B, Hkv, ...]`` and ``[B, Hkv, ...]`` split as the cache, ``[B, ...]`` by rows,
    anything else replicated. A leaf whose sizes match by chance is still split validly (the axis it
    is split on has the size that the mesh divides)."""
    L, B, H = cache.layers.k.shape[:3]

    def spec(x: Any) -> P:
        s = tuple(np.shape(x))
        if s[:3] == (L, B, H):
            return P(None, DATA, MODEL)
        if s[:2] == (B, H):
            return P(DATA, MODEL)
        return P(DATA) if s[:1] == (B,) else P()

    return jax.tree.map(spec, state)


def constrain_state(state: Any, cache: KVCache, mesh: Mesh | None) -> Any:
    """A policy's decode state pinned to `state_specs` (identity without a mesh): the state a decode
    step returns has the split of the state it was given, so a loop that feeds it back (donated)
    runs one compiled program (CHESS's page lists, built replicated, came back split by heads)."""
    return state if mesh is None else constrain(state, mesh, state_specs(state, cache))


def place_state(state: Any, cache: KVCache, mesh: Mesh | None) -> Any:
    """`constrain_state` outside jit: the state put on the mesh with `state_specs` (``decode_init``
    called eagerly, e.g. by the benchmarks)."""
    if mesh is None:
        return state
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), state, state_specs(state, cache))


def place_rows(run: Any) -> Any:
    """A `generate.Inputs` with its per-row arrays (prompt, lengths, suffix) split over ``data`` of
    ``run.backend.mesh``; unchanged without a mesh."""
    mesh = run.backend.mesh
    if mesh is None:
        return run
    rows = NamedSharding(mesh, P(DATA))
    return dataclasses.replace(run, **{f: jax.device_put(getattr(run, f), rows) for f in (
        "tokens", "lengths", "question_start", "prompt_lengths", "suffix", "suffix_lengths")
        if getattr(run, f) is not None})


def per_device(fn: Callable[..., Any], mesh: Mesh, in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    """``fn`` run on each device's shard (`jax.shard_map`): the way a Pallas kernel, which XLA cannot
    partition, runs on a sharded cache. ``in_specs``/``out_specs`` give each argument's / output's
    split (``None`` for an absent optional argument)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


_COLLECTIVE = re.compile(r"=\s*(\(?[^=]*?\)?)\s+(all-gather|all-reduce|all-to-all|collective-permute|"
                         r"reduce-scatter)(?:-start)?\(")
_SHAPE = re.compile(r"(pred|s8|u8|s16|u16|s32|u32|s64|u64|bf16|f16|f32|f64)\[([0-9,]*)\]")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "f32": 4,
          "s64": 8, "u64": 8, "f64": 8}


def collectives(hlo_text: str) -> list[tuple[str, int]]:
    """``(op, bytes of its result)`` for every collective of a compiled program's HLO text
    (``jax.jit(f).lower(...).compile().as_text()``): how much each device receives, e.g. to check
    that no step gathers the whole cache onto one device."""
    out = []
    for line in hlo_text.splitlines():
        m = _COLLECTIVE.search(line)
        if m is None:
            continue
        size = 0
        for dtype, dims in _SHAPE.findall(m.group(1)):
            size += _BYTES[dtype] * int(np.prod([int(d) for d in dims.split(",") if d] or [1]))
        out.append((m.group(2), size))
    return out


# -- the Pallas kernels, per device ---------------------------------------------------------------
# Each kernel works on independent (row, KV head) pairs, so on a mesh every device runs it on its own
# rows and heads: the arguments' splits below are the cache's, and nothing is gathered.

def _on_shards(mesh: Mesh, kernel: Callable[..., Any], arrays: dict[str, tuple[Any, P]], out_specs: Any,
               **static: Any) -> Any:
    """``kernel(**arrays, **static)`` per device; ``arrays`` maps an argument to ``(value, split)``
    (a ``None`` value is left out)."""
    present = {n: a for n, (a, _) in arrays.items() if a is not None}
    specs = {n: arrays[n][1] for n in present}
    return per_device(lambda kw: kernel(**kw, **static), mesh, (specs,), out_specs)(present)


def decode_attention(mesh: Mesh, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                     page_ids: jax.Array | None = None, page_counts: jax.Array | None = None,
                     bias: jax.Array | None = None, layer: Any = None, **static: Any) -> Any:
    """`sparsekv_jax.pallas.decode.decode_attention` run per device on ``mesh`` (same arguments;
    ``k``/``v``/``bias`` stacked ``[L, ...]`` when ``layer`` is given). A device's query heads are the
    groups of its KV heads (a group's heads are adjacent), so each device holds whole groups."""
    from sparsekv_jax.pallas.decode import decode_attention as kernel

    lead = (None,) if layer is not None else ()
    heads, kv = P(DATA, MODEL), P(*lead, DATA, MODEL)
    layer = None if layer is None else jax.numpy.asarray(layer, jax.numpy.int32)
    arrays = {"q": (q, heads), "k": (k, kv), "v": (v, kv), "lengths": (lengths, P(DATA)),
              "page_ids": (page_ids, heads), "page_counts": (page_counts, heads), "bias": (bias, kv),
              "layer": (layer, P())}
    return _on_shards(mesh, kernel, arrays, (heads, heads) if static.get("return_probs") else heads, **static)


def prefill_attention(mesh: Mesh, q: jax.Array, k: jax.Array, v: jax.Array, *, block_ids: jax.Array | None = None,
                      block_counts: jax.Array | None = None, kv_lengths: jax.Array | None = None,
                      **static: Any) -> Any:
    """`sparsekv_jax.pallas.prefill.prefill_attention` run per device on ``mesh`` (same arguments)."""
    from sparsekv_jax.pallas.prefill import prefill_attention as kernel

    heads = P(DATA, MODEL)
    arrays = {"q": (q, heads), "k": (k, heads), "v": (v, heads), "block_ids": (block_ids, heads),
              "block_counts": (block_counts, heads), "kv_lengths": (kv_lengths, P(DATA))}
    return _on_shards(mesh, kernel, arrays, (heads, heads) if static.get("return_lse") else heads, **static)


def rope_page_sums(mesh: Mesh, k: jax.Array, inv_freq: Any, layer: Any, **static: Any) -> jax.Array:
    """`sparsekv_jax.pallas.page_rope.rope_page_sums` run per device on ``mesh`` (``k`` stacked
    ``[L, B, H, S, D]``; the result ``[B, H, P, D]`` split as the cache)."""
    from sparsekv_jax.pallas.page_rope import rope_page_sums as kernel

    arrays = {"k": (k, P(None, DATA, MODEL)), "layer": (jax.numpy.asarray(layer, jax.numpy.int32), P())}
    return _on_shards(mesh, kernel, arrays, P(DATA, MODEL), inv_freq=inv_freq, **static)


def layer_matmul(mesh: Mesh, name: str, x: jax.Array, w: jax.Array, layer: Any, **static: Any) -> jax.Array:
    """`sparsekv_jax.pallas.matmul.layer_matmul` of weight ``name`` (``[L, K, N]``, split as
    `param_specs` splits it) run per device on ``mesh``: a weight split by output columns gives
    column-split activations; one split by input rows (``wo``, ``w_down``) takes row-split activations
    and sums the devices' partial products (`jax.lax.psum`), as XLA does for the same dot."""
    from sparsekv_jax.pallas.matmul import layer_matmul as kernel

    spec = _weight_spec(name, w.shape, axis_size(mesh, MODEL))
    by_rows = len(spec) == 2  # P(None, MODEL): the contracted dimension is split
    x_spec = P(DATA, MODEL) if by_rows else P(DATA)
    out_spec = P(DATA) if by_rows or len(spec) == 0 else P(DATA, MODEL)

    def local(x, w, layer):
        out = kernel(x, w, layer, **static)
        return jax.lax.psum(out, MODEL) if by_rows else out

    return per_device(local, mesh, (x_spec, spec, P()), out_spec)(x, w, jax.numpy.asarray(layer, jax.numpy.int32))
