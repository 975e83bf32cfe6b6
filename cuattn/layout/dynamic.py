"""Patterns chosen from the data: vertical-slash (per-head columns and diagonals, MInference).

The choice of columns and diagonals (``vertical_slash_tables``) is written for any array module
with NumPy's API (NumPy here; CuPy when cuattn.dynamic builds the layout on the device), so the
host and the device choose from the same arithmetic.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cuattn._util import host_array, stable_kind
from cuattn.layout.blocks import bitmask_layout, block_count, causal_cut
from cuattn.layout.layout import Layout, check_positive_int


def vertical_slash_tables(
    q: Any,
    k: Any,
    num_vertical: int,
    num_slash: int,
    last_q: int,
    causal: bool,
    scale: float,
    xp: Any = np,
) -> tuple[Any, Any]:
    """(is_vertical bool [heads, n], is_slash bool [heads, 2n]) from float64 q, k
    [batch, heads, n, d]: the softmax rows of the last ``last_q`` queries, averaged over the
    batch, summed per key column and per offset q - k (index q - k + n); the top
    ``num_vertical`` columns and ``num_slash`` offsets per head (ties to the lower index), and
    always offset 0. Each offset's sum adds the rows in order, one row per launch."""
    _, heads, n_ctx, _ = q.shape
    rows = min(last_q, n_ctx)
    qpos = xp.arange(n_ctx - rows, n_ctx)[:, None]
    kpos = xp.arange(n_ctx)[None, :]
    # Scores of the last `rows` queries only: rows x n, never n x n.
    s = (q[:, :, -rows:] @ k.transpose(0, 1, 3, 2)) * scale
    if causal:
        s = xp.where(kpos <= qpos, s, -xp.inf)
    p = xp.exp(s - s.max(axis=-1, keepdims=True))
    p = (p / p.sum(axis=-1, keepdims=True)).mean(axis=0)  # [heads, rows, n]
    vertical_score = p.sum(axis=1)
    slash_score = xp.zeros((heads, 2 * n_ctx), dtype=p.dtype)
    for r in range(rows):  # row r's keys k = 0..n-1 land on offsets q_r - k + n, descending
        first = n_ctx - rows + r + 1
        slash_score[:, first : first + n_ctx] += p[:, r, ::-1]
    is_vertical = xp.zeros((heads, n_ctx), dtype=bool)
    top = xp.argsort(-vertical_score, axis=-1, **stable_kind(xp))[:, :num_vertical]
    xp.put_along_axis(is_vertical, top, True, axis=-1)
    is_slash = xp.zeros((heads, 2 * n_ctx), dtype=bool)
    top = xp.argsort(-slash_score, axis=-1, **stable_kind(xp))[:, :num_slash]
    xp.put_along_axis(is_slash, top, True, axis=-1)
    is_slash[:, n_ctx] = True
    return is_vertical, is_slash


class VerticalSlashRule:
    """The element rule allowed(h, q, k) = is_vertical[h, k] or is_slash[h, q - k + n] (and
    k <= q when causal), on NumPy index arrays. Tables kept on a device are copied to the host
    the first time the rule is evaluated (only when a layout is looked at on the host)."""

    def __init__(self, is_vertical: Any, is_slash: Any, causal: bool) -> None:
        self.tables = (is_vertical, is_slash)
        self._host: tuple[np.ndarray, np.ndarray] | None = None
        self.causal = causal

    def __call__(self, h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        if self._host is None:
            self._host = tuple(host_array(t).astype(bool, copy=False) for t in self.tables)
        is_vertical, is_slash = self._host
        hit = is_vertical[h, k] | is_slash[h, q - k + is_vertical.shape[1]]
        return hit & (k <= q) if self.causal else hit


def host_vertical_slash_layout(
    q: np.ndarray,
    k: np.ndarray,
    blocksize: int = 64,
    num_vertical: int = 64,
    num_slash: int = 64,
    last_q: int = 64,
    causal: bool = True,
    scale: float | None = None,
) -> Layout:
    """``vertical_slash`` (MInference) chosen on the host: per-head top key columns and diagonals
    chosen from data. The rule and its NumPy statement; ``cuattn.vertical_slash_layout`` is the
    public call (any framework; built on the device for device arrays, from the same tables).

    q, k: NumPy arrays [heads, n, d] or [batch, heads, n, d] (host arrays: the choice is made
    here, on the CPU; ``cuattn.vertical_slash_layout`` takes any framework and builds on the
    device for device arrays). The last ``last_q`` queries' softmax(q k^T * scale) rows (causal
    if ``causal``), averaged over the batch, score every key column (vertical) and every offset
    q - k (slash); head h keeps its ``num_vertical`` best columns V_h and ``num_slash`` best
    offsets S_h, and always the main diagonal 0, so no causal row is left empty.
    allowed(h, q, k) = (k in V_h or q - k in S_h), and k <= q when causal.
    """
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, np.ndarray):
            raise TypeError(
                f"{name} must be a NumPy array (move device arrays to the host first), "
                f"got {type(x).__name__}"
            )
    check_vertical_slash_args(q, k, blocksize, num_vertical, num_slash, last_q)
    q64 = q.astype(np.float64).reshape((-1,) + q.shape[-3:])
    k64 = k.astype(np.float64).reshape((-1,) + k.shape[-3:])
    _, heads, n_ctx, head_dim = q64.shape
    scale = 1.0 / np.sqrt(head_dim) if scale is None else float(scale)
    is_vertical, is_slash = vertical_slash_tables(
        q64, k64, num_vertical, num_slash, last_q, causal, scale
    )
    nb = block_count(n_ctx, blocksize)
    blk = np.arange(nb)
    candidates = np.zeros((heads, nb, nb), dtype=bool)
    for h in range(heads):
        cols = np.unique(np.flatnonzero(is_vertical[h]) // blocksize)
        candidates[h][:, cols] = True
        # an offset o lands on block diagonals floor(o / b) and floor(o / b) + 1
        offs = np.flatnonzero(is_slash[h]) - n_ctx
        diag = np.unique(np.concatenate([offs // blocksize, offs // blocksize + 1]))
        candidates[h] |= np.isin(blk[:, None] - blk[None, :], diag)
    if causal:
        candidates = causal_cut(candidates)
    rule = VerticalSlashRule(is_vertical, is_slash, causal)
    return bitmask_layout(candidates, blocksize, n_ctx, rule, "vertical_slash")


def check_vertical_slash_args(
    q: Any, k: Any, blocksize: int, num_vertical: int, num_slash: int, last_q: int
) -> None:
    """Shapes ([heads, n, d] or [batch, heads, n, d], k like q) and the positive ints."""
    for name, x in (("q", q), ("k", k)):
        shape = getattr(x, "shape", None)
        if shape is None or len(shape) not in (3, 4):
            raise ValueError(
                f"{name} must be [heads, n, d] or [batch, heads, n, d], got shape {shape}"
            )
    if tuple(q.shape) != tuple(k.shape):
        raise ValueError(f"k must have the same shape as q {tuple(q.shape)}, got {k.shape}")
    for name, val in (
        ("blocksize", blocksize),
        ("num_vertical", num_vertical),
        ("num_slash", num_slash),
        ("last_q", last_q),
    ):
        check_positive_int(name, val)
