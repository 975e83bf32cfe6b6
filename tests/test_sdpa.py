"""cuattn.scaled_dot_product_attention against PyTorch's own, mask by mask, forward and gradients
(those of a learned additive mask too), and every refusal by name."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from cuattn import sdpa

torch = pytest.importorskip("torch")
F = torch.nn.functional

BATCH, HEADS, KV_HEADS, HEAD_DIM = 2, 4, 2, 16
TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5}


def inputs(n_q: int, n_k: int, dtype=torch.float64, kv_heads: int = KV_HEADS, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, HEADS, n_q, HEAD_DIM, dtype=dtype, generator=gen)
    k, v = (torch.randn(BATCH, kv_heads, n_k, HEAD_DIM, dtype=dtype, generator=gen) for _ in "kv")
    return [x.requires_grad_() for x in (q, k, v)]


def masks(n_q: int, n_k: int) -> dict:
    gen = torch.Generator().manual_seed(1)
    per_head = torch.rand(HEADS, n_q, n_k, generator=gen) > 0.4
    per_head[1, 3] = False  # a row with nothing to attend to
    additive = torch.zeros(1, 1, n_q, n_k, dtype=torch.float64)
    additive[..., ::3] = -torch.inf
    return {
        "none": {},
        "is_causal": {"is_causal": True},
        "bool per head": {"attn_mask": per_head},
        "bool shared": {"attn_mask": per_head[0]},
        "additive": {"attn_mask": additive},
    }


MASKS = ("none", "is_causal", "bool per head", "bool shared", "additive")
CASES = [(n_q, n_k, name) for n_q, n_k in ((70, 70), (50, 90), (90, 50)) for name in MASKS]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n_q, n_k, mask", CASES)
def test_matches_pytorch_forward_and_gradients(n_q, n_k, mask, dtype):
    kwargs = masks(n_q, n_k)[mask]
    if dtype == torch.float32 and "attn_mask" in kwargs and kwargs["attn_mask"].is_floating_point():
        kwargs = {"attn_mask": kwargs["attn_mask"].float()}
    ours_in, theirs_in = inputs(n_q, n_k, dtype), inputs(n_q, n_k, dtype)
    ours = cuattn.scaled_dot_product_attention(*ours_in, enable_gqa=True, **kwargs)
    theirs = F.scaled_dot_product_attention(*theirs_in, enable_gqa=True, **kwargs)
    if mask == "bool per head":  # a row with nothing to attend to gives 0 in both
        assert (ours[:, 1, 3] == 0).all() and (theirs[:, 1, 3] == 0).all()
    torch.testing.assert_close(ours, theirs, atol=TOLERANCE[dtype], rtol=0)
    dout = torch.randn_like(ours)
    ours.backward(dout)
    theirs.backward(dout)
    for a, b in zip(ours_in, theirs_in, strict=True):
        torch.testing.assert_close(a.grad, b.grad, atol=10 * TOLERANCE[dtype], rtol=0)


def test_three_dimensional_inputs_and_a_custom_scale():
    q, k, v = (x[:, 0].detach() for x in inputs(40, 40, kv_heads=HEADS))
    ours = cuattn.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    theirs = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=0)


def test_numpy_inputs_and_mask():
    q, k, v = (x.detach().numpy() for x in inputs(33, 33, kv_heads=HEADS))
    mask = np.random.default_rng(2).random((33, 33)) > 0.5
    mask[:, 0] = True
    ours = cuattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    theirs = F.scaled_dot_product_attention(*map(torch.from_numpy, (q, k, v, mask)))
    np.testing.assert_allclose(ours, theirs.numpy(), atol=1e-12, rtol=0)


def test_masks_take_the_element_rules_where_they_can():
    """An all-True mask runs dense, the square causal mask the causal rule (no bitmask table);
    anything else a bitmask layout over the blocks it touches."""
    n = 100
    plain = (None, False, None, None)
    assert sdpa._mask_layout(np.ones((n, n), bool), 1, HEADS, n, n) == plain
    assert sdpa._mask_layout(np.tri(n, dtype=bool), 1, HEADS, n, n) == (None, True, None, None)
    banded = np.tri(n, dtype=bool) & ~np.tri(n, k=-70, dtype=bool)
    layout, causal, _, pairs = sdpa._mask_layout(banded, 1, HEADS, n, n)
    assert pairs is None  # no score bias: the layout says it all
    assert not causal and layout.rule.kind == "bitmask"
    np.testing.assert_array_equal(layout.to_mask(), np.broadcast_to(banded, (HEADS, n, n)))


def test_dropout_is_cuattns_with_a_seed_from_torchs_generator():
    """dropout_p drops probabilities as sparse_attention does, masks and all: equal to it under
    the seed torch's generator gives after manual_seed; a kept fraction of the (square, causal)
    scores near 1 - p, read back through one-hot values."""
    n, p = 64, 0.2
    q = torch.zeros(1, 1, n, n)
    v = torch.eye(n)[None, None]
    torch.manual_seed(3)
    out = cuattn.scaled_dot_product_attention(q, q, v, is_causal=True, dropout_p=p)
    torch.manual_seed(3)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    want = cuattn.sparse_attention(q, q, v, causal=True, dropout_p=p, dropout_seed=seed)
    assert torch.equal(out, want)
    kept = (out > 0).sum().item() / (n * (n + 1) / 2)
    assert abs(kept - (1 - p)) < 0.05


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"dropout_p": 1.0}, ValueError, "dropout_p"),
        ({"dropout_p": "0"}, TypeError, "dropout_p"),
        ({"is_causal": 1}, TypeError, "is_causal"),
        ({"attn_mask": torch.ones(8, 8, dtype=torch.bool), "is_causal": True}, ValueError, "both"),
        ({"attn_mask": [[True]]}, TypeError, "attn_mask"),
        ({"attn_mask": torch.ones(8, 8, dtype=torch.int32)}, TypeError, "attn_mask"),
        ({"attn_mask": torch.ones(3, 8, 8, dtype=torch.bool)}, ValueError, "broadcast"),
        ({"attn_mask": torch.arange(64.0).reshape(8, 8).half()}, TypeError, "score_bias must"),
    ],
)
def test_refusals_name_the_argument(kwargs, error, match):
    q, k, v = (x.detach() for x in inputs(8, 8, kv_heads=HEADS))
    with pytest.raises(error, match=match):
        cuattn.scaled_dot_product_attention(q, k, v, **kwargs)


def test_refusals_of_shapes():
    q, k, v = (x.detach() for x in inputs(8, 8))
    with pytest.raises(ValueError, match="enable_gqa"):
        cuattn.scaled_dot_product_attention(q, k, v)  # 4 query heads, 2 kv heads
    with pytest.raises(ValueError, match="value's head dim"):
        cuattn.scaled_dot_product_attention(q, k, v[..., :8], enable_gqa=True)
    with pytest.raises(ValueError, match="query must be"):
        cuattn.scaled_dot_product_attention(q[None], k, v, enable_gqa=True)


@pytest.mark.parametrize("form", ["bool_padding", "causal_padding_4d", "additive_key_bias"])
def test_padding_and_per_key_masks_run_as_a_key_bias(form):
    """Masks that differ between batch elements by padded keys (HF's [batch, 1, 1, S] and its
    4-D causal-plus-padding form) and additive masks with one finite value per key equal
    PyTorch's SDPA, forward and gradients, on the rows that attend to something."""
    q, k, v = inputs(12, 12)
    keep = torch.ones(BATCH, 12, dtype=torch.bool)
    keep[1, 8:] = False
    keep[0, :2] = False  # left padding
    if form == "bool_padding":
        mask = keep[:, None, None, :]
    elif form == "causal_padding_4d":
        mask = torch.ones(12, 12, dtype=torch.bool).tril()[None, None] & keep[:, None, None, :]
    else:
        bias = torch.randn(
            BATCH, 1, 1, 12, dtype=q.dtype, generator=torch.Generator().manual_seed(3)
        )
        mask = torch.where(keep[:, None, None, :], bias, float("-inf"))
    ours = cuattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, enable_gqa=True
    )
    rows = mask.expand(BATCH, HEADS, 12, 12)
    rows = rows.any(-1) if rows.dtype == torch.bool else rows.isfinite().any(-1)
    tolerance = TOLERANCE[torch.float64]
    torch.testing.assert_close(ours[rows], want[rows], atol=tolerance, rtol=0)
    w = torch.randn(ours.shape, dtype=ours.dtype) * rows[..., None]
    grads = torch.autograd.grad((ours * w).sum(), (q, k, v))
    wants = torch.autograd.grad((want * w).sum(), (q, k, v))
    for g, ref in zip(grads, wants, strict=True):
        torch.testing.assert_close(g, ref, atol=10 * tolerance, rtol=0)


