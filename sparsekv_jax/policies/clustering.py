"""Clustering mechanics for merging compressors (SemantiCache): the delimiter mask over a
vocabulary, the chunk layout of a prompt, greedy seed-based clustering (GSC) in every chunk at once,
the threshold search that fits a budget, and the merged entries of each cluster. GSC runs on a
Pallas kernel on the GPU (`sparsekv_jax.pallas.gsc`; `greedy_seed_clustering` is its jnp reference).

Everything here is vectorised over rows, KV heads and chunks; there is no per-token Python loop.
Shapes: ``B`` rows, ``H`` KV heads, ``T`` prompt slots, ``D`` head dim, ``K`` thresholds.
The write of the merged entries into a new cache is `common.write_entries`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from sparsekv_jax.backend import Backend
from sparsekv_jax.models.rope import apply_rope
from sparsekv_jax.pallas import dispatch
from sparsekv_jax.pallas.gsc import greedy_seed_clustering_kernel

DELIMITERS = ".,?!;: \t\n"  # SemantiCache's set: . , ? ! ; : space tab newline
SENTENCE_ENDS = ".?!\n"  # the delimiters that close a sentence
MERGE_ALL = -2.0  # below every cosine: one cluster per chunk


def vocabulary_texts(tokenizer: Any) -> list[str]:
    """Each id of ``tokenizer`` decoded on its own (``[V]`` strings). Decoding a 49k-152k vocabulary takes
    about a second, so the masks below take it as ``texts`` when a caller builds several."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))], clean_up_tokenization_spaces=False)


def delimiter_mask(tokenizer: Any, delimiters: str = DELIMITERS, texts: Sequence[str] | None = None) -> np.ndarray:
    """``[V]`` bool over the tokenizer's ids: the decoded token is non-empty and made only of
    ``delimiters`` characters."""
    texts = vocabulary_texts(tokenizer) if texts is None else texts
    chars = set(delimiters)
    return np.array([bool(s) and set(s) <= chars for s in texts], bool)


def number_mask(tokenizer: Any, texts: Sequence[str] | None = None) -> np.ndarray:
    """``[V]`` bool over the tokenizer's ids: the decoded token, without surrounding whitespace, is
    non-empty and made only of the digits 0-9 (SmolLM2: the ten single digits)."""
    texts = vocabulary_texts(tokenizer) if texts is None else texts
    return np.array([bool(s.strip()) and set(s.strip()) <= set("0123456789") for s in texts], bool)


def word_start_mask(tokenizer: Any, texts: Sequence[str] | None = None) -> np.ndarray:
    """``[V]`` bool over the tokenizer's ids: the token begins a word. Its decoded text starts with
    whitespace, or its piece carries the tokenizer's word-start marker (byte-level BPE's ``Ġ``,
    SentencePiece's ``▁``: some tokenizers drop the space when decoding one token; a tokenizer
    without ``convert_ids_to_tokens`` is read from its decoded text alone)."""
    texts = vocabulary_texts(tokenizer) if texts is None else texts
    to_pieces = getattr(tokenizer, "convert_ids_to_tokens", None)  # a minimal tokenizer may only decode
    pieces = to_pieces(list(range(len(tokenizer)))) if to_pieces else [""] * len(texts)
    return np.array([(bool(s) and s[0].isspace()) or str(p or "").startswith(("\u0120", "\u2581"))
                     for s, p in zip(texts, pieces, strict=True)], bool)


def sentence_delimiter_mask(tokenizer: Any, ends: str = SENTENCE_ENDS,
                            texts: Sequence[str] | None = None) -> np.ndarray:
    """``[V]`` bool over the tokenizer's ids: a token made only of delimiters (`delimiter_mask`) that holds
    one of ``ends`` (``.`` ``?`` ``!`` newline): the last token of a sentence for SemantiCache's
    ``protect="digit_sentences"`` (SmolLM2: ``"."``, ``".\\n\\n"``, ``" ?"``). Not S³'s sentence ends
    (`retrieval.text.sentence_end_mask`), which also count a word that ends in a mark and special tokens."""
    texts = vocabulary_texts(tokenizer) if texts is None else texts
    delims, marks = set(DELIMITERS), set(ends)
    return np.array([bool(s) and set(s) <= delims and bool(set(s) & marks) for s in texts], bool)


