"""The "cuda" backend: forward and backward on CuPy arrays through the .cu kernels.

Same contract as the NumPy reference (backends/numpy_ref.py: computed token order,
[batch, heads, n_ctx, head_dim]). The launch sequences are backends/kernels.py's, shared with the
CPU interpreter, so the two kernel backends can only differ in where the code runs.
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from typing import Any

import numpy as np

from cuattn.backends.cuda_runtime import KERNELS, LAYOUTS, cupy_module, device_multiprocessors
from cuattn.backends.geometry import SM90_COMPUTE_CAPABILITY, KernelConfig, LayoutKernelConfig
from cuattn.backends.kernels import KernelBackend
from cuattn.backends.tensor_map import TensorMap
from cuattn.layout.device import DeviceLayout

_SCALAR_TYPES = {"i32": np.int32, "i64": np.int64, "f32": np.float32, "f64": np.float64}


def launch(config: KernelConfig | LayoutKernelConfig, **values: Any) -> None:
    """One launch on the current device and CuPy stream; `values` names every kernel argument."""
    args = []
    tensor_maps = []  # the encoded maps, alive until the launch has copied its parameters
    for name, kind in config.args:
        value = values[name]
        if kind == "ptr":
            if value.size > 1 and value.strides[-1] != value.itemsize:
                raise AssertionError(f"{config.name_expression}: {name}'s rows are not contiguous")
            args.append(value)
        elif kind == "tmap":
            # a tensor_map.TensorMap, passed by value: CuPy hands the driver a pointer to each
            # argument's bytes, and a CPointer is that pointer as it is
            tensor_maps.append(value.driver_struct)
            args.append(cupy_module().cuda.function.CPointer(ctypes.addressof(tensor_maps[-1])))
        else:
            args.append(_SCALAR_TYPES[kind](value))
    kernel = KERNELS.kernel(
        config.source_file, config.name_expression, config.smem_bytes, arch=config.arch
    )
    kernel(config.grid, config.block_dims, tuple(args), shared_mem=config.smem_bytes)


class CudaBackend(KernelBackend):
    """The kernels on the GPU, on the current CuPy stream of the inputs' device."""

    name = "cuda"
    array_kind = "CuPy arrays"
    on_gpu = True
    sm90a_by_default = True

    @property
    def xp(self) -> Any:
        return cupy_module()

    def is_array(self, x: Any) -> bool:
        return isinstance(x, cupy_module().ndarray)

    def device_of(self, x: Any) -> int:
        return x.device.id

    def data_address(self, x: Any) -> int:
        return int(x.data.ptr)

    @contextlib.contextmanager
    def on_device_of(self, x: Any) -> Iterator[None]:
        with x.device:
            yield

    def output(self, shape: tuple[int, ...], dtype: Any) -> Any:
        return cupy_module().empty(shape, dtype=dtype)

    def index_arrays(self, layout: Any) -> Any:
        if isinstance(layout, DeviceLayout):
            return layout.kernel_arrays()  # built on this device (cuattn.backends checks)
        return LAYOUTS.get(layout)

    def launch(self, config: KernelConfig, **values: Any) -> None:
        launch(config, **values)

    def multiprocessors(self, x: Any) -> int:
        return device_multiprocessors(x.device.id)

    def runs_sm90a(self, x: Any) -> bool:
        return x.device.compute_capability == SM90_COMPUTE_CAPABILITY

    def encodes(self, map_: TensorMap) -> bool:
        """Whether cuTensorMapEncodeTiled takes the map. A map whose base panel_map moved down
        to 128 bytes has rows wider than the tensor's; should the driver refuse such a map, the
        forward runs on attn_fwd instead of failing (the same numbers, the mma.sync speed). The
        encoding is kept on the map for its launch."""
        try:
            map_.driver_struct  # noqa: B018 (encodes the map, or raises)
        except RuntimeError:
            return False
        return True
