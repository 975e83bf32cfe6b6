"""decode_attention with NaN, inf and scores that overflow (docs/design.md §7, "Special values"):
the NumPy reference and the split-KV kernels on the interpreter give what a dense float64
computation of the masked softmax over the cache's kept tokens gives, NaN for NaN, inf for inf,
the finite elements within rounding, out and lse alike.

Decode computes every (query row, kept token) pair of a kv group: each row walks its whole
page table, a token it may not attend (a newer one when t_q > 1, a page Quest does not read)
taking probability 0. So 0 * NaN = NaN carries a NaN or inf in a kept v to every row of the
group, as the oracle's dense P V over the kept tokens does, and to no other group; a slot the
cache does not keep (what eviction or an earlier use of its page left there) reaches nothing.
A row with no allowed key, or only -inf scores, gives 0 and -inf, whatever it multiplied by 0.
The split count (how many partial results the kernel merges) never changes the answer.

HeavyHitters: a query row whose probabilities are NaN adds nothing to the scores, which stay
finite. Quest: a page whose key bound is NaN is read. No NumPy warning leaks.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import cuattn
from cuattn import policies as P
from cuattn.serving import decode
from cuattn.tools.oracle import dense_attention
from tests.helpers.special_values import assert_same

BATCH, KV_HEADS, GROUP, T_Q, D, PAGE = 2, 2, 2, 2, 16, 4
# queries at 27, 28 and 21, 22; the newest token of sequence 0 opens a page of its own
LENGTHS = (29, 23)
SCALE = 1.0  # so that q.k itself is the score: its overflow is the score's
# a value h with h * h beyond the score type's range (float32 for the kernels and for float32
# and bfloat16 on the reference), h itself finite in the input dtype
HUGE = {"float64": 1e160, "float32": 1e20, "bfloat16": 1e20}
# per-element |x - ref| <= tol * (|ref| + median |ref|) on the finite elements
TOL = {"float64": 1e-9, "float32": 1e-4, "bfloat16": 2e-2}
# each keeps every position the cases below touch: sequence 0 from 17, sequence 1 from 11
POLICIES = {
    "all": lambda: None,
    "window": lambda: P.SlidingWindow(12),
    "heavy": lambda: P.HeavyHitters(14, 4),
    "quest": lambda: P.Quest(2, PAGE),
}


def _numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


# Each case edits q [batch, heads, t_q, d] and k, v [batch, kv_heads, position, d] in float64;
# dimension 0 is 0 in q and k otherwise, so that a special value there touches only the scores
# meant. Query heads 2 h and 2 h + 1 read kv head h.
def nan_in_q(q, k, v, huge):
    q[1, 3, 1, 5] = np.nan  # that row is NaN, out and lse


def nan_in_k(q, k, v, huge):
    k[0, 0, 24, 3] = np.nan  # every row of sequence 0, kv head 0: both queries allow 24


def nan_in_v(q, k, v, huge):
    v[1, 1, 15, 3] = np.nan  # element 3 of every row of sequence 1, kv head 1; lse finite


def nan_in_the_newest_v(q, k, v, huge):
    # query 0 (position 27) may not attend position 28: its probability 0 still multiplies v
    v[0, 1, 28, 2] = np.nan


def inf_in_v(q, k, v, huge):
    v[0, 1, 28, 2] = -np.inf  # query 1: -inf there; query 0: 0 * inf = NaN there


def inf_in_k(q, k, v, huge):
    # key 24 scores +inf for query 1 (a NaN row) and -inf for query 0 (a zero probability)
    q[..., 0] = np.array([-1.0, 1.0])  # by query
    k[0, 0, 24, 0] = np.inf


def plus_inf_score(q, k, v, huge):
    q[1, 2, 0, 0] = k[1, 1, 19, 0] = huge  # s = +inf: that row is NaN (inf - inf)


def minus_inf_score(q, k, v, huge):
    q[1, 2, 0, 0], k[1, 1, 19, 0] = huge, -huge  # s = -inf: a zero probability


def every_score_minus_inf(q, k, v, huge):
    # sequence 0, head 1, query 1 scores -inf against every key: 0 and -inf, though it
    # multiplies 0 by the NaN the other rows of its group carry
    k[..., 0] = 1.0 + np.abs(k[..., 1])
    q[0, 1, 1, :] = 0.0
    q[0, 1, 1, 0] = -np.inf
    v[0, 0, 24, 4] = np.nan


CASES = [
    nan_in_q,
    nan_in_k,
    nan_in_v,
    nan_in_the_newest_v,
    inf_in_v,
    inf_in_k,
    plus_inf_score,
    minus_inf_score,
    every_score_minus_inf,
]


def build(case, dtype, policy, seed=0, window=None):
    """A cache of the LENGTHS tokens, the case's special values in them, and its q."""
    rng = np.random.default_rng(seed)
    k, v = (rng.standard_normal((BATCH, KV_HEADS, LENGTHS[0], D)) for _ in "kv")
    q = rng.standard_normal((BATCH, KV_HEADS * GROUP, T_Q, D))
    q[..., 0] = k[..., 0] = 0.0
    if case is not None:
        case(q, k, v, HUGE[dtype])
    np_dtype = _numpy_dtype(dtype)
    cache = cuattn.KVCache(BATCH, KV_HEADS, D, dtype, page_size=PAGE, policy=policy)
    cache.append(k.astype(np_dtype), v.astype(np_dtype), lengths=list(LENGTHS))
    return cache, q.astype(np_dtype)


