"""A score operand (``key_bias=``: [batch, (heads,) time_k]; ``rel_bias=``: a learned
relative-position table) through each front a user calls sparse_attention from, every gradient
(q, k, v and the operand's) against the dense float64 oracle: torch autograd (eager, with
recompute, with a softcap and ALiBi beside it), torch.compile (output and gradients bit for bit
eager's), the tape, jax (eager, jit, grad) and blocksparse_attention. Each operand's arrays,
layout and oracle are its own test module's (tests/test_key_bias.py, tests/test_rel_bias.py,
which test the rest: NumPy arrays, varlen, padding, T5, argument checks)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn.tools.oracle import rel_err
from tests import test_key_bias, test_rel_bias

# keyword -> (its test module, the tolerance of its gradient: float32, as the operand)
OPERANDS = {
    "key_bias": (test_key_bias, test_key_bias.BIAS_RTOL),
    "rel_bias": (test_rel_bias, test_rel_bias.TABLE_RTOL),
}
KEYWORDS = pytest.mark.parametrize("keyword", list(OPERANDS))
SHAPED = pytest.mark.parametrize("variant", [False, True], ids=["shared", "own"])  # per head/batch


def _case(keyword, seed, variant=False):
    """(q, k, v, dout, the operand), the layout, the module and the operand's tolerance."""
    module, operand_rtol = OPERANDS[keyword]
    return module._arrays(seed, variant), module._layout(), module, operand_rtol


@KEYWORDS
@SHAPED
@pytest.mark.parametrize("recompute", [False, True])
def test_torch_autograd_reaches_the_operand(keyword, variant, recompute):
    arrays, layout, module, operand_rtol = _case(keyword, 2, variant)
    slopes = cuattn.alibi_slopes(module.HEADS)
    want = module._oracle(*arrays, layout, module.SOFTCAP, slopes)
    extra = dict(recompute=recompute, softcap=module.SOFTCAP, alibi_slopes=torch.from_numpy(slopes))
    check_torch_autograd(keyword, arrays, layout, want, module.RTOL, operand_rtol, **extra)


@KEYWORDS
def test_torch_compile_fullgraph_equals_eager_with_gradients(keyword):
    arrays, layout, _, _ = _case(keyword, 3)
    check_compile_equals_eager(keyword, arrays, layout)


@KEYWORDS
def test_tape_gradients_reach_the_operand(keyword):
    arrays, layout, module, operand_rtol = _case(keyword, 4, True)
    want = module._oracle(*arrays, layout)
    check_tape(keyword, arrays, layout, want, module.RTOL, operand_rtol)


@KEYWORDS
@SHAPED
def test_jax_eager_jit_and_grad_reach_the_operand(keyword, variant):
    arrays, layout, module, operand_rtol = _case(keyword, 5, variant)
    slopes = cuattn.alibi_slopes(module.HEADS)
    want = module._oracle(*arrays, layout, module.SOFTCAP, slopes)
    extra = dict(softcap=module.SOFTCAP, alibi_slopes=slopes)
    check_jax(keyword, arrays, layout, want, module.RTOL, operand_rtol, **extra)


@KEYWORDS
def test_blocksparse_attention_takes_the_operand(keyword):
    arrays, layout, module, _ = _case(keyword, 6)
    check_blocksparse(keyword, arrays, layout, module.HEADS, module.KV_HEADS)


def check_torch_autograd(keyword, arrays, layout, want, rtol, operand_rtol, **extra):
    """Forward and every gradient (q, k, v, the operand: float32, its shape, no NaN) of
    ``sparse_attention(..., keyword=operand, **extra)`` on torch leaves against ``want``."""
    q, k, v, dout, operand = arrays
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, operand)]
    out = cuattn.sparse_attention(*leaves[:3], layout, **extra, **{keyword: leaves[3]})
    out.backward(torch.tensor(dout))
    want_out, _, want_grads, want_operand = want
    assert rel_err(out.detach().numpy(), want_out) <= rtol
    for name, leaf, ref in zip("qkv", leaves[:3], want_grads, strict=True):
        assert rel_err(leaf.grad.numpy(), ref) <= rtol, name
    grad = leaves[3].grad
    assert grad.dtype == torch.float32 and grad.shape == leaves[3].shape
    assert not grad.isnan().any()
    assert rel_err(grad.numpy(), want_operand) <= operand_rtol


def check_compile_equals_eager(keyword, arrays, layout):
    """torch.compile(fullgraph=True) of the call gives eager's output and gradients, bit for
    bit (q, k, v and the operand as leaves)."""
    q, k, v, dout, operand = arrays

    def fn(q, k, v, operand):
        return cuattn.sparse_attention(q, k, v, layout, **{keyword: operand})

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    runs = []
    for f in (fn, compiled):
        leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, operand)]
        out = f(*leaves)
        out.backward(torch.tensor(dout))
        runs.append([out.detach(), *(x.grad for x in leaves)])
    for eager, traced in zip(*runs, strict=True):
        np.testing.assert_array_equal(traced.numpy(), eager.numpy())


def check_tape(keyword, arrays, layout, want, rtol, operand_rtol):
    """Every gradient of the call on cuattn.Tensor leaves (the tape) against ``want``."""
    q, k, v, dout, operand = arrays
    leaves = [cuattn.Tensor(x, requires_grad=True) for x in (q, k, v, operand)]
    out = cuattn.sparse_attention(*leaves[:3], layout, **{keyword: leaves[3]})
    (out * cuattn.Tensor(dout)).sum().backward()
    _, _, want_grads, want_operand = want
    for name, leaf, ref in zip("qkv", leaves, want_grads, strict=False):
        assert rel_err(leaf.grad, ref) <= rtol, name
    assert rel_err(leaves[3].grad, want_operand) <= operand_rtol


def check_jax(keyword, arrays, layout, want, rtol, operand_rtol, **extra):
    """jax arrays: the forward eager, then every gradient by jax.grad, eager and jitted, against
    ``want`` (float64: x64 is switched on)."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, dout, operand = arrays
    inputs = [jax.numpy.asarray(x) for x in (q, k, v, operand)]
    extra = {
        name: jax.numpy.asarray(x) if isinstance(x, np.ndarray) else x for name, x in extra.items()
    }

    def attend(q, k, v, operand):
        return cuattn.sparse_attention(q, k, v, layout, **extra, **{keyword: operand})

    want_out, _, want_grads, want_operand = want
    assert rel_err(np.asarray(attend(*inputs)), want_out) <= rtol
    grad = jax.grad(lambda *a: (attend(*a) * dout).sum(), argnums=(0, 1, 2, 3))
    for fn in (grad, jax.jit(grad)):
        *grads, doperand = fn(*inputs)
        for name, g, ref in zip("qkv", grads, want_grads, strict=True):
            assert rel_err(np.asarray(g), ref) <= rtol, name
        assert rel_err(np.asarray(doperand), want_operand) <= operand_rtol


def check_blocksparse(keyword, arrays, layout, heads, kv_heads, mode="all"):
    """blocksparse_attention ([batch, time, heads * head_dim]) with the operand equals
    sparse_attention on the same layout."""
    q, k, v, _, operand = arrays
    heads_last = [x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1) for x in (q, k, v)]
    out = cuattn.blocksparse_attention(
        *heads_last,
        heads,
        mode,
        blocksize=layout.blocksize,
        kv_heads=kv_heads,
        **{keyword: operand},
    )
    want = cuattn.sparse_attention(q, k, v, layout, **{keyword: operand})
    np.testing.assert_allclose(out, cuattn.merge_heads(want), rtol=1e-12, atol=0)
