"""The paired forward (one CTA over two adjacent 64-blocks' query rows, walking the union of their
CSR rows) on the CPU interpreter: bit-identical to the one-block CTAs on layouts whose two rows
differ, and chosen only where the union adds few steps."""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest

from cuattn.backends import geometry, interp, kernels
from cuattn.backends.call import AttentionCall
from cuattn.layout.layout import ElementRule, Layout
from cuattn.layout.original import all_layout, local_layout
from tests.helpers.oracle import dense_attention, rel_err

ml_dtypes = pytest.importorskip("ml_dtypes")

BLOCK = geometry.FWD_PAIRED_BLOCK
HEAD_DIM = 32
DTYPES = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}
TOLERANCE = {"float16": 1e-2, "bfloat16": 2e-2}
HEADS, KV_HEADS, BATCH = 4, 2, 2
# five query blocks (an odd count: the last CTA has no second block), the last one ragged
N_Q = 4 * BLOCK + 17
N_K = N_Q + 40  # queries != keys: end-aligned, q_offset 40


def differing_rows_layout(rule: str) -> Layout:
    """Per head, random blocks, so the two rows of a pair differ in most entries, with a query
    block that attends nothing and, under the bitmask rule, a different mask per entry."""
    rng = np.random.default_rng(5)
    nbq, nb = -(-N_Q // BLOCK), -(-N_K // BLOCK)
    blocks = rng.random((HEADS, nbq, nb)) < 0.5
    blocks[:, :, -1] = True  # the ragged last key block in every row
    blocks[0, 1] = False  # ... but this one: its queries attend nothing
    if rule == "bitmask":

        def mask_fn(h, q, k):
            return (q * 5 + k * 3 + h) % 7 != 0

        return Layout.from_blocks(blocks, BLOCK, mask_fn, n_ctx=N_K, n_q=N_Q)
    return Layout(blocks, BLOCK, N_K, ElementRule(rule), n_q=N_Q)


@contextlib.contextmanager
def launched_configs():
    """The configs of every interpreter launch inside the block."""
    launched = []
    launch = interp.InterpBackend.launch

    def spy(self, config, **values):
        launched.append(config)
        return launch(self, config, **values)

    with mock.patch.object(interp.InterpBackend, "launch", spy):
        yield launched


def forward(q, k, v, layout, paired: bool):
    with (
        mock.patch.object(kernels, "layout_pairs_rows", lambda layout: paired),
        launched_configs() as launched,
    ):
        out, lse = interp.forward(q, k, v, AttentionCall(layout, HEAD_DIM**-0.5))
    assert [c.paired for c in launched if c.kernel == "attn_fwd"] == [paired]
    return out, lse


@pytest.mark.parametrize("rule", ["none", "causal", "bitmask"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_paired_forward_is_the_one_block_forward_bit_for_bit(dtype, rule):
    rng = np.random.default_rng(11)
    q = rng.standard_normal((BATCH, HEADS, N_Q, HEAD_DIM)).astype(DTYPES[dtype])
    k, v = (
        rng.standard_normal((BATCH, KV_HEADS, N_K, HEAD_DIM)).astype(DTYPES[dtype])
        for _ in range(2)
    )
    layout = differing_rows_layout(rule)
    out, lse = forward(q, k, v, layout, paired=True)
    single_out, single_lse = forward(q, k, v, layout, paired=False)
    # each warp meets its own row's tiles in the same order either way
    np.testing.assert_array_equal(out.view(np.uint16), single_out.view(np.uint16))
    np.testing.assert_array_equal(lse, single_lse)

    group = HEADS // KV_HEADS
    kk, vv = (np.repeat(x.astype(np.float64), group, axis=1) for x in (k, v))
    mask = layout.to_mask()
    ref_out, ref_lse = dense_attention(q.astype(np.float64), kk, vv, mask, HEAD_DIM**-0.5)
    empty = ~mask.any(axis=-1)[None].repeat(BATCH, axis=0)
    assert empty.any() and (out.astype(np.float32)[empty] == 0).all()
    assert np.isneginf(lse[empty]).all()
    assert rel_err(out, ref_out) <= TOLERANCE[dtype]
    assert rel_err(lse[~empty], ref_lse[~empty]) <= TOLERANCE[dtype]


def test_pairs_are_chosen_where_the_union_adds_few_steps():
    assert kernels.layout_pairs_rows(all_layout(8192, 2, BLOCK, causal=True))
    assert kernels.layout_pairs_rows(all_layout(1024, 2, BLOCK, causal=True))  # 6 % more steps
    assert kernels.layout_pairs_rows(local_layout(4096, 2, BLOCK, 1024, causal=True))  # 6 %
    assert not kernels.layout_pairs_rows(local_layout(4096, 2, BLOCK, 256, causal=True))  # 20 %
    assert not kernels.layout_pairs_rows(all_layout(2 * BLOCK, 2, BLOCK, causal=True))  # 33 %
    assert not kernels.layout_pairs_rows(all_layout(BLOCK, 2, BLOCK, causal=False))  # one block
    # even query blocks see even key blocks, odd ones odd: the union doubles the steps
    nb = 32
    parity = np.add.outer(np.arange(nb), np.arange(nb)) % 2 == 0
    alternating = Layout(np.broadcast_to(parity, (2, nb, nb)).copy(), BLOCK)
    assert not kernels.layout_pairs_rows(alternating)


@pytest.mark.parametrize("n, paired", [(1024, True), (200, False)])
def test_a_long_causal_call_runs_paired_and_a_short_one_does_not(n, paired):
    """Through the public call: FlashAttention's causal keyword on 64-blocks pairs at 1024
    tokens (6 % more steps) and not at 200 (the last block alone)."""
    import cuattn

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((1, 2, n, HEAD_DIM)).astype(ml_dtypes.bfloat16) for _ in "qkv")
    with launched_configs() as launched:
        out = cuattn.sparse_attention(q, k, v, causal=True, backend="interp")
    assert [c.paired for c in launched if c.kernel == "attn_fwd"] == [paired]
    mask = np.broadcast_to(np.tri(n, dtype=bool), (2, n, n))
    ref, _ = dense_attention(*(x.astype(np.float64) for x in (q, k, v)), mask, HEAD_DIM**-0.5)
    assert rel_err(out, ref) <= TOLERANCE["bfloat16"]
