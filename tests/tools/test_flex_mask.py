"""The FlexAttention BlockMask built from a layout computes exactly the layout's attention.

Runs FlexAttention eagerly on the CPU in float64 against the NumPy reference, for every element
rule kind and for block sizes below, at and above Flex's 128 tile (regridding both ways).
"""

from __future__ import annotations

import numpy as np
import pytest

from cuattn.backends import numpy_ref as reference
from cuattn.backends.call import AttentionCall
from cuattn.layout import make_layout

torch = pytest.importorskip("torch")
flex_attention_module = pytest.importorskip("torch.nn.attention.flex_attention")

SCALE = 0.2
HEAD_DIM = 16
HEADS = 2

CASES = [
    ("all", {}, 32, 256),  # causal rule, regrid 32 -> 128
    ("all", {"causal": False}, 128, 320),  # rule none, ragged last tile
    ("local", {"local_attn_ctx": 40}, 32, 256),  # window rule
    ("local", {"local_attn_ctx": 200}, 128, 384),  # window rule, CSR used as is
    ("strided", {"local_attn_ctx": 16}, 32, 256),  # bitmask rule
    ("fixed", {"local_attn_ctx": 64, "num_verts": 2, "vertsize": 1}, 32, 256),  # per-head blocks
    ("bigbird", {}, 64, 320),  # random blocks, ragged
    ("longformer", {"local_attn_ctx": 64}, 256, 512),  # regrid 256 -> 128
]


# Eager FlexAttention warns that it is unfused; that is what this CPU test wants.
@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("mode", "kwargs", "blocksize", "n_ctx"), CASES)
def test_block_mask_matches_reference(mode, kwargs, blocksize, n_ctx):
    from cuattn.tools.bench.flex_mask import block_mask_from_layout

    layout = make_layout(mode, n_ctx=n_ctx, heads=HEADS, blocksize=blocksize, **kwargs)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(1, HEADS, n_ctx, HEAD_DIM, dtype=torch.float64, generator=gen) for _ in range(3)
    )
    block_mask = block_mask_from_layout(layout, "cpu")
    out = flex_attention_module.flex_attention(q, k, v, block_mask=block_mask, scale=SCALE)
    want, _ = reference.attention_forward(
        q.numpy(), k.numpy(), v.numpy(), AttentionCall(layout, SCALE)
    )
    np.testing.assert_allclose(out.numpy(), want, rtol=1e-10, atol=1e-12)
