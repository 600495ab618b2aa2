set -u
export PYTHONPATH=/tmp/site:$PWD SPARSEKV_CACHE=/tmp/skv PYTHONUNBUFFERED=1 TQDM_DISABLE=1
python3 -c "
from sparsekv_jax.models.loading import load_tokenizer
tok = load_tokenizer('/tmp/gemma.gguf'); print('tokens of \" in the provided text\":', len(tok(' in the provided text', add_special_tokens=False)['input_ids']))
print([tok.decode([i]) for i in tok('In 1998, 7975467 was', add_special_tokens=False)['input_ids']])"
R=/tmp/gm; mkdir -p $R/g8 $R/g32
D=docs/results/gemma3_ruler_h100/runs
[ -s $R/g8/results.jsonl ] || zcat $D/agnostic/results.jsonl.gz > $R/g8/results.jsonl
[ -s $R/g32/results.jsonl ] || zcat $D/agnostic_32k/results.jsonl.gz > $R/g32/results.jsonl
P="fullkv, semanticache(0.25, keep_numbers=True), semanticache(0.5, keep_numbers=True)"
T=niah_single_1,niah_single_2,niah_multikey_1,niah_multivalue
start=$(date +%s)
ev() { XLA_PYTHON_CLIENT_MEM_FRACTION=$1 timeout ${DL:-500} python -m sparsekv_jax.cli eval --model /tmp/gemma.gguf \
  --dtype bfloat16 --suite ruler --tasks $T --n 25 --pad-multiple 1024 --quiet --out $R/$2 --question agnostic \
  --lengths $3 --batch-size $4 --policies "$P" > $R/$2.log 2>&1; }
ev 0.4 g8 8k,16k 25 &
ev 0.5 g32 32k 10 &
wait
echo "elapsed $(( $(date +%s) - start )) s"
for j in g8 g32; do echo "== $j"; grep "^| \|Error" $R/$j.log | tail -6; done
mkdir -p $OUT/gm && cp -r $R/* $OUT/gm/
