"""What the public calls ask about the caller's arrays across routes: whether a gradient is
wanted, whether torch.compile is tracing, raw arrays beside tape Tensors, and the differentiable
merge of two partial attentions. The route of one attention call itself is ``cuattn.api``'s
last step (``_route``), so a warm call goes from the API straight to its route's adapter.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

from cuattn import backends as _backend
from cuattn._util import array_library
from cuattn.adapters import dlpack
from cuattn.autograd.tape import Tensor

__all__ = ["merge_states", "outside_graph", "tape_args", "wants_gradient"]

T = TypeVar("T")


def _requires_torch_grad(xs: tuple[Any, ...]) -> bool:
    torch = sys.modules.get("torch")
    return (
        torch is not None
        and torch.is_grad_enabled()
        and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)
    )


def tape_args(q: Any, k: Any, v: Any) -> tuple[Tensor, Tensor, Tensor]:
    """Tensors as they are; raw arrays beside them become constants of the same array library."""
    first = next(x for x in (q, k, v) if isinstance(x, Tensor))
    xp = first.xp
    out = []
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor):
            if array_library(x) != xp.__name__:
                raise TypeError(
                    f"{name} is a {type(x).__module__}.{type(x).__name__} but another argument "
                    f"is a cuattn.Tensor over {xp.__name__}; wrap it as cuattn.Tensor or pass "
                    "arrays of the same library"
                )
            x = Tensor(x)
        out.append(x)
    return tuple(out)


def outside_graph(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, run outside any graph torch.compile is tracing (a graph break there):
    for host work on a call's metadata (a varlen call's packed layout from cu_seqlens), which
    dynamo would otherwise trace into NumPy code it cannot follow. Plain call otherwise."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.compiler.is_compiling():
        return torch.compiler.disable(fn)(*args)
    return fn(*args)


def wants_gradient(xs: Any) -> bool:
    """Whether a gradient is asked of these arrays: torch tensors requiring grad (with grad
    enabled) or jax tracers (inside jit/grad/vmap)."""
    xs = tuple(xs)
    return _requires_torch_grad(xs) or any(dlpack.is_jax_tracer(x) for x in xs)


def merge_states(arrays: dict[str, Any], backend: str | None) -> tuple[Any, Any]:
    """merge_attention_states on any framework's arrays, handed back as the caller's type."""
    return dlpack.call(_backend.merge_states, arrays, backend)
