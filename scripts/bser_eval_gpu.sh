#!/usr/bin/env bash
# BSER's question-aware quality rows on SmolLM2 (docs/RESULTS.md, issue 15), three jobs at once on one GPU
# through scripts/eval_jobs_gpu.sh (resumable; LongBench's metrics need rouge-score, nltk, absl-py, rapidfuzz):
#   ruler8k_aware          RULER 8k (n = 25): BSER at its defaults and at 25% against SnapKV question-aware
#   longbench_aware        LongBench-mini: the same four policies (the >= 97%-of-full target)
#   ruler4k_aware_budgets  RULER 4k at 20% / 35% / 50%: BSER against SnapKV at the same budgets
#   MODEL=/tmp/smollm2.gguf OUT=out RUNS=/tmp/skv_runs DEADLINE=540 bash scripts/bser_eval_gpu.sh
PEERS="fullkv, bser, bser(0.25), snapkv(0.25)"
BUDGETS="bser(0.2), snapkv(0.2), bser(0.35), snapkv(0.35), bser(0.5), snapkv(0.5)"
exec bash "$(dirname "$0")/eval_jobs_gpu.sh" \
  "ruler8k_aware: --question aware --suite ruler --lengths 8k --n 25 --batch-size 8 --policies '$PEERS'" \
  "longbench_aware: --question aware --suite longbench --n 26 --batch-size 8 --policies '$PEERS'" \
  "ruler4k_aware_budgets: --question aware --suite ruler --lengths 4k --n 25 --batch-size 16 --policies '$BUDGETS'"
