"""The primitives of kernels/common/ under the CPU interpreter, against NumPy and the PTX ISA's
documented per-lane fragment layouts (g = lane // 4, t = lane % 4)."""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from cuattn.backends import interp
from tests.helpers.interp_run import run
from tests.helpers.scripts import load_script

ml_dtypes = pytest.importorskip("ml_dtypes")

SOURCE = Path(__file__).parent / "kernels" / "primitives.cu"
HALF_TYPES = {"__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16}
FORMS = {"FORM_RS_NK": 0, "FORM_TS_KN": 1, "FORM_REGS_KN": 2}
GEMM_N = GEMM_K = 32
EXPRESSIONS = [
    *[f"test_mma<{t}>" for t in HALF_TYPES],
    "test_ldmatrix<false>",
    "test_ldmatrix<true>",
    *[f"test_warp_gemm<{t}, {f}>" for t in ("float", *HALF_TYPES) for f in FORMS],
    "test_shuffle",
    "test_block",
    *[f"test_convert<{t}>" for t in HALF_TYPES],
    "test_tile_load",
    "test_tile_load_groups",
    "test_buffer_reuse<true>",
    "test_buffer_reuse<false>",
    "test_warp_neighbour<true>",
    "test_warp_neighbour<false>",
    "test_divergent_shuffle",
    "test_lane_stack",
    *[f"test_bulk_pipeline<{bug}>" for bug in range(6)],
    "test_cp_async_mbarrier<false>",
    "test_cp_async_mbarrier<true>",
    "test_cta_order",
]


@pytest.fixture(scope="module")
def lib() -> interp.Library:
    return interp.build_library(SOURCE, EXPRESSIONS)


def _pairs_to_u32(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo.astype(np.uint32) | (hi.astype(np.uint32) << 16)


@pytest.mark.parametrize("cxx_type", HALF_TYPES)
def test_mma_m16n8k16(lib, cxx_type):
    rng = np.random.default_rng(1)
    dtype = HALF_TYPES[cxx_type]
    a = rng.standard_normal((16, 16)).astype(dtype)
    b = rng.standard_normal((16, 8)).astype(dtype)
    c = rng.standard_normal((16, 8)).astype(np.float32)
    d = np.full((16, 8), np.nan, np.float32)
    run(lib, f"test_mma<{cxx_type}>", 1, 32, a, b, c, d)
    expected = a.astype(np.float64) @ b.astype(np.float64) + c
    np.testing.assert_allclose(d, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("trans", [False, True])
def test_ldmatrix_x4(lib, trans):
    src = np.arange(256, dtype=np.uint16).reshape(16, 16)
    out = np.zeros((32, 4), np.uint32)
    run(lib, f"test_ldmatrix<{str(trans).lower()}>", 1, 32, src.view(np.float16).copy(), out)
    lane = np.arange(32)
    g, t = lane // 4, lane % 4
    for m in range(4):
        matrix = src[(m % 2) * 8 : (m % 2) * 8 + 8, (m // 2) * 8 : (m // 2) * 8 + 8]
        if trans:
            expected = _pairs_to_u32(matrix[2 * t, g], matrix[2 * t + 1, g])
        else:
            expected = _pairs_to_u32(matrix[g, 2 * t], matrix[g, 2 * t + 1])
        np.testing.assert_array_equal(out[:, m], expected, err_msg=f"matrix {m}")


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("cxx_type", ["float", *HALF_TYPES])
def test_warp_gemm(lib, cxx_type, form):
    rng = np.random.default_rng(2)
    dtype = HALF_TYPES.get(cxx_type, np.float32)
    a = rng.standard_normal((16, GEMM_K)).astype(dtype)
    b = rng.standard_normal((GEMM_K, GEMM_N)).astype(dtype)
    a_arg = np.ascontiguousarray(a.T) if form == "FORM_TS_KN" else a
    b_arg = np.ascontiguousarray(b.T) if form == "FORM_RS_NK" else b
    c = np.full((16, GEMM_N), np.nan, np.float32)
    run(lib, f"test_warp_gemm<{cxx_type}, {form}>", 1, 32, a_arg, b_arg, c)
    expected = a.astype(np.float64) @ b.astype(np.float64)
    np.testing.assert_allclose(c, expected, rtol=1e-5, atol=1e-4)


def test_shuffles(lib):
    values = np.random.default_rng(3).standard_normal(64).astype(np.float32)
    out = np.full((64, 8), np.nan, np.float32)
    run(lib, "test_shuffle", 1, 64, values, out)
    index = np.arange(64)
    for i in range(5):
        np.testing.assert_array_equal(out[:, i], values[index ^ (1 << i)])
    np.testing.assert_array_equal(out[:, 5], values[(index // 32) * 32 + 5])
    quads = values.reshape(16, 4)
    np.testing.assert_array_equal(out[:, 6], np.repeat(quads.max(axis=1), 4))
    np.testing.assert_allclose(out[:, 7], np.repeat(quads.sum(axis=1), 4), rtol=1e-6)


def test_atomics_barrier_and_shared_memory_per_block(lib):
    blocks, threads = 3, 96
    values = np.arange(blocks * threads, dtype=np.float32)
    sums = np.zeros(blocks, np.float32)
    neighbours = np.full(blocks * threads, np.nan, np.float32)
    run(lib, "test_block", blocks, threads, values, sums, neighbours)
    np.testing.assert_array_equal(sums, values.reshape(blocks, threads).sum(axis=1))
    np.testing.assert_array_equal(
        neighbours.reshape(blocks, threads), np.roll(values.reshape(blocks, threads), -1, axis=1)
    )


@pytest.mark.parametrize("cxx_type", HALF_TYPES)
def test_conversions_round_to_nearest_even(lib, cxx_type):
    dtype = HALF_TYPES[cxx_type]
    rng = np.random.default_rng(4)
    finfo = ml_dtypes.finfo(dtype)
    tiny = float(finfo.smallest_subnormal)
    special = [0.0, -0.0, np.inf, -np.inf, float(finfo.max), 65520.0, 65519.0, tiny, tiny / 2]
    values = np.concatenate(
        [
            rng.standard_normal(2000) * 10.0 ** rng.integers(-9, 6, 2000),
            special,
            -np.asarray(special),
        ]
    ).astype(np.float32)
    # exact halfway points between neighbouring representable values must round to even
    grid = np.arange(-64, 64, dtype=np.float32) * np.float32(2.0**-8)
    halfway = (grid.astype(dtype).astype(np.float32) + np.float32(2.0**-9)).astype(np.float32)
    values = np.concatenate([values, halfway]).astype(np.float32)
    out = np.zeros(values.shape, dtype)
    back = np.full(values.shape, np.nan, np.float32)
    run(lib, f"test_convert<{cxx_type}>", 1, 64, values, out, back, len(values))
    with np.errstate(over="ignore"):  # 65520 and above overflow to inf, as they must
        expected = values.astype(dtype)
    np.testing.assert_array_equal(out.view(np.uint16), expected.view(np.uint16))
    np.testing.assert_array_equal(back, expected.astype(np.float32))


def test_tile_load_zero_fills_ragged_rows(lib):
    src = np.random.default_rng(5).standard_normal((16, 32)).astype(np.float32)
    out = np.full((16, 32), np.nan, np.float32)
    stride = 32 + 4
    run(lib, "test_tile_load", 1, 64, src, out, 11, smem=16 * stride * 4)
    np.testing.assert_array_equal(out[:11], src[:11])
    np.testing.assert_array_equal(out[11:], 0.0)


def test_cp_async_groups_complete_in_order(lib):
    rng = np.random.default_rng(6)
    src_a, src_b = (rng.standard_normal((16, 32)).astype(np.float32) for _ in range(2))
    out_a, out_b = (np.full((16, 32), np.nan, np.float32) for _ in range(2))
    stride = 32 + 4
    run(lib, "test_tile_load_groups", 1, 64, src_a, src_b, out_a, out_b, smem=2 * 16 * stride * 4)
    np.testing.assert_array_equal(out_a, src_a)
    np.testing.assert_array_equal(out_b, src_b)


def _buffer_reuse(lib, barrier: bool) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    first, second = (rng.standard_normal((64, 4)).astype(np.float32) for _ in range(2))
    out = np.full((64, 4), np.nan, np.float32)
    run(lib, f"test_buffer_reuse<{str(barrier).lower()}>", 1, 64, first, second, out, smem=64 * 16)
    return first, out


def test_warp_turns_keep_a_correct_kernel_correct(lib, monkeypatch):
    for seed in range(4):
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        first, out = _buffer_reuse(lib, barrier=True)
        np.testing.assert_array_equal(out, first, err_msg=f"seed {seed}")


def test_warp_turns_expose_a_missing_barrier(lib, monkeypatch):
    """Warps take turns in a shuffled order, so reusing a buffer another warp still reads
    (the race a pipelined kernel risks) gives wrong data for some seed of a small fixed set,
    every run, instead of depending on thread timing."""
    wrong = []
    for seed in range(8):
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        first, out = _buffer_reuse(lib, barrier=False)
        wrong.append(not np.array_equal(out, first))
    assert any(wrong), "no warp order exposed the write-after-read race"


def test_misaligned_cp_async_fails_the_launch(lib):
    """A 16-byte copy from an address that is not 16-byte aligned faults on a GPU; the
    interpreter refuses it too instead of copying as a CPU can."""
    base = np.random.default_rng(8).standard_normal(16 * 32 + 2).astype(np.float32)
    offset = 1 if (base.ctypes.data + 4) % 16 else 2
    misaligned = base[offset : offset + 16 * 32]  # contiguous, not on a 16-byte boundary
    assert misaligned.ctypes.data % 16
    out = np.full((16, 32), np.nan, np.float32)
    with pytest.raises(RuntimeError, match="aligned"):
        run(lib, "test_tile_load", 1, 64, misaligned, out, 16, smem=16 * 36 * 4)


def test_lanes_of_a_warp_expose_a_missing_syncwarp(lib):
    """Lanes run one after another between warp collectives, ascending then descending, so a
    read of a value another lane of the warp writes without __syncwarp sees the old data."""
    values = np.arange(1, 33, dtype=np.float32)
    expected = np.roll(values, -1)
    synced = np.full(32, np.nan, np.float32)
    run(lib, "test_warp_neighbour<true>", 1, 32, values, synced)
    np.testing.assert_array_equal(synced, expected)
    racy = np.full(32, np.nan, np.float32)
    run(lib, "test_warp_neighbour<false>", 1, 32, values, racy)
    assert not np.array_equal(racy, expected)


def test_a_warp_collective_half_the_warp_skips_fails_the_launch(lib):
    """A GPU hangs; the interpreter says why instead."""
    out = np.full(32, np.nan, np.float32)
    with pytest.raises(RuntimeError, match="warp"):
        run(lib, "test_divergent_shuffle", 1, 32, np.ones(32, np.float32), out)


def test_every_lane_has_its_own_stack(lib):
    threads = 128
    out = np.full(threads, np.nan, np.float32)
    run(lib, "test_lane_stack", 2, threads, out)
    lanes = np.arange(threads, dtype=np.float64)
    np.testing.assert_array_equal(out, (4096 * lanes + 4095 * 4096 / 2).astype(np.float32))


def test_portable_context_switch_runs_the_same_kernels():
    """Where the hand-written x86-64 switch is not used, ucontext switches the lanes."""
    lib = interp.build_library(SOURCE, EXPRESSIONS, defines=("CUATTN_INTERP_UCONTEXT",))
    first, out = _buffer_reuse(lib, barrier=True)
    np.testing.assert_array_equal(out, first)
    test_shuffles(lib)
    test_a_warp_collective_half_the_warp_skips_fails_the_launch(lib)


PIPE_FLOATS, PIPE_SMEM = 2 * 64, 2 * (64 * 4 + 16)


def _pipeline(lib, bug: int) -> tuple[np.ndarray, np.ndarray]:
    data = np.random.default_rng(9).standard_normal(PIPE_FLOATS).astype(np.float32)
    out = np.full(PIPE_FLOATS, np.nan, np.float32)
    run(lib, f"test_bulk_pipeline<{bug}>", 1, 64, data, out, smem=PIPE_SMEM)
    return data, out


def test_bulk_copies_land_when_their_mbarrier_phase_completes(lib, monkeypatch):
    for seed in range(4):  # whichever warp runs first, the consumer waits for the data
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        data, out = _pipeline(lib, 0)
        np.testing.assert_array_equal(out, data, err_msg=f"seed {seed}")


@pytest.mark.parametrize(
    "bug, match",
    [
        (1, r"exceeds the transaction bytes its phase expects \(too few bytes expected\)"),
        (
            2,
            r"can never complete: 32 \(the first: thread 32\) wait for parity 0 of mbarrier "
            r"at shared-memory offset 512 \(1 arrivals per phase, 0 still missing, 256 ",
        ),
        (4, r"an arrival past the phase: mbarrier at shared-memory offset 512"),
        (5, r"used before mbarrier.init"),
    ],
)
def test_mbarrier_misuse_fails_the_launch_and_says_how(lib, bug, match):
    with pytest.raises(RuntimeError, match=match):
        _pipeline(lib, bug)


def test_a_wait_on_the_wrong_parity_never_passes(lib, monkeypatch):
    """Waiting for parity 1 in phase 0 returns at once (the PTX ISA's rule): a consumer that
    runs first reads the stage before its copy lands and sees the poison; one that runs after
    the producer waits for phase 1, which never completes, and the launch says so."""
    outcomes = set()
    for seed in range(8):
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        try:
            _, out = _pipeline(lib, 3)
        except RuntimeError as error:
            assert "wait for parity 1" in str(error)
            outcomes.add("hang")
        else:
            assert np.isnan(out).any(), f"seed {seed}: the early read went unseen"
            outcomes.add("poison")
    assert outcomes == {"hang", "poison"}


def test_the_mbarrier_and_bulk_copy_ptx_assembles_for_sm_90():
    """The GPU side of kernels/common/mbarrier.cuh, which the interpreter never compiles."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options
    from dev.compile_check import CompileUnit, compile_units

    units = [CompileUnit(SOURCE.name, f"test_bulk_pipeline<{bug}>") for bug in (0, 4)]
    options = [*common_options(), f"-I{SOURCE.parent}"]
    for result in compile_units(SOURCE.read_text(), units, "sm_90", options):
        assert result.ok, result.error


ASYNC_ARRIVE_FLOATS, ASYNC_ARRIVE_SMEM = 128, 128 * 4 + 16


def _async_arrive(lib, skip_wait: bool) -> tuple[np.ndarray, np.ndarray]:
    data = np.random.default_rng(10).standard_normal(ASYNC_ARRIVE_FLOATS).astype(np.float32)
    out = np.full(ASYNC_ARRIVE_FLOATS, np.nan, np.float32)
    expression = f"test_cp_async_mbarrier<{str(skip_wait).lower()}>"
    run(lib, expression, 1, 64, data, out, smem=ASYNC_ARRIVE_SMEM)
    return data, out


def test_cp_async_lands_for_the_warp_that_waits_on_its_mbarrier(lib, monkeypatch):
    """cp.async.mbarrier.arrive.noinc: the phase completes when every lane's copies have
    landed, zero-filled ones included; a reader that skips the wait sees the issue's poison."""
    want = np.random.default_rng(10).standard_normal(ASYNC_ARRIVE_FLOATS).astype(np.float32)
    want.reshape(32, 4)[1::2] = 0.0
    early = set()
    for seed in range(4):
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        np.testing.assert_array_equal(_async_arrive(lib, False)[1], want, err_msg=f"seed {seed}")
        early.add(bool(np.isnan(_async_arrive(lib, True)[1]).any()))
    assert True in early, "a read before the phase completed went unseen"


def test_the_cp_async_mbarrier_ptx_assembles_for_sm_80_and_sm_90():
    """The GPU side of cp_async_mbarrier_arrive_noinc and of the sm_80 wait (test_wait)."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options
    from dev.compile_check import CompileUnit, compile_units

    units = [CompileUnit(SOURCE.name, "test_cp_async_mbarrier<false>")]
    options = [*common_options(), f"-I{SOURCE.parent}"]
    for arch in ("sm_80", "sm_90"):
        for result in compile_units(SOURCE.read_text(), units, arch, options):
            assert result.ok, (arch, result.error)


@pytest.mark.parametrize(
    "tiles, heads, batch, groups",
    [(3, 4, 2, 1), (3, 4, 2, 3), (5, 3, 3, 4), (2, 5, 1, 5), (4, 1, 1, 1)],
)
def test_the_sm90_forward_starts_its_ctas_in_the_modelled_order(lib, tiles, heads, batch, groups):
    """cta_tile_longest_first, every CTA of the grid at its place in start order, is the order
    scripts/cta_order_model.py models (and bench/NOTES.md change 34 predicts from): groups of
    pairs of one size or one more, one after another, each the last tile of every pair first.
    Uneven groups included (8 pairs in 3, 9 in 4)."""
    out = np.full((tiles * heads * batch, 3), -1, np.int32)
    args = [ctypes.c_uint32(groups), ctypes.c_void_p(out.ctypes.data)]
    lib.launch("test_cta_order", (tiles, heads, batch), (32, 1, 1), 0, args)
    order = load_script("cta_order_model").start_order(tiles, heads * batch, groups)
    expected = [(tile, pair % heads, pair // heads) for tile, pair in order]
    assert [tuple(row) for row in out.tolist()] == expected
