"""Every kernel instantiation (block x head_dim x dtype x rule) through the CPU interpreter,
forward and backward, against the float64 dense oracle: the head dims below WIDE_HEAD_DIM here,
the wide ones (most of the time) in test_interp_kernels_wide.py, so that two test workers share
the grid; each file builds only the kernel libraries of its own head dims.

Shapes are small on purpose (the interpreter runs one host thread per CUDA thread): two layout
blocks per side with a ragged last block of at most 17 rows, two heads, and layouts that
contain a query row with nothing to attend and a key block no query attends to. Outputs are
NaN-poisoned before launch.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cuattn.backends import geometry, interp, kernels
from cuattn.backends.call import AttentionCall
from cuattn.layout.layout import ElementRule, Layout
from cuattn.layout.original import all_layout, local_layout
from tests.helpers.oracle import GRAD_FLOOR, dense_attention, dense_attention_grads, rel_err

ml_dtypes = pytest.importorskip("ml_dtypes")

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
# max |x - ref| / max |ref| against float64
TOLERANCE = {"float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}
HEADS = 2
RAGGED_ROWS_MAX = 17
WIDE_HEAD_DIM = 128  # from here on, in test_interp_kernels_wide.py


def is_wide(config) -> bool:
    """Whether an instantiation belongs to the wide file (layout kernels have no head dim)."""
    return getattr(config, "head_dim", 0) >= WIDE_HEAD_DIM


def is_plain(config) -> bool:
    """Whether an instantiation is a plain kernel (the score-modifier variants are tested, and
    their libraries built, in tests/backends/test_score_mods.py)."""
    return not getattr(config, "mods", False)


def n_ctx_for(block: int) -> int:
    """Two layout blocks, the second ragged: half a block and one row, at most 17 rows (a
    partial tile that crosses a 16-row fragment boundary; more rows prove nothing more, and the
    interpreter's time grows with them)."""
    return block + min(block // 2 + 1, RAGGED_ROWS_MAX)


def bitmask_fn(h, q, k):
    # query 3 sees nothing at all; the rest is an irregular pattern that differs per head
    return (q != 3) & ((q * 7 + k * 3 + h) % 5 != 0)


def make_test_layout(rule: str, block: int, n_ctx: int) -> Layout:
    nb = -(-n_ctx // block)
    if rule == "none":
        # head 1: query block 0 attends to nothing, key block 1 is attended by nobody
        blocks = np.array([[[1, 1], [0, 1]], [[0, 0], [1, 0]]], dtype=bool)
        return Layout(blocks, block, n_ctx, ElementRule("none"))
    if rule == "causal":
        return all_layout(n_ctx, HEADS, block, causal=True)
    if rule == "window":
        return local_layout(n_ctx, HEADS, block, block // 2 + 3, causal=False)
    return Layout.from_blocks(np.ones((HEADS, nb, nb), bool), block, bitmask_fn, n_ctx=n_ctx)


def forced_pairing(paired: bool = True):
    """Run the forward in paired CTAs (or not) whatever the layout's own choice."""
    return mock.patch.object(kernels, "layout_pairs_rows", lambda layout: paired)


def random_inputs(shape, dtype: str, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(NUMPY_DTYPES[dtype]) for _ in range(4)]


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Compile this file's kernel libraries up front, every core at once (a no-op once cached)."""
    interp.prepare(c for c in geometry.all_configs() if not is_wide(c) and is_plain(c))


def check_forward(out, lse, q, k, v, layout, scale, dtype):
    mask = layout.to_mask()
    ref_out, ref_lse = dense_attention(q, k, v, mask, scale)
    assert not np.isnan(out.astype(np.float32)).any(), "forward left poisoned outputs"
    empty = ~mask.any(axis=-1)[None].repeat(q.shape[0], axis=0)
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert not np.isnan(lse).any()
    assert (out.astype(np.float32)[empty] == 0).all()
    assert rel_err(out, ref_out) <= TOLERANCE[dtype]
    assert rel_err(lse[~empty], ref_lse[~empty]) <= TOLERANCE[dtype]


def run_forward_backward(block: int, head_dim: int, dtype: str, rule: str) -> None:
    """One instantiation's forward and backward on the grid's case against the oracle."""
    n_ctx = n_ctx_for(block)
    layout = make_test_layout(rule, block, n_ctx)
    q, k, v, dout = random_inputs((1, HEADS, n_ctx, head_dim), dtype, seed=block + head_dim)
    scale = head_dim**-0.5

    out, lse = interp.forward(q, k, v, AttentionCall(layout, scale))
    check_forward(out, lse, q, k, v, layout, scale, dtype)
    if geometry.pairs_rows("attn_fwd", block, head_dim, dtype):
        # the paired forward instantiation too (these layouts are too short to choose it)
        with forced_pairing():
            paired = interp.forward(q, k, v, AttentionCall(layout, scale))
        check_forward(*paired, q, k, v, layout, scale, dtype)

    refs = dense_attention_grads(q, k, v, dout, layout.to_mask(), scale)
    grads = interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, scale))
    for name, grad, ref in zip("qkv", grads, refs, strict=True):
        assert not np.isnan(grad.astype(np.float32)).any(), f"d{name} left poisoned"
        assert rel_err(grad, ref) <= TOLERANCE[dtype], f"d{name}"


@pytest.mark.parametrize("rule", geometry.RULES)
@pytest.mark.parametrize("dtype", geometry.DTYPES)
@pytest.mark.parametrize("head_dim", [d for d in geometry.HEAD_DIMS if d < WIDE_HEAD_DIM])
@pytest.mark.parametrize("block", geometry.BLOCK_SIZES)
def test_forward_backward(block, head_dim, dtype, rule):
    run_forward_backward(block, head_dim, dtype, rule)


@pytest.mark.parametrize("dtype", geometry.DTYPES)
def test_backward_is_bit_identical_run_to_run(dtype):
    """No atomics anywhere in the backward: a second call repeats the first bit for bit."""
    block, head_dim = 32, 64
    n_ctx = 3 * block - 5
    layout = make_test_layout("causal", block, n_ctx)
    q, k, v, dout = random_inputs((2, HEADS, n_ctx, head_dim), dtype, seed=7)
    out, lse = interp.forward(q, k, v, AttentionCall(layout, 0.3))
    first = interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.3))
    second = interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.3))
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_float16_gradients_where_ds_falls_into_subnormals():
    """Long rows spread P thin (~1/n_k) and a small dout keeps dP small, so dS = P * (dP - delta)
    falls below fp16's smallest normal (6.1e-5) where the backward rounds it to fp16 for the dQ
    and dK products: the gradients must still meet fp16's tolerance against float64."""
    n_q, n_k, head_dim, block = 64, 2048, 64, 64
    layout = Layout(np.ones((1, 1, n_k // block), bool), block, n_k, ElementRule("none"), n_q=n_q)
    rng = np.random.default_rng(17)
    q = (0.1 * rng.standard_normal((1, 1, n_q, head_dim))).astype(np.float16)
    k, v = (rng.standard_normal((1, 1, n_k, head_dim)).astype(np.float16) for _ in range(2))
    dout = (1e-3 * rng.standard_normal((1, 1, n_q, head_dim))).astype(np.float16)
    scale = head_dim**-0.5
    out, lse = interp.forward(q, k, v, AttentionCall(layout, scale))
    check_forward(out, lse, q, k, v, layout, scale, "float16")
    mask = layout.to_mask()
    q64, k64, v64, dout64 = (x.astype(np.float64) for x in (q, k, v, dout))
    p = np.exp(scale * q64 @ k64.swapaxes(-1, -2) - lse[..., None])
    dp = dout64 @ v64.swapaxes(-1, -2)
    ds = p * (dp - (dout64 * out.astype(np.float64)).sum(-1, keepdims=True))
    assert np.median(np.abs(ds)) < np.finfo(np.float16).tiny  # the regime this test is about
    refs = dense_attention_grads(q, k, v, dout, mask, scale)
    grads = interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, scale))
    for name, grad, ref in zip("qkv", grads, refs, strict=True):
        assert rel_err(grad, ref) <= TOLERANCE["float16"], f"d{name}"


@pytest.mark.parametrize("scale", [0.7, -0.45])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_batch_and_custom_scale(dtype, scale):
    """Any finite scale, negative too: masked scores must stay -inf after scaling."""
    block, head_dim = 16, 32
    n_ctx = 4 * block + 3
    layout = local_layout(n_ctx, HEADS, block, 20, causal=True)
    q, k, v, dout = random_inputs((3, HEADS, n_ctx, head_dim), dtype, seed=11)
    out, lse = interp.forward(q, k, v, AttentionCall(layout, scale))
    check_forward(out, lse, q, k, v, layout, scale, dtype)
    refs = dense_attention_grads(q, k, v, dout, layout.to_mask(), scale)
    grads = interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, scale))
    for grad, ref in zip(grads, refs, strict=True):
        assert rel_err(grad, ref) <= TOLERANCE[dtype]


