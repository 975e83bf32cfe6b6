"""The public calls: argument checks first (docs/design.md §7), then one path into the backends.

Every check here runs before anything is computed or launched and names the argument, what it
got and what is accepted.
"""

from __future__ import annotations

import functools
import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from cuattn import backends
from cuattn._util import array_library, dims, dtype_name
from cuattn.adapters import dispatch as _dispatch
from cuattn.adapters import dlpack as _dlpack
from cuattn.autograd.tape import Tensor
from cuattn.backends.call import (
    NO_MODS,
    AttentionCall,
    ScoreMods,
    ScoreOperands,
    checked_operands,
)
from cuattn.layout import MODES, make_layout
from cuattn.layout.derived import check_cu_seqlens, packed
from cuattn.layout.extended import UNBOUNDED
from cuattn.layout.layout import Layout
from cuattn.layout.pattern import Pattern

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
DENSE_MODES = ("all", "local", "strided")
# Block size the dense masked path `attention` computes with; any length works (ragged blocks).
DENSE_BLOCKSIZE = 32
# Block size of the layouts causal= / window_size= stand for: the kernels' measured-fastest
# forward shape (64-row tiles, docs/kernels.md "The forward").
IMPLICIT_BLOCKSIZE = 64


def _check_array(name: str, x: Any, ndim: int, layout_doc: str) -> None:
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{name} must be an array (NumPy, CuPy, torch, jax or any __dlpack__ object), "
            f"got {type(x).__name__}"
        )
    if len(x.shape) != ndim:
        raise ValueError(f"{name} must have rank {ndim} {layout_doc}, got shape {tuple(x.shape)}")
    if dtype_name(x) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must have a floating dtype {FLOAT_DTYPES}, got {dtype_name(x)}")


