"""DeepSpeed's sparse-attention API (``deepspeed.ops.sparse_attention``) on cuattn's kernels.

DeepSpeed's block-sparse attention is built on Triton 1.0 and no longer runs on current stacks.
This module keeps its Python API, so a model moves over by changing one import line::

    from deepspeed.ops.sparse_attention import FixedSparsityConfig, SparseSelfAttention  # was
    from cuattn.compat.deepspeed import FixedSparsityConfig, SparseSelfAttention         # now

The sparsity configs take DeepSpeed's constructor arguments and defaults, raise its errors under
its conditions, and ``make_layout(seq_len)`` returns its layouts: int64 torch tensors
[num_heads, seq_len / block, seq_len / block] of 0/1, identical block for block, random blocks
included. Each config's rule: docs/frameworks.md, section "The sparsity configs' rules".

The block rules themselves are ``cuattn.layout.extended``'s builders, those of cuattn's own
``bigbird`` and ``variable`` patterns (``band_blocks``, ``bigbird_blocks``, ``variable_blocks``;
Fixed is ``variable_blocks`` with one window size). Only the draw and DeepSpeed's checks live
here; where DeepSpeed's rule differs from cuattn's pattern, a builder parameter says so: the
random blocks drawn here are handed in as drawn (``random_blocks``; cuattn draws with NumPy
among the blocks not on yet), and Variable's and Fixed's causal global columns start at the
group's first row (``causal_columns="start"``; cuattn's at the diagonal).

``SparseSelfAttention`` has DeepSpeed's constructor and ``forward`` and computes with
``cuattn.sparse_attention``, with autograd. How each mask and rpe runs, and what differs from
DeepSpeed: docs/frameworks.md, section "Replacing DeepSpeed sparse attention".
"""

from __future__ import annotations

import hashlib
import inspect
import random
import textwrap
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import distributed as dist
from torch import nn

from cuattn import api
from cuattn.compat.distance_bias import read_bias
from cuattn.layout.extended import band_blocks, bigbird_blocks, variable_blocks
from cuattn.layout.layout import ElementRule, Layout

__all__ = [
    "BSLongformerSparsityConfig",
    "BigBirdSparsityConfig",
    "DenseSparsityConfig",
    "FixedSparsityConfig",
    "LocalSlidingWindowSparsityConfig",
    "SparseSelfAttention",
    "SparsityConfig",
    "VariableSparsityConfig",
]

UNIDIRECTIONAL, BIDIRECTIONAL = "unidirectional", "bidirectional"
MASK_MODES = ("add", "mul")


# -- DeepSpeed's draws and checks; the block rules are cuattn.layout.extended's ------------------


def _random_rows(nb: int, count: int, causal: bool) -> np.ndarray:
    """One ``random.sample(range(n), count)`` per row, top to bottom: n = nb, or r + 1 when
    causal. This is DeepSpeed's sequence of draws, so a seeded ``random`` repeats its blocks."""
    out = np.zeros((nb, nb), dtype=bool)
    for r in range(nb):
        out[r, random.sample(range(r + 1 if causal else nb), count)] = True
    return out


def _check_random_count(count: int, nb: int, causal: bool) -> None:
    """The conditions under which DeepSpeed's draws fail, checked before drawing."""
    _check_fits("num_random_blocks", count, nb)
    if count < 0:
        raise ValueError(f"num_random_blocks must be >= 0, got {count}")
    if causal and nb > 0 and count > 1:
        raise ValueError(
            f"num_random_blocks={count} with attention='unidirectional': each row draws from the "
            "blocks up to itself, so the first row has only 1 to give"
        )


def _check_fits(name: str, count: int, nb: int) -> None:
    if nb < count:
        raise ValueError(f"{name}={count} is more than the {nb} blocks of a layout row")


def _globals(
    starts: Sequence[int], ends: Sequence[int] | None, nb: int
) -> tuple[list[int], list[int] | None]:
    """The global groups that begin inside the sequence (start < nb), as ``global_blocks``'
    starts and ends: the index i, or with ``ends`` the range [start, end). Indexing keeps
    Python's rules, as DeepSpeed's (a negative index counts from the end)."""
    if ends is None:
        return [i for i in starts if i < nb], None
    inside = [(s, e) for s, e in zip(starts, ends, strict=False) if s < nb]
    return [s for s, _ in inside], [e for _, e in inside]


def _check_global_ends(starts: Sequence[int], ends: Sequence[int] | None) -> None:
    if ends is None:
        return
    if len(starts) != len(ends):
        raise ValueError(
            f"global_block_end_indices has {len(ends)} entries and global_block_indices "
            f"{len(starts)}: each end pairs with a start"
        )
    for s, e in zip(starts, ends, strict=True):
        if s >= e:
            raise ValueError(
                f"global_block_end_indices: the range [{s}, {e}) is empty; each end must exceed "
                "its start"
            )


def _check_attention(attention: str, horizontal_global_attention: bool | None = None) -> None:
    if attention not in (UNIDIRECTIONAL, BIDIRECTIONAL):
        raise NotImplementedError(
            f"attention must be {UNIDIRECTIONAL!r} or {BIDIRECTIONAL!r}, got {attention!r}"
        )
    if horizontal_global_attention and attention != BIDIRECTIONAL:
        raise ValueError(
            f"horizontal_global_attention=True needs attention={BIDIRECTIONAL!r}, got {attention!r}"
        )


