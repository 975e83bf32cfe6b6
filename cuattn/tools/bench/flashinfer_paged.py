"""FlashInfer's paged decode, a baseline of scripts/decode_bench.py where flashinfer imports.

FlashInfer's batch decode (``BatchDecodeWithPagedKVCacheWrapper``, the kernel SGLang and
vLLM's FlashInfer backend run) reads its own page layout: a pool ``[pages, page_size,
kv_heads, d]`` for keys and one for values ("NHD"), and per sequence the run of ``indices``
between ``indptr[b]`` and ``indptr[b + 1]`` with ``last_page_len[b]`` tokens in the last page.
The pages are handed out in a shuffled order, so a sequence's tokens are scattered over the pool
as in a serving cache (flex_paged.py does the same for FlexAttention). The plan is made once,
outside the timed call, as a serving loop makes it once a step for all its layers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cuattn._util import ceil_div

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's documented workspace for batch decode
# query heads per kv head from which FlashInfer advises its tensor-core decode
TENSOR_CORE_GROUP = 4


@dataclass
class PagedKV:
    """k, v [batch, kv_heads, tokens, d] in FlashInfer's page layout (module doc)."""

    k_pages: Any  # [pages, page_size, kv_heads, d]
    v_pages: Any
    indptr: Any  # int32 [batch + 1]
    indices: Any  # int32 [pages]
    last_page_len: Any  # int32 [batch]
    page_size: int


def paged_layout(k: Any, v: Any, page_size: int, seed: int = 0) -> PagedKV:
    """k, v [batch, kv_heads, tokens, d] (torch) copied into shuffled pages of ``page_size``
    tokens; every sequence holds ``tokens`` tokens."""
    import torch

    batch, kv_heads, tokens, head_dim = k.shape
    per_sequence = ceil_div(tokens, page_size)
    n_pages = batch * per_sequence
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(n_pages, generator=generator).to(torch.int32).to(k.device)
    shape = (n_pages, page_size, kv_heads, head_dim)
    pools = []
    for x in (k, v):
        padded = torch.zeros((batch, kv_heads, per_sequence * page_size, head_dim), dtype=x.dtype)
        padded = padded.to(x.device)
        padded[:, :, :tokens] = x
        # [batch, kv_heads, pages, page, d] -> [batch * pages, page, kv_heads, d]
        logical = padded.reshape(batch, kv_heads, per_sequence, page_size, head_dim)
        logical = logical.permute(0, 2, 3, 1, 4).reshape(shape)
        pool = torch.empty(shape, dtype=x.dtype, device=x.device)
        pool[indices.long()] = logical
        pools.append(pool)
    indptr = torch.arange(0, n_pages + 1, per_sequence, dtype=torch.int32, device=k.device)
    last = tokens - (per_sequence - 1) * page_size
    last_page_len = torch.full((batch,), last, dtype=torch.int32, device=k.device)
    return PagedKV(pools[0], pools[1], indptr, indices, last_page_len, page_size)


def paged_decode(k: Any, v: Any, page_size: int, heads: int) -> Callable[[Any], Any]:
    """decode(q) -> out for q [batch, heads, 1, d] over k, v [batch, kv_heads, tokens, d] in a
    FlashInfer paged cache (shuffled pages of ``page_size`` tokens). Raises ImportError where
    flashinfer does not import, ValueError for more than one query a sequence (FlashInfer's
    decode takes one; its prefill takes more)."""
    import flashinfer
    import torch

    batch, kv_heads, _, head_dim = k.shape
    paged = paged_layout(k, v, page_size)
    workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=k.device)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        workspace, "NHD", use_tensor_cores=heads // kv_heads >= TENSOR_CORE_GROUP
    )
    sizes = (paged.indptr, paged.indices, paged.last_page_len, heads, kv_heads, head_dim)
    try:
        wrapper.plan(*sizes, page_size, q_data_type=k.dtype, kv_data_type=k.dtype)
    except TypeError:  # releases before 0.2 name one dtype
        wrapper.plan(*sizes, page_size, data_type=k.dtype)
    cache = (paged.k_pages, paged.v_pages)

    def decode(q: Any) -> Any:
        if q.shape[2] != 1:
            raise ValueError(f"FlashInfer's decode takes one query a sequence, got {q.shape[2]}")
        return wrapper.run(q[:, :, 0], cache)[:, :, None]

    return decode
