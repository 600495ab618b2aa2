"""RULER-style synthetic long-context tasks, generated deterministically from a seed.

Follows NVIDIA RULER (``nvidia-long-context-eval==26.3``: ``synthetic.yaml``, ``constants.py``
and the generators ``niah.py``, ``variable_tracking.py``, ``common_words_extraction.py``,
``freq_words_extraction.py``, ``qa.py``): the same 13 task configurations, task templates, answer
prefixes, needle format, haystacks and metrics. Prompts are sized with the model's own tokenizer,
chat template included, by searching the haystack size (RULER grows it step by step; here an
interpolation/bisection search per sample) so that the prompt is the longest one that does not
exceed ``length_tokens``.

Deliberate differences from RULER, all documented here:

* ``length_tokens`` is the prompt length (what the model prefills). RULER's ``max_seq_length``
  also counts ``tokens_to_generate``; to reproduce a RULER length ``L`` pass
  ``L - Task.max_new_tokens``.
* The chat template is the tokenizer's own (``apply_chat_template``, one user turn) and RULER's
  answer prefix follows the assistant header (RULER appends it to every model template too).
* Haystack granularity is finer so that short prompts land within 2% of the target: the noise
  haystack is sized in sentences (RULER: whole 5-sentence lines), the essay haystack in words
  (as RULER), QA distractors in words (the last distractor document may be cut short).
* Needle depth is a fraction of the haystack's characters; random depths come from RULER's
  40-point grid, and a fixed ``depth`` can be requested for single-needle tasks.
* Word lists (RULER uses the ``wonderwords`` package): keys are ``word-word`` pairs and the
  common-words vocabulary is drawn from lowercase words that occur at least twice in the Paul
  Graham essays (about 8,400 words; RULER's list is about 9,000).
* RULER's sentence splitter is NLTK punkt; here a regex on ``.!?`` word endings.
* QA: questions are drawn by the seed (RULER takes them in file order); HotpotQA's supporting
  paragraphs are the gold documents and its other paragraphs are the first distractors (RULER
  keeps all 10 paragraphs as gold), which lets short prompts exist.
* Needle types: RULER's ``type_needle_k`` / ``type_needle_v`` are task variants
  (``niah_single_2@words``, ``niah_multikey_2@uuids:numbers``; :func:`ruler_config`). RULER draws a
  variant's needles from one random stream, so its keys and needle depths change with the value
  type; here a variant draws what its task draws and replaces the values of another type from a
  stream of their own, so keys, needle order and haystack text stay the same and only the values
  (and the haystack size the prompt length allows) change. Word values are RULER's ``adj-noun``
  form drawn from the essay vocabulary below (real words from the essays, not invented strings).
* Shared context (``@split``, not in RULER): a multi-key task's context asked one key at a time.
* Variable tracking's in-context example is shortened to ``min(80, max(10, L // 40))`` noise
  sentences (RULER: about 500 tokens), so 512-token prompts remain possible.
"""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
import random
import re
import string
import uuid
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from sparsekv_jax.eval.data import ruler_data_file
from sparsekv_jax.eval.tasks import Sample, Task, count_tokens, render_prompt

__all__ = [
    "DEPTHS",
    "NEEDLE",
    "NEEDLE_TYPES",
    "NOISE_SENTENCES",
    "RULER_CONFIGS",
    "RULER_TASKS",
    "RulerConfig",
    "generate_samples",
    "ruler_config",
    "ruler_task",
    "split_tasks",
    "value_type_variants",
]

# RULER's ``type_needle_k`` / ``type_needle_v`` choices (``niah.py``).
NEEDLE_TYPES: tuple[str, ...] = ("numbers", "words", "uuids")

# RULER's haystack of type "repeat" ("noise" in the RULER paper).
NOISE_SENTENCES: tuple[str, ...] = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
NEEDLE = "One of the special magic {type_needle_v} for {key} is: {value}."
# RULER: np.round(np.linspace(0, 100, num=40)); no value falls on .5, so round() agrees.
DEPTHS: tuple[int, ...] = tuple(round(i * 100 / 39) for i in range(40))


@dataclass(frozen=True)
class RulerConfig:
    """One RULER task configuration (``synthetic.yaml``)."""

    name: str
    kind: str  # niah | variable_tracking | common_words_extraction | freq_words_extraction | qa
    metric: str
    max_new_tokens: int
    type_haystack: str = ""  # niah: noise | essay | needle
    type_needle_k: str = "words"
    type_needle_v: str = "numbers"
    num_needle_k: int = 1
    num_needle_v: int = 1
    num_needle_q: int = 1
    num_chains: int = 1
    num_hops: int = 4
    freq_cw: int = 30
    freq_ucw: int = 3
    num_cw: int = 10
    alpha: float = 2.0
    dataset: str = ""  # qa: squad | hotpotqa
    description: str = ""
    base: str = ""  # a variant's RULER task (``niah_single_2`` for ``niah_single_2@words``); "" for RULER's own
    split_questions: bool = False  # ``@split``: one question per key, all over one shared context

    @property
    def base_name(self) -> str:
        """RULER's task this configuration is (a variant of)."""
        return self.base or self.name


def _niah(name: str, hay: str, k: str = "words", v: str = "numbers", nk: int = 1, nv: int = 1, nq: int = 1,
          desc: str = "") -> RulerConfig:
    return RulerConfig(name, "niah", "string_match_all", 128, type_haystack=hay, type_needle_k=k,
                       type_needle_v=v, num_needle_k=nk, num_needle_v=nv, num_needle_q=nq, description=desc)


