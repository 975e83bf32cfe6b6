"""NVRTC compile check: every kernel instantiation, every architecture, no GPU needed.

Compiles each instantiation to a cubin with `-Xptxas=-v`, collects registers / shared memory /
spills, prints a table, and fails (exit status 1) on any compile error or any spill. Run:

    python -m dev compile [--arch sm_80,sm_90] [--jobs N]

Instantiations of one file compile together, COMPILE_BATCH at a time, as one NVRTC program with
a name expression each (the file's headers are parsed once per batch: ~20% less time than one
program each); ptxas reports every entry function by its mangled name, so each instantiation's
registers and spills stand alone. A batch that fails to compile is compiled again one
instantiation at a time, so an error names its instantiation. Batches compile in a process pool
so every core works.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from typing import TextIO

from cuattn._util import one_line
from cuattn.backends.toolchain import (
    CUPY_IMPLICIT_OPTIONS,
    DEFAULT_ARCHS,
    PTXAS_VERBOSE_OPTION,
    arch_option,
    common_options,
    cuda_include_options,
)
from dev.ptxas import FunctionStats, parse_ptxas_log

EXIT_OK = 0
EXIT_FAILED = 1
MAX_ERROR_LINES = 12  # of one compiler error shown
MAX_LISTED = 4  # instantiations named per distinct error
MAX_REASON_CHARS = 160  # of a load error quoted in the one-line message
# Registers by which sm_80 may use more than sm_90 on one instantiation, with room to spare: over
# all 1265 attention, decode and layout instantiations the most is 40 (fp32 dQ at head dim 256).
ARCH_REGISTER_MARGIN = 48
# Instantiations of one file per NVRTC program: enough to parse the headers once for several,
# few enough that a job's batches still spread over every core.
COMPILE_BATCH = 8
# A block kernel's score-modifier variant (MODS_SCORE) uses at most 78 registers more than its
# plain twin on sm_90 (all 1152 pairs, NVRTC 12.9): a
# plain instantiation this far below its cap has a variant that cannot spill there.
MODS_REGISTER_MARGIN = 80
PLAIN_MODS, SCORE_MODS = "MODS_NONE>", "MODS_SCORE>"
SM90_GPU_ARCH = "sm_90"  # asked for it, the check compiles the sm_90a family too ...
SM90A_ARCH = "sm_90a"  # ... for this architecture, the only one that takes wgmma
INSTALL_HINT = (
    "pip install 'cuattn[nvrtc]' (CuPy with NVRTC and the CUDA runtime headers, no GPU needed)"
)


@dataclass(frozen=True)
class CompileUnit:
    """One kernel instantiation to compile."""

    source_file: str  # e.g. "attn_fwd.cu", relative to kernels/
    name_expression: str  # e.g. "attn_fwd<64, 64, 64, 4, 128, __half, MASK_CAUSAL, MODS_NONE>"
    threads: int = 0  # per CTA at launch (0: unknown, no occupancy in the report)
    dynamic_smem: int = 0  # bytes of dynamic shared memory at launch
    register_cap: int = 0  # registers per thread its launch bounds allow (0: not known here)


@dataclass(frozen=True)
class CompileResult:
    unit: CompileUnit
    arch: str
    seconds: float
    error: str | None = None
    # ptxas's report for the entry kernel (empty when the compile failed).
    stats: FunctionStats = field(default_factory=lambda: FunctionStats(""))
    # Spills in non-inlined device functions called by this kernel count against it too.
    callee_spill_bytes: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None and not self.spills

    @property
    def spills(self) -> bool:
        return self.stats.spills or self.callee_spill_bytes > 0


def compile_unit(
    source: str, unit: CompileUnit, arch: str, options: Sequence[str]
) -> CompileResult:
    """Compile one instantiation with NVRTC to a cubin; never raises for compile errors."""
    return compile_units(source, [unit], arch, options)[0]


def compile_units(
    source: str, units: Sequence[CompileUnit], arch: str, options: Sequence[str]
) -> list[CompileResult]:
    """Compile instantiations of one source file as one NVRTC program; a result per unit, in
    order, each timed as its share of the program's time. Never raises for compile errors: a
    failing program of several units is compiled again unit by unit, so that each error is
    reported by the instantiation it belongs to."""
    from cupy_backends.cuda.libs import nvrtc

    start = time.perf_counter()
    program = nvrtc.createProgram(source, units[0].source_file, [], [])
    try:
        for unit in units:
            nvrtc.addNameExpression(program, unit.name_expression)
        all_options = [arch_option(arch), PTXAS_VERBOSE_OPTION, *options, *CUPY_IMPLICIT_OPTIONS]
        try:
            nvrtc.compileProgram(program, all_options)
        except nvrtc.NVRTCError as exc:
            if len(units) > 1:
                return [r for u in units for r in compile_units(source, [u], arch, options)]
            log = nvrtc.getProgramLog(program).rstrip("\x00")
            return [CompileResult(units[0], arch, time.perf_counter() - start, f"{exc}\n{log}")]
        log = nvrtc.getProgramLog(program).rstrip("\x00")
        lowered = [nvrtc.getLoweredName(program, unit.name_expression) for unit in units]
    finally:
        nvrtc.destroyProgram(program)
    seconds = (time.perf_counter() - start) / len(units)
    report = parse_ptxas_log(log)
    # Spills in non-inlined device functions count against every entry of the program.
    callee_spills = sum(
        f.spill_store_bytes + f.spill_load_bytes
        for name, f in report.functions.items()
        if name not in lowered and name.startswith("_Z") and f.spills
    )
    results = []
    for unit, name in zip(units, lowered, strict=True):
        if name not in report.functions:
            error = f"no ptxas report for {name}\n{log}"
            results.append(CompileResult(unit, arch, seconds, error=error))
        else:
            stats = report.functions[name]
            results.append(CompileResult(unit, arch, seconds, None, stats, callee_spills))
    return results


def _batches(
    units: Sequence[CompileUnit], archs: Sequence[str]
) -> list[tuple[str, list[CompileUnit]]]:
    """(arch, units) programs of at most COMPILE_BATCH units of one source file each."""
    batches = []
    for arch in archs:
        by_file: dict[str, list[CompileUnit]] = {}
        for unit in units:
            by_file.setdefault(unit.source_file, []).append(unit)
        for group in by_file.values():
            for first in range(0, len(group), COMPILE_BATCH):
                batches.append((arch, group[first : first + COMPILE_BATCH]))
    return batches


def run_check(
    units: Sequence[CompileUnit],
    archs: Sequence[str],
    sources: dict[str, str],
    options: Sequence[str],
    jobs: int,
    progress: TextIO | None = sys.stderr,
) -> list[CompileResult]:
    """Compile every (unit, arch) pair in `jobs` processes, in programs of COMPILE_BATCH units
    of one file; results in submission order (by arch, then unit)."""
    tasks = [(unit, arch) for arch in archs for unit in units]
    batches = _batches(units, archs)
    results: dict[tuple[CompileUnit, str], CompileResult] = {}
    done = 0

    def collect(batch_results: list[CompileResult]) -> None:
        nonlocal done
        for result in batch_results:
            results[(result.unit, result.arch)] = result
            done += 1
            _report_progress(progress, done, len(tasks), result)

    if jobs <= 1:
        for arch, group in batches:
            collect(compile_units(sources[group[0].source_file], group, arch, options))
    else:
        # spawn, not fork: the caller may have threads (jax, BLAS), and a forked child of a
        # multithreaded process can deadlock.
        context = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
            futures = [
                pool.submit(compile_units, sources[group[0].source_file], group, arch, options)
                for arch, group in batches
            ]
            for future in as_completed(futures):
                collect(future.result())
    return [results[task] for task in tasks]


def _report_progress(stream: TextIO | None, done: int, total: int, result: CompileResult) -> None:
    if stream is None:
        return
    status = "ERROR" if result.error else ("SPILL" if result.spills else "ok")
    width = len(str(total))
    stream.write(
        f"[{done:>{width}}/{total}] {status:5} {result.arch} {result.unit.name_expression}"
        f" ({result.seconds:.1f}s)\n"
    )
    stream.flush()


def format_table(results: Iterable[CompileResult]) -> str:
    """Markdown table, one row per (instantiation, arch)."""
    header = (
        "| arch | file | instantiation | regs | static smem B | stack B | spill st B | spill ld B"
        " | threads | dynamic smem B | CTAs/SM | warps/SM | status |"
        "\n|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"
    )
    rows = [header]
    for r in results:
        status = "error" if r.error else ("SPILL" if r.spills else "ok")
        rows.append(
            f"| {r.arch} | {r.unit.source_file} | `{r.unit.name_expression}` | {r.stats.registers}"
            f" | {r.stats.static_smem_bytes} | {r.stats.stack_bytes} | {r.stats.spill_store_bytes}"
            f" | {r.stats.spill_load_bytes + r.callee_spill_bytes} | {_occupancy_cells(r)}"
            f" | {status} |"
        )
    return "\n".join(rows)


def _occupancy_cells(r: CompileResult) -> str:
    """threads | dynamic smem | CTAs per SM | warps per SM, or dashes where unknown."""
    from cuattn.backends.geometry import SM_LIMITS, WARP_SIZE, ctas_per_sm

    if r.error or not r.unit.threads or r.arch not in SM_LIMITS:
        return "- | - | - | -"
    smem = r.unit.dynamic_smem + r.stats.static_smem_bytes
    ctas = ctas_per_sm(r.arch, r.stats.registers, r.unit.threads, smem)
    warps = ctas * (r.unit.threads // WARP_SIZE)
    return f"{r.unit.threads} | {r.unit.dynamic_smem} | {ctas} | {warps}"


def format_errors(results: Iterable[CompileResult]) -> str:
    """Each distinct compiler error once (by its first error line), with where it occurred;
    one mistake in a shared header otherwise repeats for every instantiation."""
    groups: dict[str, list[CompileResult]] = {}
    for r in results:
        if r.error:
            lines = r.error.splitlines()
            first = next((line for line in lines if "error:" in line), lines[0])
            groups.setdefault(first, []).append(r)
    parts = []
    for group in groups.values():
        where = ", ".join(f"{r.arch} {r.unit.name_expression}" for r in group[:MAX_LISTED])
        more = f" and {len(group) - MAX_LISTED} more" if len(group) > MAX_LISTED else ""
        detail = "\n".join(group[0].error.splitlines()[:MAX_ERROR_LINES])
        parts.append(f"\n## {len(group)} x: {where}{more}\n{detail}")
    return "\n".join(parts)


def summarize(results: Sequence[CompileResult]) -> str:
    errors = sum(1 for r in results if r.error)
    spills = sum(1 for r in results if r.error is None and r.spills)
    ok_regs = [r.stats.registers for r in results if r.error is None]
    max_regs = max(ok_regs, default=0)
    return (
        f"{len(results)} compiled: {len(results) - errors - spills} ok, {spills} spilling,"
        f" {errors} errors; max registers {max_regs}"
    )


def kernel_instantiations() -> list[CompileUnit]:
    """Every instantiation the kernels ship, as listed by cuattn.backends.geometry."""
    from cuattn.backends import geometry

    return [
        CompileUnit(
            c.source_file,
            c.name_expression,
            c.threads,
            c.smem_bytes,
            getattr(c, "register_cap", None) or 0,
        )
        for c in (
            *geometry.all_configs(),
            *geometry.decode_gqa_configs(),
            *geometry.decode_fp8_configs(),
        )
    ]


def sm90a_instantiations() -> list[CompileUnit]:
    """The sm_90a family (the wgmma forward and backward and the backward's dQ conversion), which
    builds for sm_90a alone: what an sm_90 GPU runs besides the plain kernels."""
    from cuattn.backends import geometry

    return [
        CompileUnit(c.source_file, c.name_expression, c.threads, c.smem_bytes, 0)
        for c in (
            *geometry.sm90_configs(),
            *geometry.sm90_persistent_configs(),
            *geometry.sm90_backward_configs(),
            *geometry.sm90_backward_configs(geometry.SM90_BWD_PERSISTENT),
        )
    ]


def needs_every_arch(result: CompileResult, margin: int = ARCH_REGISTER_MARGIN) -> bool:
    """Whether an instantiation compiled for one architecture must be compiled for the others
    too to know it is spill-free there: it failed or spilled, its register cap is not known
    here, or it uses more than its cap less ``margin`` (sm_80 uses at most 40 registers more
    than sm_90 on any instantiation, less than ``margin``; further from the cap it cannot spill).
    The test suite's sweep uses this to compile sm_90 for all and sm_80 for these; the
    ``python -m dev compile`` command compiles everything for every architecture it is given."""
    cap = result.unit.register_cap
    return not result.ok or not cap or result.stats.registers > cap - margin


def modifier_twin(unit: CompileUnit, by_name: Mapping[str, CompileUnit]) -> CompileUnit | None:
    """The MODS_SCORE variant of a plain block-kernel instantiation, looked up in ``by_name``
    (name expression -> unit); None for the kernels without modifier variants."""
    if not unit.name_expression.endswith(PLAIN_MODS):
        return None
    return by_name.get(unit.name_expression[: -len(PLAIN_MODS)] + SCORE_MODS)


def needs_modifier_variant(result: CompileResult, margin: int = MODS_REGISTER_MARGIN) -> bool:
    """Whether the score-modifier variant of a compiled plain instantiation must be compiled
    too to know it is spill-free on the same architecture: the plain one failed or spilled, its
    cap is not known here, or it uses more than its cap less ``margin`` (the variant uses at
    most 78 registers more; further from the cap it cannot spill). The test suite's sweep uses
    this; ``python -m dev compile`` compiles every variant."""
    return needs_every_arch(result, margin)


def load_sources(units: Iterable[CompileUnit]) -> dict[str, str]:
    from cuattn.backends.toolchain import kernel_program

    return {name: kernel_program(name) for name in {u.source_file for u in units}}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch",
        default=",".join(DEFAULT_ARCHS),
        help="comma-separated architectures (default: %(default)s)",
    )
    parser.add_argument(
        "--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiler processes"
    )
    parser.add_argument("--filter", default="", help="only instantiations containing this text")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")


def missing_toolchain() -> str | None:
    """What is missing to compile with NVRTC here, in one line; None when nothing is."""
    try:
        from cupy_backends.cuda.libs import nvrtc

        nvrtc.getVersion()
    except (ImportError, OSError, RuntimeError) as exc:
        return f"NVRTC cannot be loaded ({one_line(exc, MAX_REASON_CHARS)}); {INSTALL_HINT}"
    if not cuda_include_options():
        return f"no CUDA headers (cuda_fp16.h) found; {INSTALL_HINT}"
    return None


def run(args: argparse.Namespace) -> int:
    problem = missing_toolchain()
    if problem is not None:
        sys.stderr.write(f"python -m dev compile: {problem}\n")
        return EXIT_FAILED
    archs = [a.strip() for a in args.arch.split(",") if a.strip()]
    units = [u for u in kernel_instantiations() if args.filter in u.name_expression]
    # with sm_90 asked for, the sm_90a family too, for sm_90a alone
    sm90a_units = [u for u in sm90a_instantiations() if args.filter in u.name_expression]
    sm90a_units = sm90a_units if SM90_GPU_ARCH in archs else []
    if not units and not sm90a_units:
        sys.stderr.write(f"no instantiations match {args.filter!r}\n")
        return EXIT_FAILED
    sys.stderr.write(
        f"compiling {len(units)} instantiations x {len(archs)} archs and {len(sm90a_units)} "
        f"for {SM90A_ARCH} with {args.jobs} jobs\n"
    )
    start = time.perf_counter()
    sources = load_sources([*units, *sm90a_units])
    results = run_check(units, archs, sources, common_options(), args.jobs)
    results += run_check(sm90a_units, [SM90A_ARCH], sources, common_options(), args.jobs)
    table = format_table(results)
    print(table)
    print(format_errors(results))
    summary = f"{summarize(results)}; {time.perf_counter() - start:.0f}s with {args.jobs} jobs"
    print(f"\n{summary}")
    if args.markdown:
        with open(args.markdown, "w") as out:
            out.write(f"{table}\n\n{summary}\n")
    return EXIT_OK if all(r.ok for r in results) else EXIT_FAILED


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dev compile", description=__doc__.splitlines()[0]
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))
