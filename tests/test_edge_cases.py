"""Edge behaviours as SDPA has them (docs/design.md §7): empty batches and sequences give empty
results (and zero gradients) on every route, empty sequences inside a packed batch, a Pattern
that checks its arguments when built, and the data-chosen layouts under jax.jit."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import dynamic

HEADS, KV_HEADS, D = 4, 2, 16
LAYOUT = cuattn.make_layout("all", 64, HEADS, 16)
PATTERN = cuattn.Pattern("local", HEADS, 16, local_attn_ctx=8)
# (q shape, k shape) with one empty axis each: batch, time_q, time_k, both times, heads
EMPTY = {
    "batch": ((0, HEADS, 64, D), (0, KV_HEADS, 64, D)),
    "time_q": ((2, HEADS, 0, D), (2, KV_HEADS, 64, D)),
    "time_k": ((2, HEADS, 64, D), (2, KV_HEADS, 0, D)),
    "times": ((2, HEADS, 0, D), (2, KV_HEADS, 0, D)),
    "heads": ((2, 0, 64, D), (2, 0, 64, D)),
}


def arrays(q_shape, k_shape, dtype=np.float32):
    rng = np.random.default_rng(0)
    q = rng.standard_normal(q_shape).astype(dtype)
    k, v = (rng.standard_normal(k_shape).astype(dtype) for _ in "kv")
    if q.size:
        q.reshape(-1)[0] = np.nan  # no value of q reaches an empty result
    return q, k, v


def check_empty(out, lse, q_shape, lse_dtype):
    out, lse = np.asarray(out), np.asarray(lse)
    assert out.shape == q_shape and lse.shape == q_shape[:3] and lse.dtype == lse_dtype
    assert (out == 0).all() and np.isneginf(lse).all()


@pytest.mark.parametrize("layout", [LAYOUT, PATTERN], ids=["layout", "pattern"])
@pytest.mark.parametrize("axis", EMPTY)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_numpy_empty_axis_gives_an_empty_result(axis, layout, dtype):
    q_shape, k_shape = EMPTY[axis]
    q, k, v = arrays(q_shape, k_shape, dtype)
    before = [x.copy() for x in (q, k, v)]
    out, lse = cuattn.sparse_attention(q, k, v, layout, return_lse=True)
    assert type(out) is np.ndarray and out.dtype == dtype
    check_empty(out, lse, q_shape, np.float64 if dtype == np.float64 else np.float32)
    for x, was in zip((q, k, v), before, strict=True):
        np.testing.assert_array_equal(x, was)


@pytest.mark.parametrize("axis", EMPTY)
def test_torch_empty_axis_has_zero_gradients(axis):
    torch = pytest.importorskip("torch")
    q_shape, k_shape = EMPTY[axis]
    q, k, v = (torch.tensor(x, requires_grad=True) for x in arrays(q_shape, k_shape))
    out, lse = cuattn.sparse_attention(q, k, v, PATTERN, return_lse=True)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    check_empty(out.detach(), lse.detach(), q_shape, np.float32)
    (out.sum() + lse.clamp(min=-1.0).sum()).backward()
    for x in (q, k, v):
        assert x.grad is not None and x.grad.shape == x.shape and (x.grad == 0).all()


@pytest.mark.parametrize("axis", ["batch", "time_k", "times"])
def test_jax_empty_axis_under_jit_and_grad(axis):
    jax = pytest.importorskip("jax")
    q_shape, k_shape = EMPTY[axis]
    q, k, v = (jax.numpy.asarray(x) for x in arrays(q_shape, k_shape))
    out, lse = jax.jit(lambda a, b, c: cuattn.sparse_attention(a, b, c, PATTERN, return_lse=True))(
        q, k, v
    )
    check_empty(out, lse, q_shape, np.float32)

    def loss(a, b, c):
        return cuattn.sparse_attention(a, b, c, PATTERN).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for g, x in zip(grads, (q, k, v), strict=True):
        assert g.shape == x.shape and not np.asarray(g).any()


@pytest.mark.parametrize("axis", ["batch", "time_k"])
def test_tape_empty_axis_has_zero_gradients(axis):
    q_shape, k_shape = EMPTY[axis]
    q, k, v = (cuattn.Tensor(x, requires_grad=True) for x in arrays(q_shape, k_shape))
    out = cuattn.sparse_attention(q, k, v, LAYOUT)
    assert isinstance(out, cuattn.Tensor) and out.shape == q_shape
    out.sum().backward()
    for x in (q, k, v):
        assert x.grad.shape == x.shape and not x.grad.any()


def test_bte_calls_with_an_empty_batch_or_sequence():
    for shape in ((0, 64, HEADS * D), (2, 0, HEADS * D)):
        x = np.zeros(shape, np.float32)
        out = cuattn.blocksparse_attention(x, x, x, HEADS, "fixed", local_attn_ctx=32, blocksize=16)
        assert out.shape == shape
        out = cuattn.attention(x, x, x, HEADS, "local", local_attn_ctx=8)
        assert out.shape == shape and not out.any()


def test_empty_calls_still_check_their_arguments():
    q, k, v = arrays(*EMPTY["batch"])
    with pytest.raises(ValueError, match="head_dim >= 1"):
        cuattn.sparse_attention(q[..., :0], k[..., :0], v[..., :0], LAYOUT)
    with pytest.raises(ValueError, match="scale must be finite"):
        cuattn.sparse_attention(q, k, v, LAYOUT, scale=float("inf"))
    with pytest.raises(ValueError, match="layout is for heads=4"):
        cuattn.sparse_attention(q[:, :2], k[:, :1], v[:, :1], LAYOUT)
    with pytest.raises(ValueError, match="kv_heads"):  # 4 query heads, no kv head
        cuattn.sparse_attention(q, k[:, :0], v[:, :0], LAYOUT)


# ---- packed batches with empty sequences ------------------------------------------------------


def causal(n_q, n_k):
    return cuattn.make_layout("all", n_k, HEADS, 16, n_q=n_q)


@pytest.mark.parametrize(
    "cu_q, cu_k",
    [
        ([0, 20, 20, 50], [0, 20, 20, 50]),  # an empty sequence in the middle
        ([0, 0, 30], [0, 0, 30]),  # and first
        ([0, 10, 25], [0, 0, 40]),  # sequence 0 has queries but no key: 0 and -inf
        ([0, 0, 25], [0, 17, 40]),  # sequence 0 has keys but no query
        ([0, 5, 5], [0, 0, 7]),  # no sequence with both
        ([0, 0], [0, 0]),  # nothing at all
    ],
)
def test_varlen_allows_empty_sequences(cu_q, cu_k):
    rng = np.random.default_rng(1)
    cu_q, cu_k = np.array(cu_q, np.int32), np.array(cu_k, np.int32)
    q = rng.standard_normal((cu_q[-1], HEADS, D)).astype(np.float32)
    k, v = (rng.standard_normal((cu_k[-1], KV_HEADS, D)).astype(np.float32) for _ in "kv")
    out, lse = cuattn.sparse_attention_varlen(q, k, v, cu_q, cu_k, causal, return_lse=True)
    assert out.shape == q.shape and lse.shape == (HEADS, cu_q[-1])
    for s in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        if rows.stop == rows.start:
            continue
        if keys.stop == keys.start:
            assert (out[rows] == 0).all() and np.isneginf(lse[:, rows]).all()
            continue
        one = [x[None].transpose(0, 2, 1, 3) for x in (q[rows], k[keys], v[keys])]
        want = cuattn.sparse_attention(*one, causal(rows.stop - rows.start, keys.stop - keys.start))
        np.testing.assert_allclose(out[rows], want[0].transpose(1, 0, 2), rtol=1e-5, atol=1e-6)


def test_varlen_errors_name_the_sequence():
    x = np.zeros((8, HEADS, D), np.float32)
    cu = np.array([0, 4, 4, 8], np.int32)
    layouts = [causal(4, 4), causal(4, 4), causal(4, 4)]
    kept = list(layouts)
    with pytest.raises(ValueError, match=r"layouts\[1\].*sequence 1 has 0 queries.*takes None"):
        cuattn.sparse_attention_varlen(x, x, x, cu, cu, layouts)
    assert layouts == kept
    with pytest.raises(TypeError, match=r"layouts\[1\] must be a cuattn.Layout"):
        cuattn.sparse_attention_varlen(x, x, x, cu, cu, [causal(4, 4), "x", causal(4, 4)])
    with pytest.raises(ValueError, match=r"layouts\[2\]: None, but sequence 2 has 4 queries"):
        cuattn.sparse_attention_varlen(x, x, x, cu, cu, [causal(4, 4), None, None])
    with pytest.raises(ValueError, match="non-decreasing.*sequence 1 would have length -2"):
        cuattn.sparse_attention_varlen(x, x, x, np.array([0, 5, 3, 8], np.int32), cu, causal)
    with pytest.raises(ValueError, match=r"max_seqlen_q=3 .*sequence 0: 4 tokens"):
        cuattn.sparse_attention_varlen(x, x, x, cu, cu, causal, max_seqlen_q=3)
    out = cuattn.sparse_attention_varlen(x, x, x, cu, cu, [causal(4, 4), None, causal(4, 4)])
    assert out.shape == x.shape


# ---- Pattern checks its arguments when built --------------------------------------------------


@pytest.mark.parametrize(
    "mode, options, error, message",
    [
        ("local", {"local_ctx": 8}, TypeError, r"did you mean 'local_attn_ctx'.*local_attn_ctx"),
        ("all", {"window": 8}, TypeError, r"\['window'\].*accepted pattern arguments: causal$"),
        ("fixed", {"num_vert": 2}, TypeError, "local_attn_ctx, num_verts, vertsize, causal"),
        ("local", {}, ValueError, "needs local_attn_ctx"),
        ("local", {"local_attn_ctx": 0}, ValueError, "local_attn_ctx must be a positive int"),
        ("fixed", {"local_attn_ctx": 24}, ValueError, "multiple of blocksize"),
        ("fixed", {"local_attn_ctx": 64, "num_verts": 3}, ValueError, "num_verts"),
        ("all", {"num_verts": 2}, ValueError, "apply only to attn_mode='fixed'"),
        ("all", {"causal": "yes"}, TypeError, "causal must be a bool"),
        ("bigbird", {"num_random_blocks": -1}, ValueError, "non-negative"),
        ("strided", {"local_attn_ctx": 4, "transpose": "y"}, TypeError, "transpose must be"),
        ("longformer", {"local_attn_ctx": 4, "global_tokens": ("a",)}, TypeError, "hold ints"),
    ],
)
def test_pattern_checks_its_arguments_when_built(mode, options, error, message):
    with pytest.raises(error, match=message):
        cuattn.Pattern(mode, HEADS, 16, **options)


def test_pattern_leaves_length_bound_arguments_to_the_call():
    """What only a length can judge (a global token past it, documents summing to it, the
    transposed strided form) waits for the call."""
    cuattn.Pattern("longformer", HEADS, 16, local_attn_ctx=4, global_tokens=(100,))
    cuattn.Pattern("document", HEADS, 16, doc_lengths=(10, 22))
    cuattn.Pattern("strided", HEADS, 16, local_attn_ctx=4, transpose=True)
    cuattn.Pattern("variable", HEADS, 16)
    with pytest.raises(ValueError, match="sum to n_ctx=64"):
        cuattn.Pattern("document", HEADS, 16, doc_lengths=(10, 22)).layout(64, 64)


def test_make_layout_names_what_each_mode_accepts():
    with pytest.raises(TypeError, match="accepted pattern arguments: local_attn_ctx, causal"):
        cuattn.make_layout("local", 64, HEADS, 16, local_ctx=8)


# ---- layouts chosen from the data, under jax.jit ----------------------------------------------


@pytest.mark.parametrize("backend", [None, "numpy", "interp", "cuda"])
@pytest.mark.parametrize(
    "build",
    [
        lambda q, b: dynamic.topk_blocks(q, q, 32, 2, backend=b),
        lambda q, b: dynamic.mass_threshold_blocks(q, q, 32, 0.9, backend=b),
        lambda q, b: dynamic.vertical_slash_layout(q, q, 32, 4, 4, 16, backend=b),
        lambda q, b: dynamic.block_scores(q, q, 32),
    ],
    ids=["topk", "mass", "vertical_slash", "scores"],
)
def test_dynamic_layouts_under_jax_jit_raise_a_named_error(build, backend):
    jax = pytest.importorskip("jax")
    q = jax.numpy.asarray(np.random.default_rng(2).standard_normal((2, 128, D)), "float32")
    with pytest.raises(TypeError, match="q is a jax tracer.*Build the layout outside"):
        jax.jit(lambda x: build(x, backend))(q)
    if backend in (None, "numpy"):
        build(q, backend)  # eagerly: a layout
