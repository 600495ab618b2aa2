"""LongBench (v1) loader, prompt preparation and scoring.

Reads LongBench-format jsonl, plain (``.jsonl``) or gzip'd (``.jsonl.gz``; by default the
MiniLongBench sample shipped in `sparsekv_jax.datasets`): one record per line with either
``prompt`` (the full LongBench prompt) or ``context`` + ``input`` (LongBench's raw fields,
formatted here with LongBench's own ``dataset2prompt`` template), plus ``answers`` and optionally
``all_classes``. ``answers`` may also be a list of ``{"answers": [...], "all_classes": [...]}``
dicts (MiniLongBench's trec).

Every sample is split into ``context`` + ``question`` (``prompt == context + question``) so
that question-agnostic compression can cache the context alone. For ``prompt``-only records the
split is at the last occurrence of the task's question marker (:data:`QUESTION_MARKERS`, taken
from LongBench's templates):

================================  ==========================================================
task                              question starts at (last occurrence of)
================================  ==========================================================
narrativeqa                       ``\\n\\nNow, answer the question based on the story``
qasper                            ``\\n\\n Answer the question based on the above article``
                                  (MiniLongBench's qasper uses the multi-doc QA template:
                                  ``\\n\\nAnswer the question based on the given passages``)
multifieldqa_en                   ``\\n\\nNow, answer the following question based on the above text``
hotpotqa, 2wikimqa, musique       ``\\n\\nAnswer the question based on the given passages``
gov_report                        ``\\n\\nNow, write a one-page summary of the report.``
qmsum                             ``\\n\\nNow, answer the query based on the above meeting transcript``
multi_news                        ``\\n\\nNow, write a one-page summary of all the news.``
trec                              ``\\nQuestion:`` (the question to classify)
triviaqa                          ``\\n\\nPassage:`` (the passage + question to answer)
samsum                            ``\\n\\nDialogue:`` (the dialogue to summarise)
passage_count                     ``\\n\\nPlease enter the final count of unique paragraphs``
passage_retrieval_en              ``\\n\\nThe following is an abstract.``
lcc, repobench-p                  ``Next line of code:\\n`` (repobench-p's in-file code stays in
                                  the context for ``prompt``-only records)
other tasks                       ``\\n\\nQuestion:``, then ``\\nQuestion:``
================================  ==========================================================

:func:`prepare` applies LongBench's middle truncation (keep the first and the last
``max_tokens // 2`` tokens) and the chat template (not for trec, triviaqa, samsum, lsht, lcc,
repobench-p, as in LongBench's ``pred.py``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from sparsekv_jax.eval.tasks import (
    Sample,
    Task,
    count_tokens,
    iter_jsonl_lines,
    jsonl_files,
    jsonl_stem,
    render_prompt,
    score_samples,
)

__all__ = [
    "DATASET2MAXGEN",
    "DATASET2METRIC",
    "DATASET2PROMPT",
    "FIRST_LINE_TASKS",
    "LONGBENCH_TASKS",
    "NO_CHAT_TASKS",
    "QUESTION_MARKERS",
    "evaluate",
    "load_longbench",
    "prepare",
    "read_jsonl",
    "split_prompt",
    "truncate_middle",
]

# LongBench's config/dataset2prompt.json (English tasks), verbatim.
_MULTIDOC = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other "
    "words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
_QASPER_RULES = (
    "as concisely as you can, using a single phrase or sentence if possible. If the question cannot be "
    "answered based on the information in the article, write \"unanswerable\". If the question is a yes/no "
    "question, answer \"yes\", \"no\", or \"unanswerable\". Do not provide any explanation."
)
DATASET2PROMPT: dict[str, str] = {
    "narrativeqa": (
        "You are given a story, which can be either a novel or a movie script, and a question. Answer the "
        "question asconcisely as you can, using a single phrase if possible. Do not provide any explanation."
        "\n\nStory: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a "
        "single phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:"
    ),
    "qasper": (
        "You are given a scientific article and a question. Answer the question " + _QASPER_RULES
        + "\n\nArticle: {context}\n\n Answer the question based on the above article " + _QASPER_RULES
        + "\n\nQuestion: {input}\n\nAnswer:"
    ),
    "multifieldqa_en": (
        "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following question based "
        "on the above text, only give me the answer and do not output any other words.\n\nQuestion: {input}\n"
        "Answer:"
    ),
    "hotpotqa": _MULTIDOC,
    "2wikimqa": _MULTIDOC,
    "musique": _MULTIDOC,
    "gov_report": (
        "You are given a report by a government agency. Write a one-page summary of the report.\n\nReport:\n"
        "{context}\n\nNow, write a one-page summary of the report.\n\nSummary:"
    ),
    "qmsum": (
        "You are given a meeting transcript and a query containing a question or instruction. Answer the query "
        "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
        "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:"
    ),
    "multi_news": (
        "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}\n\n"
        "Now, write a one-page summary of all the news.\n\nSummary:"
    ),
    "trec": (
        "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
        "{input}"
    ),
    "triviaqa": (
        "Answer the question based on the given passage. Only give me the answer and do not output any other "
        "words. The following are some examples.\n\n{context}\n\n{input}"
    ),
    "samsum": (
        "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
        "{input}"
    ),
    "passage_count": (
        "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please carefully "
        "read these paragraphs and determine how many unique paragraphs there are after removing duplicates. In "
        "other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
        "count of unique paragraphs after removing duplicates. The output format should only contain the number, "
        "such as 1, 2, 3, and so on.\n\nThe final answer is: "
    ),
    "passage_retrieval_en": (
        "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which paragraph the "
        "abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the number of "
        "the paragraph that the abstract is from. The answer format must be like \"Paragraph 1\", \"Paragraph 2\", "
        "etc.\n\nThe answer is: "
    ),
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
# LongBench's config/dataset2maxlen.json.
DATASET2MAXGEN: dict[str, int] = {
    "narrativeqa": 128, "qasper": 128, "multifieldqa_en": 64, "hotpotqa": 32, "2wikimqa": 32, "musique": 32,
    "gov_report": 512, "qmsum": 512, "multi_news": 512, "trec": 64, "triviaqa": 32, "samsum": 128,
    "lsht": 64, "passage_count": 32, "passage_retrieval_en": 32, "lcc": 64, "repobench-p": 64,
}
# LongBench's eval.py dataset2metric (English tasks and lsht), by metric name.
DATASET2METRIC: dict[str, str] = {
    "narrativeqa": "qa_f1", "qasper": "qa_f1", "multifieldqa_en": "qa_f1", "hotpotqa": "qa_f1",
    "2wikimqa": "qa_f1", "musique": "qa_f1", "triviaqa": "qa_f1",
    "gov_report": "rouge", "qmsum": "rouge", "multi_news": "rouge", "samsum": "rouge",
    "trec": "classification", "lsht": "classification",
    "passage_retrieval_en": "retrieval", "passage_count": "count",
    "lcc": "code_sim", "repobench-p": "code_sim",
}
# eval.py keeps only the first line of predictions for these.
FIRST_LINE_TASKS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht"})
# pred.py does not apply the chat template for these.
NO_CHAT_TASKS: frozenset[str] = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})

_QA_MULTIDOC_MARK = "\n\nAnswer the question based on the given passages"
QUESTION_MARKERS: dict[str, tuple[str, ...]] = {
    "narrativeqa": ("\n\nNow, answer the question based on the story",),
    "qasper": ("\n\n Answer the question based on the above article", _QA_MULTIDOC_MARK),
    "multifieldqa_en": ("\n\nNow, answer the following question based on the above text",),
    "hotpotqa": (_QA_MULTIDOC_MARK,),
    "2wikimqa": (_QA_MULTIDOC_MARK,),
    "musique": (_QA_MULTIDOC_MARK,),
    "gov_report": ("\n\nNow, write a one-page summary of the report.",),
    "qmsum": ("\n\nNow, answer the query based on the above meeting transcript",),
    "multi_news": ("\n\nNow, write a one-page summary of all the news.",),
    "trec": ("\nQuestion:",),
    "triviaqa": ("\n\nPassage:",),
    "samsum": ("\n\nDialogue:",),
    "passage_count": ("\n\nPlease enter the final count of unique paragraphs",),
    "passage_retrieval_en": ("\n\nThe following is an abstract.",),
    "lcc": ("Next line of code:\n",),
    "repobench-p": ("Next line of code:\n",),
}
_FALLBACK_MARKERS: tuple[str, ...] = ("\n\nQuestion:", "\nQuestion:")

LONGBENCH_TASKS: dict[str, Task] = {
    name: Task(name, "longbench", metric, DATASET2MAXGEN[name], first_line_only=name in FIRST_LINE_TASKS)
    for name, metric in DATASET2METRIC.items()
}


def split_prompt(task: str, prompt: str) -> tuple[str, str]:
    """Split a full LongBench prompt into ``(context, question)`` at the task's question marker.

    The first marker of :data:`QUESTION_MARKERS` (then the generic ``Question:`` markers) found
    in the prompt is used, at its last occurrence. Raises ``ValueError`` if none is found.
    """
    for marker in (*QUESTION_MARKERS.get(task, ()), *_FALLBACK_MARKERS):
        at = prompt.rfind(marker)
        if at > 0:
            return prompt[:at], prompt[at:]
    raise ValueError(f"no question marker of task {task!r} found in the prompt")


def _format(task: str, context: str, inp: str) -> tuple[str, str]:
    """LongBench's template for ``task`` filled with ``context`` and ``input``, split after the context."""
    if task not in DATASET2PROMPT:
        raise ValueError(f"no LongBench template for task {task!r}; give records a 'prompt' field")
    template = DATASET2PROMPT[task]
    head, tail = template.split("{context}", 1)
    # str.replace, not str.format: documents may contain braces.
    return head + context, tail.replace("{input}", inp)


