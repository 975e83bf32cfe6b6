"""Block-sparse attention as a tape op: ``SparseAttention`` and ``attend``, the route that
``cuattn.sparse_attention`` and friends take when an input is a ``cuattn.Tensor``.

Works on NumPy and CuPy alike (the backend follows the data).
"""

from __future__ import annotations

from typing import Any

from cuattn import backends as _backend
from cuattn.autograd.tape import Context, Function, Tensor
from cuattn.autograd.tape import recompute as recompute_region
from cuattn.backends.call import AttentionCall

__all__ = ["SparseAttention", "attend"]


class SparseAttention(Function):
    """Block-sparse attention on [batch, heads, time, head_dim]; outputs (out, lse).

    Saves only q, k, v, out and lse: the backend's backward recomputes the probabilities from
    the log-sum-exp. Both outputs are differentiable (lse's gradient enters as delta - dlse).
    """

    @staticmethod
    def forward(ctx: Context, q: Any, k: Any, v: Any, call: AttentionCall) -> tuple[Any, Any]:
        out, lse = _backend.forward(q, k, v, call.layout, call.scale, call.backend, call.mods)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx: Context, dout: Any, dlse: Any) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call
        dq, dk, dv = _backend.backward(
            q, k, v, out, lse, dout, call.layout, call.scale, call.backend, dlse, call.mods
        )
        return dq, dk, dv, None


def attend(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    """Tape route of ``cuattn.sparse_attention``: q, k, v Tensors [batch, heads, time,
    head_dim] and the validated call (its layout concrete). ``call.recompute`` keeps only q, k,
    v on the tape and re-runs the forward in backward."""
    with recompute_region(call.recompute):
        out, lse = SparseAttention.apply(q, k, v, call)
    return (out, lse) if call.return_lse else out
