"""The dense float64 oracle that every backend is checked against (tests and `cuattn check`).

Tiny on purpose: softmax(QK^T * scale, masked) V written with full n_q x n_k arrays in float64,
and its gradients, so use small n. k and v may have fewer heads than q (GQA/MQA: query head h
reads kv head h // (heads / kv_heads)); the oracle repeats them, which the kernels never do.
Rows with no allowed key give 0 and lse = -inf. Works on NumPy arrays, and on CuPy arrays (mask
included) so GPU tests check real sizes on the GPU.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import numpy as np

from cuattn._util import host_array

# Below this magnitude errors are measured as absolute: a gradient that is exactly 0 in exact
# arithmetic (a row with a single key) comes out as rounding noise, which has no relative size.
REL_FLOOR = 1e-3
# Gradients of unit-normal inputs are O(0.1..1); one that is exactly zero (a query with one key)
# is cancellation noise of O(eps) in dP - delta, measured against this magnitude.
GRAD_FLOOR = 0.1


def _xp(x: Any) -> ModuleType:
    if type(x).__module__.startswith("cupy"):
        import cupy

        return cupy
    return np


def _probs(q: Any, k: Any, mask: Any, scale: float) -> tuple[Any, Any, Any]:
    """(P, row max, row sum) of the masked softmax in float64."""
    xp = _xp(q)
    s = xp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = xp.where(mask[None], s, -xp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    p = xp.exp(s - m)
    l_sum = p.sum(axis=-1, keepdims=True)
    return p / xp.where(l_sum > 0, l_sum, 1.0), m, l_sum


def _float64(*arrays: Any) -> list[Any]:
    return [x.astype(_xp(x).float64) if hasattr(x, "astype") else np.float64(x) for x in arrays]


def _repeat_kv(q: Any, *kv: Any) -> list[Any]:
    group = q.shape[1] // kv[0].shape[1]
    return [_xp(x).repeat(x, group, axis=1) for x in kv]


def _sum_groups(grad: Any, kv_heads: int) -> Any:
    batch, heads = grad.shape[:2]
    return grad.reshape((batch, kv_heads, heads // kv_heads) + grad.shape[2:]).sum(axis=2)


def dense_attention(q: Any, k: Any, v: Any, mask: Any, scale: float) -> tuple[Any, Any]:
    """(out, lse) in float64; mask bool [heads, n_q, n_k]. Rows with no allowed key: 0, -inf."""
    q, k, v = _float64(q, k, v)
    k, v = _repeat_kv(q, k, v)
    xp = _xp(q)
    p, m, l_sum = _probs(q, k, mask, scale)
    out = xp.einsum("bhqk,bhkd->bhqd", p, v)
    has = l_sum[..., 0] > 0
    lse = xp.where(has, m[..., 0] + xp.log(xp.where(has, l_sum[..., 0], 1.0)), -xp.inf)
    return out, lse


def dense_attention_grads(
    q: Any, k: Any, v: Any, dout: Any, mask: Any, scale: float, dlse: Any = None
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) in float64 of sum(out * dout) + sum(lse * dlse) (dlse [batch, heads, n_q]
    or None; rows with no allowed key take no part); dk, dv with k's and v's heads."""
    q, k, v, dout = _float64(q, k, v, dout)
    kv_heads = k.shape[1]
    k, v = _repeat_kv(q, k, v)
    xp = _xp(q)
    p, _, _ = _probs(q, k, mask, scale)
    dv = xp.einsum("bhqk,bhqd->bhkd", p, dout)
    dp = xp.einsum("bhqd,bhkd->bhqk", dout, v)
    delta = (dp * p).sum(axis=-1, keepdims=True)
    if dlse is not None:  # d lse_i / d s_ij = p_ij: dS = P * (dP - (delta - dlse))
        (dlse,) = _float64(dlse)
        delta = delta - dlse[..., None]
    ds = p * (dp - delta)
    dq = xp.einsum("bhqk,bhkd->bhqd", ds, k) * scale
    dk = xp.einsum("bhqk,bhqd->bhkd", ds, q) * scale
    return dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)


def rel_err(x: Any, ref: Any, floor: float = REL_FLOOR) -> float:
    """max |x - ref| / max(max |ref|, floor) (0 for empty arrays)."""
    (x,) = _float64(x)
    if x.size == 0:
        return 0.0
    xp = _xp(x)
    scale = max(float(xp.abs(ref).max()), floor)
    return float(xp.abs(x - ref).max() / scale)


def kept_attention(cache: Any, q: Any, scale: float | None = None) -> np.ndarray:
    """float64 [batch, heads, t_q, head_dim] on the host: decode attention of q (each
    sequence's newest t_q positions, query head h on kv head h // (heads / kv_heads)) over
    exactly the tokens a ``cuattn.KVCache`` keeps (``cache.kept``), causal."""
    q, k_pages, v_pages = (host_array(x) for x in (q, cache.k_pages, cache.v_pages))
    batch, heads, t_q, head_dim = q.shape
    group = heads // cache.kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = np.zeros(q.shape)
    for b in range(batch):
        length = int(cache.lengths[b])
        q_pos = np.arange(length - t_q, length)
        for h in range(cache.kv_heads):
            pages, offsets, pos = cache.kept(b, h)
            rows = slice(h * group, (h + 1) * group)
            mask = np.broadcast_to(pos[None, :] <= q_pos[:, None], (group, t_q, len(pos)))
            keys, values = k_pages[pages, offsets], v_pages[pages, offsets]
            one = (q[b : b + 1, rows], keys[None, None], values[None, None])
            out[b, rows] = dense_attention(*one, mask, scale)[0][0]
    return out
