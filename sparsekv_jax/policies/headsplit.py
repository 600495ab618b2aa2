"""A head-type split in the spirit of DuoAttention (Xiao et al., 2024, *DuoAttention: Efficient
Long-Context LLM Inference with Retrieval and Streaming Heads*): streaming heads keep attention
sinks and a recent window, retrieval heads keep the rest of the layer's budget.

DuoAttention gives full attention to its retrieval heads and a constant sinks + recent cache to its
streaming heads, and finds which is which by training a gate per KV head on synthetic passkey
prompts (the paper deploys 25% retrieval heads for MHA models, 50% for GQA ones). Here the split is
a budget allocation over a scored compressor, ``HeadSplit(SnapKV(0.25))``: the layer's total is the
inner's uniform total, moved from the streaming heads to the retrieval heads, which keep their best
entries by the inner's scores. The per-head scores deciding the split are *not* DuoAttention's
learned gates but a cheaper proxy in their spirit, computed by ``sparsekv calibrate --heads``
(`sparsekv_jax.eval.head_calibration.calibrate_heads`): per KV head, the share of the attention mass of a
prompt's last queries that falls outside the sinks and the recent window (what a streaming head
would lose), averaged over RULER needle prompts. Shipped for SmolLM2 and Qwen2.5-Coder 0.5B / 1.5B
(``policies/calibration/*_heads.json``, found by the model's shapes).

The budget, per (layer, row), with ``n`` the inner's per-head count for the row, ``H`` the KV
heads, ``R = round(retrieval_share·H)`` of them retrieval heads (the layer's ``R`` highest head
scores; ties: the lower head), ``w = sinks + window``:

* every streaming head keeps ``s = min(n, w)``: its first ``sinks`` entries and its most recent
  ones (the inner's scores are not used for it);
* the retrieval heads share ``H·n - (H-R)·s``: each gets the floor of the mean, the ones with the
  higher head scores one more, clipped at the row's length (they then keep the whole prompt);
* what the clip leaves goes back to the streaming heads, spread the same way (floor of the mean,
  higher head scores first), each extending its recent window.

So the layer keeps exactly ``H·n`` entries, every head at most the row's length. ``R = 0`` is a
StreamingLLM-shaped cache of ``n`` per head, ``R = H`` the inner itself. A model with one KV head
per layer (Gemma 3 270M) has nothing to split: ``R = 1 = H`` (the inner) at a share of a half or
more, ``R = 0`` below.

Memory: as `AdaKV`, today's cache has one capacity per layer, sized for the largest head,
``min(prompt, ceil((H·n - (H-R)·s) / R))`` entries (``2n - s`` with half the heads retrieving),
plus the tokens still to come; streaming heads leave holes (bias −∞) until the per-head page pool
(issue #38, item 1) lands.
"""

from __future__ import annotations

import glob
import json
import os
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.cache import KVCache
from sparsekv_jax.policies.adakv import BudgetAllocation, head_order, keep_counts
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.common import budget_tokens, force_sinks_and_window, row_budgets
from sparsekv_jax.policies.snapkv import SnapKV

