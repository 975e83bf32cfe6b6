"""merge_attention_states: the exact merge of two partial attentions over disjoint key sets, on
NumPy and the merge kernel through the interpreter, -inf-safe, with its errors."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from tests.helpers.oracle import dense_attention, rel_err

RNG = np.random.default_rng(11)
HEADS, KV_HEADS, N_Q, N_K, SPLIT = 4, 2, 50, 90, 40


def halves(head_dim=32):
    """Partial attentions over keys [0, SPLIT) and [SPLIT, N_K), and the float64 whole."""
    q = RNG.standard_normal((2, HEADS, N_Q, head_dim))
    k, v = (RNG.standard_normal((2, KV_HEADS, N_K, head_dim)) for _ in "kv")
    parts = []
    for keys in (slice(0, SPLIT), slice(SPLIT, N_K)):
        n = keys.stop - keys.start
        layout = cuattn.make_layout("all", n, HEADS, 16, causal=False, n_q=N_Q)
        parts.append(
            cuattn.sparse_attention(q, k[:, :, keys], v[:, :, keys], layout, return_lse=True)
        )
    whole = np.ones((HEADS, N_Q, N_K), bool)
    return parts, dense_attention(q, k, v, whole, head_dim**-0.5)


def test_numpy_merge_is_attention_over_both_halves():
    ((out_a, lse_a), (out_b, lse_b)), (want_out, want_lse) = halves()
    out, lse = cuattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert rel_err(out, want_out) < 1e-14
    assert np.abs(lse - want_lse).max() < 1e-13


@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-6), (np.float16, 2e-3)])
def test_merge_kernel_on_the_interpreter(dtype, tol):
    ((out_a, lse_a), (out_b, lse_b)), (want_out, want_lse) = halves()
    out_a, out_b = out_a.astype(dtype), out_b.astype(dtype)
    lse_a, lse_b = lse_a.astype(np.float32), lse_b.astype(np.float32)
    out, lse = cuattn.merge_attention_states(out_a, lse_a, out_b, lse_b, backend="interp")
    assert out.dtype == dtype and lse.dtype == np.float32
    assert rel_err(out, want_out) < tol
    assert np.abs(lse - want_lse).max() < 1e-5


@pytest.mark.parametrize("backend", ["numpy", "interp"])
def test_empty_sides_contribute_nothing_and_never_nan(backend):
    rows = 6
    out_a = RNG.standard_normal((1, 1, rows, 16)).astype(np.float32)
    out_b = RNG.standard_normal((1, 1, rows, 16)).astype(np.float32)
    lse_a = RNG.standard_normal((1, 1, rows)).astype(np.float32)
    lse_b = RNG.standard_normal((1, 1, rows)).astype(np.float32)
    lse_a[..., 0] = -np.inf  # row 0: only b
    out_a[..., 0, :] = np.nan  # garbage on the empty side must not leak
    lse_b[..., 1] = -np.inf  # row 1: only a
    lse_a[..., 2] = lse_b[..., 2] = -np.inf  # row 2: nothing at all
    out, lse = cuattn.merge_attention_states(out_a, lse_a, out_b, lse_b, backend=backend)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    np.testing.assert_allclose(out[..., 0, :], out_b[..., 0, :], rtol=1e-6)
    np.testing.assert_allclose(lse[..., 0], lse_b[..., 0], rtol=1e-6)
    np.testing.assert_allclose(out[..., 1, :], out_a[..., 1, :], rtol=1e-6)
    assert (out[..., 2, :] == 0).all() and np.isneginf(lse[..., 2]).all()
    both = np.logaddexp(lse_a[..., 3:], lse_b[..., 3:])
    np.testing.assert_allclose(lse[..., 3:], both, rtol=1e-5)


def test_torch_arrays_come_back_as_torch():
    torch = pytest.importorskip("torch")
    ((out_a, lse_a), (out_b, lse_b)), (want_out, _) = halves()
    tensors = [torch.tensor(x) for x in (out_a, lse_a, out_b, lse_b)]
    out, lse = cuattn.merge_attention_states(*tensors)
    assert isinstance(out, torch.Tensor) and rel_err(out.numpy(), want_out) < 1e-14


def test_torch_gradients_equal_autograd_of_the_merge_formula():
    """Gradients in all four inputs equal torch autograd through the merge's formula (lse =
    logaddexp, out = the lse-weighted mean); an empty side gets zero gradient, never NaN."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(9)
    ((out_a, lse_a), (out_b, lse_b)), _ = halves()
    leaves = [torch.tensor(x, requires_grad=True) for x in (out_a, lse_a, out_b, lse_b)]
    out, lse = cuattn.merge_attention_states(*leaves)
    weight = torch.tensor(rng.standard_normal(out.shape))
    lse_weight = torch.tensor(rng.standard_normal(lse.shape))
    ((out * weight).sum() + (lse * lse_weight).sum()).backward()
    refs = [torch.tensor(x, requires_grad=True) for x in (out_a, lse_a, out_b, lse_b)]
    want_lse = torch.logaddexp(refs[1], refs[3])
    want = (refs[1] - want_lse).exp()[..., None] * refs[0]
    want = want + (refs[3] - want_lse).exp()[..., None] * refs[2]
    ((want * weight).sum() + (want_lse * lse_weight).sum()).backward()
    for name, got, ref in zip(("out_a", "lse_a", "out_b", "lse_b"), leaves, refs, strict=True):
        assert torch.allclose(got.grad, ref.grad, rtol=1e-12, atol=1e-13), name

    out_a = torch.full((3, 8), float("nan"), requires_grad=True)  # an empty side's garbage
    lse_a = torch.full((3,), float("-inf"), requires_grad=True)
    out_b = torch.tensor(rng.standard_normal((3, 8)), dtype=torch.float32, requires_grad=True)
    lse_b = torch.tensor(rng.standard_normal(3), dtype=torch.float32, requires_grad=True)
    merged, merged_lse = cuattn.merge_attention_states(out_a, lse_a, out_b, lse_b)
    (merged.sum() + merged_lse.sum()).backward()
    assert (out_a.grad == 0).all() and (lse_a.grad == 0).all()
    assert torch.isfinite(out_b.grad).all() and torch.allclose(lse_b.grad, torch.ones(3))


