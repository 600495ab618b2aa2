"""Regenerate every results report the docs link to, and the README's plot, from the committed records.

    python scripts/regenerate_reports.py            # rewrite docs/results/<run>/report/ and the README plot
    python scripts/regenerate_reports.py --check    # regenerate into a temporary folder; exit 1 if any
                                                    # report's numbers differ from the committed one
    python scripts/regenerate_reports.py --only ruler4k,longbench

Each report is `python -m sparsekv_jax.eval.report <its records> --out docs/results/<run>/report`
(tables with paired bootstrap 95% intervals, and plots); `REPORTS` names the records behind each. The
docs' prose quotes these reports; the numbers live here, not in hand-copied tables.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
# report folder (under docs/results/<run>/report) -> the record folders it is built from
REPORTS: dict[str, tuple[str, ...]] = {
    "ruler4k": ("ruler4k", "ruler4k_chess_stem"),
    "ruler8k": ("ruler8k", "ruler8k_chess_stem"),
    "longbench": ("longbench",),
    "methods_h100": ("methods_h100",),
    "semanticache_number_sentences_h100": ("semanticache_number_sentences_h100",),
    "bser_rows_h100": ("bser_rows_h100",),
    "gemma3_ruler_h100": ("gemma3_ruler_h100/runs",),
    "qwen2.5-coder-1.5b_h200": ("qwen2.5-coder-1.5b_h200",),
    "qwen2.5-coder-0.5b_h200": ("qwen2.5-coder-0.5b_h200",),
}

# record folder -> (policy A, policy B) pairs compared on their shared samples (experiments/policy_pairs.py)
_CHESS = "chess('moderate', calibration='qwen2.5-coder-1.5b')"
_CHESS_05B = "chess('moderate', calibration='/tmp/runs_qwen2.5-coder-0.5b/chess_calibration.json')"
# S3's rows name the SAE file by its path on the GPU machine: the paper run of docs/results/sae_paper_qwen_h200
_QWEN_SAES = "/tmp/qwen_sae/paper_qwen2.5-coder-1.5b.safetensors"
# stage 13's rerun of that config (docs/results/sae_paper_qwen_h200/run2) and its random-direction control
# (experiments/s3_control_saes.py --seed 0)
_QWEN_SAES2 = "/tmp/qwen_sae_r2/paper_qwen2.5-coder-1.5b.safetensors"
_QWEN_CONTROL = "/tmp/qwen_sae_r2/control_qwen2.5-coder-1.5b.safetensors"
# stage 17's run with the opt-in --dead-bias-step 1e-2 (docs/results/sae_paper_qwen_h200/run3_dead_bias)
_QWEN_SAES_DB = "/tmp/qwen_sae_db/paper_qwen2.5-coder-1.5b.safetensors"
# stage 19's rerun of the paper config (docs/results/sae_paper_qwen_h200/run4), S3 without the question at 32k
_QWEN_SAES4 = "/tmp/qwen_sae_r4/paper_qwen2.5-coder-1.5b.safetensors"
PAIRS: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2.5-coder-1.5b_h200": (
        ("adakv(snapkv(0.25))", "snapkv(0.25)"), ("pyramidkv(snapkv(0.25))", "snapkv(0.25)"),
        ("adakv(snapkv(0.1))", "snapkv(0.1)"), ("pyramidkv(snapkv(0.1))", "snapkv(0.1)"),
        ("adakv(snapkv(0.5))", "snapkv(0.5)"), ("pyramidkv(snapkv(0.5))", "snapkv(0.5)"),
        ("h2o(0.1)", "snapkv(0.1)"), ("h2o(0.25)", "snapkv(0.25)"),
        ("snapkv(0.25) [kv=int8]", "snapkv(0.25)"), ("quest(0.25) [kv=int8]", "quest(0.25)"),
        ("quest(0.25) [kv=float8_e4m3fn]", "quest(0.25)"), ("snapkv(0.25) [kv=float8_e4m3fn]", "snapkv(0.25)"),
        ("semanticache(0.25)", "snapkv(0.25)"), ("streamingllm(0.25)", "snapkv(0.25)"),
        ("bser(0.25)", "snapkv(0.25)"), (_CHESS, "quest(0.25)"),
        (f"s3hybrid(0.25, saes='{_QWEN_SAES}')", "bm25(0.25)"), (f"s3pure(0.25, saes='{_QWEN_SAES}')", "bm25(0.25)"),
        (f"s3hybrid(0.25, saes='{_QWEN_SAES}')", "snapkv(0.25)"),
        ("semanticache(0.1)", "snapkv(0.1)"), ("semanticache(0.5)", "snapkv(0.5)"),
        ("semanticache(0.25, similarity='keys_values')", "semanticache(0.25)"),
        ("semanticache(0.5, similarity='keys_values')", "semanticache(0.5)"),
        ("quest(0.1)", "quest(0.25)"), ("h2o(0.5)", "snapkv(0.5)"),
        (f"s3hybrid(0.25, saes='{_QWEN_SAES2}')", f"s3hybrid(0.25, saes='{_QWEN_CONTROL}')"),
        (f"s3pure(0.25, saes='{_QWEN_SAES2}')", f"s3pure(0.25, saes='{_QWEN_CONTROL}')"),
        (f"s3hybrid(0.25, saes='{_QWEN_SAES2}')", "bm25(0.25)"),
        (f"s3hybrid(0.25, saes='{_QWEN_CONTROL}')", "bm25(0.25)"),
        (f"s3hybrid(0.25, saes='{_QWEN_SAES2}')", f"s3hybrid(0.25, saes='{_QWEN_SAES}')"),
        (f"s3pure(0.25, saes='{_QWEN_SAES2}')", f"s3pure(0.25, saes='{_QWEN_SAES}')"),
        (f"s3hybrid(0.25, saes='{_QWEN_SAES_DB}')", f"s3hybrid(0.25, saes='{_QWEN_SAES2}')"),
        (f"s3pure(0.25, saes='{_QWEN_SAES_DB}')", f"s3pure(0.25, saes='{_QWEN_SAES2}')"),
        (f"s3hybrid(0.25, saes='{_QWEN_SAES_DB}')", "bm25(0.25)"),
        (f"s3hybrid(0.25, saes='{_QWEN_SAES4}')", "bm25(0.25)"),
        (f"s3hybrid(0.25, saes='{_QWEN_SAES4}')", "snapkv(0.25)"),
        # stage 21: question-aware 8k at 10% and 50%
        ("bser(0.1)", "snapkv(0.1)"), ("bser(0.5)", "snapkv(0.5)"),
        ("bm25(0.1)", "snapkv(0.1)"), ("bm25(0.5)", "snapkv(0.5)"),
        # the same policy with the question in the prompt against without it, on the samples both modes ran
        *((f"aware:{p}", f"agnostic:{p}") for p in ("snapkv(0.25)", "quest(0.25)", "stem", "h2o(0.25)",
                                                     "streamingllm(0.25)", "semanticache(0.25)", _CHESS)),
        # stage 24: Stem's opt-in dense question blocks against Stem, both question-aware, and against Stem without
        # the question (what it means to restore)
        ("stem(dense_question=True)", "stem"), ("aware:stem(dense_question=True)", "agnostic:stem"),
        # and SemantiCache's protect='outlier_keys' at 50% against the paper's (issue 36's 95% target)
        ("semanticache(0.5, protect='outlier_keys')", "semanticache(0.5)")),
    # the 0.5B (stage 12): does the 1.5B's ranking hold? Its CHESS rows name the calibration by its path on the GPU
    # machine; the same file ships as policies/calibration/qwen2.5-coder-0.5b.json
    "qwen2.5-coder-0.5b_h200": (
        ("stem", "quest(0.25)"), (_CHESS_05B, "quest(0.25)"), ("quest(0.25)", "snapkv(0.25)")),
}

# the fields of a report row that are results (a newer report may add fields, e.g. coverage, and its prose
# may change, without changing a result)
RESULT_FIELDS = ("policy", "scores", "n", "average", "by_length", "kv_stored_fraction", "kv_read_fraction",
                 "ci", "kept_pct")


def numbers(results_json: Path) -> list:
    """The results in a report's ``results.json``: per summary, its key and each row's `RESULT_FIELDS`."""
    out = []
    for summary in json.loads(results_json.read_text()):
        key = tuple(summary.get(k) for k in ("model", "suite", "length", "question", "n"))
        rows = [{f: row.get(f) for f in RESULT_FIELDS} for row in summary.get("rows", [])]
        out.append((key, json.dumps(rows, sort_keys=True)))
    return sorted(out, key=repr)


def regenerate(run: str, out: Path) -> None:
    """Write the report of ``run`` into ``out`` (quietly; the report module prints its paths)."""
    from sparsekv_jax.eval import report

    # record paths relative to the repository, as the committed reports name them
    args = [str((RESULTS / r).relative_to(ROOT)) for r in REPORTS[run]] + ["--out", str(Path(out).resolve())]
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(io.StringIO()):
        report.main(args)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true",
                    help="regenerate into a temporary folder and compare numbers with the committed reports")
    ap.add_argument("--only", default="", help=f"comma list of reports (default all: {', '.join(REPORTS)})")
    args = ap.parse_args(argv)
    runs = [r.strip() for r in args.only.split(",") if r.strip()] or list(REPORTS)
    unknown = [r for r in runs if r not in REPORTS]
    if unknown:
        ap.error(f"unknown report {unknown[0]!r}; known: {', '.join(REPORTS)}")
    differ = []
    with tempfile.TemporaryDirectory() as tmp:
        for run in runs:
            committed = RESULTS / run / "report"
            out = Path(tmp) / run if args.check else committed
            regenerate(run, out)
            if args.check:
                same = numbers(out / "results.json") == numbers(committed / "results.json")
                differ += [] if same else [run]
                print(f"{run}: {'same numbers' if same else 'DIFFERENT numbers'} as {committed.relative_to(ROOT)}")
            else:
                print(f"{run}: {committed.relative_to(ROOT)}")
    if not args.check and not args.only:
        sys.path.insert(0, str(ROOT / "experiments"))
        import policy_pairs
        import readme_plot

        readme_plot.main([])
        for run, pairs in PAIRS.items():  # policy against policy, where docs claim one beats another
            with contextlib.redirect_stdout(io.StringIO()):
                policy_pairs.main([str(RESULTS / run), *(f"--pair={a}::{b}" for a, b in pairs),
                                   "--out", str(RESULTS / run / "policy_pairs.md")])
            print(f"{run}: {(RESULTS / run / 'policy_pairs.md').relative_to(ROOT)}")
        import issue35_coverage  # which of issue 35's rows exist, for the model the issue is judged on

        with contextlib.redirect_stdout(io.StringIO()):
            issue35_coverage.main([str(RESULTS / "qwen2.5-coder-1.5b_h200")])
        print(f"qwen2.5-coder-1.5b_h200: {(RESULTS / 'qwen2.5-coder-1.5b_h200' / 'coverage.md').relative_to(ROOT)}")
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
