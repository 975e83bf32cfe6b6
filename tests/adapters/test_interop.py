"""DLPack bridges: type, dtype and device preserved, memory shared both ways, clear errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import cuattn
from cuattn import backends as be
from cuattn.adapters import dlpack

LAYOUT_ARGS = dict(attn_mode="local", n_ctx=32, heads=2, blocksize=8, local_attn_ctx=8)
SHAPE = (2, 2, 32, 8)
JAX_CPU_ALIGN = 64  # XLA:CPU aliases an imported buffer only at this alignment


def _aligned_copy(a: np.ndarray, align: int = JAX_CPU_ALIGN) -> np.ndarray:
    raw = np.empty(a.nbytes + align, np.uint8)
    start = (-raw.ctypes.data) % align
    out = raw[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


@pytest.fixture
def spy(monkeypatch):
    """Records the arrays handed to the backend and the (aligned) arrays it returned."""
    seen = {}
    real = be.forward

    def forward(q, k, v, call):
        out, lse = real(q, k, v, call)
        seen["inputs"] = (q, k, v)
        if isinstance(out, np.ndarray):
            out, lse = _aligned_copy(out), _aligned_copy(lse)
        seen["out"], seen["lse"] = out, lse
        return seen["out"], seen["lse"]

    monkeypatch.setattr(be, "forward", forward)
    return seen


def _qkv(seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(SHAPE).astype(dtype) for _ in range(3)]


def _call(q, k, v, **kw):
    return cuattn.sparse_attention(q, k, v, cuattn.make_layout(**LAYOUT_ARGS), **kw)


def test_numpy_in_numpy_out_no_copy(spy):
    q, k, v = _qkv()
    out = _call(q, k, v)
    assert type(out) is np.ndarray and out.dtype == np.float64
    assert spy["inputs"][0] is q and out is spy["out"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_torch_in_torch_out_no_copy(spy, dtype):
    q, k, v = (torch.from_numpy(a).to(dtype) for a in _qkv(1))
    out, lse = _call(q, k, v, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == dtype and out.device.type == "cpu"
    assert isinstance(lse, torch.Tensor) and lse.shape == SHAPE[:3]
    assert spy["inputs"][0].ctypes.data == q.data_ptr()
    assert out.data_ptr() == spy["out"].ctypes.data
    assert lse.data_ptr() == spy["lse"].ctypes.data


def test_torch_requiring_grad_is_shared_not_copied(spy):
    q, k, v = (torch.tensor(a, requires_grad=True) for a in _qkv(2))
    out = _call(q, k, v)
    assert out.requires_grad
    assert spy["inputs"][1].ctypes.data == k.data_ptr()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
def test_jax_in_jax_out_no_copy(spy, dtype):
    jax.config.update("jax_enable_x64", True)
    q, k, v = (jnp.asarray(a, dtype=dtype) for a in _qkv(3))
    out = _call(q, k, v)
    assert isinstance(out, jax.Array) and out.dtype == dtype
    assert out.devices() == q.devices()
    assert spy["inputs"][2].ctypes.data == v.unsafe_buffer_pointer()
    assert out.unsafe_buffer_pointer() == spy["out"].ctypes.data


def test_tape_tensor_in_tensor_out():
    q, k, v = (cuattn.Tensor(a, requires_grad=True) for a in _qkv(4))
    out = _call(q, k, v)
    assert isinstance(out, cuattn.Tensor) and out.requires_grad and out.dtype == np.float64


@pytest.mark.parametrize(
    "make_k, bad_name",
    [
        (lambda a: torch.from_numpy(a), "k"),
        (lambda a: jnp.asarray(a), "k"),
    ],
)
def test_mixed_frameworks_name_the_argument(make_k, bad_name):
    q, k, v = _qkv(5)
    with pytest.raises(
        ValueError, match=rf"^{bad_name} is a (torch|jax) array on cpu but q is a numpy"
    ):
        _call(q, make_k(k), v)


def test_tape_tensor_with_foreign_array_is_a_type_error():
    q, k, v = _qkv(6)
    with pytest.raises(TypeError, match="v is a torch"):
        _call(cuattn.Tensor(q), cuattn.Tensor(k), torch.from_numpy(v))


def test_bfloat16_cpu_tensor_is_a_clear_type_error():
    q, k, v = (torch.from_numpy(a).to(torch.bfloat16) for a in _qkv(7))
    with pytest.raises(TypeError, match=r"numpy backend accepts .*q\.dtype=bfloat16"):
        _call(q, k, v)


def test_describe_reports_framework_and_device():
    a = np.ones(3)
    assert dlpack.describe(a, "a") == dlpack.ArrayInfo("numpy", "cpu")
    assert dlpack.describe(torch.ones(3), "a") == dlpack.ArrayInfo("torch", "cpu")
    assert dlpack.describe(jnp.ones(3), "a") == dlpack.ArrayInfo("jax", "cpu")
    with pytest.raises(TypeError, match="x must be"):
        dlpack.describe([1.0, 2.0], "x")


# The kernels serve head dims 32-128 and blocks of 16+; the CuPy route runs them, so its case
# must be one they accept (LAYOUT_ARGS' head dim 8 is for the NumPy reference only).
KERNEL_LAYOUT_ARGS = dict(attn_mode="local", n_ctx=64, heads=2, blocksize=16, local_attn_ctx=24)
KERNEL_SHAPE = (2, 2, 64, 32)


def _kernel_case(seed: int) -> tuple[list[np.ndarray], np.ndarray]:
    """float32 q, k, v of KERNEL_SHAPE and the float64 reference output."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(KERNEL_SHAPE).astype(np.float32) for _ in range(3))
    layout = cuattn.make_layout(**KERNEL_LAYOUT_ARGS)
    want = cuattn.sparse_attention(*(x.astype(np.float64) for x in (q, k, v)), layout)
    return [q, k, v], want


