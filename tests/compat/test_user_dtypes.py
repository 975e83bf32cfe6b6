"""dtypes as users pass them: torch bfloat16 on the CPU (and CPU autocast) through the kernel
interpreter, and KVCache's dtype argument in NumPy's, torch's and text spellings."""

from __future__ import annotations

import sys

import ml_dtypes
import numpy as np
import pytest
import torch

import cuattn
from cuattn.adapters import dlpack
from cuattn.serving import KVCache
from tests.helpers.attn_cases import rel

HEADS, SEQ, DIM, BLOCK = 2, 64, 16, 16
# bfloat16 keeps 8 significant bits: one rounding of an output is 2**-8 relative; gradients go
# through bf16 inputs to the backward (dout, out) and come out rounded once more.
BF16_OUT_RTOL, BF16_GRAD_RTOL = 1e-2, 2e-2


def _layout():
    return cuattn.make_layout("local", SEQ, HEADS, blocksize=BLOCK, local_attn_ctx=32)


def _bf16_leaves(seed: int, batch: int = 2):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, HEADS, SEQ, DIM)
    return [torch.randn(shape, generator=g).bfloat16().requires_grad_() for _ in range(3)]


def test_bfloat16_cpu_tensors_run_on_the_interpreter_exactly():
    layout = _layout()
    q, k, v = _bf16_leaves(0)
    out = cuattn.sparse_attention(q, k, v, layout, backend="interp")
    assert out.dtype == torch.bfloat16 and out.device.type == "cpu"
    # the reference: the same bf16 values, widened exactly, in float64 on the NumPy backend
    ref_in = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref = cuattn.sparse_attention(*ref_in, layout)
    assert rel(out.detach().double(), ref.detach()) <= BF16_OUT_RTOL
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (out.double() * w).sum().backward()
    (ref * w).sum().backward()
    for got, want in zip((q, k, v), ref_in, strict=True):
        assert got.grad.dtype == torch.bfloat16
        assert rel(got.grad.double(), want.grad) <= BF16_GRAD_RTOL


def test_cpu_autocast_bfloat16_reaches_the_interpreter():
    """Under CPU autocast the projections produce bfloat16; attention runs in it on the
    interpreter, and gradients reach the projection weights."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, SEQ, HEADS * DIM, generator=g)
    proj = torch.nn.Linear(HEADS * DIM, 3 * HEADS * DIM, bias=False)
    layout = _layout()

    def attend(dtype_ctx, backend):
        with dtype_ctx:
            q, k, v = proj(x).view(2, SEQ, 3, HEADS, DIM).permute(2, 0, 3, 1, 4)
            return cuattn.sparse_attention(q, k, v, layout, backend=backend)

    out = attend(torch.autocast("cpu", dtype=torch.bfloat16), "interp")
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()
    got = proj.weight.grad.clone()
    proj.weight.grad = None
    plain = attend(torch.autocast("cpu", enabled=False), "numpy")  # float32 throughout
    plain.square().sum().backward()
    assert rel(out.detach().float(), plain.detach()) <= BF16_OUT_RTOL
    assert torch.isfinite(got).all() and rel(got, proj.weight.grad) <= BF16_GRAD_RTOL


def test_bfloat16_is_shared_not_copied_and_comes_back_as_torch():
    x = torch.randn(3, 32).bfloat16()[:, ::2]  # a strided view, too
    info = dlpack.describe(x, "q")
    arr = dlpack.to_backend(x, info, "q")
    assert arr.dtype == np.dtype(ml_dtypes.bfloat16)
    assert arr.ctypes.data == x.data_ptr() and arr.strides == (64, 4)
    assert np.array_equal(arr.astype(np.float32), x.float().numpy())
    back = dlpack.from_backend(arr, info)
    assert back.dtype == torch.bfloat16 and back.data_ptr() == x.data_ptr()
    assert torch.equal(back, x)


def test_the_numpy_backend_still_refuses_bfloat16_by_name():
    q, k, v = _bf16_leaves(3)
    with pytest.raises(TypeError, match=r"numpy backend accepts .*got q\.dtype=bfloat16"):
        cuattn.sparse_attention(q, k, v, _layout(), backend="numpy")


def test_bfloat16_without_ml_dtypes_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes now fails
    q, k, v = _bf16_leaves(4)
    with pytest.raises(TypeError, match="q is bfloat16 on the CPU; .*ml_dtypes, which is not"):
        cuattn.sparse_attention(q, k, v, _layout(), backend="interp")


def test_bfloat16_of_another_framework_on_the_cpu_is_refused_by_name():
    jnp = pytest.importorskip("jax.numpy")
    q = jnp.ones((1, HEADS, SEQ, DIM), dtype=jnp.bfloat16)
    with pytest.raises(TypeError, match="q is bfloat16 on the CPU from jax"):
        cuattn.sparse_attention(q, q, q, _layout(), backend="interp")


# -- KVCache(dtype=...) ---------------------------------------------------------------------------


def _jnp_float16():
    return pytest.importorskip("jax.numpy").float16


SPELLINGS = [
    ("float16", "float16"),
    ("f2", "float16"),
    ("half", "float16"),
    (np.float16, "float16"),
    (np.float32, "float32"),
    (np.float64, "float64"),
    (np.dtype("float32"), "float32"),
    (np.zeros(1, np.float16).dtype, "float16"),
    (torch.float16, "float16"),
    (torch.half, "float16"),
    (torch.bfloat16, "bfloat16"),
    (torch.float32, "float32"),
    ("torch.float32", "float32"),
    ("bfloat16", "bfloat16"),
    (ml_dtypes.bfloat16, "bfloat16"),
    (np.dtype(ml_dtypes.bfloat16), "bfloat16"),
]


@pytest.mark.parametrize("dtype,name", SPELLINGS, ids=repr)
def test_kv_cache_takes_dtypes_as_users_spell_them(dtype, name):
    cache = KVCache(1, 2, 16, dtype=dtype, page_size=4)
    assert cache.dtype == name
    assert np.dtype(cache.k_pages.dtype).name == name


def test_kv_cache_takes_a_jax_scalar_type():
    cache = KVCache(1, 1, 16, dtype=_jnp_float16(), page_size=4)
    assert cache.dtype == "float16"


@pytest.mark.parametrize("dtype", [np.int32, torch.int8, "int64", None, object, "float8", 3])
def test_kv_cache_refuses_other_dtypes_by_name(dtype):
    with pytest.raises(TypeError, match=r"dtype must be one of \('float16', 'bfloat16'"):
        KVCache(1, 1, 16, dtype=dtype)
