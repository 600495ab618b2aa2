"""Which implementation each kernel-level choice takes: one frozen, hashable value.

`generate` (and the benchmarks) take a `Backend` as a *static* argument: every choice is fixed at
trace time and is part of the compiled program's cache key, so changing it after a compile takes
effect (a different value compiles a different program). Nothing here is a module global.

``"auto"`` picks per platform: the Pallas kernels on a GPU; the jnp references on a CPU, where
the kernels only run interpreted (the tests force ``"pallas"`` there to check the GPU's code path).
`Backend.resolve` turns every ``"auto"`` into a concrete choice before jit.

A choice that is not a traced operation but an XLA compiler option (``prefill_dots``) is handed to
`jax.jit` as ``compiler_options`` by whoever compiles the prefill (`generate`; `teacher_force` and
`Session` through `engine.programs.prepare_apart`; the demo):
`Backend.prefill_compiler_options`.

Every platform question of the package is asked here and nowhere else: ``platform`` (JAX's default
backend unless set, fixed by `resolve`) is what "on a GPU" means for each ``"auto"`` of a `Backend`
and for the ``"auto"`` methods of the policies, the SAE and the retrieval scan, which take a
``backend`` (``None``: this process's default, `resolved`). Which function runs a kernel-level
operation -- the Pallas kernel, its jnp reference, or the kernel per device on ``mesh`` -- is
`sparsekv_jax.pallas.dispatch`, from a `Backend`.

No choice here reads the environment: an entry point that honours ``$SPARSEKV_DECODE_MATMUL``
(``sparsekv generate``/``eval``, ``bench e2e``) builds its backend with `Backend.from_env`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import platform
import re
from typing import Any

import jax
import numpy as np

__all__ = ["DATA", "MODEL", "Backend", "resolved"]

_IMPLS = ("auto", "pallas", "jnp")
_MATMULS = ("auto", "xla", "pallas")
_DENSE = ("auto", "xla", "cudnn", "blocked")
_LOCAL = ("ring", "full")
_DOTS = ("auto", "xla", "onednn")
# storage dtypes of K/V a cache takes (`Backend.kv_dtype`, `cache.init_cache(kv_dtype=...)`; None: the
# model's dtype); the last two are quantised (sparsekv_jax/cache.py's docstring). Defined here, the
# lower layer, so the Backend checks it without importing the cache.
KV_DTYPES = ("bfloat16", "float16", "float32", "int8", "float8_e4m3fn")
# XLA:CPU hands the program's dots (matmuls and batched matmuls) to oneDNN (x86 only)
_ONEDNN_DOTS = {"xla_cpu_use_onednn": True, "xla_cpu_experimental_onednn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
_WEIGHT_NAMES = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
# the axes of `Backend.mesh` (`sparsekv_jax.sharding.make_mesh`): rows, and heads / hidden units
DATA, MODEL = "data", "model"


def _default_platform() -> str:
    return jax.default_backend()


@contextlib.contextmanager
def _not_stored():
    """Compile without writing the program to JAX's persistent compilation cache (if one is set).

    XLA:CPU cannot serialise a program holding oneDNN fusions (jaxlib 0.10.2: ``UNIMPLEMENTED:
    ToProto is not implemented for thunk kind: onednn-fusion``): storing one only fails, with an
    "Error writing persistent compilation cache entry" warning, at every compile. So such a program
    is not offered to the cache (none is stored below the minimum compile time, here infinite for
    the compile's duration); it compiles afresh in each process. Other programs are stored as usual."""
    key = "jax_persistent_cache_min_compile_time_secs"
    old = getattr(jax.config, key)
    jax.config.update(key, float("inf"))
    try:
        yield
    finally:
        jax.config.update(key, old)


@functools.cache
def onednn_dots_available() -> bool:
    """Whether this process's XLA:CPU runs dots with `_ONEDNN_DOTS` and gets XLA's values: an x86 CPU, a
    jaxlib that knows the options (their names are XLA's, which may change between versions), and a
    probe that agrees with XLA's own dots.

    The probe is the fusion a prefill is made of, a dot and a chain of elementwise post-ops
    (``exp(0.1 · a @ w - c)``), on fixed random data, compiled both ways. On an AMD EPYC (AVX2, no
    AVX-512) with jaxlib 0.10.2 oneDNN's program returned ``inf`` there while the plain dot was exact,
    and a model's prefill logits came out about 5 off: where the probe disagrees, XLA's dots are kept."""
    if _default_platform() != "cpu" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    rng = np.random.default_rng(0)
    a, w, c = (rng.standard_normal(shape).astype(np.float32) for shape in ((64, 96), (96, 128), (64, 128)))
    lowered = jax.jit(lambda a, w, c: jax.numpy.exp(0.1 * (a @ w) - c)).lower(a, w, c)
    with _not_stored():  # neither program is the user's: none goes into a persistent compilation cache
        try:
            got = np.asarray(lowered.compile(compiler_options=_ONEDNN_DOTS)(a, w, c))
        except Exception:  # an unknown option or value: keep XLA's own dots
            return False
        want = np.asarray(lowered.compile()(a, w, c))
    return bool(np.isfinite(got).all() and np.allclose(got, want, rtol=1e-4, atol=1e-5))


_FUSION_CALL = re.compile(r"calls=%([\w.\-]+)[^\n]*__onednn_fusion")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*\S+\s+([\w\-]+)\((.*?)\)")


def onednn_fusions_runnable(hlo_text: str) -> bool:
    """Whether every oneDNN fusion of a compiled program (``Compiled.as_text()``) has the one shape
    oneDNN is known to run: one dot of the fusion's parameters, then a chain of elementwise
    post-ops, each taking the previous result and parameters or constants.

    XLA:CPU's dot fusion grows around a dot both ways. Elementwise work on the dot's result (scale,
    mask, exp, a residual add) runs as oneDNN post-ops. But an op computed before the dot (an
    elementwise producer, another dot), or a post-op whose other operand is computed inside the
    fusion, gives a graph that oneDNN fails to compile when the program first runs, and the
    process dies of SIGILL (``partition compile failed``; jaxlib 0.10.2, whose XLA forms such
    fusions; 0.11.2's keeps that work outside). This checks the text before anything runs
    (tests/test_onednn_prefill.py); anything it cannot parse counts as not runnable.
    """
    computations: dict[str, dict[str, tuple[str, list[str]]]] = {}
    current = None
    for line in hlo_text.splitlines():
        if line.endswith("{") and line.startswith("%"):
            current = computations.setdefault(line.split()[0].lstrip("%"), {})
        elif line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            operands = [o.strip().lstrip("%") for o in m.group(3).split(",") if o.strip().startswith("%")]
            current[m.group(1)] = (m.group(2), operands)
    for name in _FUSION_CALL.findall(hlo_text):
        body = computations.get(name, {})
        dots = [n for n, (op, _) in body.items() if op == "dot"]
        if len(dots) != 1:
            return False
        chain = set(dots)
        for n, (op, operands) in body.items():  # HLO text lists operands before their users
            kinds = [body[o][0] if o in body else "?" for o in operands]
            if op in ("parameter", "constant"):
                continue
            if n == dots[0]:
                if any(k != "parameter" for k in kinds):
                    return False
                continue
            inner = [o for o, k in zip(operands, kinds, strict=True) if k not in ("parameter", "constant")]
            if len(inner) != 1 or inner[0] not in chain:
                return False
            chain.add(n)
    return True


@dataclasses.dataclass(frozen=True)
class Backend:
    """Implementation choices, fixed at trace time.

    Attributes:
      decode_attention: page-sparse decode attention: ``"pallas"`` (the kernel of
        `sparsekv_jax.pallas.decode`), ``"jnp"`` (its reference path) or ``"auto"``.
      dense_prefill: dense prefill attention: ``"cudnn"``, ``"xla"`` (`jax.nn.dot_product_attention`),
        ``"blocked"`` (`attention.blocked_causal_attention`, a flash-style loop over key blocks in jnp) or
        ``"auto"`` = cuDNN on a GPU for bf16/fp16, blocked on a CPU past one block (XLA:CPU's attention
        materialises the full score matrix; experiments/diary/BENCHMARKS_DIARY.md, "CPU speed against
        transformers"), XLA otherwise. Left ``"auto"`` by `resolve`: the choice depends on the dtype and length, which
        `attention` sees.
      sparse_prefill: block-sparse prefill attention (a policy's prefill pattern): the same choice
        for `sparsekv_jax.pallas.prefill`.
      decode_carry: carry the whole cache through the decode layer scan (in-place writes; the
        kernel reads the layer by index) instead of scanning it as xs/ys, which copies every layer's
        cache out and back at each step. ``"auto"`` = True (on a CPU too: 1.7x less CPU time per
        token at 4k for SmolLM2 once the single-query attention stopped transposing the keys,
        experiments/diary/BENCHMARKS_DIARY.md, "CPU speed against transformers").
      decode_matmul: decode matmuls: ``"xla"`` (cuBLAS on the scan's slice of the stacked weights,
        which XLA copies out first), ``"pallas"`` (`layer_matmul` reads the layer's tiles from the
        stack), ``"auto"`` = ``"pallas"`` on a GPU where every weight fits the kernel (2.7x faster
        decode for Llama-3.1-8B at batch 1 on an H100: experiments/diary/BENCHMARKS_DIARY.md). `Backend.from_env`
        takes it from ``$SPARSEKV_DECODE_MATMUL`` (the command line's backends).
      page_sums: CHESS's pre-RoPE rebuild: the Pallas `rope_page_sums` (reads each layer's keys in
        place) or its jnp reference.
      prefill_unroll: unroll factor of the layer scan over many tokens (1 = rolled).
      decode_unroll: unroll factor of the decode layer scan (1 = rolled; unrolling did not remove
        the weight copies inside the decode loop on an H100, experiments/diary/BENCHMARKS_DIARY.md).
      interpret: run Pallas kernels interpreted; ``None`` = off a GPU.
      mesh: a ``data`` × ``model`` `jax.sharding.Mesh` to run on (`sparsekv_jax.sharding`): the
        cache is pinned to its split by rows and KV heads and the Pallas kernels run per device
        under `jax.shard_map`; ``None`` = wherever the inputs are (one device).
      local_cache: how a model with interleaved local (sliding-window) and global layers (Gemma 3) stores
        the local layers' KV: ``"ring"`` (default) a ring buffer of the window per local layer, beside the
        global layers' paged cache, which alone the policy manages (`sparsekv_jax.local_layers`);
        ``"full"`` every layer in the paged cache, the window as a mask (the reference path; the policy
        then manages every layer). Other models ignore it.
      prefill_dots: who computes the prefill program's matmuls on a CPU: ``"xla"`` (XLA:CPU's own
        dot emitter) or ``"onednn"`` (XLA:CPU's oneDNN fusion of dots, an XLA compiler option:
        `prefill_compiler_options`). ``"auto"`` = oneDNN on an x86 CPU for fp32 weights where this
        jaxlib takes the option, XLA otherwise. oneDNN runs the blocked prefill attention's small
        per-tile matmuls on both of a 2-core machine's cores where XLA's use about 1.2: SmolLM2's
        fp32 prefill at 4k took 9.45 s with it, 11.45 s without, and transformers 11.38 s in the
        same run (experiments/diary/BENCHMARKS_DIARY.md, "CPU prefill on oneDNN's dots"). The decode loop keeps
        XLA's dots (oneDNN made its matrix-vector products 2x slower), so `generate` compiles
        prefill and decode as two programs when this is oneDNN (`teacher_force` and `Session`: the
        prefill, compress and begin steps as three, `engine.programs.prepare_apart`).
      kv_dtype: the storage of the paged KV cache the engine allocates (`sparsekv_jax.cache.init_cache`):
        ``None`` (default) the model's dtype; ``"bfloat16"``/``"float16"``/``"float32"``; ``"int8"`` or
        ``"float8_e4m3fn"`` quantised codes with power-of-two scales per page (keys per page and
        channel, values per page and KV head; `sparsekv_jax.cache_quant`'s docstring says how writes re-scale
        a page and who dequantises). Unlike the other fields this one changes the numbers, not only
        how they are computed: it lives here because every entry point takes a `Backend` (generate,
        `Session`, eval, the benchmarks), a value fixed at trace time, so another dtype compiles
        another program. The cache itself says what it holds (its leaves' dtypes and scales), so no
        reader of a cache consults this field.
      platform: the JAX platform the choices are made for (``"gpu"``, ``"cpu"``, ...); ``None`` =
        JAX's default backend, fixed by `resolve`. Every ``"auto"`` of the package reads it (`gpu`).
    """

    decode_attention: str = "auto"
    dense_prefill: str = "auto"
    sparse_prefill: str = "auto"
    decode_carry: bool | str = "auto"
    decode_matmul: str = "auto"
    page_sums: str = "auto"
    prefill_unroll: int = 1
    decode_unroll: int | bool = 1
    interpret: bool | None = None
    mesh: Any = None
    local_cache: str = "ring"
    prefill_dots: str = "auto"
    platform: str | None = None
    kv_dtype: str | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype is not None and (not isinstance(self.kv_dtype, str) or self.kv_dtype not in KV_DTYPES):
            raise ValueError(f"Backend kv_dtype={self.kv_dtype!r}: expected one of {KV_DTYPES} or None (the model's "
                             "dtype)")
        if self.platform is not None and not isinstance(self.platform, str):
            raise ValueError(f"Backend platform={self.platform!r}: expected a JAX platform name ('gpu', 'cpu', ...) "
                             "or None")
        if self.prefill_dots not in _DOTS:
            raise ValueError(f"Backend prefill_dots={self.prefill_dots!r}: expected one of {_DOTS}")
        if self.local_cache not in _LOCAL:
            raise ValueError(f"Backend local_cache={self.local_cache!r}: expected one of {_LOCAL}")
        for name in ("decode_attention", "sparse_prefill", "page_sums"):
            if getattr(self, name) not in _IMPLS:
                raise ValueError(f"Backend {name}={getattr(self, name)!r}: expected one of {_IMPLS}")
        if self.dense_prefill not in _DENSE:
            raise ValueError(f"Backend dense_prefill={self.dense_prefill!r}: expected one of {_DENSE}")
        if self.decode_matmul not in _MATMULS:
            raise ValueError(f"Backend decode_matmul={self.decode_matmul!r}: expected one of {_MATMULS}")
        if self.decode_carry not in ("auto", True, False):
            raise ValueError(f"Backend decode_carry={self.decode_carry!r}: expected 'auto', True or False")
        for name in ("prefill_unroll", "decode_unroll"):
            value = getattr(self, name)
            if not isinstance(value, (bool, int)) or (not isinstance(value, bool) and value < 1):
                raise ValueError(f"Backend {name}={value!r}: expected an int >= 1 or a bool")

    @classmethod
    def from_env(cls, **fields: Any) -> Backend:
        """A `Backend` whose ``decode_matmul`` is ``$SPARSEKV_DECODE_MATMUL`` (``auto``/``xla``/``pallas``;
        unset: ``auto``) unless ``fields`` name it: for entry points that let a whole process's runs
        (benchmarks, ``sparsekv eval``) be switched from the shell."""
        value = os.environ.get("SPARSEKV_DECODE_MATMUL", "auto")
        if value not in _MATMULS:
            raise ValueError(f"SPARSEKV_DECODE_MATMUL={value!r}: expected one of {_MATMULS}")
        return cls(**{"decode_matmul": value, **fields})

    @property
    def resolved(self) -> bool:
        return "auto" not in (self.decode_attention, self.sparse_prefill, self.decode_carry, self.decode_matmul,
                              self.page_sums, self.prefill_dots) and self.interpret is not None \
            and self.platform is not None

    @property
    def gpu(self) -> bool:
        """Whether the choices are for a GPU (``platform``, or JAX's default backend while unset)."""
        return (self.platform or _default_platform()) == "gpu"

    def resolve(self, params: Any = None) -> Backend:
        """Every ``"auto"`` made concrete for this platform (and ``params``' weights, for the
        decode matmul: the kernel needs weight dimensions that are multiples of 16 and one dtype)."""
        plat = self.platform or _default_platform()
        gpu = plat == "gpu"

        def pick(choice: str) -> str:
            return ("pallas" if gpu else "jnp") if choice == "auto" else choice

        matmul = self.decode_matmul
        if matmul == "auto":
            fits = False
            if params is not None and gpu:
                ws = [getattr(params.layers, n) for n in _WEIGHT_NAMES]
                # on a mesh each device multiplies its share of a weight (`pallas.dispatch.layer_matmul`)
                tile = 16 * (1 if self.mesh is None else int(self.mesh.shape[MODEL]))
                fits = (all(w.shape[1] % tile == 0 and w.shape[2] % tile == 0 for w in ws)
                        and len({w.dtype for w in ws}) == 1)
            matmul = "pallas" if fits else "xla"
        dots = self.prefill_dots
        if dots == "auto":
            fp32 = params is not None and params.dtype == jax.numpy.float32
            dots = "onednn" if fp32 and plat == "cpu" and onednn_dots_available() else "xla"
        return dataclasses.replace(
            self, decode_attention=pick(self.decode_attention), sparse_prefill=pick(self.sparse_prefill),
            page_sums=pick(self.page_sums), decode_matmul=matmul,
            decode_carry=True if self.decode_carry == "auto" else bool(self.decode_carry), prefill_dots=dots,
            interpret=(not gpu) if self.interpret is None else self.interpret, platform=plat)

    def prefill_compiler_options(self) -> dict[str, Any] | None:
        """XLA compiler options for a program that prefills (``compiler_options`` of `jax.jit` or of
        ``Lowered.compile``), or ``None`` for XLA's defaults. Of a resolved backend."""
        if self.prefill_dots == "auto":
            raise ValueError("prefill_compiler_options of an unresolved Backend: call resolve(params) first")
        return dict(_ONEDNN_DOTS) if self.prefill_dots == "onednn" else None

    def compile_prefill(self, lowered: Any) -> Any:
        """Compile a lowered prefill program (``jax.jit(f).lower(...)``) with
        `prefill_compiler_options`, or with XLA's defaults where the options are none, where this
        XLA cannot take them (`onednn_dots_available`), or where the oneDNN program would not run
        (`onednn_fusions_runnable`). The same values either way. A oneDNN program is left out of a
        persistent compilation cache (`_not_stored`: XLA:CPU cannot serialise it)."""
        options = self.prefill_compiler_options()
        if options is not None and onednn_dots_available():
            with _not_stored():
                compiled = lowered.compile(compiler_options=options)
            if onednn_fusions_runnable(compiled.as_text()):
                return compiled
        return lowered.compile()

    @classmethod
    def reference(cls) -> Backend:
        """The jnp paths everywhere, the decode cache scanned layer by layer: the plainest program,
        a reference for the others."""
        return cls(decode_attention="jnp", sparse_prefill="jnp", decode_carry=False, decode_matmul="xla",
                   page_sums="jnp", prefill_dots="xla")

    @classmethod
    def kernels(cls, carry: bool = True) -> Backend:
        """The GPU's code path everywhere (Pallas kernels; interpreted off a GPU, for tests)."""
        return cls(decode_attention="pallas", sparse_prefill="pallas", decode_carry=carry, decode_matmul="pallas",
                   page_sums="pallas")


@functools.cache
def _default_resolved() -> Backend:
    return Backend().resolve()


def resolved(backend: Backend | None = None) -> Backend:
    """``backend`` with every ``"auto"`` made concrete (`Backend.resolve` without weights); ``None``:
    this process's default `Backend`, resolved once. What a function with an ``"auto"`` choice and an
    optional ``backend`` asks."""
    if backend is None:
        return _default_resolved()
    return backend if backend.resolved else backend.resolve()
