"""Where the CUDA headers and the kernel sources live, for NVRTC (runtime and compile check).

NVRTC has no default include path: `#include <cuda_fp16.h>` only works when we pass `-I` for a
CUDA toolkit's include directory. We look in the places a pip/conda/system install puts it, in
the same order CuPy uses for NVRTC itself, so the headers match the compiler that reads them.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

from . import kernel_sources
from .kernel_sources import kernel_dir

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
def sources_digest() -> str:
    """SHA-256 over every kernel source and header (cached for the process)."""
    return kernel_sources.sources_digest(kernel_dir())


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
