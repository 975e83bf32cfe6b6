"""torch.compile, torch.library.opcheck, autocast and CUDA graphs on cuattn's torch custom ops."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch
from torch._dynamo.testing import CompileCounter

import cuattn
from cuattn.adapters import torch_ops
from cuattn.backends.call import NO_MODS, AttentionCall, ScoreMods
from tests.helpers.attn_cases import GRAD_RTOL_F64, rel

HEADS, BLOCK, HEAD_DIM = 2, 16, 16
FIXED = dict(local_attn_ctx=32, num_verts=2, vertsize=1)
# The CUDA-graph test's 64-blocks: a fixed group is a whole number of blocks (the H100 run of
# 2026-11-25 met local_attn_ctx=32 refused at blocksize 64).
GRAPH_FIXED = dict(FIXED, local_attn_ctx=128)


def _leaves(seed, shapes, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen, dtype=dtype).requires_grad_() for s in shapes]


def _grads(fn, leaves):
    for x in leaves:
        x.grad = None
    loss = fn(*leaves)
    loss.backward()
    return loss.detach(), [x.grad.clone() for x in leaves]


def _model(q, k, v):
    """An attention step as a model writes it: [batch, time, embd] in, a loss out."""
    out = cuattn.blocksparse_attention(
        q, k, v, heads=HEADS, attn_mode="fixed", blocksize=BLOCK, **FIXED
    )
    return (out.tanh() * q).sum()


def test_fullgraph_compile_has_no_graph_break_and_gives_the_eager_gradients():
    leaves = _leaves(0, [(2, 96, HEADS * HEAD_DIM)] * 3)
    explained = torch._dynamo.explain(_model)(*leaves)
    assert explained.graph_break_count == 0 and explained.graph_count == 1
    compiled = torch.compile(_model, backend="aot_eager", fullgraph=True)
    loss_c, grads_c = _grads(compiled, leaves)
    loss_e, grads_e = _grads(_model, leaves)
    assert torch.equal(loss_c, loss_e)
    for name, a, b in zip("qkv", grads_c, grads_e, strict=True):
        assert torch.equal(a, b), name


def test_inductor_compiled_layout_call_matches_eager_and_the_oracle():
    layout = cuattn.make_layout("local", 64, HEADS, blocksize=BLOCK, local_attn_ctx=24, n_q=48)

    def step(q, k, v):
        out = cuattn.sparse_attention(q, k, v, layout, recompute=True)
        return (out * out).sum()

    leaves = _leaves(1, [(2, HEADS, 48, HEAD_DIM), (2, 1, 64, HEAD_DIM), (2, 1, 64, HEAD_DIM)])
    _, grads_c = _grads(torch.compile(step, fullgraph=True), leaves)
    _, grads_e = _grads(step, leaves)
    for name, a, b in zip("qkv", grads_c, grads_e, strict=True):
        assert rel(a, b) <= GRAD_RTOL_F64, name


def test_a_dynamic_length_compiles_once_for_every_length():
    counter = CompileCounter()
    compiled = torch.compile(_model, backend=counter, fullgraph=True)
    for n in (48, 80, 112, 160):
        leaves = _leaves(n, [(1, n, HEADS * HEAD_DIM)] * 3)
        for x in leaves:
            torch._dynamo.mark_dynamic(x, 1)
        _, grads_c = _grads(compiled, leaves)
        _, grads_e = _grads(_model, leaves)
        for a, b in zip(grads_c, grads_e, strict=True):
            assert torch.equal(a, b)
    assert counter.frame_count == 1


def _op_args(q, k, v, layout, recompute=False, mods=NO_MODS):
    call = AttentionCall(layout, 0.3, recompute, mods=mods)
    return (q, k, v, *torch_ops.op_arguments(call, q.device))


@pytest.mark.parametrize(
    "case",
    ["square_f64", "gqa_fewer_queries_f32", "strided_q_recompute", "pattern", "softcap", "dropout"],
)
def test_opcheck_passes_on_both_ops(case):
    dtype = torch.float32 if case.endswith("f32") else torch.float64
    n_q, kv_heads = (32, 1) if "gqa" in case else (64, HEADS)
    layout = cuattn.make_layout("fixed", 64, HEADS, blocksize=BLOCK, n_q=n_q, **FIXED)
    if case == "pattern":
        layout = cuattn.Pattern("fixed", HEADS, BLOCK, **FIXED)
    q, k, v = _leaves(7, [(2, HEADS, n_q, HEAD_DIM), *[(2, kv_heads, 64, HEAD_DIM)] * 2], dtype)
    if case.startswith("strided"):
        q = torch.randn(2, n_q, HEADS, HEAD_DIM, dtype=dtype).transpose(1, 2).requires_grad_()
    mods = {
        "softcap": ScoreMods(softcap=0.7),
        "dropout": ScoreMods().with_dropout(0.25, 2**62 + 5),
    }.get(case, NO_MODS)
    args = _op_args(q, k, v, layout, recompute="recompute" in case, mods=mods)
    torch.library.opcheck(torch.ops.cuattn.attention_fwd.default, args)
    out, lse = torch.ops.cuattn.attention_fwd(*args)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    saved = tuple(x.detach() for x in (q, k, v, out, lse, dout))
    for lse_grad in (dlse, None):  # the lse's gradient, or nothing reached it
        # attention_bwd takes attention_fwd's arguments but recompute
        bwd_args = saved + (lse_grad,) + args[3:-4] + args[-3:]
        torch.library.opcheck(torch.ops.cuattn.attention_bwd.default, bwd_args)


def test_autocast_leaves_the_input_dtype():
    """The ops are on no autocast list: inside an autocast region they compute in the dtype
    q, k, v arrive in (a model's projections already produce the autocast dtype there)."""
    layout = cuattn.make_layout("local", 64, HEADS, blocksize=BLOCK, local_attn_ctx=24)
    q, k, v = _leaves(3, [(1, HEADS, 64, HEAD_DIM)] * 3, torch.float32)
    plain = cuattn.sparse_attention(q, k, v, layout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        inside = cuattn.sparse_attention(q, k, v, layout)
    assert inside.dtype == torch.float32 and torch.equal(inside, plain)


def test_a_layout_crosses_the_ops_as_its_arrays_made_once_per_device():
    """No registry: a concrete Layout reaches the ops as tensors sharing its arrays (CPU), made
    once and kept while the Layout lives."""
    blocks = np.ones((HEADS, 2, 2), dtype=bool)
    layout = cuattn.Layout.from_blocks(blocks, BLOCK, mask_fn=lambda h, q, k: k <= q + h)
    q = torch.randn(1, HEADS, 2 * BLOCK, HEAD_DIM)
    *layout_args, _, index, operands, given = torch_ops.op_arguments(
        AttentionCall(layout, 1.0), q.device
    )
    assert (operands, given) == ([], 0)
    assert layout_args == ["", [BLOCK, 3, 0, 0], [1.0, 0.0, 0.0], 0, ""]
    assert index[1].data_ptr() == layout.row_ptr.ctypes.data  # shared, not copied
    again = torch_ops.op_arguments(AttentionCall(layout, 1.0), q.device)[-3]
    assert all(a is b for a, b in zip(index, again, strict=True))
    out, _ = torch.ops.cuattn.attention_fwd(q, q, q, *layout_args, False, index, [], 0)
    assert torch.equal(out, cuattn.sparse_attention(q, q, q, layout, scale=1.0))


def test_pattern_is_a_plain_value():
    pattern = cuattn.Pattern("fixed", HEADS, BLOCK, **FIXED)
    assert cuattn.Pattern.from_key(pattern.key) == pattern
    assert pattern.layout(48, 64) is cuattn.make_layout("fixed", 64, HEADS, BLOCK, n_q=48, **FIXED)
    assert "local_attn_ctx=32" in repr(pattern)
    with pytest.raises(ValueError, match="mode must be one of"):
        cuattn.Pattern("nope", HEADS)
    with pytest.raises(TypeError, match="takes no n_ctx"):
        cuattn.Pattern("all", HEADS, n_ctx=64)
    with pytest.raises(TypeError, match="local_attn_ctx must be a bool, int"):
        cuattn.Pattern("local", HEADS, local_attn_ctx=object())
    with pytest.raises(ValueError, match="Pattern for heads=2"):
        q = torch.randn(1, 3, 32, HEAD_DIM)
        cuattn.sparse_attention(q, q, q, pattern)


@pytest.mark.gpu
def test_a_cuda_graph_replays_forward_and_backward():
    """Captured after one warm-up call (kernels compiled, layout on the device), a training
    step replays in a CUDA graph: no host synchronisation, every allocation from torch's
    caching allocator, and the replayed gradients equal the eager ones."""
    if not torch.cuda.is_available():
        pytest.skip("needs torch with CUDA")
    layout = cuattn.make_layout("fixed", 256, HEADS, blocksize=64, **GRAPH_FIXED)
    gen = torch.Generator(device="cuda").manual_seed(5)
    qkv = [
        torch.randn(2, HEADS, 256, 64, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(3)
    ]
    leaves = [x.clone().requires_grad_() for x in qkv]

    def step():
        out = cuattn.sparse_attention(*leaves, layout)
        out.float().square().sum().backward()
        return out

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compile, upload the layout
    torch.cuda.current_stream().wait_stream(side)
    for x in leaves:
        x.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    graph.replay()
    torch.cuda.synchronize()
    eager = [x.clone().requires_grad_() for x in qkv]
    want = cuattn.sparse_attention(*eager, layout)
    want.float().square().sum().backward()
    assert torch.equal(out, want)
    for name, a, b in zip("qkv", leaves, eager, strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_a_layout_built_inline_lives_until_backward():
    """The ops take a Layout's arrays and save them for backward, so a layout the caller builds
    for one call and drops is still readable when backward runs."""
    q, k, v = _leaves(9, [(1, HEADS, 2 * BLOCK, HEAD_DIM)] * 3)
    blocks = np.ones((HEADS, 2, 2), dtype=bool)
    out = cuattn.sparse_attention(q, k, v, cuattn.Layout.from_blocks(blocks, BLOCK))
    gc.collect()
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_varlen_runs_under_compile_with_its_layout_built_outside_the_graph():
    """The packed layout is host work on cu_seqlens: it runs outside the compiled graph (dynamo
    used to trace into its NumPy construction and fail), and the result equals eager."""
    q, k, v = _leaves(5, [(40, HEADS, HEAD_DIM)] * 3, torch.float64)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)

    def layout_for(n_q, n_k):
        return cuattn.make_layout("local", n_k, HEADS, BLOCK, local_attn_ctx=8, n_q=n_q)

    def run(q, k, v):
        return cuattn.sparse_attention_varlen(q, k, v, cu, cu, layout_for)

    compiled = torch.compile(run, backend="aot_eager")(q, k, v)
    (compiled * compiled).sum().backward()
    compiled_grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    eager = run(q, k, v)
    (eager * eager).sum().backward()
    assert torch.equal(compiled, eager)
    for got, want in zip(compiled_grads, (q.grad, k.grad, v.grad), strict=True):
        assert rel(got, want) <= GRAD_RTOL_F64
