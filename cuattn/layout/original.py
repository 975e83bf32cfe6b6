"""The original Sparse Transformers modes (``all``, ``local``, ``strided``, ``fixed``), each a
registered constructor whose docstring states its element rule (docs/design.md §2)."""

from __future__ import annotations

import numpy as np

from cuattn.layout.blocks import bitmask_layout, block_count, causal_cut, require_ctx, window_blocks
from cuattn.layout.layout import ElementRule, Layout, check_positive_int
from cuattn.layout.registry import register


@register("all")
def all_layout(n_ctx: int, heads: int, blocksize: int, causal: bool = True) -> Layout:
    """``all``: allowed(h, q, k) = k <= q (causal); every (q, k) when ``causal=False``."""
    nb = block_count(n_ctx, blocksize)
    blocks = np.ones((heads, nb, nb), dtype=bool)
    if causal:
        return Layout(causal_cut(blocks), blocksize, n_ctx, ElementRule("causal"), name="all")
    return Layout(blocks, blocksize, n_ctx, ElementRule("none"), name="all")


@register("local")
def local_layout(
    n_ctx: int, heads: int, blocksize: int, local_attn_ctx: int | None, causal: bool = True
) -> Layout:
    """``local``: allowed(h, q, k) = k <= q and q - k < w, w = local_attn_ctx.

    Bidirectional (``causal=False``): |q - k| < w. Any w >= 1 works (the original required a
    multiple of the block size); blocks are exactly the ones holding an allowed element.
    """
    w = require_ctx("local_attn_ctx", local_attn_ctx, "local")
    nb = block_count(n_ctx, blocksize)
    right = 1 if causal else w
    blocks = np.broadcast_to(window_blocks(nb, blocksize, w, right, n_ctx), (heads, nb, nb))
    rule = ElementRule("window", window_left=w, window_right=right)
    return Layout(blocks, blocksize, n_ctx, rule, name="local")


@register("strided")
def strided_layout(
    n_ctx: int,
    heads: int,
    blocksize: int,
    local_attn_ctx: int | None,
    causal: bool = True,
    transpose: bool | None = None,
) -> Layout:
    """``strided``: allowed(h, q, k) = k <= q and (q - k) mod s == 0, s = local_attn_ctx.

    Bidirectional: (q - k) mod s == 0. When n mod s == 0 and (n / s) mod b == 0 the layout is
    built, as the original did, on the transposed order (``perm``): the sequence viewed as
    [n/s, s] and transposed puts every residue class mod s in one contiguous run, so the
    pattern becomes block-diagonal (causal inside each run) and maximally block-sparse.
    Otherwise (or with ``transpose=False``) it is built in natural order with per-block bitmasks.
    ``transpose=True`` demands the transposed form and raises when the lengths do not allow it.
    """
    s = require_ctx("local_attn_ctx", local_attn_ctx, "strided")
    if transpose is not None and not isinstance(transpose, (bool, np.bool_)):
        raise TypeError(f"transpose must be a bool or None, got {transpose!r}")
    fits = n_ctx % s == 0 and (n_ctx // s) % blocksize == 0
    if transpose and not fits:
        raise ValueError(
            f"strided transpose=True needs n_ctx % local_attn_ctx == 0 and "
            f"(n_ctx / local_attn_ctx) % blocksize == 0; got n_ctx={n_ctx}, "
            f"local_attn_ctx={s}, blocksize={blocksize} (use transpose=None to fall back)"
        )
    nb = block_count(n_ctx, blocksize)
    if fits and transpose is not False:
        run = n_ctx // s
        chunk = run // blocksize
        same_run = (np.arange(nb)[:, None] // chunk) == (np.arange(nb)[None, :] // chunk)
        blocks = np.broadcast_to(causal_cut(same_run) if causal else same_run, (heads, nb, nb))
        perm = np.arange(n_ctx).reshape(run, s).T.reshape(-1)
        rule = ElementRule("causal" if causal else "none")
        return Layout(blocks, blocksize, n_ctx, rule, perm=perm, name="strided")

    def rule_fn(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        hit = (q - k) % s == 0
        return hit & (k <= q) if causal else hit

    candidates = np.ones((heads, nb, nb), dtype=bool)
    if causal:
        candidates = causal_cut(candidates)
    return bitmask_layout(candidates, blocksize, n_ctx, rule_fn, "strided")


@register("fixed")
def fixed_layout(
    n_ctx: int,
    heads: int,
    blocksize: int,
    local_attn_ctx: int | None,
    num_verts: int | None = None,
    vertsize: int | None = None,
    causal: bool = True,
) -> Layout:
    """``fixed`` (Sparse Transformers), defined on blocks; l = local_attn_ctx, g = l / b.

    Offsets inside a group, numbered from the end (g-1, g-2, ..., 0), are cut into chunks of
    ``vertsize``; head h uses chunk h mod num_verts. Block (i, j) is on when j mod g is in the
    head's chunk (a summary column) or i // g == j // g (same group); causal turns off j > i.
    allowed(h, q, k) = L[h, q//b, k//b] and k <= q (bidirectional: L[h, q//b, k//b]).
    Defaults: num_verts = 1, vertsize = 1. Requires l % b == 0, vertsize | g,
    num_verts * vertsize <= g and num_verts | heads.
    """
    lctx = require_ctx("local_attn_ctx", local_attn_ctx, "fixed")
    num_verts = 1 if num_verts is None else num_verts
    vertsize = 1 if vertsize is None else vertsize
    check_positive_int("num_verts", num_verts)
    check_positive_int("vertsize", vertsize)
    if lctx % blocksize:
        raise ValueError(
            f"fixed needs local_attn_ctx to be a multiple of blocksize; got local_attn_ctx={lctx}, "
            f"blocksize={blocksize}"
        )
    g = lctx // blocksize
    if g % vertsize:
        raise ValueError(
            f"fixed needs vertsize to divide local_attn_ctx / blocksize = {g}; "
            f"got vertsize={vertsize}"
        )
    if num_verts * vertsize > g:
        raise ValueError(
            f"fixed needs num_verts * vertsize <= local_attn_ctx / blocksize = {g}; "
            f"got num_verts={num_verts}, vertsize={vertsize}"
        )
    if heads % num_verts:
        raise ValueError(
            f"fixed needs num_verts to divide heads={heads}; got num_verts={num_verts}"
        )
    nb = block_count(n_ctx, blocksize)
    offsets = np.arange(g - 1, -1, -1).reshape(-1, vertsize)
    idx = np.arange(nb)
    same_group = (idx[:, None] // g) == (idx[None, :] // g)
    blocks = np.zeros((heads, nb, nb), dtype=bool)
    for h in range(heads):
        summary = np.isin(idx % g, offsets[h % num_verts])
        blocks[h] = same_group | summary[None, :]
    if causal:
        return Layout(causal_cut(blocks), blocksize, n_ctx, ElementRule("causal"), name="fixed")
    return Layout(blocks, blocksize, n_ctx, ElementRule("none"), name="fixed")
