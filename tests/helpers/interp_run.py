"""One launch of a test kernel through the CPU interpreter, shared by the primitive tests."""

from __future__ import annotations

import ctypes

import numpy as np

from cuattn.backends import interp


def run(lib: interp.Library, expression: str, grid: int, block: int, *args, smem: int = 0):
    """Launch `expression` on a 1-D grid: arrays pass as pointers, ctypes values (a tensor map)
    as they are, anything else as a 32-bit int."""
    values = []
    for arg in args:
        if isinstance(arg, np.ndarray):
            values.append(ctypes.c_void_p(arg.ctypes.data))
        elif isinstance(arg, ctypes.Structure | ctypes._SimpleCData):
            values.append(arg)
        else:
            values.append(ctypes.c_int32(arg))
    lib.launch(expression, (grid, 1, 1), (block, 1, 1), smem, values)