@pytest.mark.parametrize("form", ["bool", "additive"])
def test_three_dimensional_inputs_broadcast_a_padding_mask_as_pytorch_does(form):
    """query [B, L, E] with a [B, 1, S] padding mask: PyTorch broadcasts the mask against the
    [B, L, S] scores, not against [B, heads, L, S]."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(BATCH, 5, HEAD_DIM, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(BATCH, 130, HEAD_DIM, dtype=torch.float64, generator=gen) for _ in "kv")
    keep = torch.ones(BATCH, 1, 130, dtype=torch.bool)
    keep[1, :, 100:] = False
    mask = (
        keep
        if form == "bool"
        else torch.zeros(keep.shape, dtype=q.dtype).masked_fill(~keep, -torch.inf)
    )
    ours = cuattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(ours, want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match=r"does not broadcast to \[batch, L, S\]"):
        cuattn.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, :, :129])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16])
def test_finfo_min_masks_as_transformers_builds_them_equal_pytorch(dtype):
    """An additive causal-plus-padding mask holding torch.finfo(dtype).min where masked (what
    transformers builds for SDPA) masks those pairs: PyTorch's softmax gives them exactly 0
    wherever a row keeps a key. A row whose every key holds finfo.min is 0 here (cuattn's rule
    for a row with nothing to attend to); PyTorch returns the mean of the values there when the
    value absorbs the scores (float32, float64; float16's is not large enough to)."""
    n = 24
    q, k, v = (x.detach().to(dtype) for x in inputs(n, n))
    keep = torch.ones(BATCH, n, dtype=torch.bool)
    keep[1, :5] = False  # left padding: row 1's first queries see nothing
    allowed = torch.ones(n, n, dtype=torch.bool).tril()[None] & keep[:, None, :]
    lowest = torch.finfo(dtype).min
    mask = torch.zeros(BATCH, 1, n, n, dtype=dtype).masked_fill(~allowed[:, None], lowest)
    ours = cuattn.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    rows = allowed.any(-1)[:, None].expand(BATCH, HEADS, n)
    atol = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(ours[rows], want[rows], atol=atol, rtol=0)
    assert (ours[~rows] == 0).all()
    if dtype != torch.float16:
        values = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
        uniform = values.mean(2, keepdim=True).expand(-1, -1, n, -1)[~rows]
        torch.testing.assert_close(want[~rows], uniform, atol=atol, rtol=0)
    # a large negative value above half the lowest is a bias on the pair: a score bias, as
    # PyTorch adds it (on the rows that keep a key; the others are cuattn's 0 and PyTorch's mean)
    biased = mask.masked_fill(~allowed[:, None], lowest / 4)
    ours = cuattn.scaled_dot_product_attention(q, k, v, attn_mask=biased, enable_gqa=True)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=biased, enable_gqa=True)
    torch.testing.assert_close(ours[rows], want[rows], atol=atol, rtol=0)


