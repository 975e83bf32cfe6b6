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

from cuattn.backends import NumpyBackend, geometry, interp
from cuattn.backends.call import AttentionCall, ScoreMods, ScoreOperands
from cuattn.layout import Pattern, make_layout
from cuattn.tools.oracle import rel_err
from tests.backends.test_interp_kernels import HEADS, TOLERANCE, make_test_layout, n_ctx_for
from tests.backends.test_score_mods import HEAD_DIM, SOFTCAP, _inputs, mods_kernels  # noqa: F401
from tests.helpers.score_operands import check_bit_identical, check_operands, check_sets_its_flag

REF_RTOL = 1e-12
REFERENCE = NumpyBackend()


def _slopes(batch: int, heads: int, per_batch: bool, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    shape = (batch, heads) if per_batch else (heads,)
    return rng.uniform(0.05, 0.6, shape).astype(np.float32)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("rule", geometry.RULES)
def test_reference_alibi_matches_the_oracle(rule, per_batch):
    n = n_ctx_for(16)
    layout = make_test_layout(rule, 16, n)
    q, k, v, dout = _inputs((2, HEADS, n, 8), np.float64, seed=1)
    dlse = np.random.default_rng(2).standard_normal(q.shape[:3])
    slopes = _slopes(2, HEADS, per_batch, seed=3)
    check_operands(REFERENCE, q, k, v, dout, layout, REF_RTOL, slopes=slopes, dlse=dlse)


def test_reference_alibi_gqa_fewer_queries_and_softcap():
    """End-aligned positions (n_q < n_k), query heads sharing a kv head, and the bias added
    after the cap (its gradient is the biased score's, before the cap's slope)."""
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 8, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, 8), np.float64, seed=4)
    _, k, v, _ = _inputs((2, 2, n_k, 8), np.float64, seed=5)
    slopes = _slopes(2, 4, True, 6)
    check_operands(REFERENCE, q, k, v, dout, layout, REF_RTOL, SOFTCAP, slopes)


def test_reference_alibi_changes_the_result():
    layout = make_test_layout("causal", 16, 24)
    q, k, v, _ = _inputs((1, HEADS, 24, 8), np.float64, seed=7)
    plain = REFERENCE.forward(q, k, v, AttentionCall(layout, 0.5))
    slopes = _slopes(1, HEADS, False, 8)
    biased = REFERENCE.forward(
        q,
        k,
        v,
        AttentionCall(layout, 0.5, mods=ScoreMods(alibi=True)).with_operands(ScoreOperands(slopes)),
    )
    assert rel_err(biased[0], plain[0]) > 0.1
    zero = REFERENCE.forward(
        q,
        k,
        v,
        AttentionCall(layout, 0.5, mods=ScoreMods(alibi=True)).with_operands(
            ScoreOperands(0 * slopes)
        ),
    )
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
    check_operands(interp, q, k, v, dout, layout, TOLERANCE[dtype], slopes=slopes, dlse=dlse)


def test_kernels_alibi_with_softcap_gqa_fewer_queries_bit_identical(mods_kernels):  # noqa: F811
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 16, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, HEAD_DIM), "float32", seed=11)
    _, k, v, _ = _inputs((2, 2, n_k, HEAD_DIM), "float32", seed=12)
    slopes = _slopes(2, 4, False, 13)
    check_bit_identical(interp, q, k, v, dout, layout, TOLERANCE["float32"], SOFTCAP, slopes)


def test_alibi_slopes_sets_its_flag():
    """The call flags the operand it carries (the kernels' variant follows the flag)."""
    layout = make_test_layout("causal", 16, 24)
    q, k, v, _ = _inputs((1, HEADS, 24, 8), np.float64, seed=14)
    slopes = _slopes(1, HEADS, False, 15)
    check_sets_its_flag("alibi_slopes", slopes, "alibi", q, k, v, layout)


def test_a_bias_refuses_a_permuted_layout_where_the_call_is_built():
    slopes = _slopes(1, HEADS, False, 15)
    permuted = make_layout("strided", 32, HEADS, 8, local_attn_ctx=4)
    assert permuted.perm is not None
    with pytest.raises(ValueError, match="alibi_slopes needs the natural token order"):
        AttentionCall(permuted, 0.5).with_operands(ScoreOperands(slopes))
    call = AttentionCall(Pattern("strided", HEADS, 8, local_attn_ctx=4), 0.5)
    call = call.with_operands(ScoreOperands(slopes))  # a Pattern: refused once it is built
    with pytest.raises(ValueError, match="alibi_slopes needs the natural token order"):
        call.for_lengths(32, 32)
