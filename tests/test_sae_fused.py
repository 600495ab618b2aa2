"""The fused SAE encoder + ReLU + top-k kernel (`sparsekv_jax.pallas.sae_encode`, interpret mode on CPU) against
numpy and jnp references: values, ids, ties (to the lower id), short rows, the overflow fallback, the masked
(AuxK) form, the gradients of `encode` and a whole training step. The kernel's outputs start as +inf / -1
(``poison=True``), so a slot it forgot to write and the wrapper read shows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from sparsekv_jax.backend import Backend
from sparsekv_jax.pallas import dispatch, sae_encode
from sparsekv_jax.pallas.sae_encode import (
    fused_encoder_applies,
    fused_encoder_candidates,
    fused_encoder_plan,
    fused_encoder_top_k,
    fused_encoder_top_k_reference,
)
from sparsekv_jax.sae.config import TrainConfig
from sparsekv_jax.sae.model import TopKSAE, encode, resolve_select, select_ids
from sparsekv_jax.sae.train import init_train_state, train_step

S, D, W, K = 2, 32, 256, 8


def _numpy_top_k(x, w, b, k, keep=None):
    """k largest of ReLU(x·w + b)·keep per row in float64, ties to the lower id; ids ascending. Also each
    row's gap between its k-th and (k+1)-th value (where rounding could swap ids)."""
    pre = np.einsum("snd,sdw->snw", np.asarray(x, np.float64), np.asarray(w, np.float64)) + \
        np.asarray(b, np.float64)[:, None]
    r = np.maximum(pre, 0)
    if keep is not None:
        r = np.where(np.asarray(keep)[:, None] != 0, r, 0)
    order = np.argsort(-r, axis=-1, kind="stable")
    top = np.take_along_axis(r, order, -1)
    gap = top[..., k - 1] - top[..., k]
    ids = np.sort(order[..., :k], -1)
    return np.take_along_axis(r, ids, -1), ids.astype(np.int32), gap


def _check(got, want, gap, tol):
    """ids equal wherever the k-th value is clear of the (k+1)-th by more than rounding; values close."""
    (v, i), (wv, wi) = got, want
    clear = gap > tol
    assert clear.mean() > 0.9, f"only {clear.mean():.2f} of the rows have a clear k-th value: the test says little"
    np.testing.assert_array_equal(np.asarray(i)[clear], wi[clear])
    np.testing.assert_allclose(np.asarray(v)[clear], wv[clear], rtol=1e-5, atol=1e-5)


@pytest.mark.share(2)
@pytest.mark.parametrize("N,block_w,masked", [(16, 32, False), (20, 32, True), (16, None, False)])
def test_fused_encoder_equals_references(rng, N, block_w, masked):
    x = jnp.asarray(rng.normal(size=(S, N, D)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(S, D, W)), jnp.float32)
    b = jnp.asarray(rng.normal(size=(S, W)), jnp.float32)
    keep = jnp.asarray(rng.random((S, W)) < 0.3) if masked else None
    want_v, want_i, gap = _numpy_top_k(x, w, b, K, keep)
    got = fused_encoder_top_k(x, w, b, K, keep=keep, block_w=block_w, block_rows=16, poison=True, interpret=True)
    _check(got, (want_v, want_i), gap, 1e-4)
    _check(fused_encoder_top_k_reference(x, w, b, K, keep=keep), (want_v, want_i), gap, 1e-4)
    # the answer came from the candidates, not the fallback: every row has k to capacity candidates
    count = np.asarray(fused_encoder_candidates(x, w, b, keep, k=K, block_w=block_w, block_rows=16, poison=True,
                                                interpret=True)[2])
    assert count.shape == (S, N) and (count >= K).all() and (count <= fused_encoder_plan(W, K, block_w)[1]).all()