def _check_qkv(
    q: Any, k: Any, v: Any, ndim: int, layout_doc: str, allow_empty: bool = False
) -> None:
    """Same rank and dtype; v shaped like k; k like q except (4-D) heads and time: k may have
    fewer heads dividing q's (GQA/MQA) and another length (queries != keys). ``allow_empty``:
    batch, heads and times may be 0 (head_dim never)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x, ndim, layout_doc)
    q_shape, k_shape = dims(q), dims(k)
    if ndim == 4:
        batch, heads, _, head_dim = q_shape
        kv_heads = k_shape[1]
        groups_fit = heads % kv_heads == 0 if kv_heads else heads == 0
        if k_shape[0] != batch or k_shape[3] != head_dim or not groups_fit:
            raise ValueError(
                f"k must be [batch={batch}, kv_heads, time_k, head_dim={head_dim}] with kv_heads "
                f"dividing heads={heads} (GQA/MQA), got shape {k_shape} (q {q_shape})"
            )
    elif k_shape != q_shape:
        raise ValueError(f"k must have the same shape as q {q_shape}, got {k_shape}")
    if dims(v) != k_shape:
        raise ValueError(f"v must have the same shape as k {k_shape}, got {tuple(v.shape)}")
    _check_dtypes(q, k, v)
    if allow_empty:
        if q_shape[-1] == 0:
            raise ValueError(
                f"q must have head_dim >= 1 (its last dimension), got shape {tuple(q.shape)}; "
                "batch, heads and time may be 0"
            )
        return
    for name, x in (("q", q), ("k", k)):
        if any(d == 0 for d in dims(x)):
            raise ValueError(f"{name} must not have an empty dimension, got shape {tuple(x.shape)}")


def _check_dtypes(q: Any, k: Any, v: Any) -> None:
    for name, x in (("k", k), ("v", v)):
        if dtype_name(x) != dtype_name(q):
            raise TypeError(
                f"{name} must have the same dtype as q ({dtype_name(q)}), got {dtype_name(x)} "
                "(cuattn never casts silently)"
            )


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


def sparse_attention(
    q: Any,
    k: Any,
    v: Any,
    layout: Layout | Pattern | None = None,
    scale: float | None = None,
    recompute: bool = False,
    return_lse: bool = False,
    *,
    causal: bool | None = None,
    window_size: tuple[int, int] | None = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    key_bias: Any = None,
    rel_bias: Any = None,
    score_bias: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Any | None = None,
    backend: str | None = None,
) -> Any:
    """Block-sparse attention on [batch, heads, time, head_dim] inputs.

    Computes ``softmax(scale * q @ k^T + biases) @ v`` over the pairs ``layout`` allows, visiting
    only its blocks. Without a layout, dense attention as FlashAttention's ``causal`` and
    ``window_size`` keywords say (on the ``all``/``window`` pattern's 64-blocks). GQA/MQA: query
    head h reads kv head ``h // (heads / kv_heads)``, nothing repeated in memory. With
    ``time_q != time_k`` query i stands at key position ``i + time_k - time_q`` (SDPA's
    bottom-right causal mask). The score modifiers apply in the order softcap, then the biases
    (summed), then the mask (docs/design.md, section 2); their gradients, memory and dropout's
    seed: docs/frameworks.md, section "Score modifiers: gradients and seeds".

    Args:
        q (array): queries, [batch, heads, time_q, head_dim], float16, bfloat16, float32 or
            float64: a NumPy, CuPy, torch or jax array, a ``cuattn.Tensor`` or any
            ``__dlpack__`` object. Batch, heads and times may be 0 (an empty result).
        k (array): keys, [batch, kv_heads, time_k, head_dim], q's dtype and kind of array;
            kv_heads divides heads.
        v (array): values, shaped and typed like k.
        layout (Layout | Pattern, optional): which blocks and elements are computed: a
            ``Layout`` built for ``heads``, ``n_q=time_q`` and ``n_ctx=time_k``
            (``make_layout(..., n_ctx=time_k, n_q=time_q)``), or a ``Pattern``, built for each
            call's lengths. None (default): dense, as ``causal`` and ``window_size`` say.
        scale (float, optional): score scale; None (default) is ``1 / sqrt(head_dim)``.
        recompute (bool): keep only q, k and v for the backward and recompute the forward
            there (default False).
        return_lse (bool): also return the per-row log-sum-exp (default False).
        causal (bool, optional): without a layout, keys after the query's (end-aligned)
            position are masked; None means False. Keyword only.
        window_size (tuple[int, int], optional): without a layout, ``(left, right)``: the query
            at position p sees keys ``p - left .. p + right``, -1 for no limit on that side
            (``causal`` makes right 0). None: no window. Keyword only.
        softcap (float, optional): caps each scaled score s as ``softcap * tanh(s / softcap)``
            before the biases and the mask (Gemma 2); None or 0 (default): off.
        alibi_slopes (array, optional): ALiBi's slopes, float32 [heads] or [batch, heads], q's
            kind of array on its device (e.g. ``cuattn.alibi_slopes(heads)``); adds
            ``-slope * |i + time_k - time_q - j|`` to the score of query i and key j.
        key_bias (array, optional): float32 [batch, time_k] or [batch, heads, time_k] (float64
            beside float64 q), q's kind of array; ``key_bias[b, (h,) j]`` is added to every
            query's score of key j (finite or -inf: a key padding mask in O(T)).
        rel_bias (array, optional): a relative-position table (T5's, Swin's), float32
            [heads, 2 M + 1] or [batch, heads, 2 M + 1]; adds
            ``rel_bias[(b,) h, clamp(j - (i + time_k - time_q), -M, M) + M]``.
        score_bias (array, optional): a dense bias broadcastable to [batch, heads, time_q,
            time_k] (rank 2 to 4, each axis 1 or full, any strides, -inf allowed), float32 or
            q's dtype, q's kind of array: xformers' ``attn_bias``, SDPA's float mask. Read only
            inside the layout's computed blocks.
        dropout_p (float): probability of dropping each attention probability after the
            softmax, in [0, 1); kept ones are scaled by ``1 / (1 - p)``, the lse is that of
            every score. Default 0.0 (off).
        dropout_seed (int | array, optional): the dropout mask's 64-bit key: an int in
            [0, 2^63), or an array of q's kind on its device (int64/uint64 [] or [1],
            uint32/int32 [2], low word first; a traced jax seed). None: drawn from torch's
            generator (torch tensors) or NumPy's global one; jax calls with dropout pass one.
        backend (str, optional): ``"numpy"``, ``"interp"`` or ``"cuda"``; None (default): from
            the arrays' device and ``CUATTN_BACKEND``.

    Returns:
        out, like q (its shape, dtype, kind of array and device); with ``return_lse=True`` the
        pair ``(out, lse)``, lse [batch, heads, time_q] float32 (float64 for float64 inputs),
        -inf on rows with nothing to attend to (whose out is 0). Every backward is bit-identical
        run to run.

    Raises:
        TypeError: q, k or v is not an array, has a non-floating dtype or dtypes differ; the
            layout is neither a Layout nor a Pattern; ``causal``, ``window_size``, ``scale``,
            ``softcap``, ``dropout_p`` or ``dropout_seed`` has the wrong type; a score operand
            is not an array of q's kind or has the wrong dtype.
        ValueError: a rank or shape does not fit (k's batch or head_dim, kv_heads not dividing
            heads, v unlike k, a head_dim of 0, an empty dimension on a computed call); the
            layout is for other heads or lengths; ``causal``/``window_size`` given with a
            layout; a value is out of range (``scale`` not finite, ``softcap`` < 0,
            ``dropout_p`` outside [0, 1), a seed outside [0, 2^63), window sides < -1); a score
            operand's shape does not fit, or a bias comes with a permuted layout; the backend
            is unknown or does not fit the arrays' device, or has no kernel for the head dim or
            block size.

    Example:
        >>> import numpy as np, cuattn
        >>> q = k = v = np.random.randn(1, 4, 256, 64).astype(np.float32)
        >>> layout = cuattn.make_layout("local", n_ctx=256, heads=4, blocksize=32,
        ...                             local_attn_ctx=64)
        >>> cuattn.sparse_attention(q, k, v, layout).shape
        (1, 4, 256, 64)
    """
    _check_qkv(q, k, v, 4, "[batch, heads, time, head_dim]", allow_empty=True)
    if layout is None:
        layout = _implicit_pattern(int(q.shape[1]), causal, window_size)
    elif causal is not None or window_size is not None:
        raise ValueError(
            "causal= and window_size= describe the layout when none is given; this call gives "
            f"a {type(layout).__name__}, whose own rule applies: pass one or the other"
        )
    if not isinstance(layout, (Layout, Pattern)):
        raise TypeError(
            f"layout must be a cuattn.Layout (cuattn.make_layout or Layout.from_blocks) or a "
            f"cuattn.Pattern, got {type(layout).__name__}"
        )
    batch, heads, n_q, _ = dims(q)
    head_dim, n_k = int(q.shape[3]), dims(k)[2]
    # An empty axis (as SDPA: batch, heads, time_q or time_k 0) fits any layout on that axis.
    empty = 0 in (batch, heads, n_q, n_k)
    axes = [(layout.heads, heads)]  # (what the layout is for, what q and k have)
    if isinstance(layout, Layout):
        axes += [(layout.n_q, n_q), (layout.n_ctx, n_k)]
    misfit = any(want != got for want, got in axes if got != 0)
    if isinstance(layout, Pattern):
        if misfit:
            raise ValueError(f"layout is a Pattern for heads={layout.heads}, q has heads={heads}")
    elif misfit:
        raise ValueError(
            f"layout is for heads={layout.heads}, n_q={layout.n_q} queries, n_ctx={layout.n_ctx} "
            f"keys, but q has heads={heads}, time={n_q} ({tuple(q.shape)}) and k time={n_k} "
            f"({tuple(k.shape)}); build it with make_layout(..., n_ctx={n_k}, n_q={n_q})"
        )
    # the common call (no modifier) does not step into backends/call.py at all: a warm
    # forward's module count is tested (tests/adapters/test_call_path.py)
    mods = NO_MODS if softcap is None else ScoreMods.from_arguments(softcap)
    seed_words = None  # a seed held in an array travels as a score operand
    if not (isinstance(dropout_p, float) and dropout_p == 0.0):  # the default stays here
        mods, seed_words = _dispatch.dropout_mods(mods, _untaped(q), dropout_p, dropout_seed)
    biased = not (alibi_slopes is None and key_bias is None and rel_bias is None)
    biased = biased or score_bias is not None
    if biased or seed_words is not None:
        operands = ScoreOperands(alibi_slopes, key_bias, rel_bias, score_bias, seed_words)
        checked_operands(q, (batch, heads, n_q, n_k), operands, unwrap=_untaped)
    call = AttentionCall(
        layout, _resolve_scale(scale, head_dim), bool(recompute), bool(return_lse), backend, mods
    )
    if biased or seed_words is not None:
        call = call.with_operands(operands)  # refuses a bias with a permuted layout
    if empty:
        lse_dtype = "float64" if dtype_name(q) == "float64" else "float32"
        out, lse = _dispatch.no_keys(q, k, v, lse_dtype)
        return (out, lse) if return_lse else out
    return _route(q, k, v, call)


def alibi_slopes(heads: int) -> np.ndarray:
    """The ALiBi paper's slopes for ``heads`` heads (BLOOM's, MPT's).

    With ``p`` the largest power of two <= heads, head h < p gets ``2 ** (-8 (h + 1) / p)`` and
    the rest the odd powers of ``2 ** (-4 / p)`` (the slopes of 2p heads that p lacks).

    Args:
        heads (int): the number of query heads, positive.

    Returns:
        numpy.ndarray: float32 [heads], for ``alibi_slopes=`` (convert it to the caller's kind
        of array, e.g. ``torch.from_numpy``).

    Raises:
        ValueError: ``heads`` is not a positive int.
    """
    if isinstance(heads, bool) or not isinstance(heads, (int, np.integer)) or heads <= 0:
        raise ValueError(f"heads must be a positive int, got {heads!r}")
    p = 2 ** int(math.floor(math.log2(int(heads))))
    slopes = [2.0 ** (-8.0 * (h + 1) / p) for h in range(p)]
    slopes += [2.0 ** (-4.0 * (2 * i + 1) / p) for i in range(int(heads) - p)]
    return np.asarray(slopes, dtype=np.float32)


def _untaped(x: Any) -> Any:
    """The array under a cuattn.Tensor (a plain array as it is)."""
    return x.data if isinstance(x, Tensor) else x


def _implicit_pattern(heads: int, causal: object, window_size: object) -> Pattern:
    """The Pattern FlashAttention's ``causal`` and ``window_size`` keywords describe."""
    if causal is None:
        causal = False
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    if window_size is None:
        window_size = (UNBOUNDED, UNBOUNDED)
    pair = isinstance(window_size, (tuple, list)) and len(window_size) == 2
    if not pair or any(
        isinstance(x, bool) or not isinstance(x, (int, np.integer)) for x in window_size
    ):
        raise TypeError(
            "window_size must be a pair of ints (left, right), -1 for no limit, got "
            f"{window_size!r}"
        )
    left, right = (int(x) for x in window_size)
    if min(left, right) < UNBOUNDED:
        raise ValueError(f"window_size sides must be >= 0, or -1 for no limit, got {window_size!r}")
    right = 0 if causal else right  # as FlashAttention: causal bounds the right side at the query
    if left == UNBOUNDED and right == (0 if causal else UNBOUNDED):  # no window: all of it
        return Pattern("all", heads, IMPLICIT_BLOCKSIZE, causal=bool(causal))
    return Pattern(
        "window",
        heads,
        IMPLICIT_BLOCKSIZE,
        causal=bool(causal),
        window_left=left,
        window_right=right,
    )


