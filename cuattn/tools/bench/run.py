"""Benchmark: cuattn against torch SDPA (flash, cuDNN) and compiled FlexAttention, in one run.

    python -m cuattn bench --quick      # < 2 min on one H100
    python -m cuattn bench              # full sweep, < 10 min on one H100
    python -m cuattn bench --dry-run    # CPU: NumPy backend, perf_counter, peers skipped

Per case: a correctness check first (our kernels vs the float64 NumPy reference on a reduced
size of the same pattern, and every peer's output vs ours at full size), then timing with CUDA
events (warm-up, median of many runs, rotating input sets so L2 never holds the inputs).
TFLOP/s count computed blocks only: 4*b*b*d per active block forward, 2.5x that backward. Writes
bench/results/<date>-<gpu>.json, .md and .png (speed vs density).
"""

from __future__ import annotations

import argparse
import datetime
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from cuattn._util import array_library, host_array, one_line
from cuattn.adapters.dlpack import cupy_stream_of_torch, torch_allocator_for_cupy
from cuattn.backends.call import AttentionCall
from cuattn.backends.geometry import HEAD_DIMS
from cuattn.tools.bench import report as bench_report
from cuattn.tools.bench.cases import SWEEPS, BenchCase, Sweep
from cuattn.tools.bench.runners import CuattnRunner, InputSet, Skip, peer_runners
from cuattn.tools.bench.timing import (
    CpuTimer,
    CudaEventTimer,
    input_sets_needed,
)

FWD_FLOPS_PER_BLOCK_ELEMENT = 4  # two matmuls of b x b x d, 2 FLOPs per multiply-add
BWD_OVER_FWD_FLOPS = 2.5
# Reduced size for the float64 correctness check of each pattern; 1024 keeps strided in the
# same transposed form as the timed sizes.
CHECK_CTX = 1024
CHECK_HEADS = 2
TOLERANCE = {"float16": 1e-2, "bfloat16": 2e-2, "float32": 1e-4}
DEFAULT_RESULTS_DIR = Path("bench/results")
# The dry run measures nothing worth keeping: it never writes into a checkout's results.
DRY_RUN_RESULTS_DIR = Path(tempfile.gettempdir()) / "cuattn-bench-dry-run"
GPU_WARMUP, GPU_REPEATS = 5, 30
CPU_WARMUP, CPU_REPEATS = 1, 3
# Seconds after which no new case starts; the last one may still take up to a minute (FlexAttention
# compiles), so these leave that much room inside the 2- and 10-minute targets.
BUDGET_S = {"quick": 90.0, "full": 480.0, "dry-run": 60.0}
SEED = 0
MAX_REASON_CHARS = 240  # a failed peer's message in the report
BF16_ITEMSIZE = 2  # NumPy has no bfloat16 without ml_dtypes


def case_flops(case: BenchCase, layout: Any) -> float:
    per_block = FWD_FLOPS_PER_BLOCK_ELEMENT * case.blocksize**2 * case.head_dim
    forward = per_block * float(layout.nnz.sum()) * case.batch
    return forward * (1 + BWD_OVER_FWD_FLOPS) if case.direction != "fwd" else forward


