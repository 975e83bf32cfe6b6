"""Layout: which blocks of the attention matrix are computed, and which elements inside them.

A layout is data, never code that a kernel compiles: a bool block array ``blocks[h, i, j]`` (query
block i of head h sees key block j), an element rule applied inside blocks that need it, and the
index arrays the kernels walk: CSR (row-major, forward and dQ) and CSC (column-major, dK and dV).

Semantics (docs/design.md §2). A layout is for ``n_q`` queries and ``n_ctx`` keys (square unless
``n_q`` is given). Query q of head h sees key k when all of these hold:
    blocks[h, q // b, k // b]  and  rule(h, q, k)  and  q < n_q  and  k < n_ctx
where ``rule`` is one of
    none      every element of an active block
    causal    k <= p, where p = q + q_offset is the query's position, q_offset = n_ctx - n_q
    window    p - k < window_left  and  k - p < window_right  (causal local: left=w, right=1)
    bitmask   per-block bit tables evaluated once, at build time, from a vectorised mask_fn(h, q, k)
With fewer queries than keys the queries are the last n_q positions (FlashAttention >= 2.1 and
SDPA's bottom-right causal mask); with more, the first n_q - n_ctx causal queries see nothing.
A layout may carry a token permutation ``perm`` (the computed order; square layouts only):
position p of the computed sequence holds token ``perm[p]`` of the caller's sequence. Blocks and
rule speak of computed order; ``to_mask()`` always answers in the caller's natural order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuattn._util import ceil_div

RULE_KINDS = ("none", "causal", "window", "bitmask")
BITS_PER_WORD = 32
# Active blocks whose element masks are evaluated at once when building a bitmask layout; bounds
# the build's temporary memory to MASK_CHUNK * b * b bytes.
MASK_CHUNK = 2048
# Widest block picture repr() draws before it groups several blocks into one character.
PICTURE_MAX_WIDTH = 64
FULL_BLOCK = -1

MaskFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]


@dataclass(frozen=True)
class ElementRule:
    """The element rule applied inside active blocks that are not fully allowed.

    Positions: p = q + n_ctx - n_q is query row q's position (end-aligned), k the key's.

    Args:
        kind (str): ``"none"`` (every element), ``"causal"`` (k <= p), ``"window"``
            (``p - k < window_left`` and ``k - p < window_right``) or ``"bitmask"`` (per-block
            bit tables from ``mask_fn``). Default ``"none"``.
        window_left (int): the window's bound before the query (kind ``"window"``; default 0).
        window_right (int): the window's bound after the query (kind ``"window"``; default 0;
            1 with a causal window).
        mask_fn (Callable, optional): ``mask_fn(h, q, k) -> bool array`` over broadcast
            integer arrays (kind ``"bitmask"``, where it is required).

    Raises:
        ValueError: an unknown ``kind``, or ``"bitmask"`` without ``mask_fn``.
    """

    kind: str = "none"
    window_left: int = 0
    window_right: int = 0
    mask_fn: MaskFn | None = None

    def __post_init__(self) -> None:
        if self.kind not in RULE_KINDS:
            raise ValueError(f"rule kind must be one of {RULE_KINDS}, got {self.kind!r}")
        if self.kind == "bitmask" and self.mask_fn is None:
            raise ValueError("rule kind 'bitmask' needs a mask_fn")


def _check_block_array(blocks: np.ndarray, name: str = "blocks") -> np.ndarray:
    arr = np.asarray(blocks)
    if arr.ndim == 2:
        arr = arr[None]
    if arr.ndim != 3:
        raise ValueError(
            f"{name} must be a [heads, n_q/b, n/b] (or [n_q/b, n/b]) 0/1 array, "
            f"got shape {arr.shape}"
        )
    if arr.dtype != np.bool_:
        if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
            raise TypeError(f"{name} must be a bool or 0/1 numeric array, got dtype {arr.dtype}")
        if not np.isin(arr, (0, 1)).all():
            raise ValueError(f"{name} must hold only 0 and 1")
    return arr.astype(bool)


def positions(
    i: np.ndarray, j: np.ndarray, b: int, n_ctx: int | None = None, n_q: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Query [R, b, 1] and key [R, 1, b] indices of R blocks.

    With ``n_ctx`` they are clipped to n_q - 1 (n_q defaults to n_ctx) and n_ctx - 1, so a mask_fn
    that indexes per-token tables never sees the padding of a ragged last block (whose elements
    the q < n_q and k < n_ctx bounds remove anyway).
    """
    r = np.arange(b)
    qpos = i[:, None, None] * b + r[None, :, None]
    kpos = j[:, None, None] * b + r[None, None, :]
    if n_ctx is not None:
        n_q = n_ctx if n_q is None else n_q
        qpos, kpos = np.minimum(qpos, n_q - 1), np.minimum(kpos, n_ctx - 1)
    return qpos, kpos