def _parse_answers(record: dict[str, Any]) -> tuple[tuple[str, ...], tuple[str, ...] | None]:
    answers: list[str] = []
    classes: list[str] | None = list(record["all_classes"]) if record.get("all_classes") else None
    raw = record.get("answers", [])
    if isinstance(raw, str | dict):
        raw = [raw]
    for a in raw:
        if isinstance(a, dict):
            inner = a.get("answers", [])
            answers += [inner] if isinstance(inner, str) else list(inner)
            if a.get("all_classes") and classes is None:
                classes = list(a["all_classes"])
        else:
            answers.append(str(a))
    return tuple(answers), None if classes is None else tuple(classes)


def _record_to_sample(record: dict[str, Any], task: str, index: int, source: str, line: int | None = None) -> Sample:
    where = f"{source} line {index + 1 if line is None else line}"
    if "outputs" in record and "answers" not in record:
        raise ValueError(f"{where}: a RULER record ('outputs', no 'answers') among LongBench records; a LongBench "
                         "record needs 'answers' and 'prompt' or 'context' + 'input'")
    metric = DATASET2METRIC.get(task)
    if metric is None:
        raise ValueError(f"{where}: unknown LongBench task {task!r} (from the record's 'task'/'dataset' field or "
                         f"the file name); known: {sorted(DATASET2METRIC)}")
    if "prompt" in record and record["prompt"] is not None:
        try:
            context, question = split_prompt(task, record["prompt"])
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
    elif "context" in record and "input" in record:
        context, question = _format(task, record["context"], record["input"] or "")
    else:
        missing = "'context'" if "input" in record else "'input'" if "context" in record else "'prompt'"
        raise ValueError(f"{where}: LongBench record without {missing}; it needs 'prompt' or 'context' + 'input'")
    if "answers" not in record:
        raise ValueError(f"{where}: LongBench record without 'answers'")
    answers, classes = _parse_answers(record)
    if not answers:
        raise ValueError(f"{where}: no answers ('answers' is empty)")
    if metric == "classification" and not classes:
        raise ValueError(f"{where}: task {task} needs all_classes")
    sid = record.get("id", record.get("_id"))
    return Sample(
        task=task,
        index=index,
        context=context,
        question=question,
        answers=answers,
        metric=metric,
        max_new_tokens=DATASET2MAXGEN.get(task),
        all_classes=classes,
        first_line_only=task in FIRST_LINE_TASKS,
        sample_id=None if sid is None else str(sid),
        meta={"source": source, "length": record.get("length"), "truncated": False, "chat": False},
    )


