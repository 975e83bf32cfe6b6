"""FlashInfer's paged-decode baseline reads what it claims: the pages, indices, indptr and last
page lengths it hands FlashInfer hold the benchmark's tokens in order (checked without
flashinfer, which needs a GPU)."""

from __future__ import annotations

import pytest
import torch

from cuattn.tools.bench.flashinfer_paged import paged_decode, paged_layout


@pytest.mark.parametrize("tokens, page", [(40, 16), (64, 32), (1, 16), (17, 1)])
def test_the_pages_hold_each_sequence_in_order(tokens, page):
    gen = torch.Generator().manual_seed(tokens)
    k, v = (torch.randn(3, 2, tokens, 8, generator=gen) for _ in range(2))
    paged = paged_layout(k, v, page, seed=5)
    per_sequence = -(-tokens // page)
    assert paged.indptr.tolist() == list(range(0, 3 * per_sequence + 1, per_sequence))
    assert sorted(paged.indices.tolist()) == list(range(3 * per_sequence))
    if 3 * per_sequence > 3:  # shuffled, as a serving cache's pages are
        assert paged.indices.tolist() != list(range(3 * per_sequence))
    assert paged.last_page_len.tolist() == [tokens - (per_sequence - 1) * page] * 3
    for b in range(3):
        pages = paged.indices[paged.indptr[b] : paged.indptr[b + 1]].long()
        for pool, want in ((paged.k_pages, k), (paged.v_pages, v)):
            # [pages, page, kv_heads, d] -> [kv_heads, pages * page, d], the real tokens
            read = pool[pages].permute(2, 0, 1, 3).reshape(2, per_sequence * page, 8)
            assert torch.equal(read[:, :tokens], want[b])


@pytest.mark.gpu
def test_more_than_one_query_is_refused_by_name():
    flashinfer = pytest.importorskip("flashinfer")
    if not torch.cuda.is_available():
        pytest.skip(f"flashinfer {flashinfer.__version__} needs a CUDA device")
    k = torch.randn(1, 2, 32, 64, device="cuda", dtype=torch.bfloat16)
    decode = paged_decode(k, k, 16, heads=8)
    with pytest.raises(ValueError, match="one query a sequence"):
        decode(torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16))
