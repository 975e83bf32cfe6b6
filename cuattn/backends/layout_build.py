"""Launch sequences that build a DeviceLayout where the scores are (kernels/layout_build.cu).

    select_topk / select_mass -> chosen uint8 [heads, nbq, nb]
    layout_count -> row_count, col_count;  layout_scan -> row_ptr, col_ptr;
    layout_fill -> col_idx, row_mask (CSR) and row_idx, col_mask (CSC)
Every buffer is sized from arguments the host already has (the budget bounds the blocks of a
row), so no launch waits for another's result on the host: the sequence can be captured in a
CUDA graph. ``impl`` is a kernel backend (cuattn.backends: "interp" on NumPy arrays, "cuda" on
CuPy arrays) and gives the array module and the launch. Buffers start poisoned (UNWRITTEN) so
that an entry a kernel fails to write cannot pass for a result on the interpreter.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from cuattn._util import ceil_div
from cuattn.backends import geometry
from cuattn.backends.geometry import LayoutKernelConfig
from cuattn.layout.device import DeviceLayout
from cuattn.layout.dynamic import VerticalSlashRule
from cuattn.layout.layout import BITS_PER_WORD, ElementRule

UNWRITTEN = -2  # poison of the int32 buffers (a valid entry is >= -1)
UNWRITTEN_BITS = 0xA5A5A5A5  # poison of the bit tables (each table the kernel writes whole)
FILL_BOTH, FILL_ROWS, FILL_COLUMNS = 0, 1, 2  # layout_fill's part (kernels/layout_build.cu)
UNCHOSEN = 255  # poison of the choice (the selection writes 0 or 1 everywhere)
INT32_LIMIT = 2**31 - 1

_budgets: dict[tuple, Any] = {}
_budgets_lock = threading.Lock()


def _score_dtype(scores: Any) -> str:
    name = np.dtype(scores.dtype).name
    if name not in geometry.SELECT_SCORE_DTYPES:
        raise TypeError(f"scores: dtype {name}; the selection takes {geometry.SELECT_SCORE_DTYPES}")
    return name


def device_budget(impl: Any, budget: np.ndarray) -> Any:
    """The per-head budget as an int32 array where the kernels read it, made once per value and
    device (a host-to-device copy cannot sit inside a CUDA graph capture; a cached one can)."""
    xp = impl.xp
    if xp is np:
        return np.ascontiguousarray(budget, dtype=np.int32)
    key = (tuple(int(b) for b in budget), int(xp.cuda.runtime.getDevice()))
    with _budgets_lock:
        if key not in _budgets:
            _budgets[key] = xp.asarray(np.asarray(budget, dtype=np.int32))
        return _budgets[key]


def _select(impl: Any, kernel: str, scores: Any, **values: Any) -> Any:
    """One selection launch over every (head, query block) row of ``scores``."""
    heads, nbq, nb = scores.shape
    config = LayoutKernelConfig(
        kernel, _score_dtype(scores), geometry.select_sort_size(nb), rows=nbq, heads=heads
    )
    chosen = impl.xp.full((heads, nbq, nb), UNCHOSEN, dtype=impl.xp.uint8)
    scores = impl.xp.ascontiguousarray(scores)
    impl.launch(config, scores=scores, chosen=chosen, nbq=nbq, nb=nb, **values)
    return chosen


def select_topk(
    impl: Any, scores: Any, budget: Any, causal: bool, keep_diagonal: bool, keep_first: int
) -> Any:
    """chosen uint8 [heads, nb, nb]: per row the forced blocks and the best others, budget[h]
    blocks at most (kernels/layout_build.cu select_topk)."""
    return _select(
        impl,
        "select_topk",
        scores,
        budget=budget,
        causal=int(causal),
        keep_diagonal=int(keep_diagonal),
        keep_first=keep_first,
    )


def select_mass(
    impl: Any,
    scores: Any,
    causal: bool,
    keep_diagonal: bool,
    scale: float,
    tau: float,
    max_blocks: int | None,
) -> Any:
    """chosen uint8 [heads, nb, nb]: per row the fewest blocks whose estimated softmax mass
    reaches tau (kernels/layout_build.cu select_mass)."""
    return _select(
        impl,
        "select_mass",
        scores,
        causal=int(causal),
        keep_diagonal=int(keep_diagonal),
        scale=scale,
        tau=tau,
        max_blocks=0 if max_blocks is None else max_blocks,
    )


def index_capacity(heads: int, nbq: int, row_capacity: int) -> int:
    """Entries of the index buffers of a layout whose rows hold at most row_capacity blocks."""
    capacity = heads * nbq * row_capacity
    if capacity > INT32_LIMIT:
        raise ValueError(
            f"the budget: heads={heads} x {nbq} query blocks x {row_capacity} blocks per row "
            f"= {capacity} entries exceed the kernels' int32 offsets; use a larger blocksize"
        )
    return capacity


def index_layout(
    impl: Any,
    chosen: Any,
    blocksize: int,
    n_ctx: int,
    causal: bool,
    row_capacity: int,
    name: str,
    vertical_slash: VerticalSlashRule | None = None,
) -> DeviceLayout:
    """The DeviceLayout of ``chosen``, whose rows hold at most ``row_capacity`` blocks; with
    ``vertical_slash`` (its tables on the device) the rule is that rule's bit tables."""
    xp = impl.xp
    heads, nbq, nb = chosen.shape
    capacity = index_capacity(heads, nbq, row_capacity)
    tables = vertical_slash is not None

    def buffer(*shape: int) -> Any:
        return xp.full(shape, UNWRITTEN, dtype=xp.int32)

    row_count, col_count = buffer(heads, nbq), buffer(heads, nb)
    index = {
        "row_ptr": buffer(heads, nbq + 1),
        "col_ptr": buffer(heads, nb + 1),
        **{
            field: buffer(max(capacity, 1))
            for field in ("col_idx", "row_mask", "row_idx", "col_mask")
        },
    }
    units = geometry.index_units(nbq, nb)
    impl.launch(
        LayoutKernelConfig("layout_count", rows=units, heads=heads),
        chosen=chosen,
        row_count=row_count,
        col_count=col_count,
        nbq=nbq,
        nb=nb,
    )
    impl.launch(
        LayoutKernelConfig("layout_scan"),
        row_count=row_count,
        row_ptr=index["row_ptr"],
        col_count=col_count,
        col_ptr=index["col_ptr"],
        heads=heads,
        nbq=nbq,
        nb=nb,
    )
    fill = {
        "chosen": chosen,
        **index,
        "entry_of": buffer(heads, nbq, nb) if tables else buffer(1),
        "nbq": nbq,
        "nb": nb,
        "blocksize": blocksize,
        "n_k": n_ctx,
        "q_offset": 0,
        "causal": int(causal),
        "capacity": capacity,
        "tables": int(tables),
    }
    fill_config = LayoutKernelConfig("layout_fill", rows=units, heads=heads)
    if not tables:
        impl.launch(fill_config, **fill, part=FILL_BOTH)
        rule = ElementRule("causal") if causal else ElementRule("none")
        return DeviceLayout(chosen, index, blocksize, n_ctx, rule, name, capacity)
    assert vertical_slash is not None
    impl.launch(fill_config, **fill, part=FILL_ROWS)
    words = ceil_div(blocksize, BITS_PER_WORD)
    mask_table = xp.full((max(capacity, 1), blocksize, words), UNWRITTEN_BITS, dtype=xp.uint32)
    is_vertical, is_slash = (xp.ascontiguousarray(t).view(xp.uint8) for t in vertical_slash.tables)
    impl.launch(
        LayoutKernelConfig("mask_vertical_slash", rows=nbq, heads=heads),
        row_ptr=index["row_ptr"],
        col_idx=index["col_idx"],
        is_vertical=is_vertical,
        is_slash=is_slash,
        mask_table=mask_table,
        row_mask=index["row_mask"],
        nbq=nbq,
        n=n_ctx,
        blocksize=blocksize,
        causal=int(causal),
    )
    impl.launch(fill_config, **fill, part=FILL_COLUMNS)
    rule = ElementRule("bitmask", mask_fn=vertical_slash)
    return DeviceLayout(chosen, index, blocksize, n_ctx, rule, name, capacity, mask_table)
