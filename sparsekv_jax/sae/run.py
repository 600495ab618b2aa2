"""A whole SAE training run: config → model keys → shuffle buffer → steps → checkpoints → files.

``sae_training/train.py --config FILE.yaml`` and ``sparsekv train-sae`` both call `run`. Output
folder (``out``)::

    config.yaml            the resolved configuration
    checkpoints/<step>/    orbax checkpoints: SAEs, Adam, dead counters, shuffle buffer, RNG
                           (elsewhere with ``checkpoint_dir``)
    curves.csv             step, layer, fvu, auxk, l0, dead_fraction, lr, vectors (every log_every steps)
    curves.png             the curves, one line per layer
    NAME.safetensors/json  the SAEs and their record (held-out FVU, L0, dead fraction per layer)

``resume=True`` restores the newest checkpoint and continues exactly as an uninterrupted run
would (same batches, same schedule, same losses): the data stream is a pure function of the
seed and the step, and everything stateful is in the checkpoint.

``max_minutes`` fits a run into a time budget: after a few timed steps the schedule's length is
set to the steps that fit (never more than ``steps``) and recorded in the checkpoint.
"""

from __future__ import annotations

import csv
import json
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.sae.config import RunConfig, TrainConfig
from sparsekv_jax.sae.train import TrainState, init_train_state, train_step

CSV_FIELDS = ("step", "layer", "fvu", "auxk", "l0", "dead_fraction", "lr", "vectors")
_CALIBRATE = (3, 23)  # steps timed (after compilation) to fit a time budget


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
    if not path.exists():
        return []
    with path.open() as f:
        return [r for r in csv.DictReader(f) if int(r["step"]) <= step]


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        w.writerows(rows)


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


