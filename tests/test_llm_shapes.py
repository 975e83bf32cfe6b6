"""The shapes of LLM attention (issue: GQA/MQA, queries != keys, packed variable-length batches,
document masks, block size 8) on NumPy and the kernel interpreter, against the float64 oracle
and, for the dense cases, torch's SDPA with enable_gqa and its bottom-right causal mask."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn.backends.call import AttentionCall
from cuattn.layout.derived import coarsened, end_aligned, packed
from tests.helpers.oracle import dense_attention, dense_attention_grads, rel_err

RNG = np.random.default_rng(20261123)
HEADS = 4
N_K = 100  # keys: ragged for every block size used here
# (n_q, kv_heads): fewer queries than keys at a non-block offset, more queries than keys
# (the first causal rows see nothing), GQA groups of 2, MQA
SHAPES = [(37, 2), (100, 1), (130, 4), (64, 2)]
PATTERNS = [
    ("all", {}),
    ("all", {"causal": False}),
    ("local", {"local_attn_ctx": 20}),
    ("local", {"local_attn_ctx": 20, "causal": False}),
    ("strided", {"local_attn_ctx": 8}),
    ("fixed", {"local_attn_ctx": 32}),
    ("bigbird", {"num_random_blocks": 1}),
    ("longformer", {"local_attn_ctx": 10, "global_tokens": (0, 50)}),
    ("document", {"doc_lengths": (30, 50, 20)}),
]


def inputs(n_q, kv_heads, n_k=N_K, head_dim=16, dtype=np.float64, batch=2):
    q = RNG.standard_normal((batch, HEADS, n_q, head_dim)).astype(dtype)
    k, v = (RNG.standard_normal((batch, kv_heads, n_k, head_dim)).astype(dtype) for _ in "kv")
    dout = RNG.standard_normal(q.shape).astype(dtype)
    return q, k, v, dout


def expected_rule(mode, kwargs, n_q, n_k):
    """allowed[q, k] restated from docs/design.md §2 with q at position q + n_k - n_q (rules
    defined on elements only; block-defined patterns are checked against their square form)."""
    pos = np.arange(n_q)[:, None] + n_k - n_q
    key = np.arange(n_k)[None, :]
    causal = kwargs.get("causal", True)
    if mode == "all":
        return key <= pos if causal else np.ones((n_q, n_k), bool)
    if mode == "local":
        w = kwargs["local_attn_ctx"]
        return (key <= pos) & (pos - key < w) if causal else np.abs(pos - key) < w
    return None


@pytest.mark.parametrize("n_q", [37, 100, 130, 1])
@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p[0] + str(len(p[1])))
def test_end_aligned_layouts_keep_the_pattern(pattern, n_q):
    mode, kwargs = pattern
    lay = cuattn.make_layout(mode, N_K, HEADS, 16, n_q=n_q, **kwargs)
    mask = lay.to_mask()
    assert mask.shape == (HEADS, n_q, N_K) and (lay.n_q, lay.n_ctx) == (n_q, N_K)
    rule = expected_rule(mode, kwargs, n_q, N_K)
    if rule is not None:
        np.testing.assert_array_equal(mask, np.broadcast_to(rule, mask.shape))
    square_kwargs = dict(kwargs, transpose=False) if mode == "strided" else kwargs
    square = cuattn.make_layout(mode, N_K, HEADS, 16, **square_kwargs).to_mask()
    for i in range(n_q):
        position = i + N_K - n_q
        if position >= 0:
            np.testing.assert_array_equal(mask[:, i], square[:, position])
        elif rule is None:
            assert not mask[:, i].any()


def test_end_aligned_errors():
    square = cuattn.make_layout("all", 64, 2, 16)
    rect = end_aligned(square, 40)
    with pytest.raises(ValueError, match="needs a square layout"):
        end_aligned(rect, 20)
    strided = cuattn.make_layout("strided", 64, 2, 16, local_attn_ctx=4)
    assert strided.perm is not None
    with pytest.raises(ValueError, match="permuted token order"):
        end_aligned(strided, 40)
    with pytest.raises(ValueError, match="permuted token order"):
        cuattn.make_layout("strided", 64, 2, 16, local_attn_ctx=4, n_q=40, transpose=True)
    with pytest.raises(ValueError, match="n_q must be a positive int"):
        cuattn.make_layout("all", 64, 2, 16, n_q=0)


@pytest.mark.parametrize("n_q, kv_heads", SHAPES)
@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p[0] + str(len(p[1])))
def test_numpy_gqa_and_lengths(pattern, n_q, kv_heads):
    mode, kwargs = pattern
    lay = cuattn.make_layout(mode, N_K, HEADS, 16, n_q=n_q, **kwargs)
    q, k, v, dout = inputs(n_q, kv_heads)
    out, lse = cuattn.sparse_attention(q, k, v, lay, scale=0.3, return_lse=True)
    ref_out, ref_lse = dense_attention(q, k, v, lay.to_mask(), 0.3)
    assert rel_err(out, ref_out) < 1e-12
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    finite = np.isfinite(ref_lse)
    assert np.abs(lse[finite] - ref_lse[finite]).max(initial=0) < 1e-12
    x = [cuattn.Tensor(a, requires_grad=True) for a in (q, k, v)]
    (cuattn.sparse_attention(*x, lay, scale=0.3) * cuattn.Tensor(dout)).sum().backward()
    grads = dense_attention_grads(q, k, v, dout, lay.to_mask(), 0.3)
    for tensor, ref in zip(x, grads, strict=True):
        assert tensor.grad.shape == ref.shape
        assert rel_err(tensor.grad, ref) < 1e-10


# The interpreter runs the .cu kernels; each (block, dtype, rule) instantiation is interpreted
# by tests/backends/test_interp_kernels.py; here the shape scalars (n_q != n_k, q_offset,
# kv_group) go through every rule at two block sizes.
INTERP_TOLERANCE = {np.float32: 1e-5, np.float16: 1e-2}
INTERP_CASES = [
    ("all", {}, 16),
    ("local", {"local_attn_ctx": 20, "causal": False}, 32),
    ("all", {"causal": False}, 16),
    ("document", {"doc_lengths": (30, 50, 20)}, 32),
    ("fixed", {"local_attn_ctx": 32}, 16),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["float32", "float16"])
@pytest.mark.parametrize("n_q, kv_heads", [(37, 2), (130, 1), (100, 4)])
@pytest.mark.parametrize("case", INTERP_CASES, ids=lambda c: f"{c[0]}-b{c[2]}-{len(c[1])}")
def test_interp_kernels_gqa_and_lengths(case, n_q, kv_heads, dtype):
    mode, kwargs, block = case
    lay = cuattn.make_layout(mode, N_K, HEADS, block, n_q=n_q, **kwargs)
    q, k, v, dout = inputs(n_q, kv_heads, head_dim=32, dtype=dtype, batch=1)
    out, lse = cuattn.sparse_attention(q, k, v, lay, return_lse=True, backend="interp")
    mask = lay.to_mask()
    ref_out, ref_lse = dense_attention(q, k, v, mask, 32**-0.5)
    assert not np.isnan(out.astype(np.float32)).any()
    assert rel_err(out, ref_out) <= INTERP_TOLERANCE[dtype]
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))
    empty = ~mask.any(axis=-1)
    assert (out[0][empty] == 0).all()
    grads = cuattn.backends.backward(
        q, k, v, out, lse, dout, None, AttentionCall(lay, 32**-0.5, backend="interp")
    )
    refs = dense_attention_grads(q, k, v, dout, mask, 32**-0.5)
    for grad, ref in zip(grads, refs, strict=True):
        assert grad.shape == ref.shape and grad.dtype == q.dtype
        assert rel_err(grad, ref) <= 2 * INTERP_TOLERANCE[dtype]


@pytest.mark.parametrize("mode, kwargs", [("all", {}), ("strided", {"local_attn_ctx": 4})])
def test_block_size_8(mode, kwargs):
    """Block 8 stays block 8 for the user; the kernels run its 16-block coarsening."""
    lay = cuattn.make_layout(mode, 64, HEADS, 8, **kwargs)
    assert lay.blocksize == 8
    coarse = coarsened(lay, 16)
    np.testing.assert_array_equal(coarse.to_mask(), lay.to_mask())
    assert lay.density_at(16) == coarse.density >= lay.density
    q, k, v, dout = inputs(64, 2, n_k=64, head_dim=32, dtype=np.float32, batch=1)
    ref_out, _ = dense_attention(q, k, v, lay.to_mask(), 32**-0.5)
    for backend in ("numpy", "interp"):
        out = cuattn.sparse_attention(q, k, v, lay, backend=backend)
        assert rel_err(out, ref_out) <= 1e-5, backend
    out, lse = cuattn.backends.forward(q, k, v, AttentionCall(lay, 32**-0.5, backend="interp"))
    grads = cuattn.backends.backward(
        q, k, v, out, lse, dout, None, AttentionCall(lay, 32**-0.5, backend="interp")
    )
    refs = dense_attention_grads(q, k, v, dout, lay.to_mask(), 32**-0.5)
    for grad, ref in zip(grads, refs, strict=True):
        assert rel_err(grad, ref) <= 2e-5


def test_document_pattern():
    lengths = (5, 20, 1, 38)
    for causal in (True, False):
        lay = cuattn.make_layout("document", 64, 2, 16, doc_lengths=lengths, causal=causal)
        doc = np.repeat(np.arange(len(lengths)), lengths)
        expected = doc[:, None] == doc[None, :]
        if causal:
            expected &= np.tril(np.ones((64, 64), bool))
        np.testing.assert_array_equal(lay.to_mask(), np.broadcast_to(expected, (2, 64, 64)))
    with pytest.raises(ValueError, match="needs doc_lengths"):
        cuattn.make_layout("document", 64, 2, 16)
    with pytest.raises(ValueError, match="sum to n_ctx=64"):
        cuattn.make_layout("document", 64, 2, 16, doc_lengths=(30, 30))


def varlen_case(kv_heads=2, head_dim=16):
    lens_q, lens_k = [17, 40, 1, 33], [17, 55, 9, 33]
    cu_q = np.concatenate([[0], np.cumsum(lens_q)]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum(lens_k)]).astype(np.int64)
    q = RNG.standard_normal((cu_q[-1], HEADS, head_dim))
    k, v = (RNG.standard_normal((cu_k[-1], kv_heads, head_dim)) for _ in "kv")
    return q, k, v, cu_q, cu_k


def local_fn(n_q, n_k):
    return cuattn.make_layout("local", n_k, HEADS, 16, local_attn_ctx=10, n_q=n_q)


def per_sequence(q, k, v, cu_q, cu_k, layouts):
    outs, lses = [], []
    for s, lay in enumerate(layouts):
        qs, ks, vs = (
            x[c[s] : c[s + 1]].transpose(1, 0, 2)[None]
            for x, c in ((q, cu_q), (k, cu_k), (v, cu_k))
        )
        out, lse = dense_attention(qs, ks, vs, lay.to_mask(), qs.shape[-1] ** -0.5)
        outs.append(out[0].transpose(1, 0, 2))
        lses.append(lse[0])
    return np.concatenate(outs), np.concatenate(lses, axis=1)


@pytest.mark.parametrize("backend", ["numpy", "interp"])
def test_varlen_matches_each_sequence_alone(backend):
    q, k, v, cu_q, cu_k = varlen_case(head_dim=16 if backend == "numpy" else 32)
    layouts = [local_fn(int(a), int(b)) for a, b in zip(np.diff(cu_q), np.diff(cu_k), strict=True)]
    layouts[2] = cuattn.make_layout("all", 9, HEADS, 16, n_q=1, causal=False)
    if backend == "interp":
        q, k, v = (x.astype(np.float32) for x in (q, k, v))
    out, lse = cuattn.sparse_attention_varlen(
        q, k, v, cu_q, cu_k, layouts, max_seqlen_q=40, return_lse=True, backend=backend
    )
    ref_out, ref_lse = per_sequence(q, k, v, cu_q, cu_k, layouts)
    assert out.shape == q.shape and lse.shape == (HEADS, q.shape[0])
    assert rel_err(out, ref_out) <= (1e-12 if backend == "numpy" else 1e-5)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref_lse))


def test_varlen_gradients_and_callable_layouts():
    torch = pytest.importorskip("torch")
    q, k, v, cu_q, cu_k = varlen_case(kv_heads=1)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = cuattn.sparse_attention_varlen(
        tq, tk, tv, torch.tensor(cu_q), torch.tensor(cu_k), local_fn
    )
    dout = RNG.standard_normal(q.shape)
    (out * torch.tensor(dout)).sum().backward()
    # the same through the padded [B, H, T, d] route, one sequence at a time
    for s in range(len(cu_q) - 1):
        sl_q, sl_k = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        lay = local_fn(sl_q.stop - sl_q.start, sl_k.stop - sl_k.start)
        args = [x[sl].transpose(1, 0, 2)[None] for x, sl in ((q, sl_q), (k, sl_k), (v, sl_k))]
        grads = dense_attention_grads(
            *args, dout[sl_q].transpose(1, 0, 2)[None], lay.to_mask(), 16**-0.5
        )
        for tensor, sl, ref in zip((tq, tk, tv), (sl_q, sl_k, sl_k), grads, strict=True):
            got = tensor.grad[sl].numpy().transpose(1, 0, 2)[None]
            assert rel_err(got, ref) < 1e-10


def test_varlen_errors():
    q, k, v, cu_q, cu_k = varlen_case()
    call = cuattn.sparse_attention_varlen
    with pytest.raises(TypeError, match="cu_seqlens_q must be an int32 or int64 array"):
        call(q, k, v, cu_q.astype(np.float32), cu_k, local_fn)
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0"):
        call(q, k, v, cu_q + 1, cu_k, local_fn)
    bad = cu_q.copy()
    bad[2] = 5
    with pytest.raises(ValueError, match="cu_seqlens_q must be non-decreasing"):
        call(q, k, v, bad, cu_k, local_fn)
    with pytest.raises(ValueError, match="cu_seqlens_k must end at the number of packed tokens"):
        call(q, k, v, cu_q, cu_k[:-1], local_fn)
    with pytest.raises(ValueError, match="the same number of sequences"):
        call(q, k[: cu_k[-2]], v[: cu_k[-2]], cu_q, cu_k[:-1], local_fn)
    with pytest.raises(ValueError, match=r"layouts\[1\]: built for n_q=40, n_ctx=40"):
        call(q, k, v, cu_q, cu_k, [local_fn(17, 17), local_fn(40, 40), *(local_fn(1, 1),) * 2])
    with pytest.raises(ValueError, match="max_seqlen_k=10 is below the longest sequence"):
        call(q, k, v, cu_q, cu_k, local_fn, max_seqlen_k=10)
    with pytest.raises(TypeError, match="layouts must be a sequence of cuattn.Layout"):
        call(q, k, v, cu_q, cu_k, "local")
    with pytest.raises(ValueError, match="q must have rank 3"):
        call(q[None], k, v, cu_q, cu_k, local_fn)


def test_packed_layout_is_block_diagonal():
    cu_q, cu_k = np.array([0, 20, 65, 72]), np.array([0, 30, 75, 115])
    layouts = [
        cuattn.make_layout("all", 30, 2, 16, n_q=20),
        cuattn.make_layout("local", 45, 2, 16, local_attn_ctx=9),
        cuattn.make_layout("fixed", 40, 2, 16, local_attn_ctx=16, n_q=7, causal=False),
    ]
    lay = packed(layouts, cu_q, cu_k)
    expected = np.zeros((2, 72, 115), bool)
    for s, sub in enumerate(layouts):
        expected[:, cu_q[s] : cu_q[s + 1], cu_k[s] : cu_k[s + 1]] = sub.to_mask()
    np.testing.assert_array_equal(lay.to_mask(), expected)


def test_blocksparse_attention_kv_heads():
    q = RNG.standard_normal((2, 48, HEADS * 16))
    k, v = (RNG.standard_normal((2, 64, 16)) for _ in "kv")  # MQA, 64 keys for 48 queries
    out = cuattn.blocksparse_attention(q, k, v, heads=HEADS, kv_heads=1, attn_mode="all")
    lay = cuattn.make_layout("all", 64, HEADS, 32, n_q=48)
    split = [cuattn.split_heads(q, HEADS), cuattn.split_heads(k, 1), cuattn.split_heads(v, 1)]
    ref, _ = dense_attention(*split, lay.to_mask(), 16**-0.5)
    assert rel_err(cuattn.split_heads(out, HEADS), ref) < 1e-12


@pytest.mark.filterwarnings("ignore:Lower right causal bias will produce NaNs")
@pytest.mark.parametrize("n_q, kv_heads", [(37, 2), (100, 1), (130, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_matches_torch_sdpa_gqa_bottom_right(n_q, kv_heads, causal):
    torch = pytest.importorskip("torch")
    bias = pytest.importorskip("torch.nn.attention.bias")
    functional = torch.nn.functional
    q, k, v, dout = inputs(n_q, kv_heads)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    lay = cuattn.make_layout("all", N_K, HEADS, 32, n_q=n_q, causal=causal)
    out = cuattn.sparse_attention(tq, tk, tv, lay)
    (out * torch.tensor(dout)).sum().backward()
    ours = [out.detach()] + [x.grad for x in (tq, tk, tv)]
    sq, sk, sv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    mask = bias.causal_lower_right(n_q, N_K) if causal else None
    ref = functional.scaled_dot_product_attention(sq, sk, sv, attn_mask=mask, enable_gqa=True)
    (ref * torch.tensor(dout)).sum().backward()
    # SDPA gives NaN on rows that see no key (n_q > n_k, causal); cuattn gives 0
    rows = slice(max(n_q - N_K, 0) if causal else 0, None)
    assert (ours[0][:, :, : rows.start or 0] == 0).all()
    assert rel_err(ours[0][:, :, rows].numpy(), ref.detach()[:, :, rows].numpy()) < 1e-12
    if rows.start:
        return  # SDPA's NaN rows poison its gradients
    for got, want in zip(ours[1:], (sq.grad, sk.grad, sv.grad), strict=True):
        assert rel_err(got.numpy(), want.numpy()) < 1e-10


def test_jax_jit_gradients_gqa_and_lengths():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, dout = (x.astype(np.float32) for x in inputs(37, 2, batch=1))
    lay = cuattn.make_layout("local", N_K, HEADS, 16, local_attn_ctx=20, n_q=37)

    def loss(q, k, v):
        return jnp.sum(cuattn.sparse_attention(q, k, v, lay) * dout)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x) for x in (q, k, v)))
    refs = dense_attention_grads(q, k, v, dout, lay.to_mask(), 16**-0.5)
    for grad, ref in zip(grads, refs, strict=True):
        assert grad.shape == ref.shape and rel_err(np.asarray(grad), ref) < 1e-5
