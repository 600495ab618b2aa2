"""BSER (Block-aware Semantic Efficient Retention): question-guided block probing, (α, β) gating and
local expansion, as a question-aware compressor after one prefill pass (docs/BSER.md: ablations).

**Defaults are the paper's** (since 2026-11-27): token embeddings as ``E`` with (α, β) = (0.3, 0.7)
and blocks of 128 tokens. Measured on the real model (Qwen2.5-Coder-1.5B-Instruct, H200, RULER 8k
question-aware, n = 25 per task, paired bootstrap 95% intervals on the shared samples; records in
``docs/results/qwen2.5-coder-1.5b_h200/aware_8k``, docs/BSER.md "Defaults are the paper's since
2026-11-27"), at 25%: B = 128 over B = 64, +9.38 points [+5.39, +13.15] with hidden states (42.50
vs 33.12, 11 tasks) and +11.64 [+8.22, +14.89] with token embeddings (46.98 vs 35.35, 13 tasks);
token embeddings over hidden states at B = 128, +4.79 [+0.92, +8.57] (46.98 vs 42.20). Hidden
states at B = 64 had been the default (issue 36) from SmolLM2 ablations; on Gemma 3 270M the two
``E`` were not separated. Both stay as opt-ins: ``embedding="hidden"`` (with
per-model gates) and ``block_size=64``. BSER still trails SnapKV on Qwen (46.98 vs 63.73 at 25%):
experiments/bser_qwen_diagnosis.md.

* **Stage I.** The context (the prompt before ``question_start``) is cut into blocks of
  ``block_size`` tokens from position 0 (default 128, the paper's; ``block_size=64`` was the default
  before 2026-11-27, chosen for SmolLM2's 8k window: on Qwen a refined 64-token block kept too few
  tokens for a needle's digits, experiments/bser_qwen_diagnosis.md).
* **Stage II.** The question ``Q``: the last ``min(m, max_question)`` tokens from
  ``question_start`` on; a question shorter than ``min_question`` (32) tokens reaches back into
  the context to that length (an instruction with no content, e.g. LongBench lcc's 6-token "Next
  line of code:", probes with the code before it). Without a split (``question_start=None``, or an
  empty question) the last ``tail`` prompt tokens stand in for it — a *fallback*:
  question-agnostic, the real question is not in the prompt. In the top ``probe_layers`` layers the
  question's queries attend to every key
  (their causal softmax rows, 16 queries at a time: ``[16, T]`` scores, never ``[T, T]``),
  averaged over those layers, all query heads and the question: ``ā`` (Eq. 3, 4). Salience ``w``
  in each block (Eq. 4): ``"attention"`` (default) = ``ā`` renormalised in the block, i.e. the
  softmax of log-attention; ``"softmax"`` = the softmax of ``ā`` itself, as Eq. 4 is written —
  attention probabilities are ≪ 1, so that is uniform to 3 decimals (= mean pooling, measured);
  ``"mean"`` = uniform (the "without Stage II" ablation). ``R = Σ w·E`` (Eq. 5) and relevance
  ``s = cos(R, mean E of Q)``. ``E`` (``embedding``): ``"input"`` (default, the paper's) = the
  token embeddings (the input of layer 0); ``"hidden"`` = the hidden states entering the first
  probed layer, scaled to unit RMS (the default from issue #36 to 2026-11-27: in the SmolLM2
  full-size ablation, docs/BSER.md, it kept 85.7% of full on RULER 4k at 25% against 71.6%; on
  Qwen it lost, above). ``stage1="tokens"`` is the paper's
  "w/o Stage I" ablation: every context token is its own block (``s`` per token, ``w`` = 1, gated
  and ordered token by token; Stage III has nothing to expand in a one-token block, so a refined
  token is kept). ``centred`` subtracts the context's mean ``E`` first (spreads the
  cosines; off by default: with it the paper's thresholds refine the needle blocks). Attention
  sinks are left out of block representations (outlying states and attention mass; kept anyway).
* **Gating** with ``(alpha, beta)``: discard ``s ≤ α``, retain ``s ≥ β``, refine otherwise. Left
  unset they follow ``E``: the paper's (0.3, 0.7) for token embeddings; for hidden states, per
  model (`HIDDEN_THRESHOLDS`, set at `bind`), the values that discard / retain the same shares of
  blocks as (0.3, 0.7) do with token embeddings on a WikiText-2 calibration set
  (``scripts/bser_thresholds.py`` derives them; SmolLM2's for a model not in the table). A
  refined block keeps a share ρ (``expansion`` = 0.5, the paper's local expansion factor) of its
  context tokens: its anchors in ``ā`` order, each with every token within ``radius`` (2) of it
  inside the block, until ``round(ρ · n)`` tokens (``fill``; i.e. the top ``round(ρ · n)`` by the
  largest ``ā`` within ``radius``, ties by own ``ā``). The question attends to a fact's key words,
  not to its unknown value, so the key words are the anchors and the value after them comes in
  with the share. ``fill=False`` is the first version: a fixed ``anchors = round(ρ · block_size /
  (2·radius + 1))`` (6 for 64 tokens, 13 for 128); their neighbourhoods overlap on the key words and the
  value was lost (RULER niah_single_1, docs/BSER.md). ``refine="drop"``/``"keep"``: refined blocks
  discarded / kept whole (the "without Stage III" ablations). The question, the first ``sinks`` and the last
  ``window`` prompt tokens are always kept (when a budget is short: sinks, window, then the
  question's last tokens). Kept entries keep their RoPE positions; one index set per row, shared
  by all layers and KV heads (the paper's ``I``).

Two modes. **Thresholds** (``budget=None``, the paper's): the gated entries are kept. A cache's size
is static, so it is sized for ``max_kept`` (default 50%) of the prompt; a row whose gated set is
larger keeps its ``max_kept`` best, in the budget mode's order. **Budget** (a fraction or token
count, for matched comparisons): entries are taken in the order retained blocks (by block ``s``,
then ``ā``), refined tokens, then the rest (by block ``s``, then ``ā``), up to the budget. Refined
tokens compete across blocks by their Stage III salience (the largest ``ā`` within ``radius``,
then their own ``ā``: ``refine_order="salience"``): a fact cut at a block edge has its value at
the start of the next block, whose ``s`` is that of the background; ranked by their block's ``s``
(``refine_order="block"``, the first version) such tokens were cut at every budget.

Cost: the probe runs only in the probed layers and the Gram matrices of ``E``'s blocks
(``[B, T, block_size]``: ``|R|`` for any ``w`` chosen later) only in ``E``'s layer, each under a
``lax.cond`` (one predicate read per layer on a GPU, against ``[Hq, max_question, T]`` softmax rows
in every layer with ``gate="mask"``); the observations are stacked over all layers (zeros
elsewhere): ``num_layers × B × T × (block_size + 2) × 4`` bytes during the prefill.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from sparsekv_jax.cache import KVCache
from sparsekv_jax.policies.base import Policy, Prompt, Setup
from sparsekv_jax.policies.bser_probe import (
    descending_rank,
    dilate,
    embedding_stats,
    lex_rank,
    max_filter,
    probe_queries,
    question_attention,
    question_start,
)
from sparsekv_jax.policies.common import (
    KEEP,
    budget_tokens,
    check_budget,
    check_sinks_window,
    compact,
    force_sinks_and_window,
    row_budgets,
)

# (α, β) when not given. Token embeddings ("input"): the paper's (0.3, 0.7), on every model. Hidden
# states ("hidden"): per model, because their cosine scale differs by model (median block s on the
# calibration prompts: SmolLM2 0.936, Qwen2.5-Coder-1.5B 0.832, Gemma 3 270M 0.991), each from
# `python scripts/bser_thresholds.py --model M`: the hidden-state cosines at which as many calibration
# blocks are discarded / retained as (0.3, 0.7) discard / retain with token embeddings (WikiText-2
# prompts, no eval data; docs/BSER.md, "Thresholds for E = hidden states"). Keyed by `config_key` of
# the config `bind` sees (Gemma 3: its global layers).
HIDDEN_THRESHOLDS: dict[tuple, tuple[float, float]] = {
    ("llama", 30, 576, 9, 3, 49152): (0.853, 0.942),  # SmolLM2-135M-Instruct: 8 prompts of 2,048 tokens
    ("qwen2", 28, 1536, 12, 2, 151936): (0.601, 0.877),  # Qwen2.5-Coder-1.5B-Instruct: 4 prompts of 1,024 tokens
    ("gemma3", 3, 640, 4, 1, 262144): (0.706, 0.951),  # Gemma 3 270M, 3 global layers: 8 prompts of 2,048 tokens
}
# A model not in the table (or an unbound policy) gets SmolLM2's, with a warning at `bind`.
THRESHOLDS = {"input": (0.3, 0.7), "hidden": (0.853, 0.942)}


def config_key(config: Any) -> tuple:
    """The key of `HIDDEN_THRESHOLDS`: family, layers (as the policy sees them), width, heads, KV heads, vocabulary."""
    return (config.family, config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads,
            config.vocab_size)


@struct.dataclass
class BSER(Policy):
    """BSER compression (see the module docstring for every choice).

    Args:
      budget: ``None`` = threshold mode (the paper's); a fraction or token count = budget mode.
      alpha, beta: gating thresholds on the cosine relevance; ``None``: token embeddings the
        paper's 0.3, 0.7; hidden states re-derived for their cosine scale per model (`HIDDEN_THRESHOLDS`).
      block_size: tokens per block (default 128, the paper's; 64 = the default before 2026-11-27).
      probe_layers: the top ``L`` layers probed (paper: 4; all layers of a shallower model).
      expansion: ρ, the share of a refined block kept at most (paper: 0.5).
      radius: neighbourhood radius around anchors, inside the block.
      embedding: ``E``: ``"input"`` (token embeddings, the default, the paper's) or ``"hidden"`` (entering the
        first probed layer, with the model's gates; the default before 2026-11-27).
      salience: ``"attention"`` (ā renormalised per block), ``"softmax"`` (Eq. 4 on ā) or ``"mean"``.
      centred: centre ``E`` on the context's mean before the cosine.
      refine: ``"expand"`` (Stage III), ``"drop"`` or ``"keep"`` (ablations).
      fill: a refined block keeps ρ of its tokens (anchors added until then); False: a fixed count.
      refine_order: refined tokens across blocks by ``"salience"`` (their Stage III ā) or ``"block"`` s.
      stage1: ``"blocks"`` (Stage I) or ``"tokens"``: each token its own block (the "w/o Stage I" ablation).
      max_kept: threshold mode: the cache holds at most this share of the prompt.
      sinks, window: first / last prompt tokens always kept (inside the budget).
      tail: stand-in question length when no split is given (fallback).
      max_question: question tokens probed at most (the last ones).
      min_question: a shorter question reaches back into the context to this many tokens.
      gate: ``"cond"`` (probe only in probed layers) or ``"mask"`` (computed everywhere, masked).
      num_layers: the model's layers, set by `bind`.
      model_gates: the model's hidden-state ``(α, β)`` from `HIDDEN_THRESHOLDS`, set by `bind`.
    """

    budget: float | int | None = struct.field(pytree_node=False, default=None)
    alpha: float | None = struct.field(pytree_node=False, default=None)
    beta: float | None = struct.field(pytree_node=False, default=None)
    block_size: int = struct.field(pytree_node=False, default=128)
    probe_layers: int = struct.field(pytree_node=False, default=4)
    expansion: float = struct.field(pytree_node=False, default=0.5)
    radius: int = struct.field(pytree_node=False, default=2)
    embedding: str = struct.field(pytree_node=False, default="input")
    salience: str = struct.field(pytree_node=False, default="attention")
    refine: str = struct.field(pytree_node=False, default="expand")
    max_kept: float = struct.field(pytree_node=False, default=0.5)
    sinks: int = struct.field(pytree_node=False, default=4)
    window: int = struct.field(pytree_node=False, default=32)
    tail: int = struct.field(pytree_node=False, default=32)
    max_question: int = struct.field(pytree_node=False, default=128)
    min_question: int = struct.field(pytree_node=False, default=32)
    gate: str = struct.field(pytree_node=False, default="cond")
    centred: bool = struct.field(pytree_node=False, default=False)
    fill: bool = struct.field(pytree_node=False, default=True)
    refine_order: str = struct.field(pytree_node=False, default="salience")
    stage1: str = struct.field(pytree_node=False, default="blocks")
    num_layers: int = struct.field(pytree_node=False, default=0)
    model_gates: tuple[float, float] | None = struct.field(pytree_node=False, default=None)

    stages = ("compress",)
    needs_whole_prefill = True
    needs_observations = True
    needs_question = True
    writes_entries = True  # through `common.compact`: the engine may send it into a page pool

    def __post_init__(self) -> None:
        if self.budget is not None:
            check_budget(self.budget)
        for name, options in (("embedding", ("input", "hidden")), ("salience", ("softmax", "attention", "mean")),
                              ("refine", ("expand", "drop", "keep")), ("gate", ("cond", "mask")),
                              ("refine_order", ("salience", "block")),
                              ("stage1", ("blocks", "tokens"))):
            if getattr(self, name) not in options:
                raise ValueError(f"{name}={getattr(self, name)!r} must be one of {options}")
        if not self.gates[0] <= self.gates[1]:
            raise ValueError(f"alpha={self.gates[0]} must be <= beta={self.gates[1]}")
        for name in ("block_size", "probe_layers", "tail", "max_question", "min_question"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.radius < 0:
            raise ValueError(f"radius={self.radius} must be >= 0")
        if not 0.0 < self.expansion <= 1.0:
            raise ValueError(f"expansion={self.expansion} must be in (0, 1]")
        if not 0.0 < self.max_kept <= 1.0:
            raise ValueError(f"max_kept={self.max_kept} must be in (0, 1]")
        check_sinks_window(self.cap, self.sinks, self.window)

    @classmethod
    def covering(cls) -> BSER:
        return cls(budget=1.0)

    @property
    def name(self) -> str:
        return f"BSER({self.budget})" if self.budget is not None else f"BSER(α={self.gates[0]}, β={self.gates[1]})"

    @property
    def cap(self) -> float | int:
        """The most entries a row keeps: the budget, or ``max_kept`` in threshold mode."""
        return self.max_kept if self.budget is None else self.budget

    @property
    def gates(self) -> tuple[float, float]:
        """``(α, β)``: the fields where given; else (0.3, 0.7) for token embeddings, and for hidden
        states the bound model's `HIDDEN_THRESHOLDS` (SmolLM2's before `bind` or for another model)."""
        model = self.embedding == "hidden" and self.model_gates is not None
        alpha, beta = self.model_gates if model else THRESHOLDS[self.embedding]
        return (alpha if self.alpha is None else self.alpha, beta if self.beta is None else self.beta)

    @property
    def gate_block(self) -> int:
        """Tokens per gated block: ``block_size``, or 1 with ``stage1="tokens"`` (each token its own block)."""
        return 1 if self.stage1 == "tokens" else self.block_size

    @property
    def anchors(self) -> int:
        bs = self.gate_block
        return max(1, min(bs, round(self.expansion * bs / (2 * self.radius + 1))))

    @property
    def probed(self) -> int:
        """Layers probed: the top ``probe_layers``, or all of a shallower model."""
        return min(self.probe_layers, self.num_layers)

    @property
    def embedding_layer(self) -> int:
        return 0 if self.embedding == "input" else self.num_layers - self.probed

    def bind(self, setup: Setup) -> BSER:
        check_sinks_window(self.cap, self.sinks, self.window, setup.prompt_len)
        gates = HIDDEN_THRESHOLDS.get(config_key(setup.config))
        if gates is None and self.embedding == "hidden" and (self.alpha is None or self.beta is None):
            warnings.warn(f"BSER: no hidden-state thresholds calibrated for the model {config_key(setup.config)}; "
                          f"using SmolLM2's (α, β) = {THRESHOLDS['hidden']}. Derive this model's with "
                          "scripts/bser_thresholds.py and pass alpha=, beta=", stacklevel=2)
        return self.replace(num_layers=setup.config.num_layers, model_gates=gates)

    def compressed_capacity(self, prompt_len: int, max_new_tokens: int, suffix_tokens: int = 0) -> int | None:
        kept = budget_tokens(self.cap, prompt_len)
        if self.budget is not None and kept >= prompt_len:
            return None  # the budget covers the prompt: nothing is dropped
        return kept + max_new_tokens  # thresholds decide per prompt: compress even at a covering cap

    # -- Stage II inside the prefill --------------------------------------------------------
    def observe(self, q, k, v, hidden, layer_index, prompt: Prompt) -> dict[str, jax.Array]:
        if not self.num_layers:
            raise ValueError("BSER.observe: bind(Setup) first (generate does) to fix num_layers")
        B, T = q.shape[:2]
        qpos, valid = probe_queries(prompt, self.tail, self.max_question, T, self.min_question)
        first = self.num_layers - self.probed
        t = jnp.arange(T)
        context = (t < question_start(prompt, self.tail, self.min_question)[:, None]) & (t >= self.sinks)

        def gated(on, fn):
            if self.gate == "mask":
                return jax.tree.map(lambda x: jnp.where(on, x, 0.0), fn())
            zeros = lambda: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(fn))  # noqa: E731
            return jax.lax.cond(on, fn, zeros)

        attn = gated(layer_index >= first, lambda: question_attention(q, k, qpos, valid))
        stats = gated(layer_index == self.embedding_layer,
                      lambda: embedding_stats(hidden, qpos, valid, self.gate_block, self.embedding == "hidden",
                                              context if self.centred else None))
        return {"attn": attn, **stats}

    # -- gating and selection ---------------------------------------------------------------
    def select(self, observations: dict[str, jax.Array], prompt: Prompt) -> dict[str, jax.Array]:
        """The selection from the stacked observations: ``scores`` ``[B, T]`` (higher = kept first),
        ``keep`` ``[B]`` entries kept, ``gated`` ``[B]`` entries the gates choose (threshold mode,
        before the cap), and per block ``s`` ``[B, nb]`` and ``tier`` (2 retain, 1 refine, 0 discard)."""
        attn = observations["attn"].sum(0) / self.probed
        e = self.embedding_layer
        dot, gram, qnorm = observations["dot"][e], observations["gram"][e], observations["qnorm"][e]
        B, T = attn.shape
        nb, bs = gram.shape[1], self.gate_block
        pos = jnp.arange(nb * bs)
        lengths, qs = prompt.lengths, question_start(prompt, self.tail, self.min_question)
        context = (pos < qs[:, None]) & (pos >= self.sinks)
        blocks = lambda x: jnp.pad(x, ((0, 0), (0, nb * bs - T))).reshape(B, nb, bs)  # noqa: E731
        a, d, m = blocks(attn), blocks(dot), context.reshape(B, nb, bs)
        if self.salience == "softmax":
            w = jnp.exp(a - jnp.max(jnp.where(m, a, -jnp.inf), -1, keepdims=True)) * m
        elif self.salience == "attention":
            w = jnp.where(m, a, 0.0)
            w = jnp.where(w.sum(-1, keepdims=True) > 0, w, m)
        else:
            w = m.astype(jnp.float32)
        w = w / jnp.maximum(w.sum(-1, keepdims=True), 1e-30)
        norm = jnp.sqrt(jnp.maximum(jnp.einsum("bni,bnij,bnj->bn", w, gram, w), 0.0)) * qnorm[:, None]
        has = m.any(-1)
        s = jnp.where(has, (w * d).sum(-1) / jnp.maximum(norm, 1e-30), -jnp.inf)

        alpha, beta = self.gates
        discard = s <= alpha
        retain = ~discard & (s >= beta)
        refine = has & ~discard & ~retain
        a_ctx = jnp.where(m, a, -jnp.inf)
        token_rank = descending_rank(a_ctx)
        # a token's salience for Stage III: the most salient token within `radius` of it (in its block)
        near = jnp.where(m, max_filter(a_ctx, self.radius), -jnp.inf)
        if self.fill:  # anchors in salience order, each with its neighbours, until ρ of the block's tokens
            share = jnp.floor(self.expansion * m.sum(-1, keepdims=True) + 0.5)
            expanded = (lex_rank(near, a_ctx) < share) & m
        else:  # a fixed number of anchors and their neighbours
            expanded = dilate((token_rank < self.anchors) & m, self.radius) & m
        refined = {"expand": refine[..., None] & expanded, "drop": jnp.zeros_like(m),
                   "keep": refine[..., None] & m}[self.refine]
        tier = jnp.where(retain[..., None] & m, 2, jnp.where(refined, 1, 0))
        N = nb * bs
        block_order = nb - 1 - descending_rank(s)
        by_block = (block_order[..., None] * bs + (bs - 1 - token_rank)).astype(jnp.float32)
        if self.refine_order == "salience":  # refined tokens across blocks by their Stage III salience
            by_salience = (N - 1 - lex_rank(near.reshape(B, N), a_ctx.reshape(B, N))).astype(jnp.float32)
            by_salience = by_salience.reshape(B, nb, bs)
        else:
            by_salience = by_block
        key = tier * N + jnp.where(tier == 1, by_salience, by_block)
        key = key.reshape(B, N)[:, :T]

        t = jnp.arange(T)
        question = (t >= qs[:, None]) & (t < lengths[:, None])
        key = jnp.where(question, 0.5 * KEEP * (1.0 + t / T), key)
        scores = force_sinks_and_window(key[:, None], lengths, self.sinks, self.window)[:, 0]
        cap = row_budgets(self.cap, lengths)
        gated = ((scores >= 0.5 * KEEP) | (tier.reshape(B, nb * bs)[:, :T] > 0)) & (t < lengths[:, None])
        gated = gated.sum(-1).astype(jnp.int32)
        keep = cap if self.budget is not None else jnp.minimum(gated, cap)
        return {"scores": scores, "keep": keep, "gated": gated, "s": s,
                "tier": jnp.where(retain, 2, jnp.where(refine, 1, 0))}

    def compress(self, cache: KVCache, observations: Any, capacity: int, prompt: Prompt) -> KVCache:
        sel = self.select(observations, prompt)
        scores = jnp.pad(sel["scores"], ((0, 0), (0, cache.capacity - sel["scores"].shape[1])),
                         constant_values=-jnp.inf)
        # one index set per row: [1, B, 1, S] scores broadcast over layers and KV heads
        return compact(cache, scores[None, :, None], sel["keep"], capacity)
