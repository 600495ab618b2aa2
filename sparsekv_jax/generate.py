"""Jitted generation: prefill (one-shot or chunked) then a `lax.while_loop` decode.

``generate(params, policy, tokens)`` is one `jax.jit` (two on an x86 CPU with fp32 weights: the
prefill compiled with oneDNN dots, the decode loop without, `Backend.prefill_dots`): prompts are
right-padded ``[B, T]`` with per-row ``lengths``; each row stops on its own at a stop token. The policy's stages
(`sparsekv_jax.policies.base.Policy`) decide the prefill pattern, the compression after
prefill and the pages each decode step reads.

The implementation is `sparsekv_jax.engine` (`setup` → `Run`, the prefill / compress / decode
steps, `Session`); this module keeps the names users import.
"""

from sparsekv_jax.engine import (
    GREEDY,
    PAD_TOKEN,
    GenerateOutput,
    Options,
    Run,
    Sampling,
    Session,
    StepOut,
    decode_loop,
    decode_step,
    extend,
    full_logits,
    generate,
    prefill,
    prefill_shared,
    sample,
    setup,
    stored_entries,
    teacher_force,
    validate_prompt,
)

__all__ = [
    "GREEDY", "PAD_TOKEN", "GenerateOutput", "Options", "Run", "Sampling", "Session", "StepOut", "decode_loop",
    "decode_step", "extend", "full_logits", "generate", "prefill", "prefill_shared", "sample", "setup",
    "stored_entries", "teacher_force", "validate_prompt",
]
