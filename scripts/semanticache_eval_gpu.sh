#!/usr/bin/env bash
# SemantiCache quality rows on SmolLM2 (docs/SEMANTICACHE.md, "GPU: commands"), three jobs at once on one GPU,
# all question-agnostic, SemantiCache next to SnapKV, H2O and StreamingLLM at 20 / 35 / 50%:
#   A  RULER 4k (n = 25). Seeded with the fullkv / snapkv / h2o rows of docs/results/methods_h100/ruler4k_agnostic
#      (same model path, seed and keys), so it runs SemantiCache and StreamingLLM (and the baselines' qa_2, which
#      that run did not reach); then, if time is left, the paper's Table 4 at 20% (fixed 64-token chunks, no chunking)
#   B  RULER 8k (n = 25), every policy
#   C  LongBench-mini, the tasks whose metrics need no extra package (rouge_score is not on the GPU image)
# Each job stops at DEADLINE seconds; `sparsekv eval` resumes from its results.jsonl, so the same command with the
# same RUNS folder carries on where it stopped (A first: the 4k rows are the priority).
#   MODEL=/tmp/smollm2.gguf OUT=out RUNS=/tmp/sc_runs DEADLINE=450 bash scripts/semanticache_eval_gpu.sh
set -uo pipefail
DEST=${OUT:-out}; mkdir -p "$DEST"; DEST=$(cd "$DEST" && pwd)
RUNS=${RUNS:-/tmp/sc_runs}; mkdir -p "$RUNS"
DEADLINE=${DEADLINE:-450}
export PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
COMMON=(--model "${MODEL:-/tmp/smollm2.gguf}" --dtype bfloat16 --pad-multiple 1024 --question agnostic)
SC="semanticache(0.2), semanticache(0.35), semanticache(0.5)"
BL="snapkv(0.2), snapkv(0.35), snapkv(0.5), h2o(0.2), h2o(0.35), h2o(0.5)"
SL="streamingllm(0.2), streamingllm(0.35), streamingllm(0.5)"
TABLE4="semanticache(0.2, chunking='fixed'), semanticache(0.2, chunking='none', layer_batch=1)"
LB_TASKS=2wikimqa,hotpotqa,multifieldqa_en,narrativeqa,qasper,passage_count,trec

start=$(date +%s)
left() { local l=$(( DEADLINE - ($(date +%s) - start) )); echo $(( l > 1 ? l : 1 )); }
eval_() { timeout "$(left)" python -m sparsekv_jax.cli eval "${COMMON[@]}" "$@"; }
job_a() {
  local dir="$RUNS/ruler4k_agnostic"; mkdir -p "$dir"
  if [ ! -s "$dir/results.jsonl" ]; then  # the earlier baselines; its SemantiCache rows had the previous layout rule
    zcat docs/results/methods_h100/ruler4k_agnostic/results.jsonl.gz | grep -v '"family": "semanticache"' \
      > "$dir/results.jsonl"
  fi
  eval_ --suite ruler --lengths 4k --n 25 --batch-size 16 --policies "fullkv, $SC, $BL, $SL" --out "$dir" &&
  eval_ --suite ruler --lengths 4k --n 25 --batch-size 16 --policies "fullkv, $SC, $BL, $SL, $TABLE4" --out "$dir"
}
job_b() {
  eval_ --suite ruler --lengths 8k --n 25 --batch-size 16 --policies "fullkv, $SC, $BL, $SL" \
    --out "$RUNS/ruler8k_agnostic"
}
job_c() {
  eval_ --suite longbench --tasks "$LB_TASKS" --n 26 --batch-size 8 --policies "fullkv, $SC, $BL, $SL" \
    --out "$RUNS/longbench_agnostic"
}
job_a > "$RUNS/a.log" 2>&1 &
job_b > "$RUNS/b.log" 2>&1 &
job_c > "$RUNS/c.log" 2>&1 &
wait
echo "elapsed $(( $(date +%s) - start )) s"
for f in a b c; do echo "=== $f"; grep -v "^WARNING\|^W1\|^I1" "$RUNS/$f.log" | tail -8; done
# tables from whatever each run has finished (a run cut by the deadline writes no summary.md itself)
python - "$RUNS" <<'PY'
import sys
from pathlib import Path
from sparsekv_jax.eval.report import load_results, markdown_table, summarize
for d in ("ruler4k_agnostic", "ruler8k_agnostic", "longbench_agnostic"):
    path = Path(sys.argv[1]) / d / "results.jsonl"
    if path.exists():
        print(f"\n## {d} ({sum(1 for _ in path.open())} records)\n")
        print(markdown_table(summarize(load_results(path))))
PY
tar czf "$DEST/semanticache_eval.tgz" -C "$RUNS" .
exit 0
