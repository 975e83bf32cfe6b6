"""Differentiable ops on the tape: enough to write a small transformer, plus attention.

Every op works on NumPy and CuPy alike (the array module is taken from the data). Each
``Function`` saves only what its backward reads, so ``saved_nbytes`` reflects real needs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuattn import backends as _backend
from cuattn.autograd.tape import Context, Function, Tensor, get_array_module
from cuattn.autograd.tape import recompute as recompute_region
from cuattn.backends.call import AttentionCall

__all__ = [
    "add",
    "attend",
    "cross_entropy",
    "div",
    "embedding",
    "gelu",
    "layer_norm",
    "matmul",
    "mean",
    "merge_heads",
    "mul",
    "reshape",
    "softmax",
    "split_heads",
    "sub",
    "sum",
    "transpose",
]

GELU_C = math.sqrt(2.0 / math.pi)  # tanh approximation of GELU (as in GPT-2)
GELU_K = 0.044715


def _shape(x: Any) -> tuple[int, ...]:
    # Python scalars (e.g. the 2.0 in `2.0 * t`) have shape ().
    return tuple(x.shape) if hasattr(x, "shape") else tuple(np.shape(x))


def _unbroadcast(grad: Any, shape: tuple[int, ...]) -> Any:
    """Sum a broadcast gradient back down to the input's shape."""
    if grad.shape == shape:
        return grad
    lead = grad.ndim - len(shape)
    if lead > 0:
        grad = grad.sum(axis=tuple(range(lead)))
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1)
    if axes:
        grad = grad.sum(axis=axes, keepdims=True)
    return grad.reshape(shape)


# -- elementwise ---------------------------------------------------------------------------------


