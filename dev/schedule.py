"""Schedule simulator: a block kernel's time on an H100/H200 from its layout, the static model's
per-tile costs and the order its CTAs start in. No GPU.

What it computes. For one launch of a block kernel over a Layout (any pattern, 64- or 128-blocks,
heads, batch, GQA):
  1. the CTA list in the kernel's start order, each CTA with its work read off the layout's
     blocks (the CSR rows a forward CTA walks, the CSC columns of dK/dV, the rows of dQ): key tiles
     walked, tensor-pipe cycles of the tiles it computes (HGMMA or HMMA counts times their
     cycles), tiles under an element rule (masked), and the K/V tiles it reads;
  2. each CTA's cycles = a fixed cost (prologue: barrier set-up, Q load, pipeline fill and drain,
     the epilogue) + a cost per walked tile + the tensor cycles over an efficiency + a cost per
     masked tile + a cost per K/V tile the L2 misses;
  3. a list schedule of those CTAs, in start order, onto SMS x (resident CTAs per SM) slots (a
     slot of an SM that holds R CTAs runs at 1/R of the SM's rate): the makespan, plus a launch
     cost, is the predicted time.
The L2 term is scripts/cta_order_model.py's: each CTA's K/V tile reads go through an LRU cache of
L2_BYTES (calibrated there on the H200's DRAM counters) in the order a nominal schedule (tiles +
OVERHEAD_TILES per CTA) issues them; the misses cost cycles to the CTA that takes them.

The few free constants of each kernel family (``FwdParams``, ``BwdParams``) are fitted on the
committed GPU sweeps by dev/calibrate_schedule.py, which writes the calibration table; this module
holds the model and the persistent-grid and wide-tile what-ifs of bench/NOTES.md.

The sm_90a backward (attn_bwd_sm90, no GPU run yet, so nothing fitted) is simulated apart
(``simulate_bwd_sm90``): its items in the kernel's claim order, each step at the static
roofline's cycles (SM90_BWD_STEP_CYCLES), a fixed cost per item, and the ordered dQ reduce's
waits; with the persistent grid, split columns and dQ copies as levers (``--bwd-sm90``).

    PYTHONPATH=. python dev/schedule.py              # every bench pattern at T = 8k, 64-blocks
    PYTHONPATH=. python dev/schedule.py --pattern bigbird --n-ctx 16384 --block 128
    PYTHONPATH=. python dev/schedule.py --whatif     # the tables of bench/NOTES.md
    PYTHONPATH=. python dev/schedule.py --bwd-sm90   # the sm_90a backward's (about 2 minutes)
"""

from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from cuattn.backends import geometry  # noqa: E402
from dev.sass_roofline import CLOCK_HZ, DRAM_BYTES_PER_S, HMMA_PER_SM_CYCLE  # noqa: E402

SMS = 132  # an H100 SXM's and an H200's SMs
# Dense 16-bit wgmma: 989 TFLOP/s over 132 SMs at 1.83 GHz = 4096 FLOP an SM a cycle, so one
# m64nNk16 (2 x 64 x N x 16 FLOP) takes N / 2 cycles of an SM's tensor pipe.
WGMMA_FLOP_PER_SM_CYCLE = 4096
HMMA_FLOP = 2 * 16 * 8 * 16  # one mma.sync m16n8k16
WGMMA_M = 64  # rows of one consumer warpgroup's wgmma
SM90_RESIDENT = 1  # 384 threads x 168 registers fill the register file (NVRTC report)
L2_BYTES = 30e6  # the L2 the reuse sees (scripts/cta_order_model.py, calibrated on DRAM counters)
OVERHEAD_TILES = 0.3  # the nominal schedule's fixed cost per CTA, in tiles (cta_order_model)
K_AND_V = 2
STATIC_BASELINE = ROOT / "bench" / "results" / "static-baseline-sm90.json"
ORDERS = ("heads-fastest", "x-fastest", "grouped", "persistent")
HALF_TILES = ("mask", "skip")


@dataclass(frozen=True)
class Cta:
    """One CTA's (or, in the persistent grid, one work item's) work, in start order."""

    pair: int  # batch * heads + head
    tile: int  # the query (forward, dQ) or key (dK/dV) tile it owns
    walked: int  # tiles walked (every thread waits on each)
    tensor_cycles: float  # tensor-pipe cycles of the tiles it computes
    masked: int  # computed tiles under the element rule (mask code runs)
    reads: tuple[tuple[int, int], ...]  # (kv pair, key tile) of every K/V tile it loads
    items: int = 1  # rows (fixed costs) it carries: > 1 for packed short rows


@dataclass(frozen=True)
class FwdParams:
    """attn_fwd_sm90's constants: launch (us), cycles per CTA, per walked tile, tensor cycles over
    efficiency, per masked consumer tile, per missed K/V tile."""

    launch_us: float
    cta_cycles: float
    tile_cycles: float
    tensor_efficiency: float
    masked_cycles: float
    miss_cycles: float


@dataclass(frozen=True)
class BwdParams:
    """The backward's constants (attn_bwd_preprocess + attn_bwd_dkdv + attn_bwd_dq): launch (us, the
    three kernels and the backward's own host work), cycles per CTA, and the static model's
    per-tile cycles over an efficiency."""

    launch_us: float
    cta_cycles: float
    static_efficiency: float


@dataclass(frozen=True)
class Prediction:
    seconds: float
    makespan_cycles: float
    balanced_cycles: float  # total work / slots: the makespan of a perfect balance
    fixed_cycles: float  # the CTAs' fixed costs, summed
    tile_cycles: float  # walked-tile, tensor and masked cycles, summed
    miss_cycles: float  # L2-miss cycles, summed
    misses: int
    compulsory: int  # distinct K/V tiles (each read from DRAM at least once)
    ctas: int

    @property
    def tail(self) -> float:
        """Makespan over the balanced one: 1.0 is no idle SM at the tail."""
        return self.makespan_cycles / self.balanced_cycles if self.balanced_cycles else 1.0


def _partial(layout: object) -> np.ndarray:
    """[heads, q blocks, key blocks]: True where a block is active and its element rule applies."""
    heads, nbq, nb = layout.blocks.shape
    out = np.zeros((heads, nbq, nb), dtype=bool)
    for h in range(heads):
        ptr = layout.row_ptr[h]
        rows = np.repeat(np.arange(nbq), np.diff(ptr))
        sel = slice(ptr[0], ptr[-1])
        out[h, rows, layout.col_idx[sel]] = layout.row_mask[sel] >= 0
    return out


def wgmma_cycles(rows: int, keys: int, head_dim: int) -> float:
    """Tensor-pipe cycles of S = Q K^T and O += P V over rows x keys at head_dim (wgmma)."""
    return 2 * (2 * rows * keys * head_dim) / WGMMA_FLOP_PER_SM_CYCLE


