"""KVCache: paged key/value storage per (sequence, kv head), with an eviction policy.

Everything the cache holds lives on the array library and device of ``like`` (NumPy by
default; CuPy for a CUDA array; torch and jax arrays are shared through DLPack):

    k_pages, v_pages  [1 + num_pages, page_size, head_dim]  the tokens
    slot_pos          int64 [1 + num_pages, page_size]      position in each slot, -1: empty
    slot_score        float64, same shape (HeavyHitters)     accumulated attention probability
    key_min, key_max  [1 + num_pages, head_dim] (Quest) element-wise bounds per page: float32
                      for float32 / float64 pages; for 16-bit and fp8 pages uint16 bfloat16 bits
                      rounded outward (min down, max up), half the bytes; ``page_bounds``
                      widens either to float32
    page_table        int32 [batch, kv_heads, width]         each pair's pages in order, -1 pad
    page_count        int32 [batch, kv_heads]                pages in each pair's table
    free_stack        int32 [1 + num_pages], free_top int64 [1]: free pages in [0, free_top)

Page 0 is the spare page: it is never in a table, and every masked write of the whole-array
updates below lands in it (its contents mean nothing), so no update needs to know on the host
how many entries it writes. An ``append`` is a fixed sequence of whole-array operations over
every (sequence, kv head) pair at once: gather the pairs' slots, the policy's keep mask, evict,
compact the tables and push emptied pages, place the kept tokens in the holes eviction left
(table order, then offset) and then in pages popped from the stack, one scatter of K, V and
positions (a cache that never evicts looks only at each pair's last page, the only one with
room, so its append costs what the incoming tokens do). A policy that reads queries (SnapKV)
gets the append's queries and the candidates' keys to vote with, when ``append`` is given them.

Nothing is read back: the pool and table width are sized on the host from bounds. A pair never
holds more than ceil(most / page_size) pages, ``most`` the tokens it may keep (min(length,
budget) for a policy that always evicts), because tokens fill holes before new pages are
taken. An eviction that can shrink a pair and leave holes anywhere (a budget the kv heads
share, a vote) is followed by a close-up that moves the pair's tokens out of its
least-filled pages into the others' holes, so no pair holds a page's worth of holes; then a
sequence's pairs hold at most (kept + kv_heads * (page_size - 1)) // page_size pages, kept the
tokens the sequence keeps, which the host knows exactly. The pool is the pages a full budget
needs by these bounds, so a page is always there to pop, and ``nbytes`` stays within 1.25x the
kept tokens' keys and values plus a page per (sequence, kv head) (with the bookkeeping of 8
bytes per slot, 16 for HeavyHitters, small beside a token's key and value). Only
``positions()``, ``kept()`` and ``page_tables()`` copy to the host, when asked.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cuattn._util import BFLOAT16_SHIFT, ceil_div, dtype_name, host_array, stable_kind, widened
from cuattn.adapters import dlpack
from cuattn.backends import device_module
from cuattn.layout.layout import check_positive_int
from cuattn.serving import fp8
from cuattn.serving.policies import EMPTY, Policy

__all__ = ["KVCache"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
CACHE_DTYPES = FLOAT_DTYPES + fp8.FP8_DTYPES
# what an fp8 cache is given (k, v at append) and asked with (q at decode): the model's dtype
FP8_INPUT_DTYPES = ("float16", "bfloat16")
# Cache dtypes whose Quest bounds stay float32 (their users ask for exact keys); the others keep
# them as bfloat16 bits rounded outward (bfloat16_outward)
FLOAT32_BOUND_DTYPES = ("float32", "float64")
SPARE = 0  # the spare page (see module doc); slot 0 of it is the spare slot
DEFAULT_TOKENS = 256  # tokens per (sequence, kv head) the first pool holds without a capacity
GROWTH = 16  # a budgeted pool that must grow takes 1/GROWTH of its kept tokens as slack


def _positive(name: str, value: object) -> int:
    check_positive_int(name, value)
    return int(value)


class KVCache:
    """Paged KV cache for ``batch`` sequences of ``kv_heads`` heads of ``head_dim``.

    ``append`` adds each sequence's new keys and values, then the ``policy`` evicts (SnapKV: by
    the votes of the queries given with them); :func:`cuattn.decode_attention` attends to what
    the cache keeps. Keys and values live in a pool of pages, each (sequence, kv head) with a
    page table of its own, on the array library and device of ``like``; a page whose every token
    is evicted goes back to the pool. ``len(cache)`` counts the tokens the longest sequence was
    given (``cache.lengths`` per sequence), every one evicted or not. How the pool is sized and
    why a decode step reads nothing back: docs/serving.md, section "The cache, the decode
    kernels, the policies"; fp8 pages: its section "FP8 pages".

    Args:
        batch (int): sequences, positive.
        kv_heads (int): key/value heads of each sequence, positive.
        head_dim (int): elements of a key or value, positive.
        dtype (str | dtype): what the pages hold: ``"float16"``, ``"bfloat16"``, ``"float32"``,
            ``"float64"``, or ``"float8_e4m3fn"`` / ``"float8_e5m2"`` (one-byte codes with a
            power-of-two scale per page; such a cache is given k, v and asked with q in float16
            or bfloat16). A string, a NumPy dtype or scalar type, or a torch dtype.
        page_size (int): tokens per page, positive (default 16).
        capacity (int, optional): the most tokens a (sequence, kv head) may keep; an append
            after which one might keep more (no policy, or SnapKV's decoding) is refused. None
            (default): no limit, the pool grows as needed.
        policy (Policy, optional): which tokens the cache keeps (:mod:`cuattn.policies`:
            ``SlidingWindow``, ``StreamingLLM``, ``HeavyHitters``, ``SnapKV``, ``Quest``),
            bound to this cache's kv heads and page size when it is built. None (default): every
            token.
        like (array, optional): an array whose library and device the cache's arrays take:
            None (default) is NumPy on the CPU; a CUDA array puts them on its GPU through CuPy;
            torch and jax arrays are read through DLPack.

    Raises:
        TypeError: ``batch``, ``kv_heads``, ``head_dim``, ``page_size`` or ``capacity`` not an
            int; ``dtype`` not one of those above (or bfloat16 without ml_dtypes installed);
            ``policy`` not a :mod:`cuattn.policies` policy, or a per-head budget entry of it
            not an int; ``like`` not an array.
        ValueError: a size not positive; ``like`` on a device other than the CPU or a CUDA
            GPU; a policy that does not fit the cache (a per-head budget with other than
            ``kv_heads`` entries, a budget under HeavyHitters' ``recent``, a ``head_adaptive``
            total that cannot keep every head's newest tokens, Quest's ``page_size`` unlike
            the cache's) or that keeps more tokens per kv head than ``capacity``.

    Attributes:
        batch, kv_heads, head_dim, page_size, capacity: as given.
        dtype (str): the pages' dtype name. policy: as given.
        lengths (numpy.ndarray): int64 [batch], the tokens each sequence was given (host).
        k_pages, v_pages: [1 + num_pages, page_size, head_dim], the pool on the cache's device
            (uint8 codes for fp8, with float32 ``k_scale``, ``v_scale`` [1 + num_pages]); the
            other arrays it keeps: the module docstring of cuattn/serving/cache.py.

    Example:
        >>> import numpy as np, cuattn
        >>> cache = cuattn.KVCache(batch=2, kv_heads=2, head_dim=64, dtype="float32",
        ...                        policy=cuattn.policies.SlidingWindow(32))
        >>> k = np.random.randn(2, 2, 100, 64).astype(np.float32)
        >>> cache.append(k, k, lengths=[100, 40])
        >>> len(cache), cache.positions().shape
        (100, (2, 2, 32))
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
        self.dtype = dtype_name(dtype)
        if self.dtype not in CACHE_DTYPES:
            raise TypeError(
                f"dtype must be one of {CACHE_DTYPES} (a string, a NumPy dtype or scalar type "
                f"such as np.float16, or a torch dtype), got {dtype!r}"
            )
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(
                f"policy must be a cuattn.policies policy or None, got {type(policy).__name__}"
            )
        self._budgets = self._shared = None
        if policy is not None:
            policy.bind(self.kv_heads, self.page_size, self.capacity)
            self._budgets = policy.budgets()
            self._shared = policy.shared_budget()
            if self.capacity is not None and self._budgets is not None:
                if self._budgets.max() > capacity:
                    raise ValueError(
                        f"policy {policy!r} keeps up to {int(self._budgets.max())} tokens per kv "
                        f"head, more than capacity={capacity}"
                    )
        self.policy = policy
        self.info = (
            dlpack.ArrayInfo("numpy", "cpu") if like is None else dlpack.describe(like, "like")
        )
        self.xp = device_module(self.info.device, "like")
        self.lengths = np.zeros(self.batch, dtype=np.int64)
        # the most tokens each pair may keep, and the tokens each sequence keeps over its kv
        # heads (host): what the pool and tables are sized by
        self._most = np.zeros((self.batch, self.kv_heads), dtype=np.int64)
        self._kept = np.zeros(self.batch, dtype=np.int64)
        xp = self.xp
        with dlpack.on_device(self.info):
            self._allocate(self._first_pool_pages())
            self.page_table = xp.full((self.batch, self.kv_heads, 1), EMPTY, dtype=xp.int32)
            self.page_count = xp.zeros((self.batch, self.kv_heads), dtype=xp.int32)
            self._lengths_device = xp.zeros(self.batch, dtype=xp.int64)
            self._budgets_device = None if self._budgets is None else xp.asarray(self._budgets)

    # -- storage ------------------------------------------------------------------------------

    @property
    def _scores_tokens(self) -> bool:
        return self.policy is not None and self.policy.scores_tokens

    @property
    def _bounds_pages(self) -> bool:
        return self.policy is not None and self.policy.selects_pages

    def _first_pool_pages(self) -> int:
        """Pages of the first pool. A budgeted cache starts at the pages its budgets need
        (``_pages_needed`` of a full budget; a budget above ``capacity`` is refused when the
        cache is built) and never grows (SnapKV's grows as decoding adds the tokens it keeps):
        its ``nbytes`` follows the budget. Without a budget, room for ``capacity`` (or
        DEFAULT_TOKENS) tokens and a page of slack per pair; it grows on demand."""
        if self._budgets is not None:
            most = np.broadcast_to(self._budgets, (self.batch, self.kv_heads))
            kept = most.sum(axis=1) if self._shared is None else self._shared
            return self._pages_needed(most, np.broadcast_to(kept, (self.batch,)))
        per_pair = ceil_div(self.capacity or DEFAULT_TOKENS, self.page_size) + 1
        return self.batch * self.kv_heads * per_pair

    def _pages_needed(self, most: np.ndarray, kept: np.ndarray) -> int:
        """Pages the pairs may hold at once when each keeps at most ``most`` [batch, kv_heads]
        tokens and each sequence ``kept`` [batch] over its kv heads: ceil(most / page_size) per
        pair (module doc), and at most (kept + kv_heads * (page_size - 1)) // page_size per
        sequence, as no pair holds a page's worth of holes (``_close_up``). The second is the
        bound for a head-adaptive budget, whose heads share the sequence's total."""
        ps = self.page_size
        per_pair = ceil_div(most, ps).sum(axis=1)
        per_sequence = (kept + self.kv_heads * (ps - 1)) // ps
        return int(np.minimum(per_pair, per_sequence).sum())

    def _allocate(self, pages: int) -> None:
        """A pool of ``pages`` free pages (plus the spare), every slot empty."""
        xp, rows = self.xp, 1 + pages
        dtype = _storage_dtype(xp, self.dtype)
        self.k_pages = xp.zeros((rows, self.page_size, self.head_dim), dtype=dtype)
        self.v_pages = xp.zeros((rows, self.page_size, self.head_dim), dtype=dtype)
        scales = (rows,) if self.quantized else None
        self.k_scale = None if scales is None else xp.ones(scales, dtype=xp.float32)
        self.v_scale = None if scales is None else xp.ones(scales, dtype=xp.float32)
        self.slot_pos = xp.full((rows, self.page_size), EMPTY, dtype=xp.int64)
        self.slot_score = (
            xp.zeros((rows, self.page_size), dtype=xp.float64) if self._scores_tokens else None
        )
        bounds = (rows, self.head_dim) if self._bounds_pages else (0, self.head_dim)
        bound_dtype = xp.float32 if self.dtype in FLOAT32_BOUND_DTYPES else xp.uint16
        self.key_min = xp.zeros(bounds, dtype=bound_dtype)  # 0 bits: +0.0 either way
        self.key_max = xp.zeros(bounds, dtype=bound_dtype)
        # popped from the top, so page 1 comes first; cell `pages` is where masked pushes land
        self.free_stack = xp.zeros(rows, dtype=xp.int32)
        self.free_stack[:pages] = xp.arange(pages, 0, -1, dtype=xp.int32)
        self.free_top = xp.full(1, pages, dtype=xp.int64)

    def _grow(self, pages: int) -> None:
        """A pool of ``pages`` pages holding what the smaller one held; the new pages pushed
        onto the free stack on the device (how many were free is never read)."""
        old = self.num_pages
        keep = {name: getattr(self, name) for name in _POOL_ARRAYS}
        stack, top = self.free_stack, self.free_top
        self._allocate(pages)
        for name, previous in keep.items():
            if previous is not None:
                getattr(self, name)[: 1 + old] = previous
        xp = self.xp
        self.free_stack[:old] = stack[:old]
        added = pages - old
        self.free_stack[top + xp.arange(added)] = xp.arange(old + 1, pages + 1, dtype=xp.int32)
        self.free_top = top + added

    def _shrink(self, pages: int, width: int) -> None:
        """A pool of ``pages`` pages holding the pairs' pages, renumbered 1, 2, ... in table
        order (pair by pair), the rest free, and tables ``width`` wide; the host knows only
        that they fit (``pages`` >= ``_pages_needed``, ``width`` >= a pair's ceil(most /
        page_size)), the device how many there are."""
        xp, rows = self.xp, 1 + pages
        table, count = self._pairs()
        in_table = xp.arange(table.shape[1])[None, :] < count[:, None]
        renumbered = xp.cumsum(in_table.reshape(-1)).reshape(table.shape)
        source = xp.zeros(rows + 1, dtype=xp.int64)  # new page -> old page; cell `rows`: masked
        source[xp.where(in_table, renumbered, rows)] = table
        source = source[:rows]
        keep = {name: getattr(self, name) for name in _POOL_ARRAYS}
        self._allocate(pages)
        for name, previous in keep.items():
            if previous is not None and previous.shape[0]:
                getattr(self, name)[:] = previous[source]
        free = (source == SPARE)[:, None]  # the free pages (and the spare: it means nothing)
        self.slot_pos = xp.where(free, EMPTY, self.slot_pos)
        if self.slot_score is not None:
            self.slot_score = xp.where(free, 0.0, self.slot_score)
        used = count.sum(keepdims=True).astype(xp.int64)
        self.free_top = pages - used
        table = xp.where(in_table, renumbered, EMPTY).astype(xp.int32)[:, :width]
        self.page_table = xp.ascontiguousarray(table).reshape(self.batch, self.kv_heads, width)

    def _widen(self, width: int) -> None:
        xp, table = self.xp, self.page_table
        self.page_table = xp.full((self.batch, self.kv_heads, width), EMPTY, dtype=xp.int32)
        self.page_table[..., : table.shape[2]] = table

    def _evicts(self, voted: bool) -> bool:
        """Whether the policy applies its budget at this append (always, or SnapKV's only when
        it votes)."""
        return self._budgets is not None and (voted or not self.policy.reads_queries)

    def _after(self, given: np.ndarray, voted: bool) -> tuple[np.ndarray, np.ndarray]:
        """(most int64 [batch, kv_heads], kept int64 [batch]) after an append of ``given``
        tokens per sequence (``voted``: with queries): the most tokens each pair may keep (what
        it might have kept, plus them, cut to its budget where the policy evicts), and the
        tokens each sequence keeps over its kv heads, exactly (every candidate is kept up to
        the budget: per head, or the shared total of a head-adaptive one)."""
        most = self._most + given[:, None]
        kept = self._kept + self.kv_heads * given
        if self._evicts(voted):
            most = np.minimum(most, self._budgets[None, :])
            kept = most.sum(axis=1) if self._shared is None else np.minimum(kept, self._shared)
        return most, kept

    def _pool_for(self, most: np.ndarray, kept: np.ndarray) -> int:
        """Pages of a budgeted pool that must grow (or, after a vote, may shrink): what the
        pairs need, plus a sixteenth (GROWTH) of the kept tokens as slack."""
        slack = int(kept.sum()) // (GROWTH * self.page_size)
        return self._pages_needed(most, kept) + slack

    def _reserve(self, most: np.ndarray, kept: np.ndarray) -> None:
        """Grow the pool and widen the tables, from the host, for every pair to hold the most
        pages it may after an append that leaves it at most ``most`` [batch, kv_heads] tokens,
        ``kept`` [batch] per sequence.

        The bound: tokens fill a pair's holes before a page is taken, so a new page is taken
        only when every page is full, and then the pair holds ceil(kept / page_size) pages;
        otherwise it holds at most what it held. kept <= most throughout. An unbudgeted pool
        doubles; a budgeted one (SnapKV's, as decoding adds tokens) takes what it needs plus
        a sixteenth of its kept tokens (GROWTH), so its nbytes stays near the kept tokens'."""
        need = self._pages_needed(most, kept)
        if need > self.num_pages:
            if self._budgets is None:
                self._grow(max(2 * self.num_pages, need))
            else:
                self._grow(self._pool_for(most, kept))
        widest = int(ceil_div(most, self.page_size).max())
        if widest > self.width:
            self._widen(widest)

    @property
    def quantized(self) -> bool:
        """Whether the pages hold fp8 codes with a scale per page (cuattn/serving/fp8.py)."""
        return self.dtype in fp8.FP8_DTYPES

    @property
    def num_pages(self) -> int:
        """Pages in the pool (the spare page not counted)."""
        return int(self.slot_pos.shape[0]) - 1

    @property
    def width(self) -> int:
        """Columns of the page table: the most pages any pair may hold now."""
        return int(self.page_table.shape[2])

    @property
    def nbytes(self) -> int:
        """Bytes the cache holds: the page pool, and every bookkeeping array."""
        arrays = [getattr(self, name) for name in _POOL_ARRAYS + _BOOK_ARRAYS]
        return sum(int(a.nbytes) for a in arrays if a is not None)

    def __len__(self) -> int:
        return int(self.lengths.max())

    # -- the pairs' slots ---------------------------------------------------------------------

    def _slots(self, table: Any, count: Any) -> tuple[Any, Any]:
        """(slot [pairs, width * page_size], in_table [same]) of tables [pairs, width]: the
        flat slot index of every slot of every page in table order, and whether that page is
        in the table (slots of absent pages point into the spare page)."""
        xp, ps = self.xp, self.page_size
        in_table = xp.arange(table.shape[1])[None, :] < count[:, None]
        page = xp.where(in_table, table, SPARE).astype(xp.int64)
        slot = (page[:, :, None] * ps + xp.arange(ps)).reshape(table.shape[0], -1)
        return slot, xp.repeat(in_table, ps, axis=1)

    def _pairs(self) -> tuple[Any, Any]:
        pairs = self.batch * self.kv_heads
        return self.page_table.reshape(pairs, -1), self.page_count.reshape(pairs)

    # -- what the host asks for ---------------------------------------------------------------

    def page_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The page tables, copied to the host.

        Returns:
            ``(page_table, page_count)`` as NumPy arrays: page_table int32 [batch, kv_heads,
            width] in table order, -1 padded; page_count int32 [batch, kv_heads].
        """
        return host_array(self.page_table), host_array(self.page_count)

    def pages(self, b: int, h: int) -> np.ndarray:
        """The pages one (sequence, kv head) holds, copied to the host.

        Args:
            b (int): the sequence, in [0, batch).
            h (int): the kv head, in [0, kv_heads).

        Returns:
            int64 [n] page ids (rows of ``k_pages``) in table order.
        """
        table, count = self.page_tables()
        return table[b, h, : count[b, h]].astype(np.int64)

    def kept(self, b: int, h: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Where the kept tokens of one (sequence, kv head) are, copied to the host.

        Args:
            b (int): the sequence, in [0, batch).
            h (int): the kv head, in [0, kv_heads).

        Returns:
            ``(pages, offsets, positions)``, int64 [n] NumPy arrays ordered by position: each
            kept token's page, its slot in the page, and its position in the sequence.
        """
        pages = self.pages(b, h)
        with dlpack.on_device(self.info):
            pos = host_array(self.slot_pos[self.xp.asarray(pages)])
        rows, offsets = np.nonzero(pos != EMPTY)
        order = np.argsort(pos[rows, offsets], kind="stable")
        return pages[rows][order], offsets[order], pos[rows, offsets][order]

    def positions(self) -> np.ndarray:
        """The positions of the tokens the cache keeps, copied to the host.

        Returns:
            int64 [batch, kv_heads, n] NumPy array, each row sorted; n is the most any
            (sequence, kv head) keeps, and -1 pads the rows that keep fewer.
        """
        with dlpack.on_device(self.info):
            slot, in_table = self._slots(*self._pairs())
            pos = self.xp.where(in_table, self.slot_pos.reshape(-1)[slot], EMPTY)
        pos = host_array(pos)
        width = int((pos != EMPTY).sum(axis=1).max(initial=0))
        ordered = np.sort(np.where(pos == EMPTY, np.iinfo(np.int64).max, pos), axis=1)[:, :width]
        ordered[ordered == np.iinfo(np.int64).max] = EMPTY
        return ordered.reshape(self.batch, self.kv_heads, width)

    # -- append -------------------------------------------------------------------------------

    def _check_tokens(self, k: Any, v: Any, lengths: Any) -> np.ndarray:
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
            self._check_dtype_and_device(name, x)
        if tuple(k.shape) != tuple(v.shape):
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        t = int(k.shape[2])
        if lengths is None:
            return np.full(self.batch, t, dtype=np.int64)
        given = np.asarray(lengths)
        if given.shape != (self.batch,) or given.dtype.kind not in "iu":
            raise ValueError(f"lengths must be {self.batch} ints, got {lengths!r}")
        if (given < 0).any() or (given > t).any():
            raise ValueError(f"lengths must lie in [0, t={t}], got {given.tolist()}")
        return given.astype(np.int64)

    def _check_capacity(self, given: np.ndarray, most: np.ndarray) -> None:
        """Refuse an append after which a pair might keep more than capacity (without an
        evicting policy every token stays; SnapKV keeps what decoding adds)."""
        if self.capacity is None:
            return
        over = np.flatnonzero(most.max(axis=1) > self.capacity)
        if over.size:
            b = int(over[0])
            raise ValueError(
                f"k: appending {int(given[b])} tokens to sequence {b} would keep "
                f"{int(most[b].max())} tokens in a kv head, past capacity={self.capacity}; give "
                "the cache a policy that evicts them or a larger capacity"
            )

    def _check_queries(self, q: Any, k: Any, given: np.ndarray, lengths: np.ndarray) -> None:
        """q [batch, heads, t, head_dim] of the tokens k brings, for a policy that reads them."""
        if self.policy is None or not self.policy.reads_queries:
            raise ValueError(
                f"q: only a policy that reads queries (SnapKV) takes them, the cache's policy is "
                f"{self.policy!r}; append without q"
            )
        if not hasattr(q, "shape") or not hasattr(q, "dtype"):
            raise TypeError(f"q must be an array, got {type(q).__name__}")
        shape = tuple(int(d) for d in q.shape)
        t = int(k.shape[2])
        if (
            len(shape) != 4
            or shape[0] != self.batch
            or shape[1] % self.kv_heads
            or shape[1] == 0
            or shape[2:] != (t, self.head_dim)
        ):
            raise ValueError(
                f"q must be [batch={self.batch}, heads (a multiple of kv_heads={self.kv_heads}), "
                f"t={t}, head_dim={self.head_dim}], got {shape}"
            )
        self._check_dtype_and_device("q", q)
        self.policy.check_queries(given, lengths)

    def _check_dtype_and_device(self, name: str, x: Any) -> None:
        self.check_input_dtype(name, x)
        self._check_device(name, x)

    def check_input_dtype(self, name: str, x: Any) -> None:
        """Refuse an array the cache is given (k, v) or asked with (q) in a dtype it does not
        take: its own, or for an fp8 cache float16 or bfloat16 (the model's; the cache quantises
        what it keeps, which is what it was built to do, not a silent cast).

        Args:
            name (str): the argument's name, for the message.
            x (array): the array.

        Raises:
            TypeError: x's dtype is not one the cache takes.
        """
        given = dtype_name(x.dtype)
        if self.quantized:
            if given not in FP8_INPUT_DTYPES:
                raise TypeError(
                    f"{name} has dtype {given}; a {self.dtype} cache is given and asked with "
                    f"one of {FP8_INPUT_DTYPES} (it quantises what it keeps itself)"
                )
        elif given != self.dtype:
            raise TypeError(
                f"{name} has dtype {given}, the cache holds {self.dtype} "
                "(cuattn never casts silently)"
            )

    def _check_device(self, name: str, x: Any) -> None:
        info = dlpack.describe(x, name)
        if (info.device, info.device_id) != (self.info.device, self.info.device_id):
            raise ValueError(
                f"{name} is a {info} but the cache lives on {self.info.device}"
                f"{'' if self.info.device == 'cpu' else ':' + str(self.info.device_id)}; "
                "cuattn never moves data between devices"
            )

    def append(self, k: Any, v: Any, lengths: Any = None, q: Any = None) -> None:
        """Add each sequence's new tokens, then evict by the policy.

        New tokens fill the holes eviction left, then new pages. Every check runs before
        anything is written (a refused append leaves the cache as it was), and nothing is read
        back from the device.

        Args:
            k (array): keys [batch, kv_heads, t, head_dim], the cache's dtype (float16 or
                bfloat16 for an fp8 cache), on its device; a prefill is a large t, a step t = 1.
            v (array): values, shaped and typed like k.
            lengths (array-like, optional): batch ints in [0, t]: sequence b takes the first
                ``lengths[b]`` tokens (ragged prompts). None (default): all t.
            q (array, optional): the same tokens' queries [batch, heads, t, head_dim], heads a
                multiple of kv_heads, for a policy that reads them (SnapKV, at the end of a
                prefill: each sequence must bring at least min(window, its length) tokens);
                SnapKV keeps everything in an append without them. None (default).

        Raises:
            TypeError: k, v or q not an array, or of a dtype the cache does not take.
            ValueError: a shape that does not fit (k or q unlike [batch, kv_heads or heads, t,
                head_dim], v unlike k), ``lengths`` not batch ints in [0, t]; an array on
                another device than the cache's; q given to a cache whose policy does not read
                queries, or bringing too few tokens for SnapKV's window; an append after which
                a kv head might keep more than ``capacity``.
        """
        given = self._check_tokens(k, v, lengths)
        new_lengths = self.lengths + given
        if q is not None:
            self._check_queries(q, k, given, new_lengths)
        voted = q is not None
        most, kept = self._after(given, voted)
        self._check_capacity(given, most)
        info = dlpack.describe(k, "k")
        if int(given.max()) > 0:
            with dlpack.stream_for(info), dlpack.on_device(self.info):
                self._reserve(most, kept)
                kb = dlpack.to_backend(k, info, "k")
                vb = dlpack.to_backend(v, dlpack.describe(v, "v"), "v")
                qb = None if q is None else dlpack.to_backend(q, dlpack.describe(q, "q"), "q")
                self._place(kb, vb, given, qb, self._moves(given, kept, voted))
                if voted:  # decoding may have grown the pool past what the vote kept
                    pages = max(self._first_pool_pages(), self._pool_for(most, kept))
                    if self.num_pages > pages:
                        self._shrink(pages, int(ceil_div(most, self.page_size).max()))
        self.lengths = new_lengths
        self._most, self._kept = most, kept

    def _moves(self, given: np.ndarray, kept: np.ndarray, voted: bool) -> int | None:
        """Tokens per pair ``_close_up`` may move at this append, or None where it is not
        needed: a per-head budget evicts a pair's oldest or lowest-scored tokens but its kept
        count never falls, so new tokens refill its holes (module doc); a shared budget or a
        vote can shrink a pair and leave holes anywhere. A pair holds fewer than page_size
        holes before the append (the invariant ``_close_up`` keeps) plus the tokens evicted
        from its sequence (what it kept and was given, less what it keeps), and moves at most
        that many."""
        if not self._evicts(voted) or (self._shared is None and not voted):
            return None
        evicted = int((self._kept + self.kv_heads * given - kept).max())
        return min(self.width * self.page_size, self.page_size - 1 + evicted)

    def _place(
        self, kb: Any, vb: Any, given: np.ndarray, qb: Any | None, moves: int | None
    ) -> None:
        """One append over every pair at once (module doc): decide, evict, close up (at most
        ``moves`` tokens per pair; None: no need), place, write."""
        xp, ps = self.xp, self.page_size
        batch, heads, t, head_dim = (int(d) for d in kb.shape)
        pairs, step, width = batch * heads, xp.arange(t), self.width
        rows = xp.arange(pairs)[:, None]
        flat_pos = self.slot_pos.reshape(-1)
        uniform = bool((given == t).all())
        arrived = xp.full(batch, t, dtype=xp.int64) if uniform else xp.asarray(given)
        old_lengths = self._lengths_device
        self._lengths_device = old_lengths + arrived
        new_pos = old_lengths[:, None, None] + step  # [batch, 1, t]
        new_pos = xp.where(step < arrived[:, None, None], new_pos, EMPTY)
        new_pos = xp.broadcast_to(new_pos, (batch, heads, t)).reshape(pairs, t)

        table, count = self._pairs()
        if self._budgets is None:
            # nothing is ever evicted: every page but the last is full, and only it has room
            keep_new = new_pos != EMPTY
            compact = xp.concatenate([table, xp.full((pairs, 1), EMPTY, xp.int32)], axis=1)
            last = xp.take_along_axis(table, xp.maximum(count - 1, 0)[:, None], axis=1)
            slot, in_table = self._slots(last, xp.minimum(count, 1))
        else:
            compact, count, keep_new = self._evict(table, count, new_pos, kb, qb)
            if moves is not None:
                compact, count = self._close_up(compact, count, moves)
            slot, in_table = self._slots(compact[:, :width], count)

        # the kept incoming tokens go to the holes (table order, then offset), then new pages
        hole = in_table & (flat_pos[slot] == EMPTY)
        hole_rank = xp.cumsum(hole, axis=1) - 1
        holes = xp.full((pairs, t + 1), SPARE, dtype=xp.int64)  # column t: masked
        holes[rows, xp.where(hole & (hole_rank < t), hole_rank, t)] = slot
        rank = xp.cumsum(keep_new, axis=1) - 1
        past_holes = rank - hole.sum(axis=1)[:, None]  # >= 0: the token needs a new page
        taken = ceil_div(xp.maximum(past_holes[:, -1] + 1, 0), ps)  # pages each pair takes
        fresh = self._pop(taken, ceil_div(t, ps))  # [pairs, most new pages], SPARE past taken
        column = count[:, None] + xp.arange(fresh.shape[1])
        compact[rows, xp.where(column < (count + taken)[:, None], column, width)] = fresh
        self.page_table = xp.ascontiguousarray(compact[:, :width]).reshape(batch, heads, width)
        self.page_count = (count + taken).astype(xp.int32).reshape(batch, heads)
        new_page = xp.take_along_axis(fresh, xp.maximum(past_holes, 0) // ps, axis=1)
        target = xp.where(
            past_holes < 0,
            xp.take_along_axis(holes, xp.maximum(rank, 0), axis=1),
            new_page.astype(xp.int64) * ps + xp.maximum(past_holes, 0) % ps,
        )
        target = xp.where(keep_new, target, SPARE)

        # the tokens, their positions: one scatter each (masked ones all land in the spare slot)
        flat_pos[target] = xp.where(keep_new, new_pos, EMPTY)
        if self.slot_score is not None:
            self.slot_score.reshape(-1)[target] = 0.0
        flat = target.reshape(-1)
        if self.quantized:
            written = self._written_pages(xp.where(keep_new, target // ps, SPARE), min(t, width))
            kf, vf = (widened(x, xp).reshape(pairs * t, head_dim) for x in (kb, vb))
            self._requantize(written, flat, kf, vf)
        else:
            self.k_pages.reshape(-1, head_dim)[flat] = kb.reshape(pairs * t, head_dim)
            self.v_pages.reshape(-1, head_dim)[flat] = vb.reshape(pairs * t, head_dim)
        if self._bounds_pages:
            self._bound_pages(xp.where(keep_new, target // ps, SPARE), min(t, width))

    def _evict(
        self, table: Any, count: Any, new_pos: Any, kb: Any, qb: Any | None
    ) -> tuple[Any, Any, Any]:
        """The policy's decision over every kept and incoming token (kb: the incoming keys; qb:
        their queries, for a policy's vote, or None); the evicted slots emptied, the pages left
        empty pushed onto the free stack and closed up in the tables. Returns (tables [pairs,
        width + 1] with a last column for masked writes, page counts, which incoming tokens are
        kept [pairs, t])."""
        xp, ps = self.xp, self.page_size
        pairs, width = table.shape
        flat_pos = self.slot_pos.reshape(-1)
        slot, in_table = self._slots(table, count)
        old_pos = xp.where(in_table, flat_pos[slot], EMPTY)
        shape = (self.batch, self.kv_heads, -1)
        positions = xp.concatenate([old_pos, new_pos], axis=1).reshape(shape)
        scores = None
        if self.slot_score is not None:
            old = xp.where(in_table, self.slot_score.reshape(-1)[slot], 0.0)
            scores = xp.concatenate([old, xp.zeros(new_pos.shape)], axis=1).reshape(shape)
        if qb is not None:
            scores = self._vote(slot, new_pos, kb, qb, positions)
        keep = self.policy.keep(
            xp, self._lengths_device, positions, scores, self._budgets_device
        ).reshape(pairs, -1)
        keep_old, keep_new = keep[:, : old_pos.shape[1]], keep[:, old_pos.shape[1] :]

        gone = (old_pos != EMPTY) & ~keep_old
        flat_pos[xp.where(gone, slot, SPARE)] = EMPTY
        if self.slot_score is not None:
            self.slot_score.reshape(-1)[xp.where(gone, slot, SPARE)] = 0.0
        in_page = in_table.reshape(pairs, width, ps)[:, :, 0]
        held = keep_old.reshape(pairs, width, ps).any(axis=2)
        stay, freed = in_page & held, in_page & ~held
        compact = xp.full((pairs, width + 1), EMPTY, dtype=xp.int32)  # column `width`: masked
        column = xp.where(stay, xp.cumsum(stay, axis=1) - 1, width)
        compact[xp.arange(pairs)[:, None], column] = table
        self._push(xp.where(freed, table, EMPTY), freed)
        return compact, stay.sum(axis=1), keep_new

    def _close_up(self, table: Any, count: Any, moves: int) -> tuple[Any, Any]:
        """After an eviction that may leave holes anywhere in a pair (a shared budget, a vote):
        keep its ceil(kept / page_size) fullest pages (ties: the earlier), move the tokens of
        the others into their holes (at most ``moves`` per pair, slot order to slot order) and
        push the emptied pages, so no pair holds a page's worth of holes and the pool sized by
        the kept tokens (``_pages_needed``) always has a page to pop. The least-filled pages
        hold no more tokens than there are holes, so ``moves`` (the holes' host bound) covers
        them. table [pairs, width + 1] (the last column masked) and count [pairs], as
        ``_evict`` returns them; returns the same, closed up. Device only."""
        xp, ps = self.xp, self.page_size
        pairs, width = table.shape[0], table.shape[1] - 1
        rows = xp.arange(pairs)[:, None]
        flat_pos = self.slot_pos.reshape(-1)
        slot, in_table = self._slots(table[:, :width], count)
        used = in_table & (flat_pos[slot] != EMPTY)
        fill = used.reshape(pairs, width, ps).sum(axis=2)
        in_page = in_table.reshape(pairs, width, ps)[:, :, 0]
        by_fill = xp.argsort(xp.where(in_page, -fill, 1), axis=1, **stable_kind(xp))
        rank = xp.empty((pairs, width), dtype=xp.int64)
        rank[rows, by_fill] = xp.arange(width)
        stay = in_page & (rank < ceil_div(fill.sum(axis=1), ps)[:, None])
        leave = in_page & ~stay

        def first(mask: Any) -> Any:  # [pairs, moves]: the first slots where mask, then SPARE
            at = xp.cumsum(mask, axis=1) - 1
            out = xp.full((pairs, moves + 1), SPARE, dtype=xp.int64)
            out[rows, xp.where(mask & (at < moves), at, moves)] = slot
            return out[:, :moves]

        source = first(xp.repeat(leave, ps, axis=1) & used)
        moved = xp.arange(moves)[None, :] < (source != SPARE).sum(axis=1)[:, None]
        target = xp.where(moved, first(xp.repeat(stay, ps, axis=1) & ~used), SPARE)
        source, target = source.reshape(-1), target.reshape(-1)
        head_dim = self.head_dim
        if self.quantized:  # values move between pages of different scales
            kf, vf = self.token_values(source // ps, source % ps)
        else:
            for pages in (self.k_pages, self.v_pages):
                pages.reshape(-1, head_dim)[target] = pages.reshape(-1, head_dim)[source]
        emptied = xp.where(moved.reshape(-1), source, SPARE)
        flat_pos[target] = flat_pos[source]
        flat_pos[emptied] = EMPTY
        if self.quantized:  # the pages that stay take the moved tokens (and their scales)
            self._requantize(xp.where(stay, table[:, :width], SPARE).reshape(-1), target, kf, vf)
        if self.slot_score is not None:  # an empty slot scores 0, as after an eviction
            flat_score = self.slot_score.reshape(-1)
            flat_score[target] = flat_score[source]
            flat_score[emptied] = 0.0
        closed = xp.full((pairs, width + 1), EMPTY, dtype=xp.int32)
        closed[rows, xp.where(stay, xp.cumsum(stay, axis=1) - 1, width)] = table[:, :width]
        self._push(xp.where(leave, table[:, :width], EMPTY), leave)
        return closed, stay.sum(axis=1)

    def _vote(self, slot: Any, new_pos: Any, kb: Any, qb: Any, positions: Any) -> Any:
        """The policy's vote over the candidates (kept slots ``slot``, then the incoming
        tokens at ``new_pos``) from the queries qb, in float64 (a slot not in the table is
        no candidate, whatever its key holds)."""
        xp = self.xp
        batch, _, t, head_dim = (int(d) for d in qb.shape)
        ps = self.page_size
        old_keys = self.token_values(slot // ps, slot % ps)[0]  # [pairs, slots, head_dim]
        new_keys = kb.reshape(-1, t, head_dim)
        if self.quantized:  # the kept keys are float32 values; the incoming ones join them
            new_keys = widened(new_keys, xp)
        keys = xp.concatenate([old_keys, new_keys], axis=1)
        keys = widened(keys, xp).astype(xp.float64).reshape(batch, self.kv_heads, -1, head_dim)
        queries = widened(qb, xp).astype(xp.float64)
        query_pos = new_pos.reshape(batch, self.kv_heads, t)[:, 0]  # every head's are the same
        return self.policy.vote(xp, self._lengths_device, queries, query_pos, keys, positions)

    def _push(self, pages: Any, freed: Any) -> None:
        """Push ``pages`` [pairs, width] where ``freed`` onto the free stack (device only)."""
        xp = self.xp
        freed = freed.reshape(-1)
        at = self.free_top + xp.cumsum(freed) - 1
        self.free_stack[xp.where(freed, at, self.num_pages)] = pages.reshape(-1)
        self.free_top = self.free_top + freed.sum(keepdims=True)

    def _pop(self, taken: Any, most: int) -> Any:
        """int64 [pairs, most]: ``taken[i]`` pages popped from the free stack for pair i, then
        SPARE. The host bound of ``_reserve`` guarantees the stack holds them."""
        xp = self.xp
        before = xp.cumsum(taken) - taken  # pages the pairs before i take
        j = xp.arange(most)
        wanted = j[None, :] < taken[:, None]
        at = xp.where(wanted, self.free_top - 1 - (before[:, None] + j), 0)
        self.free_top = self.free_top - taken.sum(keepdims=True)
        return xp.where(wanted, self.free_stack[at], SPARE).astype(xp.int64)

    # -- what the decode kernels read ---------------------------------------------------------

    def device_slot_pos(self) -> Any:
        """The position of the token in each slot, on the cache's device.

        Returns:
            int64 [1 + num_pages, page_size], the cache's own array (not a copy): -1 where a
            slot is empty; row 0 is the spare page, whose contents mean nothing.
        """
        return self.slot_pos

    def device_tables(self) -> tuple[Any, Any]:
        """The page tables, on the cache's device, where the decode kernels read them.

        Returns:
            ``(page_table, page_count)``, the cache's own arrays (not copies): page_table int32
            [batch, kv_heads, width], each (sequence, kv head)'s pages in table order, -1
            padded; page_count int32 [batch, kv_heads], the pages in each table.
        """
        return self.page_table, self.page_count

    def device_lengths(self) -> Any:
        """The tokens each sequence was given, on the cache's device.

        Returns:
            int64 [batch] (``lengths`` as the kernels read it).
        """
        return self._lengths_device

    def _written_pages(self, pages: Any, most: int) -> Any:
        """int64 [pairs * most]: the distinct pages of ``pages`` [pairs, t] (SPARE: none), at
        most ``most`` per pair, SPARE after them. A pair's written pages come in table order,
        one run each, so the first of each run names it."""
        xp = self.xp
        pairs = pages.shape[0]
        previous = xp.concatenate([xp.full((pairs, 1), SPARE, pages.dtype), pages[:, :-1]], 1)
        first = (pages != SPARE) & (pages != previous)
        rank = xp.cumsum(first, axis=1) - 1
        written = xp.full((pairs, most + 1), SPARE, dtype=xp.int64)
        written[xp.arange(pairs)[:, None], xp.where(first & (rank < most), rank, most)] = pages
        return written[:, :most].reshape(-1)

    def token_values(self, pages: Any, offsets: Any) -> tuple[Any, Any]:
        """The keys and values of some slots, as the decode kernels read them.

        Args:
            pages (array): int page ids, on the cache's device.
            offsets (array): int slot offsets within those pages, the shape of ``pages``.

        Returns:
            ``(keys, values)``, each [*pages.shape, head_dim] on the cache's device: the stored
            elements, or for an fp8 cache the float32 values of its codes times their page's
            scale.
        """
        if not self.quantized:
            return self.k_pages[pages, offsets], self.v_pages[pages, offsets]
        xp = self.xp
        return tuple(
            fp8.decode(xp, codes[pages, offsets], self.dtype) * scale[pages][..., None]
            for codes, scale in ((self.k_pages, self.k_scale), (self.v_pages, self.v_scale))
        )

    def _page_values(self, pages: Any) -> tuple[Any, Any]:
        """(keys, values) float32 [len(pages), page_size, head_dim] of whole pages."""
        xp = self.xp
        if not self.quantized:
            return widened(self.k_pages[pages], xp), widened(self.v_pages[pages], xp)
        offsets = xp.arange(self.page_size)[None, :]
        return self.token_values(pages[:, None], offsets)

    def _requantize(self, pages: Any, slots: Any, keys: Any, values: Any) -> None:
        """Write float32 ``keys``, ``values`` [n, head_dim] to the flat ``slots`` [n] of an fp8
        cache, each in one of ``pages`` (int64 [m]: every page a slot lies in, each once but
        SPARE, whose contents mean nothing): those pages are dequantised, take the new tokens,
        and are quantised again at the scale of their kept tokens (slot_pos already says which;
        cuattn/serving/fp8.py: exact for every normal code)."""
        xp, ps, head_dim = self.xp, self.page_size, self.head_dim
        row_of = xp.zeros(self.num_pages + 1, dtype=xp.int64)
        row_of[pages] = xp.arange(pages.shape[0])
        rows = row_of[slots // ps] * ps + slots % ps
        used = self.slot_pos[pages] != EMPTY
        staged = self._page_values(pages)
        for name, page_values, new in zip(("k", "v"), staged, (keys, values), strict=True):
            page_values = page_values.reshape(-1, head_dim)
            page_values[rows] = new
            codes, scale = fp8.quantize_pages(
                xp, page_values.reshape(-1, ps, head_dim), used, self.dtype
            )
            getattr(self, f"{name}_pages")[pages] = codes
            getattr(self, f"{name}_scale")[pages] = scale

    def _bound_pages(self, pages: Any, most: int) -> None:
        """Quest's element-wise key min and max over the kept tokens of the pages in ``pages``
        [pairs, t] (SPARE: none). A pair's written pages come in table order, one run each, so
        the first of each run names it; at most ``most`` per pair."""
        xp = self.xp
        written = self._written_pages(pages, most)
        used = (self.slot_pos[written] != EMPTY)[..., None]  # [pages, page_size, 1]
        keys = (
            self._page_values(written)[0] if self.quantized else widened(self.k_pages[written], xp)
        )
        low = xp.where(used, keys, xp.inf).min(axis=1)
        high = xp.where(used, keys, -xp.inf).max(axis=1)
        if self.key_min.dtype == xp.uint16:
            low = bfloat16_outward(xp, low, upward=False)
            high = bfloat16_outward(xp, high, upward=True)
        self.key_min[written] = low
        self.key_max[written] = high
        self.key_min[SPARE] = self.key_max[SPARE] = 0  # masked rows left it infinite

    def page_bounds(self, pages: Any) -> tuple[Any, Any]:
        """Quest's element-wise key bounds of pages, as float32: the stored float32, or the
        bfloat16 bits (rounded outward at append) widened exactly. What every path of the
        choice reads, so all choose alike.

        Args:
            pages: an index array (any shape) of pool rows, on the cache's device.

        Returns:
            (key_min, key_max), each float32 [*pages.shape, head_dim] on the cache's device.
        """
        xp = self.xp
        low, high = self.key_min[pages], self.key_max[pages]
        if low.dtype == xp.uint16:
            return bfloat16_widened(xp, low), bfloat16_widened(xp, high)
        return low, high


# bfloat16 bit patterns (the high 16 bits of a float32)
BF16_LOW_BITS = 0xFFFF  # what a float32 loses
BF16_SIGN = 0x8000
BF16_QUIET = 0x0040  # the quiet-NaN bit: a NaN whose payload was all in the low bits stays NaN


def bfloat16_outward(xp: Any, x: Any, upward: bool) -> Any:
    """float32 ``x`` rounded to bfloat16 toward +inf (``upward``) or -inf, as uint16 bits:
    the result widened is >= x (upward) or <= x, within one bfloat16 ulp of it, x itself where
    bfloat16 holds it (infinities, zeros of either sign included); past bfloat16's largest
    finite value, toward the infinity it rounds to; NaN stays NaN (sign kept, quiet bit set).
    Integer operations on the bits: truncation rounds toward zero, so a value that loses bits
    steps one ulp away from zero where its sign is the rounding's direction (negative for
    toward -inf) and stays truncated otherwise; a step from the largest finite magnitude
    carries into the exponent and gives the infinity."""
    x = xp.ascontiguousarray(x, dtype=xp.float32)
    bits = x.view(xp.uint32)
    high = (bits >> BFLOAT16_SHIFT).astype(xp.uint16)
    inexact = (bits & BF16_LOW_BITS) != 0
    negative = (high & BF16_SIGN) != 0
    away = inexact & (negative if not upward else ~negative)
    nan = xp.isnan(x)
    stepped = high + away.astype(xp.uint16)
    return xp.where(nan, high | BF16_QUIET, stepped).astype(xp.uint16)


def bfloat16_widened(xp: Any, bits: Any) -> Any:
    """uint16 bfloat16 bits as the float32 they stand for (exact)."""
    return (bits.astype(xp.uint32) << BFLOAT16_SHIFT).view(xp.float32)


# the arrays sized by the pool (copied when it grows), and the rest of the bookkeeping
_POOL_ARRAYS = (
    "k_pages",
    "v_pages",
    "k_scale",
    "v_scale",
    "slot_pos",
    "slot_score",
    "key_min",
    "key_max",
)
_BOOK_ARRAYS = ("free_stack", "free_top", "page_table", "page_count", "_lengths_device")


def _storage_dtype(xp: Any, name: str) -> Any:
    if name in fp8.FP8_DTYPES:  # the codes (cuattn/serving/fp8.py); ml_dtypes decodes them
        return xp.uint8
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as err:
            raise TypeError(
                "dtype bfloat16 needs ml_dtypes (pip install ml_dtypes; cuattn[cuda12] has it)"
            ) from err
        return ml_dtypes.bfloat16
    return getattr(xp, name)
