"""NumPy backend: block-sparse attention over the active blocks only, forward and backward.

This is the CPU path of every public call and the readable statement of what the kernels do.
Shapes: q, out, dout [batch, heads, n_q, head_dim]; k, v [batch, kv_heads, n_ctx, head_dim] with
kv_heads dividing heads (query head h reads kv head h // (heads / kv_heads): GQA/MQA); lse
[batch, heads, n_q]. Nothing of size n_q x n_ctx is built: the walk visits one active block per
row at a time. dK and dV of a kv head sum its query heads' contributions, in a fixed order.

Forward (FlashAttention-2 order): for each (head, query block i) walk its CSR row of active key
blocks j; every step is vectorised over all rows that still have a block left, so the Python
loop runs max-row-length times. Online softmax state per query row: running max ``m_i``,
running sum ``l_i`` and the unnormalised output ``acc``.
Backward: ``delta = rowsum(dO * O) - dLSE`` (dLSE: the gradient reaching the lse output, zero
when unused); dQ walks the CSR rows, dK and dV walk the CSC columns, each
recomputing P = exp(S - lse) from the saved log-sum-exp, so only q, k, v, out and lse are needed.
Score modifiers (``ScoreMods``: softcap) apply to ``scale * q.k`` before the mask; the backward
multiplies dS by their derivative.
Precision: float64 accumulates in float64, float32 and float16 in float32; results are cast back
to the input dtype (lse stays in the accumulation type).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import numpy as np

from cuattn.backends.call import AttentionCall, ScoreMods, ScoreOperands, rel_max_distance
from cuattn.backends.dropout import keep_mask
from cuattn.layout.layout import Layout

SUPPORTED_DTYPES = (np.float16, np.float32, np.float64)
T = TypeVar("T")


def _acc_dtype(dtype: np.dtype) -> type:
    return np.float64 if dtype == np.float64 else np.float32


def _blocked(x: np.ndarray, layout: Layout, acc: type, fill: float = 0.0) -> np.ndarray:
    """[B, H, n, ...] -> [B, H, nb, b, ...] in the accumulation dtype, padded with ``fill``
    (n is the layout's n_q or n_ctx, whichever x's length is)."""
    b, n = layout.blocksize, x.shape[2]
    nb = -(-n // b)
    out = np.full(x.shape[:2] + (nb * b,) + x.shape[3:], fill, dtype=acc)
    out[:, :, :n] = x
    return out.reshape(x.shape[:2] + (nb, b) + x.shape[3:])


def _unblocked(x: np.ndarray, n: int) -> np.ndarray:
    return x.reshape(x.shape[:2] + (-1,) + x.shape[4:])[:, :, :n]


def _walk(
    layout: Layout, ptr: np.ndarray, idx: np.ndarray, mask: np.ndarray
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Yield (head, walked block, other block, mask id) for step t of every compressed row."""
    nb = ptr.shape[1] - 1
    starts = ptr[:, :-1].reshape(-1).astype(np.int64)
    lens = np.diff(ptr, axis=1).reshape(-1)
    rows = np.arange(layout.heads * nb)
    heads, walked = rows // nb, rows % nb
    for t in range(int(lens.max(initial=0))):
        sel = lens > t
        entry = starts[sel] + t
        yield heads[sel], walked[sel], idx[entry].astype(np.int64), mask[entry]


