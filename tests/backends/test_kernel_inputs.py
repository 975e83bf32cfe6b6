"""What the kernel backends refuse before any launch, and what the kernels must survive that
the layouts never hand them (run on the CPU interpreter; the CUDA backend shares the checks)."""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import interp
from cuattn.backends.call import AttentionCall
from cuattn.backends.geometry import GRID_YZ_LIMIT
from cuattn.layout.layout import ElementRule, Layout
from cuattn.layout.original import all_layout
from tests.backends.test_interp_kernels import (
    HEADS,
    check_forward,
    random_inputs,
)


def test_misaligned_view_is_refused_naming_the_argument():
    """A contiguous view at an element offset passes every shape check, but its rows are not
    16-byte aligned: a GPU's cp.async faults on it, so the backend refuses it up front."""
    layout = all_layout(32, HEADS, 16)
    q, k, v, _ = random_inputs((1, HEADS, 32, 32), "float16", seed=1)
    flat = np.random.default_rng(2).standard_normal(q.size + 8).astype(np.float16)
    offset = next(i for i in range(1, 8) if (flat.ctypes.data + 2 * i) % 16)
    k_view = flat[offset : offset + q.size].reshape(q.shape)
    assert k_view.flags.c_contiguous and k_view.ctypes.data % 16
    before = k_view.copy()
    with pytest.raises(ValueError, match=r"k: .*16-byte.*clone\(\)"):
        interp.forward(q, k_view, v, AttentionCall(layout, 0.5))
    np.testing.assert_array_equal(k_view, before)
    out, lse = interp.forward(
        q, np.array(k_view), v, AttentionCall(layout, 0.5)
    )  # the fix the message names
    check_forward(out, lse, q, np.array(k_view), v, layout, 0.5, "float16")


@pytest.mark.parametrize("axis, name", [(0, "batch"), (1, "heads")])
def test_grid_limit_is_a_clear_error(axis, name):
    shape = [1, HEADS, 16, 32]
    shape[axis] = GRID_YZ_LIMIT + 1
    q = np.broadcast_to(np.float16(1), tuple(shape))  # no memory behind the huge shape
    with pytest.raises(ValueError, match=f"{name} = 65536 exceeds"):
        interp.forward(q, q, q, AttentionCall(all_layout(16, HEADS, 16), 0.5))


def test_a_grid_of_2_to_the_32_ctas_is_a_clear_error():
    heads = GRID_YZ_LIMIT
    q = np.broadcast_to(np.float16(1), (GRID_YZ_LIMIT, heads, 16, 32))  # each within the grid
    with pytest.raises(ValueError, match=r"65535 x 65535 x 16 reaches the kernels' limit"):
        interp.forward(q, q, q, AttentionCall(all_layout(16, heads, 16), 0.5))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_ragged_block_without_a_mask_entry(dtype):
    """A full-block entry (mask -1) on the ragged last block: the kernels must still drop the
    keys past the sequence end, from the sequence bound alone, not from a layout invariant."""
    block, head_dim = 16, 32
    n_ctx = 2 * block + 5
    layout = Layout(np.ones((HEADS, 3, 3), bool), block, n_ctx, ElementRule("none"))
    for name in ("row_mask", "col_mask"):
        array = getattr(layout, name)
        array.setflags(write=True)
        array[:] = -1
    q, k, v, _ = random_inputs((1, HEADS, n_ctx, head_dim), dtype, seed=4)
    out, lse = interp.forward(q, k, v, AttentionCall(layout, head_dim**-0.5))
    check_forward(out, lse, q, k, v, layout, head_dim**-0.5, dtype)


@pytest.mark.parametrize("dtype", ["float16", "float32"])
def test_strided_views_are_read_in_place(dtype, monkeypatch):
    """q, dout as [B, T, H, d] projections viewed as [B, H, T, d], k as a view of a fused
    [B, T, 2, H_kv, d] tensor and v at yet other strides (GQA) are read where they are, with
    no copy, and give bit for bit what their contiguous copies give."""
    batch, n, heads, kv_heads, d = 2, 40, 4, 2, 32
    rng = np.random.default_rng(7)
    numpy_dtype = np.dtype(dtype)
    q_btd = rng.standard_normal((batch, n, heads, d)).astype(numpy_dtype)
    dout_btd = rng.standard_normal((batch, n, heads, d)).astype(numpy_dtype)
    kv_fused = rng.standard_normal((batch, n, 2, kv_heads, d)).astype(numpy_dtype)
    v_wide = rng.standard_normal((batch, kv_heads, n, 2 * d)).astype(numpy_dtype)
    q, dout = (x.transpose(0, 2, 1, 3) for x in (q_btd, dout_btd))
    k = kv_fused[:, :, 0].transpose(0, 2, 1, 3)
    v = v_wide[..., d:]  # rows 2 d apart, starting at an offset of d elements
    assert not any(x.flags.c_contiguous for x in (q, k, v, dout))
    assert k.strides != v.strides
    layout = all_layout(n, heads, 16)
    contiguous = [np.ascontiguousarray(x) for x in (q, k, v, dout)]
    call = AttentionCall(layout, 0.3)
    want_out, want_lse = interp.forward(*contiguous[:3], call)
    want = interp.backward(*contiguous[:3], want_out, want_lse, contiguous[3], None, call)

    def no_copy(x, *args, **kwargs):
        raise AssertionError("a kernel input was copied")

    monkeypatch.setattr(
        np, "ascontiguousarray", lambda x, *a, **k: x if x.flags.c_contiguous else no_copy(x)
    )
    out, lse = interp.forward(q, k, v, AttentionCall(layout, 0.3))
    np.testing.assert_array_equal(out, want_out)
    np.testing.assert_array_equal(lse, want_lse)
    grads = interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.3))
    for got, ref in zip(grads, want, strict=True):
        np.testing.assert_array_equal(got, ref)


def test_strides_the_kernels_cannot_read_are_refused():
    """Rows not 16-byte aligned (a slice of a wider head dim) or a non-contiguous last axis: a
    ValueError naming the argument before any launch, the inputs untouched."""
    rng = np.random.default_rng(8)
    layout = all_layout(32, HEADS, 16)
    q, k, v, dout = random_inputs((1, HEADS, 32, 32), "float32", seed=3)
    wide = rng.standard_normal((1, HEADS, 32, 33)).astype(np.float32)
    sliced = wide[..., :32]  # rows 132 bytes apart
    before = wide.copy()
    with pytest.raises(ValueError, match=r"k: strides \(2112, 1056, 33, 1\) .*16 bytes"):
        interp.forward(q, sliced, v, AttentionCall(layout, 0.5))
    np.testing.assert_array_equal(wide, before)
    every_other = rng.standard_normal((1, HEADS, 32, 64)).astype(np.float32)[..., ::2]
    with pytest.raises(ValueError, match=r"q: strides .* last axis contiguous"):
        interp.forward(every_other, k, v, AttentionCall(layout, 0.5))
    out, lse = interp.forward(q, k, v, AttentionCall(layout, 0.5))
    with pytest.raises(ValueError, match=r"dout: strides .*contiguous\(\)"):
        interp.backward(q, k, v, out, lse, sliced, None, AttentionCall(layout, 0.5))
