"""Which tokens of a sequence each rank holds: contiguous or zigzag shards, and back.

With W ranks a sequence of T tokens is cut into chunks along ``dim``:
    contiguous  W chunks of T/W; rank r holds chunk r
    zigzag      2W chunks of T/(2W); rank r holds chunks r and 2W-1-r (in that order), so under
                a causal pattern every rank has one early and one late chunk: equal work
``positions`` gives a rank's token indices, ``shard`` cuts a rank's share out of the whole
sequence (torch tensors or NumPy/CuPy arrays), ``unshard`` puts every rank's shares back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from cuattn.adapters import dlpack

BALANCES = ("contiguous", "zigzag")


def _chunks(balance: str, world_size: int) -> int:
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {BALANCES}, got {balance!r}")
    return world_size if balance == "contiguous" else 2 * world_size


def _check_rank(rank: object, world_size: object) -> None:
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")


def chunk_ids(rank: int, world_size: int, balance: str) -> tuple[int, ...]:
    """The chunks rank holds, in the order its shard stores them."""
    _check_rank(rank, world_size)
    if _chunks(balance, world_size) == world_size:
        return (rank,)
    return (rank, 2 * world_size - 1 - rank)


def chunk_length(n: int, world_size: int, balance: str) -> int:
    """Tokens per chunk; ValueError when n does not cut evenly."""
    count = _chunks(balance, world_size)
    if n % count:
        raise ValueError(
            f"a sequence of {n} tokens does not cut into {count} equal chunks ({balance} over "
            f"{world_size} ranks needs a multiple of {count}); pad it to a multiple of {count}"
        )
    return n // count


def positions(n: int, rank: int, world_size: int, balance: str = "zigzag") -> np.ndarray:
    """The token indices one rank's shard holds.

    Args:
        n (int): the sequence's tokens, a multiple of the balance's chunks (W or 2W).
        rank (int): the rank, in [0, world_size).
        world_size (int): the ranks W.
        balance (str): ``"contiguous"`` (W chunks; rank r holds chunk r) or ``"zigzag"``
            (default: 2W chunks; rank r holds chunks r and 2W-1-r, equal causal work).

    Returns:
        numpy.ndarray: int64 [n / W], the indices in shard order.

    Raises:
        TypeError: ``rank`` or ``world_size`` not an int.
        ValueError: ``balance`` unknown; ``n`` not cutting into its chunks; ``rank`` outside
            [0, world_size).
    """
    size = chunk_length(n, world_size, balance)
    ids = chunk_ids(rank, world_size, balance)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in ids])


def _axis(x: Any, dim: int) -> int:
    if not -len(x.shape) <= dim < len(x.shape):
        raise ValueError(f"dim={dim} is out of range for an array of shape {tuple(x.shape)}")
    return dim % len(x.shape)


def shard(x: Any, rank: int, world_size: int, balance: str = "zigzag", dim: int = 2) -> Any:
    """Cut one rank's share out of a whole sequence.

    Args:
        x (array): the whole sequence: a torch tensor or a NumPy, CuPy or jax array.
        rank (int): the rank, in [0, world_size).
        world_size (int): the ranks W.
        balance (str): ``"contiguous"`` or ``"zigzag"`` (default), as :func:`positions`.
        dim (int): the sequence axis (default 2: [B, H, T, d]); negative counts from the end.

    Returns:
        The share, a new array of x's kind with T / W along ``dim``: the tokens
        ``positions(T, rank, world_size, balance)``.

    Raises:
        TypeError: ``rank`` or ``world_size`` not an int.
        ValueError: ``dim`` out of range; ``balance`` unknown; the length not cutting into
            the balance's chunks; ``rank`` outside [0, world_size).
    """
    dim = _axis(x, dim)
    size = chunk_length(int(x.shape[dim]), world_size, balance)
    ids = chunk_ids(rank, world_size, balance)
    return dlpack.concatenate([dlpack.narrow(x, dim, c * size, size) for c in ids], dim)


def unshard(shards: Sequence[Any], balance: str = "zigzag", dim: int = 2) -> Any:
    """Put a whole sequence back together from every rank's share (the inverse of
    :func:`shard`).

    Args:
        shards (Sequence[array]): one share per rank, ``shards[r]`` being rank r's, all of one
            shape and kind of array; W = len(shards).
        balance (str): how they were cut, ``"contiguous"`` or ``"zigzag"`` (default).
        dim (int): the sequence axis (default 2); negative counts from the end.

    Returns:
        The whole sequence, a new array of the shares' kind.

    Raises:
        ValueError: no shares; shares of different shapes; ``dim`` out of range; ``balance``
            unknown.
    """
    world_size = len(shards)
    if world_size == 0:
        raise ValueError("shards must hold one share per rank, got none")
    dim = _axis(shards[0], dim)
    shapes = {tuple(int(d) for d in s.shape) for s in shards}
    if len(shapes) != 1:
        raise ValueError(f"every rank's share must have the same shape, got {sorted(shapes)}")
    per_rank = len(chunk_ids(0, world_size, balance))
    size = int(shards[0].shape[dim]) // per_rank
    chunks: dict[int, Any] = {}
    for rank, share in enumerate(shards):
        for slot, c in enumerate(chunk_ids(rank, world_size, balance)):
            chunks[c] = dlpack.narrow(share, dim, slot * size, size)
    return dlpack.concatenate([chunks[c] for c in sorted(chunks)], dim)
