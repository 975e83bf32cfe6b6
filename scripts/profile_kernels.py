"""One dense-causal forward and backward of cuattn's kernels and of SDPA-flash, for Nsight Compute.

    ncu --clock-control none -k regex:'attn_|flash' --section SpeedOfLight ... \
        python scripts/profile_kernels.py [--n-ctx 4096] [--head-dim 128] [--batch 4]

Runs, once each, on bf16 inputs of [batch, 2048 / head_dim heads, n_ctx, head_dim] (the
benchmark's model width): cuattn's forward and backward, then torch
SDPA's flash forward and backward on the same tensors, so one profile shows each of our kernels
beside the FlashAttention-2 kernel doing the same work; then one decode step (GQA, 4 query heads
per key head, one new token) over a paged cache holding n_ctx tokens per sequence.
`scripts/gpu_report.sh profile` runs it under ncu with the sections that explain a gap
(throughput, occupancy, warp stalls, tensor-pipe use, shared-memory bank conflicts).
"""

from __future__ import annotations

import argparse
import sys

import cupy
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuattn
from cuattn import backends as be
from cuattn.adapters.dlpack import cupy_stream_of_torch
from cuattn.backends.call import AttentionCall

MODEL_DIM = 2048  # heads * head_dim, as in the benchmark
BLOCKSIZE = 64
DECODE_GROUP = 4  # query heads per key head in the decode step
DECODE_PAGE = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    args = parser.parse_args()
    heads = MODEL_DIM // args.head_dim
    shape = (args.batch, heads, args.n_ctx, args.head_dim)
    torch.manual_seed(0)
    q, k, v, dout = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    layout = cuattn.make_layout("all", args.n_ctx, heads, blocksize=BLOCKSIZE)
    scale = args.head_dim**-0.5

    with cupy_stream_of_torch():
        cq, ck, cv, cdout = (cupy.from_dlpack(x) for x in (q, k, v, dout))
        call = AttentionCall(layout, scale, backend="cuda")
        out, lse = be.forward(cq, ck, cv, call)
        be.backward(cq, ck, cv, out, lse, cdout, None, call)

    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        ref = F.scaled_dot_product_attention(*leaves, is_causal=True, scale=scale)
        torch.autograd.grad(ref, leaves, dout)
    torch.cuda.synchronize()

    kv_heads = max(1, heads // DECODE_GROUP)
    cache = cuattn.KVCache(
        args.batch, kv_heads, args.head_dim, "bfloat16", page_size=DECODE_PAGE, like=cq
    )
    kv_shape = (args.batch, kv_heads, args.n_ctx, args.head_dim)
    step_k, step_v = (torch.randn(kv_shape, dtype=torch.bfloat16, device="cuda") for _ in "kv")
    step_q = torch.randn(
        args.batch, kv_heads * DECODE_GROUP, 1, args.head_dim, dtype=torch.bfloat16, device="cuda"
    )
    with cupy_stream_of_torch():
        cache.append(cupy.from_dlpack(step_k), cupy.from_dlpack(step_v))
        cuattn.decode_attention(cupy.from_dlpack(step_q), cache)
    cupy.cuda.Device().synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
