"""Every named pattern's element mask equals its rule written straight from docs/design.md §2."""

import numpy as np
import pytest
import torch

import cuattn
from cuattn.backends.geometry import BLOCK_SIZES
from cuattn.layout import extended
from cuattn.layout.dynamic import host_vertical_slash_layout
from tests.helpers.kernel_cases import PATTERNS as SWEEP_PATTERNS
from tests.helpers.kernel_cases import pattern_id, sweep_layout
from tests.helpers.oracle import (
    rule_all,
    rule_blocks,
    rule_fixed,
    rule_local,
    rule_longformer,
    rule_strided,
)

SIZES = [(128, 16), (96, 32), (100, 16), (64, 64)]


@pytest.mark.parametrize("n,b", SIZES)
@pytest.mark.parametrize("causal", [True, False])
def test_all(n, b, causal):
    lay = cuattn.make_layout("all", n, 2, blocksize=b, causal=causal)
    np.testing.assert_array_equal(lay.to_mask(), rule_all(n, 2, causal))


@pytest.mark.parametrize("n,b", SIZES)
@pytest.mark.parametrize("w", [1, 16, 23, 64])
@pytest.mark.parametrize("causal", [True, False])
def test_local(n, b, w, causal):
    lay = cuattn.make_layout("local", n, 2, blocksize=b, local_attn_ctx=w, causal=causal)
    np.testing.assert_array_equal(lay.to_mask(), rule_local(n, 2, w, causal))


@pytest.mark.parametrize("n,b", SIZES)
@pytest.mark.parametrize("s", [1, 4, 8, 17])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("transpose", [None, False])
def test_strided(n, b, s, causal, transpose):
    lay = cuattn.make_layout(
        "strided", n, 2, blocksize=b, local_attn_ctx=s, causal=causal, transpose=transpose
    )
    np.testing.assert_array_equal(lay.to_mask(), rule_strided(n, 2, s, causal))


def test_strided_uses_transposed_order_when_lengths_allow():
    lay = cuattn.make_layout("strided", 256, 1, blocksize=16, local_attn_ctx=8)
    assert lay.perm is not None
    # 8 residue runs of 32 tokens = 2 blocks each: block-diagonal causal, 3 blocks per run.
    assert lay.nnz[0] == 8 * 3
    natural = cuattn.make_layout("strided", 256, 1, blocksize=16, local_attn_ctx=8, transpose=False)
    assert natural.perm is None and natural.nnz[0] > lay.nnz[0]


def test_strided_transpose_true_needs_divisible_lengths():
    with pytest.raises(ValueError, match="transpose=True"):
        cuattn.make_layout("strided", 100, 1, blocksize=16, local_attn_ctx=8, transpose=True)


@pytest.mark.parametrize("n,b,lctx", [(256, 16, 64), (256, 32, 128), (200, 16, 64), (128, 16, 16)])
@pytest.mark.parametrize("num_verts,vertsize", [(1, 1), (2, 1), (4, 1), (2, 2), (1, 4)])
@pytest.mark.parametrize("causal", [True, False])
def test_fixed(n, b, lctx, num_verts, vertsize, causal):
    g = lctx // b
    if num_verts * vertsize > g or g % vertsize:
        pytest.skip("not a valid fixed configuration")
    lay = cuattn.make_layout(
        "fixed",
        n,
        4,
        blocksize=b,
        local_attn_ctx=lctx,
        num_verts=num_verts,
        vertsize=vertsize,
        causal=causal,
    )
    np.testing.assert_array_equal(
        lay.to_mask(), rule_fixed(n, 4, b, lctx, num_verts, vertsize, causal)
    )


@pytest.mark.parametrize("n,b", SIZES)
@pytest.mark.parametrize("glob", [(0,), (5, 40), ()])
@pytest.mark.parametrize("causal", [True, False])
def test_longformer(n, b, glob, causal):
    lay = cuattn.make_layout(
        "longformer", n, 2, blocksize=b, local_attn_ctx=9, global_tokens=glob, causal=causal
    )
    np.testing.assert_array_equal(lay.to_mask(), rule_longformer(n, 2, 9, glob, causal))


