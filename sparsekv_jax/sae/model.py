"""The Top-K sparse autoencoder of S³-Attention (its Section 3.3; Gao et al., 2024).

    z = TopK(ReLU(W_enc (x - b_dec) + b_enc), k)        x̂ = z W_dec + b_dec

``x`` is one head's key (or query) vector, ``d_in = head_dim``. `TopKSAE` is a pytree usable
inside ``jit``; ``k`` is static. Stacked SAEs — one per target layer, trained together — are the
same class with leading axes on every leaf: `pre_activations`, `encode` and `decode` take ``x``
whose leading axes are the SAE's stack axes followed by any batch axes.

`encode` never builds the dense latent vector ``z``: it returns the ``k`` active ids and their
activations. Only the pre-activations are dense (every latent must be scored to find the top k), and
on a GPU not even they are written: `resolve_select`'s ``"fused"`` scores and selects in one kernel.
`decode` gathers the ``k`` decoder rows of each input instead of multiplying by ``z``.

Per-token features from per-head vectors: one SAE per layer is shared by a layer's KV heads
(every head's key is a training sample), so all heads — and the query heads S³ encodes with the
same SAE — speak one feature-id space; `merge_heads` turns a token's per-head features into one
set of ``k`` features by summing each feature's activations over the heads (docs/SAE.md).
"""

from __future__ import annotations

import math
from functools import partial

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax.backend import Backend
from sparsekv_jax.pallas import dispatch
from sparsekv_jax.pallas.sae_decode import gather_kernels_apply
from sparsekv_jax.pallas.sae_encode import fused_encoder_applies
from sparsekv_jax.sae.config import DECODE_METHODS, TOPK_METHODS
from sparsekv_jax.sae.topk import relu_top_k, resolve_method

_LOWEST = float(jnp.finfo(jnp.float32).min)


@struct.dataclass
class TopKSAE:
    """Weights of a Top-K SAE (or of a stack of them: leading axes on every leaf).

    Attributes:
      w_enc: ``[..., d_in, width]`` encoder.
      b_enc: ``[..., width]`` latent bias.
      w_dec: ``[..., width, d_in]`` decoder; rows are unit-norm after training steps.
      b_dec: ``[..., d_in]`` pre-encoder / output bias.
      k: active latents per input (static).
    """

    w_enc: jax.Array
    b_enc: jax.Array
    w_dec: jax.Array
    b_dec: jax.Array
    k: int = struct.field(pytree_node=False)

    @property
    def d_in(self) -> int:
        return self.w_enc.shape[-2]

    @property
    def width(self) -> int:
        return self.w_enc.shape[-1]

    @property
    def stack_shape(self) -> tuple[int, ...]:
        return tuple(self.w_enc.shape[:-2])

    def validate(self) -> TopKSAE:
        """Check shapes and k; returns ``self`` (call before jit, errors name the bad value)."""
        S, D, W = self.stack_shape, self.d_in, self.width
        want = {"w_enc": (*S, D, W), "b_enc": (*S, W), "w_dec": (*S, W, D), "b_dec": (*S, D)}
        for name, shape in want.items():
            got = tuple(getattr(self, name).shape)
            if got != shape:
                raise ValueError(f"TopKSAE.{name} has shape {got}, expected {shape}")
        if not 1 <= self.k <= W:
            raise ValueError(f"TopKSAE.k={self.k} must be in [1, width={W}]")
        return self

    def layer(self, i: int) -> TopKSAE:
        """SAE ``i`` of a stack (first stack axis)."""
        return jax.tree.map(lambda a: a[i], self)


