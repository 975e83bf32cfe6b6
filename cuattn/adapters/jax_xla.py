"""The kernels inside a jax program on a CUDA GPU: the XLA backend (KernelBackend's launch
sequences on traced arrays, each launch one XLA custom call whose PTX and ``opaque`` protobuf
cuattn/backends/xla.py writes without jax), which path a traced call takes, vmap, and the token
order around it.

* vmap: ``jax.custom_batching.custom_vmap`` folds a mapped axis into the batch axis (unbatched
  arguments are broadcast first), so a vmapped call is still one launch per kernel.
* Differentiation: none here; adapters/jax_vjp.py wraps forward and backward in its
  ``jax.custom_vjp``.

Without a GPU, ``with lowering_for_cuda(90):`` traces for CUDA, and
``jax.jit(f).trace(...).lower(lowering_platforms=("cuda",))`` lowers (AOT, tests).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from types import SimpleNamespace
from typing import Any

import numpy as np

from cuattn.backends.call import AttentionCall, ScoreOperands
from cuattn.backends.geometry import KernelConfig
from cuattn.backends.kernels import LAYOUT_FIELDS, KernelBackend
from cuattn.backends.toolchain import ptx_arch_option
from cuattn.backends.xla import (
    CUSTOM_CALL_TARGET,
    SCALAR_KINDS,
    create_array_parameter,
    create_scalar_parameter,
    kernel_call_opaque,
)
from cuattn.layout.device import DeviceLayout
from cuattn.layout.layout import Layout

MIN_JAXLIB = (0, 10, 1)  # the first jaxlib whose CUDA plugin registers CUSTOM_CALL_TARGET


# ---- the backend ----------------------------------------------------------------------------


class _Pending:
    """An output buffer not written yet: its launch makes it an aliased operand and binds the
    call's result to ``value``, which later launches read and the caller gets back. ``zeroed``:
    the launch writes part of it, the rest is 0."""

    __slots__ = ("shape", "dtype", "value", "zeroed")

    def __init__(self, shape: tuple[int, ...], dtype: Any, zeroed: bool = False) -> None:
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.value: Any = None
        self.zeroed = zeroed

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def get(self) -> Any:
        if self.value is None:
            raise AssertionError(f"output {self.shape} {self.dtype} was never written by a launch")
        return self.value


@dataclass(frozen=True)
class _Described:
    """Shape, dtype and (contiguous) byte strides of a traced array, for the stride checks."""

    shape: tuple[int, ...]
    dtype: np.dtype
    strides: tuple[int, ...]


def contiguous_strides(shape: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    """Row-major byte strides: a jit operand's buffer (jax.ffi.ffi_call's default layout)."""
    strides, step = [], itemsize
    for size in reversed(shape):
        strides.append(step)
        step *= max(int(size), 1)
    return tuple(reversed(strides))


def _described(x: Any) -> _Described:
    dtype = np.dtype(x.dtype)
    return _Described(tuple(x.shape), dtype, contiguous_strides(tuple(x.shape), dtype.itemsize))


# What the shared launch sequences use of an array module: outputs of the backward's
# ascontiguousarray are the operands themselves (a jit operand is contiguous); zeros is the
# stand-in for an optional operand the kernel does not read.
def _zeros(shape: Any, dtype: Any) -> Any:
    import jax.numpy as jnp

    return jnp.zeros(shape, dtype)


_XP = SimpleNamespace(
    float32=np.float32, uint32=np.uint32, ascontiguousarray=lambda x: x, zeros=_zeros
)


class XlaBackend(KernelBackend):
    """KernelBackend's launch sequences on traced jax arrays: one custom call per launch."""

    name = "xla"
    array_kind = "jax arrays"
    on_gpu = True  # staged for a CUDA device: GPU-only kernel variants stay opt-in here too

    def __init__(self, compute_capability: int) -> None:
        ptx_arch_option(compute_capability)  # validates
        self.compute_capability = compute_capability

    @property
    def xp(self) -> Any:
        return _XP

    def is_array(self, x: Any) -> bool:
        import jax

        return isinstance(x, (jax.Array, _Pending))

    def data_address(self, x: Any) -> int:
        # No address at trace time; XLA's buffers are at least 16-byte aligned, and every
        # pointer parameter asks the handler to check that (PTR_DIVISIBILITY) before launching.
        return 0

    def output(self, shape: tuple[int, ...], dtype: Any) -> _Pending:
        return _Pending(shape, dtype)

    def zeroed_output(self, shape: tuple[int, ...], dtype: Any) -> _Pending:
        return _Pending(shape, dtype, zeroed=True)

    def index_arrays(self, layout: Layout) -> SimpleNamespace:
        import jax.dlpack
        import jax.numpy as jnp

        if isinstance(layout, DeviceLayout):
            if layout.device is None:
                raise ValueError(
                    "layout: a DeviceLayout built on the CPU, but this jax program runs on a "
                    "CUDA GPU; build the layout from the jax arrays on the GPU"
                )
            arrays = vars(layout.kernel_arrays())  # shared with XLA, not copied
            return SimpleNamespace(**{k: jax.dlpack.from_dlpack(v) for k, v in arrays.items()})
        fields = {}
        for name in LAYOUT_FIELDS:
            host = np.ascontiguousarray(getattr(layout, name))
            if not host.size:  # the kernels take a valid pointer (cuda_runtime._MIN_ELEMENTS)
                host = np.zeros(1, host.dtype)
            fields[name] = jnp.asarray(host)
        return SimpleNamespace(**fields)

    def _check_strides(self, arrays: dict[str, Any]) -> None:
        super()._check_strides({name: _described(x) for name, x in arrays.items()})

    @staticmethod
    def _strides(name: str, x: Any) -> dict[str, int]:
        return KernelBackend._strides(name, _described(x))

    def launch(self, config: KernelConfig, **values: Any) -> None:
        import jax
        import jax.numpy as jnp

        operands: list[Any] = []
        parameters: list[bytes] = []
        aliases: dict[int, int] = {}
        written: list[_Pending] = []
        for name, kind in config.args:
            value = values[name]
            if kind != "ptr":
                parameters.append(create_scalar_parameter(value, SCALAR_KINDS[kind]))
                continue
            if isinstance(value, _Pending):
                if value.value is None:  # written by this launch: an aliased output
                    aliases[len(operands)] = len(written)
                    written.append(value)
                    value = (jnp.zeros if value.zeroed else jnp.empty)(value.shape, value.dtype)
                else:  # written by an earlier launch
                    value = value.value
            operands.append(value)
            parameters.append(create_array_parameter())
        opaque = kernel_call_opaque(config, parameters, self.compute_capability)
        shapes = [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in written]
        results = self.emit(config, operands, aliases, shapes, opaque)
        for pending, result in zip(written, results, strict=True):
            pending.value = result

    def emit(
        self,
        config: KernelConfig,
        operands: list[Any],
        aliases: dict[int, int],
        results: list[Any],
        opaque: bytes,
    ) -> list[Any]:
        """Stage one launch: the custom call, its results the aliased operands once written.
        (Tests replace this with a host callback that runs the kernel interpreter.)"""
        import jax

        call = jax.ffi.ffi_call(CUSTOM_CALL_TARGET, results, input_output_aliases=aliases)
        return call(*operands, opaque=opaque)

    def forward(self, q: Any, k: Any, v: Any, call: AttentionCall) -> tuple[Any, Any]:
        out, lse = super().forward(q, k, v, call)
        return out.get(), lse.get()

    def backward(self, q, k, v, out, lse, dout, dlse, call):
        grads = super().backward(q, k, v, out, lse, dout, dlse, call)
        return tuple(g.get() if isinstance(g, _Pending) else g for g in grads)

    def _slopes_gradient(self, rows: Any, slopes_ndim: int) -> Any:
        # the rows are the dQ launch's result, a jax array once that launch is staged
        return super()._slopes_gradient(rows.get(), slopes_ndim)

    def _key_bias_gradient(self, rows: Any, bias_ndim: int) -> Any:
        return super()._key_bias_gradient(rows.get(), bias_ndim)

    def _rel_bias_gradient(self, rows: Any, table_ndim: int) -> Any:
        return super()._rel_bias_gradient(rows.get(), table_ndim)

    def _score_bias_operand(self, bias: Any) -> tuple[Any, tuple[int, ...]]:
        # a jit operand is its own contiguous buffer: the whole of it, read at its shape's
        # row-major strides (0 along a broadcast axis: _score_bias_values)
        return bias, contiguous_strides(tuple(bias.shape), 1)

    def _score_bias_gradient(self, rows: Any, by_key: bool, bias: Any) -> Any:
        return super()._score_bias_gradient(rows.get(), by_key, bias)

    def merge_states(self, out_a: Any, lse_a: Any, out_b: Any, lse_b: Any) -> tuple[Any, Any]:
        raise NotImplementedError("merge_attention_states is not staged into jax programs yet")

    def decode(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError("paged decode is not staged into jax programs yet")


@functools.cache
def backend_for(compute_capability: int) -> XlaBackend:
    return XlaBackend(compute_capability)


# ---- which path a traced call takes -------------------------------------------------------

_FORCED_TARGET: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "cuattn_xla_target", default=None
)


