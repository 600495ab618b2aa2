"""Which function runs a kernel-level operation, decided by a `Backend` and nothing else: the Pallas
kernel (interpreted where the backend says so: off a GPU, for tests), its jnp reference, or the
kernel per device under `jax.shard_map` when the backend carries a mesh (XLA cannot partition a
Pallas kernel; each kernel works on independent rows and KV heads, so every device runs it on its
own shard of the cache and nothing is gathered).

Callers (`attention`, the model's stacked matmuls, the policies, the SAE, the retrieval scan) pass
the run's `Backend` (``None``: this process's default, `sparsekv_jax.backend.resolved`) and never
ask the platform themselves. The kernels and their references stay in their own modules beside
this one; this module only chooses among them.

``*_method`` functions turn a caller's ``"auto"`` into a concrete choice (the kernel on a GPU where
it applies); the others run the chosen implementation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from sparsekv_jax.backend import DATA, MODEL, Backend, resolved
from sparsekv_jax.pallas import decode as _decode
from sparsekv_jax.pallas import gsc as _gsc
from sparsekv_jax.pallas import matmul as _matmul
from sparsekv_jax.pallas import page_rope as _page_rope
from sparsekv_jax.pallas import prefill as _prefill
from sparsekv_jax.pallas import sae_decode as _sae
from sparsekv_jax.pallas import sae_encode as _sae_enc
from sparsekv_jax.pallas import stem_route as _stem_route
from sparsekv_jax.pallas import topk as _topk

__all__ = ["decode_attention", "fused_encoder_method", "fused_encoder_top_k", "gather_decode", "gather_dot",
           "gsc_method", "layer_matmul", "per_device", "prefill_attention", "rope_page_sums",
           "rope_page_sums_method", "sae_gather_method", "stem_tile_metric", "threshold_top_k",
           "threshold_top_k_method", "weight_spec"]

# The dimension of each weight split over ``model`` (None: replicated); layer weights carry [L] first.
# `sparsekv_jax.sharding.param_specs` places the weights by it and `layer_matmul` multiplies by it.
_SPLIT_DIM = {"wq": 2, "wk": 2, "wv": 2, "bq": 1, "bk": 1, "bv": 1,  # by heads (output columns)
              "wo": 1,  # by heads (input rows): the attention output is head-split already
              "w_gate": 2, "w_up": 2, "w_down": 1,  # by the MLP's hidden units
              "embed": 0, "lm_head": 1}  # by vocabulary


def weight_spec(name: str, shape: tuple[int, ...], model: int) -> P:
    """The `PartitionSpec` of weight ``name`` of ``shape`` on a mesh whose ``model`` axis has ``model``
    devices: split along `_SPLIT_DIM`, or whole on every device (norms, and a dimension the axis does
    not divide)."""
    dim = _SPLIT_DIM.get(name)
    if dim is None or shape[dim] % model:
        return P()
    return P(*([None] * dim), MODEL)


def per_device(fn: Callable[..., Any], mesh: Any, in_specs: Any, out_specs: Any) -> Callable[..., Any]:
    """``fn`` run on each device's shard (`jax.shard_map`): the way a Pallas kernel, which XLA cannot
    partition, runs on a sharded cache. ``in_specs``/``out_specs`` give each argument's / output's
    split (``None`` for an absent optional argument)."""
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)


def _on_shards(mesh: Any, kernel: Callable[..., Any], arrays: dict[str, tuple[Any, P]], out_specs: Any,
               **static: Any) -> Any:
    """``kernel(**arrays, **static)`` per device; ``arrays`` maps an argument to ``(value, split)``
    (a ``None`` value is left out)."""
    present = {n: a for n, (a, _) in arrays.items() if a is not None}
    specs = {n: arrays[n][1] for n in present}
    return per_device(lambda kw: kernel(**kw, **static), mesh, (specs,), out_specs)(present)


def _interpret(backend: Backend | None) -> bool:
    return bool(resolved(backend).interpret)


# -- attention ------------------------------------------------------------------------------------

def decode_attention(backend: Backend | None, q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                     page_ids: jax.Array | None = None, page_counts: jax.Array | None = None,
                     bias: jax.Array | None = None, layer: Any = None, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None, k_zero: jax.Array | None = None,
                     page_table: jax.Array | None = None, **static: Any) -> Any:
    """The Pallas decode kernel (`sparsekv_jax.pallas.decode.decode_attention`, same arguments; ``k``/
    ``v``/``bias`` stacked ``[L, ...]`` when ``layer`` is given), interpreted as ``backend`` says, per
    device on its mesh. A device's query heads are the groups of its KV heads (a group's heads are
    adjacent), so each device holds whole groups. Whether the kernel or `attention`'s jnp path runs
    is ``backend.decode_attention``. ``k_scale``/``v_scale``/``k_zero``: a quantised cache's scales and
    key zero points (split as the cache). ``page_table``: the kernel's pool mode (``k``/``v`` a page pool,
    `attention.decode_pool`; experimental), on one device only for now: ``ValueError`` with a mesh."""
    backend = resolved(backend)
    static = {"interpret": backend.interpret, **static}
    if page_table is not None:
        if backend.mesh is not None:
            raise ValueError("decode_attention: the kernel's pool mode (page_table=) does not run on a mesh yet")
        return _decode.decode_attention(q, k, v, lengths, page_ids=page_ids, page_counts=page_counts, bias=bias,
                                        layer=layer, k_scale=k_scale, v_scale=v_scale, k_zero=k_zero,
                                        page_table=page_table, **static)
    if backend.mesh is None:
        return _decode.decode_attention(q, k, v, lengths, page_ids=page_ids, page_counts=page_counts, bias=bias,
                                        layer=layer, k_scale=k_scale, v_scale=v_scale, k_zero=k_zero,
                                        **static)
    lead = (None,) if layer is not None else ()
    heads, kv = P(DATA, MODEL), P(*lead, DATA, MODEL)
    layer = None if layer is None else jnp.asarray(layer, jnp.int32)
    arrays = {"q": (q, heads), "k": (k, kv), "v": (v, kv), "lengths": (lengths, P(DATA)),
              "page_ids": (page_ids, heads), "page_counts": (page_counts, heads), "bias": (bias, kv),
              "layer": (layer, P()), "k_scale": (k_scale, kv), "v_scale": (v_scale, kv),
              "k_zero": (k_zero, kv)}
    return _on_shards(backend.mesh, _decode.decode_attention, arrays,
                      (heads, heads) if static.get("return_probs") else heads, **static)


def prefill_attention(backend: Backend | None, q: jax.Array, k: jax.Array, v: jax.Array, *,
                      block_ids: jax.Array | None = None, block_counts: jax.Array | None = None,
                      kv_lengths: jax.Array | None = None, **static: Any) -> Any:
    """The Pallas block-sparse prefill kernel (`sparsekv_jax.pallas.prefill.prefill_attention`, same
    arguments), interpreted as ``backend`` says, per device on its mesh."""
    backend = resolved(backend)
    static = {"interpret": backend.interpret, **static}
    if backend.mesh is None:
        return _prefill.prefill_attention(q, k, v, block_ids=block_ids, block_counts=block_counts,
                                          kv_lengths=kv_lengths, **static)
    heads = P(DATA, MODEL)
    arrays = {"q": (q, heads), "k": (k, heads), "v": (v, heads), "block_ids": (block_ids, heads),
              "block_counts": (block_counts, heads), "kv_lengths": (kv_lengths, P(DATA))}
    return _on_shards(backend.mesh, _prefill.prefill_attention, arrays,
                      (heads, heads) if static.get("return_lse") else heads, **static)


# -- CHESS's pre-RoPE page sums -------------------------------------------------------------------

def rope_page_sums_method(backend: Backend | None, head_dim: int) -> str:
    """``"pallas"`` or ``"jnp"``: ``backend.page_sums``, except that the kernel's tables want a
    power-of-two half head dim (other models take the reference)."""
    half = head_dim // 2
    impl = resolved(backend).page_sums
    return impl if impl == "jnp" or not half & (half - 1) else "jnp"


def rope_page_sums(backend: Backend | None, k: jax.Array, inv_freq: Any, layer: Any, *, page_size: int) -> jax.Array:
    """Per-page sums of layer ``layer``'s keys turned back by their slot (``k`` stacked ``[L, B, H, S,
    D]`` → ``[B, H, P, D]``): the kernel (`sparsekv_jax.pallas.page_rope.rope_page_sums`, the keys read
    in place; per device on a mesh, the result split as the cache) or its jnp reference, by
    `rope_page_sums_method`."""
    backend = resolved(backend)
    if rope_page_sums_method(backend, k.shape[-1]) == "jnp":
        return _page_rope.rope_page_sums_reference(k, inv_freq, layer, page_size=page_size)
    if backend.mesh is None:
        return _page_rope.rope_page_sums(k, inv_freq, layer, page_size=page_size, interpret=backend.interpret)
    arrays = {"k": (k, P(None, DATA, MODEL)), "layer": (jnp.asarray(layer, jnp.int32), P())}
    return _on_shards(backend.mesh, _page_rope.rope_page_sums, arrays, P(DATA, MODEL), inv_freq=inv_freq,
                      page_size=page_size, interpret=backend.interpret)


# -- decode matmuls -------------------------------------------------------------------------------

def layer_matmul(backend: Backend | None, name: str, x: jax.Array, w: jax.Array, layer: Any,
                 **static: Any) -> jax.Array:
    """``x @ w[layer]`` in the Pallas kernel (`sparsekv_jax.pallas.matmul.layer_matmul`, the layer's
    tiles read from the stack), interpreted as ``backend`` says. On its mesh the kernel runs per
    device on weight ``name``'s split (`weight_spec`): a weight split by output columns gives
    column-split activations; one split by input rows (``wo``, ``w_down``) takes row-split
    activations and sums the devices' partial products (`jax.lax.psum`), as XLA does for the same
    dot."""
    backend = resolved(backend)
    static = {"interpret": backend.interpret, **static}
    if backend.mesh is None:
        return _matmul.layer_matmul(x, w, layer, **static)
    spec = weight_spec(name, w.shape, int(backend.mesh.shape[MODEL]))
    by_rows = len(spec) == 2  # P(None, MODEL): the contracted dimension is split
    x_spec = P(DATA, MODEL) if by_rows else P(DATA)
    out_spec = P(DATA) if by_rows or len(spec) == 0 else P(DATA, MODEL)

    def local(x, w, layer):
        out = _matmul.layer_matmul(x, w, layer, **static)
        return jax.lax.psum(out, MODEL) if by_rows else out

    return per_device(local, backend.mesh, (x_spec, spec, P()), out_spec)(x, w, jnp.asarray(layer, jnp.int32))


# -- SemantiCache's greedy seed clustering --------------------------------------------------------

GSC_METHODS = ("auto", "jnp", "pallas", "interpret")


def gsc_method(backend: Backend | None, method: str, width: int) -> str:
    """``"auto"`` → ``"pallas"`` (the kernel, `sparsekv_jax.pallas.gsc`) on a GPU when it takes this band
    ``width``, else ``"jnp"`` (the reference); ``"interpret"`` runs the kernel interpreted (tests).
    ``ValueError`` for an unknown method or a kernel asked for a band it cannot take."""
    if method not in GSC_METHODS:
        raise ValueError(f"gsc={method!r} must be one of {GSC_METHODS}")
    if method == "auto":
        return "pallas" if resolved(backend).gpu and _gsc.gsc_kernel_applies(width) else "jnp"
    if method in ("pallas", "interpret") and not _gsc.gsc_kernel_applies(width):
        raise ValueError(f"gsc={method!r}: the kernel needs a power-of-two band width in [2, 128], got {width} "
                         "(chunk_size, or the prompt length with chunking='none'); use gsc='jnp'")
    return method


# -- top-k by thresholds (the SAE's and S³'s selections) ------------------------------------------

def threshold_top_k_method(backend: Backend | None, width: int, k: int) -> bool:
    """Whether an ``"auto"`` top-k of ``k`` of ``width`` takes the threshold kernel
    (`sparsekv_jax.pallas.topk.threshold_top_k`): on a GPU where it applies (on a CPU the kernel only
    runs interpreted, for tests)."""
    return resolved(backend).gpu and _topk.threshold_top_k_applies(width, k)


def threshold_top_k(backend: Backend | None, x: jax.Array, k: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`sparsekv_jax.pallas.topk.threshold_top_k` of ``x``, interpreted as ``backend`` says."""
    return _topk.threshold_top_k(x, k, interpret=_interpret(backend))