RULER_CONFIGS: dict[str, RulerConfig] = {
    c.name: c
    for c in (
        _niah("niah_single_1", "noise", desc="one number needle in repeated noise sentences"),
        _niah("niah_single_2", "essay", desc="one number needle in essays"),
        _niah("niah_single_3", "essay", v="uuids", desc="one UUID needle in essays"),
        _niah("niah_multikey_1", "essay", nk=4, desc="4 needles with different keys in essays, 1 asked"),
        _niah("niah_multikey_2", "needle", desc="one needle among distractor needles"),
        _niah("niah_multikey_3", "needle", k="uuids", v="uuids", desc="UUID key/value among distractor needles"),
        _niah("niah_multivalue", "essay", nv=4, desc="4 values for one key in essays, all asked"),
        _niah("niah_multiquery", "essay", nq=4, desc="4 keys asked at once in essays"),
        RulerConfig("vt", "variable_tracking", "string_match_all", 30, num_chains=1, num_hops=4,
                    description="variable assignment chain in noise; name all variables of a value"),
        RulerConfig("cwe", "common_words_extraction", "string_match_all", 120, freq_cw=30, freq_ucw=3,
                    num_cw=10, description="10 most common words of a numbered word list"),
        RulerConfig("fwe", "freq_words_extraction", "string_match_all", 50, alpha=2.0,
                    description="3 most frequent coded words of a zeta-distributed text"),
        RulerConfig("qa_1", "qa", "string_match_part", 32, dataset="squad",
                    description="SQuAD v2.0 question over gold + distractor paragraphs"),
        RulerConfig("qa_2", "qa", "string_match_part", 32, dataset="hotpotqa",
                    description="HotpotQA question over gold + distractor paragraphs"),
    )
}
RULER_TASKS: dict[str, Task] = {
    c.name: Task(c.name, "ruler", c.metric, c.max_new_tokens, description=c.description)
    for c in RULER_CONFIGS.values()
}

def ruler_config(name: str) -> RulerConfig:
    """The configuration of RULER task ``name`` or of a variant of a needle task.

    A variant is ``TASK@SPEC`` with ``SPEC`` one or more ``+``-joined parts:

    * ``V`` (``numbers``, ``words`` or ``uuids``): the needle values are of type ``V``
      (RULER's ``type_needle_v``), e.g. ``niah_single_2@words``;
    * ``K:V``: keys of type ``K`` (RULER's ``type_needle_k``) and values of type ``V``,
      e.g. ``niah_multikey_2@uuids:numbers``;
    * ``split``: one sample per key of the context, each asking for that key alone, all with the
      same context text (a shared context answering several questions in turn); only for tasks
      with several keys of one value each (``niah_multikey_1``, ``niah_multiquery``).

    ``TASK@numbers`` of a task whose values are numbers is RULER's task itself (same prompts).
    Raises ``ValueError`` naming the bad part.
    """
    if not isinstance(name, str):
        raise ValueError(f"a RULER task name must be a string, got {name!r}")
    base, _, spec = name.partition("@")
    if base not in RULER_CONFIGS:
        raise ValueError(f"unknown RULER task {base!r}; expected one of {list(RULER_CONFIGS)}")
    cfg = RULER_CONFIGS[base]
    if not spec:
        if "@" in name:
            raise ValueError(f"RULER task {name!r}: nothing after '@'")
        return cfg
    if cfg.kind != "niah":
        raise ValueError(f"RULER task {name!r}: variants exist for the needle tasks (niah_*) only, not {base}")
    key_type, value_type, split = cfg.type_needle_k, cfg.type_needle_v, False
    seen: set[str] = set()
    for part in spec.split("+"):
        kind = "split" if part == "split" else "types"
        if kind in seen:
            raise ValueError(f"RULER task {name!r}: the needle types or 'split' are given twice")
        seen.add(kind)
        if part == "split":
            split = True
            continue
        k, sep, v = part.rpartition(":")
        for t in ([k] if sep else []) + [v]:
            if t not in NEEDLE_TYPES:
                raise ValueError(f"RULER task {name!r}: unknown needle type {t!r}; expected one of {NEEDLE_TYPES} "
                                 "(TASK@VALUES or TASK@KEYS:VALUES, optionally +split)")
        key_type, value_type = (k if sep else key_type), v
    num_k = max(cfg.num_needle_k, cfg.num_needle_q)
    if split and (num_k < 2 or cfg.num_needle_v != 1):
        raise ValueError(f"RULER task {name!r}: 'split' needs several keys with one value each "
                         f"(niah_multikey_1, niah_multiquery); {base} has {num_k} key(s) and "
                         f"{cfg.num_needle_v} value(s) per key")
    desc = f"{cfg.description}; keys {key_type}, values {value_type}" + ("; one question per key" if split else "")
    return dataclasses.replace(cfg, name=name, type_needle_k=key_type, type_needle_v=value_type, base=base,
                               split_questions=split, description=desc)


def ruler_task(name: str) -> Task:
    """The `Task` (suite, metric, answer length) of a RULER task or variant (see :func:`ruler_config`)."""
    cfg = ruler_config(name)
    return Task(cfg.name, "ruler", cfg.metric, cfg.max_new_tokens, description=cfg.description)


