"""Score modifiers (backends/call.py ScoreMods: softcap) on the NumPy reference and the kernels'
MODS_SCORE variants through the CPU interpreter, forward and backward, against the float64
dense oracle with the same modifiers.

Inputs are scaled up (SCORE_SPREAD) so that the cap bends most scores: a softcap that changed
nothing would pass a test on unit-normal inputs. The interpreter runs every dtype and rule at
block 16 and head dim 32; a 64-block (several fragments per tile) and head dim 128 (the kernels
nearest their register limit, other tiles) once each: the modifier's code is the same for every
block, which the plain grid (test_interp_kernels*.py) covers. Each group of instantiations is
built only here.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import NumpyBackend, geometry, interp, numpy_ref
from cuattn.backends.call import NO_MODS, AttentionCall, ScoreMods
from cuattn.layout import make_layout
from cuattn.tools.oracle import dense_attention, dense_attention_grads, rel_err
from tests.backends.test_interp_kernels import (
    HEADS,
    NUMPY_DTYPES,
    TOLERANCE,
    make_test_layout,
    n_ctx_for,
)

SOFTCAP = 2.0
SCORE_SPREAD = 3.0  # inputs times this: scores of a few softcaps, where tanh bends them
REF_RTOL = 1e-12  # the float64 reference against the float64 oracle
HEAD_DIM = 32
CASES = [(16, HEAD_DIM, dtype, rule) for dtype in geometry.DTYPES for rule in geometry.RULES]
CASES += [(64, HEAD_DIM, "float16", "causal"), (32, 128, "bfloat16", "bitmask")]
REFERENCE = NumpyBackend()


def _inputs(shape, dtype, seed, kv_heads=None):
    rng = np.random.default_rng(seed)
    kv_shape = shape if kv_heads is None else (shape[0], kv_heads, *shape[2:])
    q, dout = (rng.standard_normal(shape) * SCORE_SPREAD for _ in range(2))
    k, v = (rng.standard_normal(kv_shape) * SCORE_SPREAD for _ in range(2))
    return [x.astype(NUMPY_DTYPES.get(dtype, dtype)) for x in (q, k, v, dout)]


def _check(backend, q, k, v, dout, layout, tolerance, dlse=None):
    """forward and backward of ``backend`` with the softcap against the oracle."""
    scale = q.shape[-1] ** -0.5
    mods = ScoreMods(SOFTCAP)
    mask = layout.to_mask()
    out, lse = backend.forward(q, k, v, AttentionCall(layout, scale, mods=mods))
    ref_out, ref_lse = dense_attention(q, k, v, mask, scale, softcap=SOFTCAP)
    empty = np.isneginf(ref_lse)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert rel_err(out, ref_out) <= tolerance
    assert rel_err(lse[~empty], ref_lse[~empty]) <= tolerance
    grads = backend.backward(q, k, v, out, lse, dout, dlse, AttentionCall(layout, scale, mods=mods))
    refs = dense_attention_grads(q, k, v, dout, mask, scale, dlse, softcap=SOFTCAP)
    for name, grad, ref in zip("qkv", grads, refs, strict=True):
        assert not np.isnan(np.asarray(grad, np.float32)).any(), f"d{name}"
        assert rel_err(grad, ref) <= tolerance, f"d{name}"
    return out, lse, grads


@pytest.mark.parametrize("rule", geometry.RULES)
def test_reference_softcap_matches_the_oracle(rule):
    n = n_ctx_for(16)
    layout = make_test_layout(rule, 16, n)
    q, k, v, dout = _inputs((2, HEADS, n, 8), np.float64, seed=1)
    dlse = np.random.default_rng(2).standard_normal(q.shape[:3])
    _check(REFERENCE, q, k, v, dout, layout, REF_RTOL, dlse)


def test_reference_softcap_gqa_and_fewer_queries():
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 8, n_q=n_q)
    q, _, _, dout = _inputs((1, 4, n_q, 8), np.float64, seed=3)
    _, k, v, _ = _inputs((1, 2, n_k, 8), np.float64, seed=4)
    _check(REFERENCE, q, k, v, dout, layout, REF_RTOL)


def test_reference_softcap_changes_the_result_and_zero_is_off():
    layout = make_test_layout("causal", 16, 24)
    q, k, v, _ = _inputs((1, HEADS, 24, 8), np.float64, seed=5)
    plain = numpy_ref.attention_forward(q, k, v, AttentionCall(layout, 0.5))
    capped = numpy_ref.attention_forward(
        q, k, v, AttentionCall(layout, 0.5, mods=ScoreMods(SOFTCAP))
    )
    assert rel_err(capped[0], plain[0]) > 0.1  # the cap bends these scores a lot
    assert not ScoreMods(0.0).any
    off = numpy_ref.attention_forward(q, k, v, AttentionCall(layout, 0.5, mods=ScoreMods(0.0)))
    np.testing.assert_array_equal(off[0], plain[0])


def test_reference_softcap_keeps_huge_scores_finite():
    """A capped score is finite whatever q.k is: no overflow to inf (whose row would be NaN
    uncapped), and the gradient through a saturated tanh is 0, not NaN."""
    layout = make_test_layout("none", 16, 24)
    q, k, v, dout = _inputs((1, HEADS, 24, 8), np.float64, seed=6)
    q = q * 1e200
    scale = 8**-0.5
    out, lse = numpy_ref.attention_forward(
        q, k, v, AttentionCall(layout, scale, mods=ScoreMods(SOFTCAP))
    )
    grads = numpy_ref.attention_backward(
        q, k, v, out, lse, dout, None, AttentionCall(layout, scale, mods=ScoreMods(SOFTCAP))
    )
    assert np.isfinite(out).all() and not np.isnan(lse).any()
    assert all(np.isfinite(g).all() for g in grads)


@pytest.fixture(scope="module")
def mods_kernels():
    """The MODS_SCORE groups this file runs, built up front on every core."""
    wanted = {(head_dim, dtype) for _, head_dim, dtype, _ in CASES}
    interp.prepare(
        c
        for c in geometry.all_configs()
        if getattr(c, "mods", False) and (c.head_dim, c.dtype) in wanted
    )


@pytest.mark.parametrize(("block", "head_dim", "dtype", "rule"), CASES)
def test_kernels_softcap_match_the_oracle(mods_kernels, block, head_dim, dtype, rule):
    n = n_ctx_for(block)
    layout = make_test_layout(rule, block, n)
    q, k, v, dout = _inputs((1, HEADS, n, head_dim), dtype, seed=block + head_dim)
    dlse = np.random.default_rng(7).standard_normal(q.shape[:3]).astype(np.float32)
    _check(interp, q, k, v, dout, layout, TOLERANCE[dtype], dlse)


def test_kernels_softcap_gqa_fewer_queries_bit_identical(mods_kernels):
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 16, n_q=n_q)
    q, _, _, dout = _inputs((1, 4, n_q, HEAD_DIM), "float32", seed=9)
    _, k, v, _ = _inputs((1, 2, n_k, HEAD_DIM), "float32", seed=10)
    first = _check(interp, q, k, v, dout, layout, TOLERANCE["float32"])
    again = _check(interp, q, k, v, dout, layout, TOLERANCE["float32"])
    for a, b in zip((first[0], first[1], *first[2]), (again[0], again[1], *again[2]), strict=True):
        np.testing.assert_array_equal(a, b)


def test_no_mods_runs_the_plain_kernels():
    """Without a modifier the call's configs name MODS_NONE; with one, MODS_SCORE."""
    plain = geometry.KernelConfig(
        "attn_fwd", 32, "float32", block=16, rule="causal", mods=NO_MODS.any
    )
    capped = geometry.KernelConfig(
        "attn_fwd", 32, "float32", block=16, rule="causal", mods=ScoreMods(SOFTCAP).any
    )
    assert plain.name_expression.endswith("MODS_NONE>")
    assert capped.name_expression.endswith("MODS_SCORE>")
    assert plain.group != capped.group  # a call without modifiers never builds their library


def test_a_scale_that_is_not_positive_runs_the_variant(mods_kernels):
    """The plain kernels fold a positive scale into the forward's exp2 FMA; a negative or zero
    scale (the softmax favouring the smallest scores; uniform attention) runs the variant,
    which scales each score first, and matches the reference."""
    from cuattn.backends.kernels import modifier_variant

    assert not modifier_variant(NO_MODS, 0.125)
    assert modifier_variant(NO_MODS, -0.125) and modifier_variant(NO_MODS, 0.0)
    n = n_ctx_for(16)
    layout = make_test_layout("causal", 16, n)
    q, k, v, dout = _inputs((1, HEADS, n, HEAD_DIM), "float32", seed=21)
    for scale in (-0.3, 0.0):
        out, lse = interp.forward(q, k, v, AttentionCall(layout, scale))
        ref_out, ref_lse = REFERENCE.forward(q, k, v, AttentionCall(layout, scale))
        assert rel_err(out, ref_out) <= TOLERANCE["float32"]
        empty = np.isneginf(ref_lse)
        assert rel_err(lse[~empty], ref_lse[~empty]) <= TOLERANCE["float32"]
