"""``rel_bias=`` (a learned relative-position table) on ``sparse_attention``: NumPy arrays
against the dense float64 oracle with the table's bias, varlen, T5's bucketed bias
(transformers' own) through a table, argument checks. The fronts (torch autograd and compile,
jax, the tape, blocksparse_attention): tests/test_operand_fronts.py, with this module's arrays
and oracle. Kernel-level tests: tests/backends/test_rel_bias.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn.tools.oracle import (
    alibi_bias,
    dense_attention,
    dense_attention_grads,
    rel_err,
    rel_position_bias,
    rel_table_gradient,
)
from tests.helpers.score_operands import attention_inputs

SOFTCAP = 1.5
HEADS, KV_HEADS, N_Q, N_K, HEAD_DIM, BLOCK = 4, 2, 40, 56, 16, 8
MAX_DISTANCE = 12  # most pairs of 56 keys are further apart: the end columns sum many
RTOL = 1e-10  # float64 through the NumPy backend against the float64 oracle
TABLE_RTOL = 1e-6  # the table's gradient comes back in float32, as the table


def _arrays(seed, per_batch=False):
    rng = np.random.default_rng(seed)
    q, k, v, dout = attention_inputs(rng, HEADS, KV_HEADS, N_Q, N_K, HEAD_DIM)
    width = 2 * MAX_DISTANCE + 1
    shape = (2, HEADS, width) if per_batch else (HEADS, width)
    table = (rng.standard_normal(shape) * 2).astype(np.float32)
    return q, k, v, dout, table


def _layout():
    return cuattn.make_layout("all", N_K, HEADS, BLOCK, causal=True, n_q=N_Q)


def _oracle(q, k, v, dout, table, layout, softcap=0.0, slopes=None):
    mask = layout.to_mask()
    bias = rel_position_bias(table, q.shape[0], N_Q, N_K)
    if slopes is not None:
        bias = bias + alibi_bias(slopes, q.shape[0], N_Q, N_K)
    scale = HEAD_DIM**-0.5
    out, lse = dense_attention(q, k, v, mask, scale, softcap=softcap, bias=bias)
    *grads, dbias = dense_attention_grads(q, k, v, dout, mask, scale, softcap=softcap, bias=bias)
    dtable = rel_table_gradient(dbias, MAX_DISTANCE, per_batch=table.ndim == 3)
    return out, lse, grads, dtable


@pytest.mark.parametrize("per_batch", [False, True])
def test_numpy_arrays_forward_and_lse(per_batch):
    q, k, v, dout, table = _arrays(0, per_batch)
    layout = _layout()
    out, lse = cuattn.sparse_attention(q, k, v, layout, return_lse=True, rel_bias=table)
    ref_out, ref_lse, _, _ = _oracle(q, k, v, dout, table, layout)
    assert rel_err(out, ref_out) <= RTOL and rel_err(lse, ref_lse) <= RTOL
    plain = cuattn.sparse_attention(q, k, v, layout)
    assert rel_err(plain, ref_out) > 1e-2  # the table matters


def test_varlen_equals_each_sequence_alone():
    """Each packed sequence gets its own distances (cu_seqlens_q equal to cu_seqlens_k)."""
    rng = np.random.default_rng(8)
    cu = np.array([0, 17, 17, 40, 56])
    q = rng.standard_normal((56, HEADS, HEAD_DIM))
    k, v = (rng.standard_normal((56, KV_HEADS, HEAD_DIM)) for _ in range(2))
    table = (rng.standard_normal((HEADS, 2 * 5 + 1)) * 2).astype(np.float32)

    def layout(n_q, n_k):
        return cuattn.make_layout("all", n_k, HEADS, BLOCK, causal=True, n_q=n_q)

    out = cuattn.sparse_attention_varlen(q, k, v, cu, cu, layout, rel_bias=table)
    for s in range(len(cu) - 1):
        a, b = cu[s : s + 2]
        if a == b:
            continue
        one = [x[a:b].transpose(1, 0, 2)[None] for x in (q, k, v)]
        alone = cuattn.sparse_attention(*one, layout(b - a, b - a), rel_bias=table)
        np.testing.assert_allclose(out[a:b], alone[0].transpose(1, 0, 2), rtol=1e-12, atol=1e-14)
    with pytest.raises(ValueError, match="rel_bias with sparse_attention_varlen needs cu_seqlens"):
        cuattn.sparse_attention_varlen(
            q, k, v, cu, np.array([0, 17, 20, 40, 56]), layout, rel_bias=table
        )
    with pytest.raises(ValueError, match=r"rel_bias of a varlen call must have shape \[heads"):
        cuattn.sparse_attention_varlen(q, k, v, cu, cu, layout, rel_bias=table[None])


def _t5_bucket(rel: torch.Tensor, bidirectional: bool, buckets: int, max_distance: int):
    """transformers' T5 bucket of each relative position k_pos - q_pos in ``rel``."""
    from transformers.models.t5.modeling_t5 import T5Attention

    return T5Attention._relative_position_bucket(rel, bidirectional, buckets, max_distance)


