"""`Session`: the engine's steps one at a time (prefill, compress, decode), each a compiled
program, with what each step left kept for the next; `Session.ask` answers several questions in
turn from one compressed context."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from sparsekv_jax.engine.compress import Compressed, Ready
from sparsekv_jax.engine.prefill import Prefilled
from sparsekv_jax.engine.programs import (
    GenerateOutput,
    begin_program,
    compress_program,
    decode_program,
    finish,
    prefill_program,
    run_apart,
)
from sparsekv_jax.engine.run import Run, _open, options_of, validate_suffix
from sparsekv_jax.models.params import Params
from sparsekv_jax.policies.base import Policy


class Session:
    """One prompt through the engine step by step.

    ``Session.start(params, policy, tokens, ...)`` checks and sizes it once (`setup`); then
    `prefill`, `compress` and `decode` run the steps in turn (each calls the steps before it that
    have not run), or `ask` reads a question into the compressed context and decodes its answer,
    leaving the compressed context as it was: compress once, ask many (shared-context evaluation).
    The results are the same tokens as `generate` (whose one program fuses these steps).

    Attributes: ``params`` (placed on the run's mesh), ``run`` (the `Run`), and after each step
    ``prefilled`` (`Prefilled`) and ``compressed`` (`Compressed`).
    """

    def __init__(self, params: Params, run: Run, seed: int | jax.Array = 0) -> None:
        if not isinstance(run, Run):
            raise ValueError(f"run must be a sparsekv_jax.engine.Run (from setup), got {type(run).__name__}")
        self.params, self.run, self.key = params, run, _key(seed)
        self.prefilled: Prefilled | None = None
        self.compressed: Compressed | None = None

    @classmethod
    def start(cls, params: Params, policy: Policy | None, tokens: Any, **kwargs: Any) -> Session:
        """A session of ``policy`` on ``tokens``; ``kwargs``: the prompt's ``lengths``,
        ``question_start``, ``suffix``, ``suffix_lengths`` and the options of `setup`
        (``max_new_tokens``, ``question_tokens`` — the room `ask` needs —, ``page_size``, …)."""
        prompt = {k: kwargs.pop(k, None) for k in ("lengths", "question_start", "suffix", "suffix_lengths")}
        opts = options_of(kwargs)
        params, run = _open(params, policy, tokens, prompt["lengths"], prompt["question_start"], prompt["suffix"],
                            prompt["suffix_lengths"], opts)
        return cls(params, run, opts.seed)

    def prefill(self) -> Prefilled:
        """The prefill (compiled with the backend's prefill options)."""
        if self.prefilled is None:
            self.prefilled = self._prefill_side(prefill_program, self.params, self.run)
        return self.prefilled

    def compress(self) -> Compressed:
        """The compress stage on the prefilled cache (the prefill runs first if it has not)."""
        if self.compressed is None:
            self.compressed = self._prefill_side(compress_program, self.params, self.run, self.prefill())
        return self.compressed

    def begin(self, suffix: Any = None, suffix_lengths: Any = None) -> Ready:
        """Where decoding starts: ``suffix`` (default the run's own) read into the compressed cache."""
        if suffix is None:
            suffix, suffix_lengths = self.run.suffix, self.run.suffix_lengths
        return self._prefill_side(begin_program, self.params, self.run, self.compress(), suffix, suffix_lengths)

    def _prefill_side(self, program: Any, *args: Any) -> Any:
        """Run a step before the decode loop as `generate` and `teacher_force` compile it (`programs.run_apart`:
        with the backend's prefill options where it compiles the prefill apart, else as it is)."""
        return run_apart(self.run, program, *args)

    def decode(self, ready: Ready | None = None, seed: int | jax.Array | None = None) -> GenerateOutput:
        """Decode from ``ready`` (default `begin` with the run's suffix); ``seed`` (default the
        options' seed) keys the sampling."""
        ready = self.begin() if ready is None else ready
        key = self.key if seed is None else _key(seed)
        return finish(self.run, decode_program(self.params, self.run, ready, key))

    def ask(self, question: Any, lengths: Any = None, *, seed: int | jax.Array | None = None) -> GenerateOutput:
        """Read ``question`` ``[B, Tq]`` (right-padded, ``lengths`` valid; ``[Tq]`` for one row) after
        the compressed context and decode its answer. The compressed context stays as it was, so the
        next `ask` starts from it again. ``Tq`` must fit the room kept by ``question_tokens``; questions
        padded to one width share one compiled program (the decode loop is shared whatever the width)."""
        question = np.asarray(question) if not hasattr(question, "shape") else question
        question = question[None] if question.ndim == 1 else question
        if self.run.suffix is not None:
            raise ValueError("ask: this session's run has a suffix (its question); start it with question_tokens= "
                             "instead of suffix= to ask questions in turn")
        suffix, suffix_lengths = validate_suffix(self.params, question, lengths, self.run.tokens.shape[0])
        if suffix.shape[1] > self.run.question_tokens:
            raise ValueError(f"ask: question of {suffix.shape[1]} tokens, the session keeps room for "
                             f"question_tokens={self.run.question_tokens}; start it with a larger question_tokens")
        return self.decode(self.begin(suffix, suffix_lengths), seed)


def _key(seed: int | jax.Array) -> jax.Array:
    return jax.random.key(seed) if isinstance(seed, int) else seed
