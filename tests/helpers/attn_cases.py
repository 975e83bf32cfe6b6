"""Shared by the adapter tests: the original modes with their element rules (docs/design.md
§2), and a dense masked float64 attention in torch whose autograd is the gradient oracle."""

from __future__ import annotations

import numpy as np
import torch

from tests.helpers.oracle import rule_all, rule_fixed, rule_local, rule_strided

BATCH, N_CTX, HEADS, HEAD_DIM, BLOCK = 2, 64, 2, 8, 8
# Gradients must match the dense oracle to this relative error in float64 (issue 3).
GRAD_RTOL_F64 = 1e-9

# name -> (blocksparse_attention kwargs, element mask [heads, n, n])
MODES = {
    "all": ({"attn_mode": "all"}, rule_all(N_CTX, HEADS)),
    "local": ({"attn_mode": "local", "local_attn_ctx": 16}, rule_local(N_CTX, HEADS, 16)),
    # n / s = 8 is a multiple of the block size: the layout uses the transposed token order.
    "strided": ({"attn_mode": "strided", "local_attn_ctx": 8}, rule_strided(N_CTX, HEADS, 8)),
    # s = 6 does not divide n: natural order with per-block bitmasks.
    "strided_bitmask": (
        {"attn_mode": "strided", "local_attn_ctx": 6},
        rule_strided(N_CTX, HEADS, 6),
    ),
    "fixed": (
        {"attn_mode": "fixed", "local_attn_ctx": 16, "num_verts": 2, "vertsize": 1},
        rule_fixed(N_CTX, HEADS, BLOCK, 16, 2, 1),
    ),
}


def random_qkv(seed: int, dtype=np.float64) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((BATCH, N_CTX, HEADS * HEAD_DIM)).astype(dtype) for _ in range(3)]


def torch_dense(q, k, v, mask: np.ndarray, heads: int = HEADS) -> torch.Tensor:
    """Masked softmax attention on [batch, time, heads*head_dim], plain torch ops."""
    batch, n, width = q.shape
    d = width // heads

    def split(x):
        return x.reshape(batch, n, heads, d).permute(0, 2, 1, 3)

    s = split(q) @ split(k).transpose(-1, -2) / d**0.5
    s = s.masked_fill(~torch.from_numpy(np.ascontiguousarray(mask)), float("-inf"))
    out = torch.softmax(s, dim=-1) @ split(v)
    return out.permute(0, 2, 1, 3).reshape(batch, n, width)


def rel(x, ref) -> float:
    x, ref = np.asarray(x, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    return float(np.abs(x - ref).max() / np.abs(ref).max())
