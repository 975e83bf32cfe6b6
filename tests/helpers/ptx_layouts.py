"""The Hopper layouts the PTX ISA documents, written out in NumPy: what the kernels of
tests/backends/kernels/hopper.cu must produce, on the CPU interpreter
(tests/backends/test_interp_hopper.py) and on a GPU (scripts/hopper_probe.py).

Nothing here comes from the code under test. The swizzle tables are the PTX ISA's "Swizzling
Modes" tables (section "Tensors") as the document prints them; wgmma operands follow its K-major
and MN-major "Canonical Layouts"; the register fragments of wgmma .m64nNk16 ("Register
Fragments", which gives them as figures) are placed by their text forms in CUTLASS
(cute/atom/mma_traits_sm90_gmma.hpp): CLayout_64xN for the accumulators D, ALayout_64x16
(defined there as CLayout_64x16) for A.
"""

from __future__ import annotations

import numpy as np

from cuattn.backends.tensor_map import Swizzle

LINE = 128  # bytes of one shared-memory line of the swizzle tables
CHUNK = 16  # bytes of one numbered cell of the tables

# PTX ISA, "Swizzling Modes": for each mode, which 16-byte chunk of the line (as it would be
# laid out without swizzle) each 16-byte cell of a 128-byte shared-memory line holds, line
# after line until the pattern repeats.
SWIZZLE_TABLES = {
    Swizzle.NONE: [
        [0, 1, 2, 3, 4, 5, 6, 7],
    ],
    Swizzle.B32: [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [1, 0, 3, 2, 5, 4, 7, 6],
    ],
    Swizzle.B64: [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [1, 0, 3, 2, 5, 4, 7, 6],
        [2, 3, 0, 1, 6, 7, 4, 5],
        [3, 2, 1, 0, 7, 6, 5, 4],
    ],
    Swizzle.B128: [
        [0, 1, 2, 3, 4, 5, 6, 7],
        [1, 0, 3, 2, 5, 4, 7, 6],
        [2, 3, 0, 1, 6, 7, 4, 5],
        [3, 2, 1, 0, 7, 6, 5, 4],
        [4, 5, 6, 7, 0, 1, 2, 3],
        [5, 4, 7, 6, 1, 0, 3, 2],
        [6, 7, 4, 5, 2, 3, 0, 1],
        [7, 6, 5, 4, 3, 2, 1, 0],
    ],
}
# Bytes of a box row each mode allows (no swizzle: one line).
SWIZZLE_WIDTH = {Swizzle.NONE: 128, Swizzle.B32: 32, Swizzle.B64: 64, Swizzle.B128: 128}
GLOBAL_ALIGNMENT = 128  # the CUDA guide's global alignment for the swizzled modes


