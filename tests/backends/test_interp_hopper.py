"""The Hopper primitives of kernels/common/tma.cuh and wgmma.cuh under the CPU interpreter,
against the layouts the PTX ISA documents, and their misuse, which the interpreter reports where
a GPU would not.

Expected shared-memory layouts come from the PTX ISA's "Swizzling Modes" tables (section
"Tensors"), written out below as the document prints them; the rules for tensor-map copies from
its "Tiled Mode" ("Out of Boundary Access": zero fill) and the CUDA programming guide's
"Shared-Memory Bank Swizzling" (alignment of each swizzle mode). wgmma operands are laid out by
the PTX ISA's K-major "Canonical Layouts" with those swizzle tables, descriptors follow its
"Matrix Descriptor Format" and its worked examples' encodings, and accumulators are placed by
CUTLASS's CLayout_64xN (cute/atom/mma_traits_sm90_gmma.hpp), the text form of the PTX ISA's
figure of the wgmma .m64nNk16 D fragment."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest

from cuattn.backends import interp
from cuattn.backends.tensor_map import Swizzle, TensorMap2D
from tests.helpers.interp_run import run

ml_dtypes = pytest.importorskip("ml_dtypes")

SOURCE = Path(__file__).parent / "kernels" / "hopper.cu"
THREADS = 64
TILE_OFFSET = 1024  # hopper.cu: the tile's place in shared memory, after the mbarrier
SMEM = 4096
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
# Bytes of a box row each mode allows (the widest is used below; no swizzle: one line).
SWIZZLE_WIDTH = {Swizzle.NONE: 128, Swizzle.B32: 32, Swizzle.B64: 64, Swizzle.B128: 128}
# CUDA programming guide, "Shared-Memory Bank Swizzling": bytes after which the pattern repeats.
SWIZZLE_REPEAT = {Swizzle.B32: 256, Swizzle.B64: 512, Swizzle.B128: 1024}
GLOBAL_ALIGNMENT = 128  # the guide's global alignment for the swizzled modes

WGMMA_BUGS = 7  # hopper.cu's WgmmaBug
WGMMA_SHAPES = [("__nv_bfloat16", 64), ("__half", 16)]
# wgmma.mma_async chained along K per swizzle mode: one swizzle row of 16-bit elements (no
# swizzle: 16 elements).
WGMMA_STEPS = {Swizzle.NONE: 1, Swizzle.B32: 1, Swizzle.B64: 2, Swizzle.B128: 4}
BUGGY_SHAPE = "__nv_bfloat16, 64, 4"  # the misuse tests: bf16, N = 64, the 128B swizzle
EXPRESSIONS = [
    "test_wgmma_descriptor",
    *[
        f"test_wgmma<{t}, {n}, {steps}, 0>"
        for t, n in WGMMA_SHAPES
        for steps in sorted(set(WGMMA_STEPS.values()))
    ],
    *[f"test_wgmma<{BUGGY_SHAPE}, {bug}>" for bug in range(1, WGMMA_BUGS)],
    "test_tma_load<true, false>",
    "test_tma_load<false, false>",
    "test_tma_load<true, true>",
    *[f"test_tma_round_trip<{bug}>" for bug in range(4)],
]


@pytest.fixture(scope="module")
def lib() -> interp.Library:
    return interp.build_library(SOURCE, EXPRESSIONS)


def aligned_array(shape: tuple[int, int], dtype, alignment: int = GLOBAL_ALIGNMENT) -> np.ndarray:
    """A zeroed C-contiguous array whose first element is `alignment`-byte aligned."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.zeros(shape[0] * shape[1] * itemsize + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + shape[0] * shape[1] * itemsize].view(dtype).reshape(shape)


# A u16 tensor of 20 rows x 66 columns in rows padded to 72 elements (144 bytes, a multiple of
# 16 as tensor-map strides must be); every element distinct and non-zero.
ROWS, COLUMNS, PITCH = 20, 66, 72


def u16_tensor() -> np.ndarray:
    tensor = aligned_array((ROWS, PITCH), np.uint16)
    tensor[:] = np.arange(1, ROWS * PITCH + 1, dtype=np.uint16).reshape(ROWS, PITCH)
    return tensor


