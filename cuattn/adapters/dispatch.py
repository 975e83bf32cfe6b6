"""Route one attention call to the right path for the caller's arrays.

* ``cuattn.Tensor``                     -> the tape op (autograd/attention.py attend)
* torch tensors (with or without grad)  -> the cuattn:: torch custom ops (adapters/torch_ops.py),
                                          which torch.compile traces without a graph break
* jax array (eager or traced)           -> jax.custom_vjp (adapters/jax_vjp.py)
* NumPy, CuPy, any other __dlpack__ producer -> compute and hand back
  the caller's own type on the caller's device, sharing memory (other producers get NumPy/CuPy).
Arguments are validated (shapes, dtypes, layout) by the public API before they get here; the
call's options travel as one AttentionCall (cuattn/backends/call.py).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, TypeVar

from cuattn import backends as _backend
from cuattn._util import array_library
from cuattn.adapters import dlpack
from cuattn.autograd.tape import Tensor
from cuattn.backends.call import AttentionCall

__all__ = ["outside_graph", "route"]

T = TypeVar("T")


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
            if array_library(x) != xp.__name__:
                raise TypeError(
                    f"{name} is a {type(x).__module__}.{type(x).__name__} but another argument "
                    f"is a cuattn.Tensor over {xp.__name__}; wrap it as cuattn.Tensor or pass "
                    "arrays of the same library"
                )
            x = Tensor(x)
        out.append(x)
    return tuple(out)


def _all_torch(xs: tuple[Any, ...]) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and all(isinstance(x, torch.Tensor) for x in xs)


def route(q: Any, k: Any, v: Any, call: AttentionCall) -> Any:
    """Attention on [batch, heads, time, head_dim] arrays of any supported kind; see module doc.
    A Pattern is built into its Layout for q's and k's lengths here, except on the torch route,
    whose ops take the pattern's key and build it inside (lengths may be symbolic there)."""
    xs = (q, k, v)
    if _all_torch(xs):
        from cuattn.adapters import torch_ops

        return torch_ops.attend(q, k, v, call)
    call = call.for_lengths(int(q.shape[2]), int(k.shape[2]))
    if any(isinstance(x, Tensor) for x in xs):
        from cuattn.autograd import attention

        return attention.attend(*_tape_args(q, k, v), call)
    info = dlpack.common_info({"q": q, "k": k, "v": v})
    if info.framework == "jax":
        from cuattn.adapters import jax_vjp as jax_adapter

        return jax_adapter.attend(q, k, v, call)
    # No gradient is wanted, so recompute has nothing to save and is ignored.
    named = {"q": q, "k": k, "v": v}
    out, lse = dlpack.call(_backend.forward, named, call.layout, call.scale, call.backend)
    return (out, lse) if call.return_lse else out


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
