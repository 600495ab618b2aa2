"""What context retrieval needs of a tokenizer: sentence boundaries and text.

`TextCodec` wraps a tokenizer (transformers' or anything with ``batch_decode`` and ``__len__``) for
a policy's static field: it is hashed and compared by the tokenizer's identity, so a jitted
``generate`` does not retrace per call, and prints as ``TextCodec(<name>)`` in resume keys.
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

SENTENCE_END = (".", "!", "?", "。", "！", "？")
# keyed by the tokenizer object itself, held weakly: an entry dies with its tokenizer, so a later
# tokenizer that happens to get the same id() never receives another vocabulary's mask
_MASKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def sentence_end_mask(tokenizer: Any) -> np.ndarray:
    """``[vocab]`` bool: the token ends a sentence (its text, stripped, ends in ``.``/``!``/``?``), holds
    a newline, or is a special token (chat markers end a turn). Cached per tokenizer object (not per
    `id`, which a collected tokenizer hands on); a tokenizer that cannot be weakly referenced is not
    cached."""
    try:
        return _MASKS[tokenizer]
    except (KeyError, TypeError):
        pass
    size = len(tokenizer)
    texts = tokenizer.batch_decode([[i] for i in range(size)])
    mask = np.array([("\n" in t) or t.strip().endswith(SENTENCE_END) for t in texts], bool)
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < size]
    mask[special] = True
    try:
        _MASKS[tokenizer] = mask
    except TypeError:  # not weakly referenceable (or unhashable): computed again next time
        pass
    return mask


class TextCodec:
    """A tokenizer with its sentence-end mask (see the module docstring)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.sentence_end = sentence_end_mask(tokenizer)
        self.name = str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)

    def ends(self, tokens: np.ndarray) -> np.ndarray:
        """``[T]`` bool: a sentence ends at each token (ids outside the vocabulary: no)."""
        tokens = np.asarray(tokens)
        ok = (tokens >= 0) & (tokens < self.sentence_end.shape[0])
        return ok & self.sentence_end[np.where(ok, tokens, 0)]

    def decode(self, pieces: list[np.ndarray]) -> list[str]:
        """Text of each token array (special tokens dropped)."""
        return self.tokenizer.batch_decode([np.asarray(p).tolist() for p in pieces], skip_special_tokens=True)

    def __hash__(self) -> int:
        return id(self.tokenizer)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TextCodec) and other.tokenizer is self.tokenizer

    def __repr__(self) -> str:
        return f"TextCodec({self.name})"
