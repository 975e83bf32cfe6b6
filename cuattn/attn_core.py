"""Attention on backend arrays (NumPy or CuPy), shared by the tape op and the framework adapters.

Thin on purpose: the backend module picks the implementation and applies the layout's token
permutation; this module only makes inputs contiguous (the kernels index them densely) and
keeps the call shape identical for every adapter, so their gradients agree bit for bit.
"""

from __future__ import annotations

from typing import Any

from . import backend as _backend
from .layout import Layout
from .tape import get_array_module


def _on_device(x: Any) -> bool:
    return get_array_module(x).__name__ == "cupy"


def _contiguous(*arrays: Any) -> list[Any]:
    return [get_array_module(a).ascontiguousarray(a) for a in arrays]


def forward(
    q: Any, k: Any, v: Any, layout: Layout, scale: float, backend: str | None = None
) -> tuple[Any, Any]:
    """(out, lse) in the caller's token order; lse float32 (float64 for float64 input)."""
    impl = _backend.resolve_backend(backend, on_device=_on_device(q))
    return _backend.forward(impl, *_contiguous(q, k, v), layout, scale)


def backward(
    q: Any,
    k: Any,
    v: Any,
    out: Any,
    lse: Any,
    dout: Any,
    layout: Layout,
    scale: float,
    backend: str | None = None,
    deterministic: bool = False,
) -> tuple[Any, Any, Any]:
    """(dq, dk, dv) from the saved inputs, output and log-sum-exp."""
    impl = _backend.resolve_backend(backend, on_device=_on_device(q))
    arrays = _contiguous(q, k, v, out, lse, dout)
    return _backend.backward(impl, *arrays, layout, scale, deterministic)
