"""attn_decode_gqa's modifier variant (MODS_SCORE, kernels/attn_decode_gqa.cu) on the
interpreter, whose outputs start NaN-filled: every score modifier of attn_decode_split (softcap,
ALiBi, key bias, relative-position bias, dropout; all at once) against the float64 oracle and
against attn_decode_split's modifier variant over sampled page sizes 1/16/64, t_q 1-8 and GQA
groups 1-8 with NaN in every slot the cache does not keep; fp16 at a scale whose q scale log2(e)
leaves fp16's range; HeavyHitters' per-token scores; fp8 pages with modifiers; and the special
values of docs/design.md §7 beside a modifier, as the split kernel gives them."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import policies as P
from cuattn.backends import geometry
from cuattn.backends.dropout import seed_of
from cuattn.serving import decode
from cuattn.tools.oracle import kept_attention
from tests.helpers.launches import record_launches
from tests.serving import test_decode_special_values as special
from tests.serving.test_decode_gqa import TOLERANCE, WINDOW, _cache

ml_dtypes = pytest.importorskip("ml_dtypes")

MODIFIERS = ("softcap", "alibi", "key_bias", "rel_bias", "dropout", "dropout_words", "all")
SPLIT_LAUNCHES = ["attn_decode_split", "attn_decode_merge"]


def _modifier(name, rng, batch, heads, longest, per_batch):
    """(decode_attention's keyword arguments, the oracle's) of one modifier (``all``: softcap,
    ALiBi, key bias and relative-position bias together)."""
    if name == "softcap":
        return {"softcap": 1.0}, {"softcap": 1.0}
    if name == "alibi":
        slopes = cuattn.alibi_slopes(heads)
        slopes = np.stack([slopes, slopes[::-1] * 2]) if per_batch else slopes
        return {"alibi_slopes": slopes}, {"alibi_slopes": slopes}
    if name == "key_bias":  # -inf drops the first sinks' tokens
        shape = (batch, heads, longest + 3) if per_batch else (batch, longest + 3)
        bias = (rng.standard_normal(shape) * 2).astype(np.float32)
        bias[..., :2] = -np.inf
        return {"key_bias": bias}, {"key_bias": bias}
    if name == "rel_bias":  # M = 10: the window's tokens further away share the end columns
        shape = (batch, heads, 21) if per_batch else (heads, 21)
        table = (rng.standard_normal(shape) * 2).astype(np.float32)
        return {"rel_bias": table}, {"rel_bias": table}
    if name in ("dropout", "dropout_words"):
        seed = np.array([0x01234567, 0x89ABCDEF], np.uint32) if name == "dropout_words" else 77
        key = seed_of(seed) if name == "dropout_words" else seed
        return {"dropout_p": 0.3, "dropout_seed": seed}, {"dropout": (0.3, key)}
    assert name == "all"
    kwargs, oracle = {}, {}
    for one in ("softcap", "alibi", "key_bias", "rel_bias"):
        k, o = _modifier(one, rng, batch, heads, longest, per_batch)
        kwargs.update(k)
        oracle.update(o)
    return kwargs, oracle


@pytest.mark.parametrize(
    ("modifier", "dtype", "head_dim", "page_size", "t_q", "group", "resident_ctas"),
    [
        ("softcap", "bfloat16", 64, 16, 1, 4, 1),  # one split; 4 of the 16 rows
        ("alibi", "float16", 64, 1, 3, 2, 64),  # a page a token; splits merged in the kernel
        ("key_bias", "bfloat16", 64, 64, 8, 2, 8),  # 16 rows: t_q 8 of 2 query heads
        ("rel_bias", "float16", 64, 16, 4, 8, 8),  # 32 rows: two row chunks a kv head
        ("dropout", "bfloat16", 64, 16, 2, 3, 8),
        ("dropout_words", "float16", 64, 64, 5, 1, 3),  # no GQA; the seed in an array
        ("all", "bfloat16", 128, 16, 6, 2, 3),  # d128: 32-token tiles
        ("all", "float16", 64, 1, 1, 8, 64),
    ],
)
def test_each_modifier_against_the_oracle_and_the_split_kernel(
    modifier, dtype, head_dim, page_size, t_q, group, resident_ctas, launched, monkeypatch
):
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    cache, q = _cache(dtype, head_dim, page_size, t_q, group, seed=page_size + t_q + group)
    rng = np.random.default_rng(t_q)
    per_batch = group % 2 == 0  # [batch, ...] operands in half the cases
    kwargs, oracle = _modifier(modifier, rng, 2, 2 * group, int(cache.lengths.max()), per_batch)
    scale = head_dim**-0.5
    out, lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp", **kwargs)
    assert launched == [geometry.DECODE_GQA_KERNEL]
    want = kept_attention(cache, q, scale, **oracle)
    got = out.astype(np.float64)
    assert np.isfinite(got).all() and np.isfinite(lse).all()
    assert np.abs(got - want).max() <= TOLERANCE[dtype] * np.abs(want).max()
    plain = kept_attention(cache, q, scale)
    assert np.abs(plain - want).max() > 0.1 * np.abs(want).max()  # the modifier matters
    monkeypatch.setenv(geometry.DECODE_ENV, geometry.DECODE_SPLIT_FAMILY)
    split_out, split_lse = cuattn.decode_attention(
        q, cache, return_lse=True, backend="interp", **kwargs
    )
    assert launched[1:] == SPLIT_LAUNCHES
    np.testing.assert_allclose(lse, split_lse, rtol=1e-2, atol=1e-2)
    split = split_out.astype(np.float64)
    assert np.abs(got - split).max() <= TOLERANCE[dtype] * np.abs(want).max()


def test_head_dim_256(launched, monkeypatch):
    """d256's modifier variant (Q's tile in shared memory as at every head dim, one CTA an SM):
    softcap, ALiBi, key bias (-inf over the first tokens) and relative bias at once, bf16, GQA 4,
    t_q 2, NaN in every slot the cache does not keep, against the float64 oracle with one split
    and with a split a page (merged in the kernel)."""
    cache, q = _cache("bfloat16", 256, 16, 2, 4, seed=31)
    rng = np.random.default_rng(31)
    kwargs, oracle = _modifier("all", rng, 2, 8, int(cache.lengths.max()), True)
    want = kept_attention(cache, q, 256**-0.5, **oracle)
    plain = kept_attention(cache, q, 256**-0.5)
    assert np.abs(plain - want).max() > 0.1 * np.abs(want).max()  # the modifiers matter
    for resident_ctas in (1, 64):
        monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
        out, lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp", **kwargs)
        got = out.astype(np.float64)
        assert np.isfinite(got).all() and np.isfinite(lse).all()
        assert np.abs(got - want).max() <= TOLERANCE["bfloat16"] * np.abs(want).max()
    assert launched == [geometry.DECODE_GQA_KERNEL] * 2


def test_fp16_past_the_plain_kernels_scale(launched, monkeypatch):
    """fp16 at scale 50 (q scale log2(e) past fp16's range for |q| ~ 1000: the plain kernel
    would hold inf in Q): the modifier variant scales Q by a power of two and S back; against
    the oracle with one split and with many."""
    rng = np.random.default_rng(8)
    cache = cuattn.KVCache(2, 2, 64, "float16", page_size=16, policy=P.SlidingWindow(WINDOW))
    k, v = (rng.standard_normal((2, 2, 60, 64)) for _ in "kv")
    cache.append((k * 1e-4).astype(np.float16), v.astype(np.float16), lengths=[60, 45])
    q = (1e3 * rng.standard_normal((2, 4, 2, 64))).astype(np.float16)
    assert float(np.abs(q).max()) * 50 * geometry.DECODE_GQA_LOG2E > float(np.finfo(np.float16).max)
    assert geometry.decode_gqa_mods("float16", False, False, 50.0)
    want = kept_attention(cache, q, 50.0)
    for resident_ctas in (1, 64):
        monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
        out, lse = cuattn.decode_attention(q, cache, 50.0, return_lse=True, backend="interp")
        got = out.astype(np.float64)
        assert np.isfinite(got).all() and np.isfinite(lse).all()
        assert np.abs(got - want).max() <= TOLERANCE["float16"] * np.abs(want).max()
    assert launched == [geometry.DECODE_GQA_KERNEL] * 2


@pytest.mark.parametrize("page_size", [1, 16])
def test_heavy_hitters_scores_match_the_reference(page_size, launched, monkeypatch):
    """HeavyHitters' per-token scores from the modifier variant (with and without a modifier):
    after each step's eviction the kept positions and the slot scores equal the reference's."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 8)
    caches = {}
    for backend in ("interp", "numpy"):
        rng = np.random.default_rng(page_size)
        cache = cuattn.KVCache(
            2, 1, 64, "bfloat16", page_size=page_size, policy=P.HeavyHitters(90, 16)
        )
        k, v = (rng.standard_normal((2, 1, 120, 64)).astype(ml_dtypes.bfloat16) for _ in "kv")
        cache.append(k, v, lengths=[120, 100])
        q = rng.standard_normal((2, 4, 1, 64)).astype(ml_dtypes.bfloat16)
        for step in range(4):
            k, v = (rng.standard_normal((2, 1, 1, 64)).astype(ml_dtypes.bfloat16) for _ in "kv")
            cache.append(k, v)
            kwargs = {"softcap": 2.0} if step % 2 else {}
            out = cuattn.decode_attention(q, cache, backend=backend, **kwargs)
            want = kept_attention(cache, q, 64**-0.5, **kwargs)
            error = np.abs(out.astype(np.float64) - want).max()
            assert error <= TOLERANCE["bfloat16"] * np.abs(want).max()
        caches[backend] = cache
    assert launched == [geometry.DECODE_GQA_KERNEL, geometry.DECODE_MASS_KERNEL] * 4
    assert np.array_equal(caches["interp"].positions(), caches["numpy"].positions())
    got, want = caches["interp"].slot_score, caches["numpy"].slot_score
    assert np.allclose(got, want, rtol=TOLERANCE["bfloat16"], atol=1e-6)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_pages_with_modifiers(name, launched, monkeypatch):
    """attn_decode_gqa_fp8's modifier variant (the K scale applied before every modifier):
    against the oracle over the dequantised values, NaN codes in every unkept slot."""
    from tests.serving.test_decode_fp8 import _close, _gqa_cache

    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 8)
    cache, q = _gqa_cache(name, 64, 16, 2, 4, seed=31)
    rng = np.random.default_rng(32)
    kwargs, oracle = _modifier("all", rng, 2, 8, int(cache.lengths.max()), per_batch=False)
    _close(
        cuattn.decode_attention(q, cache, backend="interp", **kwargs),
        kept_attention(cache, q, **oracle),
    )
    kwargs, oracle = _modifier("dropout", rng, 2, 8, 0, per_batch=False)
    _close(
        cuattn.decode_attention(q, cache, backend="interp", **kwargs),
        kept_attention(cache, q, **oracle),
    )
    assert launched == [geometry.DECODE_GQA_FP8_KERNEL] * 2


