#!/usr/bin/env bash
# The speed rows built on a CPU and waiting for a GPU (docs/BENCHMARKS.md "Built on a CPU, waiting for a GPU"),
# in one device call each, random weights of real model shapes (no model file to carry):
#   PART=1 bash scripts/gpu_pending.sh   # int8/fp8 caches: kernel check, kernel timings, end to end (issue 39)
#   PART=2 bash scripts/gpu_pending.sh   # Stem's tiled and kernel routing at 32k and 128k (issue 40.3)
#   PART=3 bash scripts/gpu_pending.sh   # the fused SAE encoder + top-k step (issue 37.4)
#   PART=4 bash scripts/gpu_pending.sh   # the decode kernel on a page pool vs the uniform cache (issue 38 step 1)
#   PART=5 bash scripts/gpu_pending.sh   # int8/fp8 kernel variants sweep + the quantised decode step again (issue 39)
#   PART=6 bash scripts/gpu_pending.sh   # the tuned quantised kernel at 128k + largest batch per cache dtype (issue 39)
#   PART=7 bash scripts/gpu_pending.sh   # issue 35's speed rows: every policy on Qwen2.5-Coder-1.5B's shapes at 32k
#   PART=8 bash scripts/gpu_pending.sh   # PART=7's batch-64 points again, one process per policy (bench e2e since)
#   PART=9 OLD_DECODE=.carryold/decode.py bash scripts/gpu_pending.sh   # the decode kernel's listed runs by count
#   PART=10 bash scripts/gpu_pending.sh  # Quest's page selection alone, argsort vs lax.top_k (issue 40, batch 1; ran 2026-11-28)
#   PART=11 bash scripts/gpu_pending.sh  # PART=10's selection again with the split-sign bound (two matrix products; ran 2026-11-28: slower, not adopted)
#   PART=12 OLD_QUEST=.carryold bash scripts/gpu_pending.sh  # Quest end to end, page choice by lax.top_k vs the sort (ran 2026-11-28)
# Each command has its share of DEADLINE seconds; logs and JSON land in $OUT; a short table is printed last.
set -uo pipefail
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TQDM_DISABLE=1
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxcache}
OUT=${OUT:-out}; mkdir -p "$OUT"; DEADLINE=${DEADLINE:-560}; PART=${PART:-1}
start=$(date +%s)
left() { local l=$(( DEADLINE - ($(date +%s) - start) )); echo $(( l > 1 ? l : 1 )); }
step() {  # step NAME SECONDS COMMAND...: at most SECONDS (or what is left), its log in $OUT/NAME.log
  local name=$1 budget=$2; shift 2
  local t=$(( budget < $(left) ? budget : $(left) ))
  echo "== $name (<= ${t}s): $*"
  timeout "$t" "$@" > "$OUT/$name.log" 2>&1; echo "rc=$?" >> "$OUT/$name.log"
  tail -n 15 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null
case "$PART" in
  1) # the kernel timings twice (a, b) around the end-to-end search, so one favourable run is not the result;
     # `kv_quant_show.py check` compiled 16/16 on an H200 on 2026-11-27 and the zero-point check re-runs here
     step kvq_zero_check 60 python experiments/kv_quant_fp8_gpu_check.py
     step kvq_kernel_a 150 python scripts/kv_quant_show.py kernel --out "$OUT/kvq_kernel_a.json"
     step kvq_e2e 220 python scripts/kv_quant_show.py e2e --contexts "${E2E_CONTEXTS:-32k,128k}" \
       --batches "${E2E_BATCHES:-1,8,16,24,32,48,64,96,128}" --out "$OUT/kvq_e2e.json"
     step kvq_kernel_b 150 python scripts/kv_quant_show.py kernel --out "$OUT/kvq_kernel_b.json" ;;
  2) step stem32k 200 python experiments/stem_routing_gpu.py --lengths 32k --out "$OUT"
     step stem128k_routing 150 python experiments/stem_routing_gpu.py --lengths 128k --skip-e2e --out "$OUT"
     step stem128k_e2e 200 python experiments/stem_routing_gpu.py --lengths 128k --skip-routing --repeats 1 --out "$OUT" ;;
  3) step sae_fused 540 python sae_training/bench.py --fused --models llama3.1-8b,smollm2 --iters 15 --out "$OUT" ;;
  4) step pool_decode 540 python experiments/pool_decode_gpu.py --lengths 32768,131072 --batches 1,8 --rhos 0.1,0.25 \
       --out "$OUT/pool_decode.json" ;;
  5) # issue 39 after the first timing (docs/results/kvq_timing_h200_2026-11-27): the kernel's dequantisation variants
     # x tiles (screened, then confirmed A B B A beside the bf16 kernel and cuDNN), and the decode step on quantised
     # caches after the append_token fix (full attention, 32k)
     step kvq_sweep 330 python experiments/kvq_kernel_sweep_gpu.py --out "$OUT/kvq_sweep.json"
     step kvq_e2e 200 python scripts/kv_quant_show.py e2e --contexts 32k --batches "${E2E_BATCHES:-1,16,32}" \
       --policies "${E2E_POLICIES:-fullkv}" --out "$OUT/kvq_e2e.json" ;;
  6) # issue 39 with the sweep's tiles and dequantisation as the kernel's defaults (pallas/decode.py TUNED): the
     # kernel at 128k beside the bf16 kernel and cuDNN, and the largest batch / throughput per cache dtype at 32k
     step kvq_kernel128k 70 python scripts/kv_quant_show.py kernel --contexts 128k --out "$OUT/kvq_kernel_128k.json"
     step kvq_e2e 400 python scripts/kv_quant_show.py e2e --contexts 32k --batches "${E2E_BATCHES:-1,16,32,64,128}" \
       --policies "${E2E_POLICIES:-fullkv, snapkv(0.25)}" --out "$OUT/kvq_e2e.json" ;;
  7) # issue 35's speed rows on Qwen2.5-Coder-1.5B's shapes (random bf16 weights; the model's quality rows are
     # docs/RESULTS.md): prefill s at 32k (batch 1), decode ms/token and memory at 32k for batch 1 and large batches,
     # every policy of the quality tables (SemantiCache with fixed chunks: random weights have no tokenizer to find
     # delimiters; its decode reads the same merged cache); run twice (a, b) so one favourable run is not the result
     Q="fullkv, snapkv(0.25), h2o(0.25), streamingllm(0.25), quest(0.25), semanticache(0.25, chunking='fixed'), adakv(snapkv(0.25)), \
pyramidkv(snapkv(0.25)), bser(0.25), chess('moderate', calibration='qwen2.5-coder-1.5b')"
     for run in a b; do
       step "qwen_e2e_$run" 270 python -m sparsekv_jax.bench.e2e --models qwen2.5-coder-1.5b --prefill-contexts 32k \
         --prefill-policies "fullkv, stem" --contexts 32k --batches "${E2E_BATCHES:-1,64,128}" --policies "$Q" \
         --out "$OUT/qwen_e2e_$run.json"
     done ;;
  8) # PART=7 (2026-11-27/28, one process for every policy then) reported Quest, AdaKV, PyramidKV, BSER and CHESS
     # "does not fit" at batch 64 (and SemantiCache at 128, where SnapKV fit): after the first point that ran out of
     # memory, smaller ones failed too. bench e2e now runs each decode policy in its own process; the same points
     # again, with full attention first and last (the same run's reference, twice)
     Q="fullkv, quest(0.25), adakv(snapkv(0.25)), pyramidkv(snapkv(0.25)), bser(0.25), \
chess('moderate', calibration='qwen2.5-coder-1.5b'), semanticache(0.25, chunking='fixed'), fullkv"
     step qwen_e2e_isolated 540 python -m sparsekv_jax.bench.e2e --models qwen2.5-coder-1.5b --prefill-contexts "" \
       --contexts 32k --batches "${E2E_BATCHES:-1,64}" --policies "$Q" --out "$OUT/qwen_e2e_isolated.json" ;;
  9) # the decode kernel's listed runs spread over the splits by the count (pallas/decode.py `listed_chunk`, since
     # 2026-11-28) against the static runs of the list's full width it replaced (OLD_DECODE: that file, carried, e.g.
     # `git show cca18f6:sparsekv_jax/pallas/decode.py > .carryold/decode.py`): Quest end to end, whose lists are as
     # wide as the cache, at 32k on Llama-3.1-8B's and Qwen2.5-Coder-1.5B's shapes, batch 1 and 8, beside full
     # attention in each run; new, old, new, old
     [ -f "${OLD_DECODE:-}" ] || { echo "OLD_DECODE=the replaced pallas/decode.py"; exit 2; }
     rm -rf /tmp/old_tree && mkdir -p /tmp/old_tree && cp -a sparsekv_jax /tmp/old_tree/ \
       && cp "$OLD_DECODE" /tmp/old_tree/sparsekv_jax/pallas/decode.py || exit 1
     for run in new1 old1 new2 old2; do
       dir=$PWD; [ "${run#old}" != "$run" ] && dir=/tmp/old_tree
       # from $dir: `python -m` puts the working directory first on sys.path, before $PYTHONPATH
       step "listed_$run" 130 env -C "$dir" python -m sparsekv_jax.bench.e2e \
         --models llama3.1-8b,qwen2.5-coder-1.5b --prefill-contexts "" --contexts 32k --batches 1,8 \
         --policies "fullkv, quest(0.25)" --iters 9 --out "$OUT/listed_$run.json"
     done ;;
  10) # Quest decodes 1.48x slower than full attention at batch 1 on Qwen's shapes, and the page walk is not the cause
      # (PART=9); its selection alone, every layer as one program, with the shipped top-k (a stable argsort) and with
      # lax.top_k, and the bounds without a top-k; then Quest's decode step beside full attention's in the same call
      # (the excess the selection's time is set against)
     step quest_select 240 python experiments/quest_select_bench.py --models qwen,llama --batches 1,8 --length 32768 \
       --out "$OUT"
     step quest_e2e 200 python -m sparsekv_jax.bench.e2e --models qwen2.5-coder-1.5b,llama3.1-8b --prefill-contexts "" \
       --contexts 32k --batches 1,8 --policies "fullkv, quest(0.25)" --iters 9 --out "$OUT/quest_e2e.json" ;;
  11) # PART=10 (2026-11-28): the selection is Quest's whole excess at batch 1, and launch-bound (45 us a layer for
      # 2 MB of summaries); the bound is 39% of it. The same table with the bound as two matrix products
      # (relu(q).max + min(q,0).min: experiments/quest_select_bench.py's QuestSplitSign, page lists checked equal)
     step quest_select 300 python experiments/quest_select_bench.py --models qwen,llama --batches 1,8 --length 32768 \
       --out "$OUT" ;;
  12) # Quest's page choice by lax.top_k off a mesh (2026-11-28; it was a stable sort everywhere, for sharding): Quest
      # end to end beside full attention on Qwen2.5-Coder-1.5B's shapes at 32k, batch 1 and 8, the new files and the
      # replaced ones (OLD_QUEST: a folder with the replaced policies/quest.py and policies/common.py, e.g.
      # `git show 664d9c3:sparsekv_jax/policies/quest.py > .carryold/quest.py`, the same for common.py) alternating
      # new, old, new, old
     [ -f "${OLD_QUEST:-}/quest.py" ] && [ -f "$OLD_QUEST/common.py" ] || { echo "OLD_QUEST=folder of the old files"; exit 2; }
     rm -rf /tmp/old_tree && mkdir -p /tmp/old_tree && cp -a sparsekv_jax /tmp/old_tree/ \
       && cp "$OLD_QUEST/quest.py" "$OLD_QUEST/common.py" /tmp/old_tree/sparsekv_jax/policies/ || exit 1
     for run in new1 old1 new2 old2; do
       dir=$PWD; [ "${run#old}" != "$run" ] && dir=/tmp/old_tree
       step "quest_topk_$run" 70 env -C "$dir" python -m sparsekv_jax.bench.e2e --models qwen2.5-coder-1.5b \
         --prefill-contexts "" --contexts 32k --batches 1,8 --policies "fullkv, quest(0.25)" --iters 9 \
         --out "$OUT/quest_topk_$run.json"
     done ;;
  *) echo "unknown PART=$PART"; exit 2 ;;
esac
# the device returns at most 8 files a call: everything also travels as one archive
tar czf "$OUT/gpu_pending_$PART.tgz" --exclude="gpu_pending_$PART.tgz" -C "$OUT" . 2>/dev/null
echo "== done in $(( $(date +%s) - start )) s"