# -- configs -----------------------------------------------------------------------------------


class SparsityConfig:
    """DeepSpeed's base sparsity config: ``num_heads`` heads of ``block`` x ``block`` blocks.

    The subclasses give the rule (docs/frameworks.md, section "The sparsity configs' rules");
    this base class has none, and its :meth:`make_layout` raises NotImplementedError.

    Args:
        num_heads (int): the attention heads.
        block (int): the block size (default 16).
        different_layout_per_head (bool): a layout per head (random blocks drawn per head)
            rather than head 0's for all (default False).
    """

    def __init__(self, num_heads: int, block: int = 16, different_layout_per_head: bool = False):
        self.num_heads = num_heads
        self.block = block
        self.different_layout_per_head = different_layout_per_head
        self.num_layout_heads = num_heads if different_layout_per_head else 1

    def setup_layout(self, seq_len: int) -> torch.Tensor:
        """An empty layout for ``seq_len`` tokens (DeepSpeed's first step of make_layout).

        Args:
            seq_len (int): the sequence length, a multiple of ``block``.

        Returns:
            torch.Tensor: zeros, int64 [num_heads, seq_len / block, seq_len / block].

        Raises:
            ValueError: ``block`` is not positive, or does not divide ``seq_len``.
        """
        if not self.block > 0:
            raise ValueError(f"block must be a positive int, got {self.block!r}")
        if seq_len % self.block != 0:
            raise ValueError(f"seq_len={seq_len} must be a multiple of block={self.block}")
        nb = seq_len // self.block
        return torch.zeros((self.num_heads, nb, nb), dtype=torch.int64)

    def check_and_propagate_first_head_layout(self, layout: torch.Tensor) -> torch.Tensor:
        """Copy head 0 into every head (in place), unless ``different_layout_per_head``.

        Args:
            layout (torch.Tensor): [num_heads, nb, nb].

        Returns:
            torch.Tensor: ``layout`` itself.
        """
        if not self.different_layout_per_head:
            layout[1 : self.num_heads] = layout[0]
        return layout

    def make_layout(self, seq_len: int) -> torch.Tensor:
        """The layout for ``seq_len`` tokens, block for block DeepSpeed's (random blocks drawn
        with Python's ``random`` in DeepSpeed's order).

        Args:
            seq_len (int): the sequence length, a multiple of ``block``.

        Returns:
            torch.Tensor: int64 0/1 [num_heads, seq_len / block, seq_len / block]: each layout
            head from the rule, then head 0 copied to all heads unless
            ``different_layout_per_head``.

        Raises:
            ValueError: ``block`` does not divide ``seq_len``; a count (random, window or
                global blocks) that the row of blocks cannot hold, under DeepSpeed's conditions;
                ``local_window_blocks`` not ending with a size > 0.
            NotImplementedError: on the base class, which has no rule.
        """
        layout = self.setup_layout(seq_len)
        nb = layout.shape[1]
        for h in range(self.num_layout_heads):
            layout[h] = torch.from_numpy(self._head_blocks(h, nb).astype(np.int64))
        return self.check_and_propagate_first_head_layout(layout)

    def _head_blocks(self, h: int, nb: int) -> np.ndarray:
        raise NotImplementedError(
            "SparsityConfig is the base class and has no layout rule: use DenseSparsityConfig, "
            "FixedSparsityConfig, VariableSparsityConfig, BigBirdSparsityConfig, "
            "BSLongformerSparsityConfig or LocalSlidingWindowSparsityConfig"
        )


# The base class's arguments, as every subclass's docstring repeats them for help().
# (No docstrings under python -OO: then nothing to repeat.)
_COMMON_ARGS = textwrap.dedent(
    inspect.cleandoc(SparsityConfig.__doc__ or "").partition("Args:\n")[2]
).strip()


def _with_common_args(cls: type) -> type:
    """``cls`` with its docstring's ``{common_args}`` line replaced by SparsityConfig's three."""
    cls.__doc__ = (cls.__doc__ or "").replace(
        "{common_args}", _COMMON_ARGS.replace("\n", "\n        ")
    )
    return cls


@_with_common_args
class DenseSparsityConfig(SparsityConfig):
    """Every block (dense attention in block form).

    Args:
        {common_args}
    """

    def _head_blocks(self, h: int, nb: int) -> np.ndarray:
        return np.ones((nb, nb), dtype=bool)


