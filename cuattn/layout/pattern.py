"""Pattern: a named layout rule without a length, built into a Layout for each length it meets.

A :class:`Layout` is for one (n_q, n_ctx). A model sees many lengths, and a compiled model
(torch.compile with dynamic shapes) must not be re-traced for each one, so it carries the rule
instead: ``Pattern("fixed", heads=8, blocksize=64, local_attn_ctx=128, num_verts=4,
vertsize=1)`` means ``make_layout("fixed", n_k, 8, 64, ..., n_q=n_q)`` for whatever n_q, n_k a
call has (built once per length: make_layout caches). A Pattern is a plain value: it has a
canonical text ``key`` (a Python literal: what a torch custom op takes) and
``Pattern.from_key(key)`` is its inverse.
"""

from __future__ import annotations

import ast
import math
from dataclasses import dataclass

from cuattn.adapters.dlpack import torch_compiling
from cuattn.layout.layout import Layout, check_positive_int
from cuattn.layout.registry import check_pattern, make_layout, modes

# Keys whose arguments passed check_pattern's trial build.
_CHECKED: set[str] = set()


# Option values a key can spell (Python literals, and tuples of them).
_SCALARS = (bool, int, float, str, type(None))


def _plain(name: str, value: object) -> object:
    if isinstance(value, (list, tuple)):
        return tuple(_plain(name, v) for v in value)
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if not isinstance(value, _SCALARS):
        raise TypeError(
            f"{name} must be a bool, int, float, str, None or a list of them (a Pattern is a "
            f"plain value), got {type(value).__name__}"
        )
    return value


@dataclass(frozen=True)
class Pattern:
    """A registered pattern (``cuattn.MODES``) with its options and no length.

    :func:`cuattn.sparse_attention` builds its Layout for each call's lengths
    (:meth:`layout`, cached by make_layout), so a compiled torch graph keeps the length dynamic.
    A plain, hashable value: ``key`` is its canonical text (a Python literal, what a torch
    custom op takes) and :meth:`from_key` its inverse. The arguments are checked here: names,
    kinds, and every value a trial build on one block can judge.

    Args:
        mode (str): a registered pattern name (``cuattn.MODES``).
        heads (int): the query heads.
        blocksize (int): the block size (default 32).
        **options: make_layout's keyword arguments (``local_attn_ctx``, ``num_verts``,
            ``vertsize``, ``causal``, pattern-specific ones) except ``n_ctx`` and ``n_q``,
            which come from each call's q and k; bools, ints, floats, strings, None or lists of
            them.

    Raises:
        TypeError: ``n_ctx`` or ``n_q`` given; ``heads`` or ``blocksize`` not an int; an option
            of another type, or one the mode does not take.
        ValueError: an unknown mode; ``heads`` or ``blocksize`` not positive; an option value
            the pattern refuses (a non-finite float, a window out of range, ...).

    Example:
        >>> import cuattn
        >>> p = cuattn.Pattern("local", heads=4, blocksize=32, local_attn_ctx=64)
        >>> p.layout(128, 256).n_q, p.layout(128, 256).n_ctx
        (128, 256)
    """

    mode: str
    heads: int
    blocksize: int
    key: str

    def __init__(self, mode: str, heads: int, blocksize: int = 32, **options: object) -> None:
        if not isinstance(mode, str) or mode not in modes():
            raise ValueError(f"mode must be one of {modes()}, got {mode!r}")
        for name in ("n_ctx", "n_q"):
            if name in options:
                raise TypeError(
                    f"Pattern takes no {name}: each call's q and k give the lengths (use "
                    "make_layout for a Layout of one length)"
                )
        check_positive_int("heads", heads)
        check_positive_int("blocksize", blocksize)
        plain = tuple((name, _plain(name, options[name])) for name in sorted(options))
        # repr, not json: torch.compile traces this constructor, and it cannot trace json.
        key = repr((mode, int(heads), int(blocksize), plain))
        # Arguments are checked here, not at the first call: names always; values by one trial
        # build per distinct key, outside torch.compile's tracing (a Layout is not traceable).
        # Tracing is asked first: a compiled graph must not guard on the checked set (a key
        # checked later, by an eager call, would make it compile again).
        trial = not torch_compiling() and key not in _CHECKED
        check_pattern(mode, heads, blocksize, trial=trial, **options)
        if trial:
            _CHECKED.add(key)
        object.__setattr__(self, "mode", mode)
        object.__setattr__(self, "heads", int(heads))
        object.__setattr__(self, "blocksize", int(blocksize))
        object.__setattr__(self, "key", key)

    @property
    def options(self) -> dict[str, object]:
        """The pattern's options, as given (lists as tuples)."""
        return dict(ast.literal_eval(self.key)[3])

    @classmethod
    def from_key(cls, key: str) -> Pattern:
        """The Pattern whose ``key`` this is (the inverse of ``Pattern(...).key``).

        Args:
            key (str): a Pattern's ``key``.

        Returns:
            Pattern: equal to the one the key came from.

        Raises:
            SyntaxError: ``key`` is not Python.
            ValueError: ``key`` is Python but not a literal; arguments :class:`Pattern`
                refuses.
            TypeError: a literal not of a key's form (mode, heads, blocksize, options); as
                :class:`Pattern`.
        """
        mode, heads, blocksize, options = ast.literal_eval(key)
        return cls(mode, heads, blocksize, **dict(options))

    def layout(self, n_q: int, n_k: int) -> Layout:
        """The Layout of this pattern for one call's lengths (cached by make_layout).

        Args:
            n_q (int): the queries, end-aligned to the keys.
            n_k (int): the keys.

        Returns:
            Layout: ``make_layout(mode, n_k, heads, blocksize, n_q=n_q, **options)``.

        Raises:
            TypeError: as :func:`cuattn.make_layout`.
            ValueError: as :func:`cuattn.make_layout` (a length the pattern cannot serve).
        """
        return make_layout(self.mode, n_k, self.heads, self.blocksize, n_q=n_q, **self.options)

    def __repr__(self) -> str:
        args = "".join(f", {k}={v!r}" for k, v in self.options.items())
        return f"Pattern({self.mode!r}, heads={self.heads}, blocksize={self.blocksize}{args})"
