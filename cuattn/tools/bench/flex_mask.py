"""A FlexAttention BlockMask that computes exactly what a cuattn Layout computes.

FlexAttention's kernels tile the mask in FLEX_BLOCK x FLEX_BLOCK tiles (128 by default). When the
layout's block size is 128 the BlockMask's kv lists are our CSR rows as they are: partial blocks
(row_mask >= 0) in kv_*, fully allowed ones (row_mask == -1) in full_kv_*. For other block sizes
our block array is regridded onto Flex's tiles (a tile is active when any of our blocks in it is,
"full" when all of them are full), and mask_mod evaluates our block array plus the element rule
per element inside partial tiles, so the computed set of (q, k) pairs is the same.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuattn._util import ceil_div
from cuattn.layout.device import DeviceLayout

FLEX_BLOCK = 128
BITS_PER_WORD = 32


def block_classes(layout: Any) -> tuple[np.ndarray, np.ndarray]:
    """(active, full) bool [heads, nb, nb] from the layout's CSR arrays."""
    heads, nb = layout.heads, layout.num_blocks
    active = np.zeros((heads, nb, nb), dtype=bool)
    full = np.zeros((heads, nb, nb), dtype=bool)
    for h in range(heads):
        for i in range(nb):
            lo, hi = layout.row_ptr[h, i], layout.row_ptr[h, i + 1]
            cols = layout.col_idx[lo:hi]
            active[h, i, cols] = True
            full[h, i, cols] = layout.row_mask[lo:hi] < 0
    return active, full


def regrid(active: np.ndarray, full: np.ndarray, blocksize: int, n_ctx: int, tile: int):
    """Our [H, nb, nb] block classes -> Flex's [H, nt, nt] tile classes (any / all)."""
    fine = math.gcd(blocksize, tile)
    up, down = blocksize // fine, tile // fine
    heads = active.shape[0]
    n_tiles = ceil_div(n_ctx, tile)
    size = n_tiles * down

    def resample(x: np.ndarray, pad_value: bool, reduce: str) -> np.ndarray:
        fine_grid = np.repeat(np.repeat(x, up, axis=1), up, axis=2)[:, :size, :size]
        padded = np.full((heads, size, size), pad_value, dtype=bool)
        padded[:, : fine_grid.shape[1], : fine_grid.shape[2]] = fine_grid
        tiles = padded.reshape(heads, n_tiles, down, n_tiles, down)
        return getattr(tiles, reduce)(axis=(2, 4))

    tile_active = resample(active, False, "any")
    tile_full = resample(full, False, "all") & tile_active
    if n_ctx % tile:  # a ragged last tile always needs the sequence bound applied
        tile_full[:, -1, :] = False
        tile_full[:, :, -1] = False
    return tile_active, tile_full


def _kv_lists(classes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[H, nt, nt] bool -> (num [1, H, nt], indices [1, H, nt, nt]) with active columns first."""
    num = classes.sum(axis=-1).astype(np.int32)
    order = np.argsort(~classes, axis=-1, kind="stable").astype(np.int32)
    return num[None], order[None]


def element_rule_mod(layout: Any, device: Any) -> Any:
    """mask_mod(b, h, q, k) -> allowed, evaluated only inside partial tiles."""
    import torch

    b = layout.blocksize
    blocks = torch.as_tensor(np.ascontiguousarray(layout.blocks), device=device)
    rule = layout.rule
    kind = rule.kind
    if kind == "bitmask":
        mask_id = torch.full(layout.blocks.shape, -1, dtype=torch.int64)
        for h in range(layout.heads):
            for i in range(layout.num_blocks):
                lo, hi = layout.row_ptr[h, i], layout.row_ptr[h, i + 1]
                mask_id[h, i, torch.as_tensor(layout.col_idx[lo:hi], dtype=torch.int64)] = (
                    torch.as_tensor(layout.row_mask[lo:hi], dtype=torch.int64)
                )
        mask_id = mask_id.to(device)
        table = torch.as_tensor(layout.mask_table.astype(np.int64), device=device)

    def mask_mod(batch: Any, head: Any, q: Any, k: Any) -> Any:
        allowed = blocks[head, q // b, k // b]
        if kind == "causal":
            allowed = allowed & (k <= q)
        elif kind == "window":
            allowed = allowed & (q - k < rule.window_left) & (k - q < rule.window_right)
        elif kind == "bitmask":
            mid = mask_id[head, q // b, k // b]
            word = table[mid.clamp(min=0), q % b, (k % b) // BITS_PER_WORD]
            bit = (word >> (k % BITS_PER_WORD)) & 1
            allowed = allowed & ((mid < 0) | (bit == 1))
        return allowed

    return mask_mod


def block_mask_from_layout(layout: Any, device: Any) -> Any:
    """torch BlockMask (batch dim 1, broadcast) for this layout, on `device` (built on the
    host, as a FlexAttention user builds one per step; a DeviceLayout is copied there first)."""
    import torch
    from torch.nn.attention.flex_attention import BlockMask

    if isinstance(layout, DeviceLayout):
        layout = layout.host()
    active, full = block_classes(layout)
    tile = FLEX_BLOCK
    if layout.blocksize != tile:
        active, full = regrid(active, full, layout.blocksize, layout.n_ctx, tile)
    partial = active & ~full
    kv_num, kv_idx = _kv_lists(partial)
    full_num, full_idx = _kv_lists(full)

    def on_device(x: np.ndarray) -> Any:
        return torch.as_tensor(x, device=device)

    return BlockMask.from_kv_blocks(
        on_device(kv_num),
        on_device(kv_idx),
        on_device(full_num),
        on_device(full_idx),
        tile,
        element_rule_mod(layout, device),
        (layout.n_ctx, layout.n_ctx),
    )
