"""Backward with dQ by fp32 atomics inside the dK/dV kernel vs dQ by its own pass over the CSR
rows, side by side on one GPU, with the forward and SDPA-flash's forward + backward beside them.

    PYTHONPATH=. python scripts/bwd_dq_modes.py [--out DIR]

Why: Nsight Compute on an H100 (bench/results/2026-11-23-h100/) put the atomic dK/dV kernel at
10.9 ms on dense causal T=4096 d=128, L2-bound on its scalar atomics (L2 84.7% busy, tensor pipe
10%), where the two kernels of the separate pass took 2.7 + 2.0 ms. This script measures that
choice over head dims, block sizes and patterns, so the default follows the measurement.
bf16, batch * T = 16k tokens, heads * head_dim = 2048 (as the benchmark); CUDA-event medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import cupy
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import cuattn
from cuattn import backend as be
from cuattn.interop import cupy_stream_of_torch

TOKENS, MODEL_DIM, N_CTX = 16 * 1024, 2048, 4096
WARMUP, REPEATS = 3, 15
CASES = [  # (pattern, make_layout kwargs, head dims, block sizes)
    ("all", {}, (64, 128), (32, 64, 128)),
    ("all", {"causal": False}, (64, 128), (64,)),
    ("local", {"local_attn_ctx": 512}, (64, 128), (64,)),
    ("bigbird", {}, (128,), (64,)),
    ("strided", {"local_attn_ctx": 16}, (128,), (64,)),
]


def median_ms(fn) -> float:
    for _ in range(WARMUP):
        fn()
    times = []
    for _ in range(REPEATS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def measure(mode: str, kwargs: dict, head_dim: int, blocksize: int) -> dict:
    heads, batch = MODEL_DIM // head_dim, TOKENS // N_CTX
    shape = (batch, heads, N_CTX, head_dim)
    q, k, v, dout = (torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    layout = cuattn.make_layout(mode, N_CTX, heads, blocksize=blocksize, **kwargs)
    scale = head_dim**-0.5
    cq, ck, cv, cdout = (cupy.from_dlpack(x) for x in (q, k, v, dout))
    out, lse = be.forward(cq, ck, cv, layout, scale, backend="cuda")
    row = {"pattern": mode, **kwargs, "head_dim": head_dim, "blocksize": blocksize}
    row["fwd_ms"] = median_ms(lambda: be.forward(cq, ck, cv, layout, scale, backend="cuda"))
    for name, deterministic in (("bwd_atomic_ms", False), ("bwd_separate_ms", True)):
        row[name] = median_ms(
            lambda d=deterministic: be.backward(
                cq, ck, cv, out, lse, cdout, layout, scale, "cuda", deterministic=d
            )
        )
    if mode == "all":
        leaves = [x.detach().requires_grad_() for x in (q, k, v)]
        causal = kwargs.get("causal", True)

        def sdpa() -> None:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ref = F.scaled_dot_product_attention(*leaves, is_causal=causal, scale=scale)
                torch.autograd.grad(ref, leaves, dout)

        row["sdpa_flash_fwd_bwd_ms"] = median_ms(sdpa)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    rows = []
    with cupy_stream_of_torch():
        for mode, kwargs, head_dims, blocksizes in CASES:
            for head_dim in head_dims:
                for blocksize in blocksizes:
                    rows.append(measure(mode, kwargs, head_dim, blocksize))
    header = "| pattern | d | b | fwd ms | bwd atomic ms | bwd separate ms | atomic/separate |"
    header += " fwd+bwd vs SDPA-flash: atomic | separate |"
    lines = [header, "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        label = r["pattern"] + ("-bidir" if r.get("causal") is False else "")
        ratio = r["bwd_atomic_ms"] / r["bwd_separate_ms"]
        flash = r.get("sdpa_flash_fwd_bwd_ms")
        vs = ["-", "-"]
        if flash is not None:
            vs = [
                f"{flash / (r['fwd_ms'] + r[m]):.2f}" for m in ("bwd_atomic_ms", "bwd_separate_ms")
            ]
        lines.append(
            f"| {label} | {r['head_dim']} | {r['blocksize']} | {r['fwd_ms']:.3f} | "
            f"{r['bwd_atomic_ms']:.3f} | {r['bwd_separate_ms']:.3f} | {ratio:.2f} | "
            f"{vs[0]} | {vs[1]} |"
        )
    table = "\n".join(lines)
    print(f"{torch.cuda.get_device_name()}, T={N_CTX}, bf16\n{table}")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "bwd_dq_modes.json").write_text(json.dumps(rows, indent=1))
        (args.out / "bwd_dq_modes.md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
