"""cuattn.nn: the modules against projections + dense masked SDPA, training, state_dict, compile."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounter

import cuattn
from cuattn.nn import SparseMultiheadAttention, SparseSelfAttention
from tests.helpers.attn_cases import GRAD_RTOL_F64, rel

EMBED, HEADS, KV_HEADS, BLOCK = 32, 4, 2, 16
LOCAL = dict(local_attn_ctx=24)


def _module(seed=0, **kwargs):
    torch.manual_seed(seed)
    args = dict(kv_heads=KV_HEADS, blocksize=BLOCK, dtype=torch.float64, **LOCAL) | kwargs
    return SparseMultiheadAttention(EMBED, HEADS, "local", **args)


def _reference(module, x, mem):
    """The same projections, then SDPA with the layout's element mask and kv heads repeated."""
    n_q, n_k = x.shape[1], mem.shape[1]
    mask = torch.from_numpy(
        cuattn.make_layout("local", n_k, HEADS, BLOCK, n_q=n_q, **LOCAL).to_mask()
    )
    q = cuattn.split_heads(module.q_proj(x), HEADS)
    k, v = (cuattn.split_heads(p(mem), KV_HEADS) for p in (module.k_proj, module.v_proj))
    k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None])
    return module.out_proj(cuattn.merge_heads(out))


@pytest.mark.parametrize("n_q", [40, 64])
def test_multihead_module_equals_projections_and_masked_sdpa(n_q):
    module = _module()
    mem = torch.randn(2, 64, EMBED, dtype=torch.float64)
    x = mem[:, -n_q:].clone().requires_grad_()
    got = module(x, mem)
    want = _reference(module, x, mem)
    assert got.shape == (2, n_q, EMBED)
    assert rel(got.detach(), want.detach()) <= 1e-12
    (gx,) = torch.autograd.grad(got.square().sum(), x)
    (wx,) = torch.autograd.grad(want.square().sum(), x)
    assert rel(gx, wx) <= GRAD_RTOL_F64


def test_multihead_module_trains_and_round_trips_its_state_dict():
    module = _module(seed=1)
    x = torch.randn(2, 48, EMBED, dtype=torch.float64)
    target = torch.randn_like(x)
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = F.mse_loss(module(x), target)
        loss.backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in module.parameters())
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    copy = _module(seed=2)
    copy.load_state_dict(module.state_dict())
    names = {f"{p}_proj.{w}" for p in ("q", "k", "v", "out") for w in ("weight", "bias")}
    assert set(module.state_dict()) == names
    assert torch.equal(copy(x), module(x))


def test_self_attention_module_with_a_layout_and_with_a_name():
    layout = cuattn.make_layout("local", 32, HEADS, BLOCK, **LOCAL)
    q, k, v = (torch.randn(1, HEADS, 32, 8, dtype=torch.float64) for _ in range(3))
    by_layout = SparseSelfAttention(layout)(q, k, v)
    by_name = SparseSelfAttention("local", heads=HEADS, blocksize=BLOCK, **LOCAL)(q, k, v)
    assert torch.equal(by_layout, cuattn.sparse_attention(q, k, v, layout))
    assert torch.equal(by_name, by_layout)
    assert "Pattern('local'" in repr(SparseSelfAttention("local", heads=HEADS, **LOCAL))


def test_modules_take_a_softcap():
    """softcap= on both modules is sparse_attention's; a bad one is refused when the module is
    built, not at its first forward."""
    layout = cuattn.make_layout("local", 32, HEADS, BLOCK, **LOCAL)
    q, k, v = (3 * torch.randn(1, HEADS, 32, 8, dtype=torch.float64) for _ in range(3))
    capped = SparseSelfAttention(layout, softcap=1.5)
    assert torch.equal(capped(q, k, v), cuattn.sparse_attention(q, k, v, layout, softcap=1.5))
    assert not torch.equal(capped(q, k, v), SparseSelfAttention(layout)(q, k, v))
    assert "softcap=1.5" in repr(capped)
    module, plain = _module(softcap=2.0), _module()
    x = torch.randn(2, 32, EMBED, dtype=torch.float64)
    assert module.attention.softcap == 2.0 and not torch.equal(module(x), plain(x))
    with pytest.raises(ValueError, match="softcap must be a positive finite number"):
        SparseSelfAttention(layout, softcap=-1.0)


