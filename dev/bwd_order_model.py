"""The order attn_bwd_sm90 claims its CTAs in, modelled with its ordered dQ reduce: no GPU.

Dense causal attention, one CTA per 128 keys and (kv head, batch) pair, one resident CTA per SM.
Each SM claims the next CTA when its last one ends. A CTA costs FIXED_STEPS, then one step per
64-query step of its column (key tile j of T / 128 walks T / 64 - 2j steps), walking down the
column (first query step first) or, ``reversed``, up it. A consumer holds one fp32 dQ tile, so a
step's dQ store waits until the previous step's reduce has read it (taken as its whole
duration); a reduce into a (pair, query
step) tile waits for the reduce ranked before it (the CTA claimed before it that adds there) to
end, then takes ``reduce`` steps. CTAs are taken in claim order, so every wait is on a CTA
already simulated: what the kernel's ranks guarantee (no deadlock at any occupancy). Printed:
the makespan over the balanced one (total steps / SMS).
Orders, over groups of pairs claimed one group after another, position-major within a group:
  today      one pair a group, each pair's key tiles in descending order (shortest first)
  shortest   geometry.sm90_backward_cta_groups' groups, shortest column first (this change)
  longest    the same groups, longest column first (change 34's order for the forward)
and, in the last column, the built order with CUATTN_BWD_DQ=unordered (no reduce waits for the
one ranked before it): what the ordered reduce's waits cost, for the GPU run to compare.

    python -m dev.bwd_order_model              # the table of bench/NOTES.md
"""

from __future__ import annotations

import heapq
import sys

SMS = 132
FIXED_STEPS = 2.0  # a CTA's set-up and epilogue, in steps
TILE_K = 128
TILE_Q = 64
# The benchmark patterns (cuattn/tools/bench/cases.py) the ordered and unordered dQ are compared
# on, here and by scripts/bwd_dq_order_bench.py on a GPU.
ORDER_PATTERNS = ("dense-causal", "fixed", "strided", "local", "bigbird")


def claim_order(tiles: int, pairs: int, group: int, longest: bool) -> list[tuple[int, int]]:
    """(pair, key tile) in claim order: groups of ``group`` pairs, position-major."""
    order = []
    for first in range(0, pairs, group):
        positions = range(tiles) if longest else range(tiles - 1, -1, -1)
        order += [(p, j) for j in positions for p in range(first, min(first + group, pairs))]
    return order


