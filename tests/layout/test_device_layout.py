"""Layouts built by kernels/layout_build.cu (cuattn.dynamic on the device): every selection and
index kernel on the interpreter, the DeviceLayout against the host Layout of the same blocks, and
attention on it through every route. The gpu tests check what only a GPU can: no host
synchronisation, and the whole step captured in a CUDA graph."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn import dynamic
from cuattn._util import widened
from cuattn.autograd.tape import Tensor
from cuattn.backends import geometry, interp, layout_build
from cuattn.backends.call import AttentionCall
from cuattn.backends.geometry import LayoutKernelConfig
from cuattn.layout.device import DeviceLayout
from cuattn.layout.dynamic import host_vertical_slash_layout
from cuattn.layout.layout import RULE_KINDS, ElementRule, Layout
from tests.helpers.no_sync import refuse_host_round_trips
from tests.helpers.oracle import dense_attention_grads

B = 16
FORCED, ALLOWED, FORBIDDEN = 0, 1, 2


def restated_choice(scores, classes, count):
    """chosen [rows, nb]: per row the first count[r] blocks by (class, -key, j), class < 2."""
    rows, nb = scores.shape
    chosen = np.zeros((rows, nb), np.uint8)
    for r in range(rows):
        order = sorted(
            (j for j in range(nb) if classes[r, j] <= ALLOWED),
            key=lambda j, r=r: (classes[r, j], -scores[r, j], j),
        )
        chosen[r, order[: count[r]]] = 1
    return chosen


def restated_mass_count(p, order, tau, max_blocks):
    mass, taken = 0.0, 0
    for j in order:
        if mass >= tau - 1e-9 or (max_blocks and taken == max_blocks):
            break
        mass += p[j]
        taken += 1
    return taken


SORT_CASES = [
    (kernel, dtype, size)
    for kernel in geometry.SELECT_KERNELS
    for dtype in geometry.SELECT_SCORE_DTYPES
    for size in geometry.SELECT_SORT_SIZES
]


@pytest.mark.parametrize("kernel, dtype, size", SORT_CASES)
def test_every_selection_instantiation_sorts_its_rows(kernel, dtype, size):
    """Each instantiation once, on two rows just long enough to need its sort size, with many
    tied scores: the choice equals the order (class, key descending, j ascending) restated.
    Not causal (the kernel's CTA i is query block i, and a causal row i needs i CTAs before
    it); the causal classes are checked through the rules on small layouts."""
    nb = size // 2 + 1 if size > geometry.SELECT_SORT_SIZES[0] else 20
    rows = 2
    rng = np.random.default_rng(size)
    scores = np.round(rng.standard_normal((1, rows, nb)), 1).astype(dtype)  # many ties
    chosen = np.full(scores.shape, layout_build.UNCHOSEN, np.uint8)
    config = LayoutKernelConfig(kernel, dtype, size, rows=rows, heads=1)
    j, i = np.arange(nb)[None, :], np.arange(rows)[:, None]
    shape = {"nbq": rows, "nb": nb, "causal": 0, "keep_diagonal": 1}
    if kernel == "select_topk":
        budget, keep_first = 7, 3
        interp.launch(
            config,
            scores=scores,
            budget=np.array([budget], np.int32),
            chosen=chosen,
            keep_first=keep_first,
            **shape,
        )
        classes = np.where((j == i) | (j < keep_first), FORCED, ALLOWED)
        want = restated_choice(scores[0].astype(np.float64), classes, [budget] * rows)
    else:
        scale, tau, max_blocks = 0.7, 0.6, 0
        interp.launch(
            config,
            scores=scores,
            chosen=chosen,
            scale=scale,
            tau=tau,
            max_blocks=max_blocks,
            **shape,
        )
        s = scores[0].astype(np.float64) * scale
        p = np.exp(s - s.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        classes = np.where(j == i, FORCED, ALLOWED) + np.zeros((rows, 1), int)
        count = []
        for r in range(rows):
            order = sorted(range(nb), key=lambda c, r=r: (classes[r, c], -p[r, c], c))
            count.append(restated_mass_count(p[r], order, tau, max_blocks))
        want = restated_choice(p, classes, count)
    assert set(np.unique(chosen)) <= {0, 1}, "an element of the choice was never written"
    np.testing.assert_array_equal(chosen[0], want)


def _host_twin(chosen, causal, n, blocksize=B):
    rule = ElementRule("causal") if causal else ElementRule("none")
    return Layout(chosen.astype(bool), blocksize, n, rule=rule)


@pytest.mark.parametrize("causal", [True, False])
def test_index_kernels_build_the_layouts_csr_and_csc(causal):
    """counts -> scan -> fill on a random choice with empty rows and columns and a ragged last
    block equal the host Layout's arrays; the CSC is the CSR transposed; nothing is written
    past the layout's entries, and every entry is written."""
    rng = np.random.default_rng(7)
    heads, n = 3, 7 * B - 5
    nb = -(-n // B)
    chosen = (rng.random((heads, nb, nb)) < 0.4).astype(np.uint8)
    chosen[1, 2] = 0  # an empty row
    chosen[2, :, 4] = 0  # an empty column
    if causal:
        chosen &= np.tril(np.ones((nb, nb), np.uint8))
    layout = layout_build.index_layout(interp.backend, chosen, B, n, causal, nb, "random")
    host = _host_twin(chosen, causal, n)
    total = int(layout.row_ptr[-1, -1])
    np.testing.assert_array_equal(layout.row_ptr, host.row_ptr)
    np.testing.assert_array_equal(layout.col_ptr, host.col_ptr)
    for field in ("col_idx", "row_mask", "row_idx", "col_mask"):
        got = getattr(layout, field)
        np.testing.assert_array_equal(got[:total], getattr(host, field), err_msg=field)
        assert (got[total:] == layout_build.UNWRITTEN).all(), f"{field} written past its entries"
    csr = {(h, i, j) for h in range(heads) for i, j, _ in zip(*layout.row_entries(h), strict=True)}
    csc = set()
    for h in range(heads):
        for j in range(nb):
            lo, hi = layout.col_ptr[h, j], layout.col_ptr[h, j + 1]
            csc |= {(h, int(i), j) for i in layout.row_idx[lo:hi]}
    assert csr == csc
    assert layout.nnz.tolist() == chosen.sum(axis=(1, 2)).tolist()


def test_a_device_layout_is_a_layout_of_the_same_blocks():
    q, k = (np.random.default_rng(8).standard_normal((2, 70, 16)) for _ in range(2))
    layout = dynamic.topk_blocks(q, k, B, 2, backend="interp")
    host = dynamic.topk_blocks(q, k, B, 2)
    assert isinstance(layout, DeviceLayout) and layout.device is None
    assert layout.density == host.density and layout.capacity == 2 * 5 * 2
    np.testing.assert_array_equal(layout.to_mask(), host.to_mask())
    assert layout.picture() == host.picture()
    assert "on cpu" in repr(layout)
    assert not layout.row_ptr.flags.writeable


def _oracle_inputs(seed, heads=4, kv_heads=2, n=90, d=16):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((1, heads, n, d))
    k, v = (rng.standard_normal((1, kv_heads, n, d)) for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape)


@pytest.mark.parametrize("rule", ["topk", "mass"])
def test_attention_and_gradients_on_a_device_layout_equal_the_oracle(rule):
    """Forward and backward read the device layout unchanged: NumPy reference, interpreted
    kernels, the tape (cuattn.autograd), torch and jax, against the float64 dense oracle on
    its mask; GQA 4 / 2 and a ragged last block."""
    q, k, v, dout = _oracle_inputs(9)
    if rule == "topk":
        layout = dynamic.topk_blocks(q[0], k[0], B, 3, backend="interp")
    else:
        layout = dynamic.mass_threshold_blocks(q[0], k[0], B, 0.7, backend="interp")
    mask = layout.to_mask()
    group = q.shape[1] // k.shape[1]
    k_full, v_full = (np.repeat(x, group, axis=1) for x in (k, v))
    scale = 16**-0.5
    want_dq, want_dk, want_dv = dense_attention_grads(q, k_full, v_full, dout, mask, scale)
    want_dk = want_dk.reshape(1, 2, group, *want_dk.shape[2:]).sum(axis=2)
    want_dv = want_dv.reshape(1, 2, group, *want_dv.shape[2:]).sum(axis=2)

    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = cuattn.sparse_attention(*leaves, layout)
    out.backward(torch.from_numpy(dout))
    for got, want in zip(leaves, (want_dq, want_dk, want_dv), strict=True):
        np.testing.assert_allclose(got.grad.numpy(), want, rtol=1e-9, atol=1e-11)

    ref = cuattn.sparse_attention(q, k, v, layout)
    np.testing.assert_allclose(ref, out.detach().numpy(), rtol=1e-12, atol=1e-13)
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    kernels = cuattn.sparse_attention(q32, k32, v32, layout, backend="interp")
    np.testing.assert_allclose(kernels, ref, rtol=1e-4, atol=1e-5)

    tape = [Tensor(x, requires_grad=True) for x in (q, k, v)]
    (cuattn.sparse_attention(*tape, layout) * dout).sum().backward()
    np.testing.assert_allclose(tape[0].grad, want_dq, rtol=1e-9, atol=1e-11)

    jax = pytest.importorskip("jax")
    import jax.numpy as jnp

    jax.config.update("jax_enable_x64", True)  # as the jax adapter tests run

    def loss(a, b, c):
        return (cuattn.sparse_attention(a, b, c, layout) * jnp.asarray(dout)).sum()

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(*(jnp.asarray(x) for x in (q, k, v)))
    for got, want in zip(grads, (want_dq, want_dk, want_dv), strict=True):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-9, atol=1e-11)


