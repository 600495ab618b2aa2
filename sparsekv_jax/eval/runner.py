"""The evaluation loop behind ``sparsekv eval``: suites × tasks × lengths × policies, resumable.

:func:`run_eval` evaluates policies on a suite (:mod:`sparsekv_jax.eval.suites`) in three steps,
each a small function that knows no particular policy (only the protocol of
`sparsekv_jax.policies.base.Policy`):

1. **plan** (:func:`plan_eval`, :meth:`Plan.batches`, :meth:`Plan.pending`): tokenize every
   sample, batch rows of similar length (:mod:`sparsekv_jax.eval.batching`), and name every
   (sample, policy) by its resume key; what ``results.jsonl`` already holds is not run again.
2. **run** (:func:`run_batch`): one batched greedy `generate` call of one policy, its answers
   decoded and timed.
3. **record** (:func:`make_record`): the JSON line of one row: the score, every entry of
   `generate`'s ``stats`` (the policy's ``decode_stats`` whatever their keys, the context stage's
   ``stats["context"]``), timing and, with ``fidelity``, the distance to full attention on the
   same cache (:mod:`sparsekv_jax.eval.fidelity`, on the run's ``backend``, its ``kv_dtype`` included).

``out_dir`` receives:

* ``results.jsonl``: one JSON line per finished (task, length, policy, sample), appended as soon
  as its batch finishes. A rerun with the same ``out_dir`` skips every line whose ``key`` (model,
  suite, question mode, seed, task, length, ``policy.spec_key()``, sample index; and the cache dtype
  when a ``backend`` sets ``kv_dtype``) is already there. Records carry ``kv_dtype`` (``None``, or
  absent in older records: the model's dtype) and, with one set, a policy label ending in
  ``[kv=<dtype>]``, so runs at several cache dtypes share one ``out_dir`` and their summaries keep
  them apart.
  Before appending, a line cut short by an interrupted run is moved to ``results.jsonl.damaged``
  (:func:`repair_results`), so every line of the file reads and the summary counts only those.
  (Lines written before keys used ``spec_key`` held ``repr(policy)``: such a run is recomputed.)
* ``summary.json`` / ``summary.md`` / ``*.png``: see :mod:`sparsekv_jax.eval.report`.

Question placement (recorded in every result as ``question``):

* ``"aware"``: the whole prompt is prefilled, so compression sees the question; `generate` gets
  ``question_start`` (each row's context length) so a policy knows where the question begins.
* ``"agnostic"``: ``tokens`` = the context, ``suffix`` = the question: the policy compresses the
  context before the question is read (`generate`'s ``suffix``), as when one cached document
  serves many questions. The question is read with every kept entry (dense).

Shared contexts (``--suite ruler-shared``: samples whose ``meta`` names a ``context_index`` and a
``question_index``): in question-agnostic mode the rows that share a context run as one
`sparsekv_jax.engine.Session` (:func:`run_shared`): the context is prefilled and compressed once,
then each question is read into that compressed cache and answered in turn (`Session.ask`),
batched over contexts. Their records carry ``"shared_context": true``, ``"question_index"`` and
``timing.context_seconds`` (the prefill and compression, once for all the questions of the batch;
``batch_seconds`` is the question's own reading and decoding). With ``fidelity`` (its reference
prefills each row) or question-aware placement (the compression sees each question) every
question runs alone, as in the other suites.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from sparsekv_jax._progress import bar_disabled
from sparsekv_jax.backend import resolved
from sparsekv_jax.eval import report
from sparsekv_jax.eval.batching import (
    QUESTION_MODES,
    Item,
    batch_inputs,
    batches,
    bucket,
    context_batches,
    encode,
    shared_inputs,
)
from sparsekv_jax.eval.specs import (
    PolicySpec,
    format_length,
    is_dense,
    parse_length,
    parse_lengths,
    policy_budget,
    policy_family,
    policy_specs,
)
from sparsekv_jax.eval.suites import DEFAULT_LONGBENCH_PATH, Group, build_groups, load_ruler_dir
from sparsekv_jax.policies import Policy

__all__ = [
    "DEFAULT_LONGBENCH_PATH",
    "QUESTION_MODES",
    "Batch",
    "BatchRun",
    "Plan",
    "PolicySpec",
    "SharedBatch",
    "format_length",
    "load_ruler_dir",
    "make_record",
    "parse_length",
    "parse_lengths",
    "plan_eval",
    "policy_budget",
    "policy_family",
    "policy_specs",
    "read_results",
    "repair_results",
    "row_stats",
    "run_batch",
    "run_eval",
    "run_shared",
]

# distinct compiled generate programs kept alive by one eval run before the caches are dropped
MAX_LIVE_PROGRAMS = 48


# ----------------------------------------------------------------------------------------------
# plan
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Batch:
    """Rows of one (task, length) group run together: ``items`` and their `generate` ``inputs``
    (``tokens`` ``[rows, width]`` etc., padded to ``rows`` with copies of the last item)."""

    items: list[Item]
    inputs: dict[str, Any]

    @property
    def rows(self) -> int:
        return int(self.inputs["tokens"].shape[0])

    @property
    def width(self) -> int:
        return int(self.inputs["tokens"].shape[1])

    def shapes(self) -> tuple[Any, ...]:
        """What a compiled program depends on besides the policy and the decode length."""
        return tuple(None if v is None else tuple(v.shape) for _, v in sorted(self.inputs.items()))


@dataclasses.dataclass(frozen=True)
class Plan:
    """What one `run_eval` call covers: every group's items and every policy, with their keys."""

    model: str
    suite: str
    question: str
    seed: int
    specs: list[PolicySpec]
    groups: list[Group]
    items: list[list[Item]]  # per group, in group order
    max_positions: int
    kv_dtype: str | None = None  # the KV cache's storage (`Backend.kv_dtype`); None: the model's dtype

    def key(self, item: Item, spec: PolicySpec) -> str:
        """The resume key of ``item`` under ``spec`` (its line's ``key`` in results.jsonl); with a
        ``kv_dtype``, the cache dtype ends it, so runs at several cache dtypes share one ``out_dir``
        (a key without one is a run in the model's dtype, as every key written before)."""
        key = [self.model, self.suite, self.question, self.seed, item.group.task, item.group.length, spec.key,
               item.sample.index]
        return json.dumps(key if self.kv_dtype is None else [*key, self.kv_dtype])

    def label(self, spec: PolicySpec) -> str:
        """The policy's label in records and summaries: ``spec.label``, with ``[kv=<kv_dtype>]`` after it
        when a ``kv_dtype`` is set (a table then tells the cache dtypes of one policy apart)."""
        return spec.label if self.kv_dtype is None else f"{spec.label} [kv={self.kv_dtype}]"

    def keys(self) -> list[str]:
        return [self.key(it, s) for items in self.items for it in items for s in self.specs]

    def batches(self, batch_size: int, pad_multiple: int, row_multiple: int = 1,
                shared: bool = False) -> Iterator[Batch | SharedBatch]:
        """Every group's rows in batches of at most ``batch_size``; a group with more rows than that
        fills its short last batch up to ``batch_size`` (one shape, one compile), and every batch is
        filled up to a multiple of ``row_multiple`` rows (a mesh's data axis). With ``shared``, a
        group of shared-context samples (``meta["context_index"]``) gives `SharedBatch`es instead:
        at most ``batch_size`` contexts each, every context with all its questions."""
        def fill(n: int, chunk: list[Any]) -> int:
            return -(-(batch_size if n > batch_size else len(chunk)) // row_multiple) * row_multiple

        for items in self.items:
            contexts = shared_contexts(items) if shared else None
            if contexts is None:
                for chunk in batches(items, batch_size, self.max_positions):
                    yield Batch(chunk, batch_inputs(chunk, self.question, self.max_positions, pad_multiple,
                                                    fill(len(items), chunk)))
                continue
            for chunk in context_batches(contexts, batch_size, self.max_positions):
                context, questions = shared_inputs(chunk, self.max_positions, pad_multiple,
                                                   fill(len(contexts), chunk))
                turns = [Batch(asked, {**context, "question_start": None, "suffix": suffix,
                                       "suffix_lengths": suffix_lengths})
                         for suffix, suffix_lengths, asked in questions]
                yield SharedBatch(turns, [[i for i, c in enumerate(chunk) if j < len(c)] for j in range(len(turns))])

    def pending(self, batch: Batch, done: Mapping[str, Mapping[str, Any]], fidelity: bool) -> dict[str, list[int]]:
        """``{spec.key: rows of batch still to run}``: a row is done when results hold its key (with
        fidelity metrics, if asked for)."""
        def finished(k: str) -> bool:
            return k in done and (not fidelity or done[k].get("fidelity") is not None)

        return {s.key: [i for i, it in enumerate(batch.items) if not finished(self.key(it, s))] for s in self.specs}


@dataclasses.dataclass(frozen=True)
class SharedBatch:
    """Contexts asked their questions in turn (one `Session` per policy: compress once, ask each).

    ``turns[j]`` is the `Batch` of every context's ``j``-th question: its ``tokens``/``lengths`` the
    contexts (the same in every turn), its ``suffix`` the questions. ``real[j]``: the rows of turn
    ``j`` that are samples (a context with fewer questions repeats its last, and rows filling the
    batch repeat the last context; neither is recorded)."""

    turns: list[Batch]
    real: list[list[int]]

    @property
    def rows(self) -> int:
        return self.turns[0].rows

    @property
    def items(self) -> list[Item]:
        return [t.items[i] for t, rows in zip(self.turns, self.real, strict=True) for i in rows]


def shared_contexts(items: list[Item]) -> list[list[Item]] | None:
    """``items`` grouped by shared context (``sample.meta["context_index"]``), each context's items
    in question order (``meta["question_index"]``); ``None`` if the items are not shared-context
    samples."""
    if not items or any("context_index" not in it.sample.meta for it in items):
        return None
    out: dict[Any, list[Item]] = {}
    for it in items:
        out.setdefault(it.sample.meta["context_index"], []).append(it)
    return [sorted(c, key=lambda it: it.sample.meta.get("question_index", it.sample.index)) for c in out.values()]


def plan_eval(groups: list[Group], specs: list[PolicySpec], tokenizer: Any, max_positions: int, *, model: str,
              suite: str, question: str, seed: int, kv_dtype: str | None = None) -> Plan:
    """Tokenize every sample of ``groups`` (context and question apart) and check it fits the model.
    ``kv_dtype`` (the run's `Backend.kv_dtype`) goes into every key and label (`Plan.key`, `Plan.label`).

    Raises ``ValueError`` naming the sample whose prompt plus answer exceeds ``max_positions``.
    """
    if question not in QUESTION_MODES:
        raise ValueError(f"question={question!r} must be one of {QUESTION_MODES}")
    grouped: list[list[Item]] = []
    for g in groups:
        items = []
        for s in g.samples:
            ctx, q = encode(tokenizer, s)
            it = Item(g, s, ctx, q, int(s.max_new_tokens or 128))
            if it.num_tokens + it.max_new_tokens > max_positions:
                raise ValueError(f"{g.task} sample {s.index}: {it.num_tokens} prompt tokens + {it.max_new_tokens} "
                                 f"new exceed the model's {max_positions} positions")
            items.append(it)
        grouped.append(items)
    return Plan(model=model, suite=suite, question=question, seed=seed, specs=list(specs), groups=list(groups),
                items=grouped, max_positions=max_positions, kv_dtype=kv_dtype)


# ----------------------------------------------------------------------------------------------
# run
# ----------------------------------------------------------------------------------------------


class CompiledPrograms:
    """The (policy, shapes, decode length) programs a run has compiled so far.

    XLA:CPU keeps every compiled program's code mappings: a long run would reach the kernel's
    ``vm.max_map_count`` and crash, so past ``limit`` programs the caches are dropped and
    compiling starts afresh (on a GPU the programs' code is not mapped this way and recompiling
    costs time, so nothing is dropped there).
    """

    def __init__(self, limit: int = MAX_LIVE_PROGRAMS, platform: str | None = None) -> None:
        self.limit = limit
        self.platform = resolved().platform if platform is None else platform
        self.seen: set[tuple[Any, ...]] = set()

    def first_call(self, key: tuple[Any, ...]) -> bool:
        """Whether ``key`` compiles now (dropping older programs first if the limit is reached)."""
        import jax

        if key in self.seen:
            return False
        if len(self.seen) >= self.limit and self.platform == "cpu":
            jax.clear_caches()
            self.seen.clear()
        self.seen.add(key)
        return True


@dataclasses.dataclass(frozen=True)
class BatchRun:
    """One policy's `generate` call on a `Batch`: ``tokens`` ``[rows, N]``, ``num_generated``
    ``[rows]``, ``stats`` (on the host), one ``prediction`` per item (decoded, cut to the item's
    ``max_new_tokens``), wall ``seconds`` and whether they include compiling (``first_call``)."""

    tokens: np.ndarray
    num_generated: np.ndarray
    stats: dict[str, Any]
    predictions: list[str]
    seconds: float
    first_call: bool


def decode_length(batch: Batch, policy: Policy) -> int:
    """Tokens one `generate` call decodes for ``batch``: the longest answer limit, rounded up to a
    power of two (fewer compiles: rows stop at EOS and each answer is cut to its task's own limit;
    greedy decoding is causal, so the cut equals generating exactly that many), except for a
    backtracking policy (CHESS): it may rewrite earlier tokens when a page completes past the
    limit, so it decodes exactly the limit."""
    longest = max(it.max_new_tokens for it in batch.items)
    return longest if policy.max_rewind_tokens else bucket(longest)


def run_batch(params: Any, tokenizer: Any, spec: PolicySpec, batch: Batch, *, stop_tokens: tuple[int, ...],
              page_size: int = 16, prefill_chunk: int | None = None,
              programs: CompiledPrograms | None = None, mesh: Any = None, backend: Any = None) -> BatchRun:
    """Generate greedily with ``spec.policy`` on ``batch`` and decode each item's answer (on ``mesh``,
    if given: `sparsekv_jax.sharding`; ``backend``: `generate`'s, default the platform's)."""
    from sparsekv_jax.generate import generate

    new = decode_length(batch, spec.policy)
    first_call = programs.first_call((spec.key, batch.shapes(), new)) if programs is not None else True
    t0 = time.perf_counter()
    res = generate(params, spec.policy, batch.inputs["tokens"], lengths=batch.inputs["lengths"],
                   question_start=batch.inputs["question_start"], max_new_tokens=new, stop_tokens=stop_tokens,
                   page_size=page_size, prefill_chunk=prefill_chunk, suffix=batch.inputs["suffix"],
                   suffix_lengths=batch.inputs["suffix_lengths"], mesh=mesh, backend=backend)
    return _answers(tokenizer, batch, res, stop_tokens, t0, first_call)


def _answers(tokenizer: Any, batch: Batch, res: Any, stop_tokens: tuple[int, ...], t0: float,
             first_call: bool) -> BatchRun:
    """A `GenerateOutput` of ``batch`` on the host as a `BatchRun` (timed from ``t0``)."""
    import jax

    tokens, num = np.asarray(res.tokens), np.asarray(res.num_generated)
    stats = {k: np.asarray(v) if isinstance(v, jax.Array) else v for k, v in res.stats.items()}
    seconds = time.perf_counter() - t0
    predictions = []
    for i, it in enumerate(batch.items):
        ids = tokens[i, : min(int(num[i]), it.max_new_tokens)].tolist()
        predictions.append(tokenizer.decode([t for t in ids if t not in stop_tokens], skip_special_tokens=True))
    return BatchRun(tokens=tokens, num_generated=num, stats=stats, predictions=predictions, seconds=seconds,
                    first_call=first_call)


def run_shared(params: Any, tokenizer: Any, spec: PolicySpec, shared: SharedBatch, *, stop_tokens: tuple[int, ...],
               page_size: int = 16, prefill_chunk: int | None = None, programs: CompiledPrograms | None = None,
               mesh: Any = None, backend: Any = None) -> tuple[float, list[BatchRun]]:
    """``spec.policy`` on contexts asked their questions in turn: one `Session` prefills and
    compresses the contexts once (question-agnostic: the compression sees no question), then
    `Session.ask` reads each turn's questions into that compressed cache and decodes the answers
    greedily. Returns ``(seconds of the prefill and compression, one BatchRun per turn)``."""
    import jax

    from sparsekv_jax.engine import Session

    first = shared.turns[0]
    new = max(decode_length(t, spec.policy) for t in shared.turns)
    key = (spec.key, "shared", first.shapes(), len(shared.turns), new)
    first_call = programs.first_call(key) if programs is not None else True
    t0 = time.perf_counter()
    session = Session.start(params, spec.policy, first.inputs["tokens"], lengths=first.inputs["lengths"],
                            question_tokens=int(first.inputs["suffix"].shape[1]), max_new_tokens=new,
                            stop_tokens=stop_tokens, page_size=page_size, prefill_chunk=prefill_chunk, mesh=mesh,
                            backend=backend)
    jax.block_until_ready(session.compress())
    context_seconds = time.perf_counter() - t0
    runs = []
    for turn in shared.turns:
        t1 = time.perf_counter()
        res = session.ask(turn.inputs["suffix"], turn.inputs["suffix_lengths"])
        runs.append(_answers(tokenizer, turn, res, stop_tokens, t1, first_call))
    return context_seconds, runs


# ----------------------------------------------------------------------------------------------
# record
# ----------------------------------------------------------------------------------------------


def _json_value(value: Any, row: int | None, rows: int) -> Any:
    """``value`` as JSON: an array whose leading axis has ``rows`` entries gives entry ``row``
    (unless ``row`` is ``None``), any other array its whole contents, numpy scalars numbers."""
    if isinstance(value, Mapping):
        return {str(k): _json_value(v, row, rows) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v, None, rows) for v in value]
    if isinstance(value, np.generic) or (hasattr(value, "shape") and hasattr(value, "dtype")):
        a = np.asarray(value)
        if row is not None and a.ndim >= 1 and a.shape[0] == rows:
            a = a[row]
        if a.dtype.kind not in "biufU":  # e.g. bfloat16
            a = a.astype(np.float64)
        return a.tolist()
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return repr(value)