def _both_kernels(q, cache, monkeypatch, **kwargs):
    """(out, lse) of the tensor-core kernel and of the split kernel, float64 / float32."""
    results = []
    for family in (geometry.DECODE_GQA_FAMILY, geometry.DECODE_SPLIT_FAMILY):
        monkeypatch.setenv(geometry.DECODE_ENV, family)
        out, lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp", **kwargs)
        results.append((out.astype(np.float64), np.asarray(lse, np.float64)))
    return results


@pytest.mark.parametrize("resident_ctas", [1, 64])
@pytest.mark.parametrize(
    "case",
    [special.nan_in_q, special.nan_in_k, special.plus_inf_score, special.every_score_minus_inf],
    ids=lambda c: c.__name__,
)
def test_special_values_beside_a_modifier_follow_the_split_kernel(
    case, resident_ctas, launched, monkeypatch
):
    """NaN and inf beside ALiBi (the modifier variant, bfloat16, d64) as attn_decode_split's
    modifier variant gives them: the same NaN rows and -inf lse, the finite values close."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    monkeypatch.setattr(special, "D", 64)
    cache, q = special.build(case, "bfloat16", None)
    slopes = cuattn.alibi_slopes(q.shape[1])
    (got, got_lse), (want, want_lse) = _both_kernels(q, cache, monkeypatch, alibi_slopes=slopes)
    assert launched[0] == geometry.DECODE_GQA_KERNEL and launched[1:] == SPLIT_LAUNCHES
    assert np.array_equal(np.isnan(got), np.isnan(want))
    assert np.array_equal(np.isnan(got_lse), np.isnan(want_lse))
    assert np.array_equal(got_lse == -np.inf, want_lse == -np.inf)
    finite = np.isfinite(want)
    assert np.abs(got[finite] - want[finite]).max() <= special.TOL["bfloat16"] * max(
        np.abs(want[finite]).max(), 1.0
    )


def test_a_minus_inf_key_bias_empties_rows_and_nan_stays_out(launched, monkeypatch):
    """A key bias of -inf at every position of query head 0: its rows attend nothing and give
    out 0 and lse -inf (also where the kept v holds NaN); slots the cache does not keep hold NaN
    and inf and reach no row; the other heads as the split kernel."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 64)
    cache, q = _cache("bfloat16", 64, 16, 2, 2, seed=41)
    stale = cache.slot_pos < 0
    cache.k_pages[stale] = np.inf
    cache.v_pages[stale] = np.nan
    longest = int(cache.lengths.max())
    bias = np.random.default_rng(42).standard_normal((2, 4, longest)).astype(np.float32)
    bias[:, 0] = -np.inf
    (got, got_lse), (want, want_lse) = _both_kernels(q, cache, monkeypatch, key_bias=bias)
    assert launched[0] == geometry.DECODE_GQA_KERNEL
    assert (got[:, 0] == 0).all() and (got_lse[:, 0] == -np.inf).all()
    assert np.isfinite(got[:, 1:]).all() and np.isfinite(got_lse[:, 1:]).all()
    oracle = kept_attention(cache, q, 64**-0.5, key_bias=bias)
    assert np.abs(got - oracle).max() <= TOLERANCE["bfloat16"] * np.abs(oracle).max()
    np.testing.assert_array_equal(got_lse == -np.inf, want_lse == -np.inf)
    assert np.abs(got - want).max() <= TOLERANCE["bfloat16"] * np.abs(want).max()


