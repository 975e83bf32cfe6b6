"""NaN, inf, scores that overflow and denormals (docs/design.md §7, "Special values"): the NumPy
backend, the kernels through the CPU interpreter and the dense float64 oracle give the same
answer, forward (out, lse) and backward (dq, dk, dv), NaN for NaN, inf for inf, and every finite
element within rounding; torch's SDPA in float64 agrees wherever its semantics are the contract's.

The oracle is told which (query, key) pairs the backends compute (``computed_pairs``: the
layout's active blocks; with block 16 and head dim 16 the kernels' tiles are those blocks), since
0 * NaN = NaN reaches rows that mask a key only inside computed blocks. No NumPy warning leaks.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import cuattn
from cuattn.backends import interp, numpy_ref
from cuattn.backends.call import AttentionCall
from cuattn.layout.layout import Layout
from cuattn.tools.oracle import computed_pairs, dense_attention, dense_attention_grads
from tests.helpers.special_values import assert_same

BATCH, HEADS, KV_HEADS, N, D, BLOCK = 2, 2, 1, 40, 16, 16
SCALE = 1.0  # so that q.k itself is the score: its overflow is the score's
# (input dtype, huge value h with h * h beyond the score type's range, h itself finite)
HUGE = {np.float64: 1e160, np.float32: 1e20}
SUBNORMAL = {np.float64: 1e-310, np.float32: 1e-41}
# per-element |x - ref| <= tol * (|ref| + median |ref|) on the finite elements
TOL = {np.float64: 1e-9, np.float32: 2e-4}


def holes_fn(h, q, k):
    # causal, and queries 3, 10, 17, ... (head 0) / 4, 11, ... (head 1) see nothing at all
    # although their blocks are computed
    return (k <= q) & (q % 7 != 3 + h)


def layouts() -> dict[str, Layout]:
    nb = -(-N // BLOCK)
    return {
        "causal": cuattn.make_layout("all", N, HEADS, BLOCK),
        # key block 0 is computed for query blocks 0 and 1 only: rows 32+ never touch keys 0-15
        "local": cuattn.make_layout("local", N, HEADS, BLOCK, local_attn_ctx=BLOCK),
        "holes": Layout.from_blocks(
            np.tril(np.ones((HEADS, nb, nb), bool)), BLOCK, holes_fn, n_ctx=N
        ),
        "dense": cuattn.make_layout("all", N, HEADS, BLOCK, causal=False),
        # query block 1 computes key blocks 0 and 1 but none of its rows allows a key; nothing
        # else touches key block 0: a special value there meets only empty rows
        "hollow": Layout.from_blocks(
            np.broadcast_to(np.array([[0, 0, 0], [1, 1, 0], [0, 0, 1]], bool), (HEADS, nb, nb)),
            BLOCK,
            lambda h, q, k: (k <= q) & (q // BLOCK != 1),
            n_ctx=N,
        ),
    }


LAYOUTS = layouts()


def inputs(dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((BATCH, HEADS, N, D))
    k, v = (rng.standard_normal((BATCH, KV_HEADS, N, D)) for _ in "kv")
    dout = rng.standard_normal((BATCH, HEADS, N, D))
    # dimension 0 carries the special values alone, so they touch only the scores meant
    q[..., 0] = k[..., 0] = 0.0
    return q, k, v, dout


# Each case edits (q, k, v) in float64 for a given input dtype; keys and queries in the first
# and the last blocks, in batch 1 and head 1 (GQA: heads 0 and 1 share kv head 0).
def nan_in_q(q, k, v, dt):
    q[1, 1, 5, 3] = np.nan  # row 5 of head 1 is NaN


def nan_in_k(q, k, v, dt):
    k[1, 0, 5, 3] = np.nan  # every row that allows key 5 is NaN


def nan_in_v(q, k, v, dt):
    v[1, 0, 5, 3] = np.nan  # every row whose computed blocks hold key 5


def inf_in_v(q, k, v, dt):
    v[0, 0, 33, 2] = -np.inf


def plus_inf_score(q, k, v, dt):
    q[1, 1, 9, 0] = k[1, 0, 3, 0] = HUGE[dt]  # s[9, 3] = +inf: row 9 is NaN (inf - inf)


def minus_inf_score(q, k, v, dt):
    q[1, 1, 9, 0], k[1, 0, 3, 0] = HUGE[dt], -HUGE[dt]  # s[9, 3] = -inf: a zero probability


def every_score_minus_inf(q, k, v, dt):
    # row 20 scores -inf against every key (positive dimension 0): out 0, lse -inf; in the
    # backward dS = 0 meets q = -inf (0 * inf = NaN in dk)
    k[..., 0] = 1.0 + np.abs(k[..., 1])
    q[0, 1, 20, :] = 0.0
    q[0, 1, 20, 0] = -np.inf


def inf_in_k(q, k, v, dt):
    # key 30 scores +inf or -inf by the sign of q[:, 0]: NaN rows and zero probabilities, and
    # dq = dS k meets 0 * inf
    q[..., 0] = np.where(np.arange(N) % 3 == 0, -1.0, 1.0)
    k[0, 0, 30, 0] = np.inf


def huge_finite(q, k, v, dt):
    # large but finite scores: one key takes (almost) all the probability
    q[0, 0, 12, 0] = k[0, 0, 7, 0] = np.sqrt(HUGE[dt]) * 1e-3


def subnormal_qk(q, k, v, dt):
    q *= SUBNORMAL[dt]  # scores underflow to 0: uniform attention
    k *= SUBNORMAL[dt]


def subnormal_v(q, k, v, dt):
    v *= SUBNORMAL[dt]


CASES = [
    nan_in_q,
    nan_in_k,
    nan_in_v,
    inf_in_v,
    plus_inf_score,
    minus_inf_score,
    every_score_minus_inf,
    inf_in_k,
    huge_finite,
    subnormal_qk,
    subnormal_v,
]
# cases whose special values touch only allowed scores: torch's SDPA (a boolean mask is added
# as -inf, so a NaN or inf score it masks still poisons its row) computes what the contract says
SDPA_CASES = [nan_in_q, plus_inf_score, minus_inf_score, every_score_minus_inf, huge_finite]


# gradients through a huge finite score are ill-conditioned (rounding noise times the huge key):
# only where they are NaN or inf is compared
VALUES_OF_GRADIENTS_UNCOMPARABLE = (huge_finite,)


def case_arrays(case, dt, seed=0, cast=None):
    """The case's (q, k, v, dout) with values for dtype dt, cast to ``cast`` (default dt)."""
    q, k, v, dout = inputs(dt, seed)
    case(q, k, v, dt)
    return [x.astype(cast or dt) for x in (q, k, v, dout)]


