"""Each general tape op's backward vs central finite differences and torch autograd (float64)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from cuattn.autograd.tape import Tensor
from dev.tinylm_ops import (
    cross_entropy,
    embedding,
    gelu,
    layer_norm,
    merge_heads,
    softmax,
    split_heads,
)

FD_STEP = 1e-6
FD_RTOL = 1e-6
TORCH_RTOL = 1e-10

TARGETS = np.array([[1, 0, 4], [3, 2, 2]])
INDICES = np.array([[0, 3, 3], [5, 1, 0]])

# name -> (tape fn, torch fn, input shapes)
CASES = {
    "add_broadcast": (lambda a, b: a + b, lambda a, b: a + b, [(3, 4), (4,)]),
    "sub_broadcast": (lambda a, b: a - b, lambda a, b: a - b, [(3, 4), (3, 1)]),
    "mul_broadcast": (lambda a, b: a * b, lambda a, b: a * b, [(2, 3, 4), (3, 1)]),
    "div": (lambda a, b: a / b, lambda a, b: a / b, [(3, 4), (3, 4)]),
    "scalar_ops": (lambda a: (2.0 - a) * 3.0 + 1.5, lambda a: (2.0 - a) * 3.0 + 1.5, [(3, 2)]),
    "matmul_batched": (lambda a, b: a @ b, lambda a, b: a @ b, [(2, 3, 4), (4, 5)]),
    "matmul_both_batched": (lambda a, b: a @ b, lambda a, b: a @ b, [(2, 3, 4), (2, 4, 2)]),
    "sum_all": (lambda a: a.sum(), lambda a: a.sum(), [(3, 4)]),
    "sum_axis": (lambda a: a.sum(axis=1), lambda a: a.sum(dim=1), [(2, 3, 4)]),
    "sum_keepdims": (
        lambda a: a.sum(axis=(0, 2), keepdims=True),
        lambda a: a.sum(dim=(0, 2), keepdim=True),
        [(2, 3, 4)],
    ),
    "mean_axis": (lambda a: a.mean(axis=-1), lambda a: a.mean(dim=-1), [(3, 5)]),
    "reshape": (
        lambda a: a.reshape(4, 6) * a.reshape(4, 6),
        lambda a: a.reshape(4, 6) ** 2,
        [(2, 3, 4)],
    ),
    "transpose": (lambda a: a.transpose((2, 0, 1)), lambda a: a.permute(2, 0, 1), [(2, 3, 4)]),
    "softmax": (lambda a: softmax(a, axis=-1), lambda a: torch.softmax(a, -1), [(3, 5)]),
    "softmax_axis0": (lambda a: softmax(a, axis=0), lambda a: torch.softmax(a, 0), [(3, 5)]),
    "gelu": (gelu, lambda a: F.gelu(a, approximate="tanh"), [(4, 5)]),
    "layer_norm": (
        lambda x, w, b: layer_norm(x, w, b),
        lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, eps=1e-5),
        [(2, 3, 6), (6,), (6,)],
    ),
    "cross_entropy": (
        lambda z: cross_entropy(z, TARGETS),
        lambda z: F.cross_entropy(z.reshape(-1, 5), torch.from_numpy(TARGETS).reshape(-1)),
        [(2, 3, 5)],
    ),
    "embedding": (
        lambda w: embedding(w, INDICES),
        lambda w: F.embedding(torch.from_numpy(INDICES), w),
        [(6, 4)],
    ),
    "split_heads": (
        lambda x: split_heads(x, 3),
        lambda x: x.reshape(2, 4, 3, 2).permute(0, 2, 1, 3),
        [(2, 4, 6)],
    ),
    "merge_heads": (
        merge_heads,
        lambda x: x.permute(0, 2, 1, 3).reshape(2, 4, 6),
        [(2, 3, 4, 2)],
    ),
}


def _inputs(shapes, seed):
    rng = np.random.default_rng(seed)
    # Keep divisors away from zero so finite differences stay well conditioned.
    return [rng.uniform(0.5, 1.5, s) * rng.choice([-1.0, 1.0], s) for s in shapes]


def _tape_grads(fn, arrays, weight):
    tensors = [Tensor(a.copy(), requires_grad=True) for a in arrays]
    out = fn(*tensors)
    loss = (out * weight).sum() if out.size > 1 else out * weight
    loss.backward()
    return out.data, [t.grad for t in tensors]


def _scalar_loss(fn, arrays, weight):
    out = fn(*[Tensor(a) for a in arrays]).data
    return float(np.sum(out * weight))


@pytest.mark.parametrize("name", sorted(CASES))
def test_op_matches_finite_differences_and_torch(name):
    fn, torch_fn, shapes = CASES[name]
    arrays = _inputs(shapes, seed=sorted(CASES).index(name))
    out_shape = fn(*[Tensor(a) for a in arrays]).shape
    weight = np.random.default_rng(99).standard_normal(out_shape)
    out, grads = _tape_grads(fn, arrays, weight)

    for i, a in enumerate(arrays):
        numeric = np.zeros_like(a)
        for idx in np.ndindex(a.shape):
            plus = [x.copy() for x in arrays]
            minus = [x.copy() for x in arrays]
            plus[i][idx] += FD_STEP
            minus[i][idx] -= FD_STEP
            numeric[idx] = (_scalar_loss(fn, plus, weight) - _scalar_loss(fn, minus, weight)) / (
                2 * FD_STEP
            )
        np.testing.assert_allclose(grads[i], numeric, rtol=FD_RTOL, atol=FD_RTOL)

    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    t_out = torch_fn(*leaves)
    (t_out * torch.from_numpy(weight)).sum().backward()
    np.testing.assert_allclose(out, t_out.detach().numpy(), rtol=TORCH_RTOL, atol=1e-12)
    for g, leaf in zip(grads, leaves, strict=True):
        np.testing.assert_allclose(g, leaf.grad.numpy(), rtol=TORCH_RTOL, atol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(CASES))
def test_op_on_cupy_matches_numpy(name):
    import cupy

    fn, _, shapes = CASES[name]
    if name in ("cross_entropy", "embedding"):
        pytest.skip("index arrays are NumPy constants in this table")
    arrays = _inputs(shapes, seed=sorted(CASES).index(name))
    out_shape = fn(*[Tensor(a) for a in arrays]).shape
    weight = np.random.default_rng(99).standard_normal(out_shape)
    out, grads = _tape_grads(fn, arrays, weight)
    leaves = [Tensor(cupy.asarray(a), requires_grad=True) for a in arrays]
    d_out = fn(*leaves)
    (d_out * cupy.asarray(weight)).sum().backward()
    np.testing.assert_allclose(cupy.asnumpy(d_out.data), out, rtol=1e-12, atol=1e-12)
    for g, leaf in zip(grads, leaves, strict=True):
        np.testing.assert_allclose(cupy.asnumpy(leaf.grad), g, rtol=1e-12, atol=1e-12)