def _route(q: Any, k: Any, v: Any, call: AttentionCall) -> Any:
    """The validated call on the path for the caller's arrays; every path ends in
    cuattn.backends.forward (and backward), so all of them compute alike.

    * torch tensors (with or without grad) -> the cuattn:: custom ops (adapters/torch_ops.py),
      which torch.compile traces without a graph break; a Pattern crosses as its key and is
      built inside the op (lengths may be symbolic there)
    * ``cuattn.Tensor`` -> the tape op (autograd/attention.py)
    * jax arrays (eager or traced) -> jax.custom_vjp (adapters/jax_vjp.py)
    * NumPy, CuPy, any other __dlpack__ producer -> computed and handed back as the caller's own
      type on its device, sharing memory (other producers get NumPy/CuPy arrays)
    The call's score operands (arrays of the caller's kind) cross each route beside q, k, v.
    """
    torch = sys.modules.get("torch")
    if torch is not None and all(isinstance(x, torch.Tensor) for x in (q, k, v)):
        from cuattn.adapters import torch_ops

        return torch_ops.attend(q, k, v, call)
    call = call.for_lengths(int(q.shape[2]), int(k.shape[2]))
    if any(isinstance(x, Tensor) for x in (q, k, v)):
        from cuattn.autograd import attention

        # plain arrays beside Tensors are constants of the tape
        call = call.with_operands(
            call.operands.map(lambda name, x: x if isinstance(x, Tensor) else Tensor(x))
        )
        return attention.attend(*_dispatch.tape_args(q, k, v), call)
    named = {"q": q, "k": k, "v": v}
    info = _dlpack.common_info(named)
    if info.framework == "jax":
        from cuattn.adapters import jax_vjp

        return jax_vjp.attend(q, k, v, call)
    # No gradient is wanted, so recompute has nothing to save and is ignored.
    extra = call.operands.named()
    if extra:
        named.update(extra)
        info = _dlpack.common_info(named)
    out, lse = _dlpack.call(_forward_placed, named, call.without_operands(), info=info)
    return (out, lse) if call.return_lse else out


