"""decode_attention: the newest queries of each sequence against the tokens a KVCache keeps.

q [batch, heads, t_q, head_dim] holds each sequence's last t_q positions (a step: t_q = 1;
speculative or chunked decoding: more), causal against the kept keys: query i of sequence b is
position L_b - t_q + i and sees the kept tokens at positions <= it. heads is a multiple of the
cache's kv_heads (GQA: query head h reads kv head h // (heads / kv_heads)). Quest reads only
the pages it chooses per query (cuattn.policies); HeavyHitters gets every attended token's
probability, summed over the query heads of its group and the t_q queries, added to its score.

This is the reference computation, exact and written with the cache's array library (NumPy, or
CuPy on the device); it walks (sequence, kv head) pairs and gathers each pair's kept tokens.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from cuattn.adapters import dlpack
from cuattn.serving.cache import KVCache, _dtype_name, _on_device

__all__ = ["decode_attention"]


def _check(q: Any, cache: KVCache, scale: Any) -> tuple[int, float]:
    if not isinstance(cache, KVCache):
        raise TypeError(f"cache must be a cuattn.KVCache, got {type(cache).__name__}")
    if not hasattr(q, "shape") or not hasattr(q, "dtype"):
        raise TypeError(f"q must be an array, got {type(q).__name__}")
    shape = tuple(int(d) for d in q.shape)
    if len(shape) != 4 or shape[0] != cache.batch or shape[3] != cache.head_dim:
        raise ValueError(
            f"q must be [batch={cache.batch}, heads, t_q, head_dim={cache.head_dim}], got {shape}"
        )
    batch, heads, t_q, head_dim = shape
    if heads % cache.kv_heads:
        raise ValueError(
            f"q has heads={heads}, which is not a multiple of the cache's kv_heads={cache.kv_heads}"
        )
    if _dtype_name(q.dtype) != cache.dtype:
        raise TypeError(
            f"q has dtype {_dtype_name(q.dtype)}, the cache holds {cache.dtype} "
            "(cuattn never casts silently)"
        )
    shortest = int(cache.lengths.min())
    if not 1 <= t_q <= shortest:
        raise ValueError(
            f"q has t_q={t_q} queries per sequence; they are each sequence's newest tokens, so "
            f"1 <= t_q <= the shortest sequence ({shortest} tokens appended)"
        )
    cache._check_device("q", q)
    if scale is None:
        return heads // cache.kv_heads, float(head_dim) ** -0.5
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    return heads // cache.kv_heads, float(scale)


def _quest_pages(cache: KVCache, b: int, h: int, q_group: Any, length: int) -> np.ndarray:
    """bool [g, t_q, pages in table order]: the pages each query reads (Quest)."""
    xp, policy = cache.xp, cache.policy
    table = np.asarray(cache.tables[b][h], dtype=np.int64)
    lo, hi = cache.key_min[xp.asarray(table)], cache.key_max[xp.asarray(table)]
    qf = q_group.astype(xp.float32)[..., None, :]  # [g, t_q, 1, d]
    bound = xp.maximum(qf * lo, qf * hi).sum(axis=-1)  # [g, t_q, pages]
    bound = np.asarray(bound.get() if xp is not np else bound)
    newest = (length - 1) // cache.page_size
    chosen = np.zeros(bound.shape, dtype=bool)
    chosen[..., newest] = True
    others = np.delete(np.arange(len(table)), newest)
    order = np.argsort(-bound[..., others], axis=-1, kind="stable")[..., : policy.pages]
    np.put_along_axis(chosen, others[order], True, axis=-1)
    return chosen


def decode_attention(
    q: Any, cache: KVCache, scale: float | None = None, return_lse: bool = False
) -> Any:
    """Exact attention of q [batch, heads, t_q, head_dim] (each sequence's newest t_q tokens)
    over the tokens ``cache`` keeps (``cache.positions()``), causal, GQA; returns out like q
    (and lse [batch, heads, t_q], float32 or float64, -inf where nothing is attended)."""
    group, scale = _check(q, cache, scale)
    info = dlpack.describe(q, "q")
    xp = cache.xp
    batch, heads, t_q, head_dim = (int(d) for d in q.shape)
    acc = xp.float64 if cache.dtype == "float64" else xp.float32
    scores = cache.policy is not None and cache.policy.scores_tokens
    quest = cache.policy is not None and cache.policy.selects_pages
    with dlpack.stream_for(info), _on_device(cache.info):
        qb = dlpack.to_backend(q, info, "q")
        out = xp.zeros((batch, heads, t_q, head_dim), dtype=acc)
        lse = xp.full((batch, heads, t_q), -np.inf, dtype=acc)
        for b in range(batch):
            length = int(cache.lengths[b])
            q_pos = np.arange(length - t_q, length)
            for h in range(cache.kv_heads):
                pages, offsets, pos = cache.kept(b, h)
                if pos.size == 0:
                    continue
                heads_of = slice(h * group, (h + 1) * group)
                q_group = qb[b, heads_of]
                keys = cache.k_pages[xp.asarray(pages), xp.asarray(offsets)].astype(acc)
                values = cache.v_pages[xp.asarray(pages), xp.asarray(offsets)].astype(acc)
                s = (q_group.astype(acc) @ keys.T) * scale  # [g, t_q, n]
                allowed = np.broadcast_to(pos[None, :] <= q_pos[:, None], s.shape)
                if quest:
                    chosen = _quest_pages(cache, b, h, q_group, length)
                    where = {page: i for i, page in enumerate(cache.tables[b][h])}
                    page_index = np.array([where[p] for p in pages])
                    allowed = allowed & chosen[..., page_index]
                allowed = xp.asarray(np.ascontiguousarray(allowed))
                s = xp.where(allowed, s, -xp.inf)
                m = s.max(axis=-1, keepdims=True)
                m = xp.where(xp.isfinite(m), m, 0.0)
                p = xp.where(allowed, xp.exp(s - m), 0.0)
                total = p.sum(axis=-1, keepdims=True)
                safe = xp.where(total > 0, total, 1.0)
                out[b, heads_of] = (p @ values) / safe
                lse[b, heads_of] = xp.where(total > 0, m + xp.log(safe), -xp.inf)[..., 0]
                if scores:
                    mass = (p / safe).sum(axis=(0, 1))
                    mass = mass.get() if xp is not np else mass
                    cache.slot_score[pages, offsets] += mass
        result = out.astype(qb.dtype)
        out_q, lse_q = dlpack.from_backend(result, info), dlpack.from_backend(lse, info)
    return (out_q, lse_q) if return_lse else out_q
