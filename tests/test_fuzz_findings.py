"""What the differential fuzzer (tests/fuzz) found, each kept as its minimal reproducer."""

from __future__ import annotations

import numpy as np
import pytest

import cuattn

torch = pytest.importorskip("torch")


def test_block_pattern_rows_before_every_key_see_nothing():
    """A block-defined pattern whose blocks happen to be all on is not the `all` pattern: with
    more queries than keys, its rows before every key see nothing (they saw every key)."""
    kwargs = dict(n_ctx=4, heads=1, blocksize=4, local_attn_ctx=4, causal=False, n_q=8)
    fixed = cuattn.make_layout("fixed", **kwargs)
    assert not fixed.to_mask()[0, :4].any() and fixed.to_mask()[0, 4:].all()
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 1, 8, 16))
    k, v = (rng.standard_normal((1, 1, 4, 16)) for _ in range(2))
    out, lse = cuattn.sparse_attention(q, k, v, fixed, return_lse=True)
    assert not out[0, 0, :4].any() and np.isneginf(lse[0, 0, :4]).all()
    dense = cuattn.make_layout("all", 4, 1, 4, causal=False, n_q=8)  # the rule says every key
    assert dense.to_mask()[0].all()


def test_end_aligned_document_rows_before_every_key_do_not_wrap():
    """The document rule was asked about negative positions (IndexError, or a silent wrap)."""
    doc = cuattn.make_layout(
        "document", n_ctx=2, heads=1, blocksize=2, causal=False, doc_lengths=(2,), n_q=8
    )
    assert not doc.allowed(0, 0, 0)
    assert doc.to_mask()[0].sum(axis=1).tolist() == [0] * 6 + [2, 2]
    one = cuattn.make_layout("all", n_ctx=1, heads=1, blocksize=2, n_q=1)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((9, 1, 16))
    k, v = (rng.standard_normal((3, 1, 16)) for _ in range(2))
    cu_q, cu_k = np.array([0, 1, 9], np.int32), np.array([0, 1, 3], np.int32)
    out = cuattn.sparse_attention_varlen(q, k, v, cu_q, cu_k, [one, doc])
    assert not out[1:7].any()


def test_interp_backward_of_a_permuted_single_token():
    """dlse of shape [batch, heads, 1] may carry any last stride; the interpreter refused it."""
    lay = cuattn.make_layout("strided", n_ctx=1, heads=2, blocksize=1, local_attn_ctx=1)
    x = cuattn.Tensor(np.random.default_rng(2).standard_normal((3, 2, 1, 32)), requires_grad=True)
    x32 = cuattn.Tensor(x.data.astype(np.float32), requires_grad=True)
    cuattn.sparse_attention(x32, x32, x32, lay, backend="interp").backward(
        np.ones((3, 2, 1, 32), np.float32)
    )
    cuattn.sparse_attention(x, x, x, lay).backward(np.ones((3, 2, 1, 32)))
    np.testing.assert_allclose(x32.grad, x.grad, atol=1e-5)


@pytest.mark.parametrize("special", ["k", "k and v"])
def test_rows_past_the_sequence_end_stay_out_of_dk_dv(special):
    """The dK/dV kernel's last, ragged step held zero-filled query rows past n_q whose 0 * inf
    (an infinite key or value) made dK, dV NaN where NumPy and a dense computation give 0 or
    their own NaN pattern. Both backends now agree element for element."""
    lay = cuattn.make_layout("all", n_ctx=1, heads=1, blocksize=16, causal=False)
    grads = {}
    for backend in ("numpy", "interp"):
        q = torch.ones(1, 1, 1, 16, requires_grad=True)
        k, v = torch.ones(1, 1, 1, 16), torch.ones(1, 1, 1, 16)
        k[..., 0] = -float("inf")
        if special == "k and v":
            v[..., 3] = float("inf")
        k.requires_grad_(), v.requires_grad_()
        cuattn.sparse_attention(q, k, v, lay, backend=backend).sum().backward()
        grads[backend] = [x.grad for x in (q, k, v)]
    for a, b in zip(grads["numpy"], grads["interp"], strict=True):
        assert torch.equal(torch.isnan(a), torch.isnan(b))
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))
    if special == "k":  # a row whose only score is -inf: lse -inf, no gradient in k or v
        assert not grads["interp"][1].any() and not grads["interp"][2].any()


def test_tape_hands_each_output_its_own_dtype_of_gradient():
    """A loss that adds the float32 lse to a float16 output sent float32 gradients into the
    float16 attention's backward, which the kernel backends refuse; the tape casts them, as
    torch's engine does."""
    x = cuattn.Tensor(
        np.random.default_rng(3).standard_normal((1, 1, 32, 16)).astype(np.float16),
        requires_grad=True,
    )
    layout = cuattn.make_layout("all", 32, 1, 16)
    out, lse = cuattn.sparse_attention(x, x, x, layout, return_lse=True, backend="interp")
    (out.sum() + lse.sum()).backward()
    assert x.grad.dtype == np.float16 and np.isfinite(x.grad).all()


def test_the_yardstick_rounds_gqa_gradients_as_the_kernels_do():
    """float16, GQA 4:1, one query: the kernels' dK is 2.05x the yardstick's error when the
    yardstick summed the group's per-head gradients in float32 and multiplied P and dS unrounded;
    the kernels (and a float16 dense GQA: its repeated K sums fp16 gradients) round dK per query
    head, and feed P and dS to the tensor cores in float16. The yardstick now does the same and
    the case is within it (the NumPy backend and the same case without GQA were all along)."""
    pytest.importorskip("jax")
    from tests.fuzz.strategies import Case, LayoutSpec, Shape, Special
    from tests.fuzz.test_differential import run_attention_case

    layout = LayoutSpec(
        kind="named",
        blocksize=16,
        mode="longformer",
        options=(("causal", False), ("global_tokens", ()), ("local_attn_ctx", 4)),
        as_pattern=True,
        density=1.0,
        empty_rows=(),
        rule="none",
        seed=0,
    )
    run_attention_case(
        Case(
            path="plain",
            front="jax",
            backend="interp",
            dtype="float16",
            shape=Shape(batch=2, heads=4, kv_heads=1, n_q=1, n_k=8, head_dim=128),
            layout=layout,
            special=Special(kind="denormal", target="q", count=1),
            scale=-0.8638987349216345,
            grad=True,
            recompute=True,
            seed=1519,
        )
    )
