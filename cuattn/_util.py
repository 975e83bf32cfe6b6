"""Small helpers every layer shares; nothing here imports another cuattn module."""

from __future__ import annotations

from typing import Any

import numpy as np

BFLOAT16_SHIFT = 16  # a bfloat16's bits are the high 16 bits of the float32 it stands for


def array_library(x: Any) -> str:
    """The library an array, tensor or dtype comes from, read off its type: "numpy", "cupy",
    "torch", "jax" (jaxlib's arrays too), else its module's top-level name. The one place
    cuattn tells frameworks apart by type (cuattn.adapters.dlpack.describe builds on it).
    Every ``np.dtype`` is NumPy's, whoever defined its class: ml_dtypes >= 0.7 gives bfloat16
    and the float8s dtype classes of its own module."""
    if isinstance(x, np.dtype):
        return "numpy"
    root = type(x).__module__.split(".")[0]
    return "jax" if root == "jaxlib" else root


def dtype_name(x: Any) -> str:
    """The NumPy name of an array's dtype (torch's without its "torch." prefix)."""
    return str(x.dtype).replace("torch.", "")


def dims(x: Any) -> tuple:
    """x's shape as a tuple; torch's stays as it is, so that torch.compile keeps a dynamic
    length symbolic (int() would specialise the compiled graph to one length)."""
    if isinstance(x.shape, tuple):
        return tuple(x.shape)
    return tuple(int(d) for d in x.shape)


def ceil_div(a: Any, b: int) -> Any:
    """ceil(a / b) in exact integer arithmetic, for an int or an integer array a >= 0 and an
    int b > 0."""
    return -(-a // b)


def one_line(exc: BaseException, limit: int) -> str:
    """``Type: message`` of an exception on one line, cut to ``limit`` characters (for reports
    and one-line error messages; some libraries raise multi-page messages)."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


def widened(x: Any, xp: Any) -> Any:
    """x in float32 (float64 stays float64), on its array module ``xp`` (NumPy or CuPy).
    bfloat16 is widened through its bits (exact: a bfloat16 is the high half of a float32), so
    CuPy needs no bfloat16 arithmetic, which it may lack."""
    if x.dtype == xp.float64:
        return x
    if np.dtype(x.dtype).name == "bfloat16":
        return (x.view(xp.uint16).astype(xp.uint32) << BFLOAT16_SHIFT).view(xp.float32)
    return x.astype(xp.float32)


def host_array(x: Any) -> np.ndarray:
    """x as a NumPy array: a CuPy array copied to the host (a synchronisation, so only where
    the host is asked for), anything else as np.asarray gives it."""
    return np.asarray(x.get() if hasattr(x, "get") else x)


def stable_kind(xp: Any) -> dict[str, str]:
    """The keywords that make ``xp.argsort`` stable: CuPy's sorts always are and take no
    ``kind``; NumPy (or anything standing in for it) is asked."""
    return {} if xp.__name__ == "cupy" else {"kind": "stable"}