def expected(arrays, layout, all_pairs=False):
    """The oracle's (out, lse, dq, dk, dv) in float64 for these inputs, scores formed in the
    backends' accumulation type."""
    q, k, v, dout = arrays
    mask = layout.to_mask()
    computed = None if all_pairs else computed_pairs(layout)
    score_dtype = None if q.dtype == np.float64 else np.float32
    out, lse = dense_attention(q, k, v, mask, SCALE, computed, score_dtype)
    grads = dense_attention_grads(
        q, k, v, dout, mask, SCALE, computed=computed, score_dtype=score_dtype
    )
    return (out, lse, *grads)


def assert_all_same(got, want, tol, dtype, case):
    names = ("out", "lse", "dq", "dk", "dv")
    if len(got) == 4:  # SDPA: no lse
        got = (got[0], None, *got[1:])
    for name, g, w in zip(names, got, want, strict=True):
        if w is None:
            continue
        grad = name.startswith("d")
        assert_same(
            name, g, w, np.inf if grad and case in VALUES_OF_GRADIENTS_UNCOMPARABLE else tol, dtype
        )


def run_backend(module, q, k, v, dout, layout):
    """(out, lse, dq, dk, dv) of a backend module (numpy_ref or interp), warnings as errors."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        call = AttentionCall(layout, SCALE)
        out, lse = module.attention_forward(q, k, v, call)
        grads = module.attention_backward(q, k, v, out, lse, dout, None, call)
    return (out, lse, *grads)


class _Interp:
    attention_forward = staticmethod(interp.forward)
    attention_backward = staticmethod(interp.backward)


@pytest.mark.parametrize("layout_name", ["causal", "local", "holes", "hollow"])
@pytest.mark.parametrize("dt", [np.float64, np.float32])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_numpy_backend_follows_the_oracle(case, dt, layout_name):
    layout = LAYOUTS[layout_name]
    arrays = case_arrays(case, dt)
    got = run_backend(numpy_ref, *arrays, layout)
    assert_all_same(got, expected(arrays, layout), TOL[dt], dt, case)


@pytest.mark.parametrize("layout_name", ["causal", "local", "holes", "hollow"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_kernels_on_the_interpreter_follow_the_oracle(case, layout_name):
    layout = LAYOUTS[layout_name]
    arrays = case_arrays(case, np.float32)
    got = run_backend(_Interp, *arrays, layout)
    assert_all_same(got, expected(arrays, layout), TOL[np.float32], np.float32, case)


@pytest.mark.parametrize("case", [nan_in_q, nan_in_k, nan_in_v, every_score_minus_inf])
def test_float16_on_numpy_and_the_interpreter(case):
    """Half inputs: the same specials, the scores in float32."""
    layout = LAYOUTS["holes"]
    arrays = case_arrays(case, np.float32, cast=np.float16)
    want = expected(arrays, layout)
    for module in (numpy_ref, _Interp):
        got = run_backend(module, *arrays, layout)
        assert_all_same(got, want, 2e-2, np.float16, case)


def test_nan_in_v_reaches_rows_through_computed_blocks_only():
    """The contract for v, spelled out on the local layout: key 5 (block 0) is allowed for rows
    5-20, masked but computed for rows 0-4 and 21-31, and in no computed block of rows 32+."""
    layout = LAYOUTS["local"]
    q, k, v, dout = case_arrays(nan_in_v, np.float32)
    for module in (numpy_ref, _Interp):
        out = module.attention_forward(q, k, v, AttentionCall(layout, SCALE))
        rows_nan = np.isnan(out[0][1]).any(axis=-1)  # batch 1, [heads, rows]
        assert rows_nan[:, :32].all() and not rows_nan[:, 32:].any()
    # SDPA's dense P V multiplies p = 0 by v[5] in every row
    sdpa_out = sdpa(*(x.astype(np.float64) for x in (q, k, v, dout)), layout.to_mask())[0]
    assert np.isnan(sdpa_out[1]).any(axis=-1).all()


def sdpa(q, k, v, dout, mask):
    """torch SDPA in float64 (k, v repeated for GQA): out, dq, dk, dv."""
    torch = pytest.importorskip("torch")
    group = HEADS // KV_HEADS
    tq = torch.tensor(q, requires_grad=True)
    tk, tv = (torch.tensor(x, requires_grad=True) for x in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(
        tq,
        tk.repeat_interleave(group, dim=1),
        tv.repeat_interleave(group, dim=1),
        attn_mask=torch.tensor(np.ascontiguousarray(mask)),
        scale=SCALE,
    )
    out.backward(torch.tensor(dout))
    return [x.detach().numpy() for x in (out, tq.grad, tk.grad, tv.grad)]


@pytest.mark.parametrize("case", SDPA_CASES, ids=lambda c: c.__name__)
def test_oracle_is_sdpa_where_the_contract_is_sdpa(case):
    """Every pair computed (the oracle's default) and specials on allowed scores only: the
    oracle and torch's SDPA in float64 give the same out and gradients."""
    layout = LAYOUTS["causal"]
    arrays = case_arrays(case, np.float64)
    out, _, dq, dk, dv = expected(arrays, layout, all_pairs=True)
    got = sdpa(*arrays, layout.to_mask())
    assert_all_same(got, (out, None, dq, dk, dv), 1e-9, np.float64, case)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_torch_float64_through_the_public_call_is_sdpa_on_a_dense_layout(case):
    """A layout with every block active computes every pair, as SDPA does; with no mask its
    -inf addition cannot differ from replacement. cuattn on torch float64 (the NumPy backend
    under torch.autograd) gives SDPA's NaN, inf and values."""
    torch = pytest.importorskip("torch")
    layout = LAYOUTS["dense"]
    arrays = q, k, v, dout = case_arrays(case, np.float64)
    want = sdpa(q, k, v, dout, layout.to_mask())
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = cuattn.sparse_attention(tq, tk, tv, layout, SCALE, return_lse=True)
        out.backward(torch.tensor(dout))
    got = [x.detach().numpy() for x in (out, lse, tq.grad, tk.grad, tv.grad)]
    want = (want[0], expected(arrays, layout)[1], *want[1:])  # SDPA gives no lse: the oracle's
    assert_all_same(got, want, 1e-9, np.float64, case)


# ---- merge_attention_states -------------------------------------------------------------------


def merge_inputs(dtype):
    rng = np.random.default_rng(3)
    rows, head_dim = 8, 16
    out_a, out_b = (rng.standard_normal((rows, head_dim)).astype(dtype) for _ in "ab")
    lse_a, lse_b = (rng.standard_normal(rows).astype(np.float32) for _ in "ab")
    lse_a[0] = np.nan  # a NaN side: NaN row
    lse_a[1] = np.inf  # +inf: inf - inf, NaN row
    lse_a[2], lse_b[2] = np.nan, -np.inf  # NaN against an empty side: still NaN
    out_a[3, 4] = np.nan  # NaN in a contributing side's out: NaN there
    lse_a[4], out_a[4] = lse_b[4] - 200.0, np.nan  # contributes, however little
    lse_a[5], out_a[5] = -np.inf, np.nan  # empty: contributes nothing
    lse_a[6] = lse_b[6] = -np.inf  # nothing at all: 0 and -inf
    out_b[7, 1] = np.inf  # inf in a contributing side's out
    return out_a, lse_a, out_b, lse_b


def merge_expected(out_a, lse_a, out_b, lse_b):
    """The formula row by row in float64, an empty side skipped."""
    rows, head_dim = out_a.shape
    out, lse = np.zeros((rows, head_dim)), np.full(rows, -np.inf)
    with np.errstate(invalid="ignore"):
        for r in range(rows):
            sides = [
                (float(lse_x[r]), out_x[r].astype(np.float64))
                for lse_x, out_x in ((lse_a, out_a), (lse_b, out_b))
                if lse_x[r] != -np.inf
            ]
            if not sides:
                continue
            lse[r] = np.log(sum(np.exp(s) for s, _ in sides))
            if np.isposinf(lse[r]) or np.isnan(lse[r]):
                lse[r] = np.nan
            out[r] = sum(np.exp(s - lse[r]) * o for s, o in sides)
    return out, lse


@pytest.mark.parametrize("backend", ["numpy", "interp"])
def test_merge_states_carries_nan_from_a_side_that_contributes(backend):
    arrays = merge_inputs(np.float32)
    want_out, want_lse = merge_expected(*arrays)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = cuattn.merge_attention_states(*arrays, backend=backend)
    assert_same("out", out, want_out, 1e-5)
    assert_same("lse", lse, want_lse, 1e-6)
    assert np.isnan(out[:3]).all() and np.isnan(lse[:3]).all()
    assert np.isnan(out[3, 4]) and np.isfinite(np.delete(out[3], 4)).all()
    assert np.isnan(out[4]).all() and np.isfinite(lse[4])
    assert np.isfinite(out[5]).all() and out[6].tolist() == [0.0] * 16 and lse[6] == -np.inf
