"""Why BSER loses to SnapKV question-aware on Qwen2.5-Coder (experiments/bser_qwen_diagnosis.md).

For each RULER sample (question-aware: the prompt holds the question, ``question_start`` = the
context's length, as ``sparsekv eval --question aware`` builds it) and each policy spec, run the
engine's own steps (`Session`: prefill, compress; ``--generate`` also decodes) and report:

* what BSER probes as the question: the decoded tokens after ``question_start``;
* per answer value (the needle's digits): how many of its tokens the compressed cache holds,
  averaged over (layer, KV head) and in the worst (layer, KV head) — BSER keeps one index set,
  SnapKV one per (layer, KV head);
* for BSER (the policy's own `BSER.select` on the prefill's observations): the blocks' relevance
  ``s`` (median, quartiles), how many blocks each gate put in discard / refine / retain, the
  needle blocks' ``s``, rank and tier, and where the value's tokens stand in the question's
  attention ``ā``: their ``ā`` over the context median, and the rank of their Stage III salience
  (the largest ``ā`` within ``radius``) among the context's tokens.

Every policy observes one shared dense prefill (`engine.share_prefill`), then runs its own
compress step (and decode loop with ``--generate``) through `Session`. ``local:bser(...)`` is
BSER with the probe's softmax taken over each block's keys alone (`BlockLocalBSER`, one reading of
the paper's per-(Q, B_i) probe, Eq. 3; it kept fewer of the value's digits, so it lives here).

    PYTHONPATH=$PWD python experiments/bser_qwen_diagnosis.py --model qwen2.5-coder-1.5b \\
        --tasks niah_single_2,niah_multikey_1 --length 2048 --n 3 --generate \\
        --specs "snapkv(0.25); bser(0.25); bser(0.25, embedding='input', block_size=128)"

CPU, float32, batch 1: on the 1.5B about 3–4 minutes per 2k prompt for six policies (2 shared
cores). The 0.5B has no hidden-state (α, β) in `HIDDEN_THRESHOLDS`, so BSER gets SmolLM2's with a
warning (printed), and every block of a Qwen-0.5B RULER prompt falls below them: use the 1.5B, or
pass ``alpha=``/``beta=``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from sparsekv_jax.engine import setup, share_prefill
from sparsekv_jax.engine.session import Session
from sparsekv_jax.policies import BSER, parse_policy
from sparsekv_jax.policies.base import Prompt
from sparsekv_jax.policies.bser_probe import QUERY_CHUNK, embedding_stats, max_filter, probe_queries


def block_local_attention(q, k, qpos, valid, block_size: int):
    """``[B, T]``: like `bser_probe.question_attention`, but each (query, head) softmax runs over one
    block's keys at a time (the paper's "attention maps between Q and B_i", Eq. 3, read as one
    probe per block), then is averaged over query heads and valid queries: every block sums to 1
    for a query after it, and each head weighs equally inside a block."""
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    M = qpos.shape[1]
    nb = -(-T // block_size)
    kp = jnp.pad(k, ((0, 0), (0, nb * block_size - T), (0, 0), (0, 0)))
    qq = jnp.take_along_axis(q, qpos[:, :, None, None], axis=1)
    qq = qq.reshape(B, M // QUERY_CHUNK, QUERY_CHUNK, Hkv, Hq // Hkv, D).swapaxes(0, 1)
    pos = qpos.reshape(B, M // QUERY_CHUNK, QUERY_CHUNK).swapaxes(0, 1)
    weight = valid.astype(jnp.float32).reshape(B, M // QUERY_CHUNK, QUERY_CHUNK).swapaxes(0, 1)
    t = jnp.arange(nb * block_size)

    def chunk(xs):
        qc, pc, wc = xs
        s = jnp.einsum("bchgd,bthd->bhgct", qc, kp, preferred_element_type=jnp.float32) / jnp.sqrt(D)
        ok = (t <= pc[:, None, None, :, None]) & (t < T)
        s = jnp.where(ok, s, -jnp.inf).reshape(s.shape[:-1] + (nb, block_size))
        p = jax.nn.softmax(s, axis=-1)
        p = jnp.where(jnp.isfinite(s).any(-1, keepdims=True), p, 0.0).reshape(s.shape[:-2] + (-1,))
        return jnp.einsum("bhgct,bc->bt", p, wc)

    total = jax.lax.map(chunk, (qq, pos, weight)).sum(0)[:, :T]
    return total / (Hq * jnp.maximum(valid.sum(1), 1))[:, None].astype(jnp.float32)


@struct.dataclass
class BlockLocalBSER(BSER):
    """BSER whose probe softmax runs per block (`block_local_attention`); everything else is BSER's."""

    @property
    def name(self) -> str:
        return "local:" + super().name

    def observe(self, q, k, v, hidden, layer_index, prompt):
        B, T = q.shape[:2]
        qpos, valid = probe_queries(prompt, self.tail, self.max_question, T, self.min_question)
        first = self.num_layers - self.probed
        zeros = lambda f: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(f))  # noqa: E731
        fa = lambda: block_local_attention(q, k, qpos, valid, self.gate_block)  # noqa: E731
        fe = lambda: embedding_stats(hidden, qpos, valid, self.gate_block, self.embedding == "hidden")  # noqa: E731
        return {"attn": jax.lax.cond(layer_index >= first, fa, lambda: zeros(fa)),
                **jax.lax.cond(layer_index == self.embedding_layer, fe, lambda: zeros(fe))}


