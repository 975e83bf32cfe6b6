import os

# One thread per math library in each test process, set before NumPy or torch load: the suite's
# workers already fill every core (pyproject's addopts), and libraries' own thread pools on top
# would spin and wait on each other for every tiny product the tests make.
for _variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")

import pytest  # noqa: E402


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
