"""The attention kernels' launch sequences, shared by the CUDA and the interpreter backends.

Forward:  attn_fwd (or attn_fwd_v1, CUATTN_KERNELS=v1) over CSR rows -> (out, lse).
Backward: attn_bwd_preprocess (delta = rowsum(dO * O)); attn_bwd_dkdv over CSC columns;
          attn_bwd_dq over CSR rows. No atomics, so every backward is bit-identical run to run.
Geometry and argument order of every launch come from cuattn.backends.geometry. A subclass of
:class:`KernelBackend` says only where arrays live and how a launch runs, so the two kernel
backends cannot drift apart in what they launch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np

from cuattn.backends import geometry as kc
from cuattn.backends.geometry import KernelConfig
from cuattn.layout.layout import Layout

# The layout's index arrays every kernel backend places where its kernels read them.
LAYOUT_FIELDS = ("row_ptr", "col_idx", "row_mask", "col_ptr", "row_idx", "col_mask", "mask_table")
# cp.async and ldmatrix move 16-byte chunks: every q/k/v/out/dout row must start 16-byte aligned.
COPY_ALIGNMENT = 16
GRID_YZ_LIMIT = 65535  # CUDA's limit on grid.y (heads) and grid.z (batch)


class KernelBackend:
    """forward/backward like cuattn/backends/numpy_ref.py, through the .cu kernels.

    Subclasses provide: ``name``, ``array_kind`` (for messages), ``is_array``, ``device_of``,
    ``xp`` (NumPy or CuPy), ``output`` (an output buffer), ``index_arrays`` (the layout's index
    arrays where the kernels read them) and ``launch``.
    """

    name = "kernels"
    array_kind = "arrays"

    # -- what a subclass provides -------------------------------------------------------------

    @property
    def xp(self) -> Any:
        raise NotImplementedError

    def is_array(self, x: Any) -> bool:
        raise NotImplementedError

    def device_of(self, x: Any) -> int:
        return 0

    def data_address(self, x: Any) -> int:
        """Address of x's first element where the kernels read it."""
        raise NotImplementedError

    def output(self, shape: tuple[int, ...], dtype: Any) -> Any:
        """A buffer every element of which the kernels write."""
        raise NotImplementedError

    def index_arrays(self, layout: Layout) -> Any:
        """Object with row_ptr, col_idx, row_mask, col_ptr, row_idx, col_mask, mask_table."""
        raise NotImplementedError

    def launch(self, config: KernelConfig, **values: Any) -> None:
        raise NotImplementedError

    @contextlib.contextmanager
    def on_device_of(self, x: Any) -> Iterator[None]:
        yield

    # -- the shared part ----------------------------------------------------------------------

    def _check_inputs(self, arrays: dict[str, Any], layout: Layout) -> tuple[str, tuple]:
        """Validate before any launch (docs/design.md §7): type, device, shape, dtype, layout."""
        q = arrays["q"]
        for name, array in arrays.items():
            if not self.is_array(array):
                raise TypeError(
                    f"{name}: the {self.name} backend takes {self.array_kind}, "
                    f"got {type(array).__name__}"
                )
            if self.device_of(array) != self.device_of(q):
                raise ValueError(
                    f"{name}: on device {self.device_of(array)}, q on {self.device_of(q)}"
                )
            if array.shape != q.shape:
                raise ValueError(f"{name}: shape {array.shape} differs from q's {q.shape}")
            if array.dtype != q.dtype:
                raise TypeError(f"{name}: dtype {array.dtype} differs from q's {q.dtype}")
        if q.ndim != 4:
            raise ValueError(f"q: expected [batch, heads, n_ctx, head_dim], got shape {q.shape}")
        if np.dtype(q.dtype).name not in kc.DTYPES:
            raise TypeError(
                f"q: dtype {q.dtype} has no kernel; the kernels accept {', '.join(kc.DTYPES)}"
            )
        batch, heads, n_ctx, head_dim = q.shape
        if head_dim not in kc.HEAD_DIMS:
            raise ValueError(f"q: head_dim {head_dim} has no kernel; supported: {kc.HEAD_DIMS}")
        if layout.blocksize not in kc.BLOCK_SIZES:
            raise ValueError(
                f"layout: blocksize {layout.blocksize} has no kernel; supported: {kc.BLOCK_SIZES}"
            )
        for name, size in (("heads", heads), ("batch", batch)):
            if size > GRID_YZ_LIMIT:
                raise ValueError(
                    f"q: {name} = {size} exceeds the kernels' grid limit of {GRID_YZ_LIMIT}; "
                    f"split the call into chunks of at most {GRID_YZ_LIMIT} {name}"
                )
        if layout.heads != heads or layout.n_ctx != n_ctx:
            raise ValueError(
                f"layout: built for heads={layout.heads}, n_ctx={layout.n_ctx}; "
                f"q has heads={heads}, n_ctx={n_ctx}"
            )
        return kc.dtype_name(q.dtype), tuple(q.shape)

    def _check_alignment(self, arrays: dict[str, Any]) -> None:
        """A contiguous view at an element offset (``flat[1:].reshape(...)``) passes every
        shape check but faults a GPU's 16-byte copies; refuse it before any launch."""
        for name, array in arrays.items():
            address = self.data_address(array)
            if address % COPY_ALIGNMENT:
                raise ValueError(
                    f"{name}: data starts at an address {address % COPY_ALIGNMENT} bytes past a "
                    f"{COPY_ALIGNMENT}-byte boundary (a view at an element offset?); the kernels "
                    f"copy {COPY_ALIGNMENT}-byte chunks. Pass a copy: x.clone() (torch), "
                    "np.array(x) or cupy.array(x) (ascontiguousarray returns such a view "
                    "unchanged)"
                )

    def _layout_values(self, layout: Layout, columns: bool) -> dict[str, Any]:
        index = self.index_arrays(layout)
        if columns:
            ptr, idx, mask = index.col_ptr, index.row_idx, index.col_mask
        else:
            ptr, idx, mask = index.row_ptr, index.col_idx, index.row_mask
        return {
            "ptr": ptr,
            "idx": idx,
            "mask": mask,
            "mask_table": index.mask_table,
            "num_blocks": layout.num_blocks,
            "window_left": layout.rule.window_left,
            "window_right": layout.rule.window_right,
        }

    def forward(self, q: Any, k: Any, v: Any, layout: Layout, scale: float) -> tuple[Any, Any]:
        dtype, shape = self._check_inputs({"q": q, "k": k, "v": v}, layout)
        batch, heads, n_ctx, head_dim = shape
        kernel = kc.forward_kernel()
        if kernel == "attn_fwd_v1" and head_dim not in kc.V1_HEAD_DIMS:
            raise ValueError(
                f"q: head_dim {head_dim} has no kernel of the v1 forward ({kc.KERNELS_ENV}=v1); "
                f"v1 supports {kc.V1_HEAD_DIMS}, the default generation {kc.HEAD_DIMS}"
            )
        xp = self.xp
        with self.on_device_of(q):
            q, k, v = (xp.ascontiguousarray(x) for x in (q, k, v))
            self._check_alignment({"q": q, "k": k, "v": v})
            out = self.output(shape, q.dtype)
            lse = self.output((batch, heads, n_ctx), xp.float32)
            config = KernelConfig(
                kernel,
                head_dim,
                dtype,
                batch,
                heads,
                n_ctx,
                layout.blocksize,
                layout.rule.kind,
            )
            self.launch(
                config,
                q=q,
                k=k,
                v=v,
                out=out,
                lse=lse,
                n_ctx=n_ctx,
                scale=scale,
                **self._layout_values(layout, columns=False),
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
        layout: Layout,
        scale: float,
        deterministic: bool = False,
    ) -> tuple[Any, Any, Any]:
        """(dq, dk, dv), bit-identical across runs whatever ``deterministic`` says.

        dQ is its own pass over the CSR rows: on an H100 that measured 1.2-2.5x faster than
        adding it with fp32 atomics inside the dK/dV kernel (bench/results/2026-11-23-h100/),
        so the deterministic sequence is the only one; ``deterministic`` stays in the Backend
        protocol for backends whose fast path is not.
        """
        arrays = {"q": q, "k": k, "v": v, "out": out, "dout": dout}
        dtype, shape = self._check_inputs(arrays, layout)
        batch, heads, n_ctx, head_dim = shape
        xp = self.xp
        if not self.is_array(lse) or lse.shape != (batch, heads, n_ctx) or lse.dtype != xp.float32:
            raise ValueError(
                f"lse: expected float32 {(batch, heads, n_ctx)} {self.array_kind} (as the forward "
                f"returns it), got {type(lse).__name__} {getattr(lse, 'dtype', '')} "
                f"{getattr(lse, 'shape', '')}"
            )
        with self.on_device_of(q):
            q, k, v, out, dout, lse = (xp.ascontiguousarray(x) for x in (q, k, v, out, dout, lse))
            self._check_alignment({"q": q, "k": k, "v": v, "out": out, "dout": dout})
            common = {"n_ctx": n_ctx, "scale": scale}
            geometry = (head_dim, dtype, batch, heads, n_ctx)
            delta = self.output((batch, heads, n_ctx), xp.float32)
            self.launch(
                KernelConfig("attn_bwd_preprocess", *geometry),
                out=out,
                dout=dout,
                delta=delta,
                n_ctx=n_ctx,
            )
            dq, dk, dv = (self.output(shape, q.dtype) for _ in range(3))
            tensors = {"q": q, "k": k, "v": v, "dout": dout, "lse": lse, "delta": delta}
            rule = layout.rule.kind
            self.launch(
                KernelConfig("attn_bwd_dkdv", *geometry, block=layout.blocksize, rule=rule),
                **tensors,
                dk=dk,
                dv=dv,
                **common,
                **self._layout_values(layout, columns=True),
            )
            self.launch(
                KernelConfig("attn_bwd_dq", *geometry, block=layout.blocksize, rule=rule),
                **tensors,
                dq=dq,
                **common,
                **self._layout_values(layout, columns=False),
            )
        return dq, dk, dv
