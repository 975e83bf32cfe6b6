"""FP8 KV pages (cuattn/serving/fp8.py): the codes against ml_dtypes, the power-of-two page
scales and their requantisation at every write, decode on the reference and on
attn_decode_split_fp8 (the interpreter, whose outputs start NaN-filled) against the float64
oracle over the dequantised values, every score modifier, evicted slots and special values, the
error against the unquantised values, and the arguments refused."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import cuattn
from cuattn import policies as P
from cuattn.backends import geometry, interp
from cuattn.backends.cuda_runtime import cuda_available
from cuattn.serving import decode, fp8
from cuattn.tools.oracle import dense_attention, kept_attention
from tests.helpers.opt_in import check_opt_in

FORMATS = fp8.FP8_DTYPES
BF16_TOLERANCE = 2e-2  # of max |oracle|: the bf16 output's rounding and float32 sums
# the error of attention over fp8 pages against the unquantised bf16 values, relative to max
# |oracle| (measured on these shapes: docs/serving.md and bench/NOTES.md give the table)
UNQUANTISED_BOUND = {"float8_e4m3fn": 0.08, "float8_e5m2": 0.15}
SUBNORMAL_STEP = {"float8_e4m3fn": 2.0**-9, "float8_e5m2": 2.0**-16}


def _bf16(x):
    return np.asarray(x).astype(ml_dtypes.bfloat16)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("source", [ml_dtypes.bfloat16, np.float16])
def test_codes_round_like_ml_dtypes(name, source):
    """Every finite bf16 / fp16 value within the format's range encodes as ml_dtypes rounds it
    (nearest, ties to even), and every code decodes to ml_dtypes' value."""
    bits = np.arange(2**16, dtype=np.uint16).view(source).astype(np.float32)
    top = fp8.format_max(name)
    x = bits[np.isfinite(bits) & (np.abs(bits) <= top)]
    want = x.astype(getattr(ml_dtypes, name)).view(np.uint8)
    got = fp8.encode(np, x, name)
    zero = x == 0  # -0.0 may take either sign's code: both decode to 0
    assert (got[~zero] == want[~zero]).all()
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(getattr(ml_dtypes, name)).astype(np.float32)
    decoded = fp8.decode(np, codes, name)
    assert np.array_equal(decoded, values, equal_nan=True)


@pytest.mark.parametrize("name", FORMATS)
def test_special_values_and_saturation(name):
    """NaN stays NaN; inf is inf in e5m2 and NaN in e4m3fn (no infinity there); a finite value
    past the largest saturates to it (never reached through a page scale)."""
    x = np.array([np.nan, np.inf, -np.inf, 1e30, -1e30])
    decoded = fp8.decode(np, fp8.encode(np, x, name), name)
    assert np.isnan(decoded[0])
    if name == "float8_e5m2":
        assert decoded[1] == np.inf and decoded[2] == -np.inf
    else:
        assert np.isnan(decoded[1:3]).all()
    top = fp8.format_max(name)
    assert decoded[3] == top and decoded[4] == -top


@pytest.mark.parametrize("name", FORMATS)
def test_page_scales_are_the_smallest_covering_power_of_two(name):
    top = fp8.format_max(name)
    amax = np.array([0.0, top, top * 1.0001, 2 * top, 1e-3, 3e5, 1e-45])
    scale = fp8.page_scale(np, amax, name).astype(np.float64)
    mantissa, _ = np.frexp(scale)
    assert (mantissa == 0.5).all()  # powers of two
    assert scale[0] == 1.0 and scale[1] == 1.0 and scale[2] == 2.0 and scale[3] == 2.0
    covered = amax[1:6] <= top * scale[1:6]
    assert covered.all() and (amax[1:6] > top * scale[1:6] / 2).all()
    assert scale[6] == 2.0**fp8.MIN_SCALE_EXPONENT  # clamped to float32's normal range


