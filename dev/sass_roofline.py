"""Time from static counts: a four-resource roofline with partial overlap, calibrated on the one
H100 profile we have (bench/results/2026-11-23-h100: ncu of f532ccd's kernels and SDPA-flash's
in the same run), and the report of ``python -m dev sass``.

The model. A kernel's work on the whole GPU (warp instructions, HMMA, shared-memory wavefronts,
bytes through L2) keeps four resources of each of the SMS SMs busy for
  issue   instructions / (4 schedulers x 1 instruction per cycle)
  tensor  HMMA / HMMA_PER_SM_CYCLE (2/3: each SMSP finishes one m16n8k16 mma every 6 cycles)
  shared  (load + store wavefronts) / 1 wavefront (128 B) per cycle
  L2      bytes / L2_BYTES_PER_S (the whole GPU)
cycles each. The slowest sets the time; at 2 warps per scheduler the others hide only partly
behind it, so each adds OVERLAP x (REFERENCE_WARPS / resident warps) of its own time:
  time = (max + overlap x (sum - max)) / CLOCK_HZ
HMMA_PER_SM_CYCLE and L2_BYTES_PER_S are read off the profile (tensor-pipe % against HMMA
counts; L2 % against bytes moved), OVERLAP is the one fitted constant (least squares in log
time over the five profiled kernels). Work per kernel comes from sass_model.py's per-tile counts
times the tiles a dense causal layout walks (``causal_tiles``, the kernels' own walk rules),
plus per-CTA code. Not modelled: the tail wave, bank conflicts (under 1 % of shared loads in
the profile), the instruction cache, DRAM (the attention kernels hit L2 95-97 %).

The sm_90a backward (kernels/attn_bwd_sm90.cu) runs wgmma, which no profile of ours has
measured: its tensor term is its HGMMA FLOP at WGMMA_FLOP_PER_SM_CYCLE (the dense bf16 peak,
1.5x the mma.sync rate above), and its shared term adds what the HGMMA read from shared memory
(sass.hgmma_shared_bytes: each operand byte once per warpgroup), the TMA copies it receives and
the fp32 dQ tile the bulk reduce reads, at the same 128 bytes a cycle. Its warps are 8 consumer
warps, whose counts are per step, and a producer whose two active warps' step loops count once
a step (``sm90_backward_work``).

The sm_90a forward (kernels/attn_fwd_sm90.cu) is modelled the same way (``sm90_forward_work``):
its consumer tiles' HGMMA FLOP at the wgmma rate; QK^T's Q and K and PV's V read from shared
memory, the TMA writes of Q, K and V and the O tile's stores and TMA read as shared wavefronts;
K and V a step, Q, out and lse an item through L2; and a fifth resource, DRAM, at
DRAM_BYTES_PER_S: the compulsory bytes (q, k, v read once, out and lse written once) unless
given, e.g. the DRAM reads ncu measured on the 510d8d7 run (``SM90_FORWARD_MEASURED_DRAM``).
The report sets its prediction beside that run's measured times (``SM90_FORWARD_MEASURED``).
"""

from __future__ import annotations

import csv
import dataclasses
import math
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from dev import sass
from dev.sass_model import (
    PARTIAL_TILE_CODE,
    SM90_BWD_KINDS,
    SM90_BWD_PERSISTENT_KIND,
    SM90_FWD_KINDS,
    SM90_FWD_PERSISTENT_KIND,
    STATS_BYTES,
    WGMMA_M,
    HotSpec,
    TileModel,
    format_counts_table,
    format_origin_table,
    model_specs,
)

SMS = 132  # H100 SXM
CLOCK_HZ = 1.83e9  # SM clock ncu reported for the profiled kernels (1.81-1.86 GHz)
SCHEDULERS = 4
ISSUE_PER_SM_CYCLE = SCHEDULERS * 1
# From ncu: HMMA count / (SM active cycles x tensor-pipe % of peak) = 0.666-0.667 for all five
# profiled kernels (ours and SDPA-flash's): one HMMA.16816.F32 per SMSP every 6 cycles.
HMMA_PER_SM_CYCLE = 2 / 3
SHARED_WAVEFRONTS_PER_SM_CYCLE = 1.0  # 32 banks x 4 bytes
# From ncu: bytes our three kernels move through L2 / duration / "L2 Cache Throughput" % =
# 5.81-5.91 TB/s.
L2_BYTES_PER_S = 5.85e12
# wgmma's dense fp16/bf16 peak: 989 TFLOP/s over 132 SMs at 1.83 GHz (not measured by us).
WGMMA_FLOP_PER_SM_CYCLE = 4096
# From ncu: the backward preprocess (out and dout read once, delta written) at 2.65 TB/s.
DRAM_BYTES_PER_S = 2.65e12
REFERENCE_WARPS = 8  # resident warps per SM at which OVERLAP is fitted
OVERLAP = 0.32  # fitted: see calibrate()

# The checkout's committed profile (absent from an installed wheel: then no calibration, no
# SDPA-flash rows and no ratios).
PROFILE_DIR = Path(__file__).resolve().parents[1] / "bench" / "results" / "2026-11-23-h100"
PROFILE_CSV = "ncu-metrics-f532ccd.csv"
PROFILE_COMMIT = "f532ccd"
MS = 1e3


@dataclass(frozen=True)
class Work:
    """A kernel launch's work on the whole GPU and its resident warps per SM."""

    instructions: float
    hmma: float
    ld_wavefronts: float
    st_wavefronts: float
    l2_bytes: float
    warps_per_sm: int
    wgmma_flop: float = 0.0
    dram_bytes: float = 0.0  # the sm_90a forward's (sm90_forward_work); 0: not modelled

    def cycles(self) -> dict[str, float]:
        """Busy cycles per SM of each resource."""
        return {
            "issue": self.instructions / (SMS * ISSUE_PER_SM_CYCLE),
            "tensor": self.hmma / (SMS * HMMA_PER_SM_CYCLE)
            + self.wgmma_flop / (SMS * WGMMA_FLOP_PER_SM_CYCLE),
            "shared": (self.ld_wavefronts + self.st_wavefronts)
            / (SMS * SHARED_WAVEFRONTS_PER_SM_CYCLE),
            "L2": self.l2_bytes / (L2_BYTES_PER_S / CLOCK_HZ),
            "DRAM": self.dram_bytes / (DRAM_BYTES_PER_S / CLOCK_HZ),
        }


def predict_seconds(work: Work, overlap: float = OVERLAP) -> float:
    """The roofline's time for ``work`` (module docstring); ``overlap`` only for fitting."""
    cycles = work.cycles()
    slowest = max(cycles.values())
    hidden = overlap * REFERENCE_WARPS / max(work.warps_per_sm, 1)
    return (slowest + hidden * (sum(cycles.values()) - slowest)) / CLOCK_HZ


def bound(work: Work) -> str:
    """The resource that sets ``work``'s time."""
    cycles = work.cycles()
    return max(cycles, key=cycles.__getitem__)


# ----------------------------------------------------------------------------------------------
# Dense causal workloads


@dataclass(frozen=True)
class Shape:
    """A dense causal problem: batch x heads of n_ctx queries and keys, head dim d."""

    n_ctx: int
    batch: int
    heads: int
    head_dim: int
    itemsize: int = 2

    @property
    def pairs(self) -> int:
        return self.batch * self.heads


# What the benchmark sweeps: batch x T = 16k tokens, heads x d = 2048.
BENCH_TOKENS = 16384
BENCH_WIDTH = 2048
PROFILE_SHAPE = Shape(4096, 4, 16, 128)


