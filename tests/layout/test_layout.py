"""Layout invariants: CSR/CSC agree with the block array, bitmasks agree with the rule."""

import numpy as np
import pytest

import cuattn
from cuattn.layout.layout import FULL_BLOCK


def _csr_blocks(lay):
    out = np.zeros_like(lay.blocks)
    for h in range(lay.heads):
        for i in range(lay.num_blocks):
            for e in range(lay.row_ptr[h, i], lay.row_ptr[h, i + 1]):
                out[h, i, lay.col_idx[e]] = True
    return out


def _csc_blocks(lay):
    out = np.zeros_like(lay.blocks)
    for h in range(lay.heads):
        for j in range(lay.num_blocks):
            for e in range(lay.col_ptr[h, j], lay.col_ptr[h, j + 1]):
                out[h, lay.row_idx[e], j] = True
    return out


LAYOUTS = [
    ("fixed", dict(local_attn_ctx=64, num_verts=2)),
    ("strided", dict(local_attn_ctx=6)),
    ("local", dict(local_attn_ctx=20)),
    ("longformer", dict(local_attn_ctx=8, global_tokens=(1,))),
]


@pytest.mark.parametrize("mode,kw", LAYOUTS)
def test_index_arrays_match_blocks(mode, kw):
    lay = cuattn.make_layout(mode, 136, 2, blocksize=16, **kw)
    for arr in (lay.row_ptr, lay.col_idx, lay.row_mask, lay.col_ptr, lay.row_idx, lay.col_mask):
        assert arr.dtype == np.int32 and not arr.flags.writeable
    np.testing.assert_array_equal(_csr_blocks(lay), lay.blocks)
    np.testing.assert_array_equal(_csc_blocks(lay), lay.blocks)
    assert lay.nnz.sum() == len(lay.col_idx) == len(lay.row_idx)
    assert lay.density == pytest.approx(lay.blocks.mean())
    # the same block carries the same mask id in both orders
    csr = {}
    for h in range(lay.heads):
        for i in range(lay.num_blocks):
            for e in range(lay.row_ptr[h, i], lay.row_ptr[h, i + 1]):
                csr[h, i, lay.col_idx[e]] = lay.row_mask[e]
        for j in range(lay.num_blocks):
            for e in range(lay.col_ptr[h, j], lay.col_ptr[h, j + 1]):
                assert csr[h, lay.row_idx[e], j] == lay.col_mask[e]


@pytest.mark.parametrize("mode,kw", LAYOUTS)
def test_full_flag_means_every_element_allowed(mode, kw):
    lay = cuattn.make_layout(mode, 136, 2, blocksize=16, **kw)
    for h in range(lay.heads):
        lo, hi = lay.row_ptr[h, 0], lay.row_ptr[h, -1]
        rows = np.repeat(np.arange(lay.num_blocks), np.diff(lay.row_ptr[h]))
        masks = lay.block_masks(
            np.full(len(rows), h), rows, lay.col_idx[lo:hi], lay.row_mask[lo:hi]
        )
        full = lay.row_mask[lo:hi] == FULL_BLOCK
        assert masks[full].all()
        ragged_or_partial = ~masks.all(axis=(1, 2))
        assert not (full & ragged_or_partial).any()
        # blocks touching keys past n_ctx always need the bound
        assert not (full & ((lay.col_idx[lo:hi] + 1) * 16 > lay.n_ctx)).any()


def test_bitmask_table_is_deduplicated():
    lay = cuattn.make_layout("strided", 512, 1, blocksize=16, local_attn_ctx=8, transpose=False)
    # With s dividing b every partial block has one of two masks: the diagonal one and the rest.
    assert len(lay.mask_table) == 2
    assert lay.mask_table.dtype == np.uint32 and lay.mask_table.shape[1:] == (16, 1)


def test_from_blocks_with_mask_fn():
    blocks = np.tril(np.ones((2, 4, 4), bool))
    blocks[1, 3, 0] = False

    def rule(h, q, k):
        return (k <= q) & ((q + k + h) % 3 != 0)

    lay = cuattn.Layout.from_blocks(blocks, 8, mask_fn=rule)
    q = np.arange(32)[:, None]
    k = np.arange(32)[None, :]
    for h in range(2):
        expect = blocks[h][q // 8, k // 8] & rule(h, q, k)
        np.testing.assert_array_equal(lay.to_mask()[h], expect)


def test_from_blocks_without_rule_and_2d_blocks():
    lay = cuattn.Layout.from_blocks(np.eye(3, dtype=int), 16, n_ctx=40)
    assert lay.heads == 1 and lay.n_ctx == 40
    mask = lay.to_mask()[0]
    assert mask[:16, :16].all() and not mask[:16, 16:].any() and mask[32:40, 32:40].all()


def test_permuted_mask_is_in_natural_order():
    lay = cuattn.make_layout("strided", 64, 1, blocksize=4, local_attn_ctx=4)
    assert lay.perm is not None
    mask = lay.to_mask()[0]
    assert mask[8, 0] and mask[8, 4] and not mask[8, 1] and not mask[0, 8]


@pytest.mark.parametrize(
    "mode,kwargs",
    [
        ("strided", {"local_attn_ctx": 8}),  # transposed: permuted
        ("strided", {"local_attn_ctx": 4, "causal": False}),
        ("local", {"local_attn_ctx": 20}),  # natural order already
    ],
)
def test_picture_is_in_natural_order_and_says_when_computed_permuted(mode, kwargs):
    """`cuattn show strided` once drew the computed order (a plain diagonal) as if it were the
    user's; the picture's blocks must be those of the natural element mask."""
    b, n = 16, 256
    lay = cuattn.make_layout(mode, n, 2, blocksize=b, **kwargs)
    nb = n // b
    blocks = lay.to_mask().reshape(2, nb, b, nb, b)
    active, full = (
        lay._natural_blocks() if lay.perm is not None else (lay.blocks, lay._full_blocks())
    )
    np.testing.assert_array_equal(active, blocks.any(axis=(2, 4)))
    np.testing.assert_array_equal(full, blocks.all(axis=(2, 4)))
    text = lay.picture()
    assert ("natural token order" in text) == (lay.perm is not None)
    if lay.perm is not None:
        assert lay.picture(natural=False).startswith("computed (permuted) order")
        assert text != lay.picture(natural=False)
