"""cuattn.compat.deepspeed: DeepSpeed's sparsity configs and SparseSelfAttention.

Each config's layout is checked against DeepSpeed's rule restated here block by block, as sets
of (head, row, column) built from per-block predicates (the random draws restated as DeepSpeed
makes them); the module against dense float64 softmax attention with the same element mask.
"""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch

import cuattn.compat.deepspeed as ds
from tests.helpers.attn_cases import GRAD_RTOL_F64, rel

OUT_RTOL = 1e-12
UNI, BI = "unidirectional", "bidirectional"


# -- the rules, restated ------------------------------------------------------------------------


def _active(layout: torch.Tensor) -> set[tuple[int, int, int]]:
    assert layout.dtype == torch.int64
    assert set(layout.unique().tolist()) <= {0, 1}
    return {tuple(i) for i in layout.nonzero().tolist()}


def _per_head(heads, layout_heads, nb, head_rule):
    """{(h, r, c)}: head_rule(h) -> predicate(r, c) for the layout heads; heads beyond them
    repeat head 0 (DeepSpeed's propagation when one layout serves all heads)."""
    rules = {h: head_rule(h) for h in range(layout_heads)}
    return {
        (h, r, c)
        for h in range(heads)
        for r, c in itertools.product(range(nb), repeat=2)
        if rules[h if layout_heads > 1 else 0](r, c)
    }


