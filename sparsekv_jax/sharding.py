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
`jax.shard_map`: each device calls the kernel on its own rows and heads (`sparsekv_jax.pallas.dispatch`,
through which a `Backend` carrying the mesh routes every kernel).

A weight whose split dimension does not divide the ``model`` axis (an odd vocabulary or MLP width)
stays whole on every device; the head counts and the batch must divide (`check_mesh`).
Multi-host: call `jax.distributed.initialize()` first in every process; `make_mesh` then spans
every process's devices and the same code runs (docs/SHARDING.md).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from sparsekv_jax.backend import DATA, MODEL, Backend
from sparsekv_jax.cache import KVCache, LayerKV
from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import LayerParams, Params
from sparsekv_jax.pallas.dispatch import weight_spec

__all__ = ["DATA", "MODEL", "cache_specs", "check_mesh", "collectives", "constrain", "constrain_cache",
           "constrain_layers_rows_heads", "make_mesh", "on_mesh", "param_specs", "parse_mesh", "place_rows",
           "shard_params"]


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


def param_specs(params: Params, mesh: Mesh) -> Params:
    """`Params`-shaped pytree of `PartitionSpec` (see the module docstring)."""
    model = axis_size(mesh, MODEL)
    layer = {f: (None if getattr(params.layers, f) is None
                 else weight_spec(f, getattr(params.layers, f).shape, model))
             for f in LayerParams.__dataclass_fields__}
    return Params(embed=weight_spec("embed", params.embed.shape, model), layers=LayerParams(**layer),
                  final_norm=P(), lm_head=None if params.lm_head is None else
                  weight_spec("lm_head", params.lm_head.shape, model), config=params.config)


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
