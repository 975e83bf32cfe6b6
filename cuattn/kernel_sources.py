"""Where the .cu sources are: the top-level kernels/ of a checkout, or the package data of an
installed wheel (the wheel maps kernels/ to the package ``cuattn.kernels``)."""

from __future__ import annotations

import importlib.resources
from pathlib import Path

_CHECKOUT_KERNELS = Path(__file__).resolve().parent.parent / "kernels"


def kernel_dir() -> Path:
    """The directory holding kernels/*.cu, common/*.cuh and interp/ (checkout first)."""
    if _CHECKOUT_KERNELS.is_dir():
        return _CHECKOUT_KERNELS
    installed = Path(str(importlib.resources.files("cuattn.kernels")))
    if installed.is_dir():
        return installed
    raise FileNotFoundError(
        f"cuattn's kernel sources are missing: looked in {_CHECKOUT_KERNELS} and in the "
        "installed package cuattn.kernels; reinstall cuattn"
    )


def kernel_files() -> list[Path]:
    """Every kernel source file (*.cu, *.cuh, interp shim headers), sorted."""
    root = kernel_dir()
    return sorted(p for p in root.rglob("*") if p.suffix in (".cu", ".cuh", ".h", ".hpp"))