def test_bfloat16_cpu_tensors_run_on_the_interpreter():
    """The NumPy backend has no bfloat16: with no backend chosen, CPU bfloat16 tensors run on
    the kernel interpreter, forward and backward, within bfloat16's precision of float64."""
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 40, 32, generator=gen, dtype=torch.float64) for _ in "qkv")
    low = [x.to(torch.bfloat16).requires_grad_() for x in (q, k, v)]
    exact = [x.to(torch.bfloat16).double().requires_grad_() for x in (q, k, v)]
    ours = cuattn.scaled_dot_product_attention(*low, is_causal=True)
    want = F.scaled_dot_product_attention(*exact, is_causal=True)
    assert ours.dtype == torch.bfloat16
    torch.testing.assert_close(ours.double(), want, atol=2e-2, rtol=0)
    dout = torch.randn(ours.shape, generator=gen, dtype=torch.float64)
    ours.backward(dout.to(torch.bfloat16))
    want.backward(dout)
    for a, b in zip(low, exact, strict=True):
        torch.testing.assert_close(a.grad.double(), b.grad, atol=6e-2, rtol=0)
    assert sdpa._default_backend(low[0]) == "interp"
    assert sdpa._default_backend(low[0].half()) is None  # NumPy takes float16


def _pair_masks(n: int) -> dict:
    """Masks that run with the mask as a dense score bias: a bias on each pair, a boolean mask
    that differs between batch elements by more than padded keys, -inf and finite values mixed,
    a 3-D mask, and a learned bias (it carries a gradient)."""
    gen = torch.Generator().manual_seed(9)
    per_batch = torch.ones(BATCH, 1, n, n, dtype=torch.bool)
    per_batch[1, :, 2, 3] = False  # one pair, not a key: no rule plus padding
    mixed = torch.randn(BATCH, HEADS, n, n, dtype=torch.float64, generator=gen)
    mixed[0, :, :, 5] = -torch.inf
    mixed[1, 1, 3] = -torch.inf  # a row with nothing to attend to
    mixed[1, 2, 4, :3] = -torch.inf
    learned = torch.randn(1, HEADS, n, n, dtype=torch.float64, generator=gen)
    return {
        "per pair": torch.arange(float(n * n), dtype=torch.float64).reshape(n, n) / 50,
        "bool per batch": per_batch,
        "mixed": mixed,
        "by batch and pair": torch.randn(BATCH, 1, n, n, dtype=torch.float64, generator=gen),
        "learned": learned.requires_grad_(),
    }


