"""Rewrite `sparsekv eval` records made before two default changes of 2026-11-27 (issue 36) so each
says what made it.

* **SemantiCache.** Until then ``SemantiCache(b)`` meant the digit-sentence rule (``keep_numbers=True,
  number_words=True, number_sentences=64``); now it is the paper's algorithm and the rule is
  ``protect="digit_sentences"`` (``keep_numbers=False`` → no protection, ``number_words=False`` →
  ``"digits"``, ``number_sentences=0`` → ``"digit_words"``).
* **BSER.** Until then ``BSER(b)`` probed with the token embeddings (``embedding="input"``, (α, β) =
  (0.3, 0.7)); now the default is the hidden states with per-model thresholds. Old rows become
  ``bser(b, embedding='input')`` (whose thresholds are still (0.3, 0.7)).

* **A field added since** (e.g. SnapKV's ``window``): a policy's resume key names every field, so a
  record made before a field existed is given the field at the value every run before it had: its
  default, or where the default is new behaviour, the old one (`BEFORE_FIELD`: Stem's ``routing`` was
  ``"full"`` before the tiled routing became the default).
* **A field removed since** (`REMOVED_FIELDS`: SemantiCache's ``max_cluster_size``, one of issue 36's
  candidates, measured and removed; docs/RESULTS.md): a record whose key holds it at the value that
  did what every run does now (``None``: unbounded clusters, the paper's) loses it, so it resumes under
  today's key. A record made with another value keeps its key and text: the report lists its rows
  under that text, and no policy of today resumes them (as with ``protect='attended'``).

A record's policy text, ``policy_key`` and ``key`` are rewritten to the new spelling, so its rows
are reported under what made them and a resumed run does not take them for the new default.
Other records are copied unchanged; running it twice changes nothing.

    python scripts/migrate_records.py docs/results/qwen2.5-coder-1.5b_h200*/*/results.jsonl.gz
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import re
import sys

import sparsekv_jax.policies as policies
from sparsekv_jax.policies.base import spec_key_value


def protect_of(fields: dict) -> str | None:
    if not fields.pop("keep_numbers"):
        fields.pop("number_words", None)
        return None
    if not fields.pop("number_words"):
        return "digits"
    return "digit_words" if fields.get("number_sentences") == 0 else "digit_sentences"


def migrate(record: dict) -> bool:
    """Rewrite one record in place; ``True`` when it changed."""
    key = record.get("policy_key", "")
    if key.startswith('["BSER"'):
        changed = migrate_bser(record)
    elif key.startswith('["SemantiCache"'):
        changed = migrate_semanticache(record)
    else:
        changed = False
    changed = drop_removed(record) or changed
    return fill_defaults(record) or changed


def _set_policy_key(record: dict, name: str, fields: dict) -> None:
    old_key = record["policy_key"]
    record["policy_key"] = json.dumps([name, fields], sort_keys=True, default=str)  # as Policy.spec_key
    record["key"] = record["key"].replace(json.dumps(old_key)[1:-1], json.dumps(record["policy_key"])[1:-1])


# (class, field): the value a run made before the field existed had, where it is not the default
BEFORE_FIELD = {("Stem", "routing"): "full"}
# (class, field): a field removed since, and its value that did what every run of the class does now
REMOVED_FIELDS = {("SemantiCache", "max_cluster_size"): None}


def drop_removed(record: dict) -> bool:
    """Drop from a record's policy key each removed field (`REMOVED_FIELDS`) that holds the value today's
    runs have; ``True`` when one was dropped. A record made with another value is left as it is."""
    try:
        name, fields = json.loads(record.get("policy_key", ""))
    except (ValueError, TypeError):
        return False
    if not isinstance(fields, dict):
        return False
    gone = [f for (cls, f), value in REMOVED_FIELDS.items() if cls == name and f in fields and fields[f] == value]
    if not gone:
        return False
    _set_policy_key(record, name, {k: v for k, v in fields.items() if k not in gone})
    return True


def fill_defaults(record: dict) -> bool:
    """Give a record's policy key every field its class has today that the key lacks, at the value runs
    had before it (`BEFORE_FIELD`, else the field's default); ``True`` when one was missing. Records of
    transformers' rows or of classes gone are left."""
    try:
        name, fields = json.loads(record.get("policy_key", ""))
    except (ValueError, TypeError):
        return False
    cls = getattr(policies, name, None) if isinstance(name, str) else None
    if not (isinstance(fields, dict) and dataclasses.is_dataclass(cls)):
        return False
    added = {}
    for f in dataclasses.fields(cls):
        if f.name == "backend" or f.name in fields:
            continue
        if (name, f.name) in BEFORE_FIELD:
            added[f.name] = BEFORE_FIELD[name, f.name]
        elif f.default is not dataclasses.MISSING:
            added[f.name] = spec_key_value(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            added[f.name] = spec_key_value(f.default_factory())
    if not added:
        return False
    _set_policy_key(record, name, {**fields, **added})
    for field, value in added.items():  # a value other than today's default is named, as Policy.name does
        if (name, field) in BEFORE_FIELD and "policy" in record:
            text = record["policy"]
            text = text[:-1] + ("" if text.endswith("()") else ", ") if text.endswith(")") else text + "("
            record["policy"] = f"{text}{field}={value!r})"
    return True


def migrate_semanticache(record: dict) -> bool:
    name, fields = json.loads(record["policy_key"])
    if "keep_numbers" not in fields:
        return False
    old_key = record["policy_key"]
    protect = protect_of(fields)
    if fields.get("number_sentences") == 0:
        fields["number_sentences"] = 64
    fields["protect"] = protect
    record["policy_key"] = json.dumps([name, dict(sorted(fields.items()))])
    record["key"] = record["key"].replace(json.dumps(old_key)[1:-1], json.dumps(record["policy_key"])[1:-1])
    text = re.sub(r",\s*(keep_numbers|number_words)=\w+|,\s*number_sentences=0\b", "", record["policy"])
    if protect is not None:
        text = f"{text[:-1]}, protect={protect!r})"
    record["policy"] = text
    return True


def migrate_bser(record: dict) -> bool:
    name, fields = json.loads(record["policy_key"])
    if "stage1" in fields:
        return False
    old_key = record["policy_key"]
    if fields["embedding"] == "input" and (fields["alpha"], fields["beta"]) == (0.3, 0.7):
        fields["alpha"] = fields["beta"] = None  # "input" resolves to (0.3, 0.7) at bind
    fields.update(model_gates=None, stage1="blocks")
    record["policy_key"] = json.dumps([name, dict(sorted(fields.items()))])
    record["key"] = record["key"].replace(json.dumps(old_key)[1:-1], json.dumps(record["policy_key"])[1:-1])
    if fields["embedding"] == "input" and "embedding" not in record["policy"]:
        text = record["policy"]
        record["policy"] = f"{text[:-1]}, embedding='input')" if text.endswith(")") else f"{text}(embedding='input')"
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="results.jsonl or results.jsonl.gz files, rewritten in place")
    args = parser.parse_args(argv)
    for path in args.files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            records = [json.loads(line) for line in f if line.strip()]
        changed = sum(migrate(r) for r in records)
        if changed:
            if path.endswith(".gz"):
                with open(path, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, filename="") as f:
                    f.write("".join(json.dumps(r) + "\n" for r in records).encode())
            else:
                with open(path, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in records)
        print(f"{path}: {changed} of {len(records)} records rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