def test_kernel_case_runs_on_the_interpreter(spy):
    """The CuPy test's shape and layout through the same kernels on the CPU."""
    arrays, want = _kernel_case(8)
    out = cuattn.sparse_attention(
        *arrays, cuattn.make_layout(**KERNEL_LAYOUT_ARGS), backend="interp"
    )
    assert type(out) is np.ndarray and out.dtype == np.float32
    np.testing.assert_allclose(out, want, rtol=2e-5, atol=2e-5)


@pytest.mark.gpu
def test_cupy_in_cupy_out_no_copy(spy):
    import cupy

    arrays, want = _kernel_case(8)
    q, k, v = (cupy.asarray(a) for a in arrays)
    out = cuattn.sparse_attention(q, k, v, cuattn.make_layout(**KERNEL_LAYOUT_ARGS))
    assert isinstance(out, cupy.ndarray) and out.dtype == np.float32
    assert out.device == q.device
    assert spy["inputs"][0] is q and out is spy["out"]
    np.testing.assert_allclose(cupy.asnumpy(out), want, rtol=2e-5, atol=2e-5)


class _Producer:
    """A foreign array type: shape, dtype and DLPack, nothing else."""

    def __init__(self, array: np.ndarray) -> None:
        self._array = array
        self.shape, self.dtype = array.shape, array.dtype

    def __dlpack__(self, **kwargs):
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self._array.__dlpack_device__()


def test_any_dlpack_producer_is_shared_and_answered_with_numpy(spy):
    q, k, v = _qkv(9)
    out = _call(*(_Producer(a) for a in (q, k, v)))
    assert type(out) is np.ndarray and out is spy["out"]
    assert spy["inputs"][0].ctypes.data == q.ctypes.data


def test_one_place_tells_array_libraries_apart():
    """cuattn._util.array_library: what every layer asks instead of reading type(x).__module__,
    and what dlpack.describe's framework is built on."""
    import ml_dtypes

    from cuattn._util import array_library
    from cuattn.adapters import dlpack

    cases = [(np.zeros(2), "numpy"), (np.dtype(ml_dtypes.bfloat16), "numpy"), (3, "builtins")]
    torch = pytest.importorskip("torch")
    cases += [(torch.zeros(2), "torch"), (torch.nn.Parameter(torch.zeros(2)), "torch")]
    cases += [(torch.bfloat16, "torch")]
    jnp = pytest.importorskip("jax.numpy")
    cases += [(jnp.zeros(2), "jax")]
    for x, want in cases:
        assert array_library(x) == want, x
    assert dlpack.describe(jnp.zeros(2), "q").framework == "jax"
    assert dlpack.describe(torch.zeros(2), "q").framework == "torch"


def test_a_torch_cuda_tensor_is_imported_on_torchs_current_stream(monkeypatch):
    """CuPy imports a torch CUDA tensor inside torch's current stream: its DLPack handshake then
    orders nothing. From CuPy's own (legacy default) stream, torch makes that stream wait on
    its own, which CUDA refuses while torch captures a graph: a dynamic layout step under
    torch.cuda.graph failed so on an H200 (2026-11-26). Checked here without a GPU: the import
    must happen while the torch-stream context is entered."""
    cupy = pytest.importorskip("cupy")
    events = []

    class TorchStream:
        def __enter__(self):
            events.append("enter torch stream")

        def __exit__(self, *exc):
            events.append("exit torch stream")

    class Device:
        def __init__(self, index):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(dlpack, "cupy_stream_of_torch", lambda device_id=None: TorchStream())
    monkeypatch.setattr(cupy.cuda, "Device", Device)
    monkeypatch.setattr(cupy, "from_dlpack", lambda x: events.append("import") or x)
    tensor = torch.zeros(3)
    dlpack.to_backend(tensor, dlpack.ArrayInfo("torch", "cuda", 0), "q")
    assert events == ["enter torch stream", "import", "exit torch stream"]
