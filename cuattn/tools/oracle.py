"""The dense float64 oracle that every backend is checked against (tests and `cuattn check`).

Tiny on purpose: softmax(QK^T * scale, masked) V written with full n_q x n_k arrays in float64,
and its gradients, so use small n. k and v may have fewer heads than q (GQA/MQA: query head h
reads kv head h // (heads / kv_heads)); the oracle repeats them, which the kernels never do.
Rows with no allowed key give 0 and lse = -inf. Works on NumPy arrays, and on CuPy arrays (mask
included) so GPU tests check real sizes on the GPU.

NaN and inf follow docs/design.md §7 exactly: a masked score is replaced by -inf (never
multiplied); a NaN or +inf among a row's allowed scores makes its softmax NaN (inf - inf), lse
included, and P NaN over the whole row; a -inf score is a zero probability, and a row whose
allowed scores are all -inf gives 0 and -inf like a row with no allowed key. Every other special
value goes where dense arithmetic takes it, including 0 * NaN = NaN in P V, dO V^T, dS K and
dS^T Q. By default every (query, key) pair of the head takes part, as in a dense P V (SDPA); a
block-sparse backend computes only the pairs of its active blocks, so ``computed`` (bool
[heads, n_q, n_k], e.g. :func:`computed_pairs`) restricts the products to those pairs: a pair
outside it adds nothing at all, not 0 * x. With finite inputs ``computed`` changes nothing.
``score_dtype`` (e.g. float32, the backends' accumulation type for float32 and half inputs)
forms the scores in that type, so that one beyond its range is +-inf there too.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from cuattn._util import array_module, host_array
from cuattn.backends.dropout import keep_mask

# Below this magnitude errors are measured as absolute: a gradient that is exactly 0 in exact
# arithmetic (a row with a single key) comes out as rounding noise, which has no relative size.
REL_FLOOR = 1e-3
# Gradients of unit-normal inputs are O(0.1..1); one that is exactly zero (a query with one key)
# is cancellation noise of O(eps) in dP - delta, measured against this magnitude.
GRAD_FLOOR = 0.1
T = TypeVar("T")


def alibi_bias(slopes: Any, batch: int, n_q: int, n_k: int) -> Any:
    """ALiBi's additive bias [batch, heads, n_q, n_k] in float64 from slopes [heads] or [batch,
    heads]: -slope * |i + n_k - n_q - j| (end-aligned query positions, FlashAttention's)."""
    xp = array_module(slopes)
    (slopes,) = _float64(slopes)
    slopes = xp.broadcast_to(slopes, (batch, slopes.shape[-1]))
    q_pos = xp.arange(n_q, dtype=xp.float64) + (n_k - n_q)
    distance = xp.abs(q_pos[:, None] - xp.arange(n_k, dtype=xp.float64)[None, :])
    return -slopes[:, :, None, None] * distance


def dropout_factors(p: float, seed: int, batch: int, heads: int, n_q: int, n_k: int) -> np.ndarray:
    """What dropout multiplies each probability by, float64 [batch, heads, n_q, n_k]: 0 where
    cuattn's generator drops it (backends/dropout.py), 1 / (1 - p) where it keeps it."""
    keep = keep_mask(
        p,
        seed,
        np.arange(batch)[:, None, None, None],
        np.arange(heads)[None, :, None, None],
        np.arange(n_q)[None, None, :, None],
        np.arange(n_k)[None, None, None, :],
    )
    return np.where(keep, 1.0 / (1.0 - p), 0.0)


def rel_columns(n_q: int, n_k: int, max_distance: int) -> np.ndarray:
    """The relative-position table's column [n_q, n_k] of each (query, key): clamp(k_pos -
    q_pos, -M, M) + M with end-aligned query positions q_pos = i + n_k - n_q."""
    q_pos = np.arange(n_q) + (n_k - n_q)
    rel = np.arange(n_k)[None, :] - q_pos[:, None]
    return np.clip(rel, -max_distance, max_distance) + max_distance


def rel_position_bias(table: Any, batch: int, n_q: int, n_k: int) -> Any:
    """A relative-position table's additive bias [batch, heads, n_q, n_k] in float64 from the
    table [heads, 2 M + 1] or [batch, heads, 2 M + 1]: table[.., rel_columns(n_q, n_k, M)]."""
    xp = array_module(table)
    (table,) = _float64(table)
    table = xp.broadcast_to(table, (batch, *table.shape[-2:]))
    columns = xp.asarray(rel_columns(n_q, n_k, (table.shape[-1] - 1) // 2))
    return table[:, :, columns]


def rel_table_gradient(dbias: np.ndarray, max_distance: int, per_batch: bool) -> np.ndarray:
    """A relative-position table's gradient [(batch,) heads, 2 M + 1] from the gradient of each
    biased score [batch, heads, n_q, n_k]: each column sums the scores that read it."""
    batch, heads, n_q, n_k = dbias.shape
    columns = rel_columns(n_q, n_k, max_distance).ravel()
    grad = np.zeros((batch, heads, 2 * max_distance + 1))
    for b in range(batch):
        for h in range(heads):
            np.add.at(grad[b, h], columns, dbias[b, h].ravel())
    return grad if per_batch else grad.sum(axis=0)


def _scores(q: Any, k: Any, scale: float, score_dtype: Any, softcap: float) -> tuple[Any, Any]:
    """(S, dS_capped/dS_scaled): scale * q.k, capped as ``softcap * tanh(s / softcap)`` when
    softcap > 0, and the cap's slope 1 - tanh^2 (1 without a cap), before any mask."""
    xp = array_module(q)
    s = xp.einsum("bhqd,bhkd->bhqk", q, k)
    if score_dtype is not None:  # formed as the backends do: q.k, then * scale, in that type
        s = (s.astype(score_dtype) * xp.dtype(score_dtype).type(scale)).astype(xp.float64)
    else:
        s = s * scale
    if not softcap:
        return s, 1.0
    t = xp.tanh(s / softcap)
    return softcap * t, 1.0 - t * t


def _probs(
    q: Any,
    k: Any,
    mask: Any,
    scale: float,
    score_dtype: Any = None,
    softcap: float = 0.0,
    bias: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """(P, row max, row sum, the cap's slope) of the masked softmax in float64 (l_sum == 0: an
    empty row); ``bias`` (or None) is added after the cap, before the mask."""
    xp = array_module(q)
    s, slope = _scores(q, k, scale, score_dtype, softcap)
    if bias is not None:
        s = s + bias
    s = xp.where(mask[None], s, -xp.inf)  # replaced, never multiplied
    m = s.max(axis=-1, keepdims=True)  # NaN-propagating
    m = xp.where(m == -xp.inf, 0.0, m)  # nothing but -inf: exp gives 0; NaN and +inf stay
    p = xp.exp(s - m)
    l_sum = p.sum(axis=-1, keepdims=True)
    return p / xp.where(l_sum == 0, 1.0, l_sum), m, l_sum, slope


def _rows_of(w: Any, x: Any, computed: Any) -> Any:
    """sum over keys of w[b, h, q, k] x[b, h, k, d] -> [b, h, q, d]; with ``computed``, a pair
    outside it adds nothing (not 0 * x)."""
    xp = array_module(w)
    if computed is None:
        return xp.einsum("bhqk,bhkd->bhqd", w, x)
    terms = w[..., None] * x[:, :, None, :, :]
    return xp.where(computed[None, ..., None], terms, 0.0).sum(axis=3)


def _cols_of(w: Any, x: Any, computed: Any) -> Any:
    """sum over queries of w[b, h, q, k] x[b, h, q, d] -> [b, h, k, d], as _rows_of."""
    xp = array_module(w)
    if computed is None:
        return xp.einsum("bhqk,bhqd->bhkd", w, x)
    terms = w[..., None] * x[:, :, :, None, :]
    return xp.where(computed[None, ..., None], terms, 0.0).sum(axis=2)


def computed_pairs(layout: Any) -> np.ndarray:
    """bool [heads, n_q, n_ctx]: the (query, key) pairs of ``layout``'s active blocks, in natural
    token order: what the NumPy backend computes. The kernels compute the same pairs for block
    sizes 16-64 below head dim 96; they skip the sub-tiles of a block that the element rule
    empties (block 128, head dims >= 96) and compute block 8 layouts on 16-blocks."""
    b = layout.blocksize
    full = np.repeat(np.repeat(np.asarray(layout.blocks, bool), b, axis=1), b, axis=2)
    pairs = full[:, : layout.n_q, : layout.n_ctx]
    if layout.perm is not None:
        natural = np.zeros_like(pairs)
        natural[:, layout.perm[:, None], layout.perm[None, :]] = pairs
        pairs = natural
    return pairs


def _float64(*arrays: Any) -> list[Any]:
    return [
        x.astype(array_module(x).float64) if hasattr(x, "astype") else np.float64(x) for x in arrays
    ]


def _repeat_kv(q: Any, *kv: Any) -> list[Any]:
    group = q.shape[1] // kv[0].shape[1]
    return [array_module(x).repeat(x, group, axis=1) for x in kv]


def _sum_groups(grad: Any, kv_heads: int) -> Any:
    batch, heads = grad.shape[:2]
    return grad.reshape((batch, kv_heads, heads // kv_heads) + grad.shape[2:]).sum(axis=2)


def _quiet(fn: Callable[..., T]) -> Callable[..., T]:
    """NaN and inf go where dense arithmetic takes them, without NumPy's warnings about it."""

    @functools.wraps(fn)
    def quiet(*args: Any, **kwargs: Any) -> T:
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            return fn(*args, **kwargs)

    return quiet


@_quiet
def dense_attention(
    q: Any,
    k: Any,
    v: Any,
    mask: Any,
    scale: float,
    computed: Any = None,
    score_dtype: Any = None,
    softcap: float = 0.0,
    bias: Any = None,
    dropout: Any = None,
) -> tuple[Any, Any]:
    """(out, lse) in float64; mask bool [heads, n_q, n_k]. Rows with no allowed key (or only
    -inf scores): 0, -inf. ``computed``, ``score_dtype``: see the module docstring; ``softcap``
    > 0 caps the scaled scores (``softcap * tanh(s / softcap)``) before the mask; ``bias``
    ([batch, heads, n_q, n_k], e.g. :func:`alibi_bias`) is added after the cap; ``dropout``
    ([batch, heads, n_q, n_k]: 0 for a dropped probability, 1 / (1 - p) for a kept one, e.g.
    :func:`dropout_factors`) multiplies the probabilities (the lse is of every score)."""
    q, k, v = _float64(q, k, v)
    k, v = _repeat_kv(q, k, v)
    xp = array_module(q)
    p, m, l_sum, _ = _probs(q, k, mask, scale, score_dtype, softcap, bias)
    empty = l_sum[..., 0] == 0
    if dropout is not None:
        p = p * dropout
    out = xp.where(empty[..., None], 0.0, _rows_of(p, v, computed))
    lse = xp.where(empty, -xp.inf, m[..., 0] + xp.log(xp.where(empty, 1.0, l_sum[..., 0])))
    return out, lse


@_quiet
def dense_attention_grads(
    q: Any,
    k: Any,
    v: Any,
    dout: Any,
    mask: Any,
    scale: float,
    dlse: Any = None,
    computed: Any = None,
    score_dtype: Any = None,
    softcap: float = 0.0,
    bias: Any = None,
    dropout: Any = None,
) -> tuple[Any, ...]:
    """(dq, dk, dv) in float64 of sum(out * dout) + sum(lse * dlse) (dlse [batch, heads, n_q]
    or None; rows with no allowed key take no part); dk, dv with k's and v's heads.
    ``computed``, ``score_dtype``, ``softcap``, ``dropout``: as for :func:`dense_attention`.
    With ``bias``, its gradient [batch, heads, n_q, n_k] follows (the gradient of each biased
    score)."""
    q, k, v, dout = _float64(q, k, v, dout)
    kv_heads = k.shape[1]
    k, v = _repeat_kv(q, k, v)
    xp = array_module(q)
    p, _, l_sum, slope = _probs(q, k, mask, scale, score_dtype, softcap, bias)
    kept = p if dropout is None else p * dropout  # what multiplies v
    dv = _cols_of(kept, dout, computed)
    dp = xp.einsum("bhqd,bhkd->bhqk", dout, v)
    if dropout is not None:  # d out / d p passes through the kept ones, scaled
        dp = dp * dropout
    if computed is not None:  # a pair outside takes no part in dS either
        dp = xp.where(computed[None], dp, 0.0)
    # delta = rowsum(dO * O), as the backends form it: an empty row's O is a written 0, so its
    # delta is 0 whatever 0 * NaN its P V would have held
    out = xp.where(l_sum == 0, 0.0, _rows_of(kept, v, computed))
    delta = (dout * out).sum(axis=-1, keepdims=True)
    if dlse is not None:  # d lse_i / d s_ij = p_ij: dS = P * (dP - (delta - dlse))
        (dlse,) = _float64(dlse)
        delta = delta - dlse[..., None]
    ds_biased = p * (dp - delta)
    ds = ds_biased * slope
    dq = _rows_of(ds, k, computed) * scale
    dk = _cols_of(ds, q, computed) * scale
    grads = dq, _sum_groups(dk, kv_heads), _sum_groups(dv, kv_heads)
    return grads if bias is None else (*grads, ds_biased)


def rel_err(x: Any, ref: Any, floor: float = REL_FLOOR) -> float:
    """max |x - ref| / max(max |ref|, floor) (0 for empty arrays)."""
    (x,) = _float64(x)
    if x.size == 0:
        return 0.0
    xp = array_module(x)
    scale = max(float(xp.abs(ref).max()), floor)
    return float(xp.abs(x - ref).max() / scale)


def kept_attention(
    cache: Any,
    q: Any,
    scale: float | None = None,
    softcap: float = 0.0,
    alibi_slopes: Any = None,
    key_bias: Any = None,
    rel_bias: Any = None,
    dropout: tuple[float, int] | None = None,
) -> np.ndarray:
    """float64 [batch, heads, t_q, head_dim] on the host: decode attention of q (each
    sequence's newest t_q positions, query head h on kv head h // (heads / kv_heads)) over
    exactly the tokens a ``cuattn.KVCache`` keeps (``cache.kept``), causal; ``softcap`` as for
    :func:`dense_attention`; ``alibi_slopes`` ([heads] or [batch, heads]) adds ALiBi's
    ``-slope * (query position - token position)``, ``key_bias`` ([batch, time_k] or [batch,
    heads, time_k]) the bias of each token's position, ``rel_bias`` ([heads, 2 M + 1] or
    [batch, heads, 2 M + 1]) the table's column clamp(token - query position, -M, M) + M;
    ``dropout`` (p, seed) drops probabilities by cuattn's generator at (query position, token
    position, query head, batch)."""
    q = host_array(q)
    batch, heads, t_q, head_dim = q.shape
    group = heads // cache.kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = np.zeros(q.shape)
    for b in range(batch):
        length = int(cache.lengths[b])
        q_pos = np.arange(length - t_q, length)
        for h in range(cache.kv_heads):
            pages, offsets, pos = cache.kept(b, h)
            rows = slice(h * group, (h + 1) * group)
            mask = np.broadcast_to(pos[None, :] <= q_pos[:, None], (group, t_q, len(pos)))
            # the values the cache holds (an fp8 cache's dequantised codes)
            at = (cache.xp.asarray(pages), cache.xp.asarray(offsets))
            keys, values = (host_array(x) for x in cache.token_values(*at))
            one = (q[b : b + 1, rows], keys[None, None], values[None, None])
            bias = np.zeros((1, group, 1, len(pos)))
            if alibi_slopes is not None:
                slopes = np.broadcast_to(host_array(alibi_slopes), (batch, heads))[b, rows]
                distance = (q_pos[:, None] - pos[None, :]).astype(np.float64)
                bias = bias - slopes.astype(np.float64)[None, :, None, None] * distance
            if key_bias is not None:
                kb = host_array(key_bias).astype(np.float64)
                kb = np.broadcast_to(
                    kb[b][None] if kb.ndim == 2 else kb[b, rows], (group, kb.shape[-1])
                )
                bias = bias + kb[:, pos][None, :, None, :]
            if rel_bias is not None:
                table = host_array(rel_bias).astype(np.float64)
                table = table if table.ndim == 2 else table[b]
                reach = (table.shape[-1] - 1) // 2
                column = np.clip(pos[None, :] - q_pos[:, None], -reach, reach) + reach
                bias = bias + table[rows][:, column][None]
            factors = None
            if dropout is not None:
                p, seed = dropout
                query_heads = np.arange(rows.start, rows.stop)[:, None, None]
                keep = keep_mask(p, seed, b, query_heads, q_pos[:, None], pos)
                factors = np.where(keep, 1.0 / (1.0 - p), 0.0)[None]
            kw = dict(softcap=softcap, bias=bias, dropout=factors)
            out[b, rows] = dense_attention(*one, mask, scale, **kw)[0][0]
    return out
