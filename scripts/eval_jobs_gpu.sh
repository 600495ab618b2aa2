#!/usr/bin/env bash
# Several `sparsekv eval` jobs at once on one GPU, each stopped at DEADLINE seconds and resumable:
# `sparsekv eval` carries on from its results.jsonl, so a second call with the same RUNS folder
# continues where this one stopped. Each argument is one job, "NAME: eval arguments"; every job
# gets --model "$MODEL" --dtype bfloat16 --pad-multiple 1024 --out "$RUNS/NAME".
#   MODEL=/tmp/smollm2.gguf OUT=out RUNS=/tmp/skv_runs DEADLINE=500 bash scripts/eval_jobs_gpu.sh \
#     "ruler4k_agnostic: --suite ruler --lengths 4k --n 25 --batch-size 16 --question agnostic --policies 'fullkv, snapkv(0.2)'"
set -uo pipefail
DEST=${OUT:-out}; mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
RUNS=${RUNS:-/tmp/skv_runs}; mkdir -p "$RUNS"
DEADLINE=${DEADLINE:-500}
(( $# )) || { echo "usage: $0 'NAME: eval arguments' ..." >&2; exit 2; }
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=$(python3 -c "print(round(0.9 / $#, 2))")
start=$(date +%s)
names=()
for job in "$@"; do
  name=${job%%:*}; args=${job#*:}; names+=("$name")
  eval "set -- $args"  # the job's own quoting ('fullkv, snapkv(0.2)') survives
  timeout "$DEADLINE" python -m sparsekv_jax.cli eval --model "$MODEL" --dtype bfloat16 --pad-multiple 1024 \
    "$@" --out "$RUNS/$name" > "$RUNS/$name.log" 2>&1 &
done
wait
echo "elapsed $(( $(date +%s) - start )) s"
for name in "${names[@]}"; do
  echo "=== $name"; grep "^| \|^Traceback\|Error" "$RUNS/$name.log" | tail -16
done
tar czf "$DEST/eval_jobs.tgz" -C "$RUNS" .
exit 0
