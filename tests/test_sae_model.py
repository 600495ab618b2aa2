"""The Top-K SAE, its top-k, head merging and the pre-RoPE key extraction, against references."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import seeded_rng

from sparsekv_jax.sae.model import (
    TopKSAE,
    activations_at,
    decode,
    dense_latents,
    encode,
    init_sae,
    merge_heads,
    pre_activations,
)
from sparsekv_jax.sae.topk import blocked_candidates, blocked_top_k, top_k


def _random_sae(rng, d, w, k, stack=()):
    return TopKSAE(w_enc=jnp.asarray(rng.normal(size=(*stack, d, w)), jnp.float32),
                   b_enc=jnp.asarray(rng.normal(size=(*stack, w)) * 0.5, jnp.float32),
                   w_dec=jnp.asarray(rng.normal(size=(*stack, w, d)), jnp.float32),
                   b_dec=jnp.asarray(rng.normal(size=(*stack, d)), jnp.float32), k=k).validate()


def _np_topk_relu(sae, x):
    pre = (np.asarray(x, np.float64) - np.asarray(sae.b_dec)) @ np.asarray(sae.w_enc) + np.asarray(sae.b_enc)
    r = np.maximum(pre, 0)
    order = np.argsort(-r, axis=-1, kind="stable")[..., : sae.k]
    return order, np.take_along_axis(r, order, -1)


@pytest.mark.parametrize("method", ["lax", "blocked", "threshold", "fused"])
def test_encode_is_topk_of_relu(method):
    rng = seeded_rng()
    d, w, k = 16, 2048, 24
    sae = _random_sae(rng, d, w, k)
    x = jnp.asarray(rng.normal(size=(3, 5, d)), jnp.float32)
    ids, acts = encode(sae, x, method=method)
    assert ids.shape == acts.shape == (3, 5, k) and ids.dtype == jnp.int32
    ref_ids, ref_acts = _np_topk_relu(sae, x)
    np.testing.assert_allclose(np.asarray(acts), ref_acts, rtol=1e-4, atol=1e-4)
    for a, b in zip(np.asarray(ids).reshape(-1, k), ref_ids.reshape(-1, k), strict=True):
        assert set(a.tolist()) == set(b.tolist())  # random normals: no ties
    z = np.asarray(dense_latents(ids, acts, w))
    assert ((z != 0).sum(-1) == k).all()  # ≥ k positive pre-activations here: exactly k non-zeros
    assert (np.diff(np.asarray(acts), axis=-1) <= 0).all()


def test_encode_with_few_positive_latents_keeps_exactly_those():
    rng = seeded_rng()
    d, w, k = 8, 64, 10
    sae = _random_sae(rng, d, w, k)
    sae = sae.replace(b_enc=jnp.full((w,), -50.0).at[:3].set(100.0))  # only latents 0..2 can be positive
    ids, acts = encode(sae, jnp.asarray(rng.normal(size=(4, d)), jnp.float32), method="lax")
    assert ((np.asarray(acts) > 0).sum(-1) == 3).all()
    assert all(len(set(row)) == k for row in np.asarray(ids).tolist())  # still k distinct ids
    np.testing.assert_array_equal(np.sort(np.asarray(ids)[:, :3], -1), np.tile([0, 1, 2], (4, 1)))


def test_activations_at_and_the_training_gradients_equal_plain_autodiff():
    """The training step's custom gradient (a unique-index scatter) and the stop-gradient centring
    of `pre_activations` give the same values and parameter gradients as differentiating
    ``take_along_axis(ReLU((x - b_dec) W_enc + b_enc), ids)`` directly."""
    rng = seeded_rng()
    d, w, k = 8, 256, 12
    sae = _random_sae(rng, d, w, k, stack=(2,))
    x = jnp.asarray(rng.normal(size=(2, 7, d)), jnp.float32)
    ids, _ = encode(sae, x, method="lax")
    weights = jnp.asarray(rng.normal(size=(2, 7, k)), jnp.float32)

    def plain(s):
        pre = jnp.einsum("snd,sdw->snw", x - s.b_dec[:, None], s.w_enc) + s.b_enc[:, None]
        return jnp.sum(weights * jnp.take_along_axis(jax.nn.relu(pre), ids, -1))

    def custom(s):
        return jnp.sum(weights * activations_at(pre_activations(s, x), ids))

    np.testing.assert_allclose(custom(sae), plain(sae), rtol=1e-5)
    g_plain, g_custom = jax.grad(plain)(sae), jax.grad(custom)(sae)
    for name in ("w_enc", "b_enc", "b_dec", "w_dec"):
        np.testing.assert_allclose(np.asarray(getattr(g_custom, name)), np.asarray(getattr(g_plain, name)),
                                   rtol=1e-4, atol=1e-5)
    assert float(jnp.abs(g_plain.b_dec).max()) > 0  # b_dec does get an encoder gradient


def test_blocked_top_k_fast_path_is_exact_on_spread_rows():
    rng = seeded_rng()
    x = np.maximum(rng.normal(size=(64, 8192)), 0).astype(np.float32)
    v, i, unsafe = blocked_candidates(jnp.asarray(x), 64)
    assert not bool(unsafe)  # a random row: no block holds > 32 of the top 64
    ref = np.sort(x, -1)[:, ::-1][:, :64]
    np.testing.assert_array_equal(np.asarray(v), ref)
    np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(i), -1), ref)


@pytest.mark.parametrize("case", ["crowded_block", "tie_at_round_cut", "few_positive"])
def test_blocked_top_k_exact_in_adversarial_rows(case):
    rng = seeded_rng()
    x = rng.uniform(0.0, 1.0, size=(4, 4096)).astype(np.float32)
    if case == "crowded_block":  # 40 of the top 48 of row 1 in block 2: more than the 32 offered
        x[1, 2048:2088] = 5 + rng.uniform(size=40)
    elif case == "tie_at_round_cut":  # 20 equal values straddle the first round's 16th slot
        x[2, :20] = 3.0
    else:  # row 3 has only 5 positive values
        x[3] = 0
        x[3, rng.choice(4096, 5, replace=False)] = rng.uniform(1, 2, 5)
    k = 48
    _, _, unsafe = blocked_candidates(jnp.asarray(x), k)
    if case != "few_positive":
        assert bool(unsafe)  # the fast path knows it could be wrong: the fallback must run
    v, i = blocked_top_k(jnp.asarray(x), k)
    ref = np.sort(x, -1)[:, ::-1][:, :k]
    np.testing.assert_array_equal(np.asarray(v), ref)
    np.testing.assert_array_equal(np.take_along_axis(x, np.asarray(i), -1), ref)
    assert all(len(set(r)) == k for r in np.asarray(i).tolist())


def test_top_k_rejects_unknown_method():
    with pytest.raises(ValueError, match="fastest"):
        top_k(jnp.ones((2, 8)), 2, "fastest")
    with pytest.raises(ValueError, match="width=1000"):
        top_k(jnp.ones((2, 1000)), 2, "blocked")
    with pytest.raises(ValueError, match="width=1000"):
        top_k(jnp.ones((2, 1000)), 2, "threshold")


def test_decode_equals_dense_latents_times_decoder():
    rng = seeded_rng()
    d, w, k = 12, 300, 7
    sae = _random_sae(rng, d, w, k)
    x = jnp.asarray(rng.normal(size=(2, 9, d)), jnp.float32)
    ids, acts = encode(sae, x)
    z = np.zeros((2, 9, w))
    np.put_along_axis(z, np.asarray(ids), np.asarray(acts), -1)
    ref = z @ np.asarray(sae.w_dec, np.float64) + np.asarray(sae.b_dec)
    np.testing.assert_allclose(np.asarray(decode(sae, ids, acts)), ref, rtol=1e-4, atol=1e-4)


def test_stacked_saes_equal_each_layer_alone():
    rng = seeded_rng()
    stack = _random_sae(rng, 8, 128, 5, stack=(3,))
    x = jnp.asarray(rng.normal(size=(3, 4, 6, 8)), jnp.float32)
    ids, acts = encode(stack, x)
    out = decode(stack, ids, acts)
    for i in range(3):
        ids_i, acts_i = encode(stack.layer(i), x[i])
        np.testing.assert_array_equal(np.asarray(ids[i]), np.asarray(ids_i))
        np.testing.assert_allclose(np.asarray(out[i]), np.asarray(decode(stack.layer(i), ids_i, acts_i)),
                                   rtol=1e-6, atol=1e-6)
    with pytest.raises(ValueError, match="stack"):
        pre_activations(stack, x[0])


def test_init_sae_is_tied_with_unit_decoder_rows():
    sae = init_sae(jax.random.key(0), 16, 64, 4, stack=(2,))
    np.testing.assert_allclose(np.linalg.norm(np.asarray(sae.w_dec), axis=-1), 1, rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(sae.w_enc), np.swapaxes(np.asarray(sae.w_dec), -1, -2))
    with pytest.raises(ValueError, match="k=65"):
        init_sae(jax.random.key(0), 16, 64, 65)


def test_merge_heads_sums_over_heads_then_keeps_top_k():
    rng = seeded_rng()
    width, H, kin, k = 40, 3, 6, 8  # a small width: heads share many features
    ids = np.stack([np.stack([rng.choice(width, kin, replace=False) for _ in range(H)]) for _ in range(10)])
    acts = rng.uniform(0.1, 1.0, size=ids.shape)
    acts[0, 1, :] = 0.0  # a head with zero activations
    out_ids, out_acts = merge_heads(jnp.asarray(ids), jnp.asarray(acts, jnp.float32), k)
    for row in range(10):
        dense = np.zeros(width)
        np.add.at(dense, ids[row].ravel(), acts[row].ravel())
        order = np.argsort(-dense)[:k]
        np.testing.assert_allclose(np.asarray(out_acts[row]), dense[order], rtol=1e-6)
        got = {int(i) for i, a in zip(np.asarray(out_ids[row]), np.asarray(out_acts[row]), strict=True) if a > 0}
        assert got == {int(i) for i in order if dense[i] > 0}
    # more slots than distinct features: padded with activation 0
    ids_pad, acts_pad = merge_heads(jnp.asarray([[[3, 4], [4, 5]]]), jnp.asarray([[[1.0, 2.0], [3.0, 1.0]]]), 6)
    np.testing.assert_allclose(np.asarray(acts_pad[0]), [5, 1, 1, 0, 0, 0])
    assert np.asarray(ids_pad[0, 0]) == 4


# --- pre-RoPE projections against transformers -------------------------------------------------

@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral", "gemma3"])
def test_projections_are_pre_rope_k_and_q_of_the_layers(family, hf_tiny_dir):
    """Gemma 3 (7 layers, window 8 < 40 tokens): layer 5 is global (RoPE base 1e6), 2 and 6 local (1e4);
    its queries are compared before the query_pre_attn_scalar scaling, as q_proj + q_norm give them."""
    import torch
    import transformers as tf

    from sparsekv_jax.models.loading import load_hf_dir
    from sparsekv_jax.sae.keys import projections

    path = hf_tiny_dir(family)
    params, cfg = load_hf_dir(path, dtype=jnp.float32)
    rng = seeded_rng()
    tokens = rng.integers(0, cfg.vocab_size, (2, 40))  # past Mistral's window of 24
    layers = (5, 2, 6) if family == "gemma3" else (2, 0)
    keys, queries = projections(params, jnp.asarray(tokens), layers, queries=True)
    model = tf.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = model(torch.as_tensor(tokens), output_hidden_states=True).hidden_states
        for slot, layer in enumerate(layers):
            attn = model.model.layers[layer].self_attn
            h = model.model.layers[layer].input_layernorm(hidden[layer])
            k = attn.k_proj(h).view(2, 40, cfg.num_kv_heads, cfg.head_dim)
            q = attn.q_proj(h).view(2, 40, cfg.num_heads, cfg.head_dim)
            if family in ("qwen3", "gemma3"):
                k, q = attn.k_norm(k), attn.q_norm(q)
            np.testing.assert_allclose(np.asarray(keys[slot]), k.numpy(), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(np.asarray(queries[slot]), q.numpy(), rtol=1e-4, atol=1e-4)


def test_unrotate_inverts_rope_and_rejects_bad_layers():
    from sparsekv_jax.models.config import smollm2_135m_config
    from sparsekv_jax.models.rope import apply_rope, inverse_frequencies
    from sparsekv_jax.sae.keys import check_layers, unrotate

    inv = inverse_frequencies(smollm2_135m_config())
    rng = seeded_rng()
    x = jnp.asarray(rng.normal(size=(2, 50, 3, 64)), jnp.float32)
    pos = jnp.asarray(rng.integers(0, 8000, (2, 50)))
    np.testing.assert_allclose(np.asarray(unrotate(apply_rope(x, pos, inv), pos, inv)), np.asarray(x), atol=2e-5)
    with pytest.raises(ValueError, match=r"\[30\]"):
        check_layers((0, 30), 30)
    with pytest.raises(ValueError, match="repeat"):
        check_layers((1, 1), 30)
