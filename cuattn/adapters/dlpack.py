"""DLPack in and out: which framework and device an argument lives on, and zero-copy conversion.

Inputs of any framework (NumPy, CuPy, torch, jax, or any object with ``__dlpack__``) become
NumPy arrays (CPU) or CuPy arrays (CUDA) that share the caller's memory; results go back the
same way as the caller's own type on the caller's device. Nothing here copies, casts or moves
data between host and device: an argument that cannot be shared raises instead.

Known limits (documented, not hidden):
* NumPy has no bfloat16 of its own: a torch bfloat16 CPU tensor is shared as a NumPy array of
  ``ml_dtypes.bfloat16`` (the same bits, through an int16 view, since DLPack's NumPy importer
  refuses bfloat16), which the interpreter's kernels compute on; the NumPy backend refuses it by
  name. Without ml_dtypes, and for other frameworks' bfloat16 CPU arrays, a ``TypeError``.
  (CUDA bf16 goes to CuPy.)
* jax on the CPU aliases an imported buffer only when it is 64-byte aligned; otherwise jax
  itself copies the (output) buffer on import. NumPy's allocator aligns to 16 bytes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from cuattn._util import array_library, array_module

if TYPE_CHECKING:
    import torch

__all__ = [
    "ArrayInfo",
    "common_info",
    "describe",
    "from_backend",
    "is_jax_tracer",
    "stream_for",
    "to_backend",
    "torch_info",
]

# DLPack device types (dlpack.h): the ones cuattn can compute on.
DL_CPU = 1
DL_CUDA = 2
DL_CUDA_HOST = 3
DL_CUDA_MANAGED = 13
CPU_DEVICE_TYPES = (DL_CPU, DL_CUDA_HOST)
CUDA_DEVICE_TYPES = (DL_CUDA, DL_CUDA_MANAGED)

FRAMEWORKS = ("numpy", "cupy", "torch", "jax", "dlpack")


@dataclass(frozen=True)
class ArrayInfo:
    framework: str  # one of FRAMEWORKS ("dlpack": some other __dlpack__ producer)
    device: str  # "cpu", "cuda" or "traced" (a jax tracer: no buffer yet)
    device_id: int = 0

    def __str__(self) -> str:
        where = self.device if self.device != "cuda" else f"cuda:{self.device_id}"
        return f"{self.framework} array on {where}"


def _framework(x: Any) -> str:
    library = array_library(x)
    return library if library in FRAMEWORKS else "dlpack"


def is_jax_tracer(x: Any) -> bool:
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(x, jax.core.Tracer)


def describe(x: Any, name: str) -> ArrayInfo:
    """Framework and device of argument ``name``; TypeError if it is not an array at all."""
    framework = _framework(x)
    if framework == "jax" and is_jax_tracer(x):
        return ArrayInfo("jax", "traced")
    if framework == "numpy" and not isinstance(x, np.ndarray):
        raise TypeError(f"{name} must be an array, got NumPy scalar {type(x).__name__}")
    if not hasattr(x, "__dlpack_device__"):
        raise TypeError(
            f"{name} must be a NumPy, CuPy, torch or jax array or implement __dlpack__, "
            f"got {type(x).__name__}"
        )
    dev_type, dev_id = x.__dlpack_device__()
    if int(dev_type) in CPU_DEVICE_TYPES:
        return ArrayInfo(framework, "cpu")
    if int(dev_type) in CUDA_DEVICE_TYPES:
        return ArrayInfo(framework, "cuda", int(dev_id))
    raise ValueError(
        f"{name} lives on DLPack device type {int(dev_type)}; cuattn runs on CPU and CUDA only"
    )


def common_info(named: dict[str, Any]) -> ArrayInfo:
    """The one framework/device all arguments share, or a ValueError naming the odd one out."""
    items = list(named.items())
    first_name, first = items[0]
    info = describe(first, first_name)
    for name, x in items[1:]:
        other = describe(x, name)
        # A jax tracer has no device yet; jax itself places it with its concrete peers.
        traced = "traced" in (info.device, other.device)
        if other.framework != info.framework or (other != info and not traced):
            raise ValueError(
                f"{name} is a {other} but {first_name} is a {info}; cuattn never converts "
                "between frameworks or moves data between devices, pass them all alike"
            )
    return info


def _is_bfloat16(x: Any) -> bool:
    return "bfloat16" in str(x.dtype)


def _bfloat16_to_numpy(x: Any, info: ArrayInfo, name: str) -> np.ndarray:
    """A torch bfloat16 CPU tensor as a NumPy ``ml_dtypes.bfloat16`` array sharing its memory.

    NumPy's DLPack importer knows no bfloat16, so the tensor crosses as int16 (same size, same
    strides, same bits) and is viewed back: no copy, no rounding. The kernel backends name the
    dtype by ``np.dtype(...).name``, which is 'bfloat16' for ml_dtypes' type. Other frameworks
    and a missing ml_dtypes are refused: cuattn does not cast silently."""
    if info.framework != "torch":
        raise TypeError(
            f"{name} is bfloat16 on the CPU from {info.framework}: cuattn shares bfloat16 CPU "
            "arrays of torch only (NumPy cannot import bfloat16 through DLPack); pass float32 or "
            "a torch tensor"
        )
    try:
        import ml_dtypes
    except ImportError as err:
        raise TypeError(
            f"{name} is bfloat16 on the CPU; NumPy spells bfloat16 through ml_dtypes, which is "
            "not installed (pip install ml_dtypes, then backend='interp'), or pass float32"
        ) from err
    import torch

    return np.from_dlpack(x.view(torch.int16)).view(ml_dtypes.bfloat16)


def to_backend(x: Any, info: ArrayInfo, name: str) -> Any:
    """A NumPy (CPU) or CuPy (CUDA) array sharing ``x``'s memory."""
    if info.framework in ("numpy", "cupy"):
        return x
    if info.device == "traced":
        raise TypeError(
            f"{name} is a jax tracer (inside jax.jit, grad or vmap): it has no values yet to "
            "share with NumPy or CuPy; call this outside the transformation, on concrete arrays"
        )
    if info.framework == "torch" and x.requires_grad:
        x = x.detach()  # shares storage; DLPack refuses tensors that require grad
    if info.device == "cpu":
        if _is_bfloat16(x):
            return _bfloat16_to_numpy(x, info, name)
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError) as err:
            raise TypeError(
                f"{name} ({info}, dtype {x.dtype}) cannot be shared with NumPy: {err}"
            ) from err
    import cupy

    # A torch tensor is imported on torch's current stream: DLPack's handshake then has nothing
    # to order, where CuPy's own stream (the legacy default) would be made to wait on torch's,
    # which CUDA refuses while torch captures a graph (found on an H200).
    on_torch_stream = (
        cupy_stream_of_torch(info.device_id)
        if info.framework == "torch"
        else contextlib.nullcontext()
    )
    with cupy.cuda.Device(info.device_id), on_torch_stream:
        try:
            return cupy.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError, ValueError) as err:
            raise TypeError(
                f"{name} ({info}, dtype {x.dtype}) cannot be shared with CuPy: {err}"
            ) from err


