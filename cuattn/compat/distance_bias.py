"""A dense score bias that is a function of key minus query position, read as cuattn's
``rel_bias`` table: T5's ``position_bias`` (through the transformers adapter) and DeepSpeed's
``rpe`` (through its shim) arrive as [batch or 1, heads or 1, q_len, kv_len] tensors, O(T^2)
already made by the caller; the kernels take one column per distance instead.

The table is read from the bias (its first query row and its first key column: a gather, so
autograd takes the table's gradient back to whatever made the bias, T5's bucket embedding),
after checking that every entry equals its distance's (once per tensor and version: T5 hands
one tensor to every layer). The gradient is exact for a bias that is a function of the distance
by construction (each of its parameters moves whole diagonals). A leaf tensor that requires a
gradient is refused: its entries are free, and the table's gradient is not theirs. An all-zero
bias that carries no gradient to anything (T5's placeholder in layers without a table, a leaf
under gradient checkpointing) adds nothing and is dropped.
"""

from __future__ import annotations

from typing import Any

import torch

# Set on a bias tensor once read: (its _version then, whether it is all zeros), only once it
# was found to be zeros or a function of key minus query position.
_CHECKED = "_cuattn_distance_bias"


@torch.compiler.disable
def distance_table(name: str, bias: Any, q_shape: tuple, kv_len: int) -> torch.Tensor | None:
    """The rel_bias table ([heads, 2 kv_len - 1], or [batch, heads, 2 kv_len - 1] for a bias per
    batch row) of the bias ``name`` [1 or batch, 1 or heads, q_len, kv_len] (leading axes of
    1 may be left out), for queries
    q_shape [batch, heads, q_len, ..] end-aligned on kv_len keys, or None for an all-zero bias
    that carries no gradient. Column c holds distance c - (kv_len - 1). float16 and bfloat16
    widen to float32 exactly (the table's dtype). A ValueError or TypeError naming ``name``
    otherwise (host work: it reads the check's answer back)."""
    batch, heads, q_len = (int(d) for d in q_shape[:3])
    if not isinstance(bias, torch.Tensor) or not bias.dtype.is_floating_point:
        raise TypeError(
            f"{name} must be a floating torch.Tensor [batch or 1, heads or 1, q_len, kv_len], "
            f"got {type(bias).__name__} {getattr(bias, 'dtype', '')}"
        )
    leaf = bias.requires_grad and bias.grad_fn is None
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
    checked = getattr(bias, _CHECKED, None)
    fresh = checked is None or checked[0] != bias._version
    zero = not bool(bias.any()) if fresh else checked[1]
    if zero and (leaf or not bias.requires_grad):
        setattr(bias, _CHECKED, (bias._version, True))
        return None
    if leaf:
        raise ValueError(
            f"{name}: a leaf requiring a gradient is not supported: cuattn reads it as a table "
            "by distance and would give that table's gradient, not each entry's; pass it as a "
            "function of a table (T5's bucket embedding), or cuattn's rel_bias itself"
        )
    offset, reach = kv_len - q_len, kv_len - 1
    device = bias.device
    rel = torch.arange(-reach, reach + 1, device=device)
    first_row = rel >= -offset  # distance rel at (0, rel + offset), else at (-rel - offset, 0)
    rows = torch.where(first_row, 0, -rel - offset)
    cols = torch.where(first_row, rel + offset, 0)
    valid = (rows < q_len) & (cols < kv_len)  # distances past the keys' reach: never read
    table = bias[:, :, rows.clamp(max=q_len - 1), cols.clamp(max=kv_len - 1)]
    table = torch.where(valid, table, torch.zeros((), dtype=bias.dtype, device=device))
    if fresh:
        q_pos = torch.arange(q_len, device=device)[:, None] + offset
        columns = torch.arange(kv_len, device=device)[None, :] - q_pos + reach
        if not bool((table.detach()[:, :, columns] == bias.detach()).all()):
            raise ValueError(
                f"{name} of shape {tuple(bias.shape)} is not a function of key minus query "
                "position: cuattn adds a bias by distance (rel_bias) or by key (key_bias), "
                "never a [q_len, kv_len] one"
            )
        setattr(bias, _CHECKED, (bias._version, zero))
    table = table if bias.dtype == torch.float64 else table.float()
    table = table.expand(table.shape[0], heads, table.shape[2]).contiguous()
    return table[0] if table.shape[0] == 1 else table