def _forward_placed(q: Any, k: Any, v: Any, *rest: Any) -> tuple[Any, Any]:
    """backends.forward with the call's score operands placed back from the arrays that
    crossed beside q, k, v (first in ``rest``, the call last)."""
    *present, call = rest
    return backends.forward(q, k, v, call.placed(present))


def split_heads(x: Any, heads: int) -> Any:
    """Split the heads out of the last axis: [batch, time, heads * head_dim] to
    [batch, heads, time, head_dim].

    Args:
        x (array): [batch, time, heads * head_dim], any kind of array cuattn takes (or a
            ``cuattn.Tensor``).
        heads (int): the number of heads, dividing the last axis.

    Returns:
        x as [batch, heads, time, head_dim], the same kind of array (a view where possible).

    Raises:
        TypeError: ``heads`` is not an int.
        ValueError: ``heads`` is not positive, x is not of rank 3, or heads does not divide its
            last axis.
    """
    _check_int("heads", heads)
    if len(x.shape) != 3:
        raise ValueError(f"x must have rank 3 [batch, time, embd], got shape {tuple(x.shape)}")
    batch, time, embd = dims(x)
    if embd % heads:
        raise ValueError(f"embd={embd} (last dim of x) must be divisible by heads={heads}")
    return _permute(x.reshape(batch, time, heads, embd // heads), (0, 2, 1, 3))


def merge_heads(x: Any) -> Any:
    """Merge the heads into the last axis: [batch, heads, time, head_dim] to
    [batch, time, heads * head_dim] (the inverse of :func:`split_heads`).

    Args:
        x (array): [batch, heads, time, head_dim], any kind of array cuattn takes (or a
            ``cuattn.Tensor``).

    Returns:
        x as [batch, time, heads * head_dim], the same kind of array.

    Raises:
        ValueError: x is not of rank 4.
    """
    if len(x.shape) != 4:
        raise ValueError(
            f"x must have rank 4 [batch, heads, time, head_dim], got shape {tuple(x.shape)}"
        )
    batch, heads, time, head_dim = dims(x)
    return _permute(x, (0, 2, 1, 3)).reshape(batch, time, heads * head_dim)


def _permute(x: Any, axes: tuple[int, ...]) -> Any:
    # torch spells a general axis permutation `permute`; NumPy, CuPy and jax spell it `transpose`.
    if array_library(x) == "torch":
        return x.permute(*axes)
    return x.transpose(axes)


def _check_bte(
    q: Any, k: Any, v: Any, heads: object, kv_heads: object = None
) -> tuple[int, int, int, int]:
    """Checks [batch, time, heads * head_dim] inputs (k, v: [batch, time_k, kv_heads *
    head_dim]); returns (heads, kv_heads, time_q, time_k)."""
    heads = _check_int("heads", heads)
    kv_heads = heads if kv_heads is None else _check_int("kv_heads", kv_heads)
    if heads % kv_heads:
        raise ValueError(f"kv_heads={kv_heads} must divide heads={heads} (GQA/MQA)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x, 3, "[batch, time, heads * head_dim]")
    _, n_q, embd = dims(q)
    if embd % heads:
        raise ValueError(f"embd={embd} (last dim of q) must be divisible by heads={heads}")
    kv_shape = (dims(q)[0], dims(k)[1], embd // heads * kv_heads)
    for name, x in (("k", k), ("v", v)):
        if dims(x) != kv_shape:
            raise ValueError(
                f"{name} must be [batch, time_k, kv_heads * head_dim] = {list(kv_shape)} "
                f"(kv_heads={kv_heads}, head_dim={embd // heads}), got shape {tuple(x.shape)}"
            )
    _check_dtypes(q, k, v)
    return heads, kv_heads, n_q, dims(k)[1]


def _attend_bte(
    q: Any, k: Any, v: Any, heads: int, kv_heads: int, layout: Layout, **kwargs: Any
) -> Any:
    split = [split_heads(q, heads)] + [split_heads(x, kv_heads) for x in (k, v)]
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
    kv_heads: int | None = None,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    key_bias: Any = None,
    rel_bias: Any = None,
    score_bias: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Any | None = None,
    backend: str | None = None,
) -> Any:
    """Block-sparse attention with the original's interface (``blocksparse_attention_impl``).

    q, k and v keep their heads in the last axis; the layout is the named pattern ``attn_mode``,
    built for each call's lengths (a :class:`Pattern`, so a compiled torch graph serves every
    length).

    Args:
        q (array): queries, [batch, time_q, heads * head_dim], a floating dtype, any kind of
            array :func:`sparse_attention` takes.
        k (array): keys, [batch, time_k, kv_heads * head_dim], q's dtype; time_k may differ
            from time_q (queries end-aligned).
        v (array): values, shaped and typed like k.
        heads (int): the number of query heads, dividing q's last axis.
        attn_mode (str): any :func:`cuattn.make_layout` mode (the original's ``all``,
            ``local``, ``strided``, ``fixed``, and cuattn's others: ``cuattn.MODES``).
        local_attn_ctx (int, optional): the window (``local``), stride (``strided``) or group
            size (``fixed``, a multiple of blocksize), as in make_layout.
        blocksize (int): the block size of the layout (default 32).
        num_verts (int, optional): ``fixed`` only: the summary-column chunks heads cycle over.
        vertsize (int, optional): ``fixed`` only: the blocks per summary-column chunk.
        recompute (bool): keep only q, k and v for the backward (default False).
        scale (float, optional): score scale; None (default) is ``1 / sqrt(head_dim)``.
        kv_heads (int, optional): GQA/MQA: the heads of k and v, dividing ``heads``; None
            (default) is ``heads``. Keyword only.
        softcap (float, optional): as in :func:`sparse_attention`.
        alibi_slopes (array, optional): as in :func:`sparse_attention`.
        key_bias (array, optional): as in :func:`sparse_attention`.
        rel_bias (array, optional): as in :func:`sparse_attention`.
        score_bias (array, optional): as in :func:`sparse_attention`.
        dropout_p (float): as in :func:`sparse_attention` (default 0.0, off).
        dropout_seed (int | array, optional): as in :func:`sparse_attention`.
        backend (str, optional): as in :func:`sparse_attention`.

    Returns:
        out, q's shape, dtype and kind of array, [batch, time_q, heads * head_dim].

    Raises:
        TypeError: ``heads`` or ``kv_heads`` is not an int; an input is not a floating array or
            dtypes differ; a pattern argument the mode does not take; as
            :func:`sparse_attention` for the keywords.
        ValueError: ``attn_mode`` is not a registered pattern; ``heads``/``kv_heads`` not
            positive, kv_heads not dividing heads, heads not dividing q's last axis, k or v of
            another shape; a pattern argument out of range; as :func:`sparse_attention`.
    """
    heads, kv_heads, _, _ = _check_bte(q, k, v, heads, kv_heads)
    if not isinstance(attn_mode, str) or attn_mode not in MODES:
        raise ValueError(f"attn_mode must be one of {MODES}, got {attn_mode!r}")
    # A Pattern, not a Layout: built for the call's lengths where they are known, which keeps a
    # compiled torch graph free of the length (one graph for every sequence length).
    layout = Pattern(
        attn_mode,
        heads,
        blocksize,
        local_attn_ctx=local_attn_ctx,
        num_verts=num_verts,
        vertsize=vertsize,
    )
    return _attend_bte(
        q,
        k,
        v,
        heads,
        kv_heads,
        layout,
        scale=scale,
        recompute=recompute,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        key_bias=key_bias,
        rel_bias=rel_bias,
        score_bias=score_bias,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        backend=backend,
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
    """Dense masked attention with the original's interface (``attention_impl``).

    The modes' element rules are the block-sparse modes' own; the call computes blockwise on a
    natural-order layout of 32-blocks, so no time x time array is built.

    Args:
        q (array): queries, [batch, time, heads * head_dim], a floating dtype, any kind of array
            :func:`sparse_attention` takes.
        k (array): keys, q's shape and dtype (as many keys as queries).
        v (array): values, q's shape and dtype.
        heads (int): the number of heads, dividing q's last axis.
        attn_mode (str): ``"all"``, ``"local"`` or ``"strided"``.
        local_attn_ctx (int, optional): the window (``local``) or stride (``strided``).
        recompute (bool): keep only q, k and v for the backward (default False).
        scale (float, optional): score scale; None (default) is ``1 / sqrt(head_dim)``.
        backend (str, optional): as in :func:`sparse_attention`. Keyword only.

    Returns:
        out, q's shape, dtype and kind of array, [batch, time, heads * head_dim].

    Raises:
        TypeError: ``heads`` is not an int; an input is not a floating array or dtypes differ.
        ValueError: ``attn_mode`` is not one of the three; ``heads`` not positive or not
            dividing q's last axis; k or v shaped unlike q; a mode's ``local_attn_ctx`` missing
            or not positive; as :func:`sparse_attention`.
    """
    if attn_mode not in DENSE_MODES:
        raise ValueError(f"attention's attn_mode must be one of {DENSE_MODES}, got {attn_mode!r}")
    heads, kv_heads, n_q, n_k = _check_bte(q, k, v, heads)
    if n_q != n_k:
        raise ValueError(f"attention needs k's time {n_k} equal to q's {n_q}")
    extra = {"transpose": False} if attn_mode == "strided" else {}
    args = (attn_mode, heads, DENSE_BLOCKSIZE)
    # length 0 has no Layout; its Pattern is checked the same and the call returns empty
    layout = (
        make_layout(args[0], n_k, *args[1:], local_attn_ctx=local_attn_ctx, **extra)
        if n_k
        else Pattern(*args, local_attn_ctx=local_attn_ctx, **extra)
    )
    return _attend_bte(
        q, k, v, heads, kv_heads, layout, scale=scale, recompute=recompute, backend=backend
    )


PACKED_CACHE_SIZE = 32  # packed layouts of recent varlen calls kept

LayoutFn = Callable[[int, int], Layout]


def _packed_layout(layouts: Sequence[Layout], cu_q: np.ndarray, cu_k: np.ndarray) -> Layout:
    return _packed_of(tuple(cu_q.tolist()), tuple(cu_k.tolist()), tuple(layouts))


@functools.lru_cache(maxsize=PACKED_CACHE_SIZE)
def _packed_of(cu_q: tuple, cu_k: tuple, layouts: tuple[Layout | None, ...]) -> Layout:
    """The packed layout of one packing of these per-sequence layouts (keyed by their identity,
    and kept alive by the cache, so an identity is never reused while its entry exists)."""
    return packed(layouts, np.asarray(cu_q), np.asarray(cu_k))


def _check_max_seqlen(name: str, value: object, lengths: np.ndarray) -> None:
    if value is None:
        return
    given = _check_int(name, value)
    if given < int(lengths.max(initial=0)):
        s = int(np.argmax(lengths))
        raise ValueError(
            f"{name}={given} is below the longest sequence (sequence {s}: {int(lengths[s])} tokens)"
        )


def _nothing_attended(heads: int, n_q: int, n_k: int) -> Layout | Pattern:
    """A layout of no block for a packed batch whose every sequence is empty (a Pattern, which
    the call only reads for its heads, where a length is 0)."""
    if n_q and n_k:
        blocks = np.zeros((heads, -(-n_q // DENSE_BLOCKSIZE), -(-n_k // DENSE_BLOCKSIZE)), bool)
        return Layout(blocks, DENSE_BLOCKSIZE, n_ctx=n_k, n_q=n_q)
    return Pattern("all", max(heads, 1), DENSE_BLOCKSIZE)


def _varlen_layout(
    q: Any,
    k: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    layouts: Sequence[Layout | None] | LayoutFn,
    max_seqlen_q: int | None,
    max_seqlen_k: int | None,
    positional: str | None = None,
) -> Layout:
    """The packed layout of a varlen call, its arguments checked (host values only);
    ``positional``: the name of a score operand the call has that reads positions (ALiBi's
    slopes, a relative-position table), which needs each sequence's queries to be its keys."""
    cu_q = check_cu_seqlens("cu_seqlens_q", cu_seqlens_q, int(q.shape[0]))
    cu_k = check_cu_seqlens("cu_seqlens_k", cu_seqlens_k, int(k.shape[0]))
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must describe the same number of sequences, got "
            f"{len(cu_q) - 1} and {len(cu_k) - 1}"
        )
    if positional and not np.array_equal(cu_q, cu_k):
        raise ValueError(
            f"{positional} with sparse_attention_varlen needs cu_seqlens_q equal to "
            "cu_seqlens_k (each sequence's queries are its keys): the packed call has one query "
            "offset, and the end-aligned distances would differ per sequence otherwise"
        )
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, np.diff(cu_q))
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, np.diff(cu_k))
    lengths = list(zip(np.diff(cu_q).tolist(), np.diff(cu_k).tolist(), strict=True))
    if callable(layouts) and not isinstance(layouts, Layout):
        # an empty sequence (no queries or no keys) has no layout: the callable is not asked
        layouts = [layouts(n_q, n_k) if n_q and n_k else None for n_q, n_k in lengths]
    if not isinstance(layouts, Sequence) or isinstance(layouts, str):
        raise TypeError(
            "layouts must be a sequence of cuattn.Layout (one per sequence) or a callable "
            f"(n_q, n_k) -> Layout, got {type(layouts).__name__}"
        )
    for s, lay in enumerate(layouts):
        if not isinstance(lay, Layout) and lay is not None:
            raise TypeError(
                f"layouts[{s}] must be a cuattn.Layout (None for an empty sequence), got "
                f"{type(lay).__name__}"
            )
    if any(lay is not None for lay in layouts) or len(layouts) != len(lengths):
        return _packed_layout(layouts, cu_q, cu_k)
    # every sequence empty: nothing is attended, no layout to pack
    return _nothing_attended(int(q.shape[1]), int(cu_q[-1]), int(cu_k[-1]))


def sparse_attention_varlen(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    layouts: Sequence[Layout] | LayoutFn,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    *,
    softcap: float | None = None,
    alibi_slopes: Any = None,
    key_bias: Any = None,
    rel_bias: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: int | Any | None = None,
    backend: str | None = None,
) -> Any:
    """Block-sparse attention over a packed batch of sequences of different lengths.

    FlashAttention's varlen convention: sequence s owns queries
    ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` and keys ``cu_seqlens_k[s]:cu_seqlens_k[s+1]`` and
    attends, with its own layout, only to its own keys; there is no padding. The batch runs as
    one call on one packed layout, built on the host from cu_seqlens (a device cu_seqlens is read
    back once) and cached per packing: docs/patterns.md, section "Packed batches".

    Args:
        q (array): queries, [total_q, heads, head_dim], a floating dtype, any kind of array
            :func:`sparse_attention` takes.
        k (array): keys, [total_k, kv_heads, head_dim] (kv_heads dividing heads), q's dtype.
        v (array): values, shaped and typed like k.
        cu_seqlens_q (array): int32/int64 [sequences + 1], starting at 0, non-decreasing,
            ending at total_q (a repeated value is an empty sequence).
        cu_seqlens_k (array): the same for the keys, ending at total_k.
        layouts (Sequence[Layout] | Callable[[int, int], Layout]): one Layout per sequence,
            built for its (n_q, n_k) (None for an empty one), or a callable
            ``(n_q, n_k) -> Layout``, e.g. ``lambda n_q, n_k: make_layout("local", n_k, heads,
            64, local_attn_ctx=256, n_q=n_q)`` (not asked for empty sequences).
        max_seqlen_q (int, optional): FlashAttention's argument, only checked (>= the longest).
        max_seqlen_k (int, optional): the same for the keys.
        scale (float, optional): score scale; None (default) is ``1 / sqrt(head_dim)``.
        return_lse (bool): also return the log-sum-exp (default False).
        softcap (float, optional): as in :func:`sparse_attention`. Keyword only.
        alibi_slopes (array, optional): float32 [heads], one slope per head for every
            sequence; needs cu_seqlens_q equal to cu_seqlens_k (each sequence's distances are
            its own |i - j|).
        key_bias (array, optional): float32 [total_k] or [heads, total_k]: each key's bias at
            its packed position.
        rel_bias (array, optional): float32 [heads, 2 M + 1], one table for every sequence;
            needs cu_seqlens_q equal to cu_seqlens_k.
        dropout_p (float): as in :func:`sparse_attention` (positions in the packing; default
            0.0, off).
        dropout_seed (int | array, optional): as in :func:`sparse_attention`.
        backend (str, optional): as in :func:`sparse_attention`.

    Returns:
        out [total_q, heads, head_dim] like q; with ``return_lse=True`` the pair
        ``(out, lse)``, lse [heads, total_q] float32 (float64 for float64 inputs).

    Raises:
        TypeError: an input is not an array; cu_seqlens not int32/int64; ``layouts`` neither a
            sequence of Layouts nor a callable, or an entry not a Layout; ``max_seqlen_*`` not an
            int; as :func:`sparse_attention`.
        ValueError: an input of another rank; cu_seqlens not 1-D, not starting at 0,
            decreasing, not ending at the total, or describing different numbers of sequences;
            a ``max_seqlen_*`` below the longest sequence; ``alibi_slopes``, ``key_bias`` or
            ``rel_bias`` of another shape, or ALiBi/a table with cu_seqlens_q unlike
            cu_seqlens_k; a layout unlike its sequence's lengths; as :func:`sparse_attention`.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_array(name, x, 3, "[total_tokens, heads, head_dim]")
    # Host work on a few integers per sequence: under torch.compile it runs outside the graph
    # (dynamo would otherwise trace into the layout's NumPy construction).
    lay = _dispatch.outside_graph(
        _varlen_layout,
        q,
        k,
        cu_seqlens_q,
        cu_seqlens_k,
        layouts,
        max_seqlen_q,
        max_seqlen_k,
        "alibi_slopes"
        if alibi_slopes is not None
        else "rel_bias"
        if rel_bias is not None
        else None,
    )
    if alibi_slopes is not None and tuple(dims(alibi_slopes)) != (int(q.shape[1]),):
        raise ValueError(
            f"alibi_slopes of a varlen call must have shape [heads] = ({int(q.shape[1])},), one "
            f"slope per head for every sequence, got {tuple(dims(alibi_slopes))}"
        )
    if key_bias is not None:
        total_k, heads = int(k.shape[0]), int(q.shape[1])
        if not hasattr(key_bias, "shape") or tuple(dims(key_bias)) not in (
            (total_k,),
            (heads, total_k),
        ):
            got = tuple(dims(key_bias)) if hasattr(key_bias, "shape") else type(key_bias).__name__
            raise ValueError(
                f"key_bias of a varlen call must have shape [total_k] = ({total_k},) or [heads, "
                f"total_k] = ({heads}, {total_k}), got {got}"
            )
        key_bias = key_bias.reshape((1,) + tuple(key_bias.shape))  # a batch of one: the packing
    if hasattr(rel_bias, "shape") and (len(dims(rel_bias)) != 2 or dims(rel_bias)[0] != q.shape[1]):
        got = tuple(dims(rel_bias))
        raise ValueError(
            f"rel_bias of a varlen call must have shape [heads, 2 * max_distance + 1] = "
            f"({int(q.shape[1])}, odd), one table for every sequence, got {got}"
        )
    q4, k4, v4 = (_permute(x.reshape((1,) + tuple(x.shape)), (0, 2, 1, 3)) for x in (q, k, v))
    result = sparse_attention(
        q4,
        k4,
        v4,
        lay,
        scale,
        return_lse=return_lse,
        softcap=softcap,
        alibi_slopes=alibi_slopes,
        key_bias=key_bias,
        rel_bias=rel_bias,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        backend=backend,
    )
    out, lse = result if return_lse else (result, None)
    out = _permute(out, (0, 2, 1, 3)).reshape(tuple(q.shape))
    if not return_lse:
        return out
    return out, lse.reshape(tuple(lse.shape[1:]))


def merge_attention_states(
    out_a: Any, lse_a: Any, out_b: Any, lse_b: Any, *, backend: str | None = None
) -> tuple[Any, Any]:
    """Exact attention over keys A u B from two partial attentions over disjoint A and B.

    ``lse = log(exp(lse_a) + exp(lse_b))`` and out is the two outs' mean weighted by
    ``exp(lse_x - lse)``: what a split-KV decode or a ring of context-parallel ranks combines. A
    side with lse -inf (it saw no key) contributes nothing; both empty give 0 and -inf, never
    NaN. torch tensors get gradients in all four inputs (``d out_x = w_x dout``, ``d lse_x =
    w_x (dout . (out_x - out) + dlse)``, ``w_x = exp(lse_x - lse)``; an empty side gets 0). The
    kernel backends run kernels/merge_states.cu.

    Args:
        out_a (array): [..., head_dim] (e.g. [batch, heads, time, head_dim]), a floating dtype:
            NumPy, CuPy, torch or eager jax.
        lse_a (array): [...] (out_a's shape without head_dim), float32 (float64 for float64
            outs), as ``sparse_attention(..., return_lse=True)`` returns it.
        out_b (array): out_a's shape and dtype.
        lse_b (array): lse_a's shape and dtype.
        backend (str, optional): as in :func:`sparse_attention`. Keyword only.

    Returns:
        tuple: ``(out, lse)``, out like out_a and lse like lse_a.

    Raises:
        TypeError: an out is not a floating array; an lse of another dtype than the outs call
            for.
        ValueError: out_b unlike out_a; an lse of another shape; inputs that want a gradient
            but are not all torch tensors (jax tracers).
    """
    for name, x in (("out_a", out_a), ("out_b", out_b)):
        if not hasattr(x, "shape") or not hasattr(x, "dtype"):
            raise TypeError(f"{name} must be an array, got {type(x).__name__}")
        if len(x.shape) < 1 or dtype_name(x) not in FLOAT_DTYPES:
            raise TypeError(
                f"{name} must be a floating array [..., head_dim], got {dtype_name(x)} "
                f"of shape {tuple(x.shape)}"
            )
    shape = tuple(int(d) for d in out_a.shape)
    if tuple(int(d) for d in out_b.shape) != shape or dtype_name(out_b) != dtype_name(out_a):
        raise ValueError(
            f"out_b must match out_a ({shape}, {dtype_name(out_a)}), got "
            f"{tuple(out_b.shape)}, {dtype_name(out_b)}"
        )
    lse_dtype = "float64" if dtype_name(out_a) == "float64" else "float32"
    for name, x in (("lse_a", lse_a), ("lse_b", lse_b)):
        if not hasattr(x, "shape") or tuple(int(d) for d in x.shape) != shape[:-1]:
            raise ValueError(
                f"{name} must have shape {shape[:-1]} (out's without head_dim), got "
                f"{tuple(getattr(x, 'shape', ()))}"
            )
        if dtype_name(x) != lse_dtype:
            raise TypeError(
                f"{name} must be {lse_dtype} (as sparse_attention returns it for "
                f"{dtype_name(out_a)}), got {dtype_name(x)}"
            )
    arrays = {"out_a": out_a, "lse_a": lse_a, "out_b": out_b, "lse_b": lse_b}
    if _dispatch.wants_gradient(arrays.values()):
        if not all(array_library(x) == "torch" for x in arrays.values()):
            raise ValueError(
                "merge_attention_states propagates gradients for torch tensors only; call it "
                "outside jax transformations (or on torch tensors)"
            )
        from cuattn.adapters import torch_ops

        return torch_ops.merge(out_a, lse_a, out_b, lse_b, backend)
    return _dispatch.merge_states(arrays, backend)
