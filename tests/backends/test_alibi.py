"""ALiBi (``alibi_slopes``) on the NumPy reference and the kernels' MODS_SCORE variants through
the CPU interpreter, forward and every gradient (q, k, v and the slopes), against the float64
dense oracle with ALiBi's bias (cuattn/tools/oracle.py ``alibi_bias``).

ALiBi is a runtime value of the score-modifier variant, so these tests run the instantiations
tests/backends/test_score_mods.py builds (block 16 and head dim 32 for every dtype and rule, a
64-block and a 128-block: one, two and paired fragments per warp). Slopes are large enough that
the bias reorders each row's scores: a bias that was dropped or misplaced fails by far more
than the tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import NumpyBackend, forward, geometry, interp
from cuattn.backends.call import ScoreMods
from cuattn.layout import make_layout
from cuattn.tools.oracle import alibi_bias, dense_attention, dense_attention_grads, rel_err
from tests.backends.test_interp_kernels import HEADS, TOLERANCE, make_test_layout, n_ctx_for
from tests.backends.test_score_mods import HEAD_DIM, SOFTCAP, _inputs, mods_kernels  # noqa: F401

REF_RTOL = 1e-12
REFERENCE = NumpyBackend()
# the slopes' gradient (float32, as the slopes) sums n_q x n_k products of dS and a distance
SLOPES_TOLERANCE = {"float64": 1e-6, "float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}


def _slopes(batch: int, heads: int, per_batch: bool, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (batch, heads) if per_batch else (heads,)
    return rng.uniform(0.05, 0.6, shape).astype(np.float32)


def _check(backend, q, k, v, dout, layout, slopes, tolerance, softcap=0.0, dlse=None):
    """forward and backward of ``backend`` with ALiBi (and a softcap) against the oracle."""
    scale = q.shape[-1] ** -0.5
    mods = ScoreMods(softcap, alibi=True)
    mask = layout.to_mask()
    batch, n_q, n_k = q.shape[0], q.shape[2], k.shape[2]
    bias = alibi_bias(slopes, batch, n_q, n_k)
    out, lse = backend.forward(q, k, v, layout, scale, mods, slopes)
    ref_out, ref_lse = dense_attention(q, k, v, mask, scale, softcap=softcap, bias=bias)
    empty = np.isneginf(ref_lse)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert rel_err(out, ref_out) <= tolerance
    assert rel_err(lse[~empty], ref_lse[~empty]) <= tolerance
    *grads, dslopes = backend.backward(q, k, v, out, lse, dout, layout, scale, dlse, mods, slopes)
    *refs, dbias = dense_attention_grads(
        q, k, v, dout, mask, scale, dlse, softcap=softcap, bias=bias
    )
    for name, grad, ref in zip("qkv", grads, refs, strict=True):
        assert not np.isnan(np.asarray(grad, np.float32)).any(), f"d{name}"
        assert rel_err(grad, ref) <= tolerance, f"d{name}"
    distance = -bias / np.broadcast_to(slopes, (batch, slopes.shape[-1]))[:, :, None, None]
    ref_dslopes = -(dbias * distance).sum(axis=(2, 3))
    ref_dslopes = ref_dslopes if slopes.ndim == 2 else ref_dslopes.sum(axis=0)
    assert dslopes.dtype == np.float32 and dslopes.shape == slopes.shape
    dtype = str(np.dtype(q.dtype)) if q.dtype != np.float64 else "float64"
    assert rel_err(dslopes, ref_dslopes) <= SLOPES_TOLERANCE.get(dtype, tolerance), "dslopes"
    return out, lse, grads, dslopes


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("rule", geometry.RULES)
def test_reference_alibi_matches_the_oracle(rule, per_batch):
    n = n_ctx_for(16)
    layout = make_test_layout(rule, 16, n)
    q, k, v, dout = _inputs((2, HEADS, n, 8), np.float64, seed=1)
    dlse = np.random.default_rng(2).standard_normal(q.shape[:3])
    slopes = _slopes(2, HEADS, per_batch, seed=3)
    _check(REFERENCE, q, k, v, dout, layout, slopes, REF_RTOL, dlse=dlse)


def test_reference_alibi_gqa_fewer_queries_and_softcap():
    """End-aligned positions (n_q < n_k), query heads sharing a kv head, and the bias added
    after the cap (its gradient is the biased score's, before the cap's slope)."""
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 8, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, 8), np.float64, seed=4)
    _, k, v, _ = _inputs((2, 2, n_k, 8), np.float64, seed=5)
    _check(REFERENCE, q, k, v, dout, layout, _slopes(2, 4, True, 6), REF_RTOL, softcap=SOFTCAP)


def test_reference_alibi_changes_the_result():
    layout = make_test_layout("causal", 16, 24)
    q, k, v, _ = _inputs((1, HEADS, 24, 8), np.float64, seed=7)
    plain = REFERENCE.forward(q, k, v, layout, 0.5)
    slopes = _slopes(1, HEADS, False, 8)
    biased = REFERENCE.forward(q, k, v, layout, 0.5, ScoreMods(alibi=True), slopes)
    assert rel_err(biased[0], plain[0]) > 0.1
    zero = REFERENCE.forward(q, k, v, layout, 0.5, ScoreMods(alibi=True), 0 * slopes)
    np.testing.assert_allclose(zero[0], plain[0], rtol=0, atol=1e-14)


KERNEL_CASES = [(16, HEAD_DIM, dtype, rule) for dtype in geometry.DTYPES for rule in ("causal",)]
KERNEL_CASES += [(16, HEAD_DIM, "float32", rule) for rule in ("none", "window", "bitmask")]
# a 64-block (paired CTAs where the layout allows) and a 128-block (32 rows per warp)
KERNEL_CASES += [(64, HEAD_DIM, "float16", "causal"), (128, HEAD_DIM, "float16", "causal")]


@pytest.mark.parametrize(("block", "head_dim", "dtype", "rule"), KERNEL_CASES)
def test_kernels_alibi_match_the_oracle(mods_kernels, block, head_dim, dtype, rule):  # noqa: F811
    n = n_ctx_for(block) if block < 128 else 150
    layout = make_test_layout(rule, block, n)
    q, k, v, dout = _inputs((2, HEADS, n, head_dim), dtype, seed=block + head_dim)
    dlse = np.random.default_rng(9).standard_normal(q.shape[:3]).astype(np.float32)
    slopes = _slopes(2, HEADS, per_batch=block == 16, seed=10)
    _check(interp, q, k, v, dout, layout, slopes, TOLERANCE[dtype], dlse=dlse)


def test_kernels_alibi_with_softcap_gqa_fewer_queries_bit_identical(mods_kernels):  # noqa: F811
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 16, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, HEAD_DIM), "float32", seed=11)
    _, k, v, _ = _inputs((2, 2, n_k, HEAD_DIM), "float32", seed=12)
    slopes = _slopes(2, 4, False, 13)
    args = (interp, q, k, v, dout, layout, slopes, TOLERANCE["float32"], SOFTCAP)
    first, again = _check(*args), _check(*args)
    flat = [first[0], first[1], *first[2], first[3]], [again[0], again[1], *again[2], again[3]]
    for a, b in zip(*flat, strict=True):
        np.testing.assert_array_equal(a, b)


def test_slopes_without_the_flag_or_with_a_permuted_layout_are_refused():
    layout = make_test_layout("causal", 16, 24)
    q, k, v, _ = _inputs((1, HEADS, 24, 8), np.float64, seed=14)
    slopes = _slopes(1, HEADS, False, 15)
    with pytest.raises(ValueError, match="alibi_slopes: mods.alibi=False"):
        forward(q, k, v, layout, 0.5, "numpy", ScoreMods(), slopes)
    with pytest.raises(ValueError, match="alibi_slopes: mods.alibi=True"):
        forward(q, k, v, layout, 0.5, "numpy", ScoreMods(alibi=True))
    permuted = make_layout("strided", 32, HEADS, 8, local_attn_ctx=4)
    assert permuted.perm is not None
    q, k, v, _ = _inputs((1, HEADS, 32, 8), np.float64, seed=16)
    with pytest.raises(ValueError, match="natural token order"):
        forward(q, k, v, permuted, 0.5, "numpy", ScoreMods(alibi=True), slopes)