def bench_shape(n_ctx: int, head_dim: int) -> Shape:
    return Shape(n_ctx, BENCH_TOKENS // n_ctx, BENCH_WIDTH // head_dim, head_dim)


def causal_tiles(n_ctx: int, block: int, own: int, step: int, own_is_query: bool):
    """(CTAs, tiles, partial tiles) one head of a dense causal layout walks: CTAs of ``own``
    rows, each over the sub-tiles of ``step`` rows of its CSR row (own = queries) or CSC column
    (own = keys) that the causal rule does not empty (kernels/common/walk.cuh, mask.cuh)."""
    blocks = -(-n_ctx // block)
    ctas = tiles = partial = 0
    for own_start in range(0, n_ctx, own):
        own_last = min(own_start + own, n_ctx) - 1
        own_block = own_start // block
        ctas += 1
        partners = range(own_block + 1) if own_is_query else range(own_block, blocks)
        for partner in partners:
            diagonal = partner == own_block
            for start in range(partner * block, min((partner + 1) * block, n_ctx), step):
                last = start + step - 1
                ragged = last >= n_ctx
                q0, q1, k0, k1 = (
                    (own_start, own_last, start, last)
                    if own_is_query
                    else (start, last, own_start, own_last)
                )
                if not diagonal:
                    tiles += 1
                    partial += ragged
                elif k0 > q1:
                    continue
                else:
                    tiles += 1
                    partial += not (k1 <= q0 and not ragged)
    return ctas, tiles, partial


def paired_causal_tiles(n_ctx: int, block: int, step: int) -> tuple[int, int, int, int]:
    """(CTAs, steps, tiles, partial tiles) one head of a dense causal layout takes in the paired
    forward (two query blocks per CTA, walk.cuh's PairedRowTiles): a step per key sub-tile of
    the union of the two rows (the second block's row, which holds the first's), each read once
    from L2; tiles and partial tiles per query block, which only that block's warps work."""
    blocks = -(-n_ctx // block)
    _, tiles, partial = causal_tiles(n_ctx, block, block, step, own_is_query=True)
    steps = 0
    for first in range(0, blocks, 2):
        last = min(first + 1, blocks - 1)
        steps += len(range(0, min((last + 1) * block, n_ctx), step))
    return -(-blocks // 2), steps, tiles, partial


@dataclass(frozen=True)
class Sm90BackwardSteps:
    """What one head of a dense causal layout gives the sm_90a backward: CTAs (128 keys each),
    steps (64 queries of the union of the CTA's columns, each copied and reduced once), and per
    consumer (64 keys) and step whether it computes the step (``computed``; ``partial`` of those
    under the rule's mask) or skips it (``skipped``: its keys out of the step's reach)."""

    ctas: int
    steps: int
    computed: int
    partial: int
    skipped: int

    def times(self, pairs: int) -> Sm90BackwardSteps:
        return Sm90BackwardSteps(*(pairs * x for x in dataclasses.astuple(self)))


def sm90_backward_steps(n_ctx: int, block: int, tile_k: int = 128, tile_q: int = 64):
    """Sm90BackwardSteps of one head, queries = keys = n_ctx, causal. A CTA's column (the union
    of its blocks' columns) starts at its first key block's query block; a consumer whose first
    key is past the step's last query skips it, one whose last key is at most the step's first
    query (not ragged) computes it whole."""
    consumer = tile_k // 2
    ctas = steps = computed = partial = skipped = 0
    for k_start in range(0, n_ctx, tile_k):
        ctas += 1
        first_query = k_start // block * block
        for q0 in range(first_query, n_ctx, tile_q):
            q1 = min(q0 + tile_q, n_ctx) - 1
            steps += 1
            for key_first in (k_start, k_start + consumer):
                key_last = min(key_first + consumer, n_ctx) - 1
                if key_first >= n_ctx or key_first > q1:
                    skipped += 1
                    continue
                computed += 1
                partial += not (key_last <= q0 and q0 + tile_q <= n_ctx)
    return Sm90BackwardSteps(ctas, steps, computed, partial, skipped)


def sm90_backward_work(model: TileModel, shape: Shape) -> Work:
    """The sm_90a backward's main kernel over a dense causal ``shape`` (module docstring)."""
    spec = model.spec
    n = sm90_backward_steps(shape.n_ctx, spec.block, spec.tile_m, spec.tile_n).times(shape.pairs)
    return sm90_backward_work_of(model, n)


def sm90_backward_work_of(
    model: TileModel, n: Sm90BackwardSteps, grid_ctas: int | None = None
) -> Work:
    """The sm_90a backward's main kernel over the CTAs and steps ``n`` (any layout's): for
    attn_bwd_sm90_persistent ``n.ctas`` are its items, run by ``grid_ctas`` CTAs (by default
    one an SM, at most one an item), each item paying the per-item code, each CTA the
    per-CTA code."""
    spec = model.spec
    group = sass.WARPGROUP_WARPS  # a consumer's warps; the counts are per warp
    consumer_warps = spec.tile_m // WGMMA_M * group
    skip = model.skipped
    if spec.kind == SM90_BWD_PERSISTENT_KIND:
        ctas = min(SMS, n.ctas) if grid_ctas is None else grid_ctas
    else:
        ctas = n.ctas

    def per_consumer_step(tile: float, part: float, skipped_key: str) -> float:
        return group * (n.computed * tile + n.partial * part + n.skipped * skip.get(skipped_key, 0))

    def per_pair_step(tile: float) -> float:
        """What the skipped path issues is dQ_part over its partner's 64 keys, which the
        partner also runs in place of its 128-key dQ_part (twice that): a step one consumer
        skips adds up to one computed step (a causal layout never has both skip one)."""
        return group * n.computed * tile

    skipped_instructions = sum(skip.get(c, 0.0) for c in sass.CLASSES)
    producer = sum(model.producer.get(c, 0.0) for c in sass.CLASSES)
    instructions = (
        spec.warps * ctas * sum(model.per_cta.values())
        + n.ctas
        * (consumer_warps * sum(model.per_item.values()) + sum(model.producer_item.values()))
        + group
        * (
            n.computed * model.instructions
            + n.partial * sum(model.partial.values())
            + n.skipped * skipped_instructions
        )
        + n.steps * producer
    )
    wgmma_bytes = per_pair_step(model.wgmma_shared_bytes)
    dq_tile = spec.tile_n * spec.head_dim * STATS_BYTES  # the fp32 dQ tile a step reduces
    kv_bytes = 2 * spec.tile_m * spec.head_dim * spec.itemsize
    ld = (
        per_consumer_step(model.ld_wavefronts, model.partial_ld_wavefronts, "ld_wavefronts")
        + wgmma_bytes / sass.WAVEFRONT_BYTES
        + n.steps * dq_tile / sass.WAVEFRONT_BYTES
    )
    st = (
        per_consumer_step(model.st_wavefronts, model.partial_st_wavefronts, "st_wavefronts")
        + n.steps * spec.step_bytes / sass.WAVEFRONT_BYTES
        + n.ctas * kv_bytes / sass.WAVEFRONT_BYTES
    )
    return Work(
        instructions=instructions,
        hmma=0.0,
        ld_wavefronts=ld,
        st_wavefronts=st,
        l2_bytes=n.steps * (spec.step_bytes + 2 * dq_tile) + n.ctas * 2 * kv_bytes,
        warps_per_sm=model.warps_per_sm,
        wgmma_flop=per_pair_step(model.wgmma_flop),
    )


@dataclass(frozen=True)
class Sm90BackwardStepCycles:
    """An SM's roofline cycles (``predict_seconds`` x the clock, every SM alike) for one step of
    the sm_90a backward with both consumers computing (``full``: no mask), one computing and one
    skipping (``half``: a 64-block pair whose other block lacks the step), and the per-CTA code
    and K/V bytes once (``cta``: the throughput part of a CTA's fixed cost; its latency, the
    loads' and the pipeline's, is not in the roofline). attn_bwd_sm90_persistent: ``item`` is an
    item's (its code once an item, its K/V bytes) and ``cta`` the code a CTA runs once; 0 and
    the whole fixed cost in attn_bwd_sm90, whose CTA is an item."""

    full: float
    half: float
    cta: float
    item: float = 0.0


def sm90_backward_step_cycles(model: TileModel) -> Sm90BackwardStepCycles:
    """Sm90BackwardStepCycles of one instantiation: the roofline of SMS x one step (or CTA, or
    item)."""

    def cycles(items: int, computed: int, skipped: int, grid_ctas: int | None = None) -> float:
        n = Sm90BackwardSteps(items, SMS * min(1, computed + skipped), computed, 0, skipped)
        return predict_seconds(sm90_backward_work_of(model, n, grid_ctas)) * CLOCK_HZ

    steps = {"full": cycles(0, 2 * SMS, 0, 0), "half": cycles(0, SMS, SMS, 0)}
    if model.spec.kind == SM90_BWD_PERSISTENT_KIND:
        return Sm90BackwardStepCycles(**steps, cta=cycles(0, 0, 0, SMS), item=cycles(SMS, 0, 0, 0))
    return Sm90BackwardStepCycles(**steps, cta=cycles(SMS, 0, 0))


def sm90_backward_hgmma(model: TileModel, shape: Shape) -> int:
    """HGMMA the whole sm_90a backward kernel issues over a dense causal ``shape`` (what ncu's
    instruction count of HGMMA should equal)."""
    spec = model.spec
    n = sm90_backward_steps(shape.n_ctx, spec.block, spec.tile_m, spec.tile_n).times(shape.pairs)
    # a step one consumer skips issues one computed step's HGMMA (sm90_backward_work's
    # per_pair_step): the skipper's dQ_part over one half, its partner's the same in place of
    # its 128-key one
    return round(sass.WARPGROUP_WARPS * n.computed * model.hmma)


def sm90_backward_extra_seconds(shape: Shape) -> float:
    """What the sm_90a backward runs beside its main kernel, DRAM-bound: zeroing the fp32 dQ
    accumulator, then attn_bwd_sm90_dq reading it and writing dq (the semaphores are 1/16 of a
    row's bytes and left out)."""
    elements = shape.pairs * shape.n_ctx * shape.head_dim
    return elements * (2 * STATS_BYTES + shape.itemsize) / DRAM_BYTES_PER_S


# ----------------------------------------------------------------------------------------------
# The sm_90a forward over a dense causal layout


@dataclass(frozen=True)
class Sm90ForwardTiles:
    """What one head of a dense causal layout gives the sm_90a forward: items (128 query rows:
    attn_fwd_sm90's CTAs, attn_fwd_sm90_persistent's work items), steps (key tiles of the union
    of an item's rows, each copied once for both consumers) and per consumer (64 rows) and step
    whether it computes the tile (``computed``; ``partial`` of those under the mask) or skips
    it (``skipped``: the other block's tile in a paired 64-block item, or keys past its rows)."""

    items: int
    steps: int
    computed: int
    partial: int
    skipped: int

    def times(self, pairs: int) -> Sm90ForwardTiles:
        return Sm90ForwardTiles(*(pairs * x for x in dataclasses.astuple(self)))


def sm90_forward_tiles(n_ctx: int, block: int, tile_n: int, tile_m: int = 128):
    """Sm90ForwardTiles of one head, queries = keys = n_ctx, causal. An item walks the key
    blocks up to its last query's (the union of its blocks' rows); a consumer skips a tile of
    a key block past its own (paired 64-blocks) or whose first key is past its last row, and
    computes whole one whose last key is at most its first row (not ragged)."""
    consumer = WGMMA_M  # a consumer warpgroup's rows; tile_m / WGMMA_M consumers an item
    items = steps = computed = partial = skipped = 0
    for q_start in range(0, n_ctx, tile_m):
        items += 1
        keys = min((min(q_start + tile_m, n_ctx) - 1) // block * block + block, n_ctx)
        for k0 in range(0, keys, tile_n):
            k1 = k0 + tile_n - 1
            steps += 1
            for g0 in range(q_start, q_start + tile_m, consumer):
                g1 = min(g0 + consumer, n_ctx) - 1
                own_block = g0 // block if block < tile_m else q_start // block
                if g0 >= n_ctx or k0 // block > own_block or k0 > g1:
                    skipped += 1
                    continue
                computed += 1
                partial += not (k1 <= g0 and k1 < n_ctx and g0 + consumer <= n_ctx)
    return Sm90ForwardTiles(items, steps, computed, partial, skipped)


def sm90_forward_tiles_of(model: TileModel, shape: Shape) -> Sm90ForwardTiles:
    spec = model.spec
    one = sm90_forward_tiles(shape.n_ctx, spec.block, spec.tile_n, spec.tile_m)
    return one.times(shape.pairs)


def sm90_forward_compulsory_dram(shape: Shape) -> float:
    """Bytes the sm_90a forward must move through DRAM: q, k, v read once, out and lse
    written once."""
    elements = shape.pairs * shape.n_ctx * shape.head_dim
    return 4 * elements * shape.itemsize + shape.pairs * shape.n_ctx * STATS_BYTES


def sm90_forward_executed(model: TileModel, shape: Shape, classes: Sequence[str] = sass.CLASSES):
    """Warp instructions of ``classes`` the sm_90a forward executes over a dense causal
    ``shape``: the consumer tiles (computed, their masks, skipped), the producer's steps, the
    code once an item (the 8 consumer warps' and the producer's) and once a CTA (charged to
    the 8 consumer warps; attn_fwd_sm90's CTA is an item, the persistent grid has SMS CTAs)."""
    spec = model.spec
    n = sm90_forward_tiles_of(model, shape)
    group = sass.WARPGROUP_WARPS
    consumers = spec.tile_m // WGMMA_M * group
    persistent = spec.kind == SM90_FWD_PERSISTENT_KIND
    ctas = min(SMS, n.items) if persistent else n.items

    def total(counts: dict[str, float]) -> float:
        return sum(counts.get(c, 0.0) for c in classes)

    return (
        group
        * (
            n.computed * total(model.per_tile)
            + n.partial * total(model.partial)
            + n.skipped * total(model.skipped)
        )
        + n.steps * total(model.producer)
        + n.items
        * (
            consumers * total(getattr(model, "per_item", {}))
            + total(getattr(model, "producer_item", {}))
        )
        + ctas * consumers * total(model.per_cta)
    )


def sm90_forward_work(model: TileModel, shape: Shape, dram_bytes: float | None = None) -> Work:
    """attn_fwd_sm90 (or _persistent) over a dense causal ``shape``: its instructions
    (sm90_forward_executed); wgmma FLOP and operand reads of the computed tiles; TMA writes of
    Q, K, V and the O tile's stores and TMA read as shared wavefronts; K and V a step, Q, out
    and lse an item through L2; DRAM ``dram_bytes``, by default the compulsory bytes."""
    spec = model.spec
    n = sm90_forward_tiles_of(model, shape)
    group = sass.WARPGROUP_WARPS
    skip = model.skipped
    instructions = sm90_forward_executed(model, shape)
    q_bytes = spec.tile_m * spec.head_dim * spec.itemsize  # Q in, and O out, an item
    tile_ld = n.computed * model.ld_wavefronts + n.partial * model.partial_ld_wavefronts
    tile_st = n.computed * model.st_wavefronts + n.partial * model.partial_st_wavefronts
    ld = (
        group * (tile_ld + n.skipped * skip.get("ld_wavefronts", 0.0))
        + group * n.computed * model.wgmma_shared_bytes / sass.WAVEFRONT_BYTES
        + n.items * q_bytes / sass.WAVEFRONT_BYTES
    )
    st = (
        group * (tile_st + n.skipped * skip.get("st_wavefronts", 0.0))
        + n.steps * spec.step_bytes / sass.WAVEFRONT_BYTES
        + n.items * 2 * q_bytes / sass.WAVEFRONT_BYTES
    )
    lse = spec.tile_m * STATS_BYTES
    return Work(
        instructions=instructions,
        hmma=0.0,
        ld_wavefronts=ld,
        st_wavefronts=st,
        l2_bytes=n.steps * spec.step_bytes + n.items * (2 * q_bytes + lse),
        warps_per_sm=model.warps_per_sm,
        wgmma_flop=group * n.computed * model.wgmma_flop,
        dram_bytes=sm90_forward_compulsory_dram(shape) if dram_bytes is None else dram_bytes,
    )


def sm90_forward_hgmma(model: TileModel, shape: Shape) -> int:
    """HGMMA the whole sm_90a forward issues over a dense causal ``shape`` (ncu's count): a
    consumer warp's per tile times the computed tiles; each QK^T and each PV is issued once,
    the PV of a consumer's last tile after its loop."""
    n = sm90_forward_tiles_of(model, shape)
    return round(sass.WARPGROUP_WARPS * n.computed * model.hmma)


def kernel_work(model: TileModel, shape: Shape) -> Work:
    """The work of one launch of ``model``'s kernel over a dense causal ``shape``."""
    spec = model.spec
    if spec.kind in SM90_BWD_KINDS:
        return sm90_backward_work(model, shape)
    if spec.kind in SM90_FWD_KINDS:
        return sm90_forward_work(model, shape)
    warps = tile_warps = spec.warps
    if spec.kind == "fwd" and spec.tile_m > spec.block:  # paired: a block's tiles, its warps
        ctas, steps, tiles, partial = paired_causal_tiles(shape.n_ctx, spec.block, spec.tile_n)
        tile_warps = warps * spec.block // spec.tile_m
    else:
        ctas, tiles, partial = causal_tiles(
            shape.n_ctx, spec.block, spec.tile_m, spec.tile_n, own_is_query=spec.kind != "dkdv"
        )
        steps = tiles
    ctas, steps, tiles, partial = (x * shape.pairs for x in (ctas, steps, tiles, partial))
    per_tile = sum(model.per_tile.values())
    per_partial = sum(model.partial.values())
    per_cta = sum(model.per_cta.values())
    return Work(
        instructions=warps * ctas * per_cta
        + tile_warps * (tiles * per_tile + partial * per_partial),
        hmma=tile_warps * tiles * model.hmma,
        ld_wavefronts=tile_warps
        * (tiles * model.ld_wavefronts + partial * model.partial_ld_wavefronts),
        st_wavefronts=tile_warps
        * (tiles * model.st_wavefronts + partial * model.partial_st_wavefronts),
        l2_bytes=steps * spec.step_bytes + ctas * spec.own_bytes,
        warps_per_sm=model.warps_per_sm,
    )


def preprocess_seconds(shape: Shape) -> float:
    """The backward's delta = rowsum(out * dout): DRAM-bound, out and dout read once."""
    rows = shape.pairs * shape.n_ctx
    return (2 * rows * shape.head_dim * shape.itemsize + rows * 4) / DRAM_BYTES_PER_S


# ----------------------------------------------------------------------------------------------
# The profile and f532ccd


@dataclass(frozen=True)
class Profiled:
    """ncu's figures for one kernel of the f532ccd run."""

    label: str
    seconds: float
    instructions: float
    ld_wavefronts: float
    tensor_pct: float


# SM active cycles and L2 throughput % of the same kernels (ncu-f532ccd.log, a second ncu run
# of the same commit): used to read the tensor and L2 peaks off the profile.
PROFILE_ACTIVE_CYCLES = {
    "fwd": 2_145_647,
    "dkdv": 4_552_447,
    "dq": 3_486_332,
    "fa2 fwd": 1_432_226,
    "fa2 bwd": 3_991_747,
}
PROFILE_LOG_SECONDS = {"fwd": 1.22e-3, "dkdv": 2.64e-3, "dq": 2.03e-3}
PROFILE_L2_PCT = {"fwd": 63.44, "dkdv": 58.04, "dq": 73.81}
_KERNEL_OF = {
    "attn_fwd<": "fwd",
    "attn_bwd_dkdv<": "dkdv",
    "attn_bwd_dq<": "dq",
    "flash_fwd_kernel<": "fa2 fwd",
    "flash_bwd_dq_dk_dv_loop": "fa2 bwd",
}
_METRICS = {
    "gpu__time_duration.sum": "seconds",
    "smsp__inst_executed.sum": "instructions",
    "l1tex__data_pipe_lsu_wavefronts_mem_shared_op_ld.sum": "ld_wavefronts",
    "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active": "tensor_pct",
}


def read_profile(path: Path) -> dict[str, Profiled]:
    """The five kernels of ncu-metrics-f532ccd.csv (ours: fwd, dkdv, dq; SDPA-flash: fa2 fwd,
    fa2 bwd)."""
    rows = [r for r in csv.reader(path.read_text().splitlines()) if len(r) >= 15]
    values: dict[str, dict[str, float]] = {}
    for row in rows[1:]:
        name, metric, unit, value = row[4], row[12], row[13], row[14]
        label = next((lab for key, lab in _KERNEL_OF.items() if key in name), None)
        if label is None or metric not in _METRICS:
            continue
        number = float(value.replace(",", ""))
        if unit == "ns":
            number *= 1e-9
        values.setdefault(label, {})[_METRICS[metric]] = number
    return {label: Profiled(label, **fields) for label, fields in values.items()}


def fa2_work(label: str, profiled: Profiled, shape: Shape = PROFILE_SHAPE) -> Work:
    """SDPA-flash's work at the profiled shape: instructions and shared loads from ncu; HMMA,
    copies and L2 bytes from its tiles (forward 128 x 64, backward 64 x 128 with fp32 dQ
    atomics, 8 warps per SM either way)."""
    d, item, t = shape.head_dim, shape.itemsize, shape.n_ctx
    mma_flop = 16 * 8 * 16 * 2
    if label == "fa2 fwd":
        m, n = 128, 64
        pairs = sum(-(-((i + 1) * m) // n) for i in range(t // m)) * shape.pairs
        hmma = pairs * 2 * m * n * d * 2 / mma_flop
        kv = pairs * 2 * n * d * item
        l2 = kv + 2 * shape.pairs * t * d * item
        stores = kv / 128
    else:
        m, n = 64, 128
        pairs = sum(t // m - (j * n) // m for j in range(t // n)) * shape.pairs
        hmma = pairs * 5 * m * n * d * 2 / mma_flop
        q_do = pairs * 2 * m * d * item
        dq_atomics = pairs * m * d * 4
        l2 = q_do + 2 * dq_atomics + 4 * shape.pairs * t * d * item
        stores = q_do / 128 + pairs * 2 * m * n * item / 128  # copies, then P and dS to smem
    return Work(profiled.instructions, hmma, profiled.ld_wavefronts, stores, l2, 8)


def f532ccd_specs() -> list[HotSpec]:
    """f532ccd's forward, dK/dV and dQ (bf16, causal, 64-blocks) at d = 64 and 128: 16 query
    rows per warp, 64 x 64 forward tiles; backward tiles of 32 at d >= 96, else 64."""
    specs = []
    for d in (64, 128):
        tile = 32 if d >= 96 else 64
        ld = (d + 8) * 2
        common = dict(head_dim=d, itemsize=2, block=64, regions=PARTIAL_TILE_CODE)
        specs.append(
            HotSpec(
                label=f"f532ccd fwd d{d}",
                kind="fwd",
                source_file="attn_fwd.cu",
                name_expression=f"attn_fwd<64, {d}, __nv_bfloat16, MASK_CAUSAL>",
                threads=128,
                smem_bytes=(64 + 2 * 64) * ld,
                tile_m=64,
                tile_n=64,
                hmma_per_warp_tile=2 * (64 // 8) * (d // 16),
                **common,
            )
        )
        for kernel, gemms, own, stats in (("dkdv", 4, 2, 2), ("dq", 3, 2, 0)):
            specs.append(
                HotSpec(
                    label=f"f532ccd {kernel} d{d}",
                    kind=kernel,
                    source_file="attn_bwd.cu",
                    name_expression=f"attn_bwd_{kernel}<64, {d}, __nv_bfloat16, MASK_CAUSAL>",
                    threads=tile // 16 * 32,
                    smem_bytes=4 * tile * ld + stats * tile * 4,
                    tile_m=tile,
                    tile_n=tile,
                    hmma_per_warp_tile=gemms * (tile // 8) * (d // 16),
                    own_copies=own,
                    stats_per_step=stats,
                    **common,
                )
            )
    return specs


def checkout_kernels(commit: str, into: Path) -> Path:
    """kernels/ of ``commit``, written under ``into`` (read with git show, the tree untouched)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        try:
            return subprocess.run(
                ["git", "-C", str(root), *args], capture_output=True, text=True, check=True
            ).stdout
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(f"git {' '.join(args)}: {exc.stderr.strip()}") from exc

    for name in git("ls-tree", "-r", "--name-only", commit, "kernels").split():
        text = git("show", f"{commit}:{name}")
        path = into / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return into / "kernels"


@dataclass
class Calibration:
    models: dict[str, TileModel]
    profile: dict[str, Profiled]
    rows: list[dict]  # one per profiled kernel
    bench_rows: list[dict]  # f532ccd model vs the f532ccd benchmark
    overlap_fit: float
    hmma_per_sm_cycle: list[float]
    l2_bytes_per_s: list[float]


def calibrate(
    jobs: int = 1, profile_dir: Path = PROFILE_DIR, labels: Sequence[str] = ("d64", "d128")
) -> Calibration:
    """Rebuild f532ccd's kernels (those whose label has one of ``labels``; the profile needs
    d128, the benchmark rows d64 too), model them, and set the model beside the profile."""
    from cuattn.backends.toolchain import CXX_STANDARD_OPTION, cuda_include_options

    profile = read_profile(profile_dir / PROFILE_CSV)
    with tempfile.TemporaryDirectory() as tmp:
        kernels = checkout_kernels(PROFILE_COMMIT, Path(tmp))
        specs = [s for s in f532ccd_specs() if any(x in s.label for x in labels)]
        sources = {s.source_file: (kernels / s.source_file).read_text() for s in specs}
        options = (CXX_STANDARD_OPTION, f"-I{kernels}", *cuda_include_options())
        models = {m.spec.label: m for m in model_specs(specs, sources, options, kernels, jobs)}
    works = {}
    for kernel in ("fwd", "dkdv", "dq"):
        works[kernel] = kernel_work(models[f"f532ccd {kernel} d128"], PROFILE_SHAPE)
    for kernel in ("fa2 fwd", "fa2 bwd"):
        works[kernel] = fa2_work(kernel, profile[kernel])
    overlap = _fit_overlap(works, profile)
    rows = []
    for kernel, work in works.items():
        measured = profile[kernel]
        rows.append(_model_vs_ncu(kernel, work, measured, ours=not kernel.startswith("fa2")))
    hmma_rate = [
        works[k].hmma / SMS / (PROFILE_ACTIVE_CYCLES[k] * profile[k].tensor_pct / 100)
        for k in works
    ]
    l2_rate = [
        works[k].l2_bytes / PROFILE_LOG_SECONDS[k] / (PROFILE_L2_PCT[k] / 100)
        for k in ("fwd", "dkdv", "dq")
    ]
    return Calibration(
        models, profile, rows, _bench_rows(models, profile_dir), overlap, hmma_rate, l2_rate
    )


def _fit_overlap(works: dict[str, Work], profile: dict[str, Profiled]) -> float:
    """OVERLAP minimising the squared log error of the five profiled kernels' times."""

    def loss(overlap: float) -> float:
        return sum(
            math.log(predict_seconds(w, overlap) / profile[k].seconds) ** 2
            for k, w in works.items()
        )

    grid = [i / 1000 for i in range(0, 1001)]
    return min(grid, key=loss)


def _bench_rows(models: dict[str, TileModel], profile_dir: Path) -> list[dict]:
    """f532ccd's model against f532ccd's own benchmark (dense causal, every T and d it ran)."""
    rows = []
    for shape, measured in bench_times(profile_dir).items():
        ours = measured.get("cuattn-cuda")
        if ours is None:
            continue
        d = shape[1]
        if f"f532ccd fwd d{d}" not in models:
            continue
        s = bench_shape(*shape[:2])
        fwd = predict_seconds(kernel_work(models[f"f532ccd fwd d{d}"], s))
        bwd = sum(
            predict_seconds(kernel_work(models[f"f532ccd {k} d{d}"], s)) for k in ("dkdv", "dq")
        )
        predicted = fwd if shape[2] == "fwd" else fwd + preprocess_seconds(s) + bwd
        rows.append({"shape": shape, "seconds": predicted, "measured": ours})
    return rows


def bench_times(profile_dir: Path = PROFILE_DIR) -> dict[tuple, dict[str, float]]:
    """(T, d, direction) -> {implementation: median seconds} of f532ccd's dense causal bf16
    runs (quick sweep at T = 4096, full sweep at 2k/8k/16k)."""
    import json

    times: dict[tuple, dict[str, float]] = {}
    for name in ("quick-f532ccd.json", "full-f532ccd.json"):
        path = profile_dir / name
        if not path.exists():
            continue
        for record in json.loads(path.read_text())["records"]:
            case = record["case"]
            if case["pattern"]["label"] != "dense-causal" or case["blocksize"] != 64:
                continue
            key = (case["n_ctx"], case["head_dim"], case["direction"])
            times[key] = {
                impl: result["median_ms"] / MS for impl, result in record["results"].items()
            }
    return dict(sorted(times.items()))


# ----------------------------------------------------------------------------------------------
# Out of sample: the H200 run's counters (nothing above is fitted on them)

VALIDATION_DIR = PROFILE_DIR.parent / "2026-11-26-h200"
VALIDATION_COMMIT = "e6a0613"  # the tree that ran (summary.md in VALIDATION_DIR)
VALIDATION_LOGS = {128: "counters-d128.log", 64: "counters-d64.log"}
# The instantiations scripts/profile_kernels.py ran there (dense causal 64-blocks from 1k tokens
# pair the forward's query blocks), by their labels in sass_model.hot_specs().
VALIDATION_LABELS = {"fwd": "fwd d{d} b64 paired", "dkdv": "dkdv d{d} b64", "dq": "dq d{d} b64"}
_TEMPLATE_CONSTANTS = {"MASK_CAUSAL": "1", "MODS_NONE": "0"}


def validation_shape(head_dim: int) -> Shape:
    """scripts/profile_kernels.py's problem: batch 4, T = 4096, heads x d = 2048."""
    return Shape(PROFILE_SHAPE.n_ctx, PROFILE_SHAPE.batch, BENCH_WIDTH // head_dim, head_dim)


def profiled_instantiations(path: Path) -> dict[str, str]:
    """label (fwd, dkdv, dq, fa2 fwd, fa2 bwd) -> the kernel's name as ncu printed it."""
    names = {}
    for row in csv.reader(path.read_text().splitlines()):
        if len(row) < 15:
            continue
        label = next((lab for key, lab in _KERNEL_OF.items() if key in row[4]), None)
        if label is not None:
            names[label] = row[4].removeprefix("void ").split("(")[0]
    return names


def _template_arguments(name: str) -> list[str]:
    inner = name[name.index("<") + 1 : name.rindex(">")]
    return [_TEMPLATE_CONSTANTS.get(a.strip(), a.strip()) for a in inner.split(",")]


def _same_sizes(expression: str, profiled: str) -> bool:
    """Whether today's ``expression`` has the sizes of the ``profiled`` instantiation: equal
    arguments, but for the CTA count (the fourth) that the profiled dQ kernel still took."""
    ours, theirs = _template_arguments(expression), _template_arguments(profiled)
    if profiled.startswith("attn_bwd_dq<") and len(theirs) == len(ours) + 1:
        theirs = theirs[:3] + theirs[4:]
    return ours == theirs


def validate(jobs: int = 1, profile_dir: Path = VALIDATION_DIR) -> list[dict]:
    """Rebuild VALIDATION_COMMIT's kernels, model the instantiations the H200 profiled (d = 64
    and 128) and set each beside its counters: instructions and shared-load wavefronts (which do
    not depend on the device) and time by the H100 roofline as fitted (H200: the same 132 SMs
    and L2, 1.80 GHz in the run against the model's 1.83). SDPA-flash's rows: its time only."""
    from cuattn.backends.toolchain import CXX_STANDARD_OPTION, cuda_include_options
    from dev.sass_model import hot_specs

    # Today's specs with the profiled names: the sizes are today's (asserted below through the
    # template arguments both share); the name is the tree's (dQ then took a CTA count too).
    specs = []
    by_label = {s.label: s for s in hot_specs()}
    for d, log in VALIDATION_LOGS.items():
        names = profiled_instantiations(profile_dir / log)
        for kernel, label in VALIDATION_LABELS.items():
            spec = by_label[label.format(d=d)]
            if not _same_sizes(spec.name_expression, names[kernel]):
                raise RuntimeError(f"{spec.name_expression} is not the profiled {names[kernel]}")
            specs.append(dataclasses.replace(spec, name_expression=names[kernel]))
    with tempfile.TemporaryDirectory() as tmp:
        kernels = checkout_kernels(VALIDATION_COMMIT, Path(tmp))
        sources = {s.source_file: (kernels / s.source_file).read_text() for s in specs}
        options = (CXX_STANDARD_OPTION, f"-I{kernels}", *cuda_include_options())
        models = {m.spec.label: m for m in model_specs(specs, sources, options, kernels, jobs)}
    rows = []
    for d, log in VALIDATION_LOGS.items():
        profile = read_profile(profile_dir / log)
        shape = validation_shape(d)
        for kernel, label in VALIDATION_LABELS.items():
            work, measured = kernel_work(models[label.format(d=d)], shape), profile[kernel]
            rows.append(_model_vs_ncu(f"{kernel} d{d}", work, measured, ours=True))
        for kernel in ("fa2 fwd", "fa2 bwd"):
            work = fa2_work(kernel, profile[kernel], shape)
            rows.append(_model_vs_ncu(f"{kernel} d{d}", work, profile[kernel], ours=False))
    return rows


def _model_vs_ncu(kernel: str, work: Work, measured: Profiled, ours: bool) -> dict:
    """One row of the calibration and validation tables: the model's work beside ncu's."""
    return {
        "kernel": kernel,
        "instructions": work.instructions,
        "ncu_instructions": measured.instructions,
        "ld_wavefronts": work.ld_wavefronts,
        "ncu_ld_wavefronts": measured.ld_wavefronts,
        "hmma": work.hmma,
        "seconds": predict_seconds(work),
        "ncu_seconds": measured.seconds,
        "bound": bound(work),
        "ours": ours,
    }


def backward_wavefront_ratio(rows: Sequence[dict], head_dim: int) -> float:
    """Measured shared-load wavefronts of our backward (dK/dV + dQ) over SDPA-flash's for the
    same problem (its backward kernel; its dQ conversion and preprocess load nothing shared)."""
    by_kernel = {r["kernel"]: r for r in rows}
    ours = sum(by_kernel[f"{k} d{head_dim}"]["ncu_ld_wavefronts"] for k in ("dkdv", "dq"))
    return ours / by_kernel[f"fa2 bwd d{head_dim}"]["ncu_ld_wavefronts"]


def format_validation(rows: Sequence[dict]) -> str:
    lines = _model_vs_ncu_table(f"{VALIDATION_COMMIT}, H200, T=4096 B4, heads x d = 2048", rows)
    ratios = ", ".join(
        f"d{d} {backward_wavefront_ratio(rows, d):.2f}x" for d in sorted(VALIDATION_LOGS)
    )
    lines += ["", f"Backward shared-load wavefronts, ours (dK/dV + dQ) / SDPA-flash's: {ratios}."]
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------
# Report

PREDICTION_T = 8192  # the shape of the hot table's time column (bench sweep, dense causal)


def hot_times(models: Sequence[TileModel], n_ctx: int = PREDICTION_T) -> dict[str, float]:
    """Predicted ms of each hot instantiation at the benchmark's dense causal shape."""
    out = {}
    for m in models:
        if m.spec.kind == "decode":
            continue
        out[m.spec.label] = (
            predict_seconds(kernel_work(m, bench_shape(n_ctx, m.spec.head_dim))) * MS
        )
    return out


# Columns of the ratio table: (name, forward label, block of the backward kernels). Dense causal
# 64-block layouts from 1k tokens run the paired forward (backends/kernels.layout_pairs_rows).
RATIO_VARIANTS = (
    ("b64", "fwd d{d} b64", 64),
    ("b64 paired", "fwd d{d} b64 paired", 64),
    ("b128", "fwd d{d} b128", 128),
)


def ratio_rows(models: Sequence[TileModel], profile_dir: Path = PROFILE_DIR) -> list[dict]:
    """Predicted ratio SDPA-flash time / ours for dense causal bf16: the forward (64- and
    128-blocks) and forward + backward (preprocess, dK/dV, dQ of the same block), against
    SDPA-flash's measured times at f532ccd (same H100; its time does not depend on our block
    size)."""
    by_label = {m.spec.label: m for m in models}
    rows = []
    for (n_ctx, d, direction), measured in bench_times(profile_dir).items():
        flash = measured.get("sdpa-flash")
        if flash is None:
            continue
        s = bench_shape(n_ctx, d)
        row = {"T": n_ctx, "d": d, "direction": direction, "flash_ms": flash * MS}
        for name, forward, block in RATIO_VARIANTS:
            labels = [forward.format(d=d), f"dkdv d{d} b{block}", f"dq d{d} b{block}"]
            if not all(label in by_label for label in labels):
                continue
            seconds = [predict_seconds(kernel_work(by_label[label], s)) for label in labels]
            total = seconds[0]
            if direction != "fwd":
                total += preprocess_seconds(s) + seconds[1] + seconds[2]
            row[name] = (total * MS, flash / total)
        rows.append(row)
    return rows


SM90_BACKWARD_T = (4096, 8192)  # the quick sweep's T and the hot table's


def sm90_backward_rows(models: Sequence[TileModel]) -> list[dict]:
    """The sm_90a backward beside the mma.sync backward (dK/dV + dQ of the same block), dense
    causal bf16 at the benchmark's shapes: main kernel, and with what each runs besides (the
    preprocess for both; the sm_90a one's zeroing and dQ conversion)."""
    by_label = {m.spec.label: m for m in models}
    rows = []
    for model in models:
        spec = model.spec
        if spec.kind not in SM90_BWD_KINDS:
            continue
        d, block = spec.head_dim, spec.block
        for n_ctx in SM90_BACKWARD_T:
            shape = bench_shape(n_ctx, d)
            work = sm90_backward_work(model, shape)
            main = predict_seconds(work)
            flop = 5 * 2 * spec.tile_n * spec.tile_m // 2 * d  # 5 GEMMs, per consumer step
            n = sm90_backward_steps(n_ctx, block, spec.tile_m, spec.tile_n).times(shape.pairs)
            row = {
                "label": spec.label,
                "T": n_ctx,
                "shape": shape,
                "ms": main * MS,
                "total_ms": (main + sm90_backward_extra_seconds(shape) + preprocess_seconds(shape))
                * MS,
                "bound": bound(work),
                "cycles": work.cycles(),
                "tflops": n.computed * flop / main / 1e12,
                "hgmma": sm90_backward_hgmma(model, shape),
            }
            pair = [by_label.get(f"{k} d{d} b{block}") for k in ("dkdv", "dq")]
            if all(m is not None for m in pair):
                mma = sum(predict_seconds(kernel_work(m, shape)) for m in pair if m is not None)
                row["mma_ms"] = mma * MS
                row["mma_total_ms"] = (mma + preprocess_seconds(shape)) * MS
            rows.append(row)
    return rows


def format_sm90_backward(rows: Sequence[dict]) -> str:
    lines = [
        "| instantiation | T | batch x heads | sm_90a main ms | bound | issue / tensor / shared /"
        " L2 kcycles an SM | TFLOP/s (computed steps) | + zero, dQ, delta ms | mma.sync dK/dV + dQ"
        " ms | + delta ms | x mma.sync | whole-kernel HGMMA |",
        "|---|---:|---|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        c = r["cycles"]
        kcycles = " / ".join(f"{c[k] / 1e3:.0f}" for k in ("issue", "tensor", "shared", "L2"))
        mma, mma_total = r.get("mma_ms"), r.get("mma_total_ms")
        ratio = f"{mma_total / r['total_ms']:.2f}" if mma_total else "-"
        lines.append(
            f"| {r['label']} | {r['T']} | {r['shape'].batch} x {r['shape'].heads} | {r['ms']:.3f}"
            f" | {r['bound']} | {kcycles} | {r['tflops']:.0f} | {r['total_ms']:.3f}"
            f" | {'-' if mma is None else f'{mma:.3f}'}"
            f" | {'-' if mma_total is None else f'{mma_total:.3f}'} | {ratio} | {r['hgmma']:,} |"
        )
    return "\n".join(lines)


# The 510d8d7 H200 run's sm_90a forward (bench/results/2026-11-26-h200-510d8d7/: quick.json and
# full-partial.json's medians, the ncu counters' time where the sweep did not reach), dense
# causal bf16 at bench_shape: (label, T) -> (ms, where). attn_fwd_sm90 then had the CTA order
# of change 27 (heads fastest), whose DRAM reads ncu measured (SM90_FORWARD_MEASURED_DRAM);
# change 34's L2-sized groups came after.
SM90_FORWARD_RUN = "510d8d7"
SM90_FORWARD_MEASURED = {
    ("fwd sm90a d128 b128", 4096): (0.622, "quick sweep"),
    ("fwd sm90a d128 b64", 2048): (0.476, "full sweep"),
    ("fwd sm90a d128 b64", 4096): (0.847, "quick sweep; ncu 0.855"),
    ("fwd sm90a d128 b64", 8192): (1.586, "full sweep"),
    ("fwd sm90a d128 b64", 16384): (3.101, "full sweep"),
    ("fwd sm90a d64 b64", 2048): (0.768, "full sweep"),
    ("fwd sm90a d64 b64", 4096): (1.378, "ncu"),
}
# ncu's dram__bytes_read.sum + dram__bytes_write.sum (counters-d128.log, counters-d64.log)
SM90_FORWARD_MEASURED_DRAM = {
    ("fwd sm90a d128 b64", 4096): 1_145_718_784 + 58_653_952,
    ("fwd sm90a d64 b64", 4096): 2_084_794_624 + 60_897_792,
}
# ncu's HGMMA count at the profiled shape (T = 4096, batch 4, heads x d = 2048, 64-blocks)
SM90_FORWARD_MEASURED_HGMMA = {"fwd sm90a d128 b64": 6_389_760, "fwd sm90a d64 b64": 8_519_680}
SM90_FORWARD_T = (4096, 8192)  # the quick sweep's T and the hot table's


SM90_FORWARD_DIR = PROFILE_DIR.parent / "2026-11-26-h200-510d8d7"
SM90_FORWARD_LOGS = {128: "counters-d128.log", 64: "counters-d64.log"}
SM90_FORWARD_PROFILED = "fwd sm90a d{d} b64"  # scripts/profile_kernels.py: 64-blocks, paired
_SM90_FORWARD_METRICS = {
    "gpu__time_duration.sum": "seconds",
    "smsp__inst_executed.sum": "instructions",
    "smsp__inst_executed_pipe_tensor_op_hmma.sum": "hgmma",
    "smsp__inst_executed_pipe_xu.sum": "xu",
    "dram__bytes_read.sum": "dram_read",
    "dram__bytes_write.sum": "dram_write",
}


def read_sm90_forward_counters(path: Path) -> dict[str, float]:
    """attn_fwd_sm90's metrics in one of the 510d8d7 run's counter logs (ncu CSV)."""
    values: dict[str, float] = {}
    for row in csv.reader(path.read_text().splitlines()):
        if len(row) < 15 or "attn_fwd_sm90<" not in row[4] or row[12] not in _SM90_FORWARD_METRICS:
            continue
        number = float(row[14].replace(",", ""))
        values[_SM90_FORWARD_METRICS[row[12]]] = number * 1e-9 if row[13] == "ns" else number
    return values


def validate_sm90_forward(jobs: int = 1, profile_dir: Path = SM90_FORWARD_DIR) -> list[dict]:
    """SM90_FORWARD_RUN's attn_fwd_sm90 rebuilt from git and modelled at the instantiations its
    counters profiled (d = 64 and 128, 64-blocks, validation_shape), beside those counters:
    instructions, HGMMA, MUFU against the XU pipe, time (with the run's DRAM bytes too). Nothing
    in the model is fitted on them."""
    from cuattn.backends.toolchain import CXX_STANDARD_OPTION, cuda_include_options
    from dev.sass_model import hot_specs

    by_label = {s.label: s for s in hot_specs()}
    specs = [by_label[SM90_FORWARD_PROFILED.format(d=d)] for d in SM90_FORWARD_LOGS]
    with tempfile.TemporaryDirectory() as tmp:
        kernels = checkout_kernels(SM90_FORWARD_RUN, Path(tmp))
        sources = {s.source_file: (kernels / s.source_file).read_text() for s in specs}
        options = (CXX_STANDARD_OPTION, f"-I{kernels}", *cuda_include_options())
        models = {m.spec.head_dim: m for m in model_specs(specs, sources, options, kernels, jobs)}
    rows = []
    for d, log in SM90_FORWARD_LOGS.items():
        measured = read_sm90_forward_counters(profile_dir / log)
        model, shape = models[d], validation_shape(d)
        dram = measured["dram_read"] + measured["dram_write"]
        rows.append(
            {
                "kernel": f"attn_fwd_sm90 d{d} b64",
                "instructions": sm90_forward_executed(model, shape),
                "ncu_instructions": measured["instructions"],
                "hgmma": sm90_forward_hgmma(model, shape),
                "ncu_hgmma": measured["hgmma"],
                "mufu": sm90_forward_executed(model, shape, ("MUFU",)),
                "ncu_xu": measured["xu"],
                "seconds": predict_seconds(sm90_forward_work(model, shape)),
                "seconds_dram": predict_seconds(sm90_forward_work(model, shape, dram)),
                "ncu_seconds": measured["seconds"],
            }
        )
    return rows


def format_sm90_forward_validation(rows: Sequence[dict]) -> str:
    lines = [
        f"| kernel ({SM90_FORWARD_RUN}, H200, T=4096 B4, heads x d = 2048) | instructions model /"
        " ncu | error | HGMMA model / ncu | MUFU model / XU pipe | error | time model (with the"
        " run's DRAM bytes) / ncu ms | error |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['kernel']} | {r['instructions'] / 1e6:.1f}M / {r['ncu_instructions'] / 1e6:.1f}M"
            f" | {_pct(r['instructions'], r['ncu_instructions'])}"
            f" | {r['hgmma']:,} / {r['ncu_hgmma']:,.0f}"
            f" | {r['mufu'] / 1e6:.2f}M / {r['ncu_xu'] / 1e6:.2f}M | {_pct(r['mufu'], r['ncu_xu'])}"
            f" | {r['seconds'] * MS:.3f} ({r['seconds_dram'] * MS:.3f})"
            f" / {r['ncu_seconds'] * MS:.3f} | {_pct(r['seconds'], r['ncu_seconds'])}"
            f" ({_pct(r['seconds_dram'], r['ncu_seconds'])}) |"
        )
    return "\n".join(lines)


def sm90_forward_rows(models: Sequence[TileModel]) -> list[dict]:
    """The sm_90a forward's predicted time, dense causal bf16 at the benchmark's shapes
    (SM90_FORWARD_T and every T the 510d8d7 run measured), beside the measured time; where
    ncu measured the DRAM bytes, the prediction with them too."""
    rows = []
    for model in models:
        spec = model.spec
        if spec.kind not in SM90_FWD_KINDS:
            continue
        measured_t = {t for label, t in SM90_FORWARD_MEASURED if label == spec.label}
        for n_ctx in sorted(set(SM90_FORWARD_T) | measured_t):
            shape = bench_shape(n_ctx, spec.head_dim)
            work = sm90_forward_work(model, shape)
            seconds = predict_seconds(work)
            n = sm90_forward_tiles_of(model, shape)
            flop = sass.WARPGROUP_WARPS * n.computed * model.wgmma_flop
            measured = SM90_FORWARD_MEASURED.get((spec.label, n_ctx))
            dram = SM90_FORWARD_MEASURED_DRAM.get((spec.label, n_ctx))
            rows.append(
                {
                    "label": spec.label,
                    "T": n_ctx,
                    "shape": shape,
                    "ms": seconds * MS,
                    "bound": bound(work),
                    "cycles": work.cycles(),
                    "tflops": flop / seconds / 1e12,
                    "measured_ms": None if measured is None else measured[0],
                    "measured_where": None if measured is None else measured[1],
                    "ms_measured_dram": None
                    if dram is None
                    else predict_seconds(sm90_forward_work(model, shape, dram)) * MS,
                    "hgmma": sm90_forward_hgmma(model, shape),
                }
            )
    return rows


def format_sm90_forward_tiles(models: Sequence[TileModel]) -> str:
    """Per consumer warp per tile: the tile, its masked and skipped variants, the producer's
    step, what runs once an item."""
    lines = [
        "| instantiation | tile (rows x keys) | HGMMA | instr | instr/HGMMA | MUFU | FP32 | INT"
        " | uniform | BAR | wgmma shared B (a warp) | wgmma FLOP (a warp) | masked tile, extra"
        " instr | skipped tile: HGMMA / instr | producer a step: UTMALDG / instr | TMA B a step"
        " (K, V) | once an item (a consumer warp) | regs | spill B |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|",
    ]
    for m in models:
        s = m.spec
        if s.kind not in SM90_FWD_KINDS:
            continue
        c = m.per_tile
        skipped = sum(m.skipped.get(k, 0.0) for k in sass.CLASSES)
        producer = sum(m.producer.get(k, 0.0) for k in sass.CLASSES)
        item = sum(getattr(m, "per_item", {}).values()) or sum(m.per_cta.values())
        lines.append(
            f"| {s.label} `{s.name_expression}` | {WGMMA_M} x {s.tile_n}"
            f" | {m.hmma:.0f} | {m.instructions:.0f} | {m.per_hmma:.1f} | {c['MUFU']:.0f}"
            f" | {c['FP32']:.0f} | {c['INT']:.0f} | {c['uniform']:.0f} | {c['BAR']:.0f}"
            f" | {m.wgmma_shared_bytes:,.0f} | {m.wgmma_flop:,.0f}"
            f" | {sum(m.partial.values()):.0f} | {m.skipped.get('HGMMA', 0.0):.0f} / {skipped:.0f}"
            f" | {m.producer.get('UTMALDG', 0.0):.0f} / {producer:.0f} | {s.step_bytes:,}"
            f" | {item:.0f}"
            f" | {m.registers} | {m.spill_bytes} |"
        )
    return "\n".join(lines)


def format_sm90_forward(rows: Sequence[dict]) -> str:
    lines = [
        "| instantiation | T | batch x heads | predicted ms | bound | issue / tensor / shared /"
        f" L2 / DRAM kcycles an SM | TFLOP/s (computed tiles) | measured ms ({SM90_FORWARD_RUN},"
        " H200) | error | predicted with the run's DRAM bytes | whole-kernel HGMMA |",
        "|---|---:|---|---:|---|---|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        c = r["cycles"]
        keys = ("issue", "tensor", "shared", "L2", "DRAM")
        kcycles = " / ".join(f"{c[k] / 1e3:.0f}" for k in keys)
        measured = r["measured_ms"]
        cell = "-" if measured is None else f"{measured:.3f} ({r['measured_where']})"
        error = "-" if measured is None else _pct(r["ms"], measured)
        dram = r["ms_measured_dram"]
        lines.append(
            f"| {r['label']} | {r['T']} | {r['shape'].batch} x {r['shape'].heads}"
            f" | {r['ms']:.3f} | {r['bound']} | {kcycles} | {r['tflops']:.0f} | {cell} | {error}"
            f" | {'-' if dram is None else f'{dram:.3f}'} | {r['hgmma']:,} |"
        )
    return "\n".join(lines)


def _pct(model: float, measured: float) -> str:
    return f"{model / measured - 1:+.0%}"


def _model_vs_ncu_table(kernels: str, rows: Sequence[dict]) -> list[str]:
    """Markdown lines of _model_vs_ncu rows; ``kernels`` says which run's kernels they are."""
    lines = [
        f"| kernel ({kernels}) | instructions model / ncu | error | shared ld wavefronts model /"
        " ncu | error | time model / ncu ms | error | bound |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        if r["ours"]:
            inst = f"{r['instructions'] / 1e6:.0f}M / {r['ncu_instructions'] / 1e6:.0f}M"
            wave = f"{r['ld_wavefronts'] / 1e6:.1f}M / {r['ncu_ld_wavefronts'] / 1e6:.1f}M"
            inst_err = _pct(r["instructions"], r["ncu_instructions"])
            wave_err = _pct(r["ld_wavefronts"], r["ncu_ld_wavefronts"])
        else:
            inst = f"(ncu) {r['ncu_instructions'] / 1e6:.0f}M"
            wave = f"(ncu) {r['ncu_ld_wavefronts'] / 1e6:.1f}M"
            inst_err = wave_err = "-"
        lines.append(
            f"| {r['kernel']} | {inst} | {inst_err} | {wave} | {wave_err}"
            f" | {r['seconds'] * MS:.3f} / {r['ncu_seconds'] * MS:.3f}"
            f" | {_pct(r['seconds'], r['ncu_seconds'])} | {r['bound']} |"
        )
    return lines


def format_calibration(cal: Calibration) -> str:
    lines = _model_vs_ncu_table("f532ccd, T=4096 B4 H16 d128", cal.rows)
    lines.append("")
    lines.append(
        f"Fitted overlap {cal.overlap_fit:.3f} (model constant {OVERLAP}); HMMA per SM cycle "
        f"read off the profile: {', '.join(f'{x:.3f}' for x in cal.hmma_per_sm_cycle)} "
        f"(model {HMMA_PER_SM_CYCLE:.3f}); L2 TB/s: "
        f"{', '.join(f'{x / 1e12:.2f}' for x in cal.l2_bytes_per_s)} "
        f"(model {L2_BYTES_PER_S / 1e12:.2f})."
    )
    lines.append("")
    lines.append(
        "| f532ccd dense causal bf16 b64 (benchmark) | T | d | model ms | measured ms | error |"
    )
    lines.append("|---|---:|---:|---:|---:|---:|")
    for r in cal.bench_rows:
        n_ctx, d, direction = r["shape"]
        lines.append(
            f"| {direction} | {n_ctx} | {d} | {r['seconds'] * MS:.3f} | {r['measured'] * MS:.3f}"
            f" | {_pct(r['seconds'], r['measured'])} |"
        )
    return "\n".join(lines)


# SDPA-flash's tiles in the profile (Flash_fwd_kernel_traits<128, 128, 64, 4>,
# Flash_bwd_kernel_traits<128, 64, 128, 8>): rows x keys per CTA, warps, registers, CTAs per SM.
FA2_TILES = {
    "fa2 fwd": ("128 x 64, 4", 4, 255, "2 x 8"),
    "fa2 bwd": ("64 x 128, 8", 8, 255, "1 x 8"),
}
FA2_CTA_ROWS = 128  # query rows of a forward CTA, keys of a backward CTA


def fa2_reference_rows(profile: dict[str, Profiled]) -> list[dict]:
    """SDPA-flash's per-HMMA figures at the profiled shape (d = 128) from its ncu metrics, as
    rows of the hot table: instructions and shared-load wavefronts measured, HMMA from its
    tiles; LDSM/HMMA is wavefronts / 4 (as if every shared load were an LDSM.x4)."""
    rows = []
    for label, (tile, warps, registers, occupancy) in FA2_TILES.items():
        if label not in profile:
            continue
        work = fa2_work(label, profile[label])
        p = profile[label]
        ctas = PROFILE_SHAPE.n_ctx // FA2_CTA_ROWS * PROFILE_SHAPE.pairs
        per_warp_tile = work.hmma / (ctas * warps) / _fa2_tiles_per_cta(label)
        rows.append(
            {
                "label": f"SDPA-flash {label.split()[1]} d128 (ncu at f532ccd)",
                "tile": tile,
                "hmma": per_warp_tile,
                "instructions": per_warp_tile * p.instructions / work.hmma,
                "per_hmma": p.instructions / work.hmma,
                "ldsm_per_hmma": p.ld_wavefronts / work.hmma / 4,
                "wavefronts_per_hmma": p.ld_wavefronts / work.hmma,
                "l2_per_hmma": fa2_step_bytes(label) / (per_warp_tile * warps),
                "registers": registers,
                "occupancy": occupancy,
            }
        )
    return rows


def fa2_step_bytes(label: str, shape: Shape = PROFILE_SHAPE) -> float:
    """Bytes a SDPA-flash CTA moves through L2 per tile: K and V (forward); Q and dO plus the
    fp32 dQ read-modify-write of its atomics (backward)."""
    d, item = shape.head_dim, shape.itemsize
    if label == "fa2 fwd":
        return 2 * 64 * d * item
    return 2 * 64 * d * item + 2 * 64 * d * 4


def _fa2_tiles_per_cta(label: str, shape: Shape = PROFILE_SHAPE) -> float:
    """Mean tiles a SDPA-flash CTA walks at the profiled causal shape."""
    t = shape.n_ctx
    if label == "fa2 fwd":
        return sum(2 * i + 2 for i in range(t // 128)) / (t // 128)
    return sum(t // 64 - 2 * j for j in range(t // 128)) / (t // 128)


def format_ratios(rows: Sequence[dict]) -> str:
    names = [name for name, _, _ in RATIO_VARIANTS]
    lines = [
        "| dense causal bf16 | T | d | SDPA-flash ms (measured) | "
        + " | ".join(f"{n} model ms | {n} x flash" for n in names)
        + " |",
        "|---|---:|---:|---:|" + "---:|---:|" * len(names),
    ]
    for r in rows:
        cells = []
        for name in names:
            ms, ratio = r.get(name, (float("nan"), float("nan")))
            cells.append(f"{ms:.3f} | {ratio:.2f}")
        lines.append(
            f"| {r['direction']} | {r['T']} | {r['d']} | {r['flash_ms']:.3f} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines)


def report(
    models: Sequence[TileModel],
    calibration: Calibration | None,
    validation: Sequence[dict] | None = None,
    forward_validation: Sequence[dict] | None = None,
) -> str:
    """The markdown report of ``python -m dev sass``."""
    csv_path = PROFILE_DIR / PROFILE_CSV
    profile = read_profile(csv_path) if csv_path.exists() else {}
    from dev.sass_model import toolchain_versions

    versions = toolchain_versions()
    parts = [
        f"NVRTC {versions['nvrtc']}, nvdisasm {versions['nvdisasm'] or '?'}; counts per warp per"
        " tile by the attribution rules of dev/sass_model.py, times by the roofline of"
        " dev/sass_roofline.py.",
        "",
        f"## Hot instantiations (sm_90, per warp per tile of the main loop; predicted ms: dense"
        f" causal T={PREDICTION_T}, batch x T = 16k, heads x d = 2048)",
        "",
        format_counts_table(models, hot_times(models), fa2_reference_rows(profile)),
        "",
        "## Where each tile's instructions come from (per warp per tile)",
        "",
        format_origin_table(models),
    ]
    sm90_rows = sm90_backward_rows(models)
    if sm90_rows:
        parts += [
            "",
            "## The sm_90a backward beside the mma.sync backward (predicted, dense causal bf16;"
            " per consumer warp per step above: the HMMA column is its HGMMA)",
            "",
            format_sm90_backward(sm90_rows),
        ]
    forward_rows = sm90_forward_rows(models)
    if forward_rows:
        parts += [
            "",
            "## The sm_90a forward (per consumer warp per tile; predicted beside measured, dense"
            " causal bf16, batch x T = 16k, heads x d = 2048)",
            "",
            format_sm90_forward_tiles(models),
            "",
            format_sm90_forward(forward_rows),
        ]
    if calibration is not None:
        parts += [
            "",
            "## Calibration: f532ccd rebuilt and modelled vs its H100 profile",
            "",
            format_calibration(calibration),
        ]
    if validation is not None:
        parts += [
            "",
            f"## Out of sample: {VALIDATION_COMMIT} rebuilt and modelled vs its H200 counters",
            "",
            format_validation(validation),
        ]
    if forward_validation is not None:
        parts += [
            "",
            f"## Out of sample: the sm_90a forward of {SM90_FORWARD_RUN} rebuilt and modelled vs"
            " its H200 counters",
            "",
            format_sm90_forward_validation(forward_validation),
        ]
    labels = {m.spec.label for m in models}
    needed = {f"{k} d{d} b64" for k in ("fwd", "dkdv", "dq") for d in (64, 128)}
    if profile and needed <= labels:
        parts += [
            "",
            "## Predicted ratio to SDPA-flash (its f532ccd times; > 1: ours faster)",
            "",
            format_ratios(ratio_rows(models)),
        ]
    return "\n".join(parts)
