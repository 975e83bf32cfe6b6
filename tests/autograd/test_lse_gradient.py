"""The log-sum-exp is a differentiable output on every front and backend.

``sparse_attention(..., return_lse=True)`` returns (out, lse); a loss on lse (alone, or beside
out, or through merge_attention_states, which is how split-KV and ring attention combine partial
results) must give the gradients a dense float64 computation gives: dS = P * (dP - (delta -
dlse)). Before this was fixed, torch treated lse as a constant, and merging two partial
attentions over disjoint keys gave dq, dk off by 0.1-0.26 in float64.
"""

from __future__ import annotations

import numpy as np
import pytest

import cuattn
from tests.helpers.oracle import GRAD_FLOOR, dense_attention, dense_attention_grads, rel_err

torch = pytest.importorskip("torch")

BATCH, HEADS, HEAD_DIM, N = 2, 4, 16, 48
# float64 on the NumPy backend is exact up to rounding; the interpreter runs the float32 kernels.
CASES = {"numpy": (np.float64, 1e-10), "interp": (np.float32, 1e-5)}


def _layouts() -> dict[str, cuattn.Layout]:
    blocks = np.tril(np.ones((HEADS, N // 16, N // 16), dtype=bool))
    blocks[:, 1] = False  # a block row with nothing: rows whose lse is -inf
    return {
        "local": cuattn.make_layout("local", N, HEADS, 16, local_attn_ctx=20),
        "strided-permuted": cuattn.make_layout("strided", N, HEADS, 16, local_attn_ctx=3),
        "empty-rows": cuattn.Layout.from_blocks(blocks, 16),
    }


LAYOUTS = _layouts()


def _inputs(dtype, kv_heads: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    shapes = [(BATCH, HEADS, N, HEAD_DIM)] + [(BATCH, kv_heads, N, HEAD_DIM)] * 2
    shapes += [(BATCH, HEADS, N, HEAD_DIM), (BATCH, HEADS, N)]  # weights of out and lse
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _mask(layout: cuattn.Layout) -> np.ndarray:
    return layout.allowed(*np.ix_(range(HEADS), range(N), range(N)))


def _oracle(layout, q, k, v, w_out, w_lse, scale):
    """float64 gradients of sum(out * w_out) + sum(lse * w_lse) over the rows that see a key."""
    mask = _mask(layout)
    return dense_attention_grads(q, k, v, w_out, mask, scale, dlse=w_lse)


def _finite(lse, xp):
    return xp.where(xp.isfinite(lse), lse, 0.0)


def _torch_grads(layout, arrays, backend, recompute):
    q, k, v, w_out, w_lse = (torch.from_numpy(a) for a in arrays)
    for x in (q, k, v):
        x.requires_grad_()
    out, lse = cuattn.sparse_attention(
        q, k, v, layout, return_lse=True, recompute=recompute, backend=backend
    )
    assert lse.requires_grad
    ((out * w_out).sum() + (_finite(lse, torch) * w_lse).sum()).backward()
    return [x.grad.numpy() for x in (q, k, v)]


def _jax_grads(layout, arrays, backend, recompute):
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    q, k, v, w_out, w_lse = (jnp.asarray(a) for a in arrays)

    def loss(q, k, v):
        out, lse = cuattn.sparse_attention(
            q, k, v, layout, return_lse=True, recompute=recompute, backend=backend
        )
        return (out * w_out).sum() + (_finite(lse, jnp) * w_lse).sum()

    return [np.asarray(g) for g in jax.grad(loss, argnums=(0, 1, 2))(q, k, v)]


def _tape_grads(layout, arrays, backend, recompute):
    q, k, v = (cuattn.Tensor(a, requires_grad=True) for a in arrays[:3])
    out, lse = cuattn.sparse_attention(
        q, k, v, layout, return_lse=True, recompute=recompute, backend=backend
    )
    # The tape has no `where`: a zero weight on the -inf rows gives them a zero gradient (the
    # loss's value is NaN there, which backward never reads).
    w_lse = np.where(np.isfinite(lse.data), arrays[4], 0.0).astype(arrays[4].dtype)
    with np.errstate(invalid="ignore"):
        loss = (out * cuattn.Tensor(arrays[3])).sum() + (lse * cuattn.Tensor(w_lse)).sum()
    loss.backward()
    return [x.grad for x in (q, k, v)]


FRONTS = {"torch": _torch_grads, "jax": _jax_grads, "tape": _tape_grads}


@pytest.mark.parametrize("backend", sorted(CASES))
@pytest.mark.parametrize("front", sorted(FRONTS))
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_loss_on_out_and_lse_matches_float64(front, name, backend):
    dtype, tol = CASES[backend]
    layout = LAYOUTS[name]
    kv_heads = 2 if name == "local" else HEADS  # GQA on one of them
    arrays = _inputs(dtype, kv_heads, seed=len(name))
    if front == "jax":
        jax = pytest.importorskip("jax")
        jax.config.update("jax_enable_x64", True)  # process-wide, as the jax adapter tests run
    recompute = name == "strided-permuted"
    grads = FRONTS[front](layout, arrays, backend, recompute)
    want = _oracle(layout, *arrays, HEAD_DIM**-0.5)
    for label, got, ref in zip("qkv", grads, want, strict=True):
        assert rel_err(got, ref, GRAD_FLOOR) <= tol, (front, name, backend, label)


def test_loss_on_lse_alone_has_gradients_in_q_and_k_only():
    q, k, v, _, w_lse = _inputs(np.float64, HEADS, seed=1)
    layout = LAYOUTS["local"]
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    _, lse = cuattn.sparse_attention(tq, tk, tv, layout, return_lse=True)
    (lse * torch.from_numpy(w_lse)).sum().backward()
    want = _oracle(layout, q, k, v, np.zeros_like(q), w_lse, HEAD_DIM**-0.5)
    assert rel_err(tq.grad.numpy(), want[0], GRAD_FLOOR) <= 1e-10
    assert rel_err(tk.grad.numpy(), want[1], GRAD_FLOOR) <= 1e-10
    assert not tv.grad.any()  # lse does not depend on v


@pytest.mark.parametrize("backend", sorted(CASES))
def test_merging_two_partial_attentions_differentiates_like_one(backend):
    """docs/patterns.md's example: attention over keys A u B from the partial results over A and B,
    bidirectional, merged by LSE; gradients through the merge equal the whole attention's."""
    dtype, tol = CASES[backend]
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((BATCH, HEADS, N, HEAD_DIM)).astype(dtype) for _ in range(3))
    w_out = rng.standard_normal(q.shape).astype(dtype)
    tq, tk, tv = (torch.from_numpy(a).requires_grad_() for a in (q, k, v))
    half = N // 2
    part = cuattn.make_layout("all", half, HEADS, 16, causal=False, n_q=N)
    a = cuattn.sparse_attention(
        tq, tk[:, :, :half], tv[:, :, :half], part, return_lse=True, backend=backend
    )
    b = cuattn.sparse_attention(
        tq, tk[:, :, half:], tv[:, :, half:], part, return_lse=True, backend=backend
    )
    out, _ = cuattn.merge_attention_states(*a, *b)
    (out * torch.from_numpy(w_out)).sum().backward()
    mask = np.ones((HEADS, N, N), dtype=bool)
    ref_out, _ = dense_attention(q, k, v, mask, HEAD_DIM**-0.5)
    assert rel_err(out.detach().numpy(), ref_out) <= tol
    want = dense_attention_grads(q, k, v, w_out, mask, HEAD_DIM**-0.5)
    for label, got, ref in zip("qkv", (tq.grad, tk.grad, tv.grad), want, strict=True):
        assert rel_err(got.numpy(), ref, GRAD_FLOOR) <= tol, label


def test_varlen_lse_carries_its_gradient():
    rng = np.random.default_rng(7)
    cu = np.array([0, 20, 48], dtype=np.int32)
    q, k, v = (torch.from_numpy(rng.standard_normal((48, HEADS, HEAD_DIM))) for _ in range(3))
    for x in (q, k, v):
        x.requires_grad_()
    w_lse = torch.from_numpy(rng.standard_normal((HEADS, 48)))

    def layout_for(n_q, n_k):
        return cuattn.make_layout("all", n_k, HEADS, 16, n_q=n_q)

    _, lse = cuattn.sparse_attention_varlen(q, k, v, cu, cu, layout_for, return_lse=True)
    (lse * w_lse).sum().backward()
    for s in range(2):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        n = rows.stop - rows.start
        one = [x.detach()[rows].permute(1, 0, 2)[None].numpy() for x in (q, k, v)]
        mask = layout_for(n, n).allowed(*np.ix_(range(HEADS), range(n), range(n)))
        dlse = w_lse[:, rows][None].numpy()
        want = dense_attention_grads(*one, np.zeros_like(one[0]), mask, HEAD_DIM**-0.5, dlse)
        for x, ref in zip((q, k), want[:2], strict=False):
            got = x.grad[rows].permute(1, 0, 2)[None].numpy()
            assert rel_err(got, ref, GRAD_FLOOR) <= 1e-10


def test_compiled_graph_differentiates_the_lse():
    q, k, v, w_out, w_lse = (torch.from_numpy(a) for a in _inputs(np.float64, HEADS, seed=3))
    layout = LAYOUTS["local"]

    def loss(q, k, v):
        out, lse = cuattn.sparse_attention(q, k, v, layout, return_lse=True)
        return (out * w_out).sum() + (lse * w_lse).sum()

    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    torch.compile(loss, backend="aot_eager", fullgraph=True)(*leaves).backward()
    want = _oracle(layout, q.numpy(), k.numpy(), v.numpy(), w_out.numpy(), w_lse.numpy(), 0.25)
    for label, got, ref in zip("qkv", leaves, want, strict=True):
        assert rel_err(got.grad.numpy(), ref, GRAD_FLOOR) <= 1e-10, label