# -- the Top-K SAE's gathers ----------------------------------------------------------------------

def sae_gather_method(backend: Backend | None, d_in: int) -> str:
    """An ``"auto"`` SAE decode/encoder gather: ``"pallas"`` (`sparsekv_jax.pallas.sae_decode`) on a GPU
    for a ``d_in`` the kernels take, else ``"xla"`` (the references)."""
    return "pallas" if resolved(backend).gpu and _sae.gather_kernels_apply(d_in) else "xla"


def gather_decode(backend: Backend | None, method: str, table: jax.Array, bias: jax.Array, ids: jax.Array,
                  coef: jax.Array) -> jax.Array:
    """The SAE decoder's gather-sum: the kernel (``method == "pallas"``, interpreted as ``backend``
    says) or its reference."""
    if method == "pallas":
        return _sae.gather_decode(table, bias, ids, coef, interpret=_interpret(backend))
    return _sae.gather_decode_reference(table, bias, ids, coef)


def gather_dot(backend: Backend | None, method: str, table: jax.Array, ids: jax.Array, vec: jax.Array) -> jax.Array:
    """The SAE encoder's dots at the selected latents: the kernel (``method == "pallas"``, interpreted
    as ``backend`` says) or its reference."""
    if method == "pallas":
        return _sae.gather_dot(table, ids, vec, interpret=_interpret(backend))
    return _sae.gather_dot_reference(table, ids, vec)


