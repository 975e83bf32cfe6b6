"""Layouts chosen from the data (``cuattn.dynamic``): block selection by pooled scores, top-k
(MoBA/NSA) and mass threshold (XAttention-style adaptive budgets), and vertical-slash
(MInference, its rule in cuattn/layout/dynamic.py). The selection is not differentiable;
attention over the chosen layout is, on every route.

q, k: [heads, n, d] or [1, heads, n, d] (k: kv_heads dividing heads) of any framework cuattn
takes. Where the choice is made follows ``backend`` (as for attention: from the arrays' device
and CUATTN_BACKEND by default): on the kernel backends (CUDA arrays, or ``"interp"`` on the
CPU) the whole layout is built on the arrays' device by kernels/layout_build.cu, a
:class:`DeviceLayout`; on the NumPy backend the choice is made with NumPy in float64, a Layout.
Both choose the same blocks from the same scores: docs/patterns.md, section "Layouts chosen
from the data".
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from cuattn._util import array_module, ceil_div, host_array, widened
from cuattn.adapters import dlpack
from cuattn.backends import geometry, layout_build, resolve_backend
from cuattn.backends.kernels import KernelBackend
from cuattn.layout.device import INDEX_FIELDS, DeviceLayout
from cuattn.layout.dynamic import (
    VerticalSlashRule,
    check_vertical_slash_args,
    host_vertical_slash_layout,
    vertical_slash_tables,
)
from cuattn.layout.layout import ElementRule, Layout, check_positive_int

__all__ = [
    "DeviceLayout",
    "block_scores",
    "mass_threshold_blocks",
    "topk_blocks",
    "vertical_slash_layout",
]

POOLS = ("mean", "max")
# Most bytes of bit tables a device vertical-slash layout may allocate (sized from its budget).
DEVICE_TABLE_LIMIT_BYTES = 2 * 2**30
# Mass reached when the cumulative sum is within this of tau (float sums of probabilities).
MASS_SLACK = 1e-9


def _described(name: str, x: Any) -> tuple[Any, dlpack.ArrayInfo]:
    """(x as a [heads, n, d] NumPy/CuPy array sharing its memory, where x lives)."""
    arr, info = _described_batch(name, x)
    if arr.ndim == 4:
        if arr.shape[0] != 1:
            raise ValueError(
                f"{name} must be [heads, n, d] or [1, heads, n, d] (a layout is for one "
                f"sequence; choose per sequence), got shape {tuple(arr.shape)}"
            )
        arr = arr[0]
    if arr.ndim != 3:
        raise ValueError(f"{name} must be [heads, n, d] or [1, heads, n, d], got {arr.shape}")
    return arr, info


# The pooled products one chunk of block_products holds (64 MiB of float32).
SCORE_CHUNK_ELEMENTS = 1 << 24


def _pooled(x: Any, blocksize: int, pool: str) -> Any:
    """[heads, n, d] -> [heads, nb, d] in float32 (float64 for float64)."""
    xp = array_module(x)
    acc = xp.float64 if x.dtype == xp.float64 else xp.float32
    heads, n, d = x.shape
    nb = ceil_div(n, blocksize)
    fill = 0.0 if pool == "mean" else -xp.inf
    padded = xp.full((heads, nb * blocksize, d), fill, dtype=acc)
    padded[:, :n] = widened(x, xp)
    blocks = padded.reshape(heads, nb, blocksize, d)
    if pool == "max":
        return blocks.max(axis=2)
    rows = xp.full((nb,), blocksize, dtype=acc)
    rows[-1] = n - (nb - 1) * blocksize
    return blocks.sum(axis=2) / rows[None, :, None]


def block_scores(q: Any, k: Any, blocksize: int, pool: str = "mean") -> tuple[np.ndarray, int, int]:
    """Block scores from pooled q and k: ``score[h, i, j] = pooled_q[h, i] . pooled_k[g(h), j]``.

    The scores top-k and mass threshold choose from (g(h) the kv head of query head h).

    Args:
        q (array): [heads, n, d] or [1, heads, n, d], any framework cuattn takes.
        k (array): [kv_heads, n, d] (kv_heads dividing heads), on q's device.
        blocksize (int): the block size; a ragged last block pools only its real rows.
        pool (str): ``"mean"`` (default) or ``"max"`` (element-wise) over a block's rows.

    Returns:
        tuple: ``(score, n, head_dim)``, score float64 [heads, nb, nb] on the host.

    Raises:
        TypeError: ``blocksize`` not an int; q or k a jax tracer.
        ValueError: ``blocksize`` not positive; an unknown ``pool``; q or k of another rank or
            a batch other than 1; k unlike q or its heads not dividing q's; q and k on
            different devices.
    """
    qa, ka = _checked_pair(q, k, blocksize, pool)
    scores = _scores(qa, ka, blocksize, pool)
    return host_array(scores).astype(np.float64), qa.shape[1], qa.shape[2]


def _checked_pair(q: Any, k: Any, blocksize: int, pool: str) -> tuple[Any, Any]:
    check_positive_int("blocksize", blocksize)
    if pool not in POOLS:
        raise ValueError(f"pool must be one of {POOLS}, got {pool!r}")
    (qa, q_info), (ka, k_info) = _described("q", q), _described("k", k)
    if (q_info.device, q_info.device_id) != (k_info.device, k_info.device_id):
        raise ValueError(f"k: a {k_info}, q a {q_info}; both must be on one device")
    heads, n, d = qa.shape
    kv_heads = ka.shape[0]
    if ka.shape[1:] != (n, d) or heads % kv_heads:
        raise ValueError(
            f"k must be [kv_heads dividing {heads}, n={n}, d={d}] (as many keys as queries), "
            f"got {tuple(ka.shape)}"
        )
    return qa, ka


def _scores(qa: Any, ka: Any, blocksize: int, pool: str) -> Any:
    """[heads, nb, nb] scores on the arrays' device (float32; float64 for float64 input)."""
    heads, _, d = qa.shape
    kv_heads = ka.shape[0]
    pq, pk = _pooled(qa, blocksize, pool), _pooled(ka, blocksize, pool)
    nb = pq.shape[1]
    grouped = pq.reshape(kv_heads, heads // kv_heads, nb, d)
    if isinstance(pq, np.ndarray):
        scores = grouped @ pk.transpose(0, 2, 1)[:, None]  # [kv_heads, group, nb, nb]
    else:
        scores = block_products(grouped, pk, array_module(pq))
    return scores.reshape(heads, nb, nb)


def block_products(grouped: Any, pk: Any, xp: Any) -> Any:
    """[kv_heads, group, nb, nb]: each pooled query block (grouped [kv_heads, group, nb, d])
    dotted with each pooled key block of its kv head (pk [kv_heads, nb, d]), as elementwise
    products summed over d, SCORE_CHUNK_ELEMENTS products at a time: no cuBLAS, which a CUDA
    graph capture refuses (CuPy's matmul is cuBLAS)."""
    kv_heads, group, nb, d = grouped.shape
    scores = xp.empty((kv_heads, group, nb, nb), dtype=grouped.dtype)
    rows = max(1, SCORE_CHUNK_ELEMENTS // max(kv_heads * group * nb * d, 1))
    for first in range(0, nb, rows):
        products = grouped[:, :, first : first + rows, None, :] * pk[:, None, None, :, :]
        scores[:, :, first : first + rows] = products.sum(axis=-1)
    return scores


def _kernel_route(q: Any, backend: str | None, blocksize: int, n: int, sorts: bool = True) -> Any:
    """The kernel backend that builds the layout where q lives, or None for the NumPy choice;
    a layout the kernels cannot build is refused here, before anything runs."""
    info = dlpack.describe(q, "q")
    impl = resolve_backend(backend, on_device=info.device == "cuda")
    if not isinstance(impl, KernelBackend):  # the NumPy backend chooses on the host
        return None
    if blocksize not in geometry.BLOCK_SIZES:
        raise ValueError(
            f"blocksize: a layout built on the {impl.name} backend needs a kernel block size "
            f"{geometry.BLOCK_SIZES}, got {blocksize}"
        )
    if sorts:
        geometry.select_sort_size(ceil_div(n, blocksize))
    return impl


def _with_views(layout: DeviceLayout, q: Any) -> DeviceLayout:
    """Give a layout chosen from torch tensors its arrays as torch tensors (shared, not
    copied): the torch ops take those, so a compiled graph takes a new layout as an input.
    Called on the caller's stream (``_where``): sharing then needs no cross-stream event."""
    info = dlpack.describe(q, "q")
    if info.framework == "torch":
        fields = ("blocks", *INDEX_FIELDS, "mask_table")
        layout.views = {f: dlpack.from_backend(getattr(layout, f), info) for f in fields}
    return layout


@contextlib.contextmanager
def _where(q: Any, impl: Any, arr: Any) -> Iterator[None]:
    """On q's device and the caller's stream (torch: and its caching allocator)."""
    with dlpack.stream_for(dlpack.describe(q, "q")), impl.on_device_of(arr):
        yield


def vertical_slash_layout(
    q: Any,
    k: Any,
    blocksize: int = 64,
    num_vertical: int = 64,
    num_slash: int = 64,
    last_q: int = 64,
    causal: bool = True,
    scale: float | None = None,
    *,
    backend: str | None = None,
) -> Layout:
    """The vertical-slash layout (MInference): per-head key columns and diagonals chosen from q
    and k.

    The last ``last_q`` queries' softmax rows, averaged over the batch, score every key column
    (vertical) and every offset q - k (slash); head h keeps its ``num_vertical`` best columns
    V_h, its ``num_slash`` best offsets S_h and always offset 0, and query q sees key k when
    ``k in V_h or q - k in S_h`` (and k <= q when causal). On the kernel backends (CUDA arrays,
    or ``backend="interp"``) the whole layout is built on the arrays' device: docs/patterns.md,
    section "Layouts chosen from the data".

    Args:
        q (array): [heads, n, d] or [batch, heads, n, d], any framework cuattn takes (not a jax
            tracer).
        k (array): q's shape.
        blocksize (int): the layout's block size (default 64; a kernel block size on the
            kernel backends).
        num_vertical (int): the key columns each head keeps (default 64).
        num_slash (int): the offsets each head keeps, besides 0 (default 64).
        last_q (int): the last queries whose scores choose (default 64).
        causal (bool): causal scores and layout (default True).
        scale (float, optional): score scale; None (default) is ``1 / sqrt(d)``.
        backend (str, optional): where the choice is made: ``"numpy"`` (a host Layout),
            ``"interp"`` or ``"cuda"`` (a :class:`DeviceLayout`); None (default): from the
            arrays' device and ``CUATTN_BACKEND``. Keyword only.

    Returns:
        Layout: a square layout of n tokens with a bitmask rule (a DeviceLayout on the kernel
        backends).

    Raises:
        TypeError: q or k a jax tracer; a count not an int.
        ValueError: q or k of another rank, or k unlike q; a count not positive; a block size
            without a kernel on the kernel backends; an unknown backend or one unlike the
            arrays' device; bit tables over 2 GiB on the device.
    """
    (qa, _), (ka, _) = _described_batch("q", q), _described_batch("k", k)
    check_vertical_slash_args(qa, ka, blocksize, num_vertical, num_slash, last_q)
    n = int(qa.shape[-2])
    impl = _kernel_route(q, backend, blocksize, n, sorts=False)
    if impl is None:
        host_q, host_k = (np.asarray(x) for x in (qa, ka))
        return host_vertical_slash_layout(
            host_q, host_k, blocksize, num_vertical, num_slash, last_q, causal, scale
        )
    heads, nb = int(qa.shape[-3]), ceil_div(n, blocksize)
    row_capacity = min(nb, min(num_vertical, n) + 2 * (min(num_slash, 2 * n) + 1))
    capacity = layout_build.index_capacity(heads, nb, row_capacity)
    table_bytes = capacity * blocksize * ceil_div(blocksize, 32) * 4
    if table_bytes > DEVICE_TABLE_LIMIT_BYTES:
        raise ValueError(
            f"num_vertical/num_slash: a device vertical-slash layout keeps a bit table per "
            f"active block, up to heads={heads} x {nb} rows x {row_capacity} blocks = "
            f"{table_bytes / 2**30:.1f} GiB here (limit {DEVICE_TABLE_LIMIT_BYTES / 2**30:.0f} "
            "GiB); use fewer columns or offsets, a larger blocksize, or host arrays"
        )
    with _where(q, impl, qa):
        xp = impl.xp
        q64, k64 = (
            widened(x, xp).astype(xp.float64).reshape((-1,) + tuple(x.shape[-3:])) for x in (qa, ka)
        )
        scale = float(q64.shape[-1]) ** -0.5 if scale is None else float(scale)
        is_vertical, is_slash = vertical_slash_tables(
            q64, k64, num_vertical, num_slash, last_q, causal, scale, xp
        )
        chosen = _vertical_slash_blocks(xp, is_vertical, is_slash, n, blocksize, causal)
        rule = VerticalSlashRule(is_vertical, is_slash, causal)
        layout = layout_build.index_layout(
            impl, chosen, blocksize, n, causal, row_capacity, "vertical_slash", rule
        )
        return _with_views(layout, q)


def _described_batch(name: str, x: Any) -> tuple[Any, dlpack.ArrayInfo]:
    """(x as a NumPy/CuPy array of any shape sharing its memory, where x lives)."""
    info = dlpack.describe(x, name)
    if info.device == "traced":
        raise TypeError(
            f"{name} is a jax tracer (inside jax.jit, grad or vmap): cuattn.dynamic chooses "
            "blocks from the values of q and k, which a tracer does not have. Build the layout "
            "outside the transformation (eagerly, from concrete arrays) and pass it in: "
            "sparse_attention under jax.jit takes a built Layout or DeviceLayout"
        )
    return dlpack.to_backend(x, info, name), info


def _vertical_slash_blocks(
    xp: Any, is_vertical: Any, is_slash: Any, n: int, blocksize: int, causal: bool
) -> Any:
    """uint8 [heads, nb, nb]: block (i, j) holds an allowed element of the rule. Block (i, j)
    spans queries [q_lo, q_hi] and keys [k_lo, k_hi]: a chosen column k in [k_lo, k_hi] (and
    k <= q_hi when causal), or a chosen offset o in [q_lo - k_hi, q_hi - k_lo] (o >= 0 when
    causal), counted from prefix sums: the host's pruned candidate blocks, without its loop
    over every element."""
    heads = is_vertical.shape[0]
    nb = ceil_div(n, blocksize)
    columns = xp.zeros((heads, n + 1), dtype=xp.int32)
    columns[:, 1:] = xp.cumsum(is_vertical, axis=-1)
    offsets = xp.zeros((heads, 2 * n + 1), dtype=xp.int32)
    offsets[:, 1:] = xp.cumsum(is_slash, axis=-1)
    i, j = xp.arange(nb)[:, None], xp.arange(nb)[None, :]
    q_lo, q_hi = i * blocksize, xp.minimum(i * blocksize + blocksize, n) - 1
    k_lo, k_hi = j * blocksize, xp.minimum(j * blocksize + blocksize, n) - 1
    v_hi = xp.minimum(k_hi, q_hi) if causal else xp.broadcast_to(k_hi, (nb, nb))
    v_hi = xp.maximum(v_hi, k_lo - 1)  # an empty range counts nothing
    vertical = columns[:, v_hi + 1] - columns[:, xp.broadcast_to(k_lo, (nb, nb))] > 0
    o_lo, o_hi = q_lo - k_hi, q_hi - k_lo
    if causal:
        o_lo = xp.maximum(o_lo, 0)
    o_hi = xp.maximum(o_hi, o_lo - 1)
    slash = offsets[:, o_hi + n + 1] - offsets[:, o_lo + n] > 0
    return xp.ascontiguousarray((vertical | slash).astype(xp.uint8))


def _allowed(heads: int, nb: int, causal: bool) -> np.ndarray:
    i, j = np.arange(nb)[:, None], np.arange(nb)[None, :]
    return np.broadcast_to((j <= i) if causal else np.ones((nb, nb), bool), (heads, nb, nb))


def _rank(keys: tuple[np.ndarray, ...]) -> np.ndarray:
    """rank[h, i, j]: position of j when row (h, i) is sorted by the keys (last key first,
    as np.lexsort), ties by j."""
    nb = keys[0].shape[-1]
    j = np.broadcast_to(np.arange(nb), keys[0].shape)
    order = np.lexsort((j, *keys), axis=-1)
    rank = np.empty_like(order)
    np.put_along_axis(rank, order, np.broadcast_to(np.arange(nb), order.shape), axis=-1)
    return rank


def _layout(blocks: np.ndarray, blocksize: int, n: int, causal: bool, name: str) -> Layout:
    rule = ElementRule("causal") if causal else ElementRule("none")
    return Layout(blocks, blocksize, n_ctx=n, rule=rule, name=name)


def _forced(heads: int, nb: int, allowed: np.ndarray, keep_diagonal: bool, keep_first: int):
    i, j = np.arange(nb)[:, None], np.arange(nb)[None, :]
    forced = np.zeros((nb, nb), dtype=bool)
    if keep_diagonal:
        forced |= i == j
    forced |= j < keep_first
    return np.broadcast_to(forced, (heads, nb, nb)) & allowed


def topk_blocks(
    q: Any,
    k: Any,
    blocksize: int,
    topk: int | Sequence[int],
    pool: str = "mean",
    causal: bool = True,
    keep_diagonal: bool = True,
    keep_first: int = 1,
    *,
    backend: str | None = None,
) -> Layout:
    """MoBA/NSA-style layout: the ``topk`` highest-scored key blocks per (head, query block).

    Per (h, i) the forced blocks (the diagonal with ``keep_diagonal``, the first ``keep_first``
    blocks, where allowed) plus the highest-scored other allowed blocks (:func:`block_scores`)
    until there are ``topk``; ties go to the lower block. The forced blocks count toward topk,
    so no row holds more. The choice takes no gradient; attention over it does. Where it is
    made: docs/patterns.md, section "Layouts chosen from the data".

    Args:
        q (array): [heads, n, d] or [1, heads, n, d], any framework cuattn takes (not a jax
            tracer).
        k (array): [kv_heads, n, d] (kv_heads dividing heads), on q's device.
        blocksize (int): the block size (a kernel block size on the kernel backends).
        topk (int | Sequence[int]): the blocks per query block row, one for every head or one
            per head, each >= 1.
        pool (str): ``"mean"`` (default) or ``"max"`` pooling of a block's rows.
        causal (bool): only key blocks j <= i, and a causal element rule (default True).
        keep_diagonal (bool): always keep the diagonal block (default True).
        keep_first (int): always keep the first blocks, >= 0 (default 1).
        backend (str, optional): as in :func:`vertical_slash_layout`. Keyword only.

    Returns:
        Layout: square, n tokens, named ``"topk"`` (a DeviceLayout on the kernel backends);
        ``layout.nnz`` counts each head's blocks.

    Raises:
        TypeError: ``keep_first`` or ``blocksize`` not an int; q or k a jax tracer.
        ValueError: ``topk`` not >= 1 (or not one per head), or leaving no room for the forced
            blocks; ``keep_first`` < 0; as :func:`block_scores`; a block size without a kernel,
            or more key blocks than the device sort takes, on the kernel backends.
    """
    qa, ka = _checked_pair(q, k, blocksize, pool)
    heads, n, _ = qa.shape
    nb = ceil_div(n, blocksize)
    if isinstance(keep_first, bool) or not isinstance(keep_first, (int, np.integer)):
        raise TypeError(f"keep_first must be an int >= 0, got {keep_first!r}")
    if keep_first < 0:
        raise ValueError(f"keep_first must be an int >= 0, got {keep_first}")
    budget = _per_head_ints("topk", topk, heads)
    forced_most = int(keep_diagonal) + keep_first
    if (budget < forced_most).any():
        raise ValueError(
            f"topk must leave room for the forced blocks (the diagonal {int(keep_diagonal)} + "
            f"keep_first {keep_first} = {forced_most}), got {budget.tolist()}"
        )
    impl = _kernel_route(q, backend, blocksize, n)
    if impl is not None:
        with _where(q, impl, qa):
            chosen = layout_build.select_topk(
                impl,
                _scores(qa, ka, blocksize, pool),
                layout_build.device_budget(impl, budget),
                causal,
                keep_diagonal,
                keep_first,
            )
            row_capacity = int(min(budget.max(), nb))
            layout = layout_build.index_layout(
                impl, chosen, blocksize, n, causal, row_capacity, "topk"
            )
            return _with_views(layout, q)
    scores = host_array(_scores(qa, ka, blocksize, pool)).astype(np.float64)
    allowed = _allowed(heads, nb, causal)
    forced = _forced(heads, nb, allowed, keep_diagonal, keep_first)
    candidate = allowed & ~forced
    rank = _rank((np.where(candidate, -scores, np.inf),))
    quota = budget[:, None, None] - forced.sum(axis=-1, keepdims=True)
    blocks = forced | (candidate & (rank < quota))
    return _layout(blocks, blocksize, n, causal, "topk")


def mass_threshold_blocks(
    q: Any,
    k: Any,
    blocksize: int,
    tau: float,
    pool: str = "mean",
    causal: bool = True,
    keep_diagonal: bool = True,
    max_blocks: int | None = None,
    scale: float | None = None,
    *,
    backend: str | None = None,
) -> Layout:
    """XAttention-style layout: per (head, query block) the fewest key blocks whose estimated
    softmax mass reaches ``tau``.

    Per (h, i) the estimated softmax over the allowed blocks, ``p = softmax(score * scale)``
    (:func:`block_scores`); blocks are taken in order (the diagonal first with
    ``keep_diagonal``, then by p, ties to the lower block) until their mass reaches tau, at most
    ``max_blocks``: a concentrated head spends few blocks, a diffuse one many.

    Args:
        q (array): [heads, n, d] or [1, heads, n, d], any framework cuattn takes (not a jax
            tracer).
        k (array): [kv_heads, n, d] (kv_heads dividing heads), on q's device.
        blocksize (int): the block size (a kernel block size on the kernel backends).
        tau (float): the mass to reach, in (0, 1].
        pool (str): ``"mean"`` (default) or ``"max"`` pooling of a block's rows.
        causal (bool): only key blocks j <= i, and a causal element rule (default True).
        keep_diagonal (bool): take the diagonal block first (default True).
        max_blocks (int, optional): the most blocks per row; None (default): no limit.
        scale (float, optional): the scores' scale; None (default) is ``1 / sqrt(d)``.
        backend (str, optional): as in :func:`vertical_slash_layout`. Keyword only.

    Returns:
        Layout: square, n tokens, named ``"mass_threshold"`` (a DeviceLayout on the kernel
        backends); ``layout.nnz`` counts each head's blocks.

    Raises:
        TypeError: ``tau`` not a number; ``max_blocks`` or ``blocksize`` not an int; q or k a
            jax tracer.
        ValueError: ``tau`` outside (0, 1]; ``max_blocks`` not positive; as
            :func:`block_scores`; a block size without a kernel, or more key blocks than the
            device sort takes, on the kernel backends.
    """
    if isinstance(tau, bool) or not isinstance(tau, (int, float, np.floating)):
        raise TypeError(f"tau must be a number in (0, 1], got {tau!r}")
    if not 0.0 < float(tau) <= 1.0:
        raise ValueError(f"tau must be in (0, 1], got {tau}")
    if max_blocks is not None:
        check_positive_int("max_blocks", max_blocks)
    qa, ka = _checked_pair(q, k, blocksize, pool)
    heads, n, head_dim = qa.shape
    nb = ceil_div(n, blocksize)
    scale = head_dim**-0.5 if scale is None else float(scale)
    impl = _kernel_route(q, backend, blocksize, n)
    if impl is not None:
        with _where(q, impl, qa):
            chosen = layout_build.select_mass(
                impl,
                _scores(qa, ka, blocksize, pool),
                causal,
                keep_diagonal,
                scale,
                float(tau),
                max_blocks,
            )
            row_capacity = nb if max_blocks is None else min(max_blocks, nb)
            layout = layout_build.index_layout(
                impl, chosen, blocksize, n, causal, row_capacity, "mass_threshold"
            )
            return _with_views(layout, q)
    scores = host_array(_scores(qa, ka, blocksize, pool)).astype(np.float64)
    allowed = _allowed(heads, nb, causal)
    s = np.where(allowed, scores * scale, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    first = _forced(heads, nb, allowed, keep_diagonal, 0)
    # allowed blocks first, the diagonal first among them, then by mass; ties to the lower j
    rank = _rank((-p, ~first, ~allowed))
    order = np.argsort(rank, axis=-1)
    cumulative = np.cumsum(np.take_along_axis(p, order, axis=-1), axis=-1)
    count = (cumulative < float(tau) - MASS_SLACK).sum(axis=-1, keepdims=True) + 1
    count = np.minimum(count, allowed.sum(axis=-1, keepdims=True))
    if max_blocks is not None:
        count = np.minimum(count, max_blocks)
    blocks = allowed & (rank < count)
    return _layout(blocks, blocksize, n, causal, "mass_threshold")


def _per_head_ints(name: str, value: Any, heads: int) -> np.ndarray:
    if isinstance(value, (Sequence, np.ndarray)):
        values = np.asarray(value)
        if values.shape != (heads,) or values.dtype.kind not in "iu":
            raise ValueError(f"{name} must be an int or {heads} ints (one per head), got {value!r}")
        if (values < 1).any():
            raise ValueError(f"{name} must be >= 1 everywhere, got {values.tolist()}")
        return values.astype(np.int64)
    check_positive_int(name, value)
    return np.full(heads, int(value), dtype=np.int64)