def test_modules_take_alibi_slopes_as_a_buffer_or_a_learned_parameter():
    layout = cuattn.make_layout("local", 32, HEADS, BLOCK, **LOCAL)
    q, k, v = (torch.randn(1, HEADS, 32, 8, dtype=torch.float64) for _ in range(3))
    slopes = torch.from_numpy(cuattn.alibi_slopes(HEADS))
    fixed = SparseSelfAttention(layout, alibi_slopes=slopes)
    want = cuattn.sparse_attention(q, k, v, layout, alibi_slopes=slopes)
    assert torch.equal(fixed(q, k, v), want)
    assert "alibi_slopes" in dict(fixed.named_buffers()) and not list(fixed.parameters())
    assert "alibi=True" in repr(fixed)
    learned = SparseSelfAttention(layout, alibi_slopes=torch.nn.Parameter(slopes.clone()))
    learned(q, k, v).sum().backward()
    assert learned.alibi_slopes.grad is not None and learned.alibi_slopes.grad.abs().sum() > 0
    module = _module(alibi_slopes=slopes)
    x = torch.randn(2, 32, EMBED, dtype=torch.float64)
    assert not torch.equal(module(x), _module()(x))
    with pytest.raises(TypeError, match="alibi_slopes must be a float32 torch tensor"):
        SparseSelfAttention(layout, alibi_slopes=[0.5] * HEADS)


def test_modules_learn_a_relative_position_table():
    """rel_max_distance gives a parameter [heads, 2M + 1] (zeros: the plain attention at
    first) that is cuattn.sparse_attention's rel_bias and learns (its gradient arrives)."""
    layout = cuattn.make_layout("local", 32, HEADS, BLOCK, **LOCAL)
    q, k, v = (torch.randn(1, HEADS, 32, 8, dtype=torch.float64) for _ in range(3))
    module = SparseSelfAttention(layout, rel_max_distance=6)
    assert dict(module.named_parameters())["rel_bias"].shape == (HEADS, 13)
    assert torch.equal(module(q, k, v), cuattn.sparse_attention(q, k, v, layout))
    with torch.no_grad():
        module.rel_bias.normal_()
    want = cuattn.sparse_attention(q, k, v, layout, rel_bias=module.rel_bias.detach())
    assert torch.equal(module(q, k, v), want)
    module(q, k, v).sum().backward()
    assert module.rel_bias.grad.abs().sum() > 0 and "rel_max_distance=6" in repr(module)
    mha = _module(rel_max_distance=3)
    assert dict(mha.named_parameters())["attention.rel_bias"].shape == (HEADS, 7)
    with pytest.raises(ValueError, match="rel_max_distance must be an int >= 0"):
        SparseSelfAttention(layout, rel_max_distance=-1)


def test_alibi_slopes_are_the_papers():
    """BLOOM's slopes (transformers' build_alibi_tensor) for power-of-two heads and others."""
    bloom = pytest.importorskip("transformers.models.bloom.modeling_bloom")
    for heads in (1, 4, 6, 8, 12, 16):
        alibi = bloom.build_alibi_tensor(torch.ones(1, 2), heads, torch.float32)
        torch.testing.assert_close(
            torch.from_numpy(cuattn.alibi_slopes(heads)), alibi[:, 0, 1], rtol=1e-6, atol=0
        )
    with pytest.raises(ValueError, match="heads must be a positive int"):
        cuattn.alibi_slopes(0)


def test_compiled_module_one_graph_for_every_length():
    module = _module(seed=3)
    counter = CompileCounter()
    compiled = torch.compile(module, backend=counter, fullgraph=True)
    for n in (32, 56, 72):
        x = torch.randn(1, n, EMBED, dtype=torch.float64)
        torch._dynamo.mark_dynamic(x, 1)
        assert torch.equal(compiled(x), module(x))
    assert counter.frame_count == 1


def test_module_errors_name_the_argument():
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        SparseMultiheadAttention(EMBED, HEADS, "all", kv_heads=3)
    with pytest.raises(ValueError, match="embed_dim=30 must be divisible by heads=4"):
        SparseMultiheadAttention(30, HEADS, "all")
    with pytest.raises(ValueError, match="layout is for heads=2"):
        SparseMultiheadAttention(EMBED, HEADS, cuattn.Pattern("all", 2))
    with pytest.raises(TypeError, match="heads is needed"):
        SparseSelfAttention("all")
    with pytest.raises(TypeError, match="apply to a pattern name"):
        SparseSelfAttention(cuattn.Pattern("all", 2), local_attn_ctx=3)


def test_modules_drop_attention_only_while_training():
    layout = cuattn.make_layout("local", 32, HEADS, BLOCK, **LOCAL)
    q, k, v = (torch.randn(1, HEADS, 32, 8, dtype=torch.float64) for _ in range(3))
    module = SparseSelfAttention(layout, dropout=0.3)
    torch.manual_seed(1)
    seed = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    torch.manual_seed(1)
    want = cuattn.sparse_attention(q, k, v, layout, dropout_p=0.3, dropout_seed=seed)
    assert torch.equal(module.train()(q, k, v), want)
    assert torch.equal(module.eval()(q, k, v), cuattn.sparse_attention(q, k, v, layout))
    assert "dropout=0.3" in repr(module)
    mha = _module(dropout=0.1).train()
    x = torch.randn(2, 32, EMBED, dtype=torch.float64)
    mha(x).sum().backward()
    assert all(p.grad is not None for p in mha.parameters())
    with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\)"):
        SparseSelfAttention(layout, dropout=1.5)