def number_sentences(is_digit: jax.Array, ends_sentence: jax.Array, lengths: jax.Array, longest: int) -> jax.Array:
    """``[B, T]`` bool: every token of a sentence that holds a digit and is at most ``longest``
    tokens long, its closing delimiter included. A sentence ends at a sentence-end token
    (`sentence_delimiter_mask`) and at the row's last token (``lengths`` ``[B]``); padding is in none."""
    T = is_digit.shape[1]
    t = jnp.arange(T)[None]
    live = t < lengths[:, None]
    ends_sentence = ends_sentence | (t >= lengths[:, None] - 1)  # each padding slot: a "sentence" of its own
    sentence = jnp.cumsum(ends_sentence, axis=1) - ends_sentence  # the end token closes its own sentence
    is_digit = is_digit & live

    def per_row(d, s):
        return (jax.ops.segment_max(d, s, num_segments=T),
                jax.ops.segment_sum(jnp.ones_like(d), s, num_segments=T))

    has_digit, size = jax.vmap(per_row)(is_digit.astype(jnp.int32), sentence)
    keep = (has_digit > 0) & (size <= longest)
    return jnp.take_along_axis(keep, sentence, axis=1) & live


def number_words(is_digit: jax.Array, starts_word: jax.Array, is_delim: jax.Array) -> jax.Array:
    """``[B, T]`` bool: every token of a word that holds a digit (``"x86"``, a UUID's letters), not
    the delimiters. A word is a run of tokens, cut before a word-start token and around every
    delimiter (``"3.14"`` is two words)."""
    # a delimiter opens a new id too; it holds no digit and is never kept, so what follows it in that
    # id is a word of its own
    word = jnp.cumsum(starts_word | is_delim, axis=1)  # [B, T] in 0..T
    has_digit = jax.vmap(lambda d, w: jax.ops.segment_max(d, w, num_segments=is_digit.shape[1] + 1))(
        is_digit.astype(jnp.int32), word)
    return (jnp.take_along_axis(has_digit, word, axis=1) > 0) & ~is_delim


