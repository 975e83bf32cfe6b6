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
    """Block-sparse attention of q, k, v as a module: :func:`cuattn.sparse_attention` with its
    layout and modifiers held.

    q [batch, heads, time, head_dim]; k, v may have fewer heads dividing q's (GQA/MQA). The
    module has no parameters unless ``alibi_slopes`` is an ``nn.Parameter`` or
    ``rel_max_distance`` is given.

    Args:
        layout (Layout | Pattern | str): a :class:`cuattn.Layout` (one length), a
            :class:`cuattn.Pattern`, or a pattern name (``cuattn.MODES``), which with
            ``heads``, ``blocksize`` and ``pattern_options`` becomes a Pattern: built for each
            length the module meets, one compiled graph for all of them.
        heads (int, optional): the query heads; needed with a pattern name.
        blocksize (int): the pattern's block size, with a pattern name (default 32).
        scale (float, optional): score scale; None (default) is ``1 / sqrt(head_dim)``.
        recompute (bool): keep only q, k and v for the backward (default False).
        softcap (float, optional): caps the scores as in :func:`cuattn.sparse_attention`; None
            (default): off. Keyword only.
        alibi_slopes (torch.Tensor, optional): float32 [heads] ALiBi slopes (e.g.
            ``torch.from_numpy(cuattn.alibi_slopes(heads))``): a buffer of the module (moved by
            ``.to()``), or a learned parameter if it is an ``nn.Parameter``.
        rel_max_distance (int, optional): M >= 0 gives the module a learned relative-position
            bias, the parameter ``rel_bias`` float32 [heads, 2 M + 1] (zeros at first), read as
            :func:`cuattn.sparse_attention`'s ``rel_bias``.
        dropout (float): attention dropout probability in [0, 1) while the module is training
            (a seed per call from torch's generator); none in eval mode. Default 0.0.
        **pattern_options: the pattern's options with a pattern name (``local_attn_ctx``,
            ``num_verts``, ``vertsize``, ``causal``, pattern-specific ones).

    Raises:
        TypeError: ``layout`` not a Layout, Pattern or name; options beside a Layout or
            Pattern; a name without ``heads``; ``alibi_slopes`` not a tensor; ``softcap`` or
            ``dropout`` of the wrong type; a pattern option the mode does not take.
        ValueError: an unknown pattern name or an option out of range; ``softcap`` < 0;
            ``dropout`` outside [0, 1); ``rel_max_distance`` not an int >= 0.

    Example:
        >>> import torch
        >>> from cuattn.nn import SparseSelfAttention
        >>> attn = SparseSelfAttention("strided", heads=4, blocksize=32, local_attn_ctx=32)
        >>> q = k = v = torch.randn(1, 4, 128, 32)
        >>> attn(q, k, v).shape
        torch.Size([1, 4, 128, 32])
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
        """Attend q to k and v with the module's layout and modifiers.

        Args:
            q (torch.Tensor): [batch, heads, time_q, head_dim], a floating dtype.
            k (torch.Tensor): [batch, kv_heads, time_k, head_dim], q's dtype (kv_heads
                dividing heads; keys may be longer, queries end-aligned).
            v (torch.Tensor): k's shape and dtype.

        Returns:
            torch.Tensor: [batch, heads, time_q, head_dim], q's dtype.

        Raises:
            TypeError: as :func:`cuattn.sparse_attention` (dtypes that differ or are not
                floating).
            ValueError: as :func:`cuattn.sparse_attention` (shapes, a Layout built for other
                heads or lengths).
        """
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

    ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj`` are ``nn.Linear`` (k_proj and v_proj map
    embed_dim to kv_heads * head_dim), around a :class:`SparseSelfAttention` (``attention``,
    which holds ``rel_bias`` with ``rel_max_distance``).

    Args:
        embed_dim (int): the model width, divisible by ``heads``.
        heads (int): the query heads.
        layout (Layout | Pattern | str): as in :class:`SparseSelfAttention`, for ``heads``
            heads.
        kv_heads (int, optional): the key/value heads, dividing ``heads`` (GQA/MQA); None
            (default) is ``heads``.
        bias (bool): whether the four projections have a bias (default True).
        blocksize (int): the pattern's block size, with a pattern name (default 32).
        scale (float, optional): score scale; None (default) is ``1 / sqrt(head_dim)``.
        recompute (bool): keep only q, k and v for the attention's backward (default False).
        device (torch.device | str, optional): where the projections' parameters are made.
        dtype (torch.dtype, optional): the projections' parameter dtype.
        softcap (float, optional): as in :class:`SparseSelfAttention`. Keyword only.
        alibi_slopes (torch.Tensor, optional): as in :class:`SparseSelfAttention`.
        rel_max_distance (int, optional): as in :class:`SparseSelfAttention`.
        dropout (float): as in :class:`SparseSelfAttention` (default 0.0).
        **pattern_options: the pattern's options with a pattern name.

    Raises:
        ValueError: ``embed_dim``, ``heads`` or ``kv_heads`` not a positive int; heads not
            dividing embed_dim, kv_heads not dividing heads; a layout for other heads; as
            :class:`SparseSelfAttention`.
        TypeError: as :class:`SparseSelfAttention`.
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
        """Project, attend and project back.

        Args:
            query (torch.Tensor): [batch, time_q, embed_dim].
            key (torch.Tensor, optional): [batch, time_k, embed_dim]; None (default) is
                ``query`` (self-attention). A longer key aligns the queries to its end.
            value (torch.Tensor, optional): key's shape; None (default) is ``key``.

        Returns:
            torch.Tensor: [batch, time_q, embed_dim].

        Raises:
            ValueError: as :func:`cuattn.sparse_attention` (lengths a Layout was not built
                for).
        """
        key = query if key is None else key
        value = key if value is None else value
        q = api.split_heads(self.q_proj(query), self.heads)
        k = api.split_heads(self.k_proj(key), self.kv_heads)
        v = api.split_heads(self.v_proj(value), self.kv_heads)
        return self.out_proj(api.merge_heads(self.attention(q, k, v)))
