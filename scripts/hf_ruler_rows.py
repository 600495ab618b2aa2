"""transformers' own model on the same RULER rows as `sparsekv eval`: the parity check on real data.

Builds the RULER samples exactly as `sparsekv eval --suite ruler` does (same generator, seed, tokenizer,
token ids of context + question), runs Hugging Face transformers' implementation of the model loaded from
the same GGUF (`from_pretrained(gguf_file=...)`, dequantised by transformers itself), greedy, each
row's answer cut to its task's limit and at the same stop tokens, scores it with the same metric, and
appends records in `results.jsonl`'s format under the policy label ``transformers`` (a dense row, so
`sparsekv report` pairs it with the same samples' ``fullkv`` rows from the JAX run).

Rows of one task run as a left-padded batch (``--batch-size``); positions come from the attention mask,
so padding does not move them.

    python scripts/hf_ruler_rows.py --model /tmp/qwen.gguf --lengths 4k,16k --n 25 --out $OUT/hf
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a .gguf file")
    parser.add_argument("--model-name", default=None, help="name in the resume key (default: --model)")
    parser.add_argument("--tasks", default=None, help="comma-separated RULER tasks (default: all 13)")
    parser.add_argument("--lengths", default="4k")
    parser.add_argument("--n", type=int, default=25)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=25)
    parser.add_argument("--question", default="agnostic", choices=["agnostic", "aware"],
                        help="only names the records' mode (a dense model reads the same tokens either way)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default="cuda", help="torch device (cpu for a dry run)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    from sparsekv_jax.eval.report import column_name
    from sparsekv_jax.eval.runner import (
        parse_lengths,
        plan_eval,
        read_results,
    )
    from sparsekv_jax.eval.specs import PolicySpec
    from sparsekv_jax.eval.suites import build_groups
    from sparsekv_jax.models.loading import load_tokenizer
    from sparsekv_jax.policies import FullKV

    gguf = Path(args.model)
    tokenizer = load_tokenizer(str(gguf))
    max_positions, eos = _gguf_limits(gguf)
    # the stop set `sparsekv eval` uses: the GGUF's eos and the tokenizer's
    stop = tuple(sorted({*eos, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [])}))
    tasks = args.tasks.split(",") if args.tasks else None
    suite_id, groups = build_groups("ruler", tasks, parse_lengths(args.lengths), args.n, args.seed, tokenizer,
                                    max_positions, None, None)
    spec = PolicySpec(label="transformers", key="transformers", family="transformers", budget=1.0,
                      policy=FullKV())
    plan = plan_eval(groups, [spec], tokenizer, max_positions, model=args.model_name or str(gguf), suite=suite_id,
                     question=args.question, seed=args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = out / "results.jsonl"
    done = {r["key"] for r in read_results(results)}

    dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=dtype)
    model = model.to(args.device).eval()
    print(f"transformers model loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]

    with results.open("a", encoding="utf-8") as sink:
        for items in plan.items:
            for start in range(0, len(items), args.batch_size):
                chunk = [it for it in items[start:start + args.batch_size] if plan.key(it, spec) not in done]
                if not chunk:
                    continue
                rows = [list(it.context_ids) + list(it.question_ids) for it in chunk]
                width = max(map(len, rows))
                ids = np.full((len(rows), width), pad, dtype=np.int64)
                mask = np.zeros((len(rows), width), dtype=np.int64)
                for i, r in enumerate(rows):  # left padding: the answer starts right after each prompt
                    ids[i, width - len(r):] = r
                    mask[i, width - len(r):] = 1
                new = max(it.max_new_tokens for it in chunk)
                t = time.perf_counter()
                with torch.no_grad():
                    gen = model.generate(input_ids=torch.from_numpy(ids).to(args.device),
                                         attention_mask=torch.from_numpy(mask).to(args.device), max_new_tokens=new,
                                         do_sample=False, eos_token_id=list(stop), pad_token_id=pad)
                seconds = time.perf_counter() - t
                gen = gen[:, width:].cpu().numpy()
                for i, it in enumerate(chunk):
                    answer = []
                    for token in gen[i, : it.max_new_tokens].tolist():
                        if token in stop:
                            break
                        answer.append(token)
                    pred = tokenizer.decode(answer, skip_special_tokens=True)
                    rec = {
                        "key": plan.key(it, spec), "model": plan.model, "suite": plan.suite,
                        "question": plan.question, "seed": plan.seed, "task": it.group.task,
                        "length": it.group.length, "column": column_name(it.group.task, it.group.length),
                        "policy": spec.label, "policy_key": spec.key, "family": spec.family, "budget": 1.0,
                        "index": it.sample.index, "sample_id": it.sample.sample_id, "metric": it.sample.metric,
                        "score": it.sample.score(pred), "prediction": pred, "answers": list(it.sample.answers),
                        "prompt_tokens": len(rows[i]), "generated_tokens": len(answer),
                        "max_new_tokens": it.max_new_tokens,
                        "timing": {"batch_seconds": seconds, "batch_rows": len(chunk)},
                        "reference": f"transformers {__import__('transformers').__version__}, {args.dtype}",
                    }
                    sink.write(json.dumps(rec) + "\n")
                sink.flush()
                print(f"{it.group.task}@{it.group.length}: {len(chunk)} rows in {seconds:.1f} s", flush=True)


def _gguf_limits(path: Path) -> tuple[int, tuple[int, ...]]:
    """(context length, eos ids) from the GGUF's metadata, as the JAX loader reads them."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))

    def get(key: str) -> int | None:
        field = reader.fields.get(key)
        return None if field is None else int(field.parts[field.data[0]][0])

    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    eos = get("tokenizer.ggml.eos_token_id")
    return get(f"{arch}.context_length") or 4096, () if eos is None else (eos,)


if __name__ == "__main__":
    main()
