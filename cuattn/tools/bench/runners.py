"""What the benchmark times: cuattn, torch SDPA (flash, cuDNN), FlexAttention under torch.compile.

A runner's `prepare(case, layout, inputs, scale)` returns a function of the run index that does
one forward (or forward + backward) on input set `index % len(inputs)`, or raises Skip with the
reason the runner cannot serve that case. Inputs are torch tensors on the GPU and NumPy arrays in
the CPU dry run; every runner works in the layout's computed token order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cuattn.backends.call import AttentionCall
from cuattn.tools.bench.cases import BenchCase

RunFn = Callable[[int], Any]


class Skip(Exception):
    """This runner cannot serve this case; the message says why (it goes into the report)."""


@dataclass
class InputSet:
    q: Any
    k: Any
    v: Any
    dout: Any


class CuattnRunner:
    """Our kernels through a cuattn backend (`cuda` on GPU, `numpy`/`interp` in the dry run)."""

    def __init__(self, backend: Any, to_backend_array: Callable[[Any], Any]) -> None:
        self.name = f"cuattn-{backend.name}"
        self.backend = backend
        self._convert = to_backend_array

    def prepare(
        self, case: BenchCase, layout: Any, inputs: Sequence[InputSet], scale: float
    ) -> RunFn:
        sets = [InputSet(*(self._convert(x) for x in (s.q, s.k, s.v, s.dout))) for s in inputs]
        backend, backward = self.backend, case.direction != "fwd"
        call = AttentionCall(layout, scale)

        def run(index: int) -> Any:
            s = sets[index % len(sets)]
            out, lse = backend.forward(s.q, s.k, s.v, call)
            if backward:
                return backend.backward(s.q, s.k, s.v, out, lse, s.dout, None, call)
            return out

        return run


def _torch_leaves(inputs: Sequence[InputSet], backward: bool) -> list[InputSet]:
    return [
        InputSet(*(x.detach().requires_grad_(backward) for x in (s.q, s.k, s.v)), s.dout)
        for s in inputs
    ]


def _torch_run(attend: Callable[[Any, Any, Any], Any], sets: list[InputSet], backward: bool):
    import torch

    def run(index: int) -> Any:
        s = sets[index % len(sets)]
        out = attend(s.q, s.k, s.v)
        if backward:
            return torch.autograd.grad(out, (s.q, s.k, s.v), s.dout)
        return out

    return run


class SdpaRunner:
    """torch.nn.functional.scaled_dot_product_attention pinned to one backend (dense cases)."""

    def __init__(self, backend_name: str) -> None:
        self.backend_name = backend_name  # "FLASH_ATTENTION" | "CUDNN_ATTENTION"
        self.name = f"sdpa-{backend_name.split('_')[0].lower()}"

    def prepare(
        self, case: BenchCase, layout: Any, inputs: Sequence[InputSet], scale: float
    ) -> RunFn:
        if not case.pattern.dense:
            raise Skip("SDPA has no block-sparse mask; measured on dense cases only")
        import torch
        import torch.nn.functional as F

        try:
            from torch.nn.attention import SDPBackend, sdpa_kernel
        except ImportError as exc:
            raise Skip(f"torch {torch.__version__} has no torch.nn.attention.sdpa_kernel") from exc
        backend = getattr(SDPBackend, self.backend_name, None)
        if backend is None:
            raise Skip(f"torch {torch.__version__} has no SDPBackend.{self.backend_name}")
        causal, gqa = case.pattern.causal, case.kv != case.heads

        def attend(q: Any, k: Any, v: Any) -> Any:
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(
                    q, k, v, is_causal=causal, scale=scale, **({"enable_gqa": True} if gqa else {})
                )

        backward = case.direction != "fwd"
        run = _torch_run(attend, _torch_leaves(inputs, backward), backward)
        try:
            run(0)
        except RuntimeError as exc:  # "No available kernel" for this dtype/shape/GPU
            raise Skip(f"{self.name} cannot run this case: {str(exc).splitlines()[0]}") from exc
        return run


# Every (rule kind, head dim, dtype, direction) is its own graph: the full sweep compiles a few
# dozen, far above dynamo's default limit, past which it would silently fall back to eager.
DYNAMO_RECOMPILE_LIMIT = 1024


@functools.cache
def _compiled_flex() -> Any:
    import torch
    import torch._dynamo
    from torch.nn.attention.flex_attention import flex_attention

    for limit in ("recompile_limit", "cache_size_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, DYNAMO_RECOMPILE_LIMIT)
    # dynamic=True: one compile serves every T (the sweep has five); FlexAttention's kernel is a
    # template with fixed tiles either way. Compile time stays out of the timed runs.
    return torch.compile(flex_attention, dynamic=True)


class FlexRunner:
    """FlexAttention under torch.compile with a BlockMask built from the very same layout."""

    name = "flex"

    def prepare(
        self, case: BenchCase, layout: Any, inputs: Sequence[InputSet], scale: float
    ) -> RunFn:
        import torch

        try:
            import torch.nn.attention.flex_attention  # noqa: F401
        except ImportError as exc:
            raise Skip(f"torch {torch.__version__} has no FlexAttention") from exc
        from cuattn.tools.bench.flex_mask import block_mask_from_layout

        device = inputs[0].q.device
        block_mask = block_mask_from_layout(layout, device)
        flex = _compiled_flex()

        gqa = case.kv != case.heads

        def attend(q: Any, k: Any, v: Any) -> Any:
            return flex(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=gqa)

        backward = case.direction != "fwd"
        return _torch_run(attend, _torch_leaves(inputs, backward), backward)


def peer_runners() -> list[Any]:
    return [SdpaRunner("FLASH_ATTENTION"), SdpaRunner("CUDNN_ATTENTION"), FlexRunner()]