@contextlib.contextmanager
def lowering_for_cuda(compute_capability: int = 90) -> Iterator[None]:
    """Trace cuattn calls for a CUDA device of this compute capability (90: H100) whatever
    jax's default backend is: to lower for CUDA ahead of time on a machine without a GPU
    (``jax.jit(f).trace(...)`` inside, then ``.lower(lowering_platforms=("cuda",))``). The
    choice is made when a function is traced: jax's trace cache does not see it, so trace a
    function object that was not traced (jitted) before."""
    ptx_arch_option(compute_capability)  # validates
    token = _FORCED_TARGET.set(compute_capability)
    try:
        yield
    finally:
        _FORCED_TARGET.reset(token)


def traced_target() -> int | None:
    """The compute capability traced calls compile for, or None when jax's default backend is
    the CPU (the caller's host-callback path). Raises NotImplementedError on other platforms."""
    forced = _FORCED_TARGET.get()
    if forced is not None:
        return forced
    import jax

    platform = jax.default_backend()
    if platform == "cpu":
        return None
    if platform in ("gpu", "cuda"):
        try:
            device = jax.local_devices(backend="cuda")[0]
        except RuntimeError:
            device = None  # a ROCm GPU
        if device is not None:
            check_jaxlib()
            major, minor = str(device.compute_capability).split(".")
            return int(major) * 10 + int(minor)
    raise NotImplementedError(
        f"cuattn under jax.jit runs on the CPU (host callback) and on CUDA GPUs (XLA custom "
        f"calls); jax's default backend here is {platform!r}. Call cuattn outside jit."
    )


