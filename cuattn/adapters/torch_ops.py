"""torch adapter: block-sparse attention as torch custom ops, so torch.compile sees through it.

Two ops in the ``cuattn`` namespace take tensors and plain values only:
    cuattn::attention_fwd(q, k, v, pattern, blocksize, rule, window_left, window_right, scale,
                          softcap, dropout_p, dropout_seed, backend, recompute, index,
                          operands, given)                     -> (out, lse)
    cuattn::attention_bwd(q, k, v, out, lse, dout, dlse, pattern, blocksize, rule, window_left,
                          window_right, scale, softcap, dropout_p, dropout_seed, backend,
                          index, operands, given)             -> [dq, dk, dv, *doperands]
``operands`` is the list of the call's score operands (backends/call.py SCORE_OPERANDS: ALiBi's
slopes float32 [heads] or [batch, heads], a key bias float32 [batch, n_k] or [batch, heads,
n_k], a relative-position table float32 [(batch,) heads, 2 M + 1], dropout's seed held in a
tensor on q's device), only those given, in that order; ``given`` says which (bit i for
SCORE_OPERANDS[i]). attention_bwd answers a list: dq, dk, dv, then the gradient of each
operand given but the seed. A seed tensor (int64 [] or uint32 [2]: the seed torch draws on the
device when the caller gives none, so a CUDA graph's replay draws a new mask) replaces
``dropout_seed``; it has no gradient.
A :class:`Pattern` crosses as its text key (``pattern``), a rule built for each call's lengths,
so a compiled graph with a dynamic sequence length runs every length without re-tracing. Any
concrete layout (a :class:`Layout`, or a :class:`DeviceLayout` chosen from the data) crosses as
its arrays, FlexAttention's BlockMask way: ``index`` = [blocks (uint8), row_ptr, col_idx,
row_mask, col_ptr, row_idx, col_mask, mask_table(, perm)] on q's device, beside its block size
and element rule as ints (``rule`` an index into RULE_KINDS; ``pattern`` is then empty); the
ops read them back as a DeviceLayout, no copy, nothing looked up. A host Layout's tensors are
made once per device and kept while the Layout lives (on CUDA, the layout the kernels walk,
copied to the device once); a DeviceLayout's are its own arrays, so a compiled graph takes
each step's layout as an input and never re-traces for a new one.
Each op has a fake (shape-only) implementation for tracing, attention_fwd an autograd formula
that calls attention_bwd (the backward graph AOTAutograd records; both out and lse are
differentiable: lse's gradient ``dlse`` enters as delta - dlse), and both run through DLPack
with no copies: CPU tensors on the NumPy (or interpreter) backend, CUDA tensors on the CuPy
kernels on torch's current stream. Neither op is on autocast's cast lists: they compute in the
dtype q, k, v arrive in.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch.autograd.function import once_differentiable

from cuattn import backends as _backend
from cuattn.adapters import dlpack
from cuattn.backends.call import NO_MODS, SCORE_OPERANDS, AttentionCall, ScoreMods
from cuattn.backends.kernels import kernel_layout
from cuattn.layout.device import INDEX_FIELDS, DeviceLayout
from cuattn.layout.layout import RULE_KINDS, Layout
from cuattn.layout.pattern import Pattern

__all__ = ["attend", "merge", "op_arguments"]

LAYOUT_TENSORS = ("blocks", *INDEX_FIELDS, "mask_table", "perm")  # perm: permuted layouts only
PATTERN_KEYS_CACHED = 64
# The attribute on a host Layout's blocks tensor holding its arrays read back as a DeviceLayout.
READ_BACK = "_cuattn_layout"
# A host Layout's tensors per device, made once and freed with the Layout.
_TENSORS: weakref.WeakKeyDictionary[Layout, dict[torch.device, list[torch.Tensor]]] = (
    weakref.WeakKeyDictionary()
)


@functools.lru_cache(maxsize=PATTERN_KEYS_CACHED)
def _pattern(key: str) -> Pattern:
    return Pattern.from_key(key)


def _layout_ints(layout: Layout) -> list[int]:
    """[blocksize, rule, window_left, window_right] of a layout, as the ops take them."""
    rule = layout.rule
    return [layout.blocksize, RULE_KINDS.index(rule.kind), rule.window_left, rule.window_right]


def _resolve(
    pattern: str, ints: Sequence[int], n_q: int, n_k: int, index: list[torch.Tensor]
) -> Layout:
    """The layout an op's arguments name: the Pattern's for these lengths, or the arrays'."""
    if pattern:
        return _pattern(pattern).layout(n_q, n_k)
    if not index:
        raise ValueError("layout: the op got neither a pattern key nor a layout's arrays")
    read_back = getattr(index[0], READ_BACK, None)
    return _read_back(index, ints, n_q, n_k) if read_back is None else read_back


