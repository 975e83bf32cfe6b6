"""Serving: a paged KV cache with eviction policies, and decode attention over what it keeps.

KVCache(batch, kv_heads, head_dim, dtype, page_size=16, capacity=None, policy=None, like=None)
    .append(k, v, lengths=None, q=None)
decode_attention(q, cache, scale=None, return_lse=False)
paged_decode(q, k_pages, v_pages, block_table, seq_lens, scale=None, return_lse=False): a caller's
    vLLM / FlashAttention block table
policies: SlidingWindow, StreamingLLM, HeavyHitters, SnapKV, Quest, head_adaptive, pyramid
"""

from cuattn.serving import policies
from cuattn.serving.cache import KVCache
from cuattn.serving.decode import decode_attention
from cuattn.serving.paged import paged_decode

__all__ = ["KVCache", "decode_attention", "paged_decode", "policies"]