CALIBRATION_DIR = os.path.join(os.path.dirname(__file__), "calibration")
HEADS_SUFFIX = "_heads.json"
# the config fields a shipped head calibration is matched on (a model has no name in its config)
FINGERPRINT = ("family", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
HOW_TO_CALIBRATE = ("compute them with `sparsekv calibrate --heads --model MODEL --out heads.json` and pass "
                    "calibration='heads.json', or pass head_scores=[L, Hkv] array in Python")


def retrieval_heads(share: float, num_kv_heads: int) -> int:
    """``round(share·H)`` (halves up, exact arithmetic) retrieval heads per layer."""
    s = Fraction(share).limit_denominator(1000)
    return int((2 * s.numerator * num_kv_heads + s.denominator) // (2 * s.denominator))


def split_counts(head_scores: jax.Array, keep: jax.Array, length: jax.Array, retrieval: int, streaming: int
                 ) -> jax.Array:
    """``[L, B, H]`` entries each (layer, row, head) keeps (the module docstring's rule).

    ``head_scores`` ``[L, H]`` (higher: more of a retrieval head), ``keep`` ``[B]`` the uniform count,
    ``length`` ``[B]`` the rows' lengths, ``retrieval`` the retrieval heads per layer (static),
    ``streaming`` the sinks + window a streaming head keeps.
    """
    L, H = head_scores.shape
    rank = jnp.argsort(jnp.argsort(-head_scores.astype(jnp.float32), axis=-1, stable=True), axis=-1)  # [L, H]
    keep = keep.astype(jnp.int32)[None, :, None]  # [1, B, 1]
    length = length.astype(jnp.int32)[None, :, None]
    if retrieval == 0:
        return jnp.broadcast_to(keep, (L, keep.shape[1], H))
    base = jnp.minimum(keep, streaming)
    rest = H * keep - (H - retrieval) * base  # the retrieval heads' share
    is_ret = (rank < retrieval)[:, None, :]  # [L, 1, H]
    ret = jnp.minimum(rest // retrieval + (rank[:, None, :] < rest % retrieval), length)
    if retrieval == H:
        return jnp.broadcast_to(ret, (L, keep.shape[1], H)).astype(jnp.int32)
    extra = jnp.maximum(rest - retrieval * length, 0)  # what the clip at the prompt leaves
    srank = rank[:, None, :] - retrieval
    stream = base + extra // (H - retrieval) + (srank < extra % (H - retrieval))
    return jnp.where(is_ret, ret, stream).astype(jnp.int32)


def shipped_head_calibration(config: Any) -> str | None:
    """The shipped ``*_heads.json`` whose recorded config matches ``config``, or ``None``."""
    for path in sorted(glob.glob(os.path.join(CALIBRATION_DIR, "*" + HEADS_SUFFIX))):
        with open(path) as f:
            recorded = json.load(f).get("config", {})
        if all(recorded.get(k) == getattr(config, k, None) for k in FINGERPRINT):
            return path
    return None


def load_head_scores(calibration: str) -> np.ndarray:
    """``[L, Hkv]`` head scores from a ``sparsekv calibrate --heads`` JSON file (a path, or the name
    of a shipped one: ``'smollm2'`` is ``calibration/smollm2_heads.json``)."""
    path = calibration
    if not os.path.exists(path):
        path = os.path.join(CALIBRATION_DIR, calibration + HEADS_SUFFIX)
        if not os.path.exists(path):
            shipped = sorted(os.path.basename(p)[:-len(HEADS_SUFFIX)]
                             for p in glob.glob(os.path.join(CALIBRATION_DIR, "*" + HEADS_SUFFIX)))
            raise ValueError(f"HeadSplit calibration={calibration!r}: no such file, and no shipped head calibration "
                             f"of that name (shipped: {shipped}); {HOW_TO_CALIBRATE}")
    with open(path) as f:
        data = json.load(f)
    try:
        return np.asarray(data["head_scores"], np.float32)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"HeadSplit calibration file {path} lacks head_scores: {e}") from None


@struct.dataclass
class HeadSplit(BudgetAllocation):
    """Retrieval heads keep more, streaming heads sinks + window: ``HeadSplit(SnapKV(0.25))``.

    See the module docstring for the rule and where the head scores come from.

    Args:
      inner: the scored compressor whose budget is shared and whose scores rank the retrieval heads'
        entries (default ``SnapKV(0.25)``).
      retrieval_share: the fraction of each layer's KV heads that are retrieval heads (default 0.5,
        DuoAttention's ratio for GQA models; it uses 0.25 for MHA ones).
      sinks: the first entries every streaming head keeps (default 64).
      window: the recent entries every streaming head keeps (default 256; DuoAttention's release
        deploys its streaming heads with 64 + 256 tokens of sinks and recent window).
      head_scores: ``[L, Hkv]`` per-head scores (higher: a retrieval head), a pytree leaf; ``None``
        (default): loaded from ``calibration``.
      calibration: a ``sparsekv calibrate --heads`` JSON file or the name of a shipped one; ``None``
        (default): the shipped calibration of the bound model, if there is one (else `bind` raises,
        naming how to compute one).
      num_kv_heads: set by `bind` from the model (sizes the compressed cache).
    """

    retrieval_share: float = struct.field(pytree_node=False, default=0.5)
    sinks: int = struct.field(pytree_node=False, default=64)
    window: int = struct.field(pytree_node=False, default=256)
    head_scores: Any = None
    calibration: str | None = struct.field(pytree_node=False, default=None)
    num_kv_heads: int = struct.field(pytree_node=False, default=0)

    def __post_init__(self) -> None:
        super().__post_init__()
        share = self.retrieval_share
        if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0.0 <= share <= 1.0:
            raise ValueError(f"HeadSplit retrieval_share={share!r} must be a fraction in [0, 1] "
                             "(DuoAttention: 0.5 for GQA models, 0.25 for MHA)")
        for name in ("sinks", "window"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"HeadSplit {name}={value!r} must be an integer >= 0")
        if self.sinks + self.window < 1:
            raise ValueError(f"HeadSplit sinks={self.sinks}, window={self.window}: a streaming head must keep at "
                             "least one entry")
        if self.calibration is not None and not isinstance(self.calibration, str):
            raise ValueError(f"HeadSplit calibration={self.calibration!r} must be a file path or a shipped name")

    @classmethod
    def covering(cls) -> HeadSplit:
        return cls(SnapKV(1.0))

    @property
    def retrieval(self) -> int:
        """Retrieval heads per layer (needs `bind`)."""
        return retrieval_heads(self.retrieval_share, self.num_kv_heads)

    def bind(self, setup: Setup) -> HeadSplit:
        cfg = setup.config
        bound = self.replace(inner=self.inner.bind(setup), num_kv_heads=int(cfg.num_kv_heads))
        if budget_tokens(self.inner.budget, max(setup.prompt_len, 1)) >= setup.prompt_len:
            return bound  # every row keeps its whole prompt: no compression, no head scores needed
        scores = self.head_scores
        if scores is None:
            source = self.calibration if self.calibration is not None else shipped_head_calibration(cfg)
            if source is None:
                raise ValueError(f"HeadSplit: no head calibration is shipped for this model ({cfg.family}, "
                                 f"{cfg.num_layers} layers, {cfg.num_kv_heads} KV heads) and none was given: "
                                 f"{HOW_TO_CALIBRATE}")
            scores = load_head_scores(source)
        arr = np.asarray(scores, np.float32)
        want = (int(cfg.num_layers), int(cfg.num_kv_heads))
        if arr.shape != want:
            raise ValueError(f"HeadSplit head_scores of shape {arr.shape} do not match the model's "
                             f"[layers, KV heads] = {list(want)}" + (f" (calibration={self.calibration!r})"
                                                                     if self.calibration else ""))
        if not np.isfinite(arr).all():
            raise ValueError("HeadSplit head_scores must be finite")
        return bound.replace(head_scores=jnp.asarray(arr))

    def streaming_tokens(self) -> int:
        return self.sinks + self.window

    def max_kept(self, prompt_len: int) -> int:
        if self.num_kv_heads < 1:
            raise ValueError("HeadSplit: the compressed capacity depends on the model's KV heads: bind the policy "
                             "first (policy.bind(Setup(config=...)); generate and Session do)")
        n = budget_tokens(self.inner.budget, prompt_len)
        H, R = self.num_kv_heads, self.retrieval
        if R == 0:
            return n
        return -(-(H * n - (H - R) * min(n, self.streaming_tokens())) // R)

    def allocate(self, scores: jax.Array, length: jax.Array, keep: jax.Array, floor: jax.Array) -> jax.Array:
        return split_counts(self.head_scores, keep, length, self.retrieval, self.streaming_tokens())

    def compress(self, cache: KVCache, observations: Any, capacity: int, prompt: Prompt) -> KVCache:
        if self.head_scores is None:
            raise ValueError("HeadSplit: no head scores: bind the policy first (generate and Session do)")
        inner = self.inner
        keep = row_budgets(inner.budget, cache.length)
        sinks, window = inner.forced_counts(keep)
        scores = force_sinks_and_window(inner.score(cache, observations, prompt), cache.length, sinks, window)
        counts = self.allocate(scores, cache.length, keep, None)
        # streaming heads rank their slots sinks first, then the most recent (slot = position after prefill)
        S = scores.shape[-1]
        slot = jnp.arange(S, dtype=jnp.float32)
        recency = jnp.where(slot < self.sinks, 2.0 * S - slot, slot)
        rank = jnp.argsort(jnp.argsort(-self.head_scores.astype(jnp.float32), axis=-1, stable=True), axis=-1)
        streaming = (rank >= self.retrieval)[:, None, :, None]  # [L, 1, H, 1]
        scores = jnp.where(streaming, recency, scores.astype(jnp.float32))
        _, slots = head_order(scores, cache.length)
        return keep_counts(cache, slots, counts, capacity)
