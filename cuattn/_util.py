"""Small helpers every layer shares; nothing here imports another cuattn module."""

from __future__ import annotations

import sys
from types import ModuleType
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


def array_module(x: Any) -> ModuleType:
    """NumPy or CuPy: the module to compute on a NumPy or CuPy array with (the two kinds a
    backend is handed, adapters/dlpack.py), read off its type. A CuPy array means CuPy is
    imported already: nothing here imports it. The one place cuattn asks which array module
    to compute with."""
    return sys.modules["cupy"] if array_library(x) == "cupy" else np


def dtype_name(x: Any) -> str:
    """The NumPy name of a dtype, or of an array's or tensor's dtype, however it is spelled: a
    string ('float16', 'f2', 'half', 'torch.bfloat16'), a NumPy dtype or scalar type (np.float16,
    ml_dtypes.bfloat16, jnp.float32), a torch dtype, or an array. NumPy's own rules read all
    but torch's, which are named by their text; 'bfloat16' is read by name, as NumPy knows it
    only through ml_dtypes. The one place cuattn names dtypes; anything unreadable keeps its
    text, for the caller's error to quote."""
    if not isinstance(x, (str, type, np.dtype)) and hasattr(x, "shape") and hasattr(x, "dtype"):
        x = x.dtype
    text = str(x)
    if x is None:  # np.dtype(None) is float64; no dtype is never a default
        return text
    if array_library(x) == "torch" or text.startswith("torch."):
        return text.replace("torch.", "")
    if text == "bfloat16" or getattr(x, "__name__", None) == "bfloat16":
        return "bfloat16"
    try:
        return np.dtype(x).name
    except (TypeError, ValueError):
        return text


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
