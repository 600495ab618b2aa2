"""The SAEs' training text shares nothing with the evaluation data (issue 37).

The default training corpus (`RunConfig().corpus`, and every paper config's) is compared with the
evaluation data by *content*: each training document and each paragraph of it is hashed after
normalising case, punctuation and whitespace, and none of those hashes may occur among the hashes of
the evaluation files' documents and paragraphs: WikiText-2's test split (the shipped SAEs' held-out
text and CHESS's calibration text), LongBench-mini's prompts, RULER's essays, SQuAD and HotpotQA
(its haystacks and QA contexts) and RULER's noise sentences. The same check run on the WikiText-2
test split as a training corpus must flag it, so the check can fail.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml

from sparsekv_jax.datasets import longbench_mini_files, wikitext2_text
from sparsekv_jax.eval.data import RULER_DATA_FILES, ruler_data_file
from sparsekv_jax.eval.ruler import NOISE_SENTENCES
from sparsekv_jax.sae.config import RunConfig
from sparsekv_jax.sae.data import load_corpus, wikitext_articles

REPO = Path(__file__).resolve().parents[1]
MIN_WORDS = 8  # shorter paragraphs (headings, "Amen.") are too common to mean a shared source


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _hashes(documents) -> set[str]:
    """sha256 of each normalised document and of each of its paragraphs (lines) of >= MIN_WORDS words."""
    out = set()
    for doc in documents:
        out.add(_digest(_norm(doc)))
        for para in re.split(r"\n+", doc):
            norm = _norm(para)
            if norm.count(" ") + 1 >= MIN_WORDS:
                out.add(_digest(norm))
    return out


def _strings(value):
    """Every string inside a JSON value."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


@pytest.fixture(scope="module")
def evaluation_hashes() -> set[str]:
    docs = list(wikitext_articles(wikitext2_text()))
    for path in longbench_mini_files().values():
        with gzip.open(path, "rt", encoding="utf-8") as f:
            docs += [json.loads(line)["prompt"] for line in f if line.strip()]
    for name in RULER_DATA_FILES:
        docs += list(_strings(json.loads(ruler_data_file(name).read_text())))
    docs.append(" ".join(NOISE_SENTENCES))
    hashes = _hashes(docs)
    assert len(hashes) > 100_000  # the files were read (SQuAD and HotpotQA alone have ~10^5 paragraphs)
    return hashes


def _paper_configs() -> list[Path]:
    return sorted((REPO / "sae_training" / "configs").glob("paper_*.yaml"))


def test_default_training_corpus_shares_no_document_or_paragraph_with_the_evaluation_data(evaluation_hashes):
    specs = {RunConfig().corpus} | {yaml.safe_load(p.read_text()).get("corpus", RunConfig().corpus)
                                     for p in _paper_configs()}
    assert len(_paper_configs()) == 3
    for spec in specs:
        corpus = load_corpus(spec)
        train = _hashes(corpus.train)
        assert len(train) > 1000, spec  # ~1M tokens of paragraphs, not an empty source
        shared = train & evaluation_hashes
        assert not shared, f"corpus {spec!r} shares {len(shared)} documents/paragraphs with the evaluation data"
        assert not train & _hashes(corpus.heldout)  # the held-out documents are unseen text


def test_the_overlap_check_flags_the_wikitext2_test_split(evaluation_hashes):
    """The shipped SAEs' corpus, WikiText-2's test split, is caught however it is named."""
    train = _hashes(load_corpus("wikitext2").train)
    assert len(train & evaluation_hashes) > 1000
    renamed = _hashes(d.replace("\n", "\n\n") + "  " for d in load_corpus("wikitext2").train)
    assert renamed & evaluation_hashes
