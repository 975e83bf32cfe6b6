"""The CUDA runtime's CPU-checkable parts: source discovery (checkout and installed wheel), import
without CuPy, module memoisation per device and the dynamic shared-memory opt-in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from cuattn.backends import cuda_runtime as runtime
from cuattn.backends import toolchain
from cuattn.backends.geometry import (
    KERNEL_FILES,
    all_configs,
    decode_fp8_configs,
    decode_gqa_configs,
)
from cuattn.backends.toolchain import kernel_dir
from dev.compile_check import kernel_instantiations

REPO = Path(__file__).resolve().parents[2]


def test_kernel_sources_found_in_checkout():
    assert kernel_dir() == REPO / "kernels"
    for source_file in set(KERNEL_FILES.values()):
        assert "__global__" in toolchain.kernel_source(source_file)


def test_missing_kernel_file_names_what_exists():
    with pytest.raises(FileNotFoundError, match="attn_fwd.cu"):
        toolchain.kernel_source("no_such_kernel.cu")


def test_nvrtc_options_point_at_kernels_and_cuda_headers():
    options = toolchain.nvrtc_include_options()
    assert options[0] == f"-I{REPO / 'kernels'}"
    assert any((Path(o[2:]) / "cuda_fp16.h").is_file() for o in options[1:])


def test_compile_check_lists_every_instantiation_once():
    units = kernel_instantiations()
    listed = len(all_configs()) + len(decode_gqa_configs()) + len(decode_fp8_configs())
    assert len(units) == len(set(units)) == listed


def test_imports_and_reports_no_cuda_without_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None; sys.modules['cupy_backends'] = None\n"
        "import cuattn.backends.cuda_runtime as runtime, cuattn.backends.cuda as cuda\n"
        "import dev.compile_check, cuattn.tools.bench.run\n"
        "assert not runtime.cuda_available()\n"
        "assert cuda.CudaBackend.name == 'cuda'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


class _FakeKernel:
    def __init__(self) -> None:
        self.max_dynamic_shared_size_bytes = 0
        self.smem_settings: list[int] = []

    def __setattr__(self, name, value):
        if name == "max_dynamic_shared_size_bytes" and hasattr(self, "smem_settings"):
            self.smem_settings.append(value)
        object.__setattr__(self, name, value)


class _FakeCupy:
    """Just enough of CuPy for KernelCache: devices, RawModule construction, kernels."""

    def __init__(self) -> None:
        self.device = 0
        self.modules: list[dict] = []
        self.synchronized = 0
        stream = SimpleNamespace(synchronize=self._synchronize)
        self.cuda = SimpleNamespace(
            runtime=SimpleNamespace(getDevice=lambda: self.device),
            get_current_stream=lambda: stream,
        )

    def _synchronize(self) -> None:
        self.synchronized += 1

    def asarray(self, host):
        return ("device", self.device, host)

    def RawModule(self, code, options, name_expressions):  # noqa: N802 (CuPy's name)
        kernels: dict[str, _FakeKernel] = {}
        self.modules.append({"options": options, "names": name_expressions})
        return SimpleNamespace(get_function=lambda n: kernels.setdefault(n, _FakeKernel()))


def test_modules_memoised_per_device_and_smem_opt_in(monkeypatch):
    fake = _FakeCupy()
    monkeypatch.setattr(runtime, "cupy_module", lambda: fake)
    cache = runtime.KernelCache()
    name = "attn_fwd<64, 64, 64, 128, __half, MASK_CAUSAL>"
    small = cache.kernel("attn_fwd.cu", name, 16 * 1024)
    assert small.smem_settings == []  # under 48 KB nothing to opt in to
    big = cache.kernel("attn_fwd.cu", name, 80 * 1024)
    assert big is small and big.smem_settings == [80 * 1024]
    cache.kernel("attn_fwd.cu", name, 64 * 1024)  # already allowed more: no call
    assert big.smem_settings == [80 * 1024]
    assert len(fake.modules) == 1 and fake.modules[0]["names"] == [name]
    assert "--std=c++17" in fake.modules[0]["options"]
    fake.device = 1
    other = cache.kernel("attn_fwd.cu", name, 80 * 1024)
    assert other is not big and other.smem_settings == [80 * 1024]
    assert len(fake.modules) == 2


def test_program_text_changes_with_any_header_and_keeps_line_numbers(tmp_path, monkeypatch):
    """CuPy's disk cache keys on the source text only: a header edit must change that text."""
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options
    from dev.compile_check import CompileUnit, compile_unit

    (tmp_path / "common").mkdir()
    header = tmp_path / "common" / "h.cuh"
    header.write_text("#define VALUE 1\n")
    (tmp_path / "k.cu").write_text('#include "common/h.cuh"\n\n__global__ void k() { oops; }\n')
    monkeypatch.setattr(toolchain, "kernel_dir", lambda: tmp_path)
    toolchain.sources_digest.cache_clear()
    before = toolchain.kernel_program("k.cu")
    header.write_text("#define VALUE 2\n")
    toolchain.sources_digest.cache_clear()
    after = toolchain.kernel_program("k.cu")
    toolchain.sources_digest.cache_clear()
    assert before != after and before.endswith(toolchain.kernel_source("k.cu"))
    options = (*common_options(with_kernel_dir=False), f"-I{tmp_path}")
    result = compile_unit(after, CompileUnit("k.cu", "k"), "sm_80", options)
    assert result.error is not None and "k.cu(3)" in result.error


def test_layout_arrays_cached_per_layout_and_device(monkeypatch):
    import gc

    import cuattn

    fake = _FakeCupy()
    monkeypatch.setattr(runtime, "cupy_module", lambda: fake)
    cache = runtime.LayoutDeviceCache()
    # Built directly: make_layout's own cache would keep the layout alive.
    layout = cuattn.Layout.from_blocks(np.tril(np.ones((2, 4, 4), dtype=bool)), 16)
    arrays = cache.get(layout)
    assert cache.get(layout) is arrays and fake.synchronized == 1
    where, device, host = arrays.col_idx
    assert (where, device) == ("device", 0) and (host == layout.col_idx).all()
    assert arrays.mask_table[2].size == 1  # empty table padded: kernels get a real pointer
    fake.device = 1
    other = cache.get(layout)
    assert other is not arrays and other.row_ptr[1] == 1
    del layout, arrays, other
    gc.collect()
    assert len(cache._cache) == 0
