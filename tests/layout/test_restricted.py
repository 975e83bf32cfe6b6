"""derived.restricted: chosen query rows against chosen keys keep the layout's elements exactly."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn.layout.derived import restricted

HEADS, BLOCK, N = 2, 16, 128
PATTERNS = {
    "all": {},
    "local": {"local_attn_ctx": 24},
    "strided": {"local_attn_ctx": 8},  # a permuted layout: restricted works in natural order
    "fixed": {"local_attn_ctx": 32, "num_verts": 1, "vertsize": 1},
    "bigbird": {"local_attn_ctx": 16},
}
# Query and key sets: aligned chunks, unaligned ones (blocks straddle), scattered tokens.
SELECTIONS = {
    "zigzag": (np.r_[16:32, 96:112], np.r_[0:16, 112:128]),
    "unaligned": (np.r_[5:45], np.r_[30:101]),
    "scattered": (np.arange(3, N, 7), np.arange(0, N, 5)),
}


@pytest.mark.parametrize("selection", sorted(SELECTIONS))
@pytest.mark.parametrize("mode", sorted(PATTERNS))
def test_restricted_elements_equal_the_sliced_mask(mode, selection):
    layout = cuattn.make_layout(mode, N, HEADS, BLOCK, **PATTERNS[mode])
    qpos, kpos = SELECTIONS[selection]
    sub = restricted(layout, qpos, kpos)
    assert (sub.n_q, sub.n_ctx) == (len(qpos), len(kpos))
    assert np.array_equal(sub.to_mask(), layout.to_mask()[:, qpos][:, :, kpos])
    # No block is kept that holds nothing.
    full = sub.to_mask()
    for h, i, j in zip(*np.nonzero(sub.blocks), strict=True):
        assert full[h, i * BLOCK : (i + 1) * BLOCK, j * BLOCK : (j + 1) * BLOCK].any()


def test_a_pair_with_nothing_is_empty_and_bad_positions_are_refused():
    local = cuattn.make_layout("local", N, HEADS, BLOCK, local_attn_ctx=8)
    assert restricted(local, np.arange(0, 16), np.arange(64, 80)).nnz.sum() == 0
    with pytest.raises(
        ValueError, match=r"k_positions must be a non-empty set of indices in \[0, 128\)"
    ):
        restricted(local, np.arange(4), np.array([128]))
