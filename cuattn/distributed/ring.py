"""Ring attention over torch.distributed: each rank holds a shard of the sequence's queries,
keys and values; keys and values travel around the ring, and each rank attends its queries to
every visiting shard with the block-sparse kernels, merging the partial results by LSE.

Step s of W: rank r holds the keys/values of rank (r - s) mod W and computes attention of its
queries against them on the *restricted* layout (``layout.derived.restricted``: exactly the
elements the whole layout allows between those tokens). A pair with no active block is skipped
(no launch); its transfer still flows, since later ranks need the keys. While a step computes,
the next shard is already in flight (batched isend/irecv). Backward runs the same ring: dQ
stays home, and each visiting shard's dK/dV accumulator (float32; float64 for float64) travels
with it and arrives back at its owner after W steps. Per pair the backward kernels use the
merged out and lse, so every partial gradient is exact.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from cuattn import api
from cuattn.adapters import torch_ops
from cuattn.backends.call import AttentionCall
from cuattn.distributed.sharding import chunk_length, positions
from cuattn.layout.derived import restricted
from cuattn.layout.layout import Layout

__all__ = ["RingPlan", "RingStats", "ring_attention", "ring_plan"]

GRAD_TAG = 1  # the dK/dV accumulators' messages; keys and values use tag 0


@dataclass(frozen=True)
class RingPlan:
    """What one rank computes at each ring step (:func:`ring_plan` builds it).

    Args:
        rank (int): the rank, in [0, world_size).
        world_size (int): the ranks in the ring.
        balance (str): how the sequence is sharded, ``"contiguous"`` or ``"zigzag"``.
        steps (tuple[Layout | None, ...]): ``steps[s]`` is the layout of the rank's queries
            against the keys of rank (rank - s) mod world_size, None where that pair has no
            active block (no launch).
    """

    rank: int
    world_size: int
    balance: str
    steps: tuple[Layout | None, ...]

    @property
    def skipped(self) -> int:
        """The steps with nothing to compute."""
        return sum(sub is None for sub in self.steps)

    @property
    def active_blocks(self) -> int:
        """The active blocks over every step: the rank's share of the work."""
        return sum(int(sub.nnz.sum()) for sub in self.steps if sub is not None)


@dataclass
class RingStats:
    """Counters one :func:`ring_attention` call adds to (pass the same object to several calls).

    Args:
        bytes_sent (int): bytes this rank sent (keys and values, and in the backward the
            gradient accumulators). Default 0.
        steps_computed (int): ring steps that launched kernels. Default 0.
        steps_skipped (int): ring steps with no active block. Default 0.
        compute_seconds (float): seconds spent in the kernels (synchronised on a GPU).
            Default 0.0.
        per_step_seconds (list[float]): each computed step's seconds. Default empty.
    """

    bytes_sent: int = 0
    steps_computed: int = 0
    steps_skipped: int = 0
    compute_seconds: float = 0.0
    per_step_seconds: list[float] = field(default_factory=list)


_PLANS: weakref.WeakKeyDictionary[Layout, dict[tuple[int, int, str], RingPlan]] = (
    weakref.WeakKeyDictionary()
)


def ring_plan(layout: Layout, rank: int, world_size: int, balance: str = "zigzag") -> RingPlan:
    """The per-step restricted layouts of one rank (built once per layout, rank and balance).

    Step s pairs the rank's queries with the keys of rank (rank - s) mod world_size, on exactly
    the elements the whole layout allows between those tokens.

    Args:
        layout (Layout): the whole sequence's square layout.
        rank (int): the rank, in [0, world_size).
        world_size (int): the ranks in the ring.
        balance (str): ``"contiguous"`` or ``"zigzag"`` (default), as :func:`shard`.

    Returns:
        RingPlan: the rank's steps, cached with the layout.

    Raises:
        TypeError: ``rank`` or ``world_size`` not an int.
        ValueError: ``balance`` unknown; the layout's length not cutting into the balance's
            chunks; ``rank`` outside [0, world_size).
    """
    key = (rank, world_size, balance)
    per_layout = _PLANS.setdefault(layout, {})
    if key not in per_layout:
        n = layout.n_ctx
        mine = positions(n, rank, world_size, balance)
        steps = []
        for step in range(world_size):
            theirs = positions(n, (rank - step) % world_size, world_size, balance)
            sub = restricted(layout, mine, theirs)
            steps.append(sub if int(sub.nnz.sum()) else None)
        per_layout[key] = RingPlan(rank, world_size, balance, tuple(steps))
    return per_layout[key]


