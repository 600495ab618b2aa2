"""LongBench and RULER metrics on inputs whose scores are worked out by hand."""

from __future__ import annotations

import pytest

from sparsekv_jax.eval import metrics as m
from sparsekv_jax.eval.tasks import Sample


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The Cat", "cat"),  # lowercase + article removed
        ("  a   dog,  an   apple; THE end! ", "dog apple end"),  # punctuation, articles, spaces
        ("theater another", "theater another"),  # articles only as whole words
        ("rock-n-roll", "rocknroll"),  # punctuation removed before splitting, not replaced by space
        ("A.B. the-end", "ab theend"),
        ("", ""),
    ],
)
def test_normalize_answer(text: str, expected: str) -> None:
    assert m.normalize_answer(text) == expected


def test_qa_f1_by_hand() -> None:
    # "the cat sat" -> [cat, sat]; "a cat sat down" -> [cat, sat, down]: 2 shared tokens.
    # P = 2/2, R = 2/3, F1 = 2 * 1 * 2/3 / (1 + 2/3) = 0.8
    assert m.qa_f1_score("the cat sat", "a cat sat down") == pytest.approx(0.8)
    # Repeated tokens count with multiplicity: "x x y" vs "x y y" share {x: 1, y: 1} = 2 tokens,
    # P = 2/3, R = 2/3 -> F1 = 2/3.
    assert m.qa_f1_score("x x y", "x y y") == pytest.approx(2 / 3)
    assert m.qa_f1_score("Paris.", "paris") == 1.0
    assert m.qa_f1_score("London", "Paris") == 0.0
    assert m.qa_f1_score("the", "a") == 0.0  # both normalise to nothing


def test_rouge_l_by_hand() -> None:
    # LCS("the cat sat on the mat", "the cat lay on the mat") = the cat on the mat = 5 of 6 tokens
    # each side: P = R = 5/6 -> F = 5/6.
    assert m.rouge_l_score("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    # pred 2 tokens, ref 4 tokens, LCS 2: P = 1, R = 1/2, F = 2 * 0.5 / 1.5 = 2/3.
    assert m.rouge_l_score("alpha beta", "alpha gamma beta delta") == pytest.approx(2 / 3)
    assert m.rouge_l_score("", "anything") == 0.0


def test_classification_by_hand() -> None:
    classes = ["Date", "Country", "Other", "Other location"]
    # Both "Other" and "Other location" are in the prediction; "Other" is a strict substring of
    # the reference and is dropped, leaving one match: 1.0.
    assert m.classification_score("Other location", "Other location", all_classes=classes) == 1.0
    # Two classes named, the right one among them: 1/2.
    assert m.classification_score("Date or Country", "Date", all_classes=classes) == 0.5
    assert m.classification_score("Country", "Date", all_classes=classes) == 0.0
    # Case-sensitive substring match, as LongBench.
    assert m.classification_score("date", "Date", all_classes=classes) == 0.0
    with pytest.raises(ValueError):
        m.classification_score("Date", "Date")


def test_classification_keeps_longbench_iteration_quirk() -> None:
    # Prediction and reference "ABC" name all of [A, AB, ABC]. LongBench removes "A" (a strict
    # substring of the reference) and then skips "AB" because the list shrank under the loop,
    # leaving [AB, ABC] -> 1/2 (the intended rule would give 1).
    classes = ["A", "AB", "ABC"]
    assert m.classification_score("ABC", "ABC", all_classes=classes) == 0.5


def test_retrieval_and_count_by_hand() -> None:
    # numbers in prediction: 12, 7 -> one of two equals 12.
    assert m.retrieval_score("Paragraph 12, maybe 7", "Paragraph 12") == 0.5
    assert m.retrieval_score("Paragraph 3", "Paragraph 3") == 1.0
    assert m.retrieval_score("no idea", "Paragraph 3") == 0.0
    # numbers 3, 4, 3 -> two of three equal 3.
    assert m.count_score("3 or 4, I say 3", "3") == pytest.approx(2 / 3)
    assert m.count_score("thirty", "30") == 0.0
    assert m.count_score("30", "3") == 0.0  # whole numbers, not digits


def test_code_sim_by_hand() -> None:
    # Indel similarity: "abcd" vs "abce" share 3 chars of 8 -> 2 * 3 / 8 = 0.75.
    assert m.code_sim_score("abcd", "abce") == pytest.approx(0.75)
    # Lines with '#', '//' or '`' are skipped; leading newlines are dropped.
    assert m.code_sim_score("\n```python\n# comment\n// c\nx = 1\ny = 2", "x = 1") == 1.0
    assert m.code_sim_score("# only comments", "x = 1") == 0.0


def test_ruler_string_match() -> None:
    refs = ["123", "456", "789"]
    assert m.string_match_all("The numbers are 123 and 456.", refs) == pytest.approx(2 / 3)
    assert m.string_match_part("The numbers are 123 and 456.", refs) == 1.0
    assert m.string_match_part("none", refs) == 0.0
    assert m.string_match_all("ABC-Def", ["abc-DEF"]) == 1.0  # case-insensitive
    # score() applies RULER's post-processing (control characters become newlines).
    assert m.score("string_match_all", "\x00 alpha\x07beta ", ["alpha", "beta"]) == 1.0


def test_score_dispatch_and_first_line() -> None:
    # LongBench takes the max over references.
    assert m.score("qa_f1", "cat sat", ["dog", "the cat sat"]) == 1.0
    # samsum-style first line: the second line would otherwise add tokens.
    pred = "\nalpha beta\ngamma delta"
    assert m.score("rouge", pred, ["alpha beta"], first_line_only=True) == pytest.approx(1.0)
    assert m.score("rouge", pred, ["alpha beta"]) == pytest.approx(2 / 3)  # P = 2/4, R = 1
    with pytest.raises(ValueError):
        m.score("bleu", "x", ["x"])


def test_aggregate_and_sample_score() -> None:
    assert m.aggregate([1.0, 0.5, 0.0]) == 50.0
    assert m.aggregate([1 / 3]) == 33.33
    s = Sample(task="t", index=0, context="c", question="q", answers=("Date",), metric="classification",
               all_classes=("Date", "Country"), first_line_only=True)
    assert s.prompt == "cq"
    assert s.score("Date\nCountry") == 1.0  # only the first line counts
    assert s.score("Date Country") == 0.5
