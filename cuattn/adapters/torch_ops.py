"""torch adapter: block-sparse attention as torch custom ops, so torch.compile sees through it.

Two ops in the ``cuattn`` namespace take tensors and plain values only:
    cuattn::attention_fwd(q, k, v, layout, scale, backend, recompute, index)   -> (out, lse)
    cuattn::attention_bwd(q, k, v, out, lse, dout, dlse, layout, scale, backend, index)
                                                                              -> (dq, dk, dv)
``layout`` is a text key: ``"uid:<n>"`` names a live :class:`Layout` (``Layout.lookup``), and a
Pattern's JSON key names a rule built for each call's lengths, so a compiled graph with a
dynamic sequence length runs every length without re-tracing. A :class:`DeviceLayout` (chosen
from the data, a new one every step) goes as tensors instead: its key
``"device:<blocksize>:<rule kind>"`` is the same for every such layout and ``index`` = [blocks
(uint8), row_ptr, col_idx, row_mask, col_ptr, row_idx, col_mask, mask_table] (empty for the
other keys: torch's op schemas give a tensor list no default), so a compiled graph takes each
step's layout as an input and never re-traces for a new one.
Each op has a fake (shape-only) implementation for tracing, attention_fwd an autograd formula
that calls attention_bwd (the backward graph AOTAutograd records; both out and lse are
differentiable: lse's gradient ``dlse`` enters as delta - dlse), and both run through DLPack
with no copies: CPU tensors on the NumPy (or interpreter) backend, CUDA tensors on the CuPy
kernels on torch's current stream. Neither op is on autocast's cast lists: they compute in the
dtype q, k, v arrive in.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from cuattn import backends as _backend
from cuattn.adapters import dlpack
from cuattn.backends.call import AttentionCall
from cuattn.layout.device import INDEX_FIELDS, DeviceLayout
from cuattn.layout.layout import ElementRule, Layout
from cuattn.layout.pattern import Pattern

__all__ = ["attend", "layout_key", "merge", "op_arguments"]

UID_PREFIX = "uid:"
DEVICE_PREFIX = "device:"
VIEW_FIELDS = ("blocks", *INDEX_FIELDS, "mask_table")
PATTERN_KEYS_CACHED = 64


def layout_key(layout: Layout | Pattern) -> str:
    """The text an op takes for a Layout (its uid), a Pattern (its canonical key) or a
    DeviceLayout (its block size and rule kind; its arrays go as the ops' ``index``)."""
    if isinstance(layout, Pattern):
        return layout.key
    if isinstance(layout, DeviceLayout):
        return f"{DEVICE_PREFIX}{layout.blocksize}:{layout.rule.kind}"
    return f"{UID_PREFIX}{layout.uid}"


@functools.lru_cache(maxsize=PATTERN_KEYS_CACHED)
def _pattern(key: str) -> Pattern:
    return Pattern.from_key(key)


def _live_layout(key: str) -> Layout | None:
    """The Layout a uid key names (None for a Pattern key, which rebuilds from its text)."""
    return Layout.lookup(int(key[len(UID_PREFIX) :])) if key.startswith(UID_PREFIX) else None


def _resolve(key: str, n_q: int, n_k: int, index: list[torch.Tensor]) -> Layout:
    if key.startswith(DEVICE_PREFIX):
        if not index:
            raise ValueError(f"layout: key {key!r} names a DeviceLayout, whose index is empty")
        blocksize, rule = key[len(DEVICE_PREFIX) :].split(":")
        return _device_layout(index, int(blocksize), rule, n_k)
    layout = _live_layout(key)
    return _pattern(key).layout(n_q, n_k) if layout is None else layout


def _tables_only(h: Any, q: Any, k: Any) -> Any:
    raise RuntimeError("the element rule of a layout rebuilt inside a cuattn op is its tables")


def _device_layout(index: list[torch.Tensor], blocksize: int, rule: str, n: int) -> Layout:
    """The DeviceLayout whose arrays these tensors share (no copy)."""
    blocks, *arrays, table = (
        dlpack.to_backend(t, dlpack.describe(t, "layout"), "layout") for t in index
    )
    fields = dict(zip(INDEX_FIELDS, arrays, strict=True))
    capacity = int(index[2].numel())
    if rule == "bitmask":
        element_rule = ElementRule("bitmask", mask_fn=_tables_only)
    else:
        element_rule, table = ElementRule(rule), None
    return DeviceLayout(
        blocks.view("uint8"), fields, blocksize, n, element_rule, "device", capacity, table
    )


def index_tensors(layout: DeviceLayout) -> list[torch.Tensor]:
    """A DeviceLayout's blocks (uint8) and index arrays as tensors sharing its memory."""
    views = layout.views
    if views is None or not all(isinstance(views[f], torch.Tensor) for f in VIEW_FIELDS):
        views = {f: torch.from_dlpack(getattr(layout, f)) for f in VIEW_FIELDS}
    return [views["blocks"].view(torch.uint8), *(views[f] for f in VIEW_FIELDS[1:])]


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("cuattn::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: str,
    scale: float,
    backend: str,
    recompute: bool,
    index: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); ``recompute`` only shapes the backward."""
    named = {"q": q, "k": k, "v": v}
    with dlpack.stream_for(dlpack.common_info(named)):  # a DeviceLayout's few launches too
        lay = _resolve(layout, q.shape[2], k.shape[2], index)
        out, lse = dlpack.call(_backend.forward, named, lay, scale, backend or None)
    return out.contiguous(), lse.contiguous()


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, layout, scale, backend, recompute, index):
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=_lse_dtype(q))


@torch.library.custom_op("cuattn::attention_bwd", mutates_args=())
def attention_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    layout: str,
    scale: float,
    backend: str,
    index: list[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) from the saved inputs, output and lse, and the gradients reaching out
    (dout) and lse (dlse, None when nothing reached it)."""
    named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout}
    if dlse is not None:
        named["dlse"] = dlse
    with dlpack.stream_for(dlpack.common_info(named)):
        lay = _resolve(layout, q.shape[2], k.shape[2], index)
        grads = dlpack.call(_backward_arrays, named, lay, scale, backend or None)
    return tuple(g.contiguous() for g in grads)