def fixed_rule(nb, h, local, glob, causal, horizontal, patterns):
    """Window w = blocks [w*local, (w+1)*local) ∩ [0, nb); its global group starts at
    w*local + offset (offset = local - (1 + h % patterns) * glob), except a window cut short by
    nb, whose group starts at min(w*local + offset, nb - glob)."""
    offset = local - (1 + h % patterns) * glob
    group_of = {}  # global column -> first block of its group
    for w in range(-(-nb // local)):
        start = w * local + offset
        if (w + 1) * local > nb:
            start = min(start, nb - glob)
        group_of.update({c: start for c in range(start, start + glob)})

    def rule(r, c):
        local_pair = r // local == c // local and (c <= r or not causal)
        vertical = c in group_of and (r >= group_of[c] or not causal)
        return local_pair or vertical or (horizontal and r in group_of)

    return rule


def window_spans(sizes, nb):
    """Variable's windows: the sizes in turn, then the last size until nb is covered."""
    spans, start = [], 0
    for size in itertools.chain(sizes, itertools.repeat(sizes[-1])):
        if start >= nb:
            return spans
        spans.append(range(start, min(start + size, nb)))
        start += size


def drawn(nb, count, population):
    """The random blocks of one layout head: random.sample per row, top to bottom."""
    return {(r, c) for r in range(nb) for c in random.sample(range(population(r)), count)}


def variable_rule(nb, count, sizes, starts, ends, causal, horizontal):
    picked = drawn(nb, count, lambda r: nb)
    win = {i: n for n, span in enumerate(window_spans(sizes, nb)) for i in span}
    if ends is None:
        ends = [s + 1 for s in starts]
    first_of = {c: s for s, e in zip(starts, ends, strict=True) for c in range(s, min(e, nb))}

    def rule(r, c):
        local_pair = win[r] == win[c] and (c <= r or not causal)
        vertical = c in first_of and (r >= first_of[c] or not causal)
        return (r, c) in picked or local_pair or vertical or (horizontal and r in first_of)

    return rule


def bigbird_rule(nb, count, window, glob, causal):
    picked = drawn(nb, count, (lambda r: r + 1) if causal else (lambda r: nb))

    def rule(r, c):
        seen = (r, c) in picked or abs(r - c) <= window // 2 or min(r, c) < glob
        return seen and (c <= r or not causal)

    return rule


def longformer_rule(nb, window, starts, ends, causal):
    ends = [s + 1 for s in starts] if ends is None else ends
    glob = {c for s, e in zip(starts, ends, strict=True) for c in range(s, min(e, nb))}

    def rule(r, c):
        seen = abs(r - c) <= window // 2 or r in glob or c in glob
        return seen and (c <= r or not causal)

    return rule


def sliding_rule(window, causal):
    return lambda r, c: -(window // 2) <= c - r <= (0 if causal else window // 2)


# -- configs against the restated rules -----------------------------------------------------------


@pytest.mark.parametrize("heads,block,seq", [(1, 16, 64), (3, 4, 44)])
def test_dense_is_every_block(heads, block, seq):
    nb = seq // block
    for per_head in (False, True):
        got = ds.DenseSparsityConfig(heads, block, per_head).make_layout(seq)
        assert got.shape == (heads, nb, nb)
        assert _active(got) == _per_head(heads, 1, nb, lambda h: lambda r, c: True)


FIXED_CASES = [
    # (heads, per_head, local, glob, attention, horizontal, patterns, nb)
    (2, False, 4, 1, BI, False, 1, 16),
    (2, False, 4, 1, UNI, False, 1, 16),
    (3, False, 4, 2, BI, True, 1, 18),  # short last window of 2 blocks
    (4, True, 4, 1, BI, True, 4, 14),  # four global positions, short last window
    (5, True, 6, 2, UNI, False, 3, 17),  # heads cycle through 3 patterns, last window 5
    (4, True, 8, 2, UNI, False, 2, 3),  # a single short window
    (2, True, 3, 3, BI, False, 1, 7),
]


@pytest.mark.parametrize("heads,per_head,local,glob,attention,horizontal,patterns,nb", FIXED_CASES)
def test_fixed(heads, per_head, local, glob, attention, horizontal, patterns, nb):
    cfg = ds.FixedSparsityConfig(
        heads,
        block=4,
        different_layout_per_head=per_head,
        num_local_blocks=local,
        num_global_blocks=glob,
        attention=attention,
        horizontal_global_attention=horizontal,
        num_different_global_patterns=patterns,
    )
    want = _per_head(
        heads,
        heads if per_head else 1,
        nb,
        lambda h: fixed_rule(nb, h, local, glob, attention == UNI, horizontal, patterns),
    )
    assert _active(cfg.make_layout(4 * nb)) == want


VARIABLE_CASES = [
    # (heads, per_head, random, sizes, starts, ends, attention, horizontal, nb)
    (2, False, 0, [4], [0], None, BI, False, 12),
    (2, False, 0, [4], [0], None, UNI, False, 12),
    (3, False, 2, [2, 3, 5], [1, 9, 40], None, BI, True, 19),
    (3, True, 1, [1, 2], [0, 7], [2, 10], UNI, False, 13),
    (4, True, 3, [3, 0, 2], [4], [30], BI, True, 11),  # an empty window, a clipped range
    (2, False, 2, [20], [5], None, UNI, False, 9),  # one window longer than the sequence
]


@pytest.mark.parametrize(
    "heads,per_head,count,sizes,starts,ends,attention,horizontal,nb", VARIABLE_CASES
)
def test_variable(heads, per_head, count, sizes, starts, ends, attention, horizontal, nb):
    cfg = ds.VariableSparsityConfig(
        heads,
        block=2,
        different_layout_per_head=per_head,
        num_random_blocks=count,
        local_window_blocks=sizes,
        global_block_indices=starts,
        global_block_end_indices=ends,
        attention=attention,
        horizontal_global_attention=horizontal,
    )
    random.seed(11)
    got = cfg.make_layout(2 * nb)
    after = random.random()
    random.seed(11)
    want = _per_head(
        heads,
        heads if per_head else 1,
        nb,
        lambda h: variable_rule(nb, count, sizes, starts, ends, attention == UNI, horizontal),
    )
    assert _active(got) == want
    assert random.random() == after  # the same number of draws


BIGBIRD_CASES = [
    # (heads, per_head, random, window, glob, attention, nb)
    (2, False, 1, 3, 1, BI, 12),
    (3, True, 2, 5, 2, BI, 15),
    (3, True, 1, 3, 1, UNI, 10),
    (2, False, 0, 4, 3, UNI, 9),
    (4, True, 3, 1, 0, BI, 6),
]


@pytest.mark.parametrize("heads,per_head,count,window,glob,attention,nb", BIGBIRD_CASES)
def test_bigbird(heads, per_head, count, window, glob, attention, nb):
    cfg = ds.BigBirdSparsityConfig(heads, 8, per_head, count, window, glob, attention)
    random.seed(5)
    got = cfg.make_layout(8 * nb)
    random.seed(5)
    want = _per_head(
        heads,
        heads if per_head else 1,
        nb,
        lambda h: bigbird_rule(nb, count, window, glob, attention == UNI),
    )
    assert _active(got) == want


def test_random_blocks_follow_the_seed():
    cfg = ds.BigBirdSparsityConfig(4, block=4, different_layout_per_head=True, num_random_blocks=2)
    layouts = []
    for seed in (1, 1, 2):
        random.seed(seed)
        layouts.append(cfg.make_layout(64))
    assert torch.equal(layouts[0], layouts[1])
    assert not torch.equal(layouts[0], layouts[2])
    assert len({tuple(h.flatten().tolist()) for h in layouts[0]}) > 1  # each head draws its own


LONGFORMER_CASES = [
    # (heads, per_head, window, starts, ends, attention, nb)
    (2, False, 3, [0], None, BI, 10),
    (2, False, 3, [0, 6], None, UNI, 10),
    (3, True, 5, [2, 8], [4, 20], BI, 13),
    (2, False, 1, [1], [3], UNI, 7),
    (2, False, 3, [4], None, "anything", 8),  # not validated: runs as bidirectional
]


@pytest.mark.parametrize("heads,per_head,window,starts,ends,attention,nb", LONGFORMER_CASES)
def test_bslongformer(heads, per_head, window, starts, ends, attention, nb):
    cfg = ds.BSLongformerSparsityConfig(heads, 4, per_head, window, starts, ends, attention)
    want = _per_head(
        heads,
        heads if per_head else 1,
        nb,
        lambda h: longformer_rule(nb, window, starts, ends, attention == UNI),
    )
    assert _active(cfg.make_layout(4 * nb)) == want


@pytest.mark.parametrize(
    "window,attention,want_causal", [(3, UNI, True), (5, BI, False), (4, "other", True)]
)
def test_local_sliding_window(window, attention, want_causal):
    cfg = ds.LocalSlidingWindowSparsityConfig(
        3, block=4, num_sliding_window_blocks=window, attention=attention
    )
    assert cfg.different_layout_per_head is False
    want = _per_head(3, 1, 9, lambda h: sliding_rule(window, want_causal))
    assert _active(cfg.make_layout(36)) == want


def test_base_methods_work_on_torch_layouts():
    cfg = ds.SparsityConfig(num_heads=3, block=4)
    layout = cfg.setup_layout(20)
    assert layout.shape == (3, 5, 5) and layout.dtype == torch.int64 and not layout.any()
    layout[0, 1, 2] = 1
    assert _active(cfg.check_and_propagate_first_head_layout(layout)) == {
        (h, 1, 2) for h in range(3)
    }
    per_head = ds.SparsityConfig(num_heads=3, block=4, different_layout_per_head=True)
    assert per_head.num_layout_heads == 3
    layout = per_head.setup_layout(20)
    layout[0, 1, 2] = 1
    assert _active(per_head.check_and_propagate_first_head_layout(layout)) == {(0, 1, 2)}
    with pytest.raises(NotImplementedError, match="base class"):
        cfg.make_layout(20)


FIX, VAR, BIG, LONG = (
    ds.FixedSparsityConfig,
    ds.VariableSparsityConfig,
    ds.BigBirdSparsityConfig,
    ds.BSLongformerSparsityConfig,
)
PER_HEAD = dict(different_layout_per_head=True)
CONSTRUCTOR_ERRORS = [
    # (class, arguments, DeepSpeed's error type, a phrase of ours naming the argument)
    (FIX, dict(num_local_blocks=4, num_global_blocks=3), ValueError, "num_local_blocks=4"),
    (FIX, dict(attention="causal"), NotImplementedError, "attention must be"),
    (FIX, dict(attention=UNI, horizontal_global_attention=True), ValueError, "horizontal"),
    (FIX, dict(num_different_global_patterns=2), ValueError, "different_layout_per_head"),
    (
        FIX,
        dict(num_local_blocks=4, num_global_blocks=2, num_different_global_patterns=3, **PER_HEAD),
        ValueError,
        "num_different_global_patterns=3",
    ),
    (VAR, dict(global_block_end_indices=[3, 4]), ValueError, "global_block_end_indices has 2"),
    (VAR, dict(global_block_indices=[2], global_block_end_indices=[2]), ValueError, r"\[2, 2\)"),
    (VAR, dict(attention="x"), NotImplementedError, "attention must be"),
    (VAR, dict(attention=UNI, horizontal_global_attention=True), ValueError, "horizontal"),
    (BIG, dict(attention="x"), NotImplementedError, "attention must be"),
    (LONG, dict(global_block_end_indices=[]), ValueError, "global_block_end_indices has 0"),
    (LONG, dict(global_block_indices=[5], global_block_end_indices=[1]), ValueError, r"\[5, 1\)"),
]


@pytest.mark.parametrize("cls,kwargs,error,match", CONSTRUCTOR_ERRORS)
def test_constructor_errors(cls, kwargs, error, match):
    with pytest.raises(error, match=match):
        cls(4, **kwargs)


ACCEPTED = [  # at the edge of DeepSpeed's conditions, or unchecked by it; 8 blocks a row
    (
        FIX,
        dict(num_local_blocks=4, num_global_blocks=2, num_different_global_patterns=2, **PER_HEAD),
    ),
    (FIX, dict(attention=BI, horizontal_global_attention=True)),
    (VAR, dict(num_random_blocks=8, global_block_indices=[1, 3], global_block_end_indices=[2, 9])),
    (
        BIG,
        dict(num_random_blocks=1, attention=UNI, num_sliding_window_blocks=8, num_global_blocks=8),
    ),
    (BIG, dict(num_random_blocks=8)),
    (LONG, dict(attention="x", num_sliding_window_blocks=8)),
    (ds.LocalSlidingWindowSparsityConfig, dict(attention="x", num_sliding_window_blocks=8)),
]


@pytest.mark.parametrize("cls,kwargs", ACCEPTED)
def test_accepted_combinations(cls, kwargs):
    assert cls(4, block=4, **kwargs).make_layout(32).shape == (4, 8, 8)


MAKE_LAYOUT_ERRORS = [
    (ds.DenseSparsityConfig(2, block=16), 40, "multiple of block=16"),
    (ds.VariableSparsityConfig(2, block=4, num_random_blocks=5), 16, "num_random_blocks=5"),
    (ds.BigBirdSparsityConfig(2, block=4, num_random_blocks=5), 16, "num_random_blocks=5"),
    (ds.BigBirdSparsityConfig(2, block=4, num_random_blocks=2, attention=UNI), 16, "first row"),
    (ds.BigBirdSparsityConfig(2, block=4, num_sliding_window_blocks=5), 16, "num_sliding_window"),
    (ds.BigBirdSparsityConfig(2, block=4, num_global_blocks=5), 16, "num_global_blocks=5"),
    (
        ds.BSLongformerSparsityConfig(2, block=4, num_sliding_window_blocks=5),
        16,
        "num_sliding_window",
    ),
    (
        ds.LocalSlidingWindowSparsityConfig(2, block=4, num_sliding_window_blocks=5),
        16,
        "num_sliding_window",
    ),
]


@pytest.mark.parametrize("cfg,seq,match", MAKE_LAYOUT_ERRORS)
def test_make_layout_errors(cfg, seq, match):
    with pytest.raises(ValueError, match=match):
        cfg.make_layout(seq)


# -- SparseSelfAttention against dense attention ---------------------------------------------------

BATCH, HEADS, SEQ, DIM, BLOCK = 3, 4, 48, 8, 8


def _qkv(seed, batch=BATCH, heads=HEADS, seq=SEQ):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, DIM)
    return [
        torch.randn(shape, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)
    ]


def _dense(q, k, v, blocks, keep_qk=None, keep_k=None):
    """Softmax attention over the keys the block layout (and the masks) allow; rows with none
    give 0. blocks [heads, nb, nb]; keep_qk [seq, seq]; keep_k [batch, seq]."""
    b = q.shape[2] // blocks.shape[-1]
    allowed = blocks.bool().repeat_interleave(b, 1).repeat_interleave(b, 2)[None]
    if keep_qk is not None:
        allowed = allowed & keep_qk
    if keep_k is not None:
        allowed = allowed & keep_k[:, None, None, :]
    any_key = allowed.any(-1, keepdim=True)
    s = (q @ k.transpose(-1, -2)) * DIM**-0.5
    s = s.masked_fill(~allowed, float("-inf")).masked_fill(~any_key, 0.0)
    return (torch.softmax(s, -1) * any_key) @ v


def _check_against_dense(got, want, inputs):
    assert got.shape == want.shape and not got.isnan().any()
    assert rel(got.detach(), want.detach()) <= OUT_RTOL
    w = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(99))
    grads = torch.autograd.grad((got * w).sum(), inputs)
    wants = torch.autograd.grad((want * w).sum(), inputs)
    for g, ref in zip(grads, wants, strict=True):
        assert rel(g, ref) <= GRAD_RTOL_F64


def _fixed():
    return ds.FixedSparsityConfig(
        HEADS,
        block=BLOCK,
        different_layout_per_head=True,
        num_local_blocks=2,
        num_different_global_patterns=2,
        attention=UNI,
    )


def test_forward_and_gradients_equal_dense_attention_with_the_layout():
    module = ds.SparseSelfAttention(_fixed(), max_seq_length=128)
    q, k, v = _qkv(0)
    got = module(q, k, v)
    blocks = module.master_layout[:, : SEQ // BLOCK, : SEQ // BLOCK]
    _check_against_dense(got, _dense(q, k, v, blocks), (q, k, v))
    # key handed over transposed, [batch, heads, head_dim, seq_len], as DeepSpeed allows
    assert rel(module(q, k.transpose(-1, -2), v).detach(), got.detach()) <= OUT_RTOL


def test_a_shorter_sequence_uses_the_corner_of_the_max_length_layout():
    cfg = ds.BigBirdSparsityConfig(HEADS, block=BLOCK, different_layout_per_head=True)
    random.seed(3)
    module = ds.SparseSelfAttention(cfg, max_seq_length=256)
    random.seed(3)
    assert torch.equal(module.master_layout, cfg.make_layout(256))
    nb = SEQ // BLOCK
    corner = module.master_layout[:, :nb, :nb]
    assert torch.equal(module.get_layout(SEQ), corner)
    q, k, v = _qkv(1)
    _check_against_dense(module(q, k, v), _dense(q, k, v, corner), (q, k, v))


def test_masks_drop_keys_and_fully_dropped_rows_give_zero():
    module = ds.SparseSelfAttention(
        _fixed(), key_padding_mask_mode="add", attn_mask_mode="mul", max_seq_length=64
    )
    q, k, v = _qkv(2, batch=4)
    g = torch.Generator().manual_seed(7)
    keep_qk = torch.ones(SEQ, SEQ).tril(-1).bool()  # strictly causal: query 0 sees nothing
    keep_k = torch.rand(4, SEQ, generator=g) < 0.8
    keep_k[2] = keep_k[0]  # two batch rows share their padding
    keep_k[3] = False  # a batch row of padding only
    padding = torch.zeros(4, SEQ, dtype=torch.float64).masked_fill(~keep_k, float("-inf"))
    got = module(q, k, v, key_padding_mask=padding, attn_mask=keep_qk.double())
    blocks = module.master_layout[:, : SEQ // BLOCK, : SEQ // BLOCK]
    _check_against_dense(got, _dense(q, k, v, blocks, keep_qk, keep_k), (q, k, v))
    assert not got[:, :, 0].any() and not got[3].any()

    # The same masks in other accepted forms: bool, singleton dimensions, 'mul' padding.
    mul = ds.SparseSelfAttention(_fixed(), key_padding_mask_mode="mul", max_seq_length=64)
    other = mul(q, k, v, key_padding_mask=keep_k[:, None, None, :], attn_mask=keep_qk[None, None])
    assert rel(other.detach(), got.detach()) <= OUT_RTOL


def test_add_mode_attention_mask_and_a_single_padding_row():
    module = ds.SparseSelfAttention(_fixed(), attn_mask_mode="add", max_seq_length=64)
    q, k, v = _qkv(3, batch=2)
    causal = torch.ones(SEQ, SEQ).tril().bool()
    bias = torch.zeros(SEQ, SEQ, dtype=torch.float64).masked_fill(~causal, float("-inf"))
    keep_k = torch.ones(2, SEQ, dtype=torch.bool)
    keep_k[:, -5:] = False
    pad = torch.zeros(2, SEQ).masked_fill(~keep_k, float("-inf"))
    got = module(q, k, v, key_padding_mask=pad, attn_mask=bias)
    blocks = module.master_layout[:, : SEQ // BLOCK, : SEQ // BLOCK]
    _check_against_dense(got, _dense(q, k, v, blocks, causal, keep_k), (q, k, v))


def _refuse_compute(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("computed before the arguments were checked")

    monkeypatch.setattr(ds.api, "sparse_attention", fail)


BAD_CALLS = [
    (dict(rpe=torch.rand(BATCH, HEADS, SEQ, SEQ + 8)), ValueError, r"rpe of shape .* does not fit"),
    (dict(attn_mask=torch.full((SEQ, SEQ), float("nan"))), ValueError, "attn_mask holds NaN"),
    (dict(key_padding_mask=torch.zeros(BATCH, 1, SEQ + 1)), ValueError, r"key_padding_mask m"),
    (dict(key_padding_mask=torch.zeros(SEQ)), ValueError, r"\[batch, seq_len\]"),
    (dict(attn_mask=torch.ones(2, SEQ, SEQ)), ValueError, r"attn_mask must be \[seq_len"),
    (dict(attn_mask=np.ones((SEQ, SEQ))), TypeError, "attn_mask must be a torch.Tensor"),
]


@pytest.mark.parametrize("kwargs,error,match", BAD_CALLS)
def test_bad_arguments_are_refused_by_name_before_computing(monkeypatch, kwargs, error, match):
    module = ds.SparseSelfAttention(_fixed(), max_seq_length=64)
    q, k, v = _qkv(4)
    _refuse_compute(monkeypatch)
    with pytest.raises(error, match=match):
        module(q, k, v, **kwargs)


def test_bad_shapes_lengths_and_modes_are_refused(monkeypatch):
    module = ds.SparseSelfAttention(_fixed(), max_seq_length=64)
    q, k, v = _qkv(5)
    _refuse_compute(monkeypatch)
    for error in (NotImplementedError, ValueError):  # DeepSpeed's type, and ours
        with pytest.raises(error, match="only self-attention"):
            module(q, k, v[:, :, :-8])
    short = [t[:, :, :20] for t in (q, k, v)]
    with pytest.raises(ValueError, match="multiple of block=8"):
        module(*short)
    long = [t.repeat(1, 1, 2, 1)[:, :, :72] for t in (q, k, v)]
    with pytest.raises(ValueError, match="max_seq_length=64"):
        module(*long)
    with pytest.raises(ValueError, match="query has 2 heads"):
        module(q[:, :2], k[:, :2], v[:, :2])
    with pytest.raises(TypeError, match="query must be a torch.Tensor"):
        module(q.detach().numpy(), k, v)
    with pytest.raises(ValueError, match="attn_mask_mode must be one of"):
        ds.SparseSelfAttention(_fixed(), attn_mask_mode="multiply", max_seq_length=64)
    with pytest.raises(NotImplementedError, match="base class"):
        ds.SparseSelfAttention()  # DeepSpeed's default config has no rule either


def test_a_loaded_master_layout_replaces_the_cached_one():
    random.seed(0)
    cfg = ds.BigBirdSparsityConfig(HEADS, block=BLOCK, different_layout_per_head=True)
    module = ds.SparseSelfAttention(cfg, max_seq_length=64)
    random.seed(1)
    other = ds.SparseSelfAttention(cfg, max_seq_length=64)
    assert not torch.equal(module.master_layout, other.master_layout)
    q, k, v = _qkv(6)
    before = module(q, k, v)
    module.load_state_dict(other.state_dict())
    after = module(q, k, v)
    assert rel(after.detach(), other(q, k, v).detach()) <= OUT_RTOL
    assert rel(after.detach(), before.detach()) > 1e-3


def test_rank_zero_layout_is_broadcast_once_under_torch_distributed(monkeypatch):
    module = ds.SparseSelfAttention(_fixed(), max_seq_length=64)
    rank0 = ds.DenseSparsityConfig(HEADS, block=BLOCK).make_layout(64)
    calls = []

    def broadcast(tensor, src):
        calls.append(src)
        tensor.copy_(rank0)

    monkeypatch.setattr(ds.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(ds.dist, "broadcast", broadcast)
    q, k, v = _qkv(7)
    got = module(q, k, v)
    module(q, k, v)
    assert calls == [0]
    _check_against_dense(got, _dense(q, k, v, rank0[:, :6, :6]), (q, k, v))