def init_sae(key: jax.Array, d_in: int, width: int, k: int, *, stack: tuple[int, ...] = (),
             b_dec: jax.Array | None = None) -> TopKSAE:
    """A freshly initialised SAE (or stack of ``stack`` SAEs).

    Decoder rows are random unit vectors and the encoder is their transpose ("tied" init, Gao et
    al. 2024 §A.1 and openai/sparse_autoencoder): every latent starts out detecting the direction
    it writes. ``b_dec`` (default 0) is meant to be set from data (`sparsekv_jax.sae.train`).
    """
    if d_in < 1 or width < 1:
        raise ValueError(f"d_in={d_in} and width={width} must be >= 1")
    if not 1 <= k <= width:
        raise ValueError(f"k={k} must be in [1, width={width}]")
    w_dec = jax.random.normal(key, (*stack, width, d_in), jnp.float32)
    w_dec = w_dec / jnp.linalg.norm(w_dec, axis=-1, keepdims=True)
    b = jnp.zeros((*stack, d_in), jnp.float32) if b_dec is None else jnp.asarray(b_dec, jnp.float32)
    return TopKSAE(w_enc=jnp.swapaxes(w_dec, -1, -2), b_enc=jnp.zeros((*stack, width), jnp.float32),
                   w_dec=w_dec, b_dec=jnp.broadcast_to(b, (*stack, d_in)), k=k).validate()


def _flat_stack(sae: TopKSAE, x: jax.Array) -> tuple[int, tuple[int, ...], jax.Array]:
    S = sae.stack_shape
    if tuple(x.shape[:len(S)]) != S or x.shape[-1] != sae.d_in:
        raise ValueError(f"x of shape {tuple(x.shape)} does not fit SAEs of stack {S} and d_in {sae.d_in}: "
                         f"expected {S} + batch axes + ({sae.d_in},)")
    s = math.prod(S)
    batch = tuple(x.shape[len(S):-1])
    return s, batch, x.reshape(s, -1, sae.d_in)


def _encoder_terms(sae: TopKSAE, x: jax.Array) -> tuple[int, tuple[int, ...], jax.Array, jax.Array, jax.Array]:
    """``(s, batch, xc [s, n, D], W_enc [s, D, W], latent bias [s, W])`` with ``pre = xc · W_enc + bias``.

    ``xc`` is centred with a stop-gradient ``b_dec``; ``b_dec`` gets its encoder gradient through a
    latent bias term that is exactly 0 in value, ``-(b_dec - sg(b_dec)) W_enc``: its gradient is then
    ``-W_enc Σ_n ∂pre``, a [width]-vector product, where differentiating ``x - b_dec`` would take a
    dense ``∂pre W_encᵀ`` matmul over the whole batch (x itself needs no gradient)."""
    s, batch, xs = _flat_stack(sae, x)
    D, W = sae.d_in, sae.width
    b_dec = sae.b_dec.reshape(s, D)
    w = sae.w_enc.reshape(s, D, W)
    xc = xs.astype(jnp.float32) - jax.lax.stop_gradient(b_dec)[:, None]
    zero = b_dec - jax.lax.stop_gradient(b_dec)
    return s, batch, xc, w, sae.b_enc.reshape(s, W) - jnp.einsum("sd,sdw->sw", zero, w)


def pre_activations(sae: TopKSAE, x: jax.Array, compute_dtype: jnp.dtype | None = None) -> jax.Array:
    """``W_enc (x - b_dec) + b_enc`` in fp32, ``[*stack, *batch, width]``.

    ``compute_dtype`` (e.g. ``bfloat16``) casts the matmul inputs; it accumulates in fp32.
    """
    _, batch, xc, w, bias = _encoder_terms(sae, x)
    if compute_dtype is not None:
        xc, w = xc.astype(compute_dtype), w.astype(compute_dtype)
    pre = jnp.einsum("snd,sdw->snw", xc, w, preferred_element_type=jnp.float32) + bias[:, None]
    return pre.reshape(*sae.stack_shape, *batch, sae.width)


def select(pre: jax.Array, k: int, method: str = "auto") -> tuple[jax.Array, jax.Array]:
    """``TopK(ReLU(pre), k)`` as ``(ids int32, activations)``, activations in descending order.

    The ids come from the (non-differentiable) selection; the activations are gathered from
    ``ReLU(pre)`` so that gradients reach exactly the selected pre-activations.
    """
    _, ids = relu_top_k(jax.lax.stop_gradient(pre), k, method, ordered=False)
    acts = activations_at(pre, ids)
    # one sort into descending activations (the threshold method returns ids ascending)
    acts, ids = jax.lax.sort((-acts, ids), dimension=-1, is_stable=True, num_keys=1)
    return ids, -acts


