"""The SAE optimizer: Adam with unit-norm decoder rows, as optax transformations.

Top-K SAEs keep each decoder row (the direction a latent writes) at unit norm; otherwise the
model can shrink activations and grow rows, and latents' scales drift apart. Following Gao et al.
(2024, "Scaling and evaluating sparse autoencoders", §A.1; openai/sparse_autoencoder's
``unit_norm_decoder_grad_adjustment_``) and EleutherAI/sparsify
(``remove_gradient_parallel_to_decoder_directions``), the gradient's component parallel to each
row is projected out before Adam, and the rows are renormalised after the step. Both are
`optax.GradientTransformation`s on `TopKSAE` params (stacked or not):

* `project_decoder_gradient` — first in the chain: ``g_i ← g_i − (g_i·ŵ_i) ŵ_i``;
* `unit_norm_decoder` — last in the chain: rewrites the decoder update ``u`` into
  ``(w + u)/‖w + u‖ − w``, so that ``optax.apply_updates`` lands exactly on the unit sphere.

`make_optimizer` chains them around Adam (the S³ paper's optimizer, lr 1e-3, Table 6); wrap it in
``optax.inject_hyperparams`` to change the learning rate from step to step (`lr_at`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from sparsekv_jax.sae.config import SCHEDULES
from sparsekv_jax.sae.model import TopKSAE


def _unit_rows(w: jax.Array) -> jax.Array:
    return w / jnp.maximum(jnp.linalg.norm(w, axis=-1, keepdims=True), 1e-12)


def project_decoder_gradient() -> optax.GradientTransformation:
    """Remove from each decoder row's gradient its component along the row (params: `TopKSAE`)."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates: TopKSAE, state, params: TopKSAE | None = None):
        if params is None:
            raise ValueError("project_decoder_gradient needs params")
        w = _unit_rows(params.w_dec)
        g = updates.w_dec
        return updates.replace(w_dec=g - jnp.sum(g * w, axis=-1, keepdims=True) * w), state

    return optax.GradientTransformation(init, update)


def unit_norm_decoder() -> optax.GradientTransformation:
    """Make the decoder update land on unit-norm rows: ``u ← (w + u)/‖w + u‖ − w`` (last in a chain)."""

    def init(params):
        del params
        return optax.EmptyState()

    def update(updates: TopKSAE, state, params: TopKSAE | None = None):
        if params is None:
            raise ValueError("unit_norm_decoder needs params")
        w = params.w_dec
        return updates.replace(w_dec=_unit_rows(w + updates.w_dec) - w), state

    return optax.GradientTransformation(init, update)


def make_optimizer(learning_rate: float | optax.Schedule = 1e-3, b1: float = 0.9, b2: float = 0.999,
                   eps: float = 1e-8) -> optax.GradientTransformation:
    """Projected gradient → Adam → learning rate → unit-norm decoder rows."""
    return optax.chain(
        project_decoder_gradient(),
        optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
        optax.scale_by_learning_rate(learning_rate),
        unit_norm_decoder(),
    )


def lr_at(step: jax.Array, peak: float, warmup: jax.Array | int, total: jax.Array | int,
          schedule: str = "wsd", decay_fraction: float = 0.2) -> jax.Array:
    """Learning rate at ``step`` (jit-friendly: ``warmup`` and ``total`` may be traced).

    Linear warm-up over ``warmup`` steps, then ``constant``; ``wsd`` (warm-up, stable, decay):
    constant, then linear decay to 0 over the last ``decay_fraction`` of ``total`` steps;
    ``cosine``: cosine decay to 0 from the end of warm-up to ``total``.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r} is not one of {SCHEDULES}")
    s = jnp.asarray(step, jnp.float32)
    total = jnp.maximum(jnp.asarray(total, jnp.float32), 1.0)
    warm = jnp.asarray(warmup, jnp.float32)
    factor = jnp.minimum((s + 1) / jnp.maximum(warm, 1.0), 1.0)
    if schedule == "wsd":
        decay_steps = jnp.maximum(jnp.round(decay_fraction * total), 1.0)
        factor = factor * jnp.clip((total - s) / decay_steps, 0.0, 1.0)
    elif schedule == "cosine":
        span = jnp.maximum(total - warm, 1.0)
        progress = jnp.clip((s - warm) / span, 0.0, 1.0)
        factor = factor * 0.5 * (1 + jnp.cos(jnp.pi * progress))
    return peak * factor
