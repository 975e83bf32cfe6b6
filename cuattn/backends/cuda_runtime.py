"""CUDA runtime: compile kernels/*.cu with cupy.RawModule, cache per device, launch on a stream.

One RawModule per (device, source file, options, name expression): each instantiation compiles
on first use only (seconds, not the minutes a whole file's instantiations take), and CuPy >= 14.2
keeps the cubin in its on-disk cache (~/.cupy/kernel_cache) keyed by source, options and name
expressions, so later processes load it without compiling. The architecture is the current
device's, chosen by CuPy.

Importing this module needs neither CuPy nor a GPU; the first launch does.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from cuattn.backends.kernels import LAYOUT_FIELDS
from cuattn.backends.toolchain import (
    CUPY_IMPLICIT_OPTIONS,
    arch_option,
    common_options,
    kernel_program,
    nvrtc_cubin,
)

if TYPE_CHECKING:
    import cupy

# Above this a kernel must opt in to more dynamic shared memory
# (cudaFuncAttributeMaxDynamicSharedMemorySize).
DEFAULT_DYNAMIC_SMEM_LIMIT = 48 * 1024
# Where NVRTC's cubins for an explicit architecture are kept (cubin_module); default
# ~/.cache/cuattn/cubin.
CUBIN_CACHE_ENV = "CUATTN_CUBIN_CACHE"
# First CuPy release whose disk cache keeps modules built with name_expressions.
MIN_CUPY_FOR_DISK_CACHE = (14, 2)


def cupy_module() -> Any:
    try:
        import cupy
    except ImportError as exc:
        raise RuntimeError(
            "the 'cuda' backend needs CuPy: pip install 'cuattn[cuda12]' (or [cuda13])"
        ) from exc
    return cupy


def why_no_cuda() -> str | None:
    """Why the cuda backend cannot run here, or None when CuPy imports and sees a CUDA device."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed"
    try:
        import cupy

        return None if cupy.cuda.runtime.getDeviceCount() > 0 else "no CUDA device"
    except Exception:  # no driver or no device
        return "no CUDA driver or device"


def device_arch_and_sms() -> tuple[str, int]:
    """(the architecture the kernels' geometry sizes for: "sm_90" from compute capability 9.0 up,
    else "sm_80"; the multiprocessor count) of the current CUDA device, read once a device."""
    return _arch_and_sms(cupy_module().cuda.runtime.getDevice())


def device_multiprocessors(device_id: int) -> int:
    """The multiprocessor count of CUDA device ``device_id``, read once a device."""
    return _arch_and_sms(device_id)[1]


@functools.cache
def _arch_and_sms(device_id: int) -> tuple[str, int]:
    device = cupy_module().cuda.Device(device_id)
    major = int(device.compute_capability[:-1])
    return ("sm_90" if major >= 9 else "sm_80"), int(device.attributes["MultiProcessorCount"])


def cuda_available() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    return why_no_cuda() is None


@dataclass(frozen=True)
class _ModuleKey:
    device: int
    source_file: str
    options: tuple[str, ...]
    name_expression: str


class KernelCache:
    """Compiled kernels, memoised per device; thread-safe."""

    def __init__(self) -> None:
        self._kernels: dict[_ModuleKey, Any] = {}
        # Largest dynamic shared memory each kernel has been opted in to.
        self._smem_opt_in: dict[_ModuleKey, int] = {}
        self._lock = threading.Lock()

    def kernel(
        self,
        source_file: str,
        name_expression: str,
        dynamic_smem_bytes: int = 0,
        extra_options: Sequence[str] = (),
        arch: str | None = None,
    ) -> Any:
        """The cupy.RawKernel for one instantiation on the current device, ready to launch
        with `dynamic_smem_bytes` of dynamic shared memory. ``arch`` None: CuPy compiles for
        the device's own architecture; else NVRTC builds a cubin for ``arch`` (sm_90a, which
        CuPy cannot ask for) and CuPy loads it (``cubin_module``)."""
        cupy = cupy_module()
        device = cupy.cuda.runtime.getDevice()
        options = (*common_options(), *extra_options)
        key = _ModuleKey(device, source_file, (*options, arch or ""), name_expression)
        with self._lock:
            kernel = self._kernels.get(key)
            if kernel is None:
                if arch is None:
                    module = cupy.RawModule(
                        code=kernel_program(source_file),
                        options=options,
                        name_expressions=[name_expression],
                    )
                    kernel = module.get_function(name_expression)  # compiles (or loads) here
                else:
                    module, lowered = cubin_module(source_file, name_expression, options, arch)
                    kernel = module.get_function(lowered)
                self._kernels[key] = kernel
            # The attribute is per function and per device (the key holds both).
            if dynamic_smem_bytes > max(DEFAULT_DYNAMIC_SMEM_LIMIT, self._smem_opt_in.get(key, 0)):
                kernel.max_dynamic_shared_size_bytes = dynamic_smem_bytes
                self._smem_opt_in[key] = dynamic_smem_bytes
        return kernel

    def clear(self) -> None:
        with self._lock:
            self._kernels.clear()
            self._smem_opt_in.clear()


