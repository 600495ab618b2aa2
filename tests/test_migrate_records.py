"""scripts/migrate_records.py: records made before a default changed or a field was added resume
under the key today's policy of the same meaning has (`Policy.spec_key`), and are left alone after."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest

from sparsekv_jax.policies import BSER, SemantiCache, SnapKV, Stem

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
import migrate_records  # noqa: E402


def _record(policy_key: str, text: str) -> dict:
    return {"policy": text, "policy_key": policy_key, "key": json.dumps(["m", "ruler", policy_key, 7]), "score": 1.0}


def _old_semanticache_key(**old_fields) -> str:
    """SemantiCache(0.25)'s key as written before 2026-11-27: the digit options, no ``protect`` (and no
    ``max_cluster_size``, which came and went that day)."""
    name, fields = json.loads(SemantiCache(0.25).spec_key())
    fields.pop("protect")
    fields.update(old_fields)
    return json.dumps([name, fields], sort_keys=True, default=str)


def _capped_semanticache_key(policy: SemantiCache, max_cluster_size: int | None, protect: str | None = None) -> str:
    """``policy``'s key as written while SemantiCache had ``max_cluster_size`` (2026-11-27), ``protect``
    set as given where it is a value removed since."""
    name, fields = json.loads(policy.spec_key())
    fields["max_cluster_size"] = max_cluster_size
    if protect is not None:
        fields["protect"] = protect
    return json.dumps([name, fields], sort_keys=True, default=str)


def _old_bser_key(policy: BSER, *gone: str) -> str:
    """``policy``'s key as written before ``stage1`` and ``model_gates`` (and ``gone``) existed: token
    embeddings with (α, β) given as (0.3, 0.7)."""
    name, fields = json.loads(policy.spec_key())
    assert policy.embedding == "input" and policy.alpha is None and policy.beta is None
    for f in ("stage1", "model_gates", *gone):
        fields.pop(f)
    return json.dumps([name, dict(fields, alpha=0.3, beta=0.7)], sort_keys=True)


def _migrated(tmp_path, records: list[dict], *args: str) -> list[dict]:
    path = tmp_path / "results.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    assert migrate_records.main([*args, str(path)]) == 0
    before = path.read_bytes()
    migrate_records.main([*args, str(path)])  # twice changes nothing
    assert path.read_bytes() == before
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f]


def test_old_records_take_the_keys_of_the_policies_that_made_them(tmp_path):
    cases = [
        (_old_semanticache_key(keep_numbers=True, number_words=True), "semanticache(0.25)",
         SemantiCache(0.25, protect="digit_sentences")),
        (_old_semanticache_key(keep_numbers=False, number_words=True), "semanticache(0.25, keep_numbers=False)",
         SemantiCache(0.25)),
        (_old_semanticache_key(keep_numbers=True, number_words=False), "semanticache(0.25, number_words=False)",
         SemantiCache(0.25, protect="digits")),
    ]
    snap = json.loads(SnapKV(0.25).spec_key())
    snap[1].pop("window")  # a field added later: filled at its default
    cases.append((json.dumps(snap, sort_keys=True), "snapkv(0.25)", SnapKV(0.25)))
    stem = json.loads(Stem().spec_key())
    for gone in ("routing", "route_tile"):
        stem[1].pop(gone)
    cases.append((json.dumps(stem, sort_keys=True), "stem", Stem(routing="full")))  # made before tiling
    cases.append((_old_bser_key(BSER(0.25, block_size=64)), "bser(0.25)", BSER(0.25, block_size=64)))
    # made while max_cluster_size existed: at None (unbounded, what every run does now) the field goes
    cases.append((_capped_semanticache_key(SemantiCache(0.25), None), "semanticache(0.25)", SemantiCache(0.25)))
    cases.append((_capped_semanticache_key(SemantiCache(0.5, protect="digit_sentences"), None),
                  "semanticache(0.5, protect='digit_sentences')", SemantiCache(0.5, protect="digit_sentences")))
    path = tmp_path / "results.jsonl.gz"
    with gzip.open(path, "wt") as f:
        f.writelines(json.dumps(_record(key, text)) + "\n" for key, text, _ in cases)
    assert migrate_records.main([str(path)]) == 0
    with gzip.open(path, "rt") as f:
        records = [json.loads(line) for line in f]
    for rec, (_, _, policy) in zip(records, cases, strict=True):
        assert rec["policy_key"] == policy.spec_key(), rec["policy"]
        assert rec["key"] == json.dumps(["m", "ruler", policy.spec_key(), 7])
    assert records[0]["policy"] == "semanticache(0.25, protect='digit_sentences')"
    assert records[1]["policy"] == "semanticache(0.25)"
    assert records[4]["policy"] == "stem(routing='full')"
    assert records[6]["policy"] == "semanticache(0.25)"
    before = path.read_bytes()
    migrate_records.main([str(path)])  # twice changes nothing
    assert path.read_bytes() == before


def test_records_of_removed_options_keep_what_made_them(tmp_path):
    """Rows made with SemantiCache options measured and removed (issue 36: ``max_cluster_size=8``,
    ``protect='attended'`` and its siblings) name something no policy of today is: migrating reads
    them without building one, keeps their text (the report lists them by it) and keeps the value
    that made them in their key; only ``max_cluster_size=None``, what every run does now, goes."""
    made = [(_capped_semanticache_key(SemantiCache(0.25), 8), "semanticache(0.25, max_cluster_size=8)")]
    made += [(_capped_semanticache_key(SemantiCache(0.25), None, protect), f"semanticache(0.25, protect={protect!r})")
             for protect in ("attended", "rare_tokens", "outlier_keys")]
    records = [_record(key, text) for key, text in made]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert migrate_records.main([str(path)]) == 0
    got = [json.loads(line) for line in path.read_text().splitlines()]
    assert got[0] == records[0]  # max_cluster_size=8: unchanged
    for rec, old, protect in zip(got[1:], records[1:], ("attended", "rare_tokens", "outlier_keys"), strict=True):
        name, fields = json.loads(rec["policy_key"])
        assert rec["policy"] == old["policy"] and fields["protect"] == protect and "max_cluster_size" not in fields
        want = json.loads(old["policy_key"])
        del want[1]["max_cluster_size"]
        assert [name, fields] == want
        assert rec["key"] == json.dumps(["m", "ruler", rec["policy_key"], 7])


# (what a record's text said, the policy that made it, the text it has under today's defaults)
BSER_CASES = [
    # the first version (before fill, refine_order, min_question; token embeddings, B = 64)
    ("bser(0.25)", BSER(0.25, block_size=64, min_question=1, fill=False, refine_order="block"),
     "bser(0.25, block_size=64, min_question=1, fill=False, refine_order='block')"),
    ("bser", BSER(block_size=64, min_question=1, fill=False, refine_order="block"),
     "bser(block_size=64, min_question=1, fill=False, refine_order='block')"),
    # the second round (token embeddings, B = 64, gates given as (0.3, 0.7))
    ("bser(0.2)", BSER(0.2, block_size=64), "bser(0.2, block_size=64)"),
    ("bser", BSER(block_size=64), "bser(block_size=64)"),
    # 2026-11-27, while hidden states and B = 64 were the defaults
    ("bser(0.25)", BSER(0.25, embedding="hidden", block_size=64), "bser(0.25, embedding='hidden', block_size=64)"),
    ("bser", BSER(embedding="hidden", block_size=64), "bser(embedding='hidden', block_size=64)"),
    ("bser(0.25, stage1='tokens')", BSER(0.25, embedding="hidden", block_size=64, stage1="tokens"),
     "bser(0.25, embedding='hidden', block_size=64, stage1='tokens')"),
    ("bser(0.25, block_size=128)", BSER(0.25, embedding="hidden"), "bser(0.25, embedding='hidden')"),
    ("bser(0.25, embedding='input')", BSER(0.25, block_size=64), "bser(0.25, block_size=64)"),
    ("bser(0.25, embedding='input', block_size=128)", BSER(0.25), "bser(0.25)"),
    ("bser(embedding='input', block_size=128)", BSER(), "bser"),
    # today's defaults, and a redundant spelling
    ("bser(0.25)", BSER(0.25), "bser(0.25)"),
    ("bser(0.5, embedding='hidden', block_size=64, window=16)", BSER(0.5, embedding="hidden", block_size=64, window=16),
     "bser(0.5, embedding='hidden', block_size=64, window=16)"),
    ("bser(0.5, window=16, block_size=128)", BSER(0.5, window=16), "bser(0.5, window=16)"),
]


def test_bser_records_are_named_under_todays_defaults(tmp_path):
    """BSER's defaults changed twice on 2026-11-27 (hidden states, then the paper's token embeddings
    and B = 128): each record's text is rewritten from its key to name what is not today's default,
    and the text parsed is the policy that made the row (so no two configurations share a label and
    today's ``bser(0.25)`` names only rows made with token embeddings and B = 128)."""
    from sparsekv_jax.policies import parse_policy

    first, second = BSER_CASES[:2], BSER_CASES[2:4]
    keys = [_old_bser_key(p, "fill", "refine_order", "min_question") for _, p, _ in first]
    keys += [_old_bser_key(p) for _, p, _ in second] + [p.spec_key() for _, p, _ in BSER_CASES[4:]]
    records = _migrated(tmp_path, [_record(k, text) for k, (text, _, _) in zip(keys, BSER_CASES, strict=True)])
    for rec, (old, policy, text) in zip(records, BSER_CASES, strict=True):
        assert rec["policy_key"] == policy.spec_key(), old
        assert rec["key"] == json.dumps(["m", "ruler", policy.spec_key(), 7])
        assert rec["policy"] == text, old
        assert parse_policy(rec["policy"]).spec_key() == rec["policy_key"], text  # the label says what made it
    by_text = {}
    for rec in records:
        by_text.setdefault(rec["policy"], set()).add(rec["policy_key"])
    assert all(len(keys) == 1 for keys in by_text.values()), by_text
    assert by_text["bser(0.25)"] == {BSER(0.25, embedding="input", block_size=128).spec_key()}


def test_only_the_named_classes_are_migrated(tmp_path):
    """``--classes BSER`` rewrites BSER's records and leaves another class's old record as it was;
    an unknown class is refused; a text that is not a spec is left as it is."""
    old_sc = _record(_old_semanticache_key(keep_numbers=True, number_words=True), "semanticache(0.25)")
    old_bser = _record(BSER(0.25, embedding="hidden", block_size=64).spec_key(), "bser(0.25)")
    odd = _record(BSER(0.25, embedding="hidden", block_size=64).spec_key(), "BSER(0.25) [hidden]")
    got = _migrated(tmp_path, [old_sc, old_bser, odd], "--classes", "BSER")
    assert got[0] == old_sc
    assert got[1]["policy"] == "bser(0.25, embedding='hidden', block_size=64)"
    assert got[2] == odd
    with pytest.raises(SystemExit):
        migrate_records.main(["--classes", "Nonsense", str(tmp_path / "results.jsonl.gz")])
