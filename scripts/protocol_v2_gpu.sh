#!/usr/bin/env bash
# Protocol v2 on the GPU, in one run (docs/BENCHMARKS.md, "Protocol v2"): the decode kernel's
# probabilities, H2O vs SnapKV at Llama-3.1-8B 32k x 32 (25%), FullKV decode, bench.chess, each for
# this checkout and, where OLD is given, for the code before protocol v2 (a copy of its
# sparsekv_jax package in $OLD, e.g. `git archive dc62ab5 sparsekv_jax | tar -x -C .old`), so the
# before/after ratios come from the same machine and the same timing method.
#   OUT=out OLD=.old bash scripts/protocol_v2_gpu.sh      (logs and JSON packed into $OUT/protocol_v2.tgz)
set -uo pipefail
DEST=${OUT:-out}; mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
OUT=$(mktemp -d); export OUT
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
# run TAG DIR CMD...: CMD in DIR (the old package is found by running from its folder: `python -m`
# puts the working directory first on sys.path)
run() { local tag=$1 dir=$2; shift 2; echo "=== $tag: $*"; (cd "$dir" && "$@") 2>&1 | tee "$OUT/$tag.log" | grep -v "^WARNING" | tail -25; }
run decode_probs "$PWD" env PYTHONPATH="$PWD:${PYTHONPATH:-}" python scripts/decode_probs_gpu.py
for side in new ${OLD:+old}; do
  if [ "$side" = old ]; then pp=$(cd "$OLD" && pwd); else pp="$PWD"; fi
  run "e2e_h2o_$side" "$pp" python -m sparsekv_jax.bench.e2e --models llama3.1-8b \
    --prefill-contexts "" --contexts 32k --batches 32 --policies "snapkv(0.25), h2o(0.25)" --iters 5 \
    --out "$OUT/e2e_h2o_$side.json"
  run "e2e_fullkv_$side" "$pp" python -m sparsekv_jax.bench.e2e --models llama3.1-8b \
    --prefill-contexts "" --contexts 8k --batches 1,8 --policies "fullkv" --iters 7 --out "$OUT/e2e_fullkv_$side.json"
done
run chess_new "$PWD" python -m sparsekv_jax.bench.chess --context 32k --gen 0 --iters 5 --out "$OUT/chess_new.json"
B=$(python -c "import json;print([r for r in json.load(open('$OUT/chess_new.json')) if r.get('kind')=='throughput'][0]['batch'])" 2>/dev/null || echo 16)
[ -n "${OLD:-}" ] && run chess_old "$(cd "$OLD" && pwd)" python -m sparsekv_jax.bench.chess --context 32k --gen 0 \
  --iters 5 --batch "$B" --out "$OUT/chess_old.json"
tar czf "$DEST/protocol_v2.tgz" -C "$OUT" .
exit 0