def activations_at(pre: jax.Array, ids: jax.Array) -> jax.Array:
    """``ReLU(pre)`` at ``ids``: ``[..., W]``, ``[..., k]`` → ``[..., k]``, i.e. ``take_along_axis``.

    Its gradient is the same as autodiff's, built in one step: the ``k`` incoming gradients of a
    row (zeroed where the activation is 0, ReLU's derivative) are scattered into a zero
    ``[..., W]`` gradient with indices declared unique (a row's ids are distinct), so XLA emits a
    plain scatter instead of an atomic one followed by a separate ReLU-mask pass. The training step
    multiplies it into the encoder's weight gradient as one dense matmul.
    """
    return _activations_at(pre.shape[-1], pre, ids)


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _activations_at(width: int, pre: jax.Array, ids: jax.Array) -> jax.Array:
    del width
    return jnp.take_along_axis(jax.nn.relu(pre), ids, axis=-1)


def _activations_at_fwd(width, pre, ids):
    acts = _activations_at(width, pre, ids)
    return acts, (ids, acts > 0)


def _activations_at_bwd(width, res, g):
    ids, active = res
    kk = ids.shape[-1]
    g2 = jnp.where(active, g, 0.0).reshape(-1, kk)
    rows = jnp.arange(g2.shape[0])[:, None]
    d_pre = jnp.zeros((g2.shape[0], width), g.dtype).at[rows, ids.reshape(-1, kk)].set(
        g2, unique_indices=True)
    return d_pre.reshape(*ids.shape[:-1], width), None


_activations_at.defvjp(_activations_at_fwd, _activations_at_bwd)


def resolve_select(method: str, d_in: int, width: int, k: int, compute_dtype: jnp.dtype | None = None,
                   backend: Backend | None = None) -> str:
    """The selection an SAE encode takes: ``"fused"`` (the encoder matmul, ReLU and top-k in one kernel,
    `sparsekv_jax.pallas.sae_encode`: the ``[N, width]`` pre-activations never written) or a top-k method
    of `sparsekv_jax.sae.topk` over the dense pre-activations.

    ``"auto"`` → ``"fused"`` on a GPU (``backend``'s platform; ``None``: this process's default) where the
    kernel applies and the encoder runs in fp32 (``compute_dtype`` ``None``/float32), else
    `sparsekv_jax.sae.topk.resolve_method`'s choice. An explicit ``"fused"`` that cannot run is refused."""
    if method not in TOPK_METHODS:
        raise ValueError(f"top-k method {method!r} is not one of {TOPK_METHODS}")
    fp32 = compute_dtype is None or jnp.dtype(compute_dtype) == jnp.float32
    if method == "fused":
        if not fused_encoder_applies(d_in, width, k):
            raise ValueError(f"the fused SAE encoder needs a power-of-two d_in in [16, 1024] and a width of >= 2 "
                             f"tiles of max(128, next_pow2(k)) latents (d_in * tile <= 32,768); got d_in={d_in}, "
                             f"width={width}, k={k}")
        if not fp32:
            raise ValueError(f"the fused SAE encoder runs in fp32; got compute_dtype={compute_dtype}")
        return "fused"
    if method == "auto" and fp32 and dispatch.fused_encoder_method(backend, d_in, width, k):
        return "fused"
    return resolve_method(method, width, k, backend)


def select_ids(sae: TopKSAE, x: jax.Array, k: int, method: str = "auto", *, keep: jax.Array | None = None,
               compute_dtype: jnp.dtype | None = None, backend: Backend | None = None) -> jax.Array:
    """The ids ``[*stack, *batch, k]`` of the ``k`` largest ``ReLU(W_enc (x − b_dec) + b_enc)`` of each vector
    (in no particular order: ascending for the kernels), without a gradient.

    ``keep`` ``[*stack, width]`` (bool): only those latents compete, the others count as 0 (AuxK's top-k
    over the dead latents). ``method`` as in `resolve_select`: ``"fused"`` never writes the dense
    pre-activations; the others compute them (in ``compute_dtype``) and take their top-k. Ties go to
    the lower id with the kernels and ``lax``.
    """
    S = sae.stack_shape
    if keep is not None and tuple(keep.shape) != (*S, sae.width):
        raise ValueError(f"keep has shape {tuple(keep.shape)}, expected {(*S, sae.width)}")
    if resolve_select(method, sae.d_in, sae.width, k, compute_dtype, backend) == "fused":
        s, batch, xc, w, bias = _encoder_terms(sae, x)
        keep2 = None if keep is None else keep.reshape(s, sae.width)
        _, ids = dispatch.fused_encoder_top_k(backend, xc, w, bias, k, keep2)
        return ids.reshape(*S, *batch, k)
    pre = jax.lax.stop_gradient(pre_activations(sae, x, compute_dtype))
    if keep is not None:
        s = math.prod(S)
        pre3 = jnp.where(keep.reshape(s, 1, sae.width), pre.reshape(s, -1, sae.width), _LOWEST)
        pre = pre3.reshape(pre.shape)
    return relu_top_k(pre, k, method, ordered=False, backend=backend)[1]


