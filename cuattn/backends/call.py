"""One attention call as a value: what the public API validated, carried unchanged to the kernels.

``cuattn.api`` checks the arguments once and builds an :class:`AttentionCall`; every route (the
tape, the torch custom ops, jax's custom_vjp, plain NumPy/CuPy arrays) takes ``(q, k, v, call)``
and hands the call on, so a new option of the call touches this record, the validator and the
code that uses it, and nothing in between. Nothing downstream re-checks what the API checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from cuattn.layout.layout import Layout
from cuattn.layout.pattern import Pattern


@dataclass(frozen=True)
class ScoreMods:
    """What changes the scores between ``scale * q.k`` and the mask, as every backend takes it.

    softcap   > 0: each score s becomes ``softcap * tanh(s / softcap)`` (Gemma 2, Grok); 0: off
    alibi     the call carries ALiBi slopes (an array operand beside q, k, v, since arrays are
              not hashable): each score gets ``-slope[batch, head] * |q_pos - k_pos|``
    key_bias  the call carries a key bias (an array operand too): each score of key k gets
              ``key_bias[batch, (head,) k]``

    The public calls build it with ``from_arguments``, which checks the keywords; nothing
    downstream checks it again.

    The kernels compile a variant with modifiers only for calls that use one (``any``), so a
    call without them runs the plain kernels.
    """

    softcap: float = 0.0
    alibi: bool = False
    key_bias: bool = False

    @property
    def any(self) -> bool:
        return self.softcap > 0.0 or self.alibi or self.key_bias

    @classmethod
    def from_arguments(cls, softcap: object = None) -> ScoreMods:
        """The modifiers of a public call's keywords, checked (a TypeError or ValueError naming
        the argument): softcap None or 0 (off, FlashAttention's convention) or a positive
        finite real."""
        if softcap is None:
            return NO_MODS
        real = (int, float, np.floating, np.integer)
        if isinstance(softcap, bool) or not isinstance(softcap, real):
            raise TypeError(
                "softcap must be a positive real number, 0 or None (off), got "
                f"{type(softcap).__name__}"
            )
        if not math.isfinite(float(softcap)) or softcap < 0:
            raise ValueError(
                f"softcap must be a positive finite number, 0 or None (off), got {softcap}"
            )
        return cls(softcap=float(softcap)) if softcap else NO_MODS


NO_MODS = ScoreMods()


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call (arrays aside).

    layout      the Layout, or a Pattern still to be built for the call's lengths (the torch
                route builds it inside its op, where lengths may be symbolic)
    scale       the score scale, resolved (1/sqrt(head_dim) when the caller gave none)
    recompute   keep only q, k, v for the backward and run the forward again there
    return_lse  hand the log-sum-exp back beside the output
    backend     'numpy', 'interp', 'cuda' or None (chosen from the arrays and CUATTN_BACKEND)
    mods        the score modifiers (ScoreMods; none by default)

    Frozen and hashable (a layout compares by identity), as jax's custom_vjp needs of the
    arguments it does not differentiate.
    """

    layout: Layout | Pattern
    scale: float
    recompute: bool = False
    return_lse: bool = False
    backend: str | None = None
    mods: ScoreMods = NO_MODS

    def for_lengths(self, n_q: int, n_k: int) -> AttentionCall:
        """This call with a Pattern built into its Layout for n_q queries and n_k keys (the
        call itself when its layout is concrete already)."""
        if isinstance(self.layout, Pattern):
            return replace(self, layout=self.layout.layout(n_q, n_k))
        return self


# The score modifiers that are arrays (not hashable: they travel beside q, k, v, never in the
# call), in the order every route passes them after ``mods``: a None where the call has none.
SCORE_OPERANDS = ("alibi_slopes", "key_bias")


def operand_gradients(grads: tuple, operands: tuple) -> tuple:
    """A backward's gradients of ``operands`` (one per SCORE_OPERANDS name, None where the call
    has none) from its results: (dq, dk, dv) then one gradient per operand given, in order."""
    given = iter(grads[3:])
    return tuple(None if x is None else next(given) for x in operands)


def given_operands(operands: tuple) -> tuple[dict[str, Any], tuple[bool, ...]]:
    """The score operands a call has, by name (to cross an adapter beside q, k, v), and which
    of SCORE_OPERANDS they are (a plain value that rebuilds the tuple on the other side)."""
    named = {n: x for n, x in zip(SCORE_OPERANDS, operands, strict=True) if x is not None}
    return named, tuple(x is not None for x in operands)


def placed_operands(present: Sequence[Any], given: tuple[bool, ...]) -> tuple:
    """The operands in SCORE_OPERANDS order from the arrays ``present`` (those ``given`` says
    the call has, in order), None for the others."""
    arrays = iter(present)
    return tuple(next(arrays) if g else None for g in given)
