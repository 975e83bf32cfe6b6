"""Layouts derived from layouts: end-aligned queries, packed sequences, coarser blocks.

Each derivation keeps the element contract of its source exactly (``Layout.allowed`` before
and after agree on every element) and only changes how it is laid out for the kernels:
    end_aligned(layout, n_q)      the last n_q query positions of a square layout (Tq != Tk)
    packed(layouts, cu_q, cu_k)   one layout over several sequences packed end to end (varlen)
    coarsened(layout, blocksize)  the same elements on bigger blocks (block 8 on 16-block kernels)
    restricted(layout, qpos, kpos) chosen query rows against chosen keys (a context-parallel
                                  rank's queries against a visiting rank's keys)
    natural_cover(layout)         the natural-order blocks that may hold an allowed element (what
                                  a derivation that addresses tokens in natural order starts from)
Where a derived block holds only part of what its source allowed, the derived layout carries a
per-block bitmask (evaluated once, here); blocks every element of which is allowed stay
mask-free, so the kernels test elements only on the boundary blocks.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cuattn._util import array_library, ceil_div
from cuattn.layout.blocks import bitmask_layout
from cuattn.layout.layout import ElementRule, Layout, check_positive_int

# Patterns whose element rule says everything (their blocks are the rule's cover): end-aligned
# queries follow the rule itself, also outside the square.
RULE_PATTERNS = ("all", "local")


def _rule_cover(layout: Layout, n_q: int) -> np.ndarray | None:
    """Blocks [nbq, nb] holding an element the rule alone allows for n_q end-aligned queries, or
    None when the layout's blocks are not exactly its rule's cover (a pattern defined on blocks)."""
    rule, b, n = layout.rule, layout.blocksize, layout.n_ctx
    if rule.kind == "bitmask":
        return None

    def cover(rows: int) -> np.ndarray:
        offset = n - rows
        i = np.arange(ceil_div(rows, b))[:, None]
        j = np.arange(layout.num_blocks)[None, :]
        q_lo, q_hi = i * b + offset, np.minimum(i * b + b, rows) - 1 + offset
        k_lo, k_hi = j * b, np.minimum(j * b + b, n) - 1
        if rule.kind == "causal":
            return (k_lo <= q_hi) & (q_hi >= 0)
        if rule.kind == "window":
            return (q_lo - k_hi < rule.window_left) & (k_lo - q_hi < rule.window_right)
        return np.ones((len(i), layout.num_blocks), dtype=bool)

    # Only the patterns whose rule is the whole pattern ("all", "local") extend to rows outside
    # the square; a pattern defined on blocks (fixed, bigbird, ...) whose blocks happen to be
    # all on looks the same here, but its rows before every key see nothing (docs/patterns.md).
    if layout.name not in RULE_PATTERNS or not (layout.blocks == cover(layout.n_q)[None]).all():
        return None
    return cover(n_q)


def end_aligned(layout: Layout, n_q: int) -> Layout:
    """The layout of n_q queries against ``layout``'s n_ctx keys, aligned at the end.

    Query row i of the result is position i + n_ctx - n_q of the square ``layout``: it sees what
    that position saw there (FlashAttention >= 2.1's and SDPA's bottom-right alignment). With
    n_q > n_ctx the first n_q - n_ctx rows lie before every key and see nothing.
    """
    check_positive_int("n_q", n_q)
    n, b, heads = layout.n_ctx, layout.blocksize, layout.heads
    if layout.n_q != n:
        raise ValueError(f"layout: end_aligned needs a square layout, got n_q={layout.n_q}")
    if n_q == n:
        return layout
    if layout.perm is not None:
        raise ValueError(
            f"layout: {layout.name!r} is computed in a permuted token order, which only a square "
            "layout can use; build it in natural order (strided: transpose=False)"
        )
    offset = n - n_q
    nbq = ceil_div(n_q, b)
    cover = _rule_cover(layout, n_q)
    if cover is not None:  # all, local: the rule says everything, shifted by q_offset
        blocks = np.broadcast_to(cover, (heads, nbq, layout.num_blocks))
        return Layout(blocks, b, n, layout.rule, name=layout.name, n_q=n_q)
    if offset % b == 0:  # whole blocks shift: rows of the square layout, same rule
        source = np.arange(nbq) + offset // b
        valid = (source >= 0) & (source < layout.num_q_blocks)
        blocks = np.zeros((heads, nbq, layout.num_blocks), dtype=bool)
        blocks[:, valid] = layout.blocks[:, source[valid]]
        rule = layout.rule
        if rule.kind == "bitmask":
            source_fn = rule.mask_fn

            def shifted(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
                # rows before every key (q + offset < 0) see nothing, and the source's rule is
                # never asked about a position it does not have (a document table would wrap)
                pos = q + offset
                return (pos >= 0) & source_fn(h, np.maximum(pos, 0), k)

            rule = ElementRule("bitmask", mask_fn=shifted)
        return Layout(blocks, b, n, rule, name=layout.name, n_q=n_q)
    # Each new query block straddles two square rows: their union, exact through a bitmask.
    rows = np.arange(nbq)
    first = np.clip((rows * b + offset) // b, 0, layout.num_q_blocks - 1)
    last = np.clip((np.minimum(rows * b + b, n_q) - 1 + offset) // b, 0, layout.num_q_blocks - 1)
    candidates = layout.blocks[:, first] | layout.blocks[:, last]
    return bitmask_layout(
        candidates,
        b,
        n,
        lambda h, q, k: layout.allowed(h, q + offset, k),
        layout.name,
        n_q=n_q,
    )


def check_cu_seqlens(name: str, cu_seqlens: object, total: int) -> np.ndarray:
    """int64 host copy of a cumulative-lengths vector, checked: int32/int64, 1-D, starts at 0,
    non-decreasing, ends at ``total`` (the packed tokens)."""
    dtype = str(getattr(cu_seqlens, "dtype", "")).replace("torch.", "")
    if dtype not in ("int32", "int64"):
        raise TypeError(f"{name} must be an int32 or int64 array, got {dtype or type(cu_seqlens)}")
    values = _host_ints(cu_seqlens)
    if values.ndim != 1 or len(values) < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries, got shape {values.shape}")
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {int(values[0])}")
    if (np.diff(values) < 0).any():
        s = int(np.argmax(np.diff(values) < 0))
        raise ValueError(
            f"{name} must be non-decreasing (a repeated value is an empty sequence): sequence "
            f"{s} would have length {int(values[s + 1] - values[s])} ({name}[{s}]="
            f"{int(values[s])}, [{s + 1}]={int(values[s + 1])})"
        )
    if values[-1] != total:
        raise ValueError(
            f"{name} must end at the number of packed tokens {total}, got {int(values[-1])}"
        )
    return values


def _host_ints(x: object) -> np.ndarray:
    # cu_seqlens is the layout's metadata (a few integers per sequence): the layout is built on
    # the host, so a device vector is read back here, once per distinct packing (documented).
    library = array_library(x)
    if library == "cupy":
        x = x.get()
    elif library == "torch":
        x = x.detach().cpu().numpy()
    return np.asarray(x).astype(np.int64)


def natural_cover(layout: Layout) -> np.ndarray:
    """bool [heads, nbq, nb]: the blocks, in the caller's natural token order, that may hold an
    element ``layout`` allows (a superset; a bitmask built over them makes a derived layout exact).

    ``layout.blocks`` speak of the computed order, so a derivation that addresses tokens in
    natural order (packed sequences, a context-parallel rank's shard) must start from this
    instead. Computed block I covers the natural blocks of the tokens it holds, C[I, A] = 1 when
    some position of I holds a token of natural block A; natural blocks (A, B) are reached
    through an active (I, J) when (C.T @ blocks @ C)[A, B] > 0: two [nb, nb] products per
    distinct head, never a pass over elements. The products run in float32 (BLAS): their terms
    are 0 or 1, so a sum is positive exactly when one term is, whatever it rounds to.
    """
    if layout.perm is None:
        return layout.blocks
    b, nb = layout.blocksize, layout.num_blocks
    cover = np.zeros((nb, nb), dtype=np.float32)
    cover[np.arange(layout.n_ctx) // b, layout.perm // b] = 1
    out = np.empty(layout.blocks.shape, dtype=bool)
    by_blocks: dict[bytes, np.ndarray] = {}  # heads with equal blocks (most patterns) share one
    for h, blocks in enumerate(layout.blocks):
        key = blocks.tobytes()
        if key not in by_blocks:
            by_blocks[key] = cover.T @ blocks.astype(np.float32) @ cover > 0
        out[h] = by_blocks[key]
    return out


def _order(layout: Layout) -> np.ndarray:
    """The layout's computed order of its tokens (its ``perm``, or natural order)."""
    return np.arange(layout.n_ctx) if layout.perm is None else layout.perm


def packed(layouts: Sequence[Layout | None], cu_q: np.ndarray, cu_k: np.ndarray) -> Layout:
    """One layout over sequences packed end to end: sequence s has queries cu_q[s]..cu_q[s+1]-1
    and keys cu_k[s]..cu_k[s+1]-1 and sees, inside its own box, exactly what ``layouts[s]``
    allows; nothing crosses sequences. Boundary blocks carry bitmasks.

    A self-attention packing (cu_q == cu_k) with permuted layouts among its sequences keeps each
    sequence's computed order: the packed layout permutes tokens within sequences only (each
    ``perm`` offset by its start, natural order for the others), so a strided sequence stays
    block-sparse. Any other packing has n_q != n_ctx, which no permutation can serve: there the
    candidates are each layout's natural-order cover (``natural_cover``), exact through the
    bitmasks but as dense as the natural-order pattern."""
    count = len(cu_q) - 1
    if len(layouts) != count or len(cu_k) != len(cu_q):
        raise ValueError(
            f"layouts: got {len(layouts)} layouts for {count} sequences (cu_seqlens_q has "
            f"{len(cu_q)} entries, cu_seqlens_k {len(cu_k)})"
        )
    given = [lay for lay in layouts if lay is not None]
    if not given:
        raise ValueError("layouts: every entry is None; at least one sequence needs a layout")
    heads, b = given[0].heads, given[0].blocksize
    for s, lay in enumerate(layouts):
        n_q, n_k = int(cu_q[s + 1] - cu_q[s]), int(cu_k[s + 1] - cu_k[s])
        if lay is None:  # an empty sequence (no queries or no keys) has no layout
            if n_q and n_k:
                raise ValueError(
                    f"layouts[{s}]: None, but sequence {s} has {n_q} queries and {n_k} keys"
                )
            continue
        if lay.blocksize != b or lay.heads != heads:
            raise ValueError(
                f"layouts[{s}]: blocksize {lay.blocksize}, heads {lay.heads}; every layout of a "
                f"packed batch needs the first layout's blocksize {b} and heads {heads}"
            )
        if (lay.n_q, lay.n_ctx) != (n_q, n_k):
            raise ValueError(
                f"layouts[{s}]: built for n_q={lay.n_q}, n_ctx={lay.n_ctx}, but sequence {s} has "
                f"{n_q} queries and {n_k} keys"
                + ("" if n_q and n_k else " (an empty one takes None)")
            )
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    nbq, nb = ceil_div(total_q, b), ceil_div(total_k, b)
    computed = np.array_equal(cu_q, cu_k) and any(lay.perm is not None for lay in given)
    perm = None
    if computed:
        perm = np.concatenate(
            [  # an empty sequence (no layout) holds no token
                start + (np.arange(0) if lay is None else _order(lay))
                for start, lay in zip(cu_q[:-1], layouts, strict=True)
            ]
        )
    candidates = np.zeros((heads, nbq, nb), dtype=bool)
    for s, lay in enumerate(layouts):
        if lay is None:
            continue
        source = lay.blocks if computed else natural_cover(lay)
        for h in range(heads):
            i, j = np.nonzero(source[h])
            # a source block spans at most two packed blocks on each axis
            for dq in (0, b - 1):
                q = np.minimum(i * b + dq, lay.n_q - 1) + cu_q[s]
                for dk in (0, b - 1):
                    k = np.minimum(j * b + dk, lay.n_ctx - 1) + cu_k[s]
                    candidates[h, q // b, k // b] = True
    starts_q, starts_k = np.asarray(cu_q[:-1]), np.asarray(cu_k[:-1])

    def mask_fn(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        # q and k are packed computed positions; with ``perm`` a sequence's computed positions
        # are its own token range, so the sequence is found the same way in either order.
        h, q, k = np.broadcast_arrays(h, q, k)
        seq = np.searchsorted(cu_q, q, side="right") - 1
        same = seq == np.searchsorted(cu_k, k, side="right") - 1
        out = np.zeros(q.shape, dtype=bool)
        for s in np.unique(seq[same]):
            sel = same & (seq == s)
            out[sel] = layouts[s].allowed(
                h[sel], q[sel] - starts_q[s], k[sel] - starts_k[s], natural=not computed
            )
        return out

    return bitmask_layout(candidates, b, total_k, mask_fn, "packed", n_q=total_q, perm=perm)


def coarsened(layout: Layout, blocksize: int) -> Layout:
    """The same elements on blocks of ``blocksize`` (a multiple of layout.blocksize), in the
    layout's computed order (a permutation is kept)."""
    check_positive_int("blocksize", blocksize)
    b = layout.blocksize
    if blocksize % b:
        raise ValueError(f"blocksize: {blocksize} is not a multiple of the layout's {b}")
    factor = blocksize // b
    heads, nbq, nb = layout.blocks.shape
    new_q, new_k = ceil_div(layout.n_q, blocksize), ceil_div(layout.n_ctx, blocksize)
    padded = np.zeros((heads, new_q * factor, new_k * factor), dtype=bool)
    padded[:, :nbq, :nb] = layout.blocks
    candidates = padded.reshape(heads, new_q, factor, new_k, factor).any(axis=(2, 4))

    def mask_fn(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        return layout.allowed(h, q, k, natural=False)

    return bitmask_layout(
        candidates, blocksize, layout.n_ctx, mask_fn, layout.name, n_q=layout.n_q, perm=layout.perm
    )


def restricted(layout: Layout, q_positions: np.ndarray, k_positions: np.ndarray) -> Layout:
    """Query rows ``q_positions`` of ``layout`` against its keys ``k_positions`` (natural token
    order; any integer sequences): row i of the result sees key j when ``layout`` lets row
    q_positions[i] see key k_positions[j]. Blocks no chosen element of which is allowed are
    dropped, so an empty result (``nnz.sum() == 0``) means the pair has nothing to compute."""
    qpos = np.asarray(q_positions, dtype=np.int64).reshape(-1)
    kpos = np.asarray(k_positions, dtype=np.int64).reshape(-1)
    checks = (("q_positions", qpos, layout.n_q), ("k_positions", kpos, layout.n_ctx))
    for name, pos, upper in checks:
        if pos.size == 0 or pos.min() < 0 or pos.max() >= upper:
            raise ValueError(f"{name} must be a non-empty set of indices in [0, {upper})")
    b = layout.blocksize

    # A local block may straddle two of the layout's natural-order blocks: it is a candidate
    # when any block it touches may hold an allowed element.
    def cover(pos: np.ndarray, count: int) -> np.ndarray:
        touches = np.zeros((ceil_div(len(pos), b), count), dtype=np.int32)
        touches[np.arange(len(pos)) // b, pos // b] = 1
        return touches

    active = natural_cover(layout).astype(np.int32)
    reach = cover(qpos, layout.num_q_blocks) @ active @ cover(kpos, layout.num_blocks).T
    candidates = reach > 0

    def mask_fn(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        return layout.allowed(h, qpos[q], kpos[k])

    return bitmask_layout(candidates, b, len(kpos), mask_fn, layout.name, n_q=len(qpos))
