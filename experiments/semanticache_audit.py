"""What SemantiCache's merge does to a RULER needle (the audit of experiments/semanticache_audit.md).

For each sample: prefill the context with full attention, run SemantiCache's compress step
(`semanticache_merge.cluster`, the code `SemantiCache.compress` runs) and report, over every
(layer, KV head):

* the chunk layout level (0 = the paper's delimiter anchors, 1 = clauses, 2 = fixed blocks) and
  the threshold the budget search reached (`SemantiCache.choices`);
* the share of the answer's tokens kept as their own entry, and for the merged ones the cluster's
  size, how many of its members are answer tokens, and the pre-RoPE key cosine of the member with
  its seed (what GSC compared with the threshold);
* the same unmerged share for the whole middle of the prompt (so the answer's share can be read
  against the average), and the entries kept per (layer, KV head) over the prompt's length;
* the cosine of each answer token's pre-RoPE key with its left neighbour, raw and with the head's
  mean key removed (Qwen2's ``k_proj`` has a bias: a shared component that lifts every cosine),
  and of its value; the same medians over the haystack's neighbour pairs.

With ``--generate`` it also decodes each policy's answer (question read after compression, as
``sparsekv eval --question agnostic``) and scores it with RULER's metric. With ``--bias-check`` it
reads the question into the compressed cache with and without the merged entries' ``log |S|``
biases and reports the largest change of the last-token logits (proportional attention reaching
the question's prefill).

    PYTHONPATH=$PWD python experiments/semanticache_audit.py --model qwen2.5-coder-0.5b \\
        --tasks niah_single_2@uuids --length 2048 --n 2 --specs "semanticache(0.5)" --generate

CPU, float32. Runs one sample at a time (batch 1); a 2k prompt on the 0.5B model takes about a
minute per policy on 2 shared cores.
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.cache import init_cache
from sparsekv_jax.generate import generate, prefill
from sparsekv_jax.policies import Dense, clustering, parse_policy, semanticache_merge
from sparsekv_jax.policies.base import Prompt, Setup
from sparsekv_jax.policies.common import row_budgets

_CAPTURED: dict[str, object] = {}


def _capturing_merge(k, v, pos, content, seed_of, kept_as_is, lengths, n_out, inv_freq):
    """`clustering.merge_clusters`, also returning each slot's seed and kept-as-is flag (so the
    experiment reads the clusters the policy made, not a re-implementation of them)."""
    out = _ORIGINAL_MERGE(k, v, pos, content, seed_of, kept_as_is, lengths, n_out, inv_freq)
    return (*out, seed_of, jnp.broadcast_to(kept_as_is, seed_of.shape), content, v.astype(jnp.float32))


_ORIGINAL_MERGE = clustering.merge_clusters


def clusters_of(pol, cache, prompt):
    """``(seed_of [L, B, H, T], kept_as_is [L, B, H, T], content, values [L, B, H, T, D], level, tau [L, B, H])``:
    the compress step's clusters (each member's seed slot, -1 off members), with the pre-RoPE keys
    (post-RoPE with ``keys='post_rope'``) and values it compared and averaged."""
    clustering.merge_clusters = _capturing_merge
    try:
        out, (level, tau) = jax.jit(lambda c, p: semanticache_merge.cluster(pol, c, p))(cache, prompt)
    finally:
        clustering.merge_clusters = _ORIGINAL_MERGE
    *_, seed_of, kept, content, values = out
    return (np.asarray(seed_of), np.asarray(kept), np.asarray(content), np.asarray(values), np.asarray(level),
            np.asarray(tau))


def answer_slots(tok, ids, context, answer):
    """The context slots whose text overlaps the first occurrence of ``answer``."""
    pieces = [tok.decode([i]) for i in ids]
    ends = np.cumsum([len(x) for x in pieces])
    text = "".join(pieces)
    at = text.find(answer)
    if at < 0:
        raise ValueError(f"answer {answer!r} not found in the decoded context")
    return [t for t in range(len(ids)) if ends[t] > at and ends[t] - len(pieces[t]) < at + len(answer)], pieces


def cos(a, b):
    return float(np.dot(a, b) / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-12))


def audit(pol, cache, prompt, answer, T, sinks_window):
    seed_of, kept, content, values, level, tau = clusters_of(pol, cache, prompt)
    L, _, H, _ = seed_of.shape
    rows = []
    middle = np.zeros(T, bool)
    middle[sinks_window[0]:T - sinks_window[1]] = True
    unmerged_mid, unmerged_ans, sizes, answer_mates, seed_cos, entries = [], [], [], [], [], []
    for li in range(L):
        for h in range(H):
            s, kp = seed_of[li, 0, h], kept[li, 0, h]
            head = np.where(kp | (s < 0), np.arange(T), s)  # each slot's entry (its first slot)
            size = np.bincount(head, minlength=T)[head]
            entries.append(len(np.unique(head)))
            unmerged_mid.append(float((size[middle] == 1).mean()))
            unmerged_ans.append(float((size[answer] == 1).mean()))
            for t in answer:
                if size[t] > 1:
                    sizes.append(int(size[t]))
                    answer_mates.append(int(np.isin(np.flatnonzero(head == head[t]), answer).sum()))
                    if head[t] != t:
                        seed_cos.append(cos(content[li, 0, h, t], content[li, 0, h, head[t]]))
    # neighbour cosines of the answer's pre-RoPE keys, raw and centred per head (mean over the prompt)
    c = content[:, 0]  # [L, H, T, D]
    centred = c - c[:, :, :T].mean(2, keepdims=True)
    pairs = [(t - 1, t) for t in answer[1:]]
    hay = [(t - 1, t) for t in range(sinks_window[0] + 1, T - sinks_window[1])
           if t not in answer and t - 1 not in answer]

    def mean_cos(x, prs):
        a = x[:, :, [p for p, _ in prs]]
        b = x[:, :, [q for _, q in prs]]
        num = (a * b).sum(-1)
        den = np.maximum(np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1), 1e-12)
        return float(np.median(num / den))

    rows.append(dict(
        policy=pol.name, budget=int(row_budgets(pol.budget, prompt.lengths)[0]),
        kept_fraction=float(np.mean(entries)) / T,
        level_share=[float((level == lv).mean()) for lv in (0, 1, 2)],
        tau_median=float(np.median(tau)), tau_q10=float(np.quantile(tau, 0.1)), tau_q90=float(np.quantile(tau, 0.9)),
        middle_unmerged=float(np.mean(unmerged_mid)), answer_unmerged=float(np.mean(unmerged_ans)),
        answer_unmerged_worst_layer=float(np.min(np.asarray(unmerged_ans).reshape(L, H).mean(1))),
        merged_answer_cluster_size_median=float(np.median(sizes)) if sizes else None,
        merged_answer_members_from_answer_median=float(np.median(answer_mates)) if answer_mates else None,
        merged_answer_seed_cos_median=float(np.median(seed_cos)) if seed_cos else None,
        answer_neighbour_cos_raw=mean_cos(c, pairs), haystack_neighbour_cos_raw=mean_cos(c, hay),
        answer_neighbour_cos_centred=mean_cos(centred, pairs), haystack_neighbour_cos_centred=mean_cos(centred, hay),
        answer_neighbour_value_cos=mean_cos(values[:, 0], pairs),
        haystack_neighbour_value_cos=mean_cos(values[:, 0], hay),
    ))
    return rows


def bias_effect(params, pol, cache, prompt, question):
    """Largest change of the question's last-token logits when the compressed cache's log-size
    biases are zeroed: nonzero means proportional attention (Eq. 4) reaches the question's prefill
    after compression (`engine.prefill.extend`), as it reaches decode."""
    from sparsekv_jax.engine.prefill import extend

    T = int(prompt.lengths[0])
    comp = pol.compress(cache, None, T + len(question) + 8, prompt)
    q = jnp.asarray([question], jnp.int32)
    n = jnp.asarray([len(question)], jnp.int32)
    with_bias, _ = extend(params, comp, q, n)
    zeroed = comp.replace(layers=comp.layers.replace(bias=jnp.where(comp.layers.bias > 0, 0.0, comp.layers.bias)))
    without, _ = extend(params, zeroed, q, n)
    return float(jnp.abs(with_bias - without).max()), int((np.asarray(comp.layers.bias) > 0).sum())


def main(argv: list[str] | None = None) -> int:
    from sparsekv_jax.eval.batching import encode
    from sparsekv_jax.eval.metrics import score
    from sparsekv_jax.eval.ruler import generate_samples
    from sparsekv_jax.models.embedded import load

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--tasks", default="niah_single_2@uuids", help="comma-separated RULER tasks / variants")
    p.add_argument("--length", type=int, default=2048)
    p.add_argument("--n", type=int, default=2, help="samples (indices 0..n-1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--specs", default="semanticache(0.5)", help="';'-separated policy specs")
    p.add_argument("--generate", action="store_true", help="also decode and score each policy's answer")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--bias-check", action="store_true",
                   help="also read the question into the compressed cache with and without the log-size biases")
    p.add_argument("--out", default=None, help="append JSON rows to this file")
    args = p.parse_args(argv)
    params, tok = load(args.model, progress=False)
    cfg = params.config
    samples = [s for task in args.tasks.split(",")
               for s in generate_samples(task, args.length, args.n, args.seed, tok, chat=True)]
    specs = [parse_policy(s) for s in args.specs.split(";")]
    for s in samples:
        ctx, q = encode(tok, s)
        T = len(ctx)
        answer, pieces = answer_slots(tok, ctx, s.context, s.answers[0])
        print(f"\n{s.task} #{s.index}: {T} context tokens; answer {s.answers[0]!r} = {len(answer)} slots "
              f"{answer[0]}..{answer[-1]} {[pieces[t] for t in answer]}", flush=True)
        tokens, lengths = jnp.asarray([ctx], jnp.int32), jnp.asarray([T], jnp.int32)
        cache = init_cache(cfg, 1, T + 64, page_size=16, dtype=jnp.float32)
        _, cache, _, _ = jax.jit(lambda p, t, n, c: prefill(p, Dense(), t, n, c))(params, tokens, lengths, cache)
        prompt = Prompt(tokens=tokens, lengths=lengths)
        for spec in specs:
            pol = spec.with_tokenizer(tok).bind(Setup(cfg, prompt_len=T, max_new_tokens=args.max_new_tokens))
            out = {"task": s.task, "index": s.index, "tokens": T}
            if spec.__class__.__name__ == "SemantiCache":
                out.update(audit(pol, cache, prompt, answer, T, (pol.sinks, pol.window))[0])
                if args.bias_check:
                    out["question_logits_change_without_bias"], out["merged_entries"] = bias_effect(
                        params, pol, cache, prompt, q)
            else:
                out["policy"] = pol.name
            if args.generate:
                res = generate(params, spec.with_tokenizer(tok), jnp.asarray([ctx], jnp.int32),
                               suffix=jnp.asarray([q], jnp.int32), max_new_tokens=args.max_new_tokens)
                pred = tok.decode(res.sequences()[0], skip_special_tokens=True)
                out["prediction"] = pred
                out["score"] = score(s.metric, pred, s.answers)
            print(json.dumps(out), flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
