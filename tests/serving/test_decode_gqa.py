"""attn_decode_gqa (kernels/attn_decode_gqa.cu), the opt-in tensor-core decode, on the
interpreter: against the float64 oracle over the kept tokens and against attn_decode_split,
over page sizes 1 to 64, t_q 1 to 8, GQA groups 1 to 8, head dims 16 to 256, evicted slots
poisoned with NaN, one split and many, Quest's pages, and the special values of docs/design.md
§7. Its route
(CUATTN_DECODE=gqa; attn_decode_split, the named fallback, otherwise) and its split counts."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import policies as P
from cuattn.backends import geometry, interp
from cuattn.serving import decode
from cuattn.tools.oracle import kept_attention
from tests.helpers.launches import record_launches
from tests.serving import test_decode_special_values as special

ml_dtypes = pytest.importorskip("ml_dtypes")

NUMPY_DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TOLERANCE = {"float16": 1e-2, "bfloat16": 2e-2}  # max |x - ref| / max |ref|
WINDOW = 40  # tokens SlidingWindow keeps: the older ones are evicted, their slots emptied


def _cache(dtype, head_dim, page_size, t_q, group, seed, xp=np, prefill=60, window=WINDOW):
    """Two ragged sequences (prefill and three quarters of it, then a step of t_q) under a
    sliding window, every slot the window evicted or never filled poisoned with NaN in K and V;
    and q. ``xp``: NumPy, or CuPy for a cache on the GPU."""
    rng = np.random.default_rng(seed)
    np_dtype = NUMPY_DTYPES[dtype]
    like = None if xp is np else xp.zeros(1, dtype=xp.float32)
    policy = P.SlidingWindow(window)
    cache = cuattn.KVCache(2, 2, head_dim, dtype, page_size=page_size, policy=policy, like=like)
    k, v = (rng.standard_normal((2, 2, prefill, head_dim)).astype(np_dtype) for _ in "kv")
    cache.append(xp.asarray(k), xp.asarray(v), lengths=[prefill, prefill * 3 // 4])
    k, v = (rng.standard_normal((2, 2, t_q, head_dim)).astype(np_dtype) for _ in "kv")
    cache.append(xp.asarray(k), xp.asarray(v))
    unused = cache.slot_pos < 0
    assert bool(unused.any())
    cache.k_pages[unused] = np.nan
    cache.v_pages[unused] = np.nan
    q = rng.standard_normal((2, 2 * group, t_q, head_dim)).astype(np_dtype)
    return cache, xp.asarray(q)


@pytest.mark.parametrize(
    ("dtype", "head_dim", "page_size", "t_q", "group", "resident_ctas"),
    [
        ("bfloat16", 64, 16, 1, 4, 1),  # one split; 4 of the 16 rows
        ("float16", 64, 1, 3, 2, 64),  # a page a token; a split a page or so, merged
        ("bfloat16", 128, 64, 8, 2, 8),  # 16 rows: t_q 8 of 2 query heads; wave-sized splits
        ("float16", 64, 16, 4, 8, 8),  # 32 rows: two row chunks a kv head
        ("bfloat16", 128, 7, 2, 1, 3),  # no GQA; pages that cut tiles anywhere
    ],
)
def test_against_the_oracle_and_the_split_kernel(
    dtype, head_dim, page_size, t_q, group, resident_ctas, launched, monkeypatch
):
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    cache, q = _cache(dtype, head_dim, page_size, t_q, group, seed=page_size + t_q)
    out, lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")
    assert launched == [geometry.DECODE_GQA_KERNEL]
    want = kept_attention(cache, q, head_dim**-0.5)
    got = out.astype(np.float64)
    assert np.isfinite(got).all() and np.isfinite(lse).all()
    assert np.abs(got - want).max() <= TOLERANCE[dtype] * np.abs(want).max()
    monkeypatch.setenv(geometry.DECODE_ENV, geometry.DECODE_SPLIT_FAMILY)
    split_out, split_lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")
    assert launched[1:] == ["attn_decode_split", "attn_decode_merge"]
    np.testing.assert_allclose(lse, split_lse, rtol=1e-2, atol=1e-2)
    split = split_out.astype(np.float64)
    assert np.abs(got - split).max() <= TOLERANCE[dtype] * np.abs(want).max()


def test_a_long_split_cycles_the_stage_ring(launched, monkeypatch):
    """One split of ~420 kept tokens at d128 (32-token tiles): 14 tiles, so every stage of the
    ring is refilled three times and each barrier's parity flips back and forth, and the online
    softmax rescales O over many tiles. Under several of the interpreter's warp orders: a
    consumer that hands its stage back before its P V reads it gets the next tile's V under
    some of them (seeds 1-3 here, not 0)."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 1)
    cache, q = _cache("bfloat16", 128, 16, 1, 4, seed=21, prefill=440, window=420)
    want = kept_attention(cache, q, 128**-0.5)
    for seed in range(4):
        monkeypatch.setenv("CUATTN_INTERP_SEED", str(seed))
        out = cuattn.decode_attention(q, cache, backend="interp")
        error = np.abs(out.astype(np.float64) - want).max()
        assert error <= TOLERANCE["bfloat16"] * np.abs(want).max(), f"seed {seed}"
    assert launched == [geometry.DECODE_GQA_KERNEL] * 4