def _integer_inputs(rng, N):
    """Small integers: every dot is exact in fp32, so ties are real ties. Rows 0-1 have x = 0 (pre = b: three
    positive latents, then zeros); row 2's x is -50 on a row of w that is all ones (every latent below 0)."""
    x = rng.integers(-3, 4, size=(S, N, D)).astype(np.float32)  # about a third of the rows tie at the k-th place
    w = rng.integers(-2, 3, size=(S, D, W)).astype(np.float32)
    b = rng.integers(-4, 1, size=(S, W)).astype(np.float32)
    b[:, [5, 100, 200]] = 1.0
    x[:, :2] = 0
    w[:, 0] = 1.0  # x[:, 2] = -50 · e_0 makes every pre-activation of row 2 at most -50 + 1
    x[:, 2] = 0
    x[:, 2, 0] = -50
    return jnp.asarray(x), jnp.asarray(w), jnp.asarray(b)


@pytest.mark.parametrize("block_w,masked", [(16, False), (32, True)])
def test_fused_encoder_ties_and_short_rows_are_exact(rng, block_w, masked):
    x, w, b = _integer_inputs(rng, 16)
    keep = jnp.asarray(rng.random((S, W)) < 0.5).at[:, :8].set(True) if masked else None
    want_v, want_i, gap = _numpy_top_k(x, w, b, K, keep)
    assert (gap == 0).mean() > 0.1, "too few ties at the k-th place: the test says little"
    count = np.asarray(fused_encoder_candidates(x, w, b, keep, k=K, block_w=block_w, block_rows=16, poison=True,
                                                interpret=True)[2])
    # (at most 13 of 16 over 1,600 rows of such draws: the kernel's ties are tested, not the fallback's)
    assert (count <= fused_encoder_plan(W, K, block_w)[1]).all(), "a row overflowed: this tests the fallback"
    v, i = fused_encoder_top_k(x, w, b, K, keep=keep, block_w=block_w, block_rows=16, poison=True, interpret=True)
    np.testing.assert_array_equal(np.asarray(i), want_i)
    np.testing.assert_array_equal(np.asarray(v), want_v)
    if not masked:  # rows of three positives: those three, then the lowest-id zeros
        np.testing.assert_array_equal(np.asarray(i)[:, 0], np.broadcast_to([0, 1, 2, 3, 4, 5, 100, 200], (S, K)))
        np.testing.assert_array_equal(np.asarray(i)[:, 2], np.broadcast_to(np.arange(K), (S, K)))
        assert (np.asarray(v)[:, 2] == 0).all()
    assert (np.diff(np.asarray(i), axis=-1) > 0).all()  # k distinct ids, ascending


def test_fused_encoder_overflow_falls_back_to_the_exact_result(rng):
    """Large values crowded in three classes of the tile (columns c ≡ 0, 1, 2 mod 16): the bound of the first
    pass is low, more than `capacity` entries pass it, and the batch is recomputed unfused."""
    x, w, b = _integer_inputs(rng, 16)
    b = np.array(b)
    crowded = np.arange(W) % 16 < 3
    b[:, crowded] = 100 + rng.permutation(int(crowded.sum()))  # distinct, above every other pre-activation
    b = jnp.asarray(b)
    count = np.asarray(fused_encoder_candidates(x, w, b, None, k=K, block_w=16, block_rows=16, poison=True,
                                                interpret=True)[2])
    assert (count > fused_encoder_plan(W, K, 16)[1]).any(), "no row overflowed: the fallback did not run"
    want_v, want_i, _ = _numpy_top_k(x, w, b, K)
    v, i = fused_encoder_top_k(x, w, b, K, block_w=16, block_rows=16, poison=True, interpret=True)
    np.testing.assert_array_equal(np.asarray(i), want_i)
    np.testing.assert_array_equal(np.asarray(v), want_v)


def _sae(rng, stack=(S,)):
    return TopKSAE(w_enc=jnp.asarray(rng.normal(size=(*stack, D, W)), jnp.float32),
                   b_enc=jnp.asarray(rng.normal(size=(*stack, W)) * 0.5, jnp.float32),
                   w_dec=jnp.asarray(rng.normal(size=(*stack, W, D)), jnp.float32),
                   b_dec=jnp.asarray(rng.normal(size=(*stack, D)), jnp.float32), k=K).validate()


