"""torch ``nn.Module`` blocks over cuattn's attention (imports torch; ``import cuattn.nn``).

    SparseSelfAttention(layout, ...)          q, k, v [batch, heads, time, head_dim] -> out
    SparseMultiheadAttention(embed_dim, heads, layout, ...)
                                              x [batch, time, embed_dim] -> [batch, time, embed_dim]

``layout`` is a :class:`cuattn.Layout` (one length), a :class:`cuattn.Pattern`, or a pattern
name with its options (``"fixed", blocksize=64, local_attn_ctx=128, ...``), which becomes a
Pattern: built for each length the module meets, one compiled graph for all of them.
``dropout`` drops attention probabilities in training mode (cuattn's generator, its seed from
torch's); compiled, traced and CUDA-graphed as cuattn's ops are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from cuattn import api
from cuattn.backends.call import ScoreMods
from cuattn.layout.layout import Layout
from cuattn.layout.pattern import Pattern

__all__ = ["SparseMultiheadAttention", "SparseSelfAttention"]


def _as_layout(
    layout: Layout | Pattern | str, heads: int | None, blocksize: int, options: dict[str, Any]
) -> Layout | Pattern:
    if isinstance(layout, (Layout, Pattern)):
        if options:
            raise TypeError(
                f"pattern options {sorted(options)} apply to a pattern name, not to a given "
                f"{type(layout).__name__}"
            )
        return layout
    if isinstance(layout, str):
        if heads is None:
            raise TypeError("heads is needed to build a Pattern from a pattern name")
        return Pattern(layout, heads, blocksize, **options)
    raise TypeError(
        f"layout must be a cuattn.Layout, a cuattn.Pattern or a pattern name, got "
        f"{type(layout).__name__}"
    )


class SparseSelfAttention(nn.Module):
    """Block-sparse attention of q, k, v [batch, heads, time, head_dim] (k, v may have fewer
    heads dividing q's: GQA/MQA), as ``cuattn.sparse_attention``; no parameters.

    ``SparseSelfAttention("strided", heads=8, blocksize=64, local_attn_ctx=128)``, or with a
    Layout/Pattern. ``scale`` defaults to 1/sqrt(head_dim); ``recompute`` keeps only q, k, v
    for backward; ``softcap`` (keyword) caps the scores as in ``cuattn.sparse_attention``;
    ``alibi_slopes`` (keyword: a float32 [heads] tensor, e.g. ``torch.from_numpy(
    cuattn.alibi_slopes(heads))``) adds ALiBi's bias: a buffer of the module (moved with it by
    ``.to()``), or a parameter that learns if it is an ``nn.Parameter``. ``rel_max_distance``
    (keyword: an int M >= 0) gives the module a learned relative-position bias (T5's, Swin's):
    the parameter ``rel_bias`` [heads, 2 M + 1] (float32, zeros at first), whose column
    clamp(k_pos - q_pos, -M, M) + M is added to each score (``cuattn.sparse_attention``'s
    ``rel_bias``). ``dropout`` (keyword, 0 <= p < 1) is attention dropout while the module is
    training (``cuattn.sparse_attention``'s ``dropout_p``; each call draws its seed from torch's
    default generator), none in eval mode.
    """

    def __init__(
        self,
        layout: Layout | Pattern | str,
        heads: int | None = None,
        blocksize: int = 32,
        scale: float | None = None,
        recompute: bool = False,
        *,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        rel_max_distance: int | None = None,
        dropout: float = 0.0,
        **pattern_options: Any,
    ) -> None:
        super().__init__()
        self.layout = _as_layout(layout, heads, blocksize, pattern_options)
        ScoreMods().with_dropout(dropout, 0)  # checked now, not at the first forward
        self.dropout = float(dropout)
        self.scale = scale
        self.recompute = recompute
        ScoreMods.from_arguments(softcap)  # checked now, not at the first forward
        self.softcap = softcap
        if alibi_slopes is not None and not isinstance(alibi_slopes, torch.Tensor):
            raise TypeError(
                "alibi_slopes must be a float32 torch tensor [heads] (or an nn.Parameter), got "
                f"{type(alibi_slopes).__name__}"
            )
        if isinstance(alibi_slopes, nn.Parameter):
            self.alibi_slopes = alibi_slopes
        else:
            self.register_buffer("alibi_slopes", alibi_slopes)
        self.rel_bias: nn.Parameter | None = None
        if rel_max_distance is not None:
            bad = isinstance(rel_max_distance, bool) or not isinstance(rel_max_distance, int)
            if bad or rel_max_distance < 0:
                raise ValueError(f"rel_max_distance must be an int >= 0, got {rel_max_distance!r}")
            width = 2 * rel_max_distance + 1
            self.rel_bias = nn.Parameter(torch.zeros(self.layout.heads, width))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return api.sparse_attention(
            q,
            k,
            v,
            self.layout,
            self.scale,
            self.recompute,
            softcap=self.softcap,
            alibi_slopes=self.alibi_slopes,
            rel_bias=self.rel_bias,
            dropout_p=self.dropout if self.training else 0.0,
        )

    def extra_repr(self) -> str:
        rel = None if self.rel_bias is None else (self.rel_bias.shape[-1] - 1) // 2
        return (
            f"layout={self.layout!r}, scale={self.scale}, recompute={self.recompute}, "
            f"softcap={self.softcap}, alibi={self.alibi_slopes is not None}, "
            f"rel_max_distance={rel}, dropout={self.dropout}"
        )


class SparseMultiheadAttention(nn.Module):
    """Multi-head attention with block-sparse scores: projections, GQA, output projection.

    ``forward(query, key=None, value=None)`` with [batch, time, embed_dim] inputs (key and
    value default to query: self-attention; key/value may be longer than query, end-aligned)
    returns [batch, time_q, embed_dim]. ``kv_heads`` (default ``heads``) must divide ``heads``;
    k_proj and v_proj then map embed_dim to kv_heads * head_dim. Parameters: q_proj, k_proj,
    v_proj, out_proj (``nn.Linear``, ``bias`` on all four); with ``rel_max_distance``, also
    attention.rel_bias. ``softcap``, ``alibi_slopes``, ``rel_max_distance`` and ``dropout`` as
    in :class:`SparseSelfAttention`.
    """

    def __init__(
        self,
        embed_dim: int,
        heads: int,
        layout: Layout | Pattern | str,
        kv_heads: int | None = None,
        bias: bool = True,
        blocksize: int = 32,
        scale: float | None = None,
        recompute: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        softcap: float | None = None,
        alibi_slopes: torch.Tensor | None = None,
        rel_max_distance: int | None = None,
        dropout: float = 0.0,
        **pattern_options: Any,
    ) -> None:
        super().__init__()
        kv_heads = heads if kv_heads is None else kv_heads
        for name, value in (("embed_dim", embed_dim), ("heads", heads), ("kv_heads", kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if embed_dim % heads:
            raise ValueError(f"embed_dim={embed_dim} must be divisible by heads={heads}")
        if heads % kv_heads:
            raise ValueError(f"kv_heads={kv_heads} must divide heads={heads} (GQA/MQA)")
        self.embed_dim, self.heads, self.kv_heads = embed_dim, heads, kv_heads
        self.head_dim = embed_dim // heads
        made = {"bias": bias, "device": device, "dtype": dtype}
        self.q_proj = nn.Linear(embed_dim, embed_dim, **made)
        self.k_proj = nn.Linear(embed_dim, kv_heads * self.head_dim, **made)
        self.v_proj = nn.Linear(embed_dim, kv_heads * self.head_dim, **made)
        self.out_proj = nn.Linear(embed_dim, embed_dim, **made)
        self.attention = SparseSelfAttention(
            layout,
            heads,
            blocksize,
            scale,
            recompute,
            softcap=softcap,
            alibi_slopes=alibi_slopes,
            rel_max_distance=rel_max_distance,
            dropout=dropout,
            **pattern_options,
        )
        if self.attention.layout.heads != heads:
            raise ValueError(
                f"layout is for heads={self.attention.layout.heads}, the module has heads={heads}"
            )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor | None = None,
        value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        key = query if key is None else key
        value = key if value is None else value
        q = api.split_heads(self.q_proj(query), self.heads)
        k = api.split_heads(self.k_proj(key), self.kv_heads)
        v = api.split_heads(self.v_proj(value), self.kv_heads)
        return self.out_proj(api.merge_heads(self.attention(q, k, v)))
