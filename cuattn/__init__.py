"""cuattn: fused block-sparse attention kernels, callable from torch, jax, CuPy and NumPy.

import cuattn
out = cuattn.blocksparse_attention(q, k, v, heads=4, attn_mode="fixed", local_attn_ctx=128,
                                   num_verts=4, vertsize=1, blocksize=32)
layout = cuattn.make_layout("strided", n_ctx=1024, heads=4, blocksize=32, local_attn_ctx=32)
out = cuattn.sparse_attention(q4, k4, v4, layout)   # q4: [batch, heads, time, head_dim]
"""

from cuattn.api import (
    alibi_slopes,
    attention,
    blocksparse_attention,
    merge_attention_states,
    merge_heads,
    sparse_attention,
    sparse_attention_varlen,
    split_heads,
)
from cuattn.autograd import tape
from cuattn.autograd.tape import Function, Tensor, no_grad, recompute
from cuattn.dynamic import vertical_slash_layout
from cuattn.layout import (
    MODES,
    DeviceLayout,
    ElementRule,
    Layout,
    Pattern,
    make_layout,
)
from cuattn.sdpa import scaled_dot_product_attention
from cuattn.serving import KVCache, decode_attention, paged_decode, policies

__version__ = "0.1.0"

__all__ = [
    "MODES",
    "DeviceLayout",
    "ElementRule",
    "Function",
    "KVCache",
    "Layout",
    "Pattern",
    "Tensor",
    "alibi_slopes",
    "attention",
    "blocksparse_attention",
    "decode_attention",
    "make_layout",
    "merge_attention_states",
    "merge_heads",
    "no_grad",
    "paged_decode",
    "policies",
    "recompute",
    "scaled_dot_product_attention",
    "sparse_attention",
    "sparse_attention_varlen",
    "split_heads",
    "tape",
    "vertical_slash_layout",
]
