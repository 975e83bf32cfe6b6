"""The CUDA kernels on a GPU, against the dense float64 oracle computed on the GPU.

Every pattern x dtype x block size x head dim, forward and backward, at a ragged length; plus
a fully masked row, a backward bit-identical across runs, a
non-default stream, poisoned output memory and one long sequence. Marked `gpu`: skipped without
a CUDA device. Run: `PYTHONPATH=. pytest -m gpu tests/backends/test_cuda_kernels.py` (about a
minute on an H100 after the session fixture compiles every instantiation in parallel).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import cuattn
from cuattn import backends as be
from cuattn.backends import geometry
from cuattn.backends.call import AttentionCall

cupy = pytest.importorskip("cupy")
ml_dtypes = pytest.importorskip("ml_dtypes")
from cuattn.tools.oracle import (  # noqa: E402
    GRAD_FLOOR,
    REL_FLOOR,
    dense_attention,
    dense_attention_grads,
    rel_err,
)
from tests.helpers.kernel_cases import HEADS, N_CTX, PATTERNS, pattern_id, sweep_layout  # noqa: E402

pytestmark = pytest.mark.gpu

BATCH = 2
LONG_N_CTX = 8192
TOL = {"float32": 2e-5, "float16": 1e-2, "bfloat16": 2e-2}
NUMPY_DTYPE = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


@pytest.fixture(scope="session", autouse=True)
def compiled_kernels():
    """Every instantiation compiled in parallel into CuPy's disk cache before the sweep."""
    from cuattn.backends.cuda_runtime import cuda_available, warm_disk_cache

    if not cuda_available():
        pytest.skip("needs a CUDA device")
    units = [(f, n) for f, names in geometry.all_instantiations().items() for n in names]
    warm_disk_cache(units, jobs=os.cpu_count() or 1)


def _random(rng: np.random.Generator, shape: tuple[int, ...], dtype: str):
    host = rng.standard_normal(shape, dtype=np.float32).astype(NUMPY_DTYPE[dtype])
    return cupy.asarray(host)


def _as_float64(x) -> cupy.ndarray:
    # Through the host: CuPy casts from bfloat16 only where ml_dtypes kernels exist.
    return cupy.asarray(cupy.asnumpy(x).astype(np.float64))


def _problem(layout, dtype: str, head_dim: int, seed: int):
    rng = np.random.default_rng(seed)
    shape = (BATCH, layout.heads, layout.n_ctx, head_dim)
    return [_random(rng, shape, dtype) for _ in range(4)]


@pytest.mark.parametrize("head_dim", geometry.HEAD_DIMS)
@pytest.mark.parametrize("blocksize", geometry.BLOCK_SIZES)
@pytest.mark.parametrize("dtype", geometry.DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS, ids=pattern_id)
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_kernels_match_float64_oracle(direction, pattern, dtype, blocksize, head_dim):
    layout = sweep_layout(pattern, blocksize)
    q, k, v, dout = _problem(layout, dtype, head_dim, seed=blocksize * head_dim)
    scale = head_dim**-0.5
    mask = cupy.asarray(layout.to_mask())
    # Through cuattn.backends, as every public route goes: it applies the layout's permutation.
    out, lse = be.forward(q, k, v, AttentionCall(layout, scale, backend="cuda"))
    tol = TOL[dtype]
    if direction == "forward":
        want_out, want_lse = dense_attention(q, k, v, mask, scale)
        assert out.dtype == q.dtype and out.shape == q.shape
        assert rel_err(_as_float64(out), want_out, REL_FLOOR) < tol
        finite = cupy.isfinite(want_lse)
        assert bool((cupy.isfinite(lse) == finite).all())
        assert rel_err(lse[finite], want_lse[finite], REL_FLOOR) < tol
        return
    grads = be.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, scale, backend="cuda"))
    want = dense_attention_grads(q, k, v, dout, mask, scale)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert got.dtype == q.dtype and not bool(cupy.isnan(_as_float64(got)).any()), name
        assert rel_err(_as_float64(got), ref, GRAD_FLOOR) < tol, name


