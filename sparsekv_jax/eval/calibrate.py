"""`sparsekv calibrate`: CHESS's uncertainty thresholds from a calibration set.

CHESS rebuilds its page selection when the next-token distributions over the last page of
generated tokens are too uncertain. The paper sets the two thresholds — mean entropy and
varentropy of a page — at the 99th percentile of their distribution over the pages generated
with full attention on a calibration set (its Figure 4). This module does exactly that:

1. prompts from a calibration set: plain text (by default the WikiText-2 test split shipped with
   the package, `sparsekv_jax.datasets.wikitext2_text`, or a text file; passages of ``length``
   tokens cut at seeded offsets, each followed by a request to summarise it — long answers, so
   many complete pages; for a base model, whose tokenizer has no chat template, the passage alone
   after BOS, which the model continues: its own kind of long answer), or any `sparsekv eval` suite
   (``ruler``, ``longbench``, a PATH);
2. greedy generation with full attention, then the same tokens teacher-forced to get the
   logits of every decode step;
3. per complete page of ``page_size`` generated tokens (the steps CHESS sees: tokens 1.., the
   first comes from the prompt): mean entropy and varentropy (the variance of the per-token
   entropy over the page, as CHESS computes it; the entropy is
   `sparsekv_jax.policies.common.entropy_stats`, which CHESS's trigger uses);
4. the ``percentile``-th percentiles → JSON (`CHESS.from_spec(calibration=...)` loads it) and a
   density plot of the pages with the thresholds.

Keep the calibration text apart from what you evaluate on (the default is WikiText-2, not RULER
or LongBench).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from sparsekv_jax._progress import bar_disabled

SUMMARY_REQUEST = "\n\nSummarize the text above in a few paragraphs."


def page_statistics(entropy: np.ndarray, num_steps: np.ndarray, page_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean entropy and varentropy of every complete page.

    ``entropy`` ``[B, N]``: entropy of the distribution at decode step ``i`` (column 0 = the prompt's
    distribution, not part of any page); ``num_steps`` ``[B]``: valid columns per row. Page ``j``
    of a row is columns ``1 + j·page_size .. (j+1)·page_size``; only complete pages count.
    """
    means, variances = [], []
    for row, n in zip(entropy, num_steps, strict=True):
        for start in range(1, int(n) - page_size + 1, page_size):
            page = row[start:start + page_size].astype(np.float64)
            means.append(page.mean())
            variances.append(page.var())
    return np.asarray(means), np.asarray(variances)


def text_prompts(text: str, tokenizer: Any, length: int, n: int, seed: int) -> list[list[int]]:
    """``n`` prompts, each a passage of ``length`` tokens of ``text`` at a seeded offset: in the chat
    template followed by `SUMMARY_REQUEST`, or, for a tokenizer without a chat template (a base
    model), the passage alone after the tokenizer's special tokens (BOS), to be continued."""
    from sparsekv_jax.eval.suites import has_chat_template

    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < length + 1:
        raise ValueError(f"the calibration text holds {len(ids)} tokens, fewer than one passage of length={length}")
    rng = np.random.default_rng(seed)
    starts = rng.choice(len(ids) - length, size=n, replace=n > len(ids) - length)
    prompts = []
    for s in starts:
        if not has_chat_template(tokenizer):
            prompts.append(list(tokenizer(tokenizer.decode(ids[s:s + length]))["input_ids"]))
            continue
        passage = tokenizer.decode(ids[s:s + length])
        messages = [{"role": "user", "content": passage + SUMMARY_REQUEST}]
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompts.append(list(tokenizer(rendered, add_special_tokens=False)["input_ids"]))
    return prompts


def calibration_text(suite: str, data: str | os.PathLike[str] | None = None) -> tuple[str, str] | None:
    """``(text, name)`` of a plain-text calibration set, or ``None`` when ``suite`` is an eval suite.

    ``suite="wikitext"``: the file ``data`` if given, else the WikiText-2 test split shipped with
    the package; any other ``suite`` naming an existing file: that file. ``FileNotFoundError``
    names a ``data`` file that does not exist.
    """
    if suite == "wikitext" and data is None:
        from sparsekv_jax.datasets import WIKITEXT2_TEST, wikitext2_text

        return wikitext2_text(), WIKITEXT2_TEST.name
    path = Path(data).expanduser() if suite == "wikitext" else Path(suite).expanduser()
    if suite == "wikitext" and not path.is_file():
        raise FileNotFoundError(f"calibration text {path} not found (--data)")
    if not path.is_file():
        return None
    return path.read_text(encoding="utf-8"), path.name


