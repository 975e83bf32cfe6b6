"""Context-parallel picture: ring attention on W gloo processes, per rank and per pattern.

For each world size W, pattern and balance, every rank runs cuattn.distributed.ring_attention
forward and backward on its shard and reports its active blocks, ring steps computed and
skipped, bytes sent and compute time; the table shows the spread over ranks (imbalance = the
busiest rank's active blocks over the mean: what the slowest rank costs the ring).

With --project, one process also times each rank's per-step kernels (forward + backward on
the rank's restricted layouts) and the merge on this machine's device (CUDA if present, else
the CPU backend), and projects a W-device ring: a step lasts as long as its slowest rank's
compute or the key/value transfer, whichever is longer (transfer overlapped with compute), at
an assumed link bandwidth and latency (--link-gbps, --link-latency-us; defaults: NVLink-class,
400 GB/s per direction and 10 us per message).

    python scripts/cp_bench.py                                   # W = 2, 4 on the CPU
    python scripts/cp_bench.py --world 2 4 --n 4096 --project --markdown bench/results/cp.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import cuattn  # noqa: E402
from cuattn.adapters import torch_ops  # noqa: E402
from cuattn.backends.call import AttentionCall  # noqa: E402
from cuattn.distributed import RingStats, ring_attention, ring_plan, shard  # noqa: E402
from cuattn.tools.bench.report import rows_table  # noqa: E402

PATTERNS = {
    "causal": ("all", {}),
    "local": ("local", {"local_attn_ctx": 512}),
    "strided": ("strided", {"local_attn_ctx": 128}),
    "fixed": ("fixed", {"local_attn_ctx": 256, "num_verts": 4, "vertsize": 1}),
    "bigbird": ("bigbird", {"local_attn_ctx": 128}),
}
BALANCES = ("contiguous", "zigzag")


def _layout(args: argparse.Namespace, pattern: str) -> cuattn.Layout:
    mode, options = PATTERNS[pattern]
    return cuattn.make_layout(mode, args.n, args.heads, args.blocksize, **options)


def _inputs(args: argparse.Namespace, device: str) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shape = (1, args.heads, args.n, args.head_dim)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    return [torch.randn(shape, generator=gen).to(device=device, dtype=dtype) for _ in range(3)]


def _rank_worker(rank: int, world: int, init: str, args: argparse.Namespace, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    rows = []
    try:
        whole = _inputs(args, "cpu")
        for pattern in args.patterns:
            layout = _layout(args, pattern)
            for balance in BALANCES:
                mine = [shard(x, rank, world, balance).requires_grad_() for x in whole]
                # The first call builds the ring plan and caches; the second is measured.
                for _ in range(2):
                    stats = RingStats()
                    start = time.perf_counter()
                    ring_attention(*mine, layout, balance=balance, stats=stats).sum().backward()
                    wall = time.perf_counter() - start
                plan = ring_plan(layout, rank, world, balance)
                rows.append(
                    dict(
                        world=world,
                        pattern=pattern,
                        balance=balance,
                        rank=rank,
                        active_blocks=plan.active_blocks,
                        skipped=plan.skipped,
                        bytes_sent=stats.bytes_sent,
                        compute_s=stats.compute_seconds,
                        wall_s=wall,
                    )
                )
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(rows, gathered, dst=0)
        if rank == 0:
            Path(out).write_text(json.dumps([r for part in gathered for r in part]))
        dist.barrier()  # nobody closes its connections while a peer still talks
    finally:
        dist.destroy_process_group()
    # Done (the rows are written): leave without the interpreter's finalization, where gloo's
    # worker threads may still drop tensors of finished transfers and abort the process.
    os._exit(0)


def run_ranks(args: argparse.Namespace) -> list[dict]:
    rows: list[dict] = []
    for world in args.world:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "rows.json")
            init = os.path.join(tmp, "rendezvous")
            mp.spawn(_rank_worker, args=(world, init, args, out), nprocs=world)
            rows += json.loads(Path(out).read_text())
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["world"], r["pattern"], r["balance"]), []).append(r)
    table = []
    for (world, pattern, balance), ranks in groups.items():
        blocks = np.array([r["active_blocks"] for r in ranks], dtype=float)
        compute = np.array([r["compute_s"] for r in ranks])
        table.append(
            dict(
                world=world,
                pattern=pattern,
                balance=balance,
                skipped=f"{sum(r['skipped'] for r in ranks)}/{world * world}",
                blocks=f"{int(blocks.min())}-{int(blocks.max())}",
                imbalance=blocks.max() / blocks.mean() if blocks.mean() else 1.0,
                compute=f"{compute.min():.3f}-{compute.max():.3f}",
                compute_imbalance=compute.max() / compute.mean() if compute.mean() else 1.0,
                mb_sent=max(r["bytes_sent"] for r in ranks) / 2**20,
            )
        )
    return table


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _time(fn, device: str, repeats: int) -> float:
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / repeats


def project(args: argparse.Namespace) -> list[dict]:
    """Per-step kernel times of every rank on one device, and the projected W-device ring."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    whole = _inputs(args, device)
    results = []
    for world in args.world:
        for pattern in args.patterns:
            layout = _layout(args, pattern)
            for balance in BALANCES:
                shards = [[shard(x, r, world, balance) for x in whole] for r in range(world)]
                steps = np.zeros((world, world))
                for rank in range(world):
                    q = shards[rank][0]
                    plan = ring_plan(layout, rank, world, balance)
                    for step, sub in enumerate(plan.steps):
                        if sub is None:
                            continue
                        src = shards[(rank - step) % world]
                        scale = args.head_dim**-0.5
                        call = AttentionCall(sub, scale)
                        *layout_args, _, index, _, _ = torch_ops.op_arguments(call, q.device)

                        def fwd_bwd(q=q, k=src[1], v=src[2], la=layout_args, index=index):
                            out, lse = torch_ops.attention_fwd(q, k, v, *la, False, index, [], 0)
                            bwd = torch_ops.attention_bwd
                            bwd(q, k, v, out, lse, out, None, *la, index, [], 0)

                        steps[rank, step] = _time(fwd_bwd, device, args.repeats)
                q0 = shards[0][0]
                lse0 = torch.zeros(q0.shape[:-1], dtype=torch.float32, device=device)
                merge = _time(
                    lambda q0=q0, lse0=lse0: cuattn.merge_attention_states(q0, lse0, q0, lse0),
                    device,
                    args.repeats,
                )
                kv_bytes = 2 * shards[0][1].numel() * shards[0][1].element_size()
                dkv_bytes = 2 * shards[0][1].numel() * 4  # float32 accumulators
                link = args.link_gbps * 1e9
                latency = args.link_latency_us * 1e-6
                # keys/values: one message forward and one backward per step, overlapped with
                # compute; the dK/dV accumulator moves after its step's compute (not overlapped)
                kv_transfer = 2 * (kv_bytes / link + latency)
                dkv_transfer = dkv_bytes / link + latency
                compute = steps.max(axis=0) + merge
                ring = float((np.maximum(compute, kv_transfer) + dkv_transfer).sum())
                transfer = kv_transfer + dkv_transfer
                results.append(
                    dict(
                        world=world,
                        pattern=pattern,
                        balance=balance,
                        device=torch.cuda.get_device_name() if device == "cuda" else "cpu",
                        step_ms=f"{steps.max(axis=0).min() * 1e3:.2f}-{steps.max() * 1e3:.2f}",
                        merge_ms=merge * 1e3,
                        transfer_ms=transfer * 1e3,
                        ring_ms=ring * 1e3,
                        one_device_ms=float(steps.sum()) * 1e3,
                        speedup=float(steps.sum()) / ring if ring else 0.0,
                    )
                )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--blocksize", type=int, default=64)
    parser.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=list(PATTERNS))
    parser.add_argument("--project", action="store_true", help="time per-step kernels, project")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--link-gbps", type=float, default=400.0)
    parser.add_argument("--link-latency-us", type=float, default=10.0)
    parser.add_argument("--markdown", type=Path, help="also write the tables here")
    args = parser.parse_args()

    torch.set_num_threads(1)  # W processes share the machine's cores
    text = [
        f"cp_bench: n={args.n}, heads={args.heads}, head_dim={args.head_dim}, "
        f"blocksize={args.blocksize}, float32 on gloo (CPU), forward + backward",
        "",
        rows_table(
            summarise(run_ranks(args)),
            [
                "world",
                "pattern",
                "balance",
                "skipped",
                "blocks",
                "imbalance",
                "compute",
                "compute_imbalance",
                "mb_sent",
            ],
        ),
        "",
        "skipped: ring steps with no active block over all ranks (of W*W); blocks: active "
        "blocks per rank (min-max); imbalance: max/mean of them; compute: seconds of kernel "
        "time per rank (min-max) and its max/mean; mb_sent: MiB the busiest sender sent.",
    ]
    if args.project:
        text += [
            "",
            f"Projection (link {args.link_gbps:g} GB/s per direction, "
            f"{args.link_latency_us:g} us per message; a step lasts max(slowest rank's "
            "compute + merge, key/value transfers) + the dK/dV transfer; one_device: the same "
            "work on one device, speedup: one_device / ring):",
            "",
            rows_table(
                project(args),
                [
                    "world",
                    "pattern",
                    "balance",
                    "device",
                    "step_ms",
                    "merge_ms",
                    "transfer_ms",
                    "ring_ms",
                    "one_device_ms",
                    "speedup",
                ],
            ),
        ]
    report = "\n".join(text)
    print(report)
    if args.markdown:
        args.markdown.write_text(report + "\n")


if __name__ == "__main__":
    main()
