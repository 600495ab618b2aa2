"""End-to-end speed: prefill tokens/s, decode ms/token and memory, per policy.

Random bf16 weights of real model shapes (SmolLM2-135M, Llama-3.1-8B, Qwen2.5-Coder-1.5B): speed does not depend on
the weights' values. A model's prefill points run in one process and each decode policy's points in another (a point
that runs out of memory can leave the allocator unable to place a later, smaller one: seen on an H200, where AdaKV at
batch 64 "did not fit" after Quest at batch 64 failed in the same process); each point is
compiled ahead of time, so its memory is read from XLA's memory analysis (arguments + outputs +
temporaries of the compiled step, an upper bound of what it holds at once) and its time is the
median of ``--iters`` runs after a warm-up.

Decode points start from a cache already holding the context (random K/V), sized as the policy
leaves it after compression (e.g. SnapKV at 25% holds 25% of the context plus the decoded tokens),
and time ``--decode-steps`` steps of `decode_step` in one `lax.fori_loop`.

    python -m sparsekv_jax.bench.e2e --out e2e.json
    python -m sparsekv_jax.bench.e2e --models llama3.1-8b --policies "fullkv, quest(0.25)" --contexts 8k
    python -m sparsekv_jax.bench.e2e --models llama3.1-8b --mesh model=2     # on 2 GPUs (sparsekv_jax.sharding)

With ``--mesh data=D,model=M`` the weights are drawn split over the mesh (`random_weights`), the
caches are built split by rows and KV heads and every point runs on the mesh; memory is per device.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

from sparsekv_jax.bench.timing import median_time, median_time_carry  # noqa: F401 (re-exported)
from sparsekv_jax.policies.spec import split_spec

MODELS = {"smollm2": "smollm2_135m_config", "llama3.1-8b": "llama31_8b_config",
          "qwen2.5-coder-1.5b": "qwen25_coder_15b_config"}


def parse_tokens(text: str) -> list[int]:
    out = []
    for part in filter(None, text.split(",")):
        part = part.strip().lower()
        out.append(int(float(part[:-1]) * 1024) if part.endswith("k") else int(part))
    return out


def memory_bytes(compiled) -> int | None:
    try:
        m = compiled.memory_analysis()
        return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
                   - getattr(m, "alias_size_in_bytes", 0))
    except Exception:  # not every backend reports it
        return None


def decode_cache(cfg, policy, context: int, batch: int, steps: int, key, page_size: int = 16, mesh=None,
                 dtype=None):
    """A cache holding ``context`` tokens as ``policy`` leaves it after prefill (+ room for steps; the
    page summaries it reads, as `generate` allocates them); on
    ``mesh`` (`sparsekv_jax.sharding`) built split as `generate` splits it (no device holds it whole).
    ``dtype``: of K/V (default bfloat16)."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax import sharding
    from sparsekv_jax.cache import init_cache, summarize_pages

    cap = policy.compressed_capacity(context, steps)
    kept = context if cap is None else cap - steps
    capacity = context + steps if cap is None else cap
    dtype = jnp.bfloat16 if dtype is None else dtype

    # built inside one jit: the empty cache's zero K/V are overwritten, so XLA never allocates
    # them (built eagerly, zeros + random draws held twice the cache: out of memory at 8k x 32)
    @jax.jit
    def build(key):
        cache = sharding.constrain_cache(init_cache(cfg, batch, capacity, page_size=page_size, dtype=dtype,
                                                    summaries=policy.page_summaries), mesh)
        k1, k2, k3 = jax.random.split(key, 3)
        L, B, H, S, D = cache.layers.k.shape
        used = jnp.arange(S) < kept
        positions = jnp.where(used, jnp.arange(S) * max(1, context // kept), -1).astype(jnp.int32)

        # one layer at a time: drawing the whole cache at once materialises 32-bit random bits of
        # the cache's size
        def draw(key):
            out = jax.lax.map(lambda k: jax.random.normal(k, (B, H, S, D), dtype), jax.random.split(key, L))
            return sharding.constrain_layers_rows_heads(out, mesh)

        layers = cache.layers.replace(
            k=draw(k1),
            v=draw(k2),
            positions=jnp.broadcast_to(positions, cache.layers.positions.shape))
        length = jnp.full((batch,), kept, jnp.int32)
        layers = summarize_pages(layers, length, page_size)
        cache = cache.replace(layers=layers, length=length, next_position=jnp.full((batch,), context, jnp.int32))
        observations = jax.random.uniform(k3, (L, B, H, context), jnp.float32)
        return (sharding.constrain_cache(cache, mesh),
                sharding.constrain_layers_rows_heads(observations, mesh))

    return build(key)


def policy_counts(cfg, policy, context: int, batch: int, steps: int, key):
    """``[L, B, Hkv]`` int32: the entries each (layer, row, KV head) of rows of ``context`` tokens keeps after
    ``policy`` (bound) compresses them, drawn without a prefill; ``None`` if it keeps the prompt (full attention).

    `AdaKV`: its own allocation (`AdaKV.allocate`: the joint top-``Hkv·n`` of each (layer, row) with the
    floor, after the inner's sinks and window are forced, exactly as `BudgetAllocation.compress` calls it) on
    random scores, one layer at a time (a layer's scores ``[B, Hkv, context]``, never all layers'): per
    (layer, row, head) ``u ** g``, ``u`` uniform per slot and ``g = exp(N(0, 1))`` per head, so heads differ
    in how concentrated their scores are and the split is uneven, as real heads' are (iid scores for every
    head would split ``Hkv·n`` almost evenly). Any other compressor that keeps a count per row: every head
    its uniform count, ``compressed_capacity - steps`` (SnapKV: ``n``). Other per-head allocators (PyramidKV,
    whose schedule needs every layer's scores at once) are refused."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax.policies.adakv import AdaKV, BudgetAllocation
    from sparsekv_jax.policies.common import force_sinks_and_window, row_budgets

    stage = policy.stage("compress")
    cap = stage.compressed_capacity(context, steps)
    if cap is None:
        return None
    L, H = cfg.num_layers, cfg.num_kv_heads
    if isinstance(stage, BudgetAllocation) and not isinstance(stage, AdaKV):
        raise ValueError(f"policy_counts: {stage.name}'s allocation is not drawn here (AdaKV's is; its "
                         "schedule needs every layer's scores at once); use fullkv, a scored compressor or adakv(...)")
    if not isinstance(stage, AdaKV):
        return jnp.full((L, batch, H), cap - steps, jnp.int32)
    inner = stage.inner
    length = jnp.full((batch,), context, jnp.int32)
    keep = row_budgets(inner.budget, length)
    sinks, window = inner.forced_counts(keep)
    forced = jnp.minimum(sinks + jnp.asarray(window, jnp.int32), keep)

    @jax.jit
    def draw(key):
        def one(key):
            k1, k2 = jax.random.split(key)
            g = jnp.exp(jax.random.normal(k1, (1, batch, H, 1), jnp.float32))
            scores = jax.random.uniform(k2, (1, batch, H, context), jnp.float32) ** g
            scores = force_sinks_and_window(scores, length, sinks, window)
            return stage.allocate(scores, length, keep, forced)[0]

        return jax.lax.map(one, jax.random.split(key, L))

    return draw(key)


def pool_decode_cache(cfg, policy, context: int, batch: int, steps: int, key, page_size: int = 16, counts=None,
                      dtype=None):
    """`decode_cache` on the page pool (``Options(pool=True)``, docs/PAGE_POOL.md): a `PoolCache` holding
    ``context`` tokens per row as ``policy`` (bound) leaves it after compression, with room for ``steps``
    decoded tokens, sized exactly as the engine sizes it:

    * a compressor: the decode pool `cache_pooled.decode_pool` of ``policy.compressed_pages(...)`` pages (the
      function the engine calls, `engine.run._pool_pages`), heads of capacity ``compressed_capacity``, each
      (layer, row, head) owning the pages of its count (``counts`` ``[L, B, Hkv]``, default `policy_counts`:
      SnapKV every head ``n``, AdaKV a random split of ``Hkv·n`` by its own allocation);
    * full attention: the prefill pool it decodes from, `cache_pooled.init_pool` of the prompt in the
      identity layout, today's cache size ``L·B·Hkv·pages_for(context + steps)`` (pool_pages unset), every
      head's length the prompt.

    Built in one jit: the pool allocated once and its K/V filled with random bf16 a layer's share of pages at
    a time (``ceil(N / L)`` pages per draw, `lax.fori_loop` of in-place updates: no full-size temporary;
    free pages get random values too, which no reader sees), live slots' positions as `decode_cache` gives
    them (logical slot ``s`` at ``s·max(1, context // kept)``, the others -1), the page summaries the policy
    holds (`summarize_pool`). ``ValueError`` if the pool overflowed (the counts do not fit the policy's
    bound). ``dtype``: of K/V (default bfloat16). Returns ``(pool, None)`` (the pooled decode stage is full
    attention's: no observations)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from sparsekv_jax.cache import init_cache, pages_for
    from sparsekv_jax.cache_pooled import decode_pool, init_pool, summarize_pool

    L, H, D, ps = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, page_size
    dtype = jnp.bfloat16 if dtype is None else dtype
    cap = policy.stage("compress").compressed_capacity(context, steps)
    kept = context if cap is None else cap - steps
    stride = max(1, context // kept)
    if cap is not None:
        num_pages = policy.stage("compress").compressed_pages(np.full((batch,), context), context, steps, ps, L, H)
        counts = policy_counts(cfg, policy, context, batch, steps, key) if counts is None else counts
        counts = jnp.asarray(counts, jnp.int32)
        if tuple(counts.shape) != (L, batch, H):
            raise ValueError(f"counts must be [L, B, Hkv] = {[L, batch, H]}, got shape {tuple(counts.shape)}")
        like = jax.eval_shape(lambda: init_cache(cfg, 1, ps, page_size=ps, dtype=dtype,
                                                 summaries=policy.page_summaries)).layers

    @jax.jit
    def build(key, counts):
        at = jnp.full((batch,), context, jnp.int32)
        if cap is None:
            pool = init_pool(cfg, batch, context + steps, prompt=context, page_size=ps, dtype=dtype,
                             summaries=policy.page_summaries)
            pool = pool.replace(alloc=pool.alloc.replace(length=jnp.full((L * batch, H), context, jnp.int32)))
        else:
            pool = decode_pool(like, counts, page_size=ps, max_pages_per_head=pages_for(cap, ps),
                               num_pages=num_pages, next_position=at)
        N = pool.num_pages
        C = -(-N // L)
        kk, kv = jax.random.split(key)

        def fill(c, kv_pages):
            start = jnp.minimum(c * C, N - C)
            return tuple(jax.lax.dynamic_update_slice_in_dim(
                a, jax.random.normal(jax.random.fold_in(k, c), (C, ps, D), a.dtype), start, axis=0)
                for a, k in zip(kv_pages, (kk, kv), strict=True))

        k, v = jax.lax.fori_loop(0, -(-N // C), fill, (pool.pages.k, pool.pages.v))
        # each page's logical page and its head's length, through the tables (sentinel entries dropped)
        table = pool.alloc.table
        logical = jnp.full((N,), -1, jnp.int32).at[table].set(
            jnp.broadcast_to(jnp.arange(table.shape[-1], dtype=jnp.int32), table.shape), mode="drop")
        held = jnp.zeros((N,), jnp.int32).at[table].set(
            jnp.broadcast_to(pool.alloc.length[..., None], table.shape), mode="drop")
        slot = logical[:, None] * ps + jnp.arange(ps, dtype=jnp.int32)
        positions = jnp.where((logical[:, None] >= 0) & (slot < held[:, None]), slot * stride, -1)
        pool = pool.replace(pages=pool.pages.replace(k=k, v=v, positions=positions.astype(jnp.int32)),
                            next_position=at)
        return summarize_pool(pool)

    pool = build(key, counts)
    if bool(pool.alloc.overflow.any()):
        raise ValueError(f"pool_decode_cache: {policy.name}'s counts do not fit its pool of {pool.num_pages} pages")
    return pool, None


def restart_point(cache):
    """What `decode_fn`'s ``start`` resets ``cache`` to before every call: ``(length, next_position)`` of a
    uniform cache; ``(held, length, next_position)`` of a `PoolCache` whose pages were allocated by prefix sum
    (`decode_pool`, `init_pool`: `cache_pool.allocate_after_compression`), its alloc rebuilt from them."""
    from sparsekv_jax.cache_pooled import PoolCache

    if isinstance(cache, PoolCache):
        return cache.alloc.held, cache.alloc.length, cache.next_position
    return cache.length, cache.next_position


def random_weights(cfg, mesh, dtype):
    """Random weights of ``cfg``'s shapes built where they live: each leaf drawn by a jitted call whose
    output sharding is its place on ``mesh`` (`sharding.param_specs`; the default device without a mesh),
    in ``dtype`` directly, so no device holds more than its share (a 32B model in fp32 fits no GPU).
    Normal(0, 0.02) matrices, norms 1: speed does not depend on the values."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding

    from sparsekv_jax import sharding
    from sparsekv_jax.models.params import random_params

    abstract = jax.eval_shape(lambda: random_params(cfg, jax.random.key(0), dtype))
    paths, treedef = jax.tree_util.tree_flatten_with_path(abstract)
    specs = treedef.flatten_up_to(sharding.param_specs(abstract, mesh)) if mesh is not None else [None] * len(paths)
    leaves = []
    for (path, leaf), spec, key in zip(paths, specs, jax.random.split(jax.random.key(0), len(paths)), strict=True):
        norm = "norm" in jax.tree_util.keystr(path)

        def draw(key, shape=leaf.shape, norm=norm):
            return jnp.ones(shape, dtype) if norm else jax.random.normal(key, shape, dtype) * jnp.asarray(0.02, dtype)

        leaves.append(jax.jit(draw, out_shardings=None if spec is None else NamedSharding(mesh, spec))(key))
    return jax.tree.unflatten(treedef, leaves)


def decode_fn(params, policy, steps: int, start=None, backend=None):
    """Jitted ``steps`` greedy decode steps, cache and policy state donated and returned (feed them
    back). With ``start`` (`restart_point` of the cache: ``(length, next_position)``, or for a page pool
    ``(held, length, next_position)``) every call decodes from there again, else from where the last call
    ended. A pool's restart rebuilds its allocator (`cache_pool.allocate_after_compression` of the held
    pages, one prefix sum over the tables per call, outside the steps): the pages the last call took go
    back to the free stack. A `PoolCache` decodes by the engine's pooled step (`decode_step` dispatches to
    `engine.pooled.decode_step_pool`). ``backend``: a `Backend` (default: auto)."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax.cache_pool import allocate_after_compression
    from sparsekv_jax.cache_pooled import PoolCache
    from sparsekv_jax.engine import decode_step

    def run(params, cache, state, token):
        if start is not None and isinstance(cache, PoolCache):
            held, length, position = start
            alloc = allocate_after_compression(held * cache.page_size, cache.page_size, cache.num_pages,
                                               max_pages_per_head=cache.max_pages_per_head)
            cache = cache.replace(alloc=alloc.replace(length=length), next_position=position)
        elif start is not None:
            cache = cache.replace(length=start[0], next_position=start[1])

        def body(i, carry):
            cache, state, token = carry
            step = decode_step(params, policy, cache, token, state, backend=backend)
            return step.cache, step.state, jnp.argmax(step.logits, -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, steps, body, (cache, state, token))

    return jax.jit(run, donate_argnums=(1, 2))


@dataclasses.dataclass(frozen=True)
class Grid:
    """The points of one model: prefill prompt lengths (batch 1, each policy of ``prefill_spec``),
    decode contexts × batches (each policy of ``policy_spec``, ``steps`` steps per timed run),
    ``iters`` timed repetitions (median reported)."""

    prefill_contexts: list[int]
    decode_contexts: list[int]
    batches: list[int]
    policy_spec: str = "fullkv"
    prefill_spec: str = "fullkv"
    steps: int = 32
    iters: int = 5


def run_model(model: str, grid: Grid, backend=None) -> list[dict]:
    """Every point of ``grid`` on ``model``'s shapes (random bf16 weights): one JSON row each."""
    import jax
    import jax.numpy as jnp

    from sparsekv_jax import sharding
    from sparsekv_jax.backend import Backend
    from sparsekv_jax.cache import init_cache
    from sparsekv_jax.engine import prefill
    from sparsekv_jax.models import config as mc
    from sparsekv_jax.models.params import random_params
    from sparsekv_jax.policies import parse_policies
    from sparsekv_jax.policies.base import Setup

    cfg = getattr(mc, MODELS[model])()
    mesh = None if backend is None else backend.mesh
    params = random_params(cfg, jax.random.key(0), jnp.bfloat16) if mesh is None else \
        random_weights(cfg, mesh, jnp.bfloat16)
    backend = (Backend() if backend is None else backend).resolve(params)

    base = {"model": model, "device": jax.devices()[0].device_kind, "jax": jax.__version__,
            "unroll": backend.decode_unroll, "decode_matmul": backend.decode_matmul,
            "mesh": None if mesh is None else dict(mesh.shape)}
    rows = []

    def record(row):
        rows.append({**base, **row})
        print(json.dumps(rows[-1]), flush=True)

    steps, iters = grid.steps, grid.iters
    for prefill_policy in parse_policies(grid.prefill_spec):
        for T in grid.prefill_contexts:
            pol = prefill_policy.bind(Setup(cfg, prompt_len=T, backend=backend))
            try:
                if mesh is not None:
                    sharding.check_mesh(cfg, 1, mesh)
                tokens = jax.random.randint(jax.random.key(1), (1, T), 0, cfg.vocab_size)
                lengths = jnp.full((1,), T, jnp.int32)

                def run(params, tokens, T=T, lengths=lengths, pol=pol):
                    cache = sharding.constrain_cache(init_cache(cfg, 1, T, page_size=16, dtype=jnp.bfloat16,
                                                                summaries=pol.page_summaries), mesh)
                    logits, cache, _, fraction = prefill(params, pol, tokens, lengths, cache, backend=backend)
                    return logits, cache.length, fraction

                compiled = jax.jit(run).lower(params, tokens).compile()
                sec = median_time(compiled, params, tokens, iters=iters)
                fraction = float(compiled(params, tokens)[2])
                record({"kind": "prefill", "policy": pol.name, "spec": repr(prefill_policy), "context": T,
                        "batch": 1, "ms": sec * 1e3, "tokens_per_s": T / sec, "prefill_block_fraction": fraction,
                        "memory_bytes": memory_bytes(compiled)})
            except Exception as e:  # noqa: BLE001 - report the point and go on
                record({"kind": "prefill", "policy": pol.name, "context": T, "batch": 1, "error": why(e)})

    for policy in parse_policies(grid.policy_spec):
        for T in grid.decode_contexts:
            for B in grid.batches:
                pol = policy.bind(Setup(cfg, prompt_len=T, max_new_tokens=steps, backend=backend))
                try:
                    if mesh is not None:
                        sharding.check_mesh(cfg, B, mesh)
                    cache, obs = decode_cache(cfg, pol, T, B, steps, jax.random.key(2), mesh=mesh)
                    state = pol.decode_init(cache, obs)
                    token = jnp.ones((B,), jnp.int32)

                    # the cache is donated and fed back, as in generation: one copy in memory
                    fn = decode_fn(params, pol, steps, start=restart_point(cache), backend=backend)
                    compiled = fn.lower(params, cache, state, token).compile()
                    sizes = (cache.nbytes(), cache.kv_nbytes())
                    sec, carry = median_time_carry(compiled, params, (cache, state, token), iters=iters)
                    del carry  # a carry kept alive would make the next, larger point "not fit"
                    record({"kind": "decode", "policy": pol.name, "spec": repr(policy), "context": T, "batch": B,
                            "ms_per_token": sec * 1e3 / steps, "tokens_per_s": B * steps / sec,
                            "cache_bytes": sizes[0], "kv_bytes": sizes[1],
                            "memory_bytes": memory_bytes(compiled)})
                    del obs
                except Exception as e:  # noqa: BLE001
                    record({"kind": "decode", "policy": pol.name, "context": T, "batch": B, "error": why(e)})
    return rows


def why(e: Exception) -> str:
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        return "does not fit in device memory"
    return f"{type(e).__name__}: {text.splitlines()[0][:200] if text else ''}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sparsekv_jax.bench.e2e", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2,llama3.1-8b", help="comma list of " + ", ".join(MODELS))
    p.add_argument("--prefill-contexts", default="4k,32k", help="prefill prompt lengths (batch 1)")
    p.add_argument("--contexts", default="8k,32k", help="decode context lengths")
    p.add_argument("--batches", default="1,32", help="decode batch sizes")
    p.add_argument("--policies", default="fullkv", help="policy spec for decode points (see `sparsekv eval --help`)")
    p.add_argument("--prefill-policies", default="fullkv", help="policy spec for prefill points (e.g. 'fullkv, stem')")
    p.add_argument("--decode-steps", type=int, default=32, help="decode steps per timed run")
    p.add_argument("--iters", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--unroll", type=int, default=0,
                   help="unroll factor of the decode layer scan (default 0 = the library's default, rolled)")
    p.add_argument("--decode-matmul", choices=("auto", "xla", "pallas"), default=None,
                   help="decode matmuls: cuBLAS on the scan's weight slice (xla), the Pallas kernel reading the "
                        "stacked weights by layer index (pallas), or auto: pallas on a GPU (default: "
                        "$SPARSEKV_DECODE_MATMUL, else auto)")
    p.add_argument("--mesh", default=None, metavar="data=D,model=M",
                   help="run every point on a device mesh (sparsekv_jax.sharding; e.g. model=2 on 2 GPUs)")
    p.add_argument("--out", help="write the rows as JSON here")
    p.add_argument("--one-model", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    pre, ctx, bat = parse_tokens(args.prefill_contexts), parse_tokens(args.contexts), parse_tokens(args.batches)
    from sparsekv_jax.backend import Backend

    try:  # --decode-matmul, else $SPARSEKV_DECODE_MATMUL, else auto
        backend = Backend.from_env(decode_unroll=args.unroll or 1,
                                   **({"decode_matmul": args.decode_matmul} if args.decode_matmul else {}))
    except ValueError as e:
        p.error(str(e))
    if args.one_model:
        if args.mesh:
            from sparsekv_jax import sharding

            backend = dataclasses.replace(backend, mesh=sharding.make_mesh(*sharding.parse_mesh(args.mesh)))
        grid = Grid(pre, ctx, bat, args.policies, args.prefill_policies, args.decode_steps, args.iters)
        rows = run_model(args.one_model, grid, backend=backend)
        print("ROWS " + json.dumps(rows))
        if args.out:  # a direct --one-model run keeps its rows too (the parent reads the ROWS line)
            with open(args.out, "w") as f:
                json.dump(rows, f, indent=2)
        return 0
    rows = []
    for model in args.models.split(","):
        if model not in MODELS:
            p.error(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    try:
        decode_items = split_spec(args.policies)
        split_spec(args.prefill_policies)
    except ValueError as e:
        p.error(str(e))
    for model in args.models.split(","):
        # one process for the prefill points, then one per decode policy: clean device memory for each
        jobs = [(args.prefill_contexts, "", args.policies)] if pre else []
        jobs += [("", args.contexts, item) for item in decode_items] if ctx and bat else []
        for prefill_contexts, contexts, policies in jobs:
            cmd = [sys.executable, "-m", "sparsekv_jax.bench.e2e", "--one-model", model, "--prefill-contexts",
                   prefill_contexts, "--contexts", contexts, "--batches", args.batches, "--policies", policies,
                   "--decode-steps", str(args.decode_steps), "--iters", str(args.iters), "--unroll", str(args.unroll),
                   "--prefill-policies", args.prefill_policies, "--decode-matmul", backend.decode_matmul,
                   *(["--mesh", args.mesh] if args.mesh else [])]
            res = subprocess.run(cmd, capture_output=True, text=True)
            lines = [line for line in res.stdout.splitlines() if line.startswith("ROWS ")]
            if lines:
                rows += json.loads(lines[-1][5:])
            else:
                print(res.stdout[-2000:], res.stderr[-4000:], file=sys.stderr)
                rows.append({"model": model, "policy": policies if contexts else "prefill", "error": "process failed"})
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    print(f"\n{'model':<12}{'kind':<8}{'policy':<14}{'ctx':>7}{'B':>4}{'ms':>9}{'ms/tok':>8}{'tok/s':>11}"
          f"{'cache GiB':>10}{'mem GiB':>9}")
    for r in rows:
        head = f"{r.get('model', ''):<12}{r.get('kind', ''):<8}{r.get('policy', ''):<14}{r.get('context', 0):>7}" \
               f"{r.get('batch', 0):>4}"
        if "error" in r:
            print(f"{head}   {r['error']}")
            continue
        gib = 2.0**30
        mem = (r["memory_bytes"] or 0) / gib
        print(f"{head}{r.get('ms', float('nan')):>9.1f}{r.get('ms_per_token', float('nan')):>8.2f}"
              f"{r['tokens_per_s']:>11,.0f}{r.get('cache_bytes', 0) / gib:>10.2f}{mem:>9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
