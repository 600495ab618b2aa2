"""S³'s streaming scan: the context in chunks through the model, target-layer keys → SAE features →
a host-side inverted index, the chunk's KV dropped (the paper's Phase 1, Algorithm 1 lines 6-14).

Each chunk is one call of a jitted step over the model's layers (layers past the deepest target are
skipped under a `lax.cond`): at the target layers the pre-RoPE keys (`sparsekv_jax.sae.keys`) are
kept in a carried ``[n, B, C, Hkv, D]`` buffer, then encoded into token features
(`sparsekv_jax.retrieval.features`) and sorted into the chunk's CSR segment
(`sparsekv_jax.retrieval.index.chunk_postings`) on the device. The host copies each segment into
preallocated arrays while the device computes the next chunk (JAX's asynchronous dispatch).
Device memory holds the weights, one chunk's activations and the carry below: it does not grow
with the context.

What a chunk attends to (`ScanConfig`): by default **only itself** (``sinks = window = 0``, the
paper's "chunk-independent" prefill, its Appendix I; one causal attention per chunk, cuDNN on a GPU,
the blocked attention of `sparsekv_jax.attention` on a CPU).
With ``sinks``/``window`` > 0 it also attends to a carried KV of the context's first ``sinks``
positions and the ``window`` positions before the chunk (StreamingLLM's sink + recent window,
exact for a context shorter than ``sinks + window + chunk``); docs/S3.md measures both against
full-context keys (the paper's Table 9).

Models whose layers differ (Gemma 3: sliding-window local layers at one RoPE base, full-attention
global layers at another) run each layer as the model does: its own RoPE table (rotating and
un-rotating), its own window (`sparsekv_jax.sae.keys.layer_attention`: a `lax.cond` between the two
static windows; in a carried scan the local layers' window also bounds what they see of the carry).
S³'s SAEs sit on the global layers (`sparsekv_jax.policies.s3` refuses local ones).

The question is scanned last, as its own chunk (attending to the same carry): its pre-RoPE
*queries* at the target layers are encoded by the same SAEs into a dense ``[n, B, W]`` weight per
feature (activations summed over the question's tokens).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.attention import PREFILL_BLOCK, cached_attention, dense_causal_attention
from sparsekv_jax.backend import Backend, resolved
from sparsekv_jax.models.params import Params
from sparsekv_jax.models.transformer import decoder_layer, embed
from sparsekv_jax.retrieval.features import FEATURE_METHODS, stacked_token_features
from sparsekv_jax.retrieval.index import SegmentedIndex, chunk_postings
from sparsekv_jax.sae.keys import check_layers, layer_attention, layer_inverse_frequency, pre_rope_queries, unrotate
from sparsekv_jax.sae.model import TopKSAE

QUESTION_MULTIPLE = 64  # question chunks are padded to a multiple of this (fewer compiles)


@dataclasses.dataclass(frozen=True)
class ScanConfig:
    """How the context is scanned.

    Attributes:
      chunk: tokens per chunk (paper: 2048).
      sinks: first positions of the context every later chunk attends to (0: none).
      window: positions before the chunk it attends to (0: the chunk sees only itself).
      features: token-feature method (`sparsekv_jax.retrieval.features.FEATURE_METHODS`; ``"auto"``:
        ``"threshold"`` on a GPU, ``"lax"`` elsewhere).
      attention: chunk-only attention implementation, ``"xla"``, ``"cudnn"``, ``"blocked"``
        (`sparsekv_jax.attention.blocked_causal_attention`) or ``"auto"``: cuDNN on a GPU with
        bf16/fp16 weights, blocked on a CPU for chunks past one block (XLA:CPU's attention
        materialises the chunk's whole score matrix: about half of a 2,048-token chunk's time for
        SmolLM2), XLA otherwise.
    """

    chunk: int = 2048
    sinks: int = 0
    window: int = 0
    features: str = "auto"
    attention: str = "auto"

    def resolve(self, params: Params, backend: Backend | None = None) -> ScanConfig:
        """Every ``"auto"`` made concrete for ``backend``'s platform (``None``: this process's default
        `Backend`); ``ValueError`` on a bad value."""
        if self.chunk < 1 or self.sinks < 0 or self.window < 0:
            raise ValueError(f"ScanConfig chunk={self.chunk}, sinks={self.sinks}, window={self.window}: chunk must "
                             "be >= 1, sinks and window >= 0")
        gpu = resolved(backend).gpu
        features = ("threshold" if gpu else "lax") if self.features == "auto" else self.features
        if features not in FEATURE_METHODS:
            raise ValueError(f"ScanConfig.features={self.features!r} is not 'auto' or one of {FEATURE_METHODS}")
        attention = self.attention
        if attention == "auto":
            if gpu:
                attention = "cudnn" if params.dtype in (jnp.bfloat16, jnp.float16) else "xla"
            else:
                attention = "blocked" if self.chunk > PREFILL_BLOCK else "xla"
        if attention not in ("xla", "cudnn", "blocked"):
            raise ValueError(f"ScanConfig.attention={self.attention!r} is not 'auto', 'xla', 'cudnn' or 'blocked'")
        return dataclasses.replace(self, features=features, attention=attention)

    @property
    def carried(self) -> int:
        return self.sinks + self.window


@dataclasses.dataclass
class ScanResult:
    """The index of target ``layers``, the question's feature weights ``[n, B, W]`` (on the device) and
    host timings (s)."""

    layers: tuple[int, ...]
    index: SegmentedIndex
    query_weights: jax.Array
    seconds: dict[str, float]


def _init_carry(params: Params, batch: int, size: int) -> dict[str, jax.Array]:
    cfg = params.config
    shape = (cfg.num_layers, batch, size, cfg.num_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, params.dtype), "v": jnp.zeros(shape, params.dtype),
            "pos": jnp.full((batch, size), -1, jnp.int32)}


def _roll(old: jax.Array, new: jax.Array, first: jax.Array, used: jax.Array, sinks: int) -> jax.Array:
    """A carried ``[B, sinks + window, ...]`` buffer after a chunk ``new`` ``[B, C, ...]``: the sinks
    come from the context's first chunk (``first`` ``[B]``), the window holds the last ``window``
    indexed entries of ``old``'s window followed by the chunk's first ``used`` ``[B]`` (right-aligned:
    holes stay at the left)."""
    Wn = old.shape[1] - sinks
    f = first.reshape(-1, *([1] * (new.ndim - 1)))
    sink = jnp.where(f, new[:, :sinks], old[:, :sinks])
    joined = jnp.concatenate([old[:, sinks:], new], 1)
    win = jax.vmap(lambda x, u: jax.lax.dynamic_slice_in_dim(x, u, Wn, axis=0))(joined, used)
    return jnp.concatenate([sink, win], 1)


@partial(jax.jit, static_argnames=("layers", "scan", "queries", "return_keys"))
def scan_step(params: Params, saes: TopKSAE, carry: dict[str, jax.Array], tokens: jax.Array,
              positions: jax.Array, limit: jax.Array, *, layers: tuple[int, ...], scan: ScanConfig,
              queries: bool = False, return_keys: bool = False):
    """One chunk ``tokens`` ``[B, C]`` at ``positions`` ``[B, C]`` through the model.

    Context chunk (``queries=False``): returns ``(carry, postings [n, B, C·k], counts [n, B, W])``
    (`chunk_postings`; positions ``>= limit [B]`` are not indexed). Question chunk
    (``queries=True``): returns ``[n, B, W]`` fp32, the question tokens' summed feature activations
    (tokens at positions ``>= limit`` do not count). ``return_keys`` (context chunks) also returns
    the chunk's pre-RoPE keys ``[n, B, C, Hkv, D]`` (analysis).
    """
    cfg = params.config
    B, C = tokens.shape
    n, last = len(layers), max(layers)
    slot_of = jnp.full((cfg.num_layers,), -1, jnp.int32).at[jnp.asarray(layers)].set(jnp.arange(n, dtype=jnp.int32))
    heads = cfg.num_heads if queries else cfg.num_kv_heads
    store0 = jnp.zeros((n, B, C, heads, cfg.head_dim), jnp.float32)
    kv_pos = jnp.concatenate([carry["pos"], positions], 1)  # [B, M + C]
    kv_pos = jnp.broadcast_to(kv_pos[:, None], (B, cfg.num_kv_heads, kv_pos.shape[-1]))
    first = positions[:, 0] == 0
    used = jnp.clip(limit - positions[:, 0], 0, C)  # indexed tokens of this chunk, per row

    def run(x, store, ck, cv, lw, idx):
        inv = layer_inverse_frequency(cfg, idx)  # the layer's RoPE table (Gemma 3: local or global base)

        def attention(q, k, v, hidden):
            nonlocal store, ck, cv
            if scan.carried:
                t = partial(jnp.swapaxes, axis1=1, axis2=2)
                keys, values = t(jnp.concatenate([ck, k], 1)), t(jnp.concatenate([cv, v], 1))
                out = t(layer_attention(cfg, idx, lambda w: cached_attention(
                    t(q), keys, values, positions, kv_pos, jnp.ones((B, 1, 1, 1), bool), sliding_window=w)))
                ck, cv = _roll(ck, k, first, used, scan.sinks), _roll(cv, v, first, used, scan.sinks)
            else:
                short = scan.attention == "blocked" and C <= PREFILL_BLOCK  # a question chunk: one block or less
                out = layer_attention(cfg, idx, lambda w: dense_causal_attention(
                    q, k, v, sliding_window=w, implementation="xla" if short else scan.attention))
            kept = pre_rope_queries(cfg, q, positions, inv) if queries else unrotate(k, positions, inv)
            slot = slot_of[idx]
            i = jnp.maximum(slot, 0)
            store = jax.lax.dynamic_update_index_in_dim(store, jnp.where(slot >= 0, kept, store[i]), i, 0)
            return out, None

        # the model's own decoder layer (Gemma 3's sandwich norms included) around that attention
        x, _ = decoder_layer(params, lw, x, positions, idx, inv, attention, False, None)
        return x, store, ck, cv

    def skip(x, store, ck, cv, lw, idx):  # past the deepest target layer: nothing to compute
        return x, store, ck, cv

    def layer(state, xs):
        x, store = state
        lw, idx, ck, cv = xs
        x, store, ck, cv = jax.lax.cond(idx <= last, run, skip, x, store, ck, cv, lw, idx)
        return (x, store), (ck, cv)

    (_, store), (ks, vs) = jax.lax.scan(layer, (embed(params, tokens), store0),
                                        (params.layers, jnp.arange(cfg.num_layers), carry["k"], carry["v"]))
    keys = store  # [n, B, C, heads, D] pre-RoPE keys (queries for a question chunk) of the target layers
    ids, acts = stacked_token_features(saes, keys, saes.k, scan.features)  # [n, B, C, k]
    if queries:
        live = (positions < limit[:, None])[None, :, :, None]
        flat_ids, flat_acts = ids.reshape(n, B, -1), jnp.where(live, acts, 0.0).reshape(n, B, -1)
        layer_ix, rows = jnp.arange(n)[:, None, None], jnp.arange(B)[None, :, None]
        return jnp.zeros((n, B, saes.width), jnp.float32).at[layer_ix, rows, flat_ids].add(flat_acts)
    if scan.carried:
        indexed = jnp.where(positions < limit[:, None], positions, -1)
        new_pos = _roll(carry["pos"], indexed, first, used, scan.sinks)
        new_pos = new_pos.at[:, scan.sinks:].set(jnp.where(new_pos[:, scan.sinks:] < scan.sinks, -1,
                                                           new_pos[:, scan.sinks:]))  # the sinks hold those
        carry = {"k": ks, "v": vs, "pos": new_pos}
    postings, counts = chunk_postings(ids, acts, positions, limit, saes.width)
    if return_keys:
        return carry, postings, counts, keys
    return carry, postings, counts


def _copy(index: SegmentedIndex, segment: int, postings: jax.Array, counts: jax.Array) -> float:
    """Wait for a chunk's segment, copy it into the host index; returns the copy's seconds."""
    jax.block_until_ready((postings, counts))
    t0 = time.perf_counter()
    index.put(segment, np.asarray(postings), np.asarray(counts))
    return time.perf_counter() - t0


def scan_context(params: Params, saes: TopKSAE, layers: tuple[int, ...], tokens: np.ndarray,
                 context_lengths: np.ndarray, question_starts: np.ndarray, question_lengths: np.ndarray,
                 scan: ScanConfig = ScanConfig(), *, on_chunk: Callable[[int], None] | None = None,
                 backend: Backend | None = None) -> ScanResult:
    """Index each row's context ``tokens[b, :context_lengths[b]]`` and encode its question
    ``tokens[b, question_starts[b] : question_starts[b] + question_lengths[b]]``.

    ``saes`` is a stack of one SAE per entry of ``layers`` (model layer indices). ``on_chunk(c)`` is
    called after chunk ``c`` is dispatched (tests watch the live device arrays there). ``scan``'s
    ``"auto"`` choices are made for ``backend``'s platform (``None``: this process's default). Timings:
    ``scan`` (the whole chunk loop), ``index_copy`` (host time copying segments into the index,
    overlapped with the device's next chunk), ``question`` (the question chunk).
    """
    cfg = params.config
    layers = check_layers(layers, cfg.num_layers)
    if saes.stack_shape != (len(layers),) or saes.d_in != cfg.head_dim:
        raise ValueError(f"SAEs stacked {saes.stack_shape} with d_in {saes.d_in} do not fit {len(layers)} target "
                         f"layers of head_dim {cfg.head_dim}")
    scan = scan.resolve(params, backend)
    tokens = np.asarray(tokens)
    B = tokens.shape[0]
    ctx = np.asarray(context_lengths, np.int32)
    C = scan.chunk
    n_chunks = max(1, -(-int(ctx.max()) // C))
    index = SegmentedIndex.allocate(len(layers), B, n_chunks, C, saes.k, saes.width, ctx)
    padded = np.zeros((B, n_chunks * C), np.int32)
    padded[:, : min(tokens.shape[1], n_chunks * C)] = tokens[:, : n_chunks * C]
    carry = _init_carry(params, B, scan.carried)
    limit = jnp.asarray(ctx)
    t0 = time.perf_counter()
    host = 0.0
    pending = None
    for c in range(n_chunks):
        pos = jnp.broadcast_to(jnp.arange(c * C, (c + 1) * C, dtype=jnp.int32), (B, C))
        carry, post, cnt = scan_step(params, saes, carry, jnp.asarray(padded[:, c * C:(c + 1) * C]), pos, limit,
                                     layers=layers, scan=scan)
        if on_chunk is not None:
            on_chunk(c)
        if pending is not None:  # copy the previous chunk while the device runs this one
            host += _copy(index, *pending)
        pending = (c, post, cnt)
    host += _copy(index, *pending)
    t1 = time.perf_counter()

    qs, ql = np.asarray(question_starts, np.int32), np.asarray(question_lengths, np.int32)
    tq = max(QUESTION_MULTIPLE, -(-int(ql.max()) // QUESTION_MULTIPLE) * QUESTION_MULTIPLE)
    qtok = np.zeros((B, tq), np.int32)
    for b in range(B):
        qtok[b, : ql[b]] = tokens[b, qs[b]: qs[b] + ql[b]]
    qpos = jnp.asarray(qs[:, None] + np.arange(tq, dtype=np.int32)[None])
    weights = scan_step(params, saes, carry, jnp.asarray(qtok), qpos, jnp.asarray(qs + ql), layers=layers, scan=scan,
                        queries=True)
    weights.block_until_ready()
    t2 = time.perf_counter()
    return ScanResult(layers=layers, index=index, query_weights=weights,
                      seconds={"scan": t1 - t0, "index_copy": host, "question": t2 - t1})
