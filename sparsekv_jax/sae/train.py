"""One training step of a stack of Top-K SAEs (one per target layer), trained together.

The recipe of Gao et al. (2024, "Scaling and evaluating sparse autoencoders"), as in
openai/sparse_autoencoder and EleutherAI/sparsify:

* **Loss**: normalised MSE — the fraction of variance unexplained, ``FVU = Σ‖x − x̂‖² / Σ‖x − x̄‖²``
  over the batch — plus ``aux_coef`` (1/32) times the **AuxK** loss: the top ``aux_k`` (d_in/2)
  *dead* latents reconstruct the main reconstruction's residual ``e = x − x̂`` (stopped gradient),
  ``Σ‖e − ê‖² / Σ‖x − x̄‖²``, scaled down by ``min(dead / aux_k, 1)`` when few are dead
  (sparsify). This gives dead latents a gradient and revives them (Gao et al. §A.2).
* **Dead latents**: a latent is dead once it has not fired (activation > 0) for ``dead_after``
  training vectors (10M in both references); counted per latent in steps since it last fired.
* **Opt-in, neither the paper's nor the references'**: ``dead_bias_step`` raises the encoder bias of
  every dead latent after each step (`TrainConfig`), for latents closed on every vector, which AuxK
  cannot reach.
* **Opt-in**: ``w_dec_init="data"`` draws the decoder rows from the init sample (`TrainConfig`).
* **Init**: ``b_dec`` at the geometric median of a data sample (Weiszfeld's algorithm; the
  references use the geom_median package / the batch mean), tied encoder = decoderᵀ, and the
  encoder scaled so that initial reconstructions have the data's norm (openai's
  ``init_from_data_``).
* **Optimizer**: `sparsekv_jax.sae.optim.make_optimizer` — Adam between a projected decoder
  gradient and unit-norm decoder rows — with the learning rate set every step (`lr_at`).

Layers are independent SAEs: the loss is the sum of the per-layer losses, so each layer's
parameters get their own layer's gradient, and Adam's per-parameter scaling keeps them apart.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from sparsekv_jax.sae.config import TrainConfig
from sparsekv_jax.sae.model import (
    TopKSAE,
    activations_at,
    decode,
    init_sae,
    pre_activations,
    resolve_decode,
    resolve_select,
    select,
    select_ids,
    selected_activations,
)
from sparsekv_jax.sae.optim import lr_at, make_optimizer
from sparsekv_jax.sae.topk import relu_top_k

_LOWEST = float(jnp.finfo(jnp.float32).min)


@struct.dataclass
class TrainState:
    """Everything a step changes: the SAEs (stacked over layers), Adam, dead-latent counters."""

    sae: TopKSAE
    opt_state: Any
    steps_since_fired: jax.Array  # [L, width] int32
    step: jax.Array  # int32 scalar: steps done
    total_steps: jax.Array  # int32 scalar: the schedule's length (fixed at the start of a run)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """`make_optimizer` with an injectable learning rate (set every step from `lr_at`)."""
    return optax.inject_hyperparams(make_optimizer)(learning_rate=cfg.lr, b1=cfg.adam_b1, b2=cfg.adam_b2,
                                                    eps=cfg.adam_eps)


def geometric_median(x: jax.Array, iters: int = 64, eps: float = 1e-6) -> jax.Array:
    """Geometric median of the vectors ``x`` ``[..., N, D]`` → ``[..., D]`` (Weiszfeld, from the mean)."""
    x = x.astype(jnp.float32)

    def body(_, y):
        w = 1.0 / jnp.maximum(jnp.linalg.norm(x - y[..., None, :], axis=-1), eps)  # [..., N]
        return jnp.einsum("...n,...nd->...d", w, x) / jnp.sum(w, axis=-1)[..., None]

    return jax.lax.fori_loop(0, iters, body, jnp.mean(x, axis=-2))


@partial(jax.jit, static_argnames=("cfg",))
def init_train_state(key: jax.Array, sample: jax.Array, cfg: TrainConfig, total_steps: int | jax.Array) -> TrainState:
    """Fresh SAEs for each layer of ``sample`` ``[L, N, D]`` (data-based init, see the module docstring)."""
    if sample.ndim != 3:
        raise ValueError(f"sample must be [layers, vectors, d_in], got shape {tuple(sample.shape)}")
    L, _, D = sample.shape
    sample = sample.astype(jnp.float32)
    b_dec = geometric_median(sample) if cfg.b_dec_init == "geometric_median" else jnp.mean(sample, axis=1)
    sae = init_sae(key, D, cfg.width, cfg.k, stack=(L,), b_dec=b_dec)
    if cfg.w_dec_init == "data":  # opt-in (TrainConfig): rows from the sample, 1% of the random ones mixed in
        rows = jax.random.choice(jax.random.fold_in(key, 1), sample.shape[1], (cfg.width,),
                                 replace=cfg.width > sample.shape[1])
        picked = sample[:, rows] - b_dec[:, None]
        picked = picked / jnp.maximum(jnp.linalg.norm(picked, axis=-1, keepdims=True), 1e-12)
        w_dec = picked + 0.01 * sae.w_dec
        w_dec = w_dec / jnp.linalg.norm(w_dec, axis=-1, keepdims=True)
        sae = sae.replace(w_dec=w_dec, w_enc=jnp.swapaxes(w_dec, -1, -2))
    # scale the encoder so that the initial reconstructions have the data's norm (b_enc = 0, so the
    # activations and x̂ - b_dec are linear in the encoder's scale)
    probe = sample[:, : min(sample.shape[1], 4096)]
    ids, acts = select(pre_activations(sae, probe), cfg.k, cfg.topk)
    out_norm = jnp.linalg.norm(decode(sae, ids, acts, cfg.decode) - sae.b_dec[:, None], axis=-1).mean(-1)
    in_norm = jnp.linalg.norm(probe - sae.b_dec[:, None], axis=-1).mean(-1)
    scale = in_norm / jnp.maximum(out_norm, 1e-12)
    sae = sae.replace(w_enc=sae.w_enc * scale[:, None, None])
    return TrainState(sae=sae, opt_state=optimizer(cfg).init(sae),
                      steps_since_fired=jnp.zeros((L, cfg.width), jnp.int32),
                      step=jnp.zeros((), jnp.int32), total_steps=jnp.asarray(total_steps, jnp.int32))


def _total_variance(x: jax.Array) -> jax.Array:
    """``Σ‖x − x̄‖²`` per layer of ``x`` ``[L, N, D]``."""
    return jnp.sum(jnp.square(x - jnp.mean(x, axis=1, keepdims=True)), axis=(1, 2))


def losses(sae: TopKSAE, x: jax.Array, dead: jax.Array, cfg: TrainConfig,
           auxk: bool | None = None) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Summed training loss and per-layer parts for a batch ``x`` ``[L, N, D]``; ``dead`` ``[L, width]``.

    ``auxk``: compute the AuxK loss (``True``), skip it (``False``), or decide on the device from
    ``dead`` (``None``, a `lax.cond`). `train_step` decides outside the gradient instead: under
    autodiff the cond cost 1.9 ms of a 10.5 ms SmolLM2 step even when AuxK did not run (H200,
    experiments/diary/BENCHMARKS_DIARY.md)."""
    dtype = jnp.bfloat16 if cfg.compute_dtype == "bfloat16" else None
    # The fused encoder (GPU default, `resolve_select`) never writes the dense pre-activations: it
    # gives ids only. With it, or with the gather kernels (GPU default), the selected activations are
    # recomputed at their ids (`selected_activations`), whose gradient is a sparse scatter; otherwise
    # they are gathered from the dense pre-activations (`activations_at`).
    aux_k = cfg.resolved_aux_k(sae.d_in)
    fused = all(resolve_select(cfg.topk, sae.d_in, sae.width, kk, dtype) == "fused"
                for kk in ((cfg.k, aux_k) if cfg.aux_coef > 0 else (cfg.k,)))
    sparse = fused or resolve_decode(cfg.decode, sae.d_in) == "pallas"
    pre = None if fused else pre_activations(sae, x, dtype)  # [L, N, W]
    if sparse and not fused:
        pre = jax.lax.stop_gradient(pre)

    def activations(pre_or_masked, ids):
        return selected_activations(sae, x, ids, cfg.decode) if sparse else activations_at(pre_or_masked, ids)

    # ids need no order here (unordered is cheaper for the threshold kernel); the selection itself
    # is piecewise constant, so it is taken without a gradient
    if fused:
        ids = select_ids(sae, x, cfg.k, "fused")
    else:
        ids = relu_top_k(jax.lax.stop_gradient(pre), cfg.k, cfg.topk, ordered=False)[1]
    acts = activations(pre, ids)
    x_hat = decode(sae, ids, acts, cfg.decode)
    e = x - x_hat
    var = jnp.maximum(_total_variance(x), 1e-12)
    fvu = jnp.sum(jnp.square(e), axis=(1, 2)) / var

    def auxk_loss():
        if fused:  # the dead latents alone compete (the others count as 0, as the mask below makes them)
            masked = None
            aux_ids = select_ids(sae, x, aux_k, "fused", keep=dead)
        else:
            masked = jnp.where(dead[:, None, :], pre, _LOWEST)
            aux_ids = relu_top_k(jax.lax.stop_gradient(masked), aux_k, cfg.topk, ordered=False)[1]
        aux_acts = activations(masked, aux_ids)
        if sparse:  # fewer than aux_k dead: the live latents picked count as 0, as the mask makes them
            aux_acts = aux_acts * jax.vmap(lambda d, i: d[i])(dead, aux_ids).astype(aux_acts.dtype)
        e_hat = decode(sae, aux_ids, aux_acts, cfg.decode) - sae.b_dec[:, None]
        scale = jnp.minimum(jnp.sum(dead, axis=-1) / aux_k, 1.0)
        return scale * jnp.sum(jnp.square(e_hat - jax.lax.stop_gradient(e)), axis=(1, 2)) / var

    if cfg.aux_coef <= 0 or auxk is False:
        aux = jnp.zeros_like(fvu)
    elif auxk:
        aux = auxk_loss()
    else:  # only the taken branch runs: no second top-k while nothing is dead
        aux = jax.lax.cond(jnp.any(dead), auxk_loss, lambda: jnp.zeros_like(fvu))
    fired = jax.vmap(lambda i, a: jnp.zeros((sae.width,), jnp.int32).at[i.reshape(-1)].add(
        (a.reshape(-1) > 0).astype(jnp.int32)))(ids, acts) > 0
    parts = {"fvu": fvu, "auxk": aux, "l0": jnp.mean(jnp.sum(acts > 0, axis=-1), axis=-1).astype(jnp.float32),
             "fired": fired}
    return jnp.sum(fvu + cfg.aux_coef * aux), parts