def run(cfg: RunConfig, *, resume: bool = False, stop_at: int | None = None, progress: bool = True,
        params=None, tokenizer=None) -> dict[str, Any]:
    """Train (or resume) the SAEs of ``cfg``; returns the record written next to the weights.

    ``stop_at``: stop after that step (after saving a checkpoint), as an interrupted run would;
    no export. ``params``/``tokenizer``: an already loaded model (else ``cfg.model`` is loaded).
    """
    from tqdm.auto import tqdm

    from sparsekv_jax.sae.data import TokenRows, load_corpus, sequential_rows, tokenize
    from sparsekv_jax.sae.evaluate import evaluate
    from sparsekv_jax.sae.export import save_saes
    from sparsekv_jax.sae.keys import check_layers
    from sparsekv_jax.sae.stream import ShuffleBuffer, chunk_vectors

    t_start = time.perf_counter()
    out = Path(cfg.out)
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
    (out / "config.yaml").write_text(_yaml(cfg.to_dict()))
    extract = partial(chunk_vectors, layers=layers, drop_first=cfg.drop_first, attention=cfg.attention)

    def fresh_state() -> tuple[TrainState, ShuffleBuffer]:
        data = jnp.concatenate([extract(params, jnp.asarray(rows.chunk(c))) for c in range(cfg.buffer_chunks)], 1)
        key = jax.random.PRNGKey(cfg.seed)
        k_init, k_buf = jax.random.split(key)
        sample = data[:, jax.random.permutation(k_init, capacity)[: min(cfg.init_vectors, capacity)]]
        state = init_train_state(k_init, sample, tcfg, cfg.steps)
        chunk = jnp.zeros((len(layers), per_chunk, mcfg.head_dim), jnp.float32)
        return state, ShuffleBuffer(data=data, chunk=chunk, key=k_buf)

    ckpt_dir = out / "checkpoints" if cfg.checkpoint_dir is None else Path(cfg.checkpoint_dir)
    manager = _checkpoint_manager(ckpt_dir, cfg.keep_checkpoints)
    import orbax.checkpoint as ocp

    start = manager.latest_step() if resume else None
    if start is not None:
        abstract = jax.eval_shape(fresh_state)
        restored = manager.restore(start, args=ocp.args.StandardRestore({"train": abstract[0], "buffer": abstract[1]}))
        state, buf = restored["train"], restored["buffer"]
        log_rows: list[dict[str, Any]] = _read_csv_until(out / "curves.csv", start)
    else:
        start = 0
        state, buf = fresh_state()
        log_rows = []
    total = int(state.total_steps)
    fit_budget = cfg.max_minutes is not None and start == 0
    last = total if stop_at is None else min(total, stop_at)
    bar = tqdm(total=total, initial=start, disable=not progress, desc="train-sae", dynamic_ncols=True)
    t_cal = None
    step = start
    while step < last:
        if step % steps_per_chunk == 0:
            chunk_index = cfg.buffer_chunks + step // steps_per_chunk
            buf = buf.replace(chunk=extract(params, jnp.asarray(rows.chunk(chunk_index))))
        cursor = jnp.asarray((step % steps_per_chunk) * cfg.batch_size, jnp.int32)
        state, buf, metrics = _buffered_step(state, buf, cursor, tcfg)
        step += 1
        if fit_budget and step in _CALIBRATE:
            jax.block_until_ready(state.step)
            if step == _CALIBRATE[0]:
                t_cal = time.perf_counter()
            else:
                per_step = (time.perf_counter() - t_cal) / (_CALIBRATE[1] - _CALIBRATE[0])
                left = cfg.max_minutes * 60 - (time.perf_counter() - t_start)
                total = max(step + 1, min(cfg.steps, step + int(left / per_step)))
                state = state.replace(total_steps=jnp.asarray(total, jnp.int32))
                last = total if stop_at is None else min(total, stop_at)
                bar.total = total
                bar.write(f"time budget {cfg.max_minutes:g} min: {per_step * 1e3:.1f} ms/step -> {total} steps")
        if step % cfg.log_every == 0 or step == last:
            m = jax.device_get(metrics)
            for i, layer in enumerate(layers):
                log_rows.append({"step": step, "layer": layer, "fvu": float(m["fvu"][i]),
                                 "auxk": float(m["auxk"][i]), "l0": float(m["l0"][i]),
                                 "dead_fraction": float(m["dead_fraction"][i]), "lr": float(m["lr"]),
                                 "vectors": step * cfg.batch_size})
            bar.set_postfix(fvu=f"{np.mean(m['fvu']):.4f}", l0=f"{np.mean(m['l0']):.1f}",
                            dead=f"{np.mean(m['dead_fraction']):.3f}")
        if step % cfg.checkpoint_every == 0 or step == last:
            manager.save(step, args=ocp.args.StandardSave({"train": state, "buffer": buf}), force=True)
        bar.update(1)
    bar.close()
    manager.wait_until_finished()
    _write_csv(out / "curves.csv", log_rows)
    if step < total:  # stopped early on request: the checkpoint is the product
        return {"stopped_at": step, "total_steps": total}
    t_train = time.perf_counter() - t_start

    sae = state.sae
    if cfg.export_dtype == "float16":  # evaluate what is shipped
        sae = jax.tree.map(lambda a: a.astype(jnp.float16).astype(jnp.float32), sae)
    held = sequential_rows(tokenize(tokenizer, corpus.heldout), cfg.seq_len)
    if cfg.eval_max_rows is not None:
        held = held[: cfg.eval_max_rows]
    heldout = evaluate(sae, params, held, layers, drop_first=cfg.drop_first, batch_rows=cfg.eval_batch_rows,
                       method=cfg.topk, attention=cfg.attention)
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
        "seq_len": cfg.seq_len, "drop_first": cfg.drop_first, "seed": cfg.seed,
        "max_minutes": cfg.max_minutes, "train_seconds": round(t_train, 1), "device": jax.devices()[0].device_kind,
        "heldout": heldout,
        "final_train": [{"layer": L, "fvu": final[L]["fvu"], "dead_fraction": final[L]["dead_fraction"]}
                        for L in layers if L in final],
    }
    save_saes(out / f"{cfg.name}.safetensors", state.sae, record, dtype=cfg.export_dtype)
    plot_curves(out / "curves.csv", out / "curves.png", title=f"{cfg.name}: Top-K SAEs on {cfg.model} keys")
    return json.loads((out / f"{cfg.name}.json").read_text())


def _yaml(values: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(values, sort_keys=False)
