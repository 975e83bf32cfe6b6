"""Route one attention call to the right path for the caller's arrays.

* ``cuattn.Tensor``                     -> the tape op (cuattn.ops.sparse_attention)
* torch tensor requiring grad           -> torch.autograd.Function (cuattn.torch)
* jax array (eager or traced)           -> jax.custom_vjp (cuattn.jax)
* NumPy, CuPy, torch without grad, any other __dlpack__ producer -> compute and hand back
  the caller's own type on the caller's device, sharing memory (other producers get NumPy/CuPy).
Arguments are validated (shapes, dtypes, layout) by the public API before they get here.
"""

from __future__ import annotations

import sys
from typing import Any

from . import backend as _backend
from . import interop
from .layout import Layout
from .tape import Tensor

__all__ = ["sparse_attention"]


def _requires_torch_grad(xs: tuple[Any, ...]) -> bool:
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and torch.is_grad_enabled()
        and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)
    )


def _tape_args(q: Any, k: Any, v: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Tensors as they are; raw arrays beside them become constants of the same array library."""
    first = next(x for x in (q, k, v) if isinstance(x, Tensor))
    xp = first.xp
    out = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            if type(x).__module__.split(".")[0] != xp.__name__:
                raise TypeError(
                    f"{name} is a {type(x).__module__}.{type(x).__name__} but another argument "
                    f"is a cuattn.Tensor over {xp.__name__}; wrap it as cuattn.Tensor or pass "
                    "arrays of the same library"
                )
            x = Tensor(x)
        out.append(x)
    return tuple(out)


def sparse_attention(
    q: Any,
    k: Any,
    v: Any,
    layout: Layout,
    scale: float,
    recompute: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
    deterministic: bool = False,
) -> Any:
    """Attention on [batch, heads, time, head_dim] arrays of any supported kind; see module doc."""
    xs = (q, k, v)
    extra = {"backend": backend, "deterministic": deterministic}
    if any(isinstance(x, Tensor) for x in xs):
        from . import ops

        return ops.sparse_attention(
            *_tape_args(q, k, v), layout, scale, recompute, return_lse, **extra
        )
    info = interop.common_info({"q": q, "k": k, "v": v})
    if info.framework == "torch" and _requires_torch_grad(xs):
        from . import torch as torch_adapter

        return torch_adapter.sparse_attention(
            q, k, v, layout, scale, recompute, return_lse, **extra
        )
    if info.framework == "jax":
        from . import jax as jax_adapter

        return jax_adapter.sparse_attention(q, k, v, layout, scale, recompute, return_lse, **extra)
    # No gradient is wanted, so recompute has nothing to save and is ignored.
    with interop.stream_for(info):
        arrays = [interop.to_backend(x, info, n) for n, x in (("q", q), ("k", k), ("v", v))]
        out, lse = _backend.forward(*arrays, layout, scale, backend)
        out = interop.from_backend(out, info)
        return (out, interop.from_backend(lse, info)) if return_lse else out
