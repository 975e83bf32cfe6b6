"""The wide head dims (WIDE_HEAD_DIM and up) of the interpreter's instantiation grid: every
block x dtype x rule, forward and backward, against the float64 oracle (the rest of the grid and
its helpers: test_interp_kernels.py). Its own file so that a second test worker takes it."""

from __future__ import annotations

import pytest

from cuattn.backends import geometry, interp
from tests.backends.test_interp_kernels import (
    WIDE_HEAD_DIM,
    check_kernel_traits,
    is_plain,
    is_wide,
    run_forward_backward,
)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Compile this file's kernel libraries up front, every core at once (a no-op once cached)."""
    interp.prepare(c for c in geometry.all_configs() if is_wide(c) and is_plain(c))


@pytest.mark.parametrize("rule", geometry.RULES)
@pytest.mark.parametrize("dtype", geometry.DTYPES)
@pytest.mark.parametrize("head_dim", [d for d in geometry.HEAD_DIMS if d >= WIDE_HEAD_DIM])
@pytest.mark.parametrize("block", geometry.BLOCK_SIZES)
def test_forward_backward(block, head_dim, dtype, rule):
    run_forward_backward(block, head_dim, dtype, rule)


def test_launch_geometry_matches_kernel_traits():
    check_kernel_traits(c for c in geometry.all_configs() if is_wide(c) and is_plain(c))
