"""A dense score bias (``score_bias``, broadcastable to [batch, heads, n_q, n_k]: xformers'
attn_bias, SDPA's float mask) on the kernels' MODS_SCORE variants through the CPU interpreter,
forward and every gradient (q, k, v and the bias, summed over its broadcast axes) against the
float64 dense oracle: every broadcast shape, strided and transposed views, -inf entries and
whole -inf rows, float32 and 16-bit biases, block sizes 16/64/128, GQA with fewer queries than
keys, with a softcap, ALiBi and dropout bit-identical run to run; and that the kernels read it
only where the layout computes (NaN everywhere else changes nothing).

The bias is a runtime value of the score-modifier variant: these tests run the instantiations
tests/backends/test_score_mods.py builds, each library built on first use.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import NumpyBackend, geometry, interp
from cuattn.backends.call import AttentionCall, ScoreOperands
from cuattn.layout import make_layout
from tests.backends.test_interp_kernels import HEADS, TOLERANCE, make_test_layout, n_ctx_for
from tests.backends.test_score_mods import HEAD_DIM, SOFTCAP, _inputs
from tests.helpers.opt_in import check_opt_in
from tests.helpers.score_operands import check_bit_identical, check_operands

REF_RTOL = 1e-12
REFERENCE = NumpyBackend()
BATCH = 2


def _bias(shape, dtype, seed: int) -> np.ndarray:
    """Spread biases in ``dtype`` (float32, or q's 16-bit dtype as q's arrays hold it), with a
    few -inf entries (a masked pair, a masked key)."""
    rng = np.random.default_rng(seed)
    bias = rng.standard_normal(shape) * 2
    flat = bias.reshape(-1)
    flat[rng.choice(flat.size, max(1, flat.size // 50), replace=False)] = -np.inf
    return bias.astype(dtype)


SHAPES = {
    "full": lambda n_q, n_k: (BATCH, HEADS, n_q, n_k),
    "per_head": lambda n_q, n_k: (1, HEADS, n_q, n_k),
    "plane": lambda n_q, n_k: (n_q, n_k),
    "padding": lambda n_q, n_k: (BATCH, 1, 1, n_k),
    "by_key_rank3": lambda n_q, n_k: (HEADS, 1, n_k),
    "by_query": lambda n_q, n_k: (BATCH, 1, n_q, 1),
}


def test_reference_score_bias_matches_the_oracle():
    n = n_ctx_for(16)
    layout = make_test_layout("causal", 16, n)
    q, k, v, dout = _inputs((BATCH, HEADS, n, 8), np.float64, seed=1)
    for i, shape in enumerate(SHAPES.values()):
        bias = _bias(shape(n, n), np.float32, seed=2 + i)
        check_operands(REFERENCE, q, k, v, dout, layout, REF_RTOL, score_bias=bias)


@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernels_score_bias_broadcast_shapes(shape):
    n = n_ctx_for(16)
    layout = make_test_layout("causal", 16, n)
    q, k, v, dout = _inputs((BATCH, HEADS, n, HEAD_DIM), "float32", seed=3)
    bias = _bias(SHAPES[shape](n, n), np.float32, seed=4)
    # a gradient reaching the lse too: without one, a per-query bias's gradient (the sum of dS
    # over a row) is 0 up to rounding
    dlse = np.random.default_rng(5).standard_normal(q.shape[:3]).astype(np.float32)
    check_operands(interp, q, k, v, dout, layout, TOLERANCE["float32"], dlse=dlse, score_bias=bias)


def test_kernels_score_bias_strided_and_transposed_views():
    """Views read in place at their strides: a transposed [n_k, n_q] array, every other
    column of a wider one whose other columns are NaN (read, they would poison the rows), and
    a flipped one (negative strides)."""
    n = n_ctx_for(16)
    layout = make_test_layout("window", 16, n)
    q, k, v, dout = _inputs((BATCH, HEADS, n, HEAD_DIM), "float32", seed=5)
    transposed = _bias((BATCH, HEADS, n, n), np.float32, seed=6).swapaxes(-1, -2)
    assert not transposed.flags.c_contiguous
    check_operands(interp, q, k, v, dout, layout, TOLERANCE["float32"], score_bias=transposed)
    wide = np.full((HEADS, n, 2 * n), np.nan, np.float32)
    wide[:, :, ::2] = _bias((HEADS, n, n), np.float32, seed=7)
    strided = wide[:, None, :, ::2]
    check_operands(interp, q, k, v, dout, layout, TOLERANCE["float32"], score_bias=strided)
    flipped = np.flip(_bias((BATCH, 1, n, n), np.float32, seed=8), axis=(-2, -1))
    check_operands(interp, q, k, v, dout, layout, TOLERANCE["float32"], score_bias=flipped)


CASES = [
    (16, dtype, bias_dtype) for dtype in ("float16", "bfloat16") for bias_dtype in ("q", "float32")
]
CASES += [(64, "float16", "q"), (128, "bfloat16", "float32")]


@pytest.mark.parametrize(("block", "dtype", "bias_dtype"), CASES)
def test_kernels_score_bias_dtypes_and_blocks(block, dtype, bias_dtype):
    """A bias in float32 or in q's own 16-bit dtype (read as the kernel's type, not cast)."""
    n = n_ctx_for(block) if block < 128 else 150
    layout = make_test_layout("causal" if block < 128 else "window", block, n)
    q, k, v, dout = _inputs((BATCH, HEADS, n, HEAD_DIM), dtype, seed=block)
    bias = _bias((1, HEADS, n, n), q.dtype if bias_dtype == "q" else np.float32, seed=8)
    check_operands(interp, q, k, v, dout, layout, TOLERANCE[dtype], score_bias=bias)


def test_kernels_score_bias_whole_rows_masked():
    """Rows whose every bias is -inf: out 0, lse -inf, no NaN anywhere, no gradient."""
    n = n_ctx_for(16)
    layout = make_test_layout("bitmask", 16, n)
    q, k, v, dout = _inputs((BATCH, HEADS, n, HEAD_DIM), "float32", seed=9)
    bias = _bias((BATCH, HEADS, n, n), np.float32, seed=10)
    bias[0, 1, 5, :] = -np.inf
    bias[1, :, -1, :] = -np.inf
    out, lse, grads = check_operands(
        interp, q, k, v, dout, layout, TOLERANCE["float32"], score_bias=bias
    )
    assert np.isneginf(lse[0, 1, 5]) and np.isneginf(lse[1, :, -1]).all()
    np.testing.assert_array_equal(out[0, 1, 5], 0)
    np.testing.assert_array_equal(grads[-1][0, 1, 5], 0)


@pytest.mark.parametrize(
    ("rule", "block", "dtype"), [("none", 16, "float32"), ("causal", 64, "float16")]
)
def test_kernels_read_the_bias_only_where_the_layout_computes(rule, block, dtype):
    """NaN at every element the layout does not compute (outside its active blocks, and above
    the diagonal inside them) gives bit for bit what zeros there give: it is never read outside
    the active blocks, and inside them the mask replaces what it masks."""
    n = n_ctx_for(block)
    layout = make_test_layout(rule, block, n)
    q, k, v, dout = _inputs((BATCH, HEADS, n, HEAD_DIM), dtype, seed=11)
    clean = _bias((BATCH, HEADS, n, n), np.float32, seed=12)
    computed = np.broadcast_to(layout.to_mask()[:, :n, :n], clean.shape)
    assert not computed.all()
    clean[~computed] = 0
    poisoned = np.where(computed, clean, np.float32(np.nan))
    runs = [
        check_operands(interp, q, k, v, dout, layout, TOLERANCE[dtype], score_bias=bias)
        for bias in (clean, poisoned)
    ]
    (out_a, lse_a, grads_a), (out_b, lse_b, grads_b) = runs
    for a, b in zip((out_a, lse_a, *grads_a), (out_b, lse_b, *grads_b), strict=True):
        np.testing.assert_array_equal(a, b)


def test_kernels_score_bias_gqa_fewer_queries_with_every_modifier_bit_identical():
    n_k, n_q = 40, 24
    layout = make_layout("all", n_k, 4, 16, n_q=n_q)
    q, _, _, dout = _inputs((BATCH, 4, n_q, HEAD_DIM), "float32", seed=13)
    _, k, v, _ = _inputs((BATCH, 2, n_k, HEAD_DIM), "float32", seed=14)
    slopes = np.random.default_rng(15).uniform(0.05, 0.5, 4).astype(np.float32)
    bias = _bias((4, n_q, n_k), np.float32, seed=16)
    for dropout in (None, (0.25, 1234)):
        args = (interp, q, k, v, dout, layout, TOLERANCE["float32"], SOFTCAP, slopes)
        check_bit_identical(*args, score_bias=bias, dropout=dropout)


def test_score_bias_never_reaches_the_sm90a_family(monkeypatch):
    """Asked for the sm_90a kernels (which take no modifiers), a call with a score bias runs the
    mma.sync variant, forward and backward."""
    backend = interp.backend
    monkeypatch.setattr(backend, "_sm90a_forward", lambda *a: True)
    monkeypatch.setattr(backend, "_sm90a_backward", lambda *a: True)

    def refuse(*args):
        raise AssertionError("a score bias reached the sm_90a family")

    monkeypatch.setattr(backend, "_forward_sm90", refuse)
    monkeypatch.setattr(backend, "_backward_sm90", refuse)
    n = n_ctx_for(16)
    layout = make_test_layout("causal", 16, n)
    q, k, v, dout = _inputs((BATCH, HEADS, n, HEAD_DIM), "float32", seed=17)
    bias = _bias((n, n), np.float32, seed=18)
    check_operands(backend, q, k, v, dout, layout, TOLERANCE["float32"], score_bias=bias)


def test_decode_kernels_refuse_a_score_bias():
    layout = make_test_layout("causal", 16, 16)
    bias = np.zeros((16, 16), np.float32)
    call = AttentionCall(layout, 0.5).with_operands(ScoreOperands(score_bias=bias))
    q = np.zeros((1, HEADS, 1, HEAD_DIM), np.float32)
    with pytest.raises(ValueError, match="score_bias"):
        book = dict(slot_pos=q, page_table=q, page_count=q, lengths=q)
        interp.backend.decode_pages(q, q, q, book, None, call, keep_scores=False, resident_ctas=1)


def test_kernels_score_bias_with_softcap_at_head_dim_256():
    """At d = 256 the dQ kernel recovers each capped score from P less the biases (no room to
    keep the cap's slopes), as dK/dV always does: the score bias is taken back out there too."""
    n = n_ctx_for(16)
    layout = make_test_layout("causal", 16, n)
    q, k, v, dout = _inputs((1, HEADS, n, 256), "float16", seed=19)
    bias = _bias((HEADS, n, n), q.dtype, seed=20)
    check_operands(interp, q, k, v, dout, layout, TOLERANCE["float16"], SOFTCAP, score_bias=bias)


def test_kernels_score_bias_beside_a_key_bias():
    """A padding-mask-shaped score bias and a key bias share dK/dV's per-key sums of dS: each
    still gets its own gradient, shaped like itself."""
    n = n_ctx_for(16)
    layout = make_test_layout("causal", 16, n)
    q, k, v, dout = _inputs((BATCH, HEADS, n, HEAD_DIM), "float32", seed=21)
    key_bias = _bias((BATCH, HEADS, n), np.float32, seed=22)
    bias = _bias((BATCH, 1, 1, n), np.float32, seed=23)
    check_operands(
        interp, q, k, v, dout, layout, TOLERANCE["float32"], key_bias=key_bias, score_bias=bias
    )


def test_kernels_score_bias_with_softcap_at_head_dim_16():
    """d = 16 in 16-bit types steps 32 rows in the variant's backward (geometry:
    MODS_BWD_CAPPED_STEP_FROM_HEAD_DIM): dK/dV's 64-row step spilled with a softcap and a score
    bias. The bitmask rule at 64-blocks is the widest such instantiation."""
    n = n_ctx_for(64)
    layout = make_test_layout("bitmask", 64, n)
    q, k, v, dout = _inputs((1, HEADS, n, 16), "float16", seed=24)
    bias = _bias((HEADS, n, n), q.dtype, seed=25)
    check_operands(interp, q, k, v, dout, layout, TOLERANCE["float16"], SOFTCAP, score_bias=bias)


def test_the_gpu_path_is_opt_in(monkeypatch):
    """No GPU has run the kernels' score bias: on one it needs CUATTN_SCORE_BIAS=kernel; an
    unknown value is refused by name."""
    check_opt_in(monkeypatch, geometry.SCORE_BIAS_ENV, geometry.score_bias_family)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_on_the_gpu(dtype, monkeypatch):
    """CuPy arrays: refused without CUATTN_SCORE_BIAS=kernel; with it, forward and every
    gradient (the bias's too) within the dtype's tolerance of the NumPy reference in float64."""
    from cuattn.backends import resolve_backend
    from cuattn.backends.cuda_runtime import cuda_available
    from cuattn.tools.oracle import rel_err

    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    n = n_ctx_for(64)
    layout = make_test_layout("causal", 64, n)
    host = _inputs((2, HEADS, n, 64), dtype, seed=21)
    bias = _bias((2, 1, n, n), np.float32, seed=22)
    device = [cupy.asarray(x) for x in host]
    cuda = resolve_backend("cuda", on_device=True)
    call = AttentionCall(layout, 0.125).with_operands(ScoreOperands(score_bias=cupy.asarray(bias)))
    monkeypatch.delenv(geometry.SCORE_BIAS_ENV, raising=False)
    with pytest.raises(ValueError, match=geometry.SCORE_BIAS_ENV):
        cuda.forward(*device[:3], call)
    monkeypatch.setenv(geometry.SCORE_BIAS_ENV, geometry.DECODE_FP8_KERNEL_FAMILY)
    out, lse = cuda.forward(*device[:3], call)
    grads = cuda.backward(*device[:3], out, lse, device[3], None, call)
    wide = [x.astype(np.float64) for x in host]
    ref_call = AttentionCall(layout, 0.125).with_operands(ScoreOperands(score_bias=bias))
    reference = NumpyBackend()
    ref_out, ref_lse = reference.forward(*wide[:3], ref_call)
    refs = reference.backward(*wide[:3], ref_out, ref_lse, wide[3], None, ref_call)
    got = [out, *grads]
    for name, a, b in zip(["out", "dq", "dk", "dv", "dbias"], got, [ref_out, *refs], strict=True):
        assert rel_err(cupy.asnumpy(a).astype(np.float64), b) <= TOLERANCE[dtype], name
