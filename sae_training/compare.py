"""Compare SAE sets on the same held-out keys and queries (issue 37's "Show": new SAEs against the shipped).

    python sae_training/compare.py --model smollm2 --saes shipped:smollm2 out/paper_smollm2/paper_smollm2.safetensors
    python sae_training/compare.py --model gemma3-270m --saes out/paper_gemma3-270m/paper_gemma3-270m.safetensors \\
        --corpus kjv,wikitext2 --seq-len 4100 --max-rows 16 --dtype bfloat16 --attention cudnn --out compare.json

For each corpus of ``--corpus`` (default ``kjv,wikitext2``: the training text's held-out books and
WikiText-2 test's held-out articles, text no SAE set here trained on unless it trained on WikiText-2
test), the held-out documents are cut into the same rows for every set, and each set's layers are
evaluated on them (`sparsekv_jax.sae.evaluate.evaluate`): key FVU, query FVU, L0 and the dead
fraction (latents that never fire on those keys). Prints one table, writes ``--out`` (JSON) if given.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# run from a clone without installing: the package is the repository's sparsekv_jax/
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_set(spec: str) -> tuple[dict, dict]:
    """``shipped:NAME`` (the package's SAEs) or a ``.safetensors`` path → ``({layer: TopKSAE}, record)``."""
    from sparsekv_jax.sae.export import load_saes, load_shipped

    return load_shipped(spec.split(":", 1)[1]) if spec.startswith("shipped:") else load_saes(spec)


def compare(params: Any, tokenizer: Any, sets: dict[str, dict], corpora: list[str], *, seq_len: int,
            max_rows: int | None, drop_first: int = 4, batch_rows: int = 2, attention: str = "xla",
            cache_dir: str | None = None) -> list[dict[str, Any]]:
    """One row per (corpus, set, layer): the set's held-out metrics on the corpus's held-out rows.

    ``sets``: ``{name: {layer: TopKSAE}}``. Every set sees the same rows of a corpus (its held-out
    documents, tokenized, cut into ``seq_len`` rows, the first ``max_rows``)."""
    from sparsekv_jax.sae.data import load_corpus, sequential_rows, tokenize
    from sparsekv_jax.sae.evaluate import evaluate
    from sparsekv_jax.sae.export import stack_saes

    out = []
    for spec in corpora:
        rows = sequential_rows(tokenize(tokenizer, load_corpus(spec, cache_dir=cache_dir).heldout), seq_len)
        rows = rows[:max_rows]
        for name, saes in sets.items():
            layers, stacked = stack_saes(saes)
            for r in evaluate(stacked, params, rows, layers, drop_first=drop_first, batch_rows=batch_rows,
                              attention=attention):
                out.append({"corpus": spec, "saes": name, "rows": int(len(rows)), "seq_len": seq_len, **r})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="embedded model name, HF directory or .gguf file")
    p.add_argument("--saes", nargs="+", required=True, metavar="SET",
                   help="SAE sets: shipped:NAME or a .safetensors path (each with its layers)")
    p.add_argument("--corpus", default="kjv,wikitext2", help="corpora whose held-out documents are evaluated")
    p.add_argument("--seq-len", type=int, default=4100, help="tokens per row (the first 4 are dropped)")
    p.add_argument("--max-rows", type=int, default=16, help="rows per corpus (0: all)")
    p.add_argument("--batch-rows", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--attention", default="xla", choices=("xla", "cudnn"))
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)

    import jax.numpy as jnp

    from sparsekv_jax.models.embedded import load

    params, tokenizer = load(args.model, dtype=jnp.dtype(args.dtype), cache_dir=args.cache_dir)
    sets = {spec: load_set(spec)[0] for spec in args.saes}
    bad = {s: saes[next(iter(saes))].d_in for s, saes in sets.items()
           if saes[next(iter(saes))].d_in != params.config.head_dim}
    if bad:
        print(f"compare.py: error: SAE sets {bad} (d_in) do not fit {args.model}'s head_dim "
              f"{params.config.head_dim}", file=sys.stderr)
        return 2
    rows = compare(params, tokenizer, sets, [c.strip() for c in args.corpus.split(",") if c.strip()],
                   seq_len=args.seq_len, max_rows=args.max_rows or None, batch_rows=args.batch_rows,
                   attention=args.attention, cache_dir=args.cache_dir)
    print(f"{'corpus':<10} {'saes':<48} {'layer':>5} {'FVU k':>7} {'FVU q':>7} {'L0':>6} {'dead':>6}")
    for r in rows:
        print(f"{r['corpus']:<10} {r['saes'][-48:]:<48} {r['layer']:>5} {r['fvu']:>7.4f} {r['fvu_queries']:>7.4f} "
              f"{r['l0']:>6.1f} {r['dead_fraction']:>6.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