def read_jsonl(path: str | os.PathLike[str], task: str | None = None, limit: int | None = None) -> list[Sample]:
    """Read one LongBench jsonl file (``.jsonl``, or gzip'd ``.jsonl.gz``).

    The task is ``task`` if given, else the record's ``task`` (or ``dataset``) field, else the
    file name without ``.jsonl`` / ``.jsonl.gz`` (LongBench names its files ``<task>.jsonl``).
    """
    path = Path(path)
    samples: list[Sample] = []
    for line, record in iter_jsonl_lines(path):
        name = task or record.get("task") or record.get("dataset") or jsonl_stem(path)
        if name.endswith("_e"):  # LongBench-E files: same task, length-balanced subset
            name = name[:-2]
        samples.append(_record_to_sample(record, name, len(samples), str(path), line))
        if limit is not None and len(samples) >= limit:
            break
    return samples


def load_longbench(
    path: str | os.PathLike[str] | None = None,
    tasks: Iterable[str] | None = None,
    limit: int | None = None,
) -> dict[str, list[Sample]]:
    """Load LongBench samples from a jsonl file or a directory of ``<task>.jsonl`` files.

    Args:
        path: a ``.jsonl`` / ``.jsonl.gz`` file or a directory holding them; ``None``: the
            MiniLongBench sample shipped with the package (`sparsekv_jax.datasets`).
        tasks: only these tasks (by file name / record task); all by default.
        limit: at most this many samples per file.

    Returns:
        ``{task: [Sample, ...]}`` in file order, tasks sorted by name.
    """
    if path is None:
        from sparsekv_jax.datasets import LONGBENCH_MINI_DIR

        path = LONGBENCH_MINI_DIR
    path = Path(path)
    files = jsonl_files(path) if path.is_dir() else [path]
    if not files:
        raise FileNotFoundError(f"no .jsonl or .jsonl.gz files in {path}")
    wanted = None if tasks is None else set(tasks)
    out: dict[str, list[Sample]] = {}
    for file in files:
        stem = jsonl_stem(file)
        stem = stem[:-2] if stem.endswith("_e") else stem
        if wanted is not None and stem not in wanted and path.is_dir():
            continue
        for s in read_jsonl(file, limit=limit):
            if wanted is None or s.task in wanted:
                out.setdefault(s.task, []).append(s)
    return dict(sorted(out.items()))


