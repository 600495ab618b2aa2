"""SemantiCache's token rules (`sparsekv_jax.policies.semanticache`): which vocabulary ids are
delimiters, digits, word starts and sentence ends (the ``[V]`` masks `SemantiCache.with_tokenizer`
sets; built by `clustering.delimiter_mask` and its siblings), and the prompt slots each rule of
``protect`` keeps unmerged. These read the prompt's ids only: one mask per row, the same in every
layer and head.

* **Delimiter tokens.** A token is a delimiter when its decoded text is non-empty and consists only
  of the paper's characters ``. , ? ! ; :`` space, tab, newline (SmolLM2: 177 of 49,152 tokens, e.g.
  ``"."``, ``" "``, ``"\\n\\n"``, ``" ."``). "Space" is read as a token that *is* whitespace, not one
  that starts with a space: SmolLM2's BPE glues the leading space to 65% of its vocabulary (every
  word after the first), so that reading would make nearly every word an unmerged anchor. The mask
  over the vocabulary is computed once (`clustering.delimiter_mask`) and held as a leaf.
* **Protection from merging** (``protect``; default ``None``: the paper's algorithm as written).
  Every rule below is our addition, opt-in, and a results row that uses one names it.
  On SmolLM2 the digits of a needle's number (one token each) are among the most similar neighbours
  in the prompt (keys and values alike), so without protection any budget that merges prose
  merges a number in it first (docs/SEMANTICACHE.md).

  ``protect="digits"``: numbers are kept unmerged. A token made only of digits (`clustering.number_mask`;
  SmolLM2, Gemma and Qwen2 split every number into single digits) is an anchor at every chunk
  layout. The digits of one number have similar keys (pre-RoPE cosine 0.80-0.98 on SmolLM2), so
  GSC merges a number into one entry whose mean value is no digit: RULER's needles were lost at
  every budget. Kept digits count in the budget; a row whose digits would not fit with one entry
  per chunk merges them as the paper does.
  The same prefilled caches, RULER 4k at 50%, question-agnostic: 28.81 with, 13.32 without
  (docs/SEMANTICACHE.md). These rules recognise RULER's default answer format: on the same tasks
  with word-valued needles the digit rules keep less than the paper's algorithm (issue #36;
  docs/RESULTS.md), which is why none of them is the default.

  ``protect="digit_words"``: so are the words around them: every
  token of a word that holds a digit (a UUID's letters, ``"x86"``, ``"1990s"``; a word is cut before
  a token that starts with whitespace and around delimiters, `clustering.number_words`). A row where
  the words would not fit keeps only the digits; one where the digits would not fit, nothing.
  RULER 4k at 50%, question-agnostic: 30.24 with the words, 29.07 with the digits only (UUID
  needles: 16 against 4; experiments/diary/RESULTS_DIARY.md).

  ``protect="digit_sentences"`` (the default until 2026-11-27): and the sentences that hold them:
  every token of a sentence of at most 64 tokens that holds a digit (a sentence ends at a delimiter
  token holding ``.`` ``?`` ``!`` or a newline, `clustering.sentence_delimiter_mask`), so a fact keeps the
  words that say what its number is: "One of the special magic numbers for wise-cook is: 7975467."
  (``number_sentences`` = 64 tokens at most.) A row keeps its sentences only while they take at
  most ``sentence_share`` (half) of its budget; else the words, as above. RULER at 50%,
  question-agnostic: 33.00 at 4k (95.8% of full attention) and 22.84 at 8k, against 30.24 and
  20.71 with the words; LongBench-mini even (experiments/diary/RESULTS_DIARY.md).

Shapes: ``B`` rows, ``T`` prompt slots, ``V`` the vocabulary.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp

from sparsekv_jax.policies import clustering
from sparsekv_jax.policies.base import Prompt

if TYPE_CHECKING:
    from sparsekv_jax.policies.semanticache import SemantiCache

PROTECT_TOKENS = ("digits", "digit_words", "digit_sentences")  # one mask per row
DIGITS = PROTECT_TOKENS  # the rules that keep digits: all of them
WORDS = ("digit_words", "digit_sentences")  # words holding a digit are kept (sentences fall back on them)
SENTENCES = ("digit_sentences",)


def tokenizer_masks(tokenizer: Any, protect: str | None) -> dict[str, jax.Array | None]:
    """The ``[V]`` bool leaves `SemantiCache.with_tokenizer` sets from ``tokenizer``: the delimiter
    mask always; the digit, word-start and sentence-end masks where ``protect`` reads them (else
    ``None``)."""
    texts = clustering.vocabulary_texts(tokenizer)  # decoded once for every mask
    return {"delimiter_mask": jnp.asarray(clustering.delimiter_mask(tokenizer, texts=texts)),
            "number_mask": jnp.asarray(clustering.number_mask(tokenizer, texts=texts)) if protect in DIGITS else None,
            "word_start_mask": (jnp.asarray(clustering.word_start_mask(tokenizer, texts=texts)) if protect in WORDS
                                else None),
            "sentence_end_mask": (jnp.asarray(clustering.sentence_delimiter_mask(tokenizer, texts=texts))
                                  if protect in SENTENCES else None)}


def check_masks(pol: SemantiCache) -> None:
    """Raise ``ValueError`` (before jit) where ``pol``'s chunking or ``protect`` reads a mask it lacks."""
    fix = "build it with SemantiCache.from_tokenizer(tokenizer, ...) or call policy.with_tokenizer(tokenizer)"
    if pol.protect in DIGITS and pol.number_mask is None:
        raise ValueError(f"SemantiCache(protect={pol.protect!r}) needs the tokenizer's digit tokens: {fix}")
    if pol.protect in WORDS and pol.word_start_mask is None:
        raise ValueError(f"SemantiCache(protect={pol.protect!r}) needs the tokenizer's word-start tokens: {fix}")
    if pol.protect in SENTENCES and pol.sentence_end_mask is None:
        raise ValueError(f"SemantiCache(protect={pol.protect!r}) needs the tokenizer's sentence-end tokens: {fix}")
    if (pol.chunking == "delimiters" or pol.protect in WORDS) and pol.delimiter_mask is None:
        raise ValueError(f"SemantiCache(chunking={pol.chunking!r}, protect={pol.protect!r}) needs the "
                         f"tokenizer's delimiter mask: {fix}")