def _read_back(index: list[torch.Tensor], ints: Sequence[int], n_q: int, n_k: int) -> DeviceLayout:
    """The DeviceLayout sharing these tensors' memory (no copy)."""
    info = dlpack.describe(index[0], "layout")
    arrays = {
        field: dlpack.to_backend(t, info, "layout")
        for field, t in zip(LAYOUT_TENSORS, index, strict=False)
    }
    arrays["blocks"] = arrays["blocks"].view("bool")
    blocksize, kind, left, right = ints
    return DeviceLayout.from_arrays(arrays, blocksize, n_q, n_k, RULE_KINDS[kind], (left, right))


def _as_tensor(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array as a tensor on ``device``: shared on the CPU (an empty array becomes one
    row of zeros, so that every index array has an address the kernels may read), copied to
    CUDA."""
    # dynamo traces from_numpy, not DLPack; eagerly DLPack shares read-only arrays silently
    tensor = torch.from_numpy(array) if torch.compiler.is_compiling() else torch.from_dlpack(array)
    if tensor.numel() == 0:
        tensor = torch.zeros((1, *tensor.shape[1:]), dtype=tensor.dtype)
    return tensor if device.type == "cpu" else tensor.to(device)


def index_tensors(layout: Layout, device: torch.device) -> list[torch.Tensor]:
    """The tensors a concrete layout crosses the ops as (see the module doc), on ``device``."""
    if isinstance(layout, DeviceLayout):
        views = layout.views
        fields = LAYOUT_TENSORS[:-1]  # a data-chosen layout has no permutation
        if views is None or not all(isinstance(views[f], torch.Tensor) for f in fields):
            views = {f: torch.from_dlpack(getattr(layout, f)) for f in fields}
        return [views["blocks"].view(torch.uint8), *(views[f] for f in fields[1:])]
    per_device = _TENSORS.setdefault(layout, {})
    tensors = per_device.get(device)
    if tensors is None:
        # CUDA runs the kernels' own layout (block 8 coarsened to 16) in place
        source = layout if device.type == "cpu" else kernel_layout(layout)
        arrays = [getattr(source, f) for f in LAYOUT_TENSORS[:-1]]
        arrays += [] if source.perm is None else [source.perm]
        tensors = [_as_tensor(a, device) for a in arrays]
        tensors[0] = tensors[0].view(torch.uint8)
        if not torch.compiler.is_compiling():
            # these tensors never change: the ops read them back once, not at every call
            ints = _layout_ints(source)
            read_back = _read_back(tensors, ints, source.n_q, source.n_ctx)
            setattr(tensors[0], READ_BACK, read_back)
        per_device[device] = tensors
    return tensors


# attention_fwd's arguments before the score operands: q, k, v, pattern, layout_rule, scores,
# dropout_seed, backend, recompute, index
OP_ARGUMENTS = 10
# the seed, last of the score operands, has no gradient
SEED_BIT = len(SCORE_OPERANDS) - 1
SCORE_BIAS_BIT = SCORE_OPERANDS.index("score_bias")
# past the operands' bits in attention_bwd's ``given``: the score bias takes no gradient (none
# is asked of it), so the backward skips its dS planes and answers none for it
FROZEN_BIAS_BIT = len(SCORE_OPERANDS)


def given_bits(call: AttentionCall) -> int:
    """The ops' ``given``: bit i set when the call carries SCORE_OPERANDS[i]."""
    return sum(1 << i for i, g in enumerate(call.mods.given) if g)


def _call(
    layout: Layout, scores: Sequence[float], dropout_seed: int, backend: str, given: int
) -> AttentionCall:
    """The call an op's plain arguments describe (``scores``: scale, softcap, dropout_p; its
    operands placed by the caller)."""
    scale, softcap, dropout_p = scores
    if not given and not dropout_p:
        mods = ScoreMods(softcap) if softcap else NO_MODS
        return AttentionCall(layout, scale, backend=backend or None, mods=mods)
    flags = [bool(given >> i & 1) for i in range(len(SCORE_OPERANDS))]
    mods = ScoreMods(softcap).with_dropout(dropout_p, dropout_seed).with_given(flags)
    if given >> FROZEN_BIAS_BIT & 1:
        mods = replace(mods, score_bias_frozen=True)
    return AttentionCall(layout, scale, backend=backend or None, mods=mods)


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@torch.library.custom_op("cuattn::attention_fwd", mutates_args=())
def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pattern: str,
    layout_rule: list[int],
    scores: list[float],
    dropout_seed: int,
    backend: str,
    recompute: bool,
    index: list[torch.Tensor],
    operands: list[torch.Tensor],
    given: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse); ``recompute`` only shapes the backward. The layout: a Pattern's key, or
    ``index`` with ``layout_rule`` [blocksize, rule, window_left, window_right]; ``scores``:
    [scale, softcap, dropout_p] (op_arguments spells them)."""
    named = {"q": q, "k": k, "v": v}
    info = dlpack.torch_info(named)
    with dlpack.stream_for(info):
        lay = _resolve(pattern, layout_rule, q.shape[2], k.shape[2], index)
        call = _call(lay, scores, dropout_seed, backend, given)
        if given:
            named.update(call.placed(operands).operands.named())
        out, lse = dlpack.call(_forward_arrays, named, call, info=info)
    return out.contiguous(), lse.contiguous()


def _forward_arrays(q, k, v, *rest):
    """backends.forward with the score operands placed (first in ``rest``, the call last)."""
    *present, call = rest
    return _backend.forward(q, k, v, call.placed(present) if present else call)


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, *rest):
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
    pattern: str,
    layout_rule: list[int],
    scores: list[float],
    dropout_seed: int,
    backend: str,
    index: list[torch.Tensor],
    operands: list[torch.Tensor],
    given: int,
) -> list[torch.Tensor]:
    """[dq, dk, dv, then the gradient of each operand given but the seed, which has none] from
    the saved inputs, output and lse, and the gradients reaching out (dout) and lse (dlse, None
    when nothing reached it)."""
    named = {"q": q, "k": k, "v": v, "out": out, "lse": lse, "dout": dout}
    if dlse is not None:
        named["dlse"] = dlse
    info = dlpack.torch_info(named)
    with dlpack.stream_for(info):
        lay = _resolve(pattern, layout_rule, q.shape[2], k.shape[2], index)
        call = _call(lay, scores, dropout_seed, backend, given)
        named.update(call.placed(operands).operands.named())
        grads = dlpack.call(_backward_arrays, named, dlse is not None, call, info=info)
    return [g.contiguous() for g in grads if g is not None]  # the seed's None: no gradient


def _backward_arrays(q, k, v, out, lse, dout, *rest):
    """backends.backward with the optional dlse and the score operands (in that order in
    ``rest``), then whether dlse came and the call."""
    *optional, has_dlse, call = rest
    dlse = optional.pop(0) if has_dlse else None
    return _backend.backward(q, k, v, out, lse, dout, dlse, call.placed(optional))


@attention_bwd.register_fake
def _attention_bwd_fake(q, k, v, out, lse, dout, dlse, *rest):
    *_, operands, given = rest
    answered = _with_gradients(operands, given)
    wrt = [x for x, a in zip(operands, answered, strict=True) if a]
    return [x.new_empty(x.shape) for x in (q, k, v, *wrt)]


def _with_gradients(operands: list[torch.Tensor], given: int) -> list[bool]:
    """For each operand given, whether attention_bwd answers a gradient for it: all but the
    seed and a frozen score bias."""
    bits = [i for i in range(len(SCORE_OPERANDS)) if given >> i & 1]
    frozen = given >> FROZEN_BIAS_BIT & 1
    return [bit != SEED_BIT and not (bit == SCORE_BIAS_BIT and frozen) for bit in bits]


def _setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
    q, k, v, *plain, recompute, index = inputs[:OP_ARGUMENTS]
    operands, given = inputs[OP_ARGUMENTS:]
    out, lse = output
    saved = (q, k, v) if recompute else (q, k, v, out, lse)
    ctx.save_for_backward(*saved, *index, *operands)
    ctx.saved_count = len(saved)
    ctx.index_count = len(index)
    ctx.given = given
    ctx.args = (*plain, recompute)  # pattern, layout_rule, scores, dropout_seed, backend


def _backward(ctx: Any, dout: torch.Tensor, dlse: torch.Tensor | None) -> tuple:
    *plain, recompute = ctx.args
    tensors = ctx.saved_tensors
    q, k, v, *saved = tensors[: ctx.saved_count]
    after = tensors[ctx.saved_count :]
    index = list(after[: ctx.index_count])
    operands = list(after[ctx.index_count :])
    if recompute:
        saved = attention_fwd(q, k, v, *plain, False, index, operands, ctx.given)
    out, lse = saved
    if dout is None:  # only the lse reached the loss
        dout = torch.zeros_like(out)
    dout, dlse = (
        g.contiguous() if g is not None and 0 in g.stride() else g for g in (dout, dlse)
    )  # an expanded gradient (of a sum): the kernels read real rows
    given = ctx.given
    bits = [i for i in range(len(SCORE_OPERANDS)) if given >> i & 1]
    wanted = ctx.needs_input_grad[OP_ARGUMENTS]  # one flag a score operand
    if SCORE_BIAS_BIT in bits and not wanted[bits.index(SCORE_BIAS_BIT)]:
        given |= 1 << FROZEN_BIAS_BIT  # no dS planes for a bias nothing differentiates
    dq, dk, dv, *wrt = attention_bwd(q, k, v, out, lse, dout, dlse, *plain, index, operands, given)
    # None for each plain argument and each tensor of index, then a gradient or None for each
    # operand given (None for the seed and a frozen score bias), then None for ``given``
    grads = iter(wrt)
    operand_grads = [next(grads) if a else None for a in _with_gradients(operands, given)]
    nones = [None] * (OP_ARGUMENTS - 4)  # every argument but q, k, v and index
    return (dq, dk, dv, *nones, [None] * len(index), operand_grads, None)


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
    carry gradients, and so do the call's score operands that want one. The call crosses the
    op as the ops' plain arguments and its operand list (op_arguments)."""
    out, lse = attention_fwd(q, k, v, *op_arguments(call, q.device))
    return (out, lse) if call.return_lse else out


def op_arguments(call: AttentionCall, device: torch.device) -> tuple:
    """(pattern, layout_rule, scores, dropout_seed, backend, recompute, index, operands, given):
    the call as attention_fwd's arguments after q, k, v for q on ``device`` (attention_bwd takes
    the same but recompute), the one place that spells them. A Pattern's layout_rule is unused
    (zeros)."""
    layout, backend, mods = call.layout, call.backend or "", call.mods
    scores = ([call.scale, mods.softcap, mods.dropout_p], mods.dropout_seed)
    operands = (
        ([], 0) if call.given_operands is None else (list(call.operands.present), given_bits(call))
    )
    if isinstance(layout, Pattern):
        return layout.key, [0, 0, 0, 0], *scores, backend, call.recompute, [], *operands
    index = index_tensors(layout, device)
    return "", _layout_ints(layout), *scores, backend, call.recompute, index, *operands


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
