"""Ring attention on W = 1, 2 and 4 gloo processes on the CPU against single-process attention."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import cuattn
from cuattn.distributed import (
    RingStats,
    positions,
    ring_attention,
    ring_plan,
    shard,
    unshard,
)
from tests.helpers.attn_cases import rel

BATCH, HEADS, HEAD_DIM, BLOCK = 2, 4, 8, 16
TOLERANCE = {torch.float64: (1e-12, 1e-10), torch.float32: (2e-6, 2e-5)}


def _layout(name: str, n: int) -> cuattn.Layout:
    if name == "random":
        rng = np.random.default_rng(n)
        blocks = rng.random((HEADS, n // BLOCK, n // BLOCK)) < 0.4
        blocks[:, 1] = False  # a block row with nothing: rows that see no key at all
        return cuattn.Layout.from_blocks(blocks, BLOCK, mask_fn=lambda h, q, k: (q + k + h) % 3 > 0)
    options = {
        "all": {},
        "local": {"local_attn_ctx": 20},
        "fixed": {"local_attn_ctx": 32, "num_verts": 1, "vertsize": 1},
        "bigbird": {"local_attn_ctx": 16},
        "strided": {"local_attn_ctx": 8},
    }[name]
    return cuattn.make_layout(name, n, HEADS, BLOCK, **options)


# (pattern, balance, kv_heads, dtype)
CASES = [
    ("all", "zigzag", HEADS, torch.float64),
    ("all", "contiguous", 2, torch.float64),
    ("local", "contiguous", HEADS, torch.float64),
    ("local", "zigzag", 1, torch.float32),
    ("fixed", "zigzag", 2, torch.float64),
    ("bigbird", "contiguous", HEADS, torch.float64),
    ("strided", "zigzag", HEADS, torch.float64),
    ("random", "zigzag", 2, torch.float64),
    ("random", "contiguous", HEADS, torch.float32),
]


def _lse_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _loss(out, lse, weight, lse_weight):
    """A loss on both outputs, so that the lse's gradient is checked too (rows that see no
    key have lse = -inf and take no part)."""
    finite_lse = torch.where(torch.isfinite(lse), lse, 0.0)
    return (out * weight).sum() + (finite_lse * lse_weight).sum()


def _check_case(rank, world_size, case):
    name, balance, kv_heads, dtype = case
    n = 128
    gen = torch.Generator().manual_seed(CASES.index(case))
    shapes = [(BATCH, HEADS, n, HEAD_DIM)] + [(BATCH, kv_heads, n, HEAD_DIM)] * 2
    whole = [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]
    weight = torch.randn(shapes[0], generator=gen, dtype=dtype)
    lse_weight = torch.randn(shapes[0][:-1], generator=gen, dtype=_lse_dtype(dtype))
    layout = _layout(name, n)
    want, want_lse = cuattn.sparse_attention(*whole, layout, return_lse=True)
    _loss(want, want_lse, weight, lse_weight).backward()

    mine = [shard(x.detach(), rank, world_size, balance).requires_grad_() for x in whole]
    stats = RingStats()
    out, lse = ring_attention(*mine, layout, balance=balance, return_lse=True, stats=stats)
    mine_weights = (shard(w, rank, world_size, balance) for w in (weight, lse_weight))
    _loss(out, lse, *mine_weights).backward()

    out_tol, grad_tol = TOLERANCE[dtype]
    assert rel(out.detach(), shard(want.detach(), rank, world_size, balance)) <= out_tol, case
    want_lse = shard(want_lse, rank, world_size, balance)
    assert torch.equal(torch.isinf(lse), torch.isinf(want_lse)), case
    finite = torch.isfinite(want_lse)
    assert rel(lse[finite].detach(), want_lse[finite].detach()) <= out_tol, case
    for label, got, full in zip("qkv", mine, whole, strict=True):
        expected = shard(full.grad, rank, world_size, balance)
        assert rel(got.grad, expected) <= grad_tol, (case, label)
    plan = ring_plan(layout, rank, world_size, balance)
    kv_bytes = 2 * mine[1].numel() * mine[1].element_size()
    assert stats.bytes_sent >= (world_size - 1) * kv_bytes
    assert stats.steps_computed + stats.steps_skipped == world_size
    assert stats.steps_skipped == plan.skipped


def _check_mismatched_shards(rank, world_size):
    n_local = 32 if rank == 0 else 48
    q = torch.randn(1, HEADS, n_local, HEAD_DIM, dtype=torch.float64)
    layout = cuattn.make_layout("all", n_local * world_size, HEADS, BLOCK)
    with pytest.raises(ValueError, match="every rank's shards must have the same shapes"):
        ring_attention(q, q, q, layout)


def _worker(rank, world_size, init_file):
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size
    )
    try:
        for case in CASES:
            _check_case(rank, world_size, case)
        _check_mismatched_shards(rank, world_size)
        dist.barrier()  # nobody closes its connections while a peer still talks
    finally:
        dist.destroy_process_group()
    # Passed: leave without the interpreter's finalization, where gloo's worker threads may
    # still drop tensors of finished transfers and abort the process ("terminate called
    # without an active exception": 1 run of W=4 in ~20 under a loaded CPU, after the barrier).
    os._exit(0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_ring_attention_equals_single_process_attention(world_size, tmp_path):
    mp.spawn(_worker, args=(world_size, str(tmp_path / "rendezvous")), nprocs=world_size)


def test_zigzag_balances_causal_work_and_local_patterns_skip_pairs():
    layout = cuattn.make_layout("all", 256, HEADS, BLOCK)
    contiguous = [ring_plan(layout, r, 4, "contiguous").active_blocks for r in range(4)]
    zigzag = [ring_plan(layout, r, 4, "zigzag").active_blocks for r in range(4)]
    # 16 block rows per head: rank r's 4 rows see 16r + 10 blocks; zigzag pairs chunk r (2
    # rows: 4r + 3 blocks) with chunk 7 - r (31 - 4r): 34 for every rank.
    assert contiguous == [HEADS * (16 * r + 10) for r in range(4)]
    assert zigzag == [HEADS * 34] * 4
    local = cuattn.make_layout("local", 256, HEADS, BLOCK, local_attn_ctx=20)
    plans = [ring_plan(local, r, 4, "contiguous") for r in range(4)]
    assert [p.skipped for p in plans] == [3, 2, 2, 2]


def test_shard_and_unshard_are_inverse_and_check_their_arguments():
    x = np.arange(2 * 3 * 16 * 2).reshape(2, 3, 16, 2)
    for balance in ("contiguous", "zigzag"):
        shares = [
            shard(x, r, 4 if balance == "contiguous" else 2, balance)
            for r in range(4 if balance == "contiguous" else 2)
        ]
        assert np.array_equal(unshard(shares, balance), x)
        assert np.array_equal(shares[0][0, 0, :, 0] // 2, positions(16, 0, len(shares), balance))
    assert positions(16, 1, 2, "zigzag").tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    t = torch.arange(24.0).reshape(1, 1, 24, 1)
    assert torch.equal(unshard([shard(t, r, 3) for r in range(3)]), t)
    with pytest.raises(ValueError, match="does not cut into 6 equal chunks"):
        shard(x, 0, 3, "zigzag")
    with pytest.raises(ValueError, match="balance must be one of"):
        shard(x, 0, 2, "round_robin")
    with pytest.raises(ValueError, match="rank must be in"):
        shard(x, 2, 2)


def test_ring_attention_errors_before_any_transfer(tmp_path):
    q = torch.randn(1, HEADS, 32, HEAD_DIM)
    layout = cuattn.make_layout("all", 32, HEADS, BLOCK)
    with pytest.raises(ValueError, match="init_process_group"):
        ring_attention(q, q, q, layout)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'one'}", rank=0, world_size=1)
    try:
        out = ring_attention(q, q, q, layout)
        assert torch.equal(out, cuattn.sparse_attention(q, q, q, layout))
        with pytest.raises(ValueError, match="build it with make_layout"):
            ring_attention(q, q, q, cuattn.make_layout("all", 64, HEADS, BLOCK))
        with pytest.raises(ValueError, match="does not cut into 2 equal chunks"):
            q33 = torch.randn(1, HEADS, 33, HEAD_DIM)
            ring_attention(q33, q33, q33, cuattn.make_layout("all", 33, HEADS, BLOCK))
    finally:
        dist.destroy_process_group()


def test_the_torchrun_example_runs_on_two_processes():
    """examples/ring_attention.py, as the README runs it (torchrun, gloo, loopback only)."""
    root = Path(__file__).resolve().parents[2]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += ["--nproc-per-node", "2", str(root / "examples" / "ring_attention.py")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=root)
    # the ranks' own messages come before torchrun's summary: show both ends
    assert done.returncode == 0, done.stderr[:3000] + "\n...\n" + done.stderr[-1500:]
    error = float(re.search(r"max \|ring - single\| = (\S+);", done.stdout).group(1))
    assert error < 1e-5