def delimiters(pol: SemantiCache, prompt: Prompt) -> jax.Array:
    """``[B, T]`` bool: the prompt's delimiter tokens with ``chunking="delimiters"``; none otherwise
    (``"fixed"`` and ``"none"`` have no anchors)."""
    if pol.chunking == "delimiters":
        return jnp.take(pol.delimiter_mask, prompt.tokens, mode="fill", fill_value=False)
    return jnp.zeros(prompt.tokens.shape, bool)


def protected_slots(pol: SemantiCache,
                    prompt: Prompt) -> tuple[tuple[jax.Array, ...] | None, tuple[float, ...] | None]:
    """The slots kept unmerged at every layout, most protective first (`clustering.candidate_layouts`
    takes, per row, the first that fits), and the budget share each may take: the sentences
    holding a digit (with the words of longer ones), the words holding a digit, the digits.
    ``(None, None)`` without a rule (the paper)."""
    if pol.protect is None:
        return None, None

    def take(mask):
        return jnp.take(mask, prompt.tokens, mode="fill", fill_value=False)

    digits = take(pol.number_mask)
    if pol.protect not in WORDS:
        return (digits,), (1.0,)
    words = clustering.number_words(digits, take(pol.word_start_mask), take(pol.delimiter_mask))
    if pol.protect not in SENTENCES:
        return (words, digits), (1.0, 1.0)
    sentences = clustering.number_sentences(digits, take(pol.sentence_end_mask), prompt.lengths,
                                            pol.number_sentences)
    return (sentences | words, words, digits), (pol.sentence_share, 1.0, 1.0)

