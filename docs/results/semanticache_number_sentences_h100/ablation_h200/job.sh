set -u
export PYTHONPATH=/tmp/site:$PWD SPARSEKV_CACHE=/tmp/skv PYTHONUNBUFFERED=1 TQDM_DISABLE=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
R=/tmp/abl3; mkdir -p $R
A="--model /tmp/smollm2.gguf --dtype bfloat16 --question agnostic"
timeout ${DL:-540} python scripts/semanticache_ablation.py $A --length 4096 --n 25 --batch 25 --tasks all --out $R/r1 \
  --variants "delimiters@0.5;semanticache(0.5, number_sentences=32);semanticache(0.5, number_sentences=128)" > $R/r1.log 2>&1 &
timeout ${DL:-540} python scripts/semanticache_ablation.py $A --length 4096 --n 25 --batch 25 --tasks all --out $R/r2 \
  --variants "words@0.5;semanticache(0.5, sentence_share=1.0);semanticache(0.5, sentence_share=0.25)" > $R/r2.log 2>&1 &
timeout ${DL:-540} python scripts/semanticache_ablation.py $A --length 8192 --n 26 --batch 8 --tasks '' --longbench qasper,multifieldqa_en,2wikimqa --out $R/lb \
  --variants "delimiters@0.35;semanticache(0.35, sentence_share=1.0);words@0.35" > $R/lb.log 2>&1 &
wait
for n in r1 r2 lb; do echo "== $n"; grep -v "^{" $R/$n.log | tail -8; done
tar czf $OUT/abl3.tgz -C $R .
