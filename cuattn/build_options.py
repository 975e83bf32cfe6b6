"""NVRTC options shared by the runtime and the compile check, so the check measures what runs."""

from __future__ import annotations

from cuattn.cuda_paths import cuda_include_options, nvrtc_include_options

# C++17 is what NVRTC 12 and 13 both accept without warnings; the kernels need nothing newer.
CXX_STANDARD_OPTION = "--std=c++17"
# Kernels are tuned for these; the compile check sweeps them all.
DEFAULT_ARCHS = ("sm_80", "sm_90")
# CuPy appends these to every NVRTC compile it does (cupy/cuda/compiler.py); the compile check
# adds them too so it measures the code the runtime gets.
CUPY_IMPLICIT_OPTIONS = ("-ftz=true",)
# Warnings and ptxas statistics for the compile check only.
PTXAS_VERBOSE_OPTION = "-Xptxas=-v"


def common_options(with_kernel_dir: bool = True) -> tuple[str, ...]:
    """Options every cuattn kernel build uses (without the architecture).

    `with_kernel_dir=False` is for stand-alone sources (tests) that include no cuattn header.
    """
    includes = nvrtc_include_options() if with_kernel_dir else cuda_include_options()
    return (CXX_STANDARD_OPTION, *includes)


def arch_option(arch: str) -> str:
    """`sm_90` -> NVRTC option producing a cubin for exactly that architecture."""
    if not arch.startswith("sm_") or not arch[3:].rstrip("a").isdigit():
        raise ValueError(f"arch must look like 'sm_80' or 'sm_90a', got {arch!r}")
    return f"--gpu-architecture={arch}"
