"""The persistent sm_90a forward at d = 256 (attn_fwd_sm90_persistent<..., 256, ...>, issue 53)
through the CPU interpreter against the float64 dense oracle and bit-equal to attn_fwd_sm90.

At d = 256 a CTA holds one Q tile (two of 64 KB do not fit beside the K/V rings' 128 KB), so
the producer copies an item's Q once both consumers' O rows of the item before are read out of
it: one CTA running every item reuses that tile (and its barriers' phases) item after item.
Split rows merge through attn_fwd_sm90_merge<256, ...>. Kept few: d = 256 is slow on the
interpreter.
"""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import geometry, interp
from cuattn.layout.registry import make_layout
from tests.backends.test_attn_fwd_sm90 import (
    CXX_TYPES,
    case_inputs,
    expression,
    random_inputs,
    traits,
)
from tests.backends.test_attn_fwd_sm90_persistent import (
    RAGGED_ROWS,
    check_against_both,
    check_split,
    merge_expression,
    persistent_expression,
    persistent_traits,
)

pytest.importorskip("ml_dtypes")

SOURCE = "attn_fwd_sm90.cu"
HEAD_DIM = 256
# (block, key tile, head dim, dtype, rule): 64-key tiles at both block sizes
CAUSAL_64 = (64, 64, HEAD_DIM, "bfloat16", "causal")
NONE_128 = (128, 64, HEAD_DIM, "float16", "none")


@pytest.fixture(scope="module")
def lib() -> interp.Library:
    configs = [CAUSAL_64, NONE_128]
    merges = sorted({c[2:4] for c in configs})
    expressions = [persistent_expression(*c) for c in configs] + [expression(*c) for c in configs]
    expressions += [merge_expression(*m) for m in merges]
    kernel_traits = [persistent_traits(*c[:4]) for c in configs] + [traits(*c[:4]) for c in configs]
    kernel_traits += [f"row_kernel_traits<{d}, {CXX_TYPES[t]}>" for d, t in merges]
    return interp.build_library(SOURCE, expressions, kernel_traits)


def test_one_q_tile_at_d256():
    wide = geometry.KernelConfig(
        geometry.SM90_FWD_PERSISTENT, HEAD_DIM, "bfloat16", n_rows=132, block=64, rule="causal"
    )
    base = geometry.KernelConfig(geometry.SM90_FWD, HEAD_DIM, "bfloat16", block=64, rule="causal")
    assert geometry.sm90_persistent_q_buffers(HEAD_DIM) == 1
    assert wide.smem_bytes == base.smem_bytes + geometry.sm90_persistent_smem_bytes(1)
    assert wide.smem_bytes <= geometry.SM90_SMEM_LIMIT


def test_one_cta_runs_every_item_through_one_q_tile(lib):
    """Paired 64-blocks, causal, two batches: one CTA takes all 6 items (the Q tile's q_full and
    q_empty phases wrap), then more CTAs than items: the same bits."""
    layout = make_layout("all", 2 * 128 + RAGGED_ROWS, 3, 64, causal=True)
    q, k, v = random_inputs(layout, 2, layout.heads, HEAD_DIM, "bfloat16", 3)
    one, _ = check_against_both(lib, CAUSAL_64, layout, q, k, v, ctas=1)
    many, _ = check_against_both(lib, CAUSAL_64, layout, q, k, v, ctas=8)
    np.testing.assert_array_equal(one.view(np.uint16), many.view(np.uint16))


def test_a_long_walk_at_128_blocks(lib):
    layout, q, k, v = case_inputs("none", 128, "long walk", HEAD_DIM, "float16", 4)
    check_against_both(lib, NONE_128, layout, q, k, v, ctas=2)


def test_split_rows_merge_at_d256(lib):
    layout, q, k, v = case_inputs("none", 128, "long walk", HEAD_DIM, "float16", 5)
    check_split(lib, NONE_128, layout, q, k, v, ctas=2)
