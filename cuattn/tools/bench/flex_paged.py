"""FlexAttention's paged decode, the baseline of scripts/decode_bench.py.

torch's own paged KV cache for FlexAttention (torch.nn.attention.experimental._paged_attention,
as in its gpt-fast example): one page pool [1, kv_heads, pages * page_size, d] shared by the
batch, a page table per sequence, and a decode BlockMask (one query, ``tokens`` keys per
sequence) whose logical key blocks are mapped onto the physical pages. The pages are handed out
in a shuffled order, so a sequence's tokens are scattered over the pool as in a serving cache.
It keeps every token (FlexAttention has no eviction): the comparison is at equal kept tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cuattn._util import ceil_div


def paged_decode(k: Any, v: Any, page_size: int, seed: int = 0) -> Callable[[Any], Any]:
    """decode(q) -> out for q [batch, heads, 1, d] over k, v [batch, kv_heads, tokens, d]
    stored in a FlexAttention paged cache (pages of ``page_size`` tokens, shuffled)."""
    import torch
    from torch.nn.attention.experimental._paged_attention import PagedAttention
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    batch, kv_heads, tokens, head_dim = k.shape
    pages_per_sequence = ceil_div(tokens, page_size)
    n_pages = batch * pages_per_sequence
    device = str(k.device)
    paged = PagedAttention(n_pages, page_size, batch, device=device)
    generator = torch.Generator().manual_seed(seed)
    paged.empty_pages = torch.randperm(n_pages, generator=generator).tolist()
    shape = (1, kv_heads, n_pages * page_size, head_dim)
    k_cache = torch.zeros(shape, dtype=k.dtype, device=k.device)
    v_cache = torch.zeros(shape, dtype=v.dtype, device=v.device)
    positions = torch.arange(tokens, device=k.device)[None]
    for b in range(batch):
        index = torch.tensor([b], device=k.device)
        paged.reserve(index, torch.tensor([tokens], device=k.device))
        paged.assign(index, positions, k[b : b + 1], v[b : b + 1], k_cache, v_cache)

    def keep_real_tokens(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return kv_idx < tokens

    logical = create_block_mask(
        keep_real_tokens, batch, None, 1, pages_per_sequence * page_size, device, page_size
    )
    physical = paged.convert_logical_block_mask(logical)
    attend = torch.compile(flex_attention) if k.is_cuda else flex_attention

    def decode(q: Any) -> Any:
        return attend(q, k_cache, v_cache, block_mask=physical, enable_gqa=True)

    return decode
