"""Hopper probes: does an H100/H200 do what the CPU interpreter's emulation of wgmma, TMA and
mbarrier says it does? (issue 27, step 2; bench/NOTES.md, "Hopper probes")

On a GPU machine (one call, well under 2 minutes; scripts/gpu_report.sh runs it first):
    PYTHONPATH=. python scripts/hopper_probe.py $OUT/hopper-probe.json
On the CPU, every probe through the interpreter instead (tests/test_hopper_probe.py runs this):
    PYTHONPATH=. python scripts/hopper_probe.py --interp /tmp/hopper-probe.json

The probes launch the test kernels of tests/backends/kernels/hopper.cu, the kernels the
interpreter's own tests check, compiled for sm_90a by the project's NVRTC path and loaded from
the cubin, and compare every byte they write with the layouts the PTX ISA documents
(tests/helpers/ptx_layouts.py), which those tests hold the interpreter to:
  wgmma     both forms (A from shared memory, A from registers), N = 64, 128, 256, fp16 and bf16,
            with identity and index operands (integers, so every sum is exact in any order):
            every thread's accumulator registers, i.e. the fragment layout;
  tma       a TMA load per swizzle mode, inside the tensor and over its edges: the raw shared
            memory it wrote;
  mbarrier  a two-stage bulk-copy pipeline whose waits trap after about a second instead of
            hanging: the data streamed through, and what mbarrier.test_wait says of the phases;
  trap      the same pipeline announcing a byte too many, whose first phase never completes: the
            launch must fail (a trap on a GPU, a reported deadlock on the interpreter);
  tma4d     a rank-4 TMA load of a [batch, heads, rows, columns] view of a [batch, rows, heads,
            columns] tensor, as the forward reads q, k and v: the box of the named head and
            batch, 128-byte swizzle, inside and past the last row;
  turns     the forward's warp specialisation in small: two warpgroups taking turns on named
            barriers (the order they logged), and the forward's setmaxnreg hand-over (24 / 240
            / 240 registers) completing;
  reduce    the sm_90a backward's dQ reduction in small (tests/backends/kernels/bulk_reduce.cu):
            REDUCE_ITEMS CTAs each claim an item from a counter and add their tile into one
            float32 sum with a bulk reduce (cp.reduce.async.bulk .add.f32), in item order by a
            semaphore: the sum, bit for bit that of the tiles added in order.
Each group runs in a process of its own, because a trap leaves the CUDA context unusable. The
JSON report names the device and lists every probe with pass or fail and its first differing
entries; the exit status is 1 when any probe differs or fails.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from cuattn.backends.tensor_map import Swizzle, TensorMap
from tests.helpers.ptx_layouts import (
    DESCRIPTOR_SWIZZLE,
    ELEMENT_BYTES,
    PIPELINE_OBSERVED,
    WARPGROUP,
    WGMMA_K,
    WGMMA_STEPS,
    a_fragments,
    accumulator_positions,
    aligned_array,
    documented_tile,
    wgmma_image,
    widest_box,
)

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "tests" / "backends" / "kernels" / "hopper.cu"
REDUCE_SOURCE = SOURCE.parent / "bulk_reduce.cu"
ARCH = "sm_90a"
HOPPER = (9, 0)  # compute capability
GROUP_TIMEOUT_S = 45  # one group: NVRTC compile, launches, and the trap's spin of about 1 s
DIFFERENCES_SHOWN = 8  # first differing entries per probe in the report

# hopper.cu's launch shapes (its constants of the same names).
TMA_THREADS = 64
TMA_SMEM = 4096
TILE_OFFSET = 1024
PIPE_THREADS = 96
PIPE_BYTES = 6 * 1024
PIPE_SMEM = 128 + 2 * 1024

# The TMA probe's tensor: u16, 20 rows x 66 columns in rows padded to 72 elements (a multiple of
# 16 bytes), every element distinct; the box at each position of TMA_POSITIONS.
TMA_ROWS, TMA_COLUMNS, TMA_PITCH = 20, 66, 72
TMA_POSITIONS = {"inside": (0, 0), "past the end": (48, 16), "before the start": (-8, -3)}

# How CUDA reports a kernel that executed a trap (the error names, lower case).
TRAP_ERRORS = ("launch failure", "illegal instruction")

WGMMA_N = (64, 128, 256)  # the forward's widths: head dims for P.V, key blocks for QK^T
INDEX_SCALE = 256  # the index operands make D[r][c] = INDEX_SCALE * r + c (exact in bf16/fp32)
IDENTITY_RANGE = 17  # identity operands: B holds integers in [-8, 8]


class Interpreter:
    """The probes' kernels on the CPU interpreter."""

    def __init__(self, expressions: list[str], source: Path = SOURCE):
        from cuattn.backends import interp

        self.library = interp.build_library(source, expressions)
        self.name = "CPU interpreter"

    def upload(self, host: np.ndarray) -> np.ndarray:
        # aligned as a GPU allocation is, and as TMA needs global memory to be
        array = aligned_array((1, host.size), host.dtype).reshape(host.shape)
        array[...] = host
        return array

    def download(self, array: np.ndarray) -> np.ndarray:
        return np.array(array)

    def tensor_map(self, map_):
        return map_.interp_struct()

    @staticmethod
    def stopped_waiting(error: Exception) -> bool:
        """Whether `error` is the interpreter's report of a wait that can never complete."""
        return isinstance(error, RuntimeError) and "can never complete" in str(error)

    def launch(self, expression: str, threads: int, smem: int, *args, grid: int = 1) -> None:
        from tests.helpers.interp_run import run

        run(self.library, expression, grid, threads, *args, smem=smem)