@pytest.mark.parametrize("name", FORMATS)
def test_a_page_written_in_steps_keeps_each_token_at_one_rounding(name):
    """Tokens appended one at a time, each larger than the last, so a page's scale grows at
    every step and its tokens are requantised each time: every kept value is the direct
    quantisation of its original at the page's final scale (the power-of-two rescale is exact),
    but for codes below the normal range, off by at most one subnormal step."""
    rng = np.random.default_rng(0)
    page, d = 8, 32
    cache = cuattn.KVCache(1, 1, d, name, page_size=page)
    originals = []
    for step in range(2 * page + 3):
        k = _bf16(rng.standard_normal((1, 1, 1, d)) * 2.0 ** (step / 2))
        originals.append(k[0, 0, 0].astype(np.float64))
        cache.append(k, k)
    pages, offsets, pos = cache.kept(0, 0)
    keys = cache.token_values(pages, offsets)[0].astype(np.float64)
    scales = cache.k_scale[pages].astype(np.float64)[:, None]
    originals = np.stack(originals)[pos]
    direct = fp8.decode(np, fp8.encode(np, originals / scales, name), name) * scales
    off = np.abs(keys - direct)
    assert off.max() <= SUBNORMAL_STEP[name] * scales.max()
    normal = np.abs(direct) >= scales * 2.0 ** (-6 if name == "float8_e4m3fn" else -14)
    assert (keys[normal] == direct[normal]).all()
    assert len(set(cache.k_scale[np.unique(pages)].tolist())) > 1  # the pages' scales differ
    top = fp8.format_max(name)
    full = 2 * page  # the first two pages, full, in position order
    amax = np.abs(originals[:full]).reshape(-1, page * d).max(axis=1)
    covering = cache.k_scale[pages[:full:page]].astype(np.float64)
    assert (amax <= top * covering).all() and (amax > top * covering / 2).all()


def _filled(name, policy, rng, d=64, group=2, t_q=1, page=16, steps=3):
    """A cache of two sequences (prefill 120 and 90 tokens, then ``steps`` decode steps of
    larger values), and a bf16 q; also the unquantised (k, v) of each sequence, [kv_heads,
    tokens, d] by position."""
    cache = cuattn.KVCache(2, 2, d, name, page_size=page, policy=policy)
    prefill = [_bf16(rng.standard_normal((2, 2, 120, d))) for _ in range(2)]
    cache.append(*prefill, lengths=[120, 90])
    kv = [[x[b, :, :length] for x in prefill] for b, length in enumerate((120, 90))]
    for _ in range(steps):
        new = [_bf16(3 * rng.standard_normal((2, 2, t_q, d))) for _ in range(2)]
        cache.append(*new)
        kv = [[np.concatenate([kv[b][i], new[i][b]], axis=1) for i in range(2)] for b in range(2)]
    q = _bf16(rng.standard_normal((2, 2 * group, t_q, d)))
    return cache, q, kv