def test_a_compiled_step_takes_each_new_device_layout_as_an_input():
    """torch: a DeviceLayout goes to the ops as tensors, so a compiled function called with a
    fresh layout every step compiles once (fullgraph) and equals eager on each."""
    from torch._dynamo.testing import CompileCounter

    def attend(q, k, v, layout):
        return cuattn.sparse_attention(q, k, v, layout).square().sum()

    counter = CompileCounter()
    counted = torch.compile(attend, backend=counter, fullgraph=True)
    traced = torch.compile(attend, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(12)
    for _ in range(3):
        q, k, v = (torch.randn(1, 4, 90, 16, dtype=torch.float64, generator=gen) for _ in "qkv")
        layout = dynamic.topk_blocks(q, k[:, :2], B, 3, backend="interp")
        assert layout.views is not None  # chosen from torch tensors: torch views attached
        grads = {}
        for name, fn in (("eager", attend), ("counted", counted), ("aot", traced)):
            leaves = [
                q.clone().requires_grad_(),
                *(x[:, :2].clone().requires_grad_() for x in (k, v)),
            ]
            loss = fn(*leaves, layout)
            loss.backward()
            grads[name] = (loss.detach(), *(x.grad for x in leaves))
        for name in ("counted", "aot"):
            for got, want in zip(grads[name], grads["eager"], strict=True):
                assert torch.equal(got, want), name
    assert counter.frame_count == 1


@pytest.mark.parametrize("rule", ["mass", "vertical_slash"])
@pytest.mark.parametrize("recompute", [False, True])
def test_opcheck_passes_on_device_layouts(recompute, rule):
    from cuattn.adapters import torch_ops

    gen = torch.Generator().manual_seed(13)
    q = torch.randn(2, 4, 70, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (
        torch.randn(2, 2 if rule == "mass" else 4, 70, 16, dtype=torch.float64, generator=gen)
        for _ in "kv"
    )
    k, v = k.requires_grad_(), v.requires_grad_()
    if rule == "mass":
        layout = dynamic.mass_threshold_blocks(
            q[0].detach(), k[0].detach(), B, 0.8, backend="interp"
        )
    else:
        layout = dynamic.vertical_slash_layout(
            q.detach(), k.detach(), B, 3, 2, 16, backend="interp"
        )
    *layout_args, _, index, operands, given = torch_ops.op_arguments(
        AttentionCall(layout, 0.25), q.device
    )
    assert layout_args[:2] == ["", [B, RULE_KINDS.index(layout.rule.kind), 0, 0]]
    args = (q, k, v, *layout_args, recompute, index, operands, given)
    torch.library.opcheck(torch.ops.cuattn.attention_fwd.default, args)
    out, lse = torch.ops.cuattn.attention_fwd(*args)
    saved = tuple(x.detach() for x in (q, k, v, out, lse, torch.randn_like(out)))
    dlse = torch.randn_like(lse)  # the lse's gradient
    bwd_args = (*saved, dlse, *layout_args, index, operands, given)
    torch.library.opcheck(torch.ops.cuattn.attention_bwd.default, bwd_args)


def test_bfloat16_inputs_are_widened_exactly_before_pooling():
    """CuPy has no bfloat16 arithmetic; the rules widen bfloat16 through its bits. On NumPy
    (ml_dtypes) the same route must equal the cast, including negative, tiny and inf values."""
    ml_dtypes = pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(14)
    x = rng.standard_normal((2, 50, 16)).astype(np.float32)
    x[0, 0, :3] = (-np.inf, 1e-39, -0.0)
    bf = x.astype(ml_dtypes.bfloat16)[:, ::2]  # a strided view too
    np.testing.assert_array_equal(widened(bf, np), bf.astype(np.float32))
    q, k = (rng.standard_normal((2, 64, 16)).astype(ml_dtypes.bfloat16) for _ in "qk")
    got = dynamic.topk_blocks(q, k, B, 2, backend="interp")
    want = dynamic.topk_blocks(q.astype(np.float32), k.astype(np.float32), B, 2)
    np.testing.assert_array_equal(got.blocks, want.blocks)


@pytest.mark.parametrize(
    "causal, n, batch, num_slash",
    [(True, 100, 1, 3), (False, 96, 2, 3), (True, 40, 1, 100), (False, 37, 1, 2)],
)
def test_vertical_slash_on_the_device_equals_the_host_rule(causal, n, batch, num_slash):
    """Built by the kernels (interp), the vertical-slash layout has the host version's blocks
    and elements (ragged lengths, a batch averaged, more offsets asked than exist), and
    attention and gradients on it equal the float64 oracle through torch's ops."""
    rng = np.random.default_rng(n + batch)
    q, k = (rng.standard_normal((batch, 2, n, 16)) * 0.6 for _ in "qk")
    args = (q, k, B, 4, num_slash, 16, causal)
    host = host_vertical_slash_layout(*args)
    layout = dynamic.vertical_slash_layout(*args, backend="interp")
    assert isinstance(layout, DeviceLayout) and layout.rule.kind == "bitmask"
    np.testing.assert_array_equal(layout.blocks, host.blocks)
    np.testing.assert_array_equal(layout.to_mask(), host.to_mask())
    total = int(layout.row_ptr[-1, -1])
    np.testing.assert_array_equal(layout.row_ptr, host.row_ptr)
    np.testing.assert_array_equal(layout.col_idx[:total], host.col_idx)
    # a block's CSC entry names the same table as its CSR entry
    csr_mask = {}
    for h in range(2):
        for i in range(layout.num_q_blocks):
            for e in range(layout.row_ptr[h, i], layout.row_ptr[h, i + 1]):
                csr_mask[h, i, int(layout.col_idx[e])] = int(layout.row_mask[e])
    for h in range(2):
        for j in range(layout.num_blocks):
            for e in range(layout.col_ptr[h, j], layout.col_ptr[h, j + 1]):
                assert layout.col_mask[e] == csr_mask.pop((h, int(layout.row_idx[e]), j))
    assert not csr_mask
    x = [rng.standard_normal((1, 2, n, 16)) for _ in range(4)]
    want = dense_attention_grads(*x[:3], x[3], layout.to_mask(), 0.25)
    leaves = [torch.tensor(t, requires_grad=True) for t in x[:3]]
    cuattn.sparse_attention(*leaves, layout, scale=0.25).backward(torch.from_numpy(x[3]))
    for got, ref in zip(leaves, want, strict=True):
        np.testing.assert_allclose(got.grad.numpy(), ref, rtol=1e-9, atol=1e-11)
    q32, k32, v32 = (t.astype(np.float32) for t in x[:3])
    kernels = cuattn.sparse_attention(q32, k32, v32, layout, backend="interp")
    reference = cuattn.sparse_attention(q32, k32, v32, host, backend="interp")
    np.testing.assert_array_equal(kernels, reference)


def test_device_vertical_slash_refuses_tables_over_its_memory_limit(monkeypatch):
    monkeypatch.setattr(dynamic, "DEVICE_TABLE_LIMIT_BYTES", 1024)
    q = np.ones((1, 2, 64, 16))
    with pytest.raises(ValueError, match="a bit table per active block"):
        dynamic.vertical_slash_layout(q, q, B, 4, 3, 16, backend="interp")


def test_device_layouts_refuse_what_they_cannot_build_before_running():
    q, k = (np.random.default_rng(10).standard_normal((2, 64, 16)) for _ in range(2))
    with pytest.raises(ValueError, match="kernel block size"):
        dynamic.topk_blocks(q, k, 8, 2, backend="interp")
    with pytest.raises(ValueError, match="backend must be one of"):
        dynamic.topk_blocks(q, k, B, 2, backend="gpu")
    with pytest.raises(ValueError, match="needs CUDA arrays"):
        dynamic.topk_blocks(q, k, B, 2, backend="cuda")
    long = np.ones((1, B * (geometry.SELECT_SORT_SIZES[-1] + 1), 1))
    with pytest.raises(ValueError, match="use a larger blocksize"):
        dynamic.mass_threshold_blocks(long, long, B, 0.5, backend="interp")
    with pytest.raises(TypeError, match="scores: dtype"):
        layout_build.select_topk(
            interp.backend, np.ones((1, 2, 2), np.float16), np.ones(1, np.int32), True, True, 0
        )


# ---- on a GPU ------------------------------------------------------------------------------


def _torch_inputs(n=4096, heads=8, kv_heads=2, d=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(1, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k, v = (
        torch.randn(1, kv_heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        for _ in range(2)
    )
    return q, k, v


@pytest.mark.gpu
def test_on_the_gpu_the_device_choice_equals_the_definition_on_the_same_scores():
    """bf16 inputs, float32 scores on the GPU: top-k equals the restatement on those scores;
    both rules' CSR and CSC equal the host Layout of the blocks they chose."""
    import cupy

    q, k, _ = _torch_inputs()
    blocksize, topk, max_blocks = 64, 8, 16
    qa, ka = dynamic._checked_pair(q[0], k[0], blocksize, "mean")
    scores = cupy.asnumpy(dynamic._scores(qa, ka, blocksize, "mean")).astype(np.float64)
    nb = scores.shape[-1]
    allowed = np.tril(np.ones((nb, nb), bool))
    forced = (np.eye(nb, dtype=bool) | (np.arange(nb) < 1)[None]) & allowed
    classes = np.where(~allowed, FORBIDDEN, np.where(forced, FORCED, ALLOWED))
    count = np.minimum(topk, allowed.sum(axis=1))
    want = np.stack([restated_choice(s, classes, count) for s in scores]).astype(bool)
    chosen = dynamic.topk_blocks(q[0], k[0], blocksize, topk)
    massed = dynamic.mass_threshold_blocks(q[0], k[0], blocksize, 0.9, max_blocks=max_blocks)
    np.testing.assert_array_equal(cupy.asnumpy(chosen.blocks), want)
    for layout, budget in ((chosen, topk), (massed, max_blocks)):
        assert isinstance(layout, DeviceLayout) and layout.device == q.device.index
        blocks = cupy.asnumpy(layout.blocks)
        assert (blocks.sum(axis=-1) <= budget).all()
        host = _host_twin(blocks, True, q.shape[2], blocksize)
        total = int(layout.row_ptr[-1, -1])
        for field in ("row_ptr", "col_ptr", "col_idx", "row_mask", "row_idx", "col_mask"):
            got = cupy.asnumpy(getattr(layout, field))
            got = got if field.endswith("ptr") else got[:total]
            np.testing.assert_array_equal(got, getattr(host, field), err_msg=field)


@pytest.mark.gpu
def test_on_the_gpu_a_dynamic_step_never_waits_for_the_host(monkeypatch):
    """After one warm-up step, choosing a layout and running attention forward and backward on
    it makes no device-to-host copy and no synchronisation (torch's sync debug mode, and every
    CuPy synchronisation and copy to the host patched to fail)."""

    q, k, v = _torch_inputs()
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]

    def step():
        layout = dynamic.topk_blocks(leaves[0][0].detach(), leaves[1][0].detach(), 64, 8)
        out = cuattn.sparse_attention(*leaves, layout)
        out.float().square().sum().backward()
        return out

    step()
    torch.cuda.synchronize()

    refuse_host_round_trips(monkeypatch)
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_on_the_gpu_a_dynamic_step_is_captured_in_a_cuda_graph_and_replays():
    """Choice, layout and attention forward in one CUDA graph: replaying it with new q and k
    chooses again and equals eager calls on those inputs."""
    q, k, v = _torch_inputs(n=2048)
    static_q, static_k = q.clone(), k.clone()

    def step():
        layout = dynamic.topk_blocks(static_q[0], static_k[0], 64, 6)
        return cuattn.sparse_attention(static_q, static_k, v, layout)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # warm-up: compiles the kernels, places the budget on the device
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    for seed in (1, 2):
        new_q, new_k, _ = _torch_inputs(n=2048, seed=seed)
        static_q.copy_(new_q)
        static_k.copy_(new_k)
        graph.replay()
        torch.cuda.synchronize()
        layout = dynamic.topk_blocks(new_q[0], new_k[0], 64, 6)
        want = cuattn.sparse_attention(new_q, new_k, v, layout)
        assert torch.equal(static_out, want)


@pytest.mark.gpu
def test_on_the_gpu_vertical_slash_equals_the_host_rule():
    """bf16 CUDA tensors: the layout built on the GPU has the host version's element mask
    (the same float64 arithmetic; only a tie in the last bits of a sum could differ), and
    attention on it equals attention on the host layout."""
    q, k, v = _torch_inputs(n=2048, heads=4, kv_heads=4)
    host_q, host_k = (x.float().cpu().numpy() for x in (q, k))
    host = host_vertical_slash_layout(host_q, host_k, 64, 16, 16, 64)
    layout = cuattn.vertical_slash_layout(q, k, 64, 16, 16, 64)
    assert isinstance(layout, DeviceLayout) and layout.rule.kind == "bitmask"
    np.testing.assert_array_equal(layout.to_mask(), host.to_mask())
    got = cuattn.sparse_attention(q, k, v, layout)
    want = cuattn.sparse_attention(q, k, v, host)
    assert torch.equal(got, want)


def test_block_scores_on_the_device_take_no_cublas_and_equal_the_matmul(monkeypatch):
    """On CuPy the pooled block scores are products summed over d, never a matmul: CuPy's matmul
    is cuBLAS, which a CUDA graph capture refuses (a dynamic step under torch.cuda.graph failed
    so on an H200, 2026-11-26). Checked here with NumPy standing in for CuPy, with every
    matrix-product entry point removed, and chunks small enough to take several."""
    rng = np.random.default_rng(30)
    grouped = rng.standard_normal((2, 3, 9, 8))
    pk = rng.standard_normal((2, 9, 8))

    class NoMatmul:
        def __getattr__(self, name):
            if name in ("matmul", "dot", "einsum", "tensordot", "inner", "vdot"):
                raise AssertionError(f"block_products called {name} (cuBLAS on CuPy)")
            return getattr(np, name)

    monkeypatch.setattr(dynamic, "SCORE_CHUNK_ELEMENTS", 2 * 3 * 9 * 8 * 2)  # 2 rows a chunk
    got = dynamic.block_products(grouped, pk, NoMatmul())
    want = grouped @ pk.transpose(0, 2, 1)[:, None]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
