#!/usr/bin/env bash
# RULER 4k (seed 0, n = 25, question-agnostic) of every policy that existed before protocol v2, run by
# the code before it ($OLD: a copy of its sparsekv_jax package) and by this checkout, at the same
# time on one GPU, then compared prompt by prompt (scripts/compare_eval_runs.py).
#   MODEL=/tmp/smollm2.gguf OLD=.old OUT=out bash scripts/ruler_regression_gpu.sh
set -uo pipefail
DEST=${OUT:-out}; mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
WORK=$(mktemp -d); OLDDIR=$(cd "$OLD" && pwd)
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.45 TQDM_DISABLE=1
P="fullkv, streamingllm(0.25), snapkv(0.25), h2o(0.25), quest(0.25), chess('moderate', calibration='smollm2'), \
chess('aggressive', calibration='smollm2'), chess('conservative', calibration='smollm2'), stem"
ARGS=(eval --model "$MODEL" --suite ruler --lengths 4k --n 25 --batch-size 25 --dtype bfloat16 --pad-multiple 1024
      --question agnostic --policies "$P")
(cd "$OLDDIR" && python -m sparsekv_jax.cli "${ARGS[@]}" --out "$WORK/old" > "$WORK/old.log" 2>&1) &
(python -m sparsekv_jax.cli "${ARGS[@]}" --out "$WORK/new" > "$WORK/new.log" 2>&1) &
wait
tail -3 "$WORK/old.log" "$WORK/new.log"
python scripts/compare_eval_runs.py "$WORK/old" "$WORK/new" --out "$WORK/compare.md"
for d in old new; do gzip -9 -n "$WORK/$d/results.jsonl"; done
tar czf "$DEST/ruler_regression.tgz" -C "$WORK" .