@pytest.mark.parametrize("case", list(_pair_masks(12)))
def test_every_other_mask_runs_as_a_score_bias_and_equals_pytorch(case):
    """What no layout rule plus key bias can say runs with the mask as sparse_attention's
    score_bias: forward and gradients equal PyTorch's on the rows that keep a key (a row that
    keeps none is 0 here, cuattn's rule), the learned mask's gradient too."""
    mask = _pair_masks(12)[case]
    q, k, v = inputs(12, 12, kv_heads=HEADS)
    ours = cuattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    dout = torch.randn(ours.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    wrt = [q, k, v] + ([mask] if mask.requires_grad else [])
    got = torch.autograd.grad(ours, wrt, dout)
    want_out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    rows = (
        torch.isfinite(want_out).all(-1) & ~(mask == -torch.inf).all(-1).expand_as(want_out[..., 0])
        if mask.dtype != torch.bool
        else torch.ones_like(want_out[..., 0], dtype=torch.bool)
    )
    torch.testing.assert_close(ours[rows], want_out[rows], atol=1e-12, rtol=0)
    assert (ours[~rows] == 0).all()
    want = torch.autograd.grad(want_out, wrt, torch.where(rows[..., None], dout, 0.0))
    masked = torch.where(rows[..., None], dout, 0.0)
    got = torch.autograd.grad(
        cuattn.scaled_dot_product_attention(q, k, v, attn_mask=mask), wrt, masked
    )
    for name, a, b in zip(["dq", "dk", "dv", "dmask"], got, want, strict=False):
        torch.testing.assert_close(a, torch.nan_to_num(b, nan=0.0), atol=1e-12, rtol=0, msg=name)


def test_a_3d_call_takes_a_per_pair_mask():
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(BATCH, 10, HEAD_DIM, dtype=torch.float64, generator=gen) for _ in "qkv")
    mask = torch.randn(BATCH, 10, 10, dtype=torch.float64, generator=gen)
    ours = cuattn.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(ours, want, atol=1e-12, rtol=0)
