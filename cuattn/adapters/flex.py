"""FlexAttention's ``BlockMask`` in and out: ``Layout.from_block_mask``, ``Layout.to_block_mask``.

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    mask = create_block_mask(mask_mod, 1, heads, n, n)      # Flex code as it is
    out = flex_attention(q, k, v, block_mask=mask)
    out = cuattn.sparse_attention(q, k, v, cuattn.Layout.from_block_mask(mask))  # the same

A BlockMask lists, per (batch, head, query block), the key blocks that are computed: the
"full" ones (``full_kv_*``: every pair attends) and the partial ones (``kv_*``: ``mask_mod``
decides each pair). A Layout holds the same per head, at one square block size: the partial
blocks' pairs are ``mask_mod`` evaluated once, when the layout is built, into per-block
bitmasks (a pattern is data). Flex's ``BLOCK_SIZE`` may be (q, kv) and any size that one of
cuattn's block sizes divides; the layout takes the largest such size (``blocksize=`` picks
another). Layouts have no batch axis: a BlockMask whose blocks or ``mask_mod`` differ between
batch elements is refused (one layout per element, or ``sparse_attention_varlen``); one with a
single head broadcasts to ``heads=``.

``to_block_mask`` goes back: the layout's blocks in the caller's natural token order, full
where every pair of a block attends, with a ``mask_mod`` that reads the layout's pairs from a
table of its partial blocks (each block's bits, b x b, kept on ``device``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask

from cuattn.backends.geometry import BLOCK_SIZES
from cuattn.layout.layout import MASK_CHUNK, Layout, positions

__all__ = ["layout_from_block_mask", "to_block_mask"]


def _dense_blocks(num: torch.Tensor | None, indices: torch.Tensor | None, cols: int) -> np.ndarray:
    """bool [B, H, q blocks, cols] from Flex's (num_blocks, indices) pair (None: none)."""
    if num is None:
        return np.zeros((0, 0, 0, cols), dtype=bool)
    num, indices = num.detach().cpu().numpy(), indices.detach().cpu().numpy()
    listed = np.arange(indices.shape[-1]) < num[..., None]
    dense = np.zeros((*num.shape, cols + 1), dtype=bool)
    # unlisted slots (and indices past the keys) write to a spare last column, dropped
    slots = np.where(listed, np.clip(indices, 0, cols), cols)
    np.put_along_axis(dense, slots.astype(np.int64), True, axis=-1)
    return dense[..., :cols]


def _blocksize(q_block: int, kv_block: int, blocksize: int | None) -> int:
    common = math.gcd(q_block, kv_block)
    if blocksize is not None:
        if blocksize not in BLOCK_SIZES or common % blocksize:
            raise ValueError(
                f"blocksize must be one of cuattn's {BLOCK_SIZES} dividing the BlockMask's "
                f"BLOCK_SIZE {(q_block, kv_block)}, got {blocksize}"
            )
        return blocksize
    fits = [b for b in BLOCK_SIZES if common % b == 0]
    if not fits:
        raise ValueError(
            f"block_mask has BLOCK_SIZE {(q_block, kv_block)}, which none of cuattn's block "
            f"sizes {BLOCK_SIZES} divides; build it with BLOCK_SIZE a multiple of "
            f"{BLOCK_SIZES[0]}"
        )
    return max(fits)


