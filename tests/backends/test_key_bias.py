"""A per-key bias (``key_bias``) on the NumPy reference and the kernels' MODS_SCORE variants
through the CPU interpreter, forward and every gradient (q, k, v and the bias), against the
float64 dense oracle with the bias added to every query's scores; alone and with a softcap and
ALiBi, with -inf entries (padding masks as models pass them), one row per batch or per head.

The bias is a runtime value of the score-modifier variant: these tests run the instantiations
tests/backends/test_score_mods.py builds.
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
# the bias's gradient (float32, as the bias) sums a column of dS over the queries
BIAS_TOLERANCE = {"float64": 1e-6, "float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}


def _key_bias(batch: int, heads: int, n_k: int, per_head: bool, seed: int) -> np.ndarray:
    """Spread biases, and -inf on a few keys (a padded tail of batch 0, one key of head 0)."""
    rng = np.random.default_rng(seed)
    shape = (batch, heads, n_k) if per_head else (batch, n_k)
    bias = (rng.standard_normal(shape) * 2).astype(np.float32)
    bias[0, ..., -3:] = -np.inf
    if per_head:
        bias[-1, 0, 1] = -np.inf
    return bias


def _check(backend, q, k, v, dout, layout, key_bias, tolerance, softcap=0.0, slopes=None):
    scale = q.shape[-1] ** -0.5
    mods = ScoreMods(softcap, alibi=slopes is not None, key_bias=True)
    mask = layout.to_mask()
    batch, heads, n_q = q.shape[:3]
    n_k = k.shape[2]
    bias = key_bias.astype(np.float64)
    bias = (bias if bias.ndim == 3 else bias[:, None, :])[:, :, None, :]
    if slopes is not None:
        bias = bias + alibi_bias(slopes, batch, n_q, n_k)
    operands = (slopes, key_bias)
    out, lse = backend.forward(q, k, v, layout, scale, mods, *operands)
    ref_out, ref_lse = dense_attention(q, k, v, mask, scale, softcap=softcap, bias=bias)
    empty = np.isneginf(ref_lse)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert rel_err(out, ref_out) <= tolerance
    assert rel_err(lse[~empty], ref_lse[~empty]) <= tolerance
    grads = backend.backward(q, k, v, out, lse, dout, layout, scale, None, mods, *operands)
    *refs, dbias = dense_attention_grads(q, k, v, dout, mask, scale, softcap=softcap, bias=bias)
    for name, grad, ref in zip("qkv", grads[:3], refs, strict=True):
        assert not np.isnan(np.asarray(grad, np.float32)).any(), f"d{name}"
        assert rel_err(grad, ref) <= tolerance, f"d{name}"
    dbias = np.nan_to_num(dbias, nan=0.0)  # a -inf bias: p = 0, no gradient
    ref_dkey = dbias.sum(axis=2)
    ref_dkey = ref_dkey if key_bias.ndim == 3 else ref_dkey.sum(axis=1)
    dkey = grads[-1]
    assert dkey.dtype == np.float32 and dkey.shape == key_bias.shape
    assert not np.isnan(dkey).any()
    dtype = "float64" if q.dtype == np.float64 else str(np.dtype(q.dtype))
    assert rel_err(dkey, ref_dkey) <= BIAS_TOLERANCE.get(dtype, tolerance), "dkey_bias"
    return out, lse, grads


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("rule", geometry.RULES)
def test_reference_key_bias_matches_the_oracle(rule, per_head):
    n = n_ctx_for(16)
    layout = make_test_layout(rule, 16, n)
    q, k, v, dout = _inputs((2, HEADS, n, 8), np.float64, seed=1)
    _check(REFERENCE, q, k, v, dout, layout, _key_bias(2, HEADS, n, per_head, 2), REF_RTOL)


def test_reference_key_bias_with_softcap_alibi_gqa_and_fewer_queries():
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 8, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, 8), np.float64, seed=3)
    _, k, v, _ = _inputs((2, 2, n_k, 8), np.float64, seed=4)
    slopes = np.random.default_rng(5).uniform(0.05, 0.5, 4).astype(np.float32)
    key_bias = _key_bias(2, 4, n_k, True, 6)
    _check(REFERENCE, q, k, v, dout, layout, key_bias, REF_RTOL, SOFTCAP, slopes)


KERNEL_CASES = [(16, HEAD_DIM, dtype, "causal", True) for dtype in geometry.DTYPES]
KERNEL_CASES += [(16, HEAD_DIM, "float32", rule, False) for rule in ("none", "bitmask")]
KERNEL_CASES += [(64, HEAD_DIM, "float16", "causal", False)]
KERNEL_CASES += [(128, HEAD_DIM, "float16", "window", True)]


@pytest.mark.parametrize(("block", "head_dim", "dtype", "rule", "per_head"), KERNEL_CASES)
def test_kernels_key_bias_match_the_oracle(mods_kernels, block, head_dim, dtype, rule, per_head):  # noqa: F811
    n = n_ctx_for(block) if block < 128 else 150
    layout = make_test_layout(rule, block, n)
    q, k, v, dout = _inputs((2, HEADS, n, head_dim), dtype, seed=block + head_dim)
    key_bias = _key_bias(2, HEADS, n, per_head, 7)
    _check(interp, q, k, v, dout, layout, key_bias, TOLERANCE[dtype])


def test_kernels_key_bias_softcap_alibi_gqa_bit_identical(mods_kernels):  # noqa: F811
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 16, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, HEAD_DIM), "float32", seed=8)
    _, k, v, _ = _inputs((2, 2, n_k, HEAD_DIM), "float32", seed=9)
    slopes = np.random.default_rng(10).uniform(0.05, 0.5, (2, 4)).astype(np.float32)
    args = (interp, q, k, v, dout, layout, _key_bias(2, 4, n_k, False, 11), TOLERANCE["float32"])
    first, again = _check(*args, SOFTCAP, slopes), _check(*args, SOFTCAP, slopes)
    for a, b in zip((first[0], first[1], *first[2]), (again[0], again[1], *again[2]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_key_bias_without_the_flag_is_refused():
    layout = make_test_layout("causal", 16, 24)
    q, k, v, _ = _inputs((1, HEADS, 24, 8), np.float64, seed=12)
    key_bias = _key_bias(1, HEADS, 24, False, 13)
    with pytest.raises(ValueError, match="key_bias: mods.key_bias=False but it was given"):
        forward(q, k, v, layout, 0.5, "numpy", ScoreMods(), None, key_bias)
