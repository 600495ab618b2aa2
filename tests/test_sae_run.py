"""Whole SAE runs: orbax round trip, exact resume, the CLI on SmolLM2, exported files and loaders."""

from __future__ import annotations

import csv
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import once_per_session, seeded_rng

from sparsekv_jax.models.config import ModelConfig
from sparsekv_jax.models.params import random_params
from sparsekv_jax.sae.config import RunConfig, TrainConfig
from sparsekv_jax.sae.export import load_saes, load_shipped, save_saes
from sparsekv_jax.sae.model import encode, init_sae
from sparsekv_jax.sae.run import _checkpoint_manager, run
from sparsekv_jax.sae.stream import ShuffleBuffer, draw
from sparsekv_jax.sae.train import init_train_state, train_step

REPO = Path(__file__).resolve().parents[1]
TINY = ModelConfig(family="llama", vocab_size=211, hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                   head_dim=16, intermediate_size=96, max_position_embeddings=256)


class CharTokenizer:
    """Characters as token ids (the tiny model's vocabulary); id 0 is 'special' and gets dropped."""

    all_special_ids = [0]

    def __call__(self, text, add_special_tokens=False, verbose=False):
        # code points through numpy (UTF-32, no BOM): min(ord(c), V - 1) per character, 1 CPU s -> 0.05 s on the
        # corpus a run tokenizes (4M characters), which every `run` here does
        codes = np.frombuffer(text.encode("utf-32-le"), np.uint32)
        return {"input_ids": np.minimum(codes, TINY.vocab_size - 1).astype(np.int32)}


def _tiny_run_config(out: Path, **changes) -> RunConfig:
    base = RunConfig(out=str(out), name="tiny", model="tiny", layers=(2, 0), seq_len=36, drop_first=4,
                     rows_per_chunk=4, buffer_chunks=2, batch_size=64, init_vectors=256, steps=12, width=64,
                     k=4, warmup_steps=3, dead_after=128, log_every=1, checkpoint_every=5, eval_max_rows=4,
                     eval_batch_rows=2, export_dtype="float32", topk="lax")
    return dataclasses.replace(base, **changes)


def _curve(path: Path) -> list[tuple]:
    with path.open() as f:
        return [(r["step"], r["layer"], r["fvu"], r["auxk"], r["dead_fraction"]) for r in csv.DictReader(f)]


