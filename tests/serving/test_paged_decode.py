"""cuattn.paged_decode over a caller's vLLM / FlashAttention block table: the decode kernels on
the interpreter (outputs NaN-poisoned before launch) and the NumPy reference, against a float64
oracle written here from the layout's definition; both page-table front doors bit for bit;
every refusal by its message, before any launch."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn.backends import geometry
from cuattn.backends.interp import InterpBackend
from cuattn.serving import decode, fp8, paged

HEAD_DIM = 32
TOLERANCE = {"float32": 2e-5, "float16": 1e-2, "bfloat16": 2e-2}


def _dtype(name):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _case(rng, dtype, batch=2, heads=4, kv_heads=2, t_q=1, block_size=16, lens=(37, 20)):
    """Fresh random q and pages, and a table of distinct shuffled blocks with spare blocks the
    table never names (filled with NaN: they must reach no output), -1 padding past each
    sequence's blocks, and NaN in the slots past each sequence's length."""
    lens = np.array(lens, np.int32)
    need = -(-lens // block_size)
    max_blocks = int(need.max()) + 1
    num_blocks = int(need.sum()) + 3
    k, v = (
        rng.standard_normal((num_blocks, block_size, kv_heads, HEAD_DIM)).astype(_dtype(dtype))
        for _ in range(2)
    )
    order = rng.permutation(num_blocks)
    table = np.full((batch, max_blocks), -1, np.int32)
    at = 0
    for b in range(batch):
        table[b, : need[b]] = order[at : at + need[b]]
        at += need[b]
    for spare in order[at:]:  # blocks no sequence reads
        k[spare] = np.nan
        v[spare] = np.nan
    for b in range(batch):  # the slots past the length in the last block
        if lens[b] % block_size:
            last = table[b, need[b] - 1]
            k[last, lens[b] % block_size :] = np.nan
            v[last, lens[b] % block_size :] = np.nan
    q = rng.standard_normal((batch, heads, t_q, HEAD_DIM)).astype(_dtype(dtype))
    return q, k, v, table, lens


def oracle(
    q,
    k,
    v,
    table,
    lens,
    scale=None,
    block_mask=None,
    softcap=None,
    slopes=None,
    key_bias=None,
    rel_bias=None,
):
    """float64, from the definition: token t of sequence b at block table[b, t // bs], offset
    t % bs; query i at position lens[b] - t_q + i; causal; GQA h // (H / H_kv)."""
    q64, k64, v64 = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    batch, heads, t_q, d = q64.shape
    bs, kv_heads = k64.shape[1], k64.shape[2]
    scale = d**-0.5 if scale is None else scale
    out = np.zeros(q64.shape)
    lse = np.full((batch, heads, t_q), -np.inf)
    for b in range(batch):
        n = int(lens[b])
        pos = np.arange(n)
        blocks = np.asarray(table)[b, pos // bs]
        q_pos = n - t_q + np.arange(t_q)
        for h in range(heads):
            kh = h // (heads // kv_heads)
            keys, values = k64[blocks, pos % bs, kh], v64[blocks, pos % bs, kh]
            s = q64[b, h] @ keys.T * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            if slopes is not None:
                s = s - np.broadcast_to(slopes, (batch, heads))[b, h] * (q_pos[:, None] - pos)
            if key_bias is not None:
                s = s + (key_bias[b] if key_bias.ndim == 2 else key_bias[b, h])[pos]
            if rel_bias is not None:
                reach = (rel_bias.shape[-1] - 1) // 2
                row = rel_bias[h] if rel_bias.ndim == 2 else rel_bias[b, h]
                s = s + row[np.clip(pos[None, :] - q_pos[:, None], -reach, reach) + reach]
            allowed = pos[None, :] <= q_pos[:, None]
            if block_mask is not None:
                allowed = allowed & block_mask[b, h][:, pos // bs]
            for i in range(t_q):
                if not allowed[i].any():
                    continue
                si = s[i][allowed[i]]
                m = si.max()
                p = np.exp(si - m)
                out[b, h, i] = p @ values[allowed[i]] / p.sum()
                lse[b, h, i] = m + np.log(p.sum())
    return out, lse


def _assert_close(got, want, dtype, got_lse=None, want_lse=None):
    got = np.asarray(got).astype(np.float64)
    assert not np.isnan(got).any(), "a NaN reached an output (poison or an unread block)"
    assert np.abs(got - want).max() <= TOLERANCE[dtype] * max(np.abs(want).max(), 1.0)
    if got_lse is not None:
        got_lse = np.asarray(got_lse).astype(np.float64)
        empty = want_lse == -np.inf
        assert (got_lse[empty] == -np.inf).all()
        assert np.abs(got_lse[~empty] - want_lse[~empty]).max() <= TOLERANCE[dtype] * 10


@pytest.mark.parametrize("backend", ["interp", "numpy"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize(
    ("block_size", "t_q", "heads", "resident_ctas"),
    [(1, 1, 2, 64), (16, 1, 4, 1), (16, 3, 8, 64), (64, 2, 2, 1)],
)
def test_against_the_oracle(backend, dtype, block_size, t_q, heads, resident_ctas, monkeypatch):
    """Pages of 1, 16 and 64 tokens, one query or several, GQA 1 and > 1, one split or many."""
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", resident_ctas)
    rng = np.random.default_rng(block_size * 10 + t_q)
    q, k, v, table, lens = _case(rng, dtype, heads=heads, t_q=t_q, block_size=block_size)
    out, lse = cuattn.paged_decode(q, k, v, table, lens, return_lse=True, backend=backend)
    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == q.shape[:3]
    want, want_lse = oracle(q, k, v, table, lens)
    _assert_close(out, want, dtype, lse, want_lse)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_the_tensor_core_kernel(dtype, monkeypatch):
    """CUATTN_DECODE=gqa: attn_decode_gqa walks the caller's table too (split and merged)."""
    monkeypatch.setenv(geometry.DECODE_ENV, geometry.DECODE_GQA_FAMILY)
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 1)
    rng = np.random.default_rng(7)
    q, k, v, table, lens = _case(rng, dtype, heads=8, t_q=2, lens=(70, 33))
    assert geometry.decode_gqa_applies(HEAD_DIM, dtype)
    out, lse = cuattn.paged_decode(q, k, v, table, lens, return_lse=True, backend="interp")
    want, want_lse = oracle(q, k, v, table, lens)
    _assert_close(out, want, dtype, lse, want_lse)


@pytest.mark.parametrize("backend", ["interp", "numpy"])
def test_score_modifiers(backend):
    """softcap, ALiBi, a key bias and a relative-position table, by token position."""
    rng = np.random.default_rng(3)
    dtype = "bfloat16"
    q, k, v, table, lens = _case(rng, dtype, t_q=2)
    batch, heads = q.shape[:2]
    slopes = rng.uniform(0.01, 0.2, (batch, heads)).astype(np.float32)
    key_bias = rng.standard_normal((batch, heads, 40)).astype(np.float32)
    rel_bias = rng.standard_normal((heads, 2 * 5 + 1)).astype(np.float32)
    out, lse = cuattn.paged_decode(
        q,
        k,
        v,
        table,
        lens,
        0.3,
        True,
        softcap=2.0,
        alibi_slopes=slopes,
        key_bias=key_bias,
        rel_bias=rel_bias,
        backend=backend,
    )
    want, want_lse = oracle(
        q,
        k,
        v,
        table,
        lens,
        0.3,
        softcap=2.0,
        slopes=slopes,
        key_bias=key_bias,
        rel_bias=rel_bias,
    )
    _assert_close(out, want, dtype, lse, want_lse)


@pytest.mark.parametrize("backend", ["interp", "numpy"])
@pytest.mark.parametrize("per_head", [False, True])
def test_a_page_subset(backend, per_head):
    """block_mask: the blocks each sequence (query head) reads; a row whose every chosen token
    is in its future, or that chooses nothing, gives 0 and -inf."""
    rng = np.random.default_rng(11)
    q, k, v, table, lens = _case(rng, "float16", t_q=2, block_size=8, lens=(37, 20))
    batch, heads, t_q, _ = q.shape
    max_blocks = table.shape[1]
    if per_head:
        mask = rng.random((batch, heads, max_blocks)) < 0.5
        mask[1, 0] = False  # a query head that reads nothing
        full = np.broadcast_to(mask[:, :, None], (batch, heads, t_q, max_blocks))
    else:
        mask = rng.random((batch, max_blocks)) < 0.6
        mask[:, 0] = True
        full = np.broadcast_to(mask[:, None, None], (batch, heads, t_q, max_blocks))
    out, lse = cuattn.paged_decode(
        q, k, v, table, lens, return_lse=True, block_mask=mask, backend=backend
    )
    want, want_lse = oracle(q, k, v, table, lens, block_mask=full)
    _assert_close(out, want, "float16", lse, want_lse)
    if per_head:
        assert (np.asarray(out)[1, 0] == 0).all() and (lse[1, 0] == -np.inf).all()


@pytest.mark.parametrize("backend", ["interp", "numpy"])
def test_an_empty_sequence_and_shared_blocks(backend):
    """seq_len 0 gives out 0 and lse -inf (no NaN); two sequences naming the same blocks (a
    shared prefix) read them alike; NaN in blocks and slots nobody reads reaches nothing."""
    rng = np.random.default_rng(5)
    q, k, v, table, lens = _case(rng, "bfloat16", batch=3, lens=(37, 0, 30))
    table[2, :2] = table[0, :2]  # sequence 2 shares sequence 0's first 32 tokens
    table[1, :] = 10**6  # never read: its sequence is empty
    out, lse = cuattn.paged_decode(q, k, v, table, lens, return_lse=True, backend=backend)
    want, want_lse = oracle(q, k, v, table, lens)
    _assert_close(out, want, "bfloat16", lse, want_lse)
    assert (np.asarray(out)[1] == 0).all() and (lse[1] == -np.inf).all()


def test_torch_tensors_in_place_and_a_strided_cache():
    """torch tensors go in and come out as torch tensors; the pages are k = kv[:, 0] of a
    [num_blocks, 2, block_size, kv_heads, d] cache (FlashInfer's NHD), and the table the first
    columns of a wider one, read at their strides."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    q, k, v, table, lens = _case(rng, "float32", heads=4, t_q=1)
    kv = torch.from_numpy(np.stack([k, v], axis=1).copy())
    kt, vt = kv[:, 0], kv[:, 1]
    assert not kt.is_contiguous()
    # the table: the first columns of a wider one (vLLM keeps one for the largest batch)
    wide = np.full((table.shape[0], table.shape[1] + 5), 10**6, np.int32)
    wide[:, : table.shape[1]] = table
    table_view = torch.from_numpy(wide)[:, : table.shape[1]]
    assert not table_view.is_contiguous()
    for backend in ("interp", "numpy"):
        out, lse = cuattn.paged_decode(
            torch.from_numpy(q),
            kt,
            vt,
            table_view,
            torch.from_numpy(lens),
            return_lse=True,
            backend=backend,
        )
        assert isinstance(out, torch.Tensor) and isinstance(lse, torch.Tensor)
        want, want_lse = oracle(q, k, v, table, lens)
        _assert_close(out.numpy(), want, "float32", lse.numpy(), want_lse)


def test_jax_arrays():
    """jax arrays in, jax arrays out, on the reference and the kernels."""
    jnp = pytest.importorskip("jax.numpy")
    rng = np.random.default_rng(6)
    q, k, v, table, lens = _case(rng, "float32", t_q=2)
    want, want_lse = oracle(q, k, v, table, lens)
    for backend in ("numpy", "interp"):
        out, lse = cuattn.paged_decode(
            *(jnp.asarray(x) for x in (q, k, v, table, lens)), return_lse=True, backend=backend
        )
        assert type(out) is type(jnp.asarray(q))
        _assert_close(np.asarray(out), want, "float32", np.asarray(lse), want_lse)


def test_bfloat16_torch_tensors():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    q, k, v, table, lens = _case(rng, "float32")
    as_bf16 = [torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v)]
    out = cuattn.paged_decode(
        *as_bf16, torch.from_numpy(table), torch.from_numpy(lens), backend="interp"
    )
    assert out.dtype == torch.bfloat16
    q16, k16, v16 = (x.float().numpy() for x in as_bf16)
    _assert_close(out.float().numpy(), oracle(q16, k16, v16, table, lens)[0], "bfloat16")


@pytest.mark.parametrize("family", [geometry.DECODE_SPLIT_FAMILY, geometry.DECODE_GQA_FAMILY])
def test_kv_cache_and_paged_decode_agree_bit_for_bit(family, monkeypatch):
    """The same tokens through KVCache's per-(sequence, kv head) pages and through a caller's
    block table of the same width run the same kernels on the same sums: equal bits."""
    monkeypatch.setenv(geometry.DECODE_ENV, family)
    monkeypatch.setattr(decode, "INTERP_RESIDENT_CTAS", 2)
    rng = np.random.default_rng(9)
    batch, kv_heads, heads, bs = 2, 2, 4, 16
    dtype = _dtype("bfloat16")
    cache = cuattn.KVCache(batch, kv_heads, HEAD_DIM, "bfloat16", page_size=bs)
    k, v = (rng.standard_normal((batch, kv_heads, 45, HEAD_DIM)).astype(dtype) for _ in range(2))
    cache.append(k, v, lengths=[45, 30])
    q = rng.standard_normal((batch, heads, 1, HEAD_DIM)).astype(dtype)
    want, want_lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")

    # the cache's pages, one block per (sequence, table column) holding every kv head's page
    cache_table, count = (np.asarray(x) for x in cache.device_tables())
    width = cache_table.shape[2]
    blocks = np.full((1 + batch * width, bs, kv_heads, HEAD_DIM), np.nan, dtype)
    table = np.zeros((batch, width), np.int32)
    for b in range(batch):
        for j in range(int(count[b].max())):
            table[b, j] = 1 + b * width + j
            for h in range(kv_heads):
                blocks[table[b, j], :, h] = cache.k_pages[cache_table[b, h, j]]
    vblocks = blocks.copy()
    for b in range(batch):
        for j in range(int(count[b].max())):
            for h in range(kv_heads):
                vblocks[table[b, j], :, h] = cache.v_pages[cache_table[b, h, j]]
    lens = cache.lengths.astype(np.int32)
    got, got_lse = cuattn.paged_decode(
        q, blocks, vblocks, table, lens, return_lse=True, backend="interp"
    )
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    assert np.array_equal(got_lse, want_lse)


def _refused(monkeypatch, error, match, q, k, v, table, lens, **kwargs):
    """The call is refused with ``error`` matching ``match`` before any kernel launches."""

    def no_launch(*args, **kw):
        raise AssertionError("a kernel launched before the arguments were checked")

    monkeypatch.setattr(InterpBackend, "launch", no_launch)
    with pytest.raises(error, match=match):
        cuattn.paged_decode(q, k, v, table, lens, backend="interp", **kwargs)


def test_refusals(monkeypatch):
    rng = np.random.default_rng(1)
    q, k, v, table, lens = _case(rng, "float16", lens=(37, 20))
    num_blocks = k.shape[0]

    def refused(error, match, **change):
        args = dict(q=q, k=k, v=v, table=table, lens=lens)
        extra = change.pop("kwargs", {})
        args.update(change)
        _refused(monkeypatch, error, match, *args.values(), **extra)

    bad = table.copy()
    bad[0, 1] = num_blocks
    refused(
        ValueError,
        rf"block_table\[0, 1\] = {num_blocks}.*\[0, num_blocks = {num_blocks}\)",
        table=bad,
    )
    bad = table.copy()
    bad[1, 0] = -1
    refused(ValueError, r"block_table\[1, 0\] = -1", table=bad)
    room = table.shape[1] * 16
    refused(
        ValueError,
        rf"seq_lens\[1\] = {room + 1}.*{room}\]",
        lens=np.array([37, room + 1], np.int32),
    )
    refused(ValueError, r"seq_lens\[0\] = -1", lens=np.array([-1, 20], np.int32))
    refused(
        TypeError, "block_table has dtype int64; it must be int32", table=table.astype(np.int64)
    )
    refused(TypeError, "seq_lens has dtype int64; it must be int32", lens=lens.astype(np.int64))
    refused(TypeError, "k_pages has dtype float32; q has float16", k=k.astype(np.float32))
    refused(
        ValueError, r"heads=3, which is not a multiple of k_pages's kv_heads=2", q=q[:, :3].copy()
    )
    refused(ValueError, r"block_table must be \[batch=2, max_blocks\]", table=table[:1].copy())
    refused(ValueError, r"seq_lens must be \[batch=2\]", lens=lens[:1].copy())
    refused(
        ValueError,
        r"k_pages must be \[num_blocks, block_size, kv_heads, head_dim=32\]",
        k=k[..., :16].copy(),
    )
    refused(ValueError, "v_pages must have k_pages's shape", v=v[:-1].copy())
    refused(ValueError, r"q must be \[batch, heads, t_q, head_dim\]", q=q[0])
    refused(TypeError, "block_table must be an array", table=[[0, 1]])
    refused(
        ValueError,
        r"block_mask must be \[batch, max_blocks\]",
        kwargs=dict(block_mask=np.ones((2, 1), bool)),
    )
    refused(
        TypeError,
        "block_mask must be bool or uint8",
        kwargs=dict(block_mask=np.ones(table.shape, np.float32)),
    )
    # head_dim not contiguous: a [num_blocks, block_size, head_dim, kv_heads] cache viewed
    refused(
        ValueError,
        r"k_pages: strides",
        k=np.ascontiguousarray(np.swapaxes(k, 2, 3)).swapaxes(2, 3),
        v=np.ascontiguousarray(np.swapaxes(v, 2, 3)).swapaxes(2, 3),
    )
    refused(TypeError, "scale must be a real number", kwargs=dict(scale="big"))


def test_a_q_that_asks_for_a_gradient_is_refused():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    q, k, v, table, lens = _case(rng, "float32")
    tq = torch.from_numpy(q).requires_grad_()
    with pytest.raises(ValueError, match="q requires a gradient"):
        cuattn.paged_decode(tq, *(torch.from_numpy(x) for x in (k, v, table, lens)))


def _fp8_case(rng, kv_dtype, per_block):
    """fp8 pages: the codes of a bf16 case's values at a scale per block (a power of two) or
    one for the cache, NaN codes in the blocks and slots nobody reads."""
    q, k, v, table, lens = _case(rng, "float32", heads=4, t_q=2, lens=(37, 20))
    num_blocks = k.shape[0]
    if per_block:
        scales = [2.0 ** rng.integers(-3, 3, num_blocks).astype(np.float32) for _ in range(2)]
    else:
        scales = [np.float32(0.25), np.float32(2.0)]
    codes = []
    for x, scale in zip((k, v), scales, strict=True):
        per = np.broadcast_to(np.asarray(scale, np.float32), (num_blocks,))[:, None, None, None]
        codes.append(fp8.encode(np, x / per, kv_dtype))  # NaN stays a NaN code
    return q.astype(_dtype("bfloat16")), codes, scales, table, lens


def _dequantised(codes, scales, kv_dtype):
    num_blocks = codes[0].shape[0]
    return [
        fp8.decode(np, c, kv_dtype)
        * np.broadcast_to(np.asarray(s, np.float32), (num_blocks,))[:, None, None, None]
        for c, s in zip(codes, scales, strict=True)
    ]


@pytest.mark.parametrize("backend", ["interp", "numpy"])
@pytest.mark.parametrize("per_block", [False, True])
@pytest.mark.parametrize("kv_dtype", fp8.FP8_DTYPES)
def test_fp8_pages(kv_dtype, per_block, backend, monkeypatch):
    """uint8 codes with kv_dtype and a scale for the cache (vLLM's) or per block: against the
    oracle over the dequantised values, within bf16's tolerance; both kernel families."""
    rng = np.random.default_rng(21)
    q, (kc, vc), scales, table, lens = _fp8_case(rng, kv_dtype, per_block)
    k_scale, v_scale = scales
    want, want_lse = oracle(q, *_dequantised((kc, vc), scales, kv_dtype), table, lens)
    for family in (geometry.DECODE_SPLIT_FAMILY, geometry.DECODE_GQA_FAMILY):
        monkeypatch.setenv(geometry.DECODE_ENV, family)
        out, lse = cuattn.paged_decode(
            q,
            kc,
            vc,
            table,
            lens,
            return_lse=True,
            kv_dtype=kv_dtype,
            k_scale=k_scale if per_block else float(k_scale),
            v_scale=v_scale if per_block else float(v_scale),
            backend=backend,
        )
        _assert_close(out, want, "bfloat16", lse, want_lse)


def test_fp8_kv_cache_and_paged_decode_agree_bit_for_bit():
    """An fp8 KVCache of one kv head is a block table of its pages: the same bits."""
    rng = np.random.default_rng(13)
    bf16 = _dtype("bfloat16")
    cache = cuattn.KVCache(2, 1, HEAD_DIM, "float8_e4m3fn", page_size=16)
    k, v = (rng.standard_normal((2, 1, 45, HEAD_DIM)).astype(bf16) for _ in range(2))
    cache.append(k, v, lengths=[45, 30])
    q = rng.standard_normal((2, 4, 1, HEAD_DIM)).astype(bf16)
    want, want_lse = cuattn.decode_attention(q, cache, return_lse=True, backend="interp")
    got, got_lse = cuattn.paged_decode(
        q,
        cache.k_pages[:, :, None],
        cache.v_pages[:, :, None],
        np.ascontiguousarray(cache.page_table[:, 0]).astype(np.int32),
        cache.lengths.astype(np.int32),
        return_lse=True,
        kv_dtype="float8_e4m3fn",
        k_scale=cache.k_scale,
        v_scale=cache.v_scale,
        backend="interp",
    )
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    assert np.array_equal(got_lse, want_lse)


def test_fp8_refusals(monkeypatch):
    rng = np.random.default_rng(1)
    q, (kc, vc), _, table, lens = _fp8_case(rng, "float8_e5m2", True)

    def refused(error, match, **kwargs):
        _refused(
            monkeypatch,
            error,
            match,
            kwargs.pop("q", q),
            kwargs.pop("k", kc),
            vc,
            table,
            lens,
            **{"kv_dtype": "float8_e5m2", **kwargs},
        )

    refused(TypeError, "kv_dtype must be None or one of", kv_dtype="float8")
    refused(
        TypeError,
        r"q has dtype float32; paged_decode takes \('float16', 'bfloat16'\)",
        q=q.astype(np.float32),
    )
    refused(
        TypeError,
        "k_pages has dtype float32; float8_e5m2 pages are their uint8 codes",
        k=kc.astype(np.float32),
    )
    refused(
        ValueError,
        r"k_scale must be a number or float32 \[num_blocks\]",
        k_scale=np.ones(3, np.float32),
    )
    refused(TypeError, "v_scale must be a finite number", v_scale=float("nan"))
    q16, k16, v16, table16, lens16 = _case(rng, "float16")
    _refused(
        monkeypatch,
        ValueError,
        "k_scale is for fp8 pages",
        q16,
        k16,
        v16,
        table16,
        lens16,
        k_scale=1.0,
    )


@pytest.mark.gpu
@pytest.mark.parametrize("family", [geometry.DECODE_SPLIT_FAMILY, geometry.DECODE_GQA_FAMILY])
@pytest.mark.parametrize(
    ("dtype", "block_size", "t_q", "heads"),
    [("bfloat16", 16, 1, 4), ("float16", 64, 3, 8), ("bfloat16", 1, 2, 2)],
)
def test_on_the_gpu(family, dtype, block_size, t_q, heads, monkeypatch):
    """The interpreter's cases on CuPy arrays (NaN in every block and slot no sequence reads),
    both kernel families, against the float64 oracle: what a GPU run must pass before
    paged_decode's launches are trusted there."""
    from cuattn.backends.cuda_runtime import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    monkeypatch.setenv(geometry.DECODE_ENV, family)
    rng = np.random.default_rng(block_size * 10 + t_q)
    q, k, v, table, lens = _case(rng, dtype, heads=heads, t_q=t_q, block_size=block_size)
    args = [cupy.asarray(x) for x in (q, k, v, table, lens)]
    out, lse = cuattn.paged_decode(*args, return_lse=True)
    assert isinstance(out, cupy.ndarray) and out.dtype == q.dtype
    want, want_lse = oracle(q, k, v, table, lens)
    _assert_close(cupy.asnumpy(out), want, dtype, cupy.asnumpy(lse), want_lse)
    trusted, trusted_lse = cuattn.paged_decode(*args, return_lse=True, check_table=False)
    assert bool((trusted == out).all()) and bool((trusted_lse == lse).all())


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", fp8.FP8_DTYPES)
def test_fp8_pages_on_the_gpu(kv_dtype, monkeypatch):
    """fp8 codes with a scale per block on CuPy arrays, both kernel families (opt-in: never run
    on a GPU before), against the oracle over the dequantised values."""
    from cuattn.backends.cuda_runtime import cuda_available

    if not cuda_available():
        pytest.skip("needs a CUDA device")
    import cupy

    monkeypatch.setenv(geometry.DECODE_FP8_ENV, geometry.DECODE_FP8_KERNEL_FAMILY)
    rng = np.random.default_rng(22)
    q, (kc, vc), scales, table, lens = _fp8_case(rng, kv_dtype, per_block=True)
    want, want_lse = oracle(q, *_dequantised((kc, vc), scales, kv_dtype), table, lens)
    for family in (geometry.DECODE_SPLIT_FAMILY, geometry.DECODE_GQA_FAMILY):
        monkeypatch.setenv(geometry.DECODE_ENV, family)
        arrays = [cupy.asarray(x) for x in (q, kc, vc, table, lens)]
        out, lse = cuattn.paged_decode(
            *arrays,
            return_lse=True,
            kv_dtype=kv_dtype,
            k_scale=cupy.asarray(scales[0]),
            v_scale=cupy.asarray(scales[1]),
        )
        _assert_close(cupy.asnumpy(out), want, "bfloat16", cupy.asnumpy(lse), want_lse)


def test_a_trusted_table_is_not_read_back(monkeypatch):
    """check_table=False: no check reads the table or the lengths (the synchronisation an
    engine pays each layer otherwise), the kernels give the checked call's bits, and a length
    past the table's room reads the room instead of walking past the row."""
    rng = np.random.default_rng(7)
    q, k, v, table, lens = _case(rng, "bfloat16", t_q=2, lens=(37, 20))
    want, want_lse = cuattn.paged_decode(q, k, v, table, lens, return_lse=True, backend="interp")

    def no_check(*args, **kwargs):
        raise AssertionError("check_table=False read the table back")

    monkeypatch.setattr(paged, "_check_table", no_check)
    got, got_lse = cuattn.paged_decode(
        q, k, v, table, lens, return_lse=True, backend="interp", check_table=False
    )
    assert np.array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))
    assert np.array_equal(got_lse, want_lse)

    room = table.shape[1] * 16
    full = table.copy()
    full[0, -1] = table[1, 0]  # a real block in the row's spare entry
    # every slot of the room is read: no NaN in them (nan_to_num skips bfloat16)
    k, v = (np.where(np.isnan(x.astype(np.float32)), 0.5, x).astype(x.dtype) for x in (k, v))
    kept, kept_lse = cuattn.paged_decode(
        q,
        k,
        v,
        full,
        np.array([room, 20], np.int32),
        return_lse=True,
        backend="interp",
        check_table=False,
    )
    past, past_lse = cuattn.paged_decode(
        q,
        k,
        v,
        full,
        np.array([room + 1000, 20], np.int32),
        return_lse=True,
        backend="interp",
        check_table=False,
    )
    assert not np.isnan(np.asarray(kept, np.float64)).any()
    assert np.array_equal(np.asarray(past).view(np.uint16), np.asarray(kept).view(np.uint16))
    assert np.array_equal(past_lse, kept_lse)


def test_the_reference_checks_a_trusted_table_too(monkeypatch):
    rng = np.random.default_rng(8)
    q, k, v, table, lens = _case(rng, "float16")
    bad = table.copy()
    bad[0, 0] = k.shape[0]
    with pytest.raises(ValueError, match=r"block_table\[0, 0\]"):
        cuattn.paged_decode(q, k, v, bad, lens, backend="numpy", check_table=False)
    _refused(
        monkeypatch,
        TypeError,
        "check_table must be True or False",
        q,
        k,
        v,
        table,
        lens,
        check_table="no",
    )
