"""The order attn_fwd_sm90 starts its CTAs in, modelled: load balance and L2 reuse, no GPU.

Dense causal attention, one CTA per 128 query rows and (head, batch) pair, one resident CTA per
SM (the kernel's 384 threads and ~200 KB of shared memory). Two models side by side:
  balance  list scheduling: each SM takes the next CTA in start order when its last one ends; a
           CTA over query tile t takes its key tiles (t + 1 at 128-blocks, 2t + 2 at paired
           64-blocks) plus OVERHEAD_TILES; the makespan over total work / SMS (1.0: balanced);
  L2       each CTA reads key tile j of its pair's K and V at its start + j; every read goes
           through an LRU cache of L2_BYTES; the misses are the K and V bytes read from DRAM, over
           the compulsory (each pair's K and V once).
Calibrated on the H200's counters (bench/NOTES.md, "The H200 run at 510d8d7"): at an effective
30 MB the x-fastest order reads 1.0x and change 27's 8.1x (d128) / 15.4x (d64) of compulsory,
within 5 % of the measured DRAM bytes. Orders:
  x-fastest      tiles of a pair ascending, pairs one after another (before change 27)
  heads-fastest  every pair's last tile first, then the one before (change 27: one group)
  grouped        change 34: the pairs in geometry.sm90_cta_groups groups, heads-fastest within each

    python scripts/cta_order_model.py              # the table of bench/NOTES.md change 34
"""

from __future__ import annotations

import argparse
import heapq
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from cuattn.backends.geometry import SM90_TILE_M, sm90_cta_groups, sm90_tile_n  # noqa: E402

SMS = 132  # an H100's / H200's SMs
OVERHEAD_TILES = 0.3  # a CTA's prologue and epilogue, in key tiles (change 27's model)
L2_BYTES = 30e6  # the L2 the reuse sees: calibrated on the H200's DRAM counters
K_AND_V = 2
BF16_BYTES = 2
# (T, batch x heads, d, block): the benchmark's shapes, few heads, long rows, an uneven count
SHAPES = [
    (4096, 64, 128, 128),
    (4096, 128, 64, 64),
    (2048, 128, 128, 128),
    (8192, 32, 128, 128),
    (16384, 16, 64, 64),
    (4096, 36, 128, 128),
    (4096, 8, 128, 128),
    (32768, 32, 128, 128),
    (65536, 8, 128, 128),
]


def start_order(tiles: int, pairs: int, groups: int) -> list[tuple[int, int]]:
    """(query tile, pair) of every CTA in the order attn_fwd_sm90 starts them
    (kernels/common/types.cuh, cta_tile_longest_first): pairs cut into `groups` groups of
    pairs // groups or one more pair (the first ones), one group after another; within a group
    the last tile of every pair, then the one before it."""
    narrow, wide = divmod(pairs, groups)
    order, first = [], 0
    for group in range(groups):
        size = narrow + 1 if group < wide else narrow
        for rank in range(tiles):
            order += [(tiles - 1 - rank, first + i) for i in range(size)]
        first += size
    return order


def x_fastest_order(tiles: int, pairs: int) -> list[tuple[int, int]]:
    return [(tile, pair) for pair in range(pairs) for tile in range(tiles)]


def simulate(
    order: list[tuple[int, int]], key_tiles: Callable[[int], int], tile_bytes: int
) -> tuple[float, int]:
    """(makespan over the balanced one, K and V bytes read from DRAM) of one launch."""
    free = [(0.0, sm) for sm in range(SMS)]
    reads = []
    for tile, pair in order:
        start, sm = heapq.heappop(free)
        reads += [(start + OVERHEAD_TILES / 2 + j, pair, j) for j in range(key_tiles(tile))]
        heapq.heappush(free, (start + key_tiles(tile) + OVERHEAD_TILES, sm))
    makespan = max(end for end, _ in free)
    work = sum(key_tiles(tile) + OVERHEAD_TILES for tile, _ in order)
    reads.sort()
    cache: OrderedDict[tuple[int, int], None] = OrderedDict()
    capacity, misses = int(L2_BYTES // tile_bytes), 0
    for _, pair, j in reads:
        if (pair, j) in cache:
            cache.move_to_end((pair, j))
            continue
        misses += 1
        cache[(pair, j)] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return makespan / (work / SMS), misses * tile_bytes


def model_row(n_ctx: int, pairs: int, head_dim: int, block: int) -> dict[str, tuple[float, float]]:
    """Each order's (makespan over balanced, DRAM bytes over compulsory) for dense causal."""
    tiles = n_ctx // SM90_TILE_M
    tile_n = sm90_tile_n(block, head_dim)
    tile_bytes = K_AND_V * tile_n * head_dim * BF16_BYTES
    per_cta = SM90_TILE_M // tile_n

    def key_tiles(tile: int) -> int:
        return per_cta * (tile + 1)

    compulsory = pairs * K_AND_V * n_ctx * head_dim * BF16_BYTES
    groups = sm90_cta_groups(1, pairs, n_ctx, head_dim, "bfloat16", 1)
    orders = {
        "x-fastest": x_fastest_order(tiles, pairs),
        "heads-fastest": start_order(tiles, pairs, 1),
        f"grouped ({groups})": start_order(tiles, pairs, groups),
    }
    row = {}
    for name, order in orders.items():
        makespan, dram = simulate(order, key_tiles, tile_bytes)
        row[name] = (makespan, dram / compulsory)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args()
    print("| T, batch x heads, d, block | x fastest | heads fastest | grouped (groups) |")
    print("| --- | ---: | ---: | ---: |")
    for n_ctx, pairs, head_dim, block in SHAPES:
        row = model_row(n_ctx, pairs, head_dim, block)
        cells = [f"{m:.3f} / {d:.1f}" for m, d in row.values()]
        grouped = next(name for name in row if name.startswith("grouped"))
        cells[-1] += f" ({grouped[9:-1]})"
        print(f"| {n_ctx // 1024}k, {pairs}, d{head_dim} b{block} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