def from_backend(arr: Any, info: ArrayInfo) -> Any:
    """``arr`` (NumPy or CuPy) as the caller's framework's array, sharing memory."""
    if info.framework in ("numpy", "cupy", "dlpack"):
        return arr
    if info.framework == "torch":
        import torch

        if _is_bfloat16(arr) and isinstance(arr, np.ndarray):  # back through int16, as it came
            return torch.from_dlpack(arr.view(np.int16)).view(torch.bfloat16)
        return torch.from_dlpack(arr)
    import jax.dlpack

    return jax.dlpack.from_dlpack(arr)


def torch_info(named: dict[str, torch.Tensor]) -> ArrayInfo:
    """common_info of torch tensors (a torch op's tensor arguments, torch by the op's schema),
    read off their ``device`` without asking each type what it is; anything unusual (tensors
    on different devices, a device cuattn does not run on) goes to common_info, which names it."""
    device = next(iter(named.values())).device
    if device.type in ("cpu", "cuda") and all(x.device == device for x in named.values()):
        return ArrayInfo("torch", device.type, device.index or 0)
    return common_info(named)


def call(
    fn: Callable[..., Any], named: dict[str, Any], *args: Any, info: ArrayInfo | None = None
) -> Any:
    """``fn(*arrays, *args)`` on the backend arrays of ``named`` (in order), on the caller's
    stream; every array ``fn`` returns (one, or a tuple, whose Nones stay None) comes back as
    the caller's type.
    ``info``: ``named``'s common_info, when the caller has it already.

    The one crossing between a framework's arrays and the backends, for every route: inputs are
    shared into NumPy/CuPy, never copied, and results are shared back.
    """
    if info is None:
        info = common_info(named)
    with stream_for(info):
        arrays = [to_backend(x, info, name) for name, x in named.items()]
        result = fn(*arrays, *args)
        if isinstance(result, tuple):
            return tuple(None if r is None else from_backend(r, info) for r in result)
        return from_backend(result, info)


