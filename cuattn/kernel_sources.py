"""Where the .cu sources are: the package data of an installed wheel (the wheel maps the
top-level kernels/ to the package ``cuattn.kernels``), else the checkout's kernels/.

The one place that answers this for the CUDA runtime, the NVRTC compile check and the CPU
kernel interpreter.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
from pathlib import Path

KERNELS_PACKAGE = "cuattn.kernels"
_CHECKOUT_KERNELS = Path(__file__).resolve().parent.parent / "kernels"
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


def sources_digest(root: Path) -> str:
    """SHA-256 over every kernel source file under ``root`` (names and contents): the cache key
    part that makes any edit of a kernel or a header recompile (GPU modules, interpreter .so)."""
    digest = hashlib.sha256()
    for path in kernel_files(root):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
