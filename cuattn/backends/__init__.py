"""Backend selection and the permutation-aware forward/backward every public path goes through.

A backend computes attention on arrays of one array library, its protocol three calls that
each take the validated call whole (backends/call.py AttentionCall: the layout, the scale, the
score modifiers and the score operands, arrays of the same library and device as q):
    forward(q, k, v, call) -> (out, lse), in the layout's computed token order
    backward(q, k, v, out, lse, dout, dlse, call) -> (dq, dk, dv, ...), each operand's gradient
        after dv (None for a seed array); ``dlse`` (like lse, or None) the gradient reaching lse
    decode(q, cache, call) -> (out, lse) over the tokens a serving KVCache keeps
The backends:
    numpy   the NumPy reference (numpy_ref.py, serving/decode.py's reference), the CPU path
    interp  the .cu kernels run on the CPU through the kernel interpreter (NumPy arrays)
    cuda    the .cu kernels on the GPU through CuPy (CuPy arrays)
Choose with ``backend=`` on a call or the CUATTN_BACKEND environment variable; by default CPU
arrays use ``numpy`` and CUDA arrays ``cuda``. A CPU backend is never handed device arrays, nor
the reverse: there are no silent host copies.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace
from types import ModuleType
from typing import Any, Protocol

import numpy as np

from cuattn._util import array_module
from cuattn.backends import dropout
from cuattn.backends import numpy_ref as reference
from cuattn.backends.call import AttentionCall
from cuattn.layout.device import DeviceLayout
from cuattn.layout.layout import Layout

BACKENDS = ("numpy", "interp", "cuda")
CPU_BACKENDS = ("numpy", "interp")
ENV_VAR = "CUATTN_BACKEND"


class Backend(Protocol):
    name: str
    on_gpu: bool  # computes on a CUDA device (its occupancy is that device's)

    def forward(self, q: Any, k: Any, v: Any, call: AttentionCall) -> tuple[Any, Any]: ...

    def backward(
        self, q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, dlse: Any, call: AttentionCall
    ) -> tuple[Any, ...]: ...

    def decode(self, q: Any, cache: Any, call: AttentionCall) -> tuple[Any, Any]: ...

    def merge_states(self, out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]: ...


def _host_seed(call: AttentionCall) -> AttentionCall:
    """The call as the reference takes it: a seed array's key (the reference's arrays are on
    the host) read into the modifiers."""
    if not call.mods.seed_words:
        return call
    seed = call.operands.dropout_seed
    mods = replace(call.mods, dropout_seed=dropout.seed_of(seed), seed_words=False)
    return replace(call, mods=mods, given_operands=replace(call.operands, dropout_seed=None))


class NumpyBackend:
    """The NumPy reference behind the Backend protocol."""

    name = "numpy"
    on_gpu = False

    def forward(self, q, k, v, call):
        reference.check_arrays(q)
        return reference.attention_forward(q, k, v, _host_seed(call))

    def backward(self, q, k, v, out, lse, dout, dlse, call):
        reference.check_arrays(q)
        grads = reference.attention_backward(q, k, v, out, lse, dout, dlse, _host_seed(call))
        return (*grads, None) if call.mods.seed_words else grads  # a seed has no gradient

    def decode(self, q, cache, call):
        from cuattn.serving.decode import reference_decode

        return reference_decode(q, cache, call)

    def merge_states(self, out_a, lse_a, out_b, lse_b):
        return reference.merge_states(out_a, lse_a, out_b, lse_b)


# Where the kernel backends live; imported on first use so that NumPy users never need a
# compiler or CuPy.
_LAZY = {
    "interp": ("cuattn.backends.interp", "InterpBackend"),
    "cuda": ("cuattn.backends.cuda", "CudaBackend"),
}
_INSTANCES: dict[str, Backend] = {"numpy": NumpyBackend()}


def resolve_backend(name: str | None, on_device: bool) -> Backend:
    """The backend for arrays on the CPU (on_device=False) or on a CUDA device."""
    if name is None:
        name = os.environ.get(ENV_VAR) or None
        if name is not None and on_device and name in CPU_BACKENDS:
            name = None  # the environment picks the CPU backend for CPU arrays only
    if name is None:
        name = "cuda" if on_device else "numpy"
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    if on_device and name != "cuda":
        raise ValueError(
            f"backend={name!r} runs on the CPU but the inputs are CUDA arrays; "
            "move them to the host yourself or use backend='cuda'"
        )
    if not on_device and name == "cuda":
        raise ValueError(
            "backend='cuda' needs CUDA arrays but the inputs live on the CPU; "
            "move them to the device yourself or use backend='numpy' or 'interp'"
        )
    if name not in _INSTANCES:
        module, cls = _LAZY[name]
        _INSTANCES[name] = getattr(importlib.import_module(module), cls)()
    return _INSTANCES[name]


def device_module(device: str, name: str) -> ModuleType:
    """NumPy for "cpu", CuPy for "cuda" (an ArrayInfo's device): the module that allocates
    there; another device is a ValueError naming the argument ``name`` whose device it is."""
    if device not in ("cpu", "cuda"):
        raise ValueError(f"{name} must be a CPU or CUDA array, got one on {device!r}")
    return importlib.import_module("cupy") if device == "cuda" else np


def _prepare(x: Any, layout: Layout) -> Any:
    """In the layout's computed token order: a gathered copy for a permuted layout, else x as
    it is (the NumPy backend takes any strides; the kernel backends read rows in place at any
    16-byte-multiple strides and refuse others with a ValueError)."""
    if layout.perm is None:
        return x
    xp = array_module(x)
    return xp.ascontiguousarray(x[:, :, xp.asarray(layout.perm)])


def _to_natural(x: Any, layout: Layout) -> Any:
    if layout.perm is None:
        return x
    xp = array_module(x)
    out = xp.empty_like(x)
    out[:, :, xp.asarray(layout.perm)] = x
    return out


def _resolve_for(x: Any, backend: str | None, layout: Layout | None = None) -> Backend:
    if isinstance(layout, DeviceLayout):
        _check_layout_place(x, layout)
    return resolve_backend(backend, on_device=array_module(x).__name__ == "cupy")


def _check_layout_place(q: Any, layout: DeviceLayout) -> None:
    """A device layout is read where it was built: q must be there too (no silent copies)."""
    q_device = int(q.device.id) if array_module(q).__name__ == "cupy" else None
    if q_device != layout.device:
        built = "on the CPU (NumPy)" if layout.device is None else f"on cuda:{layout.device}"
        where = "on the CPU" if q_device is None else f"on cuda:{q_device}"
        raise ValueError(
            f"layout: a DeviceLayout built {built}, but q is {where}; build the layout from "
            "arrays where the attention runs"
        )


def forward(q: Any, k: Any, v: Any, call: AttentionCall) -> tuple[Any, Any]:
    """(out, lse) in the caller's token order, on the call's backend (or the one chosen for the
    arrays).

    The single call into the backends for every route (public API, tape, torch, jax), so all
    of them compute, and differentiate, identically; the call's layout is concrete
    (``call.for_lengths``). lse is float32 (float64 for float64 input).
    """
    layout = call.layout
    impl = _resolve_for(q, call.backend, layout)
    arrays = (_prepare(x, layout) for x in (q, k, v))
    out, lse = impl.forward(*arrays, call)
    return _to_natural(out, layout), _to_natural(lse, layout)


def backward(
    q: Any, k: Any, v: Any, out: Any, lse: Any, dout: Any, dlse: Any, call: AttentionCall
) -> tuple[Any, ...]:
    """(dq, dk, dv) in the caller's token order from the saved inputs, output and lse; ``dlse``
    (like lse, or None when nothing reached it) makes the lse a differentiable output; the call
    is the forward's. The gradient of each score operand the call carries follows dv, in
    SCORE_OPERANDS order (None for a seed array). A score operand needs the natural token order:
    the public calls refuse a permuted layout with one."""
    layout = call.layout
    impl = _resolve_for(q, call.backend, layout)
    arrays = [_prepare(x, layout) for x in (q, k, v, out, lse, dout)]
    dlse = None if dlse is None else _prepare(dlse, layout)
    grads = impl.backward(*arrays, dlse, call)
    return (*(_to_natural(g, layout) for g in grads[:3]), *grads[3:])


def merge_states(
    out_a: Any, lse_a: Any, out_b: Any, lse_b: Any, backend: str | None = None
) -> tuple[Any, Any]:
    """(out, lse) of attention over keys A u B from the partial results over disjoint A and B."""
    return _resolve_for(out_a, backend).merge_states(out_a, lse_a, out_b, lse_b)