def check_jaxlib() -> None:
    import jaxlib

    match = re.match(r"(\d+)\.(\d+)\.(\d+)", jaxlib.__version__)
    version = tuple(int(p) for p in match.groups()) if match else MIN_JAXLIB
    if version < MIN_JAXLIB:
        raise NotImplementedError(
            f"cuattn under jax.jit on a GPU launches its kernels through jaxlib's "
            f"{CUSTOM_CALL_TARGET!r} custom call, which jaxlib >= "
            f"{'.'.join(map(str, MIN_JAXLIB))} registers; this is jaxlib {jaxlib.__version__}. "
            "Upgrade jax and jaxlib, or call cuattn outside jit."
        )


# ---- the jax-facing functions: token order, vmap --------------------------------------------


def _prepare(x: Any, layout: Layout) -> Any:
    """x in the layout's computed token order (as backends._prepare, with a gather)."""
    return x if layout.perm is None else x[:, :, np.asarray(layout.perm)]


def _to_natural(x: Any, layout: Layout) -> Any:
    return x if layout.perm is None else x[:, :, np.argsort(layout.perm)]


def folding_vmap(
    fun: Callable[..., tuple[Any, ...]], seeded: bool = False
) -> Callable[..., tuple[Any, ...]]:
    """``fun`` on [batch, ...] arrays returning a tuple of [batch, ...] arrays, whose vmap folds
    the mapped axis into the batch axis: [V, B, ...] -> [V * B, ...], one call, and back.
    Unbatched arguments are broadcast along the mapped axis first. ``seeded``: the last
    argument is dropout's seed, one for the whole call: it is not folded, and a vmap that maps
    it is refused (the kernels take one seed)."""
    import jax
    import jax.numpy as jnp

    mapped = jax.custom_batching.custom_vmap(fun)

    @mapped.def_vmap
    def rule(axis_size: int, in_batched: Any, *args: Any) -> tuple[Any, Any]:
        seed = ()
        if seeded:
            if in_batched[-1]:
                raise ValueError(
                    "dropout_seed is mapped by this vmap, but one call takes one seed (the "
                    "generator's counter holds the batch index, so the mapped elements' masks "
                    "differ already): pass one seed, unmapped (in_axes=None)"
                )
            *args, seed = args
            in_batched, seed = in_batched[:-1], (seed,)
        full = [
            x if batched else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, batched in zip(args, in_batched, strict=True)
        ]
        folded = (x.reshape(axis_size * x.shape[1], *x.shape[2:]) for x in full)
        outs = mapped(*folded, *seed)
        outs = tuple(o.reshape(axis_size, o.shape[0] // axis_size, *o.shape[1:]) for o in outs)
        return outs, tuple(True for _ in outs)

    return mapped


def forward(
    q: Any, k: Any, v: Any, call: AttentionCall, compute_capability: int
) -> tuple[Any, Any]:
    """(out, lse) of traced jax arrays in the caller's token order, as custom calls; the call's
    score operands (if any) with a batch axis first (ALiBi's slopes as [batch, heads], a table
    as [batch, heads, 2 M + 1]), so that a vmap folds them with the batch; a seed array as the
    two 32-bit words the kernels read."""
    backend = backend_for(compute_capability)
    layout = call.layout
    present, _ = _batched_operands(call.operands, q)
    bare = call.without_operands()

    def run(q: Any, k: Any, v: Any, *given: Any) -> tuple[Any, Any]:
        prepared = (_prepare(x, layout) for x in (q, k, v))
        out, lse = backend.forward(*prepared, bare.placed(given))
        return _to_natural(out, layout), _to_natural(lse, layout)

    return folding_vmap(run, call.mods.seed_words)(q, k, v, *present)


def _batched_operands(operands: ScoreOperands, q: Any) -> tuple[tuple, tuple]:
    """(the operands given, batch axis first; for each, how its gradient comes back to the
    operand's own shape, or None): ALiBi's [heads] slopes become [batch, heads], a table [heads,
    2 M + 1] becomes [batch, heads, 2 M + 1] and a score bias [batch, heads, time_q, time_k]
    with its batch axis as q's (its other broadcast axes stay 1, read at stride 0), their
    gradients summed over the batch they were broadcast along; a key bias has its batch axis
    already; a 64-bit seed becomes its two 32-bit words (the low first, as the kernels read
    them), with no batch axis."""
    import jax
    import jax.numpy as jnp

    batch = q.shape[0]
    batched, restore = operands, dict.fromkeys(operands.named())

    def sum_batch(g: Any) -> Any:
        return g.sum(axis=0)

    alibi_slopes, rel_bias = operands.alibi_slopes, operands.rel_bias
    if alibi_slopes is not None and alibi_slopes.ndim == 1:
        batched = replace(batched, alibi_slopes=jnp.broadcast_to(alibi_slopes, q.shape[:2]))
        restore["alibi_slopes"] = sum_batch
    if rel_bias is not None and rel_bias.ndim == 2:
        batched = replace(batched, rel_bias=jnp.broadcast_to(rel_bias, (batch, *rel_bias.shape)))
        restore["rel_bias"] = sum_batch
    score_bias = operands.score_bias
    if score_bias is not None:
        shape = tuple(score_bias.shape)
        full = (1,) * (4 - len(shape)) + shape
        widened = jnp.broadcast_to(score_bias.reshape(full), (batch, *full[1:]))
        batched = replace(batched, score_bias=widened)

        def unbroadcast(g: Any) -> Any:
            return (g.sum(axis=0, keepdims=True) if full[0] == 1 else g).reshape(shape)

        restore["score_bias"] = unbroadcast
    seed_words = operands.dropout_seed
    if seed_words is not None and seed_words.dtype.itemsize == 8:  # one 64-bit value
        words = jax.lax.bitcast_convert_type(seed_words.reshape(()), jnp.uint32)
        batched = replace(batched, dropout_seed=words)
    return batched.present, tuple(restore[name] for name in batched.named())


def backward(
    named: dict[str, Any], call: AttentionCall, compute_capability: int
) -> tuple[Any, ...]:
    """(dq, dk, dv) of traced jax arrays in the caller's token order, as custom calls, from
    ``named``: q, k, v, out, lse, dout and dlse (like lse: the cotangent of the lse output), in
    that order. The gradients of the call's score operands follow, each like its operand (None
    for a seed)."""
    backend = backend_for(compute_capability)
    layout = call.layout
    present, restore = _batched_operands(call.operands, named["q"])
    seeded = call.mods.seed_words
    bare = call.without_operands()

    def run(*arrays: Any) -> tuple[Any, ...]:
        *tensors, dlse = (_prepare(x, layout) for x in arrays[:7])
        grads = backend.backward(*tensors, dlse, bare.placed(arrays[7:]))
        grads = grads[:-1] if seeded else grads  # the seed's None: not an array to map
        return (*(_to_natural(g, layout) for g in grads[:3]), *grads[3:])

    grads = folding_vmap(run, seeded)(*named.values(), *present)
    # an operand that went in broadcast along the batch has its gradient per batch: summed
    restored = (r(g) if r else g for g, r in zip(grads[3:], restore, strict=False))
    return (*grads[:3], *restored, *((None,) if seeded else ()))
