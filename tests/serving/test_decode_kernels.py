"""The split-KV decode kernels: every instantiation on the interpreter; on a GPU (gpu marker)."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import policies as P
from cuattn.backends import geometry
from cuattn.backends.cuda_runtime import cuda_available
from cuattn.backends.dropout import seed_of
from cuattn.serving import decode
from cuattn.tools.oracle import kept_attention
from tests.helpers.no_sync import refuse_host_round_trips

TOLERANCE = {"float32": 2e-5, "float16": 1e-2, "bfloat16": 2e-2}
PAGE_SIZE = 20  # more than one shared-memory tile (16 tokens) per page, and a ragged one


def _numpy_dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _fill(cache, rng, xp, steps, group, t_q, prefill=50):
    """A prefill of ragged lengths (prefill and about three quarters of it), then decode
    steps; returns the last step's q."""
    dtype = _numpy_dtype(cache.dtype)
    batch, kv_heads, d = cache.batch, cache.kv_heads, cache.head_dim
    k, v = (rng.standard_normal((batch, kv_heads, prefill, d)).astype(dtype) for _ in range(2))
    lengths = [prefill, prefill * 3 // 4][:batch]
    cache.append(xp.asarray(k), xp.asarray(v), lengths=lengths)
    for _ in range(steps):
        k, v = (rng.standard_normal((batch, kv_heads, t_q, d)).astype(dtype) for _ in range(2))
        cache.append(xp.asarray(k), xp.asarray(v))
    q = rng.standard_normal((batch, kv_heads * group, t_q, d)).astype(dtype)
    return xp.asarray(q)


@pytest.mark.parametrize("dtype", geometry.DTYPES)
@pytest.mark.parametrize("head_dim", geometry.HEAD_DIMS)
def test_every_decode_instantiation_on_the_interpreter(head_dim, dtype, monkeypatch):
    """One split per page table (a device that holds one CTA), 150 kept tokens: every warp
    walks two or more sub-tiles, so the online softmax's rescaling and the stage ring run."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 1)
    rng = np.random.default_rng(head_dim)
    cache = cuattn.KVCache(2, 2, head_dim, dtype, page_size=PAGE_SIZE, policy=P.SlidingWindow(150))
    q = _fill(cache, rng, np, steps=3, group=2, t_q=2, prefill=200)
    assert 150 > 2 * geometry.decode_tile(
        head_dim, dtype
    )  # two whole tiles: two sub-tiles per warp
    out, lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")
    want = kept_attention(cache, q, head_dim**-0.5)
    got = out.astype(np.float64)
    assert not np.isnan(got).any() and np.isfinite(lse).all()
    assert np.abs(got - want).max() <= TOLERANCE[dtype] * np.abs(want).max()


@pytest.mark.parametrize("resident_ctas", [1, 64])
@pytest.mark.parametrize("page_size", [1, 7, 16, 64])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_page_sizes_splits_and_scores_on_the_interpreter(
    dtype, page_size, resident_ctas, monkeypatch
):
    """Pages smaller and larger than a warp's sub-tile, one split or many (merged), holes left
    by HeavyHitters' evictions: outputs against the float64 oracle over the kept tokens, and
    the scores the kernel's per-token output adds against the NumPy reference's."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    caches = {
        backend: cuattn.KVCache(
            2, 1, 64, dtype, page_size=page_size, policy=P.HeavyHitters(140, 20)
        )
        for backend in ("interp", "numpy")
    }
    dtype_np = _numpy_dtype(dtype)
    for backend, cache in caches.items():
        rng = np.random.default_rng(page_size)
        q = _fill(cache, rng, np, steps=0, group=4, t_q=1, prefill=230)
        for _ in range(4):  # a step: one token in, the lowest score out, then a scored decode
            k, v = (rng.standard_normal((2, 1, 1, 64)).astype(dtype_np) for _ in range(2))
            cache.append(k, v)
            out = cuattn.decode_attention(q, cache, backend=backend)
            want = kept_attention(cache, q, 64**-0.5)
            error = np.abs(out.astype(np.float64) - want).max()
            assert error <= TOLERANCE[dtype] * np.abs(want).max()
    assert np.array_equal(caches["interp"].positions(), caches["numpy"].positions())
    got, want = caches["interp"].slot_score, caches["numpy"].slot_score
    assert np.allclose(got, want, rtol=TOLERANCE[dtype], atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_softcap_on_the_interpreter_and_the_reference(dtype, monkeypatch):
    """softcap= caps every score before the softmax on both backends (several splits, merged),
    and HeavyHitters scores the capped probabilities alike: scores spread by 3 so that the cap
    bends them."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 16)
    softcap, spread = 1.5, 3.0
    caches = {
        backend: cuattn.KVCache(2, 1, 64, dtype, page_size=16, policy=P.HeavyHitters(120, 16))
        for backend in ("interp", "numpy")
    }
    outs = {}
    for backend, cache in caches.items():
        rng = np.random.default_rng(11)
        q = _fill(cache, rng, np, steps=2, group=2, t_q=1, prefill=150)
        q = (q.astype(np.float32) * spread).astype(q.dtype)
        outs[backend] = cuattn.decode_attention(q, cache, softcap=softcap, backend=backend)
        want = kept_attention(cache, q, 64**-0.5, softcap=softcap)
        error = np.abs(outs[backend].astype(np.float64) - want).max()
        assert error <= TOLERANCE[dtype] * np.abs(want).max(), backend
        uncapped = kept_attention(cache, q, 64**-0.5)
        assert np.abs(uncapped - want).max() > 0.1 * np.abs(want).max()  # the cap matters
        cache.append(*(np.zeros((2, 1, 1, 64), q.dtype) for _ in range(2)))  # scores evict
    assert np.array_equal(caches["interp"].positions(), caches["numpy"].positions())
    got, want = caches["interp"].slot_score, caches["numpy"].slot_score
    assert np.allclose(got, want, rtol=TOLERANCE[dtype], atol=1e-6)
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        cuattn.decode_attention(q, caches["numpy"], softcap=-2.0)


@pytest.mark.parametrize(("dtype", "per_batch"), [("float32", True), ("float16", False)])
def test_alibi_on_the_interpreter_and_the_reference(dtype, per_batch, monkeypatch):
    """alibi_slopes= biases each score by the kept positions' distance on both backends (several
    splits, merged; with a softcap first), over a cache whose StreamingLLM policy evicted the
    middle: the distances of the tokens left are their own positions', not slot indices."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 16)
    rng = np.random.default_rng(12)
    slopes = rng.uniform(0.02, 0.3, (2, 2) if per_batch else (2,)).astype(np.float32)
    for backend in ("interp", "numpy"):
        cache = cuattn.KVCache(2, 1, 64, dtype, page_size=16, policy=P.StreamingLLM(4, 60))
        q = _fill(cache, np.random.default_rng(13), np, steps=2, group=2, t_q=2, prefill=150)
        assert cache.positions()[0][0].max() - cache.positions()[0][0].min() > 100
        out = cuattn.decode_attention(q, cache, softcap=2.0, alibi_slopes=slopes, backend=backend)
        want = kept_attention(cache, q, 64**-0.5, softcap=2.0, alibi_slopes=slopes)
        error = np.abs(out.astype(np.float64) - want).max()
        assert error <= TOLERANCE[dtype] * np.abs(want).max(), backend
        plain = kept_attention(cache, q, 64**-0.5, softcap=2.0)
        assert np.abs(plain - want).max() > 0.1 * np.abs(want).max()  # ALiBi matters
    with pytest.raises(ValueError, match=r"alibi_slopes must have shape \[heads\]"):
        cuattn.decode_attention(q, cache, alibi_slopes=np.ones(3, np.float32))


