"""Paired bootstrap of one BSER variant against another on the same prompts (this record's check).

The eval summary's intervals are each policy against full attention; this one is policy A minus
policy B in points of the average over task columns: 2000 resamples of the prompts within each
column (the same prompts for A and B), seed 0, percentile 95% interval, as in sparsekv_jax.eval.
Usage: python docs/results/bser_gemma3_cpu/paired.py docs/results/bser_gemma3_cpu/run/results.jsonl.gz
"""
import collections
import gzip
import json
import sys

import numpy as np

scores: dict[str, dict[tuple[str, int], float]] = collections.defaultdict(dict)
with gzip.open(sys.argv[1], "rt") as f:
    for line in f:
        r = json.loads(line)
        scores[r["policy"]][(r["task"], r["index"])] = r["score"]


def pair(a: str, b: str) -> None:
    keys = sorted(set(scores[a]) & set(scores[b]))
    tasks = sorted({t for t, _ in keys})
    cols = [np.array([[scores[a][k], scores[b][k]] for k in keys if k[0] == t]) for t in tasks]
    point = 100 * np.mean([c[:, 0].mean() - c[:, 1].mean() for c in cols])
    rng = np.random.default_rng(0)
    boots = []
    for _ in range(2000):
        diffs = []
        for c in cols:
            i = rng.integers(0, len(c), len(c))
            diffs.append(c[i, 0].mean() - c[i, 1].mean())
        boots.append(100 * np.mean(diffs))
    lo, hi = np.percentile(boots, [2.5, 97.5])
    a_up = sum(scores[a][k] > scores[b][k] for k in keys)
    b_up = sum(scores[a][k] < scores[b][k] for k in keys)
    print(f"{a}  minus  {b}: {point:+.2f} [{lo:+.2f}, {hi:+.2f}] points over {len(keys)} prompts; "
          f"higher on {a_up} prompts, lower on {b_up}")


# the record's labels under today's defaults (scripts/migrate_records.py; run when hidden states and B = 64 were
# the defaults, as bser(0.25), bser(0.25, embedding='input') and bser(0.25, stage1='tokens'))
H, I, T, S = ("bser(0.25, embedding='hidden', block_size=64)", "bser(0.25, block_size=64)",
              "bser(0.25, embedding='hidden', block_size=64, stage1='tokens')", "snapkv(0.25)")
for a, b in ((H, I), (H, T), (I, T), (H, S)):
    pair(a, b)
