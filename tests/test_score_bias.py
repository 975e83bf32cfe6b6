"""``score_bias=`` on ``sparse_attention``: a dense additive bias broadcastable to [batch, heads,
time_q, time_k] (xformers' attn_bias, SDPA's float mask, T5's position_bias), through NumPy
arrays, torch autograd (eager, with recompute, and compiled), jax (eager, jit, grad), the tape
and blocksparse_attention; every broadcast shape, -inf entries, sparse layouts (the bias is
read only inside the computed blocks: NaN elsewhere never reaches a result), GQA and fewer
queries than keys; every gradient (q, k, v and the bias, summed over the axes it broadcasts)
against the dense float64 oracle; argument checks. Kernel-level tests:
tests/backends/test_score_bias.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn.tools.oracle import alibi_bias, dense_attention, dense_attention_grads, rel_err

SOFTCAP = 1.5
HEADS, KV_HEADS, BATCH, N_Q, N_K, HEAD_DIM, BLOCK = 4, 2, 2, 40, 56, 16, 8
RTOL = 1e-10  # float64 through the NumPy backend against the float64 oracle
# each axis of [batch, heads, time_q, time_k] full or broadcast, and the ranks below 4
SHAPES = {
    "full": (BATCH, HEADS, N_Q, N_K),
    "one batch": (1, HEADS, N_Q, N_K),
    "rank 2": (N_Q, N_K),
    "by key": (BATCH, 1, 1, N_K),
    "by head and query": (HEADS, N_Q, 1),
}


def _arrays(seed, shape, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, HEADS, N_Q, HEAD_DIM)) * 2
    k, v = (rng.standard_normal((BATCH, KV_HEADS, N_K, HEAD_DIM)) * 2 for _ in range(2))
    dout = rng.standard_normal(q.shape)
    bias = (rng.standard_normal(shape) * 2).astype(dtype)
    if shape[-1] == N_K:
        bias[..., 3] = -np.inf  # a key every query of the broadcast rows skips
    return q, k, v, dout, bias


def _layout(sparse=False):
    if sparse:  # rows with holes: blocks the walk never computes
        return cuattn.make_layout(
            "fixed", N_K, HEADS, BLOCK, local_attn_ctx=16, num_verts=1, vertsize=1, n_q=N_Q
        )
    return cuattn.make_layout("all", N_K, HEADS, BLOCK, causal=True, n_q=N_Q)


def _oracle(q, k, v, dout, score_bias, layout, softcap=0.0, slopes=None):
    """(out, lse, (dq, dk, dv), the bias's gradient summed to its shape)."""
    mask = layout.to_mask()
    bias = np.broadcast_to(score_bias.astype(np.float64), (BATCH, HEADS, N_Q, N_K))
    if slopes is not None:
        bias = bias + alibi_bias(slopes, BATCH, N_Q, N_K)
    scale = HEAD_DIM**-0.5
    out, lse = dense_attention(q, k, v, mask, scale, softcap=softcap, bias=bias)
    *grads, dbias = dense_attention_grads(q, k, v, dout, mask, scale, softcap=softcap, bias=bias)
    dbias = np.nan_to_num(dbias, nan=0.0)  # a -inf bias: p = 0, no gradient
    padded = (1,) * (4 - score_bias.ndim) + score_bias.shape
    axes = tuple(a for a, d in enumerate(padded) if d == 1)
    dscore = dbias.sum(axis=axes, keepdims=True).reshape(score_bias.shape)
    return out, lse, grads, dscore


@pytest.mark.parametrize("sparse", [False, True], ids=["causal", "sparse"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_numpy_arrays_forward_and_lse(shape, sparse):
    q, k, v, dout, bias = _arrays(0, SHAPES[shape])
    layout = _layout(sparse)
    out, lse = cuattn.sparse_attention(q, k, v, layout, return_lse=True, score_bias=bias)
    ref_out, ref_lse, _, _ = _oracle(q, k, v, dout, bias, layout)
    finite = np.isfinite(ref_lse)
    assert rel_err(out, ref_out) <= RTOL and rel_err(lse[finite], ref_lse[finite]) <= RTOL
    np.testing.assert_array_equal(np.isneginf(lse), ~finite)


def test_the_bias_is_read_only_inside_the_computed_blocks():
    """NaN everywhere the layout computes nothing, and a row whose every allowed key is -inf:
    the outputs and every gradient stay finite (that row: out 0, lse -inf)."""
    q, k, v, dout, _ = _arrays(1, SHAPES["full"])
    layout = _layout(sparse=True)
    allowed = np.broadcast_to(layout.to_mask()[None], (BATCH, HEADS, N_Q, N_K))
    bias = np.where(allowed, 0.5, np.nan)
    bias[0, 1, 7] = np.where(allowed[0, 1, 7], -np.inf, np.nan)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, bias)]
    out, lse = cuattn.sparse_attention(*leaves[:3], layout, return_lse=True, score_bias=leaves[3])
    out.backward(torch.tensor(dout))
    assert not out.isnan().any() and (out[0, 1, 7] == 0).all() and lse[0, 1, 7] == -np.inf
    for leaf in leaves:
        assert not leaf.grad.isnan().any()
    assert (leaves[3].grad[~torch.from_numpy(allowed.copy())] == 0).all()
    outside_as_zero = np.where(np.isnan(bias), 0.0, bias)  # the oracle masks those elements
    ref_out, _, refs, ref_dscore = _oracle(q, k, v, dout, outside_as_zero, layout)
    assert rel_err(out.detach().numpy(), ref_out) <= RTOL
    for name, leaf, ref in zip("qkv", leaves, refs, strict=False):
        assert rel_err(leaf.grad.numpy(), ref) <= RTOL, name
    assert rel_err(leaves[3].grad.numpy(), ref_dscore) <= RTOL


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("shape", ["full", "rank 2", "by head and query"])
def test_torch_autograd_reaches_the_score_bias(shape, recompute):
    q, k, v, dout, bias = _arrays(2, SHAPES[shape])
    layout = _layout(sparse=True)
    slopes = cuattn.alibi_slopes(HEADS)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, bias)]
    out = cuattn.sparse_attention(
        *leaves[:3],
        layout,
        recompute=recompute,
        softcap=SOFTCAP,
        alibi_slopes=torch.from_numpy(slopes),
        score_bias=leaves[3],
    )
    out.backward(torch.tensor(dout))
    ref_out, _, refs, ref_dscore = _oracle(q, k, v, dout, bias, layout, SOFTCAP, slopes)
    assert rel_err(out.detach().numpy(), ref_out) <= RTOL
    for name, leaf, ref in zip("qkv", leaves[:3], refs, strict=True):
        assert rel_err(leaf.grad.numpy(), ref) <= RTOL, name
    grad = leaves[3].grad
    assert grad.shape == bias.shape and grad.dtype == torch.float64
    assert rel_err(grad.numpy(), ref_dscore) <= RTOL


