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
Budgets (window, budget) are tokens: an int for every kv head, a sequence with one per kv head,
or (HeavyHitters) ``head_adaptive(total)``: ``total`` tokens per sequence shared by the layer's
kv heads, each head keeping its ``recent`` and the rest going to the globally highest scores
(ties: newer, then the lower head). ``pyramid(total, num_layers)`` gives per-layer budgets.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from cuattn._util import stable_kind

EMPTY = -1  # a position that is no candidate

__all__ = [
    "HeadAdaptive",
    "HeavyHitters",
    "Policy",
    "Quest",
    "SlidingWindow",
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
    """``total`` tokens per sequence shared by a layer's kv heads (Ada-KV); see module doc."""

    total: int


def head_adaptive(total: int) -> HeadAdaptive:
    """A layer budget of ``total`` tokens per sequence, spent where the scores are highest."""
    return HeadAdaptive(_count("total", total))


def pyramid(total: int, num_layers: int) -> list[int]:
    """Per-layer budgets, largest at the first layer (PyramidKV): layer l of L gets
    floor(total * (L - l) / (L (L + 1) / 2)), at least 1; non-increasing, summing to at most
    ``total``."""
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
    """Base: ``bind`` checks the policy against a cache; ``keep`` decides per sequence."""

    #: True when decode_attention must accumulate each kept token's probability mass
    scores_tokens = False
    #: True when decode_attention reads only chosen pages (Quest)
    selects_pages = False

    def bind(self, kv_heads: int, page_size: int, capacity: int | None) -> None:
        self.kv_heads = kv_heads

    def budgets(self) -> np.ndarray | None:
        """Most tokens each kv head keeps (None: no limit)."""
        return None

    def keep(
        self, xp: Any, lengths: Any, positions: Any, scores: Any | None, budgets: Any | None
    ) -> Any:
        """bool [batch, kv_heads, n]: which candidates (the kept tokens and the incoming ones)
        each (sequence, kv head) keeps, in whole-array operations of the array module ``xp``
        (NumPy, or CuPy on the cache's device; nothing is read back). lengths int64 [batch]:
        tokens each sequence was given, this append included; positions int64 [batch, kv_heads,
        n], -1 where there is no candidate (never kept); scores float64 like positions, or None
        unless ``scores_tokens``; budgets: ``budgets()`` on the cache's device."""
        raise NotImplementedError


class SlidingWindow(Policy):
    """Keep the last ``window`` positions (an int, or one per kv head)."""

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
    """Keep the first ``sinks`` positions and the last ``window`` (StreamingLLM's attention
    sinks plus a window)."""

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


class HeavyHitters(Policy):
    """H2O: the ``recent`` newest tokens plus the highest-scored others, ``budget`` in all."""

    scores_tokens = True

    def __init__(self, budget: int | Sequence[int] | HeadAdaptive, recent: int) -> None:
        self.budget = budget
        self.recent = _count("recent", recent, minimum=0)
        if not isinstance(budget, (HeadAdaptive, Sequence, np.ndarray)):
            if _count("budget", budget) < self.recent:
                raise ValueError(f"recent={recent} must not exceed budget={budget}")

    def bind(self, kv_heads: int, page_size: int, capacity: int | None) -> None:
        super().bind(kv_heads, page_size, capacity)
        if isinstance(self.budget, HeadAdaptive):
            if self.budget.total < kv_heads * self.recent:
                raise ValueError(
                    f"budget: head_adaptive({self.budget.total}) cannot keep recent={self.recent} "
                    f"tokens in each of {kv_heads} kv heads"
                )
            self._budget = None
            return
        self._budget = _per_head("budget", self.budget, kv_heads)
        if (self._budget < self.recent).any():
            raise ValueError(f"recent={self.recent} must not exceed any budget, got {self.budget}")

    def budgets(self) -> np.ndarray:
        if self._budget is None:  # head-adaptive: one head may take all but the others' recent
            total = self.budget.total
            return np.full(self.kv_heads, total - (self.kv_heads - 1) * self.recent)
        return self._budget

    def keep(self, xp, lengths, positions, scores, budgets):
        batch, kv_heads, n = positions.shape
        valid = positions != EMPTY
        recent = valid & (positions >= lengths[:, None, None] - self.recent)
        # the recent first (an infinite score), then the others by score (>= 0), newer first;
        # no candidate last (-1)
        worth = xp.where(recent, xp.inf, xp.where(valid, scores, -1.0))
        keys = [-positions, -worth]
        if self._budget is not None:
            rank = _ranks(xp, [key.reshape(batch * kv_heads, n) for key in keys])
            return valid & (rank.reshape(positions.shape) < budgets[None, :, None])
        # head-adaptive: one ranking over the sequence's heads, laid out head by head, so the
        # stable sorts leave ties to the lower head
        rank = _ranks(xp, [key.reshape(batch, kv_heads * n) for key in keys])
        return valid & (rank.reshape(positions.shape) < self.budget.total)

    def __repr__(self) -> str:
        return f"HeavyHitters(budget={self.budget!r}, recent={self.recent})"


class Quest(Policy):
    """Evicts nothing; each decode query reads ``pages`` pages chosen by their key bounds plus
    the newest page (``page_size`` must be the cache's)."""

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
