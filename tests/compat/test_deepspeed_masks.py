"""DeepSpeed's whole call: SparseSelfAttention.forward with key_padding_mask and attn_mask in
both modes, against a float64 restatement of DeepSpeed's documented semantics.

DeepSpeed (deepspeed/ops/sparse_attention/sparse_self_attention.py and softmax.py) casts each
mask to the query's dtype and squeezes it; its softmax kernel then scales the scores and adds
the key padding mask and the attention mask, a 'mul' mask as ``where(m == 0, -inf, 0)``, an
'add' mask as it is, over the blocks of the layout only. ``deepspeed_attention`` below is that,
dense, in float64. The one documented difference: a row with nothing to attend to is NaN there
and 0 in cuattn. Masks are drawn per batch row (right, left, scattered, no padding, all padding)
and every pattern the shim follows as a band (causal, windows, strictly causal, all, nothing);
attn_masks that are no band or hold finite values in 'add' mode, and rpes that are no function
of k - q, run through cuattn's score_bias and are held to the same restatement.
"""

from __future__ import annotations

import random

import pytest
import torch

import cuattn.compat.deepspeed as ds
from tests.helpers.attn_cases import GRAD_RTOL_F64, rel

OUT_RTOL = 1e-12
BATCH, HEADS, SEQ, DIM, BLOCK, MAX_LEN = 6, 4, 48, 8, 8, 64
MODES = [("add", "add"), ("add", "mul"), ("mul", "add"), ("mul", "mul")]
INF = float("-inf")


# -- DeepSpeed's semantics, restated ------------------------------------------------------------


def _squeezed_padding(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """DeepSpeed's transpose_mask_for_sparse for the key padding mask: cast, then squeeze the
    dimensions after the first, last to second."""
    mask = mask.to(dtype)
    for d in range(mask.dim() - 1, 0, -1):
        mask = mask.squeeze(d)
    return mask


def _added(mask: torch.Tensor, mode: str) -> torch.Tensor:
    """What DeepSpeed's softmax kernel adds to the scores for a mask in ``mode``."""
    if mode == "mul":
        return torch.where(mask == 0, INF, 0.0).to(mask.dtype)
    return mask


def deepspeed_scores(q, k, blocks, key_padding_mask, attn_mask, kp_mode, attn_mode, rpe=None):
    """The scores DeepSpeed's softmax sees, -inf outside the layout's blocks."""
    scores = (q @ k.transpose(-1, -2)) * float(q.shape[-1]) ** -0.5
    if rpe is not None:
        scores = scores + rpe
    if key_padding_mask is not None:
        kp = _added(_squeezed_padding(key_padding_mask, q.dtype), kp_mode)
        scores = scores + kp[:, None, None, :]
    if attn_mask is not None:
        scores = scores + _added(attn_mask.to(q.dtype).squeeze(), attn_mode)
    b = q.shape[2] // blocks.shape[-1]
    inside = blocks.bool().repeat_interleave(b, 1).repeat_interleave(b, 2)
    return scores.masked_fill(~inside, INF)


def deepspeed_attention(q, k, v, blocks, key_padding_mask, attn_mask, kp_mode, attn_mode, rpe=None):
    """(out, empty): DeepSpeed's attention, with rows that have nothing to attend to (NaN in
    DeepSpeed) set to 0 as cuattn documents, so that gradients exist; ``empty`` marks them."""
    masks = (key_padding_mask, attn_mask, kp_mode, attn_mode)
    scores = deepspeed_scores(q, k, blocks, *masks, rpe)
    empty = (scores == INF).all(-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(empty, 0.0), -1).masked_fill(empty, 0.0)
    return probs @ v, empty


# -- cases --------------------------------------------------------------------------------------

BANDS = {  # name -> (lo, hi): query q keeps key k when lo <= q - k <= hi
    "causal": (0, SEQ),
    "window": (-2, 5),
    "causal-window": (0, 9),
    "strictly-causal": (1, SEQ),  # query 0 sees nothing
    "ahead": (-6, -1),  # only later keys: the last query sees nothing
    "all": (-SEQ, SEQ),
    "nothing": (1, 0),
}
ATTN = [None, *BANDS]


def _band_keep(name: str) -> torch.Tensor:
    lo, hi = BANDS[name]
    d = torch.arange(SEQ)[:, None] - torch.arange(SEQ)[None, :]
    return (d >= lo) & (d <= hi)


def _padding_keep(g: torch.Generator) -> torch.Tensor:
    """bool [BATCH, SEQ]: one padding kind per batch row, in random order, lengths random; two
    rows share a padding."""
    rows = []
    for kind in ("right", "right", "left", "scattered", "none", "empty"):
        n = int(torch.randint(1, SEQ, (1,), generator=g))
        keep = torch.zeros(SEQ, dtype=torch.bool)
        if kind == "right":
            keep[:n] = True
        elif kind == "left":
            keep[SEQ - n :] = True
        elif kind == "scattered":
            keep = torch.rand(SEQ, generator=g) < 0.7
        elif kind == "none":
            keep[:] = True
        rows.append(keep)
    rows[1] = rows[0]
    order = torch.randperm(len(rows), generator=g)
    return torch.stack(rows)[order]


def _encode(keep: torch.Tensor, mode: str, g: torch.Generator, form: int) -> torch.Tensor:
    """A mask holding ``keep`` as a DeepSpeed user writes it in ``mode``: 'add' as 0/-inf,
    'mul' as 0 and arbitrary nonzero numbers (DeepSpeed keeps any nonzero value) or a bool."""
    if mode == "add":
        return torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, INF)
    if form % 2:
        return keep
    values = torch.tensor([1.0, 0.5, -2.0, 3.0], dtype=torch.float64)
    pick = values[torch.randint(0, len(values), keep.shape, generator=g)]
    return torch.where(keep, pick, 0.0)


