"""DeviceLayout: a Layout whose index arrays live where the kernels that built them ran.

The dynamic selection rules (cuattn.dynamic) build their layouts on the device of q with the
kernels of kernels/layout_build.cu: the chosen blocks, CSR (forward, dQ) and CSC (dK, dV) stay
there, in buffers sized from the budget, so nothing about the choice comes back to the host and
the whole construction can sit in a CUDA graph. The arrays are CuPy arrays (CUDA inputs) or
NumPy arrays (NumPy inputs on the CPU kernel interpreter); the attention backends read them in
place, on every route (tape, torch, jax).

Semantics are a Layout's (cuattn/layout/layout.py) for a square layout with the element rule
``none``, ``causal`` or ``bitmask`` (vertical-slash: one bit table per active block that needs
one, indexed by its CSR entry, not shared as the host's deduplicated tables are); the
differences are where the arrays live:
    blocks      bool [heads, nbq, nb] on the device (a view of the kernels' choice)
    row_ptr, col_ptr   int32 on the device, exact; col_idx, row_mask, row_idx, col_mask are
                buffers of ``capacity`` entries of which the first row_ptr[-1, -1] are the layout
    nnz         int64 [heads] on the device: the blocks each head received
    density     a float: reading it waits for the device (it is a host value)
What needs the whole layout on the host (``to_mask``, ``picture``, ``allowed``, ``repr``,
``density_at``, ``row_entries``) goes through :meth:`host`, an explicit copy (a synchronisation
on CUDA), made once.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from cuattn._util import ceil_div, host_array
from cuattn.layout.layout import BITS_PER_WORD, PICTURE_MAX_WIDTH, ElementRule, Layout

DEVICE_RULES = ("none", "causal", "bitmask")
INDEX_FIELDS = ("row_ptr", "col_idx", "row_mask", "col_ptr", "row_idx", "col_mask")


class DeviceLayout(Layout):
    """A square block layout built on a device; see the module doc. Built by cuattn.dynamic."""

    def __init__(
        self,
        chosen: Any,
        index: dict[str, Any],
        blocksize: int,
        n_ctx: int,
        rule: ElementRule,
        name: str,
        capacity: int,
        mask_table: Any = None,
    ) -> None:
        if rule.kind not in DEVICE_RULES:
            raise ValueError(f"rule: a device layout takes {DEVICE_RULES}, got {rule.kind!r}")
        heads, nbq, nb = chosen.shape
        if nbq != nb or ceil_div(n_ctx, blocksize) != nb:
            raise ValueError(
                f"chosen: shape {tuple(chosen.shape)} is not [heads, nb, nb] with "
                f"nb = ceil(n_ctx={n_ctx} / blocksize={blocksize})"
            )
        self.rule = rule
        self.blocksize = int(blocksize)
        self.heads = int(heads)
        self.n_ctx = self.n_q = int(n_ctx)
        self.q_offset = 0
        self.num_blocks = self.num_q_blocks = int(nb)
        self.name = name
        self.perm = None
        self.capacity = int(capacity)
        self.blocks = chosen.view(bool)
        for field in INDEX_FIELDS:
            setattr(self, field, index[field])
        xp = self.array_module
        words = ceil_div(self.blocksize, BITS_PER_WORD)
        if (rule.kind == "bitmask") != (mask_table is not None):
            raise ValueError("mask_table: a device layout has one exactly when its rule is bitmask")
        if mask_table is None:
            mask_table = xp.zeros((0, self.blocksize, words), dtype=xp.uint32)
        self.mask_table = mask_table
        # The kernels take a valid pointer for the table even when the rule never reads it.
        self._table_pointer = mask_table if mask_table.size else xp.zeros(1, dtype=xp.uint32)
        self.nnz = (self.row_ptr[:, -1] - self.row_ptr[:, 0]).astype(xp.int64)
        if xp is np:
            for arr in (self.blocks, self.nnz, *(index[f] for f in INDEX_FIELDS)):
                arr.setflags(write=False)
        self._host: Layout | None = None
        # The same arrays as tensors of the framework the layout was chosen from (torch), set
        # by the builder: handed to a compiled graph as inputs, a new layout every step does not
        # make it re-trace.
        self.views: dict[str, Any] | None = None
        self._register()

    @property
    def array_module(self) -> Any:
        """numpy or cupy: the module of the index arrays."""
        if isinstance(self.row_ptr, np.ndarray):
            return np
        import cupy

        return cupy

    @property
    def device(self) -> int | None:
        """The CUDA device of the index arrays, None for NumPy arrays."""
        return None if self.array_module is np else int(self.row_ptr.device.id)

    @property
    def density(self) -> float:  # type: ignore[override]
        """Share of the blocks that are active (a host value: waits for the device)."""
        return float(host_array(self.nnz).sum()) / (
            self.heads * self.num_q_blocks * self.num_blocks
        )

    def kernel_arrays(self) -> SimpleNamespace:
        """The index arrays as the attention kernels take them (mask_table never empty)."""
        fields = {field: getattr(self, field) for field in INDEX_FIELDS}
        return SimpleNamespace(**fields, mask_table=self._table_pointer)

    def host(self) -> Layout:
        """The same layout with its arrays on the host (copied once; on CUDA, a sync)."""
        if self._host is None:
            self._host = Layout(
                host_array(self.blocks), self.blocksize, self.n_ctx, rule=self.rule, name=self.name
            )
        return self._host

    def to_mask(self) -> np.ndarray:
        return self.host().to_mask()

    def allowed(
        self, h: np.ndarray, q: np.ndarray, k: np.ndarray, natural: bool = True
    ) -> np.ndarray:
        return self.host().allowed(h, q, k, natural)

    def density_at(self, blocksize: int) -> float:
        return self.host().density_at(blocksize)

    def row_entries(self, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.host().row_entries(h)

    def picture(
        self,
        max_width: int = PICTURE_MAX_WIDTH,
        natural: bool = True,
        heads: Sequence[int] | None = None,
    ) -> str:
        return self.host().picture(max_width, natural, heads)

    def __repr__(self) -> str:
        where = "cpu" if self.device is None else f"cuda:{self.device}"
        return f"Device{self.host()!r}".replace(")\n", f", on {where})\n", 1)