@dataclass
class Environment:
    """Where the bench runs: GPU (torch + CuPy + CUDA events) or the CPU dry run."""

    on_gpu: bool
    device_name: str
    timer: Any
    ours: CuattnRunner
    peers: list[Any]
    peer_skip_reason: str | None
    warmup: int
    repeats: int
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(SEED))

    def make_inputs(self, case: BenchCase, count: int, shape: tuple[int, ...]) -> list[InputSet]:
        """``count`` sets of q, k, v, dout; q and dout of ``shape``, k and v with the case's
        kv heads in place of its heads (GQA)."""
        kv_shape = (shape[0], shape[1] * case.kv // case.heads, *shape[2:])
        shapes = (shape, kv_shape, kv_shape, shape)
        if self.on_gpu:
            import torch

            dtype = getattr(torch, case.dtype)
            return [
                InputSet(*(torch.randn(s, dtype=dtype, device="cuda") for s in shapes))
                for _ in range(count)
            ]
        return [
            InputSet(*(self.rng.standard_normal(s).astype(case.dtype) for s in shapes))
            for _ in range(count)
        ]


def to_float64(x: Any) -> np.ndarray:
    """Any of our arrays (NumPy, CuPy, torch; bf16 included) as a float64 NumPy array."""
    if array_library(x) == "torch":
        return x.detach().double().cpu().numpy()
    return host_array(x).astype(np.float64)


def relative_error(got: Any, want: np.ndarray) -> float:
    got64 = to_float64(got)
    finite = np.isfinite(want)
    if not np.array_equal(finite, np.isfinite(got64)):
        return float("inf")
    scale = max(1.0, float(np.abs(want[finite]).max(initial=0.0)))
    return float(np.abs(got64[finite] - want[finite]).max(initial=0.0)) / scale


def check_against_oracle(env: Environment, case: BenchCase) -> tuple[bool, float]:
    """Our forward (and backward) vs the float64 reference on a reduced size of this pattern."""
    from cuattn.backends import numpy_ref as reference

    n_ctx = min(case.n_ctx, CHECK_CTX)
    group = case.heads // case.kv  # GQA: CHECK_HEADS kv heads, each serving `group` query heads
    heads = CHECK_HEADS * group
    layout = case.pattern.make_layout(n_ctx, heads, case.blocksize)
    small = BenchCase(
        case.pattern,
        n_ctx,
        case.head_dim,
        case.dtype,
        case.blocksize,
        case.direction,
        1,
        heads,
        kv_heads=CHECK_HEADS if group > 1 else 0,
    )
    (inputs,) = env.make_inputs(small, 1, (1, heads, n_ctx, case.head_dim))
    scale = case.head_dim**-0.5
    q, k, v, dout = (to_float64(x) for x in (inputs.q, inputs.k, inputs.v, inputs.dout))
    call = AttentionCall(layout, scale)
    want_out, want_lse = reference.attention_forward(q, k, v, call)
    got = env.ours.prepare(small, layout, [inputs], scale)(0)
    if case.direction == "fwd":
        err = relative_error(got, want_out)
    else:
        want = reference.attention_backward(q, k, v, want_out, want_lse, dout, None, call)
        err = max(relative_error(g, w) for g, w in zip(got, want, strict=True))
    return err <= TOLERANCE[case.dtype], err


def run_case(env: Environment, case: BenchCase, checked: dict[tuple, tuple[bool, float]]):
    layout = case.pattern.make_layout(case.n_ctx, case.heads, case.blocksize)
    from cuattn.layout.blocks import layout_density_vs_causal

    flops = case_flops(case, layout)
    record: dict[str, Any] = {
        "case": case.as_dict(),
        "name": case.name,
        "problem_key": list(case.problem_key),
        "density": layout.density,
        "density_vs_causal": layout_density_vs_causal(layout),
        "flops": flops,
        "results": {},
        "skipped": {},
        "speedup": {},
    }
    check_key = (case.pattern, case.head_dim, case.dtype, case.blocksize, case.direction)
    if check_key not in checked:
        checked[check_key] = check_against_oracle(env, case)
    record["correct"], record["oracle_rel_error"] = checked[check_key]
    shape = (case.batch, case.heads, case.n_ctx, case.head_dim)
    itemsize = BF16_ITEMSIZE if case.dtype == "bfloat16" else np.dtype(case.dtype).itemsize
    inputs = env.make_inputs(case, input_sets_needed(4 * itemsize * int(np.prod(shape))), shape)
    scale = case.head_dim**-0.5
    ours_fn = env.ours.prepare(case, layout, inputs, scale)
    reference_out = ours_fn(0)
    _measure(env, env.ours.name, ours_fn, flops, record)
    for peer in env.peers:
        try:
            _run_peer(env, peer, case, layout, inputs, scale, flops, reference_out, record)
        except Skip as why:
            record["skipped"][peer.name] = str(why)
        except Exception as exc:
            # A peer's own failure is reported, not fatal to the sweep: e.g. FlexAttention's
            # Triton kernel asking for more shared memory than the GPU has (seen on an H100).
            record["skipped"][peer.name] = f"{case.name}: failed: {one_line(exc, MAX_REASON_CHARS)}"
    if env.peer_skip_reason:
        for name in ("sdpa-flash", "sdpa-cudnn", "flex"):
            record["skipped"][name] = env.peer_skip_reason
    return record


def _run_peer(
    env: Environment,
    peer: Any,
    case: BenchCase,
    layout: Any,
    inputs: list[InputSet],
    scale: float,
    flops: float,
    reference_out: Any,
    record: dict[str, Any],
) -> None:
    """Time one peer on this case and record its agreement with our output and its speedup."""
    peer_fn = peer.prepare(case, layout, inputs, scale)
    first_call = time.perf_counter()
    peer_out = peer_fn(0)  # compiles, for FlexAttention: timed apart from the runs
    env.timer.synchronize()
    record.setdefault("first_call_s", {})[peer.name] = time.perf_counter() - first_call
    first = lambda x: x[0] if isinstance(x, tuple) else x  # noqa: E731
    want = to_float64(first(reference_out))
    record.setdefault("peer_rel_error", {})[peer.name] = relative_error(first(peer_out), want)
    _measure(env, peer.name, peer_fn, flops, record)
    ours_ms = record["results"][env.ours.name]["median_ms"]
    record["speedup"][peer.name] = record["results"][peer.name]["median_ms"] / ours_ms


def _measure(env: Environment, name: str, fn: Any, flops: float, record: dict[str, Any]) -> None:
    timing = env.timer.time(fn, env.warmup, env.repeats)
    result = timing.as_dict()
    result["tflops"] = bench_report.tflops(flops, timing.median_ms)
    result["peak_bytes"] = env.timer.peak_bytes(fn)
    record["results"][name] = result


def _progress_line(done: int, total: int, record: dict[str, Any], ours: str, start: float) -> str:
    mine = record["results"][ours]
    parts = [f"{ours} {mine['median_ms']:.3f} ms ({mine['tflops']:.1f} TFLOP/s)"]
    parts += [f"{p} x{s:.2f}" for p, s in record["speedup"].items()]
    tolerance = TOLERANCE[record["case"]["dtype"]]
    parts += [
        f"{p} DISAGREES (rel err {e:.1e})"
        for p, e in record.get("peer_rel_error", {}).items()
        if e > tolerance
    ]
    ok = "ok" if record["correct"] else f"WRONG (rel err {record['oracle_rel_error']:.2e})"
    return (
        f"[{done}/{total}] {record['name']}: {' | '.join(parts)} | {ok}"
        f" [{time.perf_counter() - start:.0f}s]\n"
    )


def build_environment(dry_run: bool, backend: str | None) -> Environment:
    if dry_run:
        from cuattn.backends import resolve_backend

        ours = CuattnRunner(resolve_backend(backend or "numpy", on_device=False), lambda x: x)
        return Environment(
            False,
            "cpu",
            CpuTimer(),
            ours,
            [],
            "no CUDA device (CPU dry run): peers need a GPU",
            CPU_WARMUP,
            CPU_REPEATS,
        )
    import torch

    from cuattn.backends import device_module, resolve_backend

    torch.manual_seed(SEED)
    to_cupy = device_module("cuda", "inputs").from_dlpack
    ours = CuattnRunner(resolve_backend(backend or "cuda", on_device=True), to_cupy)
    return Environment(
        True,
        torch.cuda.get_device_name(),
        CudaEventTimer(),
        ours,
        peer_runners(),
        None,
        GPU_WARMUP,
        GPU_REPEATS,
    )


def gpu_available() -> bool:
    try:
        import torch

        from cuattn.backends.cuda_runtime import cuda_available

        return torch.cuda.is_available() and cuda_available()
    except ImportError:
        return False


def run_sweep(
    env: Environment,
    sweep: Sweep,
    budget_s: float,
    progress: TextIO | None = None,
    checkpoint: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run every case (until `budget_s` is spent); `checkpoint(report)` after each case keeps
    the results so far on disk should the caller's time limit kill the run."""
    cases = list(sweep.cases())
    start = time.perf_counter()
    checked: dict[tuple, tuple[bool, float]] = {}
    records: list[dict[str, Any]] = []
    not_run: list[str] = []
    with ExitStack() as stack:
        if env.on_gpu:
            warm_kernels_for(cases, progress)
            stack.enter_context(cupy_stream_of_torch())
            stack.enter_context(torch_allocator_for_cupy())
        for done, case in enumerate(cases, 1):
            if time.perf_counter() - start > budget_s:
                not_run.append(f"{case.name}: time budget of {budget_s:.0f}s spent")
                continue
            try:
                record = run_case(env, case, checked)
            except ValueError as exc:  # a pattern that cannot serve this size: say so, go on
                not_run.append(f"{case.name}: {exc}")
                continue
            records.append(record)
            if progress is not None:
                progress.write(_progress_line(done, len(cases), record, env.ours.name, start))
                progress.flush()
            if checkpoint is not None:
                checkpoint(_report(env, records, not_run, start))
    return _report(env, records, not_run, start)


def _report(
    env: Environment, records: list[dict[str, Any]], not_run: list[str], start: float
) -> dict[str, Any]:
    bench_report.add_density_ratios(records, env.ours.name)
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "device": env.device_name,
        "timer": env.timer.name,
        "kernels": _kernel_family(),
        "warmup": env.warmup,
        "repeats": env.repeats,
        "ours": env.ours.name,
        "peers": [p.name for p in env.peers],
        "versions": _versions(),
        "elapsed_s": time.perf_counter() - start,
        "records": records,
        "not_run": not_run,
        "all_correct": all(r["correct"] for r in records),
    }


def kernel_units_for(cases: Sequence[BenchCase]) -> list[tuple[str, str]]:
    """(source file, name expression) of every instantiation the cases can launch: all rule
    kinds of each dtype / head dim / block size, the forward and the backward."""
    from cuattn.backends import geometry

    names = set()
    for case in cases:
        for kernel in ("attn_fwd", "attn_bwd_dkdv", "attn_bwd_dq"):
            for rule in geometry.RULES:
                names.add(
                    geometry.name_expression(
                        kernel, case.head_dim, case.dtype, case.blocksize, rule
                    )
                )
        for kernel in geometry.ROW_KERNELS:
            names.add(geometry.name_expression(kernel, case.head_dim, case.dtype))
    return [(geometry.KERNEL_FILES[name.split("<")[0]], name) for name in sorted(names)]


def warm_kernels_for(cases: Sequence[BenchCase], progress: TextIO | None) -> None:
    """Compile the cases' instantiations in parallel, so no case waits for serial NVRTC."""
    import os

    from cuattn.backends.cuda_runtime import warm_disk_cache

    warm_disk_cache(kernel_units_for(cases), jobs=os.cpu_count() or 1, progress=progress)


def _kernel_family() -> str:
    """The forward family the backends run (CUATTN_KERNELS), part of the report and its file
    names: two runs with different families must not overwrite each other."""
    from cuattn.backends import geometry

    return geometry.kernel_family()


def _versions() -> dict[str, str]:
    versions = {"numpy": np.__version__}
    for module in ("torch", "cupy", "triton"):
        try:
            versions[module] = __import__(module).__version__
        except ImportError:
            continue
    return versions


def write_results(
    report: dict[str, Any], out_dir: Path, suffix: str, plot: bool = True
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    day = report["date"][:10]
    device = re.sub(r"[^A-Za-z0-9]+", "-", report["device"]).strip("-").lower()
    stem = out_dir / f"{day}-{device}{suffix}"
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    bench_report.write_json(paths[0], report)
    paths[1].write_text(bench_report.markdown_table(report))
    if plot and bench_report.plot_speed_vs_density(report, stem.with_suffix(".png")):
        paths.append(stem.with_suffix(".png"))
    return paths


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="one size, < 2 min on one H100")
    mode.add_argument(
        "--dry-run", action="store_true", help="CPU only: exercise the harness (NumPy backend)"
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help=f"results directory (default: {DEFAULT_RESULTS_DIR} on a GPU; a folder under the "
        "system temp directory for the dry run)",
    )
    parser.add_argument("--backend", default=None, help="cuattn backend (default: cuda / numpy)")
    parser.add_argument(
        "--patterns", default="", help="comma-separated pattern labels to keep, e.g. local,bigbird"
    )
    parser.add_argument(
        "--blocksizes",
        default="",
        help="comma-separated layout block sizes replacing the sweep's, e.g. 64,128",
    )
    parser.add_argument(
        "--head-dims",
        default="",
        help="comma-separated head dims replacing the sweep's, e.g. 64 (the full sweep's d = 64 "
        "cases alone; its sparse patterns stay at their own head dims)",
    )
    parser.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start no new case after this many seconds (default: "
        + ", ".join(f"{mode} {seconds:.0f}" for mode, seconds in BUDGET_S.items())
        + ")",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per measurement")


def _sizes(flag: str, text: str, example: str, accepted: tuple[int, ...] = ()) -> tuple[int, ...]:
    """Comma-separated positive sizes (of ``accepted``, where given), or SystemExit saying what
    came and what is accepted."""
    try:
        sizes = tuple(int(size) for size in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1 or (accepted and not set(sizes) <= set(accepted)):
        of = f" of {', '.join(map(str, accepted))}" if accepted else ""
        raise SystemExit(
            f"{flag}: got {text!r}, expected comma-separated sizes{of}, e.g. {example}"
        )
    return sizes


def run(args: argparse.Namespace) -> int:
    dry_run = args.dry_run
    if not dry_run and not gpu_available():
        sys.stderr.write("no CUDA device (torch + CuPy): running the CPU dry run instead\n")
        dry_run = True
    mode = "dry-run" if dry_run else ("quick" if args.quick else "full")
    sweep = SWEEPS[mode]
    if args.patterns:
        keep = set(args.patterns.split(","))
        sweep = Sweep(
            **{**sweep.__dict__, "patterns": tuple(p for p in sweep.patterns if p.label in keep)}
        )
    if args.blocksizes:
        blocksizes = _sizes("--blocksizes", args.blocksizes, "64,128")
        sweep = Sweep(**{**sweep.__dict__, "blocksizes": blocksizes})
    if args.head_dims:
        head_dims = _sizes("--head-dims", args.head_dims, "64", HEAD_DIMS)
        sweep = Sweep(**{**sweep.__dict__, "head_dims": head_dims})
    env = build_environment(dry_run, args.backend)
    if args.repeats:
        env.repeats = args.repeats
    from cuattn.backends.geometry import AUTO_FAMILY

    family = _kernel_family()
    suffix = ("" if mode == "full" else f"-{mode}") + (
        "" if family == AUTO_FAMILY else f"-{family}"
    )
    out_dir = args.out
    if out_dir is None:
        out_dir = DRY_RUN_RESULTS_DIR if dry_run else DEFAULT_RESULTS_DIR

    def checkpoint(partial: dict[str, Any]) -> None:
        partial["mode"] = mode
        write_results(partial, out_dir, suffix, plot=False)

    report = run_sweep(
        env, sweep, args.time_budget or BUDGET_S[mode], progress=sys.stderr, checkpoint=checkpoint
    )
    report["mode"] = mode
    paths = write_results(report, out_dir, suffix)
    sys.stderr.write("wrote " + ", ".join(str(p) for p in paths) + "\n")
    if not any(p.suffix == ".png" for p in paths):
        sys.stderr.write("no PNG of speed vs density: pip install matplotlib for it\n")
    return 0 if report["all_correct"] else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="cuattn bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))