KERNELS = KernelCache()


def cubin_cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cuattn" / "cubin"
    path = Path(os.environ.get(CUBIN_CACHE_ENV, default))
    path.mkdir(parents=True, exist_ok=True)
    return path


def cubin_module(
    source_file: str, name_expression: str, options: Sequence[str], arch: str
) -> tuple[Any, str]:
    """(cupy.RawModule, the kernel's lowered name) of one instantiation built by NVRTC for
    ``arch`` into a cubin, kept on disk under a key of the program text (which names the digest
    of every kernel source), the options and the name, as CuPy keys its own cache."""
    program = kernel_program(source_file)
    all_options = [arch_option(arch), *options, *CUPY_IMPLICIT_OPTIONS]
    key = hashlib.sha256("\n".join([program, *all_options, name_expression]).encode())
    stem = cubin_cache_dir() / f"{Path(source_file).stem}-{key.hexdigest()[:24]}"
    cubin_path, name_path = stem.with_suffix(".cubin"), stem.with_suffix(".name")
    if not (cubin_path.exists() and name_path.exists()):
        lowered, cubin, _ = nvrtc_cubin(program, source_file, [name_expression], all_options)
        for path, data in ((cubin_path, cubin), (name_path, lowered[name_expression].encode())):
            staged = path.with_suffix(f"{path.suffix}.{os.getpid()}.tmp")
            staged.write_bytes(data)
            os.replace(staged, path)  # atomic: concurrent processes never read half a file
    return cupy_module().RawModule(path=str(cubin_path)), name_path.read_text()


@dataclass(frozen=True)
class LayoutArrays:
    """A layout's index arrays on one device (int32 / uint32 CuPy arrays)."""

    row_ptr: cupy.ndarray
    col_idx: cupy.ndarray
    row_mask: cupy.ndarray
    col_ptr: cupy.ndarray
    row_idx: cupy.ndarray
    col_mask: cupy.ndarray
    mask_table: cupy.ndarray


_MIN_ELEMENTS = 1  # CuPy gives size-0 arrays a null pointer; kernels may still read one element


class LayoutDeviceCache:
    """Device copies of a layout's index arrays per (layout, device), freed with the layout."""

    def __init__(self) -> None:
        self._cache: weakref.WeakKeyDictionary[Any, dict[int, LayoutArrays]] = (
            weakref.WeakKeyDictionary()
        )
        self._lock = threading.Lock()

    def get(self, layout: Any) -> LayoutArrays:
        cupy = cupy_module()
        device = cupy.cuda.runtime.getDevice()
        with self._lock:
            per_device = self._cache.setdefault(layout, {})
            arrays = per_device.get(device)
            if arrays is None:
                arrays = LayoutArrays(
                    **{name: _to_device(cupy, getattr(layout, name)) for name in LAYOUT_FIELDS}
                )
                # The copies ran on this stream; later launches may be on another one.
                cupy.cuda.get_current_stream().synchronize()
                per_device[device] = arrays
        return arrays

    def clear(self) -> None:
        with self._lock:
            self._cache.clear()


def _to_device(cupy: Any, host: Any) -> Any:
    import numpy as np

    host = np.ascontiguousarray(host)
    if host.size < _MIN_ELEMENTS:
        host = np.zeros(_MIN_ELEMENTS, dtype=host.dtype)
    return cupy.asarray(host)


LAYOUTS = LayoutDeviceCache()


def _warm_one(source_file: str, name_expression: str, arch: str | None) -> str:
    """Compile one instantiation in this (worker) process; CuPy (or, for an explicit ``arch``,
    cubin_module) writes it to its disk cache."""
    KERNELS.kernel(source_file, name_expression, arch=arch)
    return name_expression


def warm_disk_cache(
    units: Sequence[tuple[str, str]],
    jobs: int,
    progress: TextIO | None = None,
    arch: str | None = None,
) -> None:
    """Compile (source file, name expression) pairs for the current GPU in `jobs` processes
    (``arch`` as KernelCache.kernel takes it: None for the device's own, "sm_90a" for the wgmma
    forward's cubins).

    A process compiles one NVRTC program at a time, so a test run or benchmark that needs
    hundreds of instantiations would spend minutes compiling them one by one; compiled here in
    parallel first, CuPy's on-disk cache (same source, options and name expression) serves them.
    """
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    cupy = cupy_module()
    version = tuple(int(part) for part in cupy.__version__.split(".")[:2] if part.isdigit())
    if version < MIN_CUPY_FOR_DISK_CACHE and progress is not None:
        progress.write(
            f"CuPy {cupy.__version__} keeps no templated module on disk (needs >= 14.2): "
            "every process will compile its kernels again\n"
        )

    # spawn, not fork: a forked child must not inherit the parent's CUDA context.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=jobs, mp_context=context) as pool:
        futures = [pool.submit(_warm_one, source, name, arch) for source, name in units]
        for done, future in enumerate(as_completed(futures), 1):
            name = future.result()
            if progress is not None:
                progress.write(f"[{done}/{len(futures)}] compiled {name}\n")
                progress.flush()
