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
from cuattn.backends.tensor_map import Swizzle, TensorMap
from tests.helpers.interp_run import run
from tests.helpers.ptx_layouts import (
    CHUNK,
    DESCRIPTOR_SWIZZLE,
    ELEMENT_BYTES,
    LINE,
    PIPELINE_OBSERVED,
    SWIZZLE_TABLES,
    WARPGROUP,
    WGMMA_K,
    WGMMA_STEPS,
    a_fragments,
    accumulator_positions,
    aligned_array,
    documented_tile,
    wgmma_image,
    wgmma_image_both_mn_major,
    wgmma_image_mn_major,
    widest_box,
)

ml_dtypes = pytest.importorskip("ml_dtypes")

SOURCE = Path(__file__).parent / "kernels" / "hopper.cu"
THREADS = 64
TILE_OFFSET = 1024  # hopper.cu: the tile's place in shared memory, after the mbarrier
SMEM = 4096
# CUDA programming guide, "Shared-Memory Bank Swizzling": bytes after which the pattern repeats.
SWIZZLE_REPEAT = {Swizzle.B32: 256, Swizzle.B64: 512, Swizzle.B128: 1024}

WGMMA_BUGS = 8  # hopper.cu's WgmmaBug
HALF_TYPES = {"__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16}
WGMMA_N = [16, 32, 64, 128, 256]
# Every swizzle mode for these; the 128B swizzle (the forward's) for every N and type.
SWIZZLE_SWEEP_SHAPES = [("__nv_bfloat16", 64), ("__half", 16)]
BUGGY = ("__nv_bfloat16", 64, Swizzle.B128)  # the misuse tests' shape
PIPELINE_EXPRESSIONS = ["test_mbarrier_pipeline<false>", "test_mbarrier_pipeline<true>"]
EARLY_RELEASE_EXPRESSION = "test_mbarrier_pipeline<false, true>"
SKIP_EXPRESSIONS = {
    "waits": "test_mbarrier_pipeline<false, false, SKIP_WAITS>",
    "runs ahead": "test_mbarrier_pipeline<false, false, SKIP_RUNS_AHEAD>",
}


def wgmma_expression(cxx_type: str, n: int, steps: int, bug: int, registers: bool) -> str:
    return f"test_wgmma<{cxx_type}, {n}, {steps}, {bug}, {str(registers).lower()}>"


def mn_major_expression(cxx_type: str, n: int, steps: int, registers: bool) -> str:
    return f"test_wgmma_mn_major<{cxx_type}, {n}, {steps}, {str(registers).lower()}>"


def a_mn_major_expression(cxx_type: str, n: int, steps: int) -> str:
    return f"test_wgmma_mn_major<{cxx_type}, {n}, {steps}, false, true>"


# A MN-major (imm-trans-a = 1) in the shapes the sm_90a backward's dS K takes (N = d / 2).
A_MN_MAJOR_CASES = [("__nv_bfloat16", 64, Swizzle.B128), ("__half", 32, Swizzle.B128)]
WGMMA_CASES = sorted(
    {(t, n, Swizzle.B128) for t in HALF_TYPES for n in WGMMA_N}
    | {(t, n, s) for t, n in SWIZZLE_SWEEP_SHAPES for s in Swizzle}
)
EXPRESSIONS = [
    "test_wgmma_descriptor",
    *sorted(
        {
            wgmma_expression(t, n, WGMMA_STEPS[s], 0, registers)
            for t, n, s in WGMMA_CASES
            for registers in (False, True)
        }
    ),
    *[
        wgmma_expression(BUGGY[0], BUGGY[1], WGMMA_STEPS[BUGGY[2]], bug, registers)
        for bug in range(1, WGMMA_BUGS)
        for registers in (False, True)
    ],
    *sorted(
        {
            mn_major_expression(t, n, WGMMA_STEPS[s], registers)
            for t, n, s in WGMMA_CASES
            for registers in (False, True)
        }
    ),
    *[a_mn_major_expression(t, n, WGMMA_STEPS[s]) for t, n, s in A_MN_MAJOR_CASES],
    "test_tma_load<true, false>",
    "test_tma_load<false, false>",
    "test_tma_load<true, true>",
    *[f"test_tma_round_trip<{bug}>" for bug in range(4)],
    *PIPELINE_EXPRESSIONS,
    EARLY_RELEASE_EXPRESSION,
    *SKIP_EXPRESSIONS.values(),
    "test_tma_load_4d<false>",
    "test_tma_load_4d<true>",
    *[f"test_setmaxnreg<{bug}>" for bug in range(3)],
    *[f"test_named_barrier_turns<{bug}>" for bug in range(3)],
]


@pytest.fixture(scope="module")
def lib() -> interp.Library:
    return interp.build_library(SOURCE, EXPRESSIONS)


# A u16 tensor of 20 rows x 66 columns in rows padded to 72 elements (144 bytes, a multiple of
# 16 as tensor-map strides must be); every element distinct and non-zero.
ROWS, COLUMNS, PITCH = 20, 66, 72


def u16_tensor() -> np.ndarray:
    tensor = aligned_array((ROWS, PITCH), np.uint16)
    tensor[:] = np.arange(1, ROWS * PITCH + 1, dtype=np.uint16).reshape(ROWS, PITCH)
    return tensor


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


@pytest.mark.parametrize("swizzle", list(Swizzle), ids=lambda s: s.name)
@pytest.mark.parametrize(
    "x, y",
    [(0, 0), (48, 16), (-8, -3)],
    ids=["inside", "past the last row and column", "before the first row and column"],
)
def test_tma_load_lays_the_box_out_as_the_ptx_isa_swizzle_tables(lib, swizzle, x, y):
    tensor = u16_tensor()
    box = widest_box(swizzle)
    map_ = TensorMap.of(tensor, box, swizzle, columns=COLUMNS)
    tile = load(lib, map_, x, y)
    np.testing.assert_array_equal(tile, documented_tile(tensor, COLUMNS, box, x, y, swizzle))


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
    map_ = TensorMap.of(u16_tensor(), widest_box(Swizzle.B128), Swizzle.B128, columns=COLUMNS)
    for seed in range(4):
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        early = load(lib, map_, 0, 0, wait=False)
        first_warp = np.arange(len(early)) % THREADS < 32
        assert (early[first_warp] == 0xFF).all(), f"seed {seed}"


def test_the_bytes_may_be_announced_after_the_copy(lib):
    """The CUDA guide's examples issue the TMA, then arrive with expect_tx: on a GPU the copy's
    bytes complete on the barrier later, so the transaction count never runs short."""
    tensor = u16_tensor()
    map_ = TensorMap.of(tensor, widest_box(Swizzle.B128), Swizzle.B128, columns=COLUMNS)
    tile = load(lib, map_, 0, 0, copy_first=True)
    np.testing.assert_array_equal(
        tile, documented_tile(tensor, COLUMNS, map_.box, 0, 0, Swizzle.B128)
    )


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
    map_ = TensorMap.of(u16_tensor(), widest_box(swizzle), swizzle, columns=COLUMNS)
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
    map_ = TensorMap.of(tensor, box, swizzle, columns=COLUMNS - first_column)
    with pytest.raises(RuntimeError, match=f"invalid tensor map: .*{match}"):
        load(lib, map_, 0, 0)


def test_the_whole_box_counts_against_expect_tx_even_outside_the_tensor(lib):
    """A box past the tensor's edge still completes all its bytes (the zero-filled ones too):
    announcing only the elements inside leaves too few bytes expected. The fixed twin is the
    layout test's "past the last row and column" case, which announces the whole box."""
    map_ = TensorMap.of(u16_tensor(), widest_box(Swizzle.B128), Swizzle.B128, columns=COLUMNS)
    inside = (COLUMNS - 48) * (ROWS - 16) * 2
    with pytest.raises(RuntimeError, match=r"too few bytes expected"):
        load(lib, map_, 48, 16, announced=inside)


# A rank-4 u16 tensor [batch 2, heads 3, rows 10, columns 64] stored [batch, rows, heads,
# columns] (a projection's output seen head-major, as the forward reads q, k and v), and the
# forward's box: one 128-byte panel of 8 rows.
BATCH4, HEADS4, ROWS4, COLUMNS4, BOX4 = 2, 3, 10, 64, (64, 8, 1, 1)


def u16_tensor_4d() -> np.ndarray:
    stored = aligned_array((1, BATCH4 * ROWS4 * HEADS4 * COLUMNS4), np.uint16)
    stored[:] = np.arange(1, stored.size + 1, dtype=np.uint16)
    return stored.reshape(BATCH4, ROWS4, HEADS4, COLUMNS4).transpose(0, 2, 1, 3)


def load_4d(lib, map_, coords, wrong_rank=False) -> np.ndarray:
    bytes_ = int(np.prod(map_.box)) * map_.element_bytes
    out = np.zeros(bytes_, np.uint8)
    expression = f"test_tma_load_4d<{str(wrong_rank).lower()}>"
    run(lib, expression, 1, THREADS, map_.interp_struct(), *coords, out, bytes_, smem=SMEM)
    return out


@pytest.mark.parametrize(
    "coords", [(0, 0, 1, 1), (0, 6, 2, 0)], ids=["inside", "past the last row"]
)
def test_a_rank_4_load_lands_the_box_of_its_head_and_batch(lib, coords):
    """Each box row comes from the (head, batch) its coordinates name, at the tensor's own
    strides, with the 128-byte swizzle; rows past the end land as zeros."""
    tensor = u16_tensor_4d()
    map_ = TensorMap.of(tensor, BOX4, Swizzle.B128)
    x, y, z, w = coords
    expected = documented_tile(
        np.ascontiguousarray(tensor[w, z]), COLUMNS4, BOX4[:2], x, y, Swizzle.B128
    )
    np.testing.assert_array_equal(load_4d(lib, map_, coords), expected)


def test_a_load_of_another_rank_than_its_map_fails_the_launch(lib):
    """cp.async.bulk.tensor.2d on a rank-4 map: the fixed twin is the test above."""
    map_ = TensorMap.of(u16_tensor_4d(), BOX4, Swizzle.B128)
    with pytest.raises(RuntimeError, match="2 coordinates on a tensor map of rank 4"):
        load_4d(lib, map_, (0, 0, 1, 1), wrong_rank=True)


# ---- setmaxnreg ------------------------------------------------------------------------------

SETMAXNREG_THREADS = 384  # hopper.cu


@pytest.mark.parametrize(
    "bug, match",
    [
        (0, None),
        (1, "add up to 66560 registers, more than the register file's 65536"),
        (2, "thread 160 made other setmaxnreg requests than thread 128"),
    ],
    ids=["the forward's 24 / 240 / 240", "a producer keeping 40", "a warp asking 232"],
)
def test_setmaxnreg_requests_must_fit_the_register_file_and_agree_in_a_warpgroup(lib, bug, match):
    """A GPU waits forever in setmaxnreg.inc for registers the file cannot give, and the
    instruction is .aligned: the interpreter reports both when the block ends."""
    out = np.full(SETMAXNREG_THREADS, -1, np.int32)
    if match is None:
        run(lib, f"test_setmaxnreg<{bug}>", 1, SETMAXNREG_THREADS, out)
        np.testing.assert_array_equal(out, np.arange(SETMAXNREG_THREADS))
        return
    with pytest.raises(RuntimeError, match=match):
        run(lib, f"test_setmaxnreg<{bug}>", 1, SETMAXNREG_THREADS, out)


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
        TensorMap.of(a, TRIP_BOX, Swizzle.B128, columns=TRIP_COLUMNS).interp_struct()
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


def sm90a_opcodes(
    expressions: list[str], source: Path = SOURCE
) -> tuple[dict[str, list[str]], str]:
    """The SASS opcodes of each test kernel of `source` compiled by NVRTC for sm_90a (one
    program), and the ptxas log; skips without NVRTC or a disassembler."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options
    from dev import sass, sass_model

    problem = sass_model.missing_tools()
    if problem is not None:
        pytest.skip(f"no SASS tools: {problem}")
    options = [*common_options(), f"-I{source.parent}"]
    lowered, cubin, log = sass_model.compile_module(
        source.read_text(), source.name, expressions, options, "sm_90a"
    )
    with tempfile.TemporaryDirectory() as workdir:
        kernels = sass.parse(sass.disassemble(cubin, Path(workdir)))
    opcodes = {e: [i.base for i in kernels[lowered[e]].instructions] for e in expressions}
    return opcodes, log


def test_the_tma_ptx_assembles_for_sm_90a_to_utmaldg_and_utmastg():
    """The GPU side of kernels/common/tma.cuh, which the interpreter never compiles: NVRTC
    compiles it for sm_90a, and the SASS holds the TMA unit's load and store (the rank-4 load
    too)."""
    opcodes, _ = sm90a_opcodes(["test_tma_round_trip<0>", "test_tma_load_4d<false>"])
    assert {"UTMALDG", "UTMASTG"} <= set(opcodes["test_tma_round_trip<0>"]), opcodes
    assert "UTMALDG" in opcodes["test_tma_load_4d<false>"], opcodes


def test_setmaxnreg_assembles_for_sm_90a():
    """kernels/common/warpgroup.cuh's GPU side: both requests reach the SASS."""
    opcodes, log = sm90a_opcodes(["test_setmaxnreg<0>"])
    assert opcodes["test_setmaxnreg<0>"].count("USETMAXREG") == 2, (opcodes, log)


