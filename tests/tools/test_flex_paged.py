"""The FlexAttention paged-decode baseline computes what it claims: attention over the tokens
it was given, scattered over shuffled pages (so a decode benchmark compares like with like)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cuattn.tools.bench.flex_paged import paged_decode

flex = pytest.importorskip("torch.nn.attention.experimental._paged_attention")


@pytest.mark.parametrize("tokens, page", [(40, 16), (64, 32)])
def test_flex_paged_decode_equals_attention_over_the_same_tokens(tokens, page):
    gen = torch.Generator().manual_seed(tokens)
    k, v = (torch.randn(2, 2, tokens, 16, generator=gen) for _ in range(2))
    q = torch.randn(2, 4, 1, 16, generator=gen)  # GQA: 4 query heads on 2 kv heads
    out = paged_decode(k, v, page, seed=3)(q)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert torch.allclose(out, want, rtol=1e-5, atol=1e-6)