def test_orbax_checkpoint_round_trips_bit_exactly(tmp_path):
    import orbax.checkpoint as ocp

    rng = seeded_rng()
    cfg = TrainConfig(width=32, k=3, batch_size=16, dead_after=16, topk="lax")
    x = jnp.asarray(rng.normal(size=(2, 64, 8)), jnp.float32)
    state = init_train_state(jax.random.key(0), x, cfg, 10)
    buf = ShuffleBuffer(data=x, chunk=jnp.asarray(rng.normal(size=(2, 48, 8)), jnp.float32),
                        key=jax.random.PRNGKey(1))

    @jax.jit
    def step(state, buf, cursor):
        batch, buf = draw(buf, cursor, 16)
        return train_step(state, batch, cfg)[0], buf

    for i in range(3):  # Adam moments, counters and the buffer all non-trivial
        state, buf = step(state, buf, jnp.asarray(16 * i))
    saved = {"train": state, "buffer": buf}
    manager = _checkpoint_manager(tmp_path / "ckpt", keep=2)
    manager.save(3, args=ocp.args.StandardSave(saved))
    manager.wait_until_finished()
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), saved)
    restored = _checkpoint_manager(tmp_path / "ckpt", keep=2).restore(3, args=ocp.args.StandardRestore(abstract))
    assert jax.tree.structure(restored) == jax.tree.structure(saved)
    for a, b in zip(jax.tree.leaves(saved), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.fixture(scope="module")
def tiny_whole(tmp_path_factory) -> tuple[Path, dict]:
    """(folder, record) of one uninterrupted tiny run (`_tiny_run_config`): the reference the stopped, cut
    and failed runs below are compared with, run once for the three of them."""
    folder = tmp_path_factory.mktemp("tiny") / "whole"
    params = random_params(TINY, jax.random.key(7), jnp.float32, scale=0.1)
    return folder, run(_tiny_run_config(folder), progress=False, params=params, tokenizer=CharTokenizer())


def test_a_stopped_and_resumed_run_continues_exactly(tmp_path, tiny_whole):
    params = random_params(TINY, jax.random.key(7), jnp.float32, scale=0.1)
    tok = CharTokenizer()
    whole_dir, whole = tiny_whole
    split = _tiny_run_config(tmp_path / "split")
    stopped = run(split, stop_at=5, progress=False, params=params, tokenizer=tok)
    assert stopped == {"stopped_at": 5, "total_steps": 12}
    assert not (tmp_path / "split" / "tiny.safetensors").exists()
    resumed = run(split, resume=True, progress=False, params=params, tokenizer=tok)
    a, b = _curve(whole_dir / "curves.csv"), _curve(tmp_path / "split" / "curves.csv")
    assert len(a) == 24 and a == b  # same losses, AuxK terms and dead fractions, step for step
    assert any(float(r[3]) > 0 for r in a)  # AuxK was active (dead_after = 2 steps)
    assert whole["heldout"] == resumed["heldout"]
    sa, _ = load_saes(whole_dir / "tiny.safetensors")
    sb, _ = load_saes(tmp_path / "split" / "tiny.safetensors")
    for layer in (0, 2):
        for f in ("w_enc", "b_enc", "w_dec", "b_dec"):
            np.testing.assert_array_equal(np.asarray(getattr(sa[layer], f)), np.asarray(getattr(sb[layer], f)))


def test_a_time_budget_shortens_the_schedule(tmp_path):
    params = random_params(TINY, jax.random.key(7), jnp.float32, scale=0.1)
    cfg = _tiny_run_config(tmp_path / "budget", steps=1000, max_minutes=1e-4, checkpoint_dir=str(tmp_path / "ck"))
    record = run(cfg, progress=False, params=params, tokenizer=CharTokenizer())
    assert record["steps"] == 24  # the budget is spent by then: the run ends right after the timed steps
    rows = _curve(tmp_path / "budget" / "curves.csv")
    assert rows[-1][0] == "24"
    assert sorted(p.name for p in (tmp_path / "ck").iterdir() if p.name.isdigit())[-1] == "24"
    assert not (tmp_path / "budget" / "checkpoints").exists()


@pytest.mark.parametrize("refit, steps", [(40, 41), (90, 100)])
def test_the_budget_is_fitted_again_before_the_decay(tmp_path, monkeypatch, refit, steps):
    """A step clock: 10 ms a step for the timed steps, 100 ms after them (logging and checkpoints came in).
    Fitted at step 23, a 1-second budget gives 23 + 0.77 s / 10 ms = 100 steps; fitted again at step 40 from the
    mean since step 3 (the budget already spent), the run ends at 41. At step 90 the decay of a 100-step WSD
    schedule (its last 20%) has begun: no refit moves it, and the run keeps its 100 steps."""
    import sparsekv_jax.sae.run as run_mod

    calls = {"n": 0}
    inner = run_mod._buffered_step

    def counted(*args, **kwargs):
        calls["n"] += 1
        return inner(*args, **kwargs)

    def clock() -> float:
        n = calls["n"]
        return 0.01 * n if n <= 23 else 0.23 + 0.1 * (n - 23)

    monkeypatch.setattr(run_mod, "_buffered_step", counted)
    monkeypatch.setattr(run_mod, "_clock", clock)
    monkeypatch.setattr(run_mod, "_REFIT", refit)
    params = random_params(TINY, jax.random.key(7), jnp.float32, scale=0.1)
    cfg = _tiny_run_config(tmp_path / "run", steps=1000, max_minutes=1 / 60, schedule="wsd", decay_fraction=0.2,
                           checkpoint_every=1000, log_every=50)
    record = run(cfg, progress=False, params=params, tokenizer=CharTokenizer())
    assert record["steps"] == steps and calls["n"] == steps


# `sparsekv train-sae` on SmolLM2 at toy sizes: `SMOKE_STEPS`, a checkpoint every 10, every step logged; the corpus is
# `KJV_SLICE` characters of the KJV (what `smoke_run` writes next to its run): the whole KJV (4.3M characters) took
# ~8 CPU s of each CLI run to read and tokenize, three runs in this file, for rows these runs draw a few dozen of
SMOKE_STEPS = 50
SMOKE_ARGS = ["--config", str(REPO / "sae_training/configs/smoke.yaml"), "--steps", str(SMOKE_STEPS), "--layers",
              "0,2", "--seq-len", "68", "--rows-per-chunk", "2", "--batch-size", "128", "--checkpoint-every", "10",
              "--log-every", "1", "--eval-max-rows", "2", "-q"]
KJV_SLICE = 200_000  # 10 documents of ~20k characters (`sae.data._pieces`): 9 to train on, 1 held out


def _smoke_args(smoke_run: Path) -> list[str]:
    """`SMOKE_ARGS` with the corpus `smoke_run` wrote (``smoke_run`` is its run's folder)."""
    return [*SMOKE_ARGS, "--corpus", str(smoke_run.parent / "kjv_slice.txt")]


@pytest.fixture(scope="module")
def smoke_run(smol, tmp_path_factory):
    """The folder of one uninterrupted `sparsekv train-sae` run (`SMOKE_ARGS`), in this process.

    Each CLI run pays ~12 CPU s besides its steps (the model loaded, the corpus tokenized, its programs
    compiled, the evaluation, the plot): one run serves both the test of its outputs and, as the
    uninterrupted reference, the killed-and-resumed run's test."""
    from sparsekv_jax.cli import main
    from sparsekv_jax.sae.data import kjv_books

    def make(folder: Path) -> None:
        (folder / "kjv_slice.txt").write_text("".join(kjv_books(str(smol[0])))[:KJV_SLICE], encoding="utf-8")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SPARSEKV_CACHE", str(smol[0]))
            assert main(["train-sae", *_smoke_args(folder / "whole"), "--out", str(folder / "whole")]) == 0

    return once_per_session(tmp_path_factory, "sae_smoke_run", make) / "whole"  # once, whichever worker asks


def test_cli_trains_smollm2_keys_and_writes_every_output(smoke_run):
    out = smoke_run
    # keep_checkpoints is 2: the newest two of 10, 20, ..., 50
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.isdigit()) == ["40", "50"]
    rows = list(csv.DictReader((out / "curves.csv").open()))
    assert [(r["step"], r["layer"]) for r in rows] == [(str(s), str(L)) for s in range(1, SMOKE_STEPS + 1)
                                                       for L in (0, 2)]
    assert all(0 < float(r["fvu"]) < 2 and float(r["l0"]) == 8 for r in rows)
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((out / "smoke.json").read_text())
    for key in ("model", "layers", "corpus", "steps", "k", "width", "heldout"):
        assert key in record
    assert record["layers"] == [0, 2] and record["steps"] == SMOKE_STEPS and record["k"] == 8 and record["width"] == 256
    assert [r["layer"] for r in record["heldout"]] == [0, 2]
    assert all(0 < r["fvu"] < 2 and 0 <= r["dead_fraction"] <= 1 and r["l0"] == 8 for r in record["heldout"])
    saes, rec2 = load_shipped("smoke", directory=out)
    assert rec2 == record and sorted(saes) == [0, 2]
    assert saes[2].d_in == 64 and saes[2].width == 256 and saes[2].k == 8
    ids, acts = encode(saes[0], jnp.ones((5, 64)))
    assert ids.shape == (5, 8)