def test_fused_encode_and_its_gradients_equal_the_dense_path(rng):
    """``encode(method="fused")`` (ids from the kernel, activations recomputed at them) against the dense path
    (``lax``: pre-activations, top-k, activations gathered from them): ids, activations and the gradients
    to W_enc, b_enc, b_dec and x; the gradient reaches only the selected latents' columns of W_enc."""
    sae = _sae(rng)
    x = jnp.asarray(rng.normal(size=(S, 2, 8, D)), jnp.float32)  # stack + two batch axes
    coef = jnp.asarray(rng.normal(size=(S, 2, 8, K)), jnp.float32)

    def loss(sae, x, method):
        ids, acts = encode(sae, x, method=method)
        return jnp.sum(coef * acts), ids

    (lf, idf), gf = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(sae, x, "fused")
    (ld, idd), gd = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(sae, x, "lax")
    np.testing.assert_array_equal(np.asarray(idf), np.asarray(idd))
    acts_f, acts_d = (np.asarray(encode(sae, x, method=m)[1]) for m in ("fused", "lax"))
    np.testing.assert_allclose(acts_f, acts_d, rtol=1e-5, atol=1e-5 * np.abs(acts_d).max())
    # the loss sums S·16·K terms of both signs (|sum| far below the sum of |terms|): fp32 reordering error is
    # relative to the terms' magnitude, not to the cancelled sum's (a draw failed rtol 1e-5 on the sum at 1.2e-5)
    terms = np.abs(np.asarray(coef) * acts_d).sum()
    np.testing.assert_allclose(float(lf), float(ld), rtol=0, atol=1e-6 * terms)
    for name in ("w_enc", "b_enc", "b_dec"):
        np.testing.assert_allclose(np.asarray(getattr(gf[0], name)), np.asarray(getattr(gd[0], name)), rtol=1e-4,
                                   atol=1e-4, err_msg=name)
    np.testing.assert_allclose(np.asarray(gf[1]), np.asarray(gd[1]), rtol=1e-4, atol=1e-4, err_msg="x")
    chosen = np.zeros((S, W), bool)
    for s in range(S):
        chosen[s, np.unique(np.asarray(idf)[s])] = True
    g = np.abs(np.asarray(gf[0].w_enc)).sum(1)  # [S, W]
    assert (g[~chosen] == 0).all() and (g[chosen] > 0).mean() > 0.9
    assert np.abs(np.asarray(gf[1])).sum() > 0


@pytest.mark.parametrize("dead_every", [0, 3])
def test_train_step_with_the_fused_selection_equals_the_dense_one(rng, dead_every):
    """One step with ``topk="fused"`` against ``topk="lax"`` (XLA's decode: the dense encoder gradient), with no
    latent dead and with a third of them dead (AuxK's top-k over the dead latents runs fused with a mask)."""
    x = jnp.asarray(rng.normal(size=(S, 64, D)) * 2 + 0.5, jnp.float32)
    out = {}
    for topk in ("fused", "lax"):
        cfg = TrainConfig(width=W, k=K, batch_size=64, topk=topk, decode="xla")
        state = init_train_state(jax.random.key(7), x, cfg, 10)
        if dead_every:
            since = jnp.where(jnp.arange(W) % dead_every == 0, cfg.dead_after_steps, 0).astype(jnp.int32)
            state = state.replace(steps_since_fired=jnp.broadcast_to(since, (S, W)))
        out[topk] = jax.jit(lambda s, x, cfg=cfg: train_step(s, x, cfg))(state, x)
    (sf, mf), (sd, md) = out["fused"], out["lax"]
    assert (float(md["auxk"].min()) > 0) == bool(dead_every)
    for name in ("fvu", "auxk", "l0", "dead_fraction"):
        np.testing.assert_allclose(np.asarray(mf[name]), np.asarray(md[name]), rtol=1e-5, atol=1e-7, err_msg=name)
    for name in ("w_enc", "b_enc", "w_dec", "b_dec"):
        np.testing.assert_allclose(np.asarray(getattr(sf.sae, name)), np.asarray(getattr(sd.sae, name)), rtol=1e-4,
                                   atol=1e-5, err_msg=name)
    np.testing.assert_array_equal(np.asarray(sf.steps_since_fired), np.asarray(sd.steps_since_fired))