def _close(got, want, tolerance=BF16_TOLERANCE):
    got = np.asarray(got).astype(np.float64)
    assert not np.isnan(got).any()
    assert np.abs(got - want).max() <= tolerance * np.abs(want).max()


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    "policy",
    [None, P.SlidingWindow(100), P.HeavyHitters(100, 16), P.SnapKV(100, window=4)],
    ids=["full", "window", "heavy", "snapkv"],
)
@pytest.mark.parametrize("backend", ["numpy", "interp"])
def test_decode_over_the_dequantised_values(name, policy, backend, monkeypatch):
    """Reference and attn_decode_split_fp8 (several splits merged) against the float64 oracle
    over the values the pages hold (evicted slots and HeavyHitters' holes included), t_q = 2."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 8)
    cache, q, _ = _filled(name, policy, np.random.default_rng(1), t_q=2)
    out, lse = cuattn.decode_attention(q, cache, return_lse=True, backend=backend)
    _close(out, kept_attention(cache, q))
    assert np.isfinite(lse).all()


@pytest.mark.parametrize("name", FORMATS)
def test_quest_pages_and_heavy_hitters_scores_match_the_reference(name, monkeypatch):
    """Quest's page choice reads the dequantised key bounds; HeavyHitters' per-token scores
    from attn_decode_split_fp8 equal the reference's."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 4)
    for policy in (lambda: P.Quest(3, 16), lambda: P.HeavyHitters(100, 16)):
        results = []
        for backend in ("numpy", "interp"):
            cache, q, _ = _filled(name, policy(), np.random.default_rng(2))
            out = cuattn.decode_attention(q, cache, backend=backend)
            results.append((np.asarray(out).astype(np.float64), cache))
        (ref, ref_cache), (got, got_cache) = results
        assert np.abs(got - ref).max() <= BF16_TOLERANCE * np.abs(ref).max()
        if ref_cache.slot_score is not None:
            assert np.allclose(got_cache.slot_score, ref_cache.slot_score, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("modifier", ["softcap", "alibi", "key_bias", "rel_bias", "dropout"])
def test_every_score_modifier(name, modifier, monkeypatch):
    """attn_decode_split_fp8's modifier variant against the oracle over the dequantised
    values: the K scale is applied before every modifier."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 8)
    rng = np.random.default_rng(3)
    cache, q, _ = _filled(name, None, rng)
    heads, longest = q.shape[1], int(cache.lengths.max())
    kwargs, oracle = {}, {}
    if modifier == "softcap":
        kwargs = oracle = {"softcap": 5.0}
    elif modifier == "alibi":
        slopes = rng.uniform(0.01, 0.1, heads).astype(np.float32)
        kwargs = oracle = {"alibi_slopes": slopes}
    elif modifier == "key_bias":
        kwargs = oracle = {"key_bias": rng.standard_normal((2, longest)).astype(np.float32)}
    elif modifier == "rel_bias":
        kwargs = oracle = {"rel_bias": rng.standard_normal((heads, 17)).astype(np.float32)}
    else:
        kwargs = {"dropout_p": 0.25, "dropout_seed": 11}
        oracle = {"dropout": (0.25, 11)}
    out = cuattn.decode_attention(q, cache, backend="interp", **kwargs)
    _close(out, kept_attention(cache, q, **oracle))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("backend", ["numpy", "interp"])
def test_special_values(name, backend, monkeypatch):
    """A NaN in a kept v reaches every row of its kv group (0 * NaN, as dense); an inf in k is
    NaN in e4m3fn (no infinity) and stays inf in e5m2, whose score makes its row NaN; NaN codes
    left in slots the cache does not keep reach nothing; the page's other tokens keep their
    scale (non-finite elements do not count in amax)."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 8)
    rng = np.random.default_rng(4)
    cache = cuattn.KVCache(1, 1, 16, name, page_size=4, policy=P.SlidingWindow(10))
    k, v = (rng.standard_normal((1, 1, 14, 16)) for _ in range(2))
    v[0, 0, 12, 3] = np.nan  # kept
    k[0, 0, 1, 2] = v[0, 0, 1, 4] = np.nan  # evicted by the window
    cache.append(_bf16(k), _bf16(v))
    table, _ = cache.page_tables()
    in_table = np.isin(np.arange(cache.slot_pos.shape[0]), table[table >= 0])
    stale = in_table[:, None] & (cache.slot_pos == -1)
    assert stale.any()
    cache.k_pages[stale] = cache.v_pages[stale] = 0x7F  # NaN codes where nothing is kept
    assert np.isfinite(cache.k_scale).all() and np.isfinite(cache.v_scale).all()
    q = _bf16(rng.standard_normal((1, 2, 1, 16)))
    out = np.asarray(cuattn.decode_attention(q, cache, backend=backend)).astype(np.float64)
    assert np.isnan(out[..., 3]).all() and not np.isnan(np.delete(out, 3, axis=-1)).any()
    cache.append(*(_bf16(np.zeros((1, 1, 1, 16))) for _ in range(2)))  # evicts the NaN v
    k = np.zeros((1, 1, 1, 16))
    k[0, 0, 0, 0] = np.inf
    cache.append(_bf16(k), _bf16(np.ones((1, 1, 1, 16))))
    q = np.ones((1, 2, 1, 16))
    out = np.asarray(cuattn.decode_attention(_bf16(q), cache, backend=backend))
    pages, offsets, _ = cache.kept(0, 0)
    keys = cache.token_values(pages, offsets)[0].astype(np.float64)
    values = cache.token_values(pages, offsets)[1].astype(np.float64)
    mask = np.ones((2, 1, len(pages)), dtype=bool)
    want = dense_attention(q, keys[None, None], values[None, None], mask, 0.25)[0]
    assert np.isnan(want).all() and np.isnan(out.astype(np.float64)).all()


def test_error_against_the_unquantised_values():
    """The measured cost of fp8 pages: attention over them against the oracle over the bf16
    values the cache was given (the table in docs/serving.md), within UNQUANTISED_BOUND, and
    e4m3fn (3 mantissa bits) closer than e5m2 (2)."""
    errors = {}
    for name in FORMATS:
        cache, q, kv = _filled(name, None, np.random.default_rng(5))
        got = np.asarray(cuattn.decode_attention(q, cache)).astype(np.float64)
        rows = []
        for b, (k, v) in enumerate(kv):
            mask = np.ones((4, 1, k.shape[1]), dtype=bool)
            rows.append(dense_attention(q[b : b + 1], k[None], v[None], mask, 64**-0.5)[0][0])
        want = np.stack(rows)
        errors[name] = np.abs(got - want).max() / np.abs(want).max()
        assert errors[name] <= UNQUANTISED_BOUND[name], errors
    assert errors["float8_e4m3fn"] < errors["float8_e5m2"]


@pytest.mark.parametrize(
    "dtype", ["float8_e4m3", "float8_e4m3fnuz", "fp8", np.uint8, "float8_e5m2fnuz"]
)
def test_unsupported_dtype_names_are_refused(dtype):
    with pytest.raises(TypeError, match="dtype must be one of"):
        cuattn.KVCache(1, 1, 16, dtype)


def test_fp8_arrays_are_not_inputs():
    """An fp8 cache is given and asked with fp16/bf16: an fp8 (or float32) q, k or v is
    refused by name before anything is written."""
    cache = cuattn.KVCache(1, 2, 16, "float8_e4m3fn", page_size=4)
    good = _bf16(np.ones((1, 2, 3, 16)))
    fp8_k = np.ones((1, 2, 3, 16)).astype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match="^k has dtype float8_e4m3fn"):
        cache.append(fp8_k, good)
    with pytest.raises(TypeError, match="^v has dtype float32"):
        cache.append(good, np.ones((1, 2, 3, 16), np.float32))
    assert len(cache) == 0
    cache.append(good, good)
    for q in (np.ones((1, 2, 1, 16)).astype(ml_dtypes.float8_e5m2), np.ones((1, 2, 1, 16))):
        for backend in ("numpy", "interp"):
            with pytest.raises(TypeError, match="^q has dtype"):
                cuattn.decode_attention(q, cache, backend=backend)