def suite_prompts(suite: str, tokenizer: Any, cfg: Any, tasks: list[str] | None, length: int, n: int,
                  seed: int, cache_dir: str | None) -> list[list[int]]:
    """Whole prompts (context + question) of a `sparsekv eval` suite."""
    from sparsekv_jax.eval.batching import encode
    from sparsekv_jax.eval.suites import build_groups

    _, groups = build_groups(suite, tasks, [length], n, seed, tokenizer, cfg.max_position_embeddings, cache_dir, None)
    prompts = []
    for g in groups:
        for s in g.samples:
            ctx, q = encode(tokenizer, s)
            prompts.append(ctx + q)
    return prompts


@dataclasses.dataclass(frozen=True)
class CalibrateOptions:
    """The options of `calibrate` besides the model, suite and output file.

    Attributes:
      data: the text file of ``suite="wikitext"`` (default: the WikiText-2 test split shipped with
        the package); unused for an eval suite.
      tasks: task names of an eval suite (default: all of it).
      length: prompt length in tokens.
      n: prompts.
      seed: the seed drawing the prompts.
      page_size: tokens per page (CHESS's page size).
      percentile: the thresholds' percentile over pages, in (0, 100).
      max_new_tokens: tokens generated per prompt (must exceed ``page_size``).
      batch_size: prompts per `generate` call.
      plot: where to write the (mean entropy, varentropy) density plot (``None``: no plot).
      progress: a tqdm bar over batches.
      dtype: weight dtype when loading ``model`` (default float32).
      cache_dir: cache root for the embedded model and the suites' data files.
    """

    data: str | os.PathLike[str] | None = None
    tasks: list[str] | None = None
    length: int = 2048
    n: int = 32
    seed: int = 1234
    page_size: int = 32
    percentile: float = 99.0
    max_new_tokens: int = 256
    batch_size: int = 4
    plot: str | os.PathLike[str] | None = None
    progress: bool = True
    dtype: Any = None
    cache_dir: str | None = None


def calibrate_options(**options: Any) -> CalibrateOptions:
    """`CalibrateOptions` from `calibrate`'s keyword options (or ``options=CalibrateOptions(...)``).

    Raises:
      TypeError: an unknown keyword (named, with the valid ones listed), or an ``options=`` that is
        not a `CalibrateOptions`.
      ValueError: both ``options=`` and keyword options.
    """
    from sparsekv_jax.engine.run import options_of

    return options_of(options, CalibrateOptions)