def _scores(
    qb: np.ndarray,
    kb: np.ndarray,
    layout: Layout,
    h,
    i,
    j,
    mask_id,
    scale: float,
    mods: ScoreMods,
    biases: ScoreOperands,
) -> tuple[np.ndarray, np.ndarray | float]:
    """(S, bias) for R blocks at once: S = Q_i K_j^T * scale, modified (softcap), plus the
    walk's biases (ALiBi's slopes [B, H], the key bias blocked [B, H, nb, b], the
    relative-position table [B, H, 2 M + 1], each or None), then -inf where the element rule
    forbids; ``bias`` is what the biases added (0 without them), for the gradients."""
    slopes, key_bias, rel_bias = biases.alibi_slopes, biases.key_bias, biases.rel_bias
    score_bias = biases.score_bias
    s = np.matmul(qb[:, h, i], kb[:, _kv_head(h, qb, kb), j].swapaxes(-1, -2)) * scale
    s = modified_scores(s, mods, np)
    bias: np.ndarray | float = 0.0
    if slopes is not None:
        bias = -slopes[:, h, None, None] * np.abs(_q_minus_k(layout, i, j))
    if key_bias is not None:
        bias = bias + key_bias[:, h, j][:, :, None, :]
    if rel_bias is not None:
        bias = bias + rel_bias[:, h[:, None, None], _rel_index(layout, i, j, rel_bias)]
    if score_bias is not None:
        rows, cols, inside = _tile_positions(layout, i, j, score_bias.shape[2:])
        tiles = score_bias[:, h[:, None, None], rows, cols].astype(s.dtype)
        bias = bias + np.where(inside, tiles, 0.0)  # the padding beyond n_q, n_k: masked
    s = s + bias
    allowed = layout.block_masks(h, i, j, mask_id)
    return np.where(allowed, s, -np.inf), bias


def _dropped(x: np.ndarray, layout: Layout, h, i, j, mods: ScoreMods) -> np.ndarray:
    """x [B, R, b, b] (probabilities, or their gradient) of R blocks with dropout applied:
    kept elements times 1 / (1 - p), dropped ones 0 (backends/dropout.py's generator)."""
    if not mods.dropout_p:
        return x
    b = layout.blocksize
    offsets = np.arange(b)
    q = (i[:, None] * b + offsets)[None, :, :, None]
    k = (j[:, None] * b + offsets)[None, :, None, :]
    batch = np.arange(x.shape[0])[:, None, None, None]
    keep = keep_mask(mods.dropout_p, mods.dropout_seed, batch, h[None, :, None, None], q, k)
    return np.where(keep, x / (1.0 - mods.dropout_p), 0.0)


def _q_minus_k(layout: Layout, i: np.ndarray, j: np.ndarray) -> np.ndarray:
    """q_pos - k_pos [R, b, b] of query blocks i against key blocks j, with the end-aligned
    query positions q + q_offset (as FlashAttention places them for ALiBi)."""
    b = layout.blocksize
    offsets = np.arange(b)
    q_pos = (i[:, None] * b + offsets) + layout.q_offset
    k_pos = j[:, None] * b + offsets
    return q_pos[:, :, None] - k_pos[:, None, :]