def check_kernel_traits(configs) -> None:
    """geometry's threads and shared memory equal each kernel's own C++ traits."""
    for config in configs:
        library = interp.library_for(config)
        assert library.traits(config.name_expression) == (config.threads, config.smem_bytes)


def test_launch_geometry_matches_kernel_traits():
    check_kernel_traits(c for c in geometry.all_configs() if not is_wide(c) and is_plain(c))


def test_rejects_bad_inputs():
    layout = all_layout(32, HEADS, 16)
    q = np.zeros((1, HEADS, 32, 40), np.float32)
    with pytest.raises(ValueError, match="head_dim"):
        interp.forward(q, q, q, AttentionCall(layout, 1.0))
    q = np.zeros((1, HEADS, 32, 32), np.float64)
    with pytest.raises(TypeError, match="dtype"):
        interp.forward(q, q, q, AttentionCall(layout, 1.0))
    q = np.zeros((1, HEADS + 1, 32, 32), np.float32)
    with pytest.raises(ValueError, match="layout"):
        interp.forward(q, q, q, AttentionCall(layout, 1.0))


@settings(max_examples=8, deadline=None)
@given(
    n_ctx=st.integers(1, 70),
    density=st.floats(0.0, 1.0),
    rule=st.sampled_from(geometry.RULES),
    dtype=st.sampled_from(["float32", "float16"]),
    seed=st.integers(0, 2**16),
)
def test_random_layouts(n_ctx, density, rule, dtype, seed):
    """Arbitrary block patterns, lengths (down to one token) and rules on the cheapest kernels."""
    block, head_dim = 16, 32
    nb = -(-n_ctx // block)
    rng = np.random.default_rng(seed)
    blocks = rng.random((HEADS, nb, nb)) < density
    if rule == "bitmask":
        layout = Layout.from_blocks(blocks, block, bitmask_fn, n_ctx=n_ctx)
    else:
        element_rule = ElementRule(rule, window_left=9, window_right=4)
        layout = Layout(blocks, block, n_ctx, element_rule)
    q, k, v, dout = random_inputs((1, HEADS, n_ctx, head_dim), dtype, seed)
    scale = head_dim**-0.5
    out, lse = interp.forward(q, k, v, AttentionCall(layout, scale))
    check_forward(out, lse, q, k, v, layout, scale, dtype)
    refs = dense_attention_grads(q, k, v, dout, layout.to_mask(), scale)
    grads = interp.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, scale))
    for grad, ref in zip(grads, refs, strict=True):
        assert not np.isnan(grad.astype(np.float32)).any()
        # a query with a single key has dQ = 0 exactly; the kernels' is rounding noise of
        # dP - delta, measured against the gradients' scale (GRAD_FLOOR), as the oracle says
        assert rel_err(grad, ref, GRAD_FLOOR) <= TOLERANCE[dtype]