def make_policy(spec: str):
    """A policy spec; ``local:bser(...)`` gives `BlockLocalBSER` with the same fields."""
    if spec.startswith("local:"):
        pol = parse_policy(spec[len("local:"):])
        return BlockLocalBSER(**{f.name: getattr(pol, f.name) for f in dataclasses.fields(pol)})
    return parse_policy(spec)


def value_slots(tok, ids: list[int], answer: str) -> list[int]:
    """The slots of ``ids`` whose text overlaps the first occurrence of ``answer`` (error if absent)."""
    pieces = [tok.decode([i]) for i in ids]
    ends = np.cumsum([len(x) for x in pieces])
    text = "".join(pieces)
    at = text.find(answer)
    if at < 0:
        raise ValueError(f"answer {answer!r} not found in the decoded context")
    return [t for t in range(len(ids)) if ends[t] > at and ends[t] - len(pieces[t]) < at + len(answer)]


def kept_sets(cache, T: int) -> np.ndarray:
    """``[L, H, T]`` bool: which prompt positions the (row 0) compressed cache holds per (layer, KV head)."""
    pos = np.asarray(cache.layers.positions[:, 0])  # [L, H, S]
    live = np.arange(pos.shape[-1]) < int(cache.length[0])
    out = np.zeros(pos.shape[:2] + (T,), bool)
    for li in range(pos.shape[0]):
        for h in range(pos.shape[1]):
            p = pos[li, h][live & (pos[li, h] >= 0) & (pos[li, h] < T)]
            out[li, h, p] = True
    return out