@pytest.mark.parametrize("causal", [True, False])
def test_bigbird(causal):
    n, b = 256, 16
    lay = cuattn.make_layout("bigbird", n, 3, blocksize=b, causal=causal, num_random_blocks=2)
    np.testing.assert_array_equal(lay.to_mask(), rule_blocks(lay.blocks, b, n, causal))
    nb = n // b
    idx = np.arange(nb)
    window = np.abs(idx[:, None] - idx[None, :]) <= 1
    for h in range(3):
        blk = lay.blocks[h]
        expect_base = window.copy()
        expect_base[0, :] = expect_base[:, 0] = True
        if causal:
            expect_base &= np.tril(np.ones((nb, nb), bool))
        assert (blk >= expect_base).all(), "window and global blocks are always on"
        extra = blk & ~expect_base
        free = (~expect_base) & (np.tril(np.ones((nb, nb), bool)) if causal else True)
        assert (extra.sum(axis=1) == np.minimum(2, free.sum(axis=1))).all()
    assert not np.array_equal(lay.blocks[0], lay.blocks[1]), "random blocks differ per head"
    same = cuattn.make_layout("bigbird", n, 3, blocksize=b, causal=causal, num_random_blocks=2)
    np.testing.assert_array_equal(same.blocks, lay.blocks)
    other = extended.bigbird_layout(n, 3, b, causal=causal, num_random_blocks=2, seed=7)
    assert not np.array_equal(other.blocks, lay.blocks), "seed changes the random blocks"