def documented_tile(tensor: np.ndarray, box, x: int, y: int, swizzle: Swizzle) -> np.ndarray:
    """The tile's bytes as the PTX ISA's tables lay them out: cell p of line L holds chunk
    TABLE[L % repeat][p] of the unswizzled line L, whose elements are those of box row
    (offset // row bytes) or zero outside the tensor."""
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
                if 0 <= row < tensor.shape[0] and 0 <= first + j < COLUMNS:
                    chunk[j] = tensor[row, first + j]
            start = line * LINE + cell * CHUNK
            tile[start : start + CHUNK] = chunk.view(np.uint8)
    return tile


def load(
    lib, map_, x, y, *, tile_offset=TILE_OFFSET, announced=None, wait=True, copy_first=False
) -> np.ndarray:
    box_bytes = map_.box[0] * map_.box[1] * map_.element_bytes
    out = np.zeros(box_bytes, np.uint8)
    run(
        lib,
        f"test_tma_load<{str(wait).lower()}, {str(copy_first).lower()}>",
        1,
        THREADS,
        map_.interp_struct(),
        x,
        y,
        tile_offset,
        box_bytes if announced is None else announced,
        out,
        box_bytes,
        smem=SMEM,
    )
    return out


def widest_box(swizzle: Swizzle) -> tuple[int, int]:
    return SWIZZLE_WIDTH[swizzle] // 2, 8


@pytest.mark.parametrize("swizzle", list(Swizzle), ids=lambda s: s.name)
@pytest.mark.parametrize(
    "x, y",
    [(0, 0), (48, 16), (-8, -3)],
    ids=["inside", "past the last row and column", "before the first row and column"],
)
def test_tma_load_lays_the_box_out_as_the_ptx_isa_swizzle_tables(lib, swizzle, x, y):
    tensor = u16_tensor()
    box = widest_box(swizzle)
    map_ = TensorMap2D.of(tensor, box, swizzle, columns=COLUMNS)
    tile = load(lib, map_, x, y)
    np.testing.assert_array_equal(tile, documented_tile(tensor, box, x, y, swizzle))


