"""Patterns chosen from the data: vertical-slash (per-head columns and diagonals, MInference)."""

from __future__ import annotations

import numpy as np

from cuattn.layout.blocks import bitmask_layout, block_count, causal_cut
from cuattn.layout.layout import Layout, check_positive_int


def vertical_slash_layout(
    q: np.ndarray,
    k: np.ndarray,
    blocksize: int = 64,
    num_vertical: int = 64,
    num_slash: int = 64,
    last_q: int = 64,
    causal: bool = True,
    scale: float | None = None,
) -> Layout:
    """``vertical_slash`` (MInference): per-head top key columns and diagonals chosen from data.

    q, k: NumPy arrays [heads, n, d] or [batch, heads, n, d] (host arrays: the choice is made
    once, on the CPU). The last ``last_q`` queries' softmax(q k^T * scale) rows (causal if
    ``causal``), averaged over the batch, score every key column (vertical) and every offset
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
        if x.ndim not in (3, 4):
            raise ValueError(
                f"{name} must be [heads, n, d] or [batch, heads, n, d], got shape {x.shape}"
            )
    if q.shape != k.shape:
        raise ValueError(f"k must have the same shape as q {q.shape}, got {k.shape}")
    for name, val in (
        ("blocksize", blocksize),
        ("num_vertical", num_vertical),
        ("num_slash", num_slash),
        ("last_q", last_q),
    ):
        check_positive_int(name, val)
    q64 = q.astype(np.float64).reshape((-1,) + q.shape[-3:])
    k64 = k.astype(np.float64).reshape((-1,) + k.shape[-3:])
    _, heads, n_ctx, head_dim = q64.shape
    scale = 1.0 / np.sqrt(head_dim) if scale is None else float(scale)
    rows = min(last_q, n_ctx)
    qpos = np.arange(n_ctx - rows, n_ctx)[:, None]
    kpos = np.arange(n_ctx)[None, :]
    # Scores of the last `rows` queries only: rows x n, never n x n.
    s = np.einsum("bhqd,bhkd->bhqk", q64[:, :, -rows:], k64) * scale
    if causal:
        s = np.where(kpos <= qpos, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = (p / p.sum(axis=-1, keepdims=True)).mean(axis=0)  # [heads, rows, n]
    offset = np.broadcast_to(qpos - kpos + n_ctx, p.shape[1:])  # shifted to be >= 0
    is_vertical = np.zeros((heads, n_ctx), dtype=bool)
    is_slash = np.zeros((heads, 2 * n_ctx), dtype=bool)
    for h in range(heads):
        vertical_score = p[h].sum(axis=0)
        is_vertical[h, np.argsort(-vertical_score, kind="stable")[:num_vertical]] = True
        slash_score = np.bincount(offset.ravel(), weights=p[h].ravel(), minlength=2 * n_ctx)
        is_slash[h, np.argsort(-slash_score, kind="stable")[:num_slash]] = True
        is_slash[h, n_ctx] = True

    def rule_fn(h: np.ndarray, qi: np.ndarray, ki: np.ndarray) -> np.ndarray:
        hit = is_vertical[h, ki] | is_slash[h, qi - ki + n_ctx]
        return hit & (ki <= qi) if causal else hit

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
    return bitmask_layout(candidates, blocksize, n_ctx, rule_fn, "vertical_slash")
