"""Layouts chosen from the data (``cuattn.dynamic``): the selection rules in one namespace.

    topk_blocks(q, k, blocksize, topk, pool="mean", causal=True, keep_diagonal=True, keep_first=1)
    mass_threshold_blocks(q, k, blocksize, tau, pool="mean", causal=True, keep_diagonal=True,
                          max_blocks=None, scale=None)
    vertical_slash_layout(q, k, blocksize=64, num_vertical=64, num_slash=64, last_q=64, ...)

Definitions: cuattn/layout/selection.py and cuattn/layout/dynamic.py. The selection is not
differentiable; attention over the chosen layout is, on every route.
"""

from cuattn.layout.dynamic import vertical_slash_layout
from cuattn.layout.selection import block_scores, mass_threshold_blocks, topk_blocks

__all__ = ["block_scores", "mass_threshold_blocks", "topk_blocks", "vertical_slash_layout"]
