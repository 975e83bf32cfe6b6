"""Host-side description of a 2-D TMA tensor map (kernels/common/tma.cuh).

A tensor map tells the TMA unit where a global tensor is and which box one copy moves. On a GPU
it is the 128-byte opaque object cuTensorMapEncodeTiled writes from exactly these fields (rank 2,
element strides 1, no interleave, zero fill for out-of-bounds elements; ``driver_struct``, through
libcuda with ctypes: CuPy has no binding for it); the CPU interpreter takes the description
itself in the same 128 bytes (``interp_struct``), laid out as the CUATTN_INTERP branch of
``TensorMap2D`` in kernels/common/tma.cuh.
"""

from __future__ import annotations

import ctypes
import enum
from dataclasses import dataclass

import numpy as np

TENSOR_MAP_BYTES = 128  # the PTX ISA's "Tensor-map" object


class Swizzle(enum.IntEnum):
    """CUtensorMapSwizzle (and TmaSwizzle in kernels/common/tma.cuh)."""

    NONE = 0
    B32 = 1
    B64 = 2
    B128 = 3


_DESCRIPTION_FIELDS = [
    ("global_address", ctypes.c_void_p),
    ("dims", ctypes.c_uint64 * 2),
    ("row_stride", ctypes.c_uint64),
    ("box", ctypes.c_uint32 * 2),
    ("element_bytes", ctypes.c_uint32),
    ("swizzle", ctypes.c_uint32),
]


class _Description(ctypes.Structure):
    _fields_ = _DESCRIPTION_FIELDS


class _InterpTensorMap(ctypes.Structure):
    _fields_ = [
        *_DESCRIPTION_FIELDS,
        ("unused", ctypes.c_ubyte * (TENSOR_MAP_BYTES - ctypes.sizeof(_Description))),
    ]


assert ctypes.sizeof(_InterpTensorMap) == TENSOR_MAP_BYTES

# cuTensorMapEncodeTiled's arguments (cuda.h): the unsigned CUtensorMapDataType of each element
# size (the copy moves bytes; no float semantics are wanted), and the fixed modes.
_DATA_TYPE_OF_SIZE = {1: 0, 2: 1, 4: 2, 8: 4}  # CU_TENSOR_MAP_DATA_TYPE_UINT8/16/32/64
_RANK = 2
_INTERLEAVE_NONE = 0
_L2_PROMOTION_NONE = 0
_OOB_FILL_NONE = 0  # out-of-bounds elements read as zero
_MAP_ALIGNMENT = 64  # the driver's alignment for the CUtensorMap it writes
_CUDA_SUCCESS = 0


@dataclass(frozen=True)
class TensorMap2D:
    """A row-major 2-D tensor and the box one TMA copies; sizes innermost (columns) first."""

    global_address: int
    dims: tuple[int, int]  # (columns, rows) in elements
    row_stride: int  # bytes from one row to the next
    box: tuple[int, int]  # (columns, rows) in elements
    element_bytes: int
    swizzle: Swizzle = Swizzle.NONE

    @classmethod
    def of(
        cls,
        array: np.ndarray,
        box: tuple[int, int],
        swizzle: Swizzle = Swizzle.NONE,
        columns: int | None = None,
    ) -> TensorMap2D:
        """The map of a 2-D array (NumPy, or a device array such as CuPy's) whose rows may be
        padded: only the first `columns` of each row (all by default) belong to the tensor."""
        rows, width = array.shape
        assert array.strides[1] == array.itemsize, "rows must be contiguous"
        device = getattr(array, "__cuda_array_interface__", None)
        return cls(
            global_address=device["data"][0] if device else array.ctypes.data,
            dims=(width if columns is None else columns, rows),
            row_stride=array.strides[0],
            box=box,
            element_bytes=array.itemsize,
            swizzle=swizzle,
        )

    def interp_struct(self) -> _InterpTensorMap:
        """The kernel parameter the CPU interpreter takes for this map."""
        return _InterpTensorMap(
            global_address=self.global_address,
            dims=(ctypes.c_uint64 * 2)(*self.dims),
            row_stride=self.row_stride,
            box=(ctypes.c_uint32 * 2)(*self.box),
            element_bytes=self.element_bytes,
            swizzle=int(self.swizzle),
        )

    def driver_struct(self) -> ctypes.Array:
        """The kernel parameter a GPU takes for this map (its global address must be device
        memory): the CUtensorMap cuTensorMapEncodeTiled writes, 64-byte aligned."""
        buffer = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + _MAP_ALIGNMENT))()
        offset = -ctypes.addressof(buffer) % _MAP_ALIGNMENT
        encoded = (ctypes.c_ubyte * TENSOR_MAP_BYTES).from_buffer(buffer, offset)
        # the strides of every dimension but the innermost, in bytes
        strides = (ctypes.c_uint64 * (_RANK - 1))(self.row_stride)
        status = _libcuda().cuTensorMapEncodeTiled(
            ctypes.byref(encoded),
            _DATA_TYPE_OF_SIZE[self.element_bytes],
            _RANK,
            ctypes.c_void_p(self.global_address),
            (ctypes.c_uint64 * _RANK)(*self.dims),
            strides,
            (ctypes.c_uint32 * _RANK)(*self.box),
            (ctypes.c_uint32 * _RANK)(1, 1),
            _INTERLEAVE_NONE,
            int(self.swizzle),
            _L2_PROMOTION_NONE,
            _OOB_FILL_NONE,
        )
        if status != _CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled refused {self}: CUresult {status}")
        return encoded


def _libcuda() -> ctypes.CDLL:
    library = ctypes.CDLL("libcuda.so.1")
    library.cuTensorMapEncodeTiled.restype = ctypes.c_int
    return library
