"""``dropout_p=`` / ``dropout_seed=`` on ``sparse_attention`` through NumPy arrays, torch autograd
(eager, recompute, compiled), jax (eager, jit, grad), the tape, blocksparse_attention and varlen:
outputs and gradients against the dense float64 oracle with the generator's mask; seeds drawn
from torch's and NumPy's global generators repeat under their manual seeds; argument checks.
Kernel-level tests: tests/backends/test_dropout.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuattn
from cuattn.adapters.dispatch import dropout_seed_for
from cuattn.tools.oracle import dense_attention, dense_attention_grads, dropout_factors, rel_err

HEADS, KV_HEADS, N_Q, N_K, HEAD_DIM, BLOCK = 4, 2, 40, 56, 16, 8
P, SEED = 0.25, 1234567
RTOL = 1e-10


def _arrays(seed):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((2, HEADS, N_Q, HEAD_DIM))
    k, v = (rng.standard_normal((2, KV_HEADS, N_K, HEAD_DIM)) for _ in range(2))
    return q, k, v, rng.standard_normal(q.shape)


def _layout():
    return cuattn.make_layout("all", N_K, HEADS, BLOCK, causal=True, n_q=N_Q)


def _oracle(q, k, v, dout, seed=SEED):
    mask, scale = _layout().to_mask(), HEAD_DIM**-0.5
    factors = dropout_factors(P, seed, 2, HEADS, N_Q, N_K)
    out, _ = dense_attention(q, k, v, mask, scale, dropout=factors)
    return out, dense_attention_grads(q, k, v, dout, mask, scale, dropout=factors)


def test_numpy_arrays_with_a_seed_match_the_oracle_and_repeat():
    q, k, v, dout = _arrays(0)
    out = cuattn.sparse_attention(q, k, v, _layout(), dropout_p=P, dropout_seed=SEED)
    assert rel_err(out, _oracle(q, k, v, dout)[0]) <= RTOL
    again = cuattn.sparse_attention(q, k, v, _layout(), dropout_p=P, dropout_seed=SEED)
    np.testing.assert_array_equal(out, again)


def test_numpy_draws_its_seed_from_numpys_global_generator():
    q, k, v, _ = _arrays(1)
    np.random.seed(5)  # noqa: NPY002  (the global state is what the call draws from)
    first = cuattn.sparse_attention(q, k, v, _layout(), dropout_p=P)
    second = cuattn.sparse_attention(q, k, v, _layout(), dropout_p=P)
    np.random.seed(5)  # noqa: NPY002
    np.testing.assert_array_equal(cuattn.sparse_attention(q, k, v, _layout(), dropout_p=P), first)
    assert not np.array_equal(first, second)


@pytest.mark.parametrize("recompute", [False, True])
def test_torch_autograd_matches_the_oracle(recompute):
    q, k, v, dout = _arrays(2)
    leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
    kw = dict(dropout_p=P, dropout_seed=SEED, recompute=recompute)
    out = cuattn.sparse_attention(*leaves, _layout(), **kw)
    out.backward(torch.tensor(dout))
    ref_out, refs = _oracle(q, k, v, dout)
    assert rel_err(out.detach().numpy(), ref_out) <= RTOL
    for name, leaf, ref in zip("qkv", leaves, refs, strict=True):
        assert rel_err(leaf.grad.numpy(), ref) <= RTOL, name


def test_torch_draws_its_seed_from_torchs_generator_and_the_backward_reuses_it():
    """Without a seed, torch.manual_seed repeats the masks; the backward of a call regenerates
    that call's mask (its gradients equal the oracle's under the seed the forward drew)."""
    q, k, v, dout = _arrays(3)
    tensors = [torch.tensor(x) for x in (q, k, v)]
    torch.manual_seed(0)
    first = cuattn.sparse_attention(*tensors, _layout(), dropout_p=P)
    torch.manual_seed(0)
    drawn = int(torch.randint(0, 2**63 - 1, (), dtype=torch.int64))
    torch.manual_seed(0)
    leaves = [t.clone().requires_grad_() for t in tensors]
    out = cuattn.sparse_attention(*leaves, _layout(), dropout_p=P)
    assert torch.equal(out.detach(), first)
    out.backward(torch.tensor(dout))
    ref_out, refs = _oracle(q, k, v, dout, seed=drawn)
    assert rel_err(first.numpy(), ref_out) <= RTOL
    for leaf, ref in zip(leaves, refs, strict=True):
        assert rel_err(leaf.grad.numpy(), ref) <= RTOL
    assert not torch.equal(cuattn.sparse_attention(*tensors, _layout(), dropout_p=P), first)


def test_a_torch_seed_tensor_equals_its_int_and_the_drawn_seed_stays_on_the_device():
    """A seed held in a tensor (int64 [] or uint32 [2]) gives its key's mask, forward and
    backward; a drawn seed is a tensor of q's device, never read back to the host."""
    q, k, v, dout = _arrays(11)
    ref_out, refs = _oracle(q, k, v, dout)
    words = torch.tensor([SEED & 0xFFFFFFFF, SEED >> 32], dtype=torch.uint32)
    for seed in (torch.tensor(SEED), words):
        leaves = [torch.tensor(x, requires_grad=True) for x in (q, k, v)]
        out = cuattn.sparse_attention(*leaves, _layout(), dropout_p=P, dropout_seed=seed)
        out.backward(torch.tensor(dout))
        assert rel_err(out.detach().numpy(), ref_out) <= RTOL
        for leaf, ref in zip(leaves, refs, strict=True):
            assert rel_err(leaf.grad.numpy(), ref) <= RTOL
    drawn = dropout_seed_for(torch.zeros(1), None)
    assert isinstance(drawn, torch.Tensor) and drawn.dtype == torch.int64 and drawn.ndim == 0


