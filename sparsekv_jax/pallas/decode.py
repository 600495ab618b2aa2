"""Page-sparse GQA decode attention (Pallas / Triton) and its jnp reference.

One new query per sequence attends over a *subset of pages* of the paged KV cache, chosen
per (row, kv head) by a policy (Quest, CHESS, ...). Dense decode is the special case
"every page below the length".

Design (why it looks like this):

* **Memory bound.** A decode step reads each selected K/V byte once and does ~2 FLOP per
  byte, so the kernel is a streaming loop over K/V tiles; everything else is cheap.
* **GQA in-kernel.** One program handles all ``G = Hq/Hkv`` query heads of a kv head
  (padded to 16 rows, the smallest Triton dot tile), so each K/V tile is loaded once for
  the whole group -- no ``repeat_kv`` and no G-fold re-read.
* **Split-K.** A single (row, kv head) at 128k tokens is far too little parallelism for a
  132-SM GPU at batch 1, so the page list is cut into ``num_splits`` contiguous chunks,
  each a grid program writing an unnormalised partial (acc, running max, running sum);
  a tiny jnp epilogue combines them with log-sum-exp weights.
* **Gather by slot.** Pages are addressed through an int vector of slot indices
  (``page_id * page_size + offset``) and masked loads: invalid lanes (past the count, past
  the length, partial last page) are never read, are filled with 0, and their logits are
  set to -inf, so neither out-of-range memory nor garbage in unused cache slots can leak
  in. The same path serves dense decode (slot = contiguous range) so both are one kernel.
* **Empty selections** produce an all-(-inf) tile, which the finite running-max init
  (`M_INIT`) turns into exact zeros; the epilogue maps ``l == 0`` to a zero output.
* **Probabilities on request** (``return_probs``, for policies such as H2O that accumulate
  each step's attention per slot). The softmax normaliser is only known once every split
  is done, so the kernel cannot write probabilities; instead it stores the scaled logits
  (log2 units, bias included) of the tiles it already has in registers into an extra fp32
  ``[B, Hkv, G, S]`` output -- one masked scatter per tile, no second pass over K -- and the
  jnp epilogue, which combines the splits' (m, l) anyway, turns them into
  ``exp2(logit - m_all) / l_all``. Extra traffic is a write and a read of the logits plus
  the probabilities written (~3 x 4 B x Hq x S per row, about a tenth of the bf16 K/V bytes
  of a dense step at Llama-3.1-8B shapes: Hq = 4 Hkv, D = 128). Slots no split visits are
  never written, so their memory is stale; the epilogue selects them away with the read-slot
  mask rebuilt from the page lists (a scatter over pages, cheap) instead of trusting it or
  clearing the buffer first. Masked-off lanes of the scatter (padding rows of the group,
  invalid slots) are given an index one past the end: Triton never touches a masked lane,
  and interpret mode (which writes masked lanes back with their old value) drops
  out-of-bound updates, whereas a clamped, duplicated index could overwrite a real store.
  With ``return_probs=False`` the kernel and the call are exactly the plain ones.

* **Quantised caches** (int8 / float8_e4m3fn codes with power-of-two scales, `sparsekv_jax.cache`):
  the codes are loaded as they are stored (half or a quarter of the bf16 bytes) and dequantised
  in registers: a key tile is multiplied by its pages' per-channel scales (``k_scale`` ``[P, D]``,
  a gather of one row per lane, the rows of a page shared), its pages' channel zero points added
  (``k_zero``, laid out and gathered as ``k_scale``; one FMA, the product being exact) and cast
  to the query's dtype before the dot; a value's per-page scale (``v_scale`` ``[P]``) is folded
  into the probabilities (``p * v_scale[page]``) before the second dot, so the values need only a
  cast. The running softmax sums use the unscaled ``p``. That is ``dequant="tile_f32"``, the first quantised
  kernel; issue 39 measured it 2.4x *slower* than bf16 (dequantisation bound, not memory bound), so three
  static alternatives exist (``dequant=``, `DEQUANT`): one scale row per *page* broadcast to its lanes, in
  float32 (``page_f32``) or bf16 (``page_lowp``), and the key scale folded into the query per page
  (``page_q``: ``(q·s_p)·codes + q·z_p``, no key tile scaled). experiments/kvq_kernel_sweep_gpu.py picked
  ``page_lowp`` on an H200 (the default now, `TUNED`: 2.1x faster than ``tile_f32``, still 0.88-0.92x the bf16
  kernel).
  ``page_magic`` is ``page_f32`` with int8 key codes turned into float32 without the GPU's int-to-float
  instruction (I2F, a quarter of the FP32 rate on Hopper), by the bit trick of `magic_int8_to_f32`: integer
  ALU ops and one full-rate FADD, the same numbers bit for bit (issue 39; untimed yet). Value codes take the
  trick only for float32 queries: Triton lowers int8 -> bf16 without I2F already (packed ``prmt`` / ``and``
  / ``sub.bf16x2``, seen in the PTX of an H100-target compile), which is also why ``page_lowp``'s PTX holds
  no I2F at all, while ``page_f32``'s key conversion is one I2F per element.

* **Page pool** (``page_table=``, issue 38, docs/PAGE_POOL.md): K/V, bias and scales are one pool of
  head-free pages ``[N, ps, …]``; each (row, kv head) has a page table ``[M]`` and its own length. The
  same kernel (flag ``pooled``) computes *logical* slots as above, maps each lane's page through the
  table (one more int load per lane) and loads at ``phys·ps + lane % ps``; probabilities are stored at
  the logical slot. A separate static branch: the uniform call traces as before. Timed on an H200
  (jax 0.11.2, Llama-3.1-8B heads, batch 8): 1.08-1.32x the uniform kernel dense at 32k, 1.01-1.07x at
  128k. The PTX of an H100-target compile shows why: the uniform loop issues tile ``j + 1``'s K/V copies
  (``cp.async``) straight after tile ``j``'s dots, the pool loop first waits there on that tile's table
  loads (an L2 round trip per tile), and ptxas gives it 98 registers against 80, so an SM holds two of its
  programs instead of three -- in a loop that keeps one tile in flight per program, a third fewer bytes in
  flight. ``pool_variant=`` (`POOL_VARIANTS`; `default_pool_variant`): ``"ahead1"`` looks the table up once per
  *page*, one tile ahead, carried by the loop: 80 registers, three programs per SM, as the uniform kernel;
  ``"ahead2"`` two tiles ahead, so the K/V copies depend on no load of their own iteration, but at 128
  registers (160 listed); ``"lanes"``, the first kernel. Timed on an H200 (experiments/pool_decode_gpu.py,
  2026-11-27): ``"ahead1"`` is the faster reading every page, ``"lanes"`` reading listed pages.

Backend: Pallas' Triton lowering with explicit compiler params; ``interpret=True`` runs
the same kernel on CPU for tests. A Mosaic GPU version can replace `_decode_call` behind
the same signature.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from sparsekv_jax.pallas._common import (
    LOG2E,
    M_INIT,
    TARGET_PROGRAMS,
    cdiv,
    fit_stages,
    next_pow2,
    triton_params,
)
from sparsekv_jax.pallas.validation import check_decode_args, check_pool_decode_args, is_concrete

__all__ = ["DEQUANT", "POOL_VARIANTS", "decode_attention", "decode_attention_reference", "decode_plan",
           "default_pool_variant",
           "magic_int8_to_f32", "pool_slot_mask"]

#: `decode_attention`'s ways of dequantising a quantised cache's keys (``dequant=``; see its docstring).
DEQUANT = ("tile_f32", "page_f32", "page_lowp", "page_q", "page_magic")
#: pool mode's ways of finding a tile's pool slots (``pool_variant=``; `default_pool_variant` picks one).
POOL_VARIANTS = ("ahead1", "lanes", "ahead2")


def default_pool_variant(page_ids: jax.Array | None) -> str:
    """Pool mode's ``pool_variant`` when none is given, by what an H200 measured (2026-11-27,
    docs/PAGE_POOL.md step 1): ``"ahead1"`` reading every page (dense: 1.04-1.05x the uniform kernel at
    32k against ``"lanes"``' 1.06-1.08x), ``"lanes"`` reading listed pages (at 128k, 25% of pages:
    1.05-1.06x against ``"ahead1"``'s 1.21-1.33x)."""
    return "ahead1" if page_ids is None else "lanes"
# (block_k, num_warps, num_stages, dequant) by cache storage: bf16 the 12-point grid of
# experiments/diary/BENCHMARKS_DIARY.md; int8 / fp8 the fastest screened configs of
# experiments/kvq_kernel_sweep_gpu.py on an H200 (2026-11-27, docs/results/kvq_sweep_h200_2026-11-27: int8 dense
# 32k batch 8 310-314 us against 553-566 for the first quantised kernel's tile_f32 at its best tiles)
TUNED = {"bfloat16": (128, 8, 3, "tile_f32"), "int8": (64, 4, 3, "page_lowp"),
         "float8_e4m3fn": (32, 4, 3, "page_lowp")}


# float32 bits 0x4B000000 are 2^23, whose ulp is 1: 0x4B000000 | u (u < 2^23) is exactly 2^23 + u
_MAGIC_BITS = 0x4B000080  # 2^23 + 128, as float32 bits
_MAGIC = 8388736.0  # 2^23 + 128


def magic_int8_to_f32(codes: jax.Array) -> jax.Array:
    """int8 ``codes`` as float32, exactly, without an int-to-float conversion (``dequant="page_magic"``).

    For a code ``c`` in [-128, 127], ``int32(c) + 0x4B000080`` has the float32 bits ``0x4B000000 | (c + 128)``
    (``c + 128`` in [0, 255] never carries past bit 8): the float ``2^23 + c + 128``, exact because floats
    in [2^23, 2^24) are the integers. Subtracting ``2^23 + 128`` is exact as well (both operands are
    integers below 2^24; so is their difference), so the result is ``float32(c)`` bit for bit -- a sign
    extension, an integer add, a bitcast (free) and one FADD, where ``codes.astype(float32)`` is one I2F
    (``cvt.rn.f32.s8``), a quarter of the FP32 rate on Hopper. A scale must multiply the *result*: folding
    the ``- (2^23 + 128)`` into a zero point (``f·s + (z - (2^23 + 128)·s)``) would round ``f·s`` or that
    constant and lose bit-identity.
    """
    if codes.dtype != jnp.int8:
        raise ValueError(f"magic_int8_to_f32 converts int8 codes, got {codes.dtype}")
    bits = codes.astype(jnp.int32) + jnp.int32(_MAGIC_BITS)
    return lax.bitcast_convert_type(bits, jnp.float32) - jnp.float32(_MAGIC)


def tuned(k_dtype: Any, block_k: int | None = None, num_warps: int | None = None, num_stages: int | None = None,
          dequant: str | None = None) -> tuple[int, int, int, str]:
    """``(block_k, num_warps, num_stages, dequant)``: the given ones, the rest `TUNED`'s for a cache of
    ``k_dtype`` (codes int8 / float8_e4m3fn, or any float dtype: the bf16 row)."""
    name = jnp.dtype(k_dtype).name
    row = TUNED.get(name, TUNED["bfloat16"])
    given = (block_k, num_warps, num_stages, dequant)
    return tuple(row[i] if given[i] is None else given[i] for i in range(4))  # type: ignore[return-value]


def decode_plan(num_listed_pages: int, page_size: int, batch: int, kv_heads: int, *,
                block_k: int = 128, num_splits: int | None = None) -> tuple[int, int, int]:
    """Static tiling for one decode call: ``(pages_per_block, num_splits, pages_per_split)``.

    ``block_k`` slots are processed per loop iteration (whole pages, at least one page).
    Splits are chosen so that ``batch * kv_heads * num_splits`` approaches
    `TARGET_PROGRAMS` without giving any split less than one tile of work.
    """
    ppb = max(1, block_k // page_size)
    n_blocks = max(1, cdiv(num_listed_pages, ppb))
    if num_splits is None:
        num_splits = cdiv(TARGET_PROGRAMS, batch * kv_heads)
    num_splits = max(1, min(num_splits, n_blocks))
    blocks_per_split = cdiv(n_blocks, num_splits)
    num_splits = cdiv(n_blocks, blocks_per_split)
    return ppb, num_splits, blocks_per_split * ppb


def listed_chunk(split: jax.Array, count: jax.Array, ppb: int, num_splits: int) -> tuple[jax.Array, jax.Array]:
    """``(start, end)``: the entries of a page list that program ``split`` of ``num_splits`` reads, of the
    ``count`` listed (``[0, count)`` in equal runs of whole ``ppb``-page tiles, the last run shorter or empty).

    By the count, not the list's static width: a policy that pads its list to every page and reads a quarter
    of them (Quest, CHESS) would otherwise leave three quarters of the splits idle and make the first ones
    walk several tiles each, the critical path of a decode step at batch 1."""
    per_split = lax.div(lax.div(count + ppb - 1, ppb) + num_splits - 1, num_splits) * ppb
    start = split * per_split
    return start, jnp.minimum(start + per_split, count)


def _decode_kernel(*refs: jax.Array, dense: bool, has_bias: bool, stacked: bool, page_size: int, ppb: int,
                   pages_per_split: int, num_splits: int, qk_scale: float, f32_dot: bool, block_h: int,
                   store_logits: bool, quantized: bool = False, has_zero: bool = False, pooled: bool = False,
                   dequant: str = "tile_f32", pool_variant: str = "lanes") -> None:
    """One program = one (row b, kv head h, split s): online softmax over its chunk.

    With ``store_logits`` it also writes each valid slot's scaled logit (log2 units, bias
    included) to ``logit_ref`` ``[G, S]``, which the splits of one (row, kv head) share: each
    writes only the slots it read, with a masked scatter, so the splits never race (the page
    lists are duplicate-free and the splits partition them).

    With ``pooled`` (page pool, issue 38) ``k_ref``/``v_ref`` are the whole pool ``[N·ps, D]``, the
    lengths are per (row, kv head), and a ``table_ref`` ``[M]`` (this head's page table) follows them:
    the slots the dense / listed branches compute are *logical*, each lane's page is mapped through
    the table (sentinel or out-of-range entries read nothing) and the loads use the physical slot;
    the logits are stored at the logical slot. ``pool_variant`` (`POOL_VARIANTS`; bf16 and
    ``"tile_f32"`` only): ``"lanes"`` maps each lane in the tile that reads it (`lanes`); ``"ahead1"`` /
    ``"ahead2"`` map a tile's pages (`tile_pages`) one / two tiles ahead and carry them (`body_ahead`).

    ``dequant`` (quantised caches only, `DEQUANT`): how a key tile is dequantised. ``"tile_f32"``
    gathers the scales (and zero points) once per *lane* as ``[block_k, D]`` tiles and works in float32;
    ``"page_f32"`` / ``"page_lowp"`` load one scale row per *page* (``[ppb, D]``), broadcast it to the
    page's lanes and work in float32 / in q's dtype (bf16 queries only: ``code·scale`` is exact there
    and the zero point's sum rounds once, as the float32 sum cast to bf16 does); ``"page_q"`` folds the
    key scale into the query instead: per page ``p`` of the tile, ``q·s_p`` ``[block_h, D]`` meets the
    page's raw codes (exact in q's dtype) in one small dot, and the zero point adds ``q·z_p`` to the
    page's logits, so no key tile is ever scaled. The page-wise variants also cast the value codes
    straight to q's dtype. ``"page_magic"`` is ``"page_f32"`` with int8 key codes (and value codes, for float32
    queries) converted by `magic_int8_to_f32` instead of an int-to-float instruction (the same float32
    numbers, so the same output bit for bit); with float8 codes it is ``"page_lowp"`` (the very same program).
    """
    it = iter(refs)
    q_ref, k_ref, v_ref, len_ref = next(it), next(it), next(it), next(it)
    # Stacked caches ([L, ...]): this program's block spans every layer and the layer is picked
    # here, from a runtime index, so the caller never slices (copies) one layer out of the stack.
    # It is a broadcasting int array, like the other indices (interpret mode needs all-array gathers).
    layer = jnp.full((1, 1), next(it)[0], jnp.int32) if stacked else None
    table_ref = next(it) if pooled else None
    cnt_ref = ids_ref = bias_ref = None
    if not dense:
        cnt_ref, ids_ref = next(it), next(it)
    if has_bias:
        bias_ref = next(it)
    ks_ref, vs_ref = (next(it), next(it)) if quantized else (None, None)
    kz_ref = next(it) if has_zero else None
    o_ref, m_ref, l_ref = next(it), next(it), next(it)
    logit_ref = next(it) if store_logits else None

    if dequant == "page_magic" and k_ref.dtype != jnp.int8:  # the bit trick is for int8 codes: fp8 as page_lowp
        dequant = "page_lowp"
    magic = dequant == "page_magic"
    b, h, s = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    group, head_dim = q_ref.shape[-2:]
    block_k = ppb * page_size
    length = len_ref[b, h] if pooled else len_ref[b]
    n_pool = k_ref.shape[0] // page_size if pooled else None  # pool pages N; N is the table's sentinel
    lane = jnp.arange(block_k, dtype=jnp.int32)
    cols = jnp.arange(head_dim, dtype=jnp.int32)[None, :]
    # The G query heads of this kv head, padded in registers (masked rows) to block_h >= 16,
    # the smallest Triton dot tile -- no padded copy of q in HBM, no extra launch.
    q_rows = jnp.arange(block_h, dtype=jnp.int32)[:, None]
    q = plgpu.load(q_ref.at[b, h, jnp.minimum(q_rows, group - 1), cols], mask=q_rows < group, other=0.0)
    precision = lax.Precision.HIGHEST if f32_dot else None

    if dense:
        start = s * (pages_per_split * page_size)
        end = jnp.minimum(start + pages_per_split * page_size, length)
        n_iter = lax.div(jnp.maximum(end - start, 0) + block_k - 1, block_k)
    else:
        start, end = listed_chunk(s, cnt_ref[b, h], ppb, num_splits)
        n_iter = lax.div(jnp.maximum(end - start, 0) + ppb - 1, ppb)

    def lanes(j: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Tile ``j``'s lanes ``(slot, valid, logical)`` the per-lane way (pool mode: each lane's page looked
        up in the table in this tile, ``pool_variant="lanes"``); ``logical``: the slot before the table."""
        if dense:
            slot = start + j * block_k + lane
            valid = slot < end
        else:
            entry = start + j * ppb + lane // page_size  # list entry of each lane
            e_valid = entry < end  # end <= count <= K: lanes past the list are never read
            page = plgpu.load(ids_ref.at[jnp.where(e_valid, entry, 0)], mask=e_valid, other=0)
            slot = page * page_size + lane % page_size
            valid = e_valid & (slot < length)
        if pooled:  # slot is logical: its page goes through this head's table (one int load per lane)
            logical = slot
            # within the table (unchecked under jit: a length past M·ps, a listed id >= M) or nothing is read
            valid = valid & (slot < table_ref.shape[0] * page_size)
            lpage = jnp.where(valid, slot // page_size if dense else page, 0)
            phys = plgpu.load(table_ref.at[lpage], mask=valid, other=n_pool)
            valid = valid & (phys >= 0) & (phys < n_pool)  # "no page" (the sentinel N) reads nothing
            slot = phys * page_size + lane % page_size
        slot = jnp.where(valid, slot, 0)
        return slot, valid, logical if pooled else slot

    def body(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        return attend(carry, *lanes(j))

    def attend(carry: tuple[jax.Array, jax.Array, jax.Array], slot: jax.Array, valid: jax.Array,
               logical: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One tile of the online softmax over the lanes ``slot`` (physical, 0 where not ``valid``)."""
        acc, m_prev, l_prev = carry
        # Index with two broadcasting int arrays (not ``slot, :``): interpret mode only
        # discharges all-array gathers, and Triton sees the column iota as contiguous.
        rows = slot[:, None]
        at = (layer, rows, cols) if stacked else (rows, cols)
        # quantised codes load without a fill (Triton cannot cast a scalar fill to float8) and are
        # zeroed after the cast: a masked lane may hold anything, a NaN code included
        other = None if quantized else 0.0
        kt = plgpu.load(k_ref.at[at], mask=valid[:, None], other=other)
        vt = plgpu.load(v_ref.at[at], mask=valid[:, None], other=other)
        if quantized:  # dequantise in registers: keys by their pages' channel scales, values' scale into p
            pg = slot // page_size
            at_s = (layer, pg[:, None], cols) if stacked else (pg[:, None], cols)
            ks = plgpu.load(ks_ref.at[at_s], mask=valid[:, None], other=0.0).astype(jnp.float32)
            kt = kt.astype(jnp.float32) * ks
            if kz_ref is not None:  # + the pages' channel zero points (one FMA: the product is exact)
                kt = kt + plgpu.load(kz_ref.at[at_s], mask=valid[:, None], other=0.0).astype(jnp.float32)
            kt = jnp.where(valid[:, None], kt, 0.0).astype(q.dtype)
            at_v = (layer[0], pg) if stacked else (pg,)
            v_scale = plgpu.load(vs_ref.at[at_v], mask=valid, other=0.0).astype(jnp.float32)
            vt = jnp.where(valid[:, None], vt.astype(jnp.float32), 0.0).astype(q.dtype)
        logits = plgpu.dot(q, kt, trans_b=True, precision=precision) * qk_scale  # [block_h, block_k], log2 units
        logits = finish_logits(logits, slot, valid, logical)
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(logits - m_next[:, None])
        l_next = l_prev * alpha + p.sum(axis=-1)
        pw = p * v_scale[None, :] if quantized else p
        pv = plgpu.dot(pw.astype(vt.dtype), vt, precision=precision)
        return acc * alpha[:, None] + pv, m_next, l_next

    def pool_lanes(lpage: jax.Array, page: jax.Array, ok: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Pool mode, ``pool_variant="ahead*"``: a tile's lanes ``(slot, valid, logical)`` from its ``ppb``
        pages as `tile_pages` gives them (one table entry per page, not per lane), broadcast to their lanes."""
        to_lanes = lambda x: jnp.broadcast_to(x[:, None], (ppb, page_size)).reshape(block_k)  # noqa: E731
        in_page = lane % page_size
        logical = to_lanes(lpage) * page_size + in_page
        valid = to_lanes(ok) & (logical < length)  # dense: a read page lies below the split's end
        return jnp.where(valid, to_lanes(page) * page_size + in_page, 0), valid, logical

    def body_ahead(j: jax.Array, carry: tuple[jax.Array, ...]):
        """``pool_variant="ahead1"`` / ``"ahead2"``: tile ``j``'s lanes come in the carry (``carry[3:6]``), so
        its K/V loads wait on no table load of this iteration. ``ahead1`` looks tile ``j + 1``'s pages up
        here; ``ahead2`` carries tile ``j + 1``'s pages too (``carry[6:9]``), turns them into lanes here and
        looks up tile ``j + 2``'s. Past the chunk nothing is valid and nothing is read."""
        out = attend(carry[:3], *carry[3:6])
        pages = jnp.arange(ppb, dtype=jnp.int32)
        if len(carry) == 6:
            return (*out, *pool_lanes(*tile_pages(j + 1, pages)))
        return (*out, *pool_lanes(*carry[6:9]), *tile_pages(j + 2, pages))

    def finish_logits(logits: jax.Array, slot: jax.Array, valid: jax.Array, logical: jax.Array) -> jax.Array:
        """A tile's scaled logits ``[block_h, n]``: + bias, -inf where not ``valid``, stored (``return_probs``)
        at the ``logical`` slots; ``slot``: the physical slots (the bias is read there)."""
        if bias_ref is not None:
            at = (layer[0], slot) if stacked else (slot,)
            bias = plgpu.load(bias_ref.at[at], mask=valid, other=0.0).astype(jnp.float32)
            logits = logits + (bias * LOG2E)[None, :]
        logits = jnp.where(valid[None, :], logits, -jnp.inf)
        if logit_ref is not None:
            # Masked-off lanes (padding rows, invalid slots) get an index one past the end: Triton
            # never touches a masked lane, and interpret mode, which writes masked lanes back with
            # their old value, drops out-of-bound updates -- a clamped (duplicate) index there
            # could overwrite a real lane's store with the stale value.
            keep = (q_rows < group) & valid[None, :]
            rows_out = jnp.where(q_rows < group, q_rows, group)
            slots_out = jnp.where(valid, logical, logit_ref.shape[-1])[None, :]
            plgpu.store(logit_ref.at[rows_out, slots_out], logits, mask=keep)
        return logits

    def tile_pages(j: jax.Array, idx: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Pages ``idx`` (int array, positions within tile ``j``) of this program's chunk, computed once per
        page (not per lane): ``(logical page, physical page (0 where not read), read)``."""
        if dense:
            lpage = s * pages_per_split + j * ppb + idx
            ok = lpage * page_size < end
        else:
            entry = start + j * ppb + idx
            ok = entry < end
            lpage = plgpu.load(ids_ref.at[jnp.where(ok, entry, 0)], mask=ok, other=0)
            ok = ok & (lpage * page_size < length)  # a listed page wholly past the length reads nothing
        if pooled:
            ok = ok & (lpage < table_ref.shape[0])
            phys = plgpu.load(table_ref.at[jnp.where(ok, lpage, 0)], mask=ok, other=n_pool)
            ok = ok & (phys >= 0) & (phys < n_pool)
        else:
            phys = lpage
        return lpage, jnp.where(ok, phys, 0), ok

    def page_lanes(idx: jax.Array, j: jax.Array):
        """Tile ``j``'s pages ``idx`` ``[n]`` and their ``n·ps`` lanes: pages, read flags, the lanes' logical
        and physical slots (0 where not read), valid lanes and the codes ``[n·ps, D]`` of K and V."""
        n = idx.shape[0]
        lpage, page, ok = tile_pages(j, idx)
        to_lanes = lambda x: jnp.broadcast_to(x[:, None], (n, page_size)).reshape(n * page_size)  # noqa: E731
        in_page = jnp.arange(n * page_size, dtype=jnp.int32) % page_size
        logical = to_lanes(lpage) * page_size + in_page
        valid = to_lanes(ok) & (logical < length)
        slot = jnp.where(valid, to_lanes(page) * page_size + in_page, 0)
        at = (layer, slot[:, None], cols) if stacked else (slot[:, None], cols)
        kt = plgpu.load(k_ref.at[at], mask=valid[:, None], other=None)
        vt = plgpu.load(v_ref.at[at], mask=valid[:, None], other=None)
        # the values' codes straight to q's dtype (exact), zeroed where not read (a masked lane may hold a
        # NaN code); a key lane not read only spoils its own logit, which finish_logits sets to -inf.
        # page_magic: by the bit trick to float32 only: Triton's int8 -> bf16 / f16 is no I2F already
        vt = jnp.where(valid[:, None], (magic_int8_to_f32(vt) if magic and q.dtype == jnp.float32 else vt).astype(
            q.dtype), 0.0)
        at_p = (layer, page[:, None], cols) if stacked else (page[:, None], cols)
        ks = plgpu.load(ks_ref.at[at_p], mask=ok[:, None], other=0.0)  # [n, D]: one row per page
        kz = None if kz_ref is None else plgpu.load(kz_ref.at[at_p], mask=ok[:, None], other=0.0)
        vs = plgpu.load(vs_ref.at[(layer[0], page) if stacked else (page,)], mask=ok, other=0.0).astype(jnp.float32)
        return to_lanes, logical, slot, valid, kt, vt, ks, kz, vs

    def body_pages(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        """``dequant="page_f32"/"page_lowp"/"page_magic"``: one scale (and zero-point) row per page, broadcast
        to lanes; ``page_magic``: float32 math, the codes converted by `magic_int8_to_f32`."""
        acc, m_prev, l_prev = carry
        to_lanes, logical, slot, valid, kt, vt, ks, kz, vs = page_lanes(jnp.arange(ppb, dtype=jnp.int32), j)
        mdt = q.dtype if dequant == "page_lowp" and q.dtype == jnp.bfloat16 else jnp.float32  # the math dtype
        wide = lambda x: jnp.broadcast_to(x.astype(mdt)[:, None, :], (ppb, page_size, head_dim)).reshape(  # noqa
            block_k, head_dim)
        kt = (magic_int8_to_f32(kt) if magic else kt.astype(mdt)) * wide(ks)  # magic: astype's float32 codes
        if kz is not None:
            kt = kt + wide(kz)
        logits = plgpu.dot(q, kt.astype(q.dtype), trans_b=True, precision=precision) * qk_scale
        logits = finish_logits(logits, slot, valid, logical)
        m_next = jnp.maximum(m_prev, logits.max(axis=-1))
        alpha = jnp.exp2(m_prev - m_next)
        p = jnp.exp2(logits - m_next[:, None])
        l_next = l_prev * alpha + p.sum(axis=-1)
        pv = plgpu.dot((p * to_lanes(vs)[None, :]).astype(q.dtype), vt, precision=precision)
        return acc * alpha[:, None] + pv, m_next, l_next

    def body_q(j: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        """``dequant="page_q"``: per page of the tile (a static loop of ``ppb``), the key scale folded into
        the query and the zero point added to the logits; the softmax spans the whole tile."""
        acc, m_prev, l_prev = carry
        qf = q.astype(jnp.float32)
        parts = []
        for i in range(ppb):
            _, logical, slot, valid, kt, vt, ks, kz, vs = page_lanes(jnp.full((1,), i, jnp.int32), j)
            qs = (qf * ks.astype(jnp.float32)).astype(q.dtype)  # [block_h, D]; exact: power-of-two scales
            logits = plgpu.dot(qs, kt.astype(q.dtype), trans_b=True, precision=precision)  # [block_h, ps]
            if kz is not None:  # + q . z_p: the page's zero points meet the query once, not per key
                logits = logits + (qf * kz.astype(jnp.float32)).sum(axis=-1)[:, None]
            parts.append((finish_logits(logits * qk_scale, slot, valid, logical), vt, vs))
        m_next = m_prev
        for logits, _, _ in parts:
            m_next = jnp.maximum(m_next, logits.max(axis=-1))
        alpha = jnp.exp2(m_prev - m_next)
        l_next, out = l_prev * alpha, acc * alpha[:, None]
        for logits, vt, vs in parts:
            p = jnp.exp2(logits - m_next[:, None])
            l_next = l_next + p.sum(axis=-1)
            out = out + plgpu.dot((p * vs[None, :]).astype(q.dtype), vt, precision=precision)
        return out, m_next, l_next

    init = (jnp.zeros((block_h, head_dim), jnp.float32),
            jnp.full((block_h,), M_INIT, jnp.float32),
            jnp.zeros((block_h,), jnp.float32))
    if quantized and dequant != "tile_f32":
        acc, m, l = lax.fori_loop(0, n_iter, body_q if dequant == "page_q" else body_pages, init)
    elif pooled and pool_variant != "lanes":
        pages = jnp.arange(ppb, dtype=jnp.int32)
        ahead = [*pool_lanes(*tile_pages(jnp.int32(0), pages))]
        if pool_variant == "ahead2":
            ahead += tile_pages(jnp.int32(1), pages)
        acc, m, l, *_ = lax.fori_loop(0, n_iter, body_ahead, (*init, *ahead))
    else:
        acc, m, l = lax.fori_loop(0, n_iter, body, init)
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


@functools.partial(jax.jit, static_argnames=(
    "page_size", "scale", "interpret", "block_k", "num_splits", "num_warps", "num_stages", "return_probs",
    "dequant", "pool_variant"))
def _decode_call(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array,
                 page_ids: jax.Array | None, page_counts: jax.Array | None, bias: jax.Array | None,
                 layer: jax.Array | None, k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                 k_zero: jax.Array | None = None, page_table: jax.Array | None = None, *,
                 page_size: int, scale: float, interpret: bool, block_k: int,
                 num_splits: int | None, num_warps: int, num_stages: int,
                 return_probs: bool = False, dequant: str = "tile_f32",
                 pool_variant: str = "ahead1") -> jax.Array | tuple[jax.Array, jax.Array]:
    B, Hq, D = q.shape
    pooled = page_table is not None
    if pooled:  # k, v: the pool [N, ps, D]; S: the logical slots of a head, M pages (the probabilities' width)
        Hkv, S = page_table.shape[1], page_table.shape[2] * page_size
    else:
        Hkv, S = k.shape[-3], k.shape[-2]
    stacked = layer is not None
    L = k.shape[0] if stacked else None
    G = Hq // Hkv
    block_h = max(16, next_pow2(G))
    dense = page_ids is None
    n_listed = S // page_size if dense else page_ids.shape[-1]
    ppb, n_splits, pps = decode_plan(n_listed, page_size, B, Hkv, block_k=block_k, num_splits=num_splits)

    qg = q.reshape(B, Hkv, G, D)  # free: heads of a group are adjacent
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))  # noqa: E731
    if pooled:
        return _decode_call_pool(qg, k, v, lengths, page_table, page_ids, page_counts, bias, k_scale, v_scale,
                                 k_zero, page_size=page_size, scale=scale, interpret=interpret, ppb=ppb,
                                 n_splits=n_splits, pps=pps, num_warps=num_warps, num_stages=num_stages,
                                 return_probs=return_probs, dequant=dequant, pool_variant=pool_variant)
    args = [qg, k, v, lengths.astype(jnp.int32)]
    if stacked:  # the block holds this (row, head) of every layer; the kernel picks the layer
        kv_spec = pl.BlockSpec((L, None, None, S, D), lambda b, h, s: (0, b, h, 0, 0))
    else:
        kv_spec = pl.BlockSpec((None, None, S, D), lambda b, h, s: (b, h, 0, 0))
    in_specs = [full((B, Hkv, G, D)), kv_spec, kv_spec, full((B,))]
    if stacked:
        args.append(jnp.reshape(layer, (1,)).astype(jnp.int32))
        in_specs.append(full((1,)))
    counts = None
    if not dense:
        K = page_ids.shape[-1]
        counts = (jnp.full((B, Hkv), K, jnp.int32) if page_counts is None
                  else page_counts.astype(jnp.int32))
        args += [counts, page_ids.astype(jnp.int32)]
        in_specs += [full((B, Hkv)), pl.BlockSpec((None, None, K), lambda b, h, s: (b, h, 0))]
    if bias is not None:
        args.append(bias.astype(jnp.float32))
        in_specs.append(pl.BlockSpec((L, None, None, S), lambda b, h, s: (0, b, h, 0)) if stacked
                        else pl.BlockSpec((None, None, S), lambda b, h, s: (b, h, 0)))
    quantized = k_scale is not None
    if quantized:
        P = S // page_size
        args += [k_scale, v_scale]
        if stacked:
            in_specs += [pl.BlockSpec((L, None, None, P, D), lambda b, h, s: (0, b, h, 0, 0)),
                         pl.BlockSpec((L, None, None, P), lambda b, h, s: (0, b, h, 0))]
        else:
            in_specs += [pl.BlockSpec((None, None, P, D), lambda b, h, s: (b, h, 0, 0)),
                         pl.BlockSpec((None, None, P), lambda b, h, s: (b, h, 0))]
        if k_zero is not None:
            args.append(k_zero)
            in_specs.append(in_specs[-2])  # laid out as k_scale

    # a quantised tile is dequantised to q's dtype before the dots: Triton stages that copy in shared
    # memory too (an int8 cache with fp32 queries asked 270 KB of an H200's 227 KB at 3 stages)
    staged = k.dtype.itemsize + (q.dtype.itemsize if quantized else 0)
    num_stages = fit_stages(num_stages, 2 * ppb * page_size * D * staged)
    kernel = functools.partial(
        _decode_kernel, dense=dense, has_bias=bias is not None, stacked=stacked, page_size=page_size, ppb=ppb,
        pages_per_split=pps, num_splits=n_splits, qk_scale=scale * LOG2E, f32_dot=q.dtype == jnp.float32,
        block_h=block_h,
        store_logits=return_probs, quantized=quantized, has_zero=k_zero is not None,
        **({"dequant": dequant} if quantized else {}))
    out_specs = [
        pl.BlockSpec((None, None, None, block_h, D), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
        pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((B, Hkv, n_splits, block_h, D), jnp.float32),
        jax.ShapeDtypeStruct((B, Hkv, n_splits, block_h), jnp.float32),
        jax.ShapeDtypeStruct((B, Hkv, n_splits, block_h), jnp.float32),
    ]
    if return_probs:  # every split of a (row, kv head) maps to the same [G, S] block of logits
        out_specs.append(pl.BlockSpec((None, None, G, S), lambda b, h, s: (b, h, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, Hkv, G, S), jnp.float32))
    o, m, l, *logits = pl.pallas_call(
        kernel,
        grid=(B, Hkv, n_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="sparsekv_decode",
    )(*args)

    return _combine_splits(o, m, l, logits, G, q.dtype, lambda: selected_slot_mask(
        lengths, S, Hkv, page_size=page_size, page_ids=page_ids, page_counts=counts))


def _decode_call_pool(qg: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, page_table: jax.Array,
                      page_ids: jax.Array | None, page_counts: jax.Array | None, bias: jax.Array | None,
                      k_scale: jax.Array | None, v_scale: jax.Array | None, k_zero: jax.Array | None, *,
                      page_size: int, scale: float, interpret: bool, ppb: int, n_splits: int, pps: int,
                      num_warps: int, num_stages: int, return_probs: bool, dequant: str = "tile_f32",
                      pool_variant: str = "ahead1") -> jax.Array | tuple[jax.Array, jax.Array]:
    """`_decode_call`'s page-pool branch (traced inside its ``jit``): the same kernel over the whole
    pool, its slots mapped through ``page_table`` ``[B, Hkv, M]``. Its own function so that the
    uniform branch traces exactly as before the pool existed."""
    B, Hkv, G, D = qg.shape
    N, M = k.shape[0], page_table.shape[-1]
    block_h = max(16, next_pow2(G))
    full = lambda shape: pl.BlockSpec(shape, lambda b, h, s: (0,) * len(shape))  # noqa: E731
    head = lambda n: pl.BlockSpec((None, None, n), lambda b, h, s: (b, h, 0))  # noqa: E731
    # the block of every pool leaf is the whole pool (a head's pages lie anywhere in it): free reshapes
    args = [qg, k.reshape(N * page_size, D), v.reshape(N * page_size, D), lengths.astype(jnp.int32),
            page_table.astype(jnp.int32)]
    in_specs = [full((B, Hkv, G, D)), full((N * page_size, D)), full((N * page_size, D)), full((B, Hkv)), head(M)]
    dense = page_ids is None
    counts = None
    if not dense:
        K = page_ids.shape[-1]
        counts = (jnp.full((B, Hkv), K, jnp.int32) if page_counts is None
                  else page_counts.astype(jnp.int32))
        args += [counts, page_ids.astype(jnp.int32)]
        in_specs += [full((B, Hkv)), head(K)]
    if bias is not None:
        args.append(bias.astype(jnp.float32).reshape(N * page_size))
        in_specs.append(full((N * page_size,)))
    quantized = k_scale is not None
    if quantized:
        args += [k_scale, v_scale]
        in_specs += [full((N, D)), full((N,))]
        if k_zero is not None:
            args.append(k_zero)
            in_specs.append(full((N, D)))
    staged = k.dtype.itemsize + (qg.dtype.itemsize if quantized else 0)
    num_stages = fit_stages(num_stages, 2 * ppb * page_size * D * staged)
    kernel = functools.partial(
        _decode_kernel, dense=dense, has_bias=bias is not None, stacked=False, page_size=page_size, ppb=ppb,
        pages_per_split=pps, num_splits=n_splits, qk_scale=scale * LOG2E, f32_dot=qg.dtype == jnp.float32,
        block_h=block_h,
        store_logits=return_probs, quantized=quantized, has_zero=k_zero is not None, pooled=True,
        dequant=dequant, pool_variant=pool_variant)
    S = M * page_size  # a head's logical slots
    out_specs = [
        pl.BlockSpec((None, None, None, block_h, D), lambda b, h, s: (b, h, s, 0, 0)),
        pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
        pl.BlockSpec((None, None, None, block_h), lambda b, h, s: (b, h, s, 0)),
    ]
    out_shape = [
        jax.ShapeDtypeStruct((B, Hkv, n_splits, block_h, D), jnp.float32),
        jax.ShapeDtypeStruct((B, Hkv, n_splits, block_h), jnp.float32),
        jax.ShapeDtypeStruct((B, Hkv, n_splits, block_h), jnp.float32),
    ]
    if return_probs:  # logits at *logical* slots: [G, M·ps] per (row, kv head), as the uniform [G, S]
        out_specs.append(pl.BlockSpec((None, None, G, S), lambda b, h, s: (b, h, 0, 0)))
        out_shape.append(jax.ShapeDtypeStruct((B, Hkv, G, S), jnp.float32))
    o, m, l, *logits = pl.pallas_call(
        kernel,
        grid=(B, Hkv, n_splits),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=triton_params(num_warps, num_stages),
        interpret=interpret,
        name="sparsekv_decode_pool",
    )(*args)
    return _combine_splits(o, m, l, logits, G, qg.dtype, lambda: pool_slot_mask(
        lengths, page_table, N, page_size=page_size, page_ids=page_ids, page_counts=counts))


def _combine_splits(o: jax.Array, m: jax.Array, l: jax.Array, logits: list[jax.Array], G: int, dtype: Any,
                    read_mask: Any) -> jax.Array | tuple[jax.Array, jax.Array]:
    """The jnp epilogue of a decode call: the splits' partials ``o [B, Hkv, n, block_h, D]``, ``m``,
    ``l`` ``[B, Hkv, n, block_h]`` combined into ``[B, Hkv·G, D]`` in ``dtype``; with stored
    ``logits`` (``[[B, Hkv, G, S]]``, ``return_probs``) also the probabilities ``[B, Hkv·G, S]``,
    ``read_mask()`` giving the ``[B, Hkv, S]`` slots some split read (built only then)."""
    B, Hkv, _, _, D = o.shape
    # Log-sum-exp combine of the splits (m is in log2 units). Rows/heads where nothing was
    # selected have l == 0 in every split and come out as exact zeros.
    m_all = m.max(axis=2, keepdims=True)
    w = jnp.exp2(m - m_all)
    l_all = (l * w).sum(axis=2)
    acc = (o * w[..., None]).sum(axis=2)
    out = jnp.where(l_all[..., None] > 0, acc / jnp.where(l_all > 0, l_all, 1.0)[..., None], 0.0)
    out = out[:, :, :G].reshape(B, Hkv * G, D).astype(dtype)
    if not logits:
        return out
    # Probabilities from the stored logits and the combined (m, l): the same softmax as the
    # output. Slots no split read hold whatever the buffer held (NaN in interpret mode, stale
    # memory on the GPU), so the read-slot mask -- rebuilt from the page lists by a scatter over
    # pages, O(B Hkv K) -- selects them away before any arithmetic touches them.
    read = read_mask()
    S = read.shape[-1]
    m_g = m_all[:, :, 0, :G, None]  # [B, Hkv, G, 1], log2 units
    l_g = l_all[:, :, :G, None]
    ok = read[:, :, None, :] & (l_g > 0)  # l == 0: nothing (or only -inf bias) read -> zeros
    probs = jnp.exp2(jnp.where(ok, logits[0] - m_g, -jnp.inf)) / jnp.where(l_g > 0, l_g, 1.0)
    return out, probs.reshape(B, Hkv * G, S)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *, page_size: int,
                     page_ids: jax.Array | None = None, page_counts: jax.Array | None = None,
                     bias: jax.Array | None = None, layer: int | jax.Array | None = None,
                     scale: float | None = None, interpret: bool = False,
                     block_k: int | None = None, num_splits: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, return_probs: bool = False, k_scale: jax.Array | None = None,
                     v_scale: jax.Array | None = None, k_zero: jax.Array | None = None,
                     page_table: jax.Array | None = None, dequant: str | None = None,
                     pool_variant: str | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """GQA decode attention over a per-(row, kv head) subset of cache pages.

    Two layouts. *Uniform* (``page_table=None``, today's cache): ``k``/``v`` ``[B, Hkv, S, D]``,
    one length per row. *Page pool* (``page_table`` given, issue 38, docs/PAGE_POOL.md): ``k``/``v``
    are one pool ``[N, ps, D]`` of head-free pages, each (row, kv head) owns the pages its table
    lists, and each has its own length; the arguments below say what changes. Pool mode is a
    separate static branch (its own kernel specialisation): the uniform call compiles exactly as
    before. On an H200 pool mode costs 1.02-1.08x the uniform kernel on the same bytes (dense and 25% of
    pages, 32k and 128k; `default_pool_variant`; migration step 1's gate is 5%, docs/PAGE_POOL.md).

    Args:
      q: ``[B, Hq, D]`` one query per row (bf16/f16/f32).
      k, v: ``[B, Hkv, S, D]`` the cache, ``S = num_pages * page_size``; same dtype as q. With
        ``layer``: ``[L, B, Hkv, S, D]``, every layer's cache (and bias ``[L, B, Hkv, S]``).
      lengths: ``[B]`` int, slots in use; slots ``>= lengths[b]`` are masked (a partial last
        page is fine). Pool mode: ``[B, Hkv]``, tokens held by each (row, kv head), at most
        ``M·ps``.
      page_size: tokens per page (a power of two; 16/32/64/128 tested).
      page_ids: ``[B, Hkv, K]`` int page indices to read, duplicate-free, any order. None means
        dense: every page below ``ceil(length / page_size)``. Pool mode: *logical* pages in
        ``[0, M)`` (the index into the head's table), the dense default per head's length.
      page_counts: ``[B, Hkv]`` int, valid entries of each list (default K). Entries past the
        count are ignored; a zero count yields a zero output for that (row, head group).
      bias: ``[B, Hkv, S]`` additive logit per slot (natural-log units), e.g. log cluster size.
        Pool mode: ``[N, ps]``, per pool slot.
      layer: int scalar (may be traced): read this layer of stacked ``k``/``v``/``bias``. A layer
        scan that carries the whole cache passes it here instead of slicing, so a decode step
        copies nothing: the kernel reads the selected pages straight from the stacked cache.
      scale: logit scale, default ``1/sqrt(D)``.
      interpret: run the Pallas kernel in interpret mode (CPU tests).
      block_k: slots per inner tile (rounded to whole pages).
      num_splits: split-K factor (default: fill ~`TARGET_PROGRAMS` programs).
      num_warps, num_stages: Triton compiler params. ``None`` (with ``block_k`` and ``dequant``): `TUNED`'s
        row for the cache's storage -- bf16 (128, 8 warps, 3 stages), the fastest of a 12-point grid on
        an H200 at L=32k/B=8 and L=128k/B=1 (experiments/diary/BENCHMARKS_DIARY.md); int8 (64, 4, 3,
        ``"page_lowp"``) and fp8 (32, 4, 3, ``"page_lowp"``), the fastest of the sweep in
        experiments/kvq_kernel_sweep_gpu.py. Stages are lowered automatically where tiles would overflow
        shared memory (float32).
      return_probs: also return the step's attention probabilities (for policies that
        accumulate them, e.g. H2O).
      k_scale, v_scale: a quantised cache (``k``/``v`` int8 or float8_e4m3fn codes): the keys'
        scales per page and channel ``[B, Hkv, P, D]`` and the values' per page ``[B, Hkv, P]``
        (``[L, ...]`` with ``layer``), any float dtype; a key is ``k * k_scale[page]``
        (`sparsekv_jax.cache`). Dequantised in registers to q's dtype.
      k_zero: with ``k_scale``, the keys' zero points per page and channel (shaped as ``k_scale``):
        a key is then ``k * k_scale[page] + k_zero[page]``, computed in float32 and cast to q's
        dtype. ``None``: 0 (symmetric codes). Pool mode: ``k_scale``/``k_zero`` ``[N, D]``, ``v_scale``
        ``[N]``, per pool page.
      page_table: pool mode: ``[B, Hkv, M]`` int, the pool page holding each logical page of a
        (row, kv head) -- one layer's tables, ``table[l]`` of the pool (``layer`` is for the
        uniform stack only). Logical slot ``t`` of (b, h) is pool slot
        ``table[b, h, t // ps]·ps + t % ps``. Entries for pages below ``ceil(lengths[b, h] / ps)``
        must lie in ``[0, N)``; the rest may be the sentinel ``N`` ("no page") or anything:
        they are never read. Under ``jit`` (no value checks) an entry outside ``[0, N)`` reads
        nothing rather than another page.
      dequant: quantised caches only (ignored otherwise): how the kernel dequantises keys, one of
        `DEQUANT`. ``"tile_f32"``: per-lane ``[block_k, D]`` scale / zero-point tiles, float32
        arithmetic (the first quantised kernel's). ``"page_f32"``: one scale row per page broadcast to
        its lanes, float32.
        ``"page_lowp"``: the same in q's dtype when q is bf16 (float32 otherwise): the same numbers,
        ``code·scale`` being exact and the zero point's sum rounding once. ``"page_q"``: the key scale
        folded into the query per page (``(q·s_p)·codes + q·z_p``), no key is scaled: the logits are
        those of the exact dequantised keys, without the reference's rounding of each key to q's dtype.
        ``"page_magic"``: ``"page_f32"`` with int8 key codes (values too for float32 queries) converted
        without the int-to-float instruction (`magic_int8_to_f32`: integer ops and one FADD), bit for bit
        ``"page_f32"``'s output; float8 codes
        fall back to ``"page_lowp"``. Untimed (issue 39: for the next GPU sweep). All give the reference's
        output to its tolerances (tests/test_pallas_decode_quant.py). ``None``: ``"page_lowp"``, the fastest
        on an H200 (`TUNED`).
      pool_variant: pool mode only (`POOL_VARIANTS`), how the bf16 / ``"tile_f32"`` kernel finds a tile's
        pool slots; the same output bit for bit, different PTX (docs/PAGE_POOL.md, step 1). ``"ahead1"``:
        one table entry per *page*, looked up one tile ahead and carried by the loop (the uniform kernel's
        registers, hence its programs per SM). ``"ahead2"``: two tiles ahead (more registers). ``"lanes"``
        (step 1's first kernel): a table entry per *lane*, looked up in the tile that reads it. ``None``:
        `default_pool_variant` (``"ahead1"`` dense, ``"lanes"`` with ``page_ids``: the faster of each on
        an H200, experiments/pool_decode_gpu.py). The page-wise ``dequant`` variants look their pages up
        per page in the tile either way.

    Returns:
      ``[B, Hq, D]`` in q's dtype; with ``return_probs`` the pair ``(out, probs)``, ``probs``
      ``[B, Hq, S]`` float32: the softmax weight (bias included) of each slot for each query
      head -- of layer ``layer`` only in stacked mode -- and exactly 0 for every slot not read
      (not in a listed page, at or past the length). Rows with nothing read are all zero. Pool
      mode: ``probs`` ``[B, Hq, M·ps]`` at *logical* slots (the uniform layout's slot order).

    Raises:
      ValueError: on bad shapes/dtypes, and (for concrete arrays) ids out of range, counts
        beyond the list, duplicate ids, lengths out of range.
    """
    block_k, num_warps, num_stages, dequant = tuned(k.dtype, block_k, num_warps, num_stages, dequant)
    if page_table is None and pool_variant is not None:
        raise ValueError(f"pool_variant={pool_variant!r} is for pool mode (page_table=) only")
    if page_table is not None:
        return _decode_attention_pool(q, k, v, lengths, page_table, page_size=page_size, page_ids=page_ids,
                                      page_counts=page_counts, bias=bias, layer=layer, scale=scale,
                                      interpret=interpret, block_k=block_k, num_splits=num_splits,
                                      num_warps=num_warps, num_stages=num_stages, return_probs=return_probs,
                                      k_scale=k_scale, v_scale=v_scale, k_zero=k_zero, dequant=dequant,
                                      pool_variant=default_pool_variant(page_ids) if pool_variant is None
                                      else pool_variant)
    if dequant not in DEQUANT:
        raise ValueError(f"dequant={dequant!r} must be one of {DEQUANT}")
    k_like, v_like = _check_quantized(q, k, v, k_scale, v_scale, page_size, k_zero)
    if layer is not None:
        _check_stacked(k, v, bias, layer)
        k1, v1 = (jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in (k_like, v_like))
        b1 = None if bias is None else jax.ShapeDtypeStruct(bias.shape[1:], bias.dtype)
        check_decode_args(q, k1, v1, lengths, page_size=page_size, page_ids=page_ids, page_counts=page_counts,
                          bias=b1)
        layer = jnp.asarray(layer, jnp.int32)
    else:
        check_decode_args(q, k_like, v_like, lengths, page_size=page_size, page_ids=page_ids,
                          page_counts=page_counts, bias=bias)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if not scale > 0:
        raise ValueError(f"scale={scale} must be positive")
    return _decode_call(q, k, v, lengths, page_ids, page_counts, bias, layer, k_scale, v_scale, k_zero,
                        page_size=page_size,
                        scale=float(scale), interpret=interpret, block_k=block_k,
                        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                        return_probs=bool(return_probs), **({"dequant": dequant} if k_scale is not None else {}))


def _decode_attention_pool(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, page_table: jax.Array, *,
                           page_size: int, page_ids: jax.Array | None, page_counts: jax.Array | None,
                           bias: jax.Array | None, layer: Any, scale: float | None, interpret: bool, block_k: int,
                           num_splits: int | None, num_warps: int, num_stages: int, return_probs: bool,
                           k_scale: jax.Array | None, v_scale: jax.Array | None,
                           k_zero: jax.Array | None, dequant: str = "tile_f32",
                           pool_variant: str = "ahead1") -> jax.Array | tuple[jax.Array, jax.Array]:
    """`decode_attention` in pool mode: the checks, then the jitted call."""
    if dequant not in DEQUANT:
        raise ValueError(f"dequant={dequant!r} must be one of {DEQUANT}")
    if pool_variant not in POOL_VARIANTS:
        raise ValueError(f"pool_variant={pool_variant!r} must be one of {POOL_VARIANTS}")
    if layer is not None:
        raise ValueError("layer= indexes a stacked uniform cache; with page_table the pool holds every layer: "
                         "pass that layer's tables and lengths (table[l], length[l]) instead")
    k_like, v_like = _check_quantized_pool(q, k, v, k_scale, v_scale, page_size, k_zero)
    check_pool_decode_args(q, k_like, v_like, lengths, page_table, page_size=page_size, page_ids=page_ids,
                           page_counts=page_counts, bias=bias)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if not scale > 0:
        raise ValueError(f"scale={scale} must be positive")
    return _decode_call(q, k, v, lengths, page_ids, page_counts, bias, None, k_scale, v_scale, k_zero, page_table,
                        page_size=page_size, scale=float(scale), interpret=interpret, block_k=block_k,
                        num_splits=num_splits, num_warps=num_warps, num_stages=num_stages,
                        return_probs=bool(return_probs), pool_variant=pool_variant,
                        **({"dequant": dequant} if k_scale is not None else {}))


def _check_quantized_pool(q: jax.Array, k: jax.Array, v: jax.Array, k_scale: jax.Array | None,
                          v_scale: jax.Array | None, page_size: int, k_zero: jax.Array | None) -> tuple[Any, Any]:
    """`_check_quantized` for pool leaves: codes ``[N, ps, D]``, ``k_scale``/``k_zero`` ``[N, D]``,
    ``v_scale`` ``[N]``."""
    if k_scale is None and v_scale is None:
        if k_zero is not None:
            raise ValueError("k_zero without k_scale/v_scale: zero points belong to a quantised cache")
        return k, v
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale and v_scale come together (a quantised cache has both)")
    for name, x in (("k", k), ("v", v)):
        if jnp.dtype(x.dtype).name not in ("int8", "float8_e4m3fn"):
            raise ValueError(f"with k_scale/v_scale, {name} must hold int8 or float8_e4m3fn codes, got {x.dtype}")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v codes must share a dtype, got {k.dtype} and {v.dtype}")
    if k.ndim != 3:
        raise ValueError(f"with page_table, k must be a pool [N, page_size, D], got shape {tuple(k.shape)}")
    N, D = k.shape[0], k.shape[-1]
    if tuple(k_scale.shape) != (N, D):
        raise ValueError(f"with page_table, k_scale must be [N, D]={[N, D]} (a scale per pool page and channel), "
                         f"got {list(k_scale.shape)}")
    if k_zero is not None and tuple(k_zero.shape) != (N, D):
        raise ValueError(f"k_zero must be shaped as k_scale {[N, D]}, got {list(k_zero.shape)}")
    if tuple(v_scale.shape) != (N,):
        raise ValueError(f"with page_table, v_scale must be [N]={[N]} (a scale per pool page), "
                         f"got {list(v_scale.shape)}")
    return (jax.ShapeDtypeStruct(k.shape, q.dtype), jax.ShapeDtypeStruct(v.shape, q.dtype))


def _check_quantized(q: jax.Array, k: jax.Array, v: jax.Array, k_scale: jax.Array | None, v_scale: jax.Array | None,
                     page_size: int, k_zero: jax.Array | None = None) -> tuple[Any, Any]:
    """Checks of a quantised cache's codes and scales (``ValueError``); returns what the shared
    checks should see as ``k``/``v`` (codes stand in as q's dtype)."""
    if k_scale is None and v_scale is None:
        if k_zero is not None:
            raise ValueError("k_zero without k_scale/v_scale: zero points belong to a quantised cache")
        return k, v
    if k_scale is None or v_scale is None:
        raise ValueError("k_scale and v_scale come together (a quantised cache has both)")
    for name, x in (("k", k), ("v", v)):
        if jnp.dtype(x.dtype).name not in ("int8", "float8_e4m3fn"):
            raise ValueError(f"with k_scale/v_scale, {name} must hold int8 or float8_e4m3fn codes, got {x.dtype}")
    if k.dtype != v.dtype:
        raise ValueError(f"k and v codes must share a dtype, got {k.dtype} and {v.dtype}")
    if not isinstance(page_size, int) or page_size <= 0 or k.shape[-2] % page_size:
        raise ValueError(f"page_size={page_size} must divide the cache length {k.shape[-2]}")
    pages = (*k.shape[:-2], k.shape[-2] // page_size)
    if tuple(k_scale.shape) != (*pages, k.shape[-1]):
        raise ValueError(f"k_scale must be {[*pages, k.shape[-1]]} (a scale per page and channel), "
                         f"got {list(k_scale.shape)}")
    if k_zero is not None and tuple(k_zero.shape) != tuple(k_scale.shape):
        raise ValueError(f"k_zero must be shaped as k_scale {list(k_scale.shape)}, got {list(k_zero.shape)}")
    if tuple(v_scale.shape) != pages:
        raise ValueError(f"v_scale must be {list(pages)} (a scale per page), got {list(v_scale.shape)}")
    return (jax.ShapeDtypeStruct(k.shape, q.dtype), jax.ShapeDtypeStruct(v.shape, q.dtype))


def _check_stacked(k: jax.Array, v: jax.Array, bias: jax.Array | None, layer: int | jax.Array) -> None:
    if k.ndim != 5 or v.shape != k.shape:
        raise ValueError(f"with layer=, k and v must be stacked [L, B, Hkv, S, D], got {k.shape} and {v.shape}")
    if bias is not None and bias.shape != k.shape[:-1]:
        raise ValueError(f"with layer=, bias must be [L, B, Hkv, S]={list(k.shape[:-1])}, got {list(bias.shape)}")
    if jnp.ndim(layer) != 0 or not jnp.issubdtype(jnp.asarray(layer).dtype, jnp.integer):
        raise ValueError(f"layer must be an int scalar, got {layer!r}")
    if is_concrete(layer) and not 0 <= int(layer) < k.shape[0]:
        raise ValueError(f"layer={int(layer)} out of range [0, {k.shape[0]})")


def selected_slot_mask(lengths: jax.Array, S: int, Hkv: int, *, page_size: int,
                       page_ids: jax.Array | None = None,
                       page_counts: jax.Array | None = None) -> jax.Array:
    """``[B, Hkv, S]`` bool: slots a decode step reads (selected page and below the length).

    ``lengths``: ``[B]`` (a row's) or ``[B, Hkv]`` (a head's, the page pool's)."""
    B = lengths.shape[0]
    P = S // page_size
    valid = jnp.arange(S)[None, None, :] < (lengths[:, None, None] if lengths.ndim == 1 else lengths[..., None])
    if page_ids is None:
        return jnp.broadcast_to(valid, (B, Hkv, S))
    K = page_ids.shape[-1]
    counts = jnp.full((B, Hkv), K) if page_counts is None else page_counts
    live = jnp.arange(K)[None, None, :] < counts[..., None]
    tgt = jnp.where(live, page_ids, P)  # dead entries scatter out of range and are dropped
    sel = jnp.zeros((B, Hkv, P), bool)
    bi, hi = jnp.meshgrid(jnp.arange(B), jnp.arange(Hkv), indexing="ij")
    sel = sel.at[bi[..., None], hi[..., None], tgt].set(True, mode="drop")
    return jnp.repeat(sel, page_size, axis=-1) & valid


def pool_slot_mask(lengths: jax.Array, page_table: jax.Array, num_pool_pages: int, *, page_size: int,
                   page_ids: jax.Array | None = None, page_counts: jax.Array | None = None) -> jax.Array:
    """``[B, Hkv, M·ps]`` bool: the *logical* slots a pool-mode decode step reads: a selected logical
    page, below the head's length ``lengths [B, Hkv]``, and mapped by ``page_table [B, Hkv, M]`` to a
    pool page in ``[0, num_pool_pages)`` (the sentinel ``N`` reads nothing)."""
    B, Hkv, M = page_table.shape
    mapped = (page_table >= 0) & (page_table < num_pool_pages)
    sel = selected_slot_mask(lengths, M * page_size, Hkv, page_size=page_size, page_ids=page_ids,
                             page_counts=page_counts)
    return sel & jnp.repeat(mapped, page_size, axis=-1)


def decode_attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, lengths: jax.Array, *,
                               page_size: int, page_ids: jax.Array | None = None,
                               page_counts: jax.Array | None = None, bias: jax.Array | None = None,
                               scale: float | None = None, return_probs: bool = False,
                               k_scale: jax.Array | None = None, v_scale: jax.Array | None = None,
                               k_zero: jax.Array | None = None,
                               page_table: jax.Array | None = None) -> jax.Array | tuple[jax.Array, jax.Array]:
    """jnp reference: masked softmax over the selected slots, in float32 (HIGHEST precision).

    Pool mode (``page_table``, shapes as `decode_attention`): each head's logical pages are gathered
    out of the pool first (``leaf[page_table]``, the jnp readers' way in docs/PAGE_POOL.md), giving the
    uniform layout ``[B, Hkv, M·ps, …]`` with per-head lengths; pages past a head's length or
    unmapped (the sentinel) are masked, never used.

    A quantised cache (``k_scale``/``v_scale``/``k_zero``, as `decode_attention`) is dequantised
    first, in float32 then to q's dtype as the kernel does (the same numbers: the scales are powers
    of two, so ``code * scale`` is exact and the zero point's sum rounds alike).

    Unselected and out-of-length slots get weight exactly 0 (and their V is zeroed, so
    garbage there cannot turn into NaN); rows with nothing selected return zeros. With
    ``return_probs`` also returns the weights ``[B, Hq, S]`` float32, as `decode_attention`.
    """
    B, Hq, D = q.shape
    if page_table is not None:
        N = k.shape[0]
        _, Hkv, M = page_table.shape
        S = M * page_size
        mask = pool_slot_mask(lengths, page_table, N, page_size=page_size, page_ids=page_ids,
                              page_counts=page_counts)
        take = lambda x: None if x is None else x.at[page_table].get(mode="fill")  # noqa: E731 -- masked
        k, v = take(k).reshape(B, Hkv, S, D), take(v).reshape(B, Hkv, S, D)
        bias = None if bias is None else take(bias).reshape(B, Hkv, S)
        k_scale, v_scale, k_zero = take(k_scale), take(v_scale), take(k_zero)
    else:
        _, Hkv, S, _ = k.shape
        mask = selected_slot_mask(lengths, S, Hkv, page_size=page_size, page_ids=page_ids,
                                  page_counts=page_counts)
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    if k_scale is not None:
        ks = jnp.repeat(k_scale.astype(jnp.float32), page_size, axis=-2)
        vs = jnp.repeat(v_scale.astype(jnp.float32), page_size, axis=-1)[..., None]
        k = k.astype(jnp.float32) * ks
        if k_zero is not None:
            k = k + jnp.repeat(k_zero.astype(jnp.float32), page_size, axis=-2)
        k = k.astype(q.dtype)
        v = (v.astype(jnp.float32) * vs).astype(q.dtype)
    qf = q.astype(jnp.float32).reshape(B, Hkv, G, D)
    kf = jnp.where(mask[..., None], k.astype(jnp.float32), 0.0)
    vf = jnp.where(mask[..., None], v.astype(jnp.float32), 0.0)
    hp = lax.Precision.HIGHEST
    logits = jnp.einsum("bhgd,bhsd->bhgs", qf, kf, precision=hp) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)[:, :, None, :]
    logits = jnp.where(mask[:, :, None, :], logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    p = jnp.exp(logits - jnp.where(jnp.isfinite(m), m, 0.0))
    l = p.sum(-1, keepdims=True)
    l_safe = jnp.where(l > 0, l, 1.0)
    out = (jnp.einsum("bhgs,bhsd->bhgd", p, vf, precision=hp) / l_safe).reshape(B, Hq, D).astype(q.dtype)
    return (out, (p / l_safe).reshape(B, Hq, S)) if return_probs else out
