"""A dense score bias that is a function of key minus query position, read as cuattn's
``rel_bias`` table: T5's ``position_bias`` (through the transformers adapter) and DeepSpeed's
``rpe`` (through its shim) arrive as [batch or 1, heads or 1, q_len, kv_len] tensors, O(T^2)
already made by the caller; the kernels take one column per distance instead.

The table is read from the bias (its first query row and its first key column: a gather, so
autograd takes the table's gradient back to whatever made the bias, T5's bucket embedding),
after checking that every entry equals its distance's (once per tensor and version: T5 hands
one tensor to every layer). The gradient is exact for a bias that is a function of the distance
by construction (each of its parameters moves whole diagonals). An all-zero bias that carries
no gradient to anything (T5's placeholder in layers without a table, a leaf under gradient
checkpointing) adds nothing and is dropped.

``distance_table`` (T5's position_bias) refuses any other bias by name, and a leaf tensor that
requires a gradient (its entries are free, and the table's gradient is not theirs).
``read_bias`` (DeepSpeed's rpe) hands such a bias back dense instead, for cuattn's
``score_bias``, which reads it inside the computed blocks only and gives each entry its own
gradient.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

# Set on a bias tensor once read: (its _version then, whether it is all zeros, whether it is a
# function of key minus query position: None until asked), so that a bias handed to every layer
# is checked once.
_CHECKED = "_cuattn_distance_bias"


class BiasRead(NamedTuple):
    """How ``read_bias`` runs a bias: as a table by distance (``table``, cuattn's rel_bias), as
    the dense bias itself (``dense``, [1 or batch, 1 or heads, q_len, kv_len], cuattn's
    score_bias), or not at all (both None: all zeros, no gradient to carry)."""

    table: torch.Tensor | None
    dense: torch.Tensor | None


@torch.compiler.disable
def distance_table(name: str, bias: Any, q_shape: tuple, kv_len: int) -> torch.Tensor | None:
    """The rel_bias table ([heads, 2 kv_len - 1], or [batch, heads, 2 kv_len - 1] for a bias per
    batch row) of the bias ``name`` [1 or batch, 1 or heads, q_len, kv_len] (leading axes of
    1 may be left out), for queries
    q_shape [batch, heads, q_len, ..] end-aligned on kv_len keys, or None for an all-zero bias
    that carries no gradient. Column c holds distance c - (kv_len - 1). float16 and bfloat16
    widen to float32 exactly (the table's dtype). A ValueError or TypeError naming ``name``
    otherwise (host work: it reads the check's answer back)."""
    leaf = isinstance(bias, torch.Tensor) and bias.requires_grad and bias.grad_fn is None
    bias = _as_4d(name, bias, q_shape, kv_len)
    zero = _is_zero(bias)
    if zero and (leaf or not bias.requires_grad):
        return None
    if leaf:
        raise ValueError(
            f"{name}: a leaf requiring a gradient is not supported: cuattn reads it as a table "
            "by distance and would give that table's gradient, not each entry's; pass it as a "
            "function of a table (T5's bucket embedding), or cuattn's rel_bias itself"
        )
    table = _table_by_distance(bias, int(q_shape[1]))
    if table is None:
        raise ValueError(
            f"{name} of shape {tuple(bias.shape)} is not a function of key minus query "
            "position: cuattn adds a bias by distance (rel_bias) or by key (key_bias), "
            "never a [q_len, kv_len] one"
        )
    return table


@torch.compiler.disable
def read_bias(name: str, bias: Any, q_shape: tuple, kv_len: int) -> BiasRead:
    """The bias ``name`` (as ``distance_table`` takes it) as a table by distance where it is a
    function of key minus query position, else as the dense bias itself (a 4-D view, for
    score_bias); nothing for an all-zero bias that carries no gradient. A leaf that requires a
    gradient, or a view or copy of one (a slice of a longer learned bias, a cast), stays dense
    whatever its values, so that each entry gets its own gradient (a zero-initialised learned
    bias included: read by distance, its gradient would land on its first row and column
    only). TypeError/ValueError naming ``name`` for a bias of the wrong type or shape."""
    free = isinstance(bias, torch.Tensor) and bias.requires_grad and _free_entries(bias)
    bias = _as_4d(name, bias, q_shape, kv_len)
    if free:
        return BiasRead(None, bias)
    if _is_zero(bias):
        return BiasRead(None, None)
    table = _table_by_distance(bias, int(q_shape[1]))
    return BiasRead(table, None) if table is not None else BiasRead(None, bias)


# Autograd nodes that pass each entry through on its own (views, slices, casts, copies): a bias
# reached from a leaf through these alone has entries as free as the leaf's.
_PASS_THROUGH = frozenset(
    {
        "AliasBackward0",
        "AsStridedBackward0",
        "CloneBackward0",
        "ExpandBackward0",
        "PermuteBackward0",
        "ReshapeAliasBackward0",
        "SelectBackward0",
        "SliceBackward0",
        "SqueezeBackward0",
        "SqueezeBackward1",
        "SqueezeBackward2",
        "ToCopyBackward0",
        "TransposeBackward0",
        "UnsafeViewBackward0",
        "UnsqueezeBackward0",
        "ViewBackward0",
    }
)


def _free_entries(bias: torch.Tensor) -> bool:
    """Whether the bias is a leaf, or reaches one through views, slices and casts only (walked
    on its autograd graph, nothing computed)."""
    node = bias.grad_fn
    while node is not None and type(node).__name__ in _PASS_THROUGH:
        inputs = [n for n, _ in node.next_functions if n is not None]
        if len(inputs) != 1:
            return False
        node = inputs[0]
    return node is None or type(node).__name__ == "AccumulateGrad"


def _as_4d(name: str, bias: Any, q_shape: tuple, kv_len: int) -> torch.Tensor:
    """The bias as a 4-D view [1 or batch, 1 or heads, q_len, kv_len], or a TypeError or
    ValueError naming it."""
    batch, heads, q_len = (int(d) for d in q_shape[:3])
    if not isinstance(bias, torch.Tensor) or not bias.dtype.is_floating_point:
        raise TypeError(
            f"{name} must be a floating torch.Tensor [batch or 1, heads or 1, q_len, kv_len], "
            f"got {type(bias).__name__} {getattr(bias, 'dtype', '')}"
        )
    if 2 <= bias.ndim < 4:
        bias = bias.reshape((1,) * (4 - bias.ndim) + tuple(bias.shape))
    if (
        bias.ndim != 4
        or bias.shape[0] not in (1, batch)
        or bias.shape[1] not in (1, heads)
        or tuple(bias.shape[2:]) != (q_len, kv_len)
    ):
        raise ValueError(
            f"{name} of shape {tuple(bias.shape)} does not fit {batch} x {heads} heads with "
            f"{q_len} queries and {kv_len} keys: [batch or 1, heads or 1, q_len, kv_len]"
        )
    return bias


def _checked(bias: torch.Tensor) -> tuple[bool, bool | None] | None:
    """What an earlier read of this tensor found at its current version: (all zeros, a function
    of the distance, None when not asked yet), or None."""
    checked = getattr(bias, _CHECKED, None)
    return checked[1:] if checked is not None and checked[0] == bias._version else None


def _is_zero(bias: torch.Tensor) -> bool:
    checked = _checked(bias)
    if checked is not None:
        return checked[0]
    zero = not bool(bias.any())
    setattr(bias, _CHECKED, (bias._version, zero, None))
    return zero


def _table_by_distance(bias: torch.Tensor, heads: int) -> torch.Tensor | None:
    """The rel_bias table of the 4-D bias (see ``distance_table``), or None when its entries are
    not a function of key minus query position (remembered per tensor and version)."""
    q_len, kv_len = (int(d) for d in bias.shape[2:])
    checked = _checked(bias)
    if checked is not None and checked[1] is False:
        return None
    offset, reach = kv_len - q_len, kv_len - 1
    device = bias.device
    rel = torch.arange(-reach, reach + 1, device=device)
    first_row = rel >= -offset  # distance rel at (0, rel + offset), else at (-rel - offset, 0)
    rows = torch.where(first_row, 0, -rel - offset)
    cols = torch.where(first_row, rel + offset, 0)
    valid = (rows < q_len) & (cols < kv_len)  # distances past the keys' reach: never read
    table = bias[:, :, rows.clamp(max=q_len - 1), cols.clamp(max=kv_len - 1)]
    table = torch.where(valid, table, torch.zeros((), dtype=bias.dtype, device=device))
    if checked is None or checked[1] is None:
        q_pos = torch.arange(q_len, device=device)[:, None] + offset
        columns = torch.arange(kv_len, device=device)[None, :] - q_pos + reach
        by_distance = bool((table.detach()[:, :, columns] == bias.detach()).all())
        zero = checked[0] if checked is not None else not bool(bias.any())
        setattr(bias, _CHECKED, (bias._version, zero, by_distance))
        if not by_distance:
            return None
    table = table if bias.dtype == torch.float64 else table.float()
    table = table.expand(table.shape[0], heads, table.shape[2]).contiguous()
    return table[0] if table.shape[0] == 1 else table
