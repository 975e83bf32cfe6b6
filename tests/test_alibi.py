"""``alibi_slopes=`` on ``sparse_attention`` through NumPy arrays, torch autograd (eager, with
recompute, and compiled), the tape, combined with a softcap, GQA and fewer queries than keys;
every gradient (q, k, v and the slopes) against the dense float64 oracle with ALiBi's bias; and
its argument checks. Kernel-level tests: tests/backends/test_alibi.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn.tools.oracle import alibi_bias, dense_attention, dense_attention_grads, rel_err

SOFTCAP = 1.5
HEADS, KV_HEADS, N_Q, N_K, HEAD_DIM, BLOCK = 4, 2, 40, 56, 16, 8
RTOL = 1e-10  # float64 through the NumPy backend against the float64 oracle
SLOPES_RTOL = 1e-6  # the slopes' gradient comes back in float32, as the slopes


def _arrays(seed, per_batch=False):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, HEADS, N_Q, HEAD_DIM)) * 2
    k, v = (rng.standard_normal((2, KV_HEADS, N_K, HEAD_DIM)) * 2 for _ in range(2))
    dout = rng.standard_normal(q.shape)
    slopes = rng.uniform(0.05, 0.5, (2, HEADS) if per_batch else (HEADS,)).astype(np.float32)
    return q, k, v, dout, slopes


def _layout():
    return cuattn.make_layout("all", N_K, HEADS, BLOCK, causal=True, n_q=N_Q)


def _oracle(q, k, v, dout, slopes, layout, softcap=0.0, scale=HEAD_DIM**-0.5):
    mask = layout.to_mask()
    bias = alibi_bias(slopes, q.shape[0], N_Q, N_K)
    out, lse = dense_attention(q, k, v, mask, scale, softcap=softcap, bias=bias)
    *grads, dbias = dense_attention_grads(q, k, v, dout, mask, scale, softcap=softcap, bias=bias)
    distance = -bias / np.broadcast_to(slopes, (q.shape[0], HEADS))[:, :, None, None]
    dslopes = -(dbias * distance).sum(axis=(2, 3))
    return out, lse, grads, dslopes if slopes.ndim == 2 else dslopes.sum(axis=0)


@pytest.mark.parametrize("per_batch", [False, True])
def test_numpy_arrays_forward_and_lse(per_batch):
    q, k, v, dout, slopes = _arrays(0, per_batch)
    layout = _layout()
    out, lse = cuattn.sparse_attention(q, k, v, layout, return_lse=True, alibi_slopes=slopes)
    ref_out, ref_lse, _, _ = _oracle(q, k, v, dout, slopes, layout)
    assert rel_err(out, ref_out) <= RTOL and rel_err(lse, ref_lse) <= RTOL
    assert rel_err(cuattn.sparse_attention(q, k, v, layout), ref_out) > 0.05  # ALiBi moved it


def test_flash_keywords_take_alibi():
    """causal= without a layout: the implicit pattern, end-aligned like the oracle's bias."""
    q, k, v, dout, slopes = _arrays(1)
    out = cuattn.sparse_attention(q, k, v, causal=True, alibi_slopes=slopes)
    ref_out, _, _, _ = _oracle(q, k, v, dout, slopes, _layout())
    assert rel_err(out, ref_out) <= RTOL


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("per_batch", [False, True])
def test_torch_autograd_reaches_the_slopes(recompute, per_batch):
    q, k, v, dout, slopes = _arrays(2, per_batch)
    layout = _layout()
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, slopes)]
    out = cuattn.sparse_attention(
        *leaves[:3], layout, recompute=recompute, softcap=SOFTCAP, alibi_slopes=leaves[3]
    )
    out.backward(torch.tensor(dout))
    ref_out, _, refs, ref_dslopes = _oracle(q, k, v, dout, slopes, layout, SOFTCAP)
    assert rel_err(out.detach().numpy(), ref_out) <= RTOL
    for name, leaf, ref in zip("qkv", leaves[:3], refs, strict=True):
        assert rel_err(leaf.grad.numpy(), ref) <= RTOL, name
    assert leaves[3].grad.dtype == torch.float32
    assert rel_err(leaves[3].grad.numpy(), ref_dslopes) <= SLOPES_RTOL


def test_torch_fixed_slopes_take_no_gradient():
    q, k, v, dout, slopes = _arrays(3)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    fixed = torch.tensor(slopes)
    out = cuattn.sparse_attention(*leaves, _layout(), alibi_slopes=fixed)
    out.backward(torch.tensor(dout))
    assert fixed.grad is None and all(leaf.grad is not None for leaf in leaves)


def test_torch_compile_fullgraph_equals_eager():
    q, k, v, _, slopes = _arrays(4)
    layout = _layout()
    tensors = [torch.tensor(x) for x in (q, k, v, slopes)]

    def fn(q, k, v, slopes):
        return cuattn.sparse_attention(q, k, v, layout, alibi_slopes=slopes)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    np.testing.assert_array_equal(compiled(*tensors).numpy(), fn(*tensors).numpy())


def test_tape_gradients_reach_the_slopes():
    q, k, v, dout, slopes = _arrays(5)
    layout = _layout()
    leaves = [cuattn.Tensor(x, requires_grad=True) for x in (q, k, v, slopes)]
    out = cuattn.sparse_attention(*leaves[:3], layout, alibi_slopes=leaves[3])
    (out * cuattn.Tensor(dout)).sum().backward()
    _, _, refs, ref_dslopes = _oracle(q, k, v, dout, slopes, layout)
    for name, leaf, ref in zip("qkv", leaves[:3], refs, strict=True):
        assert rel_err(leaf.grad, ref) <= RTOL, name
    assert rel_err(leaves[3].grad, ref_dslopes) <= SLOPES_RTOL
    # plain slopes beside Tensors are a constant of the tape
    out = cuattn.sparse_attention(*leaves[:3], layout, alibi_slopes=slopes)
    np.testing.assert_array_equal(
        out.data, cuattn.sparse_attention(q, k, v, layout, alibi_slopes=slopes)
    )