def _backward_arrays(q, k, v, out, lse, dout, *rest):
    """backends.backward with the optional dlse array (the first of ``rest`` when given)."""
    *dlse, layout, scale, backend = rest
    dlse = dlse[0] if dlse else None
    return _backend.backward(q, k, v, out, lse, dout, layout, scale, backend, dlse=dlse)


@attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, out, lse, dout, dlse, layout, scale, backend, index):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, layout, scale, backend, recompute, index = inputs
    out, lse = output
    # The op names its Layout by uid only; the autograd graph holds the Layout itself until
    # backward, so a layout built inline for one call (and dropped by the caller) still exists.
    # A DeviceLayout's tensors are saved with the inputs instead.
    ctx.layout = _live_layout(layout)
    saved = (q, k, v) if recompute else (q, k, v, out, lse)
    ctx.save_for_backward(*saved, *index)
    ctx.saved_count = len(saved)
    ctx.args = (layout, scale, backend, recompute)


def _backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
    layout, scale, backend, recompute = ctx.args
    tensors = ctx.saved_tensors
    q, k, v, *saved = tensors[: ctx.saved_count]
    index = list(tensors[ctx.saved_count :])
    if recompute:
        saved = attention_fwd(q, k, v, layout, scale, backend, False, index)
    out, lse = saved
    if dout is None:  # only the lse reached the loss
        dout = torch.zeros_like(out)
    dout, dlse = (
        g.contiguous() if g is not None and 0 in g.stride() else g for g in (dout, dlse)
    )  # an expanded gradient (of a sum): the kernels read real rows
    grads = attention_bwd(q, k, v, out, lse, dout, dlse, layout, scale, backend, index)
    return (*grads, None, None, None, None, [None] * len(index))


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


def _no_double_backward(ctx: Any, *grads: torch.Tensor) -> tuple:
    raise RuntimeError(
        "cuattn attention cannot differentiate twice: its backward (cuattn::attention_bwd) has "
        "no gradient of its own"
    )


def _setup_nothing(ctx: Any, inputs: tuple, output: tuple) -> None:
    return None


attention_bwd.register_autograd(_no_double_backward, setup_context=_setup_nothing)


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: AttentionCall
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention on torch tensors [batch, heads, time, head_dim] through the custom ops; with
    or without autograd, eager or compiled. out and lse (float32, float64 for float64) both
    carry gradients. The call crosses the op as the ops' plain arguments (op_arguments)."""
    out, lse = attention_fwd(q, k, v, *op_arguments(call))
    return (out, lse) if call.return_lse else out


def op_arguments(call: AttentionCall) -> tuple[str, float, str, bool, list[torch.Tensor]]:
    """(layout, scale, backend, recompute, index): the call as attention_fwd's arguments after
    q, k, v (attention_bwd takes the same but recompute), the one place that spells them."""
    layout = call.layout
    index = index_tensors(layout) if isinstance(layout, DeviceLayout) else []
    return layout_key(layout), call.scale, call.backend or "", call.recompute, index


def _side_weight(lse_x: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """exp(lse_x - lse): a side's share of the merged softmax; 0 for an empty side (and when
    both are empty, lse = -inf); NaN where the merged lse is NaN, as the forward's output is."""
    empty = lse == float("-inf")
    return torch.where(empty, 0.0, torch.exp(lse_x - torch.where(empty, 0.0, lse)))


class MergeStates(torch.autograd.Function):
    """merge_attention_states with gradients: out = w_a out_a + w_b out_b, w_x = exp(lse_x -
    lse). d out_x = w_x dout; d lse_x = w_x (dout . (out_x - out) + dlse). Empty sides get 0."""

    @staticmethod
    def forward(ctx: Any, out_a, lse_a, out_b, lse_b, backend):
        named = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
        out, lse = dlpack.call(_backend.merge_states, named, backend)
        ctx.save_for_backward(out_a, lse_a, out_b, lse_b, out, lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor | None, dlse: torch.Tensor | None) -> tuple:
        out_a, lse_a, out_b, lse_b, out, lse = ctx.saved_tensors
        acc = lse.dtype
        dout = torch.zeros_like(out, dtype=acc) if dout is None else dout.to(acc)
        dlse = torch.zeros_like(lse) if dlse is None else dlse
        grads = []
        for out_x, lse_x in ((out_a, lse_a), (out_b, lse_b)):
            weight = _side_weight(lse_x, lse)
            used = (weight > 0)[..., None]
            # an empty side's out may hold anything (NaN included): it must not reach a product
            diff = torch.where(used, out_x.to(acc) - out.to(acc), 0.0)
            d_lse = weight * ((dout * diff).sum(-1) + dlse)
            grads += [(weight[..., None] * dout).to(out_x.dtype), d_lse.to(lse_x.dtype)]
        return (*grads, None)


def merge(out_a, lse_a, out_b, lse_b, backend: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_attention_states on torch tensors, differentiable in all four inputs."""
    return MergeStates.apply(out_a, lse_a, out_b, lse_b, backend)
