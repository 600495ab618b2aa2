"""Issues 39 / 38, without a GPU: compile the decode kernel's ``dequant=`` / ``pool_variant=`` variants for an H100
and count what their PTX does.

A deviceless compile (`jax.experimental.topologies`, a described H100) runs Pallas' Triton lowering and XLA's
Triton -> PTX, so a primitive Triton cannot lower fails here rather than on the GPU, and the PTX shows which
conversions each variant really issues (e.g. whether int8 codes go through I2F, ``cvt.rn.f32.s*``, a quarter
of the FP32 rate on Hopper). It needs the CUDA plugin of the installed jax's version in a private directory (not
the project venv) and no GPU or driver:

    pip install --no-deps --target /tmp/cudajax jax-cuda12-pjrt==$V jax-cuda12-plugin==$V   # V: jax.__version__
    PYTHONPATH=$PWD:/tmp/cudajax python experiments/kvq_ptx_check.py
    PYTHONPATH=$PWD:/tmp/cudajax python experiments/kvq_ptx_check.py --no-i2f page_lowp,page_magic  # exit 1 if any

Prints one row per (variant, kv dtype, q dtype, mode): the kernel's PTX instruction count and classes of it.
Static counts of one tile configuration's code (the loop body and its prologue), not a timing; ptxas is not run
(register use and SASS are not seen). Llama-3.1-8B heads, page size 16, key zero points.

Seen with jax 0.10.2's plugin (2026-11-27; the H200 timings ran jax 0.11.2, Python >= 3.12, not checkable on the
3.11 dev machine), int8, bf16 queries, block_k 64 / 4 warps / 3 stages, dense, per thread per tile: every variant
in every mode (dense, sparse, stacked, pool; int8 and fp8; bf16 and f32 queries) lowers and compiles. ``page_lowp``
issues **no I2F**: Triton turns int8 into bf16 with a packed bit trick of its own (inline asm: 2 ``prmt``, 4
``and``, 2 ``sub.bf16x2`` per 4 codes), keys and values alike, and scales / adds in scalar bf16 (128 ops).
``page_f32`` issues 64 I2F (its keys to float32; values as page_lowp); ``page_magic`` 0 (+64 integer adds, +64
FADDs). Instructions: bf16 kernel (no dequantisation) 768, page_lowp 1477, page_f32 1621, page_magic 1637; the
quantised variants also pass their tiles through shared memory once more (66 ``ld.shared`` against 6).

Page pool (issue 38): an unquantised cache (``--kv-dtypes bfloat16``, ``dequant`` unused) in the modes ``dense`` /
``listed`` (uniform) and ``pool_dense`` / ``pool_listed`` for each ``--pool-variants`` entry, e.g. the bf16 tiles:

    PYTHONPATH=$PWD:/tmp/cudajax python experiments/kvq_ptx_check.py --kv-dtypes bfloat16 --block-k 128 --warps 8 \
        --modes dense,listed,pool_dense,pool_listed --pool-variants lanes,ahead1,ahead2

(docs/PAGE_POOL.md, step 1, has the counts and what they show). The kernel is found among the PTX files that
compile dumped, by its name (``sparsekv_decode*``, jax 0.10.2) or else as the only entry with ``mma`` (`kernel_ptx`;
the name-based lookup failed under jax 0.11.2).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile

import jax
import jax.numpy as jnp
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding

from sparsekv_jax.pallas.decode import DEQUANT, POOL_VARIANTS, decode_attention

LAST_DUMP: list[str] = []  # the files the last `compile_one` dumped
DUMP = ""  # where XLA dumps the PTX: set by `main` before the first compile (not at import: importing this
# module, e.g. from the tests, must not make every later compile of the process dump its programs)

H100 = """gpu_device_info { cuda_compute_capability { major: 9 minor: 0 } threads_per_block_limit: 1024
threads_per_warp: 32 shared_memory_per_block: 49152 shared_memory_per_block_optin: 232448
shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535 memory_bandwidth: 3352320000000
l2_cache_size: 52428800 clock_rate_ghz: 1.98 device_memory_size: 84929347584 }
platform_name: "CUDA" dnn_version_info { major: 9 minor: 3 patch: 0 } device_description_str: "NVIDIA H100 80GB HBM3"
"""
# PTX instruction classes (regexes over the kernel's instruction lines)
CLASSES = {
    "I2F": r"cvt\.rn(\.[a-z]+)?\.(f32|f16|bf16)(x2)?\.[su](8|16|32)\b",  # int -> float: the quarter-rate one
    "F2F_narrow": r"cvt\.rn(\.[a-z]+)?\.(bf16|f16)(x2)?\.f32\b",  # float32 -> bf16 / f16
    "widen_bf16": r"cvt\.f32\.bf16\b",
    "sext_s8": r"cvt\.s32\.s8\b",
    "prmt": r"prmt\.b32",
    "iadd": r"add\.s32",
    "f32_add_sub": r"(add|sub)\.rn\.f32",
    "f32_mul_fma": r"(mul|fma)\.rn\.f32",
    "bf16_ops": r"(add|sub|mul|fma)(\.rn)?\.bf16(x2)?\b",
    "mma": r"mma\.sync",
    "ld_shared": r"ld\.shared",
    "st_shared": r"st\.shared",
    "ld_global": r"ld\.global",
    "ld_global_v4": r"ld\.global(\.[a-z]+)*\.v4",
    "cp_async": r"cp\.async\.(ca|cg)",
    "setp": r"setp\.",
    "selp": r"selp\.",
    "bar_sync": r"bar\.sync",
}


def ptx_counts(text: str) -> dict[str, int]:
    """Instruction count and `CLASSES` counts of one PTX kernel's text."""
    # instructions, inline asm included (Triton's int8 -> bf16 is an asm block: prmt / and / sub.bf16x2)
    lines = [ln for ln in (x.strip() for x in text.splitlines()) if re.match(r"[a-z][\w.]*(\s|;)", ln)]
    out = {"instr": len(lines)}
    for name, pat in CLASSES.items():
        out[name] = sum(bool(re.search(pat, ln)) for ln in lines)
    out["magic_const"] = text.count("1258291328")  # 0x4B000080, magic_int8_to_f32's bias
    return out