LLM_SHAPES = [(1000, 1000, 4), (333, 1000, 2), (1000, 600, 1)]  # (n_q, n_k, group)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("n_q, n_k, group", LLM_SHAPES)
@pytest.mark.parametrize("pattern", [PATTERNS[0], PATTERNS[3], PATTERNS[6]], ids=pattern_id)
@pytest.mark.parametrize("blocksize", [8, 64, 128])
def test_gqa_and_queries_unequal_keys(blocksize, pattern, n_q, n_k, group, dtype):
    mode, kwargs = pattern
    heads = HEADS * 2
    layout = cuattn.make_layout(mode, n_k, heads, blocksize=blocksize, n_q=n_q, **kwargs)
    rng = np.random.default_rng(n_q + n_k + group)
    q, dout = (_random(rng, (BATCH, heads, n_q, 128), dtype) for _ in range(2))
    k, v = (_random(rng, (BATCH, heads // group, n_k, 128), dtype) for _ in range(2))
    mask = cupy.asarray(layout.to_mask())
    out, lse = be.forward(q, k, v, AttentionCall(layout, 128**-0.5, backend="cuda"))
    want_out, _ = dense_attention(q, k, v, mask, 128**-0.5)
    assert rel_err(_as_float64(out), want_out, REL_FLOOR) < TOL[dtype]
    grads = be.backward(
        q, k, v, out, lse, dout, None, AttentionCall(layout, 128**-0.5, backend="cuda")
    )
    want = dense_attention_grads(q, k, v, dout, mask, 128**-0.5)
    for name, got, ref in zip(("dq", "dk", "dv"), grads, want, strict=True):
        assert got.shape == ref.shape, name
        assert rel_err(_as_float64(got), ref, GRAD_FLOOR) < TOL[dtype], name


def test_varlen_on_the_gpu():
    lengths = [700, 1, 333, 1024]
    cu = cupy.asarray(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    rng = np.random.default_rng(6)
    q = _random(rng, (sum(lengths), 8, 64), "bfloat16")
    k, v = (_random(rng, (sum(lengths), 2, 64), "bfloat16") for _ in range(2))
    out = cuattn.sparse_attention_varlen(
        q, k, v, cu, cu, lambda n_q, n_k: cuattn.make_layout("all", n_k, 8, 64, n_q=n_q)
    )
    start = 0
    for length in lengths:
        sl = slice(start, start + length)
        qs, ks, vs = (x[sl].transpose(1, 0, 2)[None] for x in (q, k, v))
        mask = cupy.tril(cupy.ones((8, length, length), dtype=bool))
        want, _ = dense_attention(qs, ks, vs, mask, 64**-0.5)
        got = _as_float64(out[sl]).transpose(1, 0, 2)[None]
        assert rel_err(got, want, REL_FLOOR) < TOL["bfloat16"]
        start += length


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_merge_states_on_the_gpu(dtype):
    """The merge kernel: two halves of the keys merged equal attention over all of them."""
    rng = np.random.default_rng(9)
    q = _random(rng, (BATCH, HEADS, 777, 64), dtype)
    k, v = (_random(rng, (BATCH, HEADS, 1000, 64), dtype) for _ in range(2))
    halves = []
    for keys in (slice(0, 400), slice(400, 1000)):
        n = keys.stop - keys.start
        layout = cuattn.make_layout("all", n, HEADS, 64, causal=False, n_q=777)
        halves += be.forward(
            q, k[:, :, keys], v[:, :, keys], AttentionCall(layout, 0.125, backend="cuda")
        )
    out, lse = cuattn.merge_attention_states(*halves)
    whole = cupy.ones((HEADS, 777, 1000), dtype=bool)
    want_out, want_lse = dense_attention(q, k, v, whole, 0.125)
    assert rel_err(_as_float64(out), want_out, REL_FLOOR) < TOL[dtype]
    assert rel_err(lse, want_lse, REL_FLOOR) < TOL["float32"]


def test_fully_masked_row_gives_zero_and_minus_inf():
    blocksize, n_ctx = 32, 96  # three blocks
    blocks = np.tril(np.ones((1, 3, 3), dtype=bool))
    blocks[0, 1, :] = False  # query block 1 has no key block at all
    # and query 70 sees nothing inside its active blocks
    layout = cuattn.Layout.from_blocks(
        blocks, blocksize, mask_fn=lambda h, q, k: (q != 70) & (k <= q), n_ctx=n_ctx
    )
    q, k, v, dout = _problem(layout, "float16", 64, seed=1)
    impl = be.resolve_backend("cuda", on_device=True)
    out, lse = impl.forward(q, k, v, AttentionCall(layout, 0.125))
    empty = list(range(32, 64)) + [70]
    assert bool((out[:, :, empty] == 0).all()) and bool(cupy.isneginf(lse[:, :, empty]).all())
    grads = impl.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.125))
    assert all(not bool(cupy.isnan(g.astype(cupy.float32)).any()) for g in grads)
    assert bool((grads[0][:, :, empty] == 0).all())


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_backward_is_bit_identical_across_runs(dtype):
    layout = cuattn.make_layout("bigbird", N_CTX, HEADS, blocksize=64, num_random_blocks=2)
    q, k, v, dout = _problem(layout, dtype, 64, seed=2)
    impl = be.resolve_backend("cuda", on_device=True)
    out, lse = impl.forward(q, k, v, AttentionCall(layout, 0.125))
    first = impl.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.125))
    for _ in range(3):
        again = impl.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 0.125))
        for a, b in zip(first, again, strict=True):
            assert bool((a.view(cupy.uint16) == b.view(cupy.uint16)).all())