def test_auto_takes_the_fused_kernel_on_a_gpu_where_it_applies(monkeypatch):
    gpu, cpu = Backend(platform="gpu"), Backend(platform="cpu")
    # not before the kernel has compiled and matched on a GPU: auto keeps the threshold kernel
    assert resolve_select("auto", 128, 16384, 128, backend=gpu) == "threshold"
    assert resolve_select("fused", 128, 16384, 128, backend=gpu) == "fused"  # on request
    monkeypatch.setattr(sae_encode, "AUTO_ON_GPU", True)  # once verified there
    assert resolve_select("auto", 128, 16384, 128, backend=gpu) == "fused"  # the paper's width
    assert resolve_select("auto", 64, 8192, 64, backend=gpu) == "fused"  # SmolLM2's
    assert resolve_select("auto", 128, 16384, 128, jnp.bfloat16, backend=gpu) == "threshold"  # fp32 only
    assert resolve_select("auto", 256, 32768, 256, backend=gpu) == "threshold"  # W tile too large (Gemma 3)
    assert resolve_select("auto", 128, 16384, 128, backend=cpu) == "lax"
    assert dispatch.fused_encoder_method(gpu, 128, 16384, 128) and not dispatch.fused_encoder_method(cpu, 128, 16384,
                                                                                                     128)


def test_fused_rejects_what_it_cannot_run(rng):
    assert not fused_encoder_applies(24, 256, 8)  # d_in not a power of two
    assert not fused_encoder_applies(32, 128, 8)  # one tile of 128: the bound needs >= 2
    assert not fused_encoder_applies(32, 256, 8, block_w=48)
    with pytest.raises(ValueError, match="d_in=24"):
        resolve_select("fused", 24, 256, 8)
    with pytest.raises(ValueError, match="compute_dtype"):
        resolve_select("fused", 32, 256, 8, jnp.bfloat16)
    x, w, b = jnp.zeros((S, 16, D)), jnp.zeros((S, D, W)), jnp.zeros((S, W))
    with pytest.raises(ValueError, match="bias"):
        fused_encoder_top_k(x, w, b[:1], K, interpret=True)
    with pytest.raises(ValueError, match="keep"):
        fused_encoder_top_k(x, w, b, K, keep=jnp.ones((S, W + 1)), interpret=True)
    with pytest.raises(ValueError, match="keep"):
        select_ids(_sae(rng), x, K, "fused", keep=jnp.ones((W,), bool))


@pytest.mark.parametrize("masked", [False, True])
def test_fused_encoder_lowers_to_triton_at_the_papers_shape(masked):
    """The GPU's code path, compiled no further than Triton IR (no GPU here): Pallas lowers the kernel at the
    paper's width (32,768 x 128 -> 16,384, k 128) for CUDA, with and without AuxK's mask. An operation Triton
    cannot take fails here, on a CPU; Triton's own compilation (registers, shared memory) is left to the GPU."""
    from jax import export

    s, n, d, w, k = 1, 32768, 128, 16384, 128
    args = [jax.ShapeDtypeStruct((s, n, d), jnp.float32), jax.ShapeDtypeStruct((s, d, w), jnp.float32),
            jax.ShapeDtypeStruct((s, w), jnp.float32)] + ([jax.ShapeDtypeStruct((s, w), jnp.float32)] if masked else [])
    fn = jax.jit(lambda x, wt, b, *keep: fused_encoder_top_k(x, wt, b, k, keep=keep[0] if keep else None))
    exported = export.export(fn, platforms=["cuda"],
                             disabled_checks=[export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")])(*args)
    text = exported.mlir_module()
    # the fused kernel, the top-k of its candidates, and the unfused fallback's top-k
    assert text.count('name = "sparsekv_sae_fused_encoder"') == 1
    assert text.count('name = "sparsekv_threshold_top_k"') == 2