def fwd_sm90_ctas(
    layout: object,
    batch: int,
    head_dim: int,
    kv_group: int = 1,
    order: str = "heads-fastest",
    tile_n: int | None = None,
    half_tiles: str = "mask",
    consumers: int = 2,
) -> list[Cta]:
    """attn_fwd_sm90's CTAs, one per (128 query rows, head, batch), in ``order``:
    heads-fastest   change 27 (510d8d7): every pair's last tile, then the one before, ...;
    grouped         change 34: the same within geometry.sm90_cta_groups groups of pairs;
    x-fastest       stage (a) (23e0a72): a pair's tiles ascending, pairs one after another;
    persistent      a longest-first work list over every pair (ties: the heads-fastest order).
    A CTA owns 128 / BLOCK layout blocks (one per consumer at 64-blocks) and walks the union of
    their rows in tiles of ``tile_n`` keys (default: geometry's); a tile a consumer's block lacks
    is walked (the producer loads it; both consumers wait for it) but not computed by it. With
    tiles wider than the block, a tile one of whose blocks a row lacks is computed whole with that
    half masked to -inf (``half_tiles="mask"``) or as the narrow wgmma over the half it has
    (``"skip"``). ``consumers``: warpgroups of 64 rows a CTA (3: 192 rows, three 64-blocks)."""
    if half_tiles not in HALF_TILES:
        raise ValueError(f"half_tiles={half_tiles!r}; accepted: {', '.join(HALF_TILES)}")
    block = layout.blocksize
    tile_n = tile_n or geometry.sm90_tile_n(block, head_dim)
    heads, nbq, nb = layout.blocks.shape
    if (consumers * WGMMA_M) % block:
        raise ValueError(
            f"consumers={consumers}: {consumers * WGMMA_M} rows are not whole {block}-blocks"
        )
    per_cta = consumers * WGMMA_M // block  # layout blocks a CTA owns
    partial = _partial(layout)
    tiles = -(-nbq // per_cta)
    pairs = batch * heads
    ctas: dict[tuple[int, int], Cta] = {}
    for h in range(heads):
        own = np.zeros((tiles, per_cta, nb), dtype=bool)
        own_partial = np.zeros_like(own)
        for c in range(per_cta):
            rows = layout.blocks[h, c::per_cta]
            own[: len(rows), c] = rows
            own_partial[: len(rows), c] = partial[h, c::per_cta]
        # key blocks -> key tiles: a tile is walked by a consumer where any of its blocks is active
        if tile_n >= block:
            span = tile_n // block
            width = -(-nb // span)
            pad = width * span - nb
            as_tiles = np.pad(own, ((0, 0), (0, 0), (0, pad))).reshape(tiles, per_cta, width, span)
            comp = as_tiles.any(axis=3)
            part = (
                np.pad(own_partial, ((0, 0), (0, 0), (0, pad)))
                .reshape(tiles, per_cta, width, span)
                .any(axis=3)
            )
            if half_tiles == "mask":
                part |= comp & ~as_tiles.all(axis=3)  # the half the row lacks, masked to -inf
                computed = comp.sum(axis=(1, 2)) * span  # in blocks' worth of keys
            else:
                computed = as_tiles.sum(axis=(1, 2, 3))
        else:
            split = block // tile_n
            comp = np.repeat(own, split, axis=2)
            part = np.repeat(own_partial, split, axis=2)
            computed = own.sum(axis=(1, 2))
        walked = comp.any(axis=1)  # [tiles, key tiles]
        masked = part.sum(axis=(1, 2))
        per_block = wgmma_cycles(block, block, head_dim)  # an owned block x one key block
        consumers_per_block = block // WGMMA_M
        for b in range(batch):
            pair = b * heads + h
            kv_pair = b * (heads // kv_group) + h // kv_group
            for t in range(tiles):
                keys = np.flatnonzero(walked[t])
                ctas[(pair, t)] = Cta(
                    pair=pair,
                    tile=t,
                    walked=len(keys),
                    tensor_cycles=float(computed[t]) * per_block,
                    masked=int(masked[t]) * consumers_per_block,
                    reads=tuple((kv_pair, int(k)) for k in keys),
                )
    return [
        ctas[key]
        for key in start_order(order, tiles, pairs, batch, heads, layout, head_dim, kv_group, ctas)
    ]


def start_order(
    order: str,
    tiles: int,
    pairs: int,
    batch: int,
    heads: int,
    layout: object,
    head_dim: int,
    kv_group: int,
    ctas: dict[tuple[int, int], Cta],
) -> list[tuple[int, int]]:
    """(pair, tile) of every CTA in ``order`` (see fwd_sm90_ctas)."""
    if order == "x-fastest":
        return [(p, t) for p in range(pairs) for t in range(tiles)]
    if order in ("heads-fastest", "grouped"):
        groups = 1
        if order == "grouped":
            groups = geometry.sm90_cta_groups(
                batch, heads, layout.n_ctx, head_dim, "bfloat16", kv_group
            )
        narrow, wide = divmod(pairs, groups)
        out, first = [], 0
        for g in range(groups):
            size = narrow + 1 if g < wide else narrow
            for rank in range(tiles):
                out += [(first + i, tiles - 1 - rank) for i in range(size)]
            first += size
        return out
    if order == "persistent":
        heads_fastest = start_order(
            "heads-fastest", tiles, pairs, batch, heads, layout, head_dim, kv_group, ctas
        )
        rank = {key: i for i, key in enumerate(heads_fastest)}
        return sorted(ctas, key=lambda key: (-ctas[key].tensor_cycles, rank[key]))
    raise ValueError(f"order={order!r} is not a CTA order; accepted: {', '.join(ORDERS)}")


def list_schedule(durations: Sequence[float], slots: int) -> tuple[float, list[float]]:
    """Greedy list scheduling in the given order: each CTA starts on the slot that frees first.
    (makespan, start of each CTA). Graham's bound: makespan <= sum / slots + max."""
    free = [(0.0, s) for s in range(slots)]
    starts = []
    for d in durations:
        start, s = heapq.heappop(free)
        starts.append(start)
        heapq.heappush(free, (start + d, s))
    return max(end for end, _ in free), starts


def l2_misses(
    ctas: Sequence[Cta], slots: int, tile_bytes: int, l2_bytes: float = L2_BYTES
) -> list[int]:
    """K/V tiles each CTA reads from DRAM: its reads through an LRU cache of ``l2_bytes`` in the
    order a nominal schedule (walked tiles + OVERHEAD_TILES a CTA) issues them."""
    _, starts = list_schedule([c.walked + OVERHEAD_TILES for c in ctas], slots)
    reads = []
    for i, (c, start) in enumerate(zip(ctas, starts, strict=True)):
        reads += [(start + OVERHEAD_TILES / 2 + j, i, key) for j, key in enumerate(c.reads)]
    reads.sort(key=lambda r: r[0])
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    capacity = max(1, int(l2_bytes // tile_bytes))
    misses = [0] * len(ctas)
    for _, i, key in reads:
        if key in cache:
            cache.move_to_end(key)
            continue
        misses[i] += 1
        cache[key] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return misses


def fwd_terms(ctas: Sequence[Cta], head_dim: int, tile_n: int, slots: int) -> np.ndarray:
    """[CTAs, 5]: each CTA's (1, walked, tensor cycles, masked, misses), the multipliers of
    FwdParams' cycle constants (cta, tile, 1 / efficiency, masked, miss)."""
    misses = l2_misses(ctas, slots, K_AND_V * tile_n * head_dim * 2)
    return np.array(
        [
            [c.items, c.walked, c.tensor_cycles, c.masked, m]
            for c, m in zip(ctas, misses, strict=True)
        ],
        dtype=float,
    )


def _fixed_share(rows: np.ndarray, item_share: float, row_share: float | None) -> np.ndarray:
    """Each item's fixed cost in CTAs' worth: ``item_share`` for its first row, ``row_share``
    (default: item_share) for each packed row after it."""
    more = item_share if row_share is None else row_share
    return item_share + more * (rows - 1)


def predict_terms(
    terms: np.ndarray,
    p: FwdParams,
    slots: int,
    item_share: float = 1.0,
    per_slot_cycles: float = 0.0,
    row_share: float | None = None,
) -> Prediction:
    """The forward's time from its CTA terms (fwd_terms) and constants. ``item_share``: the part
    of the per-CTA cost each item still pays (1: a CTA each; less in a persistent grid, where the
    next item's Q load runs under the current epilogue); ``row_share``: the part a packed row
    after an item's first pays (its Q load and epilogue, the pipeline kept full);
    ``per_slot_cycles``: what a persistent CTA pays once (its barrier set-up)."""
    share = _fixed_share(terms[:, 0], item_share, row_share)
    weights = np.array([p.tile_cycles, 1 / p.tensor_efficiency, p.masked_cycles, p.miss_cycles])
    fixed_each = share * p.cta_cycles
    cycles = fixed_each + terms[:, 1:] @ weights
    makespan, _ = list_schedule(cycles, slots)
    makespan += per_slot_cycles
    fixed = float(fixed_each.sum() + per_slot_cycles * slots)
    miss = float(terms[:, 4].sum() * p.miss_cycles)
    total = float(cycles.sum()) + per_slot_cycles * slots
    return Prediction(
        seconds=p.launch_us * 1e-6 + makespan / CLOCK_HZ,
        makespan_cycles=makespan,
        balanced_cycles=total / slots,
        fixed_cycles=fixed,
        tile_cycles=total - fixed - miss,
        miss_cycles=miss,
        misses=int(terms[:, 4].sum()),
        compulsory=0,
        ctas=len(terms),
    )


def predict_fwd(
    layout: object,
    batch: int,
    head_dim: int,
    p: FwdParams,
    kv_group: int = 1,
    order: str = "heads-fastest",
    tile_n: int | None = None,
    half_tiles: str = "mask",
    consumers: int = 2,
) -> Prediction:
    """attn_fwd_sm90's time on one launch over ``layout`` x ``batch``."""
    tile_n = tile_n or geometry.sm90_tile_n(layout.blocksize, head_dim)
    ctas = fwd_sm90_ctas(layout, batch, head_dim, kv_group, order, tile_n, half_tiles, consumers)
    slots = SMS * SM90_RESIDENT
    pred = predict_terms(fwd_terms(ctas, head_dim, tile_n, slots), p, slots)
    compulsory = len({key for c in ctas for key in c.reads})
    return dataclasses.replace(pred, compulsory=compulsory)


# ---------------------------------------------------------------------------------------------
# The persistent grid (issue 53): a longest-first work list, short rows packed, long rows split


def work_list(
    ctas: Sequence[Cta], pack_below: int, split_above: int | None, pairs_per_group: int = 0
) -> list[Cta]:
    """The persistent grid's items from today's CTAs: rows longer than ``split_above`` walked tiles
    cut into chunks of at most that many (merged through the LSE: each chunk pays the fixed cost,
    as a row does); rows shorter than ``pack_below`` packed, within a pair, into items of at least
    ``pack_below`` walked tiles (each packed row still pays its own Q load and epilogue:
    ``items`` counts them, and ``fixed`` is shared by item_share in predict_terms); then longest
    first within groups of ``pairs_per_group`` pairs (0: one group), the groups in pair order."""
    out: list[Cta] = []
    for c in ctas:
        if split_above and c.walked > split_above:
            chunks = -(-c.walked // split_above)
            for k in range(chunks):
                reads = c.reads[k * split_above : (k + 1) * split_above]
                share = len(reads) / c.walked
                out.append(
                    Cta(
                        c.pair,
                        c.tile,
                        len(reads),
                        c.tensor_cycles * share,
                        round(c.masked * share),
                        reads,
                    )
                )
        else:
            out.append(c)
    packed: list[Cta] = []
    pending: dict[int, list[Cta]] = {}
    for c in out:
        if c.walked >= pack_below:
            packed.append(c)
            continue
        group = pending.setdefault(c.pair, [])
        group.append(c)
        if sum(g.walked for g in group) >= pack_below:
            packed.append(_merge(group))
            pending[c.pair] = []
    packed += [_merge(g) for g in pending.values() if g]

    def key(c: Cta) -> tuple[int, float]:
        return (c.pair // pairs_per_group if pairs_per_group else 0, -(c.tensor_cycles + c.walked))

    return sorted(packed, key=key)


def _merge(group: Sequence[Cta]) -> Cta:
    return Cta(
        pair=group[0].pair,
        tile=group[0].tile,
        walked=sum(c.walked for c in group),
        tensor_cycles=sum(c.tensor_cycles for c in group),
        masked=sum(c.masked for c in group),
        reads=tuple(r for c in group for r in c.reads),
        items=sum(c.items for c in group),
    )


def predict_persistent(
    layout: object,
    batch: int,
    head_dim: int,
    p: FwdParams,
    item_share: float,
    row_share: float | None = None,
    pack_below: int = 0,
    split_factor: float | None = None,
    kv_group: int = 1,
    tile_n: int | None = None,
    half_tiles: str = "mask",
) -> Prediction:
    """A persistent grid of SMS CTAs taking items longest first (work_list) within change 34's
    L2-sized groups of pairs (geometry.sm90_cta_groups); each item pays ``item_share`` of
    today's per-CTA cost and each packed row after its first ``row_share`` (the rest hidden under
    the neighbouring items), each persistent CTA pays the rest once. Rows shorter than
    ``pack_below`` walked tiles are packed; rows longer than ``split_factor`` times the median
    row (and than pack_below) are split into chunks of that length."""
    tile_n = tile_n or geometry.sm90_tile_n(layout.blocksize, head_dim)
    ctas = fwd_sm90_ctas(layout, batch, head_dim, kv_group, "grouped", tile_n, half_tiles)
    split_above = None
    if split_factor:
        median = float(np.median([c.walked for c in ctas]))
        split_above = max(pack_below, int(np.ceil(split_factor * median)), 1)
    pairs = batch * layout.blocks.shape[0]
    groups = geometry.sm90_cta_groups(
        batch, layout.blocks.shape[0], layout.n_ctx, head_dim, "bfloat16", kv_group
    )
    items = work_list(ctas, pack_below, split_above, -(-pairs // groups))
    slots = SMS * SM90_RESIDENT
    terms = fwd_terms(items, head_dim, tile_n, slots)
    return predict_terms(terms, p, slots, item_share, p.cta_cycles * (1 - item_share), row_share)


def merge_seconds(p: FwdParams, work: geometry.Sm90WorkList, head_dim: int) -> float:
    """attn_fwd_sm90_merge after the persistent launch: a launch of its own, and its bytes at
    the DRAM rate (each slot's float32 partial out and lse read, each split row's out (16-bit)
    and lse written); 0 where no row is split."""
    if not len(work.merges):
        return 0.0
    rows = geometry.SM90_TILE_M
    read = work.slots * rows * (head_dim + 1) * 4
    written = len(work.merges) * rows * (head_dim * 2 + 4)
    return p.launch_us * 1e-6 + (read + written) / DRAM_BYTES_PER_S


def built_items(
    layout: object,
    batch: int,
    head_dim: int,
    kv_group: int,
    split_tiles: int | None,
    key_pairs: bool = False,
    list_in_pairs: bool | None = None,
    max_slots: int | None = None,
) -> tuple[list[Cta], geometry.Sm90WorkList, int]:
    """The entries of geometry.sm90_work_list as the simulator's items, in the list's order (a
    chunk: its row's CTA cut to the key tiles its block range meets, tensor and masked work in
    proportion), the list, and the key tile. ``key_pairs``: 128-key tiles of two 64-blocks (a
    half tile as the N = 64 wgmma); the list counted and cut in pairs (``list_in_pairs`` None)
    or, False, in 64-blocks as before (a tile cut inside is walked by both its chunks).
    ``max_slots``: the cap on the launch's partial slots (None: geometry.sm90_split_slots)."""
    block = layout.blocksize
    tile_n = geometry.sm90_tile_n(block, head_dim, key_pairs)
    half_tiles = "skip" if key_pairs else "mask"
    ctas = fwd_sm90_ctas(layout, batch, head_dim, kv_group, "x-fastest", tile_n, half_tiles)
    by_key = {(c.pair, c.tile): c for c in ctas}
    tiles = -(-layout.blocks.shape[1] // (geometry.SM90_TILE_M // block))
    in_pairs = key_pairs if list_in_pairs is None else list_in_pairs
    work = geometry.sm90_work_list(
        layout.blocks,
        batch,
        layout.n_ctx,
        head_dim,
        "bfloat16",
        kv_group,
        block,
        split_tiles,
        key_pairs=in_pairs,
        max_slots=max_slots,
    )
    items = []
    for item, first, end, slot, *_ in work.items.tolist():
        c = by_key[divmod(item, tiles)]
        if slot == geometry.SM90_NO_SLOT:
            items.append(c)
            continue
        # key tile r holds blocks [r tile_n / block, ceil((r + 1) tile_n / block))
        reads = tuple(
            r
            for r in c.reads
            if r[1] * tile_n // block < end and -(-(r[1] + 1) * tile_n // block) > first
        )
        share = len(reads) / c.walked
        items.append(
            Cta(c.pair, c.tile, len(reads), c.tensor_cycles * share, round(c.masked * share), reads)
        )
    return items, work, tile_n


# Packing short rows (issue 53, not built): rows of a pair walking fewer than a threshold of key
# tiles go into one item, up to the threshold. The threshold is the largest of PACK_CANDIDATES
# whose packed list still holds PACK_MIN_ITEMS_PER_SLOT items a persistent CTA: fewer, and the
# tail grows by more than packing saves (the first what-ifs lost 4-6 % on the causal thin
# layouts at ~5 items a CTA).
PACK_CANDIDATES = (4, 8, 16, 32)
PACK_MIN_ITEMS_PER_SLOT = 8


def pack_threshold(items: Sequence[Cta], slots: int, pairs_per_group: int) -> int:
    """The walked tiles short rows are packed up to (0: none): the largest PACK_CANDIDATES
    entry that keeps at least PACK_MIN_ITEMS_PER_SLOT x ``slots`` items."""
    best = 0
    for below in PACK_CANDIDATES:
        packed = work_list(items, below, None, pairs_per_group)
        if len(packed) >= PACK_MIN_ITEMS_PER_SLOT * slots:
            best = below
    return best


def predict_packed(
    layout: object,
    batch: int,
    head_dim: int,
    p: FwdParams,
    item_share: float,
    row_share: float,
    kv_group: int = 1,
) -> tuple[Prediction, int, int]:
    """The built list (geometry's split) with short rows packed (pack_threshold), each item
    paying ``item_share`` of today's per-CTA cost for its first row and ``row_share`` for each
    packed row after it; the merge follows. Returns the prediction, the threshold and the
    packed item count."""
    items, work, tile_n = built_items(layout, batch, head_dim, kv_group, None)
    heads = layout.blocks.shape[0]
    groups = geometry.sm90_cta_groups(batch, heads, layout.n_ctx, head_dim, "bfloat16", kv_group)
    per_group = -(-batch * heads // groups)
    slots = SMS * SM90_RESIDENT
    below = pack_threshold(items, slots, per_group)
    packed = work_list(items, below, None, per_group)
    terms = fwd_terms(packed, head_dim, tile_n, slots)
    per_slot = p.cta_cycles * (1 - item_share)
    pred = predict_terms(terms, p, slots, item_share, per_slot, row_share)
    pred = dataclasses.replace(pred, seconds=pred.seconds + merge_seconds(p, work, head_dim))
    return pred, below, len(packed)


@dataclass(frozen=True)
class BenchShape:
    """The shape of bench/NOTES.md's tables: T, heads, batch, head dim."""

    n_ctx: int
    heads: int
    batch: int
    head_dim: int

    def __str__(self) -> str:
        return f"T={self.n_ctx}, heads={self.heads}, batch={self.batch}, d={self.head_dim}"

    def layouts(self, block: int) -> dict[str, object]:
        """Every bench pattern's layout at this shape, by label (a pattern this block size
        cannot build, fixed's groups at 128, is left out)."""
        from cuattn.tools.bench.cases import ALL_PATTERNS

        layouts = {}
        for pattern in ALL_PATTERNS:
            try:
                layouts[pattern.label] = pattern.make_layout(self.n_ctx, self.heads, block)
            except ValueError:
                continue
        return layouts


BENCH_SHAPE = BenchShape(n_ctx=8192, heads=16, batch=2, head_dim=128)  # issue 53's bench


def pack_table(
    p: FwdParams,
    shape: BenchShape = BENCH_SHAPE,
    blocks: Sequence[int] = (64, 128),
) -> str:
    """bench/NOTES.md's packing table: every bench pattern on the built list (split rows, item
    1/2), then packed at pack_threshold with a packed row paying 1/2 (what consecutive items
    pay now) and 1/4 (its Q loaded under the previous row's tiles); ratios over dense causal's
    under the same variant."""
    lines = [
        str(shape),
        "",
        "| pattern, block | entries | pack below (tiles), items | split ms (ratio), tail "
        "| packed, row 1/2: ms (ratio), tail | packed, row 1/4: ms (ratio) | change at 1/4 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for block in blocks:
        rows = {}
        for label, layout in shape.layouts(block).items():
            split = predict_built_persistent(
                layout, shape.batch, shape.head_dim, p, 0.5, split_tiles=None
            )
            half, below, count = predict_packed(layout, shape.batch, shape.head_dim, p, 0.5, 0.5)
            quarter, _, _ = predict_packed(layout, shape.batch, shape.head_dim, p, 0.5, 0.25)
            rows[label] = (layout.density, split.ctas, below, count, split, half, quarter)
        base = rows["dense-causal"]
        for label, (density, entries, below, count, *preds) in rows.items():

            def cell(
                i: int, preds: list = preds, density: float = density, base: tuple = base
            ) -> str:
                ratio = density / base[0] * base[4 + i].seconds / preds[i].seconds
                return f"{preds[i].seconds * 1e3:.3f} ({ratio:.2f})"

            change = preds[2].seconds / preds[0].seconds - 1
            lines.append(
                f"| {label}, {block} | {entries} | {below}, {count} | {cell(0)}, "
                f"{preds[0].tail:.2f} | {cell(1)}, {preds[1].tail:.2f} | {cell(2)} | "
                f"{100 * change:+.0f} % |"
            )
    return "\n".join(lines)


def qbuffer_table(
    p: FwdParams,
    shape: BenchShape = BENCH_SHAPE,
    blocks: Sequence[int] = (64, 128),
    shares: Sequence[float] = (0.5, 0.25, 0.375),
) -> str:
    """bench/NOTES.md's double-buffered Q table: every bench pattern on the built list (split
    rows, geometry's threshold), an item paying each of ``shares`` of today's per-CTA cost: the
    first as built (Q copied once the previous item's store is read out), the others with Q
    copied under the previous item's tiles; ratios over dense causal's under the same share."""
    lines = [
        str(shape),
        "",
        "| pattern, block | density | "
        + " | ".join(
            f"item {share:g}: ms (ratio), tail" + (" | change" if i else "")
            for i, share in enumerate(shares)
        )
        + " |",
        "| --- | ---: | "
        + " | ".join("---:" if i == 0 else "---: | ---:" for i in range(len(shares)))
        + " |",
    ]
    for block in blocks:
        rows = {
            label: (
                layout.density,
                [
                    predict_built_persistent(
                        layout, shape.batch, shape.head_dim, p, share, split_tiles=None
                    )
                    for share in shares
                ],
            )
            for label, layout in shape.layouts(block).items()
        }
        base_density, base = rows["dense-causal"]
        for label, (density, preds) in rows.items():
            cells = [f"{label}, {block}", f"{density:.3f}"]
            for i, pred in enumerate(preds):
                ratio = density / base_density * base[i].seconds / pred.seconds
                cells.append(f"{pred.seconds * 1e3:.3f} ({ratio:.2f}), {pred.tail:.2f}")
                if i:
                    cells.append(f"{100 * (pred.seconds / preds[0].seconds - 1):+.0f} %")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def predict_built_persistent(
    layout: object,
    batch: int,
    head_dim: int,
    p: FwdParams,
    item_share: float,
    kv_group: int = 1,
    stride: bool = False,
    split_tiles: int | None = 0,
    key_pairs: bool = False,
    list_in_pairs: bool | None = None,
    max_slots: int | None = None,
) -> Prediction:
    """attn_fwd_sm90_persistent as built: SMS CTAs claim the entries of geometry.sm90_work_list
    (the list the host hands the kernel) in its order, each paying ``item_share`` of today's
    per-CTA cost and each CTA the rest once. ``split_tiles``: 0 splits no row (the first step);
    None, geometry's choice (sm90_split_tiles); a chunk is its row's CTA cut to the key tiles of
    its blocks (tensor and masked work in proportion), and the merge (merge_seconds) follows.
    ``stride``: the alternative not built, CTA i taking items i, i + SMS, ... instead of
    claiming the next. ``key_pairs``, ``list_in_pairs``, ``max_slots``: built_items'."""
    items, work, tile_n = built_items(
        layout, batch, head_dim, kv_group, split_tiles, key_pairs, list_in_pairs, max_slots
    )
    slots = SMS * SM90_RESIDENT
    terms = fwd_terms(items, head_dim, tile_n, slots)
    per_slot = p.cta_cycles * (1 - item_share)
    pred = predict_terms(terms, p, slots, item_share, per_slot)
    pred = dataclasses.replace(pred, seconds=pred.seconds + merge_seconds(p, work, head_dim))
    if not stride:
        return pred
    share = _fixed_share(terms[:, 0], item_share, None)
    weights = np.array([p.tile_cycles, 1 / p.tensor_efficiency, p.masked_cycles, p.miss_cycles])
    cycles = share * p.cta_cycles + terms[:, 1:] @ weights
    loads = np.bincount(np.arange(len(cycles)) % slots, weights=cycles, minlength=slots)
    makespan = float(loads.max()) + per_slot
    return dataclasses.replace(
        pred, seconds=p.launch_us * 1e-6 + makespan / CLOCK_HZ, makespan_cycles=makespan
    )


def split_table(
    p: FwdParams,
    labels: Sequence[str] = ("bigbird", "longformer", "variable"),
    shape: BenchShape = BENCH_SHAPE,
    blocks: Sequence[int] = (64, 128),
) -> str:
    """bench/NOTES.md's split-row table: each pattern on the persistent grid as built (no row
    split) and with geometry's split, an item paying 1/2 and 3/4 of today's per-CTA cost; the
    ratio is the computed-block rate over dense causal's on the same variant."""
    lines = [
        str(shape),
        "",
        "| pattern, block | split rows x chunks (tiles above) | item 1/2: unsplit ms (ratio), tail "
        "| split ms (ratio), tail | change | item 3/4: unsplit ms | split ms | merge us |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for block in blocks:
        layouts = shape.layouts(block)
        causal = layouts["dense-causal"]
        base_seconds = {
            (share, split): predict_built_persistent(
                causal, shape.batch, shape.head_dim, p, share, split_tiles=split
            ).seconds
            for share in (0.5, 0.75)
            for split in (0, None)
        }
        for label in labels:
            layout = layouts[label]
            work = geometry.sm90_work_list(
                layout.blocks, shape.batch, shape.n_ctx, shape.head_dim, "bfloat16", 1, block
            )
            rows = len(work.merges)
            chunks = f"{rows} x {work.slots / rows:.1f}" if rows else "0"
            rate_scale = layout.density / causal.density
            pred = {
                (share, split): predict_built_persistent(
                    layout, shape.batch, shape.head_dim, p, share, split_tiles=split
                )
                for share in (0.5, 0.75)
                for split in (0, None)
            }

            def cell(
                key: tuple, pred: dict = pred, scale: float = rate_scale, base: dict = base_seconds
            ) -> str:
                ratio = scale * base[key] / pred[key].seconds
                return f"{pred[key].seconds * 1e3:.3f} ({ratio:.2f}), {pred[key].tail:.2f}"

            change = pred[(0.5, None)].seconds / pred[(0.5, 0)].seconds - 1
            lines.append(
                f"| {label}, {block} | {chunks} ({work.split_tiles}) | {cell((0.5, 0))} | "
                f"{cell((0.5, None))} | {100 * change:+.0f} % | "
                f"{pred[(0.75, 0)].seconds * 1e3:.3f} | {pred[(0.75, None)].seconds * 1e3:.3f} | "
                f"{merge_seconds(p, work, shape.head_dim) * 1e6:.1f} |"
            )
    return "\n".join(lines)


SPLIT_CAP_MULTIPLES = (1, 2, 4, 8)  # cap_table's caps: these times SMS partial slots
NO_CAP = 2**62  # a max_slots no launch reaches


def cap_table(
    p: FwdParams,
    shapes: Sequence[BenchShape],
    labels: Sequence[str] | None = None,
    blocks: Sequence[int] = (64, 128),
    multiples: Sequence[int] = SPLIT_CAP_MULTIPLES,
) -> str:
    """bench/NOTES.md's split-cap table: each pattern that splits rows at all (of ``labels``,
    None: every bench pattern), with geometry's threshold uncapped and with the launch's
    partial slots capped at each of ``multiples`` x SMS (the threshold raised until its chunks
    fit): slots (threshold) and the predicted time's change, an item paying 1/2 of today's
    per-CTA cost, the merge included."""
    lines = [
        "| shape | pattern, block | uncapped: slots (tiles above), ms | "
        + " | ".join(f"cap {m} x {SMS} = {m * SMS}" for m in multiples)
        + " |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in multiples) + " |",
    ]
    for shape in shapes:
        for block in blocks:
            for label, layout in shape.layouts(block).items():
                if labels is not None and label not in labels:
                    continue
                cells = []
                for cap in (NO_CAP, *(m * SMS for m in multiples)):
                    _, work, _ = built_items(
                        layout, shape.batch, shape.head_dim, 1, None, 0, None, cap
                    )
                    if cap == NO_CAP and not len(work.merges):
                        break
                    pred = predict_built_persistent(
                        layout, shape.batch, shape.head_dim, p, 0.5, split_tiles=None, max_slots=cap
                    )
                    cells.append((work.slots, work.split_tiles, pred.seconds))
                if not cells:
                    continue
                base = cells[0][2]
                row = [
                    str(shape),
                    f"{label}, {block}",
                    f"{cells[0][0]} ({cells[0][1]}), {base * 1e3:.3f}",
                ]
                for slots, tiles, seconds in cells[1:]:
                    same = slots == cells[0][0] and tiles == cells[0][1]
                    row.append(
                        "=" if same else f"{slots} ({tiles}), {100 * (seconds / base - 1):+.1f} %"
                    )
                lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


# few_items_table's shapes: batch 1 with few heads, the launches the few-items rule is for (128
# items at 8k x 2 heads and 4k x 4 heads, 64 at 8k x 1 head; 256 at 8k x 4 heads, not few, for
# comparison).
FEW_ITEMS_SHAPES = (
    BenchShape(n_ctx=8192, heads=2, batch=1, head_dim=128),
    BenchShape(n_ctx=8192, heads=4, batch=1, head_dim=128),
    BenchShape(n_ctx=4096, heads=4, batch=1, head_dim=128),
    BenchShape(n_ctx=8192, heads=1, batch=1, head_dim=128),
)


def few_items_thresholds(layout: object, batch: int, head_dim: int) -> tuple[int, int, float]:
    """A launch's split thresholds (the cap not binding): the mean's alone (4 x the mean item's)
    and the few-items rule's unrefined (at most the launch's walked tiles over SMS, at least
    SM90_SPLIT_MIN_TILES), and the longest item's walked tiles over that fill (0 where the
    items are as many as the SMs or more)."""
    ctas = fwd_sm90_ctas(layout, batch, head_dim, 1, "x-fastest")
    walked = np.array([c.walked for c in ctas if c.pair < layout.blocks.shape[0]])
    mean_only = geometry.sm90_split_tiles(walked, batch, sms=1, max_slots=NO_CAP)
    if batch * walked.size >= SMS:
        return mean_only, mean_only, 0.0
    fill = max(geometry.SM90_SPLIT_MIN_TILES, -(-batch * int(walked.sum()) // SMS))
    return mean_only, min(mean_only, fill), float(walked.max()) / fill


def few_items_table(p: FwdParams, shapes: Sequence[BenchShape] = FEW_ITEMS_SHAPES) -> str:
    """bench/NOTES.md's few-items table: every pattern at ``shapes``, 64- and 128-blocks, with
    the few-items rule unrefined (every launch of fewer items than SMs split to fill them), not
    applied (the mean's threshold), and geometry's (the refined rule): threshold, slots and the
    predicted ms, an item paying 1/2 of today's per-CTA cost, the merge included; the ratio
    is the longest item's walked tiles over the fill."""
    lines = [
        "| shape | pattern, block | longest / fill | unrefined: tiles, slots, ms | "
        "mean's: tiles, slots, ms | geometry's: tiles, slots, ms | change |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for shape in shapes:
        for block in (64, 128):
            for label, layout in shape.layouts(block).items():
                mean_only, unrefined, ratio = few_items_thresholds(
                    layout, shape.batch, shape.head_dim
                )
                cells = []
                for split in (unrefined, mean_only, None):
                    _, work, _ = built_items(layout, shape.batch, shape.head_dim, 1, split)
                    pred = predict_built_persistent(
                        layout, shape.batch, shape.head_dim, p, 0.5, split_tiles=split
                    )
                    cells.append((work.split_tiles, work.slots, pred.seconds))
                change = cells[2][2] / cells[0][2] - 1
                lines.append(
                    f"| {shape} | {label}, {block} | {ratio:.2f} | "
                    + " | ".join(f"{t}, {s}, {ms * 1e3:.3f}" for t, s, ms in cells)
                    + f" | {100 * change:+.1f} % |"
                )
    return "\n".join(lines)


def persistent_table(
    p: FwdParams,
    shape: BenchShape = BENCH_SHAPE,
    block: int = 64,
) -> str:
    """bench/NOTES.md's persistent-forward table: every bench pattern today and as built, an
    item paying 1/2 and 3/4 of today's per-CTA cost, and the static stride at 1/2."""
    rows = {}
    for label, layout in shape.layouts(block).items():
        rows[label] = (
            layout.density,
            predict_fwd(layout, shape.batch, shape.head_dim, p),
            predict_built_persistent(layout, shape.batch, shape.head_dim, p, 0.5),
            predict_built_persistent(layout, shape.batch, shape.head_dim, p, 0.75),
            predict_built_persistent(layout, shape.batch, shape.head_dim, p, 0.5, stride=True),
        )
    density, *base = rows["dense-causal"]
    lines = [
        f"{shape}, {block}-blocks",
        "",
        "| pattern | density | today ms (ratio), tail | built, item 1/2: ms (ratio), tail "
        "| change | built, item 3/4: ms (ratio) | static stride, item 1/2: ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for label, (d, today, half, three, stride) in rows.items():

        def ratio(x: Prediction, i: int, d: float = d) -> float:
            return d / density * base[i].seconds / x.seconds

        lines.append(
            f"| {label} | {d:.3f} | {today.seconds * 1e3:.3f} ({ratio(today, 0):.2f}), "
            f"{today.tail:.2f} | {half.seconds * 1e3:.3f} ({ratio(half, 1):.2f}), "
            f"{half.tail:.2f} | {100 * (half.seconds / today.seconds - 1):+.0f} % | "
            f"{three.seconds * 1e3:.3f} ({ratio(three, 2):.2f}) | {stride.seconds * 1e3:.3f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The backward: attn_bwd_preprocess, then attn_bwd_dkdv (a CTA per key tile, over the CSC
# column) and attn_bwd_dq (a CTA per query tile, over the CSR row), mma.sync, x fastest


def _static_tile_cycles(kernel: str, block: int, head_dim: int, warps: int) -> float:
    """An SM's cycles for one step tile of a CTA, from the static model's committed counts (the
    baseline at bench/results): the larger of issue (instructions x warps / 4 schedulers) and
    tensor (HMMA x warps / HMMA_PER_SM_CYCLE)."""
    label = {"attn_bwd_dkdv": "dkdv", "attn_bwd_dq": "dq"}[kernel]
    entry = json.loads(STATIC_BASELINE.read_text())["instantiations"][
        f"{label} d{head_dim} b{block}"
    ]
    instructions = entry["instructions_per_tile"]
    hmma = instructions / entry["instructions_per_hmma"]
    return max(instructions * warps / 4, hmma * warps / HMMA_PER_SM_CYCLE)


def bwd_ctas(layout: object, batch: int, head_dim: int, kernel: str) -> tuple[list[Cta], int]:
    """(CTAs in start order, resident CTAs per SM) of attn_bwd_dkdv or attn_bwd_dq; a CTA's
    tensor_cycles are its step tiles times the static model's per-tile cycles."""
    block = layout.blocksize
    own, step, warps = geometry.tile_sizes(kernel, block, head_dim, "bfloat16")
    config = geometry.KernelConfig(kernel, head_dim, "bfloat16", block=block, rule="causal")
    baseline = json.loads(STATIC_BASELINE.read_text())["instantiations"]
    label = {"attn_bwd_dkdv": "dkdv", "attn_bwd_dq": "dq"}[kernel]
    regs = baseline[f"{label} d{head_dim} b{block}"]["registers"]
    resident = geometry.ctas_per_sm("sm_90", regs, config.threads, config.smem_bytes)
    per_tile = _static_tile_cycles(kernel, block, head_dim, warps)
    heads = layout.blocks.shape[0]
    partial = _partial(layout)
    out = []
    for b in range(batch):
        for h in range(heads):
            grid = layout.blocks[h] if kernel == "attn_bwd_dq" else layout.blocks[h].T
            part = partial[h] if kernel == "attn_bwd_dq" else partial[h].T
            counts = grid.sum(axis=1) * (block // step)
            masked = part.sum(axis=1) * (block // step)
            for blk in range(grid.shape[0]):
                for _ in range(block // own):
                    out.append(
                        Cta(
                            b * heads + h,
                            blk,
                            int(counts[blk]),
                            counts[blk] * per_tile,
                            int(masked[blk]),
                            (),
                        )
                    )
    return out, resident


def bwd_terms(layout: object, batch: int, head_dim: int) -> list[tuple[np.ndarray, int]]:
    """Per backward block kernel: ([CTAs, 2] of (1, static tile cycles), resident CTAs)."""
    out = []
    for kernel in ("attn_bwd_dkdv", "attn_bwd_dq"):
        ctas, resident = bwd_ctas(layout, batch, head_dim, kernel)
        out.append((np.array([[1.0, c.tensor_cycles] for c in ctas]), resident))
    return out


def preprocess_seconds(n_q: int, heads: int, batch: int, head_dim: int) -> float:
    """delta = rowsum(dout * out): out and dout read once at the DRAM rate (sass_roofline's)."""
    return 2 * batch * heads * n_q * head_dim * 2 / DRAM_BYTES_PER_S


def predict_bwd(terms: list[tuple[np.ndarray, int]], pre_s: float, p: BwdParams) -> float:
    seconds = p.launch_us * 1e-6 + pre_s
    for t, resident in terms:
        cycles = (t @ np.array([p.cta_cycles, 1 / p.static_efficiency])) * resident
        makespan, _ = list_schedule(cycles, SMS * resident)
        seconds += makespan / CLOCK_HZ
    return seconds


# Three consumer warpgroups at d = 64 (issue 53): what the simulator, the roofline and the CPI
# rule of bench/NOTES.md predict for a CTA of 192 rows (three 64-blocks) against today's 128.
CPI_510D8D7 = 5.35  # cycles between a warp's issues, every consumer warp (ncu on 510d8d7)
CONSUMER_SHAPES = ((4096, 4, 32), (8192, 2, 32))  # (T, batch, heads): batch x T = 16k, 2048 wide


def consumer_rows(p: FwdParams, consumers: Sequence[int] = (2, 3), head_dim: int = 64) -> list:
    """Per (pattern, T): the simulator's prediction for each consumer count at 64-blocks
    (grouped order), under two readings of its per-walked-tile cost: "latency" (a step's cost
    is a consumer's chain, the same with a third warpgroup beside it) and "rows" (a step's cost
    grows with the rows it feeds: only the per-CTA cost and the walk's shape change)."""
    from cuattn.tools.bench.cases import ALL_PATTERNS

    rows = []
    for n_ctx, batch, heads in CONSUMER_SHAPES:
        for pattern in ALL_PATTERNS:
            if n_ctx != CONSUMER_SHAPES[-1][0] and pattern.label != "dense-causal":
                continue
            layout = pattern.make_layout(n_ctx, heads, 64)
            row = {"pattern": pattern.label, "n_ctx": n_ctx, "density": layout.density}
            for c in consumers:
                for reading, scale in (("latency", 1.0), ("rows", c / 2)):
                    q = dataclasses.replace(p, tile_cycles=p.tile_cycles * scale)
                    row[(c, reading)] = predict_fwd(
                        layout, batch, head_dim, q, order="grouped", consumers=c
                    )
            rows.append(row)
    return rows


def consumers_table(p: FwdParams, head_dim: int = 64) -> str:
    """bench/NOTES.md's table of consumer_rows: ms and CTAs, 3 consumers against 2."""
    lines = [
        "| pattern | T | density | 2: CTAs, ms | 3: CTAs | 3 (latency) ms, change | "
        "3 (rows) ms, change | tail 2 / 3 | fixed % 2 / 3 |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in consumer_rows(p, head_dim=head_dim):
        two = r[(2, "latency")]
        lat, rows = r[(3, "latency")], r[(3, "rows")]

        def fixed(x: Prediction) -> float:
            return 100 * x.fixed_cycles / (x.fixed_cycles + x.tile_cycles + x.miss_cycles)

        lines.append(
            f"| {r['pattern']} | {r['n_ctx']} | {r['density']:.3f} | {two.ctas}, "
            f"{two.seconds * 1e3:.3f} | {lat.ctas} | {lat.seconds * 1e3:.3f}, "
            f"{100 * (lat.seconds / two.seconds - 1):+.0f} % | {rows.seconds * 1e3:.3f}, "
            f"{100 * (rows.seconds / two.seconds - 1):+.0f} % | {two.tail:.2f} / {lat.tail:.2f} "
            f"| {fixed(two):.0f} / {fixed(lat):.0f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# The sm_90a backward (attn_bwd_sm90): a CTA per (128-key tile, kv head, batch) walking the
# union of its key blocks' CSC columns in steps of 64 queries, claimed from a counter in the
# order of geometry.sm90_backward_cta_groups' groups and kernels.backward_tile_order, each
# step's dQ reduced into its query tile at its rank (dev/bwd_order_model.py's waits, in cycles)

SM90_BWD_TILE_K = 128
SM90_BWD_TILE_Q = 64
# An SM's roofline cycles of one step, both consumers computing and one (the other skipping:
# a 64-block pair whose other block lacks the step), and of a CTA's per-CTA code and K/V bytes:
# dev/sass_roofline.sm90_backward_step_cycles of the committed kernel (bf16, causal; NVRTC 12.9
# sm_90a), by (head dim, block). tests/dev/test_schedule.py recomputes them where NVRTC is.
SM90_BWD_STEP_CYCLES = {
    (64, 64): (2984.4, 2561.6, 3269.5),
    (64, 128): (2970.4, 2554.6, 3256.7),
    (128, 64): (5601.1, 4915.9, 6183.9),
    (128, 128): (5581.9, 4906.5, 6174.3),
}
# What a CTA's fixed cost adds to its roofline part: the latency of its set-up, pipeline fill and
# drain and epilogue, which no roofline has. Assumed to be the sm_90a forward's fitted C_cta
# (bench/results/2026-12-02-schedule-calibration.json: set-up, a 128-row tile in and one out, the
# pipeline filled and drained), the one measured fixed cost of a wgmma/TMA kernel of ours.
SM90_BWD_LATENCY_CYCLES = 7711.0
# The bulk reduce of one step's fp32 dQ tile (32 KB at d128): its latency in full steps (its
# bytes are in the step's roofline); bwd_order_model's bracket.
SM90_BWD_REDUCE_STEPS = (0.3, 1.0)
SM90_BWD_LAUNCH_US = 3.76  # a launch (the forward's fitted launch_us)


@dataclass(frozen=True)
class BwdItem:
    """One CTA of attn_bwd_sm90 (or one item of a persistent backward), in claim order: its
    (kv head, batch) pair, key tile, and steps as (query pair, query step, consumers computing:
    2, or 1 where a 64-block pair's other block lacks the step)."""

    kv_pair: int
    tile: int
    steps: tuple[tuple[int, int, int], ...]
    chunk: int = 0  # its place among a split column's chunks (0: unsplit or the first)


def bwd_sm90_items(layout: object, batch: int, head_dim: int, kv_group: int = 1) -> list[BwdItem]:
    """attn_bwd_sm90's CTAs in the order they claim their work: the (kv head, batch) pairs in
    geometry.sm90_backward_cta_groups' groups, position-major within a group over the kv head's
    kernels.backward_tile_order (the kernel's grouped_item). The rule's masks are not modelled:
    a step is computed by the consumers whose key block's column holds its query block."""
    from cuattn.backends.kernels import backward_tile_order

    block = layout.blocksize
    key_blocks = SM90_BWD_TILE_K // block
    blocks = np.asarray(layout.blocks, dtype=bool)
    heads, nbq, nb = blocks.shape
    kv_heads = heads // kv_group
    tiles = -(-nb // key_blocks)
    padded = np.zeros((heads, nbq, tiles * key_blocks), bool)
    padded[:, :, :nb] = blocks
    per_tile = padded.reshape(heads, nbq, tiles, key_blocks).sum(axis=3)  # blocks held (0-2)
    order = backward_tile_order(blocks, key_blocks, kv_group)
    steps_per_block = block // SM90_BWD_TILE_Q
    columns: dict[tuple[int, int], tuple[tuple[int, int, int], ...]] = {}
    for kv_head in range(kv_heads):
        for tile in range(tiles):
            steps = []
            for h in range(kv_head * kv_group, (kv_head + 1) * kv_group):
                for i in np.flatnonzero(per_tile[h, :, tile]):
                    held = int(per_tile[h, i, tile]) * (2 // key_blocks)
                    steps += [
                        (h, int(i) * steps_per_block + s, held) for s in range(steps_per_block)
                    ]
            columns[(kv_head, tile)] = tuple(steps)
    groups = geometry.sm90_backward_cta_groups(
        batch, kv_heads, layout.n_ctx, head_dim, "bfloat16", kv_group
    )
    pairs = batch * kv_heads
    narrow, wide = divmod(pairs, groups)
    out, first = [], 0
    for g in range(groups):
        size = narrow + 1 if g < wide else narrow
        for position in range(tiles):
            for pair in range(first, first + size):
                b, kv_head = divmod(pair, kv_heads)
                tile = int(order[kv_head, position])
                steps = tuple((b * heads + h, q, held) for h, q, held in columns[(kv_head, tile)])
                out.append(BwdItem(pair, tile, steps))
        first += size
    return out


def split_bwd_items(items: Sequence[BwdItem], factor: float, least: int) -> tuple[list, int]:
    """Lever (b): columns walking more than ``factor`` x the mean item's steps (and ``least``)
    cut into chunks of at most that many steps, each an item of its own (its dK/dV a partial
    summed after the launch in chunk order). The items keep the kernel's claim order but for
    the chunks, which take the places their lengths give them within their group (shortest
    first, as tile_order does). (items, the split threshold in steps; 0: none split)."""
    mean = float(np.mean([len(i.steps) for i in items])) if items else 0.0
    above = max(least, int(np.ceil(factor * mean)))
    if not any(len(i.steps) > above for i in items):
        return list(items), 0
    out: list[BwdItem] = []
    for item in items:
        if len(item.steps) <= above:
            out.append(item)
            continue
        chunks = -(-len(item.steps) // above)
        size = -(-len(item.steps) // chunks)
        out += [
            BwdItem(item.kv_pair, item.tile, item.steps[k * size : (k + 1) * size], k + 1)
            for k in range(chunks)
        ]
    return out, above


@dataclass(frozen=True)
class BwdSchedule:
    """A backward schedule to simulate: ``persistent`` (SMS CTAs taking the items in claim order
    from a counter; an item pays ``item_share`` of the fixed latency, the CTA the rest once, and
    its SM takes the next item once its consumers are done, the last reduces running on under
    the next item) or one CTA per item (the SM frees when the CTA's last reduce has ended);
    ``ordered`` dQ (each reduce at its rank) or not; the reduce's latency in full steps."""

    persistent: bool = False
    item_share: float = 1.0
    ordered: bool = True
    reduce_steps: float = 0.3
    dq_copies: int = 1  # lever (c): rank r adds into copy r % dq_copies after rank r - copies


def simulate_bwd_sm90(
    items: Sequence[BwdItem], head_dim: int, block: int, schedule: BwdSchedule
) -> Prediction:
    """The main kernel's makespan over SMS SMs (one resident CTA each), the items simulated in
    claim order: every wait is on an item claimed before (what the ranks guarantee), so each is
    known when reached. An item costs its fixed cycles (SM90_BWD_STEP_CYCLES' per-CTA part and
    its share of SM90_BWD_LATENCY_CYCLES) before its first step, then a step's roofline cycles a
    step; a step's dQ store waits until the previous reduce (of the same CTA) has read the tile
    (taken as its whole latency), and an ordered reduce into a (query pair, query step) tile
    waits for the reduce ranked before it to end (bwd_order_model's rules, in cycles)."""
    full, half, cta = SM90_BWD_STEP_CYCLES[(head_dim, block)]
    reduce = schedule.reduce_steps * full
    share = schedule.item_share if schedule.persistent else 1.0
    fixed_each = cta + share * SM90_BWD_LATENCY_CYCLES
    per_slot = (1 - share) * SM90_BWD_LATENCY_CYCLES if schedule.persistent else 0.0
    free = [(per_slot, s) for s in range(SMS)]
    heapq.heapify(free)
    last_read: list[float | None] = [None] * SMS  # a persistent CTA's last reduce start
    reduce_end: dict[tuple[int, int, int], float] = {}
    adders: dict[tuple[int, int], int] = {}  # reduces into each tile so far: the next rank
    end = fixed = steps_cycles = 0.0
    for item in items:
        start, slot = heapq.heappop(free)
        t = start + fixed_each
        fixed += fixed_each
        previous = last_read[slot] if schedule.persistent else None
        finish = t
        for pair, q, held in item.steps:
            cost = full if held == 2 else half
            steps_cycles += cost
            computed = t + cost
            if previous is not None:
                computed = max(computed, previous + reduce)
            begin = computed
            rank = adders.get((pair, q), 0)
            adders[(pair, q)] = rank + 1
            copy = (pair, q, rank % schedule.dq_copies)
            if schedule.ordered:
                begin = max(begin, reduce_end.get(copy, 0.0))
            reduce_end[copy] = finish = begin + reduce
            previous = begin
            t = computed
        last_read[slot] = previous
        # one shot: the SM frees when the last reduce has ended; persistent: once the
        # consumers are done (the reduce thread finishes it under the next item)
        done = max(t, finish) if not schedule.persistent else t
        heapq.heappush(free, (done, slot))
        end = max(end, finish)
    total = fixed + steps_cycles + per_slot * SMS * schedule.persistent
    return Prediction(
        seconds=SM90_BWD_LAUNCH_US * 1e-6 + end / CLOCK_HZ,
        makespan_cycles=end,
        balanced_cycles=total / SMS,
        fixed_cycles=fixed,
        tile_cycles=steps_cycles,
        miss_cycles=0.0,
        misses=0,
        compulsory=0,
        ctas=len(items),
    )


def split_sum_seconds(items: Sequence[BwdItem], head_dim: int) -> float:
    """Lever (b)'s second pass: each split column's chunk partials (fp32 dK and dV, 128 keys)
    read once and its dK/dV written (16-bit) at the DRAM rate, after a launch; 0 where nothing
    is split."""
    chunks = sum(1 for i in items if i.chunk)
    if not chunks:
        return 0.0
    columns = sum(1 for i in items if i.chunk == 1)
    tile = SM90_BWD_TILE_K * head_dim * K_AND_V
    return SM90_BWD_LAUNCH_US * 1e-6 + (chunks * tile * 4 + columns * tile * 2) / DRAM_BYTES_PER_S


# The levers of bench/NOTES.md's backward table: (label, persistent item share or None for one
# CTA an item, split long columns, dQ copies); the reduce at SM90_BWD_REDUCE_STEPS[0].
SM90_BWD_LEVERS = (
    ("today", None, False, 1),
    ("(a) 1/2", 0.5, False, 1),
    ("(a) 3/4", 0.75, False, 1),
    ("(b)", None, True, 1),
    ("(a)+(b)", 0.5, True, 1),
    ("(a)+(b)+(c)", 0.5, True, 4),
)
SM90_BWD_SPLIT_FACTOR = 4  # the forward's: a column over 4x the mean item's steps is split
SM90_BWD_SPLIT_LEAST = 8


def predict_bwd_sm90(
    layout: object,
    batch: int,
    head_dim: int,
    persistent_share: float | None = None,
    split: bool = False,
    dq_copies: int = 1,
    ordered: bool = True,
    reduce_steps: float = SM90_BWD_REDUCE_STEPS[0],
    kv_group: int = 1,
) -> Prediction:
    """The sm_90a backward's main kernel (and, split, the partials' sum) on ``layout`` x
    ``batch``: one CTA an item (``persistent_share`` None) or persistent, columns split or not
    (split_bwd_items at SM90_BWD_SPLIT_FACTOR), ``dq_copies`` dQ chains a tile."""
    items = bwd_sm90_items(layout, batch, head_dim, kv_group)
    if split:
        items, _ = split_bwd_items(items, SM90_BWD_SPLIT_FACTOR, SM90_BWD_SPLIT_LEAST)
    schedule = BwdSchedule(
        persistent=persistent_share is not None,
        item_share=1.0 if persistent_share is None else persistent_share,
        ordered=ordered,
        reduce_steps=reduce_steps,
        dq_copies=dq_copies,
    )
    pred = simulate_bwd_sm90(items, head_dim, layout.blocksize, schedule)
    return dataclasses.replace(pred, seconds=pred.seconds + split_sum_seconds(items, head_dim))


def bwd_sm90_table(
    shape: BenchShape = BENCH_SHAPE,
    blocks: Sequence[int] = (64, 128),
    reduce_steps: float = SM90_BWD_REDUCE_STEPS[0],
    labels: Sequence[str] | None = None,
) -> str:
    """bench/NOTES.md's sm_90a backward table: each bench pattern's main-kernel time today (and
    with the dQ unordered: what the ordered reduce's waits cost) and under each
    SM90_BWD_LEVERS lever; ratio = the computed-block rate over dense causal's under the same
    schedule."""
    lines = [
        f"{shape}, reduce {reduce_steps:g} step",
        "",
        "| pattern, block | density | steps a CTA: mean, max | today ms (ratio), tail "
        "| unordered dQ ms | "
        + " | ".join(f"{lever[0]} ms (ratio), change" for lever in SM90_BWD_LEVERS[1:])
        + " |",
        "| --- | ---: | ---: | ---: | ---: | "
        + " | ".join("---:" for _ in SM90_BWD_LEVERS[1:])
        + " |",
    ]
    for block in blocks:
        layouts = shape.layouts(block)
        rows = {}
        for label, layout in layouts.items():
            if labels is not None and label not in labels and label != "dense-causal":
                continue
            items = bwd_sm90_items(layout, shape.batch, shape.head_dim)
            steps = [len(i.steps) for i in items]
            preds = [
                predict_bwd_sm90(
                    layout,
                    shape.batch,
                    shape.head_dim,
                    share,
                    split,
                    copies,
                    reduce_steps=reduce_steps,
                )
                for _, share, split, copies in SM90_BWD_LEVERS
            ]
            unordered = predict_bwd_sm90(
                layout, shape.batch, shape.head_dim, ordered=False, reduce_steps=reduce_steps
            )
            rows[label] = (layout.density, np.mean(steps), max(steps), unordered, preds)
        base_density, *_, base = rows["dense-causal"]
        for label, (density, mean, most, unordered, preds) in rows.items():
            if labels is not None and label not in labels:
                continue

            def ratio(
                i: int,
                density: float = density,
                preds: list = preds,
                base_density: float = base_density,
                base: list = base,
            ) -> float:
                return density / base_density * base[i].seconds / preds[i].seconds

            today = preds[0]
            cells = [
                f"{label}, {block}",
                f"{density:.3f}",
                f"{mean:.1f}, {most}",
                f"{today.seconds * 1e3:.3f} ({ratio(0):.2f}), {today.tail:.2f}",
                f"{unordered.seconds * 1e3:.3f}",
            ]
            for i in range(1, len(preds)):
                change = 100 * (preds[i].seconds / today.seconds - 1)
                cells.append(f"{preds[i].seconds * 1e3:.3f} ({ratio(i):.2f}), {change:+.0f} %")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------


def load_fitted(path: Path | None = None) -> tuple[FwdParams, BwdParams]:
    """The constants of the committed calibration (dev/calibrate_schedule.py)."""
    from dev.calibrate_schedule import CALIBRATION_JSON

    data = json.loads((path or CALIBRATION_JSON).read_text())
    return FwdParams(**data["fwd_params"]), BwdParams(**data["bwd_params"])


# The what-ifs of bench/NOTES.md: (label, description, kwargs of predict_persistent or None for
# today's grid, tile_n). Shares are of today's fitted per-CTA cost; they are assumptions until a
# GPU run measures a persistent item's cost.
WHATIFS = (
    ("today", "one CTA per 128 rows, heads fastest (510d8d7)", None, None),
    ("grouped", "change 34: heads fastest within L2-sized groups of pairs", "grouped", None),
    (
        "P",
        "persistent, longest first within the groups, an item pays 1/2",
        {"item_share": 0.5},
        None,
    ),
    (
        "P-pack",
        "P, rows under 16 tiles packed (1/4 each after the first), rows over 4x the median split",
        {"item_share": 0.5, "row_share": 0.25, "pack_below": 16, "split_factor": 4},
        None,
    ),
    (
        "P-pack-1/4",
        "as P-pack, an item 1/4, a packed row 1/8",
        {"item_share": 0.25, "row_share": 0.125, "pack_below": 16, "split_factor": 4},
        None,
    ),
    ("W", "128-key tiles at 64-blocks, today's grid, a half-empty tile masked", "mask", 128),
    ("W-skip", "W, a half-empty tile as the N = 64 wgmma over its half", "skip", 128),
    (
        "P-pack+W-skip",
        "P-pack with W-skip's tiles (pack under 8, split over 4x the median)",
        {
            "item_share": 0.5,
            "row_share": 0.25,
            "pack_below": 8,
            "split_factor": 4,
            "half_tiles": "skip",
        },
        128,
    ),
)


def whatif(
    layout: object, batch: int, head_dim: int, p: FwdParams, how: object, tile_n: int | None
) -> Prediction:
    """One WHATIFS schedule: a dict is predict_persistent's keywords; a string the order
    ("grouped") or, with a tile_n, the half-tile rule of today's grid."""
    if isinstance(how, dict):
        return predict_persistent(layout, batch, head_dim, p, tile_n=tile_n, **how)
    if how in HALF_TILES:
        return predict_fwd(layout, batch, head_dim, p, tile_n=tile_n, half_tiles=how)
    return predict_fwd(layout, batch, head_dim, p, order=how or "heads-fastest", tile_n=tile_n)


def whatif_tables(
    p: FwdParams,
    shape: BenchShape = BENCH_SHAPE,
    block: int = 64,
) -> str:
    """bench/NOTES.md's tables: every bench pattern under each WHATIFS schedule, with the
    measured 510d8d7 forward beside today's prediction."""
    measured = _measured_fwd(shape.n_ctx, shape.head_dim, block)
    preds: dict[str, dict[str, Prediction]] = {}
    density = {}
    for label, layout in shape.layouts(block).items():
        density[label] = layout.density
        preds[label] = {
            w[0]: whatif(layout, shape.batch, shape.head_dim, p, w[2], w[3]) for w in WHATIFS
        }
    base = "dense-causal"

    def ratio(label: str, seconds: float, causal_seconds: float) -> float:
        return density[label] / density[base] * causal_seconds / seconds

    lines = [
        f"{shape}, {block}-blocks; ratio = "
        "computed-block rate over dense causal's under the same schedule",
        "",
        "| pattern | density | measured ms (ratio) | today ms (ratio), error | tail | fixed % "
        "| miss % | " + " | ".join(f"{w[0]} ms (ratio)" for w in WHATIFS[1:]) + " |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | "
        + " | ".join("---:" for _ in WHATIFS[1:])
        + " |",
    ]
    for label, row in preds.items():
        today = row["today"]
        work = today.fixed_cycles + today.tile_cycles + today.miss_cycles
        meas = measured.get(label)
        cells = [label, f"{density[label]:.3f}"]
        if meas:
            cells.append(f"{meas * 1e3:.3f} ({ratio(label, meas, measured[base]):.2f})")
            err = f"{100 * (today.seconds / meas - 1):+.0f} %"
        else:
            cells.append("-")
            err = "-"
        cells.append(
            f"{today.seconds * 1e3:.3f} "
            f"({ratio(label, today.seconds, preds[base]['today'].seconds):.2f}), {err}"
        )
        cells += [
            f"{today.tail:.2f}",
            f"{100 * today.fixed_cycles / work:.0f}",
            f"{100 * today.miss_cycles / work:.0f}",
        ]
        for w in WHATIFS[1:]:
            pw = row[w[0]]
            cells.append(
                f"{pw.seconds * 1e3:.3f} "
                f"({ratio(label, pw.seconds, preds[base][w[0]].seconds):.2f})"
            )
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *(f"* {w[0]}: {w[1]}" for w in WHATIFS)]
    return "\n".join(lines)


def _measured_fwd(n_ctx: int, head_dim: int, block: int) -> dict[str, float]:
    """The 510d8d7 sweep's forward medians (seconds) by pattern at this shape (MHA rows)."""
    path = ROOT / "bench" / "results" / "2026-11-26-h200-510d8d7" / "full-partial.json"
    out = {}
    for r in json.loads(path.read_text())["records"]:
        c = r["case"]
        if (c["n_ctx"], c["head_dim"], c["blocksize"], c["direction"], c["kv_heads"]) == (
            n_ctx,
            head_dim,
            block,
            "fwd",
            0,
        ):
            out[c["pattern"]["label"]] = r["results"]["cuattn-cuda"]["median_ms"] * 1e-3
    return out


def main(argv: Sequence[str] | None = None) -> int:
    from cuattn.tools.bench.cases import ALL_PATTERNS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pattern", default=None, help="a bench pattern label (default: all)")
    parser.add_argument("--n-ctx", type=int, default=BENCH_SHAPE.n_ctx)
    parser.add_argument("--heads", type=int, default=BENCH_SHAPE.heads)
    parser.add_argument("--batch", type=int, default=BENCH_SHAPE.batch)
    parser.add_argument("--head-dim", type=int, default=BENCH_SHAPE.head_dim)
    parser.add_argument("--block", type=int, default=64)
    parser.add_argument("--order", default="heads-fastest", choices=ORDERS)
    parser.add_argument("--whatif", action="store_true", help="bench/NOTES.md's what-if tables")
    parser.add_argument(
        "--persistent", action="store_true", help="the persistent forward's table (bench/NOTES.md)"
    )
    parser.add_argument("--split", action="store_true", help="the split-row table (bench/NOTES.md)")
    parser.add_argument("--pack", action="store_true", help="the packing table (bench/NOTES.md)")
    parser.add_argument(
        "--cap", action="store_true", help="the split-cap table (bench/NOTES.md): this shape"
    )
    parser.add_argument(
        "--few-items", action="store_true", help="the few-items split table (bench/NOTES.md)"
    )
    parser.add_argument(
        "--consumers", action="store_true", help="three consumers at d = 64 (bench/NOTES.md)"
    )
    parser.add_argument(
        "--qbuffer", action="store_true", help="the double-buffered Q table (bench/NOTES.md)"
    )
    parser.add_argument(
        "--bwd-sm90",
        action="store_true",
        help="the sm_90a backward's table: today and its levers (bench/NOTES.md)",
    )
    args = parser.parse_args(argv)
    fwd, _ = load_fitted()
    shape = BenchShape(args.n_ctx, args.heads, args.batch, args.head_dim)
    if args.whatif:
        print(whatif_tables(fwd, shape, args.block))
        return 0
    if args.consumers:
        print(consumers_table(fwd))
        return 0
    if args.pack:
        print(pack_table(fwd, shape))
        return 0
    if args.qbuffer:
        print(qbuffer_table(fwd, shape))
        return 0
    if args.split:
        print(split_table(fwd, shape=shape))
        return 0
    if args.cap:
        print(cap_table(fwd, [shape], [args.pattern] if args.pattern else None))
        return 0
    if args.few_items:
        print(few_items_table(fwd))
        return 0
    if args.persistent:
        print(persistent_table(fwd, shape, args.block))
        return 0
    if args.bwd_sm90:
        for reduce in SM90_BWD_REDUCE_STEPS:
            print(bwd_sm90_table(shape, reduce_steps=reduce) + "\n")
        return 0
    print("| pattern | density | CTAs | predicted ms | tail | fixed % | miss % |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for pattern in ALL_PATTERNS:
        if args.pattern and pattern.label != args.pattern:
            continue
        layout = pattern.make_layout(args.n_ctx, args.heads, args.block)
        pred = predict_fwd(layout, args.batch, args.head_dim, fwd, order=args.order)
        work = pred.fixed_cycles + pred.tile_cycles + pred.miss_cycles
        print(
            f"| {pattern.label} | {layout.density:.3f} | {pred.ctas} | {pred.seconds * 1e3:.3f} | "
            f"{pred.tail:.2f} | {100 * pred.fixed_cycles / work:.0f} | "
            f"{100 * pred.miss_cycles / work:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
