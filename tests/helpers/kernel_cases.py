"""The pattern table of the GPU kernel sweep (tests/backends/test_cuda_kernels.py), importable
without a GPU so that a CPU test can build every layout the sweep will ask for: a table entry
that cannot serve some block size must fail here, on the CPU, not on a lent GPU."""

from __future__ import annotations

from typing import Any

import cuattn

N_CTX = 1000  # ragged for every block size
HEADS = 2

# local_attn_ctx 256 for fixed: a multiple of every block size with at least two blocks per
# group, so num_verts = 2 is valid at b = 128 too (128 would give one block per group).
PATTERNS: list[tuple[str, dict[str, Any]]] = [
    ("all", {}),
    ("all", {"causal": False}),
    ("local", {"local_attn_ctx": 100}),
    ("local", {"local_attn_ctx": 100, "causal": False}),
    ("strided", {"local_attn_ctx": 24}),  # natural order, per-block bitmasks
    # transposed order (perm) where (n / s) % b == 0, i.e. b = 16, 32; bitmasks otherwise
    ("strided", {"local_attn_ctx": 32, "n_ctx": 1024}),
    ("fixed", {"local_attn_ctx": 256, "num_verts": 2, "vertsize": 1}),
    ("longformer", {"local_attn_ctx": 64, "global_tokens": (0, 333)}),
    ("bigbird", {"num_random_blocks": 1}),
    ("variable", {"num_random_blocks": 1, "causal": True}),
]


def pattern_id(pattern: tuple[str, dict[str, Any]]) -> str:
    mode, kwargs = pattern
    return mode + "".join(f"-{k}={v}" for k, v in kwargs.items())


def sweep_layout(pattern: tuple[str, dict[str, Any]], blocksize: int) -> cuattn.Layout:
    """The layout the GPU sweep runs for this table entry and block size."""
    mode, kwargs = pattern
    kwargs = dict(kwargs)
    n_ctx = kwargs.pop("n_ctx", N_CTX)
    return cuattn.make_layout(mode, n_ctx, HEADS, blocksize=blocksize, **kwargs)
