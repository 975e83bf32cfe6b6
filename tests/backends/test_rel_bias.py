"""A relative-position table (``rel_bias``, T5's and Swin's learned bias by distance) on the
NumPy reference and the kernels' MODS_SCORE variants through the CPU interpreter, forward and
every gradient (q, k, v and the table), against the float64 dense oracle with the table's bias
gathered for every (query, key); alone and with a softcap, ALiBi and a key bias, one table per
head or per (batch, head), distances inside and past the table's reach.

The table is a runtime value of the score-modifier variant: these tests run the instantiations
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


def _table(batch: int | None, heads: int, max_distance: int, seed: int) -> np.ndarray:
    """A table of spread biases, [heads, 2M + 1] (batch None) or [batch, heads, 2M + 1]."""
    shape = (heads, 2 * max_distance + 1) if batch is None else (batch, heads, 2 * max_distance + 1)
    return (np.random.default_rng(seed).standard_normal(shape) * 1.5).astype(np.float32)


@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("rule", geometry.RULES)
def test_reference_rel_bias_matches_the_oracle(rule, per_batch):
    n = n_ctx_for(16)
    layout = make_test_layout(rule, 16, n)
    q, k, v, dout = _inputs((2, HEADS, n, 8), np.float64, seed=1)
    table = _table(2 if per_batch else None, HEADS, 5, 2)  # most pairs are past 5 apart
    check_operands(REFERENCE, q, k, v, dout, layout, REF_RTOL, rel_bias=table)


@pytest.mark.parametrize("max_distance", [0, 1, 60])
def test_reference_rel_bias_with_everything_else(max_distance):
    """Softcap, ALiBi, a key bias, GQA and fewer queries than keys (end-aligned positions);
    a table of one column (every distance clamps to it), and one reaching past every pair."""
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 8, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, 8), np.float64, seed=3)
    _, k, v, _ = _inputs((2, 2, n_k, 8), np.float64, seed=4)
    slopes = np.random.default_rng(5).uniform(0.05, 0.5, 4).astype(np.float32)
    key_bias = (np.random.default_rng(6).standard_normal((2, n_k)) * 2).astype(np.float32)
    table = _table(None, 4, max_distance, 7)
    check_operands(
        REFERENCE, q, k, v, dout, layout, REF_RTOL, SOFTCAP, slopes, key_bias, rel_bias=table
    )


def test_rel_bias_sets_its_flag():
    """The call flags the operand it carries (the kernels' variant follows the flag)."""
    layout = make_test_layout("causal", 16, 24)
    q, k, v, _ = _inputs((1, HEADS, 24, 8), np.float64, seed=12)
    table = _table(None, HEADS, 3, 13)
    check_sets_its_flag("rel_bias", table, "rel_bias", q, k, v, layout)


KERNEL_CASES = [(16, HEAD_DIM, dtype, "causal", False) for dtype in geometry.DTYPES]
KERNEL_CASES += [(16, HEAD_DIM, "float32", rule, True) for rule in ("none", "bitmask")]
KERNEL_CASES += [(64, HEAD_DIM, "float16", "causal", True)]
KERNEL_CASES += [(128, HEAD_DIM, "float16", "window", False)]


@pytest.mark.parametrize(("block", "head_dim", "dtype", "rule", "per_batch"), KERNEL_CASES)
def test_kernels_rel_bias_match_the_oracle(mods_kernels, block, head_dim, dtype, rule, per_batch):  # noqa: F811
    n = n_ctx_for(block) if block < 128 else 150
    layout = make_test_layout(rule, block, n)
    q, k, v, dout = _inputs((2, HEADS, n, head_dim), dtype, seed=block + head_dim)
    table = _table(2 if per_batch else None, HEADS, 20, 7)  # clamped columns in every tile size
    check_operands(interp, q, k, v, dout, layout, TOLERANCE[dtype], rel_bias=table)


@pytest.mark.parametrize("max_distance", [1, 3])
def test_kernels_rel_bias_with_everything_else_bit_identical(mods_kernels, max_distance):  # noqa: F811
    """Softcap, ALiBi and a key bias beside the table, GQA, fewer queries than keys; a second
    run gives the same bits (the table's gradient is summed in a fixed order)."""
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 16, n_q=n_q)
    q, _, _, dout = _inputs((2, 4, n_q, HEAD_DIM), "float32", seed=8)
    _, k, v, _ = _inputs((2, 2, n_k, HEAD_DIM), "float32", seed=9)
    slopes = np.random.default_rng(10).uniform(0.05, 0.5, 4).astype(np.float32)
    key_bias = (np.random.default_rng(11).standard_normal((2, 4, n_k)) * 2).astype(np.float32)
    table = _table(None, 4, max_distance, 12)
    args = (interp, q, k, v, dout, layout, TOLERANCE["float32"], SOFTCAP, slopes, key_bias)
    check_bit_identical(*args, rel_bias=table)


def test_kernels_one_column_table_gets_every_scores_gradient(mods_kernels):  # noqa: F811
    """max_distance 0: one column that every score reads; its gradient is the sum of every dS,
    which is the lse's gradient (a row's dS sums to its dlse), so dlse is given."""
    layout = make_layout("all", 40, HEADS, 16, causal=False)  # keys on both sides
    q, k, v, dout = _inputs((2, HEADS, 40, HEAD_DIM), "float32", seed=14)
    dlse = np.random.default_rng(15).standard_normal(q.shape[:3]).astype(np.float32)
    table = _table(None, HEADS, 0, 16)
    check_operands(interp, q, k, v, dout, layout, TOLERANCE["float32"], dlse=dlse, rel_bias=table)
