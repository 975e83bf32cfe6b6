"""`all`, `local` and `fixed` build, block for block, the layouts of OpenAI's sparse_attention.

``original_blocks`` restates the original ``get_blocksparse_obj`` algorithm step by step
(start from a full square, then cut; for ``fixed`` set summary columns and the local group, then
cut the upper triangle), so the comparison does not lean on cuattn's own formulas.
"""

import numpy as np
import pytest

import cuattn


def original_blocks(n_ctx, heads, mode, blocksize, local_attn_ctx=None, num_verts=1, vertsize=1):
    nb = n_ctx // blocksize
    if mode == "fixed":
        stride = local_attn_ctx // blocksize
        chunks = np.array(list(range(stride - 1, -1, -1))).reshape(-1, vertsize)[:num_verts]
        out = []
        for h in range(heads):
            lay = np.zeros((nb, nb), bool)
            for col in chunks[h % num_verts]:
                lay[:, col::stride] = True
            for qi in range(nb):
                group = qi // stride
                lay[qi, group * stride : (group + 1) * stride] = True
                lay[qi, qi + 1 :] = False
            out.append(lay)
        return np.array(out)
    lay = np.ones((nb, nb), bool)
    extra = local_attn_ctx // blocksize if mode == "local" else None
    for qi in range(nb):
        for ki in range(nb):
            if ki > qi:
                lay[qi, ki] = False
            if extra and ki + extra < qi:
                lay[qi, ki] = False
    return np.broadcast_to(lay, (heads, nb, nb))


@pytest.mark.parametrize("n,b", [(1024, 32), (512, 16), (256, 64), (2048, 128)])
def test_all_matches_original(n, b):
    lay = cuattn.make_layout("all", n, 4, blocksize=b)
    np.testing.assert_array_equal(lay.blocks, original_blocks(n, 4, "all", b))


@pytest.mark.parametrize("n,b", [(1024, 32), (512, 16), (256, 64)])
@pytest.mark.parametrize("mult", [1, 2, 4])
def test_local_matches_original(n, b, mult):
    lay = cuattn.make_layout("local", n, 4, blocksize=b, local_attn_ctx=mult * b)
    np.testing.assert_array_equal(lay.blocks, original_blocks(n, 4, "local", b, mult * b))


@pytest.mark.parametrize(
    "n,b,lctx,num_verts,vertsize",
    [
        (1024, 32, 128, 4, 1),  # the original README's example
        (1024, 32, 128, 1, 1),
        (1024, 32, 128, 2, 2),
        (1024, 32, 256, 2, 4),
        (512, 16, 64, 4, 1),
        (512, 64, 256, 1, 2),
        (2048, 128, 512, 2, 1),
    ],
)
def test_fixed_matches_original(n, b, lctx, num_verts, vertsize):
    heads = 4
    lay = cuattn.make_layout(
        "fixed", n, heads, blocksize=b, local_attn_ctx=lctx, num_verts=num_verts, vertsize=vertsize
    )
    expect = original_blocks(n, heads, "fixed", b, lctx, num_verts, vertsize)
    np.testing.assert_array_equal(lay.blocks, expect)
