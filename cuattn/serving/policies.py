"""KV-cache policies: which tokens a cache keeps (and, for Quest, which pages a query reads).

A policy is applied by :class:`cuattn.KVCache` right after every ``append``, to each
sequence's kept tokens plus the incoming ones, so the kept count never exceeds the budget, not
even for a moment; ``decode_attention`` only adds scores (HeavyHitters) or chooses pages
(Quest). Positions count every token a sequence was ever given (0, 1, ..., L-1).

    SlidingWindow(window)          keep positions [L - window, L)
    StreamingLLM(sinks, window)    keep [0, sinks) and [L - window, L)
    HeavyHitters(budget, recent)   keep the `recent` newest (the one just appended included) and
                                   the budget - recent others with the largest score: the sum of
                                   the attention probabilities every decode query gave the token
                                   (summed over the query heads of its kv group; prefill does
                                   not score). Ties keep the newer token.
    Quest(pages, page_size)        keep everything; each decode query of each query head reads
                                   only the `pages` pages (page j: positions [j*ps, (j+1)*ps))
                                   with the largest bound sum_i max(q_i*min_i, q_i*max_i) over
                                   the page's element-wise key min and max, among all pages but
                                   the newest, plus the newest page. Ties read the lower page.
    SnapKV(budget, window, kernel_size=7, pooling="max")
                                   at an append given its queries (the end of a prefill): the
                                   last `window` queries vote for the older tokens: per query
                                   head the sum over the window of their softmax probabilities
                                   (causal, over every candidate, scale 1/sqrt(head_dim)),
                                   pooled over the older tokens by position (a 'same' max or
                                   average pool of `kernel_size`; a missing position counts as
                                   nothing), averaged over the query heads of the kv group; keep
                                   the window and the budget - window best-voted older tokens
                                   (ties: the newer). Appends without queries keep everything
                                   (decode grows the cache, as in SnapKV).
Budgets (window, budget) are tokens: an int for every kv head, a sequence with one per kv head,
or (HeavyHitters) ``head_adaptive(total)``: ``total`` tokens per sequence shared by the layer's
kv heads, each head keeping its ``recent`` (SnapKV: its ``window``) and the rest going to the
globally highest scores (ties: newer, then the lower head). ``pyramid(total, num_layers)``
gives per-layer budgets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuattn._util import stable_kind

EMPTY = -1  # a position that is no candidate
POOLINGS = ("max", "avg")  # SnapKV's pools along the key axis
DEFAULT_KERNEL = 7  # SnapKV's pool width (the paper's choice)
NAN_VOTE = -0.5  # a NaN vote ranks below every real one (>= 0) and above no candidate (-1)

__all__ = [
    "HeadAdaptive",
    "HeavyHitters",
    "Policy",
    "Quest",
    "SlidingWindow",
    "SnapKV",
    "StreamingLLM",
    "head_adaptive",
    "pyramid",
]


def _count(name: str, value: object, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value}")
    return int(value)


@dataclass(frozen=True)
class HeadAdaptive:
    """A budget of ``total`` tokens per sequence shared by a layer's kv heads (Ada-KV).

    Build it with :func:`head_adaptive`, which checks ``total``; HeavyHitters and SnapKV take it
    as their ``budget`` (the module docstring says how the heads share it).

    Args:
        total (int): tokens per sequence, over all the layer's kv heads.
    """

    total: int


def head_adaptive(total: int) -> HeadAdaptive:
    """A layer budget of ``total`` tokens per sequence, spent where the scores are highest.

    Each kv head keeps its newest tokens (HeavyHitters' ``recent``, SnapKV's ``window``), and
    the rest of the total goes to the highest scores over all the heads (ties: the newer, then
    the lower head).

    Args:
        total (int): tokens per sequence over the layer's kv heads, positive.

    Returns:
        HeadAdaptive: the budget, for HeavyHitters' or SnapKV's ``budget``.

    Raises:
        TypeError: ``total`` not an int.
        ValueError: ``total`` < 1.
    """
    return HeadAdaptive(_count("total", total))


def pyramid(total: int, num_layers: int) -> list[int]:
    """Per-layer budgets, largest at the first layer (PyramidKV).

    Layer l of L gets floor(total * (L - l) / (L (L + 1) / 2)), at least 1 (taken back from
    the largest where the floor of 1 overshoots).

    Args:
        total (int): tokens over all the layers, at least ``num_layers``.
        num_layers (int): the layers, positive.

    Returns:
        list[int]: one budget per layer, non-increasing, summing to at most ``total``.

    Raises:
        TypeError: ``total`` or ``num_layers`` not an int.
        ValueError: either < 1, or ``total`` < ``num_layers``.
    """
    total, num_layers = _count("total", total), _count("num_layers", num_layers)
    if total < num_layers:
        raise ValueError(f"total={total} cannot give each of num_layers={num_layers} a token")
    weights = np.arange(num_layers, 0, -1)
    budgets = np.maximum(total * weights // weights.sum(), 1)
    while budgets.sum() > total:  # the floor of 1 can overshoot; take back from the top layers
        budgets[np.argmax(budgets)] -= 1
    return [int(b) for b in budgets]


def _per_head(name: str, value: object, kv_heads: int) -> np.ndarray:
    if isinstance(value, Sequence) or isinstance(value, np.ndarray):
        values = [_count(f"{name}[{i}]", v) for i, v in enumerate(value)]
        if len(values) != kv_heads:
            raise ValueError(
                f"{name} must have one entry per kv head ({kv_heads}), got {len(values)}"
            )
        return np.array(values, dtype=np.int64)
    return np.full(kv_heads, _count(name, value), dtype=np.int64)


class Policy:
    """The base of the policies: what a KVCache asks of the one it is given.

    ``bind`` checks the policy against the cache when it is built; ``budgets`` and
    ``shared_budget`` size its pool; after every ``append``, ``keep`` decides which tokens each
    (sequence, kv head) keeps (from ``vote``'s scores when the append brings queries and the
    policy reads them). Users construct its subclasses, not it.

    Attributes:
        scores_tokens (bool): decode_attention accumulates each kept token's probability mass
            into the cache's scores (HeavyHitters).
        selects_pages (bool): decode_attention reads only the pages the policy chooses (Quest).
        reads_queries (bool): the policy chooses only at an append given the tokens' queries,
            and its budget binds only there (SnapKV).
    """

    #: True when decode_attention must accumulate each kept token's probability mass
    scores_tokens = False
    #: True when decode_attention reads only chosen pages (Quest)
    selects_pages = False

    def bind(self, kv_heads: int, page_size: int, capacity: int | None) -> None:
        """Check the policy against a cache and take its kv head count (KVCache calls it once,
        when it is built).

        Args:
            kv_heads (int): the cache's kv heads.
            page_size (int): the cache's tokens per page.
            capacity (int | None): the cache's capacity per (sequence, kv head), or None.

        Raises:
            TypeError: (a policy's own check) an entry of a per-head budget not an int.
            ValueError: (a policy's own check) a per-head budget with other than ``kv_heads``
                entries or an entry < 1; a budget under HeavyHitters' ``recent``; a
                ``head_adaptive`` total below kv_heads times the tokens each head always keeps;
                Quest's ``page_size`` unlike the cache's.
        """
        self.kv_heads = kv_heads

    #: True when the policy chooses only at an append given the tokens' queries (SnapKV);
    #: its budget binds only there
    reads_queries = False

    def budgets(self) -> np.ndarray | None:
        """The most tokens each kv head keeps (after ``bind``).

        Returns:
            int64 [kv_heads] NumPy array, or None: no limit (a policy that evicts nothing).
        """
        return None

    def shared_budget(self) -> int | None:
        """The tokens per sequence a head-adaptive budget shares over the kv heads.

        Returns:
            int | None: ``head_adaptive``'s total, by which the cache sizes its pool instead of
            by each head's most; None for any other budget.
        """
        budget = getattr(self, "budget", None)
        return budget.total if isinstance(budget, HeadAdaptive) else None

    def check_queries(self, given: np.ndarray, lengths: np.ndarray) -> None:
        """Refuse an append whose queries do not hold what ``vote`` reads (called before
        anything is written, only when ``reads_queries``).

        Args:
            given (numpy.ndarray): int64 [batch], the tokens each sequence appends (host).
            lengths (numpy.ndarray): int64 [batch], each sequence's tokens after the append.

        Raises:
            ValueError: (SnapKV) a sequence bringing fewer than min(window, its length)
                tokens.
        """

    def vote(
        self, xp: Any, lengths: Any, queries: Any, query_positions: Any, keys: Any, positions: Any
    ) -> Any:
        """Score the candidates from the queries of an append (only when ``reads_queries``).

        Args:
            xp (module): the array module, NumPy or CuPy on the cache's device.
            lengths (array): int64 [batch], each sequence's tokens, this append included.
            queries (array): float64 [batch, heads, t, head_dim], the append's queries.
            query_positions (array): int64 [batch, t], their positions (-1: none).
            keys (array): float64 [batch, kv_heads, n, head_dim], the candidates' keys.
            positions (array): int64 [batch, kv_heads, n], the candidates' positions, as
                ``keep``'s.

        Returns:
            float64 [batch, kv_heads, n]: the candidates' scores, which ``keep`` is given.

        Raises:
            NotImplementedError: a policy that does not read queries (the base's).
        """
        raise NotImplementedError

    def keep(
        self, xp: Any, lengths: Any, positions: Any, scores: Any | None, budgets: Any | None
    ) -> Any:
        """Decide which candidates (the kept tokens and the incoming ones) each (sequence, kv
        head) keeps, in whole-array operations of ``xp`` (nothing is read back).

        Args:
            xp (module): the array module, NumPy or CuPy on the cache's device.
            lengths (array): int64 [batch], each sequence's tokens, this append included.
            positions (array): int64 [batch, kv_heads, n], the candidates' positions, -1 where
                there is no candidate (never kept).
            scores (array | None): float64 like positions: the accumulated scores where
                ``scores_tokens``, ``vote``'s at an append given queries, else None.
            budgets (array | None): ``budgets()`` on the cache's device.

        Returns:
            bool [batch, kv_heads, n]: the candidates kept.

        Raises:
            NotImplementedError: the base's (every policy defines it).
        """
        raise NotImplementedError


class SlidingWindow(Policy):
    """Keep each sequence's last ``window`` positions, ``[L - window, L)``.

    Args:
        window (int | Sequence[int]): tokens kept, positive: one for every kv head, or one per
            kv head (its entries checked when a cache binds the policy).

    Raises:
        TypeError: ``window`` (or an entry of it, at binding) not an int.
        ValueError: ``window`` (or an entry) < 1; one per kv head of another length than the
            cache's kv heads (at binding).
    """

    def __init__(self, window: int | Sequence[int]) -> None:
        self.window = window
        if not isinstance(window, (Sequence, np.ndarray)):
            _count("window", window)

    def bind(self, kv_heads: int, page_size: int, capacity: int | None) -> None:
        super().bind(kv_heads, page_size, capacity)
        self._window = _per_head("window", self.window, kv_heads)

    def budgets(self) -> np.ndarray:
        return self._window

    def keep(self, xp, lengths, positions, scores, budgets):
        first = lengths[:, None, None] - budgets[None, :, None]
        return (positions != EMPTY) & (positions >= first)

    def __repr__(self) -> str:
        return f"SlidingWindow({self.window!r})"


class StreamingLLM(Policy):
    """Keep the first ``sinks`` positions and the last ``window``: ``[0, sinks)`` and
    ``[L - window, L)`` (StreamingLLM's attention sinks plus a window).

    Args:
        sinks (int): the first positions kept, >= 0.
        window (int): the newest positions kept, positive.

    Raises:
        TypeError: ``sinks`` or ``window`` not an int.
        ValueError: ``sinks`` < 0 or ``window`` < 1.
    """

    def __init__(self, sinks: int, window: int) -> None:
        self.sinks = _count("sinks", sinks, minimum=0)
        self.window = _count("window", window)

    def budgets(self) -> np.ndarray:
        return np.full(self.kv_heads, self.sinks + self.window, dtype=np.int64)

    def keep(self, xp, lengths, positions, scores, budgets):
        recent = positions >= lengths[:, None, None] - self.window
        return (positions != EMPTY) & ((positions < self.sinks) | recent)

    def __repr__(self) -> str:
        return f"StreamingLLM(sinks={self.sinks}, window={self.window})"


def _ranks(xp: Any, keys: list[Any]) -> Any:
    """int64 [rows, n]: each element's place in its row sorted ascending by ``keys`` ([rows, n]
    each, the last the most significant), ties left in index order: one stable sort per key,
    least significant first."""
    rows, n = keys[0].shape
    order = xp.broadcast_to(xp.arange(n), (rows, n))
    for key in keys:
        by_key = xp.argsort(xp.take_along_axis(key, order, axis=1), axis=1, **stable_kind(xp))
        order = xp.take_along_axis(order, by_key, axis=1)
    rank = xp.empty((rows, n), dtype=xp.int64)
    rank[xp.arange(rows)[:, None], order] = xp.arange(n)
    return rank


def _bind_budget(
    budget: int | Sequence[int] | HeadAdaptive, kv_heads: int, kept_name: str, kept: int
) -> np.ndarray | None:
    """Per-kv-head budgets of a policy that always keeps its ``kept`` newest tokens (HeavyHitters'
    recent, SnapKV's window), or None for a head-adaptive budget, checked to leave every head
    its newest tokens."""
    if not isinstance(budget, HeadAdaptive):
        return _per_head("budget", budget, kv_heads)
    if budget.total < kv_heads * kept:
        raise ValueError(
            f"budget: head_adaptive({budget.total}) cannot keep {kept_name}={kept} tokens in each "
            f"of {kv_heads} kv heads; accepted: a total >= {kv_heads * kept}"
        )
    return None


def _head_budgets(
    budget: int | Sequence[int] | HeadAdaptive, bound: np.ndarray | None, kv_heads: int, kept: int
) -> np.ndarray:
    """Most tokens each kv head keeps: the bound budgets, or under a head-adaptive budget all of
    the total but the other heads' ``kept`` newest."""
    if bound is not None:
        return bound
    return np.full(kv_heads, budget.total - (kv_heads - 1) * kept)


def _keep_best(
    xp: Any,
    lengths: Any,
    positions: Any,
    scores: Any,
    recent: int,
    budgets: Any,
    total: int | None,
) -> Any:
    """bool like positions: the ``recent`` newest candidates of each (sequence, kv head) and
    the others by score (>= 0, ties: the newer), ``budgets`` per kv head in all, or, with a
    ``total`` (head-adaptive), ``total`` per sequence over its kv heads (ties: the lower
    head)."""
    batch, kv_heads, n = positions.shape
    valid = positions != EMPTY
    newest = valid & (positions >= lengths[:, None, None] - recent)
    # the recent first (an infinite score), then the others by score, newer first; no
    # candidate last (-1)
    worth = xp.where(newest, xp.inf, xp.where(valid, scores, -1.0))
    keys = [-positions, -worth]
    if total is None:
        rank = _ranks(xp, [key.reshape(batch * kv_heads, n) for key in keys])
        return valid & (rank.reshape(positions.shape) < budgets[None, :, None])
    # head-adaptive: one ranking over the sequence's heads, laid out head by head, so the
    # stable sorts leave ties to the lower head
    rank = _ranks(xp, [key.reshape(batch, kv_heads * n) for key in keys])
    return valid & (rank.reshape(positions.shape) < total)


class HeavyHitters(Policy):
    """H2O: keep the ``recent`` newest tokens plus the highest-scored others, ``budget`` in all.

    A token's score is the sum of the attention probabilities every decode query gave it,
    summed over its kv group's query heads (an append does not score); ties keep the newer
    token.

    Args:
        budget (int | Sequence[int] | HeadAdaptive): tokens kept: one for every kv head, one
            per kv head (its entries checked when a cache binds the policy), or
            ``head_adaptive(total)``, a total per sequence the kv heads share.
        recent (int): the newest tokens always kept (the one just appended included), >= 0
            and at most ``budget``.

    Raises:
        TypeError: ``recent`` or an int ``budget`` (or an entry, at binding) not an int.
        ValueError: ``recent`` < 0; ``budget`` < 1 or under ``recent`` (a per-head or
            head-adaptive one at binding: also one per kv head of another length, a total
            below kv_heads * recent).
    """

    scores_tokens = True

    def __init__(self, budget: int | Sequence[int] | HeadAdaptive, recent: int) -> None:
        self.budget = budget
        self.recent = _count("recent", recent, minimum=0)
        if not isinstance(budget, (HeadAdaptive, Sequence, np.ndarray)):
            if _count("budget", budget) < self.recent:
                raise ValueError(f"recent={recent} must not exceed budget={budget}")

    def bind(self, kv_heads: int, page_size: int, capacity: int | None) -> None:
        super().bind(kv_heads, page_size, capacity)
        self._budget = _bind_budget(self.budget, kv_heads, "recent", self.recent)
        if self._budget is None:
            return
        if (self._budget < self.recent).any():
            raise ValueError(f"recent={self.recent} must not exceed any budget, got {self.budget}")

    def budgets(self) -> np.ndarray:
        return _head_budgets(self.budget, self._budget, self.kv_heads, self.recent)

    def keep(self, xp, lengths, positions, scores, budgets):
        return _keep_best(
            xp, lengths, positions, scores, self.recent, budgets, self.shared_budget()
        )

    def __repr__(self) -> str:
        return f"HeavyHitters(budget={self.budget!r}, recent={self.recent})"


class SnapKV(Policy):
    """SnapKV: keep the last ``window`` tokens and the older ones the prompt's last queries
    attend to most, ``budget`` in all.

    The policy chooses at an append given its queries (``cache.append(k, v, lengths, q=q)`` at
    the end of a prefill); appends without queries keep everything, as SnapKV compresses the
    prompt and leaves the generated tokens alone, so decoding grows the cache again. The vote:
    the module docstring; docs/serving.md, section "SnapKV and Ada-KV: choosing at the end of
    the prefill".

    Args:
        budget (int | Sequence[int] | HeadAdaptive): tokens kept, at least ``window``: one
            for every kv head, one per kv head, or ``head_adaptive(total)`` (Ada-KV: a total
            per sequence the layer's kv heads share).
        window (int): the last queries that vote, whose tokens are always kept; positive.
        kernel_size (int): the width of the pool over the votes along positions, odd and
            positive (default 7, the paper's).
        pooling (str): ``"max"`` (default) or ``"avg"``.

    Raises:
        TypeError: ``window``, ``kernel_size`` or a budget (or its entries) not an int;
            ``budget`` a str; ``pooling`` not a str.
        ValueError: ``window``, ``kernel_size`` or a budget < 1; ``kernel_size`` even;
            ``pooling`` neither "max" nor "avg"; a budget under ``window``; (at binding) one
            per kv head of another length, a head-adaptive total below kv_heads * window.
    """

    reads_queries = True

    def __init__(
        self,
        budget: int | Sequence[int] | HeadAdaptive,
        window: int,
        kernel_size: int = DEFAULT_KERNEL,
        pooling: str = "max",
    ) -> None:
        self.window = _count("window", window)
        self.kernel_size = _count("kernel_size", kernel_size)
        if self.kernel_size % 2 == 0:
            raise ValueError(
                f"kernel_size must be an odd int >= 1 (a 'same' pool centred on each token), "
                f"got {kernel_size}"
            )
        if not isinstance(pooling, str):
            raise TypeError(f"pooling must be one of {POOLINGS}, got {type(pooling).__name__}")
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {POOLINGS}, got {pooling!r}")
        self.pooling = pooling
        if isinstance(budget, str):
            raise TypeError(
                "budget must be an int, a sequence of ints (one per kv head) or "
                f"head_adaptive(total), got str {budget!r}"
            )
        self.budget = budget
        if isinstance(budget, HeadAdaptive):
            return
        if isinstance(budget, (Sequence, np.ndarray)):
            named = [(f"budget[{i}]", value) for i, value in enumerate(budget)]
        else:
            named = [("budget", budget)]
        for name, value in named:
            if _count(name, value) < self.window:
                raise ValueError(
                    f"{name} must be >= window={self.window} (the window is always kept), "
                    f"got {value}"
                )

    def bind(self, kv_heads: int, page_size: int, capacity: int | None) -> None:
        super().bind(kv_heads, page_size, capacity)
        self._budget = _bind_budget(self.budget, kv_heads, "window", self.window)

    def budgets(self) -> np.ndarray:
        return _head_budgets(self.budget, self._budget, self.kv_heads, self.window)

    def check_queries(self, given: np.ndarray, lengths: np.ndarray) -> None:
        short = np.flatnonzero(given < np.minimum(self.window, lengths))
        if short.size:
            b = int(short[0])
            raise ValueError(
                f"q: SnapKV(window={self.window}) votes with each sequence's last {self.window} "
                f"queries, but sequence {b} appends {int(given[b])} of its {int(lengths[b])} "
                "tokens; give q with an append that brings every sequence at least "
                "min(window, its length) tokens"
            )

    def vote(self, xp, lengths, queries, query_positions, keys, positions):
        # NaN and inf take their course (a dense softmax's); a NaN vote ranks last (NAN_VOTE)
        with np.errstate(invalid="ignore", over="ignore"):
            return self._vote(xp, lengths, queries, query_positions, keys, positions)

    def _vote(self, xp, lengths, queries, query_positions, keys, positions):
        batch, heads, _, head_dim = queries.shape
        kv_heads = positions.shape[1]
        group, w = heads // kv_heads, self.window
        # the window: each sequence's last w queries (check_queries: all in this append)
        row = (query_positions != EMPTY).sum(axis=1)[:, None] - w + xp.arange(w)  # [batch, w]
        at = xp.maximum(row, 0)
        q_pos = xp.where(row >= 0, xp.take_along_axis(query_positions, at, axis=1), EMPTY)
        window = xp.take_along_axis(queries, at[:, None, :, None], axis=2)
        window = window.reshape(batch, kv_heads, group, w, head_dim)
        s = window @ xp.swapaxes(keys, -1, -2)[:, :, None] * head_dim**-0.5  # [.., g, w, n]
        key_pos = positions[:, :, None, None, :]
        query_pos = q_pos[:, None, None, :, None]
        allowed = (key_pos != EMPTY) & (query_pos != EMPTY) & (key_pos <= query_pos)
        s = xp.where(allowed, s, -xp.inf)
        m = s.max(axis=-1, keepdims=True)
        p = xp.where(allowed, xp.exp(s - xp.where(m == -xp.inf, 0.0, m)), 0.0)
        total = p.sum(axis=-1, keepdims=True)
        votes = (p / xp.where(total > 0, total, 1.0)).sum(axis=3)  # [batch, kv, g, n]
        older = (positions != EMPTY) & (positions < lengths[:, None, None] - w)
        pooled = self._pool(xp, votes, positions, older).mean(axis=2)
        return xp.where(older, xp.where(xp.isnan(pooled), NAN_VOTE, pooled), 0.0)

    def _pool(self, xp: Any, votes: Any, positions: Any, older: Any) -> Any:
        """votes [batch, kv_heads, g, n] pooled over the older candidates by position: a
        'same' pool of kernel_size centred on each, a position that is no older candidate
        counting as nothing (-inf to a max, 0 to an average, which divides by kernel_size):
        over a whole prefix, the pool SnapKV runs on its key axis. The candidates come in slot
        order, so they are sorted by position; a neighbour within the radius by position is
        within the radius in that order, positions being distinct."""
        radius = self.kernel_size // 2
        n = positions.shape[-1]
        order = xp.argsort(xp.where(older, positions, xp.iinfo(xp.int64).max), axis=-1)
        pos = xp.take_along_axis(positions, order, axis=-1)
        ok = xp.take_along_axis(older, order, axis=-1)
        ordered = xp.take_along_axis(votes, order[:, :, None], axis=-1)
        average = self.pooling == "avg"
        nothing = 0.0 if average else -xp.inf
        pooled = xp.full(ordered.shape, nothing)
        for shift in range(-radius, radius + 1):
            j = xp.arange(n) + shift
            at = xp.clip(j, 0, n - 1)
            near = (j >= 0) & (j < n) & ok[..., at] & (xp.abs(pos[..., at] - pos) <= radius)
            other = xp.where(near[:, :, None], ordered[..., at], nothing)
            pooled = pooled + other if average else xp.maximum(pooled, other)
        if average:
            pooled = pooled / self.kernel_size
        out = xp.empty_like(pooled)
        xp.put_along_axis(out, xp.broadcast_to(order[:, :, None], out.shape), pooled, axis=-1)
        return out

    def keep(self, xp, lengths, positions, scores, budgets):
        if scores is None:  # an append without queries keeps everything
            return positions != EMPTY
        return _keep_best(
            xp, lengths, positions, scores, self.window, budgets, self.shared_budget()
        )

    def __repr__(self) -> str:
        return (
            f"SnapKV(budget={self.budget!r}, window={self.window}, "
            f"kernel_size={self.kernel_size}, pooling={self.pooling!r})"
        )


class Quest(Policy):
    """Quest: evict nothing; each decode query reads only ``pages`` pages, chosen by their key
    bounds, plus the newest page.

    The bound of a page is ``sum_i max(q_i min_i, q_i max_i)`` over its element-wise key min
    and max; ties read the lower page.

    Args:
        pages (int): pages each query reads besides the newest, positive.
        page_size (int): the cache's page size (checked when a cache binds the policy).

    Raises:
        TypeError: ``pages`` or ``page_size`` not an int.
        ValueError: either < 1; ``page_size`` unlike the cache's (at binding).
    """

    selects_pages = True

    def __init__(self, pages: int, page_size: int) -> None:
        self.pages = _count("pages", pages)
        self.page_size = _count("page_size", page_size)

    def bind(self, kv_heads: int, page_size: int, capacity: int | None) -> None:
        super().bind(kv_heads, page_size, capacity)
        if page_size != self.page_size:
            raise ValueError(
                f"policy: Quest(page_size={self.page_size}) needs a cache with that page size, "
                f"got page_size={page_size}"
            )

    def keep(self, xp, lengths, positions, scores, budgets):
        return positions != EMPTY

    def __repr__(self) -> str:
        return f"Quest(pages={self.pages}, page_size={self.page_size})"