def row_stats(stats: Mapping[str, Any], row: int, rows: int) -> dict[str, Any]:
    """Every entry of `generate`'s ``stats`` for one row of a batch of ``rows``, JSON-ready.

    Per-row arrays (leading axis ``rows``: the kv fractions, a policy's ``decode_stats`` counters)
    give the row's value, scalars (``prefill_block_fraction``, ``cache_bytes``) stay as they are;
    the context stage's ``stats["context"]`` (a host-side dict) is kept whole with the same rule
    for the arrays in it (lists inside it are kept whole).
    """
    return {str(k): _json_value(v, row, rows) for k, v in stats.items()}


def make_record(plan: Plan, spec: PolicySpec, batch: Batch, row: int, run: BatchRun,
                fidelity: dict[str, Any] | None = None, fidelity_seconds: float | None = None) -> dict[str, Any]:
    """The results.jsonl line of ``batch.items[row]`` under ``spec`` (``fidelity``: its row of
    `sparsekv_jax.eval.fidelity.compare`, if measured)."""
    it = batch.items[row]
    pred = run.predictions[row]
    rec: dict[str, Any] = {
        "key": plan.key(it, spec),
        "model": plan.model, "suite": plan.suite, "question": plan.question, "seed": plan.seed,
        "task": it.group.task, "length": it.group.length, "column": report.column_name(it.group.task, it.group.length),
        "policy": plan.label(spec), "policy_key": spec.key, "family": spec.family, "budget": spec.budget,
        "kv_dtype": plan.kv_dtype,
        "index": it.sample.index, "sample_id": it.sample.sample_id,
        "metric": it.sample.metric, "score": it.sample.score(pred), "prediction": pred,
        "answers": list(it.sample.answers), "depths": list(it.sample.depths),
        "prompt_tokens": it.num_tokens, "context_tokens": len(it.context_ids), "question_tokens": len(it.question_ids),
        "generated_tokens": int(run.num_generated[row]), "max_new_tokens": it.max_new_tokens,
        "stats": row_stats(run.stats, row, batch.rows),
        "timing": {
            "batch_seconds": run.seconds, "batch_rows": batch.rows, "seconds_per_sample": run.seconds / batch.rows,
            "includes_compile": run.first_call, "fidelity_seconds": fidelity_seconds, "padded_width": batch.width,
        },
    }
    if fidelity is not None:
        rec["fidelity"] = fidelity
    return rec


