"""Where does CHESS rank the needle's page? (diagnostic, SmolLM2, one RULER niah_single_1 prompt)

Prints the answers of full attention and of CHESS presets, then the rank of the page holding the
needle under four page-vector variants: the paper's (mean of the stored, post-RoPE keys), the
same centred (mean page vector subtracted), and both on keys un-rotated to position 0 (pre-RoPE).

    python scripts/chess_needle_ranks.py --length 1024 --seed 0
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax import load
from sparsekv_jax.eval import ruler, runner
from sparsekv_jax.generate import _setup, generate, prepare
from sparsekv_jax.models.rope import apply_rope, inverse_frequencies
from sparsekv_jax.policies import CHESS, Dense


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    params, tok = load(args.model, progress=False)
    s = ruler.generate_samples("niah_single_1", args.length, 1, args.seed, tok, chat=True)[0]
    ctx, q = runner._encode(tok, s)
    stop = tuple(params.config.eos_token_ids)
    print("answer", s.answers)
    for name, pol in (("full", Dense()), ("conservative", CHESS.conservative()), ("moderate", CHESS.moderate()),
                      ("aggressive", CHESS.aggressive())):
        out = generate(params, pol, np.array([ctx]), suffix=np.array([q]), max_new_tokens=12, stop_tokens=stop)
        print(f"{name:>12}: {tok.decode(out.sequences()[0])!r}  KV read {float(out.stats['kv_read_fraction'][0]):.2f}")

    pol = CHESS.moderate()
    p2, t2, l2, s2, sl2, cap = _setup(params, pol, np.array([ctx]), None, np.array([q]), None, 12, 16, None, None)
    _, cache, _, _ = jax.jit(lambda: prepare(params, p2, t2, l2, s2, sl2, extra_tokens=12, page_size=16,
                                             prefill_chunk=None, capacity=cap))()
    needle = tok(" " + s.answers[0], add_special_tokens=False)["input_ids"]
    at = [i for i in range(len(ctx) - len(needle)) if list(ctx[i:i + len(needle)]) == needle]
    page_of_needle = at[0] // pol.page_size
    k = jnp.swapaxes(cache.layers.k[:, 0].astype(jnp.float32), 1, 2)  # [L, S, H, D]
    pos = cache.layers.positions[:, 0, 0, :]  # [L, S]
    raw = jax.vmap(lambda x, p: apply_rope(x[None], -p[None], inverse_frequencies(params.config))[0])(k, pos)
    n, ps = int(cache.length[0]), pol.page_size
    P = k.shape[1] // ps
    used = -(-n // ps)
    print(f"needle at token {at[0]}, page {page_of_needle} of {used}")
    for name, keys in (("post-RoPE (paper)", k), ("pre-RoPE", raw)):
        keys = jnp.where((jnp.arange(P * ps) < n)[None, :, None, None], keys[:, :P * ps], 0.0)
        counts = jnp.clip(n - jnp.arange(P) * ps, 1, ps)[None, :, None, None]
        pm = keys.reshape(keys.shape[0], P, ps, *keys.shape[2:]).sum(2) / counts
        for centred in (False, True):
            v = pm[:, :used] - (pm[:, :used].mean(1, keepdims=True) if centred else 0.0)
            scores = np.asarray(jnp.einsum("lphd,lhd->p", v, v[:, used - pol.window_pages:].mean(1)))
            order = np.argsort(-scores)
            rank = int(np.where(order == page_of_needle)[0][0])
            print(f"{name:>18}{', centred' if centred else '':<10}: needle page rank {rank} of {used}; "
                  f"top pages {order[:6].tolist()}")


if __name__ == "__main__":
    main()
