"""Quest's page choice (kernels/quest_select.cu) on the interpreter: the chosen set of every
query row equal to the reference's (cuattn/serving/decode.py _quest_pages) over each table's
real pages, 0 past them, for page sizes 1/16/64, t_q 1-8, GQA 1-8, every budget, ties, NaN and
inf in keys and queries, lengths ending mid-page and tables with fewer pages than the budget;
decode_attention's output the same through the kernel and through the array path. The same with
each table split over CTAs and a CTA a row selecting (batch 1, splits ending mid-table, tables
shorter than a split): the one-CTA path's sets bit for bit. Bounds in bfloat16, rounded outward
(16-bit and fp8 caches): the rounding over random and special float32 values, and the same sets
on every path.

The keys and queries are small integers wherever the sets must be equal: every partial sum of a
bound is then exact in float32, so the kernel's fixed summation order and the reference's
matrix products give the same bound, ties included (which small integers make plentiful). With
real-valued inputs the sets may differ only where two bounds are within float32 rounding of
each other (test_real_valued_bounds_within_rounding)."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import policies
from cuattn.backends import geometry, interp
from cuattn.backends.kernels import QUEST_UNWRITTEN
from cuattn.serving import decode
from tests.helpers.launches import record_launches

KEY_RANGE = 4  # keys in [-4, 4], queries in [-3, 3]: bounds exact in float32 up to d = 256
QUERY_RANGE = 3


def _keys(lengths, kv_heads, head_dim, seed):
    """Integer keys [batch, kv_heads, longest, head_dim] in [-KEY_RANGE, KEY_RANGE]."""
    rng = np.random.default_rng(seed)
    shape = (len(lengths), kv_heads, max(lengths), head_dim)
    return rng.integers(-KEY_RANGE, KEY_RANGE + 1, shape).astype(np.float32)


def _cache(lengths, kv_heads, head_dim, page_size, budget, seed, dtype="float32"):
    """A Quest cache holding _keys (values: the same), ``lengths`` tokens a sequence."""
    cache = cuattn.KVCache(
        len(lengths),
        kv_heads,
        head_dim,
        dtype,
        page_size=page_size,
        policy=policies.Quest(budget, page_size),
    )
    k = _keys(lengths, kv_heads, head_dim, seed).astype(cache.k_pages.dtype)
    cache.append(k, k, lengths=lengths)
    return cache


def _queries(cache, group, t_q, seed, dtype=np.float32):
    rng = np.random.default_rng(seed + 1)
    shape = (cache.batch, cache.kv_heads * group, t_q, cache.head_dim)
    return rng.integers(-QUERY_RANGE, QUERY_RANGE + 1, shape).astype(dtype)


def _kernel_choice(cache, q):
    chosen = decode.quest_chosen(cache, q, *cache.device_tables(), impl=interp.backend)
    assert chosen.dtype == np.uint8 and chosen.shape[:3] == q.shape[:3]
    assert not (chosen == QUEST_UNWRITTEN).any(), "an entry the kernel did not write"
    return chosen


def _assert_reference_sets(cache, q, chosen):
    """chosen [B, H, t_q, max_pages] equal to _quest_pages's over each table's pages, 0 after."""
    group = q.shape[1] // cache.kv_heads
    for b in range(cache.batch):
        length = int(cache.lengths[b])
        for h in range(cache.kv_heads):
            rows = slice(h * group, (h + 1) * group)
            want = decode._quest_pages(cache, b, h, q[b, rows], length)
            count = want.shape[-1]
            np.testing.assert_array_equal(chosen[b, rows, :, :count], want.astype(np.uint8))
            assert not chosen[b, rows, :, count:].any()


CASES = [
    # lengths, kv_heads, group, t_q, head_dim, page_size
    ([40, 9], 1, 1, 1, 16, 1),  # page size 1: a page a token
    ([200, 33, 16], 2, 4, 3, 64, 16),  # mid-page, a page and one token, exactly one page
    ([300, 65], 1, 2, 8, 128, 64),  # 64-token pages, t_q 8
    ([57, 23], 2, 8, 2, 32, 4),  # GQA 8 x t_q 2 = 16 rows: two row tiles
    ([70], 1, 8, 8, 256, 8),  # 64 rows at d256: 16 row tiles of 4
    ([90, 41], 2, 3, 5, 48, 16),  # a head dim that leaves lanes idle
]


@pytest.mark.parametrize(("lengths", "kv_heads", "group", "t_q", "head_dim", "page_size"), CASES)
def test_the_chosen_sets_equal_the_reference(lengths, kv_heads, group, t_q, head_dim, page_size):
    cache = _cache(lengths, kv_heads, head_dim, page_size, 3, seed=len(lengths) + head_dim)
    q = _queries(cache, group, t_q, seed=head_dim)
    _assert_reference_sets(cache, q, _kernel_choice(cache, q))


@pytest.mark.parametrize(
    ("page_size", "lengths"), [(1, [34, 12]), (16, [250, 40]), (64, [700, 65])]
)
def test_every_budget(page_size, lengths):
    """Budgets 1 to past every table's pages: fewer real pages than the budget takes them all."""
    cache = _cache(lengths, 2, 16, page_size, 1, seed=page_size)
    q = _queries(cache, 2, 2, seed=page_size)
    most = int(cache.page_count.max())
    for budget in range(1, most + 2):
        cache.policy.pages = budget
        _assert_reference_sets(cache, q, _kernel_choice(cache, q))