def causal_columns(n_ctx: int) -> list[list[int]]:
    """Each key tile's query steps down its column, dense causal (tile j: 2j .. T / 64 - 1)."""
    return [list(range(2 * j, n_ctx // TILE_Q)) for j in range(n_ctx // TILE_K)]


def makespan(
    order: list[tuple[int, int]],
    n_ctx: int,
    reduce: float,
    reversed_walk: bool = False,
    ordered: bool = True,
    columns: list[list[int]] | None = None,
) -> float:
    """The simulated end over the balanced time (module docstring); ``columns``: each key
    tile's query steps down its column (default: dense causal over n_ctx). ``ordered=False`` is
    CUATTN_BWD_DQ=unordered: a reduce starts once its step is computed and the previous reduce
    has read the CTA's dQ tile, whatever the other CTAs' reduces into the same tile do."""
    columns = causal_columns(n_ctx) if columns is None else columns
    free = [0.0] * SMS
    heapq.heapify(free)
    reduce_end: dict[tuple[int, int], float] = {}
    steps_total = 0.0
    end = 0.0
    for pair, tile in order:
        t = heapq.heappop(free) + FIXED_STEPS
        previous_start = None
        finish = t
        steps = columns[tile]
        for q in reversed(steps) if reversed_walk else steps:
            computed = t + 1.0
            if previous_start is not None:  # the previous reduce has read the dQ tile
                computed = max(computed, previous_start + reduce)
            start = max(computed, reduce_end.get((pair, q), 0.0)) if ordered else computed
            reduce_end[(pair, q)] = finish = start + reduce
            previous_start = start
            t = computed
        heapq.heappush(free, finish)
        end = max(end, finish)
        steps_total += FIXED_STEPS + len(steps)
    return end / (steps_total / SMS)


def layout_case(pattern: str, n_ctx: int, block: int) -> tuple[list[list[int]], list[int]]:
    """(columns, tile order) of a benchmark pattern's first head (every pair walks it): each key
    tile's query steps (the union of its blocks' CSC columns, a block's steps in order) and the
    order the kernel claims the tiles in (kernels.backward_tile_order)."""
    import numpy as np

    from cuattn.backends.kernels import backward_tile_order
    from cuattn.tools.bench.cases import ALL_PATTERNS

    (bench_pattern,) = (p for p in ALL_PATTERNS if p.label == pattern)
    # two heads: fixed's summary columns cycle over them (num_verts = 2)
    blocks = bench_pattern.make_layout(n_ctx, 2, block).blocks[:1]
    key_blocks = TILE_K // block
    tiles = -(-blocks.shape[2] // key_blocks)
    columns = []
    for tile in range(tiles):
        held = blocks[0, :, tile * key_blocks : (tile + 1) * key_blocks].any(axis=1)
        columns.append(
            [
                int(i) * block // TILE_Q + s
                for i in np.flatnonzero(held)
                for s in range(block // TILE_Q)
            ]
        )
    return columns, [int(t) for t in backward_tile_order(blocks, key_blocks, 1)[0]]


def sparse_table(n_ctx: int = 4096, pairs: int = 64) -> None:
    """Ordered against unordered dQ for the patterns the GPU run times
    (scripts/bwd_dq_order_bench.py), 64-blocks, the built claim order and groups."""
    from cuattn.backends.geometry import sm90_backward_cta_groups

    groups = sm90_backward_cta_groups(1, pairs, n_ctx, 128, "bfloat16", 1)
    group = -(-pairs // groups)
    print(f"\nT = {n_ctx}, {pairs} pairs, {group} a group, 64-blocks (128-key tiles):\n")
    print("| pattern | reduce (steps) | ordered | unordered | the waits' cost |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for pattern in ORDER_PATTERNS:
        columns, tile_order = layout_case(pattern, n_ctx, 64)
        order = []
        for first in range(0, pairs, group):
            members = range(first, min(first + group, pairs))
            order += [(p, j) for j in tile_order for p in members]
        for reduce in (0.3, 1.0):
            ordered, unordered = (
                makespan(order, n_ctx, reduce, ordered=o, columns=columns) for o in (True, False)
            )
            print(
                f"| {pattern} | {reduce} | {ordered:.3f} | {unordered:.3f} | "
                f"{100 * (ordered / unordered - 1):.1f} % |"
            )


def main() -> int:
    from cuattn.backends.geometry import sm90_backward_cta_groups

    print(
        "| T, pairs (kv head x batch), pairs a group | reduce (steps) | today | shortest first"
        " | longest first | longest first, walk reversed | shortest first, unordered dQ |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n_ctx, pairs in ((2048, 128), (4096, 64), (4096, 128), (8192, 32), (16384, 16)):
        groups = sm90_backward_cta_groups(1, pairs, n_ctx, 128, "bfloat16", 1)
        group = -(-pairs // groups)
        tiles = n_ctx // TILE_K
        for reduce in (0.3, 1.0):
            cells = [
                makespan(claim_order(tiles, pairs, 1, False), n_ctx, reduce),
                makespan(claim_order(tiles, pairs, group, False), n_ctx, reduce),
                makespan(claim_order(tiles, pairs, group, True), n_ctx, reduce),
                makespan(claim_order(tiles, pairs, group, True), n_ctx, reduce, True),
                makespan(claim_order(tiles, pairs, group, False), n_ctx, reduce, ordered=False),
            ]
            print(
                f"| {n_ctx}, {pairs}, {group} | {reduce} | "
                + " | ".join(f"{c:.3f}" for c in cells)
                + " |"
            )
    sparse_table()
    return 0


if __name__ == "__main__":
    sys.exit(main())
