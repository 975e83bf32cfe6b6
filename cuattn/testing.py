"""The dense float64 oracle that every backend is checked against (tests and `cuattn check`).

Tiny on purpose: softmax(QK^T * scale, masked) V written with full n x n arrays in float64,
and its gradients, so use small n. Rows with no allowed key give 0 and lse = -inf.
"""

from __future__ import annotations

import numpy as np


def dense_attention(q, k, v, mask, scale):
    """(out, lse) in float64; mask bool [heads, n, n]. Rows with no allowed key: 0 and -inf."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = np.where(mask[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l_sum = p.sum(axis=-1, keepdims=True)
    has = l_sum > 0
    p = p / np.where(has, l_sum, 1.0)
    out = np.einsum("bhqk,bhkd->bhqd", p, v)
    lse = np.where(has[..., 0], (m + np.log(np.where(has, l_sum, 1.0)))[..., 0], -np.inf)
    return out, lse


def dense_attention_grads(q, k, v, dout, mask, scale):
    """(dq, dk, dv) in float64 of sum(out * dout)."""
    q, k, v, dout = (np.asarray(x, dtype=np.float64) for x in (q, k, v, dout))
    s = np.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = np.where(mask[None], s, -np.inf)
    m = s.max(axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0.0)
    p = np.exp(s - m)
    l_sum = p.sum(axis=-1, keepdims=True)
    p = p / np.where(l_sum > 0, l_sum, 1.0)
    dv = np.einsum("bhqk,bhqd->bhkd", p, dout)
    dp = np.einsum("bhqd,bhkd->bhqk", dout, v)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = np.einsum("bhqk,bhkd->bhqd", ds, k) * scale
    dk = np.einsum("bhqk,bhqd->bhkd", ds, q) * scale
    return dq, dk, dv


# Below this magnitude errors are measured as absolute: a gradient that is exactly 0 in exact
# arithmetic (a row with a single key) comes out as rounding noise, which has no relative size.
REL_FLOOR = 1e-3
# Gradients of unit-normal inputs are O(0.1..1); one that is exactly zero (a query with one key)
# is cancellation noise of O(eps) in dP - delta, measured against this magnitude.
GRAD_FLOOR = 0.1


def rel_err(x, ref, floor=REL_FLOOR):
    """max |x - ref| / max(max |ref|, floor) (0 for empty arrays)."""
    x = np.asarray(x, dtype=np.float64)
    if x.size == 0:
        return 0.0
    scale = max(float(np.abs(ref).max()), floor)
    return float(np.abs(x - ref).max() / scale)