def test_ties_read_the_lower_pages():
    """Every page's keys equal: every bound ties, so the budget's lowest pages and the newest."""
    cache = cuattn.KVCache(1, 1, 16, "float32", page_size=4, policy=policies.Quest(3, 4))
    k = np.ones((1, 1, 37, 16), np.float32)
    cache.append(k, k)
    q = _queries(cache, 2, 3, seed=5)
    chosen = _kernel_choice(cache, q)
    want = np.zeros(chosen.shape[-1], np.uint8)
    want[[0, 1, 2, 9]] = 1  # 10 pages: the three lowest, and the newest
    np.testing.assert_array_equal(chosen, np.broadcast_to(want, chosen.shape))
    _assert_reference_sets(cache, q, chosen)


def test_special_values_in_keys_and_queries():
    """NaN keys (a NaN bound: read first), +-inf keys meeting queries of either sign or 0 (inf,
    -inf, or NaN from 0 * inf and inf - inf), a NaN query element (every bound NaN: the lowest
    pages), an all-zero query (every bound 0 or NaN), -0 bounds tying +0."""
    cache = _cache([160, 100], 2, 16, 4, 6, seed=3)
    key_max, key_min = cache.key_max, cache.key_min
    table = cache.page_table
    key_max[table[0, 0, 3], 5] = np.nan
    key_min[table[0, 0, 7], 2] = -np.inf
    key_max[table[0, 0, 11], 9] = np.inf
    key_max[table[0, 1, 2], 0] = np.inf
    key_min[table[0, 1, 2], 1] = -np.inf
    key_max[table[1, 0, 4], :] = -np.inf
    key_min[table[1, 1, 6], :] = np.nan
    key_min[table[1, 1, 8]] = key_max[table[1, 1, 8]] = 0.0  # -0 for every negative query
    q = _queries(cache, 2, 4, seed=3)
    q[0, 1, 2, 7] = np.nan
    q[1, 2, 0, :] = 0.0
    q[1, 3, 1, :] = -1.0
    q[0, 0, 3, 5] = 0.0  # 0 against the NaN max
    _assert_reference_sets(cache, q, _kernel_choice(cache, q))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_queries(dtype):
    """q in fp16 or bf16 (integers: exact), widened as the reference's astype(float32)."""
    cache = _cache([120, 77], 2, 64, 16, 2, seed=9, dtype=dtype)
    q = _queries(cache, 4, 2, seed=9, dtype=cache.k_pages.dtype)
    _assert_reference_sets(cache, q, _kernel_choice(cache, q))


