"""The public calls with the original calling convention, NumPy in -> NumPy out."""

import numpy as np
import pytest

import cuattn
from tests.helpers.oracle import dense_attention, rel_err, rule_all, rule_local, rule_strided


def _qkv(rng, batch, time, embd, dtype=np.float64):
    return [rng.standard_normal((batch, time, embd)).astype(dtype) for _ in range(3)]


def _dense_bte(q, k, v, heads, mask):
    split = [cuattn.split_heads(x, heads) for x in (q, k, v)]
    out, _ = dense_attention(*split, mask, 1 / np.sqrt(q.shape[-1] // heads))
    return cuattn.merge_heads(out)


@pytest.mark.parametrize(
    "mode,kw,rule",
    [
        ("all", {}, lambda n: rule_all(n, 4)),
        ("local", {"local_attn_ctx": 32}, lambda n: rule_local(n, 4, 32)),
        ("strided", {"local_attn_ctx": 16}, lambda n: rule_strided(n, 4, 16)),
    ],
)
@pytest.mark.parametrize("n", [256, 200])
def test_blocksparse_and_dense_paths_match_the_rule(mode, kw, rule, n):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 2, n, 64)
    ref = _dense_bte(q, k, v, 4, rule(n))
    sparse = cuattn.blocksparse_attention(q, k, v, heads=4, attn_mode=mode, blocksize=16, **kw)
    dense = cuattn.attention(q, k, v, heads=4, attn_mode=mode, **kw)
    assert rel_err(sparse, ref) < 1e-12 and rel_err(dense, ref) < 1e-12


def test_original_readme_example_runs_fixed():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 2, 512, 256, np.float32)
    out = cuattn.blocksparse_attention(
        q,
        k,
        v,
        heads=4,
        attn_mode="fixed",
        local_attn_ctx=128,
        num_verts=4,
        vertsize=1,
        blocksize=32,
        recompute=True,
    )
    assert type(out) is np.ndarray and out.dtype == np.float32 and out.shape == q.shape
    lay = cuattn.make_layout("fixed", 512, 4, 32, local_attn_ctx=128, num_verts=4, vertsize=1)
    ref = _dense_bte(q, k, v, 4, lay.to_mask())
    assert rel_err(out, ref) < 2e-5


def test_sparse_attention_returns_lse_and_honours_scale():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 64, 16)) for _ in range(3))
    lay = cuattn.make_layout("all", 64, 2, blocksize=16)
    out, lse = cuattn.sparse_attention(q, k, v, lay, scale=0.3, return_lse=True)
    ref, ref_lse = dense_attention(q, k, v, lay.to_mask(), 0.3)
    assert rel_err(out, ref) < 1e-12 and rel_err(lse, ref_lse) < 1e-12
    assert lse.shape == (1, 2, 64) and lse.dtype == np.float64


def test_split_and_merge_heads_round_trip():
    x = np.arange(2 * 5 * 12, dtype=np.float32).reshape(2, 5, 12)
    s = cuattn.split_heads(x, 3)
    assert s.shape == (2, 3, 5, 4)
    assert s[1, 2, 4, 3] == x[1, 4, 2 * 4 + 3]
    np.testing.assert_array_equal(cuattn.merge_heads(s), x)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_numpy_in_numpy_out_same_dtype(dtype):
    rng = np.random.default_rng(3)
    q, k, v = _qkv(rng, 1, 64, 32, dtype)
    out = cuattn.blocksparse_attention(q, k, v, heads=2, attn_mode="all", blocksize=16)
    assert type(out) is np.ndarray and out.dtype == dtype and out.shape == q.shape


def test_env_var_selects_backend(monkeypatch):
    from cuattn import backends as be

    monkeypatch.setenv("CUATTN_BACKEND", "numpy")
    assert be.resolve_backend(None, on_device=False).name == "numpy"
    monkeypatch.setenv("CUATTN_BACKEND", "bogus")
    with pytest.raises(ValueError, match="backend must be one of"):
        be.resolve_backend(None, on_device=False)