@pytest.mark.parametrize("bidirectional", [True, False])
def test_t5_bucketed_bias_is_a_table_of_its_buckets(bidirectional):
    """T5's bias: an embedding of 32 buckets per head, looked up by the bucket of k_pos - q_pos
    (every distance past max_distance shares the last bucket). Gathered into a table of
    2 * max_distance + 1 columns it is exactly transformers' bias, and the embedding's gradient
    comes back through the gather (torch autograd)."""
    pytest.importorskip("transformers")
    buckets, max_distance, n = 32, 20, 56
    t5 = (bidirectional, buckets, max_distance)
    rng = np.random.default_rng(9)
    embedding = torch.tensor(rng.standard_normal((buckets, HEADS)), requires_grad=True)
    q, k, v = (torch.tensor(rng.standard_normal((2, HEADS, n, HEAD_DIM))) for _ in range(3))
    dout = torch.tensor(rng.standard_normal(q.shape))
    # column c of the table is the distance c - max_distance: its bucket's biases
    columns = _t5_bucket(torch.arange(-max_distance, max_distance + 1), *t5)
    table = embedding[columns].T  # [heads, 2 * max_distance + 1]
    causal = not bidirectional
    layout = cuattn.make_layout("all", n, HEADS, BLOCK, causal=causal)
    out = cuattn.sparse_attention(q, k, v, layout, scale=1.0, rel_bias=table)
    (grad,) = torch.autograd.grad((out * dout).sum(), embedding)
    # transformers' own bias: every (query, key) looked up, T5's score (no scaling)
    t5_embedding = embedding.detach().clone().requires_grad_(True)
    rel = torch.arange(n)[None, :] - torch.arange(n)[:, None]
    bias = t5_embedding[_t5_bucket(rel, *t5)].permute(2, 0, 1)
    mask = torch.from_numpy(layout.to_mask())
    scores = torch.where(mask, q @ k.transpose(-1, -2) + bias, -torch.inf)
    want = torch.softmax(scores, dim=-1) @ v
    (want_grad,) = torch.autograd.grad((want * dout).sum(), t5_embedding)
    assert rel_err(out.detach().numpy(), want.detach().numpy()) <= RTOL
    assert rel_err(grad.numpy(), want_grad.numpy()) <= RTOL


@pytest.mark.parametrize(
    ("table", "error", "message"),
    [
        ([0.0] * 9, TypeError, "rel_bias must be a float32 array"),
        (np.zeros((HEADS, 9), np.float16), TypeError, "rel_bias must be float32"),
        (np.zeros((HEADS, 8), np.float32), ValueError, r"\(4, odd\)"),
        (np.zeros((HEADS + 1, 9), np.float32), ValueError, r"\[heads, 2 \* max_distance \+ 1\]"),
        (torch.zeros(HEADS, 9), TypeError, "rel_bias is a torch.Tensor but q is"),
    ],
)
def test_bad_table_is_refused_before_anything_runs(table, error, message):
    q, k, v, _, _ = _arrays(7)
    with pytest.raises(error, match=message):
        cuattn.sparse_attention(q, k, v, _layout(), rel_bias=table)