def test_real_valued_bounds_within_rounding():
    """Gaussian keys and queries: the kernel sums in its own float32 order, so a page may trade
    places with one whose reference bound is within float32 rounding; never with any other."""
    rng = np.random.default_rng(21)
    cache = cuattn.KVCache(2, 2, 128, "float32", page_size=16, policy=policies.Quest(9, 16))
    k = rng.standard_normal((2, 2, 700, 128)).astype(np.float32)
    cache.append(k, k, lengths=[700, 333])
    q = rng.standard_normal((2, 8, 3, 128)).astype(np.float32)
    chosen = _kernel_choice(cache, q)
    eps = np.finfo(np.float32).eps
    for b in range(2):
        for h in range(2):
            count = int(cache.page_count[b, h])
            pages = cache.page_table[b, h, :count]
            lo, hi = (x[pages].astype(np.float64) for x in (cache.key_min, cache.key_max))
            qf = q[b, 4 * h : 4 * h + 4].astype(np.float64)
            bound = np.maximum(qf, 0) @ hi.T + np.minimum(qf, 0) @ lo.T  # [4, t_q, count]
            scale = np.abs(qf) @ np.maximum(np.abs(lo), np.abs(hi)).T
            tolerance = 4 * 128 * eps * scale.max()
            got = chosen[b, 4 * h : 4 * h + 4, :, : count - 1].astype(bool)
            assert (got.sum(-1) == 9).all() and chosen[b, 4 * h : 4 * h + 4, :, count - 1].all()
            others = bound[..., : count - 1]
            lowest_in = np.where(got, others, np.inf).min(-1)
            highest_out = np.where(got, -np.inf, others).max(-1)
            assert (lowest_in >= highest_out - tolerance).all()


