"""How far a warm call travels: the cuattn modules and Python frames one warm torch forward runs
through (CPU tensors, the default NumPy backend), counted with ``sys.setprofile``. The public
call validates once and goes straight to its route (docs/design.md, "One call, one path")."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import torch

import cuattn

# api -> adapters.torch_ops -> adapters.dlpack -> backends -> backends.numpy_ref (+ layout.layout,
# whose rule the reference reads): the layers a call must cross, and no more. _util (shape and
# dtype helpers every layer shares, importing nothing of cuattn) is no layer: not counted; nor is
# backends.call, the call record every layer is handed, read there through a few accessors.
MAX_MODULES = 6
NOT_A_LAYER = "_util"
CALL_RECORD = "backends.call"
MAX_CALL_RECORD_CALLS = 4
ROOT = Path(cuattn.__file__).parent


def _modules_crossed(fn) -> collections.Counter:
    """cuattn module -> number of Python calls into it while ``fn()`` runs."""
    counts: collections.Counter = collections.Counter()
    root = str(ROOT)

    def profile(frame, event, arg):
        path = frame.f_code.co_filename
        if event == "call" and path.startswith(root) and Path(path).stem != NOT_A_LAYER:
            counts[str(Path(path).relative_to(ROOT).with_suffix("")).replace("/", ".")] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return counts


def test_warm_torch_forward_crosses_at_most_six_modules():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 128, 64, generator=gen) for _ in range(3))
    layout = cuattn.make_layout("strided", n_ctx=128, heads=2, blocksize=32, local_attn_ctx=32)
    cuattn.sparse_attention(q, k, v, layout)  # warm: the layout's tensors are made once
    counts = _modules_crossed(lambda: cuattn.sparse_attention(q, k, v, layout))
    assert "api" in counts and "backends.numpy_ref" in counts  # the profiler saw the call
    assert counts.pop(CALL_RECORD, 0) <= MAX_CALL_RECORD_CALLS, dict(counts)
    assert len(counts) <= MAX_MODULES, dict(counts)
