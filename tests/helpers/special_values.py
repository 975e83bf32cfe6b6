"""One comparison for the special-value contract (docs/design.md): NaN and +-inf exactly where
the float64 oracle has them, the finite elements close."""

from __future__ import annotations

import numpy as np


def assert_same(name, got, want, tol, dtype=np.float64):
    """NaN where want is NaN, +-inf where it is, and the finite elements close (within a few
    subnormal steps of dtype, which subnormal results lose)."""
    got = np.asarray(got, dtype=np.float64)
    assert got.shape == want.shape, name
    for what, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        wrong = test(got) != test(want)
        assert not wrong.any(), (
            f"{name}: {what} differs at {np.argwhere(wrong)[:6].tolist()} "
            f"({int(wrong.sum())} elements); got {got[wrong][:4]}, want {want[wrong][:4]}"
        )
    finite = np.isfinite(want)
    g, w = got[finite], want[finite]
    if w.any() and np.isfinite(tol):
        # relative to each element and to the array's typical nonzero size (a gradient that is
        # exactly 0 comes out as rounding noise of that size)
        typical = np.median(np.abs(w[w != 0]))
        bound = tol * (np.abs(w) + typical) + 64 * np.finfo(dtype).smallest_subnormal
        worst = np.argmax(np.abs(g - w) - bound)
        assert np.all(np.abs(g - w) <= bound), f"{name}: got {g[worst]}, want {w[worst]}"
    elif not w.any():
        assert np.all(np.abs(g) <= 64 * np.finfo(dtype).smallest_subnormal), f"{name}: not 0"
