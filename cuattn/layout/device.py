"""DeviceLayout: a Layout whose index arrays live where they were made, read in place.

Two kinds of code make one. The dynamic selection rules (cuattn.dynamic) build their layouts on
the device of q with the kernels of kernels/layout_build.cu: the chosen blocks, CSR (forward, dQ)
and CSC (dK, dV) stay there, in buffers sized from the budget, so nothing about the choice comes
back to the host and the whole construction can sit in a CUDA graph. And a framework op that
takes only arrays (the torch custom ops) receives any layout as its arrays and reads them back
as a DeviceLayout (:meth:`DeviceLayout.from_arrays`, no copy). The arrays are CuPy arrays (CUDA)
or NumPy arrays (the CPU: the NumPy backend or the kernel interpreter); the attention backends
read them in place, on every route (tape, torch, jax).

Semantics are a Layout's (cuattn/layout/layout.py) with the element rule ``none``, ``causal``,
``window`` or ``bitmask`` (the rule's bits read from the layout's own mask table: one row per
block that needs one, indexed by ``row_mask``); the differences are where the arrays live:
    blocks      bool [heads, nbq, nb] on the device (a view of the kernels' choice)
    row_ptr, col_ptr   int32 on the device, exact; col_idx, row_mask, row_idx, col_mask are
                buffers of ``capacity`` entries of which the first row_ptr[-1, -1] are the layout
    nnz         int64 [heads] on the device: the blocks each head received
    density     a float: reading it waits for the device (it is a host value)
    perm        the token permutation (or None), an int64 array beside the others
What needs the whole layout on the host (``to_mask``, ``picture``, ``allowed``, ``repr``,
``density_at``, ``row_entries``) goes through :meth:`host`, an explicit copy (a synchronisation
on CUDA), made once.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import numpy as np

from cuattn._util import array_module, ceil_div, host_array
from cuattn.layout.layout import (
    BITS_PER_WORD,
    FULL_BLOCK,
    PICTURE_MAX_WIDTH,
    ElementRule,
    Layout,
)

DEVICE_RULES = ("none", "causal", "window", "bitmask")
INDEX_FIELDS = ("row_ptr", "col_idx", "row_mask", "col_ptr", "row_idx", "col_mask")
OFF_BLOCK = -2  # TableRule: a block that is not active


class TableRule:
    """allowed(h, q, k) read back from a layout's own arrays (computed order, q the query's
    row): every element of an active block whose ``row_mask`` entry is -1, else the block's bit
    in ``mask_table``; nothing outside the active blocks. What a layout that crossed an op as
    arrays keeps of its bitmask rule; host copies are made the first time it is evaluated."""

    def __init__(self, arrays: dict[str, Any], blocksize: int) -> None:
        self._arrays = arrays
        self._blocksize = int(blocksize)
        self._tables: tuple[np.ndarray, np.ndarray, int] | None = None

    def _host_tables(self) -> tuple[np.ndarray, np.ndarray, int]:
        if self._tables is None:
            arrays = self._arrays
            off = ~host_array(arrays["blocks"]).astype(bool)
            heads, nbq, _ = off.shape
            row_ptr = host_array(arrays["row_ptr"]).astype(np.int64)
            col_idx, row_mask = host_array(arrays["col_idx"]), host_array(arrays["row_mask"])
            # per block: OFF_BLOCK, FULL_BLOCK (all of it allowed) or its mask-table row
            entry = np.full(off.shape, OFF_BLOCK, dtype=np.int64)
            for h in range(heads):
                lo, hi = int(row_ptr[h, 0]), int(row_ptr[h, -1])
                rows = np.repeat(np.arange(nbq), np.diff(row_ptr[h]))
                entry[h, rows, col_idx[lo:hi]] = row_mask[lo:hi]
            self._tables = (entry, host_array(arrays["mask_table"]), self._blocksize)
        return self._tables

    def __call__(self, h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        entry, table, b = self._host_tables()
        h, q, k = np.broadcast_arrays(*(np.asarray(x, dtype=np.int64) for x in (h, q, k)))
        row = entry[h, q // b, k // b]
        masked = row >= 0
        col = k % b
        words = table[np.where(masked, row, 0), q % b, col // BITS_PER_WORD] if table.size else 0
        bit = (np.asarray(words, dtype=np.int64) >> (col % BITS_PER_WORD)) & 1
        return (row == FULL_BLOCK) | (masked & (bit == 1))


class DeviceLayout(Layout):
    """A block layout whose arrays stay where they were made (a CUDA device or the host).

    A Layout's semantics with the arrays read in place; what needs the whole layout on the host
    (``to_mask``, ``picture``, ``allowed``, ``repr``) goes through :meth:`host`, an explicit
    copy. Built by :mod:`cuattn.dynamic` (docs/patterns.md, section "Layouts chosen from the
    data"), or read back from a layout's arrays by :meth:`from_arrays`; not usually constructed
    by hand.

    Args:
        chosen (array): bool or uint8 [heads, nbq, nb] on the device: the active blocks.
        index (dict): the six index arrays ``row_ptr``, ``col_idx``, ``row_mask``,
            ``col_ptr``, ``row_idx``, ``col_mask`` (int32; the four entry arrays are buffers of
            ``capacity`` entries), NumPy or CuPy.
        blocksize (int): the block size.
        n_ctx (int): the keys.
        rule (ElementRule): kind ``none``, ``causal``, ``window`` or ``bitmask``.
        name (str): the layout's name in its repr.
        capacity (int): the entries the index buffers hold.
        mask_table (array, optional): uint32 [n_masks, b, ceil(b / 32)], exactly when the rule
            is ``bitmask``.
        n_q (int, optional): the queries, end-aligned; None (default) is n_ctx. Keyword only.
        perm (array, optional): int64 [n_ctx] token permutation (square layouts only).

    Raises:
        ValueError: a rule kind a device layout does not take; ``chosen``'s shape unlike
            [heads, ceil(n_q / b), ceil(n_ctx / b)]; ``perm`` with n_q != n_ctx; a mask table
            given without a bitmask rule or missing with one.
    """

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
        *,
        n_q: int | None = None,
        perm: Any = None,
    ) -> None:
        if rule.kind not in DEVICE_RULES:
            raise ValueError(f"rule: a device layout takes {DEVICE_RULES}, got {rule.kind!r}")
        n_q = n_ctx if n_q is None else int(n_q)
        heads, nbq, nb = chosen.shape
        if ceil_div(n_q, blocksize) != nbq or ceil_div(n_ctx, blocksize) != nb:
            raise ValueError(
                f"chosen: shape {tuple(chosen.shape)} is not [heads, nbq, nb] with "
                f"nbq = ceil(n_q={n_q} / blocksize={blocksize}) and "
                f"nb = ceil(n_ctx={n_ctx} / blocksize={blocksize})"
            )
        if perm is not None and n_q != n_ctx:
            raise ValueError(
                f"perm: a permuted layout must be square, got n_q={n_q}, n_ctx={n_ctx}"
            )
        self.rule = rule
        self.blocksize = int(blocksize)
        self.heads = int(heads)
        self.n_ctx, self.n_q = int(n_ctx), n_q
        self.q_offset = self.n_ctx - self.n_q
        self.num_blocks, self.num_q_blocks = int(nb), int(nbq)
        self.name = name
        self.perm = perm
        self.capacity = int(capacity)
        self.blocks = chosen.view(bool)
        for field in INDEX_FIELDS:
            setattr(self, field, index[field])
        # Plain attributes, not properties: every launch asks where the layout lives.
        self.array_module: Any = array_module(self.row_ptr)  # of the index arrays
        on_host = self.array_module is np
        # the CUDA device of the arrays, None on the host
        self.device: int | None = None if on_host else int(self.row_ptr.device.id)
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

    @classmethod
    def from_arrays(
        cls,
        arrays: dict[str, Any],
        blocksize: int,
        n_q: int,
        n_ctx: int,
        rule_kind: str,
        window: tuple[int, int] = (0, 0),
        name: str = "arrays",
    ) -> DeviceLayout:
        """The layout whose arrays these are, read in place (no copy).

        Args:
            arrays (dict): ``blocks`` (bool [heads, nbq, nb]), the six index arrays,
                ``mask_table`` (bitmask rules) and ``perm`` (absent or None when not permuted).
            blocksize (int): the block size.
            n_q (int): the queries.
            n_ctx (int): the keys.
            rule_kind (str): ``none``, ``causal``, ``window`` or ``bitmask`` (its bits read from
                ``mask_table``).
            window (tuple[int, int]): the window rule's (left, right) bounds (default (0, 0)).
            name (str): the layout's name in its repr (default ``"arrays"``).

        Returns:
            DeviceLayout: over the given arrays.

        Raises:
            KeyError: an array the rule needs is missing from ``arrays``.
            ValueError: as :class:`DeviceLayout`.
        """
        bitmask = rule_kind == "bitmask"
        if bitmask:
            rule = ElementRule("bitmask", mask_fn=TableRule(arrays, blocksize))
        else:
            rule = ElementRule(rule_kind, *window)
        return cls(
            arrays["blocks"],
            {field: arrays[field] for field in INDEX_FIELDS},
            blocksize,
            n_ctx,
            rule,
            name,
            int(arrays["col_idx"].shape[0]),
            arrays["mask_table"] if bitmask else None,
            n_q=n_q,
            perm=arrays.get("perm"),
        )

    @property
    def density(self) -> float:  # type: ignore[override]
        """Share of the blocks that are active (a host value: waits for the device)."""
        return float(host_array(self.nnz).sum()) / (
            self.heads * self.num_q_blocks * self.num_blocks
        )

    def kernel_arrays(self) -> SimpleNamespace:
        """The index arrays as the attention kernels take them.

        Returns:
            types.SimpleNamespace: the six index arrays and ``mask_table`` (never empty: a
            one-word placeholder when the rule reads none).
        """
        fields = {field: getattr(self, field) for field in INDEX_FIELDS}
        return SimpleNamespace(**fields, mask_table=self._table_pointer)

    def host(self) -> Layout:
        """The same layout with its arrays on the host (copied once; on CUDA, a sync).

        Returns:
            Layout: a host Layout equal to this one.
        """
        if self._host is None:
            perm = None if self.perm is None else host_array(self.perm)
            self._host = Layout(
                host_array(self.blocks),
                self.blocksize,
                self.n_ctx,
                rule=self.rule,
                perm=perm,
                name=self.name,
                n_q=self.n_q,
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
