"""``cuattn.scaled_dot_product_attention``: PyTorch's SDPA signature and semantics on cuattn.

Replacing ``torch.nn.functional.scaled_dot_product_attention`` is one import: the same
arguments, the same masks, the same output, computed by :func:`cuattn.sparse_attention`, which
visits only the blocks a mask allows. How a mask becomes a layout, a key bias or a score bias,
rows with nothing to attend to, ``finfo.min`` masks and dropout: docs/frameworks.md, section
"Replacing torch's SDPA".
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from cuattn._util import dtype_name
from cuattn.adapters.dlpack import describe
from cuattn.api import IMPLICIT_BLOCKSIZE, sparse_attention
from cuattn.backends import ENV_VAR
from cuattn.backends.numpy_ref import SUPPORTED_DTYPES
from cuattn.layout.layout import Layout

__all__ = ["scaled_dot_product_attention"]

# q/k/v ranks SDPA takes here: [batch, heads, time, head_dim], or [batch, time, head_dim]
# (one head). PyTorch's further leading dimensions have no cuattn layout axis.
RANKS = (3, 4)


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Any:
    """PyTorch's ``scaled_dot_product_attention``, computed block-sparse by cuattn.

    ``softmax(query @ key^T * scale + mask) @ value`` with PyTorch's arguments and semantics; the
    mask is read on the host once per call into a layout (for repeated calls build the
    :class:`Layout` once, ``Layout.from_blocks``, and call :func:`cuattn.sparse_attention`).
    Gradients flow to query, key, value (and a learned additive mask) through the framework's
    autograd. CPU tensors of a dtype the NumPy backend lacks (bfloat16) run on the kernel
    interpreter when ``CUATTN_BACKEND`` is unset. Details: docs/frameworks.md, section
    "Replacing torch's SDPA".

    Args:
        query (torch.Tensor | numpy.ndarray): [batch, heads, L, E] or [batch, L, E], a
            floating dtype.
        key (torch.Tensor | numpy.ndarray): [batch, kv_heads, S, E] (or [batch, S, E]),
            query's dtype.
        value (torch.Tensor | numpy.ndarray): key's shape; its head dim must equal query's.
        attn_mask (torch.Tensor | numpy.ndarray, optional): boolean (True: take part) or
            additive (finite values added, -inf or a value at or below half the dtype's lowest
            masks the pair), broadcastable to [batch, heads, L, S] ([batch, L, S] for 3-D
            inputs). None (default): no mask.
        dropout_p (float): attention dropout probability in [0, 1), cuattn's generator seeded
            from torch's (``torch.manual_seed`` repeats it); apply it in training only. Default
            0.0.
        is_causal (bool): PyTorch's top-left causal mask (query i sees keys 0..i; the same as
            cuattn's end-aligned one when L == S). Default False.
        scale (float, optional): score scale; None (default) is ``1 / sqrt(E)``.
        enable_gqa (bool): let kv_heads divide heads (query head h reads kv head
            ``h // (heads / kv_heads)``). Default False.

    Returns:
        The attention output, query's shape, dtype and kind of array ([batch, heads, L, E] or
        [batch, L, E]). A query row with nothing to attend to gives 0.

    Raises:
        TypeError: ``is_causal`` or ``enable_gqa`` not a bool; ``dropout_p`` not a number;
            ``attn_mask`` neither a torch tensor nor a NumPy array, or neither boolean nor
            floating; as :func:`cuattn.sparse_attention` for the inputs' dtypes.
        ValueError: an input not of rank 3 or 4, ranks that differ, value's head dim unlike
            query's; ``dropout_p`` outside [0, 1); ``attn_mask`` with ``is_causal=True``; key
            heads unlike query's without ``enable_gqa`` or not dividing them; a mask that does
            not broadcast, or an additive one holding NaN or +inf; as
            :func:`cuattn.sparse_attention`.

    Example:
        >>> import torch, cuattn
        >>> q, k, v = (torch.randn(2, 8, 300, 64) for _ in range(3))
        >>> mask = torch.ones(300, 300, dtype=torch.bool).tril()
        >>> cuattn.scaled_dot_product_attention(q, k, v, attn_mask=mask).shape
        torch.Size([2, 8, 300, 64])
    """
    _check_arguments(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    one_head = query.ndim == 3
    mask = lowest = None
    learned = bool(getattr(attn_mask, "requires_grad", False))
    if attn_mask is not None:
        mask, lowest = _host_mask(attn_mask)
        if one_head:  # PyTorch broadcasts it against [batch, L, S]
            mask = _broadcast(mask, (int(query.shape[0]), int(query.shape[1]), int(key.shape[1])))
            mask = mask[:, None]
    if one_head:
        query, key, value = query[:, None], key[:, None], value[:, None]
    heads, n_q, n_k = int(query.shape[1]), int(query.shape[2]), int(key.shape[2])
    causal = bool(is_causal)
    layout = key_bias = score_bias = None
    if mask is not None:
        batch = int(query.shape[0])
        layout, causal, key_bias, pairs = _mask_layout(
            mask, batch, heads, n_q, n_k, lowest, learned
        )
        if pairs is not None:
            score_bias = _pair_bias(attn_mask, pairs, query, one_head)
    elif causal and n_q != n_k:  # PyTorch's causal mask is top-left; cuattn's is end-aligned
        top_left = np.broadcast_to(np.tri(n_q, n_k, dtype=bool), (heads, n_q, n_k))
        layout, causal = _rule_layout(top_left, heads, n_q, n_k)
    kw = dict(scale=scale, dropout_p=dropout_p, key_bias=_like(key_bias, query))
    kw["score_bias"] = score_bias
    kw["backend"] = _default_backend(query)
    if layout is None:
        out = sparse_attention(query, key, value, causal=causal, **kw)
    else:
        out = sparse_attention(query, key, value, layout, **kw)
    return out[:, 0] if one_head else out


def _check_arguments(
    query: Any,
    key: Any,
    value: Any,
    attn_mask: Any,
    dropout_p: object,
    is_causal: object,
    enable_gqa: object,
) -> None:
    for name, x in (("query", query), ("key", key), ("value", value)):
        if getattr(x, "ndim", None) not in RANKS:
            raise ValueError(
                f"{name} must be [batch, heads, time, head_dim] or [batch, time, head_dim], got "
                f"shape {tuple(getattr(x, 'shape', ()))}"
            )
    if not query.ndim == key.ndim == value.ndim:
        raise ValueError(
            f"query, key and value must have the same rank, got {query.ndim}, {key.ndim}, "
            f"{value.ndim}"
        )
    if int(value.shape[-1]) != int(query.shape[-1]):
        raise ValueError(
            f"value's head dim must equal query's (cuattn's kernels share one head_dim), got "
            f"{int(value.shape[-1])} and {int(query.shape[-1])}"
        )
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, (bool, np.bool_)):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float, np.floating)):
        raise TypeError(f"dropout_p must be a float, got {type(dropout_p).__name__}")
    if not 0.0 <= float(dropout_p) < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal=True both given: pass one (as PyTorch)")
    heads, kv_heads = int(query.shape[1]), int(key.shape[1])
    if query.ndim == 4 and kv_heads != heads and (not enable_gqa or heads % kv_heads):
        raise ValueError(
            f"key has {kv_heads} heads and query {heads}: pass enable_gqa=True with kv heads "
            "dividing the query heads (as PyTorch)"
        )


def _default_backend(query: Any) -> str | None:
    """'interp' for CPU arrays of a dtype the NumPy backend (the CPU default) has no kernel for,
    when CUATTN_BACKEND chooses nothing; else None (sparse_attention's own choice)."""
    if os.environ.get(ENV_VAR) or describe(query, "query").device != "cpu":
        return None
    numpy_names = {np.dtype(t).name for t in SUPPORTED_DTYPES}
    return None if dtype_name(query) in numpy_names else "interp"


def _broadcast(mask: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``mask`` broadcast to [batch, heads, L, S] or (3-D inputs) [batch, L, S]."""
    try:
        return np.broadcast_to(mask, shape)
    except ValueError:
        axes = "batch, heads, L, S" if len(shape) == 4 else "batch, L, S"
        raise ValueError(
            f"attn_mask of shape {mask.shape} does not broadcast to [{axes}] = {list(shape)}"
        ) from None


def _like(key_bias: np.ndarray | None, query: Any) -> Any:
    """A mask's key bias as the kernels take it: float32 (float64 beside float64 query), the
    query's kind of array on its device (a copy of O(batch x heads x S) from the host, where the
    mask was read)."""
    if key_bias is None:
        return None
    dtype = np.float64 if dtype_name(query) == "float64" else np.float32
    key_bias = np.ascontiguousarray(key_bias, dtype=dtype)
    if type(query).__module__.startswith("torch"):
        import torch

        return torch.from_numpy(key_bias).to(query.device)
    return key_bias


def _host_mask(attn_mask: Any) -> tuple[np.ndarray, float | None]:
    """The mask on the host (a torch tensor without gradient, or a NumPy array), and the lowest
    finite value of its dtype when it is additive (None when boolean). A bfloat16 mask comes
    to the host as float32, which holds each of its values exactly."""
    if type(attn_mask).__module__.startswith("torch"):
        import torch

        if not attn_mask.is_floating_point():
            return attn_mask.detach().cpu().numpy(), None
        lowest = float(torch.finfo(attn_mask.dtype).min)
        host = attn_mask.detach().cpu()
        if host.dtype == torch.bfloat16:
            host = host.float()
        return host.numpy(), lowest
    if isinstance(attn_mask, np.ndarray):
        if np.issubdtype(attn_mask.dtype, np.floating):
            return attn_mask, float(np.finfo(attn_mask.dtype).min)
        return attn_mask, None
    raise TypeError(
        f"attn_mask must be a torch.Tensor or a numpy.ndarray, got {type(attn_mask).__name__}"
    )


def _mask_layout(
    mask: np.ndarray,
    batch: int,
    heads: int,
    n_q: int,
    n_k: int,
    lowest: float | None = None,
    learned: bool = False,
) -> tuple[Layout | None, bool, np.ndarray | None, np.ndarray | None]:
    """(layout, causal, key_bias, pairs) of a host mask. Where the mask is a rule the same for
    every batch element (allowed pairs) and, per batch element, a bias by key (-inf for a
    padded key, or the finite value an additive mask adds to every query's score of that key),
    the rule and key_bias say it all (pairs None). Otherwise (a bias on each pair, masks that
    differ between batch elements otherwise, or a ``learned`` mask, whose gradient only a
    score bias carries) the rule is the union of what the batch allows and ``pairs``, the
    allowed pairs in the mask's own shape, asks for the mask as a score bias (_pair_bias). The
    rule: (None, False) when it allows everything, (None, True) when it is the square causal
    mask (the kernels' element rule, no bitmask table), else a bitmask Layout over the
    64-blocks it touches. key_bias: float64 [batch, heads, n_k], or None when no key is padded
    or biased. An additive value at or below ``lowest / 2`` (``lowest``: the mask dtype's
    lowest finite value, its own by default) masks its pair, as -inf does: such a value only
    ever adds exactly 0 to a row's probabilities where the row keeps a key."""
    if mask.dtype == np.bool_:
        allowed, values, biased = mask, None, False
    elif np.issubdtype(mask.dtype, np.floating):
        if np.isnan(mask).any() or (mask == np.inf).any():
            raise ValueError("attn_mask: an additive mask must not hold NaN or +inf")
        if lowest is None:
            lowest = float(np.finfo(mask.dtype).min)
        allowed, values = mask > lowest / 2, mask.astype(np.float64)
        biased = bool((values[allowed] != 0).any())
    else:
        raise TypeError(f"attn_mask must be bool or floating point, got {mask.dtype}")
    shape = (batch, heads, n_q, n_k)
    own = allowed
    allowed = _broadcast(allowed, shape)
    if learned:
        return (*_rule_layout(allowed.any(axis=0), heads, n_q, n_k), None, own)
    if not biased and (allowed == allowed[:1]).all():  # one rule for the batch, no key bias
        return (*_rule_layout(allowed[0], heads, n_q, n_k), None, None)
    # keys a batch element's mask lets some query see, and the rule every element shares
    seen = allowed.any(axis=2)
    rule = allowed.any(axis=0)
    if not (allowed == (rule[None] & seen[:, :, None, :])).all():
        # differs between batch elements other than by padded keys: the mask as a bias
        return (*_rule_layout(rule, heads, n_q, n_k), None, own)
    key_bias = None
    if values is not None:
        values = np.broadcast_to(values, shape)
        # a finite value added to the scores must be one per key (a bias by key): the value at
        # the key's first allowed query, checked at every other (0 where nothing sees the key)
        first = np.argmax(allowed, axis=2)[:, :, None, :]
        per_key = np.where(seen, np.take_along_axis(values, first, axis=2)[:, :, 0, :], 0.0)
        if not (np.where(allowed, values == per_key[:, :, None, :], True)).all():
            # a bias on each (query, key) pair: the mask as a score bias
            return (*_rule_layout(rule, heads, n_q, n_k), None, own)
        if per_key.any():
            key_bias = per_key
    if not seen.all():
        key_bias = np.where(seen, 0.0 if key_bias is None else key_bias, -np.inf)
    layout, causal = _rule_layout(rule, heads, n_q, n_k)
    return layout, causal, key_bias, None


def _pair_bias(attn_mask: Any, pairs: np.ndarray, query: Any, one_head: bool) -> Any:
    """The mask as sparse_attention's score_bias, in its own shape (a head axis put in for 3-D
    inputs, a rank-1 mask made [1, S]) on the query's device: ``where(pairs, mask, -inf)`` for
    an additive mask (its gradient flows through the kept pairs), ``where(mask, 0, -inf)`` in
    the query's dtype for a boolean one. ``pairs``: the pairs the mask keeps, in its shape."""
    if one_head and pairs.ndim == 3:  # [batch, L, S] against [batch, 1, L, S]
        pairs = pairs[:, None]
    elif pairs.ndim < 2:
        pairs = pairs.reshape(1, -1)
    torch_query = type(query).__module__.startswith("torch")
    if type(attn_mask).__module__.startswith("torch"):
        import torch

        mask = attn_mask.reshape(pairs.shape)
        keep = torch.from_numpy(np.ascontiguousarray(pairs)).to(mask.device)
        if not mask.is_floating_point():
            zero = query.new_zeros(())
            return torch.where(keep.to(query.device), zero, zero - float("inf"))
        return torch.where(keep, mask, mask.new_full((), float("-inf")))
    mask = np.asarray(attn_mask).reshape(pairs.shape)
    if mask.dtype == np.bool_:
        bias = np.where(pairs, 0.0, -np.inf).astype(np.float32 if torch_query else query.dtype)
    else:
        bias = np.where(pairs, mask, -np.inf).astype(mask.dtype)
    if torch_query:
        import torch

        bias = torch.from_numpy(bias).to(device=query.device, dtype=query.dtype)
    return bias


def _rule_layout(keep: np.ndarray, heads: int, n_q: int, n_k: int) -> tuple[Layout | None, bool]:
    """(layout, causal) of allowed pairs [heads, n_q, n_k] (see _mask_layout)."""
    if keep.all():
        return None, False
    if n_q == n_k and (keep == np.tri(n_q, dtype=bool)).all():
        return None, True
    block = IMPLICIT_BLOCKSIZE
    nbq, nb = math.ceil(n_q / block), math.ceil(n_k / block)
    padded = np.zeros((heads, nbq * block, nb * block), dtype=bool)
    padded[:, :n_q, :n_k] = keep
    blocks = padded.reshape(heads, nbq, block, nb, block).any(axis=(2, 4))
    dense = np.ascontiguousarray(keep)
    layout = Layout.from_blocks(blocks, block, lambda h, q, k: dense[h, q, k], n_ctx=n_k, n_q=n_q)
    return layout, False
