"""Host-side description of a 2-D TMA tensor map (kernels/common/tma.cuh).

A tensor map tells the TMA unit where a global tensor is and which box one copy moves. On a GPU
it is the 128-byte opaque object cuTensorMapEncodeTiled writes from exactly these fields (rank 2,
element strides 1, no interleave, zero fill for out-of-bounds elements); the CPU interpreter
takes the description itself in the same 128 bytes (``interp_struct``), laid out as the
CUATTN_INTERP branch of ``TensorMap2D`` in kernels/common/tma.cuh.
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
        """The map of a 2-D array whose rows may be padded: only the first `columns` of each row
        (all by default) belong to the tensor."""
        rows, width = array.shape
        assert array.strides[1] == array.itemsize, "rows must be contiguous"
        return cls(
            global_address=array.ctypes.data,
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