class Gpu:
    """The probes' kernels compiled for sm_90a with NVRTC and launched from the cubin."""

    def __init__(self, expressions: list[str], source: Path = SOURCE):
        import cupy
        from cupy_backends.cuda.api import driver

        from cuattn.backends.toolchain import common_options
        from dev.sass_model import compile_module

        device = cupy.cuda.Device(0)
        capability = tuple(int(c) for c in device.compute_capability)
        properties = cupy.cuda.runtime.getDeviceProperties(device.id)
        self.name = f"{properties['name'].decode()} (compute capability {capability})"
        if capability != HOPPER:
            raise RuntimeError(f"{self.name} is not a Hopper GPU (sm_90a)")
        options = [*common_options(), f"-I{source.parent}"]
        lowered, cubin, _ = compile_module(
            source.read_text(), source.name, expressions, options, ARCH
        )
        cupy.zeros(1)  # makes the runtime's context current for the driver calls below
        module = driver.moduleLoadData(cubin)
        self.functions = {e: driver.moduleGetFunction(module, lowered[e]) for e in expressions}
        self.cupy, self.driver = cupy, driver

    def upload(self, host: np.ndarray):
        return self.cupy.asarray(host)

    def download(self, array) -> np.ndarray:
        return self.cupy.asnumpy(array)

    def tensor_map(self, map_):
        return map_.driver_struct

    def stopped_waiting(self, error: Exception) -> bool:
        """Whether `error` is what a trapping kernel gives: CUDA's launch failure or illegal
        instruction (which of the two depends on the driver), not a refused launch."""
        cuda_errors = (
            self.cupy.cuda.driver.CUDADriverError,
            self.cupy.cuda.runtime.CUDARuntimeError,
        )
        message = str(error).lower()
        return isinstance(error, cuda_errors) and any(t in message for t in TRAP_ERRORS)

    def launch(self, expression: str, threads: int, smem: int, *args, grid: int = 1) -> None:
        values = []
        for arg in args:
            if isinstance(arg, self.cupy.ndarray):
                values.append(ctypes.c_void_p(arg.data.ptr))
            elif isinstance(arg, ctypes.Array | ctypes.Structure | ctypes._SimpleCData):
                values.append(arg)
            else:
                values.append(ctypes.c_int32(arg))
        pointers = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        self.driver.launchKernel(
            self.functions[expression], grid, 1, 1, threads, 1, 1, smem, 0,
            ctypes.addressof(pointers), 0,
        )  # fmt: skip
        self.cupy.cuda.runtime.deviceSynchronize()


def compare(name: str, got: np.ndarray, expected: np.ndarray, describe=None) -> dict:
    """One probe's entry: pass when every element is equal (NaN never is); else the first
    differing entries, each with its index, and `describe(index, got)` when given."""
    differing = np.argwhere(~(got == expected))
    entry = {"probe": name, "pass": len(differing) == 0, "differing": len(differing)}
    first = []
    for index in differing[:DIFFERENCES_SHOWN]:
        at = tuple(int(i) for i in index)
        item = {"index": at, "got": got[at].item(), "expected": expected[at].item()}
        if describe is not None:
            item.update(describe(at, got[at]))
        first.append(item)
    if first:
        entry["first_differences"] = first
    return entry


# ---- wgmma -----------------------------------------------------------------------------------


def wgmma_expression(cxx_type: str, n: int, registers: bool) -> str:

    return f"test_wgmma<{cxx_type}, {n}, {WGMMA_STEPS[Swizzle.B128]}, 0, {str(registers).lower()}>"