class _Ring:
    """This rank's neighbours in ``group`` and one batched send-to-next / receive-from-prev."""

    def __init__(self, group: Any, stats: RingStats) -> None:
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.world_size)
        self.prev = dist.get_global_rank(group, (self.rank - 1) % self.world_size)
        self.stats = stats

    def start(self, tensor: torch.Tensor, tag: int = 0) -> _Transfer:
        """Send ``tensor`` to the next rank and receive the previous rank's into a new one;
        keys/values and gradient accumulators travel under different tags."""
        incoming = torch.empty_like(tensor)
        ops = [
            dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
            dist.P2POp(dist.irecv, incoming, self.prev, self.group, tag),
        ]
        self.stats.bytes_sent += tensor.numel() * tensor.element_size()
        return _Transfer(dist.batch_isend_irecv(ops), incoming)


@dataclass
class _Transfer:
    works: list[Any]
    incoming: torch.Tensor

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        return self.incoming


def _timed(stats: RingStats, fn: Any, *args: Any) -> Any:
    if args[0].is_cuda:
        torch.cuda.synchronize(args[0].device)
    start = time.perf_counter()
    result = fn(*args)
    if args[0].is_cuda:
        torch.cuda.synchronize(args[0].device)
    seconds = time.perf_counter() - start
    stats.compute_seconds += seconds
    stats.per_step_seconds.append(seconds)
    return result


def _op_layout(sub: Layout, q: torch.Tensor, scale: float, backend: str) -> tuple:
    """A step's call as the torch ops take it (torch_ops.op_arguments): its layout's
    arguments, scale and backend, recompute, index, and no score operand."""
    return torch_ops.op_arguments(AttentionCall(sub, scale, backend=backend or None), q.device)


def _ring_forward(q, k, v, plan, ring, scale, backend, stats):
    kv = torch.stack([k, v])  # one message per step: keys and values together
    out = lse = None
    for step, sub in enumerate(plan.steps):
        transfer = ring.start(kv) if step + 1 < plan.world_size else None
        if sub is None:
            stats.steps_skipped += 1
        else:
            stats.steps_computed += 1
            *layout_args, _, index, operands, given = _op_layout(sub, q, scale, backend)
            fwd = torch_ops.attention_fwd
            args = (*layout_args, False, index, operands, given)
            o, l_ = _timed(stats, fwd, q, kv[0], kv[1], *args)
            if out is None:
                out, lse = o, l_
            else:
                out, lse = api.merge_attention_states(out, lse, o, l_, backend=backend or None)
        if transfer is not None:
            kv = transfer.wait()
    if out is None:  # no key anywhere: rows with nothing to attend to give 0 and lse -inf
        out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_accumulator(q), device=q.device)
    return out, lse


def _accumulator(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _ring_backward(q, k, v, out, lse, dout, dlse, plan, ring, scale, backend, stats):
    dq = torch.zeros(q.shape, dtype=_accumulator(q), device=q.device)
    kv = torch.stack([k, v])
    dkv = torch.zeros(kv.shape, dtype=_accumulator(q), device=q.device)
    dout, dlse = dout.contiguous(), dlse.contiguous()
    for step, sub in enumerate(plan.steps):
        transfer = ring.start(kv) if step + 1 < plan.world_size else None
        if sub is not None:
            *layout_args, _, index, operands, given = _op_layout(sub, q, scale, backend)
            bwd = torch_ops.attention_bwd
            args = (q, kv[0], kv[1], out, lse, dout, dlse, *layout_args, index, operands, given)
            dq_s, dk_s, dv_s, *_ = _timed(stats, bwd, *args)  # no score operands here
            dq += dq_s
            dkv[0] += dk_s
            dkv[1] += dv_s
        if plan.world_size > 1:  # the accumulator follows its keys; after W steps it is home
            dkv = ring.start(dkv, GRAD_TAG).wait()
        if transfer is not None:
            kv = transfer.wait()
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan, ring, scale, backend, stats):
        out, lse = _ring_forward(q, k, v, plan, ring, scale, backend, stats)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (plan, ring, scale, backend, stats)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        plan, ring, scale, backend, stats = ctx.args
        # Each pair's P is the whole row's (exp(S - merged lse)), so delta - dlse is exact per
        # pair as it is for the whole row.
        grads = _ring_backward(q, k, v, out, lse, dout, dlse, plan, ring, scale, backend, stats)
        return (*grads, None, None, None, None, None)


def _check_group(group: Any) -> Any:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            "group: no torch.distributed process group is initialised; launch the ranks with "
            "torchrun (or set MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE) and call "
            "torch.distributed.init_process_group('nccl' on GPUs, 'gloo' on CPUs) first"
        )
    return dist.group.WORLD if group is None else group