def test_train_script_runs_from_a_clone():
    res = subprocess.run([sys.executable, str(REPO / "sae_training" / "train.py"), "--help"], capture_output=True,
                         text=True, cwd="/", timeout=120)
    assert res.returncode == 0, res.stderr
    assert "--max-minutes" in res.stdout and "--resume" in res.stdout


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_save_and_load_saes(tmp_path, dtype):
    sae = init_sae(jax.random.key(3), 16, 48, 5, stack=(3,))
    sae = sae.replace(b_enc=jnp.asarray(seeded_rng().normal(size=(3, 48)), jnp.float32))
    path, rec_path = save_saes(tmp_path / "x", sae, {"layers": [4, 9, 1], "model": "m"}, dtype=dtype)
    assert path.suffix == ".safetensors" and json.loads(rec_path.read_text())["dtype"] == dtype
    saes, record = load_saes(path)
    assert sorted(saes) == [1, 4, 9] and record["k"] == 5 and record["width"] == 48
    for i, layer in enumerate([4, 9, 1]):
        for f in ("w_enc", "b_enc", "w_dec", "b_dec"):
            want = np.asarray(getattr(sae, f)[i])
            got = np.asarray(getattr(saes[layer], f))
            if dtype == "float32":
                np.testing.assert_array_equal(got, want)
            else:
                np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-4)
    with pytest.raises(ValueError, match="does not match"):
        save_saes(tmp_path / "y", sae, {"layers": [1, 2]})
    with pytest.raises(FileNotFoundError, match="nothere"):
        load_shipped("nothere", directory=tmp_path)


