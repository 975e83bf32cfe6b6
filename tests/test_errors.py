"""Bad input raises ValueError/TypeError naming the argument and what is accepted
(docs/design.md §7)."""

import numpy as np
import pytest

import cuattn

RNG = np.random.default_rng(0)


def qkv(shape=(2, 64, 32), dtype=np.float32):
    return [RNG.standard_normal(shape).astype(dtype) for _ in range(3)]


def test_wrong_rank():
    q, k, v = qkv((64, 32))
    with pytest.raises(ValueError, match=r"q must have rank 3 \[batch, time, heads \* head_dim\]"):
        cuattn.blocksparse_attention(q, k, v, heads=2, attn_mode="all")
    q4 = RNG.standard_normal((2, 64, 32))
    lay = cuattn.make_layout("all", 64, 2, 16)
    with pytest.raises(ValueError, match=r"q must have rank 4"):
        cuattn.sparse_attention(q4, q4, q4, lay)


def test_mismatched_shapes():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"v must be \[batch, time_k, kv_heads \* head_dim\]"):
        cuattn.blocksparse_attention(q, k[:, :32], v, heads=2, attn_mode="all")
    with pytest.raises(ValueError, match=r"k must be \[batch, time_k, kv_heads \* head_dim\] = "):
        cuattn.blocksparse_attention(q, k[:, :, :16], v[:, :, :16], heads=2, attn_mode="all")
    with pytest.raises(ValueError, match=r"kv_heads=3 must divide heads=2"):
        cuattn.blocksparse_attention(q, k, v, heads=2, kv_heads=3, attn_mode="all")
    q4 = RNG.standard_normal((2, 4, 64, 16))
    k4 = RNG.standard_normal((2, 3, 64, 16))
    lay = cuattn.make_layout("all", 64, 4, 16)
    with pytest.raises(ValueError, match=r"kv_heads dividing heads=4 \(GQA/MQA\)"):
        cuattn.sparse_attention(q4, k4, k4, lay)
    with pytest.raises(ValueError, match=r"v must have the same shape as k"):
        cuattn.sparse_attention(q4, q4, k4, lay)
    with pytest.raises(ValueError, match=r"make_layout\(\.\.\., n_ctx=32, n_q=64\)"):
        cuattn.sparse_attention(q4, q4[:, :, :32], q4[:, :, :32], lay)


def test_mismatched_dtypes():
    q, k, v = qkv()
    with pytest.raises(
        TypeError, match=r"v must have the same dtype as q \(float32\), got float64"
    ):
        cuattn.blocksparse_attention(q, k, v.astype(np.float64), heads=2, attn_mode="all")


def test_non_float_dtype():
    q = np.ones((2, 64, 32), dtype=np.int32)
    with pytest.raises(TypeError, match="q must have a floating dtype"):
        cuattn.blocksparse_attention(q, q, q, heads=2, attn_mode="all")


def test_not_an_array():
    with pytest.raises(TypeError, match="q must be an array"):
        cuattn.blocksparse_attention([[1.0]], [[1.0]], [[1.0]], heads=1, attn_mode="all")


def test_embd_not_divisible_by_heads():
    q, k, v = qkv((2, 64, 30))
    with pytest.raises(ValueError, match=r"embd=30 .* divisible by heads=4"):
        cuattn.blocksparse_attention(q, k, v, heads=4, attn_mode="all")
    with pytest.raises(ValueError, match=r"embd=30 .* divisible by heads=4"):
        cuattn.split_heads(q, 4)


def test_bad_heads():
    q, k, v = qkv()
    with pytest.raises(ValueError, match="heads must be a positive int, got 0"):
        cuattn.blocksparse_attention(q, k, v, heads=0, attn_mode="all")
    with pytest.raises(TypeError, match="heads must be a positive int"):
        cuattn.blocksparse_attention(q, k, v, heads=2.0, attn_mode="all")


def test_unknown_mode():
    q, k, v = qkv()
    with pytest.raises(ValueError, match=r"attn_mode must be one of \('all', 'local'"):
        cuattn.blocksparse_attention(q, k, v, heads=2, attn_mode="dilated")
    with pytest.raises(ValueError, match="attention's attn_mode must be one of"):
        cuattn.attention(q, k, v, heads=2, attn_mode="fixed")


def test_missing_local_attn_ctx():
    with pytest.raises(ValueError, match="attn_mode='local' needs local_attn_ctx"):
        cuattn.make_layout("local", 64, 2, 16)


def test_fixed_num_verts_not_dividing_heads():
    with pytest.raises(ValueError, match=r"num_verts to divide heads=6; got num_verts=4"):
        cuattn.make_layout("fixed", 256, 6, 32, local_attn_ctx=128, num_verts=4)


def test_fixed_num_verts_times_vertsize_larger_than_group():
    with pytest.raises(
        ValueError, match=r"num_verts \* vertsize <= local_attn_ctx / blocksize = 4"
    ):
        cuattn.make_layout("fixed", 256, 4, 32, local_attn_ctx=128, num_verts=4, vertsize=2)