def test_the_gpu_kernel_is_opt_in(monkeypatch):
    """On a GPU the fp8 pages need CUATTN_DECODE_FP8=kernel (no GPU has run the kernel); an
    unknown value is refused by name."""
    check_opt_in(monkeypatch, geometry.DECODE_FP8_ENV, geometry.decode_fp8_family)


@pytest.mark.parametrize("name", FORMATS)
def test_bytes_halve(name):
    """The pages of an fp8 cache take half the bytes of a bf16 one (plus 8 bytes of scales a
    page)."""
    caches = {
        dtype: cuattn.KVCache(2, 2, 128, dtype, page_size=16, capacity=512)
        for dtype in ("bfloat16", name)
    }
    half = caches["bfloat16"].k_pages.nbytes // 2
    quantised = caches[name]
    assert quantised.k_pages.nbytes == half
    assert quantised.k_scale.nbytes + quantised.v_scale.nbytes == 8 * quantised.k_pages.shape[0]


def _gqa_cache(
    name, head_dim, page_size, t_q, group, seed, prefill=60, window=40, k_gain=1.0, q_gain=1.0
):
    """Two ragged sequences under a sliding window, every slot it evicted or never filled
    holding NaN codes; a bf16 q. k_gain and q_gain multiply the keys and the queries."""
    rng = np.random.default_rng(seed)
    cache = cuattn.KVCache(
        2, 2, head_dim, name, page_size=page_size, policy=P.SlidingWindow(window)
    )
    k, v = (rng.standard_normal((2, 2, prefill, head_dim)) for _ in "kv")
    cache.append(_bf16(k * k_gain), _bf16(v), lengths=[prefill, prefill * 3 // 4])
    k, v = (2 * rng.standard_normal((2, 2, t_q, head_dim)) for _ in "kv")
    cache.append(_bf16(k * k_gain), _bf16(v))
    unused = cache.slot_pos < 0
    assert unused.any()
    cache.k_pages[unused] = cache.v_pages[unused] = 0x7F  # NaN in both formats
    return cache, _bf16(q_gain * rng.standard_normal((2, 2 * group, t_q, head_dim)))


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize(
    ("head_dim", "page_size", "t_q", "group", "resident_ctas"),
    [
        (64, 16, 1, 4, 1),  # one split; 4 of the 16 rows
        (128, 7, 2, 2, 3),  # pages that cut tiles anywhere; a few splits, merged in the kernel
        (64, 1, 4, 8, 8),  # a page a token; two row chunks a kv head
    ],
)
def test_tensor_core_kernel_against_the_oracle_and_the_split_kernel(
    name, head_dim, page_size, t_q, group, resident_ctas, launched, monkeypatch
):
    """attn_decode_gqa_fp8 (CUATTN_DECODE=gqa, bf16 q) against the float64 oracle over the
    dequantised values and against attn_decode_split_fp8; NaN codes in the slots the cache
    does not keep reach nothing; outputs start NaN-filled on the interpreter."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    cache, q = _gqa_cache(name, head_dim, page_size, t_q, group, seed=page_size + t_q)
    out, lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")
    assert launched == [geometry.DECODE_GQA_FP8_KERNEL]
    want = kept_attention(cache, q)
    _close(out, want)
    assert np.isfinite(lse).all()
    monkeypatch.setenv(geometry.DECODE_ENV, geometry.DECODE_SPLIT_FAMILY)
    split_out, split_lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")
    assert launched[1:] == [geometry.DECODE_FP8_KERNEL, "attn_decode_merge"]
    np.testing.assert_allclose(lse, split_lse, rtol=1e-2, atol=1e-2)
    _close(out, np.asarray(split_out).astype(np.float64))


def test_tensor_core_kernel_at_head_dim_256(launched, monkeypatch):
    """attn_decode_gqa_fp8 at d256 (Q's tile in shared memory, one CTA an SM) over e4m3 pages:
    GQA 4, t_q 4 (16 rows), NaN codes in every slot the cache does not keep, against the float64
    oracle over the dequantised values with one split and with a split a page."""
    cache, q = _gqa_cache("float8_e4m3fn", 256, 16, 4, 4, seed=25)
    want = kept_attention(cache, q)
    for resident_ctas in (1, 64):
        monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
        out, lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")
        _close(out, want)
        assert np.isfinite(lse).all()
    assert launched == [geometry.DECODE_GQA_FP8_KERNEL] * 2


def test_tensor_core_kernel_cycles_its_ring(launched, monkeypatch):
    """One split of ~420 kept tokens at d128: every stage refilled several times (scales and
    widened tiles with it), under several of the interpreter's warp orders."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 1)
    cache, q = _gqa_cache("float8_e4m3fn", 128, 16, 1, 4, seed=21, prefill=440, window=420)
    want = kept_attention(cache, q)
    for seed in range(3):
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        _close(cuattn.decode_attention(q, cache, backend="interp"), want)
    assert launched == [geometry.DECODE_GQA_FP8_KERNEL] * 3


def test_tensor_core_kernel_wraps_its_ring_many_times(launched, monkeypatch):
    """One split of ~1500 kept tokens at d128: 16-token tiles through 8 stages (two a
    consumer, two a producer round), every stage's barrier phase flipping ~12 times, and a
    sequence whose odd page count leaves its last round one tile."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 1)
    cache, q = _gqa_cache("float8_e5m2", 128, 16, 1, 4, seed=22, prefill=1540, window=1500)
    assert geometry.decode_gqa_stages(geometry.decode_gqa_fp8_tile(128)) == 8
    assert (np.asarray(cache.page_count) % 2 == 1).any()
    _close(cuattn.decode_attention(q, cache, backend="interp"), kept_attention(cache, q))
    assert launched == [geometry.DECODE_GQA_FP8_KERNEL]


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("d", [64, 128])  # one producer warp; two, taking alternate rounds
def test_tensor_core_kernel_takes_v_scales_past_fp16s_range(name, d, launched, monkeypatch):
    """P V runs on fp16 tensor cores over the V codes widened to fp16, P with its token's V scale
    relative to its tile's largest: values 2^-24 and 2^40 in size (page scales past fp16's range
    both ways), pages of 4 tokens whose scales differ by up to 2^10 within a 16-token tile and
    whose tiles' largest differ from tile to tile (O changes its units), NaN
    codes in every slot the cache does not keep; each kv head's rows against the float64 oracle
    over the dequantised values, at its own magnitude."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 1)  # one split: ~12 tiles a CTA
    rng = np.random.default_rng(31)
    group, prefill = 4, 200
    cache = cuattn.KVCache(2, 2, d, name, page_size=4, policy=P.SlidingWindow(180))
    sizes = np.array([[2.0**-24, 2.0**40], [1.0, 2.0**-10]])[:, :, None, None]
    page_gain = 2.0 ** np.array([0, 3, -4, 6, 1])  # by the token's page of 4: tiles' v_ref differ

    def gained(tokens, first):
        x = rng.standard_normal((2, 2, tokens, d))
        page = (first + np.arange(tokens)) // 4 % len(page_gain)
        return x * page_gain[page][None, None, :, None]

    k = rng.standard_normal((2, 2, prefill, d))
    cache.append(_bf16(k), _bf16(sizes * gained(prefill, 0)), lengths=[prefill, prefill - 9])
    cache.append(_bf16(rng.standard_normal((2, 2, 1, d))), _bf16(sizes * gained(1, prefill)))
    cache.v_pages[cache.slot_pos < 0] = 0x7F  # NaN in both formats
    v_scale = np.asarray(cache.v_scale)[np.unique(np.asarray(cache.page_table))]
    assert v_scale.min() < 2.0**-24 and v_scale.max() > 2.0**16  # past fp16's, both ways
    q = _bf16(rng.standard_normal((2, 2 * group, 1, d)))
    got = np.asarray(cuattn.decode_attention(q, cache, backend="interp")).astype(np.float64)
    want = kept_attention(cache, q)
    for b in range(2):
        for kv_head in range(2):
            rows = slice(kv_head * group, (kv_head + 1) * group)
            _close(got[b, rows], want[b, rows])
    assert launched == [geometry.DECODE_GQA_FP8_KERNEL]


@pytest.mark.parametrize("name", FORMATS)
def test_tensor_core_kernel_keeps_large_queries_in_fp16_range(name, launched, monkeypatch):
    """Q K^T runs in fp16: queries whose |q scale log2(e)| reaches ~10^5 (past fp16's 65504)
    against keys ~10^-6, so the scores stay ~1, match the oracle; an inf in q stays inf (a
    NaN row, as in float64), the other rows unharmed."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 3)
    cache, q = _gqa_cache(name, 64, 16, 2, 2, seed=23, k_gain=1e-6, q_gain=1e6)
    assert np.abs(np.asarray(q, np.float64)).max() * 64**-0.5 * np.log2(np.e) > 2**16
    want = kept_attention(cache, q)
    _close(cuattn.decode_attention(q, cache, backend="interp"), want)
    q = np.array(q)
    q[0, 1, 0, 5] = np.inf
    got = np.asarray(cuattn.decode_attention(q, cache, backend="interp")).astype(np.float64)
    want = kept_attention(cache, q)
    assert np.isnan(got[0, 1, 0]).all() and np.isnan(want[0, 1, 0]).all()
    rest = np.ones(got.shape[:3], dtype=bool)
    rest[0, 1, 0] = False
    assert np.abs(got[rest] - want[rest]).max() <= BF16_TOLERANCE * np.abs(want[rest]).max()
    assert launched == [geometry.DECODE_GQA_FP8_KERNEL] * 2


def test_fp16_queries_keep_the_split_kernel(launched, monkeypatch):
    """attn_decode_gqa_fp8 takes bf16 q (with modifiers too: its modifier variant); fp16 q (a
    probability times a small V scale could leave fp16's range) goes to attn_decode_split_fp8."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 1)
    cache, q = _gqa_cache("float8_e5m2", 64, 16, 1, 2, seed=5)
    fp16_q = np.asarray(q).astype(np.float16)
    _close(cuattn.decode_attention(fp16_q, cache, backend="interp"), kept_attention(cache, fp16_q))
    assert launched == [geometry.DECODE_FP8_KERNEL, "attn_decode_merge"]
    cuattn.decode_attention(q, cache, backend="interp", softcap=30.0)
    assert launched[2:] == [geometry.DECODE_GQA_FP8_KERNEL]


def test_geometry_matches_the_kernel_traits_and_the_compile_check_lists_it():
    """Every fp8 instantiation is in the compile check; geometry's threads and shared memory
    equal the C++ traits of the libraries the tests above built (bf16 q, head dims 64, 128)."""
    from dev.compile_check import kernel_instantiations

    names = {u.name_expression for u in kernel_instantiations()}
    fp8_gqa = [
        c for c in geometry.decode_gqa_configs() if c.kernel == geometry.DECODE_GQA_FP8_KERNEL
    ]
    configs = [*geometry.decode_fp8_configs(), *fp8_gqa]
    assert len(configs) == 64 + 32  # the tensor-core kernel's with and without modifiers
    for config in configs:
        assert config.name_expression in names
        if config.head_dim not in (64, 128) or config.dtype != "bfloat16":
            continue
        library = interp.library_for(config)
        assert library.traits(config.name_expression) == (config.threads, config.smem_bytes)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("family", [geometry.DECODE_SPLIT_FAMILY, geometry.DECODE_GQA_FAMILY])
def test_on_the_gpu(name, family, monkeypatch):
    """An fp8 cache on CuPy: refused without CUATTN_DECODE_FP8=kernel; with it, the kernel
    (split or tensor-core) against the oracle over the dequantised values, the same codes and
    scales as a host cache given the same tokens, and append + decode steps that never wait
    for the host."""
    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    from tests.helpers.no_sync import refuse_host_round_trips

    monkeypatch.setenv(geometry.DECODE_ENV, family)
    like = cupy.zeros(1, dtype=cupy.float32)
    rng = np.random.default_rng(8)
    k, v = (_bf16(rng.standard_normal((2, 2, 300, 128))) for _ in "kv")
    q = _bf16(rng.standard_normal((2, 8, 1, 128)))
    caches = {
        where: cuattn.KVCache(2, 2, 128, name, policy=P.SlidingWindow(200), like=like_of)
        for where, like_of in (("host", None), ("gpu", like))
    }
    caches["host"].append(k, v, lengths=[300, 250])
    caches["gpu"].append(cupy.asarray(k), cupy.asarray(v), lengths=[300, 250])
    assert np.array_equal(cupy.asnumpy(caches["gpu"].k_pages), caches["host"].k_pages)
    assert np.array_equal(cupy.asnumpy(caches["gpu"].v_scale), caches["host"].v_scale)
    with pytest.raises(ValueError, match=geometry.DECODE_FP8_ENV):
        cuattn.decode_attention(cupy.asarray(q), caches["gpu"])
    monkeypatch.setenv(geometry.DECODE_FP8_ENV, geometry.DECODE_FP8_KERNEL_FAMILY)
    out = cupy.asnumpy(cuattn.decode_attention(cupy.asarray(q), caches["gpu"]))
    _close(out, kept_attention(caches["gpu"], q))
    steps = [
        tuple(cupy.asarray(_bf16(rng.standard_normal((2, 2, 1, 128)))) for _ in "kv")
        for _ in range(20)
    ]
    q_gpu = cupy.asarray(q)
    cupy.cuda.Device().synchronize()
    refuse_host_round_trips(monkeypatch)
    for step_k, step_v in steps:
        caches["gpu"].append(step_k, step_v)
        out = cuattn.decode_attention(q_gpu, caches["gpu"])
    monkeypatch.undo()
    assert bool(cupy.isfinite(out).all())