def test_torch_compile_fullgraph_draws_its_seed_inside_the_graph():
    """Without a seed the compiled call draws one from torch's generator in the graph (no host
    read, no graph break): under one manual seed it equals eager."""
    q, k, v, _ = _arrays(12)
    tensors = [torch.tensor(x) for x in (q, k, v)]
    layout = _layout()  # built outside the graph, as a model builds it once

    def fn(q, k, v):
        return cuattn.sparse_attention(q, k, v, layout, dropout_p=P)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.manual_seed(3)
    first = compiled(*tensors)
    torch.manual_seed(3)
    assert torch.equal(first, fn(*tensors))
    assert not torch.equal(compiled(*tensors), first)


def test_torch_compile_fullgraph_with_a_seed_equals_eager():
    q, k, v, _ = _arrays(4)
    tensors = [torch.tensor(x) for x in (q, k, v)]
    layout = _layout()  # built outside the graph, as a model builds it once

    def fn(q, k, v):
        return cuattn.sparse_attention(q, k, v, layout, dropout_p=P, dropout_seed=SEED)

    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(*tensors), fn(*tensors))


def test_tape_gradients_match_the_oracle():
    q, k, v, dout = _arrays(5)
    _, refs = _oracle(q, k, v, dout)
    words = np.array([SEED & 0xFFFFFFFF, SEED >> 32], np.uint32)
    for seed in (SEED, words, cuattn.Tensor(words)):  # an array seed is a constant of the tape
        leaves = [cuattn.Tensor(x, requires_grad=True) for x in (q, k, v)]
        out = cuattn.sparse_attention(*leaves, _layout(), dropout_p=P, dropout_seed=seed)
        (out * cuattn.Tensor(dout)).sum().backward()
        for name, leaf, ref in zip("qkv", leaves, refs, strict=True):
            assert rel_err(leaf.grad, ref) <= RTOL, name


def test_jax_with_a_seed_eager_jit_and_grad_and_without_one_refused():
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    q, k, v, dout = _arrays(6)
    ref_out, refs = _oracle(q, k, v, dout)
    arrays = [jax.numpy.asarray(x) for x in (q, k, v)]

    def attend(q, k, v):
        return cuattn.sparse_attention(q, k, v, _layout(), dropout_p=P, dropout_seed=SEED)

    assert rel_err(np.asarray(attend(*arrays)), ref_out) <= RTOL
    grad = jax.grad(lambda *a: (attend(*a) * dout).sum(), argnums=(0, 1, 2))
    for fn in (grad, jax.jit(grad)):
        for name, g, ref in zip("qkv", fn(*arrays), refs, strict=True):
            assert rel_err(np.asarray(g), ref) <= RTOL, name
    with pytest.raises(ValueError, match="dropout_seed is needed with jax arrays"):
        cuattn.sparse_attention(*arrays, _layout(), dropout_p=P)


