"""Host-side description of a TMA tensor map of rank 1 to 5 (kernels/common/tma.cuh).

A tensor map tells the TMA unit where a global tensor is and which box one copy moves. On a GPU
it is the 128-byte opaque object cuTensorMapEncodeTiled writes from exactly these fields (element
strides 1, no interleave, zero fill for out-of-bounds elements; ``driver_struct``, through
libcuda with ctypes: CuPy has no binding for it); the CPU interpreter takes the description
itself in the same 128 bytes (``interp_struct``), laid out as the CUATTN_INTERP branch of
``TensorMap`` in kernels/common/tma.cuh.
"""

from __future__ import annotations

import ctypes
import enum
import functools
from dataclasses import dataclass
from typing import Any

TENSOR_MAP_BYTES = 128  # the PTX ISA's "Tensor-map" object
MAX_RANK = 5  # cuTensorMapEncodeTiled without interleave, and cp.async.bulk.tensor's .5d


class Swizzle(enum.IntEnum):
    """CUtensorMapSwizzle (and TmaSwizzle in kernels/common/tma.cuh)."""

    NONE = 0
    B32 = 1
    B64 = 2
    B128 = 3


_DESCRIPTION_FIELDS = [
    ("global_address", ctypes.c_void_p),
    ("dims", ctypes.c_uint64 * MAX_RANK),
    ("strides", ctypes.c_uint64 * (MAX_RANK - 1)),
    ("box", ctypes.c_uint32 * MAX_RANK),
    ("rank", ctypes.c_uint32),
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
_INTERLEAVE_NONE = 0
_L2_PROMOTION_NONE = 0
_OOB_FILL_NONE = 0  # out-of-bounds elements read as zero
_MAP_ALIGNMENT = 64  # the driver's alignment for the CUtensorMap it writes
_CUDA_SUCCESS = 0


def _pad(values: tuple[int, ...], length: int) -> tuple[int, ...]:
    return (*values, *(0,) * (length - len(values)))


@dataclass(frozen=True)
class TensorMap:
    """A strided tensor (its innermost dimension contiguous) and the box one TMA copies; every
    size innermost first, as cuTensorMapEncodeTiled and the PTX ISA take them."""

    global_address: int
    dims: tuple[int, ...]  # elements per dimension
    strides: tuple[int, ...]  # bytes from one index of dimension d + 1 to the next
    box: tuple[int, ...]  # elements per copy and dimension
    element_bytes: int
    swizzle: Swizzle = Swizzle.NONE

    def __post_init__(self) -> None:
        rank = len(self.dims)
        assert 1 <= rank <= MAX_RANK and len(self.box) == rank and len(self.strides) == rank - 1

    @property
    def rank(self) -> int:
        return len(self.dims)

    @classmethod
    def of(
        cls,
        array: Any,
        box: tuple[int, ...],
        swizzle: Swizzle = Swizzle.NONE,
        columns: int | None = None,
    ) -> TensorMap:
        """The map of an array (NumPy, or a device array such as CuPy's) whose last axis is
        contiguous and whose rows may be padded: only the first `columns` of each row (all by
        default) belong to the tensor. `box` is innermost first, one entry per axis."""
        assert array.strides[-1] == array.itemsize, "rows must be contiguous"
        device = getattr(array, "__cuda_array_interface__", None)
        width = array.shape[-1] if columns is None else columns
        return cls(
            global_address=device["data"][0] if device else array.ctypes.data,
            dims=(width, *reversed(array.shape[:-1])),
            strides=tuple(reversed(array.strides[:-1])),
            box=tuple(box),
            element_bytes=array.itemsize,
            swizzle=swizzle,
        )

    def interp_struct(self) -> _InterpTensorMap:
        """The kernel parameter the CPU interpreter takes for this map."""
        return _InterpTensorMap(
            global_address=self.global_address,
            dims=(ctypes.c_uint64 * MAX_RANK)(*_pad(self.dims, MAX_RANK)),
            strides=(ctypes.c_uint64 * (MAX_RANK - 1))(*_pad(self.strides, MAX_RANK - 1)),
            box=(ctypes.c_uint32 * MAX_RANK)(*_pad(self.box, MAX_RANK)),
            rank=self.rank,
            element_bytes=self.element_bytes,
            swizzle=int(self.swizzle),
        )

    @functools.cached_property
    def driver_struct(self) -> ctypes.Array:
        """The kernel parameter a GPU takes for this map (its global address must be device
        memory): the CUtensorMap cuTensorMapEncodeTiled writes, 64-byte aligned. Encoded once
        per map: the backend's check that the driver takes it is the launch's encoding."""
        buffer = (ctypes.c_ubyte * (TENSOR_MAP_BYTES + _MAP_ALIGNMENT))()
        offset = -ctypes.addressof(buffer) % _MAP_ALIGNMENT
        encoded = (ctypes.c_ubyte * TENSOR_MAP_BYTES).from_buffer(buffer, offset)
        rank = self.rank
        status = _libcuda().cuTensorMapEncodeTiled(
            ctypes.byref(encoded),
            _DATA_TYPE_OF_SIZE[self.element_bytes],
            rank,
            ctypes.c_void_p(self.global_address),
            (ctypes.c_uint64 * rank)(*self.dims),
            (ctypes.c_uint64 * max(rank - 1, 1))(*self.strides),
            (ctypes.c_uint32 * rank)(*self.box),
            (ctypes.c_uint32 * rank)(*(1,) * rank),
            _INTERLEAVE_NONE,
            int(self.swizzle),
            _L2_PROMOTION_NONE,
            _OOB_FILL_NONE,
        )
        if status != _CUDA_SUCCESS:
            raise RuntimeError(f"cuTensorMapEncodeTiled refused {self}: CUresult {status}")
        return encoded


@functools.cache
def _libcuda() -> ctypes.CDLL:
    """The driver library, opened once (every forward on the wgmma kernel encodes its maps)."""
    library = ctypes.CDLL("libcuda.so.1")
    library.cuTensorMapEncodeTiled.restype = ctypes.c_int
    return library
