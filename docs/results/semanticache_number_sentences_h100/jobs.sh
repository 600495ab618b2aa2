set -u
export PYTHONPATH=/tmp/site:$PWD SPARSEKV_CACHE=/tmp/skv
R=/tmp/ns; D=docs/results
for j in 4ag:semanticache_eval_h100/sc_ruler4k_agnostic 4aw:aware_budgets_h100/a4 8ag:semanticache_eval_h100/sc_ruler8k_agnostic 8aw:aware_budgets_h100/c8; do
  n=${j%%:*}; old=${j#*:}; mkdir -p $R/s$n
  [ -s $R/s$n/results.jsonl ] || zcat $D/$old/results.jsonl.gz $D/semanticache_number_words_h100/w$n/results.jsonl.gz > $R/s$n/results.jsonl
done

P="fullkv, ${SP:-semanticache(0.2, number_sentences=64), semanticache(0.35, number_sentences=64), semanticache(0.5, number_sentences=64)}"
MODEL=/tmp/smollm2.gguf OUT=$OUT RUNS=$R DEADLINE=${DL:-540} bash scripts/eval_jobs_gpu.sh \
 "s4ag: --suite ruler --lengths 4k --n 25 --batch-size 16 --question agnostic --policies '$P'" \
 "s4aw: --suite ruler --lengths 4k --n 25 --batch-size 16 --question aware --policies '$P'" \
 "s8ag: --suite ruler --lengths 8k --n 25 --batch-size 8 --question agnostic --policies '$P'" \
 "s8aw: --suite ruler --lengths 8k --n 25 --batch-size 8 --question aware --policies '$P'"
rm -f $OUT/eval_jobs.tgz
for n in s4ag s4aw s8ag s8aw; do mkdir -p /tmp/o/$n; cp $R/$n/summary.md $R/$n/summary.json /tmp/o/$n/ 2>/dev/null; grep number_sentences $R/$n/results.jsonl | gzip -c > /tmp/o/$n/results.jsonl.gz; cp $R/$n.log /tmp/o/$n/run.log; done
tar czf $OUT/sent.tgz -C /tmp/o .
set -u
export PYTHONPATH=/tmp/site:$PWD SPARSEKV_CACHE=/tmp/skv
R=/tmp/ns; D=docs/results
mkdir -p $R/s8ag $R/slbaw $R/slbag
[ -s $R/s8ag/results.jsonl ] || zcat $D/semanticache_eval_h100/sc_ruler8k_agnostic/results.jsonl.gz /tmp/s8ag_ns.jsonl.gz > $R/s8ag/results.jsonl
[ -s $R/slbaw/results.jsonl ] || zcat $D/semanticache_longbench_h100/aware/results.jsonl.gz > $R/slbaw/results.jsonl
[ -s $R/slbag/results.jsonl ] || zcat $D/semanticache_longbench_h100/agnostic/results.jsonl.gz > $R/slbag/results.jsonl
P="fullkv, semanticache(0.2, number_sentences=64), semanticache(0.35, number_sentences=64), semanticache(0.5, number_sentences=64)"
MODEL=/tmp/smollm2.gguf OUT=$OUT RUNS=$R DEADLINE=${DL:-560} bash scripts/eval_jobs_gpu.sh \
 "s8ag: --suite ruler --lengths 8k --n 25 --batch-size 8 --question agnostic --policies '$P'" \
 "slbaw: --suite longbench --n 26 --batch-size 8 --question aware --policies '$P'" \
 "slbag: --suite longbench --n 26 --batch-size 8 --question agnostic --policies '$P'"
rm -f $OUT/eval_jobs.tgz
for n in s8ag slbaw slbag; do mkdir -p /tmp/o/$n; cp $R/$n/summary.md $R/$n/summary.json /tmp/o/$n/ 2>/dev/null; grep number_sentences $R/$n/results.jsonl | gzip -c > /tmp/o/$n/results.jsonl.gz; cp $R/$n.log /tmp/o/$n/run.log; done
tar czf $OUT/sent2.tgz -C /tmp/o .
set -u
export PYTHONPATH=/tmp/site:$PWD SPARSEKV_CACHE=/tmp/skv
R=/tmp/ns; D=docs/results
mkdir -p $R/slbag
[ -s $R/slbag/results.jsonl ] || zcat $D/semanticache_longbench_h100/agnostic/results.jsonl.gz /tmp/slbag_ns.jsonl.gz > $R/slbag/results.jsonl
P="fullkv, semanticache(0.2, number_sentences=64), semanticache(0.35, number_sentences=64), semanticache(0.5, number_sentences=64)"
MODEL=/tmp/smollm2.gguf OUT=$OUT RUNS=$R DEADLINE=${DL:-560} bash scripts/eval_jobs_gpu.sh \
 "slbag: --suite longbench --n 26 --batch-size 8 --question agnostic --policies '$P'"
rm -f $OUT/eval_jobs.tgz
for n in slbag; do mkdir -p /tmp/o/$n; cp $R/$n/summary.md $R/$n/summary.json /tmp/o/$n/ 2>/dev/null; grep number_sentences $R/$n/results.jsonl | gzip -c > /tmp/o/$n/results.jsonl.gz; cp $R/$n.log /tmp/o/$n/run.log; done
tar czf $OUT/sent3.tgz -C /tmp/o .