def test_decode_equals_the_array_path(monkeypatch):
    """decode_attention through quest_select (one launch before the decode kernels) gives the
    array path's output bit for bit, and the reference's within float32 rounding."""
    cache = _cache([150, 61], 2, 32, 16, 3, seed=13)
    rng = np.random.default_rng(13)
    q = rng.standard_normal((2, 8, 2, 32)).astype(np.float32)
    names = record_launches(monkeypatch, interp.InterpBackend)
    out, lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")
    assert names[0] == geometry.QUEST_SELECT_KERNEL
    assert names.count(geometry.QUEST_SELECT_KERNEL) == 1
    monkeypatch.setattr(decode, "quest_kernel_applies", lambda impl, qb: False)
    names.clear()
    out_xp, lse_xp = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")
    assert geometry.QUEST_SELECT_KERNEL not in names
    np.testing.assert_array_equal(out, out_xp)
    np.testing.assert_array_equal(lse, lse_xp)
    out_ref, lse_ref = cuattn.decode_attention(q, cache, return_lse=True, backend="numpy")
    np.testing.assert_allclose(out, out_ref, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(lse, lse_ref, rtol=2e-5, atol=2e-5)


def test_the_gpu_path_is_opt_in(monkeypatch):
    """On a GPU quest_select runs only with CUATTN_QUEST=kernel; the interpreter always runs it;
    a dtype or head dim with no instantiation keeps the array path; a bad value is refused."""
    gpu = type("Gpu", (), {"on_gpu": True, "quest_select": None})()
    q = np.zeros((1, 2, 1, 64), np.float32)
    monkeypatch.delenv(geometry.QUEST_ENV, raising=False)
    assert not decode.quest_kernel_applies(gpu, q)
    assert decode.quest_kernel_applies(interp.backend, q)
    monkeypatch.setenv(geometry.QUEST_ENV, geometry.QUEST_KERNEL_FAMILY)
    assert decode.quest_kernel_applies(gpu, q)
    assert not decode.quest_kernel_applies(interp.backend, q.astype(np.float64))
    assert not decode.quest_kernel_applies(interp.backend, np.zeros((1, 2, 1, 24), np.float32))
    assert not decode.quest_kernel_applies(None, q)
    monkeypatch.setenv(geometry.QUEST_ENV, "fast")
    with pytest.raises(ValueError, match=geometry.QUEST_ENV):
        decode.quest_kernel_applies(gpu, q)


def test_bad_arguments_are_refused_before_any_launch(monkeypatch):
    cache = _cache([40], 2, 16, 4, 2, seed=1)
    q = _queries(cache, 2, 1, seed=1)
    table, count = cache.device_tables()
    names = record_launches(monkeypatch, interp.InterpBackend)
    select = interp.backend.quest_select
    with pytest.raises(TypeError, match="key_min"):
        select(q, cache.key_min.astype(np.float64), cache.key_max, table, count, 2)
    with pytest.raises(TypeError, match="page_table"):
        select(q, cache.key_min, cache.key_max, table.astype(np.int64), count, 2)
    with pytest.raises(ValueError, match="page_count"):
        select(q, cache.key_min, cache.key_max, table, count[:, :1], 2)
    with pytest.raises(ValueError, match="key_max"):
        select(q, cache.key_min, cache.key_max[:, :8], table, count, 2)
    with pytest.raises(ValueError, match="heads"):
        select(q[:, :3], cache.key_min, cache.key_max, table, count, 2)
    with pytest.raises(ValueError, match="budget_pages"):
        select(q, cache.key_min, cache.key_max, table, count, -1)
    with pytest.raises(TypeError, match="budget_pages"):
        select(q, cache.key_min, cache.key_max, table, count, 2.0)
    assert names == []


def test_geometry_matches_the_kernel_traits():
    """Geometry's threads and shared memory equal the C++ traits of every instantiation."""
    kernels = (geometry.QUEST_SELECT_KERNEL, geometry.QUEST_ROWS_KERNEL)
    configs = [c for c in geometry.all_configs() if c.kernel in kernels]
    per_bound = len(geometry.HEAD_DIMS) * len(geometry.DTYPES)
    assert len(configs) == per_bound * len(geometry.QUEST_BOUND_DTYPES) + 1
    for config in configs:
        library = interp.library_for(config)
        assert library.traits(config.name_expression) == (config.threads, config.smem_bytes)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_instantiation_compiles_without_spills(arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options, kernel_source
    from dev.compile_check import compile_units, kernel_instantiations

    units = [u for u in kernel_instantiations() if u.source_file == "quest_select.cu"]
    per_bound = len(geometry.HEAD_DIMS) * len(geometry.DTYPES)
    assert len(units) == per_bound * len(geometry.QUEST_BOUND_DTYPES) + 1
    results = compile_units(kernel_source("quest_select.cu"), units, arch, common_options())
    for result in results:
        assert result.ok, (result.unit.name_expression, result.error, result.stats)


@pytest.mark.gpu
@pytest.mark.parametrize(("page_size", "t_q", "group"), [(16, 1, 4), (64, 4, 4), (1, 8, 2)])
def test_on_the_gpu(page_size, t_q, group, monkeypatch):
    """A CuPy cache with CUATTN_QUEST=kernel: quest_select's sets equal the reference's on a
    host cache given the same tokens (integer keys: exact bounds; fp32 FTZ changes nothing for
    them), and decode_attention's output the CuPy path's; without the variable the CuPy path
    runs. What a GPU run must pass before the kernel can be the GPU's default."""
    from cuattn.backends.cuda_runtime import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    from cuattn.backends import resolve_backend

    lengths = [900, 333, 40]
    host = _cache(lengths, 2, 128, page_size, 7, seed=page_size)
    q = _queries(host, group, t_q, seed=page_size)
    gpu = cuattn.KVCache(
        3,
        2,
        128,
        "float32",
        page_size=page_size,
        policy=policies.Quest(7, page_size),
        like=cupy.zeros(1, dtype=cupy.float32),
    )
    keys = _keys(lengths, 2, 128, seed=page_size)
    gpu.append(cupy.asarray(keys), cupy.asarray(keys), lengths=lengths)
    impl = resolve_backend("cuda", on_device=True)
    q_gpu = cupy.asarray(q)
    monkeypatch.delenv(geometry.QUEST_ENV, raising=False)
    assert not decode.quest_kernel_applies(impl, q_gpu)
    monkeypatch.setenv(geometry.QUEST_ENV, geometry.QUEST_KERNEL_FAMILY)
    names = record_launches(monkeypatch, type(impl))
    chosen = decode.quest_chosen(gpu, q_gpu, *gpu.device_tables(), impl=impl)
    # 6 pairs split over the device where their tables allow (page 1 and 16), then a CTA a row
    resident = decode._quest_resident_ctas(impl, 128)
    splits, _ = geometry.quest_splits(6, gpu.page_table.shape[2], resident)
    want = [geometry.QUEST_SELECT_KERNEL] + [geometry.QUEST_ROWS_KERNEL] * (splits > 1)
    assert names == want
    _assert_reference_sets(host, q, cupy.asnumpy(chosen))
    single = impl.quest_select(q_gpu, gpu.key_min, gpu.key_max, *gpu.device_tables(), 7)
    np.testing.assert_array_equal(cupy.asnumpy(single), cupy.asnumpy(chosen))
    out = cupy.asnumpy(cuattn.decode_attention(q_gpu, gpu))
    monkeypatch.setenv(geometry.QUEST_ENV, geometry.QUEST_XP_FAMILY)
    np.testing.assert_array_equal(out, cupy.asnumpy(cuattn.decode_attention(q_gpu, gpu)))


# ---- a table split over CTAs (quest_select over page chunks, then quest_select_rows) ----------


def _select(cache, q, resident_ctas):
    """quest_select on the interpreter with ``resident_ctas`` (None: one CTA a pair)."""
    table, count = cache.device_tables()
    chosen = interp.backend.quest_select(
        q, cache.key_min, cache.key_max, table, count, cache.policy.pages, resident_ctas
    )
    assert chosen.dtype == np.uint8 and not (chosen == QUEST_UNWRITTEN).any()
    return chosen


SPLIT_CASES = [
    # lengths, kv_heads, group, t_q, head_dim, page_size, resident CTAs
    ([2000], 1, 4, 1, 16, 4, 64),  # batch 1, 500 pages: 28 splits of 18, the last of 14
    ([900, 20], 1, 1, 8, 32, 4, 16),  # a table of 5 pages, fewer than a split's 28
    ([1500], 2, 8, 2, 64, 8, 8),  # GQA 8 x t_q 2, 4 splits of 47 pages: ends mid-table
    ([700, 333], 2, 3, 5, 48, 1, 32),  # page size 1: a page a token, GQA 3, t_q 5
    ([600], 1, 8, 8, 256, 16, 8),  # 64 rows at d256 (4-row tiles), 38 pages: 2 splits of 19
    ([3000], 1, 2, 3, 128, 64, 8),  # page 64, 47 pages: 2 splits of 24 and 23
]


@pytest.mark.parametrize(
    ("lengths", "kv_heads", "group", "t_q", "head_dim", "page_size", "resident"), SPLIT_CASES
)
def test_split_tables_choose_the_single_kernels_sets(
    lengths, kv_heads, group, t_q, head_dim, page_size, resident, monkeypatch
):
    """Each table split over CTAs (quest_splits of ``resident`` CTAs) and selected a CTA a row:
    the single kernel's sets bit for bit, and the reference's."""
    budget = max(int(np.ceil(max(lengths) / page_size)) // 4, 1)
    cache = _cache(lengths, kv_heads, head_dim, page_size, budget, seed=sum(lengths) + t_q)
    q = _queries(cache, group, t_q, seed=head_dim + t_q)
    max_pages = cache.device_tables()[0].shape[2]
    splits, _ = geometry.quest_splits(cache.batch * kv_heads, max_pages, resident)
    assert splits > 1
    names = record_launches(monkeypatch, interp.InterpBackend)
    split = _select(cache, q, resident)
    assert names == [geometry.QUEST_SELECT_KERNEL, geometry.QUEST_ROWS_KERNEL]
    single = _select(cache, q, None)
    np.testing.assert_array_equal(split, single)
    _assert_reference_sets(cache, q, split)


def test_split_tables_every_budget_ties_and_special_values():
    """Budgets 0 to past the pages over a split table, with tied bounds (equal keys in runs of
    pages), NaN and infinite key bounds and a NaN query element: the single kernel's sets."""
    cache = _cache([450, 130], 1, 16, 2, 1, seed=31)
    table = cache.page_table
    cache.key_max[table[0, 0, 40:90]] = 1.0  # 50 tied pages
    cache.key_min[table[0, 0, 40:90]] = -1.0
    cache.key_max[table[0, 0, 7], 3] = np.nan
    cache.key_max[table[0, 0, 150], 1] = np.inf
    cache.key_min[table[1, 0, 20], 5] = -np.inf
    q = _queries(cache, 3, 2, seed=31)
    q[1, 2, 1, 4] = np.nan
    for budget in [0, 1, 2, 37, 60, 100, 223, 224, 225, 300]:
        cache.policy.pages = budget
        split = _select(cache, q, 16)
        np.testing.assert_array_equal(split, _select(cache, q, None))
        if budget:
            _assert_reference_sets(cache, q, split)
        else:  # only each table's newest page
            count = cache.page_count
            want = np.zeros_like(split)
            for b in range(2):
                want[b, :, :, count[b, 0] - 1] = 1
            np.testing.assert_array_equal(split, want)


def test_quest_chosen_splits_on_few_pairs(monkeypatch):
    """decode's route: the interpreter's resident CTAs (INTERP_RESIDENT_CTAS) split a single
    sequence's tables, and the output equals the array path's."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 16)
    cache = _cache([640], 2, 32, 4, 20, seed=41)
    q = _queries(cache, 2, 1, seed=41)
    names = record_launches(monkeypatch, interp.InterpBackend)
    out = cuattn.decode_attention(q, cache, backend="interp")
    assert names[:2] == [geometry.QUEST_SELECT_KERNEL, geometry.QUEST_ROWS_KERNEL]
    monkeypatch.setattr(decode, "quest_kernel_applies", lambda impl, qb: False)
    np.testing.assert_array_equal(out, cuattn.decode_attention(q, cache, backend="interp"))


def test_split_counts_follow_the_waves():
    """The model's split counts on an H200 (132 SMs, 2 quest_select CTAs each up to d128): one
    long sequence fills one wave; 64 sequences x 8 kv heads keep today's single kernel."""
    h200 = geometry.quest_resident_ctas("sm_90", 132, 128)
    assert h200 == 264
    # 1 x 128k: 240 CTAs (0.91 of the wave, within QUEST_WAVE_SLACK of 33 splits' 1.0)
    assert geometry.quest_splits(8, 8192, h200) == (30, 274)  # page 16
    assert geometry.quest_splits(8, 2048, h200) == (30, 69)  # page 64
    assert geometry.quest_splits(512, 2048, h200) == (1, 2048)  # 64 x 32k, page 16
    assert geometry.quest_splits(512, 512, h200) == (1, 512)  # page 64
    assert geometry.quest_splits(8, 20, h200) == (1, 20)  # fewer than two splits' pages
    assert geometry.quest_resident_ctas("sm_90", 132, 256) == 132


def test_a_bad_resident_count_is_refused(monkeypatch):
    cache = _cache([40], 1, 16, 4, 2, seed=1)
    q = _queries(cache, 1, 1, seed=1)
    names = record_launches(monkeypatch, interp.InterpBackend)
    for bad in (0, -3, 2.0, True):
        with pytest.raises(ValueError, match="resident_ctas"):
            _select(cache, q, bad)
    assert names == []


# ---- bounds in bfloat16, rounded outward (16-bit and fp8 caches) ------------------------------

BF16_MAX_BITS = 0x7F7F0000
SPECIAL_BITS = {
    "zeros": [0x00000000, 0x80000000],
    "infinities": [0x7F800000, 0xFF800000],
    "NaNs": [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7F80FFFF, 0x7FFFFFFF],
    "denormals": [0x00000001, 0x80000001, 0x0000FFFF, 0x8000FFFF, 0x00010000, 0x007FFFFF],
    "bf16's max, just past it, float32's max": [BF16_MAX_BITS, BF16_MAX_BITS + 1, 0x7F7FFFFF],
    "their negatives": [0xFF7F0000, 0xFF7F0001, 0xFF7FFFFF],
    "near 1 and -1": [0x3F800000, 0x3F800001, 0xBF800001, 0x3F80FFFF, 0xBF80FFFF, 0x3F7FFFFF],
}


def _bf16_code(bits):
    """An order code of bf16 bits (unsigned order = value order, -0 just below +0)."""
    bits = bits.astype(np.int64)
    return np.where(bits & 0x8000, 0x7FFF - (bits & 0x7FFF), bits | 0x8000)


def test_bfloat16_outward_rounding():
    """Random float32 bit patterns and the special values: rounded down <= x <= rounded up, each
    x itself where bf16 holds it and otherwise the two adjacent bf16 values around x; past
    bf16's largest finite value, toward infinity; NaN stays NaN with its sign."""
    from cuattn.serving.cache import bfloat16_outward, bfloat16_widened

    rng = np.random.default_rng(5)
    specials = [bits for group in SPECIAL_BITS.values() for bits in group]
    bits = rng.integers(0, 2**32, 400_000, dtype=np.uint64)
    bits = np.concatenate([bits, specials]).astype(np.uint32)
    x = bits.view(np.float32)
    down = bfloat16_outward(np, x, upward=False)
    up = bfloat16_outward(np, x, upward=True)
    assert down.dtype == up.dtype == np.uint16
    low, high = bfloat16_widened(np, down), bfloat16_widened(np, up)
    nan = np.isnan(x)
    assert np.isnan(low[nan]).all() and np.isnan(high[nan]).all()
    assert (np.signbit(low[nan]) == np.signbit(x[nan])).all()
    assert (np.signbit(high[nan]) == np.signbit(x[nan])).all()
    assert not np.isnan(low[~nan]).any() and not np.isnan(high[~nan]).any()
    with np.errstate(invalid="ignore"):
        assert (low[~nan] <= x[~nan]).all() and (high[~nan] >= x[~nan]).all()
    exact = (bits & 0xFFFF) == 0
    keep = ~nan & exact
    np.testing.assert_array_equal(down[keep], (bits[keep] >> 16).astype(np.uint16))
    np.testing.assert_array_equal(up[keep], (bits[keep] >> 16).astype(np.uint16))
    inexact = ~nan & ~exact
    step = _bf16_code(up[inexact]) - _bf16_code(down[inexact])
    assert (step == 1).all(), "an inexact value between two adjacent bf16 values"
    past = np.isfinite(x) & (np.abs(x) > bfloat16_widened(np, np.uint16(0x7F7F)))
    assert (high[past & (x > 0)] == np.inf).all() and (low[past & (x < 0)] == -np.inf).all()
    assert np.isfinite(low[past & (x > 0)]).all() and np.isfinite(high[past & (x < 0)]).all()
    assert past.sum() >= 4 and inexact.sum() > 300_000


def _integer_keys_cache(lengths, kv_heads, head_dim, page_size, budget, seed, dtype):
    """A Quest cache of ``dtype`` holding integer keys in [-1000, 1000] (exact in fp16, not in
    bf16: the outward rounding changes them), so every partial sum of a bound stays exact."""
    cache = cuattn.KVCache(
        len(lengths),
        kv_heads,
        head_dim,
        dtype,
        page_size=page_size,
        policy=policies.Quest(budget, page_size),
    )
    rng = np.random.default_rng(seed)
    k = rng.integers(-1000, 1001, (len(lengths), kv_heads, max(lengths), head_dim))
    k = k.astype(cache.k_pages.dtype)
    cache.append(k, k, lengths=lengths)
    return cache, k


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_bfloat16_bounds_choose_alike_on_every_path(dtype):
    """A 16-bit cache keeps its bounds as bf16 bits rounded outward of the exact page min and
    max; the reference, the array path and the kernel (one CTA a pair, and split) choose the
    same sets from them."""
    cache, k = _integer_keys_cache([900, 260], 2, 64, 16, 9, seed=51, dtype=dtype)
    assert cache.key_min.dtype == cache.key_max.dtype == np.uint16
    table, count = cache.page_table, cache.page_count
    rounded = 0
    for b, h in np.ndindex(2, 2):
        for j in range(count[b, h]):
            page_keys = k[b, h, j * 16 : (j + 1) * 16].astype(np.float32)
            page_keys = page_keys[: max(0, min(16, cache.lengths[b] - j * 16))]
            lo, hi = cache.page_bounds(np.array([table[b, h, j]]))
            assert (lo[0] <= page_keys.min(0)).all() and (hi[0] >= page_keys.max(0)).all()
            rounded += int((lo[0] != page_keys.min(0)).sum())
    # fp16 keys lose bits in bf16: the bounds are not the float32 ones; bf16 keys keep theirs
    assert rounded > 100 if dtype == "float16" else rounded == 0
    q = _queries(cache, 4, 3, seed=51, dtype=cache.k_pages.dtype)
    xp_path = decode.quest_chosen(cache, q, *cache.device_tables())
    _assert_reference_sets(cache, q, xp_path)
    np.testing.assert_array_equal(_select(cache, q, None), xp_path)
    assert geometry.quest_splits(4, cache.page_table.shape[2], 32)[0] == 3
    np.testing.assert_array_equal(_select(cache, q, 32), xp_path)


@pytest.mark.parametrize("name", ["float8_e4m3fn", "float8_e5m2"])
def test_fp8_cache_bounds_are_its_keys_bounds_in_bfloat16(name):
    """An fp8 cache keeps bf16 bounds, and loses nothing by it: a dequantised key is a code of
    at most 4 significant bits times a power-of-two scale (cuattn/serving/fp8.py), which
    bfloat16 holds, so the bounds are its kept keys' exact page min and max; the sets equal the
    array path's on the kernel, split or not."""
    cache = cuattn.KVCache(1, 2, 32, name, page_size=16, policy=policies.Quest(3, 16))
    rng = np.random.default_rng(61)
    k = (rng.standard_normal((1, 2, 600, 32)) * 100).astype(np.float16)
    cache.append(k, k)
    assert cache.key_min.dtype == cache.key_max.dtype == np.uint16
    for h in range(2):
        pages = cache.pages(0, h)
        keys, _ = cache.token_values(pages[:, None], np.arange(16)[None, :])
        used = (cache.slot_pos[pages] >= 0)[..., None]
        lo, hi = cache.page_bounds(pages)
        np.testing.assert_array_equal(lo, np.where(used, keys, np.inf).min(1))
        np.testing.assert_array_equal(hi, np.where(used, keys, -np.inf).max(1))
    q = _queries(cache, 2, 2, seed=61, dtype=np.float16)
    xp_path = decode.quest_chosen(cache, q, *cache.device_tables())
    np.testing.assert_array_equal(_select(cache, q, None), xp_path)
    assert geometry.quest_splits(2, cache.page_table.shape[2], 4)[0] == 2
    np.testing.assert_array_equal(_select(cache, q, 4), xp_path)


def test_float32_caches_keep_float32_bounds():
    for dtype in ("float32", "float64"):
        cache = cuattn.KVCache(1, 1, 16, dtype, page_size=4, policy=policies.Quest(1, 4))
        assert cache.key_min.dtype == cache.key_max.dtype == np.float32


def test_bfloat16_bounds_are_refused_beside_float32(monkeypatch):
    cache, _ = _integer_keys_cache([40], 1, 16, 4, 2, seed=1, dtype="float16")
    q = _queries(cache, 1, 1, seed=1, dtype=np.float16)
    table, count = cache.device_tables()
    names = record_launches(monkeypatch, interp.InterpBackend)
    with pytest.raises(TypeError, match="key_max"):
        interp.backend.quest_select(
            q, cache.key_min, cache.key_max.view(np.float16), table, count, 2
        )
    with pytest.raises(TypeError, match="key_min"):
        interp.backend.quest_select(q, cache.key_min.view(np.int16), cache.key_max, table, count, 2)
    assert names == []


@pytest.mark.gpu
def test_bfloat16_bounds_on_the_gpu(monkeypatch):
    """A float16 CuPy cache keeps the same bf16 bound bits as a host one given the same tokens,
    and quest_select (split over the device: one sequence) chooses the host reference's sets."""
    from cuattn.backends.cuda_runtime import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    from cuattn.backends import resolve_backend

    host, k = _integer_keys_cache([3000], 2, 128, 16, 40, seed=71, dtype="float16")
    gpu = cuattn.KVCache(
        1,
        2,
        128,
        "float16",
        page_size=16,
        policy=policies.Quest(40, 16),
        like=cupy.zeros(1, dtype=cupy.float16),
    )
    gpu.append(cupy.asarray(k), cupy.asarray(k))
    np.testing.assert_array_equal(cupy.asnumpy(gpu.key_min), host.key_min)
    np.testing.assert_array_equal(cupy.asnumpy(gpu.key_max), host.key_max)
    q = _queries(host, 4, 2, seed=71, dtype=np.float16)
    impl = resolve_backend("cuda", on_device=True)
    monkeypatch.setenv(geometry.QUEST_ENV, geometry.QUEST_KERNEL_FAMILY)
    names = record_launches(monkeypatch, type(impl))
    chosen = decode.quest_chosen(gpu, cupy.asarray(q), *gpu.device_tables(), impl=impl)
    assert names == [geometry.QUEST_SELECT_KERNEL, geometry.QUEST_ROWS_KERNEL]
    _assert_reference_sets(host, q, cupy.asnumpy(chosen))


def test_split_rows_past_a_held_tile():
    """Rows of more candidates than quest_select_rows holds in registers (8192): the codes
    loaded again each pass, over a tile that ends mid-way; the single kernel's sets, the
    reference's, for budgets that rank the threshold's ties and for one that takes them all
    (the bound after the budget's last is lower in row 0)."""
    cache = _cache([8500, 300], 1, 16, 1, 2100, seed=81)
    q = _queries(cache, 2, 1, seed=81)
    count = int(cache.page_count[0, 0])
    assert count - 1 > 8192
    lo, hi = cache.page_bounds(cache.page_table[0, 0, : count - 1])
    bound = decode._page_bounds(np, q[0, 0, 0].astype(np.float32), lo, hi)
    ranked = np.sort(bound)[::-1]
    clear = next(k for k in range(3000, 8000) if ranked[k - 1] > ranked[k])
    for budget in (2100, 8000, clear):
        cache.policy.pages = budget
        split = _select(cache, q, 64)
        np.testing.assert_array_equal(split, _select(cache, q, None))
        _assert_reference_sets(cache, q, split)
