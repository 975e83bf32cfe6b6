"""Context parallelism: a sequence sharded over the ranks of a torch.distributed group.

    shard(x, rank, world_size, balance="zigzag", dim=2)   this rank's share of a whole sequence
    unshard(shards, balance="zigzag", dim=2)              the whole sequence from every share
    positions(n, rank, world_size, balance)               the token indices a share holds
    ring_attention(q, k, v, layout, group=None, balance="zigzag", scale=None, return_lse=False)
    ring_plan(layout, rank, world_size, balance)          what each ring step computes or skips

Needs torch (torch.distributed: NCCL on GPUs, gloo on CPUs).
"""

from cuattn.distributed.ring import RingPlan, RingStats, ring_attention, ring_plan
from cuattn.distributed.sharding import BALANCES, positions, shard, unshard

__all__ = [
    "BALANCES",
    "RingPlan",
    "RingStats",
    "positions",
    "ring_attention",
    "ring_plan",
    "shard",
    "unshard",
]
