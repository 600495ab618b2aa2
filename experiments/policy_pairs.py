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

A side may name its question mode, ``aware:`` or ``agnostic:`` before the label (both sides, or neither):
``aware:quest(0.25)::agnostic:quest(0.25)`` pairs Quest with the question in the prompt against Quest without
it, on the samples both modes ran (RULER's samples are the same in both: the question is only placed
differently), and the question column says ``aware − agnostic``.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from pathlib import Path

from sparsekv_jax.eval.report import find_results, load_results, paired_bootstrap

QUESTION_MODES = ("aware", "agnostic")


def _mode(label: str) -> tuple[str | None, str]:
    """``"aware:quest(0.25)"`` -> ``("aware", "quest(0.25)")``; a label without a mode -> ``(None, label)``."""
    head, sep, rest = label.partition(":")
    return (head, rest.strip()) if sep and head in QUESTION_MODES else (None, label)


def parse_pair(text: str) -> tuple[str, str]:
    """``"A::B"`` -> ``(A, B)``; raises `argparse.ArgumentTypeError` naming the text otherwise (also when one
    side names a question mode and the other does not)."""
    a, sep, b = text.partition("::")
    if not sep or not a.strip() or not b.strip() or "::" in b:
        raise argparse.ArgumentTypeError(f"--pair {text!r}: expected POLICY_A::POLICY_B (two labels as the records "
                                         "spell them, e.g. 'adakv(snapkv(0.25))::snapkv(0.25)')")
    if (_mode(a.strip())[0] is None) != (_mode(b.strip())[0] is None):
        raise argparse.ArgumentTypeError(f"--pair {text!r}: name the question mode on both sides "
                                         f"({' or '.join(QUESTION_MODES)}:POLICY) or on neither")
    return a.strip(), b.strip()


def table(folder: Path, pairs: list[tuple[str, str]]) -> list[dict]:
    """One dict per (pair, question mode, length) with shared samples; a pair with none gives one row
    with ``samples == 0``. A pair whose sides name question modes (`parse_pair`) matches samples across them."""
    scores: dict[str, dict[tuple, float]] = defaultdict(dict)
    for r in (rec for path in find_results([folder]) for rec in load_results(path)):
        key = (r.get("suite", "ruler"), r["question"], r["length"], r["task"], r["seed"], r["index"])
        scores[r["policy"]][key] = float(r["score"])

    def side(label: str, across: str) -> dict[tuple, float]:
        mode, policy = _mode(label)
        return {k if mode is None else (k[0], across, *k[2:]): v for k, v in scores.get(policy, {}).items()
                if mode is None or k[1] == mode}

    rows = []
    for a, b in pairs:
        across = f"{_mode(a)[0]} − {_mode(b)[0]}"
        a_scores, b_scores = side(a, across), side(b, across)
        shared = sorted(set(a_scores) & set(b_scores))
        if not shared:
            rows.append({"a": a, "b": b, "samples": 0})
            continue
        for suite, question, length in sorted({k[:3] for k in shared}):
            keys = [k for k in shared if k[:3] == (suite, question, length)]
            pol, ref = defaultdict(list), defaultdict(list)
            for k in keys:
                pol[k[3]].append(a_scores[k])
                ref[k[3]].append(b_scores[k])
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