def bser_view(pol: BSER, observations, prompt: Prompt, values: list[list[int]], qs: int) -> dict:
    """Block relevance, tiers and the value tokens' attention, from the policy's own `select`."""
    sel = pol.select(observations, prompt)
    s = np.asarray(sel["s"][0])
    tier = np.asarray(sel["tier"][0])
    attn = np.asarray(observations["attn"].sum(0)[0] / pol.probed)
    bs = pol.gate_block
    has = np.isfinite(s)
    ctx = np.zeros(attn.shape[0], bool)
    ctx[pol.sinks:qs] = True
    a_ctx = np.where(ctx, attn, -np.inf)
    near = np.asarray(max_filter(jnp.asarray(a_ctx)[None], pol.radius)[0])
    near = np.where(ctx, near, -np.inf)
    near_rank = np.argsort(np.argsort(-near, kind="stable"), kind="stable")
    order = np.argsort(np.argsort(-np.where(has, s, -np.inf), kind="stable"), kind="stable")
    med = float(np.median(attn[ctx]))

    def in_block(t: int) -> str:
        """``rank/share``: the token's Stage III rank inside its block (by the largest ā within
        ``radius``, ties by its own ā) and the tokens a refined block keeps (round(ρ·n))."""
        lo = (t // bs) * bs
        idx = [u for u in range(lo, min(lo + bs, len(near))) if ctx[u]]
        order = sorted(idx, key=lambda u: (-near[u], -a_ctx[u]))
        return f"{order.index(t)}/{int(np.floor(pol.expansion * len(idx) + 0.5))}"

    out = {"gates": [round(g, 3) for g in pol.gates], "blocks": int(has.sum()),
           "gated_share": round(float(sel["gated"][0]) / int(prompt.lengths[0]), 3),
           "s_median": round(float(np.median(s[has])), 3),
           "s_q25_q75": [round(float(np.quantile(s[has], q)), 3) for q in (0.25, 0.75)],
           "tiers_discard_refine_retain": [int(((tier == t) & has).sum()) for t in (0, 1, 2)],
           "values": []}
    for v in values:
        blocks = sorted({t // bs for t in v})
        out["values"].append({
            "blocks": [{"block": b, "s": round(float(s[b]), 3), "rank": int(order[b]), "tier": int(tier[b])}
                       for b in blocks],
            "attn_over_median": [round(float(attn[t] / med), 1) for t in v],
            "stage3_salience_rank": [int(near_rank[t]) for t in v],
            "stage3_rank_in_block": [in_block(t) for t in v],
        })
    return out


_share = jax.jit(share_prefill)


def main(argv: list[str] | None = None) -> int:
    from sparsekv_jax.eval.batching import encode
    from sparsekv_jax.eval.ruler import generate_samples
    from sparsekv_jax.models.embedded import load

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--tasks", default="niah_single_2,niah_multikey_1", help="comma-separated RULER tasks")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--n", type=int, default=4, help="samples (indices 0..n-1)")
    p.add_argument("--indices", default=None, help="comma-separated sample indices (instead of 0..n-1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--specs", default="snapkv(0.25); bser(0.25); bser(0.25, embedding='hidden', block_size=64)",
                   help="';'-separated policy specs")
    p.add_argument("--generate", action="store_true", help="also decode and score each policy's answer")
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--out", default=None, help="append JSON rows to this file")
    args = p.parse_args(argv)
    params, tok = load(args.model, progress=False)
    n = max(int(i) for i in args.indices.split(",")) + 1 if args.indices else args.n
    keep = None if args.indices is None else {int(i) for i in args.indices.split(",")}
    samples = [s for task in args.tasks.split(",")
               for s in generate_samples(task, args.length, n, args.seed, tok, chat=True)
               if keep is None or s.index in keep]
    specs = [x.strip() for x in args.specs.split(";") if x.strip()]
    warned: set[str] = set()
    for smp in samples:
        ctx, q = encode(tok, smp)
        T, qs = len(ctx) + len(q), len(ctx)
        values = [value_slots(tok, ctx, a) for a in smp.answers]
        print(f"\n{smp.task} #{smp.index}: {T} tokens, question {len(q)} tokens from {qs}: "
              f"{tok.decode(q)!r}; values {smp.answers} at {[(v[0], v[-1]) for v in values]}: "
              f"{[[tok.decode([ctx[t]]) for t in v] for v in values]}", flush=True)
        tokens = np.asarray([ctx + q], np.int32)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runs = [setup(params, make_policy(spec), tokens, lengths=np.asarray([T], np.int32),
                          question_start=np.asarray([qs], np.int32), max_new_tokens=args.max_new_tokens)
                    for spec in specs]
        for w in caught:
            if str(w.message) not in warned:
                warned.add(str(w.message))
                print(f"warning: {w.message}", flush=True)
        shared = _share(params, runs)  # one dense prefill, observed by every policy
        for spec, run, pre in zip(specs, runs, shared, strict=True):
            sess = Session(params, run)
            sess.prefilled = pre
            comp = sess.compress()
            kept = kept_sets(comp.cache, T)  # [L, H, T]
            row = {"task": smp.task, "index": smp.index, "tokens": T, "spec": spec,
                   "stored": round(float(comp.stats["kv_stored_fraction"][0]), 3),
                   "value_kept_mean": [round(float(kept[:, :, v].mean()), 3) for v in values],
                   "value_kept_worst_head": [round(float(kept[:, :, v].mean(-1).min()), 3) for v in values],
                   "value_kept_pattern": ["".join("K" if kept[:, :, t].mean() > 0.5 else "." for t in v)
                                          for v in values]}
            pol = sess.run.policy.stage("compress")
            if isinstance(pol, BSER):
                prompt = Prompt(tokens=sess.run.tokens, lengths=sess.run.lengths,
                                question_start=sess.run.question_start, offset=0)
                row["bser"] = bser_view(pol, pre.observations["compress"], prompt, values, qs)
            if args.generate:
                out = sess.decode()
                text = tok.decode(out.sequences()[0], skip_special_tokens=True)
                row["prediction"] = text
                row["score"] = smp.score(text)
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
