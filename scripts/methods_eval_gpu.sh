#!/usr/bin/env bash
# Quality rows of the newer methods on SmolLM2 (docs/RESULTS.md), three jobs at once on one GPU:
#   A  question-aware RULER 4k (n = 25), then LongBench-mini: BSER against SnapKV question-aware
#   B  question-agnostic RULER 4k (n = 25): SemantiCache against SnapKV and H2O at the same budgets
#   C  S3 ablation (Pure / Hybrid / BM25, target layers 1 -> 4): scripts/s3_ablation.py
# Each job stops at DEADLINE seconds; `sparsekv eval` resumes from its results.jsonl (keys are the
# policies' spec keys), so a second call with the same RUNS folder carries on where this one stopped.
#   MODEL=/tmp/smollm2.gguf OUT=out RUNS=/tmp/skv_runs DEADLINE=480 bash scripts/methods_eval_gpu.sh
set -uo pipefail
DEST=${OUT:-out}; mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
RUNS=${RUNS:-/tmp/skv_runs}; mkdir -p "$RUNS"
DEADLINE=${DEADLINE:-480}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
COMMON=(--model "$MODEL" --dtype bfloat16 --pad-multiple 1024)
A_POLICIES=${A_POLICIES:-"fullkv, bser, bser(0.25), snapkv(0.25)"}
B_POLICIES=${B_POLICIES:-"fullkv, semanticache(0.2), semanticache(0.35), semanticache(0.5), snapkv(0.2), snapkv(0.35), snapkv(0.5), h2o(0.2), h2o(0.35), h2o(0.5)"}

start=$(date +%s)
left() { local l=$(( DEADLINE - ($(date +%s) - start) )); echo $(( l > 1 ? l : 1 )); }
job_a() {
  timeout "$(left)" python -m sparsekv_jax.cli eval "${COMMON[@]}" --suite ruler --lengths 4k --n 25 \
    --batch-size 16 --question aware --policies "$A_POLICIES" --out "$RUNS/ruler4k_aware" &&
  timeout "$(left)" python -m sparsekv_jax.cli eval "${COMMON[@]}" --suite longbench --n 26 --batch-size 8 \
    --question aware --policies "fullkv, bser, bser(0.25), snapkv(0.25), s3hybrid" --out "$RUNS/longbench_aware"
}
job_b() {
  timeout "$(left)" python -m sparsekv_jax.cli eval "${COMMON[@]}" --suite ruler --lengths 4k --n 25 \
    --batch-size 16 --question agnostic --policies "$B_POLICIES" --out "$RUNS/ruler4k_agnostic"
}
job_c() {
  timeout "$(left)" python scripts/s3_ablation.py --model "$MODEL" --dtype bfloat16 --length 0 --ruler-length 4096 --n 10 \
    --niah-n 4 --budget 1024 --pad 8192 --max-new 64 --max-minutes $(( $(left) / 60 - 1 )) --out "$RUNS/s3_ablation"
}
job_a > "$RUNS/a.log" 2>&1 &
job_b > "$RUNS/b.log" 2>&1 &
job_c > "$RUNS/c.log" 2>&1 &
wait
echo "elapsed $(( $(date +%s) - start )) s"
for f in a b c; do echo "=== $f"; grep -v "^WARNING\|^W1\|^I1" "$RUNS/$f.log" | tail -22; done
tar czf "$DEST/methods_eval.tgz" -C "$RUNS" .
exit 0
