"""`retrieval.text.sentence_end_mask` caches per tokenizer object: a tokenizer created after another was
collected (CPython hands the freed id on) gets its own vocabulary's mask, not the dead one's."""

from __future__ import annotations

import numpy as np

from sparsekv_jax.retrieval.text import TextCodec, sentence_end_mask


class WordTokenizer:
    """A minimal tokenizer over a fixed vocabulary of words (decode = the word)."""

    def __init__(self, words: list[str], special: tuple[int, ...] = ()) -> None:
        self.words = words
        self.all_special_ids = list(special)

    def __len__(self) -> int:
        return len(self.words)

    def batch_decode(self, ids, skip_special_tokens: bool = False) -> list[str]:
        return ["".join(self.words[i] for i in row) for row in ids]


def reference(words: list[str], special: tuple[int, ...] = ()) -> np.ndarray:
    ends = [("\n" in w) or w.strip().endswith((".", "!", "?", "。", "！", "？")) for w in words]
    return np.array([e or i in special for i, e in enumerate(ends)], bool)


def test_mask_follows_the_rule():
    words = ["a", " cat.", "?", "\n", " x", "。", "<eos>"]
    assert sentence_end_mask(WordTokenizer(words, special=(6,))).tolist() == reference(words, (6,)).tolist()


def test_a_new_tokenizer_at_a_reused_id_gets_its_own_mask():
    first, second = ["one.", " two", " three"], [" four", " five", " six."]
    tok = WordTokenizer(first)
    assert sentence_end_mask(tok).tolist() == reference(first).tolist()
    del tok
    # CPython hands the freed slot (and so its id) to the next object of the same size: an id-keyed
    # cache served `first`'s mask here (checked when this test was written: it fails on that cache)
    tok2 = WordTokenizer(second)
    assert sentence_end_mask(tok2).tolist() == reference(second).tolist()
    assert TextCodec(tok2).ends(np.array([0, 1, 2, 7])).tolist() == [False, False, True, False]


def test_an_unhashable_tokenizer_is_served_uncached():
    class Unhashable(WordTokenizer):
        __hash__ = None

    words = ["a.", "b"]
    tok = Unhashable(words)
    assert sentence_end_mask(tok).tolist() == reference(words).tolist()
    assert sentence_end_mask(tok).tolist() == reference(words).tolist()
