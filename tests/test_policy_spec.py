"""The policy spec parser refuses what Python refuses in a call (a keyword given twice, ``**``); `split_spec`."""

from __future__ import annotations

import pytest

from sparsekv_jax.policies import parse_policies, parse_policy


@pytest.mark.parametrize("spec, keyword", [
    ("snapkv(budget=0.25, budget=0.5)", "budget"),
    ("pipeline(compress=snapkv(0.25), compress=h2o(0.2))", "compress"),
    ("fullkv, quest(0.25, page_size=16, page_size=32)", "page_size"),
    ("pipeline(compress=snapkv(window=16, window=8), decode=quest(0.25))", "window"),  # inside a nested call
])
def test_a_repeated_keyword_is_refused_and_named(spec, keyword):
    with pytest.raises(ValueError, match=rf"keyword '{keyword}' repeated"):
        parse_policies(spec)


def test_double_star_arguments_are_refused():
    with pytest.raises(ValueError, match=r"unsupported argument '\*\*x'"):
        parse_policy("snapkv(**x)")


def test_distinct_keywords_still_parse_to_the_values_given():
    pol = parse_policy("pipeline(compress=snapkv(0.25, window=16), decode=quest(0.5, page_size=16))")
    assert pol.stage("compress").budget == 0.25 and pol.stage("compress").window == 16
    assert pol.stage("decode").budget == 0.5 and pol.stage("decode").page_size == 16
    with pytest.raises(ValueError, match="multiple values for argument 'budget'"):  # positional and keyword
        parse_policy("snapkv(0.25, budget=0.5)")


def test_split_spec_gives_each_policy_as_text_that_parses_to_it():
    """`split_spec` (bench e2e's one process per policy) cuts at top-level commas only: nested calls, tuples and
    strings with commas stay whole, and each piece parses to the policy `parse_policies` gives for that item."""
    from sparsekv_jax.policies.spec import split_spec

    spec = ("fullkv, pipeline(compress=snapkv(0.25, window=16), decode=quest(0.5)), chess((0.9, 0.8, 0.7)), "
            "semanticache(0.25, chunking='fixed'), adakv(snapkv(0.1))")
    items = split_spec(spec)
    assert len(items) == 5
    assert [repr(parse_policy(item)) for item in items] == [repr(p) for p in parse_policies(spec)]
    with pytest.raises(ValueError, match="unknown policy 'nosuch'"):
        split_spec("fullkv, nosuch(1)")
