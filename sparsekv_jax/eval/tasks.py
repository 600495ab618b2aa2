"""Common task and sample types of the evaluation harness, and prompt helpers shared by suites.

Every evaluation prompt is split in two: ``context`` (everything up to and including the long
document, chat-template prefix included) and ``question`` (the query, the chat template's
closing tokens and any answer prefix), with ``prompt == context + question``. A question-agnostic
KV-compression policy can prefill and compress ``context`` alone and then append ``question``.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

from sparsekv_jax.eval import metrics as _metrics

__all__ = ["JSONL_SUFFIXES", "Sample", "Task", "count_tokens", "iter_jsonl", "iter_jsonl_lines", "jsonl_files",
           "jsonl_stem", "render_prompt", "score_samples"]

# Data files the suites read: plain jsonl, or gzip'd (as the package's own data ships).
JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")


@dataclass(frozen=True)
class Task:
    """One evaluation task of a suite.

    Attributes:
        name: task name, e.g. ``"niah_single_1"`` or ``"hotpotqa"``.
        suite: ``"ruler"`` or ``"longbench"``.
        metric: metric name from :data:`sparsekv_jax.eval.metrics.METRICS`.
        max_new_tokens: generation budget the suite uses for this task.
        first_line_only: score only the first line of the prediction (LongBench few-shot tasks).
        description: one line on what the task tests.
    """

    name: str
    suite: str
    metric: str
    max_new_tokens: int
    first_line_only: bool = False
    description: str = ""


@dataclass(frozen=True)
class Sample:
    """One prompt with its gold answers.

    Attributes:
        task: task name.
        index: position of the sample within its generated / loaded set.
        context: text before the question (chat prefix + instructions + long document).
        question: the query part; ``context + question`` is the full prompt.
        answers: gold strings.
        metric: metric name (see :mod:`sparsekv_jax.eval.metrics`).
        depths: for needle tasks, where each inserted needle sits, as the fraction of the
            haystack text before it (0 = start, 1 = end), in insertion order; empty otherwise.
        num_tokens: prompt length in tokens, when it was measured with a tokenizer.
        max_new_tokens: generation budget of the task.
        all_classes: label set for classification metrics.
        first_line_only: score only the first line of a prediction.
        sample_id: identifier from the source data, if any.
        meta: task-specific extras (e.g. haystack type, char spans of needles in ``prompt``).
    """

    task: str
    index: int
    context: str
    question: str
    answers: tuple[str, ...]
    metric: str
    depths: tuple[float, ...] = ()
    num_tokens: int | None = None
    max_new_tokens: int | None = None
    all_classes: tuple[str, ...] | None = None
    first_line_only: bool = False
    sample_id: str | None = None
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """The full prompt text, ``context + question``."""
        return self.context + self.question

    @property
    def depth(self) -> float | None:
        """Depth of the single needle, or ``None`` when there is not exactly one."""
        return self.depths[0] if len(self.depths) == 1 else None

    def score(self, prediction: str) -> float:
        """Score a model's prediction for this sample, in ``[0, 1]``."""
        return _metrics.score(
            self.metric,
            prediction,
            self.answers,
            all_classes=self.all_classes,
            first_line_only=self.first_line_only,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict of all fields plus ``prompt``."""
        d = asdict(self)
        d["meta"] = dict(self.meta)
        d["prompt"] = self.prompt
        return d


def count_tokens(tokenizer: Any, text: str, *, chat: bool) -> int:
    """Number of tokens the model sees for ``text``.

    A chat-templated prompt already holds its special tokens (BOS included where the template
    has one), so it is tokenized with ``add_special_tokens=False``; a plain prompt gets the
    tokenizer's usual special tokens.
    """
    return len(tokenizer(text, add_special_tokens=not chat)["input_ids"])


def render_prompt(
    tokenizer: Any,
    context_text: str,
    question_text: str,
    *,
    chat: bool,
    answer_prefix: str = "",
    system_prompt: str | None = None,
) -> tuple[str, str]:
    """Wrap a user message ``context_text + question_text`` and split the result.

    With ``chat`` the message goes through ``tokenizer.apply_chat_template`` (one user turn,
    generation prompt added) and ``answer_prefix`` (leading whitespace removed) follows the
    assistant header; without, the prompt is the raw text followed by ``answer_prefix`` as is
    (RULER's ``base`` template). Returns ``(context, question)`` where ``context`` ends right
    after ``context_text`` inside the rendered prompt.
    """
    user = context_text + question_text
    if not chat:
        return context_text, question_text + answer_prefix
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("chat=True but the tokenizer has no chat template")
    messages: list[dict[str, str]] = []
    if system_prompt is not None:
        messages.append({"role": "system", "content": system_prompt})
    messages.append({"role": "user", "content": user})
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    rendered = rendered + answer_prefix.lstrip()
    at = rendered.rfind(user)
    if at >= 0:
        cut = at + len(context_text)
    else:
        # The template altered the message (e.g. stripped it): cut before the question text.
        q = question_text.strip()
        at = rendered.rfind(q) if q else -1
        if at < 0:
            raise ValueError("could not locate the question inside the chat-templated prompt")
        cut = at
    return rendered[:cut], rendered[cut:]


def score_samples(samples: Sequence[Sample], predictions: Sequence[str]) -> dict[str, float]:
    """Per-task score (``round(100 * mean, 2)``, as RULER and LongBench report) of aligned predictions."""
    if len(samples) != len(predictions):
        raise ValueError(f"{len(samples)} samples but {len(predictions)} predictions")
    per_task: dict[str, list[float]] = {}
    for s, p in zip(samples, predictions, strict=True):
        per_task.setdefault(s.task, []).append(s.score(p))
    return {task: _metrics.aggregate(scores) for task, scores in sorted(per_task.items())}


def jsonl_stem(path: str | os.PathLike[str]) -> str:
    """File name without ``.jsonl`` / ``.jsonl.gz`` (``"hotpotqa.jsonl.gz"`` → ``"hotpotqa"``)."""
    name = Path(path).name
    for suffix in sorted(JSONL_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return Path(path).stem


def jsonl_files(directory: str | os.PathLike[str], recursive: bool = False) -> list[Path]:
    """The ``.jsonl`` and ``.jsonl.gz`` files in ``directory`` (and below it if ``recursive``), sorted.

    Raises ``ValueError`` when one folder holds both forms of the same file (``x.jsonl`` and
    ``x.jsonl.gz``): their records would be read twice.
    """
    root = Path(directory)
    files = sorted({p for suffix in JSONL_SUFFIXES
                    for p in (root.rglob(f"*{suffix}") if recursive else root.glob(f"*{suffix}")) if p.is_file()})
    seen: dict[tuple[Path, str], Path] = {}
    for f in files:
        other = seen.setdefault((f.parent, jsonl_stem(f)), f)
        if other != f:
            raise ValueError(f"both {other} and {f} exist: keep one of them")
    return files


def _open_text(path: Path) -> TextIO:
    if path.name.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def iter_jsonl_lines(path: str | os.PathLike[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number, record)`` of a ``.jsonl`` or gzip'd ``.jsonl.gz`` file, one per non-blank line
    (numbered from 1, blank lines counted).

    Raises ``ValueError`` naming the file and line of a line that is not JSON or not a JSON object.
    """
    path = Path(path)
    with _open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} line {number}: invalid JSON ({e.msg} at column {e.colno})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path} line {number}: a record must be a JSON object, not {type(record).__name__}")
            yield number, record


def iter_jsonl(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The records of a ``.jsonl`` or gzip'd ``.jsonl.gz`` file, one per non-blank line (errors as
    :func:`iter_jsonl_lines`)."""
    for _, record in iter_jsonl_lines(path):
        yield record