def calibrate(model: Any = "smollm2", suite: str = "wikitext", *,
              out: str | os.PathLike[str] = "chess_calibration.json", **options: Any) -> dict[str, Any]:
    """Measure the page statistics and write the thresholds (see the module docstring).

    Args:
      model: ``"smollm2"``, a model directory / ``.gguf`` path, or a loaded ``(params, tokenizer)``.
      suite: ``"wikitext"`` (plain text from the file ``data``, by default the WikiText-2 test split
        shipped with the package), another text file path, or a `sparsekv eval` suite (``data``
        unused).
      out: the JSON file written.
      **options: the fields of `CalibrateOptions` (``data``, ``tasks``, ``length``, ``n``, ``seed``,
        ``page_size``, ``percentile``, ``max_new_tokens``, ``batch_size``, ``plot``, ``progress``,
        ``dtype``, ``cache_dir``), or ``options=CalibrateOptions(...)``. They are checked before the
        model loads: an unknown keyword raises `TypeError` naming it.

    Returns:
      The JSON written to ``out``.
    """
    o = calibrate_options(**options)
    data, tasks, length, n, seed, plot = o.data, o.tasks, o.length, o.n, o.seed, o.plot
    page_size, percentile, max_new_tokens, batch_size = o.page_size, o.percentile, o.max_new_tokens, o.batch_size
    progress, dtype, cache_dir = o.progress, o.dtype, o.cache_dir

    import jax
    import jax.numpy as jnp
    from tqdm.auto import tqdm

    from sparsekv_jax.generate import generate, teacher_force
    from sparsekv_jax.models.embedded import load
    from sparsekv_jax.policies import Dense
    from sparsekv_jax.policies.common import entropy_stats

    if not 0 < percentile < 100:
        raise ValueError(f"percentile={percentile} must be in (0, 100)")
    if page_size < 2 or max_new_tokens <= page_size:
        raise ValueError(f"max_new_tokens={max_new_tokens} must exceed page_size={page_size} (>= 2): "
                         "no page would ever complete")
    if isinstance(model, tuple):
        params, tokenizer = model
    else:
        params, tokenizer = load(model, dtype=jnp.float32 if dtype is None else dtype, progress=progress,
                                 cache_dir=cache_dir)
    cfg = params.config
    text = calibration_text(suite, data)
    if text is not None:
        prompts = text_prompts(text[0], tokenizer, length, n, seed)
    else:
        prompts = suite_prompts(suite, tokenizer, cfg, tasks, length, n, seed, cache_dir)
    width = max(map(len, prompts))
    if width + max_new_tokens > cfg.max_position_embeddings:
        raise ValueError(f"prompts of {width} tokens + max_new_tokens={max_new_tokens} exceed the model's "
                         f"{cfg.max_position_embeddings} positions")
    stop = tuple(sorted({*cfg.eos_token_ids, *([tokenizer.eos_token_id] if tokenizer.eos_token_id is not None
                                               else [])}))
    entropies, steps = [], []
    batches = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    for batch in tqdm(batches, disable=bar_disabled(progress), desc="calibrate", unit="batch"):
        rows = batch + [batch[-1]] * (batch_size - len(batch))  # one shape: one compile
        tokens = np.zeros((batch_size, width), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        lengths = np.asarray([len(r) for r in rows], np.int32)
        res = generate(params, Dense(), tokens, lengths=lengths, max_new_tokens=max_new_tokens, stop_tokens=stop)
        forced = np.asarray(res.tokens).clip(min=0)  # padding after a stop: any id, its logits are unused
        logits, _ = teacher_force(params, Dense(), tokens, forced, lengths=lengths)
        ent = np.asarray(jax.jit(entropy_stats)(logits.reshape(-1, logits.shape[-1]))).reshape(forced.shape)
        entropies.append(ent[: len(batch)])
        # every distribution CHESS sees: one per decode step, the step producing the stop included
        steps.append(np.asarray(res.num_generated)[: len(batch)])
    mean_h, var_h = page_statistics(np.concatenate(entropies), np.concatenate(steps), page_size)
    if len(mean_h) == 0:
        raise ValueError("no complete page of generated tokens: raise max_new_tokens or use longer answers")
    result = {
        "entropy_threshold": float(np.percentile(mean_h, percentile)),
        "varentropy_threshold": float(np.percentile(var_h, percentile)),
        "percentile": percentile, "page_size": page_size, "pages": int(len(mean_h)), "samples": len(prompts),
        "model": model if isinstance(model, str) else "custom", "suite": suite,
        "data": None if text is None else text[1], "length": length,
        "max_new_tokens": max_new_tokens, "seed": seed,
        "mean_entropy": {"median": float(np.median(mean_h)), "max": float(mean_h.max())},
        "varentropy": {"median": float(np.median(var_h)), "max": float(var_h.max())},
        "date": datetime.date.today().isoformat(), "device": jax.devices()[0].device_kind,
        # CHESS's default trigger_on="both" (the paper's Figure 4), and the "either" reading
        "trigger_rate": float(np.mean((mean_h > np.percentile(mean_h, percentile))
                                      & (var_h > np.percentile(var_h, percentile)))),
        "trigger_rate_either": float(np.mean((mean_h > np.percentile(mean_h, percentile))
                                             | (var_h > np.percentile(var_h, percentile)))),
        "page_stats": [[round(float(a), 5), round(float(b), 5)] for a, b in zip(mean_h, var_h, strict=True)],
    }
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(result, indent=2) + "\n")
    if plot is not None:
        plot_pages(mean_h, var_h, result, plot)
    return result


def plot_pages(mean_h: np.ndarray, var_h: np.ndarray, result: dict[str, Any], path: str | os.PathLike[str]) -> None:
    """Density of (mean entropy, varentropy) over pages with the thresholds (the paper's Figure 4)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    hb = ax.hexbin(mean_h, var_h, gridsize=30, mincnt=1, cmap="viridis", bins="log")
    fig.colorbar(hb, ax=ax, label="pages (log)")
    te, tv = result["entropy_threshold"], result["varentropy_threshold"]
    ax.axvline(te, ls="--", c="k", lw=1)
    ax.axhline(tv, ls="--", c="k", lw=1)
    x_hi, y_hi = max(te, mean_h.max()) * 1.05, max(tv, var_h.max()) * 1.05
    # a page triggers when both statistics are above their thresholds (trigger_on="both", the
    # paper's Figure 4): shade the upper-right quadrant
    ax.fill_between([te, x_hi], tv, y_hi, color="r", alpha=0.12, lw=0)
    ax.set_xlim(0, x_hi)
    ax.set_ylim(0, y_hi)
    ax.set_xlabel("mean entropy of a page (nats)")
    ax.set_ylabel("varentropy of a page")
    ax.set_title(f"{result['pages']} pages of {result['page_size']} tokens, p{result['percentile']:g} thresholds\n"
                 f"shaded: a rebuild triggers ({result['trigger_rate']:.1%} of pages)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