def train_step(state: TrainState, x: jax.Array, cfg: TrainConfig) -> tuple[TrainState, dict[str, jax.Array]]:
    """One optimizer step on the batch ``x`` ``[L, batch_size, D]``; returns the new state and metrics.

    Metrics (per layer ``[L]`` unless noted): ``fvu``, ``auxk``, ``l0``, ``dead_fraction`` (after
    the step's firing counts), ``lr`` (scalar).
    """
    dead = state.steps_since_fired >= cfg.dead_after_steps
    x = x.astype(jnp.float32)

    def gradients(auxk: bool):
        return lambda: jax.value_and_grad(losses, has_aux=True)(state.sae, x, dead, cfg, auxk)

    # the AuxK decision taken outside the gradient: each branch is a whole forward + backward
    if cfg.aux_coef > 0:
        (_, parts), grads = jax.lax.cond(jnp.any(dead), gradients(True), gradients(False))
    else:
        (_, parts), grads = gradients(False)()
    lr = lr_at(state.step, cfg.lr, cfg.warmup_steps, state.total_steps, cfg.schedule, cfg.decay_fraction)
    opt_state = state.opt_state._replace(hyperparams={**state.opt_state.hyperparams, "learning_rate": lr})
    updates, opt_state = optimizer(cfg).update(grads, opt_state, state.sae)
    sae = optax.apply_updates(state.sae, updates)
    if cfg.dead_bias_step > 0:  # opt-in: reopen the gates of latents no gradient reaches (TrainConfig)
        sae = sae.replace(b_enc=sae.b_enc + cfg.dead_bias_step * dead.astype(sae.b_enc.dtype))
    since = jnp.where(parts["fired"], 0, state.steps_since_fired + 1)
    metrics = {"fvu": parts["fvu"], "auxk": parts["auxk"], "l0": parts["l0"],
               "dead_fraction": jnp.mean(since >= cfg.dead_after_steps, axis=-1), "lr": lr}
    return state.replace(sae=sae, opt_state=opt_state, steps_since_fired=since, step=state.step + 1), metrics
