"""The dense float64 oracle of tests/oracle.py, written once for any array module (NumPy or CuPy),
so GPU tests check real sizes against float64 on the GPU instead of waiting for the CPU."""

from __future__ import annotations

from typing import Any


def _probs(xp: Any, q: Any, k: Any, mask: Any, scale: float) -> tuple[Any, Any, Any]:
    s = xp.einsum("bhqd,bhkd->bhqk", q, k) * scale
    s = xp.where(mask[None], s, -xp.inf)
    m = s.max(axis=-1, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0.0)
    p = xp.exp(s - m)
    l_sum = p.sum(axis=-1, keepdims=True)
    has = l_sum > 0
    return p / xp.where(has, l_sum, 1.0), m, l_sum


def dense_attention(xp: Any, q: Any, k: Any, v: Any, mask: Any, scale: float) -> tuple[Any, Any]:
    """(out, lse) in float64; mask bool [heads, n, n]; empty rows give 0 and -inf."""
    q, k, v = (x.astype(xp.float64) for x in (q, k, v))
    p, m, l_sum = _probs(xp, q, k, mask, scale)
    out = xp.einsum("bhqk,bhkd->bhqd", p, v)
    has = l_sum[..., 0] > 0
    lse = xp.where(has, m[..., 0] + xp.log(xp.where(has, l_sum[..., 0], 1.0)), -xp.inf)
    return out, lse


def dense_attention_grads(
    xp: Any, q: Any, k: Any, v: Any, dout: Any, mask: Any, scale: float
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) in float64 of sum(out * dout)."""
    q, k, v, dout = (x.astype(xp.float64) for x in (q, k, v, dout))
    p, _, _ = _probs(xp, q, k, mask, scale)
    dv = xp.einsum("bhqk,bhqd->bhkd", p, dout)
    dp = xp.einsum("bhqd,bhkd->bhqk", dout, v)
    ds = p * (dp - (dp * p).sum(axis=-1, keepdims=True))
    dq = xp.einsum("bhqk,bhkd->bhqd", ds, k) * scale
    dk = xp.einsum("bhqk,bhqd->bhkd", ds, q) * scale
    return dq, dk, dv


def rel_err(xp: Any, x: Any, ref: Any, floor: float) -> float:
    """max |x - ref| / max(max |ref|, floor)."""
    if x.size == 0:
        return 0.0
    diff = xp.abs(x.astype(xp.float64) - ref).max()
    return float(diff / max(float(xp.abs(ref).max()), floor))
