"""Fidelity of a KV policy to full attention on the same prompt.

Quality scores say whether an answer survived; these metrics say how far a policy's computation
drifted from full attention, per sample, even when the answer did not change:

* ``kl_first``: KL(full ‖ policy) of the next-token distribution at the first answer token
  (the logits after the prompt, or after the suffix in question-agnostic mode).
* ``kl_mean``: the same KL teacher-forced along full attention's greedy answer, averaged over
  the answer's steps (stop token included).
* ``top1_agreement``: fraction of those steps where the policy's argmax equals full attention's.
* ``layer_rel_error``: per layer, ``‖o_policy − o_full‖ / ‖o_full‖`` of the attention outputs
  (all query heads of the layer flattened) at each teacher-forced decode step, averaged over the
  steps; ``layer_rel_error_mean`` averages it over layers. Only decode steps are compared (the
  first answer token comes from prefill, where only the logits are compared), so an answer of a
  single token has no attention-output error (``None``).

Everything is batched: prompts are right-padded ``[B, T]`` with ``lengths`` as for `generate`.
Compute the reference once with :func:`reference` and compare any number of policies with
:func:`compare`; :func:`fidelity` does both.

The reference and every policy compared with it run on one `sparsekv_jax.Backend` (``backend=``,
e.g. ``Backend(kv_dtype="int8")``, as ``sparsekv eval --kv-dtype`` passes): fidelity is to full
attention *on the same cache*, so a quantised run measures what the policy loses on top of the
quantisation. To measure a quantised cache against the model-dtype one, compare with the
reference's ``inputs["backend"]`` replaced (scripts/kv_quant_show.py ``fidelity``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.backend import Backend
from sparsekv_jax.generate import PAD_TOKEN, generate, teacher_force
from sparsekv_jax.models.params import Params
from sparsekv_jax.policies.base import Dense, Policy

__all__ = ["Reference", "compare", "fidelity", "identical", "kl_divergence", "reference"]


def kl_divergence(p_logits: jax.Array, q_logits: jax.Array) -> jax.Array:
    """``KL(softmax(p) ‖ softmax(q))`` over the last axis, in fp32 (natural log, nats).

    Tokens where ``p`` has zero probability contribute nothing; the result is clipped at 0 (it
    can come out at ``-1e-9`` from rounding).
    """
    logp = jax.nn.log_softmax(jnp.asarray(p_logits, jnp.float32), axis=-1)
    logq = jax.nn.log_softmax(jnp.asarray(q_logits, jnp.float32), axis=-1)
    p = jnp.exp(logp)
    terms = jnp.where(p > 0, p * (logp - logq), 0.0)
    return jnp.maximum(terms.sum(-1), 0.0)


@dataclasses.dataclass(frozen=True)
class Reference:
    """Full attention's answer and what the policy is compared with.

    Attributes:
      forced: ``[B, N]`` full attention's greedy answer (stop token included; padding replaced
        by token 0, masked out by ``steps``).
      steps: ``[B]`` answer length per row (``num_generated`` of the greedy run).
      logits: ``[B, N, V]`` fp32 teacher-forced full-attention logits (``logits[:, i]`` predicts
        ``forced[:, i]``).
      attn: ``[N - 1, L, B, Hq, D]`` full-attention outputs of each decode step, or ``None``
        when ``N == 1``.
      inputs: the keyword arguments (``tokens``, ``lengths``, ``question_start``, ``suffix``,
        ``suffix_lengths``, ``page_size``, ``mesh``, ``backend``) the policy runs are given.
    """

    forced: jax.Array
    steps: np.ndarray
    logits: jax.Array
    attn: jax.Array | None
    inputs: dict[str, Any]


def reference(params: Params, tokens: Any, *, lengths: Any = None, question_start: Any = None, suffix: Any = None,
              suffix_lengths: Any = None, max_new_tokens: int = 32, stop_tokens: tuple[int, ...] | None = None,
              page_size: int = 16, forced: Any = None, steps: Any = None, mesh: Any = None,
              backend: Backend | None = None) -> Reference:
    """Full attention's greedy answer to each prompt and its teacher-forced logits/attention outputs.

    ``forced`` ``[B, N]`` (with ``steps`` ``[B]`` valid tokens per row) gives the answer instead
    of generating it (e.g. the greedy tokens of an earlier full-attention `generate` call, on the
    same ``backend``). ``question_start`` (where each row's question begins in ``tokens``,
    question-aware prompts) is handed on to the policies :func:`compare` runs, as are ``mesh``
    (`generate`'s device mesh) and ``backend`` (`generate`'s `Backend`, its ``kv_dtype`` included;
    default the platform's): full attention and the policies run on the same cache.
    """
    if backend is not None and not isinstance(backend, Backend):
        raise ValueError(f"backend must be a sparsekv_jax.Backend, got {type(backend).__name__}")
    if forced is None:
        out = generate(params, Dense(), tokens, lengths=lengths, question_start=question_start,
                       max_new_tokens=max_new_tokens, stop_tokens=stop_tokens, page_size=page_size, suffix=suffix,
                       suffix_lengths=suffix_lengths, mesh=mesh, backend=backend)
        forced, steps = np.asarray(out.tokens), np.asarray(out.num_generated)
    forced = np.asarray(forced)
    steps = np.asarray(forced.shape[1] if steps is None else steps).reshape(-1)
    if steps.shape[0] == 1 and forced.shape[0] > 1:
        steps = np.full((forced.shape[0],), int(steps[0]))
    n = max(1, int(steps.max()))
    forced = np.where(forced[:, :n] == PAD_TOKEN, 0, forced[:, :n]).astype(np.int32)
    inputs = {"tokens": tokens, "lengths": lengths, "question_start": question_start, "suffix": suffix,
              "suffix_lengths": suffix_lengths, "page_size": page_size, "mesh": mesh, "backend": backend}
    logits, attn = teacher_force(params, Dense(), forced=forced, collect_attention=n > 1, **inputs)
    return Reference(forced=jnp.asarray(forced), steps=steps, logits=logits, attn=attn, inputs=inputs)


@jax.jit
def _metrics(ref_logits: jax.Array, logits: jax.Array, steps: jax.Array, ref_attn: jax.Array | None,
             attn: jax.Array | None) -> dict[str, jax.Array]:
    n = ref_logits.shape[1]
    valid = jnp.arange(n)[None, :] < steps[:, None]  # [B, N]
    count = jnp.maximum(valid.sum(1), 1)
    kl = kl_divergence(ref_logits, logits)  # [B, N]
    agree = jnp.argmax(ref_logits, -1) == jnp.argmax(logits, -1)
    res = {
        "kl_first": kl[:, 0],
        "kl_mean": jnp.where(valid, kl, 0.0).sum(1) / count,
        "kl_max": jnp.where(valid, kl, 0.0).max(1),
        "top1_agreement": jnp.where(valid, agree, False).sum(1) / count,
    }
    if ref_attn is not None:
        diff = (attn.astype(jnp.float32) - ref_attn.astype(jnp.float32)).reshape(*attn.shape[:3], -1)
        ref = ref_attn.astype(jnp.float32).reshape(*attn.shape[:3], -1)
        rel = jnp.linalg.norm(diff, axis=-1) / jnp.maximum(jnp.linalg.norm(ref, axis=-1), 1e-30)  # [N-1, L, B]
        dvalid = (jnp.arange(1, n)[:, None] < steps[None, :])[:, None, :]  # decode step j predicts token j+1
        dcount = dvalid.sum(0)  # [1, B]
        res["layer_rel_error"] = (jnp.where(dvalid, rel, 0.0).sum(0) / jnp.maximum(dcount, 1)).T  # [B, L]
        res["decode_steps"] = dcount[0]
    return res


def compare(params: Params, policy: Policy, ref: Reference) -> list[dict[str, Any]]:
    """Fidelity metrics of ``policy`` against the full-attention ``ref``, one dict per row
    (``policy`` runs on ``ref.inputs``: the reference's prompt, mesh and backend).

    Keys: ``kl_first``, ``kl_mean``, ``kl_max``, ``top1_agreement``, ``steps`` (answer tokens
    compared), ``layer_rel_error`` (list over layers, or ``None``) and ``layer_rel_error_mean``.
    """
    logits, attn = teacher_force(params, policy, forced=ref.forced, collect_attention=ref.attn is not None,
                                 **ref.inputs)
    m = _metrics(ref.logits, logits, jnp.asarray(ref.steps, jnp.int32), ref.attn, attn)
    m = jax.tree.map(np.asarray, m)
    rows = []
    for b in range(ref.forced.shape[0]):
        row: dict[str, Any] = {k: float(m[k][b]) for k in ("kl_first", "kl_mean", "kl_max", "top1_agreement")}
        row["steps"] = int(ref.steps[b])
        if "layer_rel_error" in m and int(m["decode_steps"][b]) > 0:
            errs = [float(e) for e in m["layer_rel_error"][b]]
            row["layer_rel_error"] = errs
            row["layer_rel_error_mean"] = float(np.mean(errs))
        else:
            row["layer_rel_error"] = None
            row["layer_rel_error_mean"] = None
        rows.append(row)
    return rows


def identical(ref: Reference, num_layers: int) -> list[dict[str, Any]]:
    """What :func:`compare` returns for full attention itself (exact zeros), without running it."""
    rows = []
    for b in range(ref.forced.shape[0]):
        decode = ref.attn is not None and int(ref.steps[b]) > 1
        rows.append({"kl_first": 0.0, "kl_mean": 0.0, "kl_max": 0.0, "top1_agreement": 1.0,
                     "steps": int(ref.steps[b]), "layer_rel_error": [0.0] * num_layers if decode else None,
                     "layer_rel_error_mean": 0.0 if decode else None})
    return rows


def fidelity(params: Params, policy: Policy, tokens: Any, *, lengths: Any = None, question_start: Any = None,
             suffix: Any = None, suffix_lengths: Any = None, max_new_tokens: int = 32,
             stop_tokens: tuple[int, ...] | None = None, page_size: int = 16, mesh: Any = None,
             backend: Backend | None = None) -> list[dict[str, Any]]:
    """:func:`reference` then :func:`compare`: fidelity of ``policy`` on each prompt of the batch
    (both on ``backend`` and ``mesh``)."""
    ref = reference(params, tokens, lengths=lengths, question_start=question_start, suffix=suffix,
                    suffix_lengths=suffix_lengths, max_new_tokens=max_new_tokens, stop_tokens=stop_tokens,
                    page_size=page_size, mesh=mesh, backend=backend)
    return compare(params, policy, ref)
