"""The score modifiers on a CUDA GPU against the float64 NumPy reference: softcap, ALiBi, a key
bias, a relative-position table and dropout, alone and together, forward and every gradient
(torch CUDA tensors through cuattn.sparse_attention, so the cuda backend's MODS_SCORE kernels).
One line per case; exits 1 on any case over its tolerance, NaN, or a dropout mask unlike the
reference's. Run on the GPU machine: PYTHONPATH=. python scripts/gpu_modifiers_check.py
"""

from __future__ import annotations

import sys

import numpy as np
import torch

import cuattn

TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 5e-2, torch.float32: 1e-4}
HEADS, KV_HEADS, N_Q, N_K = 4, 2, 333, 400


def _case(name, dtype, head_dim, block, rule_causal, **mods):
    rng = np.random.default_rng(abs(hash(name)) % 2**32)
    q = rng.standard_normal((2, HEADS, N_Q, head_dim))
    k, v = (rng.standard_normal((2, KV_HEADS, N_K, head_dim)) for _ in range(2))
    dout = rng.standard_normal(q.shape)
    layout = cuattn.make_layout("all", N_K, HEADS, block, causal=rule_causal, n_q=N_Q)
    host = {
        key: (val.numpy() if isinstance(val, torch.Tensor) else val) for key, val in mods.items()
    }
    leaves = [torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v)]
    ops = {
        key: torch.tensor(val, requires_grad=key != "alibi_slopes")
        for key, val in host.items()
        if isinstance(val, np.ndarray)
    }
    scalars = {key: val for key, val in host.items() if not isinstance(val, np.ndarray)}
    ref = cuattn.sparse_attention(*leaves, layout, **ops, **scalars)
    ref.backward(torch.tensor(dout))
    refs = [x.grad.numpy() for x in leaves] + [
        ops[key].grad.numpy() for key in ops if ops[key].requires_grad
    ]
    dev = [torch.tensor(x, dtype=dtype, device="cuda", requires_grad=True) for x in (q, k, v)]
    dops = {
        key: torch.tensor(val, device="cuda", requires_grad=key != "alibi_slopes")
        for key, val in host.items()
        if isinstance(val, np.ndarray)
    }
    out = cuattn.sparse_attention(*dev, layout, **dops, **scalars)
    out.backward(torch.tensor(dout, dtype=dtype, device="cuda"))
    got = [x.grad.float().cpu().numpy() for x in dev] + [
        dops[key].grad.cpu().numpy() for key in dops if dops[key].requires_grad
    ]
    errors = [
        float(
            np.linalg.norm(out.detach().float().cpu().numpy() - ref.detach().numpy())
            / np.linalg.norm(ref.detach().numpy())
        )
    ]
    for g, r in zip(got, refs, strict=True):
        errors.append(float(np.linalg.norm(g - r) / max(np.linalg.norm(r), 1e-30)))
    bad = any(
        not np.isfinite(e) or e > TOLERANCE[dtype] * (4 if i > 3 else 1)
        for i, e in enumerate(errors)
    )
    print(
        f"{'FAIL' if bad else 'ok  '} {name:44s} {str(dtype):15s} d{head_dim} b{block} "
        + " ".join(f"{e:.1e}" for e in errors),
        flush=True,
    )
    return not bad


def _dropout_mask(block):
    """q = k = 0 and one-hot values read P * Z back: the GPU's kept set against the reference's."""
    n, p, seed = 128, 0.3, 2**40 + 3
    q = torch.zeros(2, HEADS, n, n, device="cuda")
    v = torch.eye(n, device="cuda").expand(2, HEADS, n, n).contiguous()
    layout = cuattn.make_layout("all", n, HEADS, block, causal=False)
    out = cuattn.sparse_attention(q, q, v, layout, scale=1.0, dropout_p=p, dropout_seed=seed)
    kept = (out * n * (1 - p)).round().cpu().numpy() == 1
    from cuattn.backends.dropout import keep_mask

    want = keep_mask(p, seed, *np.indices(kept.shape, sparse=True))
    same = bool((kept == want).all())
    print(
        f"{'ok  ' if same else 'FAIL'} dropout mask equals the reference's, block {block}: "
        f"{int((kept != want).sum())} differ",
        flush=True,
    )
    return same


def main() -> int:
    rng = np.random.default_rng(0)
    slopes = cuattn.alibi_slopes(HEADS)
    key_bias = (rng.standard_normal((2, N_K)) * 2).astype(np.float32)
    key_bias[1, -30:] = -np.inf
    table = rng.standard_normal((HEADS, 41)).astype(np.float32)
    ok = True
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim, block in ((64, 64), (128, 128), (128, 64)):
            ok &= _case("softcap", dtype, head_dim, block, True, softcap=20.0)
            ok &= _case(
                "alibi+key_bias",
                dtype,
                head_dim,
                block,
                True,
                alibi_slopes=slopes,
                key_bias=key_bias,
            )
            ok &= _case("rel_bias", dtype, head_dim, block, False, rel_bias=table)
            ok &= _case("dropout", dtype, head_dim, block, True, dropout_p=0.2, dropout_seed=7)
            ok &= _case(
                "all",
                dtype,
                head_dim,
                block,
                True,
                softcap=5.0,
                alibi_slopes=slopes,
                key_bias=key_bias,
                rel_bias=table,
                dropout_p=0.1,
                dropout_seed=9,
            )
    for block in (16, 64, 128):
        ok &= _dropout_mask(block)
    print("ALL OK" if ok else "FAILURES", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