def _tile_positions(
    layout: Layout, i: np.ndarray, j: np.ndarray, sizes: tuple[int, int]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query index [R, b, 1], key index [R, 1, b], whether both are below ``sizes`` = (n_q,
    n_k) [R, b, b]) of the elements of query blocks i against key blocks j, the indices
    clipped into range (a tile's padding reads a real element, then masked)."""
    b = layout.blocksize
    offsets = np.arange(b)
    rows = (i[:, None] * b + offsets)[:, :, None]
    cols = (j[:, None] * b + offsets)[:, None, :]
    inside = (rows < sizes[0]) & (cols < sizes[1])
    return np.minimum(rows, sizes[0] - 1), np.minimum(cols, sizes[1] - 1), inside


def _rel_index(layout: Layout, i: np.ndarray, j: np.ndarray, rel_bias: np.ndarray) -> np.ndarray:
    """The relative-position table's column [R, b, b] of each element: clamp(k_pos - q_pos,
    -M, M) + M for a table of 2 M + 1 columns."""
    m = rel_max_distance(rel_bias)
    return np.clip(-_q_minus_k(layout, i, j), -m, m) + m


def modified_scores(s: Any, mods: ScoreMods, xp: Any) -> Any:
    """Scaled scores ``s`` (NumPy or CuPy, module ``xp``) with the score modifiers applied:
    softcap's ``softcap * tanh(s / softcap)``. The one statement of them for the references
    (this one and decode_attention's)."""
    if mods.softcap:
        return mods.softcap * xp.tanh(s / mods.softcap)
    return s


def _mods_gradient(s: np.ndarray, ds: np.ndarray, mods: ScoreMods) -> np.ndarray:
    """dS with respect to the scaled scores before the modifiers, from ``ds`` with respect to
    the modified scores ``s``: softcap's tanh contributes 1 - (s / softcap)^2 (0 where masked)."""
    if not mods.softcap:
        return ds
    t = s / mods.softcap
    return ds * np.maximum(1.0 - t * t, 0.0)


def _kv_head(h: np.ndarray, qb: np.ndarray, kb: np.ndarray) -> np.ndarray:
    """The kv head query head h reads (GQA/MQA: heads / kv_heads query heads per kv head)."""
    return h // (qb.shape[1] // kb.shape[1])


def check_arrays(q: np.ndarray) -> None:
    """The dtypes this backend computes in (the Backend wrapper asks before computing)."""
    if q.dtype.type not in SUPPORTED_DTYPES:
        names = ", ".join(np.dtype(t).name for t in SUPPORTED_DTYPES)
        raise TypeError(
            f"the numpy backend accepts dtypes {names}; got q.dtype={q.dtype} (cuattn never "
            "casts silently: pass float32, or backend='interp' on the CPU for bfloat16)"
        )


def _quiet_specials(fn: Callable[..., T]) -> Callable[..., T]:
    """NaN and inf take the course of a dense float64 computation (docs/design.md §7): the
    invalid operations that carry them (inf - inf, 0 * inf) are expected, not warned about.
    A fresh errstate per call (one shared instance is not thread-safe on NumPy 1.x)."""

    @functools.wraps(fn)
    def quiet(*args: Any, **kwargs: Any) -> T:
        with np.errstate(invalid="ignore", over="ignore"):
            return fn(*args, **kwargs)

    return quiet


@_quiet_specials
def attention_forward(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, call: AttentionCall
) -> tuple[np.ndarray, np.ndarray]:
    """(out, lse) of the call (its layout concrete, its dropout seed an int): out like q; lse
    [B, H, n] (-inf on rows with nothing to attend to). The call's score operands:
    ``alibi_slopes`` float32 [H] or [B, H], ``key_bias`` float32 [B, n_k] or [B, H, n_k],
    ``rel_bias`` float32 [H, 2 M + 1] or [B, H, 2 M + 1]."""
    layout, scale, mods = call.layout, call.scale, call.mods
    operands = call.operands
    alibi_slopes, key_bias, rel_bias = operands.alibi_slopes, operands.key_bias, operands.rel_bias
    acc_t = _acc_dtype(q.dtype)
    qb, kb, vb = (_blocked(x, layout, acc_t) for x in (q, k, v))
    slopes = _per_batch(alibi_slopes, q.shape[0], acc_t, 2)
    key_b = _key_bias(key_bias, q.shape[1], layout, acc_t)
    rel_b = _per_batch(rel_bias, q.shape[0], acc_t, 3)
    score_b = _broadcast_bias(operands.score_bias, q, k)
    biases = ScoreOperands(slopes, key_b, rel_b, score_b)
    m_i = np.full(qb.shape[:-1], -np.inf, dtype=acc_t)
    l_i = np.zeros(qb.shape[:-1], dtype=acc_t)
    acc = np.zeros(qb.shape, dtype=acc_t)
    for h, i, j, mask_id in _walk(layout, layout.row_ptr, layout.col_idx, layout.row_mask):
        s, _ = _scores(qb, kb, layout, h, i, j, mask_id, scale, mods, biases)
        m_old = m_i[:, h, i]
        m_new = np.maximum(m_old, s.max(axis=-1))  # NaN-propagating, unlike fmax
        # A row that has seen only masked (or -inf) scores keeps m = -inf: shift by 0 so exp
        # gives 0, not NaN. NaN and +inf stay: they are the dense computation's answer.
        m_safe = np.where(m_new == -np.inf, 0.0, m_new)
        p = np.exp(s - m_safe[..., None])
        alpha = np.exp(m_old - m_safe)
        l_i[:, h, i] = l_i[:, h, i] * alpha + p.sum(axis=-1)  # of every score, dropped or not
        p = _dropped(p, layout, h, i, j, mods)
        acc[:, h, i] = acc[:, h, i] * alpha[..., None] + np.matmul(p, vb[:, _kv_head(h, qb, vb), j])
        m_i[:, h, i] = m_new
    # l_i == 0: no allowed key, or only -inf scores (zero probability everywhere): out 0 and
    # lse -inf, written rather than computed, whatever acc holds (0 * NaN from v). A NaN l_i
    # (NaN or +inf score) gives NaN for both.
    empty = l_i == 0
    l_safe = np.where(empty, 1.0, l_i)
    out = np.where(empty[..., None], 0.0, acc / l_safe[..., None])
    lse = np.where(empty, -np.inf, m_i + np.log(l_safe))
    n_q = q.shape[2]
    return _unblocked(out, n_q).astype(q.dtype), _unblocked(lse, n_q).astype(acc_t)


@_quiet_specials
def attention_backward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    dout: np.ndarray,
    dlse: np.ndarray | None,
    call: AttentionCall,
) -> tuple[np.ndarray, ...]:
    """(dq, dk, dv) from the saved out and lse; each like its input. ``dlse`` (like lse, or
    None for zero) is the gradient reaching the lse output: since d lse_i / d s_ij = P_ij, it
    enters as dS = P * (dP - (delta - dlse)), one subtraction where delta is formed. The call
    is the forward's; with ALiBi's slopes, their gradient (like them, float32)
    follows dv: -sum of dS * |q_pos - k_pos| over the keys and queries (and the batch for [H]);
    then with a key bias its gradient (like it, float32): the sum of dS over the queries (and
    the heads for [B, n_k]); then with a relative-position table its gradient (like it): the
    sum of dS over the elements each column reaches (and the batch for [H, 2 M + 1])."""
    layout, scale, mods = call.layout, call.scale, call.mods
    operands = call.operands
    alibi_slopes, key_bias, rel_bias = operands.alibi_slopes, operands.key_bias, operands.rel_bias
    acc_t = _acc_dtype(q.dtype)
    slopes = _per_batch(alibi_slopes, q.shape[0], acc_t, 2)
    dslopes = None if slopes is None else np.zeros_like(slopes)
    rel_b = _per_batch(rel_bias, q.shape[0], acc_t, 3)
    drel = None if rel_b is None else np.zeros_like(rel_b)
    key_b = _key_bias(key_bias, q.shape[1], layout, acc_t)
    score_b = _broadcast_bias(operands.score_bias, q, k)
    wants_dscore = score_b is not None and not mods.score_bias_frozen
    dscore = _score_grid(q, k, layout, acc_t) if wants_dscore else None
    biases = ScoreOperands(slopes, key_b, rel_b, score_b)
    qb, kb, vb, dob = (_blocked(x, layout, acc_t) for x in (q, k, v, dout))
    row_delta = np.sum(dout.astype(acc_t) * out.astype(acc_t), axis=-1)
    if dlse is not None:
        row_delta = row_delta - dlse.astype(acc_t)
    delta = _blocked(row_delta, layout, acc_t)
    lse_b = _blocked(lse, layout, acc_t, fill=-np.inf)
    # lse -inf (no allowed key, or only -inf scores): P is exactly 0. A NaN lse (a NaN or +inf
    # score) gives P = NaN over the row's computed blocks, as a dense computation's exp(S - lse).
    lse_empty = lse_b == -np.inf
    lse_safe = np.where(lse_empty, 0.0, lse_b)

    def probs_and_dscores(h, i, j, mask_id):
        s, bias = _scores(qb, kb, layout, h, i, j, mask_id, scale, mods, biases)
        p = np.exp(s - lse_safe[:, h, i][..., None])
        p = np.where(lse_empty[:, h, i][..., None], 0.0, p)
        dp = np.matmul(dob[:, h, i], vb[:, _kv_head(h, qb, vb), j].swapaxes(-1, -2))
        dp = _dropped(dp, layout, h, i, j, mods)  # d / d(the probability, before dropout)
        ds_biased = p * (dp - delta[:, h, i][..., None])  # d / d(the score with its bias)
        # the capped score is the score less its biases; a -inf bias leaves -inf (p = 0)
        capped = np.where(s == -np.inf, -np.inf, s - bias)
        return p, ds_biased, _mods_gradient(capped, ds_biased, mods)

    dq = np.zeros_like(qb)
    for h, i, j, mask_id in _walk(layout, layout.row_ptr, layout.col_idx, layout.row_mask):
        _, ds_biased, ds = probs_and_dscores(h, i, j, mask_id)
        dq[:, h, i] += np.matmul(ds, kb[:, _kv_head(h, qb, kb), j]) * scale
        if dslopes is not None:  # d bias / d slope = -|q_pos - k_pos|
            moment = np.einsum("brqk,rqk->br", ds_biased, np.abs(_q_minus_k(layout, i, j)))
            np.add.at(dslopes.T, h, -moment.T)
        if dscore is not None:  # each element's dS, once (a row's blocks are distinct)
            rows, cols, _ = _tile_positions(layout, i, j, dscore.shape[2:])
            dscore[:, h[:, None, None], rows, cols] = ds_biased
        if drel is not None:  # each element adds its dS to the table column it read
            width = drel.shape[-1]
            column = h[:, None, None] * width + _rel_index(layout, i, j, rel_b)
            for b in range(drel.shape[0]):
                drel[b] += np.bincount(
                    column.ravel(), ds_biased[b].ravel(), minlength=drel[b].size
                ).reshape(drel[b].shape)
    # Per query head first (a walk step may hold several heads of one kv group, which an
    # indexed += would collapse), then each group summed in head order.
    heads, kv_heads = qb.shape[1], kb.shape[1]
    dk = np.zeros(kb.shape[:1] + (heads,) + kb.shape[2:], dtype=acc_t)
    dv = np.zeros_like(dk)
    dkey = None if key_b is None else np.zeros_like(key_b)  # per query head, blocked
    for h, j, i, mask_id in _walk(layout, layout.col_ptr, layout.row_idx, layout.col_mask):
        p, ds_biased, ds = probs_and_dscores(h, i, j, mask_id)
        if dkey is not None:
            dkey[:, h, j] += ds_biased.sum(axis=-2)
        p = _dropped(p, layout, h, i, j, mods)
        dv[:, h, j] += np.matmul(p.swapaxes(-1, -2), dob[:, h, i])
        dk[:, h, j] += np.matmul(ds.swapaxes(-1, -2), qb[:, h, i]) * scale
    group = heads // kv_heads
    dk, dv = (g.reshape((g.shape[0], kv_heads, group) + g.shape[2:]).sum(axis=2) for g in (dk, dv))
    n_q, n_k = q.shape[2], k.shape[2]
    grads = (
        _unblocked(dq, n_q).astype(q.dtype),
        _unblocked(dk, n_k).astype(k.dtype),
        _unblocked(dv, n_k).astype(v.dtype),
    )
    if dslopes is not None:
        summed = dslopes if alibi_slopes.ndim == 2 else dslopes.sum(axis=0)
        grads = (*grads, summed.astype(alibi_slopes.dtype))
    if dkey is not None:
        dkey = dkey.reshape(dkey.shape[:2] + (-1,))[:, :, :n_k]
        summed = dkey if key_bias.ndim == 3 else dkey.sum(axis=1)
        grads = (*grads, summed.astype(key_bias.dtype))
    if drel is not None:
        summed = drel if rel_bias.ndim == 3 else drel.sum(axis=0)
        grads = (*grads, summed.astype(rel_bias.dtype))
    if dscore is not None:
        grads = (*grads, _bias_gradient(dscore[:, :, :n_q, :n_k], operands.score_bias))
    elif score_b is not None:
        grads = (*grads, None)  # a frozen score bias: no gradient asked
    return grads