@pytest.mark.parametrize(("dtype", "per_head"), [("float32", True), ("bfloat16", False)])
def test_key_bias_on_the_interpreter_and_the_reference(dtype, per_head, monkeypatch):
    """key_bias= adds the bias of each kept token's position on both backends (several splits,
    with a softcap and ALiBi too), over a cache that evicted the middle; -inf drops a token."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 16)
    rng = np.random.default_rng(15)
    slopes = cuattn.alibi_slopes(2)
    for backend in ("interp", "numpy"):
        cache = cuattn.KVCache(2, 1, 64, dtype, page_size=16, policy=P.StreamingLLM(4, 60))
        q = _fill(cache, np.random.default_rng(16), np, steps=2, group=2, t_q=2, prefill=150)
        longest = int(cache.lengths.max())
        shape = (2, 2, longest + 3) if per_head else (2, longest + 3)
        key_bias = (rng.standard_normal(shape) * 2).astype(np.float32)
        key_bias[..., :2] = -np.inf  # the first two sinks drop
        kw = dict(softcap=2.0, alibi_slopes=slopes, key_bias=key_bias)
        out = cuattn.decode_attention(q, cache, backend=backend, **kw)
        want = kept_attention(cache, q, 64**-0.5, **kw)
        error = np.abs(out.astype(np.float64) - want).max()
        assert error <= TOLERANCE[dtype] * np.abs(want).max(), backend
        plain = kept_attention(cache, q, 64**-0.5, softcap=2.0, alibi_slopes=slopes)
        assert np.abs(plain - want).max() > 0.1 * np.abs(want).max()  # the bias matters
    with pytest.raises(ValueError, match=r"time_k covering the cache's positions"):
        cuattn.decode_attention(q, cache, key_bias=key_bias[..., :10])


@pytest.mark.parametrize(("dtype", "per_batch"), [("float32", True), ("float16", False)])
def test_rel_bias_on_the_interpreter_and_the_reference(dtype, per_batch, monkeypatch):
    """rel_bias= adds the table's column of (token - query position) on both backends over a
    cache that evicted the middle (the kept tokens keep their positions), beside a softcap."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 16)
    rng = np.random.default_rng(17)
    shape = (2, 2, 2 * 40 + 1) if per_batch else (2, 2 * 40 + 1)
    table = (rng.standard_normal(shape) * 2).astype(np.float32)
    for backend in ("interp", "numpy"):
        cache = cuattn.KVCache(2, 1, 64, dtype, page_size=16, policy=P.StreamingLLM(4, 60))
        q = _fill(cache, np.random.default_rng(18), np, steps=2, group=2, t_q=2, prefill=150)
        out = cuattn.decode_attention(q, cache, backend=backend, softcap=2.0, rel_bias=table)
        want = kept_attention(cache, q, 64**-0.5, softcap=2.0, rel_bias=table)
        error = np.abs(out.astype(np.float64) - want).max()
        assert error <= TOLERANCE[dtype] * np.abs(want).max(), backend
        plain = kept_attention(cache, q, 64**-0.5, softcap=2.0)
        assert np.abs(plain - want).max() > 0.1 * np.abs(want).max()  # the table matters
    with pytest.raises(ValueError, match=r"rel_bias must have shape \[heads, 2 \* max_distance"):
        cuattn.decode_attention(q, cache, rel_bias=table[..., :-1])


