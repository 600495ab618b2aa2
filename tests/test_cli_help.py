"""``sparsekv eval --help`` names the registered policies and the ones ``--prefill-chunk`` allows,
generated from the registry and each policy's declared ``needs_whole_prefill``."""

from __future__ import annotations

import re

import pytest
from flax import struct

from sparsekv_jax import cli
from sparsekv_jax.policies import Policy
from sparsekv_jax.policies import spec as policy_spec


def _eval_help(capsys) -> str:
    with pytest.raises(SystemExit):
        cli.main(["eval", "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse's wrapping undone


def _chunkable(text: str) -> set[str]:
    m = re.search(r"no one-pass prefill: (.*?) --no-fullkv", text)
    assert m, text
    return {n.strip() for n in re.sub(r"\(when none of its members needs one\)", "",
                                      m.group(1)).split(",")}


def test_eval_help_names_every_registered_policy_and_what_may_be_chunked(capsys):
    text = _eval_help(capsys)
    names = text[text.index("names: "):text.index("(case-insensitive)")]
    for name in ("fullkv", "dense", "streamingllm", "streaming_llm", "snapkv", "h2o", "quest", "pipeline", "stem",
                 "chess", "bser", "semanticache", "s3pure", "s3hybrid", "bm25", "rag"):
        assert re.search(rf"\b{name}\b", names), name
    assert "fullkv (= dense)" in names and "streamingllm (= streaming_llm)" in names
    # written by hand from the policies' declarations: the evicting compressors and the prefill
    # patterns need the whole prompt at once; full attention, decode-stage and context-stage
    # policies do not; a Pipeline as its members
    assert _chunkable(text) == {"fullkv", "streamingllm", "quest", "pipeline", "chess", "semanticache", "s3pure",
                                "s3hybrid", "bm25", "rag"}
    assert "pipeline (when none of its members needs one)" in text
    assert "semanticache (" not in text  # it observes nothing (its rules read the prompt's ids): no condition


@struct.dataclass
class _Whole(Policy):
    needs_whole_prefill = True


@struct.dataclass
class _Chunked(Policy):
    pass


def test_a_newly_registered_policy_appears_in_the_help(monkeypatch, capsys):
    monkeypatch.setitem(policy_spec.REGISTRY, "wholeprobe", _Whole)
    monkeypatch.setitem(policy_spec.REGISTRY, "chunkprobe", _Chunked)
    text = _eval_help(capsys)
    assert "wholeprobe" in text[text.index("names: "):] and "chunkprobe" in text[text.index("names: "):]
    chunkable = _chunkable(text)
    assert "chunkprobe" in chunkable and "wholeprobe" not in chunkable