def test_runs_on_the_current_stream_and_ignores_poisoned_memory():
    layout = cuattn.make_layout("local", N_CTX, HEADS, blocksize=64, local_attn_ctx=100)
    q, k, v, _ = _problem(layout, "float16", 64, seed=3)
    impl = be.resolve_backend("cuda", on_device=True)
    want, _ = impl.forward(q, k, v, AttentionCall(layout, 0.125))
    cupy.cuda.Device().synchronize()
    # Freed NaN-filled blocks of the output's size: the pool hands them to the next allocation.
    poison = [cupy.full(q.shape, cupy.nan, dtype=q.dtype) for _ in range(4)]
    del poison
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        got, lse = impl.forward(q, k, v, AttentionCall(layout, 0.125))
    stream.synchronize()
    assert not bool(cupy.isnan(got).any()) and not bool(cupy.isnan(lse).any())
    assert bool((got == want).all())


def test_long_sequence_dense_causal_bf16():
    layout = cuattn.make_layout("all", LONG_N_CTX, 1, blocksize=128)
    rng = np.random.default_rng(4)
    q, k, v, dout = (_random(rng, (1, 1, LONG_N_CTX, 128), "bfloat16") for _ in range(4))
    impl = be.resolve_backend("cuda", on_device=True)
    out, lse = impl.forward(q, k, v, AttentionCall(layout, 128**-0.5))
    mask = cupy.tril(cupy.ones((1, LONG_N_CTX, LONG_N_CTX), dtype=bool))
    want_out, _ = dense_attention(q, k, v, mask, 128**-0.5)
    assert rel_err(_as_float64(out), want_out, REL_FLOOR) < TOL["bfloat16"]
    grads = impl.backward(q, k, v, out, lse, dout, None, AttentionCall(layout, 128**-0.5))
    want = dense_attention_grads(q, k, v, dout, mask, 128**-0.5)
    for got, ref in zip(grads, want, strict=True):
        assert rel_err(_as_float64(got), ref, GRAD_FLOOR) < TOL["bfloat16"]


def test_wrong_inputs_raise_before_launch():
    layout = cuattn.make_layout("all", 256, HEADS, blocksize=64)
    q, k, v, _ = _problem(layout, "float16", 64, seed=5)
    impl = be.resolve_backend("cuda", on_device=True)
    with pytest.raises(TypeError, match="k: dtype"):
        impl.forward(q, k.astype(cupy.float32), v, AttentionCall(layout, 0.125))
    with pytest.raises(ValueError, match="head_dim 40"):  # 48 has kernels since 2026-11-24
        impl.forward(q[..., :40], k[..., :40], v[..., :40], AttentionCall(layout, 0.125))
    with pytest.raises(TypeError, match="CuPy arrays"):
        impl.forward(cupy.asnumpy(q), k, v, AttentionCall(layout, 0.125))
    other = cuattn.make_layout("all", 512, HEADS, blocksize=64)
    with pytest.raises(ValueError, match="layout: built for"):
        impl.forward(q, k, v, AttentionCall(other, 0.125))
