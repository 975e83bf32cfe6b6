"""Attention on the tape: gradients vs dense torch autograd, recompute identity and bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn.autograd.tape import Tensor, saved_nbytes
from dev.tinylm_ops import merge_heads, split_heads
from tests.helpers import attn_cases as cases
from tests.helpers.attn_cases import random_qkv, rel, torch_dense


@pytest.mark.parametrize("mode", sorted(cases.MODES))
def test_tape_grads_match_dense_and_recompute_is_bit_identical(mode):
    kwargs, mask = cases.MODES[mode]
    arrays = random_qkv(seed=40 + sorted(cases.MODES).index(mode))
    weight = np.random.default_rng(8).standard_normal(arrays[0].shape)

    ref_leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    (torch_dense(*ref_leaves, mask) * torch.from_numpy(weight)).sum().backward()

    grads = {}
    for recompute in (False, True):
        leaves = [Tensor(a.copy(), requires_grad=True) for a in arrays]
        out = cuattn.blocksparse_attention(
            *leaves, heads=cases.HEADS, blocksize=cases.BLOCK, recompute=recompute, **kwargs
        )
        assert isinstance(out, Tensor) and out.dtype == np.float64
        (out * weight).sum().backward()
        grads[recompute] = [t.grad for t in leaves]
    for name, plain, again, want in zip("qkv", grads[False], grads[True], ref_leaves, strict=True):
        assert rel(plain, want.grad) <= cases.GRAD_RTOL_F64, name
        assert np.array_equal(plain, again), name


def test_attention_recompute_drops_out_and_lse():
    lay = cuattn.make_layout("all", 64, cases.HEADS, blocksize=cases.BLOCK)
    rng = np.random.default_rng(9)
    q, k, v = (
        Tensor(rng.standard_normal((2, cases.HEADS, 64, 8)), requires_grad=True) for _ in "qkv"
    )
    out, lse = cuattn.sparse_attention(q, k, v, lay, return_lse=True)
    plain = saved_nbytes(out)
    again = cuattn.sparse_attention(q, k, v, lay, recompute=True)
    assert plain == 3 * q.data.nbytes + out.data.nbytes + lse.data.nbytes
    assert plain - saved_nbytes(again) == out.data.nbytes + lse.data.nbytes


def _attention_block(x, wq, wk, wv, wo, layout):
    """Projection, split heads, sparse attention, merge heads, output projection."""
    q, k, v = (split_heads(x @ w, cases.HEADS) for w in (wq, wk, wv))
    return merge_heads(cuattn.sparse_attention(q, k, v, layout)) @ wo


def test_recompute_region_around_an_attention_block():
    batch, n_ctx, width = 2, 64, 16
    lay = cuattn.make_layout("local", n_ctx, cases.HEADS, blocksize=cases.BLOCK, local_attn_ctx=16)
    rng = np.random.default_rng(10)
    x0 = rng.standard_normal((batch, n_ctx, width))
    weights0 = [rng.standard_normal((width, width)) / 4 for _ in range(4)]
    target = rng.standard_normal((batch, n_ctx, width))

    results = {}
    for use_region in (False, True):
        x = Tensor(x0.copy(), requires_grad=True)
        weights = [Tensor(w.copy(), requires_grad=True) for w in weights0]
        with cuattn.recompute(use_region):
            y = _attention_block(x, *weights, lay)
        results[use_region] = saved_nbytes(y)
        ((y - target) * (y - target)).mean().backward()
        results[use_region, "grads"] = [t.grad for t in (x, *weights)]

    # Plain keeps x and four weights (the region's inputs) plus, per projection, the head-split
    # copy saved by attention (3x), attention's out and lse, and the merged heads saved by the
    # output matmul. The region keeps only its inputs.
    act = batch * n_ctx * width * 8
    lse = batch * cases.HEADS * n_ctx * 8
    inputs = act + 4 * width * width * 8
    assert results[True] == inputs
    assert results[False] - results[True] == 5 * act + lse
    for a, b in zip(results[False, "grads"], results[True, "grads"], strict=True):
        assert np.array_equal(a, b)