@pytest.mark.parametrize("causal", [True, False])
def test_variable(causal):
    n, b = 256, 16
    lay = cuattn.make_layout(
        "variable",
        n,
        1,
        blocksize=b,
        causal=causal,
        local_window_blocks=[2, 3],
        global_block_indices=[0, 7],
        global_block_end_indices=[1, 9],
    )
    np.testing.assert_array_equal(lay.to_mask(), rule_blocks(lay.blocks, b, n, causal))
    nb = n // b
    window = np.array([0, 0, 1, 1, 1] + [2 + (i // 3) for i in range(nb - 5)])
    expect = window[:, None] == window[None, :]
    expect[:, 0] = True
    expect[:, 7:9] = True
    if causal:
        expect &= np.tril(np.ones((nb, nb), bool))
    np.testing.assert_array_equal(lay.blocks[0], expect)


def test_variable_horizontal_global():
    lay = cuattn.make_layout(
        "variable",
        128,
        1,
        blocksize=16,
        causal=False,
        horizontal_global_attention=True,
        global_block_indices=[3],
    )
    assert lay.blocks[0, 3].all() and lay.blocks[0, :, 3].all()


def test_layouts_are_cached_by_arguments():
    a = cuattn.make_layout("local", 128, 2, blocksize=16, local_attn_ctx=32)
    b = cuattn.make_layout("local", 128, 2, blocksize=16, local_attn_ctx=32)
    c = cuattn.make_layout("local", 128, 2, blocksize=16, local_attn_ctx=48)
    assert a is b and a is not c


def test_repr_draws_a_picture_per_head():
    lay = cuattn.make_layout("fixed", 256, 4, blocksize=32, local_attn_ctx=128, num_verts=4)
    text = repr(lay)
    assert text.count("head ") == 4
    assert "█" in text and "░" in text and "·" in text
    assert "density=" in text


def test_picture_draws_only_the_chosen_heads():
    lay = cuattn.make_layout("fixed", 256, 4, blocksize=32, local_attn_ctx=128, num_verts=4)
    full = lay.picture().split("head ")
    text = lay.picture(heads=[2])
    assert text.count("head ") == 1 and text == ("head " + full[3]).rstrip("\n")
    with pytest.raises(ValueError, match="heads: head 4 out of range; the layout has 4"):
        lay.picture(heads=[4])
    with pytest.raises(TypeError, match="heads: expected head indices"):
        lay.picture(heads=["0"])


def test_picture_groups_blocks_when_wide():
    lay = cuattn.make_layout("all", 4096, 1, blocksize=16)
    rows = lay.picture(max_width=64).splitlines()
    assert len(rows) == 1 + 64 and all(len(r) == 64 for r in rows[1:])


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("n", [128, 100])
def test_vertical_slash_picks_planted_columns_and_diagonals(causal, n):
    rng = np.random.default_rng(0)
    heads, d = 2, 16
    q = rng.standard_normal((heads, n, d)) * 0.1
    k = rng.standard_normal((heads, n, d)) * 0.1
    # head 0: key 5 is loud for every query (a vertical line)
    k[0, 5] = 4.0 * q[0, -16:].mean(axis=0) / np.linalg.norm(q[0, -16:].mean(axis=0)) ** 2
    lay = cuattn.vertical_slash_layout(
        q, k, blocksize=16, num_vertical=4, num_slash=3, last_q=16, causal=causal
    )
    mask = lay.to_mask()
    assert mask[0, n - 1, 5] and mask[0, n - 40, 5], "the planted column is kept"
    assert all(mask[h, i, i] for h in range(heads) for i in range(n)), "main diagonal kept"
    qi, ki = np.arange(n)[:, None], np.arange(n)[None, :]
    for h in range(heads):
        cols = np.flatnonzero(mask[h].sum(axis=0) >= (n // 2 if causal else n) - 1)
        assert len(cols) <= 4 + 3
        if causal:
            assert not mask[h][ki > qi].any()
    assert lay.nnz.max() < lay.num_blocks**2
    # the element rule, evaluated directly, equals the layout's mask
    out = cuattn.sparse_attention(q[None], k[None], k[None], lay)
    assert np.isfinite(out).all()


def test_vertical_slash_rejects_device_or_bad_shapes():
    with pytest.raises(TypeError, match="q must be a NumPy, CuPy, torch or jax array"):
        cuattn.vertical_slash_layout([[1.0]], np.ones((1, 4, 2)))
    with pytest.raises(TypeError, match="q must be a NumPy array"):
        host_vertical_slash_layout(torch.ones(1, 4, 2), np.ones((1, 4, 2)))
    with pytest.raises(ValueError, match=r"q must be \[heads, n, d\]"):
        cuattn.vertical_slash_layout(np.ones((4, 2)), np.ones((4, 2)))


@pytest.mark.parametrize("blocksize", BLOCK_SIZES)
@pytest.mark.parametrize("pattern", SWEEP_PATTERNS, ids=pattern_id)
def test_every_gpu_sweep_layout_builds_at_every_block_size(pattern, blocksize):
    # The GPU sweep once asked `fixed` for one block per group at b = 128 and only a GPU run
    # found out; every (pattern, block size) it runs is built here first.
    layout = sweep_layout(pattern, blocksize)
    assert layout.blocksize == blocksize and int(layout.nnz.sum()) > 0


def test_a_new_pattern_is_one_registered_constructor(monkeypatch):
    from cuattn.layout import registry

    monkeypatch.setattr(registry, "_PATTERNS", dict(registry._PATTERNS))

    @registry.register("every_other")
    def every_other_layout(n_ctx, heads, blocksize, causal=True, offset=0):
        """allowed(h, q, k) = (k - offset) % 2 == 0 (and k <= q if causal)."""
        nb = -(-n_ctx // blocksize)
        return cuattn.Layout.from_blocks(
            np.ones((heads, nb, nb), bool),
            blocksize,
            mask_fn=lambda h, q, k: ((k - offset) % 2 == 0) & ((k <= q) | (not causal)),
            n_ctx=n_ctx,
        )

    assert "every_other" in registry.modes()
    lay = cuattn.make_layout("every_other", 64, 2, blocksize=16, offset=1)
    want = np.tril(np.ones((64, 64), bool)) & ((np.arange(64)[None, :] - 1) % 2 == 0)
    np.testing.assert_array_equal(lay.to_mask()[0], want)
    with pytest.raises(TypeError, match="accepted pattern arguments: offset"):
        cuattn.make_layout("every_other", 64, 2, blocksize=16, stride=3)
    with pytest.raises(ValueError, match="registered already"):
        registry.register("local")(every_other_layout)
