"""One policy against another on the samples both ran: the paired comparisons the report does not print.

    python experiments/policy_pairs.py docs/results/qwen2.5-coder-1.5b_h200 \\
        --pair "adakv(snapkv(0.25))::snapkv(0.25)" --pair "bser(0.25)::snapkv(0.25)" [--out pairs.md]

The report (`sparsekv_jax.eval.report`) compares every policy with full attention. A claim such as "AdaKV
keeps 5 points more than uniform SnapKV" needs the two policies paired with each other instead: this reads
every ``results.jsonl(.gz)`` under the folder (the report's readers: the last record per key wins), matches
the records of policy A and policy B (their labels, the ``policy`` field) on the same samples (suite, task,
length, question mode, seed, sample index), and prints per (suite, question mode, length): the tasks and
samples both ran, both averages, A − B in points and A as a % of B, with the report's paired bootstrap 95%
interval (`sparsekv_jax.eval.report.paired_bootstrap`, B as the reference: per task, the same resampled
samples for both). A pair is written ``A::B`` (policy specs contain
commas and ``=``). Pairs with no shared sample are listed as such.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from sparsekv_jax.eval.report import find_results, load_results, paired_bootstrap


def parse_pair(text: str) -> tuple[str, str]:
    """``"A::B"`` -> ``(A, B)``; raises `argparse.ArgumentTypeError` naming the text otherwise."""
    a, sep, b = text.partition("::")
    if not sep or not a.strip() or not b.strip() or "::" in b:
        raise argparse.ArgumentTypeError(f"--pair {text!r}: expected POLICY_A::POLICY_B (two labels as the records "
                                         "spell them, e.g. 'adakv(snapkv(0.25))::snapkv(0.25)')")
    return a.strip(), b.strip()


def table(folder: Path, pairs: list[tuple[str, str]]) -> list[dict]:
    """One dict per (pair, question mode, length) with shared samples; a pair with none gives one row
    with ``samples == 0``."""
    scores: dict[str, dict[tuple, float]] = defaultdict(dict)
    for r in (rec for path in find_results([folder]) for rec in load_results(path)):
        key = (r.get("suite", "ruler"), r["question"], r["length"], r["task"], r["seed"], r["index"])
        scores[r["policy"]][key] = float(r["score"])
    rows = []
    for a, b in pairs:
        shared = sorted(set(scores.get(a, {})) & set(scores.get(b, {})))
        if not shared:
            rows.append({"a": a, "b": b, "samples": 0})
            continue
        for suite, question, length in sorted({k[:3] for k in shared}):
            keys = [k for k in shared if k[:3] == (suite, question, length)]
            pol, ref = defaultdict(list), defaultdict(list)
            for k in keys:
                pol[k[3]].append(scores[a][k])
                ref[k[3]].append(scores[b][k])
            boot = paired_bootstrap(dict(pol), dict(ref))
            ref_avg = boot["reference"][0] if isinstance(boot["reference"], list) else boot["reference"]
            rows.append({"a": a, "b": b, "suite": suite, "question": question, "length": length, "tasks": len(pol),
                         "samples": len(keys), "a_average": boot["average"][0], "b_average": ref_avg,
                         "difference": boot["difference"], "ratio": boot["ratio"]})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| A | B | suite | question | length | tasks | samples | A | B | A − B, points [95% CI] "
           "| A as % of B [95% CI] |",
           "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if not r["samples"]:
            out.append(f"| {r['a']} | {r['b']} | – | – | – | 0 | 0 | – | – | no shared samples | – |")
            continue
        d, ratio = r["difference"], r["ratio"]
        pct = "–" if ratio is None else f"{ratio[0]:.1f} [{ratio[1]:.1f}, {ratio[2]:.1f}]"
        out.append(f"| {r['a']} | {r['b']} | {r['suite']} | {r['question']} | {r['length'] // 1024}k | {r['tasks']} | "
                   f"{r['samples']} | {r['a_average']:.2f} | {r['b_average']:.2f} | "
                   f"{d[0]:+.2f} [{d[1]:+.2f}, {d[2]:+.2f}] | {pct} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", type=Path, help="a folder of `sparsekv eval` run folders")
    p.add_argument("--pair", action="append", type=parse_pair, required=True, metavar="A::B",
                   help="two policy labels as the records spell them (repeatable)")
    p.add_argument("--out", type=Path, default=None, help="also write the markdown table here")
    a = p.parse_args(argv)
    if not a.folder.is_dir():
        p.error(f"folder {a.folder} does not exist")
    text = markdown(table(a.folder, a.pair))
    print(text, end="")
    if a.out:
        a.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
