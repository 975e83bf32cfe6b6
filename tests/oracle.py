"""The dense float64 oracle every backend is checked against, and element rules written
straight from DESIGN.md §2 (independently of cuattn.layout), for the tests only.

Everything here builds full n x n arrays: use small n.
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


def _grid(n):
    q = np.arange(n)[:, None]
    k = np.arange(n)[None, :]
    return q, k


def rule_all(n, heads, causal=True):
    q, k = _grid(n)
    m = (k <= q) if causal else np.ones((n, n), bool)
    return np.broadcast_to(m, (heads, n, n))


def rule_local(n, heads, w, causal=True):
    q, k = _grid(n)
    m = ((k <= q) & (q - k < w)) if causal else (np.abs(q - k) < w)
    return np.broadcast_to(m, (heads, n, n))


def rule_strided(n, heads, s, causal=True):
    q, k = _grid(n)
    m = (q - k) % s == 0
    if causal:
        m &= k <= q
    return np.broadcast_to(m, (heads, n, n))


def rule_fixed(n, heads, b, lctx, num_verts, vertsize, causal=True):
    """Fixed from the block rule in DESIGN.md §2, expanded to elements."""
    g = lctx // b
    nb = -(-n // b)
    offsets_from_end = list(range(g - 1, -1, -1))
    chunks = [offsets_from_end[c : c + vertsize] for c in range(0, g, vertsize)]
    out = np.zeros((heads, n, n), bool)
    q, k = _grid(n)
    for h in range(heads):
        chunk = chunks[h % num_verts]
        blk = np.zeros((nb, nb), bool)
        for i in range(nb):
            for j in range(nb):
                if (j % g) in chunk or i // g == j // g:
                    blk[i, j] = True
                if causal and j > i:
                    blk[i, j] = False
        m = blk[q // b, k // b]
        if causal:
            m &= k <= q
        out[h] = m
    return out


def rule_longformer(n, heads, w, global_tokens, causal=False):
    q, k = _grid(n)
    g = np.zeros(n, bool)
    g[list(global_tokens)] = True
    m = (np.abs(q - k) < w) | g[q] | g[k]
    if causal:
        m &= k <= q
    return np.broadcast_to(m, (heads, n, n))


def rule_blocks(blocks, b, n, causal):
    """Block-level patterns (bigbird, variable): L[h, q//b, k//b] and, if causal, k <= q."""
    q, k = _grid(n)
    m = blocks[:, q // b, k // b]
    if causal:
        m = m & (k <= q)[None]
    return m


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