def value_type_variants(tasks: Sequence[str] | None = None) -> list[str]:
    """``TASK@numbers``, ``TASK@words``, ``TASK@uuids`` of every needle task of ``tasks``
    (default: RULER's 8 needle tasks); a name that already names a variant is kept as it is."""
    names = list(tasks) if tasks is not None else [n for n, c in RULER_CONFIGS.items() if c.kind == "niah"]
    out: list[str] = []
    for name in names:
        if "@" in name:
            out.append(ruler_config(name).name)
            continue
        cfg = ruler_config(name)
        if cfg.kind != "niah":
            raise ValueError(f"{name!r} has no value-type variants (needle tasks niah_* only)")
        out += [f"{name}@{v}" for v in NEEDLE_TYPES]
    return out


def split_tasks() -> list[str]:
    """The shared-context tasks: every needle task with several keys, one question per key."""
    return [f"{n}@split" for n, c in RULER_CONFIGS.items()
            if c.kind == "niah" and max(c.num_needle_k, c.num_needle_q) > 1 and c.num_needle_v == 1]



# Task templates and answer prefixes (RULER constants.py). The context goes between pre and post.
_NIAH_PRE = (
    "Some special magic {type_needle_v} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {type_needle_v} afterwards.\n"
)
_NIAH_POST = "\nWhat are all the special magic {type_needle_v} for {query} mentioned in the provided text?"
_NIAH_ANSWER = " The special magic {type_needle_v} for {query} mentioned in the provided text are"
_VT_PRE = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n"
_VT_POST = "\nQuestion: Find all variables that are assigned the value {query} in the text above."
_VT_ANSWER = (
    " Answer: According to the chain(s) of variable assignment in the text above, {num_v} variables "
    "are assgined the value {query}, they are: "
)
_CWE_PRE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n"
)
_CWE_POST = "\nQuestion: What are the {num_cw} most common words in the above list?"
_CWE_ANSWER = " Answer: The top {num_cw} words that appear most often in the list are:"
_FWE_PRE = (
    "Read the following coded text and track the frequency of each coded word. "
    "Find the three most frequently appeared coded words. "
)
_FWE_POST = (
    "\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
_FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"
_QA_INSTRUCTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other words."
)
_QA_PRE = _QA_INSTRUCTION + "\n\nThe following are given documents.\n\n"
_QA_POST = "\n\n" + _QA_INSTRUCTION + "\n\nQuestion: {query}"
_QA_ANSWER = " Answer:"
_QA_DOC = "Document {i}:\n{document}"


def _singular(text: str) -> str:
    # RULER's rewrite of the NIAH template when exactly one value is asked for.
    return (text.replace("Some", "A").replace("are all", "is").replace("are", "is")
            .replace("answers", "answer"))


# ----------------------------------------------------------------------------------------------
# Data: essays, word lists, QA sets (loaded once per process).
# ----------------------------------------------------------------------------------------------

_SENT_END = re.compile(r"[.!?][\"')\]]*$")


@dataclass(frozen=True)
class _Essay:
    words: tuple[str, ...]
    ends: tuple[int, ...]  # word indices (exclusive) at which a sentence ends


@lru_cache(maxsize=4)
def _essay(path: str) -> _Essay:
    text = json.loads(Path(path).read_text())["text"]
    words = tuple(re.sub(r"\s+", " ", text).strip().split(" "))
    ends = tuple(i + 1 for i, w in enumerate(words) if _SENT_END.search(w))
    return _Essay(words, ends)


@lru_cache(maxsize=4)
def _vocab(path: str) -> tuple[str, ...]:
    text = json.loads(Path(path).read_text())["text"]
    counts = Counter(re.findall(r"(?<![\w'-])[a-z]{4,14}(?![\w'-])", text))
    return tuple(sorted(w for w, n in counts.items() if n >= 2))


@dataclass(frozen=True)
class _QASet:
    queries: tuple[str, ...]
    answers: tuple[tuple[str, ...], ...]
    gold: tuple[tuple[int, ...], ...]
    more: tuple[tuple[int, ...], ...]
    docs: tuple[str, ...]
    doc_words: tuple[int, ...]