def truncate_middle(text: str, tokenizer: Any, max_tokens: int) -> str:
    """LongBench's truncation: if ``text`` has more than ``max_tokens`` tokens keep the first and
    the last ``max_tokens // 2`` (decoded back to text); otherwise return it unchanged."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    return _decode(tokenizer, ids[:half]) + _decode(tokenizer, ids[len(ids) - half:])


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode(list(ids), skip_special_tokens=True, clean_up_tokenization_spaces=False)


def prepare(sample: Sample, tokenizer: Any, max_tokens: int | None = None, chat: bool = True) -> Sample:
    """Truncate a LongBench sample to ``max_tokens`` and apply the chat template, like ``pred.py``.

    ``max_tokens`` bounds the raw LongBench prompt (before the chat template, as in LongBench,
    whose ``model2maxlen`` leaves room for the template and the answer). The question is kept
    whole when it fits in the tail half; the chat template is skipped for :data:`NO_CHAT_TASKS`.
    The returned sample has ``num_tokens`` of the final prompt and ``meta['truncated']`` /
    ``meta['chat']`` set.
    """
    context, question = sample.context, sample.question
    truncated = False
    if max_tokens is not None:
        ids = tokenizer(sample.prompt, add_special_tokens=False)["input_ids"]
        if len(ids) > max_tokens:
            truncated = True
            half = max_tokens // 2
            head = _decode(tokenizer, ids[:half])
            tail = _decode(tokenizer, ids[len(ids) - half:])
            if question and tail.endswith(question) and len(tail) > len(question):
                context, question = head + tail[: len(tail) - len(question)], question
            else:
                try:
                    context, question = split_prompt(sample.task, head + tail)
                except ValueError:
                    context, question = head + tail, ""
    use_chat = chat and sample.task not in NO_CHAT_TASKS
    context, question = render_prompt(tokenizer, context, question, chat=use_chat)
    meta = dict(sample.meta)
    meta.update(truncated=truncated, chat=use_chat, max_tokens=max_tokens)
    return dataclasses.replace(
        sample,
        context=context,
        question=question,
        num_tokens=count_tokens(tokenizer, context + question, chat=use_chat),
        meta=meta,
    )


def evaluate(samples: Sequence[Sample], predictions: Sequence[str]) -> dict[str, float]:
    """LongBench scores per task (``round(100 * mean, 2)``) of predictions aligned with samples."""
    return score_samples(samples, predictions)
