"""Launch sequences that build a DeviceLayout where the scores are (kernels/layout_build.cu).

    select_topk / select_mass -> chosen uint8 [heads, nbq, nb]
    layout_count -> row_count, col_count;  layout_scan -> row_ptr, col_ptr;
    layout_fill -> col_idx, row_mask (CSR) and row_idx, col_mask (CSC)
and, for the sm_90a kernels, the schedules of a device layout (sm90_work_list: the persistent
forward's work list; sm90_backward_order: the backward's claim order and dQ ranks), equal to what
the host builds from a host layout.
Every buffer is sized from arguments the host already has (the budget bounds the blocks of a
row), so no launch waits for another's result on the host: the sequence can be captured in a
CUDA graph. ``impl`` is a kernel backend (cuattn.backends: "interp" on NumPy arrays, "cuda" on
CuPy arrays) and gives the array module and the launch. Buffers start poisoned (UNWRITTEN) so
that an entry a kernel fails to write cannot pass for a result on the interpreter.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
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


# ---- the sm_90a kernels' schedules of a device layout (kernels/layout_build.cu) ---------------

ENTRY_FIELDS = 11  # sm90_work_fill's entries (kernels/layout_build.cu EntryField)
WEIGHT_LIMIT = 2**21  # each of an entry's sort weights (walk, computed, tile) stays below


@dataclass(frozen=True)
class DeviceWorkList:
    """geometry.sm90_work_list of a device layout, where the layout lives, in buffers sized from
    shapes: ``items`` int32 [num_items, SM90_WORK_FIELDS] holds the list at its END, and
    ``work_counter`` (int32 [1]) starts at its first entry, so that a persistent launch with
    ``num_items`` claims exactly the list; ``merges`` int32 [num_merges, SM90_MERGE_FIELDS]
    holds the split rows' merges first, then entries of no chunks; ``slots`` bounds the partial
    slots the chunks write; ``split_tiles`` int32 [1] is the threshold the device chose. A host
    list (kernels.KernelBackend._sm90_work) fills the same fields exactly: its own entries,
    counts and threshold (an int)."""

    items: Any
    work_counter: Any
    merges: Any
    split_tiles: Any
    num_items: int
    num_merges: int
    slots: int


def work_list_bounds(
    units: int, batch: int, sms: int = geometry.SM90_SMS, max_slots: int | None = None
) -> tuple[int, int, int]:
    """(entries, merges, slots) a device-built work list of ``units`` (head, query tile) items
    a batch holds at most. A unit is split when it walks more than the threshold, into
    ceil(walked / threshold) chunks, so the chunks beyond the first sum to under a batch's
    walked tiles over the threshold, and fewer units than that are split. The threshold is at
    least SM90_SPLIT_FACTOR x the mean unit's key tiles (under units / SM90_SPLIT_FACTOR
    chunks beyond the first) or, where batch x units < ``sms``, the launch's walked tiles over
    ``sms`` (under sms / batch: geometry.sm90_split_tiles). The launch's chunks write at most
    ``max_slots`` slots (None: geometry.sm90_split_slots(sms)), so at most half as many rows
    are split and as many chunks are beyond the first."""
    cap = geometry.sm90_split_slots(sms) if max_slots is None else max_slots
    split = units // geometry.SM90_SPLIT_FACTOR
    if batch * units < sms:
        split = max(split, sms // batch)
    return (
        batch * units + min(batch * split, cap),
        min(batch * split, cap // 2),
        min(batch * 2 * split, cap),
    )


def work_list_fits(num_q_blocks: int, num_blocks: int, heads: int, batch: int, block: int) -> bool:
    """Whether sm90_work_list can build this shape's list on the device: its sort weights and
    list places within the kernels' integers (else the caller keeps attn_fwd_sm90)."""
    tiles = ceil_div(num_q_blocks, geometry.SM90_TILE_M // block)
    entries, _, _ = work_list_bounds(heads * tiles, batch)
    return (
        block in geometry.SM90_BLOCKS
        and 2 * num_blocks < WEIGHT_LIMIT  # key tiles walked, blocks computed
        and tiles < WEIGHT_LIMIT
        and entries * geometry.SM90_WORK_FIELDS <= INT32_LIMIT
    )


def sm90_work_list(
    impl: Any,
    blocks: Any,
    batch: int,
    n_k: int,
    head_dim: int,
    dtype: str,
    kv_group: int,
    block: int,
    key_pairs: bool = False,
    sms: int = geometry.SM90_SMS,
    max_slots: int | None = None,
) -> DeviceWorkList:
    """The persistent forward's work list of the device layout whose active blocks are
    ``blocks`` (bool [heads, query blocks, key blocks], where the layout lives): the entries
    geometry.sm90_work_list gives for these blocks (with ``key_pairs``, ``sms`` and
    ``max_slots``, None: geometry.sm90_split_slots(sms)), in its
    order, built by sm90_work_count, sm90_work_scan, sm90_work_fill and sm90_work_order with
    no host round trip."""
    xp = impl.xp
    heads, nbq, nb = blocks.shape
    item_rows = geometry.SM90_TILE_M // block
    tiles = ceil_div(nbq, item_rows)
    units = heads * tiles
    span = geometry.sm90_key_span(block, key_pairs)
    key_tiles = max(1, span * block // geometry.sm90_tile_n(block, head_dim, key_pairs))
    if max_slots is None:
        max_slots = geometry.sm90_split_slots(sms)
    list_bound, merge_bound, slot_bound = work_list_bounds(units, batch, sms, max_slots)
    chosen = xp.ascontiguousarray(blocks).view(xp.uint8)

    def buffer(*shape: int) -> Any:
        return xp.full(shape, UNWRITTEN, dtype=xp.int32)

    union_count = buffer(units)
    pointers = {name: buffer(units + 1) for name in ("entry_ptr", "slot_ptr", "merge_ptr")}
    split_tiles = buffer(1)
    shape = {"nbq": nbq, "nb": nb, "item_rows": item_rows, "tiles": tiles, "span": span}
    per_tile = LayoutKernelConfig("sm90_work_count", rows=tiles, heads=heads)
    impl.launch(per_tile, chosen=chosen, union_count=union_count, **shape)
    impl.launch(
        LayoutKernelConfig("sm90_work_scan"),
        union_count=union_count,
        **pointers,
        split_tiles=split_tiles,
        units=units,
        key_tiles=key_tiles,
        split_factor=geometry.SM90_SPLIT_FACTOR,
        split_min_tiles=geometry.SM90_SPLIT_MIN_TILES,
        spread_percent=geometry.SM90_FEW_ITEMS_SPREAD_PERCENT,
        batch=batch,
        sms=sms,
        max_slots=max_slots,
    )
    entry_bound = list_bound // batch
    entries = buffer(entry_bound, ENTRY_FIELDS)
    weights = xp.zeros(entry_bound, dtype=xp.uint64)
    impl.launch(
        LayoutKernelConfig("sm90_work_fill", rows=tiles, heads=heads),
        chosen=chosen,
        union_count=union_count,
        entry_ptr=pointers["entry_ptr"],
        entries=entries,
        weights=weights,
        key_tiles=key_tiles,
        **shape,
    )
    items = buffer(list_bound, geometry.SM90_WORK_FIELDS)
    # a merge entry of no chunks is passed by: the padding past the split rows
    merges = xp.zeros((max(merge_bound, 1), geometry.SM90_MERGE_FIELDS), dtype=xp.int32)
    work_counter = buffer(1)
    impl.launch(
        LayoutKernelConfig("sm90_work_order", rows=entry_bound, heads=batch),
        entries=entries,
        weights=weights,
        **pointers,
        work_list=items,
        merge_list=merges,
        work_counter=work_counter,
        heads=heads,
        tiles=tiles,
        batch=batch,
        groups=geometry.sm90_cta_groups(batch, heads, n_k, head_dim, dtype, kv_group),
        list_bound=list_bound,
    )
    return DeviceWorkList(
        items, work_counter, merges, split_tiles, list_bound, merge_bound, slot_bound
    )


def backward_order_fits(num_blocks: int, key_blocks: int) -> bool:
    """Whether sm90_backward_order builds this shape's order on the device: a row's key tiles
    within what sm90_dq_ranks flags in shared memory (else the caller keeps the mma.sync
    backward)."""
    return (
        key_blocks <= geometry.SCHEDULE_MAX_TILE_BLOCKS
        and ceil_div(num_blocks, key_blocks) <= geometry.SCHEDULE_MAX_TILES
    )


def sm90_backward_order(
    impl: Any, layout: DeviceLayout, index: Any, key_blocks: int, kv_group: int
) -> tuple[Any, Any]:
    """(tile_order int32 [kv heads, key tiles], dq_ranks int32 [one per CSC entry]) of a device
    layout, where it lives: kernels.backward_tile_order's and kernels.dq_ranks' values, by
    sm90_claim_order and sm90_dq_ranks from ``index`` (the layout's arrays where the kernels
    read them). Entries past the layout's own are left poisoned (never read)."""
    xp = impl.xp
    heads, nbq, nb = layout.heads, layout.num_q_blocks, layout.num_blocks
    tiles = ceil_div(nb, key_blocks)
    kv_heads = heads // kv_group
    walked, tile_order, tile_place = (
        xp.full((kv_heads, tiles), UNWRITTEN, dtype=xp.int32) for _ in range(3)
    )
    shape = {"nb": nb, "tiles": tiles, "key_blocks": key_blocks, "kv_group": kv_group}
    impl.launch(
        LayoutKernelConfig("sm90_claim_order", rows=kv_heads),
        col_ptr=index.col_ptr,
        row_idx=index.row_idx,
        walked=walked,
        tile_order=tile_order,
        tile_place=tile_place,
        **shape,
    )
    dq_ranks = xp.full(index.row_idx.shape, UNWRITTEN, dtype=xp.int32)
    impl.launch(
        LayoutKernelConfig("sm90_dq_ranks", rows=nbq, heads=heads),
        row_ptr=index.row_ptr,
        col_idx=index.col_idx,
        col_ptr=index.col_ptr,
        row_idx=index.row_idx,
        tile_place=tile_place,
        dq_ranks=dq_ranks,
        nbq=nbq,
        **shape,
    )
    return tile_order, dq_ranks