def test_run_config_validation(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("width: 64\nlearning_rate: 0.1\n")
    with pytest.raises(ValueError, match="learning_rate"):
        RunConfig.from_yaml(bad)
    with pytest.raises(ValueError, match="drop_first=40"):
        RunConfig(seq_len=40, drop_first=40)
    with pytest.raises(ValueError, match="k=100"):
        RunConfig(width=64, k=100)
    cfg = RunConfig.from_yaml(REPO / "sae_training/configs/smollm2.yaml", steps=3)
    assert cfg.steps == 3 and cfg.layers == (0, 11, 15, 27) and cfg.width == 8192 and cfg.k == 64
    params = random_params(TINY, jax.random.key(0), jnp.float32)
    with pytest.raises(ValueError, match="batch_size=100000"):
        run(_tiny_run_config(tmp_path / "b", batch_size=100000), progress=False, params=params,
            tokenizer=CharTokenizer())


def test_shipped_smollm2_saes_match_their_record_on_held_out_text(smol):
    """The SAEs shipped in the package load, have the recorded shapes, and on held-out WikiText-2
    rows re-measured here (fp32 model on the CPU; the record was measured in bf16 on a GPU) give
    key FVU near the record's and the same exact L0."""
    from sparsekv_jax.sae.data import load_corpus, sequential_rows, tokenize
    from sparsekv_jax.sae.evaluate import evaluate
    from sparsekv_jax.sae.export import stack_saes

    _, params, tokenizer, _ = smol
    saes, record = load_shipped("smollm2")
    assert sorted(saes) == record["layers"] == [0, 11, 15, 27]
    assert all((s.d_in, s.width, s.k) == (64, 8192, 64) for s in saes.values())
    layers, stacked = stack_saes(saes)
    held = load_corpus(record["corpus"], holdout=0.1).heldout
    rows = sequential_rows(tokenize(tokenizer, held), 260)
    rows = rows[seeded_rng().choice(len(rows), 2, replace=False)]  # a fresh pair each run
    got = evaluate(stacked, params, rows, layers, drop_first=record["drop_first"], batch_rows=2)
    for mine, theirs in zip(got, record["heldout"], strict=True):
        assert mine["layer"] == theirs["layer"] and mine["l0"] == theirs["l0"] == 64
        assert mine["fvu"] < 3 * theirs["fvu"] + 2e-3, (mine, theirs)
        assert 0.1 < mine["fvu_queries"] < 1.0


# ---- interruption: a run in --out is neither wrecked nor mixed with another (issue 42, docs/INTERRUPTION.md)


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path → bytes): a snapshot to compare."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _weights(path: Path) -> dict[tuple[int, str], np.ndarray]:
    saes, _ = load_saes(path)
    return {(layer, f): np.asarray(getattr(s, f)) for layer, s in saes.items() for f in ("w_enc", "b_enc", "w_dec",
                                                                                        "b_dec")}


