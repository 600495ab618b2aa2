"""SAE training speed: the model forward and the SAE step timed apart, and the step against its matmul floor.

For each model's *shapes* (random bf16 weights: speed does not depend on their values) and the S³
paper's SAE size scaled to its head dim (width = 128 x head_dim, k = head_dim, batch = 4,096 tokens
x KV heads vectors per layer, 4 target layers):

1. **forward** — `sparsekv_jax.sae.stream.chunk_vectors` (keys of the 4 target layers of a chunk
   of rows): tokens/s;
2. **SAE step** — `sparsekv_jax.sae.train.train_step` on a fixed batch, per variant: top-k
   ``lax`` (XLA's sort) vs ``blocked`` (`sparsekv_jax.sae.topk`), fp32 vs bf16 encoder inputs,
   and with half the latents dead (the AuxK branch runs); plus the shuffle-buffer draw;
3. **components** — encoder matmul + ReLU, the top-k alone (each method; on a GPU also the kernel
   without its no-tie fast path), the sparse decode (XLA's gather; on a GPU the Pallas gather
   kernel), and the decoder's forward + backward as XLA's gathered rows, the Pallas kernels and a
   dense ``z @ W_dec``; the step taken apart (the loss forward, its gradient, the whole step);
4. **matmul floor** — the five dense matmuls of a Top-K SAE step (encoder forward, encoder weight
   gradient; decoder forward, its weight gradient and its input gradient, as a dense decoder would
   run them: 10·L·N·D·W FLOPs), each timed alone at the step's shapes in the same run
   ("floor"), and the same FLOPs at the rate of an 8k x 8k matmul ("peak floor"). The SAE step's
   ratio to both is reported.

Training throughput = tokens/s of (forward + the steps that consume its vectors).

    python sae_training/bench.py --out $OUT             # GPU: smollm2 and llama3.1-8b shapes
    python sae_training/bench.py --smoke                # any machine, toy sizes, checks it runs
    python sae_training/bench.py --fused --models llama3.1-8b --iters 15 --out $OUT   # issue 37 item 4 (GPU)

``--fused`` runs only issue 37's comparison (`fused_comparison`): the step with the fused encoder + top-k
kernel (`sparsekv_jax.pallas.sae_encode`) against today's step (dense pre-activations + the threshold
top-k) and the fp32 matmul floor, interleaved round by round in one run, per step and chained, after
checks of the kernel's ids; writes ``sae_fused_bench.json``.

Prints a table last; writes ``sae_bench.json`` under ``--out`` (default ``$OUT`` or ``./out``).
Timings are medians of ``--iters`` calls after a warm-up, each ``block_until_ready``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a clone without installing

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from sparsekv_jax.bench.timing import median_time, timed_call  # noqa: E402
from sparsekv_jax.models import config as mc  # noqa: E402
from sparsekv_jax.models.params import random_params  # noqa: E402
from sparsekv_jax.pallas.topk import threshold_top_k  # noqa: E402
from sparsekv_jax.sae.config import TrainConfig  # noqa: E402
from sparsekv_jax.sae.model import decode, dense_latents, pre_activations, select  # noqa: E402
from sparsekv_jax.sae.stream import ShuffleBuffer, chunk_vectors, draw  # noqa: E402
from sparsekv_jax.sae.topk import top_k  # noqa: E402
from sparsekv_jax.sae.train import init_train_state, losses, train_step  # noqa: E402

MODELS = {
    # name: (config, target layers, SAE layers stacked in one step)
    "smollm2": (mc.smollm2_135m_config, (0, 11, 15, 27), 4),
    "llama3.1-8b": (mc.llama31_8b_config, (0, 12, 16, 29), 1),  # one layer per step: 4 would need ~60 GB
}


def peak_matmul_rate(dtype, n: int, iters: int) -> float:
    a = jnp.ones((n, n), dtype)
    t = median_time(jax.jit(lambda a: a @ a), a, iters=iters)
    return 2 * n**3 / t


def floor_matmuls(L: int, N: int, D: int, W: int, dtype, iters: int) -> dict[str, float]:
    """Seconds of each dense matmul of a Top-K SAE step at its shapes (outputs fp32, like the step)."""
    return {name: median_time(f, *args, iters=iters) for name, (f, args) in floor_calls(L, N, D, W, dtype).items()}


def floor_calls(L: int, N: int, D: int, W: int, dtype) -> dict[str, tuple]:
    """The five dense matmuls of a Top-K SAE step at its shapes: ``{name: (jitted fn, args)}``."""
    key = jax.random.key(0)
    x = jax.random.normal(key, (L, N, D), dtype)
    w_enc = jax.random.normal(key, (L, D, W), dtype)
    z = jax.random.normal(key, (L, N, W), dtype)
    w_dec = jax.random.normal(key, (L, W, D), dtype)
    e = jax.random.normal(key, (L, N, D), dtype)
    f32 = jnp.float32
    mm = {
        "enc_fwd": (lambda x, w: jnp.einsum("lnd,ldw->lnw", x, w, preferred_element_type=f32), (x, w_enc)),
        "enc_wgrad": (lambda x, g: jnp.einsum("lnd,lnw->ldw", x, g, preferred_element_type=f32), (x, z)),
        "dec_fwd": (lambda z, w: jnp.einsum("lnw,lwd->lnd", z, w, preferred_element_type=f32), (z, w_dec)),
        "dec_wgrad": (lambda z, e: jnp.einsum("lnw,lnd->lwd", z, e, preferred_element_type=f32), (z, e)),
        "dec_igrad": (lambda e, w: jnp.einsum("lnd,lwd->lnw", e, w, preferred_element_type=f32), (e, w_dec)),
    }
    return {name: (jax.jit(f), args) for name, (f, args) in mm.items()}


def bench_model(name: str, *, rows: int, seq_len: int, iters: int, smoke: bool) -> dict:
    make_cfg, layers, L = MODELS[name]
    cfg = make_cfg()
    D, H = cfg.head_dim, cfg.num_kv_heads
    width, k, batch_tokens = 128 * D, D, 4096
    if smoke:  # toy shapes with the same structure (blocked top-k still applies: width 2048)
        cfg = dataclasses.replace(cfg, vocab_size=512, hidden_size=64, num_layers=4, num_heads=4, num_kv_heads=2,
                                  head_dim=16, intermediate_size=128)
        layers, L, D, H = (0, 3), 2, 16, 2
        width, k, batch_tokens = 2048, 16, 256
    N = batch_tokens * H
    row = {"model": name, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "layers": list(layers),
           "sae_layers_per_step": L, "d_in": D, "width": width, "k": k, "batch_vectors": N,
           "batch_tokens": batch_tokens}

    # 1. forward: keys of the target layers for a chunk of rows
    params = random_params(cfg, jax.random.key(1), jnp.bfloat16)
    tokens = jax.random.randint(jax.random.key(2), (rows, seq_len), 0, cfg.vocab_size)
    t_fwd = median_time(lambda p, t: chunk_vectors(p, t, layers, 4), params, tokens, iters=iters)
    row["forward_tokens"] = rows * seq_len
    row["forward_s"] = t_fwd
    row["forward_tokens_per_s"] = rows * seq_len / t_fwd
    del params
    jax.clear_caches()

    # 2. the SAE step (stacked over L layers), variants
    x = jax.random.normal(jax.random.key(3), (L, N, D), jnp.float32) * 4 + 1
    # name: (top-k method, encoder input dtype, half the latents dead, decode method)
    variants = {"lax_fp32": ("lax", "float32", False, "auto"), "blocked_fp32": ("blocked", "float32", False, "auto"),
                "threshold_fp32_xla_decode": ("threshold", "float32", False, "xla"),
                "threshold_fp32": ("threshold", "float32", False, "auto"),
                "threshold_bf16": ("threshold", "bfloat16", False, "auto"),
                "threshold_fp32_auxk": ("threshold", "float32", True, "auto"),
                "fused_fp32": ("fused", "float32", False, "auto"),
                "fused_fp32_auxk": ("fused", "float32", True, "auto")}
    if jax.default_backend() != "gpu":  # the Pallas kernels run interpreted off the GPU: far too slow to time
        variants = {n: v for n, v in variants.items() if v[0] not in ("threshold", "fused")}
        variants["blocked_fp32_auxk"] = ("blocked", "float32", True, "auto")
    steps = {}
    for vname, (method, cdt, dead, dec) in variants.items():
        tcfg = TrainConfig(width=width, k=k, batch_size=N, topk=method, compute_dtype=cdt, decode=dec)
        state = init_train_state(jax.random.key(4), x, tcfg, 1000)
        if dead:  # half the latents dead: AuxK's second top-k and decode run
            since = jnp.where(jnp.arange(width) % 2 == 0, tcfg.dead_after_steps, 0).astype(jnp.int32)
            state = state.replace(steps_since_fired=jnp.broadcast_to(since, (L, width)))
        step = jax.jit(lambda s, x, tcfg=tcfg: train_step(s, x, tcfg))
        try:
            steps[vname] = median_time(step, state, x, iters=iters)
        except Exception as e:  # e.g. out of memory: report, keep going
            steps[vname] = None
            row[f"error_{vname}"] = f"{type(e).__name__}: {str(e)[:200]}"
        del state
    row["sae_step_s"] = steps
    # check: 5 steps from one state with the default decode and with XLA's (dense encoder gradient)
    # give the same losses (the gradients are equal up to summation order; the top-k may flip a tie)
    fvus = {}
    for dec in ("auto", "xla"):
        tcfg = TrainConfig(width=width, k=k, batch_size=N, decode=dec)
        state = init_train_state(jax.random.key(4), x, tcfg, 1000)
        step = jax.jit(lambda s, x, tcfg=tcfg: train_step(s, x, tcfg))
        curve = []
        for i in range(5):
            state, metrics = step(state, x + 0.01 * i)
            curve.append(float(metrics["fvu"].mean()))
        fvus[dec] = curve
        del state
    row["check_fvu_curves"] = fvus
    row["check_fvu_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(fvus["auto"], fvus["xla"], strict=True))
    buf = ShuffleBuffer(data=jnp.zeros((L, 8 * N, D)), chunk=jnp.zeros((L, 2 * N, D)), key=jax.random.PRNGKey(0))
    row["buffer_draw_s"] = median_time(jax.jit(lambda b, c: draw(b, c, N)), buf, jnp.int32(0), iters=iters)
    del buf

    # 3. components
    tcfg = TrainConfig(width=width, k=k, batch_size=N)
    sae = init_train_state(jax.random.key(4), x, tcfg, 1).sae
    pre = jax.jit(pre_activations)(sae, x)
    r = jax.nn.relu(pre)
    comp = {"encoder_relu": median_time(jax.jit(lambda s, x: jax.nn.relu(pre_activations(s, x))), sae, x,
                                        iters=iters)}
    on_gpu = jax.default_backend() == "gpu"
    for method in ("lax", "blocked", "threshold") if on_gpu else ("lax", "blocked"):
        comp[f"topk_{method}"] = median_time(jax.jit(lambda r, m=method: top_k(r, k, m)), r, iters=iters)
    if on_gpu:  # the kernel's selection without its no-tie fast path (same results)
        comp["topk_threshold_tie_scan"] = median_time(
            jax.jit(lambda r: threshold_top_k(r, k, fast_select=False)), r, iters=iters)
    ids, acts = jax.jit(lambda p: select(p, k, "lax"))(pre)
    comp["decode_sparse"] = median_time(jax.jit(lambda s, i, a: decode(s, i, a, "xla")), sae, ids, acts, iters=iters)
    # the decoder's forward + backward (grads of W_dec and the activations): gathered rows (XLA),
    # the Pallas gather kernel (its W_dec gradient by atomics or by XLA's scatter), a dense z
    target = x + 0.1

    def sparse_loss(w_dec, acts):
        return jnp.sum(jnp.square(decode(sae.replace(w_dec=w_dec), ids, acts, "xla") - target))

    def dense_loss(w_dec, acts):
        z = dense_latents(ids, acts, width)
        return jnp.sum(jnp.square(jnp.einsum("lnw,lwd->lnd", z, w_dec) + sae.b_dec[:, None] - target))

    def pallas_loss(w_dec, acts):
        return jnp.sum(jnp.square(decode(sae.replace(w_dec=w_dec), ids, acts, "pallas") - target))

    losses_fb = {"sparse": sparse_loss, "dense": dense_loss}
    if on_gpu:
        comp["decode_pallas"] = median_time(jax.jit(lambda s, i, a: decode(s, i, a, "pallas")), sae, ids, acts,
                                            iters=iters)
        losses_fb["pallas"] = pallas_loss
    for tag, f in losses_fb.items():
        comp[f"decode_fwd_bwd_{tag}"] = median_time(jax.jit(jax.grad(f, argnums=(0, 1))), sae.w_dec, acts,
                                                    iters=iters)
    # the step taken apart (the default top-k; nothing dead): the loss forward, its gradient, and the
    # whole step with the optimizer, so the optimizer's and the backward's shares can be read off
    dead0 = jnp.zeros((L, width), bool)
    state0 = init_train_state(jax.random.key(4), x, tcfg, 1000)
    comp["loss_forward"] = median_time(jax.jit(lambda s, x: losses(s, x, dead0, tcfg)[0]), sae, x, iters=iters)
    comp["loss_value_and_grad"] = median_time(
        jax.jit(lambda s, x: jax.value_and_grad(losses, has_aux=True)(s, x, dead0, tcfg)), sae, x, iters=iters)
    comp["loss_value_and_grad_dead_traced"] = median_time(  # `dead` as the step sees it: a traced array
        jax.jit(lambda s, x, d: jax.value_and_grad(losses, has_aux=True)(s, x, d, tcfg)), sae, x, dead0, iters=iters)
    comp["train_step"] = median_time(jax.jit(lambda s, x: train_step(s, x, tcfg)), state0, x, iters=iters)
    no_aux = dataclasses.replace(tcfg, aux_coef=0.0)
    comp["train_step_without_auxk"] = median_time(jax.jit(lambda s, x: train_step(s, x, no_aux)), state0, x,
                                                  iters=iters)
    # as training runs it (`sae.run`): the state donated, steps dispatched back to back, one wait
    chained = jax.jit(lambda s, x: train_step(s, x, tcfg)[0], donate_argnums=0)
    state0 = jax.block_until_ready(chained(state0, x))
    runs = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(iters):
            state0 = chained(state0, x)
        jax.block_until_ready(state0)
        runs.append((time.perf_counter() - t0) / iters)
    comp["train_step_chained_donated"] = statistics.median(runs)
    del state0
    row["components_s"] = comp
    del pre, r

    # 4. the matmul floor, in the same run
    flops = 10 * L * N * D * width
    for dtype in (jnp.float32, jnp.bfloat16):
        tag = jnp.dtype(dtype).name
        mms = floor_matmuls(L, N, D, width, dtype, iters)
        peak = peak_matmul_rate(dtype, 512 if smoke else 8192, iters)
        row[f"floor_{tag}"] = {"matmuls_s": mms, "floor_s": sum(mms.values()),
                               "floor_tflops": flops / sum(mms.values()) / 1e12,
                               "peak_tflops": peak / 1e12, "peak_floor_s": flops / peak}
    row["step_flops_dense_equiv"] = flops

    best = min((v, n) for n, v in steps.items() if v is not None and "auxk" not in n)
    t_step, best_name = best
    floor_tag = "bfloat16" if best_name.endswith("bf16") else "float32"
    row["best_step"] = best_name
    row["step_over_floor"] = t_step / row[f"floor_{floor_tag}"]["floor_s"]
    row["step_over_peak_floor"] = t_step / row[f"floor_{floor_tag}"]["peak_floor_s"]
    # the default (on a GPU the fused encoder + top-k, fp32, the decode `auto` picks) against the fp32 floor,
    # per step and chained (the chained step is `TrainConfig`'s default: `topk="auto"`)
    floor32 = row["floor_float32"]["floor_s"]
    default = next((n for n in ("fused_fp32", "threshold_fp32") if steps.get(n)), best_name)
    row["default_step"] = default
    row["default_over_fp32_floor"] = steps[default] / floor32
    row["chained_over_fp32_floor"] = comp["train_step_chained_donated"] / floor32
    # tokens/s of training 4 target layers: each token gives H vectors per layer
    sae_s_per_token = t_step * (4 / L) / batch_tokens
    row["sae_step_tokens_per_s"] = 1 / sae_s_per_token
    row["train_tokens_per_s"] = 1 / (sae_s_per_token + t_fwd / (rows * seq_len))
    print(json.dumps(row), flush=True)
    return row


def interleaved(calls: dict[str, tuple], rounds: int) -> tuple[dict[str, float], dict[str, list[float]]]:
    """Median seconds of each ``fn(*args)`` of ``calls`` over ``rounds`` rounds; each round calls every one
    once, in turn (so drifts of the clock or the card hit all alike). One warm-up call each first."""
    for f, args in calls.values():
        timed_call(f, *args)
    times = {n: [] for n in calls}
    for _ in range(rounds):
        for n, (f, args) in calls.items():
            times[n].append(timed_call(f, *args)[1])
    return {n: statistics.median(t) for n, t in times.items()}, times


def _chain(step, state, x, n: int):
    """A call that runs ``n`` donated steps from the last state (as `sae.run` trains): for `interleaved`."""
    box = {"state": state}

    def run():
        s = box["state"]
        for _ in range(n):
            s = step(s, x)
        box["state"] = s
        return s

    return run


def fused_comparison(name: str, *, rounds: int, chain: int, smoke: bool) -> dict:
    """Issue 37 item 4: the SAE step with the fused encoder + top-k kernel (`topk="fused"`) against today's
    (dense pre-activations + the threshold top-k kernel) and the step's fp32 matmul floor, interleaved in
    one run; per step and chained (``chain`` donated steps per timed call). Plus checks (ids against
    the unfused selection, the kernel's candidate counts, 5-step FVU curves both ways), the selection
    alone both ways, and a small tiling sweep of the kernel."""
    from sparsekv_jax.pallas.sae_encode import (  # noqa: PLC0415
        fused_encoder_candidates,
        fused_encoder_plan,
        fused_encoder_top_k,
        fused_encoder_top_k_reference,
    )
    from sparsekv_jax.sae.model import _encoder_terms, select_ids, selected_activations  # noqa: PLC0415

    make_cfg, _, L = MODELS[name]
    mcfg = make_cfg()
    D, H = mcfg.head_dim, mcfg.num_kv_heads
    width, k, batch_tokens = 128 * D, D, 4096
    if smoke:
        L, D, H, width, k, batch_tokens = 2, 16, 2, 2048, 16, 256
    N = batch_tokens * H
    on_gpu = jax.default_backend() == "gpu"
    today = "threshold" if on_gpu else "lax"  # off a GPU the kernels run interpreted: toy shapes only
    row = {"model": name, "device": jax.devices()[0].device_kind, "jax": jax.__version__, "sae_layers_per_step": L,
           "d_in": D, "width": width, "k": k, "batch_vectors": N, "rounds": rounds, "chain": chain,
           "today_topk": today, "fused_plan": dict(zip(("block_w", "capacity"), fused_encoder_plan(width, k),
                                                       strict=True))}
    x = jax.random.normal(jax.random.key(3), (L, N, D), jnp.float32) * 4 + 1
    cfgs = {"fused": TrainConfig(width=width, k=k, batch_size=N, topk="fused"),
            "today": TrainConfig(width=width, k=k, batch_size=N, topk=today)}
    state0 = init_train_state(jax.random.key(4), x, cfgs["today"], 1000)
    sae = state0.sae

    _, _, xc, w, bias = _encoder_terms(sae, x)

    def sweep(reference_ids) -> dict:
        """The kernel's tilings (block_rows, num_warps, num_stages, block_w) that compile here, each checked
        against ``reference_ids`` (None: not checked); errors go to ``row``. The defaults: (64, 8, 2, None)."""
        out = {}
        for bm, warps, stages, bw in ((32, 4, 2, None), (64, 4, 2, None), (64, 8, 1, None), (64, 8, 3, None),
                                      (128, 8, 2, None), (128, 8, 1, None), (128, 16, 1, None), (64, 8, 1, 256),
                                      (32, 8, 1, 256)):
            tag = f"fused_rows{bm}_warps{warps}_stages{stages}_w{bw or 'default'}"
            f = jax.jit(lambda a, b, c, bm=bm, warps=warps, stages=stages, bw=bw: fused_encoder_top_k(
                a, b, c, k, block_rows=bm, num_warps=warps, num_stages=stages, block_w=bw))
            try:
                _, i_cfg = jax.block_until_ready(f(xc, w, bias))
                if reference_ids is not None:
                    row[f"ids_equal_default_{tag}"] = float(jnp.mean(jnp.all(i_cfg == reference_ids, axis=-1)))
                out[tag] = (f, (xc, w, bias))
            except Exception as e:  # a tiling Triton cannot compile: report, keep going
                row[f"error_{tag}"] = f"{type(e).__name__}: {str(e)[:300]}"
        return out

    # checks first (a wrong kernel should not be timed): ids against the unfused selection on this batch
    try:
        ids_f = jax.block_until_ready(jax.jit(lambda s, x: select_ids(s, x, k, "fused"))(sae, x))
    except Exception as e:  # the default tiling does not compile here: say which do, then stop
        row["error_default_tiling"] = f"{type(e).__name__}: {str(e)[:1000]}"
        if on_gpu:
            row["tilings_that_compile"] = sorted(sweep(None))
        print(json.dumps(row), flush=True)
        raise
    ids_t = jax.jit(lambda s, x: select_ids(s, x, k, today))(sae, x)
    ids_t = jnp.sort(ids_t, axis=-1)  # "lax" gives them by value
    act = jax.jit(lambda s, x, i: selected_activations(s, x, i))
    mass_f, mass_t = act(sae, x, ids_f).sum(-1), act(sae, x, ids_t).sum(-1)
    check = {"rows_with_equal_ids": float(jnp.mean(jnp.all(ids_f == ids_t, axis=-1))),
             "max_rel_selected_mass_deficit": float(jnp.max((mass_t - mass_f) / jnp.maximum(mass_t, 1e-30))),
             "distinct_ids_every_row": bool(jnp.all(jnp.diff(ids_f, axis=-1) > 0))}
    # at full fp32 the kernel must equal the jnp reference (ids), up to genuine near-ties
    hi = jax.lax.Precision.HIGHEST
    _, i_hi = jax.jit(lambda a, b, c: fused_encoder_top_k(a, b, c, k, precision=hi, interpret=not on_gpu))(xc, w, bias)
    _, i_ref = jax.jit(lambda a, b, c: fused_encoder_top_k_reference(a, b, c, k))(xc, w, bias)
    check["highest_precision_rows_equal_reference"] = float(jnp.mean(jnp.all(i_hi == i_ref, axis=-1)))
    dead = jnp.arange(width) % 2 == 0  # AuxK's masked form, half the latents dead
    for tag, keep, kk in (("main", None, k), ("auxk_half_dead", jnp.broadcast_to(dead, (L, width)), D // 2)):
        count = jax.jit(lambda a, b, c, m, kk=kk: fused_encoder_candidates(a, b, c, m, k=kk, interpret=not on_gpu)[2])(
            xc, w, bias, keep)
        check[f"candidates_{tag}"] = {"k": kk, "capacity": fused_encoder_plan(width, kk)[1],
                                      "mean": float(count.mean()), "max": int(count.max()),
                                      "overflow_rows": int(jnp.sum(count > fused_encoder_plan(width, kk)[1]))}
    fvus = {}
    for tag, tcfg in cfgs.items():
        st = init_train_state(jax.random.key(4), x, tcfg, 1000)
        step = jax.jit(lambda s, x, tcfg=tcfg: train_step(s, x, tcfg))
        curve = []
        for i in range(5):
            st, metrics = step(st, x + 0.01 * i)
            curve.append(float(metrics["fvu"].mean()))
        fvus[tag] = curve
        del st
    check["fvu_curves"] = fvus
    check["fvu_max_rel_diff"] = max(abs(a - b) / abs(b) for a, b in zip(fvus["fused"], fvus["today"], strict=True))
    row["check"] = check
    print(json.dumps({"model": name, "check": check}), flush=True)

    # the step both ways, chained both ways and the five fp32 matmuls, interleaved
    calls = {}
    for tag, tcfg in cfgs.items():
        st = init_train_state(jax.random.key(4), x, tcfg, 1000)
        calls[f"step_{tag}"] = (jax.jit(lambda s, x, tcfg=tcfg: train_step(s, x, tcfg)), (st, x))
        donated = jax.jit(lambda s, x, tcfg=tcfg: train_step(s, x, tcfg)[0], donate_argnums=0)
        st2 = init_train_state(jax.random.key(4), x, tcfg, 1000)
        calls[f"chained_{tag}"] = (_chain(donated, st2, x, chain), ())
    floor = floor_calls(L, N, D, width, jnp.float32)
    calls.update({f"floor_{n}": c for n, c in floor.items()})
    med, raw = interleaved(calls, rounds)
    for tag in cfgs:
        med[f"chained_{tag}"] /= chain
    floor_s = sum(med[f"floor_{n}"] for n in floor)
    row["median_s"] = med
    row["raw_s"] = raw
    row["floor_fp32_s"] = floor_s
    for tag in cfgs:
        row[f"{tag}_over_floor"] = med[f"step_{tag}"] / floor_s
        row[f"{tag}_chained_over_floor"] = med[f"chained_{tag}"] / floor_s
    del calls, floor
    jax.clear_caches()

    # the selection alone, both ways, and the kernel's tiling (block_rows, num_warps, num_stages), interleaved
    sel = {"select_fused": (jax.jit(lambda s, x: select_ids(s, x, k, "fused")), (sae, x)),
           "select_today": (jax.jit(lambda s, x: select_ids(s, x, k, today)), (sae, x))}
    if on_gpu:
        sel.update(sweep(ids_f))
    row["selection_median_s"], _ = interleaved(sel, rounds)
    print(json.dumps({k_: v for k_, v in row.items() if k_ != "raw_s"}), flush=True)
    return row


def fused_table(rows: list[dict]) -> str:
    lines = ["| model | SAE (L x N x D -> W, k) | step ms: fused / today | chained ms: fused / today | fp32 floor ms | "
             "**fused / floor** (chained) | today / floor (chained) | selection ms: fused / today | ids equal |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["median_s"]
        lines.append(
            f"| {r['model']} | {r['sae_layers_per_step']} x {r['batch_vectors']} x {r['d_in']} -> {r['width']}, "
            f"{r['k']} | {m['step_fused'] * 1e3:.2f} / {m['step_today'] * 1e3:.2f} | "
            f"{m['chained_fused'] * 1e3:.2f} / {m['chained_today'] * 1e3:.2f} | {r['floor_fp32_s'] * 1e3:.2f} | "
            f"**{r['fused_over_floor']:.2f}** ({r['fused_chained_over_floor']:.2f}) | {r['today_over_floor']:.2f} "
            f"({r['today_chained_over_floor']:.2f}) | {r['selection_median_s']['select_fused'] * 1e3:.2f} / "
            f"{r['selection_median_s']['select_today'] * 1e3:.2f} | {r['check']['rows_with_equal_ids']:.4f} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = ["| model | SAE (L x N x D -> W, k) | forward tok/s | SAE step ms (variants) | "
             "SAE tok/s | train tok/s | floor ms fp32 / bf16 | step / floor | step / peak floor | "
             "default / fp32 floor (chained) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        steps = ", ".join(f"{n} {'fail' if v is None else f'{v * 1e3:.2f}'}" for n, v in r["sae_step_s"].items())
        lines.append(
            f"| {r['model']} | {r['sae_layers_per_step']} x {r['batch_vectors']} x {r['d_in']} -> {r['width']}, "
            f"{r['k']} | {r['forward_tokens_per_s']:,.0f} | {steps} | {r['sae_step_tokens_per_s']:,.0f} | "
            f"{r['train_tokens_per_s']:,.0f} | {r['floor_float32']['floor_s'] * 1e3:.2f} / "
            f"{r['floor_bfloat16']['floor_s'] * 1e3:.2f} | {r['step_over_floor']:.2f} ({r['best_step']}) | "
            f"{r['step_over_peak_floor']:.2f} | {r['default_over_fp32_floor']:.2f} "
            f"({r['chained_over_fp32_floor']:.2f}) |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2,llama3.1-8b", help="comma-separated: smollm2, llama3.1-8b")
    p.add_argument("--rows", type=int, default=None, help="rows per forward chunk (default 16 smollm2, 4 llama)")
    p.add_argument("--seq-len", type=int, default=1028)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--smoke", action="store_true", help="toy shapes: checks the script end to end on any machine")
    p.add_argument("--out", default=os.environ.get("OUT", "out"))
    p.add_argument("--fused", action="store_true",
                   help="only issue 37's comparison: the step with the fused encoder + top-k against today's and "
                        "the fp32 matmul floor, interleaved (median of max(--iters, 9) rounds); writes "
                        "sae_fused_bench.json")
    p.add_argument("--chain", type=int, default=5, help="--fused: donated steps per chained timing call")
    args = p.parse_args(argv)
    if args.fused:
        rows = []
        for name in [m.strip() for m in args.models.split(",") if m.strip()]:
            if name not in MODELS:
                p.error(f"unknown model {name!r}; expected {sorted(MODELS)}")
            rows.append(fused_comparison(name, rounds=2 if args.smoke else max(args.iters, 9),
                                         chain=1 if args.smoke else args.chain, smoke=args.smoke))
            jax.clear_caches()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "sae_fused_bench.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(fused_table(rows))
        return 0
    rows = []
    for name in [m.strip() for m in args.models.split(",") if m.strip()]:
        if name not in MODELS:
            p.error(f"unknown model {name!r}; expected {sorted(MODELS)}")
        n_rows = args.rows or (16 if name == "smollm2" else 4)
        seq = 68 if args.smoke else args.seq_len
        rows.append(bench_model(name, rows=2 if args.smoke else n_rows, seq_len=seq, iters=2 if args.smoke else
                                args.iters, smoke=args.smoke))
        jax.clear_caches()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sae_bench.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
