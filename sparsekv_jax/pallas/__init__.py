"""Pallas kernels (Triton backend), each beside its jnp reference.

* `decode_attention` -- GQA decode over a per-(row, kv head) subset of cache pages, split-K
  with a log-sum-exp combine, optional per-slot bias. Dense decode = all pages.
* `prefill_attention` -- causal GQA flash attention over a list of KV blocks per query
  block. Dense prefill = all causal blocks.
* `layer_matmul` (`matmul`) -- decode matmuls against one layer of the stacked weights.
* `rope_page_sums` (`page_rope`) -- per-page sums of keys turned back by their slot, read from
  one layer of the stacked cache (CHESS's pre-RoPE rebuild).
* `threshold_top_k` (`topk`) -- exact row-wise top-k of non-negative values by a bisection on
  their bit patterns (the SAE's and S³'s k of 64-128, where XLA sorts every row).
* `gather_decode` / `gather_dot` (`sae_decode`) -- the Top-K SAE's decoder and its encoder at the
  selected latents as gathers into registers; each is the other's gradient.
* `greedy_seed_clustering_kernel` (`gsc`) -- SemantiCache's greedy seed-based clustering as a scan
  over slots with a ring of seed flags (reference: `policies.clustering.greedy_seed_clustering`).

Arguments are validated at the Python boundary (`validation`); value checks run only on
concrete arrays, so calls from inside ``jit`` skip them.

Which of a kernel, its reference or the kernel per device on a mesh runs for a `Backend` is
`dispatch`'s choice (the kernels themselves know no platform: ``interpret`` is an argument).
"""

from sparsekv_jax.pallas.decode import decode_attention, decode_attention_reference
from sparsekv_jax.pallas.prefill import dense_block_lists, prefill_attention, prefill_attention_reference

__all__ = [
    "decode_attention",
    "decode_attention_reference",
    "dense_block_lists",
    "prefill_attention",
    "prefill_attention_reference",
]
