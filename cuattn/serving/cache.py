"""KVCache: paged key/value storage per (sequence, kv head), with an eviction policy.

Keys and values live in a pool of pages, ``k_pages`` and ``v_pages`` [num_pages, page_size,
head_dim], on the array library and device of ``like`` (NumPy by default; CuPy for a CUDA
array; torch and jax arrays are shared through DLPack). Each (sequence, kv head) owns a list of
pages (its page table); a slot of a page holds one token, and ``slot_pos`` [num_pages,
page_size] says which position (-1: empty). Tokens go into the holes eviction left in a head's
pages first, then into new pages; a page whose every slot is evicted returns to the pool and is
reused. The pool doubles when it runs out (a copy), so ``capacity`` only sizes the first pool and
bounds appends without a policy.

The bookkeeping (page tables, slot positions, HeavyHitters scores) is small and lives on the
host; the tokens themselves never leave the device. Quest's per-page key min and max live on
the device beside the pages.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cuattn._util import ceil_div, widened
from cuattn.adapters import dlpack
from cuattn.layout.layout import check_positive_int
from cuattn.serving.policies import Policy

__all__ = ["KVCache"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
EMPTY = -1
DEFAULT_TOKENS = 256  # tokens per (sequence, kv head) the first pool holds without a capacity


def _dtype_name(dtype: Any) -> str:
    return str(getattr(dtype, "name", dtype)).replace("torch.", "")


def _positive(name: str, value: object) -> int:
    check_positive_int(name, value)
    return int(value)


class KVCache:
    """Paged KV cache for ``batch`` sequences of ``kv_heads`` heads of ``head_dim``.

    ``append(k, v, lengths=None)`` adds [batch, kv_heads, t, head_dim] tokens (sequence b takes
    the first ``lengths[b]`` of them), then the ``policy`` evicts. ``len(cache)``: tokens the
    longest sequence was given (``cache.lengths`` per sequence); ``positions()``: the kept
    positions; ``nbytes``: bytes held. ``capacity``: tokens per sequence (kv head) the cache may
    keep; without a policy, an append past it is refused.
    """

    def __init__(
        self,
        batch: int,
        kv_heads: int,
        head_dim: int,
        dtype: Any,
        page_size: int = 16,
        capacity: int | None = None,
        policy: Policy | None = None,
        like: Any = None,
    ) -> None:
        self.batch = _positive("batch", batch)
        self.kv_heads = _positive("kv_heads", kv_heads)
        self.head_dim = _positive("head_dim", head_dim)
        self.page_size = _positive("page_size", page_size)
        self.capacity = None if capacity is None else _positive("capacity", capacity)
        self.dtype = _dtype_name(dtype)
        if self.dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be one of {FLOAT_DTYPES}, got {dtype!r}")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(
                f"policy must be a cuattn.policies policy or None, got {type(policy).__name__}"
            )
        if policy is not None:
            policy.bind(self.kv_heads, self.page_size, self.capacity)
            budgets = policy.budgets()
            if self.capacity is not None and budgets is not None and budgets.max() > capacity:
                raise ValueError(
                    f"policy {policy!r} keeps up to {int(budgets.max())} tokens per kv head, "
                    f"more than capacity={capacity}"
                )
        self.policy = policy
        self.info = (
            dlpack.ArrayInfo("numpy", "cpu") if like is None else dlpack.describe(like, "like")
        )
        self.xp = _array_module(self.info)
        per_head = ceil_div(self.capacity or DEFAULT_TOKENS, self.page_size) + 1
        self._allocate(self.batch * self.kv_heads * per_head)
        self.tables: list[list[list[int]]] = [
            [[] for _ in range(self.kv_heads)] for _ in range(self.batch)
        ]
        self.lengths = np.zeros(self.batch, dtype=np.int64)

    # -- storage ------------------------------------------------------------------------------

    def _allocate(self, pages: int) -> None:
        xp, shape = self.xp, (pages, self.page_size, self.head_dim)
        dtype = _storage_dtype(xp, self.dtype)
        with _on_device(self.info):
            self.k_pages = xp.zeros(shape, dtype=dtype)
            self.v_pages = xp.zeros(shape, dtype=dtype)
            self.key_min = xp.zeros((pages, self.head_dim), dtype=xp.float32)
            self.key_max = xp.zeros((pages, self.head_dim), dtype=xp.float32)
        self.slot_pos = np.full((pages, self.page_size), EMPTY, dtype=np.int64)
        self.slot_score = np.zeros((pages, self.page_size), dtype=np.float64)
        self.free_pages = list(range(pages - 1, -1, -1))
        with _on_device(self.info):
            # the kernels' copy of slot_pos (NumPy: the same array), kept in step by every write
            self._slot_pos_device = self.slot_pos if xp is np else xp.asarray(self.slot_pos)
        self._device_tables: tuple[Any, Any] | None = None

    def _grow(self) -> None:
        old = self.num_pages
        keep = (self.k_pages, self.v_pages, self.key_min, self.key_max)
        pos, score = self.slot_pos, self.slot_score
        self._allocate(2 * old)
        with _on_device(self.info):
            for new, previous in zip(
                (self.k_pages, self.v_pages, self.key_min, self.key_max), keep, strict=True
            ):
                new[:old] = previous
        self.slot_pos[:old], self.slot_score[:old] = pos, score
        if self.xp is not np:
            with _on_device(self.info):
                self._slot_pos_device[:old] = self.xp.asarray(pos)
        self.free_pages = list(range(2 * old - 1, old - 1, -1))

    @property
    def num_pages(self) -> int:
        return int(self.slot_pos.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: the page pool with its key bounds, and the bookkeeping."""
        device = sum(
            int(a.nbytes) for a in (self.k_pages, self.v_pages, self.key_min, self.key_max)
        )
        return device + self.slot_pos.nbytes + self.slot_score.nbytes

    def __len__(self) -> int:
        return int(self.lengths.max())

    def _slots(self, b: int, h: int) -> tuple[np.ndarray, np.ndarray]:
        """(page, offset) of every kept token of (b, h), in page-table order."""
        pages = np.asarray(self.tables[b][h], dtype=np.int64)
        if pages.size == 0:
            return pages, pages
        used = self.slot_pos[pages] != EMPTY
        rows, offsets = np.nonzero(used)
        return pages[rows], offsets

    def kept(self, b: int, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pages, offsets, positions) of the kept tokens of sequence b, kv head h, by position."""
        pages, offsets = self._slots(b, h)
        pos = self.slot_pos[pages, offsets]
        order = np.argsort(pos, kind="stable")
        return pages[order], offsets[order], pos[order]

    def positions(self) -> np.ndarray:
        """int64 [batch, kv_heads, n_kept]: the kept positions, sorted; -1 pads heads that keep
        fewer than the most."""
        kept = [[self.kept(b, h)[2] for h in range(self.kv_heads)] for b in range(self.batch)]
        width = max((len(p) for row in kept for p in row), default=0)
        out = np.full((self.batch, self.kv_heads, width), EMPTY, dtype=np.int64)
        for b, row in enumerate(kept):
            for h, pos in enumerate(row):
                out[b, h, : len(pos)] = pos
        return out

    # -- append -------------------------------------------------------------------------------

    def _check_tokens(self, k: Any, v: Any, lengths: Any) -> tuple[Any, Any, np.ndarray]:
        for name, x in (("k", k), ("v", v)):
            if not hasattr(x, "shape") or not hasattr(x, "dtype"):
                raise TypeError(f"{name} must be an array, got {type(x).__name__}")
            shape = tuple(int(d) for d in x.shape)
            if (
                len(shape) != 4
                or shape[0] != self.batch
                or shape[1] != self.kv_heads
                or (shape[3] != self.head_dim)
            ):
                raise ValueError(
                    f"{name} must be [batch={self.batch}, kv_heads={self.kv_heads}, t, "
                    f"head_dim={self.head_dim}], got {shape}"
                )
            if _dtype_name(x.dtype) != self.dtype:
                raise TypeError(
                    f"{name} has dtype {_dtype_name(x.dtype)}, the cache holds {self.dtype} "
                    "(cuattn never casts silently)"
                )
            self._check_device(name, x)
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        t = int(k.shape[2])
        if lengths is None:
            return k, v, np.full(self.batch, t, dtype=np.int64)
        given = np.asarray(lengths)
        if given.shape != (self.batch,) or given.dtype.kind not in "iu":
            raise ValueError(f"lengths must be {self.batch} ints, got {lengths!r}")
        if (given < 0).any() or (given > t).any():
            raise ValueError(f"lengths must lie in [0, t={t}], got {given.tolist()}")
        return k, v, given.astype(np.int64)

    def _check_device(self, name: str, x: Any) -> None:
        info = dlpack.describe(x, name)
        if (info.device, info.device_id) != (self.info.device, self.info.device_id):
            raise ValueError(
                f"{name} is a {info} but the cache lives on {self.info.device}"
                f"{'' if self.info.device == 'cpu' else ':' + str(self.info.device_id)}; "
                "cuattn never moves data between devices"
            )

    def append(self, k: Any, v: Any, lengths: Any = None) -> None:
        """Add tokens [batch, kv_heads, t, head_dim] (sequence b: the first lengths[b]), then
        evict by the policy. Every check runs before anything is written."""
        k, v, lengths = self._check_tokens(k, v, lengths)
        new_lengths = self.lengths + lengths
        decisions = []
        for b in range(self.batch):
            incoming = np.arange(self.lengths[b], new_lengths[b])
            old = [self._slots(b, h) for h in range(self.kv_heads)]
            old_pos = [self.slot_pos[p, o] for p, o in old]
            if self.policy is None:
                keep_old = [np.ones(len(p), dtype=bool) for p in old_pos]
                keep_new = [np.ones(len(incoming), dtype=bool)] * self.kv_heads
            else:
                positions = [np.concatenate([p, incoming]) for p in old_pos]
                scores = [
                    np.concatenate([self.slot_score[p, o], np.zeros(len(incoming))]) for p, o in old
                ]
                masks = self.policy.keep(int(new_lengths[b]), positions, scores)
                keep_old = [m[: len(p)] for m, p in zip(masks, old_pos, strict=True)]
                keep_new = [m[len(p) :] for m, p in zip(masks, old_pos, strict=True)]
            for h in range(self.kv_heads):
                kept = int(keep_old[h].sum() + keep_new[h].sum())
                if self.capacity is not None and kept > self.capacity:
                    raise ValueError(
                        f"k: appending {int(lengths[b])} tokens to sequence {b} would keep "
                        f"{kept} tokens in kv head {h}, past capacity={self.capacity}; give the "
                        "cache a policy or a larger capacity"
                    )
            decisions.append((incoming, old, keep_old, keep_new))
        kb = dlpack.to_backend(k, dlpack.describe(k, "k"), "k")
        vb = dlpack.to_backend(v, dlpack.describe(v, "v"), "v")
        writes = _Writes()
        with _on_device(self.info):
            for b, (incoming, old, keep_old, keep_new) in enumerate(decisions):
                for h in range(self.kv_heads):
                    self._evict(b, h, *old[h], keep_old[h], writes)
                    self._write(b, h, incoming, keep_new[h], writes)
            self._flush(writes, kb, vb)
        self.lengths = new_lengths

    def _evict(
        self,
        b: int,
        h: int,
        pages: np.ndarray,
        offsets: np.ndarray,
        keep: np.ndarray,
        writes: _Writes,
    ) -> None:
        gone = ~keep
        if not gone.any():
            return
        self.slot_pos[pages[gone], offsets[gone]] = EMPTY
        writes.touched.append((pages[gone], offsets[gone]))
        self.slot_score[pages[gone], offsets[gone]] = 0.0
        table = self.tables[b][h]
        for page in np.unique(pages[gone]):
            if (self.slot_pos[page] == EMPTY).all():
                table.remove(int(page))
                self.free_pages.append(int(page))
                self._device_tables = None

    def _write(self, b: int, h: int, incoming: np.ndarray, keep: np.ndarray, writes: _Writes):
        """Place the kept incoming tokens in (b, h)'s holes, then in new pages (the bookkeeping
        now, on the host; the tokens themselves in ``_flush``, with every other head's)."""
        source = np.flatnonzero(keep)
        if source.size == 0:
            return
        table = self.tables[b][h]
        holes = [(p, o) for p in table for o in np.flatnonzero(self.slot_pos[p] == EMPTY)]
        while len(holes) < source.size:
            if not self.free_pages:
                self._grow()
            page = self.free_pages.pop()
            table.append(page)
            self._device_tables = None
            holes += [(page, o) for o in range(self.page_size)]
        pages = np.array([p for p, _ in holes[: source.size]], dtype=np.int64)
        offsets = np.array([o for _, o in holes[: source.size]], dtype=np.int64)
        self.slot_pos[pages, offsets] = incoming[source]
        self.slot_score[pages, offsets] = 0.0
        writes.touched.append((pages, offsets))
        writes.tokens.append(
            (pages, offsets, np.full(source.size, b), np.full(source.size, h), source)
        )

    def _flush(self, writes: _Writes, kb: Any, vb: Any) -> None:
        """Every token an append placed, in one scatter of K and one of V; the device copy of
        slot_pos updated in one scatter from the host's final values (a slot evicted and
        refilled in the same append is written once, with what it holds now); Quest's bounds of
        the written pages in one masked reduction. A handful of launches per append, whatever
        the batch and head count."""
        xp = self.xp
        if writes.touched and xp is not np:
            flat = np.unique(np.concatenate([p * self.page_size + o for p, o in writes.touched]))
            pages, offsets = flat // self.page_size, flat % self.page_size
            values = xp.asarray(self.slot_pos[pages, offsets])
            self._slot_pos_device[xp.asarray(pages), xp.asarray(offsets)] = values
        if not writes.tokens:
            return
        pages, offsets, bs, hs, ts = (
            np.concatenate(part) for part in zip(*writes.tokens, strict=True)
        )
        where = (xp.asarray(pages), xp.asarray(offsets))
        source = (xp.asarray(bs), xp.asarray(hs), xp.asarray(ts))
        self.k_pages[where] = kb[source]
        self.v_pages[where] = vb[source]
        if self.policy is not None and self.policy.selects_pages:
            self._bound_pages(np.unique(pages))

    # -- what the decode kernels read ---------------------------------------------------------

    def device_slot_pos(self) -> Any:
        """int64 [num_pages, page_size] slot positions where the kernels read them."""
        return self._slot_pos_device

    def device_tables(self) -> tuple[Any, Any]:
        """(page_table int32 [batch, kv_heads, max_pages] in table order, -1 padded;
        page_count int32 [batch, kv_heads]) where the kernels read them; rebuilt (one small
        copy to the device) only after a page table changed."""
        if self._device_tables is None:
            counts = np.array([[len(t) for t in row] for row in self.tables], dtype=np.int32)
            table = np.full((self.batch, self.kv_heads, max(int(counts.max()), 1)), EMPTY, np.int32)
            for b, row in enumerate(self.tables):
                for h, pages in enumerate(row):
                    table[b, h, : len(pages)] = pages
            with _on_device(self.info):
                self._device_tables = (self.xp.asarray(table), self.xp.asarray(counts))
        return self._device_tables

    def _bound_pages(self, pages: np.ndarray) -> None:
        """Quest's element-wise key min and max over each page's kept tokens (a written page
        keeps at least one)."""
        xp = self.xp
        index = xp.asarray(pages)
        used = xp.asarray(self.slot_pos[pages] != EMPTY)[..., None]  # [P, page_size, 1]
        keys = widened(self.k_pages[index], xp)
        self.key_min[index] = xp.where(used, keys, xp.inf).min(axis=1)
        self.key_max[index] = xp.where(used, keys, -xp.inf).max(axis=1)


class _Writes:
    """What one append changes on the device, gathered over every (sequence, kv head): the
    slots whose position changed, and the tokens placed (pages, offsets, and their source
    sequence, head and step)."""

    def __init__(self) -> None:
        self.touched: list[tuple[np.ndarray, np.ndarray]] = []
        self.tokens: list[tuple[np.ndarray, ...]] = []


def _array_module(info: dlpack.ArrayInfo) -> Any:
    if info.device == "cuda":
        import cupy

        return cupy
    if info.device != "cpu":
        raise ValueError(f"like must be a CPU or CUDA array, got {info}")
    return np


def _storage_dtype(xp: Any, name: str) -> Any:
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as err:
            raise TypeError(
                "dtype bfloat16 needs ml_dtypes (pip install ml_dtypes; cuattn[cuda12] has it)"
            ) from err
        return ml_dtypes.bfloat16
    return getattr(xp, name)


def _on_device(info: dlpack.ArrayInfo) -> Any:
    import contextlib

    if info.device != "cuda":
        return contextlib.nullcontext()
    import cupy

    return cupy.cuda.Device(info.device_id)
