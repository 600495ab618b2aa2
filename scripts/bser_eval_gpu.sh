#!/usr/bin/env bash
# BSER's remaining quality rows on SmolLM2 (docs/RESULTS.md, issue 15), three jobs at once on one GPU:
#   A  question-aware RULER 8k (n = 25): BSER at its defaults and at 25% against SnapKV question-aware
#   B  LongBench-mini question-aware: the same four policies (the >= 97%-of-full target)
#   C  question-aware RULER 4k at 20% / 35% / 50%: BSER against SnapKV at the same budgets
# LongBench's metrics need rouge-score (and nltk, absl-py, rapidfuzz) importable.
# Each job stops at DEADLINE seconds; `sparsekv eval` resumes from its results.jsonl, so a second
# call with the same RUNS folder carries on where this one stopped.
#   MODEL=/tmp/smollm2.gguf OUT=out RUNS=/tmp/skv_runs DEADLINE=540 bash scripts/bser_eval_gpu.sh
set -uo pipefail
DEST=${OUT:-out}; mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
RUNS=${RUNS:-/tmp/skv_runs}; mkdir -p "$RUNS"
DEADLINE=${DEADLINE:-540}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
COMMON=(--model "$MODEL" --dtype bfloat16 --pad-multiple 1024 --question aware)
PEERS="fullkv, bser, bser(0.25), snapkv(0.25)"
BUDGETS="bser(0.2), snapkv(0.2), bser(0.35), snapkv(0.35), bser(0.5), snapkv(0.5)"

start=$(date +%s)
left() { local l=$(( DEADLINE - ($(date +%s) - start) )); echo $(( l > 1 ? l : 1 )); }
run() { local name=$1; shift; timeout "$(left)" python -m sparsekv_jax.cli eval "${COMMON[@]}" "$@" --out "$RUNS/$name"; }
run ruler8k_aware --suite ruler --lengths 8k --n 25 --batch-size 8 --policies "$PEERS" > "$RUNS/a.log" 2>&1 &
run longbench_aware --suite longbench --n 26 --batch-size 8 --policies "$PEERS" > "$RUNS/b.log" 2>&1 &
run ruler4k_aware_budgets --suite ruler --lengths 4k --n 25 --batch-size 16 --policies "$BUDGETS" > "$RUNS/c.log" 2>&1 &
wait
echo "elapsed $(( $(date +%s) - start )) s"
for f in a b c; do echo "=== $f"; grep -v "^WARNING\|^W1\|^I1\|^\[transformers\]" "$RUNS/$f.log" | grep "^| \|^Traceback\|Error" | tail -16; done
tar czf "$DEST/bser_eval.tgz" -C "$RUNS" .
exit 0
