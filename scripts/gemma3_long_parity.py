"""Gemma 3 270M (Q4_K_M GGUF): our JAX port against transformers on real long RULER prompts, CPU, fp32.

Question: is Gemma 3 270M's poor RULER niah_single_1 score at 8k (full attention, garbled-looking
continuations such as ' t he provid ed text?') the model, or our port at long context (ring-buffer
local layers, local/global RoPE bases, the 512 sliding window, positions past the window)?

The prompts and token ids are exactly what ``sparsekv eval`` feeds the model for a base model
(``chat=False``): `sparsekv_jax.eval.batching.encode` tokenizes the context with the tokenizer's
special tokens (BOS) and the question without, and `batch_inputs` right-pads them (the context to a
multiple of ``--pad-multiple``, the question to 64) as the eval does. The eval's default question
mode is ``agnostic``: the context is prefilled, then the question is read with `extend` (``suffix``);
``--question aware`` prefills context + question in one pass instead.

Per prompt:
* transformers (`Gemma3ForCausalLM`, the saved reading of the same GGUF, fp32): greedy continuation
  of ``--new`` tokens (no stop tokens) and its logits at each step;
* ours, per variant (``ring``: `Backend()` default, ring-buffer local layers; ``full``:
  ``Backend(local_cache="full")``, the masked reference path; ``ring-bf16``: ring with bf16 weights,
  as the GPU eval ran): greedy `generate` of ``--new`` tokens (no stop tokens) and, with
  `teacher_force` along transformers' continuation, the logits at each of its steps, so the max abs
  logit difference is measured on the same prefix (no [T, V] logits of the whole prompt).

Writes ``results.json`` and ``table.md`` under ``--out``.

    python scripts/gemma3_long_parity.py --lengths 2k --n 3
    python scripts/gemma3_long_parity.py --lengths 8k --n 2 --variants ring,full
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers as tf

from sparsekv_jax.backend import Backend
from sparsekv_jax.eval import ruler
from sparsekv_jax.eval.batching import Item, batch_inputs, encode
from sparsekv_jax.generate import generate, teacher_force
from sparsekv_jax.models.embedded import EMBEDDED_MODELS, cache_root, embedded_gguf_path, load

VARIANTS = {
    "ring": (Backend(), jnp.float32),
    "full": (Backend(local_cache="full"), jnp.float32),
    "ring-bf16": (Backend(), jnp.bfloat16),
}


def _length(s: str) -> int:
    s = s.strip().lower()
    return int(float(s[:-1]) * 1024) if s.endswith("k") else int(s)


def reference_model(attn: str):
    """transformers' own reading of the GGUF, as tests/test_gemma3_gguf.py's fixture saves it."""
    spec = EMBEDDED_MODELS["gemma3-270m"]
    root = cache_root()
    ref_dir = root / "reference" / f"gemma3-270m-{spec.file_sha256[:12]}-transformers-{tf.__version__}"
    if not (ref_dir / "config.json").is_file():
        import shutil
        import tempfile

        from safetensors.torch import save_file

        gguf = embedded_gguf_path("gemma3-270m", root)
        model = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        ref_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{ref_dir.name}.", dir=ref_dir.parent))
        try:
            sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}  # tied
            save_file(sd, str(staging / "model.safetensors"), metadata={"format": "pt"})
            model.config.to_json_file(str(staging / "config.json"))
            os.rename(staging, ref_dir)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    model = tf.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32, attn_implementation=attn)
    model.eval()
    return model


def hf_greedy(model, ids: list[int], new: int) -> tuple[list[int], np.ndarray, float]:
    x = torch.as_tensor([ids])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    toks = out.sequences[0, len(ids):].tolist()
    logits = torch.stack(out.logits, 1)[0].float().numpy()  # [new, V]
    return toks, logits, time.perf_counter() - t0


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def found(text: str, answers) -> bool:
    return all(a.lower() in text.lower() for a in answers)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="2k,8k")
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--task", default="niah_single_1")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--new", type=int, default=24, help="greedy tokens per prompt")
    ap.add_argument("--variants", default="ring,full", help=f"ours: comma list of {','.join(VARIANTS)}")
    ap.add_argument("--question", default="agnostic", choices=("agnostic", "aware"))
    ap.add_argument("--pad-multiple", type=int, default=64)
    ap.add_argument("--attn", default="sdpa", choices=("sdpa", "eager"), help="transformers attention")
    ap.add_argument("--no-teacher-force", action="store_true", help="skip our logits along HF's continuation")
    ap.add_argument("--out", default="docs/results/gemma3_long_parity")
    args = ap.parse_args(argv)
    assert jax.default_backend() == "cpu", jax.default_backend()
    torch.set_num_threads(max(1, os.cpu_count() or 1))

    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    params = {}
    for v in variants:
        dtype = VARIANTS[v][1]
        if dtype not in params:
            params[dtype], tok = load("gemma3-270m", dtype=dtype, cache_dir=cache_root(), progress=False)
    cfg = next(iter(params.values())).config
    model = reference_model(args.attn)
    print(f"transformers {tf.__version__} ({args.attn}), jax {jax.__version__}; sliding_window {cfg.sliding_window}, "
          f"layer_types {''.join('G' if t == 'full_attention' else 'L' for t in cfg.layer_types)}", flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = "_".join(s.strip() for s in args.lengths.split(","))
    records = []
    for length in [_length(s) for s in args.lengths.split(",")]:
        samples = ruler.generate_samples(args.task, length, args.n, seed=args.seed, tokenizer=tok, chat=False)
        for s in samples:
            ctx, q = encode(tok, s)
            ids = ctx + q
            item = Item(group=None, sample=s, context_ids=ctx, question_ids=q, max_new_tokens=args.new)
            inputs = batch_inputs([item], args.question, cfg.max_position_embeddings, args.pad_multiple, 1)
            hf_toks, hf_logits, hf_s = hf_greedy(model, ids, args.new)
            hf_text = tok.decode(hf_toks, skip_special_tokens=True)
            rec = {"length": length, "index": s.index, "prompt_tokens": len(ids), "context_tokens": len(ctx),
                   "question_tokens": len(q), "bos_first": ids[0] == cfg.bos_token_id, "depths": list(s.depths),
                   "answers": list(s.answers), "hf": {"tokens": hf_toks, "text": hf_text,
                                                      "found": found(hf_text, s.answers), "seconds": hf_s},
                   "ours": {}}
            print(f"\n[{length} #{s.index}] {len(ids)} tokens (ctx {len(ctx)} + q {len(q)}), answer {s.answers}, "
                  f"depth {s.depths}\n  HF   ({hf_s:.0f}s) found={rec['hf']['found']}: {hf_text!r}", flush=True)
            for v in variants:
                backend, dtype = VARIANTS[v]
                p = params[dtype]
                t0 = time.perf_counter()
                res = generate(p, None, inputs["tokens"], lengths=inputs["lengths"],
                               question_start=inputs["question_start"], suffix=inputs["suffix"],
                               suffix_lengths=inputs["suffix_lengths"], max_new_tokens=args.new, stop_tokens=(),
                               backend=backend)
                ours = res.sequences()[0]
                gen_s = time.perf_counter() - t0
                text = tok.decode(ours, skip_special_tokens=True)
                r = {"tokens": ours, "text": text, "found": found(text, s.answers),
                     "first_divergence": first_divergence(hf_toks, ours), "seconds": gen_s}
                if not args.no_teacher_force:
                    lg = np.asarray(teacher_force(p, None, inputs["tokens"], np.asarray([hf_toks]),
                                                  lengths=inputs["lengths"], question_start=inputs["question_start"],
                                                  suffix=inputs["suffix"], suffix_lengths=inputs["suffix_lengths"],
                                                  backend=backend)[0][0], np.float32)
                    diff = np.abs(lg - hf_logits).max(-1)  # [new]
                    r["logit_maxabs_first"] = float(diff[0])
                    r["logit_maxabs_steps"] = [float(d) for d in diff]
                    r["logit_maxabs_all"] = float(diff.max())
                    r["hf_logit_scale"] = float(np.abs(hf_logits).max())
                    r["argmax_agree_along_hf"] = float((lg.argmax(-1) == np.asarray(hf_toks)).mean())
                r["seconds_total"] = time.perf_counter() - t0
                rec["ours"][v] = r
                lgs = (f" logit maxabs first {r['logit_maxabs_first']:.2e} all {r['logit_maxabs_all']:.2e}"
                       if "logit_maxabs_first" in r else "")
                print(f"  {v:9s} ({r['seconds_total']:.0f}s) found={r['found']} div={r['first_divergence']}{lgs}: "
                      f"{text!r}", flush=True)
            records.append(rec)
            (out_dir / f"results_{tag}.json").write_text(json.dumps(
                {"args": vars(args), "transformers": tf.__version__, "jax": jax.__version__, "records": records},
                indent=1))

    lines = [f"Gemma 3 270M Q4_K_M, CPU fp32 (unless -bf16), {args.task}, seed {args.seed}, question "
             f"{args.question}, {args.new} greedy tokens, transformers {tf.__version__} ({args.attn}).", "",
             "| length | # | prompt tok | answer | who | found | first div | logit max abs (first / all 24) | "
             "continuation |", "|---|---|---|---|---|---|---|---|---|"]
    for rec in records:
        ans = ",".join(rec["answers"])
        lines.append(f"| {rec['length']} | {rec['index']} | {rec['prompt_tokens']} | {ans} | HF | {rec['hf']['found']} "
                     f"| - | - | `{rec['hf']['text']!r}` |")
        for v, r in rec["ours"].items():
            lg = (f"{r['logit_maxabs_first']:.1e} / {r['logit_maxabs_all']:.1e}" if "logit_maxabs_first" in r
                  else "-")
            lines.append(f"| | | | | {v} | {r['found']} | {r['first_divergence']} | {lg} | `{r['text']!r}` |")
    (out_dir / f"table_{tag}.md").write_text("\n".join(lines) + "\n")
    print("\n" + "\n".join(lines))


if __name__ == "__main__":
    main()
