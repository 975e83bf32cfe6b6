"""Patterns beyond the original: Longformer, BigBird and DeepSpeed's ``variable``, each a
registered constructor whose docstring states its element rule (docs/design.md §2)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from cuattn.layout.blocks import (
    bitmask_layout,
    block_count,
    causal_cut,
    int_tuple,
    require_ctx,
    window_blocks,
)
from cuattn.layout.layout import ElementRule, Layout
from cuattn.layout.registry import register


@register("longformer")
def longformer_layout(
    n_ctx: int,
    heads: int,
    blocksize: int,
    local_attn_ctx: int | None,
    causal: bool = False,
    global_tokens: Sequence[int] = (0,),
) -> Layout:
    """``longformer``: sliding window plus global tokens G (``global_tokens``, default (0,)).

    allowed(h, q, k) = |q - k| < w or q in G or k in G, w = local_attn_ctx; with ``causal=True``
    additionally k <= q (then a global query sees every earlier key).
    """
    w = require_ctx("local_attn_ctx", local_attn_ctx, "longformer")
    glob = np.array(int_tuple("global_tokens", global_tokens, n_ctx), dtype=np.int64)
    nb = block_count(n_ctx, blocksize)

    def rule_fn(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        hit = (np.abs(q - k) < w) | np.isin(q, glob) | np.isin(k, glob)
        return hit & (k <= q) if causal else hit

    candidates = window_blocks(nb, blocksize, w, w, n_ctx)
    gblocks = np.unique(glob // blocksize)
    candidates[gblocks, :] = True
    candidates[:, gblocks] = True
    candidates = np.broadcast_to(candidates, (heads, nb, nb))
    if causal:
        candidates = causal_cut(candidates)
    return bitmask_layout(candidates, blocksize, n_ctx, rule_fn, "longformer")


def _random_blocks(
    rng: np.random.Generator, taken: np.ndarray, count: int, causal: bool
) -> np.ndarray:
    """Per row, ``count`` extra key blocks drawn without replacement from those not yet on."""
    nb = taken.shape[0]
    extra = np.zeros_like(taken)
    for i in range(nb):
        limit = i + 1 if causal else nb
        free = np.flatnonzero(~taken[i, :limit])
        if len(free):
            extra[i, rng.choice(free, size=min(count, len(free)), replace=False)] = True
    return extra


def _block_level_layout(
    base: np.ndarray,
    heads: int,
    blocksize: int,
    n_ctx: int,
    causal: bool,
    num_random_blocks: int,
    seed: int,
    name: str,
) -> Layout:
    """A pattern defined on blocks: ``base`` plus seeded random blocks per head, per row."""
    rng = np.random.default_rng(seed)
    blocks = np.stack(
        [base | _random_blocks(rng, base, num_random_blocks, causal) for _ in range(heads)]
    )
    return Layout(blocks, blocksize, n_ctx, ElementRule("causal" if causal else "none"), name=name)


@register("bigbird")
def bigbird_layout(
    n_ctx: int,
    heads: int,
    blocksize: int,
    causal: bool = False,
    num_global_blocks: int = 1,
    num_window_blocks: int = 3,
    num_random_blocks: int = 1,
    seed: int = 0,
) -> Layout:
    """``bigbird``: window + global + random blocks, defined on blocks (seeded, per head).

    Block (i, j) is on when |i - j| <= num_window_blocks // 2, or i or j < num_global_blocks,
    or j is one of row i's ``num_random_blocks`` random blocks (drawn per head with
    ``numpy.random.default_rng(seed)``). allowed(h, q, k) = L[h, q//b, k//b], and k <= q when
    ``causal=True`` (random blocks then drawn from j <= i).
    """
    for name, val in (
        ("num_global_blocks", num_global_blocks),
        ("num_window_blocks", num_window_blocks),
        ("num_random_blocks", num_random_blocks),
        ("seed", seed),
    ):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 0:
            raise ValueError(f"{name} must be a non-negative int, got {val!r}")
    nb = block_count(n_ctx, blocksize)
    idx = np.arange(nb)
    base = np.abs(idx[:, None] - idx[None, :]) <= num_window_blocks // 2
    base[:num_global_blocks, :] = True
    base[:, :num_global_blocks] = True
    if causal:
        base = causal_cut(base)
    return _block_level_layout(
        base, heads, blocksize, n_ctx, causal, num_random_blocks, seed, "bigbird"
    )


@register("variable")
def variable_layout(
    n_ctx: int,
    heads: int,
    blocksize: int,
    causal: bool = False,
    num_random_blocks: int = 0,
    local_window_blocks: Sequence[int] = (4,),
    global_block_indices: Sequence[int] = (0,),
    global_block_end_indices: Sequence[int] | None = None,
    horizontal_global_attention: bool = False,
    seed: int = 0,
) -> Layout:
    """``variable`` (DeepSpeed's VariableSparsityConfig), defined on blocks.

    Local windows: consecutive runs of blocks of sizes ``local_window_blocks`` (the last size
    repeats to the end); blocks of one run see each other. Global: key-block columns
    ``global_block_indices`` (or ranges [start, end) with ``global_block_end_indices``) are
    seen by every row; with ``horizontal_global_attention`` (bidirectional only) those rows
    also see everything. ``num_random_blocks`` random key blocks per row, seeded.
    allowed(h, q, k) = L[h, q//b, k//b], and k <= q when ``causal=True``.
    """
    nb = block_count(n_ctx, blocksize)
    windows = int_tuple("local_window_blocks", local_window_blocks, nb + 1)
    if not windows or min(windows) < 1:
        raise ValueError(
            f"local_window_blocks must hold positive ints, got {local_window_blocks!r}"
        )
    starts = int_tuple("global_block_indices", global_block_indices, nb)
    if global_block_end_indices is None:
        ends = tuple(s + 1 for s in starts)
    else:
        ends = int_tuple("global_block_end_indices", global_block_end_indices, nb + 1)
        if len(ends) != len(starts) or any(e <= s for s, e in zip(starts, ends, strict=True)):
            raise ValueError(
                "global_block_end_indices must pair with global_block_indices, each end > start; "
                f"got {starts} and {ends}"
            )
    if horizontal_global_attention and causal:
        raise ValueError("horizontal_global_attention needs causal=False")
    if isinstance(num_random_blocks, bool) or not isinstance(num_random_blocks, (int, np.integer)):
        raise TypeError(f"num_random_blocks must be an int, got {num_random_blocks!r}")
    if num_random_blocks < 0:
        raise ValueError(f"num_random_blocks must be >= 0, got {num_random_blocks}")
    window_id = np.empty(nb, dtype=np.int64)
    pos, wid = 0, 0
    while pos < nb:
        size = windows[min(wid, len(windows) - 1)]
        window_id[pos : pos + size] = wid
        pos, wid = pos + size, wid + 1
    base = window_id[:, None] == window_id[None, :]
    for s, e in zip(starts, ends, strict=True):
        base[:, s:e] = True
        if horizontal_global_attention:
            base[s:e, :] = True
    if causal:
        base = causal_cut(base)
    return _block_level_layout(
        base, heads, blocksize, n_ctx, causal, num_random_blocks, seed, "variable"
    )


@register("document")
def document_layout(
    n_ctx: int,
    heads: int,
    blocksize: int,
    causal: bool = True,
    doc_lengths: Sequence[int] | None = None,
) -> Layout:
    """``document``: several documents packed in one sequence, ``doc_lengths`` tokens each
    (summing to n_ctx). allowed(h, q, k) = doc(q) == doc(k) and k <= q; bidirectional
    (``causal=False``): doc(q) == doc(k). Blocks inside one document carry no mask; blocks a
    document boundary crosses carry bitmasks.
    """
    if doc_lengths is None:
        raise ValueError(
            "attn_mode='document' needs doc_lengths (the token count of each document)"
        )
    lengths = int_tuple("doc_lengths", doc_lengths, n_ctx + 1)
    if not lengths or min(lengths) < 1 or sum(lengths) != n_ctx:
        raise ValueError(
            f"doc_lengths must be positive and sum to n_ctx={n_ctx}, got {list(lengths)} "
            f"(sum {sum(lengths)})"
        )
    doc_of = np.repeat(np.arange(len(lengths)), lengths)

    def rule_fn(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        same = doc_of[q] == doc_of[k]
        return same & (k <= q) if causal else same

    nb = block_count(n_ctx, blocksize)
    first_doc = doc_of[np.arange(nb) * blocksize]
    last_doc = doc_of[np.minimum(np.arange(nb) * blocksize + blocksize, n_ctx) - 1]
    # key block j can share a document with query block i when their document ranges overlap
    candidates = (first_doc[:, None] <= last_doc[None, :]) & (
        first_doc[None, :] <= last_doc[:, None]
    )
    candidates = np.broadcast_to(candidates, (heads, nb, nb))
    if causal:
        candidates = causal_cut(candidates)
    return bitmask_layout(candidates, blocksize, n_ctx, rule_fn, "document")
