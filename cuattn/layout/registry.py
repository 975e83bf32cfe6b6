"""The registry of named patterns and ``make_layout``, the one entry point that builds them.

A pattern is one constructor ``f(n_ctx, heads, blocksize, causal, ...) -> Layout`` decorated
with ``@register(name)``: its signature says which arguments it takes, so a new pattern touches
no table and no if-chain. ``make_layout`` validates the arguments, caches layouts by them and
calls the constructor.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cuattn.layout.derived import end_aligned
from cuattn.layout.layout import Layout, check_positive_int

# Arguments every constructor takes, and the ones make_layout names for the original's modes.
COMMON_ARGS = ("n_ctx", "heads", "blocksize", "causal")
NAMED_ARGS = ("local_attn_ctx", "num_verts", "vertsize")


@dataclass(frozen=True)
class Constructor:
    """A registered pattern's constructor: its name, the function make_layout calls, and the
    arguments it takes beyond COMMON_ARGS (cuattn.Pattern, pattern.py, is the public value)."""

    name: str
    build: Callable[..., Layout]
    params: tuple[str, ...]  # every argument beyond COMMON_ARGS

    @property
    def extra_args(self) -> tuple[str, ...]:
        """The keyword arguments make_layout forwards through ``**pattern_args``."""
        return tuple(p for p in self.params if p not in NAMED_ARGS)


_PATTERNS: dict[str, Constructor] = {}


def register(name: str) -> Callable[[Callable[..., Layout]], Callable[..., Layout]]:
    """Decorator: make ``fn`` the constructor of the pattern ``name`` in ``make_layout``."""

    def add(fn: Callable[..., Layout]) -> Callable[..., Layout]:
        if name in _PATTERNS:
            raise ValueError(f"pattern {name!r} is registered already")
        params = tuple(p for p in inspect.signature(fn).parameters if p not in COMMON_ARGS)
        _PATTERNS[name] = Constructor(name, fn, params)
        return fn

    return add


def modes() -> tuple[str, ...]:
    """Names of the registered patterns, in registration order."""
    return tuple(_PATTERNS)


def accepted_arguments(attn_mode: str) -> tuple[str, ...]:
    """The keyword arguments pattern ``attn_mode`` takes (besides heads and blocksize)."""
    return (*_PATTERNS[attn_mode].params, "causal")


def check_arguments(
    attn_mode: str,
    heads: object,
    blocksize: object,
    num_verts: object = None,
    vertsize: object = None,
    causal: object = True,
    pattern_args: dict[str, object] | None = None,
    also_accepted: tuple[str, ...] = (),
) -> Constructor:
    """The checks of a pattern's arguments that need no length (make_layout's and Pattern's):
    the mode, heads, blocksize, causal, and argument names; a name the mode does not take is a
    TypeError naming the ones it does (``also_accepted``: the caller's own, e.g. n_q)."""
    if not isinstance(attn_mode, str) or attn_mode not in _PATTERNS:
        raise ValueError(f"attn_mode must be one of {modes()}, got {attn_mode!r}")
    pattern = _PATTERNS[attn_mode]
    check_positive_int("heads", heads)
    check_positive_int("blocksize", blocksize)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    unknown = sorted(set(pattern_args or ()) - set(pattern.extra_args))
    if unknown:
        accepted = (*accepted_arguments(attn_mode), *also_accepted)
        close = difflib.get_close_matches(unknown[0], accepted, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(
            f"unexpected argument(s) {unknown} for attn_mode={attn_mode!r}{hint}; accepted "
            f"pattern arguments: {', '.join(accepted)}"
        )
    if "num_verts" not in pattern.params and (num_verts is not None or vertsize is not None):
        raise ValueError(f"num_verts/vertsize apply only to attn_mode='fixed', not {attn_mode!r}")
    return pattern


# Messages of the constructors' checks that depend on the length (an index past it, documents
# that do not sum to it, a transposed form it does not fit): a trial build without the length
# cannot judge those.
_LENGTH_BOUND = re.compile(r"\bn_ctx\b|entries must be in \[0,")


def check_pattern(
    attn_mode: str, heads: int, blocksize: int, trial: bool = True, **options: object
) -> None:
    """Every check of make_layout's arguments that holds for all lengths, without a length:
    check_arguments, then (``trial``) the constructor run once on one block of tokens, whose
    errors are the arguments' own unless they speak of the length (those wait for a call's
    lengths)."""
    named = {name: options.pop(name, None) for name in NAMED_ARGS}
    causal = options.pop("causal", True)
    pattern = check_arguments(
        attn_mode, heads, blocksize, named["num_verts"], named["vertsize"], causal, options
    )
    if not trial:
        return
    given = {name: value for name, value in named.items() if name in pattern.params}
    try:
        pattern.build(
            n_ctx=blocksize,
            heads=heads,
            blocksize=blocksize,
            causal=bool(causal),
            **given,
            **options,
        )
    except (ValueError, TypeError) as err:
        if not _LENGTH_BOUND.search(str(err)):
            raise


CACHE_SIZE = 64  # layouts make_layout keeps


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
    n_q: int | None = None,
    **pattern_args: object,
) -> Layout:
    """Build (or fetch from the cache) the layout of a named pattern.

    Each pattern's element rule and parameters: docs/patterns.md, section "The named patterns".
    Layouts are cached by their arguments.

    Args:
        attn_mode (str): a registered pattern (``cuattn.MODES``: ``all``, ``local``,
            ``strided``, ``fixed``, ``window``, ``longformer``, ``bigbird``, ``variable``,
            ``document``, and any registered since).
        n_ctx (int): the keys (the sequence length for self-attention).
        heads (int): the query heads.
        blocksize (int): the block size (default 32).
        local_attn_ctx (int, optional): the window (``local``, ``longformer``), stride
            (``strided``) or group size (``fixed``, a multiple of blocksize); modes without one
            ignore it, as the original's do.
        num_verts (int, optional): ``fixed`` only: the summary-column chunks heads cycle over.
        vertsize (int, optional): ``fixed`` only: the blocks per summary-column chunk.
        causal (bool): True (default): keys after the query's position are masked; False: the
            bidirectional variant.
        n_q (int, optional): the queries, aligned to the end of the keys (query i is position
            ``i + n_ctx - n_q``: cross-attention, chunked prefill; ``to_mask()`` is then
            [heads, n_q, n_ctx]); None (default) is n_ctx.
        **pattern_args: the pattern's own arguments (e.g. ``window_left``, ``global_tokens``,
            ``num_random_blocks``, ``seed``, ``doc_lengths``, ``transpose``).

    Returns:
        Layout: the pattern's layout for n_q queries and n_ctx keys.

    Raises:
        TypeError: a size not an int; ``causal`` not a bool; an argument the mode does not take
            (the message lists those it does, and the closest name).
        ValueError: an unknown ``attn_mode``; a size not positive; ``num_verts``/``vertsize``
            with a mode other than ``fixed``; a value the pattern refuses (a missing
            ``local_attn_ctx``, a group not a multiple of blocksize, ...).

    Example:
        >>> import cuattn
        >>> layout = cuattn.make_layout("local", n_ctx=1024, heads=4, blocksize=64,
        ...                             local_attn_ctx=256, n_q=256)
        >>> layout.n_q, layout.n_ctx, layout.heads
        (256, 1024, 4)
    """
    check_positive_int("n_ctx", n_ctx)
    if n_q is not None:
        check_positive_int("n_q", n_q)
    pattern = check_arguments(
        attn_mode, heads, blocksize, num_verts, vertsize, causal, pattern_args, ("n_ctx", "n_q")
    )
    key = (
        attn_mode,
        n_ctx,
        heads,
        blocksize,
        local_attn_ctx,
        num_verts,
        vertsize,
        bool(causal),
        n_q,
        tuple(sorted((k, _freeze(v)) for k, v in pattern_args.items())),
    )
    return _built(key, pattern)


@functools.lru_cache(maxsize=CACHE_SIZE)
def _built(key: tuple, pattern: Constructor) -> Layout:
    """The layout of make_layout's checked, frozen arguments (``key``), built once per key."""
    _, n_ctx, heads, blocksize, local_attn_ctx, num_verts, vertsize, causal, n_q, frozen = key
    pattern_args = dict(frozen)
    given = dict(local_attn_ctx=local_attn_ctx, num_verts=num_verts, vertsize=vertsize)
    # The original passes local_attn_ctx to every mode; a pattern without a window ignores it.
    named = {name: value for name, value in given.items() if name in pattern.params}
    rectangular = n_q is not None and n_q != n_ctx
    if rectangular and "transpose" in pattern.params and pattern_args.get("transpose") is None:
        pattern_args = {**pattern_args, "transpose": False}  # a permutation needs a square
    layout = pattern.build(
        n_ctx=n_ctx, heads=heads, blocksize=blocksize, causal=bool(causal), **named, **pattern_args
    )
    if rectangular:
        layout = end_aligned(layout, n_q)
    return layout
