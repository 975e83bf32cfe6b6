"""The old import path of the tape's ops (also ``cuattn.ops``), kept for one release.

Every name it held still resolves, with a ``DeprecationWarning`` naming its new place: the
attention op is :mod:`cuattn.autograd.attention`; the arithmetic is ``Tensor``'s own (``add``
is ``a + b``, ``sum`` is ``t.sum()``, ...; the Functions behind it are in
:mod:`cuattn.autograd.tape`); the other transformer ops went with the demo model that uses them,
to :mod:`cuattn.tools.tinylm_ops`.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

_ATTENTION = "cuattn.autograd.attention"
_TAPE = "cuattn.autograd.tape"
_DEMO = "cuattn.tools.tinylm_ops"

# old name -> (module it moved to, its name there: "Tensor.<method>" for the arithmetic)
_MOVED = {
    "attend": (_ATTENTION, "attend"),
    "SparseAttention": (_ATTENTION, "SparseAttention"),
    "add": (_TAPE, "Tensor.__add__"),
    "sub": (_TAPE, "Tensor.__sub__"),
    "mul": (_TAPE, "Tensor.__mul__"),
    "div": (_TAPE, "Tensor.__truediv__"),
    "matmul": (_TAPE, "Tensor.__matmul__"),
    "sum": (_TAPE, "Tensor.sum"),
    "mean": (_TAPE, "Tensor.mean"),
    "reshape": (_TAPE, "Tensor.reshape"),
    "transpose": (_TAPE, "Tensor.transpose"),
    **{
        name: (_TAPE, name)
        for name in ("Add", "Sub", "Mul", "Div", "MatMul", "Sum", "Reshape", "Transpose")
    },
    **{
        name: (_DEMO, name)
        for name in (
            "softmax",
            "gelu",
            "layer_norm",
            "cross_entropy",
            "embedding",
            "split_heads",
            "merge_heads",
            "Softmax",
            "Gelu",
            "LayerNorm",
            "CrossEntropy",
            "Embedding",
            "SplitHeads",
            "MergeHeads",
            "GELU_C",
            "GELU_K",
        )
    },
}


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, path = _MOVED[name]
    warnings.warn(
        f"{__name__}.{name} is deprecated and will be removed in the next release; "
        f"use {module}.{path} instead",
        DeprecationWarning,
        stacklevel=2,
    )
    value: Any = importlib.import_module(module)
    for part in path.split("."):
        value = getattr(value, part)
    return value
