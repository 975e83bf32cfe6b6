"""``softcap=`` through every front: torch autograd (eager and compiled), jax (eager, jit, grad),
the tape, NumPy arrays, varlen and the original blocksparse call, against a dense float64
oracle with the cap; and its argument checks. Kernel-level tests: tests/backends/
test_score_mods.py; Gemma 2 end to end: tests/compat/test_transformers.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn.tools.oracle import dense_attention, dense_attention_grads, rel_err

SOFTCAP = 1.5
SPREAD = 3.0  # inputs times this: scores the cap bends
HEADS, KV_HEADS, N_Q, N_K, HEAD_DIM, BLOCK = 4, 2, 40, 56, 16, 8
RTOL = 1e-10  # float64 through the NumPy backend against the float64 oracle


def _arrays(seed, n_q=N_Q, n_k=N_K):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, HEADS, n_q, HEAD_DIM)) * SPREAD
    k, v = (rng.standard_normal((2, KV_HEADS, n_k, HEAD_DIM)) * SPREAD for _ in range(2))
    dout = rng.standard_normal(q.shape)
    return q, k, v, dout


def _layout(n_q=N_Q, n_k=N_K):
    return cuattn.make_layout(
        "fixed", n_k, HEADS, BLOCK, local_attn_ctx=16, num_verts=1, vertsize=1, n_q=n_q
    )


def _oracle(q, k, v, dout, layout, scale=HEAD_DIM**-0.5):
    mask = layout.to_mask()
    out, lse = dense_attention(q, k, v, mask, scale, softcap=SOFTCAP)
    return out, lse, dense_attention_grads(q, k, v, dout, mask, scale, softcap=SOFTCAP)


def test_numpy_arrays_forward_and_lse():
    q, k, v, dout = _arrays(0)
    layout = _layout()
    out, lse = cuattn.sparse_attention(q, k, v, layout, return_lse=True, softcap=SOFTCAP)
    ref_out, ref_lse, _ = _oracle(q, k, v, dout, layout)
    assert rel_err(out, ref_out) <= RTOL and rel_err(lse, ref_lse) <= RTOL
    plain = cuattn.sparse_attention(q, k, v, layout)
    assert rel_err(plain, ref_out) > 0.05  # the cap bends these scores


@pytest.mark.parametrize("recompute", [False, True])
def test_torch_autograd_matches_the_oracle(recompute):
    q, k, v, dout = _arrays(1)
    layout = _layout()
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    out = cuattn.sparse_attention(*leaves, layout, recompute=recompute, softcap=SOFTCAP)
    out.backward(torch.tensor(dout))
    ref_out, _, refs = _oracle(q, k, v, dout, layout)
    assert rel_err(out.detach().numpy(), ref_out) <= RTOL
    for name, leaf, ref in zip("qkv", leaves, refs, strict=True):
        assert rel_err(leaf.grad.numpy(), ref) <= RTOL, name


def test_torch_compile_fullgraph_equals_eager():
    layout = cuattn.Pattern("fixed", HEADS, BLOCK, local_attn_ctx=16, num_verts=1, vertsize=1)
    q, k, v, _ = _arrays(2, N_K, N_K)

    def loss(q, k, v):
        out = cuattn.sparse_attention(q, k, v, layout, softcap=SOFTCAP)
        return (out * out).sum()

    grads = []
    for fn in (loss, torch.compile(loss, fullgraph=True)):
        leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        fn(*leaves).backward()
        grads.append([x.grad for x in leaves])
    for name, a, b in zip("qkv", *grads, strict=True):
        assert rel_err(a.numpy(), b.numpy()) <= RTOL, name


def test_jax_eager_jit_and_grad():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)  # process-wide, as the jax adapter tests run
    q, k, v, dout = _arrays(3)
    layout = _layout()
    ref_out, _, refs = _oracle(q, k, v, dout, layout)

    def loss(q, k, v):
        out = cuattn.sparse_attention(q, k, v, layout, softcap=SOFTCAP)
        return (out * dout).sum()

    arrays = [jax.numpy.asarray(x) for x in (q, k, v)]
    out = cuattn.sparse_attention(*arrays, layout, softcap=SOFTCAP)
    assert rel_err(np.asarray(out), ref_out) <= RTOL
    for fn in (jax.grad(loss, argnums=(0, 1, 2)), jax.jit(jax.grad(loss, argnums=(0, 1, 2)))):
        for name, grad, ref in zip("qkv", fn(*arrays), refs, strict=True):
            assert rel_err(np.asarray(grad), ref) <= RTOL, name


def test_tape_gradients():
    q, k, v, dout = _arrays(4)
    layout = _layout()
    leaves = [cuattn.Tensor(x, requires_grad=True) for x in (q, k, v)]
    out = cuattn.sparse_attention(*leaves, layout, softcap=SOFTCAP)
    (out * cuattn.Tensor(dout)).sum().backward()
    _, _, refs = _oracle(q, k, v, dout, layout)
    for name, leaf, ref in zip("qkv", leaves, refs, strict=True):
        assert rel_err(leaf.grad, ref) <= RTOL, name


def test_varlen_equals_each_sequence_alone():
    rng = np.random.default_rng(5)
    lengths = [(24, 40), (40, 40), (9, 17)]
    cu_q = np.cumsum([0] + [a for a, _ in lengths])
    cu_k = np.cumsum([0] + [b for _, b in lengths])
    q = rng.standard_normal((cu_q[-1], HEADS, HEAD_DIM)) * SPREAD
    k, v = (rng.standard_normal((cu_k[-1], KV_HEADS, HEAD_DIM)) * SPREAD for _ in range(2))
    out = cuattn.sparse_attention_varlen(
        q, k, v, cu_q, cu_k, lambda n_q, n_k: _layout(n_q, n_k), softcap=SOFTCAP
    )
    for s, (n_q, n_k) in enumerate(lengths):
        rows, keys = slice(cu_q[s], cu_q[s + 1]), slice(cu_k[s], cu_k[s + 1])
        one = (x.transpose(1, 0, 2)[None] for x in (q[rows], k[keys], v[keys]))
        ref, _ = dense_attention(*one, _layout(n_q, n_k).to_mask(), HEAD_DIM**-0.5, softcap=SOFTCAP)
        assert rel_err(out[rows], ref[0].transpose(1, 0, 2)) <= RTOL, s


def test_blocksparse_attention_takes_softcap():
    q, k, v, dout = _arrays(6, N_K, N_K)
    bte = [x.transpose(0, 2, 1, 3).reshape(2, N_K, -1) for x in (q, k, v)]
    out = cuattn.blocksparse_attention(
        *bte, heads=HEADS, attn_mode="all", blocksize=BLOCK, kv_heads=KV_HEADS, softcap=SOFTCAP
    )
    layout = cuattn.make_layout("all", N_K, HEADS, BLOCK)
    ref = _oracle(q, k, v, dout, layout)[0].transpose(0, 2, 1, 3).reshape(2, N_K, -1)
    assert rel_err(out, ref) <= RTOL


def test_zero_and_none_are_off():
    q, k, v, _ = _arrays(7)
    layout = _layout()
    plain = cuattn.sparse_attention(q, k, v, layout)
    for off in (None, 0, 0.0):
        np.testing.assert_array_equal(cuattn.sparse_attention(q, k, v, layout, softcap=off), plain)


@pytest.mark.parametrize(
    ("softcap", "error", "message"),
    [
        (-1.0, ValueError, "softcap must be a positive finite number, 0 or None.*got -1.0"),
        (float("inf"), ValueError, "softcap must be a positive finite number.*got inf"),
        (float("nan"), ValueError, "softcap must be a positive finite number.*got nan"),
        (True, TypeError, "softcap must be a positive real number.*got bool"),
        ("30", TypeError, "softcap must be a positive real number.*got str"),
    ],
)
def test_bad_softcap_is_refused_before_anything_runs(softcap, error, message):
    q, k, v, _ = _arrays(8)
    with pytest.raises(error, match=message):
        cuattn.sparse_attention(q, k, v, _layout(), softcap=softcap)
