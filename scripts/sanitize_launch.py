"""Small launches of every kernel family, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/sanitize_launch.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python scripts/sanitize_launch.py
    python scripts/sanitize_launch.py --cpu   # the same launches on the interpreter (smoke test)

Covers the forward, the delta preprocess, dK/dV and dQ kernels for
every element-rule kind, all three dtypes, GQA, a ragged length and shared memory above 48 KB; the
two-way merge; the split-KV decode kernels (split, merge, and the HeavyHitters mass and Quest
page-choice kernels); the device layout builders (top-k, mass threshold, vertical-slash) and
attention on the layouts they build. Sizes are small enough for racecheck, which serialises and
instruments every shared-memory access. Exits non-zero if an output holds NaN.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import ml_dtypes
import numpy as np

import cuattn
from cuattn import backends as be
from cuattn import dynamic
from cuattn._util import host_array
from cuattn.backends.call import AttentionCall
from cuattn.serving import policies as P

N_CTX = 200  # ragged for every block size
BATCH, HEADS = 1, 2
# (pattern, pattern arguments, block size, head dim, dtype, kv heads): one per rule kind and
# dtype, one forward config above 48 KB of shared memory (b=64, d=128), one GQA case and one at
# 128-blocks.
CASES = [
    ("all", {}, 64, 128, np.float16, HEADS),  # causal
    ("all", {"causal": False}, 32, 64, ml_dtypes.bfloat16, HEADS),  # none
    ("local", {"local_attn_ctx": 40}, 16, 32, np.float32, HEADS),  # window
    ("strided", {"local_attn_ctx": 12}, 32, 64, np.float16, HEADS),  # bitmask
    ("all", {}, 64, 64, ml_dtypes.bfloat16, 1),  # GQA: two query heads per key head
    ("all", {"causal": False}, 128, 64, np.float16, HEADS),  # 128-blocks (sm_90a kernels)
]
DECODE_PAGE = 16
DECODE_POLICIES = [None, P.HeavyHitters(40, 8), P.Quest(2, DECODE_PAGE)]
BUILDER_N, BUILDER_BLOCK = 512, 64


def attention_cases(xp: Any, backend: str, rng: np.random.Generator) -> list[tuple[str, Any]]:
    results = []
    for mode, kwargs, blocksize, head_dim, dtype, kv_heads in CASES:
        layout = cuattn.make_layout(mode, N_CTX, HEADS, blocksize=blocksize, **kwargs)
        q_shape, kv_shape = (BATCH, HEADS, N_CTX, head_dim), (BATCH, kv_heads, N_CTX, head_dim)
        q, k, v, dout = (
            xp.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
            for shape in (q_shape, kv_shape, kv_shape, q_shape)
        )
        call = AttentionCall(layout, head_dim**-0.5, backend=backend)
        out, lse = be.forward(q, k, v, call)
        grads = be.backward(q, k, v, out, lse, dout, None, call)
        name = f"{mode} b={blocksize} d={head_dim} {np.dtype(dtype).name} kv_heads={kv_heads}"
        results += [(name, x) for x in (out, *grads)]
        if mode == "all" and kv_heads == HEADS:
            merged = be.merge_states(out, lse, out, lse, backend=backend)
            results += [(name + " merge", x) for x in merged]
    return results


def decode_cases(xp: Any, backend: str, rng: np.random.Generator) -> list[tuple[str, Any]]:
    results = []
    like = xp.zeros(1, dtype=np.float32) if xp is not np else None
    for policy in DECODE_POLICIES:
        cache = cuattn.KVCache(2, 2, 64, "float16", page_size=DECODE_PAGE, policy=policy, like=like)
        k, v = (rng.standard_normal((2, 2, 90, 64)).astype(np.float16) for _ in "kv")
        cache.append(xp.asarray(k), xp.asarray(v), lengths=[90, 61])
        for _ in range(3):
            k, v = (rng.standard_normal((2, 2, 1, 64)).astype(np.float16) for _ in "kv")
            cache.append(xp.asarray(k), xp.asarray(v))
            q = xp.asarray(rng.standard_normal((2, 4, 1, 64)).astype(np.float16))
            out = cuattn.decode_attention(q, cache, backend=backend)
        results.append((f"decode {type(policy).__name__}", out))
    return results


def builder_cases(xp: Any, backend: str, rng: np.random.Generator) -> list[tuple[str, Any]]:
    shape = (HEADS, BUILDER_N, 64)
    q, k, v = (xp.asarray(rng.standard_normal(shape).astype(np.float16)) for _ in "qkv")
    layouts = {
        "topk": dynamic.topk_blocks(q, k, BUILDER_BLOCK, 3, backend=backend),
        "mass": dynamic.mass_threshold_blocks(
            q, k, BUILDER_BLOCK, 0.9, max_blocks=4, backend=backend
        ),
        "vertical_slash": dynamic.vertical_slash_layout(
            q, k, BUILDER_BLOCK, 8, 8, 64, backend=backend
        ),
    }
    results = []
    for name, layout in layouts.items():
        out, _ = be.forward(
            q[None], k[None], v[None], AttentionCall(layout, 0.125, backend=backend)
        )
        results.append((f"builder {name}", out))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="NumPy arrays on the interpreter")
    args = parser.parse_args(argv)
    if args.cpu:
        xp, backend = np, "interp"
    else:
        import cupy

        # No memory pool: every array is its own cudaMalloc, so memcheck sees its exact bounds
        # (a pooled array has neighbours inside one allocation, and overruns into them go unseen).
        cupy.cuda.set_allocator(None)
        xp, backend = cupy, "cuda"
    rng = np.random.default_rng(0)
    results = attention_cases(xp, backend, rng)
    results += decode_cases(xp, backend, rng)
    results += builder_cases(xp, backend, rng)
    if xp is not np:
        xp.cuda.Device().synchronize()
    bad = {name for name, x in results if np.isnan(host_array(x).astype(np.float32)).any()}
    if bad:
        sys.stderr.write("NaN in outputs of: " + ", ".join(sorted(bad)) + "\n")
        return 1
    sys.stderr.write(f"{len(results)} outputs, no NaN\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