def test_a_non_empty_out_is_refused_without_resume_or_overwrite(tmp_path):
    """The issue's sequence: a finished run, the same command again (here stopping at step 5), then
    --resume. The second command must refuse before touching anything, naming --resume and
    --overwrite; --overwrite starts over as a run into an empty folder would."""
    params = random_params(TINY, jax.random.key(7), jnp.float32, scale=0.1)
    tok = CharTokenizer()
    cfg = _tiny_run_config(tmp_path / "run")
    whole = run(cfg, progress=False, params=params, tokenizer=tok)
    before = _files(tmp_path / "run")
    with pytest.raises(ValueError, match=r"is not empty .*--resume.*--overwrite"):
        run(cfg, stop_at=5, progress=False, params=params, tokenizer=tok)
    assert _files(tmp_path / "run") == before  # checkpoints, curves, config and export untouched
    with pytest.raises(ValueError, match="--resume and --overwrite"):
        run(cfg, resume=True, overwrite=True, progress=False, params=params, tokenizer=tok)
    # a custom checkpoint folder holding another run's steps counts too
    (tmp_path / "ck" / "5").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"is not empty .*ck/5"):
        run(_tiny_run_config(tmp_path / "other", checkpoint_dir=str(tmp_path / "ck")), progress=False, params=params,
            tokenizer=tok)
    (tmp_path / "run" / "notes.txt").write_text("mine")
    again = run(cfg, overwrite=True, progress=False, params=params, tokenizer=tok)
    assert again == {**whole, "train_seconds": again["train_seconds"]}
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == ["10", "12"]
    assert _curve(tmp_path / "run" / "curves.csv") == _curve_rows(before)
    assert (tmp_path / "run" / "notes.txt").read_text() == "mine"  # --overwrite deletes only a run's files


def _curve_rows(files: dict[str, bytes]) -> list[tuple]:
    rows = csv.DictReader(files["curves.csv"].decode().splitlines())
    return [(r["step"], r["layer"], r["fvu"], r["auxk"], r["dead_fraction"]) for r in rows]