def _pack_bits(masks: np.ndarray) -> np.ndarray:
    """bool [N, b, b] -> uint32 [N, b, words]: bit (c % 32) of word (c // 32) is column c."""
    n, b, _ = masks.shape
    words = ceil_div(b, BITS_PER_WORD)
    padded = np.zeros((n, b, words * BITS_PER_WORD), dtype=bool)
    padded[:, :, :b] = masks
    packed = np.packbits(padded, axis=-1, bitorder="little")
    return packed.view("<u4").reshape(n, b, words).astype(np.uint32)


def _unpack_bits(table: np.ndarray, b: int) -> np.ndarray:
    """uint32 [N, b, words] -> bool [N, b, b] (inverse of _pack_bits)."""
    as_bytes = np.ascontiguousarray(table.astype("<u4")).view(np.uint8)
    bits = np.unpackbits(as_bytes, axis=-1, bitorder="little")
    return bits[:, :, :b].astype(bool)


class Layout:
    """Block-sparse attention layout: which blocks are computed, and which elements inside.

    Build one with :func:`cuattn.make_layout` (a named pattern) or :meth:`from_blocks` (your own
    blocks and element rule); the constructor takes the block array and a rule directly. The
    layout's contract (``allowed``) and what it holds: docs/design.md, section 2, and
    docs/patterns.md, section "A `Layout`: what it holds, how to look at it".

    Args:
        blocks (numpy.ndarray): bool or 0/1 [heads, nbq, nb] (or [nbq, nb], one head): query
            block i of head h sees key block j.
        blocksize (int): the block size b, positive.
        n_ctx (int, optional): the keys; None (default) is ``nb * blocksize``.
        rule (ElementRule, optional): the element rule inside active blocks; None (default):
            every element of an active block.
        perm (numpy.ndarray, optional): a permutation of range(n_ctx), the computed token order
            (square layouts only); None (default): natural order.
        name (str): the layout's name in its repr (default ``"custom"``).
        n_q (int, optional): the queries, end-aligned to the keys; None (default) is n_ctx when
            the block array is square, else ``nbq * blocksize``.

    Raises:
        TypeError: ``blocks`` neither bool nor numeric; ``blocksize``, ``n_ctx`` or ``n_q`` not
            an int.
        ValueError: ``blocks`` not 2-D or 3-D or holding values other than 0 and 1; a size not
            positive; the block array's shape unlike ``ceil(n / blocksize)`` on an axis;
            ``perm`` not a permutation of range(n_ctx), or given with n_q != n_ctx.

    Attributes (all arrays read-only):
        blocks      bool [heads, nbq, nb], nbq = ceil(n_q / blocksize), nb = ceil(n_ctx / blocksize)
        blocksize, heads, n_ctx (keys), n_q (queries; n_ctx unless given), q_offset = n_ctx - n_q,
        num_q_blocks (nbq), num_blocks (nb, key blocks), rule (ElementRule),
        perm (int64 [n_ctx] or None; square layouts only)
        row_ptr     int32 [heads, nbq + 1], absolute offsets into col_idx (CSR)
        col_idx     int32 [nnz_total]
        row_mask    int32 [nnz_total]: -1 = block fully allowed (no masking), >= 0 = apply the rule
                    (for kind 'bitmask' an index into mask_table)
        col_ptr, row_idx, col_mask   the same for CSC (key block -> query blocks)
        mask_table  uint32 [n_masks, b, ceil(b/32)] per-block bitmasks (kind 'bitmask' only)
        nnz         int64 [heads] active blocks per head; density = active / all blocks
    """

    def __init__(
        self,
        blocks: np.ndarray,
        blocksize: int,
        n_ctx: int | None = None,
        rule: ElementRule | None = None,
        perm: np.ndarray | None = None,
        name: str = "custom",
        n_q: int | None = None,
    ) -> None:
        blocks = _check_block_array(blocks)
        check_positive_int("blocksize", blocksize)
        heads, nbq, nb = blocks.shape
        if n_ctx is None:
            n_ctx = nb * blocksize
        check_positive_int("n_ctx", n_ctx)
        if n_q is None:
            n_q = n_ctx if nbq == nb else nbq * blocksize
        check_positive_int("n_q", n_q)
        for axis, length, count in (("n_ctx", n_ctx, nb), ("n_q", n_q, nbq)):
            if ceil_div(length, blocksize) != count:
                raise ValueError(
                    f"blocks has shape {blocks.shape} ([heads, query blocks, key blocks]), but "
                    f"{axis}={length} with blocksize={blocksize} needs "
                    f"ceil({axis} / blocksize) = {ceil_div(length, blocksize)} blocks on that axis"
                )
        self.rule = rule if rule is not None else ElementRule()
        self.blocksize = int(blocksize)
        self.heads = int(heads)
        self.n_ctx = int(n_ctx)
        self.n_q = int(n_q)
        self.q_offset = self.n_ctx - self.n_q
        self.num_blocks = int(nb)
        self.num_q_blocks = int(nbq)
        self.name = name
        if perm is not None and self.n_q != self.n_ctx:
            raise ValueError(
                f"perm: a permuted layout must be square, got n_q={n_q} queries and "
                f"n_ctx={n_ctx} keys"
            )
        if perm is not None:
            perm = np.asarray(perm, dtype=np.int64)
            if perm.shape != (n_ctx,) or not np.array_equal(np.sort(perm), np.arange(n_ctx)):
                raise ValueError(f"perm must be a permutation of range({n_ctx})")
            perm.setflags(write=False)
        self.perm = perm
        self._build(blocks)

    @classmethod
    def from_blocks(
        cls,
        blocks: np.ndarray,
        blocksize: int,
        mask_fn: MaskFn | None = None,
        n_ctx: int | None = None,
        n_q: int | None = None,
    ) -> Layout:
        """A user layout: a 0/1 block array and an optional element rule.

        Query q of head h sees key k when ``blocks[h, q//b, k//b] and mask_fn(h, q, k)``.

        Args:
            blocks (numpy.ndarray): bool or 0/1 [heads, n_q/b, n/b] (or [n_q/b, n/b]).
            blocksize (int): the block size b.
            mask_fn (Callable, optional): ``mask_fn(h, q, k) -> bool array``, evaluated with
                NumPy broadcasting (h, q, k integer arrays) once, at build time, over the
                active blocks only, into per-block bitmasks; it sees q < n_q and k < n_ctx (q is
                the query's row: add ``n_ctx - n_q`` for its end-aligned position). None
                (default): every element of an active block.
            n_ctx (int, optional): the keys; None (default) is ``n/b * blocksize``.
            n_q (int, optional): the queries, end-aligned; None (default) as in
                :class:`Layout`.

        Returns:
            Layout: the layout, named ``"custom"``.

        Raises:
            TypeError: ``mask_fn`` not callable, or returning a non-bool array; as
                :class:`Layout`.
            ValueError: as :class:`Layout`.

        Example:
            >>> import numpy as np
            >>> from cuattn import Layout
            >>> blocks = np.tril(np.ones((4, 4), dtype=bool))[None]
            >>> layout = Layout.from_blocks(blocks, 16, lambda h, q, k: k <= q)
            >>> layout.to_mask().shape
            (1, 64, 64)
        """
        if mask_fn is not None and not callable(mask_fn):
            raise TypeError(f"mask_fn must be callable(h, q, k) -> bool array, got {mask_fn!r}")
        rule = ElementRule("bitmask", mask_fn=mask_fn) if mask_fn is not None else None
        return cls(blocks, blocksize, n_ctx=n_ctx, rule=rule, name="custom", n_q=n_q)

    @classmethod
    def from_block_mask(
        cls, block_mask: Any, heads: int | None = None, blocksize: int | None = None
    ) -> Layout:
        """FlexAttention's ``BlockMask`` as a Layout.

        Its full and partial blocks, its ``mask_mod`` evaluated once over the partial ones into
        per-block bitmasks. Needs torch; docs/frameworks.md, section "FlexAttention's
        BlockMask".

        Args:
            block_mask (BlockMask): ``torch.nn.attention.flex_attention.BlockMask``, the same for
                every batch element.
            heads (int, optional): the heads, to broadcast a one-head mask; None (default): the
                mask's own.
            blocksize (int, optional): one of cuattn's block sizes dividing the mask's
                BLOCK_SIZE; None (default): the largest that does.

        Returns:
            Layout: the same pattern, for the mask's query and key lengths.

        Raises:
            TypeError: ``block_mask`` is not a BlockMask.
            ValueError: no cuattn block size divides its BLOCK_SIZE (or ``blocksize`` does not);
                the mask differs between batch elements; ``heads`` does not fit its heads.
        """
        from cuattn.adapters.flex import layout_from_block_mask

        return layout_from_block_mask(block_mask, heads, blocksize)

    def to_block_mask(self, device: Any = "cpu") -> Any:
        """This layout as a FlexAttention ``BlockMask``, in the caller's natural token order.

        Args:
            device (torch.device | str): where the mask's tensors go (default ``"cpu"``).

        Returns:
            BlockMask: for ``flex_attention`` (needs torch).
        """
        from cuattn.adapters.flex import to_block_mask

        return to_block_mask(self, device)

    # -- construction -------------------------------------------------------------------------

    def _build(self, blocks: np.ndarray) -> None:
        b, nb, nbq = self.blocksize, self.num_blocks, self.num_q_blocks
        row_ptr = np.zeros((self.heads, nbq + 1), dtype=np.int64)
        col_ptr = np.zeros((self.heads, nb + 1), dtype=np.int64)
        col_idx, row_mask, row_idx, col_mask, tables = [], [], [], [], []
        n_masks = 0
        offset = 0
        for h in range(self.heads):
            i, j = np.nonzero(blocks[h])
            mask_id, table = self._classify(h, i, j)
            if table is not None:
                mask_id = np.where(mask_id >= 0, mask_id + n_masks, mask_id)
                n_masks += len(table)
                tables.append(table)
            row_ptr[h] = offset + np.concatenate(([0], np.cumsum(np.bincount(i, minlength=nbq))))
            col_ptr[h] = offset + np.concatenate(([0], np.cumsum(np.bincount(j, minlength=nb))))
            by_col = np.lexsort((i, j))
            col_idx.append(j)
            row_mask.append(mask_id)
            row_idx.append(i[by_col])
            col_mask.append(mask_id[by_col])
            offset += len(i)
        words = ceil_div(b, BITS_PER_WORD)
        self.blocks = blocks
        self.row_ptr = row_ptr.astype(np.int32)
        self.col_ptr = col_ptr.astype(np.int32)
        self.col_idx = np.concatenate(col_idx).astype(np.int32)
        self.row_mask = np.concatenate(row_mask).astype(np.int32)
        self.row_idx = np.concatenate(row_idx).astype(np.int32)
        self.col_mask = np.concatenate(col_mask).astype(np.int32)
        self.mask_table = (
            np.concatenate(tables) if tables else np.zeros((0, b, words), dtype=np.uint32)
        )
        self.nnz = blocks.reshape(self.heads, -1).sum(axis=1).astype(np.int64)
        self.density = float(self.nnz.sum()) / (self.heads * nbq * nb)
        for arr in (
            self.blocks,
            self.row_ptr,
            self.col_ptr,
            self.col_idx,
            self.row_mask,
            self.row_idx,
            self.col_mask,
            self.mask_table,
            self.nnz,
        ):
            arr.setflags(write=False)
        assert self.row_ptr[-1, -1] == self.col_ptr[-1, -1] == len(self.col_idx) == offset

    def _classify(
        self, h: int, i: np.ndarray, j: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Per active block: -1 when every element is allowed, else >= 0 (a mask-table row)."""
        b, n, rule = self.blocksize, self.n_ctx, self.rule
        ragged = (j + 1) * b > n
        if rule.kind == "bitmask":
            return self._bitmask_ids(h, i, j, ragged)
        # Query positions (shifted by q_offset) against key positions; rows past n_q are never
        # stored, so the last query block's bound is n_q.
        q_lo, k_lo = i * b + self.q_offset, j * b
        q_hi, k_hi = np.minimum(i * b + b, self.n_q) - 1 + self.q_offset, k_lo + b - 1
        if rule.kind == "none":
            full = np.ones(len(i), dtype=bool)
        elif rule.kind == "causal":
            full = k_hi <= q_lo
        else:
            full = (q_hi - k_lo < rule.window_left) & (k_hi - q_lo < rule.window_right)
        return np.where(full & ~ragged, FULL_BLOCK, 0).astype(np.int64), None

    def _bitmask_ids(
        self, h: int, i: np.ndarray, j: np.ndarray, ragged: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        b = self.blocksize
        packed = []
        full = np.zeros(len(i), dtype=bool)
        for start in range(0, len(i), MASK_CHUNK):
            sl = slice(start, start + MASK_CHUNK)
            masks = self._eval_mask_fn(h, i[sl], j[sl])
            full[sl] = masks.all(axis=(1, 2))
            packed.append(_pack_bits(masks))
        words = ceil_div(b, BITS_PER_WORD)
        packed_all = np.concatenate(packed) if packed else np.zeros((0, b, words), np.uint32)
        needs = ~full | ragged
        ids = np.full(len(i), FULL_BLOCK, dtype=np.int64)
        if not needs.any():
            return ids, np.zeros((0, b, words), dtype=np.uint32)
        flat = packed_all[needs].reshape(int(needs.sum()), -1)
        table, inverse = np.unique(flat, axis=0, return_inverse=True)
        ids[needs] = inverse.reshape(-1)
        return ids, table.reshape(-1, b, words).astype(np.uint32)

    def _eval_mask_fn(self, h: int, i: np.ndarray, j: np.ndarray) -> np.ndarray:
        qpos, kpos = positions(i, j, self.blocksize, self.n_ctx, self.n_q)
        out = self.rule.mask_fn(np.int64(h), qpos, kpos)
        out = np.asarray(out)
        if out.dtype != np.bool_:
            raise TypeError(f"mask_fn must return a bool array, got dtype {out.dtype}")
        return np.broadcast_to(out, qpos.shape[:1] + (self.blocksize, self.blocksize)).copy()

    # -- queries ------------------------------------------------------------------------------

    def block_masks(
        self, h: np.ndarray, i: np.ndarray, j: np.ndarray, mask_id: np.ndarray
    ) -> np.ndarray:
        """Element masks of R active blocks, in computed order, the sequence end included.

        Args:
            h (numpy.ndarray): int [R], each block's head (read by the bitmask rule's ids only).
            i (numpy.ndarray): int [R], each block's query block.
            j (numpy.ndarray): int [R], each block's key block.
            mask_id (numpy.ndarray): int [R], each block's ``row_mask``/``col_mask`` entry.

        Returns:
            numpy.ndarray: bool [R, b, b].
        """
        b, kind = self.blocksize, self.rule.kind
        qpos, kpos = positions(np.asarray(i), np.asarray(j), b)
        if kind == "none":
            masks = np.ones((len(i), b, b), dtype=bool)
        elif kind == "causal":
            masks = kpos <= qpos + self.q_offset
        elif kind == "window":
            diff = qpos + self.q_offset - kpos
            masks = (diff < self.rule.window_left) & (-diff < self.rule.window_right)
        else:
            mask_id = np.asarray(mask_id)
            masks = np.ones((len(mask_id), b, b), dtype=bool)
            needs = mask_id >= 0
            masks[needs] = _unpack_bits(self.mask_table[mask_id[needs]], b)
        return masks & (kpos < self.n_ctx)

    def allowed(
        self, h: np.ndarray, q: np.ndarray, k: np.ndarray, natural: bool = True
    ) -> np.ndarray:
        """Whether query row q of head h sees key k: the layout's whole contract in one call.

        Blocks, element rule and bounds, element-wise; costs O(elements asked), so ask in
        chunks.

        Args:
            h (numpy.ndarray): head indices (any integer array broadcasting with q and k).
            q (numpy.ndarray): query rows; outside [0, n_q) nothing is allowed.
            k (numpy.ndarray): key indices; outside [0, n_ctx) nothing is allowed.
            natural (bool): q and k in the caller's natural token order (default True), or in
                the computed (permuted) order.

        Returns:
            numpy.ndarray: bool, the broadcast shape of h, q and k.
        """
        h, q, k = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (h, q, k)))
        inside = (q >= 0) & (q < self.n_q) & (k >= 0) & (k < self.n_ctx) & (h >= 0)
        inside &= h < self.heads
        h, q, k = (np.where(inside, x, 0) for x in (h, q, k))
        if natural and self.perm is not None:
            computed = np.empty_like(self.perm)
            computed[self.perm] = np.arange(self.n_ctx)
            q, k = computed[q], computed[k]
        b, kind, pos = self.blocksize, self.rule.kind, q + self.q_offset
        on = self.blocks[h, q // b, k // b]
        if kind == "causal":
            on &= k <= pos
        elif kind == "window":
            on &= (pos - k < self.rule.window_left) & (k - pos < self.rule.window_right)
        elif kind == "bitmask":
            on &= np.asarray(self.rule.mask_fn(h, q, k), dtype=bool)
        return inside & on

    def density_at(self, blocksize: int) -> float:
        """Density of this layout on coarser blocks: the share of them holding an active block.

        What the kernels walk for a block size they run coarsened (block 8 on 16-blocks), beside
        ``density`` at the layout's own size.

        Args:
            blocksize (int): the coarser block size, a multiple of the layout's.

        Returns:
            float: in [0, 1].

        Raises:
            TypeError: ``blocksize`` is not an int.
            ValueError: ``blocksize`` is not positive or not a multiple of the layout's.
        """
        check_positive_int("blocksize", blocksize)
        if blocksize % self.blocksize:
            raise ValueError(f"blocksize: {blocksize} is not a multiple of {self.blocksize}")
        factor = blocksize // self.blocksize
        rows, cols = ceil_div(self.num_q_blocks, factor), ceil_div(self.num_blocks, factor)
        grid = np.zeros((self.heads, rows * factor, cols * factor), dtype=bool)
        grid[:, : self.num_q_blocks, : self.num_blocks] = self.blocks
        coarse = grid.reshape(self.heads, rows, factor, cols, factor).any(axis=(2, 4))
        return float(coarse.sum()) / coarse.size

    def row_entries(self, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every active block of one head, in CSR order.

        Args:
            h (int): the head.

        Returns:
            tuple: ``(query_block, key_block, mask_id)``, three int arrays [nnz[h]] (mask_id as
            ``row_mask``: -1 for a full block).
        """
        lo, hi = self.row_ptr[h, 0], self.row_ptr[h, -1]
        rows = np.repeat(np.arange(self.num_q_blocks), np.diff(self.row_ptr[h]))
        return rows, self.col_idx[lo:hi], self.row_mask[lo:hi]

    def to_mask(self) -> np.ndarray:
        """The dense element mask, in the caller's natural token order (for small lengths).

        Returns:
            numpy.ndarray: bool [heads, n_q, n_ctx].
        """
        b, nb, nbq = self.blocksize, self.num_blocks, self.num_q_blocks
        full = np.zeros((self.heads, nbq * b, nb * b), dtype=bool)
        for h in range(self.heads):
            rows, cols, ids = self.row_entries(h)
            masks = self.block_masks(np.full(len(rows), h), rows, cols, ids)
            view = full[h].reshape(nbq, b, nb, b)
            view[rows, :, cols, :] = masks
        mask = full[:, : self.n_q, : self.n_ctx]
        if self.perm is not None:
            natural = np.zeros_like(mask)
            natural[:, self.perm[:, None], self.perm[None, :]] = mask
            mask = natural
        return mask

    def __repr__(self) -> str:
        queries = f", n_q={self.n_q}" if self.n_q != self.n_ctx else ""
        head = (
            f"Layout({self.name!r}, n_ctx={self.n_ctx}{queries}, heads={self.heads}, "
            f"blocksize={self.blocksize}, rule={self.rule.kind!r}, "
            f"density={self.density:.3f}{', permuted' if self.perm is not None else ''})"
        )
        return head + "\n" + self.picture()

    def picture(
        self,
        max_width: int = PICTURE_MAX_WIDTH,
        natural: bool = True,
        heads: Sequence[int] | None = None,
    ) -> str:
        """ASCII block picture per head: '█' full block, '░' partial, '·' off.

        Args:
            max_width (int): the most characters per row (default 64); with more blocks a
                character stands for a group of them: '█' all full, '░' any active.
            natural (bool): draw in the caller's natural token order (default True); False
                draws a permuted layout's blocks as computed.
            heads (Sequence[int], optional): the heads to draw; None (default): every head.

        Returns:
            str: a title line for a permuted layout, then per head a ``head h`` line and one
            line per row of blocks.

        Raises:
            TypeError: a head index is not an int.
            ValueError: a head out of range; ``max_width`` < 1.
        """
        shown = range(self.heads) if heads is None else list(heads)
        for h in shown:
            if isinstance(h, bool) or not isinstance(h, (int, np.integer)):
                raise TypeError(f"heads: expected head indices, got {type(h).__name__}")
            if not 0 <= h < self.heads:
                raise ValueError(f"heads: head {h} out of range; the layout has {self.heads}")
        if max_width < 1:
            raise ValueError(f"max_width: got {max_width}, expected a positive width")
        if natural and self.perm is not None:
            active, full = self._natural_blocks()
            title = "natural token order; computed permuted, as picture(natural=False) shows"
        else:
            active, full = self.blocks, self._full_blocks()
            title = "computed (permuted) order" if self.perm is not None else ""
        nb, nbq = self.num_blocks, self.num_q_blocks
        group = max(1, math.ceil(nb / max_width))
        cells, row_cells = ceil_div(nb, group), ceil_div(nbq, group)
        pads = ((0, 0), (0, row_cells * group - nbq), (0, cells * group - nb))
        active, full = np.pad(active, pads), np.pad(full, pads)
        grouped = (self.heads, row_cells, group, cells, group)
        any_on = active.reshape(grouped).any(axis=(2, 4))
        all_full = full.reshape(grouped).all(axis=(2, 4))
        lines = [title] if title else []
        for h in shown:
            lines.append(
                f"head {h}" + (f" ({group}x{group} blocks per character)" if group > 1 else "")
            )
            for r in range(row_cells):
                lines.append(
                    "".join(
                        "█" if all_full[h, r, c] else ("░" if any_on[h, r, c] else "·")
                        for c in range(cells)
                    )
                )
        return "\n".join(lines)

    def _full_blocks(self) -> np.ndarray:
        """bool [heads, nbq, nb]: active blocks whose every element is allowed (computed order)."""
        full = np.zeros(self.blocks.shape, dtype=bool)
        for h in range(self.heads):
            rows, cols, ids = self.row_entries(h)
            full[h, rows, cols] = ids == FULL_BLOCK
        return full

    def _natural_blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """(active, full) bool [heads, nb, nb] in natural token order, counted element by
        element from the computed blocks, a chunk at a time (no [n, n] array)."""
        b, nb, n = self.blocksize, self.num_blocks, self.n_ctx
        natural_block = self.perm // b  # computed position -> its token's natural block
        counts = np.zeros((self.heads, nb, nb), dtype=np.int64)
        for h in range(self.heads):
            rows, cols, ids = self.row_entries(h)
            for start in range(0, len(rows), MASK_CHUNK):
                sl = slice(start, start + MASK_CHUNK)
                masks = self.block_masks(np.full(len(rows[sl]), h), rows[sl], cols[sl], ids[sl])
                qpos, kpos = positions(rows[sl], cols[sl], b)
                allowed = masks & (qpos < n)
                q_nat = natural_block[np.minimum(qpos, n - 1)]
                k_nat = natural_block[np.minimum(kpos, n - 1)]
                shape = allowed.shape
                np.add.at(
                    counts[h],
                    (
                        np.broadcast_to(q_nat, shape)[allowed],
                        np.broadcast_to(k_nat, shape)[allowed],
                    ),
                    1,
                )
        sizes = np.minimum(b, n - np.arange(nb) * b)  # tokens per natural block (ragged last)
        return counts > 0, counts == sizes[:, None] * sizes[None, :]


def check_positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