@pytest.mark.parametrize(
    ("slopes", "error", "message"),
    [
        ([0.5] * HEADS, TypeError, "alibi_slopes must be a float32 array"),
        (np.full(HEADS, 0.5), TypeError, "alibi_slopes must be float32"),
        (np.full(HEADS + 1, 0.5, np.float32), ValueError, r"shape \[heads\] = \(4,\)"),
        (np.full((3, HEADS), 0.5, np.float32), ValueError, r"\[batch, heads\] = \(2, 4\)"),
        (torch.full((HEADS,), 0.5), TypeError, "alibi_slopes is a torch.Tensor but q is"),
    ],
)
def test_bad_slopes_are_refused_before_anything_runs(slopes, error, message):
    q, k, v, _, _ = _arrays(6)
    with pytest.raises(error, match=message):
        cuattn.sparse_attention(q, k, v, _layout(), alibi_slopes=slopes)


def test_permuted_layouts_are_refused():
    rng = np.random.default_rng(7)
    q = rng.standard_normal((1, 2, 64, 8))
    strided = cuattn.make_layout("strided", 64, 2, 16, local_attn_ctx=4)
    assert strided.perm is not None
    with pytest.raises(ValueError, match="natural token order"):
        cuattn.sparse_attention(q, q, q, strided, alibi_slopes=np.ones(2, np.float32))


@pytest.mark.parametrize("per_batch", [False, True])
def test_jax_eager_jit_and_grad_reach_the_slopes(per_batch):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, dout, slopes = _arrays(8, per_batch)
    layout = _layout()
    ref_out, _, refs, ref_dslopes = _oracle(q, k, v, dout, slopes, layout, SOFTCAP)
    arrays = [jax.numpy.asarray(x) for x in (q, k, v, slopes)]

    def loss(q, k, v, slopes):
        out = cuattn.sparse_attention(q, k, v, layout, softcap=SOFTCAP, alibi_slopes=slopes)
        return (out * dout).sum()

    out = cuattn.sparse_attention(*arrays[:3], layout, softcap=SOFTCAP, alibi_slopes=arrays[3])
    assert rel_err(np.asarray(out), ref_out) <= RTOL
    grad = jax.grad(loss, argnums=(0, 1, 2, 3))
    for fn in (grad, jax.jit(grad)):
        *grads, dslopes = fn(*arrays)
        for name, g, ref in zip("qkv", grads, refs, strict=True):
            assert rel_err(np.asarray(g), ref) <= RTOL, name
        assert dslopes.dtype == np.float32
        assert rel_err(np.asarray(dslopes), ref_dslopes) <= SLOPES_RTOL


def test_varlen_equals_each_sequence_alone():
    rng = np.random.default_rng(9)
    cu = np.array([0, 23, 23, 64, 90])
    q, k, v = (rng.standard_normal((int(cu[-1]), HEADS, HEAD_DIM)) for _ in range(3))
    slopes = rng.uniform(0.05, 0.5, HEADS).astype(np.float32)

    def layout(n_q, n_k):
        return cuattn.make_layout("local", n_k, HEADS, BLOCK, local_attn_ctx=16, n_q=n_q)

    out = cuattn.sparse_attention_varlen(q, k, v, cu, cu, layout, alibi_slopes=slopes)
    for s in range(len(cu) - 1):
        a, b = cu[s], cu[s + 1]
        if a == b:
            continue
        one = [x[a:b].transpose(1, 0, 2)[None] for x in (q, k, v)]
        alone = cuattn.sparse_attention(*one, layout(b - a, b - a), alibi_slopes=slopes)
        np.testing.assert_allclose(out[a:b], alone[0].transpose(1, 0, 2), rtol=1e-12, atol=0)


def test_varlen_refuses_per_sequence_offsets_and_slopes():
    rng = np.random.default_rng(10)
    cu_q, cu_k = np.array([0, 10, 30]), np.array([0, 16, 36])
    q = rng.standard_normal((30, HEADS, HEAD_DIM))
    k = rng.standard_normal((36, HEADS, HEAD_DIM))

    def layout(n_q, n_k):
        return cuattn.make_layout("all", n_k, HEADS, BLOCK, n_q=n_q)

    slopes = np.full(HEADS, 0.25, np.float32)
    with pytest.raises(ValueError, match="needs cu_seqlens_q equal to cu_seqlens_k"):
        cuattn.sparse_attention_varlen(q, k, k, cu_q, cu_k, layout, alibi_slopes=slopes)
    with pytest.raises(ValueError, match=r"one slope per head for every sequence"):
        cuattn.sparse_attention_varlen(
            q, q, q, cu_q, cu_q, layout, alibi_slopes=np.full((2, HEADS), 0.25, np.float32)
        )


def test_blocksparse_attention_takes_alibi():
    q, k, v, _, slopes = _arrays(11)
    heads_last = [x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1) for x in (q, k, v)]
    out = cuattn.blocksparse_attention(
        *heads_last, HEADS, "all", blocksize=BLOCK, kv_heads=KV_HEADS, alibi_slopes=slopes
    )
    want = cuattn.sparse_attention(q, k, v, _layout(), alibi_slopes=slopes)
    np.testing.assert_allclose(out, cuattn.merge_heads(want), rtol=1e-12, atol=0)