def _check_same_shards(q: torch.Tensor, k: torch.Tensor, ring: _Ring) -> None:
    """One small all-gather of every rank's shard shapes before any transfer."""
    mine = torch.tensor([*q.shape, k.shape[1], k.shape[2]], dtype=torch.int64, device=q.device)
    every = [torch.empty_like(mine) for _ in range(ring.world_size)]
    dist.all_gather(every, mine, group=ring.group)
    shapes = [tuple(int(d) for d in s.tolist()) for s in every]
    if len(set(shapes)) != 1:
        described = ", ".join(
            f"rank {r}: q {list(s[:4])}, k heads {s[4]} time {s[5]}" for r, s in enumerate(shapes)
        )
        raise ValueError(f"q, k, v: every rank's shards must have the same shapes, got {described}")


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: Layout,
    group: Any = None,
    balance: str = "zigzag",
    scale: float | None = None,
    return_lse: bool = False,
    *,
    backend: str | None = None,
    stats: RingStats | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention of a sequence sharded over the ranks of ``group``.

    Keys and values travel around the ring; each rank attends its queries to every visiting
    shard on the restricted layout of that pair (skipping pairs with no active block) and
    merges the partial results by LSE. The result equals ``shard(sparse_attention(whole q, k,
    v, layout))``, and gradients of out and lse flow to q, k and v through torch.autograd.
    Every rank calls it with the same layout and balance. The ring's schedule, its backward
    and how it is tested: docs/context-parallel.md.

    Args:
        q (torch.Tensor): this rank's shard of the queries, [B, H, T/W, d] for a sequence of T
            tokens over W ranks (``shard(x, rank, W, balance)``).
        k (torch.Tensor): this rank's shard of the keys, [B, H_kv, T/W, d], H_kv dividing H;
            q's dtype.
        v (torch.Tensor): the values' shard, shaped and typed like k.
        layout (Layout): the whole sequence's square layout, n_ctx = T, for H heads.
        group (ProcessGroup, optional): the torch.distributed group; None (default) is the
            default group.
        balance (str): how the sequence was sharded, ``"contiguous"`` or ``"zigzag"``
            (default).
        scale (float, optional): the score scale; None (default) is ``1 / sqrt(d)``.
        return_lse (bool): also return the rows' log-sum-exp (default False).
        backend (str, optional): the backend each step runs on, as in
            :func:`cuattn.sparse_attention`; None (default): from the tensors' device. Keyword
            only.
        stats (RingStats, optional): counters this call adds to (bytes sent, steps computed
            and skipped, compute time). Keyword only.

    Returns:
        This rank's shard of the output, like q; with ``return_lse=True`` the pair ``(out,
        lse)``, lse [B, H, T/W] (float32; float64 for float64), -inf for a row that attends
        nothing.

    Raises:
        TypeError: q, k or v not an array, of a non-floating dtype or of different dtypes;
            ``layout`` not a Layout; ``scale`` not a real number.
        ValueError: no initialised process group; q, k, v not 4-D or of shapes that do not fit
            (k's batch or head_dim, H_kv not dividing H, v unlike k, an empty dimension, k with
            another length than q); a layout not square, for other heads, or for another
            length than W shards of q; a length not cutting into the balance's chunks or an
            unknown balance; shards of different shapes on different ranks; ``scale`` not
            finite. All before any transfer.
    """
    group = _check_group(group)
    api._check_qkv(q, k, v, 4, "[batch, heads, time / world_size, head_dim]")
    if not isinstance(layout, Layout):
        raise TypeError(f"layout must be a cuattn.Layout, got {type(layout).__name__}")
    stats = RingStats() if stats is None else stats
    ring = _Ring(group, stats)
    world_size, n_local = ring.world_size, int(q.shape[2])
    if k.shape[2] != n_local:
        raise ValueError(f"k must hold as many tokens as q ({n_local}) per rank, got {k.shape[2]}")
    if layout.n_q != layout.n_ctx or layout.heads != q.shape[1]:
        raise ValueError(
            f"layout must be square with heads={q.shape[1]}, got heads={layout.heads}, "
            f"n_q={layout.n_q}, n_ctx={layout.n_ctx}"
        )
    if layout.n_ctx != n_local * world_size:
        raise ValueError(
            f"layout is for {layout.n_ctx} tokens but {world_size} ranks of {n_local} hold "
            f"{n_local * world_size}; build it with make_layout(..., n_ctx={n_local * world_size})"
        )
    chunk_length(layout.n_ctx, world_size, balance)
    _check_same_shards(q, k, ring)
    plan = ring_plan(layout, ring.rank, world_size, balance)
    scale = api._resolve_scale(scale, int(q.shape[3]))
    args = (plan, ring, scale, backend or "", stats)
    out, lse = _RingAttention.apply(q, k, v, *args)
    return (out, lse) if return_lse else out
