"""BSER ablations (the analogue of the paper's Section 5.2) as one `sparsekv eval` run.

Every variant is a policy spec; the script passes the chosen ones to ``sparsekv eval --policies``
with the rest of its command line (model, suite, lengths, n, question mode, ``--out``: `sparsekv
eval` resumes finished rows from ``--out``), so each variant runs the real policy through the
eval harness on the same prompts and the table is the eval's own (rows labelled by spec text).
Variants (``--variants``, default all), at ``--budget`` (default 25%) unless "thresholds":

    full                 full attention (the reference)
    snapkv               SnapKV at the budget (the question-aware peer)
    bser                 BSER at the budget, defaults (the paper's: token embeddings, blocks of 128, since
                         2026-11-27; docs/BSER.md)
    thresholds           BSER's threshold mode at its default (α, β), cache sized for 50% of the prompt
    thresholds-uncapped  the same with a cache sized for the whole prompt: the budget the thresholds give
    no-stage1            the paper's "w/o Stage I": each token its own block (token-level screening)
    no-stage1-thresholds the same in threshold mode
    no-stage2            block representation mean-pooled instead of attention-weighted
    softmax              the paper's literal Eq. 4: softmax over the averaged attention probabilities
    no-stage3-drop       refine blocks discarded (threshold mode)
    no-stage3-keep       refine blocks kept whole (threshold mode)
    hidden               E = the hidden states entering the first probed layer, with their derived gates
                         (the default from issue #36 to 2026-11-27)
    hidden-thresholds    the same in threshold mode
    b64                  blocks of 64 tokens (the default before 2026-11-27) instead of the paper's 128
    centred              E centred on the context's mean
    L1, L2               probing the top 1 / 2 layers (default 4)
    v1, v1-thresholds    the first version's Stage III at the budget / at the thresholds: fixed anchors,
                         refined tokens ranked by block s, the question as given (min_question=1)
    fixed-anchors        thresholds with round(ρ·B/(2r+1)) anchors instead of filling ρ of the block
    block-order          the budget with refined tokens ranked by their block's s, not their salience
    question-as-given    thresholds without reaching a short question back into the context

    python scripts/bser_ablation.py --variants bser,no-stage1,hidden --print     # the specs only
    python scripts/bser_ablation.py --model /tmp/smollm2.gguf --dtype bfloat16 --suite ruler --lengths 4k \\
        --n 25 --batch-size 25 --question aware --out $OUT/bser_ablation_ruler4k
"""

from __future__ import annotations

import argparse

V1 = "fill=False, refine_order='block', min_question=1"  # the first version (before the niah_single_1 fix)


def variants(budget: float) -> dict[str, str]:
    """``{variant name: policy spec}`` (`sparsekv_jax.policies.parse_policy` syntax)."""
    b = f"bser({budget}"
    return {
        "full": "fullkv", "snapkv": f"snapkv({budget})", "bser": f"{b})", "thresholds": "bser",
        "thresholds-uncapped": "bser(max_kept=1.0)",
        "no-stage1": f"{b}, stage1='tokens')", "no-stage1-thresholds": "bser(stage1='tokens')",
        "no-stage2": f"{b}, salience='mean')", "softmax": f"{b}, salience='softmax')",
        "no-stage3-drop": "bser(refine='drop')", "no-stage3-keep": "bser(refine='keep')",
        "hidden": f"{b}, embedding='hidden')", "hidden-thresholds": "bser(embedding='hidden')",
        "b64": f"{b}, block_size=64)",
        "centred": f"{b}, centred=True)", "L1": f"{b}, probe_layers=1)", "L2": f"{b}, probe_layers=2)",
        "v1": f"{b}, {V1})", "v1-thresholds": f"bser({V1})", "fixed-anchors": "bser(fill=False)",
        "block-order": f"{b}, refine_order='block')", "question-as-given": "bser(min_question=1)",
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default="all", help="comma-separated variant names, or 'all'")
    p.add_argument("--budget", type=float, default=0.25)
    p.add_argument("--print", action="store_true", help="print the policy specs and stop")
    args, rest = p.parse_known_args(argv)
    table = variants(args.budget)
    names = list(table) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    unknown = [v for v in names if v not in table]
    if unknown:
        p.error(f"unknown variants {unknown}; known: {', '.join(table)}")
    from sparsekv_jax.policies import parse_policy

    for name in names:
        parse_policy(table[name])  # refuse a bad spec before the model loads
    spec = ", ".join(table[v] for v in names)
    if args.print:
        for v in names:
            print(f"{v:22s} {table[v]}")
        print(spec)
        return 0
    if "--policies" in rest:
        p.error("--policies is set from --variants")
    from sparsekv_jax.cli import main as sparsekv

    return sparsekv(["eval", *rest, "--policies", spec])


if __name__ == "__main__":
    raise SystemExit(main())
