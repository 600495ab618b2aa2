"""Rewrite `sparsekv eval` records made before the default changes of 2026-11-27 (issue 36) so each
says what made it.

* **SemantiCache.** Until then ``SemantiCache(b)`` meant the digit-sentence rule (``keep_numbers=True,
  number_words=True, number_sentences=64``); now it is the paper's algorithm and the rule is
  ``protect="digit_sentences"`` (``keep_numbers=False`` → no protection, ``number_words=False`` →
  ``"digits"``, ``number_sentences=0`` → ``"digit_words"``).
* **BSER, twice.** Until the first change ``BSER(b)`` probed with the token embeddings
  (``embedding="input"``, (α, β) given as (0.3, 0.7)); then the hidden states with per-model
  thresholds were the default (``embedding="hidden"``, ``alpha=beta=None``); since the second, later
  that day, the paper's settings are again (``embedding="input"``, and ``block_size=128`` where it was
  64). A record's key names ``embedding`` and ``block_size``, so its text is rewritten from its key
  (`NAMED_FIELDS`): it names each of them whose value is not today's default, and no other. Under
  today's defaults: old ``bser(0.25)`` made with hidden states is ``bser(0.25, embedding='hidden',
  block_size=64)``, old ``bser(0.25, embedding='input')`` is ``bser(0.25, block_size=64)``, ``bser(0.25,
  embedding='input', block_size=128)`` is ``bser(0.25)``; the first rows, made before the gates
  followed ``embedding``, get ``alpha=beta=None`` (what (0.3, 0.7) is with token embeddings).

* **A field added since** (e.g. SnapKV's ``window``): a policy's resume key names every field, so a
  record made before a field existed is given the field at the value every run before it had: its
  default, or where the default is new behaviour, the old one (`BEFORE_FIELD`: Stem's ``routing`` was
  ``"full"`` before the tiled routing became the default; BSER's first version, before ``fill``,
  ``refine_order`` and ``min_question`` (commit 3865dea), was ``fill=False, refine_order='block',
  min_question=1``). Such a value is named in the record's text.
* **A field removed since** (`REMOVED_FIELDS`: SemantiCache's ``max_cluster_size``, one of issue 36's
  candidates, measured and removed; docs/RESULTS.md): a record whose key holds it at the value that
  did what every run does now (``None``: unbounded clusters, the paper's) loses it, so it resumes under
  today's key. A record made with another value keeps its key and text: the report lists its rows
  under that text, and no policy of today resumes them (as with ``protect='attended'``).

A record's policy text, ``policy_key`` and ``key`` are rewritten to the new spelling, so its rows
are reported under what made them and a resumed run does not take them for the new default.
Other records are copied unchanged; running it twice changes nothing.

    python scripts/migrate_records.py docs/results/qwen2.5-coder-1.5b_h200*/*/results.jsonl.gz
    python scripts/migrate_records.py --classes BSER $(find docs/results -name 'results.jsonl*')  # BSER's only
"""

from __future__ import annotations

import argparse
import ast
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


def migrate(record: dict, classes: tuple[str, ...] | None = None) -> bool:
    """Rewrite one record in place; ``True`` when it changed. ``classes``: only records of these
    policy classes (e.g. ``("BSER",)``); ``None``: every record."""
    key = record.get("policy_key", "")
    if classes is not None and not any(key.startswith(f'["{c}"') for c in classes):
        return False
    if key.startswith('["BSER"'):
        changed = migrate_bser(record)
    elif key.startswith('["SemantiCache"'):
        changed = migrate_semanticache(record)
    else:
        changed = False
    changed = drop_removed(record) or changed
    changed = fill_defaults(record) or changed
    return name_fields(record) or changed


def _set_policy_key(record: dict, name: str, fields: dict) -> None:
    old_key = record["policy_key"]
    record["policy_key"] = json.dumps([name, fields], sort_keys=True, default=str)  # as Policy.spec_key
    record["key"] = record["key"].replace(json.dumps(old_key)[1:-1], json.dumps(record["policy_key"])[1:-1])


