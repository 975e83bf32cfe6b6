"""Small forward and backward launches of every kernel, for compute-sanitizer.

    compute-sanitizer --tool memcheck --error-exitcode 1 python scripts/sanitize_launch.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python scripts/sanitize_launch.py

Covers every kernel (forward, delta preprocess, dK/dV, dQ),
every element-rule kind, all three dtypes, a ragged length and shared memory above 48 KB, at sizes
small enough for racecheck (which serialises and instruments every shared-memory access).
Exits non-zero if an output holds NaN.
"""

from __future__ import annotations

import sys

import cupy
import ml_dtypes
import numpy as np

import cuattn
from cuattn import backends as be

N_CTX = 200  # ragged for every block size
BATCH, HEADS = 1, 2
# (pattern, pattern arguments, block size, head dim, dtype): one per rule kind and dtype, and one
# forward config above 48 KB of shared memory (b=64, d=128).
CASES = [
    ("all", {}, 64, 128, np.float16),  # causal
    ("all", {"causal": False}, 32, 64, ml_dtypes.bfloat16),  # none
    ("local", {"local_attn_ctx": 40}, 16, 32, np.float32),  # window
    ("strided", {"local_attn_ctx": 12}, 32, 64, np.float16),  # bitmask
]


def main() -> int:
    # No memory pool: every array is its own cudaMalloc, so memcheck sees its exact bounds (a
    # pooled array has neighbours inside one big allocation, and overruns into them go unseen).
    cupy.cuda.set_allocator(None)
    rng = np.random.default_rng(0)
    bad = []
    for mode, kwargs, blocksize, head_dim, dtype in CASES:
        layout = cuattn.make_layout(mode, N_CTX, HEADS, blocksize=blocksize, **kwargs)
        shape = (BATCH, HEADS, N_CTX, head_dim)
        q, k, v, dout = (
            cupy.asarray(rng.standard_normal(shape, dtype=np.float32).astype(dtype))
            for _ in range(4)
        )
        out, lse = be.forward(q, k, v, layout, head_dim**-0.5, backend="cuda")
        grads = be.backward(q, k, v, out, lse, dout, layout, head_dim**-0.5, backend="cuda")
        results = [out, *grads]
        cupy.cuda.Device().synchronize()
        if any(np.isnan(cupy.asnumpy(r).astype(np.float32)).any() for r in results):
            bad.append(f"{mode} b={blocksize} d={head_dim} {np.dtype(dtype).name}")
    if bad:
        sys.stderr.write("NaN in outputs of: " + ", ".join(bad) + "\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
