"""Patterns beyond the original: FlashAttention's sliding ``window``, Longformer, BigBird and
DeepSpeed's ``variable``, each a registered constructor whose docstring states its element rule
(docs/design.md §2).

Their block rules are written once, as bool [nb, nb] block-array builders (``band_blocks``,
``local_windows``, ``global_blocks``, ``bigbird_blocks``, ``variable_blocks``), which the
DeepSpeed configs of ``cuattn.compat.deepspeed`` build their layouts from too; where DeepSpeed's
rule differs from cuattn's pattern, a builder's parameter says which applies (``random_blocks``:
how random blocks are drawn; ``causal_columns``: where a causal global column starts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

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

# -- block rules: bool [nb, nb] arrays, row i = query block, column j = key block ------------------
# The registered patterns below and the DeepSpeed configs (cuattn.compat.deepspeed) build their
# blocks from these; where the two differ, a parameter says which rule applies.

CAUSAL_COLUMNS = ("diagonal", "start")

RandomBlocks = np.random.Generator | np.ndarray | None


def band_blocks(nb: int, before: int, after: int) -> np.ndarray:
    """A sliding window of blocks: (i, j) on when i - before <= j <= i + after."""
    i, j = np.arange(nb)[:, None], np.arange(nb)[None, :]
    return (j >= i - before) & (j <= i + after)


def local_windows(nb: int, sizes: Sequence[int]) -> np.ndarray:
    """Variable local windows: (i, j) on when blocks i and j lie in one window.

    The windows are consecutive runs of ``sizes[0]``, ``sizes[1]``, ... blocks (a size of 0 is
    a window of no block), then runs of ``sizes[-1]`` blocks to the end; ``sizes[-1]`` must be
    positive (the callers check ``sizes`` and word their own errors). ``sizes=(w,)``: windows of
    w blocks, i // w == j // w.
    """
    ends = np.cumsum(sizes)
    i = np.arange(nb)
    beyond = len(sizes) + (i - ends[-1]) // sizes[-1]
    window_of = np.where(i < ends[-1], np.searchsorted(ends, i, side="right"), beyond)
    return window_of[:, None] == window_of[None, :]


def global_blocks(
    nb: int,
    starts: Sequence[int],
    ends: Sequence[int] | None = None,
    horizontal: bool = False,
    causal: bool = False,
    causal_columns: Literal["diagonal", "start"] = "diagonal",
) -> np.ndarray:
    """Global blocks: every row sees the columns of each global group; with ``horizontal`` the
    group's rows also see every column.

    Group g is block ``starts[g]``, or with ``ends`` the blocks [starts[g], ends[g]), indexed as
    NumPy indexes an axis (a negative index counts from the end, an end past nb is cut, a single
    index out of range raises IndexError). ``causal_columns`` says which rows see a global column
    when ``causal``:

    - ``"diagonal"``: rows from the column's own row on (the whole result keeps j <= i);
    - ``"start"``: rows from the group's first block ``starts[g]`` on, so inside a group of
      several blocks some are seen above the diagonal (DeepSpeed's variable and fixed); global
      rows then keep every column.
    """
    if causal_columns not in CAUSAL_COLUMNS:
        raise ValueError(f"causal_columns must be one of {CAUSAL_COLUMNS}, got {causal_columns!r}")
    from_start = causal and causal_columns == "start"
    out = np.zeros((nb, nb), dtype=bool)
    for g, start in enumerate(starts):
        group = start if ends is None else slice(start, ends[g])
        if horizontal:
            out[group, :] = True
        out[start if from_start else 0 :, group] = True
    return causal_cut(out) if causal and not from_start else out


def _with_random_blocks(
    base: np.ndarray, random_blocks: RandomBlocks, count: int, causal: bool
) -> np.ndarray:
    """``base`` plus the random blocks ``random_blocks`` gives (see ``bigbird_blocks``)."""
    if random_blocks is None:
        return base
    if not isinstance(random_blocks, np.random.Generator):
        return base | random_blocks
    nb = base.shape[0]
    extra = np.zeros_like(base)
    for i in range(nb):
        limit = i + 1 if causal else nb
        free = np.flatnonzero(~base[i, :limit])
        if len(free):
            extra[i, random_blocks.choice(free, size=min(count, len(free)), replace=False)] = True
    return base | extra


def bigbird_blocks(
    nb: int,
    num_window_blocks: int,
    global_starts: Sequence[int],
    global_ends: Sequence[int] | None = None,
    causal: bool = False,
    random_blocks: RandomBlocks = None,
    num_random_blocks: int = 0,
) -> np.ndarray:
    """BigBird's blocks (Longformer's, on blocks): (i, j) on when |i - j| <= num_window_blocks // 2,
    or i or j lies in a global group (``global_blocks`` with ``horizontal``), or j is one of row
    i's random blocks; ``causal`` keeps j <= i of the window and global blocks.

    ``random_blocks``: None, no random blocks; a ``numpy.random.Generator``: per row,
    ``num_random_blocks`` key blocks drawn from it without replacement among those not on yet
    (j <= i when causal; fewer where fewer are free), cuattn's draw; a bool [nb, nb] array:
    blocks the caller drew (DeepSpeed's configs, before the base and possibly on it), added as
    they are.
    """
    w = num_window_blocks // 2
    base = band_blocks(nb, w, w) | global_blocks(nb, global_starts, global_ends, horizontal=True)
    if causal:
        base = causal_cut(base)
    return _with_random_blocks(base, random_blocks, num_random_blocks, causal)


def variable_blocks(
    nb: int,
    local_window_blocks: Sequence[int],
    global_starts: Sequence[int],
    global_ends: Sequence[int] | None = None,
    horizontal: bool = False,
    causal: bool = False,
    causal_columns: Literal["diagonal", "start"] = "diagonal",
    random_blocks: RandomBlocks = None,
    num_random_blocks: int = 0,
) -> np.ndarray:
    """DeepSpeed's variable blocks: (i, j) on when i and j lie in one local window
    (``local_windows``), or j (with ``horizontal`` also i) lies in a global group
    (``global_blocks``, ``causal_columns`` as there), or j is one of row i's random blocks
    (``random_blocks`` as in ``bigbird_blocks``); ``causal`` keeps j <= i of the windows.
    DeepSpeed's fixed pattern is this with one window size and its global groups, and
    ``causal_columns="start"``.
    """
    windows = local_windows(nb, local_window_blocks)
    if causal:
        windows = causal_cut(windows)
    base = windows | global_blocks(
        nb, global_starts, global_ends, horizontal, causal, causal_columns
    )
    return _with_random_blocks(base, random_blocks, num_random_blocks, causal)


def _block_level_layout(
    head_blocks: Callable[[np.random.Generator], np.ndarray],
    heads: int,
    seed: int,
    blocksize: int,
    n_ctx: int,
    causal: bool,
    name: str,
) -> Layout:
    """A pattern defined on blocks: head h's blocks are ``head_blocks(rng)``, heads in turn on one
    ``numpy.random.default_rng(seed)``; allowed(h, q, k) = blocks[h, q//b, k//b] (and k <= q)."""
    rng = np.random.default_rng(seed)
    blocks = np.stack([head_blocks(rng) for _ in range(heads)])
    return Layout(blocks, blocksize, n_ctx, ElementRule("causal" if causal else "none"), name=name)


# -- the registered patterns -------------------------------------------------------------------


UNBOUNDED = -1  # a window side with no limit (FlashAttention's -1)


def _window_side(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int (-1: no limit), got {value!r}")
    if value < UNBOUNDED:
        raise ValueError(f"{name} must be >= 0, or -1 for no limit, got {value}")
    return int(value)


@register("window")
def window_layout(
    n_ctx: int,
    heads: int,
    blocksize: int,
    causal: bool = True,
    window_left: int = UNBOUNDED,
    window_right: int = UNBOUNDED,
) -> Layout:
    """``window``: FlashAttention's ``window_size=(window_left, window_right)``:
    allowed(h, q, k) = q - window_left <= k <= q + window_right, -1 leaving that side unbounded;
    ``causal`` also requires k <= q (so window_right must then be 0 or -1). (-1, -1) without
    causal is full attention, (w - 1, 0) is ``local`` with ``local_attn_ctx=w``.
    """
    left = _window_side("window_left", window_left)
    right = _window_side("window_right", window_right)
    if causal and right > 0:
        raise ValueError(
            f"window_right={right} looks past the query, which causal forbids: pass "
            "causal=False, or window_right=0"
        )
    right = 0 if causal else right
    # the element rule's bounds are exclusive (q - k < left, k - q < right); n_ctx is no limit
    rule_left = n_ctx if left == UNBOUNDED else left + 1
    rule_right = n_ctx if right == UNBOUNDED else right + 1
    nb = block_count(n_ctx, blocksize)
    blocks = window_blocks(nb, blocksize, rule_left, rule_right, n_ctx)
    rule = ElementRule("window", window_left=rule_left, window_right=rule_right)
    return Layout(np.broadcast_to(blocks, (heads, nb, nb)), blocksize, n_ctx, rule, name="window")


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

    candidates = window_blocks(nb, blocksize, w, w, n_ctx) | global_blocks(
        nb, np.unique(glob // blocksize).tolist(), horizontal=True
    )
    candidates = np.broadcast_to(candidates, (heads, nb, nb))
    if causal:
        candidates = causal_cut(candidates)
    return bitmask_layout(candidates, blocksize, n_ctx, rule_fn, "longformer")


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
    ``numpy.random.default_rng(seed)`` among the blocks not on yet). allowed(h, q, k) =
    L[h, q//b, k//b], and k <= q when ``causal=True`` (random blocks then drawn from j <= i).
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

    def head_blocks(rng: np.random.Generator) -> np.ndarray:
        return bigbird_blocks(
            nb, num_window_blocks, (0,), (num_global_blocks,), causal, rng, num_random_blocks
        )

    return _block_level_layout(head_blocks, heads, seed, blocksize, n_ctx, causal, "bigbird")


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
    also see everything. ``num_random_blocks`` random key blocks per row, seeded (drawn per head
    with ``numpy.random.default_rng(seed)`` among the blocks not on yet).
    allowed(h, q, k) = L[h, q//b, k//b], and k <= q when ``causal=True`` (a global column is
    then seen from its own row on).
    """
    nb = block_count(n_ctx, blocksize)
    windows = int_tuple("local_window_blocks", local_window_blocks, nb + 1)
    if not windows or min(windows) < 1:
        raise ValueError(
            f"local_window_blocks must hold positive ints, got {local_window_blocks!r}"
        )
    starts = int_tuple("global_block_indices", global_block_indices, nb)
    ends = None
    if global_block_end_indices is not None:
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

    def head_blocks(rng: np.random.Generator) -> np.ndarray:
        return variable_blocks(
            nb,
            windows,
            starts,
            ends,
            horizontal_global_attention,
            causal,
            random_blocks=rng,
            num_random_blocks=num_random_blocks,
        )

    return _block_level_layout(head_blocks, heads, seed, blocksize, n_ctx, causal, "variable")


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
