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

    python -m dev.bwd_order_model              # the table of bench/NOTES.md
"""

from __future__ import annotations

import heapq
import sys

SMS = 132
FIXED_STEPS = 2.0  # a CTA's set-up and epilogue, in steps
TILE_K = 128
TILE_Q = 64


def claim_order(tiles: int, pairs: int, group: int, longest: bool) -> list[tuple[int, int]]:
    """(pair, key tile) in claim order: groups of ``group`` pairs, position-major."""
    order = []
    for first in range(0, pairs, group):
        positions = range(tiles) if longest else range(tiles - 1, -1, -1)
        order += [(p, j) for j in positions for p in range(first, min(first + group, pairs))]
    return order


def makespan(
    order: list[tuple[int, int]], n_ctx: int, reduce: float, reversed_walk: bool = False
) -> float:
    """The simulated end over the balanced time (module docstring)."""
    free = [0.0] * SMS
    heapq.heapify(free)
    reduce_end: dict[tuple[int, int], float] = {}
    steps_total = 0.0
    end = 0.0
    q_steps = n_ctx // TILE_Q
    for pair, tile in order:
        t = heapq.heappop(free) + FIXED_STEPS
        previous_start = None
        finish = t
        steps = range(2 * tile, q_steps)
        for q in reversed(steps) if reversed_walk else steps:
            computed = t + 1.0
            if previous_start is not None:  # the previous reduce has read the dQ tile
                computed = max(computed, previous_start + reduce)
            start = max(computed, reduce_end.get((pair, q), 0.0))
            reduce_end[(pair, q)] = finish = start + reduce
            previous_start = start
            t = computed
        heapq.heappush(free, finish)
        end = max(end, finish)
        steps_total += FIXED_STEPS + len(steps)
    return end / (steps_total / SMS)


def main() -> int:
    from cuattn.backends.geometry import sm90_backward_cta_groups

    print(
        "| T, pairs (kv head x batch), pairs a group | reduce (steps) | today | shortest first"
        " | longest first | longest first, walk reversed |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
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
            ]
            print(
                f"| {n_ctx}, {pairs}, {group} | {reduce} | "
                + " | ".join(f"{c:.3f}" for c in cells)
                + " |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