@contextlib.contextmanager
def stream_for(info: ArrayInfo) -> Iterator[None]:
    """Run CuPy work on the caller's current CUDA stream (torch's), so no extra sync is needed,
    with CuPy's allocations taken from torch's caching allocator: torch's memory statistics see
    them, and inside a CUDA graph capture they come from the graph's private pool.

    Other producers synchronise through the DLPack ``stream`` handshake on import.
    """
    if info.device != "cuda" or info.framework != "torch":
        yield
        return
    import cupy

    with (
        cupy.cuda.Device(info.device_id),
        cupy_stream_of_torch(info.device_id),
        torch_allocator_for_cupy(),
    ):
        yield


def _torch_allocation(size: int) -> Any:
    """``size`` bytes from torch's caching allocator on the current device and stream, as a
    CuPy pointer that keeps the torch block alive as long as CuPy holds it."""
    import cupy
    import torch

    device = cupy.cuda.runtime.getDevice()
    block = torch.empty(size, dtype=torch.uint8, device=f"cuda:{device}")
    # A zero-byte block has a null pointer, which CuPy takes only with its device named (an
    # empty array, such as a device layout's mask table without a bitmask rule, asks for one).
    memory = cupy.cuda.UnownedMemory(block.data_ptr(), size, block, device)
    return cupy.cuda.MemoryPointer(memory, 0)


def on_device(info: ArrayInfo) -> Any:
    """Context manager: CuPy work (allocations, launches) on the CUDA device ``info`` names;
    nothing for a CPU array."""
    if info.device != "cuda":
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(info.device_id)


def torch_allocator_for_cupy() -> Any:
    """Context manager: CuPy allocates from torch's caching allocator (this thread, the current
    device and stream), so torch's memory statistics see our kernels' outputs and workspaces,
    and both libraries share one pool."""
    import cupy

    return cupy.cuda.using_allocator(_torch_allocation)


def cupy_stream_of_torch(device_id: int | None = None) -> Any:
    """torch's current CUDA stream (of ``device_id``, default the current device) as a CuPy
    stream; used as a context manager it makes CuPy launch there."""
    import cupy
    import torch

    stream = torch.cuda.current_stream(device_id)
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    # CuPy < 14, or a torch without the CUDA stream protocol (ExternalStream is deprecated in 14).
    return cupy.cuda.ExternalStream(stream.cuda_stream, stream.device.index)


def torch_compiling() -> bool:
    """Whether torch.compile is tracing this call (never imports torch): the layers below the
    adapters ask here rather than torch."""
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def narrow(x: Any, dim: int, start: int, size: int) -> Any:
    """x[..., start:start + size, ...] along ``dim``, a view in x's own library (torch's
    ``narrow`` keeps a traced length symbolic)."""
    if array_library(x) == "torch":
        return x.narrow(dim, start, size)
    index = [slice(None)] * len(x.shape)
    index[dim] = slice(start, start + size)
    return x[tuple(index)]


def concatenate(parts: Sequence[Any], dim: int) -> Any:
    """The parts (one library's arrays) joined along ``dim`` by that library."""
    library = array_library(parts[0])
    if library == "torch":
        import torch

        return torch.cat(list(parts), dim)
    if library == "jax":
        import jax.numpy as xp
    else:
        xp = array_module(parts[0])
    return xp.concatenate(list(parts), axis=dim)
