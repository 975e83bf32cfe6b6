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
    The score operands come as inputs after v (a gradient reaches those that want one), the
    call (without them) last.
    """

    @staticmethod
    def forward(ctx: Context, q: Any, k: Any, v: Any, *rest: Any) -> tuple[Any, Any]:
        *present, call = rest
        call = call.placed(present)
        out, lse = _backend.forward(q, k, v, call)
        ctx.save_for_backward(q, k, v, out, lse, *present)
        ctx.call = call.without_operands()
        return out, lse

    @staticmethod
    def backward(ctx: Context, dout: Any, dlse: Any) -> tuple:
        q, k, v, out, lse, *present = ctx.saved_tensors
        call = ctx.call.placed(present).wanting(ctx.needs_input_grad[3 : 3 + len(present)])
        grads = _backend.backward(q, k, v, out, lse, dout, dlse, call)
        return (*grads[:3], *grads[3 : 3 + len(present)], None)  # the call has none


def attend(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    """Tape route of ``cuattn.sparse_attention``: q, k, v Tensors [batch, heads, time,
    head_dim] and the validated call (its layout concrete), its score operands Tensors (a
    gradient reaches ALiBi's slopes, the key bias and the relative-position table when they
    require one; dropout's seed array is a constant). ``call.recompute`` keeps only q, k, v
    (and the operands) on the tape and re-runs the forward in backward."""
    with recompute_region(call.recompute):
        present = call.operands.present
        out, lse = SparseAttention.apply(q, k, v, *present, call.without_operands())
    return (out, lse) if call.return_lse else out
