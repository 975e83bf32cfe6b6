"""The transformer ops of the tiny demo model (:mod:`dev.tinylm`) on cuattn's tape.

``softmax``, ``gelu``, ``layer_norm``, ``cross_entropy``, ``embedding``, ``split_heads`` and
``merge_heads``, each a ``Function`` of :mod:`cuattn.autograd.tape` and a function that applies
it; the arithmetic (``+ - * / @``, ``sum``, ``mean``, ``reshape``, ``transpose``) is
``Tensor``'s own. Every op works on NumPy and CuPy alike (the array module is taken from the
data) and saves only what its backward reads, so ``saved_nbytes`` reflects real needs.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuattn._util import array_module
from cuattn.autograd.tape import Context, Function, Tensor, unbroadcast

__all__ = [
    "cross_entropy",
    "embedding",
    "gelu",
    "layer_norm",
    "merge_heads",
    "softmax",
    "split_heads",
]

GELU_C = math.sqrt(2.0 / math.pi)  # tanh approximation of GELU (as in GPT-2)
GELU_K = 0.044715


class Gelu(Function):
    @staticmethod
    def forward(ctx: Context, x: Any) -> Any:
        xp = array_module(x)
        ctx.save_for_backward(x)
        return 0.5 * x * (1.0 + xp.tanh(GELU_C * (x + GELU_K * x * x * x)))

    @staticmethod
    def backward(ctx: Context, g: Any) -> Any:
        (x,) = ctx.saved_tensors
        xp = array_module(x)
        t = xp.tanh(GELU_C * (x + GELU_K * x * x * x))
        dt = (1.0 - t * t) * GELU_C * (1.0 + 3.0 * GELU_K * x * x)
        return g * (0.5 * (1.0 + t) + 0.5 * x * dt)


class Softmax(Function):
    @staticmethod
    def forward(ctx: Context, a: Any, axis: int = -1) -> Any:
        xp = array_module(a)
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
        xp = array_module(x)
        mu = x.mean(axis=-1, keepdims=True)
        rstd = 1.0 / xp.sqrt(((x - mu) ** 2).mean(axis=-1, keepdims=True) + eps)
        xhat = (x - mu) * rstd
        ctx.shapes = (np.shape(weight), np.shape(bias))
        ctx.save_for_backward(xhat, rstd, weight)
        return xhat * weight + bias

    @staticmethod
    def backward(ctx: Context, g: Any) -> tuple:
        xhat, rstd, weight = ctx.saved_tensors
        sw, sb = ctx.shapes
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gxhat = g * weight
            gx = rstd * (
                gxhat
                - gxhat.mean(axis=-1, keepdims=True)
                - xhat * (gxhat * xhat).mean(axis=-1, keepdims=True)
            )
        if ctx.needs_input_grad[1]:
            gw = unbroadcast(g * xhat, sw)
        if ctx.needs_input_grad[2]:
            gb = unbroadcast(g, sb)
        return gx, gw, gb


class CrossEntropy(Function):
    """Mean over rows of -log softmax(logits)[target]; logits [..., classes], targets int [...]."""

    @staticmethod
    def forward(ctx: Context, logits: Any, targets: Any) -> Any:
        xp = array_module(logits)
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
        xp = array_module(logp)
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
        xp = array_module(g)
        grad = xp.zeros(ctx.shape, dtype=g.dtype)
        flat = g.reshape(-1, ctx.shape[-1])
        if xp is np:
            np.add.at(grad, idx.reshape(-1), flat)
        else:
            import cupyx

            cupyx.scatter_add(grad, idx.reshape(-1), flat)
        return grad, None


class SplitHeads(Function):
    """[batch, time, heads*head_dim] -> contiguous [batch, heads, time, head_dim]."""

    @staticmethod
    def forward(ctx: Context, x: Any, heads: int) -> Any:
        xp = array_module(x)
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
        xp = array_module(g)
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


def softmax(a: Tensor, axis: int = -1) -> Tensor:
    return Softmax.apply(a, axis=axis)


def gelu(a: Tensor) -> Tensor:
    """GELU, tanh approximation (torch's ``gelu(approximate='tanh')``)."""
    return Gelu.apply(a)


def layer_norm(x: Tensor, weight: Any, bias: Any, eps: float = 1e-5) -> Tensor:
    return LayerNorm.apply(x, weight, bias, eps=eps)


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
