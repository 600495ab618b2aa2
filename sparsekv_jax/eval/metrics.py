"""Answer-quality metrics of LongBench (v1) and RULER.

Per-sample scores are floats in ``[0, 1]``; :func:`aggregate` turns a list of them into the
percentage both benchmarks report (``round(100 * mean, 2)``).

LongBench metrics follow ``LongBench/metrics.py`` and ``eval.py``:

* ``normalize_answer``: lowercase, drop ``string.punctuation``, drop the articles a/an/the,
  collapse whitespace (SQuAD's normalisation, applied in that order).
* ``qa_f1``: token-level F1 between the normalised prediction and reference.
* ``rouge``: ROUGE-L F-measure. LongBench uses the ``rouge`` package; here ``rouge-score``'s
  ``RougeScorer(["rougeL"])`` is used (same LCS-based F; tokenisation differs slightly:
  rouge-score lowercases and splits on non-alphanumerics).
* ``classification``: the classes named in the prediction, minus those that are a strict
  substring of the reference, give ``1/len(matches)`` if the reference is among them.
  LongBench removes items from the list while iterating over it, which skips the element after
  each removal; that quirk is kept so scores stay comparable with published numbers.
* ``retrieval``: fraction of the numbers in the prediction equal to the reference's
  ``Paragraph N``.
* ``count``: fraction of the numbers in the prediction equal to the reference count.
* ``code_sim``: first prediction line without a backtick, ``#`` or ``//``, compared with
  ``rapidfuzz.fuzz.ratio / 100`` (LongBench used fuzzywuzzy's ratio, which rounds to an int).

RULER metrics follow ``eval/synthetic/constants.py``: case-insensitive substring matching of
each reference in the (stripped, control-characters-to-newline) prediction; ``string_match_all``
is the fraction of references found, ``string_match_part`` is 1 if any is found.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from functools import lru_cache
from typing import Any

__all__ = [
    "LONGBENCH_METRICS",
    "METRICS",
    "RULER_METRICS",
    "aggregate",
    "classification_score",
    "code_sim_score",
    "count_score",
    "f1_score",
    "first_line",
    "normalize_answer",
    "qa_f1_score",
    "retrieval_score",
    "rouge_l_score",
    "ruler_postprocess",
    "score",
    "string_match_all",
    "string_match_part",
]

_PUNCT = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_CONTROL = re.compile(r"[\x00-\x1f]")
_NUMBER = re.compile(r"\d+")
_PARAGRAPH = re.compile(r"Paragraph (\d+)")


def normalize_answer(s: str) -> str:
    """LongBench/SQuAD normalisation: lowercase, remove punctuation, articles, extra whitespace."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def f1_score(prediction: Sequence[str], ground_truth: Sequence[str]) -> float:
    """Bag-of-tokens F1 between two token lists (0 when nothing is shared)."""
    common = Counter(prediction) & Counter(ground_truth)
    num_same = sum(common.values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(prediction)
    recall = num_same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """Token F1 of the normalised prediction against one reference (LongBench ``qa_f1_score``)."""
    return f1_score(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


@lru_cache(maxsize=1)
def _rouge_scorer() -> Any:
    from rouge_score import rouge_scorer

    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


def rouge_l_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """ROUGE-L F-measure of the prediction against one reference (0 if either side is empty)."""
    if not prediction.strip() or not ground_truth.strip():
        return 0.0
    return float(_rouge_scorer().score(ground_truth, prediction)["rougeL"].fmeasure)


def classification_score(prediction: str, ground_truth: str, all_classes: Sequence[str] | None = None,
                         **_: Any) -> float:
    """LongBench ``classification_score`` (trec, lsht); needs the task's ``all_classes``."""
    if not all_classes:
        raise ValueError("classification_score needs all_classes")
    em_match_list = [c for c in all_classes if c in prediction]
    # Same loop as LongBench: removing while iterating skips the element after a removal.
    for match_term in em_match_list:
        if match_term in ground_truth and match_term != ground_truth:
            em_match_list.remove(match_term)
    if ground_truth in em_match_list:
        return 1.0 / len(em_match_list)
    return 0.0


def retrieval_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """LongBench ``retrieval_score``: share of the prediction's numbers equal to ``Paragraph N``'s N."""
    matches = _PARAGRAPH.findall(ground_truth)
    if not matches:
        raise ValueError(f"reference {ground_truth!r} has no 'Paragraph N'")
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(n == matches[0] for n in numbers) / len(numbers)


def count_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """LongBench ``count_score``: share of the prediction's numbers equal to the reference."""
    numbers = _NUMBER.findall(prediction)
    if not numbers:
        return 0.0
    return sum(n == str(ground_truth) for n in numbers) / len(numbers)


def code_sim_score(prediction: str, ground_truth: str, **_: Any) -> float:
    """LongBench ``code_sim_score``: edit similarity of the first code-looking line of the prediction."""
    from rapidfuzz import fuzz

    line = ""
    for candidate in prediction.lstrip("\n").split("\n"):
        if "`" not in candidate and "#" not in candidate and "//" not in candidate:
            line = candidate
            break
    return float(fuzz.ratio(line, ground_truth)) / 100.0


def ruler_postprocess(prediction: str) -> str:
    """RULER's ``postprocess_pred``: strip, map control characters to newlines, strip again."""
    return _CONTROL.sub("\n", prediction.strip()).strip()


def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """Fraction of references contained (case-insensitively) in the prediction (RULER)."""
    if not references:
        raise ValueError("string_match_all needs at least one reference")
    pred = prediction.lower()
    return sum(r.lower() in pred for r in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """1.0 if any reference is contained (case-insensitively) in the prediction, else 0.0 (RULER)."""
    if not references:
        raise ValueError("string_match_part needs at least one reference")
    pred = prediction.lower()
    return float(max(r.lower() in pred for r in references))


LONGBENCH_METRICS: dict[str, Callable[..., float]] = {
    "qa_f1": qa_f1_score,
    "rouge": rouge_l_score,
    "classification": classification_score,
    "retrieval": retrieval_score,
    "count": count_score,
    "code_sim": code_sim_score,
}
RULER_METRICS: dict[str, Callable[[str, Sequence[str]], float]] = {
    "string_match_all": string_match_all,
    "string_match_part": string_match_part,
}
METRICS: tuple[str, ...] = tuple(LONGBENCH_METRICS) + tuple(RULER_METRICS)


def first_line(prediction: str) -> str:
    """LongBench's few-shot post-processing: the first line after leading newlines."""
    return prediction.lstrip("\n").split("\n")[0]


def score(
    metric: str,
    prediction: str,
    answers: Sequence[str],
    *,
    all_classes: Sequence[str] | None = None,
    first_line_only: bool = False,
) -> float:
    """Score one prediction against its gold answers with metric ``metric``; returns ``[0, 1]``.

    RULER metrics see the RULER-post-processed prediction and all references at once.
    LongBench metrics take the max over references (LongBench's ``scorer``), after keeping only
    the first line when ``first_line_only`` (trec, triviaqa, samsum, lsht).
    """
    if metric in RULER_METRICS:
        return RULER_METRICS[metric](ruler_postprocess(prediction), answers)
    if metric not in LONGBENCH_METRICS:
        raise ValueError(f"unknown metric {metric!r}; expected one of {METRICS}")
    if first_line_only:
        prediction = first_line(prediction)
    fn = LONGBENCH_METRICS[metric]
    best = 0.0
    for gt in answers:
        best = max(best, fn(prediction, gt, all_classes=all_classes))
    return best


def aggregate(scores: Iterable[float]) -> float:
    """Mean of per-sample scores in ``[0, 1]`` as a percentage rounded to 2 decimals."""
    values = list(scores)
    if not values:
        raise ValueError("aggregate of no scores")
    return round(100.0 * sum(values) / len(values), 2)