def _configs():
    random.seed(11)
    return [
        ds.FixedSparsityConfig(
            HEADS,
            block=BLOCK,
            different_layout_per_head=True,
            num_local_blocks=2,
            num_different_global_patterns=2,
            attention="unidirectional",
        ),
        ds.BigBirdSparsityConfig(HEADS, block=BLOCK, different_layout_per_head=True),
        ds.VariableSparsityConfig(HEADS, block=BLOCK, local_window_blocks=[1, 2]),
    ]


def _qkv(seed: int, batch: int = BATCH, dtype=torch.float64, seq=SEQ, heads=HEADS, dim=DIM):
    g = torch.Generator().manual_seed(seed)
    shape = (batch, heads, seq, dim)
    return [torch.randn(shape, generator=g, dtype=dtype, requires_grad=True) for _ in range(3)]


def _close(x: torch.Tensor, ref: torch.Tensor, rtol: float) -> bool:
    """Relative to ref's largest entry; an all-zero ref (nothing attended) wants exact zeros."""
    x, ref = x.detach(), ref.detach()
    return not x.any() if not ref.any() else rel(x, ref) <= rtol


def _check(got, want, inputs, out_rtol=OUT_RTOL, grad_rtol=GRAD_RTOL_F64):
    assert got.shape == want.shape and got.dtype == want.dtype and not got.isnan().any()
    assert _close(got, want, out_rtol)
    w = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(99))
    grads = torch.autograd.grad((got * w).sum(), inputs, retain_graph=True)  # a shared rpe graph
    wants = torch.autograd.grad((want * w).sum(), inputs)
    for g, ref in zip(grads, wants, strict=True):
        assert _close(g, ref, grad_rtol)


# -- the call against DeepSpeed -----------------------------------------------------------------