@_with_common_args
class FixedSparsityConfig(SparsityConfig):
    """Sparse Transformer's 'fixed' pattern as DeepSpeed customises it (docs/frameworks.md,
    section "The sparsity configs' rules").

    Args:
        {common_args}
        num_local_blocks (int): blocks per local window (default 4).
        num_global_blocks (int): global blocks per window, dividing num_local_blocks (default 1).
        attention (str): ``"bidirectional"`` (default) or ``"unidirectional"`` (causal).
        horizontal_global_attention (bool): global rows that see every column too
            (bidirectional only; default False).
        num_different_global_patterns (int): global positions heads cycle over (needs
            ``different_layout_per_head``; default 1).

    Raises:
        ValueError: ``num_global_blocks`` 0 or not dividing ``num_local_blocks``; horizontal
            global attention that is not bidirectional; more global patterns than a window's
            positions, or several without ``different_layout_per_head``.
        NotImplementedError: ``attention`` neither of the two.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_local_blocks: int = 4,
        num_global_blocks: int = 1,
        attention: str = BIDIRECTIONAL,
        horizontal_global_attention: bool = False,
        num_different_global_patterns: int = 1,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_local_blocks = num_local_blocks
        if num_global_blocks == 0:
            raise ValueError("num_global_blocks must not be 0 (it divides num_local_blocks)")
        if num_local_blocks % num_global_blocks != 0:
            raise ValueError(
                f"num_local_blocks={num_local_blocks} must be a multiple of "
                f"num_global_blocks={num_global_blocks}"
            )
        self.num_global_blocks = num_global_blocks
        _check_attention(attention, horizontal_global_attention)
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention
        if num_different_global_patterns > 1 and not different_layout_per_head:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} needs "
                "different_layout_per_head=True (one layout for all heads has one pattern)"
            )
        groups = num_local_blocks // num_global_blocks
        if num_different_global_patterns > groups:
            raise ValueError(
                f"num_different_global_patterns={num_different_global_patterns} is more than the "
                f"{groups} global positions a window has (num_local_blocks // num_global_blocks)"
            )
        self.num_different_global_patterns = num_different_global_patterns

    def _head_blocks(self, h: int, nb: int) -> np.ndarray:
        local, glob = self.num_local_blocks, self.num_global_blocks
        offset = local - (1 + h % self.num_different_global_patterns) * glob
        whole = nb - nb % local  # blocks in complete windows
        starts = list(range(offset, whole, local))
        if whole < nb:  # a short last window
            starts.append(min(whole + offset, nb - glob))
        return variable_blocks(
            nb,
            [local],
            starts,
            [s + glob for s in starts],  # ranges, as DeepSpeed's slices (a negative s counts back)
            self.horizontal_global_attention,
            self.attention == UNIDIRECTIONAL,
            causal_columns="start",
        )


@_with_common_args
class VariableSparsityConfig(SparsityConfig):
    """Random blocks, variable local windows and chosen global blocks (docs/frameworks.md,
    section "The sparsity configs' rules").

    Args:
        {common_args}
        num_random_blocks (int): random columns per row (default 0).
        local_window_blocks (Sequence[int]): window sizes in blocks, in turn, the last repeated
            (default (4,)).
        global_block_indices (Sequence[int]): global blocks (default (0,)), or the starts of
            global ranges with ``global_block_end_indices``.
        global_block_end_indices (Sequence[int], optional): the ranges' ends (exclusive).
        attention (str): ``"bidirectional"`` (default) or ``"unidirectional"`` (causal).
        horizontal_global_attention (bool): global rows that see every column too
            (bidirectional only; default False).

    Raises:
        ValueError: ends unlike the starts in number, or not above them; horizontal global
            attention that is not bidirectional.
        NotImplementedError: ``attention`` neither of the two.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 0,
        local_window_blocks: Sequence[int] = (4,),
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = BIDIRECTIONAL,
        horizontal_global_attention: bool = False,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.local_window_blocks = list(local_window_blocks)
        self.global_block_indices = list(global_block_indices)
        _check_global_ends(self.global_block_indices, global_block_end_indices)
        self.global_block_end_indices = (
            None if global_block_end_indices is None else list(global_block_end_indices)
        )
        _check_attention(attention, horizontal_global_attention)
        self.attention = attention
        self.horizontal_global_attention = horizontal_global_attention

    def _head_blocks(self, h: int, nb: int) -> np.ndarray:
        _check_random_count(self.num_random_blocks, nb, False)
        drawn = _random_rows(nb, self.num_random_blocks, False)
        sizes = self.local_window_blocks
        if not sizes or sizes[-1] <= 0 or min(sizes) < 0:
            raise ValueError(
                "local_window_blocks must list window sizes >= 0 and end with one > 0, got "
                f"{sizes!r}"
            )
        starts, ends = _globals(self.global_block_indices, self.global_block_end_indices, nb)
        return variable_blocks(
            nb,
            sizes,
            starts,
            ends,
            self.horizontal_global_attention,
            self.attention == UNIDIRECTIONAL,
            causal_columns="start",
            random_blocks=drawn,
        )


