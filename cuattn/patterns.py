"""Named sparse-attention patterns -> Layout. Every pattern is data; none compiles a kernel.

``make_layout(attn_mode, n_ctx, heads, blocksize, ...)`` is the single entry point. Each
constructor's docstring states its element rule ``allowed(h, q, k)``, the contract the backends
are tested against (DESIGN.md §2). ``b`` is the block size, ``n`` the sequence length, positions
are 0-based; every rule also requires ``k < n``.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .layout import MASK_CHUNK, ElementRule, Layout, MaskFn, _check_positive_int, _positions

MODES = ("all", "local", "strided", "fixed", "longformer", "bigbird", "variable")

_PATTERN_ARGS = {
    "all": (),
    "local": (),
    "strided": ("transpose",),
    "fixed": (),
    "longformer": ("global_tokens",),
    "bigbird": ("num_global_blocks", "num_window_blocks", "num_random_blocks", "seed"),
    "variable": (
        "num_random_blocks",
        "local_window_blocks",
        "global_block_indices",
        "global_block_end_indices",
        "horizontal_global_attention",
        "seed",
    ),
}

_CACHE: dict[tuple, Layout] = {}
CACHE_SIZE = 64


def _freeze(value: object) -> object:
    if isinstance(value, (list, tuple, np.ndarray)):
        return tuple(_freeze(v) for v in value)
    return value


def make_layout(
    attn_mode: str,
    n_ctx: int,
    heads: int,
    blocksize: int = 32,
    local_attn_ctx: int | None = None,
    num_verts: int | None = None,
    vertsize: int | None = None,
    causal: bool = True,
    **pattern_args: object,
) -> Layout:
    """Build (or fetch from the cache) the layout of a named pattern.

    attn_mode: one of ``all``, ``local``, ``strided``, ``fixed``, ``longformer``, ``bigbird``,
    ``variable``; see each ``*_layout`` function for its element rule and parameters.
    ``causal=False`` gives the bidirectional variant. Layouts are cached by their arguments.
    """
    if not isinstance(attn_mode, str) or attn_mode not in MODES:
        raise ValueError(f"attn_mode must be one of {MODES}, got {attn_mode!r}")
    _check_positive_int("n_ctx", n_ctx)
    _check_positive_int("heads", heads)
    _check_positive_int("blocksize", blocksize)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    unknown = set(pattern_args) - set(_PATTERN_ARGS[attn_mode])
    if unknown:
        accepted = ", ".join(_PATTERN_ARGS[attn_mode]) or "none"
        raise TypeError(
            f"unexpected argument(s) {sorted(unknown)} for attn_mode={attn_mode!r}; "
            f"accepted pattern arguments: {accepted}"
        )
    if attn_mode != "fixed" and (num_verts is not None or vertsize is not None):
        raise ValueError(f"num_verts/vertsize apply only to attn_mode='fixed', not {attn_mode!r}")
    key = (
        attn_mode,
        n_ctx,
        heads,
        blocksize,
        local_attn_ctx,
        num_verts,
        vertsize,
        bool(causal),
        tuple(sorted((k, _freeze(v)) for k, v in pattern_args.items())),
    )
    if key in _CACHE:
        return _CACHE[key]
    common = dict(n_ctx=n_ctx, heads=heads, blocksize=blocksize, causal=bool(causal))
    if attn_mode == "all":
        layout = all_layout(**common)
    elif attn_mode == "local":
        layout = local_layout(local_attn_ctx=local_attn_ctx, **common)
    elif attn_mode == "strided":
        layout = strided_layout(local_attn_ctx=local_attn_ctx, **common, **pattern_args)
    elif attn_mode == "fixed":
        layout = fixed_layout(
            local_attn_ctx=local_attn_ctx, num_verts=num_verts, vertsize=vertsize, **common
        )
    elif attn_mode == "longformer":
        layout = longformer_layout(local_attn_ctx=local_attn_ctx, **common, **pattern_args)
    elif attn_mode == "bigbird":
        layout = bigbird_layout(**common, **pattern_args)
    else:
        layout = variable_layout(**common, **pattern_args)
    if len(_CACHE) >= CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = layout
    return layout


# -- helpers ----------------------------------------------------------------------------------


def _num_blocks(n_ctx: int, blocksize: int) -> int:
    return -(-n_ctx // blocksize)


def _require_ctx(name: str, value: object, mode: str) -> int:
    if value is None:
        raise ValueError(f"attn_mode={mode!r} needs {name} (a positive int), got None")
    _check_positive_int(name, value)
    return int(value)


def _causal_cut(blocks: np.ndarray) -> np.ndarray:
    """Turn off every block above the diagonal (j > i): causal rows never see them."""
    return blocks & np.tril(np.ones(blocks.shape[-2:], dtype=bool))


def _window_blocks(nb: int, b: int, left: int, right: int, n_ctx: int) -> np.ndarray:
    """Blocks holding at least one (q, k) with q - k < left and k - q < right, both < n_ctx."""
    i = np.arange(nb)[:, None]
    j = np.arange(nb)[None, :]
    q_lo, k_lo = i * b, j * b
    q_hi, k_hi = np.minimum(q_lo + b, n_ctx) - 1, np.minimum(k_lo + b, n_ctx) - 1
    return (q_lo - k_hi < left) & (k_lo - q_hi < right)


def _prune(candidates: np.ndarray, blocksize: int, n_ctx: int, mask_fn: MaskFn) -> np.ndarray:
    """Keep the candidate blocks where mask_fn allows at least one element (q, k < n_ctx)."""
    heads = candidates.shape[0]
    blocks = np.zeros_like(candidates)
    for h in range(heads):
        i, j = np.nonzero(candidates[h])
        for start in range(0, len(i), MASK_CHUNK):
            sl = slice(start, start + MASK_CHUNK)
            qpos, kpos = _positions(i[sl], j[sl], blocksize)
            inside = (qpos < n_ctx) & (kpos < n_ctx)
            qpos, kpos = np.minimum(qpos, n_ctx - 1), np.minimum(kpos, n_ctx - 1)
            allowed = inside & np.broadcast_to(
                mask_fn(np.int64(h), qpos, kpos), (len(qpos), blocksize, blocksize)
            )
            blocks[h, i[sl], j[sl]] = allowed.any(axis=(1, 2))
    return blocks


def _bitmask_layout(
    candidates: np.ndarray, blocksize: int, n_ctx: int, mask_fn: MaskFn, name: str
) -> Layout:
    blocks = _prune(candidates, blocksize, n_ctx, mask_fn)
    return Layout(
        blocks, blocksize, n_ctx=n_ctx, rule=ElementRule("bitmask", mask_fn=mask_fn), name=name
    )


def _int_tuple(name: str, value: object, upper: int) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        value = (value,)
    if not isinstance(value, Sequence | np.ndarray):
        raise TypeError(f"{name} must be a sequence of ints, got {type(value).__name__}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise TypeError(f"{name} must hold ints, got {v!r}")
        if not 0 <= v < upper:
            raise ValueError(f"{name} entries must be in [0, {upper}), got {v}")
        out.append(int(v))
    return tuple(out)


# -- the original's modes ---------------------------------------------------------------------


def all_layout(n_ctx: int, heads: int, blocksize: int, causal: bool = True) -> Layout:
    """``all``: allowed(h, q, k) = k <= q (causal); every (q, k) when ``causal=False``."""
    nb = _num_blocks(n_ctx, blocksize)
    blocks = np.ones((heads, nb, nb), dtype=bool)
    if causal:
        return Layout(_causal_cut(blocks), blocksize, n_ctx, ElementRule("causal"), name="all")
    return Layout(blocks, blocksize, n_ctx, ElementRule("none"), name="all")


def local_layout(
    n_ctx: int, heads: int, blocksize: int, local_attn_ctx: int | None, causal: bool = True
) -> Layout:
    """``local``: allowed(h, q, k) = k <= q and q - k < w, w = local_attn_ctx.

    Bidirectional (``causal=False``): |q - k| < w. Any w >= 1 works (the original required a
    multiple of the block size); blocks are exactly the ones holding an allowed element.
    """
    w = _require_ctx("local_attn_ctx", local_attn_ctx, "local")
    nb = _num_blocks(n_ctx, blocksize)
    right = 1 if causal else w
    blocks = np.broadcast_to(_window_blocks(nb, blocksize, w, right, n_ctx), (heads, nb, nb))
    rule = ElementRule("window", window_left=w, window_right=right)
    return Layout(blocks, blocksize, n_ctx, rule, name="local")


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
    s = _require_ctx("local_attn_ctx", local_attn_ctx, "strided")
    if transpose is not None and not isinstance(transpose, (bool, np.bool_)):
        raise TypeError(f"transpose must be a bool or None, got {transpose!r}")
    fits = n_ctx % s == 0 and (n_ctx // s) % blocksize == 0
    if transpose and not fits:
        raise ValueError(
            f"strided transpose=True needs n_ctx % local_attn_ctx == 0 and "
            f"(n_ctx / local_attn_ctx) % blocksize == 0; got n_ctx={n_ctx}, "
            f"local_attn_ctx={s}, blocksize={blocksize} (use transpose=None to fall back)"
        )
    nb = _num_blocks(n_ctx, blocksize)
    if fits and transpose is not False:
        run = n_ctx // s
        chunk = run // blocksize
        same_run = (np.arange(nb)[:, None] // chunk) == (np.arange(nb)[None, :] // chunk)
        blocks = np.broadcast_to(_causal_cut(same_run) if causal else same_run, (heads, nb, nb))
        perm = np.arange(n_ctx).reshape(run, s).T.reshape(-1)
        rule = ElementRule("causal" if causal else "none")
        return Layout(blocks, blocksize, n_ctx, rule, perm=perm, name="strided")

    def rule_fn(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        hit = (q - k) % s == 0
        return hit & (k <= q) if causal else hit

    candidates = np.ones((heads, nb, nb), dtype=bool)
    if causal:
        candidates = _causal_cut(candidates)
    return _bitmask_layout(candidates, blocksize, n_ctx, rule_fn, "strided")


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
    lctx = _require_ctx("local_attn_ctx", local_attn_ctx, "fixed")
    num_verts = 1 if num_verts is None else num_verts
    vertsize = 1 if vertsize is None else vertsize
    _check_positive_int("num_verts", num_verts)
    _check_positive_int("vertsize", vertsize)
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
    nb = _num_blocks(n_ctx, blocksize)
    offsets = np.arange(g - 1, -1, -1).reshape(-1, vertsize)
    idx = np.arange(nb)
    same_group = (idx[:, None] // g) == (idx[None, :] // g)
    blocks = np.zeros((heads, nb, nb), dtype=bool)
    for h in range(heads):
        summary = np.isin(idx % g, offsets[h % num_verts])
        blocks[h] = same_group | summary[None, :]
    if causal:
        return Layout(_causal_cut(blocks), blocksize, n_ctx, ElementRule("causal"), name="fixed")
    return Layout(blocks, blocksize, n_ctx, ElementRule("none"), name="fixed")


# -- beyond the original ----------------------------------------------------------------------


def longformer_layout(
    n_ctx: int,
    heads: int,
    blocksize: int,
    local_attn_ctx: int | None,
    causal: bool = False,
    global_tokens: Sequence[int] = (0,),
) -> Layout:
    """``longformer``: sliding window plus global tokens G (``global_tokens``, default (0,)).

    allowed(h, q, k) = |q - k| < w or q in G or k in G, w = local_attn_ctx; with ``causal=True``
    additionally k <= q (then a global query sees every earlier key).
    """
    w = _require_ctx("local_attn_ctx", local_attn_ctx, "longformer")
    glob = np.array(_int_tuple("global_tokens", global_tokens, n_ctx), dtype=np.int64)
    nb = _num_blocks(n_ctx, blocksize)

    def rule_fn(h: np.ndarray, q: np.ndarray, k: np.ndarray) -> np.ndarray:
        hit = (np.abs(q - k) < w) | np.isin(q, glob) | np.isin(k, glob)
        return hit & (k <= q) if causal else hit

    candidates = _window_blocks(nb, blocksize, w, w, n_ctx)
    gblocks = np.unique(glob // blocksize)
    candidates[gblocks, :] = True
    candidates[:, gblocks] = True
    candidates = np.broadcast_to(candidates, (heads, nb, nb))
    if causal:
        candidates = _causal_cut(candidates)
    return _bitmask_layout(candidates, blocksize, n_ctx, rule_fn, "longformer")


def _random_blocks(
    rng: np.random.Generator, taken: np.ndarray, count: int, causal: bool
) -> np.ndarray:
    """Per row, ``count`` extra key blocks drawn without replacement from those not yet on."""
    nb = taken.shape[0]
    extra = np.zeros_like(taken)
    for i in range(nb):
        limit = i + 1 if causal else nb
        free = np.flatnonzero(~taken[i, :limit])
        if len(free):
            extra[i, rng.choice(free, size=min(count, len(free)), replace=False)] = True
    return extra


def _block_level_layout(
    base: np.ndarray,
    heads: int,
    blocksize: int,
    n_ctx: int,
    causal: bool,
    num_random_blocks: int,
    seed: int,
    name: str,
) -> Layout:
    """A pattern defined on blocks: ``base`` plus seeded random blocks per head, per row."""
    rng = np.random.default_rng(seed)
    blocks = np.stack(
        [base | _random_blocks(rng, base, num_random_blocks, causal) for _ in range(heads)]
    )
    return Layout(blocks, blocksize, n_ctx, ElementRule("causal" if causal else "none"), name=name)


def bigbird_layout(
    n_ctx: int,
    heads: int,
    blocksize: int,
    causal: bool = False,
    num_global_blocks: int = 1,
    num_window_blocks: int = 3,
    num_random_blocks: int = 1,
    seed: int = 0,
) -> Layout:
    """``bigbird``: window + global + random blocks, defined on blocks (seeded, per head).

    Block (i, j) is on when |i - j| <= num_window_blocks // 2, or i or j < num_global_blocks,
    or j is one of row i's ``num_random_blocks`` random blocks (drawn per head with
    ``numpy.random.default_rng(seed)``). allowed(h, q, k) = L[h, q//b, k//b], and k <= q when
    ``causal=True`` (random blocks then drawn from j <= i).
    """
    for name, val in (
        ("num_global_blocks", num_global_blocks),
        ("num_window_blocks", num_window_blocks),
        ("num_random_blocks", num_random_blocks),
        ("seed", seed),
    ):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 0:
            raise ValueError(f"{name} must be a non-negative int, got {val!r}")
    nb = _num_blocks(n_ctx, blocksize)
    idx = np.arange(nb)
    base = np.abs(idx[:, None] - idx[None, :]) <= num_window_blocks // 2
    base[:num_global_blocks, :] = True
    base[:, :num_global_blocks] = True
    if causal:
        base = _causal_cut(base)
    return _block_level_layout(
        base, heads, blocksize, n_ctx, causal, num_random_blocks, seed, "bigbird"
    )


def variable_layout(
    n_ctx: int,
    heads: int,
    blocksize: int,
    causal: bool = False,
    num_random_blocks: int = 0,
    local_window_blocks: Sequence[int] = (4,),
    global_block_indices: Sequence[int] = (0,),
    global_block_end_indices: Sequence[int] | None = None,
    horizontal_global_attention: bool = False,
    seed: int = 0,
) -> Layout:
    """``variable`` (DeepSpeed's VariableSparsityConfig), defined on blocks.

    Local windows: consecutive runs of blocks of sizes ``local_window_blocks`` (the last size
    repeats to the end); blocks of one run see each other. Global: key-block columns
    ``global_block_indices`` (or ranges [start, end) with ``global_block_end_indices``) are
    seen by every row; with ``horizontal_global_attention`` (bidirectional only) those rows
    also see everything. ``num_random_blocks`` random key blocks per row, seeded.
    allowed(h, q, k) = L[h, q//b, k//b], and k <= q when ``causal=True``.
    """
    nb = _num_blocks(n_ctx, blocksize)
    windows = _int_tuple("local_window_blocks", local_window_blocks, nb + 1)
    if not windows or min(windows) < 1:
        raise ValueError(
            f"local_window_blocks must hold positive ints, got {local_window_blocks!r}"
        )
    starts = _int_tuple("global_block_indices", global_block_indices, nb)
    if global_block_end_indices is None:
        ends = tuple(s + 1 for s in starts)
    else:
        ends = _int_tuple("global_block_end_indices", global_block_end_indices, nb + 1)
        if len(ends) != len(starts) or any(e <= s for s, e in zip(starts, ends, strict=True)):
            raise ValueError(
                "global_block_end_indices must pair with global_block_indices, each end > start; "
                f"got {starts} and {ends}"
            )
    if horizontal_global_attention and causal:
        raise ValueError("horizontal_global_attention needs causal=False")
    if isinstance(num_random_blocks, bool) or not isinstance(num_random_blocks, (int, np.integer)):
        raise TypeError(f"num_random_blocks must be an int, got {num_random_blocks!r}")
    if num_random_blocks < 0:
        raise ValueError(f"num_random_blocks must be >= 0, got {num_random_blocks}")
    window_id = np.empty(nb, dtype=np.int64)
    pos, wid = 0, 0
    while pos < nb:
        size = windows[min(wid, len(windows) - 1)]
        window_id[pos : pos + size] = wid
        pos, wid = pos + size, wid + 1
    base = window_id[:, None] == window_id[None, :]
    for s, e in zip(starts, ends, strict=True):
        base[:, s:e] = True
        if horizontal_global_attention:
            base[s:e, :] = True
    if causal:
        base = _causal_cut(base)
    return _block_level_layout(
        base, heads, blocksize, n_ctx, causal, num_random_blocks, seed, "variable"
    )


def vertical_slash_layout(
    q: np.ndarray,
    k: np.ndarray,
    blocksize: int = 64,
    num_vertical: int = 64,
    num_slash: int = 64,
    last_q: int = 64,
    causal: bool = True,
    scale: float | None = None,
) -> Layout:
    """``vertical_slash`` (MInference): per-head top key columns and diagonals chosen from data.

    q, k: NumPy arrays [heads, n, d] or [batch, heads, n, d] (host arrays: the choice is made
    once, on the CPU). The last ``last_q`` queries' softmax(q k^T * scale) rows (causal if
    ``causal``), averaged over the batch, score every key column (vertical) and every offset
    q - k (slash); head h keeps its ``num_vertical`` best columns V_h and ``num_slash`` best
    offsets S_h, and always the main diagonal 0, so no causal row is left empty.
    allowed(h, q, k) = (k in V_h or q - k in S_h), and k <= q when causal.
    """
    for name, x in (("q", q), ("k", k)):
        if not isinstance(x, np.ndarray):
            raise TypeError(
                f"{name} must be a NumPy array (move device arrays to the host first), "
                f"got {type(x).__name__}"
            )
        if x.ndim not in (3, 4):
            raise ValueError(
                f"{name} must be [heads, n, d] or [batch, heads, n, d], got shape {x.shape}"
            )
    if q.shape != k.shape:
        raise ValueError(f"k must have the same shape as q {q.shape}, got {k.shape}")
    for name, val in (
        ("blocksize", blocksize),
        ("num_vertical", num_vertical),
        ("num_slash", num_slash),
        ("last_q", last_q),
    ):
        _check_positive_int(name, val)
    q64 = q.astype(np.float64).reshape((-1,) + q.shape[-3:])
    k64 = k.astype(np.float64).reshape((-1,) + k.shape[-3:])
    _, heads, n_ctx, head_dim = q64.shape
    scale = 1.0 / np.sqrt(head_dim) if scale is None else float(scale)
    rows = min(last_q, n_ctx)
    qpos = np.arange(n_ctx - rows, n_ctx)[:, None]
    kpos = np.arange(n_ctx)[None, :]
    # Scores of the last `rows` queries only: rows x n, never n x n.
    s = np.einsum("bhqd,bhkd->bhqk", q64[:, :, -rows:], k64) * scale
    if causal:
        s = np.where(kpos <= qpos, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p = (p / p.sum(axis=-1, keepdims=True)).mean(axis=0)  # [heads, rows, n]
    offset = np.broadcast_to(qpos - kpos + n_ctx, p.shape[1:])  # shifted to be >= 0
    is_vertical = np.zeros((heads, n_ctx), dtype=bool)
    is_slash = np.zeros((heads, 2 * n_ctx), dtype=bool)
    for h in range(heads):
        vertical_score = p[h].sum(axis=0)
        is_vertical[h, np.argsort(-vertical_score, kind="stable")[:num_vertical]] = True
        slash_score = np.bincount(offset.ravel(), weights=p[h].ravel(), minlength=2 * n_ctx)
        is_slash[h, np.argsort(-slash_score, kind="stable")[:num_slash]] = True
        is_slash[h, n_ctx] = True

    def rule_fn(h: np.ndarray, qi: np.ndarray, ki: np.ndarray) -> np.ndarray:
        hit = is_vertical[h, ki] | is_slash[h, qi - ki + n_ctx]
        return hit & (ki <= qi) if causal else hit

    nb = _num_blocks(n_ctx, blocksize)
    blk = np.arange(nb)
    candidates = np.zeros((heads, nb, nb), dtype=bool)
    for h in range(heads):
        cols = np.unique(np.flatnonzero(is_vertical[h]) // blocksize)
        candidates[h][:, cols] = True
        # an offset o lands on block diagonals floor(o / b) and floor(o / b) + 1
        offs = np.flatnonzero(is_slash[h]) - n_ctx
        diag = np.unique(np.concatenate([offs // blocksize, offs // blocksize + 1]))
        candidates[h] |= np.isin(blk[:, None] - blk[None, :], diag)
    if causal:
        candidates = _causal_cut(candidates)
    return _bitmask_layout(candidates, blocksize, n_ctx, rule_fn, "vertical_slash")


def layout_density_vs_causal(layout: Layout) -> float:
    """Active blocks over the blocks of a dense causal layout of the same size (for benchmarks)."""
    nb = layout.num_blocks
    return float(layout.nnz.sum()) / (layout.heads * nb * (nb + 1) / 2)


__all__ = [
    "MODES",
    "make_layout",
    "all_layout",
    "local_layout",
    "strided_layout",
    "fixed_layout",
    "longformer_layout",
    "bigbird_layout",
    "variable_layout",
    "vertical_slash_layout",
    "layout_density_vs_causal",
]