def test_a_strided_view_is_read_in_place():
    """A transposed bias (a view, not contiguous) gives what its contiguous copy gives."""
    q, k, v, _, bias = _arrays(3, (BATCH, HEADS, N_K, N_Q))
    view = bias.transpose(0, 1, 3, 2)
    assert not view.flags.c_contiguous
    layout = _layout()
    got = cuattn.sparse_attention(q, k, v, layout, score_bias=view)
    want = cuattn.sparse_attention(q, k, v, layout, score_bias=np.ascontiguousarray(view))
    np.testing.assert_array_equal(got, want)


def test_torch_compile_fullgraph_equals_eager():
    q, k, v, _, bias = _arrays(4, SHAPES["one batch"])
    layout = _layout()
    tensors = [torch.tensor(x) for x in (q, k, v, bias)]

    def fn(q, k, v, score_bias):
        return cuattn.sparse_attention(q, k, v, layout, score_bias=score_bias)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    np.testing.assert_array_equal(compiled(*tensors).numpy(), fn(*tensors).numpy())


def test_tape_gradients_reach_the_score_bias():
    q, k, v, dout, bias = _arrays(5, SHAPES["by key"])
    layout = _layout(sparse=True)
    leaves = [cuattn.Tensor(x, requires_grad=True) for x in (q, k, v, bias)]
    out = cuattn.sparse_attention(*leaves[:3], layout, score_bias=leaves[3])
    (out * cuattn.Tensor(dout)).sum().backward()
    _, _, refs, ref_dscore = _oracle(q, k, v, dout, bias, layout)
    for name, leaf, ref in zip("qkv", leaves, refs, strict=False):
        assert rel_err(leaf.grad, ref) <= RTOL, name
    assert leaves[3].grad.shape == bias.shape
    assert rel_err(leaves[3].grad, ref_dscore) <= RTOL


@pytest.mark.parametrize("shape", ["full", "rank 2"])
def test_jax_eager_jit_and_grad_reach_the_score_bias(shape):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, dout, bias = _arrays(6, SHAPES[shape])
    layout = _layout(sparse=True)
    ref_out, _, refs, ref_dscore = _oracle(q, k, v, dout, bias, layout, SOFTCAP)
    arrays = [jax.numpy.asarray(x) for x in (q, k, v, bias)]

    def attend(q, k, v, score_bias):
        return cuattn.sparse_attention(q, k, v, layout, softcap=SOFTCAP, score_bias=score_bias)

    assert rel_err(np.asarray(attend(*arrays)), ref_out) <= RTOL
    grad = jax.grad(lambda *a: (attend(*a) * dout).sum(), argnums=(0, 1, 2, 3))
    for fn in (grad, jax.jit(grad)):
        *grads, dscore = fn(*arrays)
        for name, g, ref in zip("qkv", grads, refs, strict=True):
            assert rel_err(np.asarray(g), ref) <= RTOL, name
        assert dscore.shape == bias.shape and rel_err(np.asarray(dscore), ref_dscore) <= RTOL


