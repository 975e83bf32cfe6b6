"""The public calls: argument checks first (docs/design.md §7), then one path into the backends.

Every check here runs before anything is computed or launched and names the argument, what it
got and what is accepted.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from cuattn.adapters import dispatch as _dispatch
from cuattn.layout import make_layout
from cuattn.layout.layout import Layout

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
DENSE_MODES = ("all", "local", "strided")
# Block size the dense masked path `attention` computes with; any length works (ragged blocks).
DENSE_BLOCKSIZE = 32


def _dtype_name(x: Any) -> str:
    return str(x.dtype).replace("torch.", "")


def _check_array(name: str, x: Any, ndim: int, layout_doc: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{name} must be an array (NumPy, CuPy, torch, jax or any __dlpack__ object), "
            f"got {type(x).__name__}"
        )
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim} {layout_doc}, got shape {tuple(x.shape)}")
    if _dtype_name(x) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype {FLOAT_DTYPES}, got {_dtype_name(x)}")


def _check_qkv(q: Any, k: Any, v: Any, ndim: int, layout_doc: str) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x, ndim, layout_doc)
    for name, x in (("k", k), ("v", v)):
        if tuple(x.shape) != tuple(q.shape):
            raise ValueError(
                f"{name} must have the same shape as q {tuple(q.shape)}, got {tuple(x.shape)}"
            )
        if _dtype_name(x) != _dtype_name(q):
            raise TypeError(
                f"{name} must have the same dtype as q ({_dtype_name(q)}), got {_dtype_name(x)} "
                "(cuattn never casts silently)"
            )
    if any(int(d) == 0 for d in q.shape):
        raise ValueError(f"q must not have an empty dimension, got shape {tuple(q.shape)}")


def _resolve_scale(scale: object, head_dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
        raise TypeError(f"scale must be a real number or None, got {type(scale).__name__}")
    if not math.isfinite(float(scale)):
        raise ValueError(f"scale must be finite, got {scale}")
    return float(scale)


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be a positive int, got {type(value).__name__} {value!r}")
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return int(value)


def _compute(
    q: Any,
    k: Any,
    v: Any,
    layout: Layout,
    scale: float,
    recompute: bool,
    return_lse: bool,
    backend: str | None,
    deterministic: bool,
) -> Any:
    # Routing by the caller's array kind (tape, torch autograd, jax custom_vjp, plain arrays)
    # lives in adapters/dispatch.py; every route ends in cuattn.backends.
    return _dispatch.route(q, k, v, layout, scale, recompute, return_lse, backend, deterministic)


def sparse_attention(
    q: Any,
    k: Any,
    v: Any,
    layout: Layout,
    scale: float | None = None,
    recompute: bool = False,
    return_lse: bool = False,
    *,
    backend: str | None = None,
    deterministic: bool = False,
) -> Any:
    """Block-sparse attention on [batch, heads, time, head_dim] inputs with a :class:`Layout`.

    Returns ``out`` (like q), or ``(out, lse)`` with ``return_lse=True`` (lse float32, float64
    for float64 input, [batch, heads, time], -inf on rows with nothing to attend to).
    ``scale`` defaults to 1/sqrt(head_dim). ``backend``: 'numpy', 'interp' or 'cuda' (default:
    from the arrays' device and CUATTN_BACKEND). ``recompute`` keeps only q, k, v for backward
    and recomputes the forward there. ``deterministic`` makes the CUDA backward bit-identical
    across runs.
    """
    _check_qkv(q, k, v, 4, "[batch, heads, time, head_dim]")
    if not isinstance(layout, Layout):
        raise TypeError(
            f"layout must be a cuattn.Layout (cuattn.make_layout or Layout.from_blocks), "
            f"got {type(layout).__name__}"
        )
    _, heads, n_ctx, head_dim = (int(d) for d in q.shape)
    if layout.heads != heads or layout.n_ctx != n_ctx:
        raise ValueError(
            f"layout is for heads={layout.heads}, n_ctx={layout.n_ctx} but q has heads={heads}, "
            f"time={n_ctx} (shape [batch, heads, time, head_dim] = {tuple(q.shape)})"
        )
    return _compute(
        q,
        k,
        v,
        layout,
        _resolve_scale(scale, head_dim),
        bool(recompute),
        bool(return_lse),
        backend,
        bool(deterministic),
    )


def split_heads(x: Any, heads: int) -> Any:
    """[batch, time, heads * head_dim] -> [batch, heads, time, head_dim] (a view where possible)."""
    _check_int("heads", heads)
    if len(x.shape) != 3:
        raise ValueError(f"x must have rank 3 [batch, time, embd], got shape {tuple(x.shape)}")
    batch, time, embd = (int(d) for d in x.shape)
    if embd % heads:
        raise ValueError(f"embd={embd} (last dim of x) must be divisible by heads={heads}")
    return _permute(x.reshape(batch, time, heads, embd // heads), (0, 2, 1, 3))


def merge_heads(x: Any) -> Any:
    """[batch, heads, time, head_dim] -> [batch, time, heads * head_dim]."""
    if len(x.shape) != 4:
        raise ValueError(
            f"x must have rank 4 [batch, heads, time, head_dim], got shape {tuple(x.shape)}"
        )
    batch, heads, time, head_dim = (int(d) for d in x.shape)
    return _permute(x, (0, 2, 1, 3)).reshape(batch, time, heads * head_dim)


def _permute(x: Any, axes: tuple[int, ...]) -> Any:
    # torch spells a general axis permutation `permute`; NumPy, CuPy and jax spell it `transpose`.
    if type(x).__module__.startswith("torch"):
        return x.permute(*axes)
    return x.transpose(axes)


def _check_bte(q: Any, k: Any, v: Any, heads: object) -> tuple[int, int]:
    """Checks [batch, time, heads * head_dim] inputs; returns (heads, time)."""
    _check_qkv(q, k, v, 3, "[batch, time, heads * head_dim]")
    heads = _check_int("heads", heads)
    _, n_ctx, embd = (int(d) for d in q.shape)
    if embd % heads:
        raise ValueError(f"embd={embd} (last dim of q) must be divisible by heads={heads}")
    return heads, n_ctx


def _attend_bte(q: Any, k: Any, v: Any, heads: int, layout: Layout, **kwargs: Any) -> Any:
    split = (split_heads(x, heads) for x in (q, k, v))
    return merge_heads(sparse_attention(*split, layout, **kwargs))


def blocksparse_attention(
    q: Any,
    k: Any,
    v: Any,
    heads: int,
    attn_mode: str,
    local_attn_ctx: int | None = None,
    blocksize: int = 32,
    num_verts: int | None = None,
    vertsize: int | None = None,
    recompute: bool = False,
    scale: float | None = None,
    *,
    backend: str | None = None,
    deterministic: bool = False,
) -> Any:
    """The original ``blocksparse_attention_impl``: q, k, v [batch, time, heads * head_dim].

    ``attn_mode`` is any :func:`cuattn.make_layout` mode (the original's: all, local, strided,
    fixed); the result has q's shape and dtype.
    """
    heads, n_ctx = _check_bte(q, k, v, heads)
    layout = make_layout(
        attn_mode,
        n_ctx,
        heads,
        blocksize=blocksize,
        local_attn_ctx=local_attn_ctx,
        num_verts=num_verts,
        vertsize=vertsize,
    )
    return _attend_bte(
        q,
        k,
        v,
        heads,
        layout,
        scale=scale,
        recompute=recompute,
        backend=backend,
        deterministic=deterministic,
    )


def attention(
    q: Any,
    k: Any,
    v: Any,
    heads: int,
    attn_mode: str,
    local_attn_ctx: int | None = None,
    recompute: bool = False,
    scale: float | None = None,
    *,
    backend: str | None = None,
) -> Any:
    """The original dense masked ``attention_impl`` (modes all, local, strided).

    Same element rules as the block-sparse modes; computed blockwise on a natural-order layout,
    so no time x time array is built. q, k, v [batch, time, heads * head_dim].
    """
    if attn_mode not in DENSE_MODES:
        raise ValueError(f"attention's attn_mode must be one of {DENSE_MODES}, got {attn_mode!r}")
    heads, n_ctx = _check_bte(q, k, v, heads)
    extra = {"transpose": False} if attn_mode == "strided" else {}
    layout = make_layout(
        attn_mode, n_ctx, heads, blocksize=DENSE_BLOCKSIZE, local_attn_ctx=local_attn_ctx, **extra
    )
    return _attend_bte(q, k, v, heads, layout, scale=scale, recompute=recompute, backend=backend)
