"""What one XLA custom call that launches a kernel carries, written without jax: its PTX and
the protobuf of its ``opaque`` attribute. The XLA backend that stages KernelBackend's launch
sequences as these calls is jax's, in cuattn/adapters/jax_xla.py (nothing below adapters/
knows jax, docs/design.md).

Under ``jax.jit`` there is no buffer to hand the CuPy backend; instead each kernel launch of
backends/kernels.py's launch sequences is staged into the program as one custom call to
``triton_kernel_call_ffi``, the FFI target jaxlib's CUDA plugin registers for Triton kernels
(jaxlib >= 0.10.1; jaxlib/gpu/triton_kernels.cc). That handler launches any kernel given its
PTX, so the .cu kernels need no compiled extension of ours:

* PTX: NVRTC (through CuPy's bindings) compiles the one instantiation at trace time for the
  virtual architecture ``compute_XX`` of the device (``XX`` = compute capability, 90 on an
  H100), memoised per process. jaxlib compiles it to a cubin at the first execution with the
  ptxas it finds (for compute capability 9.x and up it targets the ``a`` variant, sm_90a),
  caches it (per process: a process's first run of a kernel pays its ptxas compile), and
  loads the function by NVRTC's lowered (mangled) name. The PTX ISA version is the one NVRTC
  emits (NVRTC 12.9 writes ``.version 8.8``): jaxlib's ptxas (the CUDA toolkit or
  nvidia-cuda-nvcc wheel it finds) must be at least as new as the NVRTC that wrote it.
* Launch: grid and dynamic shared memory from cuattn.backends.geometry, block = (num_warps * 32,
  1, 1) (the handler launches 1-D blocks only, which is all the kernels use), on XLA's stream.
  The handler opts in to more than 48 KB of dynamic shared memory itself.
* Arguments: the handler hands each array parameter the next buffer of [operands..., results...]
  and each scalar its value, then appends two null pointers (Triton's scratch slots) which our
  kernels, declaring fewer parameters, never read. The kernels interleave inputs and outputs, so
  every pointer is an operand in the kernel's parameter order: an output is a fresh buffer of
  its shape, aliased to a result of the call (``input_output_aliases``); no result buffer is
  ever consumed by a parameter. Scalars (shapes, strides, scale, the layout's rule) are baked in
  at trace time; the layout's CSR/CSC arrays are constants of the program. Every pointer carries
  ``ptr_divisibility=16``: the handler refuses a misaligned buffer instead of faulting.

The custom call's ``opaque`` attribute is a zlib-compressed ``jax_triton.TritonAnyKernelCall``
protobuf (jaxlib/gpu/triton.proto), written by the small encoder below: the nanobind helpers
that write it (``jax._src.lib.gpu_triton``) exist only in a CUDA jaxlib, and tracing or lowering
for CUDA must work on any machine.
"""

from __future__ import annotations

import functools
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cuattn.backends import geometry
from cuattn.backends.geometry import KernelConfig
from cuattn.backends.kernels import COPY_ALIGNMENT
from cuattn.backends.toolchain import (
    CUPY_IMPLICIT_OPTIONS,
    common_options,
    kernel_program,
    ptx_arch_option,
)

CUSTOM_CALL_TARGET = "triton_kernel_call_ffi"
# Every buffer the kernels read or write starts 16-byte aligned (cp.async, ldmatrix); XLA's
# buffers are at least that, and the handler checks each pointer against this before launching.
PTR_DIVISIBILITY = COPY_ALIGNMENT
CALL_NAME_PREFIX = "cuattn "  # TritonAnyKernelCall.name: shows up in jaxlib's messages

# ---- protobuf wire format (https://protobuf.dev/programming-guides/encoding/) --------------

WIRE_VARINT, WIRE_FIXED64, WIRE_LENGTH, WIRE_FIXED32 = 0, 1, 2, 5
_U64 = (1 << 64) - 1

