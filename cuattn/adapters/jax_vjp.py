"""jax adapter: block-sparse attention as a ``jax.custom_vjp`` function.

Eager jax arrays (not traced) go to the backend through DLPack with no copies: CPU arrays to
the NumPy backend, GPU arrays to the CuPy kernels; ``jax.grad`` works through the custom VJP.

Under ``jax.jit`` (or any transformation that traces: vmap, scan, ...) there is no buffer to
share. Which path a traced call takes is decided when it is traced, from jax's default backend:

* CPU: the forward and backward run through ``jax.pure_callback``: correct and differentiable
  (first order; the callback has no derivative of its own), but XLA copies the arguments and
  results across the callback boundary and cannot fuse around it; ``vmap`` runs the callback
  once per mapped element.
* CUDA GPU: every kernel launch of the forward (1 launch) and of the backward (3, plus 2 under
  GQA) is an XLA custom call to jaxlib's ``triton_kernel_call_ffi`` with the kernel's NVRTC PTX
  (cuattn/adapters/jax_xla.py): launched by XLA on its stream, no host round-trip, no compiled
  extension; ``vmap`` folds the mapped axis into the batch axis (one launch per kernel). Needs
  jaxlib >= 0.10.1 with its CUDA plugin, and CuPy's NVRTC when tracing. Checked without a GPU
  (tests/adapters/test_jax_xla.py): programs lowered for CUDA carry the launches geometry.py
  prescribes, their PTX assembles for sm_90a, and the staged programs, run with each custom call
  replaced by the kernel interpreter, match the eager interpreter bit for bit. The gpu-marked
  tests there (jit vs eager, grad, vmap, GQA, bf16 vs float64) have not run on a GPU yet.
  ``with cuattn.adapters.jax_xla.lowering_for_cuda(90):`` traces for CUDA on any machine, for
  ``lower(lowering_platforms=("cuda",))``.
* Other platforms (TPU, ROCm): ``NotImplementedError``; call cuattn outside ``jit``.

The log-sum-exp output is differentiable: its cotangent enters the backward as
delta - dlse (jax hands a zero cotangent when the lse is unused).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from cuattn import backends as _backend
from cuattn.adapters import dlpack
from cuattn.adapters import jax_xla as _xla
from cuattn.backends.call import (
    SCORE_OPERANDS,
    AttentionCall,
    given_operands,
    operand_gradients,
    placed_operands,
)

__all__ = ["attend"]

SEED_OPERAND = SCORE_OPERANDS[-1]  # dropout's seed held in an array: no gradient


def _lse_dtype(dtype: Any) -> Any:
    return jnp.float64 if dtype == jnp.float64 else jnp.float32


def _traced(*xs: Any) -> bool:
    return any(isinstance(x, jax.core.Tracer) for x in xs)


def _device_target(backend: str | None) -> int | None:
    """Compute capability a traced call compiles its kernels for (the XLA custom-call path), or
    None on the CPU (the host-callback path)."""
    target = _xla.traced_target()
    if target is not None and backend not in (None, "cuda"):
        raise ValueError(
            f"backend={backend!r} runs on the CPU but this jax program runs on a CUDA GPU; "
            "use backend='cuda' (or None) under jit there, or call cuattn outside jit"
        )
    return target


def _host_forward(call: AttentionCall, given: tuple, *arrays):
    return _eager_forward(*(np.asarray(x) for x in arrays), given, call)


def _host_backward(call: AttentionCall, given: tuple, *arrays):
    grads = _eager_backward(*(np.asarray(x) for x in arrays), given, call)
    return tuple(g for g in grads if g is not None)  # a seed array has no gradient


def _forward(q, k, v, operands, call: AttentionCall):
    """(out, lse); ``operands``: the score operands (SCORE_OPERANDS order, None if absent)."""
    extra, given = given_operands(operands)
    if _traced(q, k, v, *extra.values()):
        target = _device_target(call.backend)
        if target is not None:
            return _xla.forward(q, k, v, call.layout, call.scale, call.mods, target, *operands)
        shapes = (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(q.shape[:3], _lse_dtype(q.dtype)),
        )
        # the operands cross the callback as arrays; which ones, as a static value
        host = functools.partial(_host_forward, call, given)
        return jax.pure_callback(host, shapes, q, k, v, *extra.values(), vmap_method="sequential")
    named = {"q": q, "k": k, "v": v, **extra}
    return dlpack.call(_eager_forward, named, given, call)


def _eager_forward(q, k, v, *rest):
    *present, given, call = rest
    operands = placed_operands(present, given)
    return _backend.forward(q, k, v, call.layout, call.scale, call.backend, call.mods, *operands)


def _backward(q, k, v, operands, out, lse, dout, dlse, call: AttentionCall):
    """(dq, dk, dv, gradients of the operands: None for those absent)."""
    named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "dlse": dlse}
    extra, given = given_operands(operands)
    if _traced(*named.values(), *extra.values()):
        target = _device_target(call.backend)
        if target is not None:
            args = (call.layout, call.scale, call.mods, target)
            grads = _xla.backward(*named.values(), *args, *operands)
        else:
            wrt = (x for name, x in extra.items() if name != SEED_OPERAND)
            shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, *wrt))
            host = functools.partial(_host_backward, call, given)
            arrays = (*named.values(), *extra.values())
            grads = jax.pure_callback(host, shapes, *arrays, vmap_method="sequential")
            grads = (*grads, None) if SEED_OPERAND in extra else grads
    else:
        grads = dlpack.call(_eager_backward, {**named, **extra}, given, call)
    return (*grads[:3], operand_gradients(tuple(grads), operands))


def _eager_backward(q, k, v, out, lse, dout, dlse, *rest):
    *present, given, call = rest
    operands = placed_operands(present, given)
    args = (call.layout, call.scale, call.backend, dlse, call.mods)
    return _backend.backward(q, k, v, out, lse, dout, *args, *operands)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, operands, call):
    return _forward(q, k, v, operands, call)


def _attention_fwd(q, k, v, operands, call):
    out, lse = _forward(q, k, v, operands, call)
    residuals = (q, k, v, operands) if call.recompute else (q, k, v, operands, out, lse)
    return (out, lse), residuals


def _attention_bwd(call, residuals, cotangents):
    dout, dlse = cotangents
    if call.recompute:
        q, k, v, operands = residuals
        out, lse = _forward(q, k, v, operands, call)
    else:
        q, k, v, operands, out, lse = residuals
    return _backward(q, k, v, operands, out, lse, dout, dlse, call)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attend(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    call: AttentionCall,
    alibi_slopes: jax.Array | None = None,
    key_bias: jax.Array | None = None,
    rel_bias: jax.Array | None = None,
    seed_words: jax.Array | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Differentiable attention on jax arrays [batch, heads, time, head_dim] (the call's
    layout concrete); ALiBi's slopes, the key bias and the relative-position table
    differentiable too. ``seed_words``: dropout's seed as an array (traced or not), or None."""
    out, lse = _attention(q, k, v, (alibi_slopes, key_bias, rel_bias, seed_words), call)
    return (out, lse) if call.return_lse else out
