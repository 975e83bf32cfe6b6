"""CPU kernel interpreter backend: runs the very same kernels/*.cu sources on the CPU.

Each kernel file is compiled with g++ together with the shim in kernels/interp/ (docs/design.md
§5) into a shared library, one per (file, dtype, head dim) group so that a handful of
compiler runs cover every instantiation. Libraries are cached on disk, keyed by a hash of every
kernel source, the generated entry code, the flags and the compiler version. Launches go through
ctypes with the grid, block and shared-memory size of backends/geometry.py, exactly as the
GPU launch; before each launch the Python geometry is checked against the kernel's own C++ traits.

Select it with backend="interp" or CUATTN_BACKEND=interp. Slow (every CUDA thread is a fiber on
one host thread, every mma is emulated lane by lane), meant for debugging and CI on small shapes.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from cuattn.backends import geometry
from cuattn.backends.geometry import KernelConfig, LayoutKernelConfig
from cuattn.backends.kernels import LAYOUT_FIELDS, KernelBackend
from cuattn.backends.toolchain import kernel_dir, sources_digest

CXX = os.environ.get("CXX", "g++")
CXX_FLAGS = ("-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-DCUATTN_INTERP=1")
ENTRY_PREFIX = "cuattn_launch_"
# cuattn_interp::LaunchStatus in kernels/interp/cuda_shim.h
LAUNCH_MISALIGNED = 3
LAUNCH_DEADLOCK = 4
LAUNCH_HAZARD = 5
ERROR_SYMBOL = "cuattn_interp_error"  # what failed a DEADLOCK or HAZARD launch
TRAITS_PREFIX = "cuattn_traits_"


def cache_dir() -> Path:
    default = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cuattn" / "interp"
    path = Path(os.environ.get("CUATTN_INTERP_CACHE", default))
    path.mkdir(parents=True, exist_ok=True)
    return path


@functools.cache
def _compiler_version() -> str:
    # once per process: a subprocess per launch cost ~30 ms, more than most test launches
    result = subprocess.run([CXX, "--version"], capture_output=True, text=True, check=True)
    return result.stdout.splitlines()[0]


class Library:
    """One compiled shared library: launch entries and traits probes by name expression."""

    def __init__(self, path: Path, expressions: Sequence[str], traits: Sequence[str | None]):
        self._lib = ctypes.CDLL(str(path))
        self.path = path
        self._entries: dict[str, Any] = {}
        self._traits: dict[str, tuple[int, int] | None] = {}
        for i, (expression, traits_expression) in enumerate(zip(expressions, traits, strict=True)):
            entry = getattr(self._lib, f"{ENTRY_PREFIX}{i}")
            entry.restype = ctypes.c_int
            entry.argtypes = [
                ctypes.POINTER(ctypes.c_uint),
                ctypes.POINTER(ctypes.c_uint),
                ctypes.c_size_t,
                ctypes.POINTER(ctypes.c_void_p),
            ]
            self._entries[expression] = entry
            self._traits[expression] = None
            if traits_expression is not None:
                probe = getattr(self._lib, f"{TRAITS_PREFIX}{i}")
                probe.restype = None
                probe.argtypes = [ctypes.POINTER(ctypes.c_longlong)]
                out = (ctypes.c_longlong * 2)()
                probe(out)
                self._traits[expression] = (int(out[0]), int(out[1]))

    def traits(self, expression: str) -> tuple[int, int] | None:
        """(threads, dynamic shared-memory bytes) the kernel itself expects."""
        return self._traits[expression]

    def launch(
        self,
        expression: str,
        grid: Sequence[int],
        block: Sequence[int],
        smem_bytes: int,
        args: Sequence[Any],
    ) -> None:
        """Launch with cuLaunchKernel-style arguments (ctypes values, one per kernel parameter)."""
        grid_c = (ctypes.c_uint * 3)(*grid)
        block_c = (ctypes.c_uint * 3)(*block)
        pointers = (ctypes.c_void_p * max(len(args), 1))(
            *[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args]
        )
        status = self._entries[expression](grid_c, block_c, smem_bytes, pointers)
        if status == LAUNCH_MISALIGNED:
            raise RuntimeError(
                f"interpreter launch of {expression}: a cp.async, ldmatrix or paired store used "
                "an address that is not aligned to its size; a GPU would fault on it"
            )
        if status in (LAUNCH_DEADLOCK, LAUNCH_HAZARD):
            error = getattr(self._lib, ERROR_SYMBOL)
            error.restype = ctypes.c_char_p
            what = "a GPU would hang" if status == LAUNCH_DEADLOCK else "a GPU would not say so"
            raise RuntimeError(f"interpreter launch of {expression}: {error().decode()}; {what}")
        if status != 0:
            raise RuntimeError(f"interpreter launch of {expression} failed with status {status}")


_libraries: dict[str, Library] = {}
_lock = threading.Lock()


def build_library(
    source: str | Path,
    expressions: Sequence[str],
    traits: Sequence[str | None] | None = None,
    include_dirs: Iterable[Path] = (),
    defines: Iterable[str] = (),
) -> Library:
    """Compile (or fetch from the cache) one library exporting every expression of `source`.

    `source` is a kernel file name relative to kernels/ or an absolute path (tests use their own
    kernel files). `traits`, aligned with `expressions`, names a traits struct with NUM_THREADS and
    SMEM_BYTES per kernel (or None).
    """
    root = kernel_dir()
    source_path = Path(source) if Path(source).is_absolute() else root / source
    traits = list(traits) if traits is not None else [None] * len(expressions)
    lines = ['#include "interp/cuda_shim.h"', f'#include "{source_path}"']
    for i, (expression, traits_expression) in enumerate(zip(expressions, traits, strict=True)):
        lines.append(f"CUATTN_INTERP_ENTRY({ENTRY_PREFIX}{i}, {expression})")
        if traits_expression is not None:
            lines.append(
                f'extern "C" void {TRAITS_PREFIX}{i}(long long* out) {{ '
                f"out[0] = {traits_expression}::NUM_THREADS; "
                f"out[1] = {traits_expression}::SMEM_BYTES; }}"
            )
    code = "\n".join(lines) + "\n"
    includes = [root, *include_dirs]
    flags = [*CXX_FLAGS, *[f"-D{d}" for d in defines], *[f"-I{path}" for path in includes]]
    key = hashlib.sha256()
    for part in (code, " ".join(flags), _compiler_version(), sources_digest(root)):
        key.update(part.encode())
    if source_path.parent != root:
        key.update(source_path.read_bytes())
    digest = key.hexdigest()[:24]
    with _lock:
        if digest in _libraries:
            return _libraries[digest]
    target = cache_dir() / f"{source_path.stem}-{digest}.so"
    if not target.exists():
        with tempfile.TemporaryDirectory(prefix="cuattn-interp-") as tmp:
            cpp = Path(tmp) / "entries.cpp"
            cpp.write_text(code)
            built = Path(tmp) / "lib.so"
            result = subprocess.run(
                [CXX, *flags, str(cpp), "-o", str(built)], capture_output=True, text=True
            )
            if result.returncode != 0:
                raise RuntimeError(f"g++ failed on {source_path.name}:\n{result.stderr[-20000:]}")
            staged = target.with_suffix(f".{os.getpid()}.tmp")
            shutil.copyfile(built, staged)
            os.replace(staged, target)  # atomic: concurrent builders never see half a library
    library = Library(target, expressions, traits)
    with _lock:
        _libraries[digest] = library
    return library


# ---- kernel groups -------------------------------------------------------------------------


def _group_configs(group: tuple) -> list[KernelConfig | LayoutKernelConfig]:
    every = (
        *geometry.all_configs(),
        *geometry.sm90_configs(),
        *geometry.sm90_persistent_configs(),
        *geometry.sm90_backward_configs(),
        *geometry.sm90_backward_configs(geometry.SM90_BWD_PERSISTENT),
        *geometry.decode_gqa_configs(),
        *geometry.decode_fp8_configs(),
    )
    return [c for c in every if c.group == group]


_group_libraries: dict[tuple, Library] = {}


def library_for(config: KernelConfig | LayoutKernelConfig) -> Library:
    """The library holding `config`'s instantiation (all blocks and rules of its file/dtype/dim).

    Looked up once per group and process: building the whole config table and hashing the
    entry code again at every launch cost more than a small launch itself. (Kernel sources are
    read once per process for the cache key too: toolchain.sources_digest.)"""
    library = _group_libraries.get(config.group)
    if library is None:
        members = _group_configs(config.group)
        library = build_library(
            config.source_file,
            [c.name_expression for c in members],
            [c.traits_expression for c in members],
        )
        _group_libraries[config.group] = library
    return library


def prepare(configs: Iterable[KernelConfig], jobs: int | None = None) -> None:
    """Compile the libraries these configs need, several compiler runs in parallel."""
    keys = {c.group: c for c in configs}
    with ThreadPoolExecutor(max_workers=jobs or os.cpu_count() or 1) as pool:
        list(pool.map(library_for, keys.values()))


def _ctype_args(config: KernelConfig | LayoutKernelConfig, values: dict[str, Any]) -> list[Any]:
    args: list[Any] = []
    for name, kind in config.args:
        value = values[name]
        if kind == "ptr":
            # rows contiguous; the other axes may be strided (their strides are arguments too)
            assert isinstance(value, np.ndarray), name
            # (a last axis of length 1 may carry any stride: NumPy leaves it free)
            assert value.size <= 1 or value.shape[-1] == 1 or value.strides[-1] == value.itemsize, (
                name
            )
            args.append(ctypes.c_void_p(value.ctypes.data))
        elif kind == "tmap":
            args.append(value.interp_struct())  # a tensor_map.TensorMap
        elif kind == "i32":
            args.append(ctypes.c_int32(int(value)))
        elif kind == "i64":
            args.append(ctypes.c_int64(int(value)))
        elif kind == "f64":
            args.append(ctypes.c_double(float(value)))
        else:
            args.append(ctypes.c_float(float(value)))
    return args


def launch(config: KernelConfig | LayoutKernelConfig, **values: Any) -> None:
    """Run one kernel launch on the CPU; `values` names every kernel argument."""
    library = library_for(config)
    expected = library.traits(config.name_expression)
    assert expected == (config.threads, config.smem_bytes), (
        f"{config.name_expression}: geometry says (threads, smem) = "
        f"{(config.threads, config.smem_bytes)}, the kernel's traits say {expected}"
    )
    library.launch(
        config.name_expression,
        config.grid,
        config.block_dims,
        config.smem_bytes,
        _ctype_args(config, values),
    )


# ---- the backend ---------------------------------------------------------------------------


class InterpBackend(KernelBackend):
    """The kernels on the CPU: NumPy arrays in and out, outputs poisoned with NaN before launch
    so an element a kernel fails to write cannot pass for a result."""

    name = "interp"
    array_kind = "NumPy arrays"

    @property
    def xp(self) -> Any:
        return np

    def is_array(self, x: Any) -> bool:
        return isinstance(x, np.ndarray)

    def data_address(self, x: Any) -> int:
        return int(x.ctypes.data)

    def output(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        return np.full(shape, np.nan, dtype=dtype)

    def index_arrays(self, layout: Any) -> SimpleNamespace:
        fields = {name: np.ascontiguousarray(getattr(layout, name)) for name in LAYOUT_FIELDS}
        if not fields["mask_table"].size:
            fields["mask_table"] = np.zeros(1, np.uint32)  # the kernels take a valid pointer
        return SimpleNamespace(**fields)

    def launch(self, config: KernelConfig, **values: Any) -> None:
        launch(config, **values)

    def runs_sm90a(self, x: Any) -> bool:
        return True  # the interpreter emulates wgmma, TMA and mbarriers (kernels/interp/)


backend = InterpBackend()
forward = backend.forward
backward = backend.backward
