"""What the public calls ask about the caller's arrays across routes: whether a gradient is
wanted, whether torch.compile is tracing, raw arrays beside tape Tensors, a dropout seed drawn
from the caller's own generator, and the differentiable merge of two partial attentions. The
route of one attention call itself is ``cuattn.api``'s last step (``_route``), so a warm call
goes from the API straight to its route's adapter.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from cuattn import backends as _backend
from cuattn._util import array_library, array_module
from cuattn.adapters import dlpack
from cuattn.autograd.tape import Context, Function, Tensor
from cuattn.backends.call import ScoreMods, check_same_kind

__all__ = [
    "dropout_mods",
    "merge_states",
    "no_keys",
    "outside_graph",
    "tape_args",
    "wants_gradient",
]

MAX_DRAWN_SEED = 2**63 - 1  # a drawn dropout seed: a non-negative int64

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


def no_keys(q: Any, k: Any, v: Any, lse_dtype: str) -> tuple[Any, Any]:
    """The result of a call with an empty axis: out like q, all zeros (with time_k = 0 every
    row has no key), lse -inf [batch, heads, time_q] of ``lse_dtype``, as the caller's own kind
    of array on its device. torch and jax results come from q, k and v through where(False,
    ...), so autograd and tracing see the inputs (gradients: zeros) and no value of theirs (a
    NaN) can leak; tape Tensors through a tape op of zero gradient."""
    if any(isinstance(x, Tensor) for x in (q, k, v)):
        return _NoKeys.apply(*tape_args(q, k, v), lse_dtype)
    if array_library(q) == "torch":
        import torch

        never = torch.zeros((), dtype=torch.bool, device=q.device)
        seen = q + (k.sum() + v.sum()).to(q.dtype)  # every input, for autograd
        lse_type = getattr(torch, lse_dtype)
        return (
            torch.where(never, seen, 0.0),
            torch.where(never, seen[..., 0].to(lse_type), float("-inf")),
        )
    if array_library(q) == "jax":
        import jax.numpy as jnp

        seen = q + (k.sum() + v.sum()).astype(q.dtype)
        return (
            jnp.where(False, seen, jnp.zeros((), q.dtype)),
            jnp.where(False, seen[..., 0].astype(lse_dtype), -jnp.inf),
        )
    return dlpack.call(_no_keys_arrays, {"q": q, "k": k, "v": v}, lse_dtype)


def _no_keys_arrays(q: Any, k: Any, v: Any, lse_dtype: str) -> tuple[Any, Any]:
    """NumPy or CuPy zeros like q and lse -inf, on q's device."""
    xp = array_module(q)
    with q.device if xp is not np else contextlib.nullcontext():
        return xp.zeros(q.shape, q.dtype), xp.full(q.shape[:3], -np.inf, lse_dtype)


class _NoKeys(Function):
    """Tape op: (zeros like q, lse -inf) whose gradients in q, k and v are zeros."""

    @staticmethod
    def forward(ctx: Context, q: Any, k: Any, v: Any, lse_dtype: str) -> tuple[Any, Any]:
        ctx.shapes = [(x.shape, x.dtype) for x in (q, k, v)]
        return _no_keys_arrays(q, k, v, lse_dtype)

    @staticmethod
    def backward(ctx: Context, dout: Any, dlse: Any) -> tuple:
        xp = array_module(dout)
        return (*(xp.zeros(shape, dtype) for shape, dtype in ctx.shapes), None)


def outside_graph(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, run outside any graph torch.compile is tracing (a graph break there):
    for host work on a call's metadata (a varlen call's packed layout from cu_seqlens), which
    dynamo would otherwise trace into NumPy code it cannot follow. Plain call otherwise."""
    if dlpack.torch_compiling():
        return sys.modules["torch"].compiler.disable(fn)(*args)
    return fn(*args)


def wants_gradient(xs: Any) -> bool:
    """Whether a gradient is asked of these arrays: torch tensors requiring grad (with grad
    enabled) or jax tracers (inside jit/grad/vmap)."""
    xs = tuple(xs)
    return _requires_torch_grad(xs) or any(dlpack.is_jax_tracer(x) for x in xs)


def merge_states(arrays: dict[str, Any], backend: str | None) -> tuple[Any, Any]:
    """merge_attention_states on any framework's arrays, handed back as the caller's type."""
    return dlpack.call(_backend.merge_states, arrays, backend)


def dropout_mods(mods: ScoreMods, q: Any, dropout_p: object, dropout_seed: object) -> tuple:
    """(``mods`` with a call's dropout, the seed array that travels as a score operand or None):
    the arguments checked by ScoreMods.with_dropout (a TypeError or ValueError naming them, a
    seed array of q's kind), the seed drawn when the caller gives none (dropout_seed_for). q is
    the caller's array (a tape Tensor's data)."""
    if not dropout_p:
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, np.number)):
            mods.with_dropout(dropout_p, dropout_seed)  # refused there, by name
        return mods, None
    seed = dropout_seed_for(q, dropout_seed)
    mods = mods.with_dropout(dropout_p, seed)
    if not mods.seed_words:
        return mods, None
    check_same_kind("dropout_seed", seed.data if isinstance(seed, Tensor) else seed, q)
    return mods, seed


def dropout_seed_for(q: Any, seed: object) -> object:
    """The seed of a call with dropout: the caller's, or one drawn from torch's generator of q's
    device (torch tensors: an int64 tensor there, so that nothing waits for the host and a CUDA
    graph's replays draw anew) or NumPy's global one; jax has none."""
    if seed is not None:
        return seed
    library = array_library(q)
    if library == "torch":
        import torch

        return torch.randint(0, MAX_DRAWN_SEED, (), dtype=torch.int64, device=q.device)
    if library == "jax":
        raise ValueError(
            "dropout_seed is needed with jax arrays (jax keeps no global random state): pass "
            "jax.random.bits(key, (2,), jnp.uint32) (traced: a new seed does not retrace) or an "
            "int in [0, 2^63)"
        )
    # NumPy's global state, so that np.random.seed repeats a run's masks
    return int(np.random.randint(0, MAX_DRAWN_SEED, dtype=np.int64))  # noqa: NPY002