@_with_common_args
class BigBirdSparsityConfig(SparsityConfig):
    """BigBird: random, sliding-window and leading global blocks (docs/frameworks.md, section
    "The sparsity configs' rules").

    Args:
        {common_args}
        num_random_blocks (int): random columns per row (default 1).
        num_sliding_window_blocks (int): the window's width in blocks (default 3).
        num_global_blocks (int): the leading global rows and columns (default 1).
        attention (str): ``"bidirectional"`` (default) or ``"unidirectional"`` (causal).

    Raises:
        NotImplementedError: ``attention`` neither of the two.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_random_blocks: int = 1,
        num_sliding_window_blocks: int = 3,
        num_global_blocks: int = 1,
        attention: str = BIDIRECTIONAL,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_random_blocks = num_random_blocks
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.num_global_blocks = num_global_blocks
        _check_attention(attention)
        self.attention = attention

    def _head_blocks(self, h: int, nb: int) -> np.ndarray:
        causal = self.attention == UNIDIRECTIONAL
        _check_random_count(self.num_random_blocks, nb, causal)
        drawn = _random_rows(nb, self.num_random_blocks, causal)
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, nb)
        _check_fits("num_global_blocks", self.num_global_blocks, nb)
        return bigbird_blocks(
            nb,
            self.num_sliding_window_blocks,
            [0],
            [self.num_global_blocks],
            causal,
            random_blocks=drawn,
        )


@_with_common_args
class BSLongformerSparsityConfig(SparsityConfig):
    """Block-sparse Longformer: sliding window and global blocks (docs/frameworks.md, section
    "The sparsity configs' rules").

    Args:
        {common_args}
        num_sliding_window_blocks (int): the window's width in blocks (default 3).
        global_block_indices (Sequence[int]): global blocks (default (0,)), or the starts of
            global ranges with ``global_block_end_indices``.
        global_block_end_indices (Sequence[int], optional): the ranges' ends (exclusive).
        attention (str): ``"unidirectional"`` (causal) or anything else (bidirectional; not
            validated, as in DeepSpeed). Default ``"bidirectional"``.

    Raises:
        ValueError: ends unlike the starts in number, or not above them.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        different_layout_per_head: bool = False,
        num_sliding_window_blocks: int = 3,
        global_block_indices: Sequence[int] = (0,),
        global_block_end_indices: Sequence[int] | None = None,
        attention: str = BIDIRECTIONAL,
    ):
        super().__init__(num_heads, block, different_layout_per_head)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.global_block_indices = list(global_block_indices)
        self.attention = attention  # not validated, as in DeepSpeed: only 'unidirectional' is
        _check_global_ends(self.global_block_indices, global_block_end_indices)
        self.global_block_end_indices = (
            None if global_block_end_indices is None else list(global_block_end_indices)
        )

    def _head_blocks(self, h: int, nb: int) -> np.ndarray:
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, nb)
        starts, ends = _globals(self.global_block_indices, self.global_block_end_indices, nb)
        return bigbird_blocks(
            nb, self.num_sliding_window_blocks, starts, ends, self.attention == UNIDIRECTIONAL
        )


class LocalSlidingWindowSparsityConfig(SparsityConfig):
    """A sliding window only; causal unless ``attention='bidirectional'`` (docs/frameworks.md,
    section "The sparsity configs' rules").

    Args:
        num_heads (int): the attention heads.
        block (int): the block size (default 16).
        num_sliding_window_blocks (int): the window's width in blocks (default 3).
        attention (str): ``"bidirectional"``, or anything else for the causal window (not
            validated, as in DeepSpeed). Default ``"unidirectional"``.
    """

    def __init__(
        self,
        num_heads: int,
        block: int = 16,
        num_sliding_window_blocks: int = 3,
        attention: str = UNIDIRECTIONAL,
    ):
        super().__init__(num_heads, block)
        self.num_sliding_window_blocks = num_sliding_window_blocks
        self.attention = attention  # not validated, as in DeepSpeed

    def _head_blocks(self, h: int, nb: int) -> np.ndarray:
        _check_fits("num_sliding_window_blocks", self.num_sliding_window_blocks, nb)
        w = self.num_sliding_window_blocks // 2
        return band_blocks(nb, w, 0 if self.attention != BIDIRECTIONAL else w)


# -- the module --------------------------------------------------------------------------------


class SelfAttentionOnlyError(ValueError, NotImplementedError):
    """query, key and value differ in shape; DeepSpeed raises NotImplementedError here."""


MaskFn = Callable[[np.ndarray, np.ndarray, np.ndarray], np.ndarray]
# Layouts kept per module (a length, a key count, a band, a key-padding row): enough for the
# distinct padding lengths of a few batches, bounded so that a stream of new paddings cannot grow
# it without end.
LAYOUT_CACHE_SIZE = 64
# The band no query attends in: lo > hi (an attn_mask that drops every pair).
NOTHING = (1, 0)