def test_fixed_vertsize_not_dividing_group():
    with pytest.raises(ValueError, match=r"vertsize to divide local_attn_ctx / blocksize = 4"):
        cuattn.make_layout("fixed", 256, 4, 32, local_attn_ctx=128, num_verts=1, vertsize=3)


def test_fixed_local_ctx_not_multiple_of_blocksize():
    with pytest.raises(ValueError, match="local_attn_ctx to be a multiple of blocksize"):
        cuattn.make_layout("fixed", 256, 4, 32, local_attn_ctx=100)


def test_ragged_lengths_are_served_not_refused():
    # The original needed n % blocksize == 0 and, for strided, (n/s) % blocksize == 0; cuattn
    # serves ragged lengths (the last block is partial) and builds strided in natural order.
    q, k, v = qkv((1, 100, 32))
    for mode, kw in (
        ("all", {}),
        ("strided", {"local_attn_ctx": 7}),
        ("local", {"local_attn_ctx": 9}),
    ):
        out = cuattn.blocksparse_attention(q, k, v, heads=2, attn_mode=mode, blocksize=16, **kw)
        assert out.shape == q.shape and np.isfinite(out).all()


def test_layout_blocks_shape_must_fit_n_ctx():
    with pytest.raises(ValueError, match=r"blocks has shape \(1, 4, 4\) .*, but n_ctx=100"):
        cuattn.Layout.from_blocks(np.ones((1, 4, 4), bool), 16, n_ctx=100)
    with pytest.raises(ValueError, match=r"blocks must be a \[heads, n_q/b, n/b\]"):
        cuattn.Layout.from_blocks(np.ones((1, 1, 4, 3), bool), 16)
    with pytest.raises(ValueError, match=r"but n_q=100 with blocksize=16 needs"):
        cuattn.Layout.from_blocks(np.ones((1, 4, 3), bool), 16, n_q=100)
    rectangular = cuattn.Layout.from_blocks(np.ones((1, 4, 3), bool), 16)
    assert (rectangular.n_q, rectangular.n_ctx) == (64, 48)
    with pytest.raises(ValueError, match="blocks must hold only 0 and 1"):
        cuattn.Layout.from_blocks(np.full((1, 2, 2), 2), 16)


def test_layout_of_the_wrong_shape_for_the_inputs():
    q = RNG.standard_normal((1, 2, 64, 16))
    lay = cuattn.make_layout("all", 128, 2, 16)
    with pytest.raises(
        ValueError,
        match=r"layout is for heads=2, n_q=128 queries, n_ctx=128 keys, but q has heads=2, time=64",
    ):
        cuattn.sparse_attention(q, q, q, lay)
    lay3 = cuattn.make_layout("all", 64, 3, 16)
    with pytest.raises(ValueError, match="layout is for heads=3"):
        cuattn.sparse_attention(q, q, q, lay3)
    with pytest.raises(TypeError, match="layout must be a cuattn.Layout"):
        cuattn.sparse_attention(q, q, q, np.ones((2, 4, 4), bool))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_scale(scale):
    q, k, v = qkv()
    with pytest.raises(ValueError, match="scale must be finite"):
        cuattn.blocksparse_attention(q, k, v, heads=2, attn_mode="all", scale=scale)


def test_scale_of_the_wrong_type():
    q, k, v = qkv()
    with pytest.raises(TypeError, match="scale must be a real number"):
        cuattn.blocksparse_attention(q, k, v, heads=2, attn_mode="all", scale="0.1")


def test_unknown_pattern_argument():
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['windw'\].*accepted"):
        cuattn.make_layout("bigbird", 64, 2, 16, windw=3)
    with pytest.raises(ValueError, match="num_verts/vertsize apply only to attn_mode='fixed'"):
        cuattn.make_layout("all", 64, 2, 16, num_verts=2)


def test_bad_blocksize_and_n_ctx():
    with pytest.raises(ValueError, match="blocksize must be a positive int, got 0"):
        cuattn.make_layout("all", 64, 2, 0)
    with pytest.raises(TypeError, match="n_ctx must be a positive int"):
        cuattn.make_layout("all", 64.0, 2, 16)


def test_mask_fn_must_return_bools():
    with pytest.raises(TypeError, match="mask_fn must return a bool array"):
        cuattn.Layout.from_blocks(np.ones((1, 2, 2), bool), 8, mask_fn=lambda h, q, k: q - k)
    with pytest.raises(TypeError, match="mask_fn must be callable"):
        cuattn.Layout.from_blocks(np.ones((1, 2, 2), bool), 8, mask_fn=3)


def test_global_tokens_out_of_range():
    with pytest.raises(ValueError, match=r"global_tokens entries must be in \[0, 64\), got 64"):
        cuattn.make_layout("longformer", 64, 1, 16, local_attn_ctx=4, global_tokens=[64])


def test_unknown_backend():
    q = RNG.standard_normal((1, 2, 64, 16))
    lay = cuattn.make_layout("all", 64, 2, 16)
    with pytest.raises(ValueError, match="backend must be one of"):
        cuattn.sparse_attention(q, q, q, lay, backend="tpu")
    with pytest.raises(ValueError, match="backend='cuda' needs CUDA arrays"):
        cuattn.sparse_attention(q, q, q, lay, backend="cuda")
