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
from cuattn.backends.call import SCORE_OPERANDS, AttentionCall

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


def _host_forward(call: AttentionCall, *arrays):
    return _eager_forward(*(np.asarray(x) for x in arrays), call)


def _host_backward(call: AttentionCall, *arrays):
    grads = _eager_backward(*(np.asarray(x) for x in arrays), call)
    return tuple(g for g in grads if g is not None)  # a seed array has no gradient


def _forward(q, k, v, present, call: AttentionCall):
    """(out, lse); ``present``: the call's score operands (those its modifiers flag, in
    SCORE_OPERANDS order), the call without them."""
    if _traced(q, k, v, *present):
        target = _device_target(call.backend)
        if target is not None:
            return _xla.forward(q, k, v, call.placed(present), target)
        shapes = (
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct(q.shape[:3], _lse_dtype(q.dtype)),
        )
        # the operands cross the callback as arrays, the call as a static value
        host = functools.partial(_host_forward, call)
        return jax.pure_callback(host, shapes, q, k, v, *present, vmap_method="sequential")
    named = {"q": q, "k": k, "v": v, **call.placed(present).operands.named()}
    return dlpack.call(_eager_forward, named, call)


def _eager_forward(q, k, v, *rest):
    *present, call = rest
    return _backend.forward(q, k, v, call.placed(present))


def _backward(q, k, v, present, out, lse, dout, dlse, call: AttentionCall):
    """(dq, dk, dv, gradients of the operands present: None for a seed array)."""
    named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout, "dlse": dlse}
    extra = call.placed(present).operands.named()
    if _traced(*named.values(), *present):
        target = _device_target(call.backend)
        if target is not None:
            grads = _xla.backward(named, call.placed(present), target)
        else:
            wrt = (x for name, x in extra.items() if name != SEED_OPERAND)
            shapes = tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (q, k, v, *wrt))
            host = functools.partial(_host_backward, call)
            arrays = (*named.values(), *present)
            grads = jax.pure_callback(host, shapes, *arrays, vmap_method="sequential")
            grads = (*grads, None) if SEED_OPERAND in extra else grads
    else:
        grads = dlpack.call(_eager_backward, {**named, **extra}, call)
    return (*grads[:3], tuple(grads[3:]))


def _eager_backward(q, k, v, out, lse, dout, dlse, *rest):
    *present, call = rest
    return _backend.backward(q, k, v, out, lse, dout, dlse, call.placed(present))


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _attention(q, k, v, present, call):
    return _forward(q, k, v, present, call)


def _attention_fwd(q, k, v, present, call):
    out, lse = _forward(q, k, v, present, call)
    residuals = (q, k, v, present) if call.recompute else (q, k, v, present, out, lse)
    return (out, lse), residuals


def _attention_bwd(call, residuals, cotangents):
    dout, dlse = cotangents
    if call.recompute:
        q, k, v, present = residuals
        out, lse = _forward(q, k, v, present, call)
    else:
        q, k, v, present, out, lse = residuals
    return _backward(q, k, v, present, out, lse, dout, dlse, call)


_attention.defvjp(_attention_fwd, _attention_bwd)


def attend(
    q: jax.Array, k: jax.Array, v: jax.Array, call: AttentionCall
) -> jax.Array | tuple[jax.Array, jax.Array]:
    """Differentiable attention on jax arrays [batch, heads, time, head_dim] (the call's
    layout concrete); ALiBi's slopes, the key bias and the relative-position table among the
    call's operands differentiable too; dropout's seed array (traced or not) has no gradient.
    The operands cross jax's custom_vjp as arrays, the call without them as a static value."""
    present = call.operands.present
    out, lse = _attention(q, k, v, present, call.without_operands())
    return (out, lse) if call.return_lse else out