def aligned_array(shape: tuple[int, int], dtype, alignment: int = GLOBAL_ALIGNMENT) -> np.ndarray:
    """A zeroed C-contiguous array whose first element is `alignment`-byte aligned."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(shape[0] * shape[1] * itemsize + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + shape[0] * shape[1] * itemsize].view(dtype).reshape(shape)


def widest_box(swizzle: Swizzle) -> tuple[int, int]:
    """A box of 16-bit elements with rows as wide as the mode allows, 8 rows."""
    return SWIZZLE_WIDTH[swizzle] // 2, 8


def documented_tile(tensor: np.ndarray, columns: int, box, x: int, y: int, swizzle) -> np.ndarray:
    """The bytes a TMA load of the box at (x, y) of `tensor` (its first `columns` columns)
    lands, as the PTX ISA's tables lay them out: cell p of line L holds chunk TABLE[L % repeat][p]
    of the unswizzled line L, whose elements are those of box row (offset // row bytes) or zero
    outside the tensor ("Tiled Mode", "Out of Boundary Access")."""
    table = SWIZZLE_TABLES[swizzle]
    itemsize = tensor.itemsize
    row_bytes = box[0] * itemsize
    tile = np.zeros(row_bytes * box[1], np.uint8)
    for line in range(len(tile) // LINE):
        for cell in range(LINE // CHUNK):
            unswizzled = line * LINE + table[line % len(table)][cell] * CHUNK
            box_row, column_bytes = divmod(unswizzled, row_bytes)
            row, first = y + box_row, x + column_bytes // itemsize
            chunk = np.zeros(CHUNK // itemsize, tensor.dtype)
            for j in range(len(chunk)):
                if 0 <= row < tensor.shape[0] and 0 <= first + j < columns:
                    chunk[j] = tensor[row, first + j]
            start = line * LINE + cell * CHUNK
            tile[start : start + CHUNK] = chunk.view(np.uint8)
    return tile


# ---- wgmma ------------------------------------------------------------------------------------

WARPGROUP = 128
WGMMA_M = 64
WGMMA_K = 16
# PTX ISA, "Matrix Descriptor Format": the swizzle field's values.
DESCRIPTOR_SWIZZLE = {Swizzle.NONE: 0, Swizzle.B128: 1, Swizzle.B64: 2, Swizzle.B32: 3}
ELEMENT_BYTES = 2
PER_CHUNK = CHUNK // ELEMENT_BYTES  # T of the canonical layouts for 16-bit elements
NO_SWIZZLE_CORE_BYTES = 8 * CHUNK  # one 8 x 16-byte core matrix
# wgmma.mma_async chained along K per swizzle mode: one swizzle row of 16-bit elements (no
# swizzle: 16 elements).
WGMMA_STEPS = {Swizzle.NONE: 1, Swizzle.B32: 1, Swizzle.B64: 2, Swizzle.B128: 4}
A_REGISTERS = 4  # 32-bit registers of a thread's A fragment, two 16-bit elements each
# The 128B swizzle's repeat, the largest: an operand starting on it starts on every mode's.
PATTERN_REPEAT_MAX = 1024


def canonical_offset(row: int, k: int, swizzle: Swizzle, leading: int, stride: int) -> int:
    """Byte offset of element (row, k) in the PTX ISA's K-major canonical layouts (in elements,
    T = 8): no swizzle ((8,m),(T,2k)):((1T,SBO),(1,LBO)); 32/64/128B swizzle
    ((8,m),(T,2k)):((2T|4T|8T,SBO),(1,T)), unswizzled."""
    row_pitch = CHUNK if swizzle == Swizzle.NONE else SWIZZLE_WIDTH[swizzle]
    chunk_step = leading if swizzle == Swizzle.NONE else CHUNK
    return (
        (row % 8) * row_pitch
        + (row // 8) * stride
        + (k % PER_CHUNK) * ELEMENT_BYTES
        + (k // PER_CHUNK) * chunk_step
    )


def mn_major_offset(n: int, k: int, swizzle: Swizzle, leading: int, stride: int) -> int:
    """Byte offset of element (n, k) in the PTX ISA's MN-major canonical layouts (in elements,
    T = 8, W = 2, 4, 8 chunks to the 32, 64, 128B swizzle width): no swizzle
    ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)); swizzled ((T,W,m),(8,k)):((1,T,LBO),(WT,SBO)),
    unswizzled."""
    if swizzle == Swizzle.NONE:
        along_n = (n % PER_CHUNK) * ELEMENT_BYTES + (n // PER_CHUNK) * stride
        return along_n + (k % 8) * CHUNK + (k // 8) * leading
    per_width = SWIZZLE_WIDTH[swizzle] // ELEMENT_BYTES
    along_n = (n % per_width) * ELEMENT_BYTES + (n // per_width) * leading
    return along_n + (k % 8) * SWIZZLE_WIDTH[swizzle] + (k // 8) * stride


def _place_element(image: np.ndarray, value: np.ndarray, unswizzled: int, swizzle) -> None:
    """Writes one 16-bit element where the swizzle table moves its 16-byte chunk."""
    table = SWIZZLE_TABLES[swizzle]
    line, cell = divmod(unswizzled, LINE)
    chunk, within = divmod(cell, CHUNK)
    moved = table[line % len(table)].index(chunk)
    at = line * LINE + moved * CHUNK + within
    image[at : at + ELEMENT_BYTES] = np.frombuffer(value.tobytes(), np.uint8)


def place(image: np.ndarray, matrix: np.ndarray, base: int, swizzle, leading, stride) -> None:
    """Writes a K-major matrix into the shared-memory image, moving each 16-byte chunk to the
    cell the swizzle table gives it."""
    raw = matrix.view(np.uint16)
    for row in range(matrix.shape[0]):
        for k in range(matrix.shape[1]):
            offset = base + canonical_offset(row, k, swizzle, leading, stride)
            _place_element(image, raw[row, k], offset, swizzle)


def place_mn_major(image: np.ndarray, b: np.ndarray, base: int, swizzle, leading, stride) -> None:
    """Writes B (K rows of N) MN-major into the shared-memory image, swizzled as `place`."""
    raw = b.view(np.uint16)
    for k in range(b.shape[0]):
        for n in range(b.shape[1]):
            offset = base + mn_major_offset(n, k, swizzle, leading, stride)
            _place_element(image, raw[k, n], offset, swizzle)


def operand_strides(swizzle: Swizzle) -> tuple[int, int]:
    """(leading, stride) bytes for operands whose K is one swizzle row (16 elements without
    swizzle: two core matrices side by side)."""
    if swizzle == Swizzle.NONE:
        return NO_SWIZZLE_CORE_BYTES, 2 * NO_SWIZZLE_CORE_BYTES
    return CHUNK, 8 * SWIZZLE_WIDTH[swizzle]


def wgmma_image(a: np.ndarray, b: np.ndarray, swizzle: Swizzle, first: int):
    """The shared memory of a wgmma test: A (64 rows of K) at `first`, B (N rows of K) after
    it, in the canonical layout of `swizzle`. Returns (image, a_offset, b_offset, leading,
    stride)."""
    leading, stride = operand_strides(swizzle)
    a_offset = first
    b_offset = a_offset + (WGMMA_M // 8) * stride
    image = np.zeros(b_offset + (b.shape[0] // 8) * stride, np.uint8)
    place(image, a, a_offset, swizzle, leading, stride)
    place(image, b, b_offset, swizzle, leading, stride)
    return image, a_offset, b_offset, leading, stride


def mn_major_strides(swizzle: Swizzle, n: int, k: int) -> tuple[int, int]:
    """(leading, stride) bytes of a dense MN-major B of K rows of N: swizzled, the atoms of 8 K
    rows one after another along K (SBO: one atom), the swizzle-wide columns of atoms after that
    (LBO: K / 8 atoms); without swizzle, core matrices along N first (SBO: one core matrix), the
    groups of 8 K rows after that (LBO: N / 8 core matrices)."""
    if swizzle == Swizzle.NONE:
        return (n // PER_CHUNK) * NO_SWIZZLE_CORE_BYTES, NO_SWIZZLE_CORE_BYTES
    atom = 8 * SWIZZLE_WIDTH[swizzle]
    return (k // 8) * atom, atom


def wgmma_image_mn_major(a: np.ndarray, b: np.ndarray, swizzle: Swizzle, first: int):
    """The shared memory of a wgmma test with B (K rows of N) MN-major: A (64 rows of K,
    K-major as in wgmma_image) at `first`, B after it, both in the canonical layouts of
    `swizzle`. Returns (image, a_offset, b_offset, a_leading, a_stride, b_leading, b_stride,
    b_step): b_step is the bytes from one K-step of 16 rows of B to the next."""
    a_leading, a_stride = operand_strides(swizzle)
    k, n = b.shape
    b_leading, b_stride = mn_major_strides(swizzle, n, k)
    a_offset = first
    a_end = a_offset + (WGMMA_M // 8) * a_stride
    b_offset = -(-a_end // PATTERN_REPEAT_MAX) * PATTERN_REPEAT_MAX
    if swizzle == Swizzle.NONE:
        b_bytes = (k // 8) * b_leading
    else:
        b_bytes = -(-n * ELEMENT_BYTES // SWIZZLE_WIDTH[swizzle]) * b_leading
    image = np.zeros(b_offset + b_bytes, np.uint8)
    place(image, a, a_offset, swizzle, a_leading, a_stride)
    place_mn_major(image, b, b_offset, swizzle, b_leading, b_stride)
    b_step = 2 * (b_leading if swizzle == Swizzle.NONE else b_stride)
    return image, a_offset, b_offset, a_leading, a_stride, b_leading, b_stride, b_step


def wgmma_image_both_mn_major(a: np.ndarray, b: np.ndarray, swizzle: Swizzle, first: int):
    """wgmma_image_mn_major with A MN-major as well: A (64 rows of K) stored as its K rows of 64
    in the MN-major canonical layout at `first`, B (K rows of N) after it. Returns (image,
    a_offset, b_offset, a_leading, a_stride, b_leading, b_stride, a_step, b_step)."""
    k, n = b.shape
    a_leading, a_stride = mn_major_strides(swizzle, WGMMA_M, k)
    b_leading, b_stride = mn_major_strides(swizzle, n, k)
    a_bytes = -(-WGMMA_M * ELEMENT_BYTES // SWIZZLE_WIDTH[swizzle]) * a_leading
    b_offset = -(-(first + a_bytes) // PATTERN_REPEAT_MAX) * PATTERN_REPEAT_MAX
    b_bytes = -(-n * ELEMENT_BYTES // SWIZZLE_WIDTH[swizzle]) * b_leading
    image = np.zeros(b_offset + b_bytes, np.uint8)
    place_mn_major(image, np.ascontiguousarray(a.T), first, swizzle, a_leading, a_stride)
    place_mn_major(image, b, b_offset, swizzle, b_leading, b_stride)
    return (
        image,
        first,
        b_offset,
        a_leading,
        a_stride,
        b_leading,
        b_stride,
        2 * a_stride,
        2 * b_stride,
    )


def accumulator_positions(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of accumulator i of thread t: CUTLASS's CLayout_64xN, shape
    ((4, 8, 4), (2, 2, N/8)), stride ((128, 1, 16), (64, 8, 512)), into a column-major 64 x N."""
    t = np.arange(WARPGROUP)[:, None]
    i = np.arange(n // 2)[None, :]
    index = 128 * (t % 4) + (t // 4 % 8) + 16 * (t // 32) + 64 * (i % 2) + 8 * (i // 2 % 2)
    index = index + 512 * (i // 4)
    return index % WGMMA_M, index // WGMMA_M


def a_fragments(a: np.ndarray) -> np.ndarray:
    """Every thread's A registers for each K-step of 16: [step][thread][register] as uint32,
    element v of a thread at (row, k) of CUTLASS's ALayout_64x16 (= CLayout_64x16), two
    elements to a register, the even one in the low half."""
    rows, ks = accumulator_positions(WGMMA_K)
    steps = a.shape[1] // WGMMA_K
    halves = np.stack([a.view(np.uint16)[rows, s * WGMMA_K + ks] for s in range(steps)])
    pairs = halves.reshape(steps, WARPGROUP, A_REGISTERS, 2).astype(np.uint32)
    return pairs[..., 0] | (pairs[..., 1] << 16)


# ---- mbarrier ---------------------------------------------------------------------------------

# PTX ISA, "mbarrier.test_wait/mbarrier.try_wait": the .parity variant names the current phase
# or the one before it and reports whether that one has completed. test_mbarrier_pipeline reads
# full[0] right after init (current phase 0: parity 0 not complete, parity 1, the "phase before",
# complete) and after its 3 phases (current phase 3, parity 1: the other way round).
PIPELINE_OBSERVED = [0, 1, 1, 0]
