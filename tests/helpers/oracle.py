"""Element rules written straight from docs/design.md §2 (independently of cuattn.layout), and the
dense float64 oracle from cuattn.tools.oracle, for the tests. Everything here is n x n: use small n.
"""

from __future__ import annotations

import numpy as np

from cuattn.tools.oracle import (  # noqa: F401  (re-exported for the tests)
    GRAD_FLOOR,
    dense_attention,
    dense_attention_grads,
    rel_err,
)


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
    """Fixed from the block rule in docs/design.md §2, expanded to elements."""
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
