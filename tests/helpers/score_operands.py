"""One check of a backend with the score operands (ALiBi's slopes, a key bias, a relative-position
table; any of them, with a softcap and dropout) against the float64 dense oracle: forward, dq,
dk, dv and each operand's gradient. Shared by the kernel-level tests of tests/backends:
test_alibi.py, test_key_bias.py, test_rel_bias.py and test_dropout.py."""

from __future__ import annotations

import numpy as np

from cuattn.backends.call import AttentionCall, ScoreMods, ScoreOperands, is_seed_array
from cuattn.backends.dropout import seed_of
from cuattn.tools.oracle import (
    alibi_bias,
    dense_attention,
    dense_attention_grads,
    dropout_factors,
    rel_err,
    rel_position_bias,
    rel_table_gradient,
)

# An operand's gradient comes back in float32, as the operand; it sums n_q x n_k products of dS
# (and a distance, for the slopes): the float32 rounding bounds it for float64 inputs.
OPERAND_TOLERANCE = {"float64": 1e-6, "float32": 1e-5, "float16": 1e-2, "bfloat16": 2e-2}


def check_operands(
    backend,
    q,
    k,
    v,
    dout,
    layout,
    tolerance,
    softcap=0.0,
    slopes=None,
    key_bias=None,
    dlse=None,
    rel_bias=None,
    dropout=None,
    score_bias=None,
):
    """``backend``'s (out, lse, grads) with these operands, each checked against the oracle;
    grads: dq, dk, dv, then the gradient of each operand given (slopes first). ``score_bias``:
    broadcastable to [batch, heads, n_q, n_k]; its gradient is the oracle's summed over the
    axes it broadcasts."""
    scale = q.shape[-1] ** -0.5
    seed_words = None  # dropout's seed as an array (an operand of its own)
    if dropout is not None and is_seed_array(dropout[1]):
        seed_words = dropout[1]
    operands = ScoreOperands(slopes, key_bias, rel_bias, score_bias, seed_words)
    mods = ScoreMods(softcap)
    factors = None
    if dropout is not None:  # (p, seed: an int or an array holding one)
        mods = mods.with_dropout(*dropout)
        seed = dropout[1] if seed_words is None else seed_of(seed_words)
        factors = dropout_factors(dropout[0], seed, q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    mask = layout.to_mask()
    batch, n_q, n_k = q.shape[0], q.shape[2], k.shape[2]
    bias = np.zeros((1, 1, 1, 1))
    if slopes is not None:
        alibi = alibi_bias(slopes, batch, n_q, n_k)
        bias = bias + alibi
    if key_bias is not None:
        per_key = key_bias.astype(np.float64)
        bias = bias + (per_key if per_key.ndim == 3 else per_key[:, None, :])[:, :, None, :]
    if rel_bias is not None:
        bias = bias + rel_position_bias(rel_bias, batch, n_q, n_k)
    if score_bias is not None:
        bias = bias + score_bias.astype(np.float64)
    out, lse = backend.forward(
        q, k, v, AttentionCall(layout, scale, mods=mods).with_operands(operands)
    )
    ref_out, ref_lse = dense_attention(
        q, k, v, mask, scale, softcap=softcap, bias=bias, dropout=factors
    )
    empty = np.isneginf(ref_lse)
    assert not np.isnan(np.asarray(out, np.float32)).any()
    np.testing.assert_array_equal(np.isneginf(lse), empty)
    assert rel_err(out, ref_out) <= tolerance
    assert rel_err(lse[~empty], ref_lse[~empty]) <= tolerance
    grads = backend.backward(
        q,
        k,
        v,
        out,
        lse,
        dout,
        dlse,
        AttentionCall(layout, scale, mods=mods).with_operands(operands),
    )
    *refs, dbias = dense_attention_grads(
        q, k, v, dout, mask, scale, dlse, softcap=softcap, bias=bias, dropout=factors
    )
    for name, grad, ref in zip("qkv", grads[:3], refs, strict=True):
        assert not np.isnan(np.asarray(grad, np.float32)).any(), f"d{name}"
        assert rel_err(grad, ref) <= tolerance, f"d{name}"
    dbias = np.nan_to_num(dbias, nan=0.0)  # a -inf bias: p = 0, no gradient
    dtype = "float64" if q.dtype == np.float64 else str(np.dtype(q.dtype))
    limit = OPERAND_TOLERANCE.get(dtype, tolerance)
    wrt = iter(grads[3:])
    if slopes is not None:
        distance = -alibi / np.broadcast_to(slopes, (batch, slopes.shape[-1]))[:, :, None, None]
        ref_dslopes = -(dbias * distance).sum(axis=(2, 3))
        ref_dslopes = ref_dslopes if slopes.ndim == 2 else ref_dslopes.sum(axis=0)
        dslopes = next(wrt)
        assert dslopes.dtype == np.float32 and dslopes.shape == slopes.shape
        assert rel_err(dslopes, ref_dslopes) <= limit, "dslopes"
    if key_bias is not None:
        ref_dkey = dbias.sum(axis=2)
        ref_dkey = ref_dkey if key_bias.ndim == 3 else ref_dkey.sum(axis=1)
        dkey = next(wrt)
        assert dkey.dtype == np.float32 and dkey.shape == key_bias.shape
        assert not np.isnan(dkey).any()
        assert rel_err(dkey, ref_dkey) <= limit, "dkey_bias"
    if rel_bias is not None:
        max_distance = (rel_bias.shape[-1] - 1) // 2
        ref_drel = rel_table_gradient(dbias, max_distance, per_batch=rel_bias.ndim == 3)
        drel = next(wrt)
        assert drel.dtype == rel_bias.dtype and drel.shape == rel_bias.shape
        assert not np.isnan(drel).any()
        assert rel_err(drel, ref_drel) <= limit, "drel_bias"
    if score_bias is not None:
        padded = (1,) * (4 - score_bias.ndim) + score_bias.shape
        ref_dscore = np.broadcast_to(dbias, (batch, q.shape[1], n_q, n_k))
        axes = tuple(a for a, d in enumerate(padded) if d == 1 and ref_dscore.shape[a] != 1)
        ref_dscore = ref_dscore.sum(axis=axes, keepdims=True).reshape(score_bias.shape)
        dscore = next(wrt)
        assert dscore.dtype == score_bias.dtype and dscore.shape == score_bias.shape
        assert not np.isnan(np.asarray(dscore, np.float32)).any()
        assert rel_err(dscore, ref_dscore) <= limit, "dscore_bias"
    if seed_words is not None:
        assert next(wrt) is None, "a seed has no gradient"
    assert next(wrt, "none left") == "none left"
    return out, lse, grads


def check_bit_identical(*args, **operands):
    """check_operands(*args, **operands) twice: both pass, and the second run gives the first's
    bits (out, lse and every gradient: each sum is taken in a fixed order)."""
    first, again = (check_operands(*args, **operands) for _ in range(2))
    for a, b in zip((first[0], first[1], *first[2]), (again[0], again[1], *again[2]), strict=True):
        np.testing.assert_array_equal(a, b)


def check_sets_its_flag(name, operand, flag, q, k, v, layout):
    """A call carrying operand ``name`` alone flags it (``flag``: the ScoreMods field the
    kernels' variant follows), holds it, drops it with without_operands, and changes the
    NumPy reference's output."""
    from cuattn.backends import forward

    call = AttentionCall(layout, 0.5, backend="numpy").with_operands(
        ScoreOperands(**{name: operand})
    )
    assert getattr(call.mods, flag) and sum(call.mods.given) == 1
    assert getattr(call.operands, name) is operand
    assert getattr(call.without_operands().operands, name) is None
    out, _ = forward(q, k, v, call)
    plain, _ = forward(q, k, v, AttentionCall(layout, 0.5, backend="numpy"))
    assert not np.array_equal(out, plain)


def attention_inputs(rng, heads, kv_heads, n_q, n_k, head_dim):
    """q [2, heads, n_q, head_dim], k and v [2, kv_heads, n_k, head_dim] (normal, times 2) and
    dout like q, drawn from ``rng`` in that order: the API-level operand tests' inputs."""
    q = rng.standard_normal((2, heads, n_q, head_dim)) * 2
    k, v = (rng.standard_normal((2, kv_heads, n_k, head_dim)) * 2 for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape)