def wgmma_types() -> dict[str, type]:
    return {"__half": np.float16, "__nv_bfloat16": ml_dtypes.bfloat16}


def wgmma_expressions() -> list[str]:
    return [
        wgmma_expression(t, n, registers)
        for t in wgmma_types()
        for n in WGMMA_N
        for registers in (False, True)
    ]


def wgmma_operands(kind: str, n: int, k: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """identity: A = I (64 x 64), B small integers, so D = B^T places each B element; index:
    A[r] = (r, 1, 0...), B[c] = (INDEX_SCALE, c, 0...), so D[r][c] = INDEX_SCALE * r + c names
    its own row and column."""
    rows = np.arange(64)[:, None]
    columns = np.arange(n)[:, None]
    ks = np.arange(k)[None, :]
    if kind == "identity":
        a = (rows == ks).astype(np.float32)
        b = (columns * 7 + ks * 3) % IDENTITY_RANGE - IDENTITY_RANGE // 2
    else:
        a = np.where(ks == 0, rows, ks == 1).astype(np.float32)
        b = np.where(ks == 0, INDEX_SCALE, np.where(ks == 1, columns, 0))
    return a.astype(dtype), b.astype(np.float32).astype(dtype)


def wgmma_describer(rows: np.ndarray, columns: np.ndarray, kind: str):
    """What the report says of a differing accumulator: where the documented fragment places
    it and, with the index operands, which element of D the GPU put there instead."""

    def describe(at: tuple[int, ...], value) -> dict:
        place = {"documented_row_column": [int(rows[at]), int(columns[at])]}
        if kind == "index" and np.isfinite(value):
            place["got_row_column"] = list(divmod(int(value), INDEX_SCALE))
        return place

    return describe


def probe_wgmma(device) -> list[dict]:

    swizzle = Swizzle.B128
    k = WGMMA_K * WGMMA_STEPS[swizzle]
    results = []
    for cxx_type, dtype in wgmma_types().items():
        for n in WGMMA_N:
            rows, columns = accumulator_positions(n)
            for kind in ("identity", "index"):
                a, b = wgmma_operands(kind, n, k, dtype)
                expected = (a.astype(np.float64) @ b.astype(np.float64).T)[rows, columns]
                image, a_offset, b_offset, leading, stride = wgmma_image(a, b, swizzle, TILE_OFFSET)
                for registers in (False, True):
                    out = device.upload(np.zeros((WARPGROUP, n // 2), np.float32))
                    device.launch(
                        wgmma_expression(cxx_type, n, registers),
                        WARPGROUP,
                        len(image),
                        device.upload(image),
                        len(image),
                        a_offset,
                        b_offset,
                        leading,
                        stride,
                        DESCRIPTOR_SWIZZLE[swizzle],
                        WGMMA_K * ELEMENT_BYTES,
                        device.upload(np.ascontiguousarray(a_fragments(a))),
                        out,
                    )

                    form = "A in registers" if registers else "A in shared memory"
                    name = f"wgmma m64n{n}k16 {cxx_type} {form}, {kind} operands"
                    got = device.download(out)
                    describe = wgmma_describer(rows, columns, kind)
                    results.append(compare(name, got, expected.astype(np.float32), describe))
    return results


# ---- TMA -------------------------------------------------------------------------------------

TMA_EXPRESSION = "test_tma_load<true, false>"


def probe_tma(device) -> list[dict]:

    host = np.arange(1, TMA_ROWS * TMA_PITCH + 1, dtype=np.uint16).reshape(TMA_ROWS, TMA_PITCH)
    tensor = device.upload(host)
    results = []
    for swizzle in Swizzle:
        box = widest_box(swizzle)
        map_ = device.tensor_map(TensorMap.of(tensor, box, swizzle, columns=TMA_COLUMNS))
        box_bytes = box[0] * box[1] * host.itemsize
        for where, (x, y) in TMA_POSITIONS.items():
            out = device.upload(np.zeros(box_bytes, np.uint8))
            device.launch(
                TMA_EXPRESSION, TMA_THREADS, TMA_SMEM, map_, x, y, TILE_OFFSET, box_bytes,
                out, box_bytes,
            )  # fmt: skip
            expected = documented_tile(host, TMA_COLUMNS, box, x, y, swizzle)
            name = f"TMA load, {swizzle.name} swizzle, box {box} {where} at ({x}, {y})"
            results.append(compare(name, device.download(out), expected))
    return results


# ---- mbarrier --------------------------------------------------------------------------------

PIPELINE_EXPRESSION = "test_mbarrier_pipeline<false>"
TRAP_EXPRESSION = "test_mbarrier_pipeline<true>"


def pipeline(device, expression: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    source = np.random.default_rng(5).integers(0, 256, PIPE_BYTES, dtype=np.uint8)
    out = device.upload(np.zeros(PIPE_BYTES, np.uint8))
    observed = device.upload(np.zeros(4, np.uint32))
    device.launch(expression, PIPE_THREADS, PIPE_SMEM, device.upload(source), out, observed)
    return source, device.download(out), device.download(observed)


def probe_pipeline(device) -> list[dict]:

    source, out, observed = pipeline(device, PIPELINE_EXPRESSION)
    return [
        compare("mbarrier pipeline: the bytes streamed through 2 stages", out, source),
        compare(
            "mbarrier.test_wait on full[0] for parity 0, 1 after init and after 3 phases",
            observed,
            np.array(PIPELINE_OBSERVED, np.uint32),
        ),
    ]


def probe_trap(device) -> list[dict]:
    name = "mbarrier pipeline with a phase that never completes: the launch fails"
    start = time.monotonic()
    try:
        pipeline(device, TRAP_EXPRESSION)
    except Exception as error:  # judged below: a trap's CUDA error, the interpreter's report
        entry = {"probe": name, "pass": device.stopped_waiting(error), "error": str(error)[:500]}
    else:
        entry = {"probe": name, "pass": False, "error": "the launch completed"}
    entry["seconds"] = round(time.monotonic() - start, 2)
    return [entry]


# ---- rank-4 TMA and warp specialisation ------------------------------------------------------

TMA_4D_EXPRESSION = "test_tma_load_4d<false>"
# hopper.cu's shapes: [batch 2, heads 3, rows 10, columns 64] u16 stored [batch, rows, heads,
# columns]; the box one 128-byte panel of 8 rows; two warpgroups x TURN_ROUNDS turns; 384
# threads for the register hand-over.
TMA_4D_SHAPE, TMA_4D_BOX = (2, 3, 10, 64), (64, 8, 1, 1)
TMA_4D_POSITIONS = {"inside": (0, 0, 1, 1), "past the last row": (0, 6, 2, 0)}
TURN_EXPRESSION, TURN_THREADS, TURN_ROUNDS = "test_named_barrier_turns<0>", 256, 4
SETMAXNREG_EXPRESSION, SETMAXNREG_THREADS = "test_setmaxnreg<0>", 384


def probe_tma_4d(device) -> list[dict]:
    batch, heads, rows, columns = TMA_4D_SHAPE
    stored = np.arange(1, batch * rows * heads * columns + 1, dtype=np.uint16)
    stored = stored.reshape(batch, rows, heads, columns)
    view = device.upload(stored).transpose(0, 2, 1, 3)
    map_ = device.tensor_map(TensorMap.of(view, TMA_4D_BOX, Swizzle.B128))
    box_bytes = int(np.prod(TMA_4D_BOX)) * stored.itemsize
    results = []
    for where, (x, y, z, w) in TMA_4D_POSITIONS.items():
        out = device.upload(np.zeros(box_bytes, np.uint8))
        device.launch(TMA_4D_EXPRESSION, TMA_THREADS, TMA_SMEM, map_, x, y, z, w, out, box_bytes)
        head_rows = np.ascontiguousarray(stored[w, :, z, :])
        expected = documented_tile(head_rows, columns, TMA_4D_BOX[:2], x, y, Swizzle.B128)
        name = f"rank-4 TMA load, head {z} of batch {w}, rows from {y} ({where})"
        results.append(compare(name, device.download(out), expected))
    return results


def probe_turns(device) -> list[dict]:
    log = device.upload(np.full(2 * TURN_ROUNDS, -1, np.int32))
    device.launch(TURN_EXPRESSION, TURN_THREADS, 0, log)
    threads = device.upload(np.full(SETMAXNREG_THREADS, -1, np.int32))
    device.launch(SETMAXNREG_EXPRESSION, SETMAXNREG_THREADS, 0, threads)
    return [
        compare(
            "named barriers: two warpgroups take turns",
            device.download(log),
            np.array([0, 1] * TURN_ROUNDS, np.int32),
        ),
        compare(
            "setmaxnreg 24 / 240 / 240 over 384 threads: every thread ran past it",
            device.download(threads),
            np.arange(SETMAXNREG_THREADS, dtype=np.int32),
        ),
    ]


REDUCE_EXPRESSION = "test_ordered_reduce<0>"
# bulk_reduce.cu's shapes (REDUCE_THREADS, REDUCE_FLOATS); items enough for many CTAs at once
REDUCE_THREADS, REDUCE_FLOATS, REDUCE_ITEMS = 64, 256, 64


def probe_reduce(device) -> list[dict]:
    rng = np.random.default_rng(3)
    # magnitudes apart, so that float32 sums in another order differ
    values = (rng.standard_normal((REDUCE_ITEMS, REDUCE_FLOATS)) * 1e3).astype(np.float32)
    start = rng.standard_normal(REDUCE_FLOATS).astype(np.float32)
    total = device.upload(start)
    counters = device.upload(np.zeros(2, np.int32))
    device.launch(
        REDUCE_EXPRESSION,
        REDUCE_THREADS,
        REDUCE_FLOATS * 4,
        device.upload(values),
        total,
        counters,
        REDUCE_ITEMS,
        grid=REDUCE_ITEMS,
    )
    expected = start.copy()
    for item in values:
        expected = expected + item
    return [
        compare(
            f"bulk reduce add.f32 of {REDUCE_ITEMS} CTAs ordered by a semaphore: the in-order sum",
            device.download(total),
            expected,
        ),
        compare(
            "the semaphore and the work counter after the last CTA",
            device.download(counters),
            np.array([REDUCE_ITEMS, REDUCE_ITEMS], np.int32),
        ),
    ]


# name: (the kernels it launches, the probe)
GROUPS: dict[str, tuple[Callable[[], list[str]], Callable]] = {
    "wgmma": (wgmma_expressions, probe_wgmma),
    "tma": (lambda: [TMA_EXPRESSION], probe_tma),
    "mbarrier": (lambda: [PIPELINE_EXPRESSION], probe_pipeline),
    "trap": (lambda: [TRAP_EXPRESSION], probe_trap),
    "tma4d": (lambda: [TMA_4D_EXPRESSION], probe_tma_4d),
    "turns": (lambda: [TURN_EXPRESSION, SETMAXNREG_EXPRESSION], probe_turns),
    "reduce": (lambda: [REDUCE_EXPRESSION], probe_reduce),
}
# The groups whose kernels are not hopper.cu's.
GROUP_SOURCES = {"reduce": REDUCE_SOURCE}


def run_group(group: str, use_interpreter: bool, report: Path) -> None:
    """One group in this process: its results (and the device's name) as JSON in `report`."""
    expressions, probe = GROUPS[group]
    source = GROUP_SOURCES.get(group, SOURCE)
    device = (Interpreter if use_interpreter else Gpu)(expressions(), source)
    report.write_text(json.dumps({"device": device.name, "probes": probe(device)}))


def run_all(use_interpreter: bool, timeout_s: float) -> dict:
    """Every group in a child process; a child that dies or overruns is a failed probe."""
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    devices, probes = set(), []
    with tempfile.TemporaryDirectory(prefix="hopper-probe-") as workdir:
        for group in GROUPS:
            part = Path(workdir) / f"{group}.json"
            command = [sys.executable, __file__, "--group", group, str(part)]
            command += ["--interp"] if use_interpreter else []
            try:
                child = subprocess.run(
                    command, capture_output=True, text=True, timeout=timeout_s, env=env
                )
                failure = (
                    None if part.exists() else f"exit {child.returncode}: {child.stderr[-2000:]}"
                )
            except subprocess.TimeoutExpired:
                failure = f"no result within {timeout_s} s"
            if failure is not None:
                probes.append(
                    {"probe": f"{group} (the whole group)", "pass": False, "error": failure}
                )
                continue
            result = json.loads(part.read_text())
            devices.add(result["device"])
            probes.extend(result["probes"])
    failed = [p["probe"] for p in probes if not p["pass"]]
    return {
        "devices": sorted(devices),
        "passed": len(probes) - len(failed),
        "failed": failed,
        "probes": probes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("report", type=Path, help="where the JSON report goes")
    parser.add_argument("--interp", action="store_true", help="run on the CPU interpreter")
    parser.add_argument(
        "--timeout", type=float, default=GROUP_TIMEOUT_S, help="seconds a group may take"
    )
    parser.add_argument("--group", choices=list(GROUPS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.group:
        run_group(args.group, args.interp, args.report)
        return 0
    summary = run_all(args.interp, args.timeout)
    args.report.parent.mkdir(parents=True, exist_ok=True)
    args.report.write_text(json.dumps(summary, indent=1) + "\n")
    for probe in summary["probes"]:
        print(f"{'ok  ' if probe['pass'] else 'FAIL'} {probe['probe']}")
    devices = ", ".join(summary["devices"]) or "no device"
    print(f"{summary['passed']} probes agree with the documented layouts on {devices}; ", end="")
    print(f"{len(summary['failed'])} differ or failed")
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