QUANTISED = ("int8", "float8_e4m3fn")
MODES = ("dense", "sparse", "stacked", "pool", "listed", "pool_dense", "pool_listed")


def kernel_ptx(paths: list[str], tag: str) -> str:
    """The decode kernel's PTX among ``paths`` (the files one compile dumped; those that are not PTX are skipped):
    the entry named ``sparsekv_decode*`` if there is one, else the only entry with ``mma`` (the decode kernel
    has two dots, XLA's epilogue fusions none). A file holding several entries is cut at each ``.entry``. Under
    jax 0.11.2 the lookup by dump-file name (``*jit_<tag>*.ptx``) and entry name (``sparsekv_decode``) failed
    (/tmp/ptx.log of the H200 run); which name changed is not known here, so neither is relied on."""
    entries = []
    for path in paths:
        try:
            text = open(path, errors="replace").read()
        except (IsADirectoryError, OSError):
            continue
        if ".entry" not in text or not re.search(r"^\s*\.target\s+sm_", text, re.M):
            continue
        starts = [m for m in re.finditer(r"^[^\n]*\.entry\s+([\w$.]+)", text, re.M)]
        for i, m in enumerate(starts):
            entries.append((m.group(1), text[m.start():starts[i + 1].start() if i + 1 < len(starts) else None]))
    named = [t for n, t in entries if "sparsekv_decode" in n]
    if len(named) == 1:
        return named[0]
    with_mma = [(n, t) for n, t in entries if re.search(r"\bmma\.sync|\bwgmma\.", t)]
    if len(with_mma) == 1:
        return with_mma[0][1]
    raise RuntimeError(f"{tag}: compiled, but no single decode kernel among the {len(paths)} files it dumped "
                       f"in {DUMP}: PTX entries {[n for n, _ in entries]}, with mma {[n for n, _ in with_mma]}")