def encode(sae: TopKSAE, x: jax.Array, *, method: str = "auto", compute_dtype: jnp.dtype | None = None,
           backend: Backend | None = None) -> tuple[jax.Array, jax.Array]:
    """``(ids, activations)`` ``[*stack, *batch, k]`` of the k active latents of each vector of ``x``.

    Exactly ``k`` distinct ids per vector; an activation is 0 only when fewer than ``k``
    pre-activations are positive. ``method``: `resolve_select` (``"auto"``: the fused encoder kernel on
    a GPU where it applies, else a top-k of `sparsekv_jax.sae.topk`). With ``"fused"`` the activations
    are recomputed at the ids in fp32 (`selected_activations`): their gradient (to ``x``, ``W_enc``,
    ``b_enc``, ``b_dec``) flows through the k selected latents only, like the dense path's.
    """
    if resolve_select(method, sae.d_in, sae.width, sae.k, compute_dtype, backend) != "fused":
        return select(pre_activations(sae, x, compute_dtype), sae.k, method)
    ids = select_ids(sae, x, sae.k, "fused", backend=backend)
    acts = selected_activations(sae, x, ids, backend=backend, x_grad=True)
    acts, ids = jax.lax.sort((-acts, ids), dimension=-1, is_stable=True, num_keys=1)
    return ids, -acts


def decode(sae: TopKSAE, ids: jax.Array, acts: jax.Array, method: str = "auto",
           backend: Backend | None = None) -> jax.Array:
    """``x̂ = Σ_j acts_j · W_dec[ids_j] + b_dec`` (gathers the k rows; ``z`` is never built).

    ``method``: ``"xla"`` (a gather and an einsum), ``"pallas"`` (`sparsekv_jax.pallas.sae_decode`:
    the rows gathered into registers, never written out; its own gradient), or ``"auto"``: the
    kernel on a GPU where it applies, else XLA (``backend``'s platform; ``None``: this process's
    default); the kernel runs interpreted where ``backend`` says (off a GPU, for tests). Both return fp32.
    """
    S, D, W = sae.stack_shape, sae.d_in, sae.width
    s = math.prod(S)
    kk = ids.shape[-1]
    batch = tuple(ids.shape[len(S):-1])
    w_dec, b_dec = sae.w_dec.reshape(s, W, D), sae.b_dec.reshape(s, D)
    ids3, acts3 = ids.reshape(s, -1, kk), acts.reshape(s, -1, kk)
    out = dispatch.gather_decode(backend, resolve_decode(method, D, backend), w_dec, b_dec, ids3, acts3)
    return out.reshape(*S, *batch, D)


def resolve_decode(method: str, d_in: int, backend: Backend | None = None) -> str:
    """``"auto"`` → ``"pallas"`` on a GPU (``backend``'s platform; ``None``: this process's default) for a
    power-of-two ``d_in`` (experiments/diary/BENCHMARKS_DIARY.md), else ``"xla"`` (`dispatch.sae_gather_method`)."""
    if method not in DECODE_METHODS:
        raise ValueError(f"decode method {method!r} is not one of {DECODE_METHODS}")
    if method == "pallas" and not gather_kernels_apply(d_in):
        raise ValueError(f"the Pallas decode needs a power-of-two d_in in [16, 1024]; got {d_in}")
    if method == "auto":
        return dispatch.sae_gather_method(backend, d_in)
    return method


