"""The NumPy backend (forward and backward) against the dense float64 oracle, every pattern."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuattn
from cuattn import backends as be
from cuattn.backends.call import AttentionCall
from tests.helpers.oracle import GRAD_FLOOR, dense_attention, dense_attention_grads, rel_err

TOL = {np.float64: 1e-12, np.float32: 2e-5, np.float16: 1e-2}

PATTERNS = [
    ("all", {}),
    ("local", {"local_attn_ctx": 24}),
    ("strided", {"local_attn_ctx": 8}),
    ("strided", {"local_attn_ctx": 8, "transpose": False}),
    ("fixed", {"local_attn_ctx": 64, "num_verts": 2, "vertsize": 1}),
    ("longformer", {"local_attn_ctx": 12, "global_tokens": (0, 33)}),
    ("bigbird", {"num_random_blocks": 1}),
    ("variable", {"local_window_blocks": (2, 3), "num_random_blocks": 1}),
]


def _inputs(rng, shape, dtype):
    return [rng.standard_normal(shape).astype(dtype) for _ in range(3)]


def _check(layout, dtype, rng, batch=2, head_dim=16):
    shape = (batch, layout.heads, layout.n_ctx, head_dim)
    q, k, v = _inputs(rng, shape, dtype)
    dout = rng.standard_normal(shape).astype(dtype)
    scale = 1 / np.sqrt(head_dim)
    mask = layout.to_mask()
    out, lse = be.forward(q, k, v, AttentionCall(layout, scale, backend="numpy"))
    ref_out, ref_lse = dense_attention(q, k, v, mask, scale)
    assert out.dtype == dtype and out.shape == shape and not np.isnan(out).any()
    tol = TOL[dtype]
    assert rel_err(out, ref_out) < tol
    finite = np.isfinite(ref_lse)
    np.testing.assert_array_equal(np.isfinite(lse), finite)
    assert rel_err(lse[finite], ref_lse[finite]) < tol
    grads = be.backward(
        q, k, v, out, lse, dout, None, AttentionCall(layout, scale, backend="numpy")
    )
    for g, ref in zip(grads, dense_attention_grads(q, k, v, dout, mask, scale), strict=True):
        assert g.dtype == dtype and not np.isnan(g).any()
        assert rel_err(g, ref, GRAD_FLOOR) < tol


@pytest.mark.parametrize("mode,kw", PATTERNS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n,b", [(128, 16), (100, 16), (96, 32)])
def test_patterns_forward_backward_float64(mode, kw, causal, n, b):
    lay = cuattn.make_layout(mode, n, 2, blocksize=b, causal=causal, **kw)
    _check(lay, np.float64, np.random.default_rng(n + b))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("mode,kw", PATTERNS)
def test_patterns_low_precision(mode, kw, dtype):
    lay = cuattn.make_layout(mode, 128, 2, blocksize=16, **kw)
    _check(lay, dtype, np.random.default_rng(1))


def test_float16_error_is_within_twice_a_dense_float16_computation():
    rng = np.random.default_rng(3)
    lay = cuattn.make_layout("all", 128, 2, blocksize=16)
    q, k, v = _inputs(rng, (1, 2, 128, 32), np.float16)
    out = cuattn.sparse_attention(q, k, v, lay)
    ref, _ = dense_attention(q, k, v, lay.to_mask(), 1 / np.sqrt(32))
    ref16, _ = dense_attention(q, k, v, lay.to_mask(), 1 / np.sqrt(32))
    dense16 = ref16.astype(np.float16)  # the best a float16 result can be
    assert rel_err(out, ref) <= max(2 * rel_err(dense16, ref), 1e-3)


def test_rows_with_nothing_to_attend_give_zero_and_minus_inf():
    blocks = np.zeros((1, 4, 4), bool)
    blocks[0, 1:, 0] = True  # block row 0 has no active block at all

    def rule(h, q, k):
        return (k <= q) & (q != 20)  # query 20 is masked out of its only block

    lay = cuattn.Layout.from_blocks(blocks, 16, mask_fn=rule)
    _check(lay, np.float64, np.random.default_rng(0))
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, (1, 1, 64, 8), np.float32)
    out, lse = cuattn.sparse_attention(q, k, v, lay, return_lse=True)
    assert (out[0, 0, :16] == 0).all() and (out[0, 0, 20] == 0).all()
    assert np.isneginf(lse[0, 0, :16]).all() and np.isneginf(lse[0, 0, 20])
    assert np.isfinite(lse[0, 0, 16:20]).all()


@st.composite
def random_layouts(draw):
    b = draw(st.sampled_from([4, 8, 16]))
    nb = draw(st.integers(1, 5))
    n = draw(st.integers((nb - 1) * b + 1, nb * b))
    heads = draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    blocks = rng.random((heads, nb, nb)) < draw(st.floats(0.1, 1.0))
    kind = draw(st.sampled_from(["none", "fn"]))
    if kind == "none":
        return cuattn.Layout.from_blocks(blocks, b, n_ctx=n)
    table = rng.random((heads, nb * b, nb * b)) < 0.7

    def rule(h, q, k):
        return table[h, q, k]

    return cuattn.Layout.from_blocks(blocks, b, mask_fn=rule, n_ctx=n)


@settings(max_examples=60, deadline=None)
@given(random_layouts(), st.sampled_from([np.float64, np.float32]))
def test_random_layouts_against_oracle(layout, dtype):
    _check(layout, dtype, np.random.default_rng(0), batch=1, head_dim=8)