@pytest.mark.parametrize(("dtype", "seed"), [("float32", 2**40 + 3), ("bfloat16", "words")])
def test_dropout_on_the_interpreter_and_the_reference(dtype, seed, monkeypatch):
    """dropout_p= drops each row's probability of a kept token by the generator at (query
    position, token position, query head, batch), after the softmax: both backends against the
    oracle with the same mask, over an evicting cache, beside a softcap; a seed held in an
    array (the key above 2^63) equals that key; the lse is of every probability."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 16)
    p = 0.3
    if seed == "words":
        seed = np.array([0x01234567, 0x89ABCDEF], np.uint32)
    key = seed_of(seed) if isinstance(seed, np.ndarray) else seed
    for backend in ("interp", "numpy"):
        cache = cuattn.KVCache(2, 1, 64, dtype, page_size=16, policy=P.StreamingLLM(4, 60))
        q = _fill(cache, np.random.default_rng(19), np, steps=2, group=2, t_q=2, prefill=150)
        kw = dict(softcap=2.0, dropout_p=p, dropout_seed=seed, return_lse=True)
        out, lse = cuattn.decode_attention(q, cache, backend=backend, **kw)
        want = kept_attention(cache, q, 64**-0.5, softcap=2.0, dropout=(p, key))
        error = np.abs(out.astype(np.float64) - want).max()
        assert error <= TOLERANCE[dtype] * np.abs(want).max(), backend
        plain, plain_lse = cuattn.decode_attention(q, cache, backend=backend, softcap=2.0,
                                                   return_lse=True)  # fmt: skip
        assert np.abs(plain.astype(np.float64) - want).max() > 0.1 * np.abs(want).max()
        np.testing.assert_array_equal(lse, plain_lse)
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        cuattn.decode_attention(q, cache, dropout_p=1.0)


def test_alibi_decode_equals_the_full_forward():
    """Nothing evicted: decode's ALiBi is sparse_attention's end-aligned causal ALiBi."""
    cache = cuattn.KVCache(1, 2, 16, "float64", page_size=8)
    rng = np.random.default_rng(14)
    k, v = (rng.standard_normal((1, 2, 40, 16)) for _ in range(2))
    cache.append(k, v)
    q = rng.standard_normal((1, 4, 3, 16))
    slopes = cuattn.alibi_slopes(4)
    out = cuattn.decode_attention(q, cache, alibi_slopes=slopes)
    layout = cuattn.make_layout("all", 40, 4, 8, n_q=3)
    want = cuattn.sparse_attention(q, k, v, layout, alibi_slopes=slopes)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-14)


def test_more_splits_than_a_warp_has_lanes(monkeypatch):
    """The merge's lanes each read every 32nd split's lse: past 32 splits a lane takes two,
    and the warp's max and sum still cover all of them."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 256)
    cache = cuattn.KVCache(1, 1, 48, "float32", page_size=1)
    rng = np.random.default_rng(11)
    q = _fill(cache, rng, np, steps=1, group=2, t_q=1, prefill=120)
    assert geometry.decode_splits(1, 121, 256)[0] > 32
    out = cuattn.decode_attention(q, cache, backend="interp")
    want = kept_attention(cache, q, 48**-0.5)
    assert np.abs(out - want).max() <= TOLERANCE["float32"] * np.abs(want).max()