def test_jax_takes_a_traced_seed_without_retracing():
    """A seed held in a jax array (jax.random.bits(key, (2,), jnp.uint32)) is traced: a new
    seed runs the same compiled program with another mask, and the grads use that mask; under
    vmap an unmapped seed serves every mapped element, a mapped one each its own."""
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    jax.config.update("jax_enable_x64", True)
    q, k, v, dout = _arrays(13)
    arrays = [jnp.asarray(x) for x in (q, k, v)]
    traces = []

    def loss(q, k, v, seed):
        traces.append(1)
        out = cuattn.sparse_attention(q, k, v, _layout(), dropout_p=P, dropout_seed=seed)
        return (out * dout).sum(), out

    step = jax.jit(jax.grad(loss, argnums=(0, 1, 2), has_aux=True))
    for seed in (SEED, SEED + 1):
        words = jnp.asarray([seed & 0xFFFFFFFF, seed >> 32], jnp.uint32)
        grads, out = step(*arrays, words)
        ref_out, refs = _oracle(q, k, v, dout, seed=seed)
        assert rel_err(np.asarray(out), ref_out) <= RTOL
        for name, g, ref in zip("qkv", grads, refs, strict=True):
            assert rel_err(np.asarray(g), ref) <= RTOL, name
    assert len(traces) == 1
    words = jnp.asarray([SEED & 0xFFFFFFFF, SEED >> 32], jnp.uint32)

    def attend(q, seed):
        return cuattn.sparse_attention(q, *arrays[1:], _layout(), dropout_p=P, dropout_seed=seed)

    stacked = jnp.stack([arrays[0], arrays[0]])
    mapped = jax.vmap(attend, in_axes=(0, None))(stacked, words)
    np.testing.assert_array_equal(np.asarray(mapped[1]), np.asarray(attend(arrays[0], words)))
    # on the CPU the host callback runs each mapped element with its own seed (the GPU's custom
    # calls take one seed per call and refuse a mapped one: tests/adapters/test_jax_xla.py)
    other = words + jnp.asarray([1, 0], jnp.uint32)
    mapped = jax.jit(jax.vmap(attend, in_axes=(0, 0)))(stacked, jnp.stack([words, other]))
    np.testing.assert_array_equal(np.asarray(mapped[1]), np.asarray(attend(arrays[0], other)))


def test_a_seed_array_of_another_kind_or_shape_is_refused():
    q, k, v, _ = _arrays(14)
    tensors = [torch.tensor(x) for x in (q, k, v)]
    with pytest.raises(TypeError, match="dropout_seed is a numpy.ndarray but q is a torch"):
        cuattn.sparse_attention(*tensors, _layout(), dropout_p=P, dropout_seed=np.array(SEED))
    with pytest.raises(ValueError, match=r"must have shape \(2,\)"):
        cuattn.sparse_attention(q, k, v, _layout(), dropout_p=P, dropout_seed=np.zeros(3, "u4"))
    words = np.array([SEED & 0xFFFFFFFF, SEED >> 32], np.uint32)
    np.testing.assert_array_equal(
        cuattn.sparse_attention(q, k, v, _layout(), dropout_p=P, dropout_seed=words),
        cuattn.sparse_attention(q, k, v, _layout(), dropout_p=P, dropout_seed=SEED),
    )


def test_blocksparse_and_varlen_take_dropout():
    q, k, v, _ = _arrays(7)
    heads_last = [x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1) for x in (q, k, v)]
    kw = dict(dropout_p=P, dropout_seed=SEED)
    out = cuattn.blocksparse_attention(
        *heads_last, HEADS, "all", blocksize=BLOCK, kv_heads=KV_HEADS, **kw
    )
    want = cuattn.sparse_attention(q, k, v, _layout(), **kw)
    np.testing.assert_allclose(out, cuattn.merge_heads(want), rtol=1e-12, atol=0)
    # varlen: one sequence packed alone is the batch of one at the same positions
    one = [x[0].transpose(1, 0, 2) for x in (q, k, v)]
    cu_q, cu_k = np.array([0, N_Q]), np.array([0, N_K])
    packed = cuattn.sparse_attention_varlen(*one, cu_q, cu_k, [_layout()], **kw)
    alone = cuattn.sparse_attention(q[:1], k[:1], v[:1], _layout(), **kw)
    np.testing.assert_allclose(packed, alone[0].transpose(1, 0, 2), rtol=1e-12, atol=1e-14)
    words = np.array([SEED & 0xFFFFFFFF, SEED >> 32], np.uint32)  # the same key, held in an array
    by_array = dict(dropout_p=P, dropout_seed=words)
    np.testing.assert_array_equal(
        cuattn.sparse_attention_varlen(*one, cu_q, cu_k, [_layout()], **by_array), packed
    )
    heads_kw = dict(blocksize=BLOCK, kv_heads=KV_HEADS, **by_array)
    np.testing.assert_array_equal(
        cuattn.blocksparse_attention(*heads_last, HEADS, "all", **heads_kw), out
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        (dict(dropout_p=1.0), ValueError, r"dropout_p must be in \[0, 1\)"),
        (dict(dropout_p="0.1"), TypeError, "dropout_p must be a float"),
        (dict(dropout_p=0.1, dropout_seed=-3), ValueError, "dropout_seed must be in"),
        (dict(dropout_p=0.1, dropout_seed=2.0), TypeError, "dropout_seed must be an int"),
    ],
)
def test_bad_dropout_arguments_are_refused(kwargs, error, message):
    q, k, v, _ = _arrays(8)
    with pytest.raises(error, match=message):
        cuattn.sparse_attention(q, k, v, _layout(), **kwargs)
