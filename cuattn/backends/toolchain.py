"""The CUDA toolchain side of the kernels: where the .cu sources and the CUDA headers are, the
text handed to NVRTC, and the NVRTC options every build uses.

One place answers these for the CUDA runtime, the NVRTC compile check and the CPU kernel
interpreter. The sources are the package data of an installed wheel (the wheel maps the
top-level kernels/ to the package ``cuattn.kernels``), else the checkout's kernels/. NVRTC has
no default include path: ``#include <cuda_fp16.h>`` only works when we pass ``-I`` for a CUDA
toolkit's include directory; we look where a pip/conda/system install puts it, in the order
CuPy uses for NVRTC itself, so the headers match the compiler that reads them.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
from pathlib import Path

KERNELS_PACKAGE = "cuattn.kernels"
# cuattn/backends/toolchain.py -> the checkout root, which holds kernels/
_CHECKOUT_KERNELS = Path(__file__).resolve().parents[2] / "kernels"
SOURCE_SUFFIXES = (".cu", ".cuh", ".h", ".hpp")


@functools.cache
def kernel_dir() -> Path:
    """The directory holding kernels/*.cu, common/*.cuh and interp/."""
    # kernels/ has no __init__.py, so in a wheel cuattn.kernels is a namespace package: its
    # spec's search locations are plain directories (importlib.resources would hand back a
    # MultiplexedPath, which is no path a compiler's -I can use).
    try:
        spec = importlib.util.find_spec(KERNELS_PACKAGE)
    except ModuleNotFoundError:
        spec = None
    for location in (spec.submodule_search_locations or []) if spec else []:
        if any(Path(location).glob("*.cu")):
            return Path(location)
    if _CHECKOUT_KERNELS.is_dir():
        return _CHECKOUT_KERNELS
    raise FileNotFoundError(
        f"cuattn's kernel sources are missing: neither the package data {KERNELS_PACKAGE!r} nor "
        f"the checkout directory {_CHECKOUT_KERNELS} exists; reinstall cuattn"
    )


def kernel_files(root: Path | None = None) -> list[Path]:
    """Every kernel source file (*.cu, common/*.cuh, the interpreter's shim headers), sorted."""
    root = kernel_dir() if root is None else root
    return sorted(p for p in root.rglob("*") if p.suffix in SOURCE_SUFFIXES and p.is_file())


def _digest_of(root: Path) -> str:
    """SHA-256 over every kernel source file under ``root`` (names and contents): the cache key
    part that makes any edit of a kernel or a header recompile (GPU modules, interpreter .so)."""
    digest = hashlib.sha256()
    for path in kernel_files(root):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


# A header every CUDA toolkit include directory has; used to recognise one.
_MARKER_HEADER = "cuda_fp16.h"
_ENV_ROOTS = ("CUDA_PATH", "CUDA_HOME")
_SYSTEM_ROOT = "/usr/local/cuda"


@functools.cache
def cuda_include_dirs() -> tuple[str, ...]:
    """Include directories holding the CUDA runtime headers (empty when none is found)."""
    found: list[str] = []
    pathfinder_dir = _pathfinder_include_dir()
    if pathfinder_dir is not None:
        found.append(pathfinder_dir)
    roots = [os.environ.get(name) for name in _ENV_ROOTS] + [_SYSTEM_ROOT]
    for root in roots:
        if root and (Path(root) / "include" / _MARKER_HEADER).is_file():
            found.append(str(Path(root) / "include"))
    return tuple(dict.fromkeys(found))


def _pathfinder_include_dir() -> str | None:
    # cuda.pathfinder ships with CuPy >= 14 and knows the nvidia-* wheel layouts (CUDA 12 and 13).
    try:
        from cuda.pathfinder import find_nvidia_header_directory
    except ImportError:
        return None
    try:
        directory = find_nvidia_header_directory("cudart")
    except Exception:  # pathfinder raises its own types for "not found"; any failure means none
        return None
    if directory and (Path(directory) / _MARKER_HEADER).is_file():
        return str(directory)
    return None


def kernel_source(filename: str) -> str:
    """Text of one kernel file, e.g. 'attn_fwd.cu'."""
    path = kernel_dir() / filename
    if not path.is_file():
        available = sorted(p.name for p in kernel_dir().glob("*.cu"))
        raise FileNotFoundError(f"kernel file {filename!r} not in {kernel_dir()}; have {available}")
    return path.read_text()


@functools.cache
def sources_digest(root: Path | None = None) -> str:
    """SHA-256 over every kernel source and header under ``root`` (default: the kernel
    directory), names and contents: the cache key part that makes any edit of a kernel or a
    header recompile (GPU modules, interpreter libraries). Cached for the process."""
    return _digest_of(kernel_dir() if root is None else root)


def kernel_program(filename: str) -> str:
    """The text to hand NVRTC (through CuPy) for one kernel file.

    CuPy's disk cache keys a module by its source text, options and name expressions, never by
    the headers it includes: a changed common/*.cuh would be served from a stale cubin. A first
    line naming the digest of every source and header makes any change a new key; `#line` keeps
    compiler messages pointing at the file's own line numbers.
    """
    return f'// cuattn sources {sources_digest()}\n#line 1 "{filename}"\n{kernel_source(filename)}'


def cuda_include_options() -> list[str]:
    """`-I` options for the CUDA headers."""
    return [f"-I{d}" for d in cuda_include_dirs()]


def nvrtc_include_options() -> list[str]:
    """`-I` options for the kernel directory (for common/*.cuh) and the CUDA headers."""
    return [f"-I{kernel_dir()}", *cuda_include_options()]


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


def ptx_arch_option(compute_capability: int) -> str:
    """NVRTC option producing PTX for the virtual architecture of a device of compute capability
    ``major * 10 + minor`` (90 for an H100 -> `--gpu-architecture=compute_90`): the form jaxlib's
    kernel-launch custom call takes and compiles itself (cuattn/backends/xla.py)."""
    if isinstance(compute_capability, bool) or not isinstance(compute_capability, int):
        raise TypeError(f"compute_capability must be an int like 90, got {compute_capability!r}")
    if not 50 <= compute_capability < 1000:
        raise ValueError(f"compute_capability must look like 80 or 90, got {compute_capability}")
    return f"--gpu-architecture=compute_{compute_capability}"


def nvrtc_cubin(
    source: str, source_file: str, name_expressions: list[str] | tuple[str, ...], options: list[str]
) -> tuple[dict[str, str], bytes, str]:
    """({name expression: lowered name}, cubin, compiler log) of one NVRTC program holding every
    instantiation in ``name_expressions``; ``options`` must name the architecture (a cubin needs
    a real one: ``arch_option``). For the kernels CuPy cannot build (it compiles for the
    device's own architecture, and sm_90a's wgmma needs the 'a'), and for the static model.
    Raises RuntimeError with the log on a compile error."""
    from cupy_backends.cuda.libs import nvrtc

    program = nvrtc.createProgram(source, source_file, [], [])
    try:
        for name_expression in name_expressions:
            nvrtc.addNameExpression(program, name_expression)
        try:
            nvrtc.compileProgram(program, list(options))
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(program).rstrip("\x00")
            raise RuntimeError(f"{', '.join(name_expressions)}: {exc}\n{log}") from exc
        log = nvrtc.getProgramLog(program).rstrip("\x00")
        lowered = {name: nvrtc.getLoweredName(program, name) for name in name_expressions}
        return lowered, nvrtc.getCUBIN(program), log
    finally:
        nvrtc.destroyProgram(program)
