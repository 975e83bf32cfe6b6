"""FlexAttention's BlockMask in and out: Layout.from_block_mask runs what flex_attention runs with
the same BlockMask, and Layout.to_block_mask hands flex_attention what cuattn runs (CPU, float64).
"""

from __future__ import annotations

import numpy as np
import pytest

import cuattn

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

# flex_attention without torch.compile says it runs unfused: the reference here, on purpose
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

HEADS, HEAD_DIM = 2, 16
ATOL = 1e-12


def _qkv(n_q, n_k, heads=HEADS, seed=0, grad=False):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, n_q, HEAD_DIM, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, heads, n_k, HEAD_DIM, dtype=torch.float64, generator=gen) for _ in "kv")
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _document_mask(n):
    """Causal attention inside documents of uneven lengths (a mask_mod that reads a tensor)."""
    document = torch.as_tensor(np.repeat(np.arange(4), [37, 90, 11, n - 138]))

    def mask_mod(b, h, q, k):
        return (document[q] == document[k]) & (k <= q)

    return mask_mod


def _window(b, h, q, k):
    return (k <= q) & (q - k < 24 + 40 * h)  # a window per head


@pytest.mark.parametrize(
    "case",
    ["causal 128", "documents 64", "window (128, 64)", "one head broadcast", "queries < keys"],
)
def test_from_block_mask_equals_flex_attention(case):
    n_q = n_k = 200
    heads_in_mask, kwargs = HEADS, {}
    if case == "causal 128":
        mask_mod, size = (lambda b, h, q, k: k <= q), 128
    elif case == "documents 64":
        mask_mod, size = _document_mask(n_k), 64
    elif case == "window (128, 64)":
        mask_mod, size = _window, (128, 64)
    elif case == "one head broadcast":
        mask_mod, size, heads_in_mask, kwargs = _document_mask(n_k), 32, 1, {"heads": HEADS}
    else:
        n_q, size = 70, 32
        mask_mod = lambda b, h, q, k: k <= q + (n_k - n_q)  # noqa: E731  end-aligned causal
    block_mask = flex.create_block_mask(
        mask_mod, 1, heads_in_mask, n_q, n_k, device="cpu", BLOCK_SIZE=size
    )
    layout = cuattn.Layout.from_block_mask(block_mask, **kwargs)
    expected_b = {"causal 128": 128, "window (128, 64)": 64}.get(case, 64 if size == 64 else 32)
    assert layout.blocksize == expected_b and layout.heads == HEADS
    q, k, v = _qkv(n_q, n_k)
    got = cuattn.sparse_attention(q, k, v, layout)
    want = flex.flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_from_block_mask_gradients_equal_sdpa_with_flexs_dense_mask():
    """FlexAttention has no backward on the CPU: the reference is SDPA given the mask Flex's
    create_mask makes of the same mask_mod."""
    mask_mod = _document_mask(160)
    block_mask = flex.create_block_mask(mask_mod, 1, HEADS, 160, 160, BLOCK_SIZE=32)
    dense = flex.create_mask(mask_mod, 1, HEADS, 160, 160, device="cpu")
    ours, theirs = _qkv(160, 160, grad=True), _qkv(160, 160, grad=True)
    got = cuattn.sparse_attention(*ours, cuattn.Layout.from_block_mask(block_mask))
    want = torch.nn.functional.scaled_dot_product_attention(*theirs, attn_mask=dense)
    dout = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(3))
    got.backward(dout)
    want.backward(dout)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    "pattern",
    [
        ("fixed", {"local_attn_ctx": 64, "num_verts": 2, "vertsize": 1}),
        ("strided", {"local_attn_ctx": 16}),  # computed in a permuted order
        ("local", {"local_attn_ctx": 40}),
        ("all", {"causal": False}),
    ],
    ids=lambda p: p[0],
)
def test_to_block_mask_runs_in_flex_what_cuattn_runs_and_comes_back(pattern):
    mode, options = pattern
    n = 256
    layout = cuattn.make_layout(mode, n, HEADS, blocksize=32, **options)
    block_mask = layout.to_block_mask()
    q, k, v = _qkv(n, n, seed=4)
    want = cuattn.sparse_attention(q, k, v, layout)
    got = flex.flex_attention(q, k, v, block_mask=block_mask)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    back = cuattn.Layout.from_block_mask(block_mask)
    np.testing.assert_array_equal(back.to_mask(), layout.to_mask())


def test_full_blocks_stay_full_both_ways():
    """create_block_mask marks the causal mask's blocks below the diagonal full; the layout
    keeps them full (no bitmask), and to_block_mask lists them as full again."""
    block_mask = flex.create_block_mask(
        lambda b, h, q, k: k <= q, 1, HEADS, 256, 256, BLOCK_SIZE=64
    )
    layout = cuattn.Layout.from_block_mask(block_mask)
    assert (layout.row_mask == -1).sum() == HEADS * 6  # 3 + 2 + 1 below the diagonal
    back = layout.to_block_mask()
    assert torch.equal(back.full_kv_num_blocks, block_mask.full_kv_num_blocks)
    assert torch.equal(back.kv_num_blocks, block_mask.kv_num_blocks)


def test_refusals_name_what_to_do():
    with pytest.raises(TypeError, match="BlockMask"):
        cuattn.Layout.from_block_mask(np.ones((2, 4, 4), dtype=bool))
    padded = torch.tensor([200, 120])

    def padding(b, h, q, k):
        return (k <= q) & (k < padded[b])

    per_batch = flex.create_block_mask(padding, 2, 1, 200, 200, device="cpu", BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="differs between batch elements.*varlen"):
        cuattn.Layout.from_block_mask(per_batch)
    odd = flex.create_block_mask(lambda b, h, q, k: k <= q, 1, 1, 96, 96, BLOCK_SIZE=24)
    with pytest.raises(ValueError, match="none of cuattn's block sizes"):
        cuattn.Layout.from_block_mask(odd)
    two = flex.create_block_mask(lambda b, h, q, k: k <= q, 1, 2, 64, 64, BLOCK_SIZE=32)
    with pytest.raises(ValueError, match="heads=3 does not fit"):
        cuattn.Layout.from_block_mask(two, heads=3)
    with pytest.raises(TypeError, match="cuattn.Layout"):
        from cuattn.adapters.flex import to_block_mask

        to_block_mask(two)
