"""torch tensors through the public API: autograd gradients vs a dense masked torch oracle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from tests.helpers.attn_cases import (
    BLOCK,
    GRAD_RTOL_F64,
    HEADS,
    MODES,
    random_qkv,
    rel,
    torch_dense,
)

BF16_RTOL = 2e-2  # bf16 inputs, float32 accumulation, against float64


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_grads_match_dense_torch_autograd(mode, recompute):
    kwargs, mask = MODES[mode]
    arrays = random_qkv(seed=sorted(MODES).index(mode))
    weight = torch.from_numpy(np.random.default_rng(5).standard_normal(arrays[0].shape))

    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = cuattn.blocksparse_attention(
        *leaves, heads=HEADS, blocksize=BLOCK, recompute=recompute, **kwargs
    )
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float64
    assert out.requires_grad and out.device.type == "cpu"
    (out * weight).sum().backward()

    ref_leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    ref = torch_dense(*ref_leaves, mask)
    (ref * weight).sum().backward()

    assert rel(out.detach(), ref.detach()) <= GRAD_RTOL_F64
    for name, got, want in zip("qkv", leaves, ref_leaves, strict=True):
        assert rel(got.grad, want.grad) <= GRAD_RTOL_F64, name


def _saved_bytes(fn):
    """Bytes of floating-point tensors autograd saves while running fn (each storage once); the
    layout's index tensors it also saves share the Layout's own arrays, costing nothing new."""
    storages = {}

    def pack(t):
        if t.is_floating_point():
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn()
    return result, sum(storages.values())


def test_recompute_saves_only_qkv_and_gives_identical_grads():
    lay = cuattn.make_layout("local", 64, HEADS, blocksize=BLOCK, local_attn_ctx=16)
    rng = np.random.default_rng(11)
    arrays = [rng.standard_normal((2, HEADS, 64, 8)) for _ in range(3)]
    grads, saved = {}, {}
    for recompute in (False, True):
        leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
        (out, lse), saved[recompute] = _saved_bytes(
            lambda leaves=leaves, r=recompute: cuattn.sparse_attention(
                *leaves, lay, recompute=r, return_lse=True
            )
        )
        assert lse.requires_grad  # a differentiable output (tests/autograd/test_lse_gradient.py)
        out.pow(2).sum().backward()
        grads[recompute] = [t.grad for t in leaves]
    assert saved[False] - saved[True] == out.nbytes + lse.element_size() * lse.nelement()
    assert saved[True] == 3 * out.nbytes
    for a, b in zip(grads[False], grads[True], strict=True):
        assert torch.equal(a, b)


def test_float32_keeps_dtype_and_matches():
    kwargs, mask = MODES["fixed"]
    arrays = random_qkv(3, np.float32)
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = cuattn.blocksparse_attention(*leaves, heads=HEADS, blocksize=BLOCK, **kwargs)
    assert out.dtype == torch.float32
    out.sum().backward()
    assert leaves[0].grad.dtype == torch.float32
    ref_leaves = [torch.tensor(a.astype(np.float64), requires_grad=True) for a in arrays]
    torch_dense(*ref_leaves, mask).sum().backward()
    assert rel(leaves[1].grad, ref_leaves[1].grad) <= 1e-5


def test_no_grad_tensors_and_inference_mode_return_torch():
    kwargs, mask = MODES["local"]
    arrays = random_qkv(4)
    tensors = [torch.from_numpy(a) for a in arrays]
    ref = torch_dense(*tensors, mask)
    out = cuattn.blocksparse_attention(*tensors, heads=HEADS, blocksize=BLOCK, **kwargs)
    assert isinstance(out, torch.Tensor) and not out.requires_grad
    assert rel(out, ref) <= 1e-12
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    with torch.no_grad():
        out = cuattn.blocksparse_attention(*leaves, heads=HEADS, blocksize=BLOCK, **kwargs)
    assert not out.requires_grad and rel(out, ref) <= 1e-12


@pytest.mark.parametrize("mode", ["all", "local", "strided"])
def test_dense_path_attention_grads(mode):
    kwargs, mask = MODES[mode]
    arrays = random_qkv(seed=30)
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    cuattn.attention(*leaves, heads=HEADS, recompute=True, **kwargs).square().sum().backward()
    ref_leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    torch_dense(*ref_leaves, mask).square().sum().backward()
    for got, want in zip(leaves, ref_leaves, strict=True):
        assert rel(got.grad, want.grad) <= GRAD_RTOL_F64


def test_double_backward_is_refused():
    kwargs, _ = MODES["all"]
    leaves = [torch.tensor(a, requires_grad=True) for a in random_qkv(seed=31)]
    out = cuattn.blocksparse_attention(*leaves, heads=HEADS, blocksize=BLOCK, **kwargs)
    (gq,) = torch.autograd.grad(out.square().sum(), leaves[0], create_graph=True)
    with pytest.raises(RuntimeError, match="differentiate twice"):
        gq.sum().backward()


# A side-stream case the kernels serve: [batch, time, heads * head_dim], bf16, local window.
SIDE_STREAM_CASE = dict(batch=2, n_ctx=384, heads=2, head_dim=64, blocksize=32, window=80)
SLEEP_CYCLES = 50_000_000  # ~25 ms of a spinning kernel at GPU clocks: inputs are written late


@pytest.mark.gpu
def test_cuda_tensors_on_a_side_stream_with_autograd():
    """bf16 CUDA tensors produced on a non-default torch stream after a delay: cuattn must run
    on that stream (a launch on any other stream would read the inputs before they exist), and
    its autograd gradients must match float64 dense attention."""
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    c = SIDE_STREAM_CASE
    width = c["heads"] * c["head_dim"]
    arrays = [
        np.random.default_rng(40 + i).standard_normal((c["batch"], c["n_ctx"], width))
        for i in range(3)
    ]
    weight = np.random.default_rng(43).standard_normal(arrays[0].shape)
    kwargs = dict(heads=c["heads"], attn_mode="local", local_attn_ctx=c["window"])
    kwargs.update(blocksize=c["blocksize"])
    staged = [torch.tensor(a, dtype=torch.bfloat16, device="cuda") for a in arrays]
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.cuda._sleep(SLEEP_CYCLES)
        leaves = [s.clone().requires_grad_() for s in staged]
        out = cuattn.blocksparse_attention(*leaves, **kwargs)
        (out.float() * torch.tensor(weight, device="cuda")).sum().backward()
    side.synchronize()
    assert out.dtype == torch.bfloat16 and out.device.type == "cuda"

    layout = cuattn.make_layout(
        "local", c["n_ctx"], c["heads"], blocksize=c["blocksize"], local_attn_ctx=c["window"]
    )
    # The oracle sees exactly the bf16 values the kernels saw.
    ref_leaves = [s.double().cpu().requires_grad_() for s in staged]
    ref = torch_dense(*ref_leaves, layout.to_mask(), heads=c["heads"])
    (ref * torch.from_numpy(weight)).sum().backward()
    assert rel(out.detach().double().cpu(), ref.detach()) < BF16_RTOL
    for name, got, want in zip("qkv", leaves, ref_leaves, strict=True):
        assert rel(got.grad.double().cpu(), want.grad) < BF16_RTOL, name
