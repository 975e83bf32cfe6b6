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

from cuattn.backends import NumpyBackend, geometry, interp
from cuattn.layout import make_layout
from tests.backends.test_interp_kernels import HEADS, TOLERANCE, make_test_layout, n_ctx_for
from tests.backends.test_score_mods import HEAD_DIM, SOFTCAP, _inputs, mods_kernels  # noqa: F401
from tests.helpers.score_operands import check_bit_identical, check_operands, check_sets_its_flag

REF_RTOL = 1e-12
REFERENCE = NumpyBackend()


def _key_bias(batch: int, heads: int, n_k: int, per_head: bool, seed: int) -> np.ndarray:
    """Spread biases, and -inf on a few keys (a padded tail of batch 0, one key of head 0)."""
    rng = np.random.default_rng(seed)
    shape = (batch, heads, n_k) if per_head else (batch, n_k)
    bias = (rng.standard_normal(shape) * 2).astype(np.float32)
    bias[0, ..., -3:] = -np.inf
    if per_head:
        bias[-1, 0, 1] = -np.inf
    return bias


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("rule", geometry.RULES)
def test_reference_key_bias_matches_the_oracle(rule, per_head):
    n = n_ctx_for(16)
    layout = make_test_layout(rule, 16, n)
    q, k, v, dout = _inputs((2, HEADS, n, 8), np.float64, seed=1)
    key_bias = _key_bias(2, HEADS, n, per_head, 2)
    check_operands(REFERENCE, q, k, v, dout, layout, REF_RTOL, key_bias=key_bias)


def test_reference_key_bias_with_softcap_alibi_gqa_and_fewer_queries():
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 8, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, 8), np.float64, seed=3)
    _, k, v, _ = _inputs((2, 2, n_k, 8), np.float64, seed=4)
    slopes = np.random.default_rng(5).uniform(0.05, 0.5, 4).astype(np.float32)
    key_bias = _key_bias(2, 4, n_k, True, 6)
    check_operands(REFERENCE, q, k, v, dout, layout, REF_RTOL, SOFTCAP, slopes, key_bias)


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
    check_operands(interp, q, k, v, dout, layout, TOLERANCE[dtype], key_bias=key_bias)


def test_kernels_key_bias_softcap_alibi_gqa_bit_identical(mods_kernels):  # noqa: F811
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 16, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, HEAD_DIM), "float32", seed=8)
    _, k, v, _ = _inputs((2, 2, n_k, HEAD_DIM), "float32", seed=9)
    slopes = np.random.default_rng(10).uniform(0.05, 0.5, (2, 4)).astype(np.float32)
    key_bias = _key_bias(2, 4, n_k, False, 11)
    args = (interp, q, k, v, dout, layout, TOLERANCE["float32"], SOFTCAP, slopes, key_bias)
    check_bit_identical(*args)


def test_key_bias_sets_its_flag():
    """The call flags the operand it carries (the kernels' variant follows the flag)."""
    layout = make_test_layout("causal", 16, 24)
    q, k, v, _ = _inputs((1, HEADS, 24, 8), np.float64, seed=12)
    key_bias = _key_bias(1, HEADS, 24, False, 13)
    check_sets_its_flag("key_bias", key_bias, "key_bias", q, k, v, layout)
