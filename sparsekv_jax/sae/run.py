"""A whole SAE training run: config → model keys → shuffle buffer → steps → checkpoints → files.

``sae_training/train.py --config FILE.yaml`` and ``sparsekv train-sae`` both call `run`. Output
folder (``out``)::

    config.yaml            the resolved configuration
    checkpoints/<step>/    orbax checkpoints: SAEs, Adam, dead counters, shuffle buffer, RNG
                           (elsewhere with ``checkpoint_dir``)
    curves.csv             step, layer, fvu, auxk, l0, dead_fraction, lr, vectors (every log_every steps)
    curves.png             the curves, one line per layer
    NAME.safetensors/json  the SAEs and their record: written when training ends (``heldout: null``),
                           rewritten with the held-out FVU, L0, dead fraction per layer

``resume=True`` restores the newest checkpoint and continues exactly as an uninterrupted run
would (same batches, same schedule, same losses): the data stream is a pure function of the
seed and the step, and everything stateful is in the checkpoint. Before anything is loaded or
written, the configuration is compared with the run's ``config.yaml``: a difference is refused,
naming each field, unless the field is one of `RESUMABLE` and named in ``change``. Without
``resume``, an ``out`` (or ``checkpoint_dir``) that is not empty is refused unless
``overwrite=True``, which deletes the earlier run's files first. ``curves.csv`` is appended (and
flushed) at every logged step; on resume, its rows after the checkpoint's step are dropped, so it
holds each step's rows once. What an interruption keeps: docs/INTERRUPTION.md.

``max_minutes`` fits a run into a time budget: after a few timed steps the schedule's length is
set to the steps that fit (never more than ``steps``) and recorded in the checkpoint. It is fitted
again after the first checkpoint (step ``_REFIT``) from the mean step time since the timed steps,
which then includes logging and checkpoint writes: fitted on the first steps alone, Qwen's 8- and
10-minute runs took 12.5 and 15.6 minutes (2026-11-27/28). A refit never moves a decay that has begun,
nor a cosine schedule (fitted once).
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax._progress import bar_disabled
from sparsekv_jax.sae.config import RESUMABLE_FIELDS, RunConfig, TrainConfig
from sparsekv_jax.sae.train import TrainState, init_train_state, train_step

CSV_FIELDS = ("step", "layer", "fvu", "auxk", "l0", "dead_fraction", "lr", "vectors")
RESUMABLE = RESUMABLE_FIELDS  # may differ from the saved config on resume, when named in ``change``
_NOT_COMPARED = ("out",)  # the folder itself: the same run may be named by another path
_CALIBRATE = (3, 23)  # steps timed (after compilation) to fit a time budget
_REFIT = 1_100  # the budget fitted again here, from the mean step time since _CALIBRATE[0]
_clock = time.perf_counter  # the budget's clock (a test replaces it)


@partial(jax.jit, static_argnames=("cfg",), donate_argnums=(0, 1))
def _buffered_step(state: TrainState, buf, cursor: jax.Array, cfg: TrainConfig):
    from sparsekv_jax.sae.stream import draw

    x, buf = draw(buf, cursor, cfg.batch_size)
    state, metrics = train_step(state, x, cfg)
    return state, buf, metrics


def _checkpoint_manager(directory: Path, keep: int):
    import orbax.checkpoint as ocp

    options = ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=False, create=True)
    return ocp.CheckpointManager(directory.resolve(), options=options)


def _read_csv_until(path: Path, step: int) -> list[dict[str, str]]:
    """Rows of ``path`` up to ``step``; a row cut off by a kill (missing fields) is left out."""
    if not path.exists():
        return []
    kept = []
    with path.open(newline="") as f:
        for r in csv.DictReader(f):
            if any(r.get(k) in (None, "") for k in CSV_FIELDS):
                continue
            try:
                if int(r["step"]) <= step:
                    kept.append(r)
            except ValueError:
                continue
    return kept


def _replace_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename: never half written."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


class _CurveLog:
    """``curves.csv`` written as the run goes: ``start`` rewrites the file with the rows up to the
    step the run starts from (atomically), `append` adds one step's rows and flushes them."""

    def __init__(self, path: Path, start: int):
        import io

        self.rows: list[dict[str, Any]] = _read_csv_until(path, start)
        buf = io.StringIO()
        w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
        w.writeheader()
        w.writerows(self.rows)
        _replace_file(path, buf.getvalue())
        self._file = path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=CSV_FIELDS, lineterminator="\n")

    def append(self, rows: list[dict[str, Any]]) -> None:
        self._writer.writerows(rows)
        self._file.flush()  # in the OS's hands: a killed process loses nothing written so far
        self.rows.extend(rows)

    def close(self) -> None:
        self._file.close()