def test_torch_gradient_of_a_nan_side_is_nan_and_of_an_empty_row_zero():
    """A NaN lse poisons its merged row in the forward, so its gradients are NaN too (not a
    silent zero weight); a row where both sides are empty gets zero gradients, never NaN."""
    torch = pytest.importorskip("torch")
    gen = torch.Generator().manual_seed(3)
    outs = [torch.randn(1, 2, 4, 8, generator=gen, dtype=torch.float64) for _ in range(2)]
    lses = [torch.randn(1, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2)]
    lses[0][0, 0, 1] = float("nan")
    lses[0][0, 1, 3] = lses[1][0, 1, 3] = float("-inf")
    leaves = [x.requires_grad_() for x in (outs[0], lses[0], outs[1], lses[1])]
    out, lse = cuattn.merge_attention_states(*leaves)
    assert out[0, 0, 1].isnan().all() and lse[0, 0, 1].isnan() and lse[0, 1, 3] == float("-inf")
    (out.sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()).backward()
    for leaf in leaves:
        assert leaf.grad[0, 0, 1].isnan().all()
        assert not leaf.grad[0, 1, 3].any()
        assert not leaf.grad[0, 1, :3].isnan().any()


def test_jax_tracers_are_refused():
    jax = pytest.importorskip("jax")
    ((out_a, lse_a), (out_b, lse_b)), _ = halves()
    out_a, lse_a, out_b, lse_b = (x.astype(np.float32) for x in (out_a, lse_a, out_b, lse_b))

    def merged(a):
        return cuattn.merge_attention_states(a, lse_a, out_b, lse_b)[0].sum()

    with pytest.raises(ValueError, match="for torch tensors only"):
        jax.grad(merged)(jax.numpy.asarray(out_a))


def test_bad_inputs_name_the_argument():
    ((out_a, lse_a), (out_b, lse_b)), _ = halves()
    merge = cuattn.merge_attention_states
    with pytest.raises(ValueError, match=r"out_b must match out_a"):
        merge(out_a, lse_a, out_b[..., :16], lse_b)
    with pytest.raises(ValueError, match=r"lse_b must have shape \(2, 4, 50\)"):
        merge(out_a, lse_a, out_b, lse_b[..., :10])
    with pytest.raises(TypeError, match=r"lse_a must be float64"):
        merge(out_a, lse_a.astype(np.float32), out_b, lse_b)
    with pytest.raises(TypeError, match=r"out_a must be an array"):
        merge([1.0], lse_a, out_b, lse_b)
    f32 = [x.astype(np.float32) for x in (out_a, lse_a, out_b, lse_b)]
    with pytest.raises(ValueError, match=r"out_a: head_dim 20 has no kernel"):
        merge(f32[0][..., :20].copy(), f32[1], f32[2][..., :20].copy(), f32[3], backend="interp")