class Pairs(NamedTuple):
    """The (query, key) pairs an attn_mask keeps: the band ``lo <= q - k <= hi`` (None: every
    pair), or, for a mask that is no band, ``table``: uint8 [seq_len, seq_len / 8] (the keep
    mask's bits, ``np.packbits`` along the keys), with its digest as a layout cache key."""

    band: tuple[int, int] | None = None
    table: np.ndarray | None = None

    def key(self) -> tuple:
        if self.table is None:
            return (self.band,)
        return (hashlib.blake2b(self.table.tobytes(), digest_size=16).digest(),)

    def kept(self, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        """bool: whether query q keeps key k (NumPy broadcasting)."""
        if self.table is not None:
            return ((self.table[q, k >> 3] >> (7 - (k & 7))) & 1).astype(bool)
        if self.band is None:
            return np.ones(np.broadcast(q, k).shape, dtype=bool)
        return (q - k >= self.band[0]) & (q - k <= self.band[1])

    def cover(self, nbq: int, nbk: int, block: int, n_keys: int) -> np.ndarray:
        """bool [nbq, nbk]: blocks holding a kept pair among the first ``n_keys`` keys, so that
        blocks the mask leaves empty are not walked at all."""
        if self.table is None:
            return _band_cover(nbq, nbk, block, n_keys, self.band)
        keep = np.unpackbits(self.table, axis=1, count=n_keys).astype(bool)
        keep = np.pad(keep, ((0, nbq * block - keep.shape[0]), (0, nbk * block - n_keys)))
        return keep.reshape(nbq, block, nbk, block).any(axis=(1, 3))


def _check_tensor(name: str, x: Any) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(
            f"{name} must be [batch, heads, seq_len, head_dim], got shape {tuple(x.shape)}"
        )


def _added_bias(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor | None:
    """What an 'add' mask (``_mask_values``: cast as DeepSpeed casts it, gradient kept) adds
    beyond dropping keys: the values themselves, float32 (float64 beside float64 queries), when
    a kept entry (``_keep``: not -inf) is not 0; None when the mask only keeps (0) and drops
    (-inf), which the layouts follow without a bias. One read of a flag from the device."""
    if not bool(((values.detach() != 0) & keep).any()):
        return None
    return values.to(torch.float64 if values.dtype == torch.float64 else torch.float32)


def _mask_values(
    name: str,
    mask: Any,
    head: tuple[int, ...],
    tail: tuple[int, ...],
    layout: str,
    dtype: torch.dtype,
) -> torch.Tensor:
    """The mask shaped ``head`` + ``tail`` (singleton dimensions between squeezed, as DeepSpeed
    does), cast to ``dtype`` as DeepSpeed casts it (a bool mask: 0/1), its autograd kept."""
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(mask).__name__}")
    dims, shape = tuple(mask.shape), head + tail
    middle = dims[len(head) : len(dims) - len(tail)]
    if (
        len(dims) < len(shape)
        or dims[: len(head)] != head
        or dims[len(dims) - len(tail) :] != tail
        or any(d != 1 for d in middle)
    ):
        raise ValueError(f"{name} must be {layout} = {list(shape)}, got shape {list(dims)}")
    if mask.is_complex():
        raise TypeError(f"{name} must be real or bool, got {mask.dtype}")
    return mask.reshape(shape).to(dtype)


def _keep(name: str, values: torch.Tensor, mode: str) -> torch.Tensor:
    """bool, like ``values`` (a mask as ``_mask_values`` shapes and casts it), on its device:
    where DeepSpeed's softmax keeps a key.

    The values are read as DeepSpeed reads them after its cast to the query's dtype (so in
    float16 -1e5 is -inf): 'mul' drops where the value is 0 and keeps any other value (its
    kernel adds ``where(m == 0, -inf, 0)``), and 'add' adds the value to the score, so it drops
    at -inf and keeps a finite value (which ``_added_bias`` adds). Refused: NaN in both modes
    (it would poison the row in 'add' and be kept, by accident of ``NaN != 0``, in 'mul'), and
    +inf in 'add' (the row's softmax would have no finite scale: NaN in DeepSpeed).
    """
    values = values.detach()
    plus_inf = (values == float("inf")).any() if mode == "add" else values.new_zeros((), dtype=bool)
    has_nan, has_plus_inf = torch.stack([values.isnan().any(), plus_inf]).tolist()  # one read
    if has_nan:
        takes = "0 to drop and any other number to keep" if mode == "mul" else "finite and -inf"
        raise ValueError(
            f"{name} holds NaN; a mask must keep or drop each key ({name}_mode={mode!r} takes "
            f"{takes})"
        )
    if mode == "mul":
        return values != 0
    if has_plus_inf:
        raise ValueError(
            f"{name} holds inf: with {name}_mode={mode!r} +inf would leave the softmax no finite "
            "scale; 'add' takes finite values (added to the scores) and -inf (drop)"
        )
    return values != float("-inf")


def _pairs(keep: torch.Tensor) -> Pairs:
    """The (query, key) pairs the [seq_len, seq_len] keep mask keeps: a band
    ``lo <= q - k <= hi`` (none: every pair), or else the mask itself as a table.

    Causal (lo = 0), a sliding window, causal with a window, all pairs: the patterns a model
    writes into its attention mask are bands, and a band is two integers the kernels test per
    element, where any other mask is a T x T table (held as bits, evaluated once into per-block
    bitmasks). The mask is read once, on its device, down to three numbers per row (kept
    count, first and last kept key); the band is whatever those rows span, then checked against
    every row; a mask that leaves it is read back whole.
    """
    n = keep.shape[0]
    count = keep.sum(1)
    if bool((count == n).all()):
        return Pairs()
    as_bytes = keep.to(torch.uint8)
    first = as_bytes.argmax(1)  # the first kept key (0 in a row that keeps none)
    last = n - 1 - as_bytes.flip(1).argmax(1)
    count, first, last = (t.cpu().numpy().astype(np.int64) for t in (count, first, last))
    q = np.arange(n)
    has = count > 0
    if not has.any():
        return Pairs(band=NOTHING)
    hi, lo = int((q - first)[has].max()), int((q - last)[has].min())
    lo_key, hi_key = np.maximum(q - hi, 0), np.minimum(q - lo, n - 1)
    agrees = np.where(
        has,
        (first == lo_key) & (last == hi_key) & (count == last - first + 1),
        lo_key > hi_key,
    )
    if agrees.all():
        return Pairs(band=(lo, hi))
    return Pairs(table=np.packbits(keep.cpu().numpy(), axis=1))


def _band_cover(
    nbq: int, nbk: int, block: int, n_keys: int, band: tuple[int, int] | None
) -> np.ndarray:
    """bool [nbq, nbk]: blocks holding a pair of the band (all, without one), so that blocks the
    band leaves empty are not walked at all."""
    if band is None:
        return np.ones((nbq, nbk), dtype=bool)
    lo, hi = band
    i, j = np.arange(nbq)[:, None] * block, np.arange(nbk)[None, :] * block
    q_lo, q_hi = i, i + block - 1
    k_lo, k_hi = j, np.minimum(j + block, n_keys) - 1
    return (q_hi - k_lo >= lo) & (q_lo - k_hi <= hi)


def _band_rule(band: tuple[int, int] | None, n_q: int, n_keys: int) -> ElementRule:
    """The kernels' element rule for ``lo <= q - k <= hi`` with ``n_keys`` keys.

    The kernels measure a query from its end-aligned position ``q + n_keys - n_q``: with the
    keys cut to a padding length that offset is taken out of the window's two bounds (the window
    rule is ``pos - k < left and k - pos < right``, any integers), so padding and a band still
    need no per-element table."""
    if band is None:
        return ElementRule()
    lo, hi = band
    offset = n_keys - n_q
    if offset == 0 and lo == 0 and hi >= n_q - 1:
        return ElementRule("causal")
    return ElementRule("window", window_left=hi + 1 + offset, window_right=1 - lo - offset)


class SparseSelfAttention(nn.Module):
    """DeepSpeed's SparseSelfAttention on :func:`cuattn.sparse_attention`.

    The layout is ``sparsity_config.make_layout(max_seq_length)`` (buffer ``master_layout``, so
    DeepSpeed checkpoints load); a length L uses its top-left ``L / block`` blocks. How masks
    and rpe run: docs/frameworks.md, section "Replacing DeepSpeed sparse attention".

    Args:
        sparsity_config (SparsityConfig): the pattern (default
            ``SparsityConfig(num_heads=4)``, DeepSpeed's default, which has no rule).
        key_padding_mask_mode (str): ``"add"`` (default: values added to the scores, -inf
            drops) or ``"mul"`` (0 drops, anything else keeps).
        attn_mask_mode (str): ``"add"`` or ``"mul"`` (default), as above.
        max_seq_length (int): the longest sequence; the master layout is made for it (default
            2048).

    Raises:
        ValueError: a mask mode other than ``"add"`` and ``"mul"``; as the config's
            ``make_layout`` for ``max_seq_length``.
        NotImplementedError: the base ``SparsityConfig``, which has no rule.
    """

    def __init__(
        self,
        sparsity_config: SparsityConfig = SparsityConfig(num_heads=4),  # noqa: B008 (DeepSpeed's)
        key_padding_mask_mode: str = "add",
        attn_mask_mode: str = "mul",
        max_seq_length: int = 2048,
    ):
        super().__init__()
        for name, mode in (
            ("key_padding_mask_mode", key_padding_mask_mode),
            ("attn_mask_mode", attn_mask_mode),
        ):
            if mode not in MASK_MODES:
                raise ValueError(f"{name} must be one of {MASK_MODES}, got {mode!r}")
        self.sparsity_config = sparsity_config
        self.register_buffer("master_layout", sparsity_config.make_layout(max_seq_length))
        self._need_layout_synchronization = True
        self.key_padding_mask_mode = key_padding_mask_mode
        self.attn_mask_mode = attn_mask_mode
        self._layouts: dict[tuple, Layout] = {}
        self._layouts_of: tuple[int, int] | None = None

    def get_layout(self, L: int) -> torch.Tensor:
        """The block layout for length L (under torch.distributed, rank 0's master layout is
        broadcast first, once, as in DeepSpeed).

        Args:
            L (int): the sequence length, a multiple of the block size.

        Returns:
            torch.Tensor: int64 on the CPU, ``master_layout[..., :L/block, :L/block]``.

        Raises:
            ValueError: the block size does not divide L.
        """
        if self._need_layout_synchronization and dist.is_available() and dist.is_initialized():
            dist.broadcast(self.master_layout, src=0)
            self._need_layout_synchronization = False
        block = self.sparsity_config.block
        if L % block != 0:
            raise ValueError(f"seq_len={L} must be a multiple of block={block}")
        nb = L // block
        return self.master_layout[..., :nb, :nb].cpu()

    def transpose_key_for_scores(self, x: torch.Tensor, L: int) -> torch.Tensor:
        """The key as [batch, heads, seq_len, head_dim], as DeepSpeed's method.

        A key whose dim 2 is not L is taken as transposed ([batch, heads, head_dim, seq_len]),
        transposed back and, its head_dim axis then strided (which the kernels cannot read),
        copied once into rows: DeepSpeed's own Bert layer hands the key over transposed.

        Args:
            x (torch.Tensor): the key, [batch, heads, L, head_dim] or [batch, heads, head_dim,
                L].
            L (int): the sequence length.

        Returns:
            torch.Tensor: [batch, heads, L, head_dim], x itself when it already is.
        """
        if x.shape[2] == L:
            return x
        x = x.permute(0, 1, 3, 2)
        return x if x.stride(-1) == 1 else x.contiguous()

    def _check_lengths(self, seq_len: int, heads: int) -> None:
        block = self.sparsity_config.block
        max_len = self.master_layout.shape[-1] * block
        if seq_len > max_len:
            raise ValueError(
                f"query has seq_len={seq_len}, more than max_seq_length={max_len} (the length "
                "the layout was made for); build SparseSelfAttention with a larger one"
            )
        if self.master_layout.shape[0] != heads:
            raise ValueError(
                f"query has {heads} heads, the sparsity config has "
                f"num_heads={self.master_layout.shape[0]}"
            )
        if seq_len % block != 0:
            raise ValueError(f"seq_len={seq_len} must be a multiple of block={block}")

    def _layout(
        self,
        seq_len: int,
        n_keys: int,
        pairs: Pairs,
        keep_k: np.ndarray | None,
    ) -> Layout:
        """The cuattn Layout for ``seq_len`` queries: the master layout's corner, restricted to
        the attn_mask's pairs (a band: the kernels' causal or window rule; a table: per-block
        bitmasks) and to the keys a padding row keeps, cached per module.

        ``n_keys`` < seq_len: the keys are cut to the first n_keys (right padding), so with a
        band the layout is for n_keys keys and needs no table. ``keep_k`` (bool [seq_len]): any
        other padding, a per-key element rule evaluated into per-block bitmasks, O(seq_len) to
        hold. The cache is emptied when ``master_layout`` changes (load_state_dict, a
        broadcast)."""
        buffer = self.master_layout
        stamp = (id(buffer), buffer._version)
        if stamp != self._layouts_of:
            self._layouts, self._layouts_of = {}, stamp
        padding = None if keep_k is None else np.packbits(keep_k).tobytes()
        key = (seq_len, n_keys, *pairs.key(), padding)
        if key in self._layouts:
            return self._layouts[key]
        block = self.sparsity_config.block
        blocks = self.get_layout(seq_len).numpy().astype(bool)
        self._layouts_of = (id(self.master_layout), self.master_layout._version)
        nbk = -(-n_keys // block)
        blocks = blocks[:, :, :nbk] & pairs.cover(blocks.shape[1], nbk, block, n_keys)
        if keep_k is None and pairs.table is None:
            rule = _band_rule(pairs.band, seq_len, n_keys)
            layout = Layout(blocks, block, n_ctx=n_keys, rule=rule, name="deepspeed", n_q=seq_len)
        else:
            if keep_k is not None:
                blocks &= keep_k.reshape(nbk, block).any(axis=1)  # columns of dropped keys only
            layout = Layout.from_blocks(
                blocks, block, _element_rule(pairs, keep_k), n_ctx=n_keys, n_q=seq_len
            )
        if len(self._layouts) >= LAYOUT_CACHE_SIZE:
            self._layouts.pop(next(iter(self._layouts)))
        self._layouts[key] = layout
        return layout

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        rpe: torch.Tensor | None = None,
        key_padding_mask: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Block-sparse self-attention with DeepSpeed's masks and relative-position bias.

        Every argument is checked before anything is computed. Batch rows are grouped by their
        key padding, one call per group; how each mask and rpe runs: docs/frameworks.md,
        section "Replacing DeepSpeed sparse attention".

        Args:
            query (torch.Tensor): [batch, heads, seq_len, head_dim]; heads as the config's,
                seq_len a multiple of the block size and at most ``max_seq_length``.
            key (torch.Tensor): query's shape, or [batch, heads, head_dim, seq_len].
            value (torch.Tensor): query's shape.
            rpe (torch.Tensor, optional): a relative-position bias added to the scores,
                [batch or 1, heads or 1, seq_len, seq_len] (or fewer leading axes).
            key_padding_mask (torch.Tensor, optional): [batch, seq_len] (singleton axes between
                allowed), read in ``key_padding_mask_mode``.
            attn_mask (torch.Tensor, optional): [seq_len, seq_len], read in ``attn_mask_mode``.

        Returns:
            torch.Tensor: [batch, heads, seq_len, head_dim], query's dtype. A query row with no
            key left gives 0.

        Raises:
            SelfAttentionOnlyError: query, key and value of different shapes (a ValueError and
                DeepSpeed's NotImplementedError).
            TypeError: an input, mask or rpe not a tensor (or a complex mask).
            ValueError: an input not 4-D; a length over ``max_seq_length`` or not a multiple
                of the block size; heads unlike the config's; a mask or rpe of the wrong shape;
                NaN in a mask, +inf in an ``add`` mask.
        """
        for name, x in (("query", query), ("key", key), ("value", value)):
            _check_tensor(name, x)
        batch, heads, seq_len, head_dim = query.shape
        given_key = tuple(key.shape)
        key = self.transpose_key_for_scores(key, seq_len)
        if query.shape != key.shape or key.shape != value.shape:
            raise SelfAttentionOnlyError(
                f"query, key and value must have one shape [batch, heads, seq_len, head_dim] "
                f"(key may be [batch, heads, head_dim, seq_len]): only self-attention is "
                f"supported, got query {tuple(query.shape)}, key {given_key}, value "
                f"{tuple(value.shape)}"
            )
        self._check_lengths(seq_len, heads)
        n = seq_len
        bias_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        table, score_bias = None, None
        if rpe is not None:
            table, score_bias = read_bias("rpe", rpe, query.shape, n)
        pairs = Pairs()
        if attn_mask is not None:
            qk = _mask_values("attn_mask", attn_mask, (), (n, n), "[seq_len, seq_len]", query.dtype)
            keep_qk = _keep("attn_mask", qk, self.attn_mask_mode)
            pairs = _pairs(keep_qk)
            added = _added_bias(qk, keep_qk) if self.attn_mask_mode == "add" else None
            if added is not None:
                score_bias = added if score_bias is None else score_bias.to(bias_dtype) + added
            del keep_qk
        if score_bias is not None:
            score_bias = score_bias.to(bias_dtype).reshape(
                (1,) * (4 - score_bias.ndim) + score_bias.shape
            )
        scale = float(head_dim) ** -0.5
        groups: list[tuple[np.ndarray, int, np.ndarray | None]] = [(np.arange(batch), n, None)]
        if key_padding_mask is not None:
            padding = _mask_values(
                "key_padding_mask",
                key_padding_mask,
                (batch,),
                (n,),
                "[batch, seq_len]",
                query.dtype,
            )
            mode = self.key_padding_mask_mode
            keep_k = _keep("key_padding_mask", padding, mode)
            key_bias = _added_bias(padding, keep_k) if mode == "add" else None
            if key_bias is not None:  # a per-key bias: added to the scores as it is
                layout = self._layout(n, n, pairs, None)
                return api.sparse_attention(
                    query,
                    key,
                    value,
                    layout,
                    scale=scale,
                    key_bias=key_bias,
                    rel_bias=table,
                    score_bias=score_bias,
                )
            groups = _padding_groups(keep_k.cpu().numpy())
        if len(groups) == 1 and groups[0][1] == n:
            _, _, keep_row = groups[0]
            layout = self._layout(n, n, pairs, keep_row)
            return api.sparse_attention(
                query, key, value, layout, scale=scale, rel_bias=table, score_bias=score_bias
            )
        parts = []
        for rows, n_keys, keep_row in groups:
            pick = torch.as_tensor(rows, device=query.device)
            q, k, v = query[pick], key[pick, :, :n_keys], value[pick, :, :n_keys]
            if not n_keys:  # rows with no key at all: the call returns zeros
                parts.append(api.sparse_attention(q, k, v, self._layout(n, n, Pairs(), None)))
                continue
            rel = (
                None
                if table is None
                else _shifted(table if table.ndim == 2 else table[pick], n - n_keys)
            )
            bias = None
            if score_bias is not None:
                bias = score_bias[pick] if score_bias.shape[0] == batch > 1 else score_bias
                bias = bias[..., :n_keys]
            layout = self._layout(n, n_keys, pairs, keep_row)
            parts.append(
                api.sparse_attention(q, k, v, layout, scale=scale, rel_bias=rel, score_bias=bias)
            )
        order = np.argsort(np.concatenate([rows for rows, _, _ in groups]))
        return torch.cat(parts)[torch.as_tensor(order, device=query.device)]

    def extra_repr(self) -> str:
        cfg = self.sparsity_config
        return (
            f"{type(cfg).__name__}(num_heads={cfg.num_heads}, block={cfg.block}), "
            f"key_padding_mask_mode={self.key_padding_mask_mode!r}, "
            f"attn_mask_mode={self.attn_mask_mode!r}, "
            f"max_seq_length={self.master_layout.shape[-1] * cfg.block}"
        )


def _shifted(table: torch.Tensor, cut: int) -> torch.Tensor:
    """A table by distance k - q for a call whose keys were cut by ``cut`` from the end: the
    kernels place the queries end-aligned on the keys left (q_pos = q - cut), so distance r is
    read at column r + cut; the columns before them are never read (zeros)."""
    if cut == 0:
        return table
    return nn.functional.pad(table[..., : table.shape[-1] - cut], (cut, 0))


def _padding_groups(keep_k: np.ndarray) -> list[tuple[np.ndarray, int, np.ndarray | None]]:
    """Batch rows grouped by their padding row (bool [batch, seq_len]): (rows, n_keys, keep)
    with keep None when the row keeps exactly its first n_keys keys, else (rows, seq_len, keep)."""
    distinct, which = np.unique(keep_k, axis=0, return_inverse=True)
    which = which.reshape(-1)
    groups = []
    for u, keep in enumerate(distinct):
        rows = np.flatnonzero(which == u)
        count = int(keep.sum())
        if keep[:count].all():
            groups.append((rows, count, None))
        else:
            groups.append((rows, len(keep), keep))
    return groups


def _element_rule(pairs: Pairs, keep_k: np.ndarray | None) -> MaskFn:
    """Layout.from_blocks' element rule: key k is kept by the padding (``keep_k``, when given)
    and the pair (q, k) by the attn_mask; O(seq_len) to hold beside a band, the mask's bits
    (seq_len^2 / 8 bytes) beside a table."""

    def allowed(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        out = pairs.kept(q, k)
        return out if keep_k is None else out & keep_k[k]

    return allowed