@pytest.mark.parametrize("head_dim", [64, 256])
def test_query_rows_beyond_one_cta(head_dim):
    """8 query heads on one kv head with t_q = 3: 24 rows of one kv group, more than a CTA's
    (16, or 8 at head dim 256), so the rows take several CTAs, each reading the same pages."""
    rng = np.random.default_rng(3)
    cache = cuattn.KVCache(2, 1, head_dim, "float32", page_size=PAGE_SIZE)
    q = _fill(cache, rng, np, steps=2, group=8, t_q=3)
    assert geometry.decode_row_chunks(8, 3, head_dim) >= 2
    out = cuattn.decode_attention(q, cache, backend="interp")
    want = kept_attention(cache, q, head_dim**-0.5)
    assert np.abs(out.astype(np.float64) - want).max() <= TOLERANCE["float32"] * np.abs(want).max()


def test_the_split_count_fills_the_device_once():
    assert geometry.decode_splits(ctas=16, max_pages=100, resident_ctas=1056) == (50, 2)
    assert geometry.decode_splits(ctas=2048, max_pages=100, resident_ctas=1056) == (1, 100)
    splits, per_split = geometry.decode_splits(ctas=4, max_pages=7, resident_ctas=64)
    assert splits * per_split >= 7 and (splits - 1) * per_split < 7 and splits <= 7


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "policy", [None, P.SlidingWindow(40), P.HeavyHitters(40, 8), P.Quest(2, PAGE_SIZE)]
)
def test_decode_on_the_gpu(policy, dtype):
    """A CuPy cache against its host twin (the same tokens, the NumPy reference): outputs
    within the dtype's tolerance, the same kept positions and HeavyHitters scores."""
    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    like = cupy.zeros(1, dtype=cupy.float32)
    caches = {
        "gpu": cuattn.KVCache(2, 2, 128, dtype, page_size=PAGE_SIZE, policy=policy, like=like),
        "host": cuattn.KVCache(2, 2, 128, dtype, page_size=PAGE_SIZE, policy=policy),
    }
    outs = {}
    for where, xp in (("gpu", cupy), ("host", np)):
        q = _fill(caches[where], np.random.default_rng(7), xp, steps=5, group=4, t_q=1)
        out = cuattn.decode_attention(q, caches[where])
        outs[where] = (cupy.asnumpy(out) if xp is cupy else out).astype(np.float64)
    assert np.array_equal(caches["gpu"].positions(), caches["host"].positions())
    want = outs["host"]
    assert np.abs(outs["gpu"] - want).max() <= TOLERANCE[dtype] * np.abs(want).max()
    if caches["host"].slot_score is not None:
        got = cupy.asnumpy(caches["gpu"].slot_score)
        assert np.allclose(got, caches["host"].slot_score, rtol=1e-3, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "policy",
    [None, P.SlidingWindow(40), P.HeavyHitters(40, 8), P.HeavyHitters(P.head_adaptive(60), 4)]
    + [P.Quest(2, PAGE_SIZE)],
)
def test_on_the_gpu_a_decode_step_never_waits_for_the_host(policy, monkeypatch):
    """After a warm-up, append + decode_attention steps (evictions, new pages, HeavyHitters'
    scores, Quest's choice, and a pool that grows where every token is kept) make no
    device-to-host copy and no synchronisation: every CuPy way to one is patched to fail."""
    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    from cuattn.serving import cache as cache_module

    monkeypatch.setattr(cache_module, "DEFAULT_TOKENS", 1)  # a small first pool

    rng = np.random.default_rng(9)
    like = cupy.zeros(1, dtype=cupy.float32)
    cache = cuattn.KVCache(2, 2, 64, "float16", page_size=PAGE_SIZE, policy=policy, like=like)
    q = _fill(cache, rng, cupy, steps=2, group=2, t_q=1)
    cuattn.decode_attention(q, cache)
    steps = [
        tuple(cupy.asarray(rng.standard_normal((2, 2, 1, 64)).astype(np.float16)) for _ in "kv")
        for _ in range(3 * PAGE_SIZE)
    ]
    cupy.cuda.Device().synchronize()

    refuse_host_round_trips(monkeypatch)
    for k, v in steps:
        cache.append(k, v)
        out = cuattn.decode_attention(q, cache)
    monkeypatch.undo()
    assert bool(cupy.isfinite(out).all())
    if policy is None:
        assert cache.num_pages >= 2 * 2 * (len(cache) // PAGE_SIZE)
