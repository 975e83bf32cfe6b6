"""jax adapter: block-sparse attention as a ``jax.custom_vjp`` function.

Eager jax arrays (not traced) go to the backend through DLPack with no copies: CPU arrays to
the NumPy backend, GPU arrays to the CuPy kernels; ``jax.grad`` works through the custom VJP.

Under ``jax.jit`` (or any transformation that traces: vmap, scan, ...) there is no buffer to
share, so on the CPU the forward and backward run through ``jax.pure_callback``: correct and
differentiable (first order; the callback has no derivative of its own), but XLA copies the
arguments and results across the callback boundary and cannot fuse around it; ``vmap`` runs the
callback once per mapped element. On a GPU a traced call raises ``NotImplementedError``:
pure_callback would silently round-trip through host memory, and a proper path needs an XLA
FFI custom call (not built yet). Call cuattn outside ``jit`` on GPU for now.
The log-sum-exp side output is treated as a constant (its cotangent is ignored).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cuattn import backends as _backend
from cuattn.adapters import dlpack
from cuattn.layout.layout import Layout

__all__ = ["attend"]


def _lse_dtype(dtype: Any) -> Any:
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _traced(*xs: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def _require_cpu() -> None:
    if jax.default_backend() != "cpu":
        raise NotImplementedError(
            "cuattn under jax.jit on a GPU is not supported yet: it would need an XLA FFI "
            "custom call, and jax.pure_callback would copy through host memory. Call "
            "cuattn.sparse_attention outside jit (eager), or on the CPU backend."
        )


def _host_forward(layout: Layout, scale: float, backend: str | None, q, k, v):
    out, lse = _backend.forward(np.asarray(q), np.asarray(k), np.asarray(v), layout, scale, backend)
    return out, lse


def _host_backward(layout, scale, backend, deterministic, q, k, v, out, lse, dout):
    arrays = [np.asarray(x) for x in (q, k, v, out, lse, dout)]
    return _backend.backward(*arrays, layout, scale, backend, deterministic)


def _forward(q, k, v, layout: Layout, scale: float, backend: str | None):
    if _traced(q, k, v):
        _require_cpu()
        shapes = (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(q.shape[:3], _lse_dtype(q.dtype)),
        )
        host = functools.partial(_host_forward, layout, scale, backend)
        return jax.pure_callback(host, shapes, q, k, v, vmap_method="sequential")
    return dlpack.call(_backend.forward, {"q": q, "k": k, "v": v}, layout, scale, backend)


def _backward(q, k, v, out, lse, dout, layout, scale, backend, deterministic):
    named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout}
    if _traced(*named.values()):
        _require_cpu()
        shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v))
        host = functools.partial(_host_backward, layout, scale, backend, deterministic)
        return jax.pure_callback(host, shapes, *named.values(), vmap_method="sequential")
    return dlpack.call(_backend.backward, named, layout, scale, backend, deterministic)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _attention(q, k, v, layout, scale, recompute, backend, deterministic):
    return _forward(q, k, v, layout, scale, backend)


def _attention_fwd(q, k, v, layout, scale, recompute, backend, deterministic):
    out, lse = _forward(q, k, v, layout, scale, backend)
    residuals = (q, k, v) if recompute else (q, k, v, out, lse)
    return (out, lse), residuals


def _attention_bwd(layout, scale, recompute, backend, deterministic, residuals, cotangents):
    dout, _ = cotangents  # lse is a constant side output
    if recompute:
        q, k, v = residuals
        out, lse = _forward(q, k, v, layout, scale, backend)
    else:
        q, k, v, out, lse = residuals
    return _backward(q, k, v, out, lse, dout, layout, scale, backend, deterministic)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    layout: Layout,
    scale: float,
    recompute: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
    deterministic: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Differentiable attention on jax arrays [batch, heads, time, head_dim]."""
    out, lse = _attention(
        q, k, v, layout, float(scale), bool(recompute), backend, bool(deterministic)
    )
    return (out, lse) if return_lse else out