# (class, field): the value a run made before the field existed had, where it is not the default
BEFORE_FIELD = {("Stem", "routing"): "full",
                # BSER's first version (before 3865dea: fixed anchors, refined tokens by block s, the question as given)
                ("BSER", "fill"): False, ("BSER", "refine_order"): "block", ("BSER", "min_question"): 1}
# class -> fields whose default changed: a record's text names each whose key value is not today's default
# (in this order, after the positional arguments), and none that is (BSER: 2026-11-27, twice)
NAMED_FIELDS = {"BSER": ("embedding", "block_size")}
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
    """A BSER key made before ``stage1`` and ``model_gates`` existed (token embeddings, (α, β) given as
    (0.3, 0.7)): the gates left to follow ``embedding``, as today's key of the same policy has them.
    Its text is rewritten by `name_fields`."""
    name, fields = json.loads(record["policy_key"])
    if "stage1" in fields:
        return False
    old_key = record["policy_key"]
    if fields["embedding"] == "input" and (fields["alpha"], fields["beta"]) == (0.3, 0.7):
        fields["alpha"] = fields["beta"] = None  # "input" resolves to (0.3, 0.7) at bind
    fields.update(model_gates=None, stage1="blocks")
    record["policy_key"] = json.dumps([name, dict(sorted(fields.items()))])
    record["key"] = record["key"].replace(json.dumps(old_key)[1:-1], json.dumps(record["policy_key"])[1:-1])
    return True


def spec_with(text: str, named: dict, fields: tuple[str, ...]) -> str:
    """``text`` (a policy spec, ``name`` or ``name(args)``) naming ``named`` (``{field: value}``) and
    none of the other ``fields``; other arguments kept as written. A text that is not a spec, or
    already names exactly ``named``, is returned as it is."""
    text = text.strip()
    try:
        call = ast.parse(text, mode="eval").body
    except SyntaxError:
        return text
    if isinstance(call, ast.Name):
        head, args, keywords = call.id, [], []
    elif isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and all(k.arg for k in call.keywords):
        head, args, keywords = call.func.id, call.args, call.keywords
    else:
        return text
    try:
        given = {k.arg: ast.literal_eval(k.value) for k in keywords if k.arg in fields}
    except ValueError:
        return text
    if given == named:
        return text
    parts = [ast.get_source_segment(text, a) for a in args] + [f"{f}={v!r}" for f, v in named.items()]
    parts += [f"{k.arg}={ast.get_source_segment(text, k.value)}" for k in keywords if k.arg not in fields]
    return f"{head}({', '.join(parts)})" if parts else head


def name_fields(record: dict) -> bool:
    """Rewrite a record's text to name each `NAMED_FIELDS` field whose value in its key is not today's
    default, and no other; ``True`` when it changed."""
    try:
        name, fields = json.loads(record.get("policy_key", ""))
    except (ValueError, TypeError):
        return False
    cls = getattr(policies, name, None) if isinstance(name, str) else None
    if name not in NAMED_FIELDS or not isinstance(fields, dict) or "policy" not in record:
        return False
    default = {f.name: spec_key_value(f.default) for f in dataclasses.fields(cls) if f.name in NAMED_FIELDS[name]}
    named = {f: fields[f] for f in NAMED_FIELDS[name] if f in fields and fields[f] != default[f]}
    text = spec_with(record["policy"], named, NAMED_FIELDS[name])
    if text == record["policy"]:
        return False
    record["policy"] = text
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="results.jsonl or results.jsonl.gz files, rewritten in place")
    parser.add_argument("--classes", default="",
                        help="comma list of policy classes whose records are rewritten (default: all), e.g. BSER")
    args = parser.parse_args(argv)
    classes = tuple(c.strip() for c in args.classes.split(",") if c.strip()) or None
    unknown = [c for c in classes or () if not dataclasses.is_dataclass(getattr(policies, c, None))]
    if unknown:
        parser.error(f"--classes: {unknown[0]!r} is not a policy class of sparsekv_jax.policies")
    for path in args.files:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            records = [json.loads(line) for line in f if line.strip()]
        changed = sum(migrate(r, classes) for r in records)
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
