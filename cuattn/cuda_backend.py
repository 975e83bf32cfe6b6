"""The "cuda" backend: forward and backward on CuPy arrays through the .cu kernels.

Same contract as cuattn/reference.py (computed token order, [batch, heads, n_ctx, head_dim]);
every launch's geometry and argument order come from cuattn.kernel_config, exactly as the CPU
interpreter's do, so the two kernel backends can only differ in where the code runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cuattn import kernel_config as kc
from cuattn.kernel_config import KernelConfig
from cuattn.runtime import KERNELS, LAYOUTS, LayoutArrays, _cupy

_SCALAR_TYPES = {"i32": np.int32, "f32": np.float32}


def launch(config: KernelConfig, **values: Any) -> None:
    """One launch on the current device and CuPy stream; `values` names every kernel argument."""
    args = []
    for name, kind in config.args:
        value = values[name]
        if kind == "ptr":
            if not value.flags.c_contiguous:
                raise AssertionError(f"{config.name_expression}: {name} is not contiguous")
            args.append(value)
        else:
            args.append(_SCALAR_TYPES[kind](value))
    kernel = KERNELS.kernel(config.source_file, config.name_expression, config.smem_bytes)
    kernel(config.grid, config.block_dims, tuple(args), shared_mem=config.smem_bytes)


def _check_inputs(arrays: dict[str, Any], layout: Any) -> tuple[str, tuple[int, ...]]:
    """Validate before any launch (DESIGN.md §7): type, device, shape, dtype, layout fit."""
    cupy = _cupy()
    q = arrays["q"]
    for name, array in arrays.items():
        if not isinstance(array, cupy.ndarray):
            raise TypeError(
                f"{name}: the cuda backend takes CuPy arrays, got {type(array).__name__}"
            )
        if array.device.id != q.device.id:
            raise ValueError(f"{name}: on device {array.device.id}, q on {q.device.id}")
        if array.shape != q.shape:
            raise ValueError(f"{name}: shape {array.shape} differs from q's {q.shape}")
        if array.dtype != q.dtype:
            raise TypeError(f"{name}: dtype {array.dtype} differs from q's {q.dtype}")
    if q.ndim != 4:
        raise ValueError(f"q: expected [batch, heads, n_ctx, head_dim], got shape {q.shape}")
    dtype = kc.dtype_name(q.dtype)
    batch, heads, n_ctx, head_dim = q.shape
    if head_dim not in kc.HEAD_DIMS:
        raise ValueError(f"q: head_dim {head_dim} has no kernel; supported: {kc.HEAD_DIMS}")
    if layout.blocksize not in kc.BLOCK_SIZES:
        raise ValueError(
            f"layout: blocksize {layout.blocksize} has no kernel; supported: {kc.BLOCK_SIZES}"
        )
    if layout.heads != heads or layout.n_ctx != n_ctx:
        raise ValueError(
            f"layout: built for heads={layout.heads}, n_ctx={layout.n_ctx}; "
            f"q has heads={heads}, n_ctx={n_ctx}"
        )
    return dtype, q.shape


def _layout_values(layout: Any, arrays: LayoutArrays, columns: bool) -> dict[str, Any]:
    rule = layout.rule
    if columns:
        ptr, idx, mask = arrays.col_ptr, arrays.row_idx, arrays.col_mask
    else:
        ptr, idx, mask = arrays.row_ptr, arrays.col_idx, arrays.row_mask
    return {
        "ptr": ptr,
        "idx": idx,
        "mask": mask,
        "mask_table": arrays.mask_table,
        "num_blocks": layout.num_blocks,
        "window_left": rule.window_left,
        "window_right": rule.window_right,
    }


class CudaBackend:
    """forward/backward like cuattn/reference.py, on the GPU."""

    name = "cuda"

    def forward(self, q: Any, k: Any, v: Any, layout: Any, scale: float) -> tuple[Any, Any]:
        cupy = _cupy()
        dtype, shape = _check_inputs({"q": q, "k": k, "v": v}, layout)
        batch, heads, n_ctx, head_dim = shape
        with q.device:
            q, k, v = (cupy.ascontiguousarray(x) for x in (q, k, v))
            out = cupy.empty(shape, dtype=q.dtype)
            lse = cupy.empty((batch, heads, n_ctx), dtype=cupy.float32)
            config = KernelConfig(
                "attn_fwd",
                head_dim,
                dtype,
                batch,
                heads,
                n_ctx,
                layout.blocksize,
                layout.rule.kind,
            )
            launch(
                config,
                q=q,
                k=k,
                v=v,
                out=out,
                lse=lse,
                n_ctx=n_ctx,
                scale=scale,
                **_layout_values(layout, LAYOUTS.get(layout), columns=False),
            )
        return out, lse

    def backward(
        self,
        q: Any,
        k: Any,
        v: Any,
        out: Any,
        lse: Any,
        dout: Any,
        layout: Any,
        scale: float,
        deterministic: bool = False,
    ) -> tuple[Any, Any, Any]:
        """(dq, dk, dv). dQ by fp32 atomics, or with `deterministic=True` by a separate pass
        over the CSR rows (bit-identical across runs)."""
        cupy = _cupy()
        dtype, shape = _check_inputs({"q": q, "k": k, "v": v, "out": out, "dout": dout}, layout)
        batch, heads, n_ctx, head_dim = shape
        if lse.shape != (batch, heads, n_ctx) or lse.dtype != cupy.float32:
            raise ValueError(
                f"lse: expected float32 {(batch, heads, n_ctx)}, got {lse.dtype} {lse.shape}"
            )
        with q.device:
            q, k, v, out, dout, lse = (cupy.ascontiguousarray(x) for x in (q, k, v, out, dout, lse))
            arrays = LAYOUTS.get(layout)
            common = {"n_ctx": n_ctx, "scale": scale}
            geometry = (head_dim, dtype, batch, heads, n_ctx)
            delta = cupy.empty((batch, heads, n_ctx), dtype=cupy.float32)
            launch(
                KernelConfig("attn_bwd_preprocess", *geometry),
                out=out,
                dout=dout,
                delta=delta,
                n_ctx=n_ctx,
            )
            dq = cupy.empty(shape, dtype=q.dtype)
            dk = cupy.empty(shape, dtype=q.dtype)
            dv = cupy.empty(shape, dtype=q.dtype)
            # The atomics path accumulates dQ in fp32; the deterministic path never touches it.
            dq_accum = cupy.zeros(shape if not deterministic else (1,), dtype=cupy.float32)
            tensors = {"q": q, "k": k, "v": v, "dout": dout, "lse": lse, "delta": delta}
            rule = layout.rule.kind
            launch(
                KernelConfig("attn_bwd_dkdv", *geometry, block=layout.blocksize, rule=rule),
                **tensors,
                dq_accum=dq_accum,
                dk=dk,
                dv=dv,
                compute_dq=0 if deterministic else 1,
                **common,
                **_layout_values(layout, arrays, columns=True),
            )
            if deterministic:
                launch(
                    KernelConfig("attn_bwd_dq", *geometry, block=layout.blocksize, rule=rule),
                    **tensors,
                    dq=dq,
                    **common,
                    **_layout_values(layout, arrays, columns=False),
                )
            else:
                launch(
                    KernelConfig("attn_bwd_dq_convert", *geometry),
                    dq_accum=dq_accum,
                    dq=dq,
                    **common,
                )
        return dq, dk, dv
