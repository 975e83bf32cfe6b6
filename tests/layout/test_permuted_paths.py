"""Layouts computed in a permuted token order (strided, transposed) on every path that derives a
layout from them: packed variable-length batches (square and not), the natural-order block cover,
context-parallel shards and the Hugging Face adapter's patterns. Each is checked element by
element against the rules of docs/design.md §2 (tests/helpers/oracle.py) and against the same
layout run on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn.distributed.sharding import positions
from cuattn.layout.derived import natural_cover, packed, restricted
from cuattn.layout.layout import ElementRule
from tests.helpers.oracle import (
    dense_attention,
    dense_attention_grads,
    rel_err,
    rule_all,
    rule_local,
    rule_strided,
)

HEADS, BLOCK = 2, 16
F64_TOLERANCE = 1e-10
INTERP_TOLERANCE = 1e-5  # float32 through the kernel interpreter

# (mode, options, the square element rule for n tokens from tests/helpers/oracle.py)
STRIDED_4 = ("strided", {"local_attn_ctx": 4}, lambda n: rule_strided(n, HEADS, 4))
STRIDED_3 = ("strided", {"local_attn_ctx": 3}, lambda n: rule_strided(n, HEADS, 3))
LOCAL_10 = ("local", {"local_attn_ctx": 10}, lambda n: rule_local(n, HEADS, 10))
ALL = ("all", {}, lambda n: rule_all(n, HEADS))
ALL_BIDIRECTIONAL = ("all", {"causal": False}, lambda n: rule_all(n, HEADS, causal=False))

# name -> ([(n_q, n_k, pattern)], blocksize, which sequences are permuted). strided is permuted
# when n % s == 0 and (n / s) % blocksize == 0; 50 is no multiple of 4, so natural order.
PACKINGS = {
    "strided_alone": ([(64, 64, STRIDED_4)], BLOCK, [True]),
    "strided_alone_block8": (
        [(64, 64, ("strided", {"local_attn_ctx": 8}, lambda n: rule_strided(n, HEADS, 8)))],
        8,
        [True],
    ),
    "self_attention_mixed": (
        [
            (64, 64, STRIDED_4),
            (37, 37, LOCAL_10),
            (48, 48, STRIDED_3),
            (50, 50, STRIDED_4),
            (20, 20, ALL_BIDIRECTIONAL),
        ],
        BLOCK,
        [True, False, True, False, False],
    ),
    "queries_differ_from_keys": (
        [(17, 40, LOCAL_10), (64, 64, STRIDED_4), (5, 33, ALL), (50, 50, STRIDED_4)],
        BLOCK,
        [False, True, False, False],
    ),
}
NATURAL = {"strided": {"transpose": False}}  # options that build a pattern in natural order
# The kernel interpreter is slow: small packings only.
INTERP_PACKINGS = {
    "strided_alone": PACKINGS["strided_alone"],
    "strided_alone_block8": PACKINGS["strided_alone_block8"],
    "self_attention_mixed": ([(64, 64, STRIDED_4), (21, 21, LOCAL_10)], BLOCK, [True, False]),
    "queries_differ_from_keys": ([(9, 30, ALL), (64, 64, STRIDED_4)], BLOCK, [False, True]),
}


def _build(case):
    """(layouts, cu_q, cu_k, oracle masks) of a packing; asserts which layouts are permuted."""
    sequences, blocksize, permuted = case
    layouts, masks = [], []
    for n_q, n_k, (mode, options, rule) in sequences:
        layouts.append(cuattn.make_layout(mode, n_k, HEADS, blocksize, n_q=n_q, **options))
        masks.append(np.ascontiguousarray(rule(n_k)[:, n_k - n_q :]))  # the last n_q rows
    assert [lay.perm is not None for lay in layouts] == permuted
    cu_q = np.concatenate([[0], np.cumsum([s[0] for s in sequences])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([s[1] for s in sequences])]).astype(np.int64)
    return layouts, cu_q, cu_k, masks


def _inputs(cu_q, cu_k, kv_heads, head_dim, dtype, seed):
    rng = np.random.default_rng(seed)
    q, dout = (rng.standard_normal((cu_q[-1], HEADS, head_dim)).astype(dtype) for _ in "qo")
    k, v = (rng.standard_normal((cu_k[-1], kv_heads, head_dim)).astype(dtype) for _ in "kv")
    return q, k, v, dout


def _sequence(x, cu, s):
    """Sequence s of a packed [total, heads, d] array as [1, heads, n, d]."""
    return x[cu[s] : cu[s + 1]].transpose(1, 0, 2)[None]


def _oracle(q, k, v, dout, cu_q, cu_k, masks):
    """Packed (out, lse, dq, dk, dv) from the float64 dense oracle, one sequence at a time."""
    parts = []
    for s, mask in enumerate(masks):
        qs, ks, vs, ds = (
            _sequence(x, c, s) for x, c in ((q, cu_q), (k, cu_k), (v, cu_k), (dout, cu_q))
        )
        scale = qs.shape[-1] ** -0.5
        out, lse = dense_attention(qs, ks, vs, mask, scale)
        parts.append((out, lse, *dense_attention_grads(qs, ks, vs, ds, mask, scale)))
    out, lse, dq, dk, dv = zip(*parts, strict=True)
    tokens = [np.concatenate([x[0].transpose(1, 0, 2) for x in xs]) for xs in (out, dq, dk, dv)]
    return tokens[0], np.concatenate([x[0] for x in lse], axis=1), *tokens[1:]


@pytest.mark.parametrize("name", sorted(PACKINGS))
def test_packed_layout_allows_exactly_each_sequences_rule(name):
    layouts, cu_q, cu_k, masks = _build(PACKINGS[name])
    lay = packed(layouts, cu_q, cu_k)
    expected = np.zeros((HEADS, cu_q[-1], cu_k[-1]), dtype=bool)
    for s, mask in enumerate(masks):
        expected[:, cu_q[s] : cu_q[s + 1], cu_k[s] : cu_k[s + 1]] = mask
    np.testing.assert_array_equal(lay.to_mask(), expected)


def test_self_attention_packing_keeps_the_permutation_and_its_sparsity():
    """With cu_seqlens_q == cu_seqlens_k the packed layout runs each sequence in its own computed
    order: a strided sequence stays block-diagonal instead of becoming causal-dense."""
    layouts, cu_q, cu_k, _ = _build(PACKINGS["self_attention_mixed"])
    lay = packed(layouts, cu_q, cu_k)
    assert lay.perm is not None
    for s, sub in enumerate(layouts):
        own = lay.perm[cu_q[s] : cu_q[s + 1]] - cu_q[s]
        expected = np.arange(sub.n_ctx) if sub.perm is None else sub.perm
        np.testing.assert_array_equal(own, expected)
    # The same packing of the same rules built in natural order needs more blocks.
    twins = [
        cuattn.make_layout(mode, n, HEADS, BLOCK, **options, **NATURAL.get(mode, {}))
        for n, _, (mode, options, _) in PACKINGS["self_attention_mixed"][0]
    ]
    assert lay.nnz.sum() < packed(twins, cu_q, cu_k).nnz.sum()
    non_square = packed(*_build(PACKINGS["queries_differ_from_keys"])[:3])
    assert non_square.perm is None


@pytest.mark.parametrize("name", sorted(PACKINGS))
def test_varlen_forward_and_gradients_on_numpy(name):
    layouts, cu_q, cu_k, masks = _build(PACKINGS[name])
    kv_heads = 1 if name == "queries_differ_from_keys" else HEADS
    q, k, v, dout = _inputs(cu_q, cu_k, kv_heads, 16, np.float64, seed=len(name))
    want_out, want_lse, *want_grads = _oracle(q, k, v, dout, cu_q, cu_k, masks)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out, lse = cuattn.sparse_attention_varlen(
        tq, tk, tv, torch.tensor(cu_q), torch.tensor(cu_k), layouts, return_lse=True
    )
    (out * torch.tensor(dout)).sum().backward()
    assert rel_err(out.detach().numpy(), want_out) <= F64_TOLERANCE
    np.testing.assert_array_equal(np.isneginf(lse.detach().numpy()), np.isneginf(want_lse))
    finite = np.isfinite(want_lse)
    assert rel_err(lse.detach().numpy()[finite], want_lse[finite]) <= F64_TOLERANCE
    for tensor, want in zip((tq, tk, tv), want_grads, strict=True):
        assert rel_err(tensor.grad.numpy(), want) <= F64_TOLERANCE

    # The same layouts, one sequence at a time through sparse_attention.
    for s, sub in enumerate(layouts):
        parts = [
            torch.tensor(_sequence(x, c, s), requires_grad=True)
            for x, c in ((q, cu_q), (k, cu_k), (v, cu_k))
        ]
        alone = cuattn.sparse_attention(*parts, sub)
        (alone * torch.tensor(_sequence(dout, cu_q, s))).sum().backward()
        rows = slice(cu_q[s], cu_q[s + 1])
        got = out.detach()[rows].numpy().transpose(1, 0, 2)[None]
        assert rel_err(got, alone.detach().numpy()) <= F64_TOLERANCE
        for tensor, part, cu in zip((tq, tk, tv), parts, (cu_q, cu_k, cu_k), strict=True):
            got = _sequence(tensor.grad.numpy(), cu, s)
            assert rel_err(got, part.grad.numpy()) <= F64_TOLERANCE


@pytest.mark.parametrize("name", sorted(INTERP_PACKINGS))
def test_varlen_forward_and_gradients_on_the_kernel_interpreter(name):
    layouts, cu_q, cu_k, masks = _build(INTERP_PACKINGS[name])
    q, k, v, dout = _inputs(cu_q, cu_k, HEADS, 32, np.float32, seed=len(name))
    want_out, _, *want_grads = _oracle(q, k, v, dout, cu_q, cu_k, masks)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    out = cuattn.sparse_attention_varlen(
        tq, tk, tv, torch.tensor(cu_q), torch.tensor(cu_k), layouts, backend="interp"
    )
    (out * torch.tensor(dout)).sum().backward()
    assert rel_err(out.detach().numpy(), want_out) <= INTERP_TOLERANCE
    for tensor, want in zip((tq, tk, tv), want_grads, strict=True):
        assert rel_err(tensor.grad.numpy(), want) <= 2 * INTERP_TOLERANCE


def _exact_natural_blocks(layout):
    """Natural-order blocks holding an allowed element, from the element mask (small n)."""
    b, nb = layout.blocksize, layout.num_blocks
    mask = np.zeros((layout.heads, nb * b, nb * b), dtype=bool)
    mask[:, : layout.n_ctx, : layout.n_ctx] = layout.to_mask()
    return mask.reshape(layout.heads, nb, b, nb, b).any(axis=(2, 4))


def _random_permuted_layout(seed):
    rng = np.random.default_rng(seed)
    n, b = 90, 16
    nb = -(-n // b)
    blocks = rng.random((HEADS, nb, nb)) < 0.3
    rule = ElementRule("bitmask", mask_fn=lambda h, q, k: (q * 7 + k + h) % 5 > 1)
    return cuattn.Layout(blocks, b, n, rule, perm=rng.permutation(n))


@pytest.mark.parametrize(
    "layout",
    [
        cuattn.make_layout("strided", 64, HEADS, 16, local_attn_ctx=4),
        cuattn.make_layout("strided", 256, HEADS, 16, local_attn_ctx=16, causal=False),
        cuattn.make_layout("strided", 64, HEADS, 8, local_attn_ctx=8),
        cuattn.make_layout("local", 70, HEADS, 16, local_attn_ctx=9),
        _random_permuted_layout(0),
        _random_permuted_layout(1),
    ],
    ids=["strided", "strided_bidirectional", "strided_block8", "local", "random0", "random1"],
)
def test_natural_cover_holds_every_allowed_element(layout):
    cover = natural_cover(layout)
    exact = _exact_natural_blocks(layout)
    assert cover.shape == layout.blocks.shape and cover.dtype == bool
    assert not (exact & ~cover).any()
    if layout.perm is None:
        np.testing.assert_array_equal(cover, layout.blocks)


@pytest.mark.parametrize("balance", ["contiguous", "zigzag"])
def test_context_parallel_shards_of_a_permuted_layout_equal_its_natural_twin(balance):
    """Ring attention's per-pair layouts (``restricted`` over natural token positions) of the
    transposed strided layout and of the same rule built in natural order: the same blocks and
    elements, which are the whole layout's rows and columns of those tokens."""
    n, world_size = 128, 4
    permuted = cuattn.make_layout("strided", n, HEADS, BLOCK, local_attn_ctx=8)
    natural = cuattn.make_layout("strided", n, HEADS, BLOCK, local_attn_ctx=8, transpose=False)
    assert permuted.perm is not None and natural.perm is None
    full = rule_strided(n, HEADS, 8)
    for rank in range(world_size):
        mine = positions(n, rank, world_size, balance)
        for other in range(world_size):
            theirs = positions(n, other, world_size, balance)
            sub, twin = (restricted(lay, mine, theirs) for lay in (permuted, natural))
            np.testing.assert_array_equal(sub.blocks, twin.blocks)
            np.testing.assert_array_equal(sub.to_mask(), full[:, mine][:, :, theirs])