def selected_activations(sae: TopKSAE, x: jax.Array, ids: jax.Array, method: str = "auto",
                         backend: Backend | None = None, x_grad: bool = False) -> jax.Array:
    """``ReLU(W_enc (x − b_dec) + b_enc)`` at the latents ``ids`` only: ``[*stack, *batch, k]``, fp32.

    The same values as ``activations_at(pre_activations(sae, x), ids)`` (up to rounding: one dot of
    ``d_in`` per entry instead of a matmul's), without the dense pre-activations in the gradient:
    ``∂W_enc`` is a scatter of the ``N·k`` rows ``∂act · (x − b_dec)`` (`sparsekv_jax.pallas.sae_decode`)
    instead of a dense ``[N, width]`` gradient and an ``xᵀ · ∂pre`` matmul; ``x`` gets no gradient unless
    ``x_grad`` (then ``∂x = Σ_j ∂pre_j W_enc[:, id_j]``, the decoder kernel; training data needs none).
    The encoder runs in fp32 here whatever a step's ``compute_dtype`` (which only feeds the selection).
    ``method`` as in `decode` (the same kernels: the dot is the decoder's gradient and vice versa).
    """
    s, _, xc, w, bias = _encoder_terms(sae, x)
    if not x_grad:
        xc = jax.lax.stop_gradient(xc)  # data: its cotangent (the decoder kernel) is never asked for
    kk = ids.shape[-1]
    ids3 = ids.reshape(s, -1, kk)
    table = jnp.swapaxes(w, 1, 2)  # [s, W, D]: one row per latent
    dots = dispatch.gather_dot(backend, resolve_decode(method, sae.d_in, backend), table, ids3, xc)
    pre_at = dots + jax.vmap(lambda b, i: b[i])(bias, ids3)
    return jax.nn.relu(pre_at).reshape(*ids.shape)


def reconstruct(sae: TopKSAE, x: jax.Array, *, method: str = "auto") -> jax.Array:
    """``decode(encode(x))``."""
    ids, acts = encode(sae, x, method=method)
    return decode(sae, ids, acts)


def dense_latents(ids: jax.Array, acts: jax.Array, width: int) -> jax.Array:
    """The dense latent vector ``z`` ``[..., width]`` (analysis and tests; training never builds it)."""
    z = jnp.zeros((*ids.shape[:-1], width), acts.dtype)
    return jnp.put_along_axis(z, ids, acts, axis=-1, inplace=False)


def merge_heads(ids: jax.Array, acts: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """One token's feature set from its heads' features: ``[..., H, k_in]`` → ``[..., k]``.

    A feature's token activation is the sum of its activations over the heads; the token keeps the
    ``k`` features of largest sum (descending). Sparse: sorts the ``H * k_in`` (id, act) pairs and
    sums runs of equal ids, never a ``[width]`` vector. Rows with fewer than ``k`` distinct
    features are padded with activation 0 (their ids are unspecified).
    """
    *lead, H, kin = ids.shape
    n = H * kin
    fid = ids.reshape(*lead, n)
    a = acts.reshape(*lead, n).astype(jnp.float32)
    fid, a = jax.lax.sort((fid, a), dimension=-1, num_keys=1)
    starts = jnp.concatenate([jnp.ones((*lead, 1), bool), fid[..., 1:] != fid[..., :-1]], axis=-1)
    ends = jnp.concatenate([starts[..., 1:], jnp.ones((*lead, 1), bool)], axis=-1)

    def seg_add(left, right):  # segmented prefix sum: a run restarts at each start flag
        fl, vl = left
        fr, vr = right
        return fl | fr, jnp.where(fr, vr, vl + vr)

    _, run_sum = jax.lax.associative_scan(seg_add, (starts, a), axis=a.ndim - 1)
    score = jnp.where(ends, run_sum, -1.0)  # one entry per distinct feature: its run's end
    top, pos = jax.lax.top_k(score, min(k, n))
    out_ids = jnp.take_along_axis(fid, pos, axis=-1)
    out_acts = jnp.maximum(top, 0.0)
    if k > n:
        pad = [(0, 0)] * len(lead) + [(0, k - n)]
        out_ids, out_acts = jnp.pad(out_ids, pad), jnp.pad(out_acts, pad)
    return out_ids.astype(jnp.int32), out_acts