def _export(out: Path, name: str, sae, record: dict[str, Any], dtype: str) -> Path:
    """`save_saes` to ``out/NAME.safetensors`` + ``.json`` through temporary names and renames: an earlier
    export is replaced whole or not at all. Returns the weights' path."""
    from sparsekv_jax.sae.export import save_saes

    tmp, tmp_record = save_saes(out / f"{name}.partial.safetensors", sae, record, dtype=dtype)
    path = out / f"{name}.safetensors"
    os.replace(tmp, path)
    os.replace(tmp_record, path.with_suffix(".json"))
    return path


def _entries(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def _check_out(cfg: RunConfig, ckpt_dir: Path, resume: bool, overwrite: bool,
               change: tuple[str, ...]) -> RunConfig | None:
    """Refuse what would mix two runs, before anything is written; returns the saved config (or None).

    Without ``resume``: ``out`` and ``ckpt_dir`` must be empty (or ``overwrite``). With it: the
    config must equal the saved one but for the fields named in ``change`` (all of `RESUMABLE`)."""
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other: --resume continues the run in --out, "
                         "--overwrite deletes it")
    unknown = [c for c in change if c not in RESUMABLE]
    if unknown:
        raise ValueError(f"--change {','.join(unknown)}: only these fields may change on resume: "
                         f"{', '.join(RESUMABLE)} (the others would make the checkpoint another run's)")
    if change and not resume:
        raise ValueError(f"--change {','.join(change)} applies to --resume only")
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out} is a file, not a folder")
    saved_path = out / "config.yaml"
    saved = RunConfig.from_yaml(saved_path) if saved_path.is_file() else None
    found = _entries(out) + [f"{ckpt_dir}/{n}" for n in _entries(ckpt_dir) if ckpt_dir != out / "checkpoints"]
    if not resume:
        if found and not overwrite:
            shown = ", ".join(found[:5]) + (", ..." if len(found) > 5 else "")
            raise ValueError(f"--out {out} is not empty ({shown}): pass --resume to continue the run in it, "
                             "or --overwrite to delete its checkpoints, curves and exported SAEs and start over "
                             "(or choose another --out)")
        return saved
    if saved is None:
        if found:
            raise ValueError(f"--resume: {out} has no config.yaml, so it is not a train-sae run to continue "
                             f"(it holds {', '.join(found[:5])}); choose another --out")
        return None
    a, b = saved.to_dict(), cfg.to_dict()
    diffs = [k for k in a if k not in _NOT_COMPARED and a[k] != b[k]]
    refused = [k for k in diffs if k not in change]
    if refused:
        listed = "; ".join(f"{k}: {a[k]!r} in {saved_path}, {b[k]!r} now" for k in refused)
        may = [k for k in refused if k in RESUMABLE]
        hint = (f" To continue with the new value of {', '.join(may)}, pass --change {','.join(may)}." if may
                else "")
        raise ValueError(f"--resume: the config differs from the run's: {listed}.{hint} Only "
                         f"{', '.join(RESUMABLE)} may change on resume; for the others start a new --out.")
    return saved


