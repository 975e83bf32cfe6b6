"""``key_bias=`` on ``sparse_attention``: NumPy arrays against the dense float64 oracle with
the bias, a -inf padding mask equals attention over the unpadded keys, varlen, argument checks.
The fronts (torch autograd and compile, jax, the tape, blocksparse_attention):
tests/test_operand_fronts.py, with this module's arrays and oracle. Kernel-level tests:
tests/backends/test_key_bias.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn.tools.oracle import alibi_bias, dense_attention, dense_attention_grads, rel_err
from tests.helpers.score_operands import attention_inputs

SOFTCAP = 1.5
HEADS, KV_HEADS, N_Q, N_K, HEAD_DIM, BLOCK = 4, 2, 40, 56, 16, 8
RTOL = 1e-10  # float64 through the NumPy backend against the float64 oracle
BIAS_RTOL = 1e-6  # the bias's gradient comes back in float32, as the bias


def _arrays(seed, per_head=False):
    rng = np.random.default_rng(seed)
    q, k, v, dout = attention_inputs(rng, HEADS, KV_HEADS, N_Q, N_K, HEAD_DIM)
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