def run(cache, q, backend):
    """(out, lse) of decode_attention, a NumPy warning an error."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return cuattn.decode_attention(q, cache, SCALE, return_lse=True, backend=backend)


def expected(cache, q):
    """float64 (out, lse, probability mass per slot like cache.slot_score) of a dense masked
    softmax over each (sequence, kv head)'s kept tokens, scores formed in the accumulation
    type; causal, and with Quest only the pages the reference reads. The mass sums each kept
    token's probability over the rows whose probabilities are not NaN."""
    score_dtype = None if cache.dtype == "float64" else np.float32
    q64 = q.astype(np.float64)
    k_pages, v_pages = (x.astype(np.float64) for x in (cache.k_pages, cache.v_pages))
    out = np.zeros(q.shape)
    lse = np.full(q.shape[:3], -np.inf)
    mass = np.zeros(cache.slot_pos.shape)
    quest = isinstance(cache.policy, P.Quest)
    for b in range(BATCH):
        length = int(cache.lengths[b])
        q_pos = np.arange(length - T_Q, length)
        for h in range(KV_HEADS):
            pages, offsets, pos = cache.kept(b, h)
            rows = slice(h * GROUP, (h + 1) * GROUP)
            if pos.size == 0:
                continue
            mask = np.broadcast_to(pos[None, :] <= q_pos[:, None], (GROUP, T_Q, pos.size))
            if quest:
                chosen = decode._quest_pages(cache, b, h, q[b, rows], length)
                where = {page: i for i, page in enumerate(cache.pages(b, h))}
                mask = mask & chosen[..., [where[p] for p in pages]]
            keys, values = k_pages[pages, offsets], v_pages[pages, offsets]
            one = (q64[b : b + 1, rows], keys[None, None], values[None, None], mask, SCALE)
            o, lse_bh = dense_attention(*one, score_dtype=score_dtype)
            out[b, rows], lse[b, rows] = o[0], lse_bh[0]
            with np.errstate(invalid="ignore", over="ignore"):
                s = q64[b, rows] @ keys.T
                if score_dtype is not None:
                    s = s.astype(score_dtype).astype(np.float64) * SCALE
                s = np.where(mask, s, -np.inf)
                p = np.where(mask, np.exp(s - lse[b, rows][..., None]), 0.0)
            p = np.where(np.isnan(p), 0.0, p)  # a NaN row adds nothing
            mass[pages, offsets] = p.sum(axis=(0, 1))
    return out, lse, mass


def check(cache, q, backend, tol):
    want_out, want_lse, _ = expected(cache, q)
    out, lse = run(cache, q, backend)
    assert_same("out", out, want_out, tol)
    assert_same("lse", lse, want_lse, tol)
    return out, lse


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_the_reference_follows_the_dense_computation(case, policy, dtype):
    cache, q = build(case, dtype, POLICIES[policy]())
    check(cache, q, "numpy", TOL[dtype])


@pytest.mark.parametrize("resident_ctas", [1, 64])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.__name__)
def test_the_kernels_follow_the_dense_computation(case, policy, resident_ctas, monkeypatch):
    """One split per page table, or one page per split (partial results merged, some of them
    with no key a row may attend)."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    cache, q = build(case, "float32", POLICIES[policy]())
    check(cache, q, "interp", TOL["float32"])


@pytest.mark.parametrize("backend", ["numpy", "interp"])
@pytest.mark.parametrize(
    "case", [nan_in_q, nan_in_v, plus_inf_score, every_score_minus_inf], ids=lambda c: c.__name__
)
def test_bfloat16(case, backend):
    """Half inputs: the same specials, the scores in float32."""
    cache, q = build(case, "bfloat16", POLICIES["heavy"]())
    check(cache, q, backend, TOL["bfloat16"])


def test_the_cases_do_what_they_say():
    """The oracle's answer, spelled out for a few cases (so a wrong oracle cannot pass)."""
    cache, q = build(nan_in_q, "float32", None)
    out, lse, _ = expected(cache, q)
    assert np.isnan(out[1, 3, 1]).all() and np.isnan(lse[1, 3, 1])
    assert np.isnan(out).any(axis=-1).sum() == 1 and np.isnan(lse).sum() == 1

    cache, q = build(nan_in_the_newest_v, "float32", None)
    out, lse, _ = expected(cache, q)
    assert np.isnan(out[0, 2:, :, 2]).all() and np.isfinite(lse).all()
    assert np.isnan(out).sum() == 4

    cache, q = build(every_score_minus_inf, "float32", None)
    out, lse, _ = expected(cache, q)
    assert out[0, 1, 1].tolist() == [0.0] * D and lse[0, 1, 1] == -np.inf
    assert np.isnan(out[0, 0, :, 4]).all() and np.isnan(out[0, 1, 0, 4])

    cache, q = build(plus_inf_score, "float32", None)
    _, lse, _ = expected(cache, q)
    assert np.isnan(lse[1, 2, 0]) and np.isnan(lse).sum() == 1


