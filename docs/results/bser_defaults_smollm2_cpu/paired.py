"""Paired bootstrap of BSER's new default against its previous one on this record's shared prompts.

`sparsekv_jax.eval.report.paired_bootstrap` (2000 resamples of the prompts within each task column, seed
0, percentile 95% interval): new minus old, in points of the average over the task columns.
Usage (from the repository root):
    python docs/results/bser_defaults_smollm2_cpu/paired.py docs/results/bser_defaults_smollm2_cpu/run/results.jsonl.gz
"""
import collections
import gzip
import json
import sys

from sparsekv_jax.eval.report import paired_bootstrap

NEW, OLD = "bser(0.25)", "bser(0.25, embedding='hidden', block_size=64)"
scores: dict[str, dict[tuple, float]] = collections.defaultdict(dict)
with gzip.open(sys.argv[1], "rt") as f:
    for line in f:
        r = json.loads(line)
        scores[r["policy"]][(r["column"], r["index"])] = r["score"]
keys = sorted(set(scores[NEW]) & set(scores[OLD]))
cols = sorted({c for c, _ in keys})
got = paired_bootstrap({c: [scores[NEW][k] for k in keys if k[0] == c] for c in cols},
                       {c: [scores[OLD][k] for k in keys if k[0] == c] for c in cols})
d, lo, hi = got["difference"]
print(f"{NEW} {got['average'][0]:.2f} minus {OLD} {got['reference'][0]:.2f}: {d:+.2f} [{lo:+.2f}, {hi:+.2f}] points "
      f"over {len(keys)} prompts; higher on {sum(scores[NEW][k] > scores[OLD][k] for k in keys)}, "
      f"lower on {sum(scores[NEW][k] < scores[OLD][k] for k in keys)}")
