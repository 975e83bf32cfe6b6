import pytest


def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


# Files that take minutes (the interpreter's grid of forward/backward cases at wide head dims,
# the NVRTC sweep of every instantiation, the rest of the grid), longest first: with one worker
# per core (pyproject's addopts) they start at once and the other files fill the gaps.
LONGEST_FILES = (
    "tests/backends/test_interp_kernels_wide.py",
    "tests/tools/test_compile_check.py",
    "tests/backends/test_interp_kernels.py",
)


def _rank(item: pytest.Item) -> int:
    path = item.nodeid.split("::")[0]
    return LONGEST_FILES.index(path) if path in LONGEST_FILES else len(LONGEST_FILES)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_rank)  # stable: every file keeps its own order
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