def test_the_split_kernel_stays_for_what_gqa_lacks(launched, monkeypatch):
    """fp32 keeps attn_decode_split with modifiers too (the named fallback)."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 4)
    rng = np.random.default_rng(9)
    cache = cuattn.KVCache(1, 1, 64, "float32", page_size=16)
    k, v = (rng.standard_normal((1, 1, 30, 64)).astype(np.float32) for _ in "kv")
    cache.append(k, v)
    q = rng.standard_normal((1, 2, 1, 64)).astype(np.float32)
    cuattn.decode_attention(q, cache, backend="interp", softcap=2.0)
    assert launched == SPLIT_LAUNCHES


@pytest.mark.gpu
@pytest.mark.parametrize("resident_ctas", [1, 256])
@pytest.mark.parametrize(
    ("modifier", "dtype", "head_dim", "page_size", "t_q", "group"),
    [
        ("all", "bfloat16", 128, 16, 1, 4),
        ("dropout", "float16", 128, 64, 4, 4),
        ("key_bias", "bfloat16", 64, 1, 8, 2),
        ("softcap", "float16", 64, 16, 2, 8),
    ],
)
def test_on_the_gpu(modifier, dtype, head_dim, page_size, t_q, group, resident_ctas, monkeypatch):
    """The interpreter's modifier cases on a CuPy cache (NaN in every slot the cache does not
    keep), one split per table or many, against the float64 oracle; the route launched
    attn_decode_gqa alone. What a GPU run must pass before CUATTN_DECODE=gqa can be the
    default for modified decodes."""
    from cuattn.backends.cuda_runtime import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    from cuattn.backends import cuda

    monkeypatch.setenv(geometry.DECODE_ENV, geometry.DECODE_GQA_FAMILY)
    monkeypatch.setattr(decode, "_resident_ctas", lambda impl, d, dt, gqa: resident_ctas)
    names = record_launches(monkeypatch, cuda.CudaBackend)
    cache, q = _cache(dtype, head_dim, page_size, t_q, group, seed=5, xp=cupy, prefill=600)
    rng = np.random.default_rng(6)
    kwargs, oracle = _modifier(modifier, rng, 2, 2 * group, int(cache.lengths.max()), True)
    kwargs = {k: cupy.asarray(x) if isinstance(x, np.ndarray) else x for k, x in kwargs.items()}
    out = cuattn.decode_attention(q, cache, **kwargs)
    assert names == [geometry.DECODE_GQA_KERNEL]
    got = cupy.asnumpy(out).astype(np.float64)
    want = kept_attention(cache, q, head_dim**-0.5, **oracle)
    assert np.isfinite(got).all()
    assert np.abs(got - want).max() <= TOLERANCE[dtype] * np.abs(want).max()


def test_a_callers_page_table_with_modifiers(launched, monkeypatch):
    """cuattn.paged_decode (positions are the table slots, no slot_pos) with softcap, ALiBi
    per (batch, head), a per-head key bias and a relative-position table: the modifier variant
    against test_paged_decode.py's oracle, one split and several."""
    from tests.serving.test_paged_decode import _assert_close, _case, oracle

    rng = np.random.default_rng(13)
    q, k, v, table, lens = _case(rng, "bfloat16", heads=8, t_q=3, lens=(70, 33))
    batch, heads = q.shape[:2]
    kwargs = dict(
        softcap=2.0,
        alibi_slopes=rng.uniform(0.01, 0.2, (batch, heads)).astype(np.float32),
        key_bias=rng.standard_normal((batch, heads, 80)).astype(np.float32),
        rel_bias=rng.standard_normal((heads, 2 * 5 + 1)).astype(np.float32),
    )
    want, want_lse = oracle(q, k, v, table, lens, 0.3, **{
        "softcap": 2.0, "slopes": kwargs["alibi_slopes"], "key_bias": kwargs["key_bias"],
        "rel_bias": kwargs["rel_bias"],
    })  # fmt: skip
    for resident_ctas in (1, 16):
        monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
        out, lse = cuattn.paged_decode(q, k, v, table, lens, 0.3, True, backend="interp", **kwargs)
        _assert_close(out, want, "bfloat16", lse, want_lse)
    assert launched == [geometry.DECODE_GQA_KERNEL] * 2