def read_results(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a results.jsonl (a line cut short by an interrupted run is skipped)."""
    path = Path(path)
    if not path.exists():
        return []
    records = []
    with path.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def repair_results(path: str | os.PathLike[str]) -> list[str]:
    """Make every line of a results.jsonl a readable record before a run appends to it.

    An interrupted run can leave a line cut short (no newline, unreadable JSON); appending to it
    would glue the next record onto it and lose both. Unreadable lines are moved to
    ``<path>.damaged`` (appended, so nothing is thrown away) and the file is rewritten with the
    readable lines only (written to a temporary file, then renamed: an interruption here leaves
    the old file whole); a last line that reads but lacks its newline gets one. Returns the lines
    set aside (empty when the file was sound or is missing).
    """
    path = Path(path)
    if not path.exists():
        return []
    raw = path.read_bytes()
    if not raw:
        return []
    good: list[bytes] = []
    bad: list[bytes] = []
    for line in raw.splitlines():
        if not line.strip():
            continue
        try:
            ok = isinstance(json.loads(line), dict)
        except (json.JSONDecodeError, UnicodeDecodeError):
            ok = False
        (good if ok else bad).append(line)
    if not bad and raw.endswith(b"\n"):
        return []
    if bad:
        with path.with_name(path.name + ".damaged").open("ab") as f:
            f.write(b"".join(line + b"\n" for line in bad))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in good))
    os.replace(tmp, path)
    return [line.decode("utf-8", "replace") for line in bad]


# ----------------------------------------------------------------------------------------------
# the loop
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Options:
    stop_tokens: tuple[int, ...]
    page_size: int
    prefill_chunk: int | None
    fidelity: bool
    num_layers: int
    mesh: Any = None
    backend: Any = None


def _eval_batch(params: Any, tokenizer: Any, plan: Plan, batch: Batch, done: Mapping[str, Any], opts: _Options,
                programs: CompiledPrograms) -> Iterator[list[dict[str, Any]]]:
    """Run every policy with rows pending on ``batch``; yield each policy's new records."""
    from sparsekv_jax.eval import fidelity as fid

    pending = plan.pending(batch, done, opts.fidelity)
    others_pending = any(pending[s.key] for s in plan.specs if not is_dense(s.policy))
    ref: fid.Reference | None = None
    dense_run: BatchRun | None = None
    for spec in plan.specs:  # full attention first: fidelity reuses its answers
        rows = pending[spec.key]
        # full attention also runs when only its answer is needed (the fidelity reference)
        if not rows and not (is_dense(spec.policy) and opts.fidelity and others_pending):
            continue
        run = run_batch(params, tokenizer, spec, batch, stop_tokens=opts.stop_tokens, page_size=opts.page_size,
                        prefill_chunk=opts.prefill_chunk, programs=programs, mesh=opts.mesh, backend=opts.backend)
        if is_dense(spec.policy):
            dense_run = run
        fids, fid_seconds = None, None
        if opts.fidelity and rows:
            t1 = time.perf_counter()
            if ref is None:
                ref = fid.reference(params, batch.inputs["tokens"], lengths=batch.inputs["lengths"],
                                    question_start=batch.inputs["question_start"], suffix=batch.inputs["suffix"],
                                    suffix_lengths=batch.inputs["suffix_lengths"],
                                    max_new_tokens=decode_length(batch, spec.policy), stop_tokens=opts.stop_tokens,
                                    page_size=opts.page_size,
                                    forced=None if dense_run is None else dense_run.tokens,
                                    steps=None if dense_run is None else dense_run.num_generated, mesh=opts.mesh,
                                    backend=opts.backend)
            if is_dense(spec.policy):  # exactly the reference: zeros, nothing to run
                fids = fid.identical(ref, opts.num_layers)
            else:
                fids = fid.compare(params, spec.policy, ref)
            fid_seconds = time.perf_counter() - t1
        yield [make_record(plan, spec, batch, i, run, None if fids is None else fids[i], fid_seconds) for i in rows]


def _eval_shared(params: Any, tokenizer: Any, plan: Plan, shared: SharedBatch, done: Mapping[str, Any],
                 opts: _Options, programs: CompiledPrograms) -> Iterator[list[dict[str, Any]]]:
    """Run every policy with rows pending on ``shared`` (one `Session` each: compress once, ask each
    question); yield each policy's new records."""
    pending = [plan.pending(turn, done, False) for turn in shared.turns]
    for spec in plan.specs:
        todo = [[i for i in p[spec.key] if i in real] for p, real in zip(pending, shared.real, strict=True)]
        if not any(todo):
            continue
        context_seconds, runs = run_shared(params, tokenizer, spec, shared, stop_tokens=opts.stop_tokens,
                                           page_size=opts.page_size, prefill_chunk=opts.prefill_chunk,
                                           programs=programs, mesh=opts.mesh, backend=opts.backend)
        records = []
        for j, (turn, run, rows) in enumerate(zip(shared.turns, runs, todo, strict=True)):
            for i in rows:
                rec = make_record(plan, spec, turn, i, run)
                rec["shared_context"], rec["question_index"] = True, j
                rec["timing"].update(context_seconds=context_seconds, questions=len(shared.turns),
                                     seconds_per_sample=(run.seconds + context_seconds / len(shared.turns))
                                     / turn.rows)
                records.append(rec)
        yield records


def _checked_specs(policies: str | Sequence[str | Policy], prefill_chunk: int | None, fidelity: bool,
                   add_fullkv: bool) -> list[PolicySpec]:
    specs = policy_specs(policies)
    if prefill_chunk is not None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be >= 1")
        if fidelity:
            raise ValueError("prefill_chunk is not supported with fidelity (its references prefill in one pass)")
        whole = [s.label for s in specs if s.policy.needs_whole_prefill]
        if whole:
            raise ValueError(f"prefill_chunk={prefill_chunk}: {', '.join(whole)} need(s) the whole prompt in one "
                             "prefill pass (a prefill block pattern or prefill observations)")
    if add_fullkv and not any(is_dense(s.policy) for s in specs):
        specs = policy_specs("fullkv") + specs
    specs.sort(key=lambda s: not is_dense(s.policy))  # full attention first: fidelity reuses its answers
    return specs


def _load_model(model: Any, model_name: str | None, dtype: Any, progress: bool,
                cache_dir: str | os.PathLike[str] | None) -> tuple[Any, Any, str]:
    if isinstance(model, tuple):
        params, tokenizer = model
        return params, tokenizer, model_name or "custom"
    import jax.numpy as jnp

    from sparsekv_jax.models.embedded import load

    params, tokenizer = load(model, dtype=jnp.float32 if dtype is None else dtype, progress=progress,
                             cache_dir=cache_dir)
    return params, tokenizer, model_name or (str(model) if isinstance(model, (str, os.PathLike)) else "custom")


@dataclasses.dataclass(frozen=True)
class EvalOptions:
    """The options of `run_eval` besides the model, suite, policies and output folder.

    Attributes:
      tasks: task names (default: all of the suite).
      lengths: RULER prompt lengths / LongBench truncation lengths, ints or ``"4k"`` strings
        (default: 4k for RULER; the model's limit for LongBench; all folders of a RULER path).
      n: samples per task and length.
      seed: RULER's sample seed (part of the resume key for every suite).
      question: ``"agnostic"`` (compress the context, then read the question) or ``"aware"``.
      batch_size: rows per `generate` call.
      fidelity: also measure KL / top-1 agreement / attention-output error against full attention.
      progress: a tqdm bar over (sample, policy) pairs.
      dtype: weight dtype when loading ``model`` (default float32).
      model_name: name in the resume key (default: ``model`` when it is a string).
      longbench_path: LongBench data for ``suite="longbench"`` (default: the shipped sample).
      cache_dir: cache root for the embedded model and RULER's data files.
      page_size: KV cache page size.
      pad_multiple: prompts are right-padded to a multiple of this (fewer distinct shapes).
      add_fullkv: run full attention too when no policy is dense (the "% kept" reference).
      prefill_chunk: prefill prompts in chunks of this many tokens (memory: a chunk's scores
        instead of the whole prompt's); only for policies that need no one-pass prefill
        (``needs_whole_prefill`` false: full attention, decode-stage policies such as Quest and
        CHESS), and not with ``fidelity``.
      mesh: a ``data`` × ``model`` device mesh (`sparsekv_jax.sharding.make_mesh`) every `generate`
        runs on; batches are filled up to a multiple of its ``data`` axis.
      backend: the `sparsekv_jax.Backend` of every `generate` (default: ``Backend()``, the platform's
        choices; ``sparsekv eval`` passes `Backend.from_env`, which reads ``$SPARSEKV_DECODE_MATMUL``).
    """

    tasks: Sequence[str] | None = None
    lengths: Sequence[int | str] | str | None = None
    n: int = 10
    seed: int = 0
    question: str = "agnostic"
    batch_size: int = 4
    fidelity: bool = False
    progress: bool = True
    dtype: Any = None
    model_name: str | None = None
    longbench_path: str | os.PathLike[str] | None = None
    cache_dir: str | os.PathLike[str] | None = None
    page_size: int = 16
    pad_multiple: int = 64
    add_fullkv: bool = True
    prefill_chunk: int | None = None
    mesh: Any = None
    backend: Any = None


def eval_options(**options: Any) -> EvalOptions:
    """`EvalOptions` from `run_eval`'s keyword options (or ``options=EvalOptions(...)``, taken whole).

    Raises:
      TypeError: an unknown keyword (named, with the valid ones listed), or an ``options=`` that is
        not an `EvalOptions`.
      ValueError: both ``options=`` and keyword options.
    """
    from sparsekv_jax.engine.run import options_of

    return options_of(options, EvalOptions)


def run_eval(model: str | os.PathLike[str] | tuple[Any, Any] = "smollm2", suite: str = "ruler", *,
             policies: str | Sequence[str | Policy] = "fullkv", out_dir: str | os.PathLike[str] = "eval_out",
             **options: Any) -> dict[str, Any]:
    """Evaluate ``policies`` on a suite; append results to ``out_dir/results.jsonl``; write summaries.

    Args:
      model: ``"smollm2"``, a model directory / ``.gguf`` path (loaded with
        `sparsekv_jax.models.embedded.load`), or an already loaded ``(params, tokenizer)``.
      suite: ``"ruler"``, ``"longbench"`` (the MiniLongBench sample shipped with the package) or a
        path (see :mod:`sparsekv_jax.eval.suites`).
      policies: a spec string (``"fullkv, snapkv(budget=0.1)"``) or a list of specs / `Policy`.
      out_dir: where results and summaries go (created).
      **options: the fields of `EvalOptions` (``tasks``, ``lengths``, ``n``, ``seed``, ``question``,
        ``batch_size``, ``fidelity``, ``progress``, ``dtype``, ``model_name``, ``longbench_path``,
        ``cache_dir``, ``page_size``, ``pad_multiple``, ``add_fullkv``, ``prefill_chunk``, ``mesh``,
        ``backend``), or ``options=EvalOptions(...)``. They are checked before the model loads: an
        unknown keyword raises `TypeError` naming it.

    Shared-context suites (``ruler-shared``) in question-agnostic mode without ``fidelity`` run each
    batch of contexts as one `Session` per policy: compressed once, asked each question in turn
    (see the module docstring).

    Returns:
      The summary (also written to ``summary.json``), see `sparsekv_jax.eval.report.summarize`.
    """
    o = eval_options(**options)
    tasks, lengths, n, seed, question, batch_size = o.tasks, o.lengths, o.n, o.seed, o.question, o.batch_size
    fidelity, progress, page_size, pad_multiple = o.fidelity, o.progress, o.page_size, o.pad_multiple
    prefill_chunk, cache_dir, mesh, backend = o.prefill_chunk, o.cache_dir, o.mesh, o.backend
    from tqdm.auto import tqdm

    if question not in QUESTION_MODES:
        raise ValueError(f"question={question!r} must be one of {QUESTION_MODES}")
    if n < 1 or batch_size < 1:
        raise ValueError(f"n={n} and batch_size={batch_size} must be >= 1")
    specs = _checked_specs(policies, prefill_chunk, fidelity, o.add_fullkv)
    length_list = parse_lengths(lengths) if lengths else None
    params, tokenizer, name = _load_model(model, o.model_name, o.dtype, progress, cache_dir)
    # what a policy needs of the tokenizer (delimiter masks) is fixed once; keys stay the spec's
    specs = [dataclasses.replace(s, policy=s.policy.with_tokenizer(tokenizer)) for s in specs]
    cfg = params.config
    stop = tuple(sorted({*cfg.eos_token_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None
                                               else [])}))
    suite_id, groups = build_groups(suite, tasks, length_list, n, seed, tokenizer, cfg.max_position_embeddings,
                                    cache_dir, o.longbench_path)
    kv_dtype = None if backend is None else backend.kv_dtype
    plan = plan_eval(groups, specs, tokenizer, cfg.max_position_embeddings, model=name, suite=suite_id,
                     question=question, seed=seed, kv_dtype=kv_dtype)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.jsonl"
    damaged = repair_results(results_path)
    if damaged:
        warnings.warn(f"{results_path}: {len(damaged)} unreadable line(s) (a run cut short) moved to "
                      f"{results_path}.damaged; their samples run again", stacklevel=2)
    done: dict[str, dict[str, Any]] = {r["key"]: r for r in read_results(results_path) if "key" in r}
    opts = _Options(stop_tokens=stop, page_size=page_size, prefill_chunk=prefill_chunk, fidelity=fidelity,
                    num_layers=cfg.num_layers, mesh=mesh, backend=backend)

    shared = question == "agnostic" and not fidelity
    batch_list = list(plan.batches(batch_size, pad_multiple, 1 if mesh is None else int(mesh.shape["data"]), shared))
    total = sum(_pending_count(plan, b, done, fidelity) for b in batch_list)
    bar = tqdm(total=total, disable=bar_disabled(progress), desc="eval", unit="sample")
    programs = CompiledPrograms(MAX_LIVE_PROGRAMS, resolved(backend).platform)
    with results_path.open("a", encoding="utf-8") as sink:
        for batch in batch_list:
            run = _eval_shared if isinstance(batch, SharedBatch) else _eval_batch
            steps = run(params, tokenizer, plan, batch, done, opts, programs)
            for records in steps:
                for rec in records:
                    sink.write(json.dumps(rec) + "\n")
                    done[rec["key"]] = rec
                sink.flush()
                bar.update(len(records))
    bar.close()

    records = [done[k] for k in sorted(set(plan.keys())) if k in done]
    summary = report.summarize(records, policy_order=[plan.label(s) for s in specs],
                               column_order=column_order(groups))
    summary.update({"model": name, "suite": suite_id, "question": question, "seed": seed, "n": n,
                    "fidelity": fidelity, "kv_dtype": kv_dtype, "out_dir": str(out)})
    report.write_reports(summary, out)
    return summary


def _pending_count(plan: Plan, batch: Batch | SharedBatch, done: Mapping[str, Any], fidelity: bool) -> int:
    if isinstance(batch, SharedBatch):
        return sum(len(set(rows) & set(real)) for turn, real in zip(batch.turns, batch.real, strict=True)
                   for rows in plan.pending(turn, done, fidelity).values())
    return sum(len(rows) for rows in plan.pending(batch, done, fidelity).values())


def column_order(groups: list[Group]) -> list[str]:
    seen: list[str] = []
    for g in sorted(groups, key=lambda g: g.length if g.length is not None else math.inf):
        c = report.column_name(g.task, g.length)
        if c not in seen:
            seen.append(c)
    return seen