class _Module(torch.nn.Module):
    """What the Hugging Face adapter reads from an attention layer: its config and causality."""

    def __init__(self, pattern):
        super().__init__()
        self.config = type("Config", (), {"cuattn_pattern": pattern})()
        self.is_causal = True


@pytest.mark.parametrize("n_q", [64, 5])
def test_hugging_face_strided_pattern_keeps_the_rule(n_q):
    """Prefill (square: the permuted layout) and a decoding chunk (queries at the end of the
    keys: natural order, since a permutation needs a square) through the adapter."""
    hf = pytest.importorskip("cuattn.compat.transformers")
    pattern = {"attn_mode": "strided", "blocksize": 16, "local_attn_ctx": 4}
    n_k = 64
    layout = hf.pattern_of(_Module(pattern).config, HEADS, True).layout(n_q, n_k)
    assert (layout.perm is not None) == (n_q == n_k)
    rng = np.random.default_rng(n_q)
    q = rng.standard_normal((1, HEADS, n_q, 16))
    k, v = (rng.standard_normal((1, 1, n_k, 16)) for _ in "kv")
    out, _ = hf.attention_forward(
        _Module(pattern), *(torch.tensor(x) for x in (q, k, v)), attention_mask=None
    )
    mask = rule_strided(n_k, HEADS, 4)[:, n_k - n_q :]
    want, _ = dense_attention(q, k, v, mask, 16**-0.5)
    assert rel_err(out.numpy().transpose(0, 2, 1, 3), want) <= F64_TOLERANCE
