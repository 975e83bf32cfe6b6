"""Ring attention over torch.distributed: every rank holds a zigzag shard of one sequence.

    torchrun --nproc-per-node 2 examples/ring_attention.py          # gloo on CPUs
    torchrun --nproc-per-node 8 examples/ring_attention.py          # NCCL on 8 GPUs

Rank 0 prints how far the gathered ring output is from single-process attention.
"""

import os
import sys

import torch
import torch.distributed as dist

import cuattn
from cuattn.distributed import RingStats, ring_attention, shard, unshard

cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
dtype = torch.bfloat16 if cuda else torch.float32

n, heads, kv_heads, head_dim = 1024 * world, 8, 2, 64
layout = cuattn.make_layout("fixed", n, heads, 64, local_attn_ctx=256, num_verts=4, vertsize=1)
gen = torch.Generator().manual_seed(0)  # the same whole sequence on every rank
q = torch.randn(1, heads, n, head_dim, generator=gen)
k, v = (torch.randn(1, kv_heads, n, head_dim, generator=gen) for _ in range(2))

mine = [shard(x, rank, world, "zigzag").to(device, dtype).requires_grad_() for x in (q, k, v)]
stats = RingStats()
out = ring_attention(*mine, layout, balance="zigzag", stats=stats)
out.float().square().sum().backward()  # q.grad, k.grad, v.grad of this rank's shard

shares = [torch.empty_like(out) for _ in range(world)]
dist.all_gather(shares, out.detach())
if rank == 0:
    whole = cuattn.sparse_attention(*(x.to(device, dtype) for x in (q, k, v)), layout)
    error = (unshard(shares, "zigzag").float() - whole.float()).abs().max().item()
    print(
        f"{world} ranks: max |ring - single| = {error:.2e}; rank 0 sent "
        f"{stats.bytes_sent / 2**20:.1f} MiB, skipped {stats.steps_skipped} of {world} steps"
    )
dist.barrier()  # nobody closes its connections while a peer still talks
dist.destroy_process_group()
# Leave without the interpreter's finalization, where gloo's worker threads may still drop the
# tensors of finished transfers and abort the process (SIGABRT after everything passed: seen once
# under a loaded CI machine; the test workers in tests/distributed leave the same way).
sys.stdout.flush()
os._exit(0)
