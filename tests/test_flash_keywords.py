"""``sparse_attention`` without a layout: FlashAttention's ``causal=`` and ``window_size=``
(the ``window`` pattern), against masks written from FlashAttention's own definition: query i
of n_q, at position p = i + n_k - n_q, sees keys p - left .. p + right (-1: no limit), and
causal makes right 0."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import cuattn
from cuattn.tools.oracle import dense_attention, rel_err

HEADS, HEAD_DIM = 2, 16
RTOL = 1e-12  # float64, the NumPy backend against the float64 oracle
INTERP_RTOL = 1e-5  # float32 kernels on the interpreter


def flash_mask(n_q, n_k, causal, window_size):
    left, right = window_size
    right = 0 if causal else right
    pos = np.arange(n_q)[:, None] + n_k - n_q
    key = np.arange(n_k)[None, :]
    allowed = np.ones((n_q, n_k), bool)
    if left >= 0:
        allowed &= key >= pos - left
    if right >= 0:
        allowed &= key <= pos + right
    return np.broadcast_to(allowed, (HEADS, n_q, n_k))


def _qkv(n_q, n_k, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, HEADS, n_q, HEAD_DIM)).astype(dtype)
    k, v = (rng.standard_normal((2, HEADS, n_k, HEAD_DIM)).astype(dtype) for _ in range(2))
    return q, k, v


CASES = [
    (False, None),
    (True, None),
    (True, (20, 7)),  # causal ignores the right side, as FlashAttention
    (False, (20, 7)),
    (False, (5, -1)),
    (False, (-1, 3)),
    (False, (0, 0)),  # only the query's own position
    (True, (-1, -1)),
]


@pytest.mark.parametrize(("causal", "window_size"), CASES)
@pytest.mark.parametrize(("n_q", "n_k"), [(150, 150), (40, 150)])
def test_numpy_matches_flash_attention_masks(causal, window_size, n_q, n_k):
    q, k, v = _qkv(n_q, n_k)
    out, lse = cuattn.sparse_attention(
        q, k, v, causal=causal, window_size=window_size, return_lse=True
    )
    mask = flash_mask(n_q, n_k, causal, window_size or (-1, -1))
    ref_out, ref_lse = dense_attention(q, k, v, mask, HEAD_DIM**-0.5)
    assert rel_err(out, ref_out) <= RTOL and rel_err(lse, ref_lse) <= RTOL


def test_no_layout_and_no_keywords_is_full_attention():
    q, k, v = _qkv(30, 50)
    out = cuattn.sparse_attention(q, k, v)
    ref, _ = dense_attention(q, k, v, np.ones((HEADS, 30, 50), bool), HEAD_DIM**-0.5)
    assert rel_err(out, ref) <= RTOL


@pytest.mark.parametrize(("causal", "window_size"), [(False, (20, 7)), (True, (33, 0))])
def test_interpreter_kernels(causal, window_size):
    q, k, v = _qkv(90, 150, seed=1, dtype=np.float32)
    out = cuattn.sparse_attention(q, k, v, causal=causal, window_size=window_size, backend="interp")
    ref, _ = dense_attention(q, k, v, flash_mask(90, 150, causal, window_size), HEAD_DIM**-0.5)
    assert rel_err(out, ref) <= INTERP_RTOL


def test_torch_gradients_and_compile_keep_the_length_dynamic():
    def loss(q, k, v):
        out = cuattn.sparse_attention(q, k, v, causal=True, window_size=(24, 0), softcap=5.0)
        return (out * out).sum()

    counter = CompileCounter()
    compiled = torch.compile(loss, backend=counter, fullgraph=True)
    for n in (96, 160):
        q, k, v = (torch.tensor(x, requires_grad=True) for x in _qkv(n, n, seed=n))
        for x in (q, k, v):
            torch._dynamo.mark_dynamic(x, 2)
        compiled(q, k, v).backward()
        leaves = [torch.tensor(x.detach().numpy(), requires_grad=True) for x in (q, k, v)]
        loss(*leaves).backward()
        for name, a, b in zip("qkv", (q, k, v), leaves, strict=True):
            assert rel_err(a.grad.numpy(), b.grad.numpy()) <= RTOL, name
    assert counter.frame_count == 1  # one graph for both lengths


def test_window_pattern_by_name():
    layout = cuattn.make_layout(
        "window", 64, HEADS, 16, causal=False, window_left=9, window_right=4
    )
    np.testing.assert_array_equal(layout.to_mask(), flash_mask(64, 64, False, (9, 4)))
    with pytest.raises(ValueError, match="window_right=4 looks past the query"):
        cuattn.make_layout("window", 64, HEADS, 16, window_left=9, window_right=4)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(causal=1), TypeError, "causal must be a bool, got int 1"),
        (dict(window_size=(3,)), TypeError, r"window_size must be a pair of ints.*\(3,\)"),
        (dict(window_size=(3.0, 1)), TypeError, "window_size must be a pair of ints"),
        (dict(window_size="3,1"), TypeError, "window_size must be a pair of ints"),
        (dict(window_size=(-2, 1)), ValueError, r"window_size sides must be >= 0.*\(-2, 1\)"),
    ],
)
def test_bad_keywords_are_refused_by_name(kwargs, error, message):
    q, k, v = _qkv(8, 8)
    with pytest.raises(error, match=message):
        cuattn.sparse_attention(q, k, v, **kwargs)


def test_a_layout_and_the_keywords_together_are_refused():
    q, k, v = _qkv(64, 64)
    layout = cuattn.make_layout("all", 64, HEADS, 16)
    for kwargs in (dict(causal=True), dict(window_size=(4, 0)), dict(causal=False)):
        with pytest.raises(ValueError, match="pass one or the other"):
            cuattn.sparse_attention(q, k, v, layout, **kwargs)
