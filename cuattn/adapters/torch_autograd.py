"""torch adapter: block-sparse attention as a ``torch.autograd.Function``.

CPU tensors run the NumPy backend and CUDA tensors the CuPy kernels, both through DLPack with
no copies, on torch's current stream. ``loss.backward()`` fills q.grad, k.grad, v.grad.
``recompute=True`` saves only q, k, v and re-runs the forward inside backward.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.function import once_differentiable

from cuattn import backends as _backend
from cuattn.adapters import dlpack
from cuattn.layout.layout import Layout

__all__ = ["attend"]


def _forward_arrays(q: Any, k: Any, v: Any, layout: Layout, scale: float, backend: str | None):
    return dlpack.call(_backend.forward, {"q": q, "k": k, "v": v}, layout, scale, backend)


class SparseAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layout: Layout,
        scale: float,
        recompute: bool,
        backend: str | None,
        deterministic: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out, lse = _forward_arrays(q, k, v, layout, scale, backend)
        ctx.mark_non_differentiable(lse)
        if recompute:
            ctx.save_for_backward(q, k, v)
        else:
            ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, scale, recompute, backend, deterministic)
        return out, lse

    @staticmethod
    @once_differentiable  # backward runs outside autograd: refuse double backward loudly
    def backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
        layout, scale, recompute, backend, deterministic = ctx.args
        saved = ctx.saved_tensors
        q, k, v = saved[:3]
        if recompute:
            out, lse = _forward_arrays(q, k, v, layout, scale, backend)
        else:
            out, lse = saved[3:]
        named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout}
        dq, dk, dv = dlpack.call(_backend.backward, named, layout, scale, backend, deterministic)
        return dq, dk, dv, None, None, None, None, None


def attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    scale: float,
    recompute: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Differentiable attention on torch tensors [batch, heads, time, head_dim].

    lse (float32, float64 for float64 input) is returned without a gradient.
    """
    out, lse = SparseAttentionFunction.apply(
        q, k, v, layout, float(scale), bool(recompute), backend, bool(deterministic)
    )
    return (out, lse) if return_lse else out