def compile_one(dev, dequant: str, kv_dtype: str, q_dtype: str, mode: str, a: argparse.Namespace,
                pool_variant: str | None = None) -> str:
    """Lower and compile one call for ``dev``; returns the decode kernel's PTX text.

    ``mode``: ``dense`` / ``listed`` (uniform cache, every page / a quarter listed), ``sparse`` (listed, with
    ``return_probs``), ``stacked`` (dense, ``layer=1`` of a 2-layer stack), ``pool_dense`` / ``pool_listed``
    (page-pool mode through a table), ``pool`` (pool, listed, with ``return_probs``). A ``kv_dtype`` outside
    `QUANTISED` is an unquantised cache (no scales; ``dequant`` is unused). ``pool_variant``: pool modes'
    ``pool_variant=`` (``None``: the default)."""
    on = lambda shape, dt: jax.ShapeDtypeStruct(shape, dt, sharding=SingleDeviceSharding(dev))  # noqa: E731
    B, Hq, Hkv, D, L, ps = a.batch, 32, 8, 128, a.context, 16
    P = L // ps
    quant = kv_dtype in QUANTISED
    kw = dict(page_size=ps, block_k=a.block_k, num_warps=a.warps, num_stages=a.stages)
    if quant:
        kw["dequant"] = dequant
    pooled = mode.startswith("pool")
    if pooled and pool_variant is not None:
        kw["pool_variant"] = pool_variant
    lead = (2,) if mode == "stacked" else ()
    if pooled:
        N = B * Hkv * P
        args = [on((B, Hq, D), q_dtype), on((N, ps, D), kv_dtype), on((N, ps, D), kv_dtype), on((B, Hkv), jnp.int32),
                on((N, D), jnp.bfloat16), on((N,), jnp.bfloat16), on((N, D), jnp.bfloat16),
                on((B, Hkv, P), jnp.int32), on((B, Hkv, P // 4), jnp.int32)]
    else:
        args = [on((B, Hq, D), q_dtype), on((*lead, B, Hkv, L, D), kv_dtype), on((*lead, B, Hkv, L, D), kv_dtype),
                on((B,), jnp.int32), on((*lead, B, Hkv, P, D), jnp.bfloat16), on((*lead, B, Hkv, P), jnp.bfloat16),
                on((*lead, B, Hkv, P, D), jnp.bfloat16), on((B, Hkv, P // 4), jnp.int32)]

    def f(q, k, v, n, ks, vs, kz, *rest):
        extra = {"layer": 1} if mode == "stacked" else {}
        if mode in ("sparse", "listed"):
            extra = {"page_ids": rest[0], "return_probs": mode == "sparse"}
        if pooled:
            extra = {"page_table": rest[0]}
            if mode != "pool_dense":
                extra.update(page_ids=rest[1], return_probs=mode == "pool")
        scales = dict(k_scale=ks, v_scale=vs, k_zero=kz) if quant else {}
        return decode_attention(q, k, v, n, **scales, **kw, **extra)

    tag = f"kvq_{dequant if quant else 'none'}_{kv_dtype}_{q_dtype}_{mode}_{pool_variant or ''}"
    f.__name__ = tag
    before = set(glob.glob(os.path.join(DUMP, "**", "*"), recursive=True))
    jax.jit(f).lower(*args).compile()
    new = sorted(set(glob.glob(os.path.join(DUMP, "**", "*"), recursive=True)) - before)
    LAST_DUMP[:] = new
    return kernel_ptx(new, tag)


def resources(paths: list[str], kernel: str, ptxas: str, warps: int) -> dict[str, int]:
    """Registers per thread and spills (``ptxas -v`` on the PTX file holding ``kernel``), dynamic shared memory
    per program (the launch in XLA's dumped thunk sequence) and the programs per SM these allow on an H100 (64K
    registers, allocated per warp in units of 256; 228 KB shared memory, 1 KB reserved per program; 64 warps):
    a loop that keeps one tile in flight per program has as many tiles in flight per SM as that."""
    src = next(p for p in paths if p.endswith(".ptx") and kernel[:200] in open(p, errors="replace").read())
    with tempfile.TemporaryDirectory() as tmp:
        r = subprocess.run([ptxas, "-arch=sm_90a", "-v", src, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True, check=True)
    name = re.search(r"\.entry\s+([\w$.]+)", kernel).group(1)
    info = r.stderr[r.stderr.find(name):]
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    spill = sum(int(x) for x in re.findall(r"(\d+) bytes spill", info.split("Compiling entry")[0]))
    smem = 0
    for p in paths:
        if p.endswith("thunk_sequence.txt"):
            smem = max([smem, *map(int, re.findall(r"shared_memory: (\d+) bytes", open(p).read()))])
    return {"regs": regs, "spill_B": spill, "smem_KB": smem // 1024,
            "progs_per_SM": programs_per_sm(regs, smem, warps)}


def programs_per_sm(regs: int, smem: int, warps: int) -> int:
    """Programs (CTAs) of ``warps`` warps, ``regs`` registers per thread and ``smem`` bytes of shared memory one
    H100 SM holds at once: 64K registers allocated per warp in units of 256, 228 KB of shared memory with 1 KB
    reserved per program, 64 warps."""
    per_warp = -(-regs * 32 // 256) * 256
    return min(65536 // (per_warp * warps), 228 * 1024 // (smem + 1024), 64 // warps)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(DEQUANT))
    p.add_argument("--kv-dtypes", default="int8")
    p.add_argument("--q-dtypes", default="bfloat16")
    p.add_argument("--modes", default="dense", help=f"of {','.join(MODES)}")
    p.add_argument("--pool-variants", default="", help=f"pool modes only: of {','.join(POOL_VARIANTS)} "
                   "('': the default)")
    p.add_argument("--block-k", type=int, default=64)
    p.add_argument("--warps", type=int, default=4)
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--no-i2f", default="", help="variants whose PTX must hold no I2F (exit 1 otherwise)")
    p.add_argument("--ptxas", default="", help="a ptxas binary (pip install nvidia-cuda-nvcc-cu12): also report "
                   "registers, spills, shared memory and programs per SM (`resources`)")
    a = p.parse_args(argv)
    global DUMP
    DUMP = tempfile.mkdtemp(prefix="kvq_ptx_")  # read by XLA when the cuda backend first compiles, below
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={DUMP}".strip()
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")  # no driver here
    split = lambda s: [x for x in s.split(",") if x]  # noqa: E731
    bad = [v for v in split(a.variants) + split(a.no_i2f) if v not in DEQUANT]
    bad += [m for m in split(a.modes) if m not in MODES]
    bad += [v for v in split(a.pool_variants) if v not in POOL_VARIANTS]
    if bad:
        p.error(f"{bad}: variants are of {DEQUANT}, modes of {MODES}, pool variants of {POOL_VARIANTS}")
    dev = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=H100).devices[0]
    print(f"jax {jax.__version__}, target {dev.device_kind}, bk{a.block_k} w{a.warps} s{a.stages}, PTX in {DUMP}")
    cols = ["instr", *CLASSES, "magic_const"] + (["regs", "spill_B", "smem_KB", "progs_per_SM"] if a.ptxas else [])
    print(f"{'variant':<11} {'kv':<13} {'q':<8} {'mode':<19} " + " ".join(f"{c:>11}" for c in cols))
    failed = []
    runs = []
    for kvd in split(a.kv_dtypes):
        for v in split(a.variants) if kvd in QUANTISED else ["-"]:  # an unquantised cache has no dequant=
            for qd in split(a.q_dtypes):
                for mode in split(a.modes):
                    for pv in (split(a.pool_variants) or [None]) if mode.startswith("pool") else [None]:
                        runs.append((v, kvd, qd, mode, pv))
    for v, kvd, qd, mode, pv in runs:
        label = f"{v:<11} {kvd:<13} {qd:<8} {mode + (':' + pv if pv else ''):<19}"
        try:
            text = compile_one(dev, v, kvd, qd, mode, a, pv)
            c = ptx_counts(text)
            if a.ptxas:
                c.update(resources(LAST_DUMP, text, a.ptxas, a.warps))
        except Exception as e:  # noqa: BLE001 -- a lowering error is the finding: print it, go on
            print(f"{label} FAILED: {type(e).__name__}: {str(e)[:500]}")
            failed.append((v, kvd, qd, mode, pv))
            continue
        print(f"{label} " + " ".join(f"{c[k]:>11}" for k in cols), flush=True)
        if v in split(a.no_i2f) and c["I2F"]:
            failed.append((v, kvd, qd, mode, pv, "I2F"))
    if failed:
        print("failed:", failed)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
