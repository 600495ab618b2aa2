"""The engine: a prompt checked and sized once (`setup` → `Run`), then the steps — prefill,
compress, decode — as traceable functions over it, the compiled programs built from them
(`generate`, `teacher_force`) and `Session`, which runs the steps one at a time
(docs/DESIGN.md, "Engine")."""

from sparsekv_jax.engine.compress import Compressed, Ready, begin, compress, prepare, stored_entries
from sparsekv_jax.engine.decode import PAD_TOKEN, Decoded, StepOut, decode_loop, decode_step, sample
from sparsekv_jax.engine.prefill import (
    Prefilled,
    empty_cache,
    extend,
    prefill,
    prefill_run,
    prefill_shared,
    share_prefill,
)
from sparsekv_jax.engine.programs import (
    GenerateOutput,
    compiled_prepare,
    decode_program,
    decode_ready,
    full_logits,
    generate,
    generate_program,
    prepare_program,
    run_program,
    teacher_force,
)
from sparsekv_jax.engine.run import (
    GREEDY,
    Decoding,
    Options,
    Run,
    Sampling,
    place_params,
    setup,
    validate_prompt,
    validate_question_start,
    validate_suffix,
)
from sparsekv_jax.engine.session import Session

__all__ = [
    "Compressed", "Decoded", "Decoding", "GREEDY", "GenerateOutput", "Options", "PAD_TOKEN", "Prefilled", "Ready",
    "Run", "Sampling", "Session", "StepOut", "begin", "compiled_prepare", "compress", "decode_loop",
    "decode_program", "decode_ready", "decode_step", "empty_cache", "extend", "full_logits", "generate",
    "generate_program", "place_params", "prefill", "prefill_run", "prefill_shared", "prepare", "prepare_program",
    "run_program", "sample", "setup", "share_prefill", "stored_entries", "teacher_force", "validate_prompt",
    "validate_question_start", "validate_suffix",
]
