#!/usr/bin/env bash
# BSER after the niah_single_1 / LongBench fixes (docs/BSER.md, "Second round"), question-aware rows
# on SmolLM2, three jobs at once on one GPU (the same prompts, seed and flags as the first round,
# docs/results/methods_h100/ruler4k_aware and docs/results/bser_eval_h100/):
#   A  RULER 4k (n = 25): BSER at its threshold defaults and at 25%, SnapKV question-aware at 25%
#   B  LongBench-mini (113 prompts): the same policies (the >= 97%-of-full target at the defaults)
#   C  RULER 4k at 20% / 35% / 50%: BSER (SnapKV's rows at these budgets are in the first round)
#   D  (after C) RULER 4k, niah_single_1 only: the first version (fill=False, refine_order='block',
#      min_question=1) at the defaults and 25%, to show the fix on the same machine
# LongBench's metrics need rouge-score (and nltk, absl-py, rapidfuzz) importable.
# Each job stops at DEADLINE seconds; `sparsekv eval` resumes from its results.jsonl, so a second
# call with the same RUNS folder carries on where this one stopped.
#   MODEL=/tmp/smollm2.gguf OUT=out RUNS=/tmp/skv_runs2 DEADLINE=540 bash scripts/bser_recheck_gpu.sh
set -uo pipefail
DEST=${OUT:-out}; mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
RUNS=${RUNS:-/tmp/skv_runs2}; mkdir -p "$RUNS"
DEADLINE=${DEADLINE:-540}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
COMMON=(--model "$MODEL" --dtype bfloat16 --pad-multiple 1024 --question aware)
PEERS=${PEERS:-"fullkv, bser, bser(0.25), snapkv(0.25)"}
BUDGETS=${BUDGETS:-"bser(0.2), bser(0.35), bser(0.5)"}
V1=${V1:-"bser(fill=False, refine_order='block', min_question=1), bser(0.25, fill=False, refine_order='block', min_question=1)"}

start=$(date +%s)
left() { local l=$(( DEADLINE - ($(date +%s) - start) )); echo $(( l > 1 ? l : 1 )); }
run() { local name=$1; shift; timeout "$(left)" python -m sparsekv_jax.cli eval "${COMMON[@]}" "$@" --out "$RUNS/$name"; }
run ruler4k_aware --suite ruler --lengths 4k --n 25 --batch-size 16 --policies "$PEERS" > "$RUNS/a.log" 2>&1 &
run longbench_aware --suite longbench --n 26 --batch-size 8 --policies "$PEERS" > "$RUNS/b.log" 2>&1 &
{ run ruler4k_aware_budgets --suite ruler --lengths 4k --n 25 --batch-size 16 --policies "$BUDGETS" > "$RUNS/c.log" 2>&1
  run ruler4k_aware_v1 --suite ruler --tasks niah_single_1 --lengths 4k --n 25 --batch-size 25 --policies "$V1" \
    > "$RUNS/d.log" 2>&1; } &
wait
echo "elapsed $(( $(date +%s) - start )) s"
for f in a b c d; do echo "=== $f"; grep -v "^WARNING\|^W1\|^I1\|^\[transformers\]" "$RUNS/$f.log" | grep "^| \|^Traceback\|Error" | tail -16; done
tar czf "$DEST/bser_recheck.tgz" -C "$RUNS" .
exit 0
