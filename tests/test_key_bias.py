"""``key_bias=`` on ``sparse_attention`` through NumPy arrays, torch autograd (eager, with
recompute, and compiled), jax (eager, jit, grad), the tape and blocksparse_attention, alone and
with a softcap and ALiBi; every gradient (q, k, v and the bias) against the dense float64 oracle
with the bias; a -inf padding mask equals attention over the unpadded keys; argument checks.
Kernel-level tests: tests/backends/test_key_bias.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn.tools.oracle import alibi_bias, dense_attention, dense_attention_grads, rel_err

SOFTCAP = 1.5
HEADS, KV_HEADS, N_Q, N_K, HEAD_DIM, BLOCK = 4, 2, 40, 56, 16, 8
RTOL = 1e-10  # float64 through the NumPy backend against the float64 oracle
BIAS_RTOL = 1e-6  # the bias's gradient comes back in float32, as the bias


def _arrays(seed, per_head=False):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, HEADS, N_Q, HEAD_DIM)) * 2
    k, v = (rng.standard_normal((2, KV_HEADS, N_K, HEAD_DIM)) * 2 for _ in range(2))
    dout = rng.standard_normal(q.shape)
    key_bias = (rng.standard_normal((2, HEADS, N_K) if per_head else (2, N_K)) * 2).astype(
        np.float32
    )
    key_bias[1, ..., -5:] = -np.inf  # batch 1's last keys are padding
    return q, k, v, dout, key_bias


def _layout():
    return cuattn.make_layout("all", N_K, HEADS, BLOCK, causal=True, n_q=N_Q)


def _oracle(q, k, v, dout, key_bias, layout, softcap=0.0, slopes=None):
    mask = layout.to_mask()
    kb = key_bias.astype(np.float64)
    bias = (kb if kb.ndim == 3 else kb[:, None, :])[:, :, None, :]
    if slopes is not None:
        bias = bias + alibi_bias(slopes, q.shape[0], N_Q, N_K)
    scale = HEAD_DIM**-0.5
    out, lse = dense_attention(q, k, v, mask, scale, softcap=softcap, bias=bias)
    *grads, dbias = dense_attention_grads(q, k, v, dout, mask, scale, softcap=softcap, bias=bias)
    dkey = dbias.sum(axis=2)
    return out, lse, grads, dkey if key_bias.ndim == 3 else dkey.sum(axis=1)


@pytest.mark.parametrize("per_head", [False, True])
def test_numpy_arrays_forward_and_lse(per_head):
    q, k, v, dout, key_bias = _arrays(0, per_head)
    layout = _layout()
    out, lse = cuattn.sparse_attention(q, k, v, layout, return_lse=True, key_bias=key_bias)
    ref_out, ref_lse, _, _ = _oracle(q, k, v, dout, key_bias, layout)
    assert rel_err(out, ref_out) <= RTOL and rel_err(lse, ref_lse) <= RTOL


def test_a_padding_mask_equals_attention_over_the_unpadded_keys():
    """-inf on a sequence's padded keys (as a model's key padding mask): exactly the attention
    over its real keys, as if the padding were not there."""
    q, k, v, _, _ = _arrays(1)
    real = [N_K, N_K - 9]
    key_bias = np.zeros((2, N_K), np.float32)
    key_bias[1, real[1] :] = -np.inf
    layout = cuattn.make_layout("all", N_K, HEADS, BLOCK, causal=False, n_q=N_Q)
    out = cuattn.sparse_attention(q, k, v, layout, key_bias=key_bias)
    for b, n in enumerate(real):
        short = cuattn.make_layout("all", n, HEADS, BLOCK, causal=False, n_q=N_Q)
        alone = cuattn.sparse_attention(
            q[b : b + 1], k[b : b + 1, :, :n], v[b : b + 1, :, :n], short
        )
        np.testing.assert_allclose(out[b : b + 1], alone, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("per_head", [False, True])
def test_torch_autograd_reaches_the_key_bias(recompute, per_head):
    q, k, v, dout, key_bias = _arrays(2, per_head)
    layout = _layout()
    slopes = cuattn.alibi_slopes(HEADS)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v, key_bias)]
    out = cuattn.sparse_attention(
        *leaves[:3],
        layout,
        recompute=recompute,
        softcap=SOFTCAP,
        alibi_slopes=torch.from_numpy(slopes),
        key_bias=leaves[3],
    )
    out.backward(torch.tensor(dout))
    ref_out, _, refs, ref_dkey = _oracle(q, k, v, dout, key_bias, layout, SOFTCAP, slopes)
    assert rel_err(out.detach().numpy(), ref_out) <= RTOL
    for name, leaf, ref in zip("qkv", leaves[:3], refs, strict=True):
        assert rel_err(leaf.grad.numpy(), ref) <= RTOL, name
    grad = leaves[3].grad
    assert grad.dtype == torch.float32 and not grad.isnan().any()
    assert rel_err(grad.numpy(), ref_dkey) <= BIAS_RTOL


def test_torch_compile_fullgraph_equals_eager():
    q, k, v, _, key_bias = _arrays(3)
    layout = _layout()
    tensors = [torch.tensor(x) for x in (q, k, v, key_bias)]

    def fn(q, k, v, key_bias):
        return cuattn.sparse_attention(q, k, v, layout, key_bias=key_bias)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    np.testing.assert_array_equal(compiled(*tensors).numpy(), fn(*tensors).numpy())


def test_tape_gradients_reach_the_key_bias():
    q, k, v, dout, key_bias = _arrays(4, per_head=True)
    layout = _layout()
    leaves = [cuattn.Tensor(x, requires_grad=True) for x in (q, k, v, key_bias)]
    out = cuattn.sparse_attention(*leaves[:3], layout, key_bias=leaves[3])
    (out * cuattn.Tensor(dout)).sum().backward()
    _, _, refs, ref_dkey = _oracle(q, k, v, dout, key_bias, layout)
    for name, leaf, ref in zip("qkv", leaves, refs, strict=False):
        assert rel_err(leaf.grad, ref) <= RTOL, name
    assert rel_err(leaves[3].grad, ref_dkey) <= BIAS_RTOL


@pytest.mark.parametrize("per_head", [False, True])
def test_jax_eager_jit_and_grad_reach_the_key_bias(per_head):
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, dout, key_bias = _arrays(5, per_head)
    layout = _layout()
    slopes = cuattn.alibi_slopes(HEADS)
    ref_out, _, refs, ref_dkey = _oracle(q, k, v, dout, key_bias, layout, SOFTCAP, slopes)
    arrays = [jax.numpy.asarray(x) for x in (q, k, v, key_bias)]
    slopes_j = jax.numpy.asarray(slopes)

    def attend(q, k, v, key_bias):
        kw = dict(softcap=SOFTCAP, alibi_slopes=slopes_j, key_bias=key_bias)
        return cuattn.sparse_attention(q, k, v, layout, **kw)

    assert rel_err(np.asarray(attend(*arrays)), ref_out) <= RTOL
    grad = jax.grad(lambda *a: (attend(*a) * dout).sum(), argnums=(0, 1, 2, 3))
    for fn in (grad, jax.jit(grad)):
        *grads, dkey = fn(*arrays)
        for name, g, ref in zip("qkv", grads, refs, strict=True):
            assert rel_err(np.asarray(g), ref) <= RTOL, name
        assert rel_err(np.asarray(dkey), ref_dkey) <= BIAS_RTOL


def test_blocksparse_attention_takes_a_key_bias():
    q, k, v, _, key_bias = _arrays(6)
    heads_last = [x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1) for x in (q, k, v)]
    out = cuattn.blocksparse_attention(
        *heads_last, HEADS, "all", blocksize=BLOCK, kv_heads=KV_HEADS, key_bias=key_bias
    )
    want = cuattn.sparse_attention(q, k, v, _layout(), key_bias=key_bias)
    np.testing.assert_allclose(out, cuattn.merge_heads(want), rtol=1e-12, atol=0)


@pytest.mark.parametrize(
    ("key_bias", "error", "message"),
    [
        ([0.0] * N_K, TypeError, "key_bias must be a float32 array"),
        (np.zeros((2, N_K), np.float16), TypeError, "key_bias must be float32"),
        (np.zeros((2, N_K + 1), np.float32), ValueError, r"\[batch, time_k\] = \(2, 56\)"),
        (np.zeros((2, N_Q, N_K), np.float32), ValueError, r"O\(T\^2\), which cuattn never"),
        (torch.zeros(2, N_K), TypeError, "key_bias is a torch.Tensor but q is"),
    ],
)
def test_bad_key_bias_is_refused_before_anything_runs(key_bias, error, message):
    q, k, v, _, _ = _arrays(7)
    with pytest.raises(error, match=message):
        cuattn.sparse_attention(q, k, v, _layout(), key_bias=key_bias)


@pytest.mark.parametrize("per_head", [False, True])
def test_varlen_equals_each_sequence_alone(per_head):
    """A packed key bias [total_k] (or [heads, total_k]): each sequence gets its own keys'."""
    rng = np.random.default_rng(8)
    cu_q, cu_k = np.array([0, 17, 17, 40]), np.array([0, 23, 30, 56])
    q = rng.standard_normal((int(cu_q[-1]), HEADS, HEAD_DIM))
    k, v = (rng.standard_normal((int(cu_k[-1]), KV_HEADS, HEAD_DIM)) for _ in range(2))
    key_bias = (rng.standard_normal((HEADS, 56) if per_head else (56,)) * 2).astype(np.float32)
    key_bias[..., 20:23] = -np.inf  # the first sequence's last keys are padding

    def layout(n_q, n_k):
        return cuattn.make_layout("all", n_k, HEADS, BLOCK, n_q=n_q)

    out = cuattn.sparse_attention_varlen(q, k, v, cu_q, cu_k, layout, key_bias=key_bias)
    for s in range(len(cu_q) - 1):
        (a, b), (c, d) = cu_q[s : s + 2], cu_k[s : s + 2]
        if a == b or c == d:
            continue
        one = [x.transpose(1, 0, 2)[None] for x in (q[a:b], k[c:d], v[c:d])]
        alone = cuattn.sparse_attention(
            *one, layout(b - a, d - c), key_bias=np.ascontiguousarray(key_bias[..., c:d])[None]
        )
        np.testing.assert_allclose(out[a:b], alone[0].transpose(1, 0, 2), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match=r"key_bias of a varlen call must have shape \[total_k\]"):
        cuattn.sparse_attention_varlen(q, k, v, cu_q, cu_k, layout, key_bias=key_bias[None])
