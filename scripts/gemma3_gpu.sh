#!/usr/bin/env bash
# Gemma 3 270M (base) on one GPU (docs/GEMMA3.md): CHESS's calibration, RULER at 8k / 16k / 32k for every
# policy, then prefill and decode speed at 32k. Resumable: every step writes under $OUT/runs and skips
# what a folder given as RESUME (a copy of an earlier call's $OUT) already holds, so a call cut by the
# device's 10-minute limit is continued by the next one:
#   MODEL=/tmp/gemma-3-270m-q4_k_m.gguf OUT=out bash scripts/gemma3_gpu.sh               # first call
#   MODEL=/tmp/gemma-3-270m-q4_k_m.gguf OUT=out RESUME=prev bash scripts/gemma3_gpu.sh   # prev = last $OUT
# Jobs on the GPU at once (each stops at DEADLINE s; `sparsekv eval` appends each batch to results.jsonl
# and skips finished keys when run again):
#   A  `sparsekv calibrate` (WikiText-2, 32 passages of 2k tokens continued for 256 tokens), then CHESS
#   B  question-agnostic 32k: fullkv, streamingllm, snapkv, h2o, quest, stem, semanticache
#   C  question-agnostic 8k and 16k: the same
#   D  question-aware 8k / 16k / 32k: bser(0.25) and snapkv(0.25) (BSER reads the question by design)
# then, alone on the GPU while time is left, scripts/gemma3_speed.py (32k, ring vs full-cache path).
# RULER: the four needle tasks whose answers are 128-token generations (one decode length: one compiled
# program per policy and length), seed 0, n = 25 each, pad-multiple 1024, bf16.
set -uo pipefail
: "${MODEL:?MODEL=/path/to/gemma-3-270m-q4_k_m.gguf}"
DEST=${OUT:-out}; mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
RUNS="$DEST/runs"; mkdir -p "$RUNS"
if [ -n "${RESUME:-}" ] && [ -d "$RESUME/runs" ]; then cp -rn "$RESUME/runs/." "$RUNS/"; fi
DEADLINE=${DEADLINE:-540}
N=${N:-25}
TASKS=${TASKS:-niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue}
SHORT=${SHORT:-8k,16k}; LONG=${LONG:-32k}  # (a CPU dry run: SHORT=1k LONG=2k N=1 CAL_N=2 CAL_LENGTH=256 ...)
B25=${B25:-25}; B32K=${B32K:-10}  # rows per generate call (32k: 10 rows fit beside the other jobs)
CAL_N=${CAL_N:-32}; CAL_LENGTH=${CAL_LENGTH:-2k}; CAL_NEW=${CAL_NEW:-256}
SPEED_CONTEXT=${SPEED_CONTEXT:-32640}; SPEED_STEPS=${SPEED_STEPS:-64}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # run from the checkout
P_AGNOSTIC=${P_AGNOSTIC:-"fullkv, streamingllm(0.25), snapkv(0.25), h2o(0.25), quest(0.25, dense_layers=0), stem, semanticache(0.2)"}
P_AWARE=${P_AWARE:-"snapkv(0.25), bser(0.25)"}
CAL="$RUNS/chess_gemma3-270m.json"
start=$(date +%s)
left() { local l=$(( DEADLINE - ($(date +%s) - start) )); echo $(( l > 1 ? l : 1 )); }
ev() {  # ev MEM_FRACTION OUTDIR QUESTION LENGTHS BATCH POLICIES [more sparsekv eval arguments]
  [ -n "$4" ] || return 0  # no lengths (e.g. LONG= to leave 32k out)
  XLA_PYTHON_CLIENT_MEM_FRACTION=$1 timeout "$(left)" python -m sparsekv_jax.cli eval --model "$MODEL" \
    --dtype bfloat16 --suite ruler --tasks "$TASKS" --n "$N" --pad-multiple 1024 --quiet \
    --out "$RUNS/$2" --question "$3" --lengths "$4" --batch-size "$5" --policies "$6" "${@:7}"
}
job_a() {
  if [ ! -f "$CAL" ]; then
    XLA_PYTHON_CLIENT_MEM_FRACTION=0.2 timeout "$(left)" python -m sparsekv_jax.cli calibrate --model "$MODEL" \
      --dtype bfloat16 --n "$CAL_N" --length "$CAL_LENGTH" --max-new-tokens "$CAL_NEW" --batch-size "$CAL_N" \
      --out "$CAL" --plot "$RUNS/chess_gemma3-270m.png" || return
  fi
  local chess="chess('moderate', calibration='$CAL')"
  # full attention's rows come from jobs B and C
  ev 0.2 chess_agnostic agnostic "$SHORT" "$B25" "$chess" --no-fullkv &&
    ev 0.2 chess_agnostic agnostic "$LONG" "$B32K" "$chess" --no-fullkv
}
job_b() { ev 0.3 agnostic_32k agnostic "$LONG" "$B32K" "$P_AGNOSTIC"; }
job_c() { ev 0.2 agnostic agnostic "$SHORT" "$B25" "$P_AGNOSTIC"; }
job_d() {
  ev 0.2 aware aware "$SHORT" "$B25" "$P_AWARE" --no-fullkv && ev 0.2 aware aware "$LONG" "$B32K" "$P_AWARE" --no-fullkv
}
job_a > "$RUNS/a.log" 2>&1 &
job_b > "$RUNS/b.log" 2>&1 &
job_c > "$RUNS/c.log" 2>&1 &
job_d > "$RUNS/d.log" 2>&1 &
wait
echo "RULER jobs: $(( $(date +%s) - start )) s"
# One summary of whatever finished (a job cut by the deadline writes none itself): $RUNS/ruler/
python scripts/gemma3_summary.py "$RUNS"
if [ "$(left)" -gt 200 ]; then  # the speed points, alone on the GPU, about a minute each with compiles
  timeout "$(left)" python scripts/gemma3_speed.py --model "$MODEL" --out "$RUNS/speed.json" \
    --context "$SPEED_CONTEXT" --steps "$SPEED_STEPS" --deadline "$(( $(left) - 100 ))" > "$RUNS/speed.log" 2>&1
fi
tail -9 "$RUNS/speed.log" 2>/dev/null
for f in a b c d; do echo "=== job $f"; grep -v "^WARNING\|^W0\|^W1\|^I0\|^I1" "$RUNS/$f.log" | tail -4; done
echo "elapsed $(( $(date +%s) - start )) s"
exit 0
