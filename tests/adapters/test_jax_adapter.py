"""jax arrays through the public API: jax.grad (eager and jitted) vs a dense masked oracle."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import cuattn
from tests.helpers import attn_cases as cases
from tests.helpers.attn_cases import random_qkv, rel, torch_dense

# float64 is needed for the 1e-9 comparison; jax keeps this process-wide.
jax.config.update("jax_enable_x64", True)


def _oracle(arrays, mask, weight):
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    out = torch_dense(*leaves, mask)
    (out * torch.from_numpy(weight)).sum().backward()
    return out.detach().numpy(), [t.grad.numpy() for t in leaves]


def _loss(kwargs, recompute, weight):
    def loss(q, k, v):
        out = cuattn.blocksparse_attention(
            q, k, v, heads=cases.HEADS, blocksize=cases.BLOCK, recompute=recompute, **kwargs
        )
        return (out * weight).sum()

    return loss


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("mode", sorted(cases.MODES))
def test_eager_grad_matches_dense(mode, recompute):
    kwargs, mask = cases.MODES[mode]
    arrays = random_qkv(seed=sorted(cases.MODES).index(mode))
    weight = np.random.default_rng(6).standard_normal(arrays[0].shape)
    ref_out, ref_grads = _oracle(arrays, mask, weight)

    q, k, v = (jnp.asarray(a) for a in arrays)
    out = cuattn.blocksparse_attention(q, k, v, heads=cases.HEADS, blocksize=cases.BLOCK, **kwargs)
    assert isinstance(out, jax.Array) and out.dtype == jnp.float64
    assert rel(out, ref_out) <= cases.GRAD_RTOL_F64
    grads = jax.grad(_loss(kwargs, recompute, jnp.asarray(weight)), argnums=(0, 1, 2))(q, k, v)
    for name, got, want in zip("qkv", grads, ref_grads, strict=True):
        assert isinstance(got, jax.Array)
        assert rel(got, want) <= cases.GRAD_RTOL_F64, name


@pytest.mark.parametrize("recompute", [False, True])
def test_jit_grad_on_cpu_through_pure_callback(recompute):
    kwargs, mask = cases.MODES["fixed"]
    arrays = random_qkv(seed=21)
    weight = np.random.default_rng(7).standard_normal(arrays[0].shape)
    _, ref_grads = _oracle(arrays, mask, weight)
    q, k, v = (jnp.asarray(a) for a in arrays)
    loss = _loss(kwargs, recompute, jnp.asarray(weight))
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for got, want in zip(grads, ref_grads, strict=True):
        assert rel(got, want) <= cases.GRAD_RTOL_F64


def test_eager_and_jit_agree_bitwise():
    kwargs, _ = cases.MODES["strided"]
    q, k, v = (jnp.asarray(a) for a in random_qkv(seed=22))
    loss = _loss(kwargs, False, 1.0)
    eager = jax.grad(loss)(q, k, v)
    jitted = jax.jit(jax.grad(loss))(q, k, v)
    assert np.array_equal(np.asarray(eager), np.asarray(jitted))


def test_float32_keeps_dtype():
    kwargs, mask = cases.MODES["local"]
    arrays = random_qkv(seed=23, dtype=np.float32)
    q, k, v = (jnp.asarray(a) for a in arrays)
    out = cuattn.blocksparse_attention(q, k, v, heads=cases.HEADS, blocksize=cases.BLOCK, **kwargs)
    assert out.dtype == jnp.float32
    g = jax.grad(_loss(kwargs, False, 1.0))(q, k, v)
    assert g.dtype == jnp.float32
    ref = torch_dense(*(torch.from_numpy(a.astype(np.float64)) for a in arrays), mask)
    assert rel(out, ref) <= 1e-5


def test_vmap_runs_per_element_through_the_callback():
    lay = cuattn.make_layout("local", 32, cases.HEADS, blocksize=cases.BLOCK, local_attn_ctx=8)
    x = jnp.asarray(np.random.default_rng(24).standard_normal((3, 2, cases.HEADS, 32, 8)))

    def f(q):
        return cuattn.sparse_attention(q, q * 0.5, q, lay)

    mapped = jax.vmap(f)(x)
    looped = jnp.stack([f(x[i]) for i in range(x.shape[0])])
    assert np.array_equal(np.asarray(mapped), np.asarray(looped))
    grads = jax.vmap(jax.grad(lambda q: f(q).sum()))(x)
    looped = jnp.stack([jax.grad(lambda q: f(q).sum())(x[i]) for i in range(x.shape[0])])
    assert np.array_equal(np.asarray(grads), np.asarray(looped))