# jaxlib/gpu/triton.proto, package jax_triton (same field numbers from jaxlib 0.10.1 to 0.11):
# TritonKernel
KERNEL_NAME, KERNEL_NUM_WARPS, KERNEL_SHARED_MEM, KERNEL_PTX = 1, 2, 3, 4
KERNEL_TTIR, KERNEL_COMPUTE_CAPABILITY, KERNEL_NUM_CTAS = 5, 6, 10
# TritonKernelCall
CALL_KERNEL, CALL_GRID_0, CALL_GRID_1, CALL_GRID_2, CALL_PARAMETERS = 1, 2, 3, 4, 5
# TritonKernelCall.Parameter (a oneof) and its Array
PARAM_FIELDS = {"array": 1, "bool": 2, "i32": 3, "u32": 4, "i64": 5, "u64": 6, "fp32": 7, "fp64": 8}
ARRAY_BYTES_TO_ZERO, ARRAY_PTR_DIVISIBILITY = 1, 2
# TritonAnyKernelCall
ANY_KERNEL_CALL, ANY_METADATA, ANY_NAME = 1, 3, 4

# geometry.KERNEL_ARGS kinds -> create_scalar_parameter dtype names
SCALAR_KINDS = {"i32": "i32", "i64": "i64", "f32": "fp32"}