def layout_from_block_mask(
    block_mask: BlockMask, heads: int | None = None, blocksize: int | None = None
) -> Layout:
    """The Layout of ``block_mask`` (module doc)."""
    if not isinstance(block_mask, BlockMask):
        raise TypeError(
            "block_mask must be a torch.nn.attention.flex_attention.BlockMask, got "
            f"{type(block_mask).__name__}"
        )
    n_q, n_k = (int(x) for x in block_mask.seq_lengths)
    q_block, kv_block = (int(x) for x in block_mask.BLOCK_SIZE)
    b = _blocksize(q_block, kv_block, blocksize)
    cols = math.ceil(n_k / kv_block)
    listed = _dense_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, cols)
    full = _dense_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, cols)
    if full.size == 0:
        full = np.zeros_like(listed)
    rows = math.ceil(n_q / q_block)
    listed, full = listed[:, :, :rows], full[:, :, :rows]
    if not ((listed == listed[:1]).all() and (full == full[:1]).all()):
        raise ValueError(
            "block_mask differs between batch elements; a Layout is one pattern for every "
            "element: build one BlockMask (and Layout) per element, or pack the sequences "
            "and call cuattn.sparse_attention_varlen"
        )
    listed, full = listed[0], full[0]
    given_heads = listed.shape[0]
    if heads is None:
        heads = given_heads
    if given_heads not in (1, heads):
        raise ValueError(
            f"heads={heads} does not fit block_mask's {given_heads} heads (1 broadcasts)"
        )
    listed = np.broadcast_to(listed, (heads, *listed.shape[1:]))
    full = np.broadcast_to(full, (heads, *full.shape[1:]))
    # cuattn blocks of b inside Flex's blocks of (q_block, kv_block)
    nbq, nb = math.ceil(n_q / b), math.ceil(n_k / b)
    q_of, k_of = np.arange(nbq) * b // q_block, np.arange(nb) * b // kv_block
    active = (listed | full)[:, q_of][:, :, k_of]
    full_b = full[:, q_of][:, :, k_of]
    mask_mod = block_mask.mask_mod
    batch = int(block_mask.kv_num_blocks.shape[0])
    device = block_mask.kv_num_blocks.device

    def mask_fn(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        in_full = full_b[h, q // b, k // b]
        if mask_mod is None:  # Flex's "noop": every pair of a listed block attends
            return np.ones(np.shape(in_full), dtype=bool)
        args = [torch.as_tensor(np.asarray(x), device=device) for x in (h, q, k)]
        first = None
        for element in range(batch):
            got = mask_mod(torch.tensor(element, device=device), *args)
            got = np.broadcast_to(got.detach().cpu().numpy().astype(bool), np.shape(in_full))
            if first is None:
                first = got
            elif not np.array_equal(got[~in_full], first[~in_full]):
                raise ValueError(
                    "block_mask's mask_mod differs between batch elements; a Layout is one "
                    "pattern for every element: build one per element, or pack the sequences "
                    "and call cuattn.sparse_attention_varlen"
                )
        return in_full | first

    return Layout.from_blocks(active.copy(), b, mask_fn, n_ctx=n_k, n_q=n_q)


def to_block_mask(layout: Layout, device: Any = "cpu") -> BlockMask:
    """``layout`` as a FlexAttention BlockMask on ``device`` (module doc)."""
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a cuattn.Layout, got {type(layout).__name__}")
    b = layout.blocksize
    if layout.perm is None:
        active, full = layout.blocks.astype(bool), layout._full_blocks()
    else:
        active, full = layout._natural_blocks()
    partial = active & ~full
    h, i, j = np.nonzero(partial)
    bits = np.zeros((len(h) + 2, b, b), dtype=bool)
    bits[-1] = True  # the last two rows: a block that is off, and one that is full
    for start in range(0, len(h), MASK_CHUNK):
        sl = slice(start, min(start + MASK_CHUNK, len(h)))
        qpos, kpos = positions(i[sl], j[sl], b)
        bits[sl] = layout.allowed(h[sl, None, None], qpos, kpos)
    off, on = len(h), len(h) + 1
    table = np.where(full, on, off)
    table[h, i, j] = np.arange(len(h))
    table_t = torch.as_tensor(table, device=device)
    bits_t = torch.as_tensor(bits, device=device)

    def mask_mod(batch: Any, head: Any, q_idx: Any, kv_idx: Any) -> Any:
        return bits_t[table_t[head, q_idx // b, kv_idx // b], q_idx % b, kv_idx % b]

    def listing(which: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        count = which.sum(-1)
        order = np.argsort(~which, axis=-1, kind="stable")  # listed blocks first, in order
        as_tensor = (
            torch.as_tensor(x[None], dtype=torch.int32, device=device) for x in (count, order)
        )
        return tuple(as_tensor)

    kv_num, kv_idx = listing(partial)
    full_num, full_idx = listing(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=b,
        mask_mod=mask_mod,
        seq_lengths=(layout.n_q, layout.n_ctx),
    )