def test_the_documented_tables_are_the_chunk_xor_line_rule():
    """The CUDA guide's index relation smem[y][x] <-> smem[y][(y % n) ^ x] for a buffer aligned
    to the repeat: a second reading of the same documentation that the tables above must agree
    with (a typo in a table would otherwise make the test expect the wrong layout)."""
    for swizzle, table in SWIZZLE_TABLES.items():
        for line, cells in enumerate(table):
            assert cells == [line ^ cell for cell in range(LINE // CHUNK)], swizzle


def test_the_destination_reads_as_poison_until_the_phase_completes(lib, monkeypatch):
    """A reader that skips the mbarrier wait sees the 0xFF the destination holds from the issue:
    warp 0, which issues the copy, reads it in its own turn whichever warp runs first."""
    map_ = TensorMap2D.of(u16_tensor(), widest_box(Swizzle.B128), Swizzle.B128, columns=COLUMNS)
    for seed in range(4):
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        early = load(lib, map_, 0, 0, wait=False)
        first_warp = np.arange(len(early)) % THREADS < 32
        assert (early[first_warp] == 0xFF).all(), f"seed {seed}"


def test_the_bytes_may_be_announced_after_the_copy(lib):
    """The CUDA guide's examples issue the TMA, then arrive with expect_tx: on a GPU the copy's
    bytes complete on the barrier later, so the transaction count never runs short."""
    tensor = u16_tensor()
    map_ = TensorMap2D.of(tensor, widest_box(Swizzle.B128), Swizzle.B128, columns=COLUMNS)
    tile = load(lib, map_, 0, 0, copy_first=True)
    np.testing.assert_array_equal(tile, documented_tile(tensor, map_.box, 0, 0, Swizzle.B128))


@pytest.mark.parametrize(
    "swizzle, offset, match",
    [
        (Swizzle.NONE, TILE_OFFSET + 64, "not 128-byte aligned"),
        *[
            (s, TILE_OFFSET + 128, f"not aligned to the pattern's {SWIZZLE_REPEAT[s]}-byte repeat")
            for s in (Swizzle.B32, Swizzle.B64, Swizzle.B128)
        ],
    ],
)
def test_a_destination_misaligned_for_its_swizzle_fails_the_launch(lib, swizzle, offset, match):
    """The fixed twin is the layout test above (the same load at an aligned offset)."""
    map_ = TensorMap2D.of(u16_tensor(), widest_box(swizzle), swizzle, columns=COLUMNS)
    with pytest.raises(RuntimeError, match=match):
        load(lib, map_, 0, 0, tile_offset=offset)


@pytest.mark.parametrize(
    "first_column, box, swizzle, match",
    [
        (0, widest_box(Swizzle.B128), Swizzle.B64, "128 bytes, wider than the 64-byte swizzle"),
        (8, widest_box(Swizzle.B64), Swizzle.B64, "a global address not aligned to 128 bytes"),
    ],
    ids=["box wider than the swizzle", "swizzled tensor 16-byte aligned"],
)
def test_a_tensor_map_the_driver_would_refuse_fails_the_launch(
    lib, first_column, box, swizzle, match
):
    """The CUDA guide's table for compute capability 9: a box row at most the swizzle width,
    global memory 128-byte aligned when swizzled. The fixed twins are the layout tests."""
    tensor = u16_tensor()[:, first_column:]
    map_ = TensorMap2D.of(tensor, box, swizzle, columns=COLUMNS - first_column)
    with pytest.raises(RuntimeError, match=f"invalid tensor map: .*{match}"):
        load(lib, map_, 0, 0)


def test_the_whole_box_counts_against_expect_tx_even_outside_the_tensor(lib):
    """A box past the tensor's edge still completes all its bytes (the zero-filled ones too):
    announcing only the elements inside leaves too few bytes expected. The fixed twin is the
    layout test's "past the last row and column" case, which announces the whole box."""
    map_ = TensorMap2D.of(u16_tensor(), widest_box(Swizzle.B128), Swizzle.B128, columns=COLUMNS)
    inside = (COLUMNS - 48) * (ROWS - 16) * 2
    with pytest.raises(RuntimeError, match=r"too few bytes expected"):
        load(lib, map_, 48, 16, announced=inside)


# The round trip: a float tensor of 12 rows x 36 columns in rows padded to 40, a box of 32 x 8
# (128-byte rows, the 128-byte swizzle) at (16, 8), past both edges.
TRIP_ROWS, TRIP_COLUMNS, TRIP_PITCH, TRIP_BOX, TRIP_X, TRIP_Y = 12, 36, 40, (32, 8), 16, 8
UNTOUCHED = -1.0


def round_trip(lib, bug: int) -> tuple[np.ndarray, np.ndarray]:
    source = aligned_array((TRIP_ROWS, TRIP_PITCH), np.float32)
    source[:] = np.random.default_rng(11).standard_normal(source.shape)
    target = aligned_array((TRIP_ROWS, TRIP_PITCH), np.float32)
    target[:] = UNTOUCHED
    maps = [
        TensorMap2D.of(a, TRIP_BOX, Swizzle.B128, columns=TRIP_COLUMNS).interp_struct()
        for a in (source, target)
    ]
    run(lib, f"test_tma_round_trip<{bug}>", 1, THREADS, *maps, TRIP_X, TRIP_Y, smem=SMEM)
    return source, target


def test_tma_store_writes_the_box_back_inside_the_tensor_only(lib, monkeypatch):
    for seed in range(4):  # whichever warp runs first
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        source, target = round_trip(lib, 0)
        expected = np.full_like(source, UNTOUCHED)
        rows = slice(TRIP_Y, TRIP_ROWS)
        columns = slice(TRIP_X, TRIP_COLUMNS)
        expected[rows, columns] = 2 * source[rows, columns]
        np.testing.assert_array_equal(target, expected, err_msg=f"seed {seed}")


@pytest.mark.parametrize(
    "bug, match",
    [
        (1, r"exits with 1 TMA store\(s\) still reading shared memory"),
        (2, r"changed before cp.async.bulk.wait_group.read retired it"),
        (
            3,
            r"a TMA store reads shared-memory offset \d+, written by plain stores with no "
            r"fence.proxy.async after them",
        ),
    ],
)
def test_tma_store_misuse_fails_the_launch(lib, bug, match):
    """The fixed twin of each is the round trip above."""
    with pytest.raises(RuntimeError, match=match):
        round_trip(lib, bug)


def test_the_tma_ptx_assembles_for_sm_90a_to_utmaldg_and_utmastg():
    """The GPU side of kernels/common/tma.cuh, which the interpreter never compiles: NVRTC
    compiles it for sm_90a, and the SASS holds the TMA unit's load and store."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options
    from cuattn.tools import sass, sass_model

    problem = sass_model.missing_tools()
    if problem is not None:
        pytest.skip(f"no SASS tools: {problem}")
    options = [*common_options(), f"-I{SOURCE.parent}"]
    lowered, cubin, _ = sass_model.compile_cubin(
        SOURCE.read_text(), SOURCE.name, "test_tma_round_trip<0>", options, arch="sm_90a"
    )
    with tempfile.TemporaryDirectory() as workdir:
        kernel = sass.parse(sass.disassemble(cubin, Path(workdir)))[lowered]
    opcodes = {instruction.base for instruction in kernel.instructions}
    assert {"UTMALDG", "UTMASTG"} <= opcodes, sorted(opcodes)


# ---- wgmma ------------------------------------------------------------------------------------

# PTX ISA, "Matrix Descriptor Format": the swizzle field's values.
DESCRIPTOR_SWIZZLE = {Swizzle.NONE: 0, Swizzle.B128: 1, Swizzle.B64: 2, Swizzle.B32: 3}


@pytest.mark.parametrize(
    "offset, leading, stride, swizzle, expected",
    [
        # "K-Major, no-swizzling and tf32 type": LBO 64 * 4 bytes encodes as 16, SBO 32 * 4 as 8
        (0, 256, 128, Swizzle.NONE, 0x0000_0008_0010_0000),
        # "MN-Major, 64B swizzling and bf16 type": LBO 256 * 2 bytes -> 32, SBO 512 * 2 -> 64
        (1024, 512, 1024, Swizzle.B64, 0x8000_0040_0020_0040),
        # "MN-Major, 32B swizzling and bf16 type": LBO 128 * 2 -> 16, SBO 256 * 2 -> 32; the
        # start address field is (address & 0x3FFFF) >> 4 in bits 0-13
        (0x3FFF0, 256, 512, Swizzle.B32, 0xC000_0020_0010_3FFF),
        # 128B swizzle: field value 1 in bits 62-63
        (2048, 16, 1024, Swizzle.B128, 0x4000_0040_0001_0080),
    ],
)
def test_wgmma_descriptor_is_the_documented_bit_layout(
    lib, offset, leading, stride, swizzle, expected
):
    out = np.zeros(1, np.uint64)
    run(
        lib,
        "test_wgmma_descriptor",
        1,
        32,
        offset,
        leading,
        stride,
        DESCRIPTOR_SWIZZLE[swizzle],
        out,
        smem=offset + 16,
    )
    assert int(out[0]) == expected, hex(int(out[0]))


WARPGROUP = 128
HALF_TYPES = {"__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16}
ELEMENT_BYTES = 2
PER_CHUNK = CHUNK // ELEMENT_BYTES  # T of the canonical layouts for 16-bit elements
NO_SWIZZLE_CORE_BYTES = 8 * CHUNK  # one 8 x 16-byte core matrix


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


def place(image: np.ndarray, matrix: np.ndarray, base: int, swizzle, leading, stride) -> None:
    """Writes a K-major matrix into the shared-memory image, moving each 16-byte chunk to the
    cell the swizzle table gives it."""
    table = SWIZZLE_TABLES[swizzle]
    raw = matrix.view(np.uint16)
    for row in range(matrix.shape[0]):
        for k in range(matrix.shape[1]):
            unswizzled = base + canonical_offset(row, k, swizzle, leading, stride)
            line, cell = divmod(unswizzled, LINE)
            chunk, within = divmod(cell, CHUNK)
            moved = table[line % len(table)].index(chunk)
            at = line * LINE + moved * CHUNK + within
            image[at : at + ELEMENT_BYTES] = np.frombuffer(raw[row, k].tobytes(), np.uint8)


def accumulator_positions(n: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of accumulator i of thread t: CUTLASS's CLayout_64xN, shape
    ((4, 8, 4), (2, 2, N/8)), stride ((128, 1, 16), (64, 8, 512)), into a column-major 64 x N."""
    t = np.arange(WARPGROUP)[:, None]
    i = np.arange(n // 2)[None, :]
    index = 128 * (t % 4) + (t // 4 % 8) + 16 * (t // 32) + 64 * (i % 2) + 8 * (i // 2 % 2)
    index = index + 512 * (i // 4)
    return index % 64, index // 64


# (leading, stride) bytes per mode, for operands whose K is one swizzle row (16 elements
# without swizzle: two core matrices side by side).
def operand_strides(swizzle: Swizzle) -> tuple[int, int]:
    if swizzle == Swizzle.NONE:
        return NO_SWIZZLE_CORE_BYTES, 2 * NO_SWIZZLE_CORE_BYTES
    return CHUNK, 8 * SWIZZLE_WIDTH[swizzle]


def wgmma(lib, cxx_type: str, n: int, swizzle: Swizzle, bug: int = 0, seed: int = 12):
    dtype = HALF_TYPES[cxx_type]
    steps = WGMMA_STEPS[swizzle]
    k_total = 16 * steps
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((64, k_total)).astype(dtype)
    b = rng.standard_normal((n, k_total)).astype(dtype)
    leading, stride = operand_strides(swizzle)
    a_offset = TILE_OFFSET
    b_offset = a_offset + 8 * stride
    image = np.zeros(b_offset + (n // 8) * stride, np.uint8)
    place(image, a, a_offset, swizzle, leading, stride)
    place(image, b, b_offset, swizzle, leading, stride)
    out = np.zeros((WARPGROUP, n // 2), np.float32)
    run(
        lib,
        f"test_wgmma<{cxx_type}, {n}, {steps}, {bug}>",
        1,
        WARPGROUP,
        image,
        len(image),
        a_offset,
        b_offset,
        leading,
        stride,
        DESCRIPTOR_SWIZZLE[swizzle],
        16 * ELEMENT_BYTES,
        out,
        smem=len(image),
    )
    return a, b, out


@pytest.mark.parametrize("swizzle", list(Swizzle), ids=lambda s: s.name)
@pytest.mark.parametrize("cxx_type, n", WGMMA_SHAPES)
def test_wgmma_multiplies_the_documented_layouts_into_the_documented_fragment(
    lib, cxx_type, n, swizzle
):
    """A and B laid out as the PTX ISA documents each swizzle mode (the 64B and 128B cases chain
    2 and 4 instructions along K, the descriptors advancing 32 bytes inside the swizzle row),
    each thread's accumulators at the places CUTLASS's CLayout_64xN gives."""
    a, b, out = wgmma(lib, cxx_type, n, swizzle)
    expected = a.astype(np.float64) @ b.astype(np.float64).T
    rows, columns = accumulator_positions(n)
    np.testing.assert_allclose(out, expected[rows, columns], rtol=1e-5, atol=1e-5)


def test_accumulators_read_before_wait_group_are_nan(lib):
    _, _, out = wgmma(lib, "__nv_bfloat16", 64, Swizzle.B128, bug=3)
    assert np.isnan(out).all()


@pytest.mark.parametrize(
    "bug, match",
    [
        (
            1,
            r"a wgmma.mma_async operand reads shared-memory offset \d+, written by plain stores "
            r"with no fence.proxy.async",
        ),
        (2, r"wgmma.mma_async with no wgmma.fence"),
        (4, r"accumulator registers of a wgmma.mma_async written before the wgmma.wait_group"),
        (5, r"wgmma operand shared memory at offset \d+ changed between wgmma.mma_async and"),
        (6, r"thread 96 issued other wgmma.mma_async than thread 0 of its warpgroup"),
    ],
)
def test_wgmma_misuse_fails_the_launch(lib, bug, match):
    """The fixed twin of each is the layout test above (the same kernel without the bug)."""
    with pytest.raises(RuntimeError, match=match):
        wgmma(lib, "__nv_bfloat16", 64, Swizzle.B128, bug=bug)


def test_the_wgmma_ptx_assembles_for_sm_90a_to_hgmma():
    """NVRTC compiles kernels/common/wgmma.cuh for sm_90a; the SASS holds HGMMA."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options
    from cuattn.tools import sass, sass_model

    problem = sass_model.missing_tools()
    if problem is not None:
        pytest.skip(f"no SASS tools: {problem}")
    options = [*common_options(), f"-I{SOURCE.parent}"]
    for cxx_type, n in WGMMA_SHAPES:
        lowered, cubin, log = sass_model.compile_cubin(
            SOURCE.read_text(), SOURCE.name, f"test_wgmma<{cxx_type}, {n}, 4, 0>", options, "sm_90a"
        )
        with tempfile.TemporaryDirectory() as workdir:
            kernel = sass.parse(sass.disassemble(cubin, Path(workdir)))[lowered]
        assert any(i.base == "HGMMA" for i in kernel.instructions), cxx_type
        # no ptxas note of waits injected between the instructions (C7519) or of the
        # instructions serialized
        assert "C7519" not in log and "serialized" not in log, log