def varint(value: int) -> bytes:
    """Base-128 varint; a negative value as its 64-bit two's complement (ten bytes), as protobuf
    writes int32 and int64."""
    value &= _U64
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _key(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def varint_field(field: int, value: int) -> bytes:
    return _key(field, WIRE_VARINT) + varint(int(value))


def bytes_field(field: int, data: bytes) -> bytes:
    return _key(field, WIRE_LENGTH) + varint(len(data)) + bytes(data)


def _implicit(encode: Callable[[int, Any], bytes], field: int, value: Any) -> bytes:
    """A proto3 field without explicit presence: its default (0, empty) is not written."""
    return encode(field, value) if value else b""


def create_array_parameter(
    bytes_to_zero: int = 0, ptr_divisibility: int = PTR_DIVISIBILITY
) -> bytes:
    """An encoded Parameter consuming the next buffer (like gpu_triton.create_array_parameter)."""
    array = _implicit(varint_field, ARRAY_BYTES_TO_ZERO, bytes_to_zero)
    array += _implicit(varint_field, ARRAY_PTR_DIVISIBILITY, ptr_divisibility)
    return bytes_field(PARAM_FIELDS["array"], array)  # oneof member: written even when empty


def create_scalar_parameter(value: float | int | bool, dtype: str) -> bytes:
    """An encoded scalar Parameter, ``dtype`` one of bool, i32, u32, i64, u64, fp32, fp64 (like
    gpu_triton.create_scalar_parameter). A oneof member is written even when it is 0."""
    field = PARAM_FIELDS[dtype]
    if dtype == "fp32":
        return _key(field, WIRE_FIXED32) + struct.pack("<f", float(value))
    if dtype == "fp64":
        return _key(field, WIRE_FIXED64) + struct.pack("<d", float(value))
    bits = {"bool": 1, "i32": 32, "u32": 32, "i64": 64, "u64": 64}[dtype]
    value = int(value)
    low, high = (0, 1 << bits) if dtype[0] in "bu" else (-(1 << bits - 1), 1 << bits - 1)
    if not low <= value < high:
        raise OverflowError(f"{value} does not fit a {dtype} kernel parameter")
    return varint_field(field, value)


def kernel_message(
    kernel_name: str,
    num_warps: int,
    shared_mem_bytes: int,
    ptx: bytes,
    compute_capability: int,
    num_ctas: int = 1,
) -> bytes:
    """An encoded TritonKernel (no ttir); num_ctas, an explicit-presence field, is written as
    jaxlib's own ToProto writes it (1: a plain cuLaunchKernel, no cluster)."""
    return b"".join(
        (
            _implicit(bytes_field, KERNEL_NAME, kernel_name.encode()),
            _implicit(varint_field, KERNEL_NUM_WARPS, num_warps),
            _implicit(varint_field, KERNEL_SHARED_MEM, shared_mem_bytes),
            _implicit(bytes_field, KERNEL_PTX, ptx),
            _implicit(varint_field, KERNEL_COMPUTE_CAPABILITY, compute_capability),
            varint_field(KERNEL_NUM_CTAS, num_ctas),
        )
    )


def kernel_call_message(
    kernel: bytes, grid: tuple[int, int, int], parameters: list[bytes]
) -> bytes:
    """An encoded TritonKernelCall from an encoded kernel and encoded parameters."""
    fields = [bytes_field(CALL_KERNEL, kernel)]
    for field, size in zip((CALL_GRID_0, CALL_GRID_1, CALL_GRID_2), grid, strict=True):
        fields.append(_implicit(varint_field, field, size))
    fields += [bytes_field(CALL_PARAMETERS, p) for p in parameters]
    return b"".join(fields)


def any_kernel_call_message(kernel_call: bytes, name: str = "", metadata: bytes = b"") -> bytes:
    """An encoded TritonAnyKernelCall (what ``TritonKernelCall.to_proto(name, metadata)`` gives)."""
    return (
        bytes_field(ANY_KERNEL_CALL, kernel_call)
        + _implicit(bytes_field, ANY_METADATA, metadata)
        + _implicit(bytes_field, ANY_NAME, name.encode())
    )


# ---- decoding (tests, debugging: what exactly does a custom call launch?) -------------------


def parse_message(data: bytes) -> list[tuple[int, int, int | bytes]]:
    """(field, wire type, value) of every field of one encoded message, in order; varints as
    unsigned ints, fixed32/fixed64 and length-delimited values as raw bytes."""
    fields: list[tuple[int, int, int | bytes]] = []
    pos = 0

    def read_varint() -> int:
        nonlocal pos
        result = shift = 0
        while True:
            if pos >= len(data) or shift > 63:
                raise ValueError("truncated or overlong varint")
            byte = data[pos]
            pos += 1
            result |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                return result

    while pos < len(data):
        key = read_varint()
        field, wire = key >> 3, key & 7
        value: int | bytes
        if wire == WIRE_VARINT:
            value = read_varint()
        elif wire in (WIRE_FIXED32, WIRE_FIXED64, WIRE_LENGTH):
            size = {WIRE_FIXED32: 4, WIRE_FIXED64: 8}.get(wire) or read_varint()
            if pos + size > len(data):
                raise ValueError(f"field {field}: truncated")
            value, pos = data[pos : pos + size], pos + size
        else:
            raise ValueError(f"field {field}: unsupported wire type {wire}")
        fields.append((field, wire, value))
    return fields


def _signed(value: int, bits: int) -> int:
    value &= (1 << bits) - 1
    return value - (1 << bits) if value >> (bits - 1) else value


@dataclass(frozen=True)
class DecodedKernelCall:
    """A TritonAnyKernelCall holding one TritonKernelCall, as the handler will read it."""

    name: str
    kernel_name: str
    num_warps: int
    num_ctas: int | None
    shared_mem_bytes: int
    ptx: bytes
    compute_capability: int
    grid: tuple[int, int, int]
    # ("array", (bytes_to_zero, ptr_divisibility)) or (dtype, value) per parameter, in order
    parameters: tuple[tuple[str, Any], ...]


def decode_kernel_call(opaque: bytes) -> DecodedKernelCall:
    """Decode a custom call's ``opaque`` attribute (zlib-compressed TritonAnyKernelCall)."""
    top = parse_message(zlib.decompress(opaque))
    call = next(v for f, _, v in top if f == ANY_KERNEL_CALL)
    name = b"".join(v for f, _, v in top if f == ANY_NAME).decode()
    call_fields = parse_message(call)
    kernel = dict((f, v) for f, _, v in parse_message(_one(call_fields, CALL_KERNEL, b"")))
    parameters = []
    kinds = {number: kind for kind, number in PARAM_FIELDS.items()}
    for f, _, raw in call_fields:
        if f != CALL_PARAMETERS:
            continue
        ((field, _, value),) = parse_message(raw)
        kind = kinds[field]
        if kind == "array":
            array = dict((a, b) for a, _, b in parse_message(value))
            decoded: Any = (array.get(ARRAY_BYTES_TO_ZERO, 0), array.get(ARRAY_PTR_DIVISIBILITY, 0))
        elif kind == "fp32":
            decoded = struct.unpack("<f", value)[0]
        elif kind == "fp64":
            decoded = struct.unpack("<d", value)[0]
        elif kind in ("i32", "i64"):
            decoded = _signed(value, 32 if kind == "i32" else 64)
        else:
            decoded = value
        parameters.append((kind, decoded))
    return DecodedKernelCall(
        name=name,
        kernel_name=kernel.get(KERNEL_NAME, b"").decode(),
        num_warps=kernel.get(KERNEL_NUM_WARPS, 0),
        num_ctas=kernel.get(KERNEL_NUM_CTAS),
        shared_mem_bytes=kernel.get(KERNEL_SHARED_MEM, 0),
        ptx=kernel.get(KERNEL_PTX, b""),
        compute_capability=kernel.get(KERNEL_COMPUTE_CAPABILITY, 0),
        grid=tuple(_one(call_fields, f, 0) for f in (CALL_GRID_0, CALL_GRID_1, CALL_GRID_2)),
        parameters=tuple(parameters),
    )


def _one(fields: list[tuple[int, int, Any]], number: int, default: Any) -> Any:
    values = [v for f, _, v in fields if f == number]
    return values[-1] if values else default  # protobuf: the last occurrence wins


# ---- PTX ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ptx:
    ptx: bytes
    lowered_name: str  # the mangled name cuModuleGetFunction finds the kernel by


@functools.cache
def compile_ptx(source_file: str, name_expression: str, compute_capability: int) -> Ptx:
    """PTX of one instantiation for ``compute_<compute_capability>``, compiled with NVRTC and the
    options CuPy compiles the eager path with (toolchain.common_options, -ftz=true)."""
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as exc:
        raise RuntimeError(
            "cuattn under jax.jit on a GPU compiles its kernels with NVRTC through CuPy: "
            "pip install 'cuattn[cuda12]' (or [nvrtc])"
        ) from exc
    program = nvrtc.createProgram(kernel_program(source_file), source_file, [], [])
    try:
        nvrtc.addNameExpression(program, name_expression)
        options = [ptx_arch_option(compute_capability), *common_options(), *CUPY_IMPLICIT_OPTIONS]
        try:
            nvrtc.compileProgram(program, options)
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program).rstrip("\x00")
            raise RuntimeError(f"NVRTC failed on {name_expression}: {exc}\n{log}") from exc
        ptx = nvrtc.getPTX(program)
        lowered = nvrtc.getLoweredName(program, name_expression)
    finally:
        nvrtc.destroyProgram(program)
    ptx = ptx if isinstance(ptx, bytes) else ptx.encode()
    return Ptx(ptx.rstrip(b"\x00"), lowered)


def kernel_call_opaque(
    config: KernelConfig, parameters: list[bytes], compute_capability: int
) -> bytes:
    """The ``opaque`` attribute of one launch of ``config`` with these encoded parameters."""
    compiled = compile_ptx(config.source_file, config.name_expression, compute_capability)
    assert config.block_dims == (config.num_warps * geometry.WARP_SIZE, 1, 1), config.block_dims
    kernel = kernel_message(
        compiled.lowered_name,
        config.num_warps,
        config.smem_bytes,
        compiled.ptx,
        compute_capability,
    )
    call = kernel_call_message(kernel, config.grid, parameters)
    return zlib.compress(any_kernel_call_message(call, CALL_NAME_PREFIX + config.name_expression))
