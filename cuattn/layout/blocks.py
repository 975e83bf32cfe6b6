"""Block-level building blocks of the pattern constructors: block counts, the causal cut,
windows, pruning candidate blocks by an element rule, and argument checks."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cuattn._util import ceil_div
from cuattn.layout.layout import (
    MASK_CHUNK,
    ElementRule,
    Layout,
    MaskFn,
    check_positive_int,
    positions,
)


def block_count(n_ctx: int, blocksize: int) -> int:
    return ceil_div(n_ctx, blocksize)


def require_ctx(name: str, value: object, mode: str) -> int:
    if value is None:
        raise ValueError(f"attn_mode={mode!r} needs {name} (a positive int), got None")
    check_positive_int(name, value)
    return int(value)


def causal_cut(blocks: np.ndarray) -> np.ndarray:
    """Turn off every block above the diagonal (j > i): causal rows never see them."""
    return blocks & np.tril(np.ones(blocks.shape[-2:], dtype=bool))


def window_blocks(nb: int, b: int, left: int, right: int, n_ctx: int) -> np.ndarray:
    """Blocks holding at least one (q, k) with q - k < left and k - q < right, both < n_ctx."""
    i = np.arange(nb)[:, None]
    j = np.arange(nb)[None, :]
    q_lo, k_lo = i * b, j * b
    q_hi, k_hi = np.minimum(q_lo + b, n_ctx) - 1, np.minimum(k_lo + b, n_ctx) - 1
    return (q_lo - k_hi < left) & (k_lo - q_hi < right)


def prune_blocks(
    candidates: np.ndarray, blocksize: int, n_ctx: int, mask_fn: MaskFn, n_q: int | None = None
) -> np.ndarray:
    """Keep the candidate blocks where mask_fn allows at least one element (q < n_q, k < n_ctx;
    n_q defaults to n_ctx)."""
    n_q = n_ctx if n_q is None else n_q
    heads = candidates.shape[0]
    blocks = np.zeros_like(candidates)
    for h in range(heads):
        i, j = np.nonzero(candidates[h])
        for start in range(0, len(i), MASK_CHUNK):
            sl = slice(start, start + MASK_CHUNK)
            qpos, kpos = positions(i[sl], j[sl], blocksize)
            inside = (qpos < n_q) & (kpos < n_ctx)
            qpos, kpos = np.minimum(qpos, n_q - 1), np.minimum(kpos, n_ctx - 1)
            allowed = inside & np.broadcast_to(
                mask_fn(np.int64(h), qpos, kpos), (len(qpos), blocksize, blocksize)
            )
            blocks[h, i[sl], j[sl]] = allowed.any(axis=(1, 2))
    return blocks


def bitmask_layout(
    candidates: np.ndarray,
    blocksize: int,
    n_ctx: int,
    mask_fn: MaskFn,
    name: str,
    n_q: int | None = None,
    perm: np.ndarray | None = None,
) -> Layout:
    """The candidate blocks mask_fn allows anything in, with mask_fn as the element rule."""
    blocks = prune_blocks(candidates, blocksize, n_ctx, mask_fn, n_q)
    rule = ElementRule("bitmask", mask_fn=mask_fn)
    return Layout(blocks, blocksize, n_ctx=n_ctx, rule=rule, perm=perm, name=name, n_q=n_q)


def int_tuple(name: str, value: object, upper: int) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, Sequence | np.ndarray):
        raise TypeError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must hold ints, got {v!r}")
        if not 0 <= v < upper:
            raise ValueError(f"{name} entries must be in [0, {upper}), got {v}")
        out.append(int(v))
    return tuple(out)


def layout_density_vs_causal(layout: Layout) -> float:
    """Active blocks over the blocks of a dense causal layout of the same size (for benchmarks)."""
    nb = layout.num_blocks
    return float(layout.nnz.sum()) / (layout.heads * nb * (nb + 1) / 2)
