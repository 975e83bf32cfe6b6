"""Block-sparse attention as a tape op: ``SparseAttention`` and ``attend``, the route that
``cuattn.sparse_attention`` and friends take when an input is a ``cuattn.Tensor``.

Works on NumPy and CuPy alike (the backend follows the data).
"""

from __future__ import annotations

from typing import Any

from cuattn import backends as _backend
from cuattn.autograd.tape import Context, Function, Tensor
from cuattn.autograd.tape import recompute as recompute_region
from cuattn.backends.call import AttentionCall, operand_gradients

__all__ = ["SparseAttention", "attend"]


class SparseAttention(Function):
    """Block-sparse attention on [batch, heads, time, head_dim]; outputs (out, lse).

    Saves only q, k, v, out and lse: the backend's backward recomputes the probabilities from
    the log-sum-exp. Both outputs are differentiable (lse's gradient enters as delta - dlse).
    """

    @staticmethod
    def forward(
        ctx: Context,
        q: Any,
        k: Any,
        v: Any,
        alibi_slopes: Any | None,
        key_bias: Any | None,
        rel_bias: Any | None,
        seed_words: Any | None,
        call: AttentionCall,
    ) -> tuple[Any, Any]:
        operands = (alibi_slopes, key_bias, rel_bias, seed_words)
        args = (call.layout, call.scale, call.backend, call.mods)
        out, lse = _backend.forward(q, k, v, *args, *operands)
        ctx.save_for_backward(q, k, v, out, lse, *operands)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx: Context, dout: Any, dlse: Any) -> tuple:
        q, k, v, out, lse, *operands = ctx.saved_tensors
        call = ctx.call
        args = (call.layout, call.scale, call.backend, dlse, call.mods)
        grads = _backend.backward(q, k, v, out, lse, dout, *args, *operands)
        return (*grads[:3], *operand_gradients(grads, tuple(operands)), None)


def attend(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    call: AttentionCall,
    alibi_slopes: Tensor | None = None,
    key_bias: Tensor | None = None,
    rel_bias: Tensor | None = None,
    seed_words: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Tape route of ``cuattn.sparse_attention``: q, k, v Tensors [batch, heads, time,
    head_dim] and the validated call (its layout concrete); ALiBi's slopes, the key bias and
    the relative-position table Tensors (a gradient reaches them when they require one) or
    None; ``seed_words`` dropout's seed held in an array (a constant), or None.
    ``call.recompute`` keeps
    only q, k, v (and the operands) on the tape and re-runs the forward in backward."""
    with recompute_region(call.recompute):
        operands = (alibi_slopes, key_bias, rel_bias, seed_words)
        out, lse = SparseAttention.apply(q, k, v, *operands, call)
    return (out, lse) if call.return_lse else out