# ---- wgmma ------------------------------------------------------------------------------------


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


def random_operands(cxx_type: str, n: int, swizzle: Swizzle, seed: int):
    """A (64 x K) and B (N x K) random, K one swizzle row (WGMMA_STEPS instructions)."""
    dtype = HALF_TYPES[cxx_type]
    k = WGMMA_K * WGMMA_STEPS[swizzle]
    rng = np.random.default_rng(seed)
    return rng.standard_normal((64, k)).astype(dtype), rng.standard_normal((n, k)).astype(dtype)


def wgmma(lib, cxx_type: str, n: int, swizzle: Swizzle, bug=0, registers=False, seed=12):
    """A (64 x K) and B (N x K) random, K one swizzle row; A in the shared-memory image or, with
    `registers`, in each thread's registers. Returns A, B and every thread's accumulators."""
    steps = WGMMA_STEPS[swizzle]
    a, b = random_operands(cxx_type, n, swizzle, seed)
    image, *descriptors = wgmma_image(a, b, swizzle, TILE_OFFSET)
    out = np.zeros((WARPGROUP, n // 2), np.float32)
    run_wgmma(
        lib,
        wgmma_expression(cxx_type, n, steps, bug, registers),
        image,
        descriptors,
        swizzle,
        (WGMMA_K * ELEMENT_BYTES,),
        np.ascontiguousarray(a_fragments(a)),
        out,
    )
    return a, b, out


def wgmma_mn_major(lib, cxx_type: str, n: int, swizzle: Swizzle, registers: bool, seed=13):
    """wgmma's inputs as in `wgmma`, B (K rows of N) MN-major in the canonical layout of the
    PTX ISA. Returns A, B and every thread's accumulators."""
    steps = WGMMA_STEPS[swizzle]
    a, b_rows_of_n = random_operands(cxx_type, n, swizzle, seed)
    b = np.ascontiguousarray(b_rows_of_n.T)
    image, *descriptors, b_step = wgmma_image_mn_major(a, b, swizzle, TILE_OFFSET)
    out = np.zeros((WARPGROUP, n // 2), np.float32)
    run_wgmma(
        lib,
        mn_major_expression(cxx_type, n, steps, registers),
        image,
        descriptors,
        swizzle,
        (WGMMA_K * ELEMENT_BYTES, b_step),
        np.ascontiguousarray(a_fragments(a)),
        out,
    )
    return a, b, out


def run_wgmma(lib, expression, image, descriptors, swizzle, steps, a_fragments, out):
    """One warpgroup's wgmma kernel over a shared-memory image: ``descriptors`` are A's and B's
    offsets, then the leading and stride byte offsets (one pair for both, or A's then B's);
    ``steps`` the advance a K-step (one for both, or A's then B's); ``a_fragments`` A in
    registers (read where the expression takes A from them)."""
    run(
        lib,
        expression,
        1,
        WARPGROUP,
        image,
        len(image),
        *descriptors,
        DESCRIPTOR_SWIZZLE[swizzle],
        *steps,
        a_fragments,
        out,
        smem=len(image),
    )


@pytest.mark.parametrize("b_major", ["K-major B", "MN-major B"])
@pytest.mark.parametrize("registers", [False, True], ids=["A in shared memory", "A in registers"])
@pytest.mark.parametrize("cxx_type, n, swizzle", WGMMA_CASES, ids=str)
def test_wgmma_multiplies_the_documented_layouts_into_the_documented_fragment(
    lib, cxx_type, n, swizzle, registers, b_major
):
    """A and B laid out as the PTX ISA documents each swizzle mode (the 64B and 128B cases chain
    2 and 4 instructions along K, the descriptors advancing 32 bytes inside the swizzle row) or
    A in registers as CUTLASS's ALayout_64x16 places it; each thread's accumulators at the
    places CUTLASS's CLayout_64xN gives. B is K-major (N rows of K) or, with imm-trans-b = 1,
    MN-major by the PTX ISA's MN-major canonical layout (K rows of N, the swizzle-wide columns
    of atoms LBO apart, the 8-row groups along K SBO apart; without swizzle 8 x 16-byte core
    matrices SBO apart along N, LBO along K): the layout in which P.V reads V's rows as they
    are stored."""
    if b_major == "K-major B":
        a, b, out = wgmma(lib, cxx_type, n, swizzle, registers=registers)
        b_rows_of_n = b.T
    else:
        a, b_rows_of_n, out = wgmma_mn_major(lib, cxx_type, n, swizzle, registers)
    expected = a.astype(np.float64) @ b_rows_of_n.astype(np.float64)
    rows, columns = accumulator_positions(n)
    np.testing.assert_allclose(out, expected[rows, columns], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cxx_type, n, swizzle", A_MN_MAJOR_CASES, ids=str)
def test_wgmma_takes_a_mn_major_from_shared_memory(lib, cxx_type, n, swizzle):
    """imm-trans-a = 1: A (64 rows of K) read from its K rows of 64 in the PTX ISA's MN-major
    canonical layout (as B's MN-major form above), the descriptors advancing two 8-row atoms a
    K-step; each thread's accumulators at CLayout_64xN's places."""
    steps = WGMMA_STEPS[swizzle]
    a, b_rows_of_n = random_operands(cxx_type, n, swizzle, seed=17)
    b = np.ascontiguousarray(b_rows_of_n.T)
    image, *descriptors, a_step, b_step = wgmma_image_both_mn_major(a, b, swizzle, TILE_OFFSET)
    out = np.zeros((WARPGROUP, n // 2), np.float32)
    unused_fragments = np.zeros(1, np.uint32)
    expression = a_mn_major_expression(cxx_type, n, steps)
    run_wgmma(lib, expression, image, descriptors, swizzle, (a_step, b_step), unused_fragments, out)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    rows, columns = accumulator_positions(n)
    np.testing.assert_allclose(out, expected[rows, columns], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("registers", [False, True], ids=["A in shared memory", "A in registers"])
def test_accumulators_read_before_wait_group_are_nan(lib, registers):
    _, _, out = wgmma(lib, *BUGGY, bug=3, registers=registers)
    assert np.isnan(out).all()


MISUSE = [
    (
        1,
        r"a wgmma.mma_async operand reads shared-memory offset \d+, written by plain stores "
        r"with no fence.proxy.async",
    ),
    (2, r"wgmma.mma_async with no wgmma.fence"),
    (4, r"accumulator registers of a wgmma.mma_async written before the wgmma.wait_group"),
    (5, r"wgmma operand shared memory at offset \d+ changed between wgmma.mma_async and"),
    (6, r"thread 96 issued other wgmma.mma_async than thread 0 of its warpgroup"),
]


@pytest.mark.parametrize(
    "registers, bug, match",
    [
        *[(False, bug, match) for bug, match in MISUSE],
        *[(True, bug, match) for bug, match in MISUSE],
        (
            True,
            7,
            r"the A fragment registers of a wgmma.mma_async changed between its issue and the "
            r"wgmma.wait_group retiring it",
        ),
    ],
)
def test_wgmma_misuse_fails_the_launch(lib, registers, bug, match):
    """The fixed twin of each is the layout test above (the same kernel without the bug)."""
    with pytest.raises(RuntimeError, match=match):
        wgmma(lib, *BUGGY, bug=bug, registers=registers)


def test_the_a_fragment_is_the_accumulator_fragment_of_16_columns():
    """The PTX ISA's mma.m16n8k16 A layout per warp (a0, a1: row g, columns 2t, 2t + 1; a2, a3:
    row g + 8; a4..a7: the same 8 columns on), which the wgmma A figure repeats for the four
    warps, agrees with CUTLASS's ALayout_64x16 used above: a second reading of the layout the
    RS test relies on, and the reason P can feed P.V straight from the QK^T accumulators."""
    rows, ks = accumulator_positions(WGMMA_K)
    thread = np.arange(WARPGROUP)[:, None]
    v = np.arange(8)[None, :]
    g, t = thread % 32 // 4, thread % 4
    np.testing.assert_array_equal(rows, 16 * (thread // 32) + g + 8 * (v // 2 % 2))
    np.testing.assert_array_equal(ks, 2 * t + v % 2 + 8 * (v // 4))


def test_the_wgmma_ptx_assembles_for_sm_90a_to_hgmma():
    """NVRTC compiles kernels/common/wgmma.cuh for sm_90a, both forms with B K-major and
    MN-major, every N and type: the
    SASS holds one HGMMA per chained instruction, and ptxas neither injects waits between them
    (C7519) nor serialises them."""
    steps = WGMMA_STEPS[Swizzle.B128]
    expressions = [
        wgmma_expression(t, n, steps, 0, registers)
        for t in HALF_TYPES
        for n in WGMMA_N
        for registers in (False, True)
    ]
    expressions += [
        mn_major_expression(t, n, steps, registers)
        for t in HALF_TYPES
        for n in WGMMA_N
        for registers in (False, True)
    ]
    opcodes, log = sm90a_opcodes(expressions)
    for expression, ops in opcodes.items():
        assert ops.count("HGMMA") == steps, (expression, sorted(set(ops)))
    assert "C7519" not in log and "serialized" not in log, log


def test_the_mbarrier_ptx_assembles_for_sm_90a():
    """The bounded waits, test_wait and bulk copies of the pipeline compile for sm_90a: the SASS
    holds the SYNCS unit's barrier instructions and the bulk copy."""
    opcodes, _ = sm90a_opcodes(PIPELINE_EXPRESSIONS[:1])
    ops = set(opcodes[PIPELINE_EXPRESSIONS[0]])
    assert any(op.startswith("SYNCS") for op in ops), sorted(ops)
    assert "UBLKCP" in ops, sorted(ops)


# ---- mbarrier pipeline ------------------------------------------------------------------------

PIPE_THREADS = 96  # hopper.cu: a producer warp and PIPE_CONSUMERS = 64 threads
PIPE_BYTES = 6 * 1024  # PIPE_CHUNKS chunks of PIPE_CHUNK_BYTES
PIPE_SMEM = 128 + 2 * 1024  # the barriers, then PIPE_STAGES stages


def pipeline(lib, deadlock: bool, expression: str | None = None):
    source = aligned_array((1, PIPE_BYTES), np.uint8)
    source[:] = np.random.default_rng(5).integers(0, 256, source.shape, dtype=np.uint8)
    out = np.zeros_like(source)
    observed = np.zeros(4, np.uint32)
    run(
        lib,
        expression or PIPELINE_EXPRESSIONS[deadlock],
        1,
        PIPE_THREADS,
        source,
        out,
        observed,
        smem=PIPE_SMEM,
    )
    return source, out, observed


def test_the_mbarrier_pipeline_streams_every_chunk_and_test_wait_reads_the_phase_before(
    lib, monkeypatch
):
    for seed in range(4):  # whichever warp runs first
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        source, out, observed = pipeline(lib, deadlock=False)
        np.testing.assert_array_equal(out, source, err_msg=f"seed {seed}")
        assert observed.tolist() == PIPELINE_OBSERVED, f"seed {seed}"


def test_a_phase_that_never_completes_is_reported_not_waited_for(lib):
    """The pipeline's producer announcing a byte more than it copies: a GPU would trap at the
    bounded wait (scripts/hopper_probe.py checks it does); the fixed twin is the test above."""
    with pytest.raises(RuntimeError, match=r"wait for parity 0 of mbarrier at shared-memory"):
        pipeline(lib, deadlock=True)


SKIP_SEEDS = range(8)


def test_a_consumer_that_waits_for_what_it_skips_keeps_the_ring_in_step(lib, monkeypatch):
    """The fixed twin of the next test: the second consumer warp reads no odd chunk but waits
    for each before it hands it back, so the first warp's copy is exact whatever the order."""
    for seed in SKIP_SEEDS:
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        source, out, _ = pipeline(lib, deadlock=False, expression=SKIP_EXPRESSIONS["waits"])
        np.testing.assert_array_equal(out, source, err_msg=f"seed {seed}")


def test_a_consumer_that_hands_back_what_it_did_not_wait_for_is_caught(lib, monkeypatch):
    """Arrivals only count: a warp that arrives for a stage it skipped without waiting for it
    can arrive twice in one phase while its peer is still reading, and the phase completes
    without the peer. The interpreter holds random warps back for rounds (as a slow warp is on
    a GPU), so some seed shows it: a wrong copy or a wait that can never complete."""
    caught = []
    for seed in SKIP_SEEDS:
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        try:
            source, out, _ = pipeline(
                lib, deadlock=False, expression=SKIP_EXPRESSIONS["runs ahead"]
            )
        except RuntimeError as error:
            assert "can never complete" in str(error) or "arrival past the phase" in str(error)
            caught.append(seed)
            continue
        if (out != source).any():
            caught.append(seed)
    assert caught, "no warp order showed the run-ahead arrival"


def test_a_stage_released_before_it_is_read_is_overwritten_under_its_reader(lib, monkeypatch):
    """Consumers that arrive on the empty barrier before they read the stage: on a GPU the
    producer may refill it at once. The interpreter lets the other warps run at every arrival,
    so the producer's next copy lands under the readers (its destination poisoned at issue)
    whichever warp runs first. The fixed twin is the streaming test above."""
    for seed in range(4):
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        source, out, _ = pipeline(lib, deadlock=False, expression=EARLY_RELEASE_EXPRESSION)
        assert (out != source).any(), f"seed {seed}"


# ---- named barriers --------------------------------------------------------------------------

TURN_ROUNDS, TURN_THREADS = 4, 256  # hopper.cu


@pytest.mark.parametrize(
    "bug, match",
    [
        (0, None),
        (1, r"can never complete: .* wait for parity 0 of named barrier 1 \(256 threads"),
        (2, r"named barrier 1 \(\d+ threads per phase.* arrived at for \d+ threads in the same"),
    ],
    ids=["turns", "no opening arrival", "128 threads against 256"],
)
def test_two_warpgroups_take_turns_on_named_barriers(lib, monkeypatch, bug, match):
    """The forward's ping-pong in small: the log alternates whatever the warp order; without the
    second warpgroup's opening arrival the first waits forever, and a phase arrived at with two
    thread counts is caught (as a hazard or as the wait it leaves unfinished)."""
    for seed in range(4):
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        log = np.full(2 * TURN_ROUNDS, -1, np.int32)
        if match is None:
            run(lib, f"test_named_barrier_turns<{bug}>", 1, TURN_THREADS, log)
            assert log.tolist() == [0, 1] * TURN_ROUNDS, f"seed {seed}"
            continue
        with pytest.raises(RuntimeError, match=match):
            run(lib, f"test_named_barrier_turns<{bug}>", 1, TURN_THREADS, log)


def test_named_barriers_assemble_for_sm_90a():
    opcodes, log = sm90a_opcodes(["test_named_barrier_turns<0>"])
    ops = opcodes["test_named_barrier_turns<0>"]
    assert "BAR" in ops, (ops, log)