def test_resume_with_a_changed_config_is_refused_naming_each_field(tmp_path, capsys):
    """Changed width and k are refused by name before anything is written; a resumable field
    (steps) needs --change; with it, a WSD run lengthened before its decay equals a run planned
    that long from the start (the schedule had not yet depended on its length)."""
    params = random_params(TINY, jax.random.key(7), jnp.float32, scale=0.1)
    tok = CharTokenizer()
    cfg = _tiny_run_config(tmp_path / "run", schedule="wsd")
    assert run(cfg, stop_at=5, progress=False, params=params, tokenizer=tok) == {"stopped_at": 5, "total_steps": 12}
    before = _files(tmp_path / "run")
    changed = dataclasses.replace(cfg, width=128, k=8, lr=3e-3)
    with pytest.raises(ValueError, match=r"width: 64 in .*128 now; k: 4 in .*8 now; lr: 0.001 in .*0.003 now"):
        run(changed, resume=True, progress=False, params=params, tokenizer=tok)
    with pytest.raises(ValueError, match=r"--change lr: only these fields may change"):
        run(changed, resume=True, change=("lr",), progress=False, params=params, tokenizer=tok)
    longer = dataclasses.replace(cfg, steps=16)
    with pytest.raises(ValueError, match=r"steps: 12 in .*16 now\. To continue with the new value of steps, pass "
                                         r"--change steps"):
        run(longer, resume=True, progress=False, params=params, tokenizer=tok)
    with pytest.raises(ValueError, match=r"--change steps applies to --resume only"):
        run(dataclasses.replace(cfg, out=str(tmp_path / "new")), change=("steps",), progress=False, params=params,
            tokenizer=tok)
    # the command: on --resume without --config the run's config.yaml is the base, so only what is given differs
    from sparsekv_jax.cli import main

    assert main(["train-sae", "--out", str(tmp_path / "run"), "--resume", "--steps", "16", "--k", "8", "-q"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sparsekv train-sae: error: --resume: the config differs from the run's: steps: 12 in ")
    assert "k: 4 in" in err and "pass --change steps." in err and err.count(" now") == 2
    assert main(["train-sae", "--out", str(tmp_path / "run"), "-q"]) == 2
    assert "pass --resume to continue the run in it, or --overwrite" in capsys.readouterr().err
    assert _files(tmp_path / "run") == before  # config.yaml (and all else) not rewritten to a rejected value
    resumed = run(longer, resume=True, change=("steps",), progress=False, params=params, tokenizer=tok)
    assert "steps: 16" in (tmp_path / "run" / "config.yaml").read_text()
    planned = run(dataclasses.replace(longer, out=str(tmp_path / "planned")), progress=False, params=params,
                  tokenizer=tok)
    assert resumed["steps"] == planned["steps"] == 16 and resumed["heldout"] == planned["heldout"]
    assert _curve(tmp_path / "run" / "curves.csv") == _curve(tmp_path / "planned" / "curves.csv")
    a, b = _weights(tmp_path / "run" / "tiny.safetensors"), _weights(tmp_path / "planned" / "tiny.safetensors")
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


def test_curves_csv_is_cut_back_to_the_checkpoint_it_resumes_from(tmp_path, tiny_whole):
    """Rows logged after the newest checkpoint (here: checkpoint 7 removed, as a kill during its
    write leaves it) are dropped on resume and logged again once; a row cut off mid-line too."""
    import shutil

    params = random_params(TINY, jax.random.key(7), jnp.float32, scale=0.1)
    tok = CharTokenizer()
    cfg = _tiny_run_config(tmp_path / "run")
    run(cfg, stop_at=7, progress=False, params=params, tokenizer=tok)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "7")
    path = tmp_path / "run" / "curves.csv"
    assert [r[0] for r in _curve(path)][-1] == "7"
    with path.open("a") as f:
        f.write("8,2,0.5")  # a row cut off by the kill
    run(cfg, resume=True, progress=False, params=params, tokenizer=tok)
    rows = _curve(path)
    assert [(r[0], r[1]) for r in rows] == [(str(s), str(L)) for s in range(1, 13) for L in (2, 0)]
    assert rows == _curve(tiny_whole[0] / "curves.csv")


def test_a_killed_cli_run_resumes_to_the_uninterrupted_weights_and_curves(smol, smoke_run, tmp_path, monkeypatch):
    """`sparsekv train-sae` in a subprocess, SIGKILLed mid-run (after a checkpoint, with rows logged
    beyond it), then `--resume`: the exported weights are bit-identical to an uninterrupted run's
    (`smoke_run`, the same arguments) and curves.csv holds every step's rows once, equal to the
    uninterrupted run's. 50 steps (200, then 80 before; each costs every run ~0.1 CPU s), killed once 20 are
    logged: 10 steps past the checkpoint at 10 (time for its write to finish), with rows beyond it, and 30
    steps short of the end (3 s of steps at least, against a poll every 20 ms)."""
    import os
    import signal
    import time

    from sparsekv_jax.cli import main

    cache, _, _, _ = smol
    out = tmp_path / "killed"
    env = {**os.environ, "SPARSEKV_CACHE": str(cache), "PYTHONPATH": str(REPO)}
    with (tmp_path / "stderr.txt").open("w") as err:  # a file, not a pipe: a full pipe would stall the run
        proc = subprocess.Popen([sys.executable, "-m", "sparsekv_jax.cli", "train-sae", *_smoke_args(smoke_run),
                                 "--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=err)
        logged = 0  # steps logged; killed at 20, far from the end (50) even on a fast machine
        t0 = time.monotonic()
        while logged < 20 and proc.poll() is None and time.monotonic() - t0 < 300:
            time.sleep(0.02)
            if (out / "curves.csv").exists():
                logged = len((out / "curves.csv").read_text().splitlines()) // 2  # two layers a step (+ header)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert proc.returncode == -signal.SIGKILL, (tmp_path / "stderr.txt").read_text()[-2000:]
    newest = max(int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit())
    assert 10 <= newest < SMOKE_STEPS and not (out / "smoke.safetensors").exists()  # killed mid-run, not after it
    steps_logged = [int(r[0]) for r in _curve(out / "curves.csv")][::2]
    # written as it went: every step's rows up to the kill are there, beyond the newest checkpoint
    assert steps_logged == list(range(1, len(steps_logged) + 1)) and len(steps_logged) >= max(20, newest)
    monkeypatch.setenv("SPARSEKV_CACHE", str(cache))
    assert main(["train-sae", *_smoke_args(smoke_run), "--out", str(out), "--resume"]) == 0
    rows = _curve(out / "curves.csv")
    assert [(r[0], r[1]) for r in rows] == [(str(s), str(L)) for s in range(1, SMOKE_STEPS + 1) for L in (0, 2)]
    assert rows == _curve(smoke_run / "curves.csv")
    a, b = _weights(out / "smoke.safetensors"), _weights(smoke_run / "smoke.safetensors")
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=str(key))


def test_a_failed_evaluation_keeps_the_exported_saes_and_resume_evaluates_them(tmp_path, monkeypatch, tiny_whole):
    """The Qwen paper run's loss (2026-11-27): all steps trained, the held-out evaluation ran out of GPU
    memory, and nothing was exported. Now the SAEs are exported before the evaluation: when it raises,
    NAME.safetensors holds the trained weights (record ``heldout: null``, no half-written file) and the
    error names that file and --resume. --resume of the finished run trains no step and goes straight to
    the evaluation and the export, here with --change eval_batch_rows (3: a last batch padded): the
    record's metrics equal an uninterrupted run's to fp32 rounding, its weights bit for bit."""
    import sparsekv_jax.sae.evaluate as sae_evaluate
    import sparsekv_jax.sae.run as sae_run

    params = random_params(TINY, jax.random.key(7), jnp.float32, scale=0.1)
    tok = CharTokenizer()
    whole_dir, whole = tiny_whole
    cfg = _tiny_run_config(tmp_path / "run")

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 97.13GiB (simulated)")

    monkeypatch.setattr(sae_evaluate, "evaluate", out_of_memory)
    with pytest.raises(RuntimeError, match=r"exported at \S*/run/tiny\.safetensors .*checkpoint 12 .*--resume") as e:
        run(cfg, progress=False, params=params, tokenizer=tok)
    assert "RESOURCE_EXHAUSTED" in str(e.value.__cause__)
    out = tmp_path / "run"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoints", "config.yaml", "curves.csv", "curves.png",
                                                     "tiny.json", "tiny.safetensors"]
    saes, record = load_saes(out / "tiny.safetensors")
    assert record == json.loads((out / "tiny.json").read_text())
    assert record["heldout"] is None and record["steps"] == 12 and record["layers"] == [2, 0]
    want = _weights(whole_dir / "tiny.safetensors")
    for key, value in _weights(out / "tiny.safetensors").items():
        np.testing.assert_array_equal(value, want[key], err_msg=str(key))
    monkeypatch.undo()

    curves = (out / "curves.csv").read_bytes()

    def no_step(*args, **kwargs):
        raise AssertionError("a finished run trained a step on --resume")

    monkeypatch.setattr(sae_run, "_buffered_step", no_step)
    resumed = run(dataclasses.replace(cfg, eval_batch_rows=3), resume=True, change=("eval_batch_rows",),
                  progress=False, params=params, tokenizer=tok)
    assert (out / "curves.csv").read_bytes() == curves
    assert json.loads((out / "tiny.json").read_text()) == resumed
    assert {k: v for k, v in resumed.items() if k not in ("heldout", "train_seconds")} == \
        {k: v for k, v in whole.items() if k not in ("heldout", "train_seconds")}
    for got, ref in zip(resumed["heldout"], whole["heldout"], strict=True):
        assert got.keys() == ref.keys() and got["layer"] == ref["layer"]
        for key in ref:
            np.testing.assert_allclose(got[key], ref[key], rtol=1e-5, err_msg=f"{key} of layer {ref['layer']}")
    for key, value in _weights(out / "tiny.safetensors").items():
        np.testing.assert_array_equal(value, want[key], err_msg=str(key))