def _delete_run(out: Path, ckpt_dir: Path, saved: RunConfig | None, name: str) -> None:
    """--overwrite: remove the files a run writes (other files in ``out`` stay)."""
    if ckpt_dir.is_dir():
        if ckpt_dir == out / "checkpoints":
            shutil.rmtree(ckpt_dir)
        else:  # a shared folder: only the step directories (orbax names them by the step)
            for p in ckpt_dir.iterdir():
                if p.is_dir() and p.name.split(".")[0].isdigit():
                    shutil.rmtree(p)
    names = {name} | ({saved.name} if saved is not None else set())
    files = ["config.yaml", "curves.csv", "curves.png", "curves.csv.tmp"]
    files += [f"{n}{ext}" for n in names for ext in (".safetensors", ".json", ".partial.safetensors",
                                                      ".partial.json")]
    for f in files:
        (out / f).unlink(missing_ok=True)


def plot_curves(csv_path: str | Path, png_path: str | Path, title: str = "") -> None:
    """FVU (log), L0, dead fraction and AuxK loss against steps, one line per layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with Path(csv_path).open() as f:
        rows = list(csv.DictReader(f))
    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    panels = (("fvu", "FVU (train batches)", True), ("l0", "L0", False),
              ("dead_fraction", "dead fraction", False), ("auxk", "AuxK loss", False))
    layers = sorted({int(r["layer"]) for r in rows})
    for ax, (key, label, log) in zip(axes.flat, panels, strict=True):
        for layer in layers:
            pts = [(int(r["step"]), float(r[key])) for r in rows if int(r["layer"]) == layer]
            if pts:
                ax.plot(*zip(*pts, strict=True), label=f"layer {layer}")
        ax.set_ylabel(label)
        if log:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    for ax in axes[1]:
        ax.set_xlabel("step")
    axes[0, 0].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


def run(cfg: RunConfig, *, resume: bool = False, overwrite: bool = False, change: tuple[str, ...] = (),
        stop_at: int | None = None, progress: bool = True, params=None, tokenizer=None) -> dict[str, Any]:
    """Train (or resume) the SAEs of ``cfg``; returns the record written next to the weights.

    ``resume``: continue the run in ``cfg.out`` from its newest checkpoint (a fresh start if it has
    none); the config must equal its ``config.yaml`` except for the `RESUMABLE` fields named in
    ``change``. ``overwrite``: delete the run in ``cfg.out`` first (without it, a non-empty
    ``out`` is refused). ``stop_at``: stop after that step (after saving a checkpoint), as an
    interrupted run would; no export. ``params``/``tokenizer``: an already loaded model (else
    ``cfg.model`` is loaded).
    """
    from tqdm.auto import tqdm

    from sparsekv_jax.sae.data import TokenRows, load_corpus, sequential_rows, tokenize
    from sparsekv_jax.sae.evaluate import evaluate
    from sparsekv_jax.sae.keys import check_layers
    from sparsekv_jax.sae.stream import ShuffleBuffer, chunk_vectors

    t_start = _clock()
    out = Path(cfg.out)
    ckpt_dir = out / "checkpoints" if cfg.checkpoint_dir is None else Path(cfg.checkpoint_dir)
    change = tuple(change)
    saved = _check_out(cfg, ckpt_dir, resume, overwrite, change)  # before anything is loaded or written
    if stop_at is not None and stop_at < 1:
        raise ValueError(f"stop_at={stop_at} must be >= 1")
    if overwrite:
        _delete_run(out, ckpt_dir, saved, cfg.name)
    out.mkdir(parents=True, exist_ok=True)
    if params is None:
        from sparsekv_jax.models.embedded import load

        params, tokenizer = load(cfg.model, dtype=jnp.dtype(cfg.dtype), progress=progress, cache_dir=cfg.cache_dir)
    mcfg = params.config
    layers = check_layers(cfg.layers, mcfg.num_layers)
    tcfg = cfg.train_config()
    corpus = load_corpus(cfg.corpus, cfg.holdout, cfg.cache_dir)
    rows = TokenRows(tokenize(tokenizer, corpus.train), cfg.seq_len, cfg.rows_per_chunk, cfg.seed)
    per_chunk = cfg.rows_per_chunk * (cfg.seq_len - cfg.drop_first) * mcfg.num_kv_heads
    steps_per_chunk = per_chunk // cfg.batch_size
    if steps_per_chunk < 1:
        raise ValueError(f"a chunk holds {per_chunk} vectors per layer, fewer than batch_size={cfg.batch_size}: "
                         "raise rows_per_chunk or lower batch_size")
    capacity = cfg.buffer_chunks * per_chunk
    extract = partial(chunk_vectors, layers=layers, drop_first=cfg.drop_first, attention=cfg.attention)

    def fresh_state() -> tuple[TrainState, ShuffleBuffer]:
        data = jnp.concatenate([extract(params, jnp.asarray(rows.chunk(c))) for c in range(cfg.buffer_chunks)], 1)
        key = jax.random.PRNGKey(cfg.seed)
        k_init, k_buf = jax.random.split(key)
        sample = data[:, jax.random.permutation(k_init, capacity)[: min(cfg.init_vectors, capacity)]]
        state = init_train_state(k_init, sample, tcfg, cfg.steps)
        chunk = jnp.zeros((len(layers), per_chunk, mcfg.head_dim), jnp.float32)
        return state, ShuffleBuffer(data=data, chunk=chunk, key=k_buf)

    manager = _checkpoint_manager(ckpt_dir, cfg.keep_checkpoints)
    import orbax.checkpoint as ocp

    start = manager.latest_step() if resume else None
    if start is not None:
        if "steps" in change and cfg.steps < start:
            raise ValueError(f"--change steps: steps={cfg.steps} is before the checkpoint's step {start}")
        abstract = jax.eval_shape(fresh_state)
        restored = manager.restore(start, args=ocp.args.StandardRestore({"train": abstract[0], "buffer": abstract[1]}))
        state, buf = restored["train"], restored["buffer"]
        if "steps" in change and saved is not None and cfg.steps != saved.steps:
            state = state.replace(total_steps=jnp.asarray(cfg.steps, jnp.int32))
    else:
        start = 0
        state, buf = fresh_state()
    _replace_file(out / "config.yaml", _yaml(cfg.to_dict()))
    curves = _CurveLog(out / "curves.csv", start)
    log_rows = curves.rows
    total = int(state.total_steps)
    fit_budget = cfg.max_minutes is not None and start == 0
    last = total if stop_at is None else min(total, stop_at)
    bar = tqdm(total=total, initial=start, disable=bar_disabled(progress), desc="train-sae", dynamic_ncols=True)
    t_cal = None
    step = start
    try:
        while step < last:
            if step % steps_per_chunk == 0:
                chunk_index = cfg.buffer_chunks + step // steps_per_chunk
                buf = buf.replace(chunk=extract(params, jnp.asarray(rows.chunk(chunk_index))))
            cursor = jnp.asarray((step % steps_per_chunk) * cfg.batch_size, jnp.int32)
            state, buf, metrics = _buffered_step(state, buf, cursor, tcfg)
            step += 1
            # a refit moves no learning rate already used: not within a WSD decay, never a cosine (its curve
            # depends on the total from the first step after warm-up)
            refit = cfg.schedule == "constant" or (cfg.schedule == "wsd" and step < (1 - cfg.decay_fraction) * total)
            if fit_budget and (step in _CALIBRATE or (step == _REFIT and step < total and refit)):
                jax.block_until_ready(state.step)
                if step == _CALIBRATE[0]:
                    t_cal = _clock()
                else:
                    now = _clock()
                    per_step = (now - t_cal) / (step - _CALIBRATE[0])
                    left = cfg.max_minutes * 60 - (now - t_start)
                    total = max(step + 1, min(cfg.steps, step + int(left / per_step)))
                    state = state.replace(total_steps=jnp.asarray(total, jnp.int32))
                    last = total if stop_at is None else min(total, stop_at)
                    bar.total = total
                    bar.write(f"time budget {cfg.max_minutes:g} min: {per_step * 1e3:.1f} ms/step "
                              f"(steps {_CALIBRATE[0]}-{step}) -> {total} steps")
            if step % cfg.log_every == 0 or step == last:
                m = jax.device_get(metrics)
                curves.append([{"step": step, "layer": layer, "fvu": float(m["fvu"][i]), "auxk": float(m["auxk"][i]),
                                "l0": float(m["l0"][i]), "dead_fraction": float(m["dead_fraction"][i]),
                                "lr": float(m["lr"]), "vectors": step * cfg.batch_size}
                               for i, layer in enumerate(layers)])
                bar.set_postfix(fvu=f"{np.mean(m['fvu']):.4f}", l0=f"{np.mean(m['l0']):.1f}",
                                dead=f"{np.mean(m['dead_fraction']):.3f}")
            if step % cfg.checkpoint_every == 0 or step == last:
                manager.save(step, args=ocp.args.StandardSave({"train": state, "buffer": buf}), force=True)
            bar.update(1)
    finally:  # the rows logged so far are on disk already
        curves.close()
    bar.close()
    manager.wait_until_finished()
    if step < total:  # stopped early on request: the checkpoint is the product
        return {"stopped_at": step, "total_steps": total}
    t_train = _clock() - t_start

    held = sequential_rows(tokenize(tokenizer, corpus.heldout), cfg.seq_len)
    if cfg.eval_max_rows is not None:
        held = held[: cfg.eval_max_rows]
    final = {int(r["layer"]): r for r in log_rows if int(r["step"]) == step}
    record = {
        "model": Path(cfg.model).name,
        "model_config": {"num_layers": mcfg.num_layers, "num_kv_heads": mcfg.num_kv_heads,
                         "num_heads": mcfg.num_heads, "head_dim": mcfg.head_dim},
        "layers": list(layers), "keys": "pre-RoPE key projections, one SAE per layer shared by its KV heads",
        "corpus": cfg.corpus, "split": f"last {cfg.holdout:g} of documents held out",
        "train_tokens": int(len(rows.tokens)), "heldout_tokens": int(held.size), "steps": step,
        "batch_size": cfg.batch_size, "vectors_seen": step * cfg.batch_size, "lr": cfg.lr,
        "schedule": cfg.schedule, "aux_coef": cfg.aux_coef, "dead_after": cfg.dead_after,
        **({"dead_bias_step": cfg.dead_bias_step} if cfg.dead_bias_step else {}),  # opt-ins: named when used
        **({"w_dec_init": cfg.w_dec_init} if cfg.w_dec_init != "random" else {}),
        "seq_len": cfg.seq_len, "drop_first": cfg.drop_first, "seed": cfg.seed,
        "max_minutes": cfg.max_minutes, "train_seconds": round(t_train, 1), "device": jax.devices()[0].device_kind,
        "heldout": None,  # until measured below
        "final_train": [{"layer": L, "fvu": float(final[L]["fvu"]), "dead_fraction": float(final[L]["dead_fraction"])}
                        for L in layers if L in final],
    }
    # the weights first: a failed evaluation must not take the run's product with it
    path = _export(out, cfg.name, state.sae, record, cfg.export_dtype)
    plot_curves(out / "curves.csv", out / "curves.png", title=f"{cfg.name}: Top-K SAEs on {cfg.model} keys")
    sae = state.sae
    if cfg.export_dtype == "float16":  # evaluate what is shipped
        sae = jax.tree.map(lambda a: a.astype(jnp.float16).astype(jnp.float32), sae)
    try:
        record["heldout"] = evaluate(sae, params, held, layers, drop_first=cfg.drop_first,
                                     batch_rows=cfg.eval_batch_rows, method=cfg.topk, attention=cfg.attention)
    except Exception as e:
        raise RuntimeError(
            f"the held-out evaluation failed after training ({type(e).__name__}; its traceback above). The trained "
            f"SAEs are exported at {path} (its record has heldout: null) and checkpoint {step} is in {ckpt_dir}. "
            f"Re-run the evaluation with the same command plus --resume (--out {out}): a finished run goes straight "
            "to the evaluation and the export; --eval-batch-rows / --eval-max-rows may change on resume "
            "(--change eval_batch_rows,eval_max_rows).") from e
    _export(out, cfg.name, state.sae, record, cfg.export_dtype)
    return json.loads((out / f"{cfg.name}.json").read_text())


def _yaml(values: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(values, sort_keys=False)