@pytest.mark.parametrize("backend", ["numpy", "interp"])
def test_rows_with_nothing_to_attend(backend, monkeypatch):
    """A window of one token with t_q = 2: query 0 attends nothing and gives 0 and -inf, also
    when the one kept token's v is NaN (which query 1, attending it, carries)."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 64)
    cache, q = build(nan_in_the_newest_v, "float32", P.SlidingWindow(1))
    out, lse = check(cache, q, backend, TOL["float32"])
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == -np.inf).all()
    assert np.isnan(out[0, 2:, 1, 2]).all() and np.isfinite(lse[:, :, 1]).all()


@pytest.mark.parametrize("backend", ["numpy", "interp"])
@pytest.mark.parametrize("resident_ctas", [1, 64])
def test_slots_the_cache_does_not_keep_reach_nothing(backend, resident_ctas, monkeypatch):
    """An empty slot of a page in a table (here the room left in each table's last page) holds
    whatever an earlier token left there; NaN and inf there change nothing."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    cache, q = build(None, "float32", None)
    table, _ = cache.page_tables()
    in_table = np.isin(np.arange(cache.slot_pos.shape[0]), table[table >= 0])
    stale = in_table[:, None] & (cache.slot_pos == -1)  # [pages, page_size]
    assert stale.any()
    cache.k_pages[stale] = np.inf
    cache.k_pages[stale, 1] = np.nan
    cache.v_pages[stale] = np.nan
    out, lse = check(cache, q, backend, TOL["float32"])
    assert np.isfinite(out).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("resident_ctas", [1, 64])
@pytest.mark.parametrize(
    "case", [nan_in_q, nan_in_k, inf_in_k, plus_inf_score, nan_in_v], ids=lambda c: c.__name__
)
def test_heavy_hitters_scores_stay_finite(case, resident_ctas, monkeypatch):
    """A row whose probabilities are NaN (a NaN or +inf score) adds nothing to the scores; the
    others add theirs. Reference and kernels agree on the scores and on what the next append
    evicts (a NaN score would rank below an empty slot and evict a token the budget keeps)."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    rng = np.random.default_rng(5)
    steps = [(rng.standard_normal((BATCH, KV_HEADS, 1, D)) for _ in "kv") for _ in range(3)]
    steps = [tuple(x.astype(np.float32) for x in step) for step in steps]
    caches = {}
    for backend in ("numpy", "interp"):
        cache, q = build(case, "float32", P.HeavyHitters(14, 4))
        for k, v in steps:
            before = cache.slot_score.copy()
            _, _, mass = expected(cache, q)
            run(cache, q, backend)
            assert np.isfinite(cache.slot_score).all()
            assert np.allclose(cache.slot_score - before, mass, rtol=1e-4, atol=1e-6)
            cache.append(k, v)
        caches[backend] = cache
    assert np.array_equal(caches["numpy"].positions(), caches["interp"].positions())
    assert np.allclose(caches["numpy"].slot_score, caches["interp"].slot_score, atol=1e-5)


@pytest.mark.parametrize("backend", ["numpy", "interp"])
@pytest.mark.parametrize("case", [nan_in_k, inf_in_k], ids=lambda c: c.__name__)
def test_quest_reads_a_page_whose_bound_is_nan(case, backend):
    """Key 24's page has a bound of NaN (a NaN key element, or an infinite one meeting a query
    element of the other sign: 0 * inf) or +inf for every query of sequence 0, kv head 0: it is
    read ahead of every other page, and its key takes part with a NaN or +-inf score."""
    cache, q = build(case, "float32", P.Quest(1, PAGE))
    out, lse = check(cache, q, backend, TOL["float32"])
    if case is nan_in_k:
        assert np.isnan(lse[0, :2]).all()
    else:  # query 1 scores +inf (NaN), query 0 -inf (probability 0)
        assert np.isnan(lse[0, :2, 1]).all() and np.isfinite(lse[0, :2, 0]).all()
    assert np.isfinite(lse[0, 2:]).all() and np.isfinite(lse[1]).all()
