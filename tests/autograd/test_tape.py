"""The tape's mechanics: accumulation, shape checks, no_grad, graph freeing and recompute."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn.autograd.tape as tape
from cuattn.autograd.tape import Context, Function, Tensor, no_grad, recompute, saved_nbytes
from dev.tinylm_ops import cross_entropy, gelu, layer_norm, softmax


def _leaf(rng, *shape):
    return Tensor(rng.standard_normal(shape), requires_grad=True)


def test_grad_accumulates_over_paths_and_calls():
    rng = np.random.default_rng(0)
    x = _leaf(rng, 3, 4)
    (x * x + x).sum().backward()
    first = x.grad.copy()
    np.testing.assert_allclose(first, 2 * x.data + 1)
    (x * 3.0).sum().backward()
    np.testing.assert_allclose(x.grad, first + 3.0)


def test_backward_default_grad_needs_single_element():
    rng = np.random.default_rng(1)
    y = _leaf(rng, 2, 2) * 2.0
    with pytest.raises(ValueError, match="single-element"):
        y.backward()
    with pytest.raises(ValueError, match="shape"):
        y.backward(np.ones((3, 2)))


def test_wrong_gradient_shape_from_a_function_is_caught():
    class Bad(Function):
        @staticmethod
        def forward(ctx: Context, a):
            return a * 2

        @staticmethod
        def backward(ctx: Context, g):
            return g[:1]

    x = _leaf(np.random.default_rng(2), 3, 2)
    with pytest.raises(ValueError, match="Bad.backward produced a gradient of shape"):
        Bad.apply(x).sum().backward()


def test_no_grad_records_nothing():
    x = _leaf(np.random.default_rng(3), 4)
    with no_grad():
        y = x * 2.0
    assert not y.requires_grad and y._node is None
    assert tape.is_grad_enabled()


def test_second_backward_needs_retain_graph():
    x = _leaf(np.random.default_rng(4), 3)
    _retained_once_then_refused((gelu(x) * x).sum(), x, "retain_graph")


def _retained_once_then_refused(y, x, message):
    """A backward retaining the graph, a second one adding the same gradient again (bit for
    bit), and a third refused with ``message``: the graph was released by the second."""
    y.backward(retain_graph=True)
    once = x.grad.copy()
    y.backward()
    np.testing.assert_array_equal(x.grad, 2 * once)
    with pytest.raises(RuntimeError, match=message):
        y.backward()


def test_multi_output_and_non_differentiable_output():
    class SplitStats(Function):
        @staticmethod
        def forward(ctx: Context, a):
            ctx.mark_non_differentiable(2)
            return a * 2, a * 3, a.argmax(keepdims=True)

        @staticmethod
        def backward(ctx: Context, g2, g3, g_idx):
            return 2 * g2 + 3 * g3

    x = _leaf(np.random.default_rng(5), 4)
    two, three, idx = SplitStats.apply(x)
    assert not idx.requires_grad
    three.sum().backward()  # `two` unused: its gradient is zero-filled
    np.testing.assert_allclose(x.grad, np.full(4, 3.0))


def test_tensor_rejects_integer_grad():
    with pytest.raises(TypeError, match="floating"):
        Tensor(np.arange(3), requires_grad=True)


def _mlp(x, w1, w2):
    return (gelu(x @ w1) @ w2).sum(axis=-1)


def _mlp_setup(seed=6):
    rng = np.random.default_rng(seed)
    return _leaf(rng, 16, 8), _leaf(rng, 8, 32), _leaf(rng, 32, 8)


def test_recompute_region_gradients_bit_identical_and_bytes_drop():
    weight = np.random.default_rng(7).standard_normal(16)

    x, w1, w2 = _mlp_setup()
    y = _mlp(x, w1, w2)
    plain_bytes = saved_nbytes(y)
    (y * weight).sum().backward()
    plain = [t.grad for t in (x, w1, w2)]

    x, w1, w2 = _mlp_setup()
    with recompute():
        y = _mlp(x, w1, w2)
    region_bytes = saved_nbytes(y)
    (y * weight).sum().backward()
    for g, t in zip(plain, (x, w1, w2), strict=True):
        assert np.array_equal(g, t.grad)

    # Plain: matmul saves x, w1; gelu saves h = x @ w1; matmul saves g = gelu(h), w2.
    # Region: keeps only x, w1, w2. The drop is exactly the two [16, 32] float64 intermediates.
    hidden_bytes = 16 * 32 * 8
    assert plain_bytes == sum(t.data.nbytes for t in (x, w1, w2)) + 2 * hidden_bytes
    assert plain_bytes - region_bytes == 2 * hidden_bytes


def test_recompute_region_inside_a_larger_graph():
    rng = np.random.default_rng(8)
    base = rng.standard_normal((4, 6))
    w = rng.standard_normal((6, 6))

    def run(use_region):
        x = Tensor(base.copy(), requires_grad=True)
        wt = Tensor(w.copy(), requires_grad=True)
        pre = layer_norm(x, np.ones(6), np.zeros(6))
        with recompute(use_region):
            mid = softmax(pre @ wt, axis=-1) * pre
        loss = cross_entropy(mid + x, np.array([0, 5, 2, 3]))
        loss.backward()
        return x.grad, wt.grad

    for a, b in zip(run(False), run(True), strict=True):
        assert np.array_equal(a, b)


def test_recompute_region_freed_after_backward_unless_retained():
    x, w1, w2 = _mlp_setup(9)
    with recompute():
        y = _mlp(x, w1, w2).sum()
    _retained_once_then_refused(y, x, "freed")


def test_ndarray_on_the_left_defers_to_tensor():
    rng = np.random.default_rng(12)
    x = _leaf(rng, 3)
    scale = rng.standard_normal(3)
    y = scale * x + scale
    assert isinstance(y, Tensor)
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, scale)


def test_recompute_replays_temporary_constants_correctly():
    # Each NumPy constant is wrapped in a short-lived Tensor; a freed wrapper's id can be
    # reused by the next one, which must not make the replay read the wrong constant.
    rng = np.random.default_rng(13)
    base = rng.standard_normal(5)
    consts = [rng.standard_normal(5) for _ in range(8)]

    def run(use_region):
        x = Tensor(base.copy(), requires_grad=True)
        with recompute(use_region):
            y = gelu(x)
            for c in consts:
                y = gelu(y * c.copy())
        y.sum().backward()
        return x.grad

    assert np.array_equal(run(False), run(True))