def forced_counts(keep: jax.Array, lengths: jax.Array, sinks: int, window: int, width: int,
                  recent_ratio: float = 0.0, longest: int = 0) -> tuple[jax.Array, jax.Array]:
    """Per-row sinks and window ``([B], [B])``: as many as asked — ``sinks``, and a window of
    ``max(window, floor(recent_ratio * keep))`` — fewer where the row's budget ``keep`` then could
    not hold one entry per ``width`` block of the rest; sinks first. ``longest`` (the prompt's
    width) bounds the window statically when ``recent_ratio`` is set."""
    def blocks(n):
        return -(-n // width)

    n, keep = lengths[:, None], keep[:, None]
    s = jnp.arange(sinks + 1)[None]
    s_ok = (s <= n) & (s + blocks(jnp.maximum(n - s, 0)) <= keep)
    sinks_b = jnp.max(jnp.where(s_ok, s, 0), axis=1)
    asked = jnp.maximum(window, jnp.floor(recent_ratio * keep.astype(jnp.float32) + 1e-6).astype(jnp.int32))
    w = jnp.arange(max(window, longest if recent_ratio else 0) + 1)[None]
    rest = n - sinks_b[:, None] - w
    w_ok = (w <= asked) & (rest >= 0) & (sinks_b[:, None] + w + blocks(jnp.maximum(rest, 0)) <= keep)
    return sinks_b, jnp.max(jnp.where(w_ok, w, 0), axis=1)


def chunk_layout(is_delim: jax.Array, lengths: jax.Array, sinks: jax.Array, window: jax.Array, level: jax.Array,
                 chunk_size: int, protect: jax.Array | None = None) -> tuple[jax.Array, ...]:
    """Where each prompt slot goes, per row (``[B, T]`` each): ``(forced, anchor, member, place)``.

    ``forced``: sinks and window (kept as they are); ``anchor``: delimiters kept unmerged;
    ``member``: clustered; ``place``: its index in its chunk (``-1`` off members). ``level`` ``[B]``:
    0 = chunks between delimiters, delimiters anchors; 1 = a chunk is a run of words and the
    delimiters after it (no anchors); 2 = ``chunk_size`` blocks of the middle. Chunks longer than
    ``chunk_size`` are split. ``protect`` ``[B, T]``: slots that are anchors at every level (a chunk
    never spans one: GSC's chunks are runs of consecutive members).
    """
    T = is_delim.shape[1]
    t = jnp.arange(T)[None]
    live = t < lengths[:, None]
    forced = live & ((t < sinks[:, None]) | (t >= (lengths - window)[:, None]))
    middle = live & ~forced
    delim = is_delim & middle
    lvl = level[:, None]
    anchor = delim & (lvl == 0)
    if protect is not None:
        anchor = anchor | (protect & middle)
    member = middle & ~anchor

    def prev(x):
        return jnp.pad(x[:, :-1], ((0, 0), (1, 0)))

    clause = ~prev(middle) | (prev(delim) & ~delim)  # level 1: words, then the delimiters closing them
    block = (t - sinks[:, None]) % chunk_size == 0
    start = ~prev(member) | jnp.where(lvl == 0, False, jnp.where(lvl == 1, clause, block))
    run_start = jax.lax.cummax(jnp.where(member & start, t, -1), axis=1)
    place = jnp.where(member, (t - run_start) % chunk_size, -1)
    return forced, anchor, member, place


def candidate_layouts(is_delim: jax.Array, lengths: jax.Array, keep: jax.Array, sinks: int, window: int,
                      chunk_size: int, levels: tuple[int, ...], recent_ratio: float = 0.0,
                      protect: jax.Array | tuple[jax.Array, ...] | None = None,
                      shares: tuple[float, ...] | None = None) -> tuple[jax.Array, ...]:
    """`chunk_layout` at each of ``levels``: ``(forced, anchor, member, place)`` ``[N, B, T]`` each and
    ``fits`` ``[N, B]``: the level's coarsest clustering (one cluster per chunk) fits the row's
    budget ``keep``. Sinks and window are the same at every level (`forced_counts`). ``protect``
    ``[B, T]``: anchors at every level; or a tuple of such masks, the most protective first: each
    row takes the first with which its last level fits, none where no mask does. ``shares`` (one
    per mask; default 1): a row takes a mask only where the slots it protects (outside sinks and
    window) are at most that share of ``keep``."""
    sinks_b, window_b = forced_counts(keep, lengths, sinks, window, chunk_size, recent_ratio, is_delim.shape[1])

    def layouts(protect):
        stacked = [chunk_layout(is_delim, lengths, sinks_b, window_b, jnp.full(lengths.shape, lv, jnp.int32),
                                chunk_size, protect) for lv in levels]
        forced, anchor, member, place = jax.tree.map(lambda *x: jnp.stack(x), *stacked)
        return forced, anchor, member, place, (forced | anchor | (place == 0)).sum(-1) <= keep

    if protect is None:
        return layouts(None)
    masks = (protect,) if isinstance(protect, jax.Array) else protect
    chosen, placed = jnp.zeros(is_delim.shape, bool), jnp.zeros(lengths.shape, bool)
    for mask, share in zip(masks, shares or (1.0,) * len(masks), strict=True):  # a static handful of masks
        _, anchor, _, _, fits = layouts(mask)  # the last level's anchors are the protected slots alone
        fits = fits[-1] & (anchor[-1].sum(-1) <= share * keep) & ~placed  # [B]
        chosen, placed = jnp.where(fits[:, None], mask, chosen), placed | fits
    return layouts(chosen)  # a row whose coarsest level overflows with every mask keeps nothing protected


def fitting_layout(is_delim: jax.Array, lengths: jax.Array, keep: jax.Array, sinks: int, window: int,
                   chunk_size: int, levels: tuple[int, ...], recent_ratio: float = 0.0,
                   protect: jax.Array | tuple[jax.Array, ...] | None = None,
                   shares: tuple[float, ...] | None = None) -> tuple[jax.Array, ...]:
    """``(forced, anchor, member, place, level)``: `chunk_layout` at each row's first level of
    ``levels`` whose coarsest clustering (one cluster per chunk) fits the row's budget ``keep``
    (the last level when none does). Threshold mode's layout."""
    *layout, fits = candidate_layouts(is_delim, lengths, keep, sinks, window, chunk_size, levels, recent_ratio,
                                      protect, shares)
    first = first_fitting(fits)
    return (*(jnp.take_along_axis(x, first[None, :, None], 0)[0] for x in layout),
            jnp.asarray(levels, jnp.int32)[first])


def first_fitting(fits: jax.Array) -> jax.Array:
    """``[B]``: per row the index of the first layout whose coarsest clustering fits (``fits``
    ``[N, B]``, `candidate_layouts`), the last where none does."""
    return jnp.argmax(fits.at[-1].set(True), axis=0)


def similarity_band(keys: jax.Array, width: int) -> jax.Array:
    """``[..., T, width]`` cosines ``band[t, o] = cos(k_t, k_{t-o})`` of ``keys`` ``[..., T, D]``
    (one matmul per block of ``width`` tokens against itself and the block before)."""
    *lead, T, D = keys.shape
    u = keys.astype(jnp.float32)
    u = u / jnp.maximum(jnp.linalg.norm(u, axis=-1, keepdims=True), 1e-12)
    n = -(-T // width)
    blocks = jnp.pad(u, [(0, 0)] * len(lead) + [(0, n * width - T), (0, 0)]).reshape(*lead, n, width, D)
    before = jnp.pad(blocks, [(0, 0)] * len(lead) + [(1, 0), (0, 0), (0, 0)])[..., :n, :, :]
    both = jnp.concatenate([before, blocks], axis=-2)  # [..., n, 2w, D]
    # HIGHEST: true fp32 products (a GPU's default for fp32 is TF32), so the cosines compared with a
    # threshold are the same on every backend up to summation order
    sims = jnp.einsum("...ad,...cd->...ac", blocks, both, preferred_element_type=jnp.float32,
                      precision=jax.lax.Precision.HIGHEST)  # [..., n, w, 2w]
    a, o = np.arange(width)[:, None], np.arange(width)[None, :]
    index = jnp.broadcast_to(jnp.asarray(width + a - o), sims.shape[:-1] + (width,))
    band = jnp.take_along_axis(sims, index, axis=-1).reshape(*lead, n * width, width)[..., :T, :]
    return jnp.clip(band, -1.0, 1.0)  # a cosine never exceeds 1: tau = 1 merges nothing, not even duplicates


def greedy_seed_clustering(band: jax.Array, member: jax.Array, place: jax.Array, taus: jax.Array) -> jax.Array:
    """Algorithm 1 in every chunk at once: ``[K, B, H, T]`` each member's distance back to its
    cluster's seed (0 for a seed and off members), for ``K`` thresholds ``taus`` ``[K, B, H]``.

    ``band`` ``[B, H, T, width]`` (`similarity_band`), ``member``/``place`` ``[B, T]``
    (`chunk_layout`). Step ``s`` makes every still unassigned member at place ``s`` a seed, and
    each seed absorbs the later unassigned members of its chunk whose cosine with it exceeds tau.
    At step ``s`` a member at a later place is unassigned exactly when its distance is still 0, so
    that distance (1 byte for chunks up to 127 tokens) is the loop's whole state; the loop runs to
    the longest chunk present, not to ``width``.
    """
    T, width = band.shape[2:]
    slot = jnp.arange(T)
    dtype = jnp.int8 if width <= 127 else jnp.int16 if width <= 32767 else jnp.int32
    member, place = member[:, None], place[:, None]  # [B, 1, T]
    taus = taus[..., None]

    def step(s, back):
        is_seed = member & (place == s) & (back == 0)
        delta = place - s  # how far back this member's candidate seed sits
        src = jnp.clip(slot - delta, 0, T - 1)
        cos = jnp.take_along_axis(band, jnp.clip(delta, 0, width - 1)[..., None], axis=-1)[..., 0]
        from_seed = jnp.take_along_axis(is_seed, jnp.broadcast_to(src, is_seed.shape), axis=-1)
        absorb = member & (delta > 0) & (back == 0) & from_seed & (cos > taus)
        return jnp.where(absorb, delta.astype(dtype), back)

    init = jnp.zeros(taus.shape[:-1] + (T,), dtype)
    return jax.lax.fori_loop(0, place.max() + 1, step, init)


def search_grid(top: float, steps: int) -> np.ndarray:
    """The first pass's thresholds, descending: ``top``, then ``steps - 1`` more whose distance
    below ``top`` grows geometrically from ``3e-4`` to ``top - MERGE_ALL`` (the last merges every
    chunk into one cluster). Near-duplicate keys (cosines of 0.99+, e.g. a repeated haystack
    sentence) need the fine steps near 1; a second, linear pass refines between two points."""
    gaps = (top - MERGE_ALL) * np.geomspace(1e-4, 1.0, steps - 1)
    return np.concatenate([[top], top - gaps]).astype(np.float32)


GSC_METHODS = dispatch.GSC_METHODS


def resolve_gsc(method: str, width: int, backend: Backend | None = None) -> str:
    """``"auto"`` → ``"pallas"`` (the kernel, `sparsekv_jax.pallas.gsc`) on a GPU (``backend``'s platform;
    ``None``: this process's default) when it takes this band ``width``, else ``"jnp"``
    (`greedy_seed_clustering`); ``"interpret"`` runs the kernel on the CPU (tests). `dispatch.gsc_method`."""
    return dispatch.gsc_method(backend, method, width)


def clusterings(band: jax.Array, member: jax.Array, place: jax.Array, taus: jax.Array, method: str) -> jax.Array:
    """`greedy_seed_clustering` for ``N`` chunk layouts sharing one band: ``member``/``place`` ``[N, B, T]``,
    ``taus`` ``[N, K, B, H]`` → ``[N, K, B, H, T]``, on the kernel or in jnp (``method``: `resolve_gsc`)."""
    method = resolve_gsc(method, band.shape[-1])
    if method == "jnp":
        return jax.vmap(greedy_seed_clustering, in_axes=(None, 0, 0, 0))(band, member, place, taus)
    return greedy_seed_clustering_kernel(band, member, place, taus, interpret=method == "interpret")


def search_clustering(band: jax.Array, member: jax.Array, place: jax.Array, kept_as_is: jax.Array,
                      keep: jax.Array, top: float, steps: int, method: str = "auto") -> tuple[jax.Array, jax.Array]:
    """``([N, B, H, T], [N, B, H])``: per chunk layout (``member``/``place``/``kept_as_is`` ``[N, B, T]``)
    and (row, head), GSC (distances back to seeds) at the largest threshold ``<= top`` whose entries
    (``kept_as_is`` slots + clusters) fit ``keep`` ``[B]``, and that threshold (``-inf`` where none
    fits: a layout whose coarsest clustering overflows).

    Two passes of ``steps`` thresholds, each evaluated at once: `search_grid`, then a linear
    grid between the last threshold that did not fit and the first that did, ending on that one,
    so a fitting clustering is always among its results (the last of the grid merges each chunk
    into one cluster, which fits whenever the layout does). A larger ``keep`` never gives a lower
    threshold: each pass takes the first fitting entry of a descending list, and the second list
    only moves up with the first pass's result."""
    N = member.shape[0]
    B, H = band.shape[:2]
    fixed = kept_as_is.sum(-1)[:, None, :, None]  # [N, 1, B, 1]

    def first_fit(taus):  # taus [N, K, B, H], descending along K
        back = clusterings(band, member, place, taus, method)  # [N, K, B, H, T]
        fit = fixed + (member[:, None, :, None] & (back == 0)).sum(-1) <= keep[:, None]  # [N, K, B, H]
        k = jnp.argmax(fit, axis=1)  # [N, B, H]
        chosen = jnp.take_along_axis(taus, k[:, None], axis=1)[:, 0]
        back = jnp.take_along_axis(back, k[:, None, ..., None], axis=1)[:, 0]
        return back, k, jnp.where(fit.any(1), chosen, -jnp.inf)

    grid = jnp.asarray(search_grid(top, steps))
    _, k1, _ = first_fit(jnp.broadcast_to(grid[None, :, None, None], (N, steps, B, H)))
    lo, hi = grid[k1], grid[jnp.maximum(k1 - 1, 0)]  # [N, B, H]
    between = hi[:, None] + (lo - hi)[:, None] * (jnp.arange(1, steps) / steps)[None, :, None, None]
    back, _, tau = first_fit(jnp.concatenate([between, lo[:, None]], axis=1))
    return back, tau


def largest_fitting_clustering(band: jax.Array, member: jax.Array, place: jax.Array, kept_as_is: jax.Array,
                               keep: jax.Array, top: float, steps: int,
                               method: str = "auto") -> tuple[jax.Array, jax.Array]:
    """`search_clustering` on one layout: ``member``/``place``/``kept_as_is`` ``[B, T]`` →
    ``([B, H, T], [B, H])``."""
    back, tau = search_clustering(band, member[None], place[None], kept_as_is[None], keep, top, steps, method)
    return back[0], tau[0]


def least_lossy_clustering(band: jax.Array, layouts: tuple[jax.Array, ...], keep: jax.Array, top: float,
                           steps: int, method: str = "auto") -> tuple[jax.Array, ...]:
    """Budget mode over several chunk layouts: per (row, head), the layout whose budget search
    (`search_clustering`) reaches the highest threshold, i.e. whose clusters join only
    the most similar keys; ties go to the earlier (finer) layout.

    ``layouts``: ``(forced, anchor, member, place)`` ``[N, B, T]`` each (`candidate_layouts`; the
    last must fit). Returns ``(back [B, H, T], kept_as_is [B, H, T], choice [B, H], tau [B, H])``
    (``choice``: the index into ``layouts``). The threshold each layout reaches never falls when the
    budget grows, so neither does their maximum."""
    forced, anchor, member, place = layouts
    kept_as_is = forced | anchor
    # all layouts at once: one kernel launch (or one vmapped jnp loop, to the longest chunk of any layout)
    # [N, B, H, T], [N, B, H]
    backs, taus = search_clustering(band, member, place, kept_as_is, keep, top, steps, method)
    choice = jnp.argmax(taus, axis=0)  # [B, H]: the first of equal maxima
    back = jnp.take_along_axis(backs, choice[None, ..., None], axis=0)[0]
    kept = jnp.take_along_axis(jnp.broadcast_to(kept_as_is[:, :, None], backs.shape), choice[None, ..., None],
                               axis=0)[0]
    return back, kept, choice, jnp.take_along_axis(taus, choice[None], axis=0)[0]


def rotate(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """RoPE ``x`` ``[..., T, D]`` by ``positions`` ``[..., T]`` (negative: rotate back), fp32."""
    return apply_rope(x[..., None, :], positions, inv_freq)[..., 0, :]


def merge_clusters(k: jax.Array, v: jax.Array, pos: jax.Array, content: jax.Array, seed_of: jax.Array,
                   kept_as_is: jax.Array, lengths: jax.Array, n_out: int,
                   inv_freq: np.ndarray | None) -> tuple[jax.Array, ...]:
    """One layer's entries: ``(k, v [B, H, n_out, D], positions, bias [B, H, n_out], counts [B, H])``.

    ``seed_of`` ``[B, H, T]``: each member's seed slot (``-1`` off members); ``kept_as_is``
    ``[B, H, T]`` or ``[B, 1, T]``. Each kept-as-is slot
    and each cluster is an entry, in the order of its first slot; a cluster's key/value are the
    means (keys: of ``content``; rotated to the mean position when ``inv_freq`` is given, i.e.
    ``content`` is pre-RoPE), its position the rounded mean, its bias ``log size``. Singletons keep
    their stored key, value and position bit for bit.
    """
    B, H, T, D = k.shape
    slot = jnp.arange(T)
    live = slot[None] < lengths[:, None]
    head_of = jnp.where(kept_as_is | (seed_of < 0), slot, seed_of)  # [B, H, T] its entry's first slot
    head_of = jnp.where(live[:, None], head_of, T)  # padding goes to a spill row
    is_head = live[:, None] & (head_of == slot)

    def total(x):  # per-first-slot sums [B, H, T, ...]
        def one(x, at):  # one (row, head): under vmap its rows and heads are batch dimensions, which XLA
            # keeps on their devices on a mesh (a scatter indexed by iotas had its sums gathered whole)
            return jnp.zeros((T + 1,) + x.shape[1:], jnp.float32).at[at].add(x)[:T]

        return jax.vmap(jax.vmap(one))(x, head_of)

    size = total(jnp.ones((B, H, T), jnp.float32))
    mean_pos = jnp.floor(total(pos.astype(jnp.float32)) / jnp.maximum(size, 1.0) + 0.5).astype(jnp.int32)
    mean_key = total(content) / jnp.maximum(size, 1.0)[..., None]
    if inv_freq is not None:
        mean_key = rotate(mean_key, mean_pos, inv_freq)
    mean_val = total(v.astype(jnp.float32)) / jnp.maximum(size, 1.0)[..., None]
    single = (size == 1.0)[..., None]
    # the entries' first slots in order (as `common.keep_slots`: padded with T past the count)
    firsts = jnp.sort(jnp.where(is_head, slot, T), axis=-1)[..., :n_out]
    at = jnp.minimum(firsts, T - 1)

    def take(x):
        return jnp.take_along_axis(x, at.reshape(at.shape + (1,) * (x.ndim - 3)), axis=2)

    key = take(jnp.where(single, k.astype(jnp.float32), mean_key)).astype(k.dtype)
    val = take(jnp.where(single, v.astype(jnp.float32), mean_val)).astype(v.dtype)
    position = take(jnp.where(size == 1.0, pos, mean_pos))
    bias = take(jnp.log(jnp.maximum(size, 1.0)))
    return key, val, position, bias, jnp.minimum(is_head.sum(-1), n_out).astype(jnp.int32)