class Add(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (_shape(a), _shape(b))
        return a + b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        sa, sb = ctx.shapes
        ga = _unbroadcast(g, sa) if ctx.needs_input_grad[0] else None
        gb = _unbroadcast(g, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class Sub(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (_shape(a), _shape(b))
        return a - b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        sa, sb = ctx.shapes
        ga = _unbroadcast(g, sa) if ctx.needs_input_grad[0] else None
        gb = _unbroadcast(-g, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class Mul(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (_shape(a), _shape(b))
        # da needs b and db needs a: keep only what a requested gradient will read.
        ctx.save_for_backward(
            b if ctx.needs_input_grad[0] else None, a if ctx.needs_input_grad[1] else None
        )
        return a * b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        b, a = ctx.saved_tensors
        sa, sb = ctx.shapes
        ga = _unbroadcast(g * b, sa) if ctx.needs_input_grad[0] else None
        gb = _unbroadcast(g * a, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class Div(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        ctx.shapes = (_shape(a), _shape(b))
        out = a / b
        ctx.save_for_backward(b, out if ctx.needs_input_grad[1] else None)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        b, out = ctx.saved_tensors
        sa, sb = ctx.shapes
        ga = _unbroadcast(g / b, sa) if ctx.needs_input_grad[0] else None
        gb = _unbroadcast(-g * out / b, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


class Gelu(Function):
    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        xp = get_array_module(x)
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + xp.tanh(GELU_C * (x + GELU_K * x * x * x)))

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (x,) = ctx.saved_tensors
        xp = get_array_module(x)
        t = xp.tanh(GELU_C * (x + GELU_K * x * x * x))
        dt = (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_K * x * x)
        return g * (0.5 * (1.0 + t) + 0.5 * x * dt)


# -- linear algebra and reductions --------------------------------------------------------------


class MatMul(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, b: Any) -> Any:
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(
                f"matmul needs inputs with ndim >= 2, got shapes {a.shape} and {b.shape}"
            )
        ctx.shapes = (a.shape, b.shape)
        ctx.save_for_backward(
            b if ctx.needs_input_grad[0] else None, a if ctx.needs_input_grad[1] else None
        )
        return a @ b

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        b, a = ctx.saved_tensors
        sa, sb = ctx.shapes
        ga = _unbroadcast(g @ b.swapaxes(-1, -2), sa) if ctx.needs_input_grad[0] else None
        gb = _unbroadcast(a.swapaxes(-1, -2) @ g, sb) if ctx.needs_input_grad[1] else None
        return ga, gb


def _norm_axes(axis: int | tuple[int, ...] | None, ndim: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(range(ndim))
    axes = (axis,) if isinstance(axis, int) else tuple(axis)
    return tuple(sorted(a % ndim for a in axes))


class Sum(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, axis: Any = None, keepdims: bool = False) -> Any:
        ctx.shape = a.shape
        ctx.axes = _norm_axes(axis, a.ndim)
        ctx.keepdims = keepdims
        return a.sum(axis=ctx.axes, keepdims=keepdims)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        xp = get_array_module(g)
        if not ctx.keepdims:
            g = xp.expand_dims(g, ctx.axes)
        return xp.broadcast_to(g, ctx.shape).copy()


class Softmax(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, axis: int = -1) -> Any:
        xp = get_array_module(a)
        e = xp.exp(a - a.max(axis=axis, keepdims=True))
        out = e / e.sum(axis=axis, keepdims=True)
        ctx.axis = axis
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (out,) = ctx.saved_tensors
        return out * (g - (g * out).sum(axis=ctx.axis, keepdims=True))


class LayerNorm(Function):
    """Normalise over the last axis, then scale by ``weight`` and shift by ``bias``."""

    @staticmethod
    def forward(ctx: Context, x: Any, weight: Any, bias: Any, eps: float = 1e-5) -> Any:
        xp = get_array_module(x)
        mu = x.mean(axis=-1, keepdims=True)
        rstd = 1.0 / xp.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)
        xhat = (x - mu) * rstd
        ctx.shapes = (x.shape, _shape(weight), _shape(bias))
        ctx.save_for_backward(xhat, rstd, weight)
        return xhat * weight + bias

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        xhat, rstd, weight = ctx.saved_tensors
        _, sw, sb = ctx.shapes
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gxhat = g * weight
            gx = rstd * (
                gxhat
                - gxhat.mean(axis=-1, keepdims=True)
                - xhat * (gxhat * xhat).mean(axis=-1, keepdims=True)
            )
        if ctx.needs_input_grad[1]:
            gw = _unbroadcast(g * xhat, sw)
        if ctx.needs_input_grad[2]:
            gb = _unbroadcast(g, sb)
        return gx, gw, gb


class CrossEntropy(Function):
    """Mean over rows of -log softmax(logits)[target]; logits [..., classes], targets int [...]."""

    @staticmethod
    def forward(ctx: Context, logits: Any, targets: Any) -> Any:
        xp = get_array_module(logits)
        if targets.shape != logits.shape[:-1] or targets.dtype.kind not in "iu":
            raise ValueError(
                f"targets must be an integer array of shape {logits.shape[:-1]}, "
                f"got {targets.dtype} {targets.shape}"
            )
        shifted = logits - logits.max(axis=-1, keepdims=True)
        lse = xp.log(xp.exp(shifted).sum(axis=-1, keepdims=True))
        logp = shifted - lse
        picked = xp.take_along_axis(logp, targets[..., None], axis=-1)
        ctx.save_for_backward(logp, targets)
        return -picked.mean()

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        logp, targets = ctx.saved_tensors
        xp = get_array_module(logp)
        grad = xp.exp(logp)
        xp.put_along_axis(
            grad, targets[..., None], xp.take_along_axis(grad, targets[..., None], -1) - 1, -1
        )
        return grad * (g / targets.size), None


class Embedding(Function):
    """Rows of ``weight`` [vocab, dim] picked by integer ``idx`` of any shape."""

    @staticmethod
    def forward(ctx: Context, weight: Any, idx: Any) -> Any:
        ctx.shape = weight.shape
        ctx.save_for_backward(idx)
        return weight[idx]

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        (idx,) = ctx.saved_tensors
        xp = get_array_module(g)
        grad = xp.zeros(ctx.shape, dtype=g.dtype)
        flat = g.reshape(-1, ctx.shape[-1])
        if xp is np:
            np.add.at(grad, idx.reshape(-1), flat)
        else:
            import cupyx

            cupyx.scatter_add(grad, idx.reshape(-1), flat)
        return grad, None


# -- shape ----------------------------------------------------------------------------------------


class Reshape(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, shape: tuple[int, ...]) -> Any:
        ctx.shape = a.shape
        return a.reshape(shape)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return g.reshape(ctx.shape), None


class Transpose(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, axes: tuple[int, ...] | None = None) -> Any:
        axes = tuple(reversed(range(a.ndim))) if axes is None else tuple(axes)
        ctx.axes = axes
        return a.transpose(axes)

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return g.transpose(tuple(np.argsort(ctx.axes))), None


class SplitHeads(Function):
    """[batch, time, heads*head_dim] -> contiguous [batch, heads, time, head_dim]."""

    @staticmethod
    def forward(ctx: Context, x: Any, heads: int) -> Any:
        xp = get_array_module(x)
        batch, time, width = _check_split(x.shape, heads)
        return xp.ascontiguousarray(
            x.reshape(batch, time, heads, width // heads).transpose(0, 2, 1, 3)
        )

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        return _merge(g), None


class MergeHeads(Function):
    """[batch, heads, time, head_dim] -> [batch, time, heads*head_dim]."""

    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        if x.ndim != 4:
            raise ValueError(f"merge_heads needs [batch, heads, time, head_dim], got {x.shape}")
        ctx.heads = x.shape[1]
        return _merge(x)

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        xp = get_array_module(g)
        batch, time, width = g.shape
        heads = ctx.heads
        return xp.ascontiguousarray(
            g.reshape(batch, time, heads, width // heads).transpose(0, 2, 1, 3)
        )


def _check_split(shape: tuple[int, ...], heads: int) -> tuple[int, int, int]:
    if len(shape) != 3:
        raise ValueError(f"split_heads needs [batch, time, heads*head_dim], got shape {shape}")
    if not isinstance(heads, (int, np.integer)) or heads <= 0 or shape[2] % heads:
        raise ValueError(f"heads={heads!r} must be a positive divisor of the last dim {shape[2]}")
    return shape


def _merge(x: Any) -> Any:
    batch, heads, time, dim = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, time, heads * dim)


# -- public functional API ----------------------------------------------------------------------


def _t(x: Any) -> Any:
    """Wrap raw arrays/scalars as constant tensors so every op sees Tensor or Python scalar."""
    if isinstance(x, (Tensor, int, float)):
        return x
    return Tensor(x)


def add(a: Any, b: Any) -> Tensor:
    return Add.apply(_t(a), _t(b))


def sub(a: Any, b: Any) -> Tensor:
    return Sub.apply(_t(a), _t(b))


def mul(a: Any, b: Any) -> Tensor:
    return Mul.apply(_t(a), _t(b))


def div(a: Any, b: Any) -> Tensor:
    return Div.apply(_t(a), _t(b))


def matmul(a: Any, b: Any) -> Tensor:
    return MatMul.apply(_t(a), _t(b))


def sum(a: Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
    return Sum.apply(a, axis=axis, keepdims=keepdims)


def mean(a: Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
    count = 1
    for ax in _norm_axes(axis, a.ndim):
        count *= a.shape[ax]
    return mul(sum(a, axis=axis, keepdims=keepdims), 1.0 / count)


def reshape(a: Tensor, shape: tuple[int, ...]) -> Tensor:
    return Reshape.apply(a, tuple(shape))


def transpose(a: Tensor, axes: tuple[int, ...] | None = None) -> Tensor:
    return Transpose.apply(a, None if axes is None else tuple(axes))


def softmax(a: Tensor, axis: int = -1) -> Tensor:
    return Softmax.apply(a, axis=axis)


def gelu(a: Tensor) -> Tensor:
    """GELU, tanh approximation (torch's ``gelu(approximate='tanh')``)."""
    return Gelu.apply(a)


def layer_norm(x: Tensor, weight: Any, bias: Any, eps: float = 1e-5) -> Tensor:
    return LayerNorm.apply(x, _t(weight), _t(bias), eps=eps)


def cross_entropy(logits: Tensor, targets: Any) -> Tensor:
    """Mean cross-entropy; ``targets`` is an integer array (or Tensor) of class indices."""
    targets = targets.data if isinstance(targets, Tensor) else targets
    return CrossEntropy.apply(logits, targets)


def embedding(weight: Tensor, idx: Any) -> Tensor:
    idx = idx.data if isinstance(idx, Tensor) else idx
    return Embedding.apply(weight, idx)


def split_heads(x: Tensor, heads: int) -> Tensor:
    return SplitHeads.apply(x, heads)


def merge_heads(x: Tensor) -> Tensor:
    return MergeHeads.apply(x)


# -- attention ------------------------------------------------------------------------------------


class SparseAttention(Function):
    """Block-sparse attention on [batch, heads, time, head_dim]; outputs (out, lse).

    Saves only q, k, v, out and lse: the backend's backward recomputes the probabilities from
    the log-sum-exp. Both outputs are differentiable (lse's gradient enters as delta - dlse).
    """

    @staticmethod
    def forward(ctx: Context, q: Any, k: Any, v: Any, call: AttentionCall) -> tuple[Any, Any]:
        out, lse = _backend.forward(q, k, v, call.layout, call.scale, call.backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.call = call
        return out, lse

    @staticmethod
    def backward(ctx: Context, dout: Any, dlse: Any) -> tuple:
        q, k, v, out, lse = ctx.saved_tensors
        call = ctx.call
        dq, dk, dv = _backend.backward(
            q, k, v, out, lse, dout, call.layout, call.scale, call.backend, dlse=dlse
        )
        return dq, dk, dv, None


def attend(q: Tensor, k: Tensor, v: Tensor, call: AttentionCall) -> Tensor | tuple[Tensor, Tensor]:
    """Tape route of ``cuattn.sparse_attention``: q, k, v Tensors [batch, heads, time,
    head_dim] and the validated call (its layout concrete). ``call.recompute`` keeps only q, k,
    v on the tape and re-runs the forward in backward."""
    with recompute_region(call.recompute):
        out, lse = SparseAttention.apply(q, k, v, call)
    return (out, lse) if call.return_lse else out


def _sum_method(self: Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = False):
    return sum(self, axis=axis, keepdims=keepdims)


def _mean_method(self: Tensor, axis: int | tuple[int, ...] | None = None, keepdims: bool = False):
    return mean(self, axis=axis, keepdims=keepdims)


def _reshape_method(self: Tensor, *shape: Any) -> Tensor:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = tuple(shape[0])
    return reshape(self, shape)


def _transpose_method(self: Tensor, *axes: Any) -> Tensor:
    if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
        axes = tuple(axes[0])
    return transpose(self, axes or None)


def _attach_operators() -> None:
    """Give Tensor its operators, micrograd style, from here: the tape defines the Tensor and the
    walk, this module the math, and only this module imports the other."""
    Tensor.__add__ = lambda self, other: add(self, other)
    Tensor.__radd__ = lambda self, other: add(other, self)
    Tensor.__sub__ = lambda self, other: sub(self, other)
    Tensor.__rsub__ = lambda self, other: sub(other, self)
    Tensor.__mul__ = lambda self, other: mul(self, other)
    Tensor.__rmul__ = lambda self, other: mul(other, self)
    Tensor.__truediv__ = lambda self, other: div(self, other)
    Tensor.__neg__ = lambda self: mul(self, -1.0)
    Tensor.__matmul__ = lambda self, other: matmul(self, other)
    Tensor.sum = _sum_method
    Tensor.mean = _mean_method
    Tensor.reshape = _reshape_method
    Tensor.transpose = _transpose_method


_attach_operators()