def _dedupe(items: Sequence[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


@lru_cache(maxsize=2)
def _qa_set(dataset: str, path: str) -> _QASet:
    data = json.loads(Path(path).read_text())
    queries: list[str] = []
    answers: list[tuple[str, ...]] = []
    gold: list[tuple[int, ...]] = []
    more: list[tuple[int, ...]] = []
    if dataset == "squad":
        docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
        index = {c: i for i, c in enumerate(docs)}
        for d in data["data"]:
            article = [index[p["context"]] for p in d["paragraphs"]]
            for p in d["paragraphs"]:
                me = index[p["context"]]
                for qa in p["qas"]:
                    if qa["is_impossible"]:
                        continue
                    queries.append(qa["question"])
                    answers.append(_dedupe([a["text"] for a in qa["answers"]]))
                    gold.append((me,))
                    more.append(tuple(i for i in article if i != me))
    elif dataset == "hotpotqa":
        docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
        index = {c: i for i, c in enumerate(docs)}
        for d in data:
            support = {t for t, _ in d["supporting_facts"]}
            paras = [(t, index[f"{t}\n{''.join(p)}"]) for t, p in d["context"]]
            queries.append(d["question"])
            answers.append((d["answer"],))
            gold.append(tuple(i for t, i in paras if t in support))
            more.append(tuple(i for t, i in paras if t not in support))
    else:
        raise ValueError(f"unknown QA dataset {dataset!r}")
    return _QASet(tuple(queries), tuple(answers), tuple(gold), tuple(more), tuple(docs),
                  tuple(len(doc.split()) for doc in docs))


def _zeta(alpha: float, terms: int = 2000) -> float:
    """Riemann zeta for alpha > 1 (partial sum plus Euler-Maclaurin tail), as scipy.special.zeta."""
    s = math.fsum(k ** -alpha for k in range(1, terms))
    return s + terms ** (1 - alpha) / (alpha - 1) + 0.5 * terms ** -alpha + alpha / 12 * terms ** (-alpha - 1)


# ----------------------------------------------------------------------------------------------
# Rendering helpers.
# ----------------------------------------------------------------------------------------------


@dataclass
class _Built:
    """Task text for one haystack size: prompt = chat(pre + haystack + post) + answer prefix."""

    pre: str
    haystack: str
    post: str
    answer_prefix: str
    answers: tuple[str, ...]
    needle_spans: list[tuple[int, int]]  # char spans of needles within haystack, in text order
    meta: dict[str, Any]


def _join(pieces: Sequence[tuple[str, bool]], sep: str) -> tuple[str, list[tuple[int, int]]]:
    """Join non-empty pieces with ``sep``; return the text and the spans of the flagged pieces."""
    out: list[str] = []
    spans: list[tuple[int, int]] = []
    pos = 0
    for text, flagged in pieces:
        if not text:
            continue
        if out:
            out.append(sep)
            pos += len(sep)
        if flagged:
            spans.append((pos, pos + len(text)))
        out.append(text)
        pos += len(text)
    return "".join(out), spans


def _depths(haystack: str, spans: Sequence[tuple[int, int]]) -> tuple[float, ...]:
    """Fraction of the haystack's non-needle characters before each needle."""
    needle_chars = sum(e - s for s, e in spans)
    total = max(len(haystack) - needle_chars, 1)
    out = []
    before = 0
    for s, e in spans:
        out.append(round((s - before) / total, 4))
        before += e - s
    return tuple(out)


def _closest_boundary(cum: Sequence[int], frac: float) -> int:
    """Index b of the boundary (cum[b] = chars before boundary b) closest to frac * cum[-1]."""
    target = frac * cum[-1]
    b = bisect.bisect_left(cum, target)
    if b >= len(cum):
        return len(cum) - 1
    if b > 0 and target - cum[b - 1] <= cum[b] - target:
        return b - 1
    return b


def _insert(units: Sequence[str], inserts: Sequence[tuple[int, str]]) -> list[tuple[str, bool]]:
    """Interleave needle texts into unit texts; ``inserts`` = (boundary index, text), sorted."""
    pieces: list[tuple[str, bool]] = []
    j = 0
    for b in range(len(units) + 1):
        while j < len(inserts) and inserts[j][0] == b:
            pieces.append((inserts[j][1], True))
            j += 1
        if b < len(units):
            pieces.append((units[b], False))
    return pieces


def _noise_lines(n: int, inserts: Sequence[tuple[int, str]]) -> tuple[str, list[tuple[int, int]]]:
    """``n`` noise sentences, 5 to a line (one RULER noise repeat), needles on their own lines."""
    pieces: list[tuple[str, bool]] = []
    line: list[str] = []
    j = 0
    for i in range(n + 1):
        while j < len(inserts) and inserts[j][0] == i:
            if line:
                pieces.append((" ".join(line), False))
                line = []
            pieces.append((inserts[j][1], True))
            j += 1
        if i == n:
            break
        line.append(NOISE_SENTENCES[i % 5])
        if i % 5 == 4:
            pieces.append((" ".join(line), False))
            line = []
    if line:
        pieces.append((" ".join(line), False))
    return _join(pieces, "\n")


def _noise_cum(n: int) -> list[int]:
    cum = [0]
    for i in range(n):
        cum.append(cum[-1] + len(NOISE_SENTENCES[i % 5]) + 1)
    return cum


# ----------------------------------------------------------------------------------------------
# Task builders: each returns (build(units) -> _Built, min_units, max_units or None).
# ----------------------------------------------------------------------------------------------

Builder = Callable[[int], _Built]


def _random_value(rng: random.Random, kind: str, vocab: Sequence[str]) -> str:
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    if kind == "words":
        return f"{rng.choice(vocab)}-{rng.choice(vocab)}"
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    raise ValueError(f"unknown needle type {kind!r}")


def _niah_builder(cfg: RulerConfig, key: str, depth: float | None, cache: Any) -> tuple[Builder, int, int | None]:
    rng = random.Random(key)
    essay_path = str(ruler_data_file("PaulGrahamEssays.json", cache))
    vocab = _vocab(essay_path)
    base = RULER_CONFIGS[cfg.base_name]
    # A variant draws exactly what its RULER task draws (keys, values, shuffles, positions), then
    # replaces keys / values of another type by draws from streams of their own: the keys, the
    # needle order and the haystack stay those of the task whatever the value type.
    key_rng = random.Random(f"{key}:keys:{cfg.type_needle_k}")
    value_rng = random.Random(f"{key}:values:{cfg.type_needle_v}")
    num_k = max(cfg.num_needle_k, cfg.num_needle_q)
    base_keys: list[str] = []
    keys: list[str] = []
    values: list[list[str]] = []
    needles: list[str] = []
    for _ in range(num_k):
        k = _random_value(rng, base.type_needle_k, vocab)
        while k in base_keys:
            k = _random_value(rng, base.type_needle_k, vocab)
        base_keys.append(k)
        if cfg.type_needle_k != base.type_needle_k:
            k = _random_value(key_rng, cfg.type_needle_k, vocab)
            while k in keys:
                k = _random_value(key_rng, cfg.type_needle_k, vocab)
        keys.append(k)
        vals = [_random_value(rng, base.type_needle_v, vocab) for _ in range(cfg.num_needle_v)]
        if cfg.type_needle_v != base.type_needle_v:
            vals = [_random_value(value_rng, cfg.type_needle_v, vocab) for _ in vals]
        values.append(vals)
        needles += [NEEDLE.format(type_needle_v=cfg.type_needle_v, key=k, value=v) for v in vals]
    rng.shuffle(needles)
    asked = rng.sample(range(num_k), cfg.num_needle_q)
    queries = [keys[i] for i in asked]
    answers = tuple(v for i in asked for v in values[i])
    query = ", ".join(queries[:-1]) + ", and " + queries[-1] if len(queries) > 1 else queries[0]
    pre, post, ans = _NIAH_PRE, _NIAH_POST, _NIAH_ANSWER
    type_v = cfg.type_needle_v
    if cfg.num_needle_q * cfg.num_needle_v == 1:
        pre, post, ans = _singular(pre), _singular(post), _singular(ans)
        type_v = type_v[:-1]
    pre = pre.format(type_needle_v=type_v)
    post = post.format(type_needle_v=type_v, query=query)
    ans = ans.format(type_needle_v=type_v, query=query)
    if depth is not None and len(needles) != 1:
        raise ValueError(f"depth= needs a single-needle task; {cfg.name} inserts {len(needles)} needles")
    meta = {"type_haystack": cfg.type_haystack, "query": query, "keys": keys, "queries": queries,
            "values": {k: list(v) for k, v in zip(keys, values, strict=True)},
            "type_needle_k": cfg.type_needle_k, "type_needle_v": cfg.type_needle_v}
    # Distractor needles (type "needle"), generated as a stream so their prefix is size-independent.
    hay_rng = random.Random(key + ":haystack")
    hay_key_rng = random.Random(f"{key}:haystack:keys:{cfg.type_needle_k}")
    hay_value_rng = random.Random(f"{key}:haystack:values:{cfg.type_needle_v}")
    distractors: list[str] = []

    def build(units: int) -> _Built:
        pos_rng = random.Random(f"{key}:positions:{units}")
        if cfg.type_haystack == "essay":
            essay = _essay(essay_path)
            n_sent = bisect.bisect_right(essay.ends, units)
            bounds = [0, *essay.ends[:n_sent]]
            if bounds[-1] < units:
                bounds.append(units)
            sents = [" ".join(essay.words[a:b]) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
            cum = [0]
            for s in sents:
                cum.append(cum[-1] + len(s) + 1)
            fracs = [depth] if depth is not None else sorted(d / 100 for d in pos_rng.sample(DEPTHS, len(needles)))
            inserts = [(_closest_boundary(cum, f), n) for f, n in zip(fracs, needles, strict=True)]
            hay, spans = _join(_insert(sents, inserts), " ")
        elif cfg.type_haystack == "noise":
            if depth is not None:
                inserts = [(_closest_boundary(_noise_cum(units), depth), needles[0])]
            else:
                lines = max(1, math.ceil(units / 5))
                idx = sorted(pos_rng.sample(range(max(lines, len(needles))), len(needles)))
                inserts = [(min(5 * i, units), n) for i, n in zip(idx, needles, strict=True)]
            hay, spans = _noise_lines(units, inserts)
        elif cfg.type_haystack == "needle":
            while len(distractors) < units:
                k = _random_value(hay_rng, base.type_needle_k, vocab)
                if k in base_keys:
                    continue
                v = _random_value(hay_rng, base.type_needle_v, vocab)
                if cfg.type_needle_k != base.type_needle_k:
                    k = _random_value(hay_key_rng, cfg.type_needle_k, vocab)
                    while k in keys:
                        k = _random_value(hay_key_rng, cfg.type_needle_k, vocab)
                if cfg.type_needle_v != base.type_needle_v:
                    v = _random_value(hay_value_rng, cfg.type_needle_v, vocab)
                distractors.append(NEEDLE.format(type_needle_v=cfg.type_needle_v, key=k, value=v))
            units_text = distractors[:units]
            if depth is not None:
                cum = [0]
                for s in units_text:
                    cum.append(cum[-1] + len(s) + 1)
                inserts = [(_closest_boundary(cum, depth), needles[0])]
            else:
                idx = sorted(pos_rng.sample(range(max(units, len(needles))), len(needles)))
                inserts = list(zip(idx, needles, strict=True))
            hay, spans = _join(_insert(units_text, inserts), "\n")
        else:
            raise ValueError(f"unknown haystack {cfg.type_haystack!r}")
        return _Built(pre, hay, post, ans, answers, spans, meta)

    min_units = len(needles) if cfg.type_haystack == "needle" else 1
    max_units = len(_essay(essay_path).words) if cfg.type_haystack == "essay" else None
    return build, min_units, max_units


def _vt_chains(
    rng: random.Random, num_chains: int, num_hops: int, letters: int
) -> tuple[list[list[str]], list[list[str]]]:
    n = (num_hops + 1) * num_chains
    names: list[str] = []
    while len(names) < n:
        v = "".join(rng.choices(string.ascii_uppercase, k=letters))
        if v not in names:
            names.append(v)
    var_groups, chains = [], []
    for c in range(num_chains):
        vs = names[c * (num_hops + 1):(c + 1) * (num_hops + 1)]
        var_groups.append(vs)
        chain = [f"VAR {vs[0]} = {rng.randint(10000, 99998)}"]
        chain += [f"VAR {vs[j + 1]} = VAR {vs[j]}" for j in range(num_hops)]
        chains.append(chain)
    return var_groups, chains


def _vt_text(rng: random.Random, n_noise: int, chains: list[list[str]]) -> tuple[str, list[tuple[int, int]]]:
    inserts: list[tuple[int, int, int, str]] = []
    for c, chain in enumerate(chains):
        pos = sorted(rng.sample(range(max(n_noise, len(chain))), len(chain)))
        inserts += [(min(p, n_noise), c, j, s) for j, (p, s) in enumerate(zip(pos, chain, strict=True))]
    inserts.sort()
    return _noise_lines(n_noise, [(p, s) for p, _, _, s in inserts])


def _vt_builder(cfg: RulerConfig, key: str, target: int) -> tuple[Builder, int, int | None]:
    rng = random.Random(key)
    # In-context example (RULER: 3-letter names, at most 10 hops, its answer shown).
    icl_hops = min(10, cfg.num_hops)
    icl_vars, icl_chains = _vt_chains(rng, cfg.num_chains, icl_hops, 3)
    icl_noise = min(80, max(10, target // 40))
    icl_hay, _ = _vt_text(random.Random(key + ":icl"), icl_noise, icl_chains)
    icl_value = icl_chains[0][0].split("=")[-1].strip()
    icl = (_VT_PRE + icl_hay + _VT_POST.format(query=icl_value)
           + _VT_ANSWER.format(num_v=icl_hops + 1, query=icl_value) + " ".join(icl_vars[0]))
    var_groups, chains = _vt_chains(rng, cfg.num_chains, cfg.num_hops, 5)
    value = chains[0][0].split("=")[-1].strip()
    pre = icl + "\n\n" + _VT_PRE
    post = _VT_POST.format(query=value)
    ans = _VT_ANSWER.format(num_v=cfg.num_hops + 1, query=value)
    meta = {"query": value, "icl_noise_sentences": icl_noise}

    def build(units: int) -> _Built:
        hay, spans = _vt_text(random.Random(f"{key}:positions:{units}"), units, chains)
        return _Built(pre, hay, post, ans, tuple(var_groups[0]), spans, meta)

    return build, 1, None


def _cwe_builder(cfg: RulerConfig, key: str, target: int, cache: Any) -> tuple[Builder, int, int | None]:
    rng = random.Random(key)
    vocab = _vocab(str(ruler_data_file("PaulGrahamEssays.json", cache)))
    if target < 4096:  # RULER's short-context setting
        ex_words, ex_c, ex_u, freq_c, freq_u = 20, 3, 1, 6, 1
    else:
        ex_words, ex_c, ex_u, freq_c, freq_u = 40, 10, 3, cfg.freq_cw, cfg.freq_ucw
    num_cw = cfg.num_cw

    def word_list(words: Sequence[str], rep_c: int, rep_u: int, shuffle_rng: random.Random) -> str:
        lst = list(words[:num_cw]) * rep_c + list(words[num_cw:]) * rep_u
        shuffle_rng.shuffle(lst)
        return " ".join(f"{i + 1}. {w}" for i, w in enumerate(lst))

    ex = rng.sample(vocab, ex_words)
    ex_text = (_CWE_PRE + word_list(ex, ex_c, ex_u, rng) + _CWE_POST.format(num_cw=num_cw)
               + _CWE_ANSWER.format(num_cw=num_cw) + " "
               + " ".join(f"{i + 1}. {w}" for i, w in enumerate(ex[:num_cw])))
    order = rng.sample(vocab, len(vocab))
    pre = ex_text + "\n" + _CWE_PRE
    post = _CWE_POST.format(num_cw=num_cw)
    ans = _CWE_ANSWER.format(num_cw=num_cw)
    meta = {"freq_common": freq_c, "freq_uncommon": freq_u}

    def build(units: int) -> _Built:
        hay = word_list(order[:units], freq_c, freq_u, random.Random(f"{key}:shuffle:{units}"))
        return _Built(pre, hay, post, ans, tuple(order[:num_cw]), [], meta)

    return build, num_cw + 1, len(order)


def _fwe_builder(cfg: RulerConfig, key: str, target: int) -> tuple[Builder, int, int | None]:
    rng = random.Random(key)
    vocab_size = max(8, target // 50)
    wordlen = 6
    vocab: set[str] = set()
    while len(vocab) < vocab_size:
        vocab.add("".join(rng.choices(string.ascii_lowercase, k=wordlen)))
    words = sorted(vocab)
    rng.shuffle(words)
    words[0] = "..."  # the top-ranked word is noise
    z = _zeta(cfg.alpha)
    weights = [k ** -cfg.alpha / z for k in range(1, len(words) + 1)]
    meta = {"vocab_size": vocab_size, "alpha": cfg.alpha}

    def build(units: int) -> _Built:
        sampled = [w for w, p in zip(words, weights, strict=True) for _ in range(int(units * p))]
        random.Random(f"{key}:shuffle:{units}").shuffle(sampled)
        return _Built(_FWE_PRE, " ".join(sampled), _FWE_POST, _FWE_ANSWER, tuple(words[1:4]), [], meta)

    return build, 1, None


def _qa_builder(cfg: RulerConfig, key: str, question: int, cache: Any) -> tuple[Builder, int, int | None]:
    qa = _qa_set(cfg.dataset, str(ruler_data_file(f"{cfg.dataset}.json", cache)))
    rng = random.Random(key)
    gold = list(qa.gold[question])
    more = list(qa.more[question])
    rng.shuffle(more)
    taken = set(gold) | set(more)
    stream: list[int] = list(more)  # distractors in the order they are added

    def extend(words_needed: int) -> None:
        have = sum(qa.doc_words[i] for i in stream)
        while have < words_needed and len(taken) < len(qa.docs):
            i = rng.randrange(len(qa.docs))
            if i in taken:
                continue
            taken.add(i)
            stream.append(i)
            have += qa.doc_words[i]

    query = qa.queries[question]
    post = _QA_POST.format(query=query)
    meta: dict[str, Any] = {"query": query, "question_index": question, "dataset": cfg.dataset}

    def build(units: int) -> _Built:
        extend(units + 1)
        docs: list[tuple[str, bool]] = [(qa.docs[i], True) for i in gold]
        left = units
        for i in stream:
            if left <= 0:
                break
            if qa.doc_words[i] <= left:
                docs.append((qa.docs[i], False))
                left -= qa.doc_words[i]
            else:  # cut the last distractor after `left` words, keeping its whitespace
                m = list(re.finditer(r"\S+", qa.docs[i]))[left - 1]
                docs.append((qa.docs[i][: m.end()], False))
                left = 0
        random.Random(f"{key}:order:{units}").shuffle(docs)
        pieces = [(_QA_DOC.format(i=i + 1, document=d), g) for i, (d, g) in enumerate(docs)]
        hay, spans = _join(pieces, "\n\n")
        return _Built(_QA_PRE, hay, post, _QA_ANSWER, qa.answers[question], spans, meta)

    return build, 0, None


# ----------------------------------------------------------------------------------------------
# Length search and the public entry point.
# ----------------------------------------------------------------------------------------------


def _fit_units(count: Callable[[int], int], target: int, lo: int, hi: int | None, hint: int | None) -> int:
    """Largest ``u`` in ``[lo, hi]`` with ``count(u) <= target`` (``count`` ~ increasing, ~ linear).

    Brackets the answer by extrapolating the measured slope, then alternates interpolation
    and bisection steps.
    """
    memo: dict[int, int] = {}

    def f(u: int) -> int:
        if u not in memo:
            memo[u] = count(u)
        return memo[u]

    if f(lo) > target:
        raise ValueError(f"length_tokens={target} is too small: the shortest prompt has {f(lo)} tokens")
    a = lo
    guess = max(lo + 1, hint if hint is not None else lo + 16)
    b: int | None = None
    while b is None:
        if hi is not None and guess >= hi:
            guess = hi
        if f(guess) > target:
            b = guess
            break
        a = guess
        if hi is not None and a >= hi:
            return hi
        slope = max((f(a) - f(lo)) / max(a - lo, 1), 1e-3)
        guess = a + max(1, math.ceil(1.05 * (target - f(a)) / slope) + 1)
    bisect_next = False
    while b - a > 1:
        width = b - a
        if bisect_next:
            m = (a + b) // 2
        else:
            m = a + round((target - f(a)) * (b - a) / max(f(b) - f(a), 1))
            m = min(max(m, a + 1), b - 1)
        if f(m) <= target:
            a = m
        else:
            b = m
        bisect_next = (b - a) > width // 2
    return a


def generate_samples(
    task: str,
    length_tokens: int,
    n: int,
    seed: int,
    tokenizer: Any,
    chat: bool = True,
    *,
    depth: float | None = None,
    answer_prefix: bool = True,
    cache_dir: str | Path | None = None,
) -> list[Sample]:
    """Generate ``n`` prompts of RULER task ``task``, each about ``length_tokens`` tokens long.

    Args:
        task: a name from :data:`RULER_TASKS` (``niah_single_1`` ... ``qa_2``) or a needle task's
            variant (:func:`ruler_config`: ``niah_single_2@words``, ``niah_multiquery@split``).
            A variant's keys, needle order and haystack are those of its task with the same
            seed; only keys / values of another type differ. ``@split`` gives ``n`` contexts
            with one sample per key each (``n * keys`` samples).
        length_tokens: target prompt length in tokens of ``tokenizer``, chat template included.
            Each prompt is the longest that does not exceed it (within 2% of it unless a single
            haystack unit is coarser than that: distractor needles of ``niah_multikey_2/3``
            are 25/75 tokens for SmolLM2, so use at least ~2k/4k tokens there).
        n: number of samples.
        seed: everything (needles, keys, positions, questions) is a deterministic function of
            ``(task, seed, index)``; different seeds give different prompts.
        tokenizer: a Hugging Face tokenizer (fast or slow) of the evaluated model.
        chat: wrap the task text in the tokenizer's chat template (one user turn).
        depth: for single-needle NIAH tasks, put the needle at this fraction of the haystack
            (0 = start, 1 = end) instead of RULER's random grid depth.
        answer_prefix: end the prompt with RULER's answer prefix (as RULER does).
        cache_dir: where RULER's data files are cached (see :mod:`sparsekv_jax.eval.data`).

    Returns:
        Samples with ``prompt == context + question``; ``context`` ends right after the
        haystack. ``meta`` holds ``haystack_span`` and ``needle_spans`` (char offsets in
        ``prompt``), ``units`` (haystack size found) and ``target_tokens``.
    """
    cfg = ruler_config(task)
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    if depth is not None and cfg.kind != "niah":
        raise ValueError(f"depth= applies to NIAH tasks only, not {task}")
    questions: list[int] = []
    if cfg.kind == "qa":
        n_q = len(_qa_set(cfg.dataset, str(ruler_data_file(f"{cfg.dataset}.json", cache_dir))).queries)
        if n > n_q:
            raise ValueError(f"{task} has only {n_q} questions")
        questions = random.Random(f"ruler:{task}:{seed}:questions").sample(range(n_q), n)
    samples: list[Sample] = []
    hint: int | None = None
    for index in range(n):
        key = f"ruler:{cfg.base_name}:{seed}:{index}"  # a variant draws what its task draws
        if cfg.kind == "niah":
            build, lo, hi = _niah_builder(cfg, key, depth, cache_dir)
        elif cfg.kind == "variable_tracking":
            build, lo, hi = _vt_builder(cfg, key, length_tokens)
        elif cfg.kind == "common_words_extraction":
            build, lo, hi = _cwe_builder(cfg, key, length_tokens, cache_dir)
        elif cfg.kind == "freq_words_extraction":
            build, lo, hi = _fwe_builder(cfg, key, length_tokens)
        else:
            build, lo, hi = _qa_builder(cfg, key, questions[index], cache_dir)

        def render(built: _Built) -> tuple[str, str]:
            return render_prompt(tokenizer, built.pre + built.haystack, built.post, chat=chat,
                                 answer_prefix=built.answer_prefix if answer_prefix else "")

        def count(units: int, build: Builder = build) -> int:
            built = build(units)
            if cfg.split_questions:  # the longest of its one-key prompts must fit
                return max(s.num_tokens or 0 for s in _split_questions(None, cfg, built, tokenizer, chat,
                                                                      answer_prefix))
            context, question = render(built)
            return count_tokens(tokenizer, context + question, chat=chat)

        units = _fit_units(count, length_tokens, lo, hi, hint)
        hint = units
        built = build(units)
        context, question = render(built)
        num_tokens = count(units) if cfg.split_questions else count_tokens(tokenizer, context + question, chat=chat)
        if num_tokens < 0.98 * length_tokens:
            warnings.warn(
                f"{task} sample {index}: {num_tokens} tokens, more than 2% below the target {length_tokens}",
                stacklevel=2,
            )
        start = len(context) - len(built.haystack)
        meta = dict(built.meta)
        meta.update(
            haystack_span=(start, len(context)),
            needle_spans=[(start + s, start + e) for s, e in built.needle_spans],
            units=units,
            target_tokens=length_tokens,
            chat=chat,
        )
        sample = Sample(
            task=task,
            index=index,
            context=context,
            question=question,
            answers=built.answers,
            metric=cfg.metric,
            depths=_depths(built.haystack, built.needle_spans),
            num_tokens=num_tokens,
            max_new_tokens=cfg.max_new_tokens,
            sample_id=key if task == cfg.base_name else f"ruler:{task}:{seed}:{index}",
            meta=meta,
        )
        if cfg.split_questions:
            samples += _split_questions(sample, cfg, built, tokenizer, chat, answer_prefix)
        else:
            samples.append(sample)
    return samples


def _split_questions(sample: Sample | None, cfg: RulerConfig, built: _Built, tokenizer: Any, chat: bool,
                     answer_prefix: bool) -> list[Sample]:
    """``sample``'s context asked once per key (the asked keys first, then the others), one value each.

    The haystack is sized so that the longest of these prompts fits the target. Sample ``j`` of
    context ``i`` has index ``i * keys + j``. With ``sample=None`` only the prompts are built (for
    their lengths: the samples' ``num_tokens``).
    """
    queries = list(built.meta["queries"]) + [k for k in built.meta["keys"] if k not in built.meta["queries"]]
    type_v = cfg.type_needle_v[:-1]
    post_t, ans_t = _singular(_NIAH_POST), _singular(_NIAH_ANSWER)
    out = []
    for j, q in enumerate(queries):
        post = post_t.format(type_needle_v=type_v, query=q)
        ans = ans_t.format(type_needle_v=type_v, query=q)
        context, question = render_prompt(tokenizer, built.pre + built.haystack, post, chat=chat,
                                          answer_prefix=ans if answer_prefix else "")
        num_tokens = count_tokens(tokenizer, context + question, chat=chat)
        if sample is None:
            out.append(Sample(cfg.name, j, context, question, (), cfg.metric, num_tokens=num_tokens))
            continue
        if context != sample.context:  # the template would have to depend on the question
            raise ValueError(f"{cfg.name}: the chat template renders the context differently per question")
        meta = dict(sample.meta)
        meta.update(query=q, context_index=sample.index, question_index=j, questions=len(queries))
        out.append(dataclasses.replace(
            sample, index=sample.index * len(queries) + j, question=question,
            answers=tuple(built.meta["values"][q]), num_tokens=num_tokens,
            sample_id=f"{sample.sample_id}:q{j}", meta=meta))
    return out
