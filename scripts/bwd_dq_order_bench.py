"""The sm_90a backward with its dQ reduces ordered and unordered, side by side, on a GPU.

    CUATTN_KERNELS=sm90a python scripts/bwd_dq_order_bench.py [--markdown out.md]

For each pattern dev/bwd_order_model.py predicts (ORDER_PATTERNS, 64-blocks, and dense causal at
128-blocks): one forward, then attn_bwd_sm90 with CUATTN_BWD_DQ=ordered and =unordered in
alternating repetitions (so that whatever else shares the GPU slows both alike), timed by CUDA
events. Printed per case: the median of each, their ratio (what the ordered reduce's waits cost,
against the model's column "the waits' cost"), dQ's relative difference between the two orders
and between two unordered runs (0 where the adds happened to land in one order), whether two
ordered runs' dQ are bit-identical (they must be) and whether dK and dV are bit-identical across
all runs (they must be: only dQ is reduced across CTAs). Exits 1 if any of those fails or dQ
differs between the orders beyond bf16's tolerance. `scripts/gpu_report.sh optin`
runs it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import cupy
import torch

from cuattn import backends as be
from cuattn.adapters.dlpack import cupy_stream_of_torch
from cuattn.backends import geometry
from cuattn.backends.call import AttentionCall
from cuattn.tools.bench.cases import ALL_PATTERNS, MODEL_DIM
from dev.bwd_order_model import ORDER_PATTERNS

BF16_TOLERANCE = 2e-2  # relative, dQ of one order against the other's


def bits(x: cupy.ndarray) -> cupy.ndarray:
    """A copy of a bf16 array's bits (whatever dtype CuPy labels bf16 with)."""
    return x.view(cupy.uint16).copy()


def as_float(x: cupy.ndarray) -> cupy.ndarray:
    """bf16 bits as float32: the high half of the float's word."""
    return (x.astype(cupy.uint32) << 16).view(cupy.float32)


def rel_diff(a: cupy.ndarray, b: cupy.ndarray) -> float:
    a, b = as_float(a), as_float(b)
    return float(cupy.linalg.norm(a - b) / max(float(cupy.linalg.norm(b)), 1e-30))


def bits_equal(a: cupy.ndarray, b: cupy.ndarray) -> bool:
    return bool((a == b).all())


def run_case(label: str, block: int, args: argparse.Namespace) -> tuple[str, bool]:
    (pattern,) = (p for p in ALL_PATTERNS if p.label == label)
    heads = MODEL_DIM // args.head_dim
    layout = pattern.make_layout(args.n_ctx, heads, block)
    shape = (args.batch, heads, args.n_ctx, args.head_dim)
    torch.manual_seed(0)
    tensors = [torch.randn(shape, dtype=torch.bfloat16, device="cuda") for _ in range(4)]
    q, k, v, dout = (cupy.from_dlpack(x) for x in tensors)
    call = AttentionCall(layout, args.head_dim**-0.5, backend="cuda")
    orders = (geometry.BWD_DQ_ORDERED, geometry.BWD_DQ_UNORDERED)
    times: dict[str, list[float]] = {order: [] for order in orders}
    grads: dict[str, list[list[cupy.ndarray]]] = {order: [] for order in orders}
    with cupy_stream_of_torch():
        out, lse = be.forward(q, k, v, call)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        for rep in range(args.reps + 1):  # the first of each order warms it
            for order in orders:
                os.environ[geometry.BWD_DQ_ENV] = order
                start.record()
                result = be.backward(q, k, v, out, lse, dout, None, call)
                end.record()
                end.synchronize()
                if rep > 0:
                    times[order].append(cupy.cuda.get_elapsed_time(start, end))
                if rep < 2:
                    grads[order].append([bits(g) for g in result])
    ordered_ms, unordered_ms = (statistics.median(times[o]) for o in orders)
    (dq_o, dk_o, dv_o), _ = grads[geometry.BWD_DQ_ORDERED]
    (dq_u, _, _), (dq_u2, _, _) = grads[geometry.BWD_DQ_UNORDERED]
    runs = [run for order in orders for run in grads[order]]
    same_kv = all(bits_equal(run[1], dk_o) and bits_equal(run[2], dv_o) for run in runs)
    same_ordered = bits_equal(grads[geometry.BWD_DQ_ORDERED][1][0], dq_o)
    between, run_to_run = rel_diff(dq_u, dq_o), rel_diff(dq_u2, dq_u)
    ok = same_kv and same_ordered and between <= BF16_TOLERANCE
    row = (
        f"| {label} | {block} | {ordered_ms:.3f} | {unordered_ms:.3f} | "
        f"{100 * (ordered_ms / unordered_ms - 1):.1f} % | {between:.2e} | {run_to_run:.2e} | "
        f"{'yes' if same_ordered else 'NO'} | {'yes' if same_kv else 'NO'} |"
    )
    return row, ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args()
    os.environ[geometry.KERNELS_ENV] = geometry.SM90_FAMILY
    lines = [
        f"attn_bwd_sm90, bf16, T = {args.n_ctx}, d = {args.head_dim}, batch {args.batch}, "
        f"{MODEL_DIM // args.head_dim} heads; median of {args.reps} (ms)",
        "",
        "| pattern | block | ordered | unordered | the waits' cost | dQ ordered vs unordered "
        "| dQ unordered run to run | dQ ordered bit-identical | dK, dV bit-identical |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    all_ok = True
    for label, block in [(p, 64) for p in ORDER_PATTERNS] + [("dense-causal", 128)]:
        row, ok = run_case(label, block, args)
        lines.append(row)
        print(row, flush=True)
        all_ok &= ok
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(lines) + "\n")
    print("\n".join(lines[:4]))
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
