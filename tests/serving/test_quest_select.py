"""Quest's page choice in one kernel (kernels/quest_select.cu) on the interpreter: the chosen
set of every query row equal to the reference's (cuattn/serving/decode.py _quest_pages) over
each table's real pages, 0 past them, for page sizes 1/16/64, t_q 1-8, GQA 1-8, every budget,
ties, NaN and inf in keys and queries, lengths ending mid-page and tables with fewer pages than
the budget; decode_attention's output the same through the kernel and through the array path.

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
    configs = [c for c in geometry.all_configs() if c.kernel == geometry.QUEST_SELECT_KERNEL]
    assert len(configs) == len(geometry.HEAD_DIMS) * len(geometry.DTYPES)
    for config in configs:
        library = interp.library_for(config)
        assert library.traits(config.name_expression) == (config.threads, config.smem_bytes)


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_every_instantiation_compiles_without_spills(arch):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc")
    from cuattn.backends.toolchain import common_options, kernel_source
    from dev.compile_check import compile_units, kernel_instantiations

    units = [u for u in kernel_instantiations() if u.source_file == "quest_select.cu"]
    assert len(units) == len(geometry.HEAD_DIMS) * len(geometry.DTYPES)
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
    assert names == [geometry.QUEST_SELECT_KERNEL]
    _assert_reference_sets(host, q, cupy.asnumpy(chosen))
    out = cupy.asnumpy(cuattn.decode_attention(q_gpu, gpu))
    monkeypatch.setenv(geometry.QUEST_ENV, geometry.QUEST_XP_FAMILY)
    np.testing.assert_array_equal(out, cupy.asnumpy(cuattn.decode_attention(q_gpu, gpu)))
