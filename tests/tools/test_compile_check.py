"""NVRTC compile check: parser, a tiny kernel of our own, and (slow) every real instantiation."""

from __future__ import annotations

import os

import pytest

from cuattn.backends.toolchain import common_options
from dev.compile_check import (
    CompileUnit,
    compile_unit,
    format_table,
    run_check,
    summarize,
)
from dev.ptxas import parse_ptxas_log

nvrtc = pytest.importorskip("cupy_backends.cuda.libs.nvrtc")

STANDALONE_OPTIONS = common_options(with_kernel_dir=False)

SAMPLE_LOG = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z1kILi128EEvPf' for 'sm_80'
ptxas info    : Function properties for _Z1kILi128EEvPf
ptxas         .     8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 512 bytes smem, 368 bytes cmem[0]
"""

TINY_KERNEL = r"""
#include <cuda_fp16.h>
template <int N, typename T>
__global__ void tiny(const T* x, float* y) {
  __shared__ float tile[N];
  tile[threadIdx.x] = __half2float(x[threadIdx.x]);
  __syncthreads();
  y[threadIdx.x] = tile[(threadIdx.x + 1) % N];
}
"""

# __launch_bounds__(1024, 2) caps a thread at 32 registers; 256 live floats cannot fit, so ptxas
# must spill: the check has to flag it.
SPILLING_KERNEL = r"""
__global__ void __launch_bounds__(1024, 2) spill(const int* idx, float* y) {
  float acc[256];
#pragma unroll
  for (int i = 0; i < 256; ++i) acc[i] = y[i * 1024 + threadIdx.x];
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 256; ++i) s += acc[i] * acc[(i * 7) & 255];
  y[threadIdx.x] = s;
}
"""


def test_parse_ptxas_log():
    stats = parse_ptxas_log(SAMPLE_LOG).functions["_Z1kILi128EEvPf"]
    assert (stats.registers, stats.static_smem_bytes) == (255, 512)
    assert (stats.stack_bytes, stats.spill_store_bytes, stats.spill_load_bytes) == (8, 4, 12)
    assert stats.spills


def test_tiny_kernel_compiles_and_reports():
    unit = CompileUnit("tiny.cu", "tiny<128, __half>")
    result = compile_unit(TINY_KERNEL, unit, "sm_80", STANDALONE_OPTIONS)
    assert result.error is None, result.error
    assert result.stats.registers > 0
    assert result.stats.static_smem_bytes == 128 * 4
    assert not result.spills and result.ok


def test_compile_error_is_reported_not_raised():
    unit = CompileUnit("broken.cu", "tiny<128, __half>")
    result = compile_unit(
        TINY_KERNEL.replace("__syncthreads();", "syncthreads_typo();"),
        unit,
        "sm_90",
        STANDALONE_OPTIONS,
    )
    assert result.error is not None and "syncthreads_typo" in result.error
    assert not result.ok


def test_one_program_of_several_instantiations_reports_each_alone():
    """A batch (one NVRTC program) gives each instantiation its own ptxas figures, the same as
    compiling it alone; a batch that fails is compiled again one by one, so the error names the
    instantiation that has it and the others still compile."""
    from dev.compile_check import compile_units

    units = [CompileUnit("tiny.cu", f"tiny<{n}, __half>") for n in (32, 64, 128)]
    together = compile_units(TINY_KERNEL, units, "sm_80", STANDALONE_OPTIONS)
    alone = [compile_unit(TINY_KERNEL, u, "sm_80", STANDALONE_OPTIONS) for u in units]
    assert [r.unit for r in together] == units
    for a, b in zip(together, alone, strict=True):
        assert a.ok and (a.stats.registers, a.stats.static_smem_bytes) == (
            b.stats.registers,
            b.stats.static_smem_bytes,
        )
    assert [r.stats.static_smem_bytes for r in together] == [128, 256, 512]
    refusing = TINY_KERNEL.replace("{", '{\n  static_assert(N != 64, "no 64 here");', 1)
    mixed = compile_units(refusing, units, "sm_80", STANDALONE_OPTIONS)
    assert [r.ok for r in mixed] == [True, False, True]
    assert "no 64 here" in mixed[1].error and mixed[0].stats.registers > 0


def test_spill_fails_the_check():
    unit = CompileUnit("spill.cu", "spill")
    result = compile_unit(SPILLING_KERNEL, unit, "sm_80", STANDALONE_OPTIONS)
    assert result.error is None, result.error
    assert result.spills and not result.ok


def test_run_check_parallel_table():
    units = [CompileUnit("tiny.cu", f"tiny<{n}, __half>") for n in (32, 64)]
    results = run_check(
        units,
        ["sm_80", "sm_90"],
        {"tiny.cu": TINY_KERNEL},
        STANDALONE_OPTIONS,
        jobs=2,
        progress=None,
    )
    assert [(r.unit, r.arch) for r in results] == [
        (u, a) for a in ("sm_80", "sm_90") for u in units
    ]
    assert all(r.ok for r in results)
    table = format_table(results)
    assert table.count("\n") == 1 + len(results)
    assert "0 spilling, 0 errors" in summarize(results)
    assert table.splitlines()[2].endswith("| - | - | - | - | ok |")  # no launch geometry given


def test_occupancy_from_registers_threads_and_shared_memory():
    from cuattn.backends.geometry import ctas_per_sm

    # 255 registers round up to 8192 per warp: 8 warps per SM, 2 CTAs of 4 warps
    assert ctas_per_sm("sm_90", 255, 128, 70 * 1024) == 2
    # shared memory binds: 3 CTAs of 70 KB (+1 KB reserved each) fit in sm_90's 228 KB, 2 in 164
    assert ctas_per_sm("sm_90", 64, 128, 70 * 1024) == 3
    assert ctas_per_sm("sm_80", 64, 128, 70 * 1024) == 2
    # threads bind: 16 CTAs of 128 threads; CTA count binds: 32 CTAs of one warp
    assert ctas_per_sm("sm_80", 32, 128, 0) == 16
    assert ctas_per_sm("sm_80", 32, 32, 0) == 32
    unit = CompileUnit("tiny.cu", "tiny<32, __half>", threads=128, dynamic_smem=70 * 1024)
    result = run_check(
        [unit], ["sm_90"], {"tiny.cu": TINY_KERNEL}, STANDALONE_OPTIONS, jobs=1, progress=None
    )[0]
    cells = format_table([result]).splitlines()[2].split("|")
    assert [c.strip() for c in cells[9:13]] == ["128", str(70 * 1024), "3", "12"]


def test_one_instantiation_of_every_kernel_file_compiles_without_spills():
    """The suite's quick NVRTC check (the sweep of every instantiation is `slow`, .ci/run's own
    step): in each kernel file, the instantiation with the most shared memory (the widest tiles),
    for sm_90."""
    from dev.compile_check import kernel_instantiations, load_sources

    widest = {}
    for unit in kernel_instantiations():
        key = (unit.dynamic_smem, unit.name_expression)
        if unit.source_file not in widest or key > widest[unit.source_file][0]:
            widest[unit.source_file] = (key, unit)
    units = [unit for _, unit in widest.values()]
    assert len(units) >= 5, sorted(widest)
    jobs = os.cpu_count() or 1
    results = run_check(units, ["sm_90"], load_sources(units), common_options(), jobs, None)
    failures = [f"{r.unit.name_expression}: {r.error or 'spills'}" for r in results if not r.ok]
    assert not failures, "\n".join(failures)


@pytest.mark.slow
def test_every_kernel_instantiation_compiles_without_spills():
    """Every plain instantiation for sm_90; the score-modifier variant of every one within
    MODS_REGISTER_MARGIN of its register cap (further below, the variant cannot spill); and for
    sm_80 every compiled one that could spill there (within ARCH_REGISTER_MARGIN of its cap, or
    a cap not known here): each instantiation is compiled where it can tell something new."""
    geometry = pytest.importorskip("cuattn.backends.geometry")
    from dev.compile_check import (
        SCORE_MODS,
        kernel_instantiations,
        load_sources,
        modifier_twin,
        needs_every_arch,
        needs_modifier_variant,
    )

    units = kernel_instantiations()
    assert units, geometry
    by_name = {u.name_expression: u for u in units}
    plain = [u for u in units if not u.name_expression.endswith(SCORE_MODS)]
    assert len(plain) < len(units)
    jobs = os.cpu_count() or 1
    sources, options = load_sources(units), common_options()
    results = run_check(plain, ["sm_90"], sources, options, jobs, progress=None)
    twins = [modifier_twin(r.unit, by_name) for r in results if needs_modifier_variant(r)]
    twins = [t for t in twins if t is not None]
    results += run_check(twins, ["sm_90"], sources, options, jobs, progress=None)
    near_cap = [r.unit for r in results if needs_every_arch(r)]
    results += run_check(near_cap, ["sm_80"], sources, options, jobs, progress=None)
    failures = [
        f"{r.arch} {r.unit.name_expression}: {r.error or 'spills'}" for r in results if not r.ok
    ]
    assert not failures, "\n".join(failures)


def test_only_instantiations_near_their_register_cap_need_a_second_arch():
    from cuattn.backends.geometry import KernelConfig
    from dev.compile_check import ARCH_REGISTER_MARGIN, CompileResult, needs_every_arch
    from dev.ptxas import FunctionStats

    dq = KernelConfig("attn_bwd_dq", 128, "bfloat16", block=64, rule="causal")
    assert dq.register_cap == 255  # one CTA of 128 threads: 512 a thread, the ISA's 255
    fwd = KernelConfig("attn_fwd", 64, "float16", block=64, rule="none")
    assert fwd.register_cap == 255
    assert KernelConfig("merge_states", 64, "float16").register_cap is None

    def result(cap, registers, spill=0, error=None):
        unit = CompileUnit("k.cu", "k", register_cap=cap)
        stats = FunctionStats("k", registers=registers, spill_store_bytes=spill)
        return CompileResult(unit, "sm_90", 0.0, error=error, stats=stats)

    assert not needs_every_arch(result(255, 255 - ARCH_REGISTER_MARGIN))
    assert needs_every_arch(result(255, 256 - ARCH_REGISTER_MARGIN))
    assert needs_every_arch(result(168, 130))  # dq at 3 CTAs: near its own cap
    assert needs_every_arch(result(0, 40))  # cap not known here
    assert needs_every_arch(result(255, 100, spill=8))
    assert needs_every_arch(result(255, 0, error="boom"))


def test_a_modifier_variant_is_compiled_only_near_its_twins_cap():
    from dev.compile_check import (
        MODS_REGISTER_MARGIN,
        CompileResult,
        modifier_twin,
        needs_modifier_variant,
    )
    from dev.ptxas import FunctionStats

    plain = CompileUnit(
        "attn_fwd.cu", "attn_fwd<64, 64, 64, 4, 64, float, MASK_NONE, MODS_NONE>", 128, 0, 255
    )
    variant = CompileUnit("attn_fwd.cu", plain.name_expression.replace("NONE>", "SCORE>"))
    by_name = {u.name_expression: u for u in (plain, variant)}
    assert modifier_twin(plain, by_name) == variant
    assert modifier_twin(variant, by_name) is None
    assert (
        modifier_twin(CompileUnit("attn_bwd.cu", "attn_bwd_preprocess<64, float>"), by_name) is None
    )

    def result(registers):
        return CompileResult(plain, "sm_90", 0.0, stats=FunctionStats("k", registers=registers))

    assert not needs_modifier_variant(result(255 - MODS_REGISTER_MARGIN))
    assert needs_modifier_variant(result(256 - MODS_REGISTER_MARGIN))


def test_one_header_mistake_is_reported_once():
    from dev.compile_check import format_errors

    broken = TINY_KERNEL.replace("__syncthreads();", "syncthreads_typo();")
    units = [CompileUnit("tiny.cu", f"tiny<{n}, __half>") for n in (32, 64, 128)]
    results = run_check(units, ["sm_80"], {"tiny.cu": broken}, STANDALONE_OPTIONS, 1, None)
    report = format_errors(results)
    assert report.count("## ") == 1 and "## 3 x" in report and "syncthreads_typo" in report


def test_missing_nvrtc_is_one_line_naming_the_extra(monkeypatch, capsys):
    """`python -m dev compile` without NVRTC once died in a 50-line traceback (no
    libnvrtc.so.12)."""
    import cupy_backends.cuda.libs.nvrtc as nvrtc

    from dev import compile_check

    def missing():
        raise RuntimeError("CuPy failed to load libnvrtc.so.12: OSError: cannot open shared object")

    monkeypatch.setattr(nvrtc, "getVersion", missing)
    assert compile_check.main(["--filter", "attn_bwd_preprocess<32"]) == compile_check.EXIT_FAILED
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "NVRTC cannot be loaded" in err and "pip install 'cuattn[nvrtc]'" in err
