"""scripts/migrate_records.py: records made before a default changed or a field was added resume
under the key today's policy of the same meaning has (`Policy.spec_key`), and are left alone after."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

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
    name, fields = json.loads(BSER(0.25).spec_key())
    current = dict(fields)
    for gone in ("stage1", "model_gates"):
        fields.pop(gone)
    old_bser = dict(fields, embedding="input", alpha=0.3, beta=0.7)
    cases.append((json.dumps([name, old_bser], sort_keys=True), "bser(0.25)",
                  BSER(0.25, embedding="input")))
    assert current != old_bser
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