@pytest.mark.parametrize(
    ("head_dim", "dtype"),
    [(16, "float16"), (48, "bfloat16"), (96, "float16")],
)
def test_the_other_head_dims(head_dim, dtype, launched, monkeypatch):
    """Head dims other than 64 and 128, one dtype each: tiles of 64 tokens with 2 and 6 copies a
    K row, of 32 with 12 (32 and 80, the same shapes again, only compile: every interpreter
    library costs a compile in CI); t_q 2, GQA 3, a few splits."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 8)
    cache, q = _cache(dtype, head_dim, page_size=16, t_q=2, group=3, seed=head_dim)
    out = cuattn.decode_attention(q, cache, backend="interp")
    assert launched == [geometry.DECODE_GQA_KERNEL]
    want = kept_attention(cache, q, head_dim**-0.5)
    assert np.abs(out.astype(np.float64) - want).max() <= TOLERANCE[dtype] * np.abs(want).max()


@pytest.mark.parametrize(
    ("dtype", "page_size", "t_q", "resident_ctas", "prefill", "window"),
    [
        ("bfloat16", 64, 1, 1, 200, 180),  # one split of ~12 tiles: the 8-stage ring wraps
        ("float16", 16, 4, 64, 60, WINDOW),  # 16 rows (GQA 4 x t_q 4); a split a page, merged
    ],
)
def test_head_dim_256(dtype, page_size, t_q, resident_ctas, prefill, window, launched, monkeypatch):
    """d256 (Q's tile in shared memory, one CTA an SM, 16-token tiles through 8 stages): GQA 4,
    NaN in every slot the window evicted or never filled, outputs NaN-filled, against the
    float64 oracle; every row counts tokens, so the lse is finite."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    cache, q = _cache(dtype, 256, page_size, t_q, 4, seed=t_q, prefill=prefill, window=window)
    out, lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")
    assert launched == [geometry.DECODE_GQA_KERNEL]
    want = kept_attention(cache, q, 256**-0.5)
    got = out.astype(np.float64)
    assert np.isfinite(got).all() and np.isfinite(lse).all()
    assert np.abs(got - want).max() <= TOLERANCE[dtype] * np.abs(want).max()


def test_quest_pages(launched, monkeypatch):
    """Quest's per-row page choice (chosen, read by the producer into each token's row mask)."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 8)
    rng = np.random.default_rng(3)
    cache = cuattn.KVCache(2, 2, 64, "bfloat16", page_size=8, policy=P.Quest(3, 8))
    k, v = (rng.standard_normal((2, 2, 70, 64)).astype(ml_dtypes.bfloat16) for _ in "kv")
    cache.append(k, v, lengths=[70, 51])
    q = rng.standard_normal((2, 6, 2, 64)).astype(ml_dtypes.bfloat16)
    out = cuattn.decode_attention(q, cache, backend="interp")
    assert launched == [geometry.QUEST_SELECT_KERNEL, geometry.DECODE_GQA_KERNEL]
    want = cuattn.decode_attention(q, cache, backend="numpy").astype(np.float64)
    error = np.abs(out.astype(np.float64) - want).max()
    assert error <= TOLERANCE["bfloat16"] * np.abs(want).max()
    everything = kept_attention(cache, q, 64**-0.5)
    assert np.abs(everything - want).max() > 0.1 * np.abs(want).max()  # the choice matters


SPECIAL_CASES = [
    special.nan_in_q,
    special.nan_in_k,
    special.nan_in_the_newest_v,
    special.inf_in_v,
    special.plus_inf_score,
    special.every_score_minus_inf,
]


@pytest.mark.parametrize("resident_ctas", [1, 64])
@pytest.mark.parametrize("case", SPECIAL_CASES, ids=lambda c: c.__name__)
def test_special_values_follow_the_dense_computation(case, resident_ctas, launched, monkeypatch):
    """NaN and inf as a dense masked softmax over the kept tokens (bfloat16, head dim 64, so
    that attn_decode_gqa takes it): one split per table or one page per split."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    monkeypatch.setattr(special, "D", 64)
    cache, q = special.build(case, "bfloat16", None)
    special.check(cache, q, "interp", special.TOL["bfloat16"])
    assert launched[0] == geometry.DECODE_GQA_KERNEL


def test_rows_with_nothing_to_attend_and_stale_slots(launched, monkeypatch):
    """A window of one token with t_q = 2: query 0 attends nothing and gives 0 and -inf, also
    when the kept token's v is NaN; slots the cache does not keep hold NaN and inf and reach
    nothing."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 64)
    monkeypatch.setattr(special, "D", 64)
    cache, q = special.build(special.nan_in_the_newest_v, "bfloat16", P.SlidingWindow(1))
    stale = cache.slot_pos < 0
    cache.k_pages[stale] = np.inf
    cache.v_pages[stale] = np.nan
    out, lse = special.check(cache, q, "interp", special.TOL["bfloat16"])
    assert launched[0] == geometry.DECODE_GQA_KERNEL
    out = out.astype(np.float32)
    assert (out[:, :, 0] == 0).all() and (lse[:, :, 0] == -np.inf).all()
    assert np.isnan(out[0, 2:, 1, 2]).all() and np.isfinite(lse[:, :, 1]).all()


def test_the_route_keeps_the_split_kernel_by_default_and_for_what_gqa_lacks(monkeypatch):
    assert geometry.decode_family() == geometry.DECODE_SPLIT_FAMILY
    assert not geometry.decode_gqa_applies(128, "bfloat16")
    monkeypatch.setenv(geometry.DECODE_ENV, geometry.DECODE_GQA_FAMILY)
    assert geometry.decode_gqa_applies(128, "bfloat16")
    assert geometry.decode_gqa_applies(64, "float8_e4m3fn")  # fp8 pages (a bf16 q)
    assert not geometry.decode_gqa_applies(128, "float32")  # fp32
    assert geometry.decode_gqa_applies(256, "float16")  # Q's tile in shared memory
    assert not geometry.decode_gqa_applies(192, "bfloat16")  # no instantiation
    # the modifier variant: score modifiers, HeavyHitters' scores, and fp16 holding q scale
    # log2(e) where a scale past 1 / log2(e) could overflow it (bf16 cannot)
    assert not geometry.decode_gqa_mods("float16", False, False, 0.1)
    assert geometry.decode_gqa_mods("float16", True, False, 0.1)
    assert geometry.decode_gqa_mods("bfloat16", False, True, 0.1)
    assert geometry.decode_gqa_mods("float16", False, False, 0.8)
    assert not geometry.decode_gqa_mods("bfloat16", False, False, 0.8)
    monkeypatch.setenv(geometry.DECODE_ENV, "fast")
    with pytest.raises(ValueError, match=r"CUATTN_DECODE='fast' is not a decode kernel family"):
        geometry.decode_family()


def test_split_counts_follow_wave_efficiency():
    """H200 sizes (132 SMs, 2 CTAs each): batch 64 x 8 kv heads fills whole waves unsplit;
    1 x 128k (8 tables of 2048 pages of 64) takes about one wave of splits; never more splits
    than pages or DECODE_MAX_SPLITS."""
    resident = 132 * 2
    assert geometry.decode_gqa_splits(512, 2048, resident) == (1, 2048)
    splits, per_split = geometry.decode_gqa_splits(8, 2048, resident)
    assert 0.9 * resident <= 8 * splits <= resident and splits * per_split >= 2048
    assert geometry.decode_gqa_splits(8, 3, resident) == (3, 1)
    # one table: the fewest splits within DECODE_GQA_WAVE_SLACK of DECODE_MAX_SPLITS' wave
    splits = geometry.decode_gqa_splits(1, 10**6, resident)[0]
    slack = geometry.DECODE_GQA_WAVE_SLACK
    assert slack * geometry.DECODE_MAX_SPLITS <= splits <= geometry.DECODE_MAX_SPLITS
    assert geometry.wave_efficiency(396, 264) == pytest.approx(0.75)


def test_geometry_matches_the_kernel_traits_and_the_compile_check_lists_it():
    from dev.compile_check import kernel_instantiations

    names = {u.name_expression for u in kernel_instantiations()}
    for config in geometry.decode_gqa_configs():
        assert config.name_expression in names
        if config.head_dim not in (64, 128) or config.mods and config.head_dim == 128:
            continue  # the libraries the tests above (and test_decode_gqa_mods.py's) built
        library = interp.library_for(config)
        assert library.traits(config.name_expression) == (config.threads, config.smem_bytes)


@pytest.mark.gpu
@pytest.mark.parametrize("resident_ctas", [1, 256])
@pytest.mark.parametrize(
    ("dtype", "head_dim", "page_size", "t_q", "group"),
    [
        ("bfloat16", 128, 16, 1, 4),
        ("float16", 128, 64, 4, 4),
        ("bfloat16", 64, 1, 8, 2),
        ("float16", 64, 16, 2, 8),
        ("bfloat16", 256, 16, 2, 4),  # Q's tile in shared memory, one CTA an SM
    ],
)
def test_on_the_gpu(dtype, head_dim, page_size, t_q, group, resident_ctas, monkeypatch):
    """The interpreter's cases on a CuPy cache (NaN in every slot the cache does not keep), one
    split per table or many (the fused merge), against the float64 oracle; the route launched
    attn_decode_gqa alone. What a GPU run must pass before CUATTN_DECODE=gqa can be the default."""
    from cuattn.backends.cuda_runtime import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    from cuattn.backends import cuda

    monkeypatch.setenv(geometry.DECODE_ENV, geometry.DECODE_GQA_FAMILY)
    monkeypatch.setattr(decode, "_resident_ctas", lambda impl, d, dt, gqa: resident_ctas)
    names = record_launches(monkeypatch, cuda.CudaBackend)
    cache, q = _cache(dtype, head_dim, page_size, t_q, group, seed=3, xp=cupy, prefill=600)
    out, lse = cuattn.decode_attention(q, cache, return_lse=True)
    assert names == [geometry.DECODE_GQA_KERNEL]
    got = cupy.asnumpy(out).astype(np.float64)
    want = kept_attention(cache, q, head_dim**-0.5)
    assert np.isfinite(got).all() and bool(cupy.isfinite(lse).all())
    assert np.abs(got - want).max() <= TOLERANCE[dtype] * np.abs(want).max()