@pytest.mark.parametrize("modes", MODES, ids=lambda m: f"kp-{m[0]}-attn-{m[1]}")
@pytest.mark.parametrize("attn", ATTN, ids=str)
def test_masks_in_both_modes_equal_deepspeeds_semantics(modes, attn):
    kp_mode, attn_mode = modes
    case = MODES.index(modes) * len(ATTN) + ATTN.index(attn)
    cfg = _configs()[case % 3]
    module = ds.SparseSelfAttention(cfg, kp_mode, attn_mode, max_seq_length=MAX_LEN)
    g = torch.Generator().manual_seed(case)
    keep_k = _padding_keep(g)
    padding = _encode(keep_k, kp_mode, g, case)
    if case % 3 == 0:  # singleton dimensions, squeezed as DeepSpeed does
        padding = padding[:, None, None, :]
    attn_mask = None
    if attn is not None:
        attn_mask = _encode(_band_keep(attn), attn_mode, g, case // 2)
        if case % 4 == 1:
            attn_mask = attn_mask[None, None]
    q, k, v = _qkv(case)
    key = k.transpose(-1, -2) if case % 5 == 0 else k  # DeepSpeed's transposed key
    got = module(q, key, v, key_padding_mask=padding, attn_mask=attn_mask)

    blocks = module.get_layout(SEQ)
    want, empty = deepspeed_attention(q, k, v, blocks, padding, attn_mask, kp_mode, attn_mode)
    _check(got, want, (q, k, v))
    # The rows cuattn gives 0 are exactly those DeepSpeed's softmax leaves NaN.
    scores = deepspeed_scores(q, k, blocks, padding, attn_mask, kp_mode, attn_mode)
    literal = torch.softmax(scores, -1) @ v
    assert torch.equal(literal.isnan().any(-1, keepdim=True), empty)
    assert not got.detach().masked_select(empty).any()


def test_float16_casts_masks_as_deepspeed_does():
    """DeepSpeed casts a mask to the query's dtype first: in float16, -1e5 is -inf (a drop),
    in float32 it stays a finite bias (added: exp(-1e5) is 0 there too)."""
    module = ds.SparseSelfAttention(_configs()[1], max_seq_length=MAX_LEN)
    q, k, v = (x.detach().half() for x in _qkv(3))
    keep = _padding_keep(torch.Generator().manual_seed(3))
    big = torch.zeros(BATCH, SEQ, dtype=torch.float32).masked_fill(~keep, -1e5)
    minus_inf = big.masked_fill(~keep, INF)
    got = module(q, k, v, key_padding_mask=big)
    assert torch.equal(got, module(q, k, v, key_padding_mask=minus_inf))
    want, _ = deepspeed_attention(
        *(x.double() for x in (q, k, v)), module.get_layout(SEQ), minus_inf, None, "add", "mul"
    )
    assert rel(got.double(), want) <= 2e-3
    # in float32 a row whose keys all hold -1e5 attends to all of them alike, as in DeepSpeed;
    # there a score s - 1e5 keeps s to float32's ulp at 1e5 (2^-7), hence the tolerance
    as_float = [x.float() for x in (q, k, v)]
    biased = module(*as_float, key_padding_mask=big)
    as_double = (x.double() for x in as_float)
    want, _ = deepspeed_attention(
        *as_double, module.get_layout(SEQ), big.double(), None, "add", "mul"
    )
    assert rel(biased.double(), want) <= 5e-3


def test_the_kernels_follow_a_band_with_the_keys_cut_to_a_padding_length(monkeypatch):
    """On the interpreter (the .cu kernels, float32): right padding cuts the keys and moves the
    window rule's bounds by the end-aligned offset; left padding runs on a per-key rule; a
    mask that is no band (dilated, and causal with one row keeping keys 0..4) runs as per-block
    bitmasks, with the keys cut too."""
    monkeypatch.setenv("CUATTN_BACKEND", "interp")
    cfg = ds.BSLongformerSparsityConfig(2, block=16, num_sliding_window_blocks=3)
    for band in ("causal", "window", "general"):
        module = ds.SparseSelfAttention(cfg, "mul", "mul", max_seq_length=64)
        lo, hi = BANDS["causal" if band == "general" else band]
        d = torch.arange(64)[:, None] - torch.arange(64)[None, :]
        keep_qk = (d >= lo) & (d <= hi)
        if band == "general":
            keep_qk &= d % 3 != 1
            keep_qk[40] = False
            keep_qk[40, :5] = True
        keep_k = torch.ones(3, 64, dtype=torch.bool)
        keep_k[0, 37:] = False  # right padding: keys cut to 37
        keep_k[1, :21] = False  # left padding: a per-key rule
        q, k, v = _qkv(5, batch=3, dtype=torch.float32, seq=64, heads=2, dim=16)
        got = module(q, k, v, key_padding_mask=keep_k, attn_mask=keep_qk)
        ref = [x.double() for x in (q, k, v)]
        blocks = module.get_layout(64)
        want, _ = deepspeed_attention(*ref, blocks, keep_k, keep_qk, "mul", "mul")
        _check(got.double(), want, (q, k, v), out_rtol=1e-5, grad_rtol=1e-4)
    # DeepSpeed's Bert layer hands the key over transposed: the kernels get it back in rows
    transposed = module(q, k.transpose(-1, -2), v, key_padding_mask=keep_k, attn_mask=keep_qk)
    assert torch.equal(transposed, got)


# -- how the masks are run: never a dense T x T ---------------------------------------------------


def _spy(monkeypatch):
    calls = []
    real = ds.api.sparse_attention

    def spy(q, k, v, layout, **kwargs):
        calls.append((q.shape[0], k.shape[2], layout))
        return real(q, k, v, layout, **kwargs)

    monkeypatch.setattr(ds.api, "sparse_attention", spy)
    return calls


def test_right_padding_cuts_the_keys_and_needs_no_element_table(monkeypatch):
    module = ds.SparseSelfAttention(_configs()[0], "mul", "mul", max_seq_length=MAX_LEN)
    lengths = [SEQ, 20, 7, 20]
    keep_k = torch.arange(SEQ)[None, :] < torch.tensor(lengths)[:, None]
    q, k, v = _qkv(8, batch=4)
    calls = _spy(monkeypatch)
    for attn, kinds in ((None, {"none"}), ("causal", {"causal", "window"}), ("window", {"window"})):
        calls.clear()
        mask = None if attn is None else _band_keep(attn)
        module(q, k, v, key_padding_mask=keep_k, attn_mask=mask)
        # one call per distinct length (rows 1 and 3 share theirs), keys cut to it
        assert sorted((rows, keys) for rows, keys, _ in calls) == [(1, 7), (1, SEQ), (2, 20)]
        for _, keys, layout in calls:
            assert layout.n_ctx == keys and layout.n_q == SEQ
            assert layout.rule.kind in kinds and layout.mask_table.size == 0


def test_other_padding_is_a_per_key_rule_and_an_all_pairs_mask_is_no_rule(monkeypatch):
    module = ds.SparseSelfAttention(_configs()[1], max_seq_length=MAX_LEN)
    keep_k = torch.ones(2, SEQ, dtype=torch.bool)
    keep_k[0, :5] = False  # left padding
    keep_k[1, 10:30] = False  # a hole
    calls = _spy(monkeypatch)
    q, k, v = _qkv(9, batch=2)
    padding = torch.zeros(2, SEQ).masked_fill(~keep_k, INF)
    module(q, k, v, key_padding_mask=padding, attn_mask=torch.ones(SEQ, SEQ))
    assert len(calls) == 2
    assert all(keys == SEQ and layout.rule.kind == "bitmask" for _, keys, layout in calls)
    # key block 2 (keys 16..23) lies inside the hole: the hole's row does not walk that column
    walked = sorted(bool(layout.blocks[:, :, 2].any()) for _, _, layout in calls)
    assert walked == [False, True]
    calls.clear()
    module(q, k, v, attn_mask=torch.ones(SEQ, SEQ))
    assert len(calls) == 1 and calls[0][2].rule.kind == "none"


# -- refusals, each before anything is computed ---------------------------------------------------


def _refuse_compute(monkeypatch):
    def fail(*args, **kwargs):
        raise AssertionError("computed before the arguments were checked")

    monkeypatch.setattr(ds.api, "sparse_attention", fail)


def _gappy() -> torch.Tensor:
    d = torch.arange(SEQ)[:, None] - torch.arange(SEQ)[None, :]
    return (d >= 0) & (d % 2 == 0)  # causal, every other key: dilated, not a band


def _one_row_differs() -> torch.Tensor:
    keep = _band_keep("causal")
    keep[10] = True  # row 10 sees every key, the others are causal
    return keep


def _bias(value: float, shape: tuple[int, ...]) -> torch.Tensor:
    mask = torch.zeros(shape)
    mask[..., -1] = value
    return mask


def _row_cut_from_band() -> torch.Tensor:
    """A sliding window in which one row keeps only keys 0..4: a band with one odd row."""
    keep = _band_keep("window")
    keep[30] = False
    keep[30, :5] = True
    return keep


REFUSALS = [
    (
        dict(key_padding_mask=_bias(float("inf"), (BATCH, SEQ))),
        ("add", "mul"),
        r"key_padding_mask holds inf: .*\+inf",
    ),
    (
        dict(key_padding_mask=_bias(float("nan"), (BATCH, SEQ))),
        ("mul", "mul"),
        "key_padding_mask holds NaN",
    ),
    (dict(attn_mask=_bias(float("nan"), (SEQ, SEQ))), ("add", "add"), "attn_mask holds NaN"),
    (dict(attn_mask=_bias(float("nan"), (SEQ, SEQ))), ("add", "mul"), "attn_mask holds NaN"),
    (
        dict(attn_mask=_bias(float("inf"), (SEQ, SEQ))),
        ("add", "add"),
        r"attn_mask holds inf: .*\+inf would leave the softmax no finite scale",
    ),
    (
        dict(attn_mask=torch.ones(SEQ, SEQ, dtype=torch.complex64)),
        ("add", "mul"),
        "attn_mask must be real or bool",
    ),
    (
        dict(rpe=torch.zeros(BATCH, HEADS, SEQ, SEQ - 8)),
        ("add", "mul"),
        r"rpe of shape \(6, 4, 48, 40\) does not fit",
    ),
    (dict(rpe=torch.zeros(2, HEADS, SEQ, SEQ)), ("add", "mul"), r"rpe of shape \(2, 4, 48, 48\)"),
    (dict(rpe=torch.zeros(SEQ, SEQ, dtype=torch.int64)), ("add", "mul"), "rpe must be a floating"),
]


@pytest.mark.parametrize("attn", [None, "causal"])
def test_an_additive_padding_mask_with_finite_values_is_a_key_bias(attn):
    """'add' mode adds a key padding mask to the scores as it is: -10000 on padded keys, a
    learned bias (its gradient too), -inf beside finite values, and a bool mask (True adds 1),
    all as DeepSpeed's softmax adds them."""
    cfg = _configs()[1]
    module = ds.SparseSelfAttention(cfg, "add", "mul", max_seq_length=MAX_LEN)
    g = torch.Generator().manual_seed(21)
    learned = torch.randn(BATCH, SEQ, generator=g, dtype=torch.float64)
    learned[0, -4:] = INF
    learned.requires_grad_(True)
    masks = [_bias(-1e4, (BATCH, SEQ)), learned, torch.rand(BATCH, SEQ, generator=g) > 0.5]
    attn_mask = None if attn is None else _band_keep(attn).to(torch.float64)
    blocks = module.get_layout(SEQ)
    for i, padding in enumerate(masks):
        q, k, v = _qkv(30 + i)
        got = module(q, k, v, key_padding_mask=padding, attn_mask=attn_mask)
        want, _ = deepspeed_attention(q, k, v, blocks, padding, attn_mask, "add", "mul")
        inputs = (q, k, v, learned) if padding is learned else (q, k, v)
        _check(got, want, inputs)


@pytest.mark.parametrize("modes", [("add", "mul"), ("mul", "mul")], ids=lambda m: f"kp-{m[0]}")
@pytest.mark.parametrize("attn", [None, "causal", "window"])
def test_an_rpe_by_distance_runs_as_a_table_with_its_gradient(modes, attn):
    """An rpe that is a function of k - q (a learned embedding per distance, gathered as
    relative-position models build it) through every padding kind (keys cut for right
    padding, a per-key rule for the others, whole rows empty): output and the gradients of
    q, k, v and the embedding equal DeepSpeed's semantics with the rpe added densely."""
    module = ds.SparseSelfAttention(_configs()[0], *modes, max_seq_length=MAX_LEN)
    g = torch.Generator().manual_seed(23)
    embedding = torch.randn(HEADS, 2 * SEQ - 1, generator=g, dtype=torch.float64)
    embedding.requires_grad_(True)
    distance = torch.arange(SEQ)[None, :] - torch.arange(SEQ)[:, None]  # k - q
    padding = _encode(_padding_keep(g), modes[0], g, 0)
    attn_mask = None if attn is None else _band_keep(attn).to(torch.float64)
    q, k, v = _qkv(40)
    rpe = embedding[:, distance + SEQ - 1][None]  # [1, heads, SEQ, SEQ]
    got = module(q, k, v, rpe=rpe, key_padding_mask=padding, attn_mask=attn_mask)
    blocks = module.get_layout(SEQ)
    rpe = embedding[:, distance + SEQ - 1][None]  # its own graph: each side differentiates
    want, _ = deepspeed_attention(q, k, v, blocks, padding, attn_mask, *modes, rpe=rpe)
    _check(got, want, (q, k, v, embedding))


# -- what DeepSpeed allows beyond a band and a table by distance: cuattn's score_bias ----------


def _general_attn_masks(g: torch.Generator) -> dict[str, tuple[str, torch.Tensor]]:
    """name -> (attn_mask_mode, mask): the masks that are no band, or hold finite values in
    'add' mode, which DeepSpeed's softmax adds as they are."""
    finite = torch.randn(SEQ, SEQ, generator=g, dtype=torch.float64)
    finite_causal = finite.masked_fill(~_band_keep("causal"), INF)
    finite_causal[5] = INF  # a row with nothing left: 0 here, NaN in DeepSpeed
    finite_gappy = finite.masked_fill(~_gappy(), INF)
    random_keep = torch.rand(SEQ, SEQ, generator=g) < 0.6
    return {
        "mul-random": ("mul", _encode(random_keep, "mul", g, 0)),
        "mul-dilated": ("mul", _gappy()),
        "mul-one-row-sees-all": ("mul", _one_row_differs().double()),
        "mul-row-keeps-0..4-of-a-band": ("mul", _row_cut_from_band()),
        "add-general-0/-inf": ("add", _encode(random_keep, "add", g, 0)),
        "add-minus-1e4": ("add", _bias(-1e4, (SEQ, SEQ))),
        "add-finite-dense": ("add", finite),
        "add-finite-with-causal-inf": ("add", finite_causal),
        "add-finite-dilated-inf": ("add", finite_gappy[None, None]),
    }


def _rpes(g: torch.Generator) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """name -> (rpe, the leaf whose gradient is checked, or None): rpes that are not a
    function of k - q, in each shape DeepSpeed allows, and leaves that require a gradient."""
    full = torch.randn(BATCH, HEADS, SEQ, SEQ, generator=g, dtype=torch.float64)
    source = torch.randn(HEADS, SEQ, SEQ, generator=g, dtype=torch.float64, requires_grad=True)
    leaf = torch.randn(HEADS, SEQ, SEQ, generator=g, dtype=torch.float64).requires_grad_(True)
    zeros = torch.zeros(1, HEADS, SEQ, SEQ, dtype=torch.float64, requires_grad=True)
    by_distance = torch.arange(SEQ)[None, :] - torch.arange(SEQ)[:, None]
    toeplitz_leaf = (0.1 * by_distance).double().requires_grad_(True)
    per_row = torch.randn(BATCH, 1, SEQ, SEQ, generator=g, dtype=torch.float32)
    longer = torch.zeros(1, HEADS, MAX_LEN, MAX_LEN, dtype=torch.float32, requires_grad=True)
    return {
        "batch-heads": (full, None),
        "batch-one-head-float32": (per_row, None),
        "made-from-a-tensor": ((source * 2).tanh()[None], source),
        "leaf": (leaf, leaf),
        "zero-leaf": (zeros, zeros),  # a zero-initialised learned rpe: still its gradient
        "toeplitz-leaf": (toeplitz_leaf, toeplitz_leaf),  # by distance, but its entries are free
        # a zero-initialised learned rpe for max_seq_length, sliced and cast: free entries too
        "slice-of-a-zero-leaf": (longer[:, :, :SEQ, :SEQ].double(), longer),
    }


GENERAL_MASKS = list(_general_attn_masks(torch.Generator().manual_seed(0)))
RPES = list(_rpes(torch.Generator().manual_seed(0)))
PADDINGS = ["mul", "add", "add-finite", None]  # key_padding_mask_mode, or none given


def _padding(kind: str | None, g: torch.Generator) -> torch.Tensor | None:
    """A key padding mask of every padding kind (right, left, scattered, none, all), or for
    'add-finite' a learned per-key bias with -inf on some keys (cuattn's key_bias)."""
    if kind is None:
        return None
    keep = _padding_keep(g)
    if kind != "add-finite":
        return _encode(keep, kind, g, 0)
    bias = torch.randn(BATCH, SEQ, generator=g, dtype=torch.float64)
    return bias.masked_fill(~keep, INF)


def _run_against_deepspeed(case: int, padding_kind, attn_mode, attn_mask, rpe, leaf, dtype):
    kp_mode = "mul" if padding_kind == "mul" else "add"
    cfg = _configs()[case % 3]
    module = ds.SparseSelfAttention(cfg, kp_mode, attn_mode, max_seq_length=MAX_LEN)
    g = torch.Generator().manual_seed(100 + case)
    padding = _padding(padding_kind, g)
    q, k, v = _qkv(100 + case, dtype=dtype)
    got = module(q, k, v, rpe=rpe, key_padding_mask=padding, attn_mask=attn_mask)
    as_double = [x.double() for x in (q, k, v)]
    ref_rpe = None if rpe is None else rpe.double()
    blocks = module.get_layout(SEQ)
    want, empty = deepspeed_attention(
        *as_double, blocks, padding, attn_mask, kp_mode, attn_mode, rpe=ref_rpe
    )
    inputs = (q, k, v) if leaf is None else (q, k, v, leaf)
    if dtype == torch.float64:
        _check(got, want, inputs)
    else:
        _check(got.double(), want, inputs, out_rtol=1e-5, grad_rtol=1e-4)
    assert not got.detach().masked_select(empty).any()


@pytest.mark.parametrize("padding_kind", PADDINGS, ids=lambda p: f"kp-{p}")
@pytest.mark.parametrize("name", GENERAL_MASKS)
def test_a_general_attn_mask_in_either_mode_equals_deepspeeds_semantics(name, padding_kind):
    """Masks that are no band (random, dilated, a row that differs, a row keeping keys 0..4
    of a window) in 'mul' mode, and 0/-inf or finite values in 'add' mode, through every
    padding kind: forward and the gradients of q, k, v equal DeepSpeed's softmax, in
    float64."""
    case = GENERAL_MASKS.index(name) * len(PADDINGS) + PADDINGS.index(padding_kind)
    attn_mode, attn_mask = _general_attn_masks(torch.Generator().manual_seed(0))[name]
    _run_against_deepspeed(case, padding_kind, attn_mode, attn_mask, None, None, torch.float64)


@pytest.mark.parametrize("padding_kind", PADDINGS, ids=lambda p: f"kp-{p}")
@pytest.mark.parametrize("name", RPES)
def test_an_rpe_not_by_distance_is_a_score_bias_with_its_gradient(name, padding_kind):
    """An rpe that is no function of k - q ([batch, heads, L, L], [batch, 1, L, L] in
    float32, one made from a tensor), and leaves that require a gradient (even one by
    distance, even all zeros): forward and the gradients of q, k, v and the rpe's leaf equal
    DeepSpeed's softmax with the rpe added densely, through every padding kind."""
    case = RPES.index(name) * len(PADDINGS) + PADDINGS.index(padding_kind)
    rpe, leaf = _rpes(torch.Generator().manual_seed(0))[name]
    _run_against_deepspeed(case, padding_kind, "mul", None, rpe, leaf, torch.float64)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("padding_kind", PADDINGS, ids=lambda p: f"kp-{p}")
def test_an_rpe_and_a_finite_additive_mask_add_up(padding_kind, dtype):
    """A dense rpe (a leaf) and a finite 'add' attn_mask that is no band, together: one score
    bias, their sum; gradients of q, k, v and the rpe. float32 runs on the NumPy backend too."""
    g = torch.Generator().manual_seed(5)
    rpe = torch.randn(1, HEADS, SEQ, SEQ, generator=g, dtype=dtype).requires_grad_(True)
    _, mask = _general_attn_masks(g)["add-finite-dilated-inf"]
    case = PADDINGS.index(padding_kind) + (7 if dtype == torch.float32 else 0)
    _run_against_deepspeed(case, padding_kind, "add", mask.to(dtype), rpe, rpe, dtype)


def test_a_general_mul_mask_is_a_bitmask_layout_and_no_score_bias(monkeypatch):
    """A 0/1 mask that is no band restricts the layout exactly (per-block bitmasks, blocks it
    leaves empty not walked), so the kernels run it without a dense bias; a finite 'add' mask
    is the only one that becomes a score_bias."""
    module = ds.SparseSelfAttention(_configs()[1], "mul", "mul", max_seq_length=MAX_LEN)
    calls = []
    real = ds.api.sparse_attention

    def spy(q, k, v, layout, **kwargs):
        calls.append((layout, kwargs.get("score_bias")))
        return real(q, k, v, layout, **kwargs)

    monkeypatch.setattr(ds.api, "sparse_attention", spy)
    q, k, v = _qkv(50)
    keep = _gappy()
    keep[:, 16:24] = False  # key block 2 holds no kept pair: not walked
    module(q, k, v, attn_mask=keep)
    ((layout, bias),) = calls
    assert bias is None and layout.rule.kind == "bitmask" and not layout.blocks[:, :, 2].any()
    calls.clear()
    add = ds.SparseSelfAttention(_configs()[1], "mul", "add", max_seq_length=MAX_LEN)
    add(q, k, v, attn_mask=torch.zeros(SEQ, SEQ).masked_fill(~keep, INF))
    ((layout, bias),) = calls
    assert bias is None and layout.rule.kind == "bitmask"
    calls.clear()
    add(q, k, v, attn_mask=_bias(-1e4, (SEQ, SEQ)))
    ((layout, bias),) = calls
    assert bias.shape == (1, 1, SEQ, SEQ) and layout.rule.kind == "none"


def test_an_rpe_by_distance_stays_a_table_and_any_other_is_a_score_bias(monkeypatch):
    module = ds.SparseSelfAttention(_configs()[0], max_seq_length=MAX_LEN)
    calls = []
    real = ds.api.sparse_attention

    def spy(q, k, v, layout, **kwargs):
        calls.append((kwargs.get("rel_bias"), kwargs.get("score_bias")))
        return real(q, k, v, layout, **kwargs)

    monkeypatch.setattr(ds.api, "sparse_attention", spy)
    q, k, v = _qkv(51)
    embedding = torch.randn(HEADS, 2 * SEQ - 1, dtype=torch.float64, requires_grad=True)
    distance = torch.arange(SEQ)[None, :] - torch.arange(SEQ)[:, None]
    module(q, k, v, rpe=embedding[:, distance + SEQ - 1])
    module(q, k, v, rpe=embedding[:, distance + SEQ - 1].detach().requires_grad_(True))
    module(q, k, v, rpe=torch.zeros(SEQ, SEQ))  # adds nothing: dropped
    (table, none), (no_table, dense), (nothing, nothing_either) = calls
    assert table.shape == (HEADS, 2 * SEQ - 1) and none is None
    assert no_table is None and dense.shape == (1, HEADS, SEQ, SEQ)
    assert nothing is None and nothing_either is None


@pytest.mark.parametrize("kwargs,modes,match", REFUSALS)
def test_refusals_name_the_argument_before_computing(monkeypatch, kwargs, modes, match):
    module = ds.SparseSelfAttention(_configs()[0], *modes, max_seq_length=MAX_LEN)
    q, k, v = _qkv(4)
    _refuse_compute(monkeypatch)
    error = TypeError if "must be" in match and "fit" not in match else ValueError
    with pytest.raises(error, match=match):
        module(q, k, v, **kwargs)


def test_the_band_reader_finds_each_pattern_and_holds_any_other_mask_as_bits():
    for name, (lo, hi) in BANDS.items():
        pairs = ds._pairs(_band_keep(name))
        got = pairs.band
        assert pairs.table is None
        if name == "all":
            assert got is None
        elif name == "nothing":
            assert got == ds.NOTHING
        else:
            # the band as the rows span it: the same pairs, bounds clipped to the sequence
            assert got[0] == max(lo, -(SEQ - 1)) and got[1] == min(hi, SEQ - 1), (name, got)
    q, k = torch.arange(SEQ)[:, None].numpy(), torch.arange(SEQ)[None, :].numpy()
    for keep in (_gappy(), _one_row_differs(), _row_cut_from_band()):
        pairs = ds._pairs(keep)
        assert pairs.band is None and pairs.table.shape == (SEQ, SEQ // 8)
        assert (pairs.kept(q, k) == keep.numpy()).all()
        cover = keep.reshape(SEQ // BLOCK, BLOCK, SEQ // BLOCK, BLOCK).any(3).any(1).numpy()
        assert (pairs.cover(SEQ // BLOCK, SEQ // BLOCK, BLOCK, SEQ) == cover).all()
