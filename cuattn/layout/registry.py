"""The registry of named patterns and ``make_layout``, the one entry point that builds them.

A pattern is one constructor ``f(n_ctx, heads, blocksize, causal, ...) -> Layout`` decorated
with ``@register(name)``: its signature says which arguments it takes, so a new pattern touches
no table and no if-chain. ``make_layout`` validates the arguments, caches layouts by them and
calls the constructor.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from cuattn.layout.derived import end_aligned
from cuattn.layout.layout import Layout, check_positive_int

# Arguments every constructor takes, and the ones make_layout names for the original's modes.
COMMON_ARGS = ("n_ctx", "heads", "blocksize", "causal")
NAMED_ARGS = ("local_attn_ctx", "num_verts", "vertsize")


@dataclass(frozen=True)
class Pattern:
    name: str
    build: Callable[..., Layout]
    params: tuple[str, ...]  # every argument beyond COMMON_ARGS

    @property
    def extra_args(self) -> tuple[str, ...]:
        """The keyword arguments make_layout forwards through ``**pattern_args``."""
        return tuple(p for p in self.params if p not in NAMED_ARGS)


_PATTERNS: dict[str, Pattern] = {}


def register(name: str) -> Callable[[Callable[..., Layout]], Callable[..., Layout]]:
    """Decorator: make ``fn`` the constructor of the pattern ``name`` in ``make_layout``."""

    def add(fn: Callable[..., Layout]) -> Callable[..., Layout]:
        if name in _PATTERNS:
            raise ValueError(f"pattern {name!r} is registered already")
        params = tuple(p for p in inspect.signature(fn).parameters if p not in COMMON_ARGS)
        _PATTERNS[name] = Pattern(name, fn, params)
        return fn

    return add


def modes() -> tuple[str, ...]:
    """Names of the registered patterns, in registration order."""
    return tuple(_PATTERNS)


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
    n_q: int | None = None,
    **pattern_args: object,
) -> Layout:
    """Build (or fetch from the cache) the layout of a named pattern.

    attn_mode: a registered pattern (``modes()``: ``all``, ``local``, ``strided``, ``fixed``,
    ``longformer``, ``bigbird``, ``variable``); see each ``*_layout`` constructor for its element
    rule and parameters.
    ``causal=False`` gives the bidirectional variant. ``n_q`` (default ``n_ctx``) builds the
    layout of n_q queries against n_ctx keys, aligned at the end (query i is position
    i + n_ctx - n_q of the pattern: cross-attention, chunked prefill; ``to_mask()`` is then
    [heads, n_q, n_ctx]). Layouts are cached by their arguments.
    """
    if not isinstance(attn_mode, str) or attn_mode not in _PATTERNS:
        raise ValueError(f"attn_mode must be one of {modes()}, got {attn_mode!r}")
    pattern = _PATTERNS[attn_mode]
    check_positive_int("n_ctx", n_ctx)
    check_positive_int("heads", heads)
    check_positive_int("blocksize", blocksize)
    if n_q is not None:
        check_positive_int("n_q", n_q)
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__} {causal!r}")
    unknown = set(pattern_args) - set(pattern.extra_args)
    if unknown:
        accepted = ", ".join(pattern.extra_args) or "none"
        raise TypeError(
            f"unexpected argument(s) {sorted(unknown)} for attn_mode={attn_mode!r}; "
            f"accepted pattern arguments: {accepted}"
        )
    if "num_verts" not in pattern.params and (num_verts is not None or vertsize is not None):
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
        n_q,
        tuple(sorted((k, _freeze(v)) for k, v in pattern_args.items())),
    )
    if key in _CACHE:
        return _CACHE[key]
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
    if len(_CACHE) >= CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    _CACHE[key] = layout
    return layout