def test_blocksparse_attention_takes_a_score_bias():
    q, k, v, _, bias = _arrays(7, SHAPES["full"])
    heads_last = [x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1) for x in (q, k, v)]
    layout = cuattn.make_layout("all", N_K, HEADS, BLOCK, n_q=N_Q)
    out = cuattn.blocksparse_attention(
        *heads_last, HEADS, "all", blocksize=BLOCK, kv_heads=KV_HEADS, score_bias=bias
    )
    want = cuattn.sparse_attention(q, k, v, layout, score_bias=bias)
    np.testing.assert_allclose(out, cuattn.merge_heads(want), rtol=1e-12, atol=0)


def test_a_16_bit_bias_beside_16_bit_inputs():
    """A bias in q's own dtype (as SDPA's float masks come) is read as it is, no copy."""
    q, k, v, dout, bias = _arrays(8, SHAPES["full"], np.float32)
    q, k, v = (x.astype(np.float16) for x in (q, k, v))
    layout = _layout()
    got = cuattn.sparse_attention(q, k, v, layout, score_bias=bias.astype(np.float16))
    ref_out, _, _, _ = _oracle(*(x.astype(np.float64) for x in (q, k, v)), dout,
                               bias.astype(np.float16), layout)  # fmt: skip
    assert rel_err(got.astype(np.float64), ref_out) <= 2e-3


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda q: [[0.0] * N_K] * N_Q, TypeError, "score_bias must be a float32 array"),
        (lambda q: np.zeros((N_Q, N_K), np.float16), TypeError, "float32 or q's dtype float64"),
        (lambda q: np.zeros((N_Q, N_K + 1)), ValueError, r"broadcast to \[batch, heads, time_q"),
        (lambda q: np.zeros((3, HEADS, N_Q, N_K)), ValueError, r"\(2, 4, 40, 56\)"),
        (lambda q: np.zeros(N_K), ValueError, "rank 2 to 4"),
        (lambda q: torch.zeros(N_Q, N_K, dtype=torch.float64), TypeError, "score_bias is a torch"),
    ],
)
def test_bad_score_bias_is_refused_before_anything_runs(make, error, message):
    q, k, v, _, _ = _arrays(9, SHAPES["full"])
    with pytest.raises(error, match=message):
        cuattn.sparse_attention(q, k, v, _layout(), score_bias=make(q))


def test_a_permuted_layout_is_refused_with_it():
    rng = np.random.default_rng(10)
    q = k = v = rng.standard_normal((1, HEADS, 32, HEAD_DIM))
    bias = np.zeros((32, 32))
    permuted = cuattn.make_layout("strided", 32, HEADS, BLOCK, local_attn_ctx=4)
    assert permuted.perm is not None
    with pytest.raises(ValueError, match="score_bias needs the natural token order"):
        cuattn.sparse_attention(q, k, v, permuted, score_bias=bias)


@pytest.mark.parametrize("backend", ["numpy", "interp"])
@pytest.mark.parametrize("front", ["torch", "tape"])
def test_a_bias_that_asks_no_gradient_makes_no_planes(backend, front, monkeypatch):
    """A score bias nothing differentiates (a fixed mask, a constant table) is frozen in the
    backward: its dS planes (float32 [batch, heads, time_q, time_k]) are never made, and q, k
    and v get the gradients of the same call with a bias that asks one, bit for bit."""
    from cuattn.backends import kernels, numpy_ref

    q, k, v, dout, bias = (x.astype(np.float32) for x in _arrays(9, SHAPES["one batch"]))
    layout = _layout(sparse=True)
    wrap = torch.tensor if front == "torch" else cuattn.Tensor
    planes = []

    def run(bias_grad):
        leaves = [wrap(x, requires_grad=True) for x in (q, k, v)]
        fixed = wrap(bias, requires_grad=bias_grad)
        out = cuattn.sparse_attention(*leaves, layout, score_bias=fixed, backend=backend)
        if front == "torch":
            out.backward(torch.tensor(dout))
        else:
            (out * cuattn.Tensor(dout)).sum().backward()
        grads = [np.asarray(leaf.grad) for leaf in leaves]
        return grads, fixed.grad

    def spy_grid(*args):
        planes.append("numpy_ref._score_grid")
        return score_grid(*args)

    def spy_zeroed(self, shape, dtype):
        if tuple(shape)[-2:] == (N_Q, N_K):
            planes.append(f"zeroed_output{tuple(shape)}")
        return zeroed(self, shape, dtype)

    score_grid, zeroed = numpy_ref._score_grid, kernels.KernelBackend.zeroed_output
    monkeypatch.setattr(numpy_ref, "_score_grid", spy_grid)
    monkeypatch.setattr(kernels.KernelBackend, "zeroed_output", spy_zeroed)
    learned, learned_bias_grad = run(bias_grad=True)
    assert planes and learned_bias_grad is not None  # the spies see the planes when asked
    planes.clear()
    frozen, frozen_bias_grad = run(bias_grad=False)
    assert planes == [] and frozen_bias_grad is None
    for name, a, b in zip("qkv", frozen, learned, strict=True):
        np.testing.assert_array_equal(a, b, err_msg=name)