def _key_bias(
    key_bias: np.ndarray | None, heads: int, layout: Layout, acc: type
) -> np.ndarray | None:
    """The key bias as [B, H, nb, b] in the accumulation dtype (padded keys 0), or None."""
    if key_bias is None:
        return None
    full = key_bias if key_bias.ndim == 3 else key_bias[:, None, :]
    full = np.broadcast_to(full, (full.shape[0], heads, full.shape[-1]))
    return _blocked(full, layout, acc)


def _broadcast_bias(bias: np.ndarray | None, q: np.ndarray, k: np.ndarray) -> np.ndarray | None:
    """A score bias as a [B, H, n_q, n_k] view (broadcast, nothing copied), or None."""
    if bias is None:
        return None
    return np.broadcast_to(bias, (q.shape[0], q.shape[1], q.shape[2], k.shape[2]))


def _score_grid(q: np.ndarray, k: np.ndarray, layout: Layout, acc: type) -> np.ndarray:
    """Zeros [B, H, n_q, n_k] padded to whole blocks: a score bias's gradient while the walk
    writes it (0 outside the computed blocks)."""
    b = layout.blocksize
    n_q, n_k = (-(-n // b) * b for n in (q.shape[2], k.shape[2]))
    return np.zeros((q.shape[0], q.shape[1], n_q, n_k), dtype=acc)


def _bias_gradient(dscore: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """The gradient of a score bias from its broadcast one [B, H, n_q, n_k]: summed over each
    axis the bias broadcasts (size 1, or missing), shaped and typed like it."""
    padded = (1,) * (4 - bias.ndim) + bias.shape
    axes = tuple(a for a, d in enumerate(padded) if d == 1 and dscore.shape[a] != 1)
    return dscore.sum(axis=axes, keepdims=True).reshape(bias.shape).astype(bias.dtype)


def _per_batch(operand: np.ndarray | None, batch: int, acc: type, ndim: int) -> np.ndarray | None:
    """An operand that may leave out its batch axis (ALiBi's slopes [H] of [B, H], ndim 2; a
    relative-position table [H, W] of [B, H, W], ndim 3) with that axis, in the accumulation
    dtype; or None."""
    if operand is None:
        return None
    shape = operand.shape if operand.ndim == ndim else (batch, *operand.shape)
    return np.broadcast_to(operand, shape).astype(acc)


@_quiet_specials
def merge_states(
    out_a: np.ndarray, lse_a: np.ndarray, out_b: np.ndarray, lse_b: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The attention over keys A u B from partial results over disjoint A and B: out like
    out_a, lse in the accumulation dtype. A side with lse = -inf contributes nothing (whatever
    its out holds); both empty give 0 and -inf. A side that contributes carries NaN and inf as
    the dense formula does: a NaN or +inf lse, or a NaN in its out, makes the row NaN."""
    acc_t = _acc_dtype(out_a.dtype)
    a, b = lse_a.astype(acc_t), lse_b.astype(acc_t)
    base = np.maximum(a, b)  # NaN-propagating
    base_safe = np.where(base == -np.inf, 0.0, base)
    parts, total = [], np.zeros_like(base_safe)
    for lse_x, x in ((a, out_a), (b, out_b)):
        empty = lse_x == -np.inf
        w = np.where(empty, 0.0, np.exp(lse_x - base_safe))  # +inf - +inf: NaN, as dense
        total = total + w
        parts.append(np.where(empty[..., None], 0.0, w[..., None] * x.astype(acc_t)))
    none = total == 0
    total_safe = np.where(none, 1.0, total)
    out = np.where(none[..., None], 0.0, (parts[0] + parts[1]) / total_safe[..., None])
    lse = np.where(none, -np.inf, base_safe + np.log(total_safe))
    return out.astype(out_a.dtype), lse.astype(acc_t)