def stem_tile_metric(backend: Backend | None, qb: jax.Array, qi: jax.Array, inside: jax.Array, ks: jax.Array,
                     bonus: jax.Array, *, gqa: str, scale: float) -> jax.Array:
    """Stem's routing metric of a tile of query blocks on the Pallas kernel (`sparsekv_jax.pallas.stem_route`),
    interpreted where ``backend`` says so; its jnp reference is `policies.stem_routing.tile_metric`."""
    return _stem_route.stem_tile_metric_kernel(qb, qi, inside, ks, bonus, gqa=gqa, scale=scale,
                                               interpret=_interpret(backend))


# -- the Top-K SAE's encoder, ReLU and top-k fused --------------------------------------------------

def fused_encoder_method(backend: Backend | None, d_in: int, width: int, k: int) -> bool:
    """Whether an ``"auto"`` SAE selection takes the fused encoder kernel (`sparsekv_jax.pallas.sae_encode`):
    on a GPU where it applies, once it is verified there (`sae_encode.AUTO_ON_GPU`; on a CPU the
    kernel only runs interpreted, for tests)."""
    return _sae_enc.AUTO_ON_GPU and resolved(backend).gpu and _sae_enc.fused_encoder_applies(d_in, width, k)


def fused_encoder_top_k(backend: Backend | None, x: jax.Array, w: jax.Array, bias: jax.Array, k: int,
                        keep: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """`sparsekv_jax.pallas.sae_encode.fused_encoder_top_k`, interpreted as ``backend`` says."""
    return _sae_enc.fused_encoder_top_k(x, w, bias, k, keep=keep, interpret=_interpret(backend))
