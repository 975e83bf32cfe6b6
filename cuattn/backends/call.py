"""One attention call as a value: what the public API validated, carried unchanged to the kernels.

``cuattn.api`` checks the arguments once and builds an :class:`AttentionCall`; every route (the
tape, the torch custom ops, jax's custom_vjp, plain NumPy/CuPy arrays) takes ``(q, k, v, call)``
and hands the call on, so a new option of the call touches this record, the validator and the
code that uses it, and nothing in between. Nothing downstream re-checks what the API checked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from cuattn._util import array_library, dims, dtype_name
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
    rel_bias  the call carries a relative-position table [(batch,) heads, 2 M + 1] (an array
              operand): each score gets ``table[(batch,) head, clamp(k_pos - q_pos, -M, M) + M]``
    score_bias  the call carries a dense bias broadcastable to [batch, heads, n_q, n_k] (an
              array operand, read only inside the computed blocks): each score gets
              ``score_bias[b, h, i, j]`` (broadcast)
    score_bias_frozen  the score bias takes no gradient (its caller asks none): the backward
              skips its dS planes, O(batch x heads x n_q x n_k), and gives None for it
    dropout_p     0 <= p < 1: each probability is dropped with probability p (after the softmax,
                  whose log-sum-exp is of every score), a kept one scaled by 1 / (1 - p), by the
                  counter-based generator of backends/dropout.py
    dropout_seed  its seed, 0 <= seed < 2^63: the backward regenerates the forward's mask
    seed_words    the seed is an array operand instead (8 bytes on q's device, read there as the
                  generator's 64-bit key: a traced jax seed, a seed torch drew on the GPU);
                  dropout_seed is then unused (0)

    The public calls build it with ``from_arguments``, which checks the keywords; nothing
    downstream checks it again.

    The kernels compile a variant with modifiers only for calls that use one (``any``), so a
    call without them runs the plain kernels.
    """

    softcap: float = 0.0
    alibi: bool = False
    key_bias: bool = False
    rel_bias: bool = False
    score_bias: bool = False
    score_bias_frozen: bool = False
    dropout_p: float = 0.0
    dropout_seed: int = 0
    seed_words: bool = False

    @property
    def any(self) -> bool:
        biased = any(self.given[:-1])  # every operand but the seed is a bias
        return self.softcap > 0.0 or biased or self.dropout_p > 0.0

    @property
    def given(self) -> tuple[bool, ...]:
        """Which score operands a call with these modifiers carries (SCORE_OPERANDS order)."""
        return tuple(getattr(self, flag) for flag in OPERAND_FLAGS)

    def with_given(self, given: Sequence[bool]) -> ScoreMods:
        """These modifiers flagging the score operands ``given`` says a call carries
        (SCORE_OPERANDS order)."""
        if tuple(given) == self.given:
            return self
        return replace(self, **dict(zip(OPERAND_FLAGS, map(bool, given), strict=True)))

    def with_operands(self, operands: ScoreOperands) -> ScoreMods:
        """These modifiers with a flag for each score operand ``operands`` holds."""
        return self.with_given(operands.given)

    def with_dropout(self, dropout_p: object, dropout_seed: object) -> ScoreMods:
        """These modifiers with dropout, its arguments checked (a TypeError or ValueError naming
        the argument): dropout_p a real in [0, 1) (0: off), dropout_seed an int in [0, 2^63)
        (a torch op's int64) or a seed array (check_seed_words; it then travels as an operand
        and the call's flag says so)."""
        real = (int, float, np.floating, np.integer)
        if isinstance(dropout_p, bool) or not isinstance(dropout_p, real):
            raise TypeError(f"dropout_p must be a float in [0, 1), got {type(dropout_p).__name__}")
        if not 0.0 <= float(dropout_p) < 1.0:
            raise ValueError(f"dropout_p must be in [0, 1) (0: no dropout), got {dropout_p}")
        if not dropout_p:
            return self
        if is_seed_array(dropout_seed):
            check_seed_words(dropout_seed)
            return replace(self, dropout_p=float(dropout_p), dropout_seed=0, seed_words=True)
        integer = (int, np.integer)
        if isinstance(dropout_seed, bool) or not isinstance(dropout_seed, integer):
            raise TypeError(
                "dropout_seed must be an int in [0, 2^63) or an integer array of 8 bytes (int64 "
                f"[] or [1], uint32 [2]) on q's device, got {type(dropout_seed).__name__}"
            )
        if not 0 <= int(dropout_seed) < 2 ** (SEED_BITS - 1):
            raise ValueError(f"dropout_seed must be in [0, 2^63), got {dropout_seed}")
        return replace(self, dropout_p=float(dropout_p), dropout_seed=int(dropout_seed))

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
SEED_BITS = 64  # a dropout seed is the generator's 64-bit key
# A seed array: its 8 bytes are the key, little-endian (the low word first, as the kernels read
# two 32-bit words). Shapes by dtype: one 64-bit integer or two 32-bit words.
SEED_ARRAY_SHAPES = {
    "int64": ((), (1,)),
    "uint64": ((), (1,)),
    "uint32": ((2,),),
    "int32": ((2,),),
}


def is_seed_array(seed: object) -> bool:
    """Whether a dropout seed is an array (anything with a shape and a dtype) and not an int."""
    return hasattr(seed, "shape") and hasattr(seed, "dtype") and not isinstance(seed, np.generic)


def check_seed_words(seed: Any) -> None:
    """A seed array holds the 64-bit key in 8 bytes: int64/uint64 [] or [1], uint32/int32 [2]
    (jax's ``jax.random.bits(key, (2,), jnp.uint32)``); its kind and device are q's (the
    caller's check_same_kind). Its value is never read on the host."""
    shapes = SEED_ARRAY_SHAPES.get(dtype_name(seed))
    if shapes is None:
        raise TypeError(
            f"dropout_seed as an array must be int64 or uint64 (one value) or uint32 or int32 "
            f"(two words, the low one first), got {dtype_name(seed)}; cuattn never casts silently"
        )
    if tuple(dims(seed)) not in shapes:
        raise ValueError(
            f"dropout_seed as a {dtype_name(seed)} array must have shape "
            f"{' or '.join(str(s) for s in shapes)} (8 bytes: the generator's 64-bit key), got "
            f"{tuple(dims(seed))}"
        )


# The score modifiers that are arrays, in the order every route passes them: ALiBi's slopes, a
# key bias, a relative-position table, a dense score bias, and last dropout's seed when an array
# holds it (no gradient); ScoreMods' flag of each.
SCORE_OPERANDS = ("alibi_slopes", "key_bias", "rel_bias", "score_bias", "dropout_seed")
OPERAND_FLAGS = ("alibi", "key_bias", "rel_bias", "score_bias", "seed_words")


@dataclass(frozen=True)
class ScoreOperands:
    """The score modifiers that are arrays (SCORE_OPERANDS; None where absent), of q's kind and
    on its device. Arrays are not hashable: a call carries them outside its equality and hash,
    and an adapter that must hand the call over as a static value (jax's custom_vjp, a torch
    op's plain arguments) sends them beside it and places them back (``AttentionCall.placed``).
    """

    alibi_slopes: Any = None
    key_bias: Any = None
    rel_bias: Any = None
    score_bias: Any = None
    dropout_seed: Any = None

    def values(self) -> tuple[Any, ...]:
        """Every operand in SCORE_OPERANDS order, None where absent."""
        return tuple(getattr(self, name) for name in SCORE_OPERANDS)

    @property
    def given(self) -> tuple[bool, ...]:
        return tuple(x is not None for x in self.values())

    @property
    def present(self) -> tuple[Any, ...]:
        """The operands given, in order."""
        return tuple(x for x in self.values() if x is not None)

    def named(self) -> dict[str, Any]:
        """The operands given by name (to cross an adapter beside q, k, v)."""
        return {n: x for n, x in zip(SCORE_OPERANDS, self.values(), strict=True) if x is not None}

    def map(self, fn: Any) -> ScoreOperands:
        """These operands with ``fn(name, x)`` for each one given."""
        pairs = zip(SCORE_OPERANDS, self.values(), strict=True)
        return ScoreOperands(*(None if x is None else fn(n, x) for n, x in pairs))

    def gradients(self, grads: Sequence[Any]) -> tuple[Any, ...]:
        """A backward's gradient of each operand (None where absent) from its results:
        (dq, dk, dv) then one gradient per operand given, in order."""
        given = iter(grads[3:])
        return tuple(None if x is None else next(given) for x in self.values())

    @classmethod
    def placed(cls, present: Sequence[Any], given: Sequence[bool]) -> ScoreOperands:
        """The operands from the arrays ``present`` (those ``given`` says there are, in order)."""
        arrays = iter(present)
        return cls(*(next(arrays) if g else None for g in given))


NO_OPERANDS = ScoreOperands()


@dataclass(frozen=True)
class AttentionCall:
    """A validated attention call.

    layout      the Layout, or a Pattern still to be built for the call's lengths (the torch
                route builds it inside its op, where lengths may be symbolic); None for decode
                (the cache says which tokens each query sees)
    scale       the score scale, resolved (1/sqrt(head_dim) when the caller gave none)
    recompute   keep only q, k, v for the backward and run the forward again there
    return_lse  hand the log-sum-exp back beside the output
    backend     'numpy', 'interp', 'cuda' or None (chosen from the arrays and CUATTN_BACKEND)
    mods        the score modifiers (ScoreMods; none by default), with a flag for each operand
    given_operands  the score modifiers that are arrays (ScoreOperands; ``operands`` reads
                them, NO_OPERANDS for none), checked where the call was built
                (checked_operands); outside equality and hash

    Frozen and hashable (a layout compares by identity), as jax's custom_vjp needs of the
    arguments it does not differentiate.
    """

    layout: Layout | Pattern | None
    scale: float
    recompute: bool = False
    return_lse: bool = False
    backend: str | None = None
    mods: ScoreMods = NO_MODS
    # None for none (not NO_OPERANDS: torch.compile cannot trace a default it did not create)
    given_operands: ScoreOperands | None = field(default=None, compare=False)

    @property
    def operands(self) -> ScoreOperands:
        return NO_OPERANDS if self.given_operands is None else self.given_operands

    def for_lengths(self, n_q: int, n_k: int) -> AttentionCall:
        """This call with a Pattern built into its Layout for n_q queries and n_k keys (the
        call itself when its layout is concrete already)."""
        if isinstance(self.layout, Pattern):
            call = replace(self, layout=self.layout.layout(n_q, n_k))
            _check_natural_order(call.layout, call.mods)
            return call
        return self

    def with_operands(self, operands: ScoreOperands) -> AttentionCall:
        """This call carrying ``operands``, its modifiers flagging each one; a bias with a
        permuted layout is refused (a ValueError naming it)."""
        mods = self.mods.with_operands(operands)
        _check_natural_order(self.layout, mods)
        return replace(self, mods=mods, given_operands=operands)

    def without_operands(self) -> AttentionCall:
        """This call without its arrays (its flags stay): the static value an adapter hands
        over, the operands crossing beside it."""
        return self if self.given_operands is None else replace(self, given_operands=None)

    def placed(self, present: Sequence[Any]) -> AttentionCall:
        """This call with its operands from the arrays ``present``: one for each operand its
        modifiers flag, in SCORE_OPERANDS order (what crossed an adapter beside q, k, v)."""
        if not present:
            return self.without_operands()
        return replace(self, given_operands=ScoreOperands.placed(present, self.mods.given))

    def wanting(self, wanted: Sequence[bool]) -> AttentionCall:
        """This call for a backward in which ``wanted[i]`` says whether the i-th operand given
        asks a gradient: a score bias that asks none is frozen (no dS planes are made)."""
        present = [name for name, g in zip(SCORE_OPERANDS, self.mods.given, strict=True) if g]
        if "score_bias" not in present or wanted[present.index("score_bias")]:
            return self
        return replace(self, mods=replace(self.mods, score_bias_frozen=True))


def _check_natural_order(layout: Layout | Pattern | None, mods: ScoreMods) -> None:
    """A bias (ALiBi's slopes, a key bias, a table) follows the natural token order: a layout
    computed in a permuted one is refused with it."""
    permuted = isinstance(layout, Layout) and layout.perm is not None
    biased = [n for n, g in zip(SCORE_OPERANDS[:-1], mods.given, strict=False) if g]
    if permuted and biased:
        raise ValueError(
            f"{biased[0]} needs the natural token order, but the layout {layout.name!r} is "
            "permuted (its perm reorders tokens, and the bias would not follow)"
        )


def checked_operands(
    q: Any,
    sizes: tuple[int, int, int, int],
    operands: ScoreOperands,
    *,
    covering: bool = False,
    unwrap: Any = None,
) -> ScoreOperands:
    """The score operands of a public call, checked (a TypeError or ValueError naming the
    argument) against q and ``sizes`` (batch, heads, n_q, n_k): each of q's kind of array
    (``unwrap(x)``'s, when given: a tape Tensor's data), ALiBi's slopes float32 [heads] or
    [batch, heads], a key bias [batch, (heads,) n_k] (at least n_k keys with ``covering``:
    decode, by cache position), a relative-position table [(batch,) heads, 2 M + 1], a score
    bias broadcastable to [batch, heads, n_q, n_k]; a seed array is checked where dropout's
    arguments are. The one place sparse_attention, varlen, SDPA and decode check them."""
    unwrap = unwrap or (lambda x: x)
    batch, heads, n_q, n_k = sizes
    checks = {
        "alibi_slopes": lambda x: check_alibi_slopes(x, batch, heads),
        "key_bias": lambda x: check_key_bias(x, q, batch, heads, n_k, covering=covering),
        "rel_bias": lambda x: check_rel_bias(x, q, batch, heads),
        "score_bias": lambda x: check_score_bias(x, q, sizes),
    }
    for name, x in operands.named().items():
        if name in checks:
            checks[name](x)
            check_same_kind(name, unwrap(x), unwrap(q))
    return operands


def check_alibi_slopes(slopes: Any, batch: int, heads: int) -> None:
    """ALiBi's slopes: float32 [heads] or [batch, heads] (their array kind is the caller's
    check: check_same_kind, or the API's through cuattn.Tensor)."""
    _require_array("alibi_slopes", slopes, "[heads] or [batch, heads]")
    if dtype_name(slopes) != "float32":
        raise TypeError(
            f"alibi_slopes must be float32 (as FlashAttention takes them), got "
            f"{dtype_name(slopes)}; cuattn never casts silently"
        )
    shape = dims(slopes)
    if shape not in ((heads,), (batch, heads)):
        raise ValueError(
            f"alibi_slopes must have shape [heads] = ({heads},) or [batch, heads] = "
            f"({batch}, {heads}), got {tuple(shape)}"
        )


def check_key_bias(
    bias: Any, q: Any, batch: int, heads: int, n_k: int, *, covering: bool = False
) -> None:
    """A key bias: float32 [batch, time_k] or [batch, heads, time_k] (float64 too beside
    float64 q, which only the NumPy reference computes), time_k = n_k, or at least n_k with
    ``covering`` (decode: the cache's positions)."""
    _require_array("key_bias", bias, "[batch, time_k] or [batch, heads, time_k]")
    _check_operand_dtype("key_bias", bias, q)
    shape = tuple(dims(bias))
    fits = len(shape) >= 2 and shape[:-1] in ((batch,), (batch, heads))
    if not fits or (shape[-1] < n_k if covering else shape[-1] != n_k):
        keys = f">= {n_k}" if covering else f"{n_k}"
        raise ValueError(
            f"key_bias must have shape [batch, time_k] = ({batch}, {keys}) or [batch, heads, "
            f"time_k] = ({batch}, {heads}, {keys}), got {shape}"
            + (
                " (time_k covering the cache's positions)"
                if covering
                else " (a [.., time_q, time_k] bias is O(T^2), which cuattn never builds)"
            )
        )


def check_rel_bias(table: Any, q: Any, batch: int, heads: int) -> None:
    """A relative-position table: float32 (float64 too beside float64 q) [heads, 2 M + 1] or
    [batch, heads, 2 M + 1], M >= 0 the largest distance it tells apart."""
    _require_array("rel_bias", table, "[heads, 2 * max_distance + 1]")
    _check_operand_dtype("rel_bias", table, q)
    shape = tuple(dims(table))
    if (
        len(shape) not in (2, 3)
        or shape[:-1] not in ((heads,), (batch, heads))
        or shape[-1] % 2 != 1
    ):
        raise ValueError(
            f"rel_bias must have shape [heads, 2 * max_distance + 1] = ({heads}, odd) or "
            f"[batch, heads, 2 * max_distance + 1] = ({batch}, {heads}, odd), got {shape}"
        )


def check_score_bias(bias: Any, q: Any, sizes: tuple[int, int, int, int]) -> None:
    """A dense score bias: float32 or q's dtype, of rank 2 to 4, broadcastable to [batch, heads,
    n_q, n_k] = ``sizes`` the way torch and NumPy broadcast (each axis 1 or the full size, the
    missing leading axes 1); any strides."""
    _require_array("score_bias", bias, "broadcastable to [batch, heads, time_q, time_k]")
    allowed = ("float32", dtype_name(q))
    if dtype_name(bias) not in allowed:
        raise TypeError(
            f"score_bias must be float32 or q's dtype {dtype_name(q)}, got {dtype_name(bias)}; "
            "cuattn never casts silently"
        )
    shape = tuple(dims(bias))
    padded = (1,) * (4 - len(shape)) + shape
    if not 2 <= len(shape) <= 4 or any(d not in (1, s) for d, s in zip(padded, sizes, strict=True)):
        raise ValueError(
            f"score_bias must broadcast to [batch, heads, time_q, time_k] = {tuple(sizes)} "
            f"(rank 2 to 4, each axis 1 or its full size), got {shape}"
        )


def rel_max_distance(table: Any) -> int:
    """M of a relative-position table [.., 2 M + 1]."""
    return (int(table.shape[-1]) - 1) // 2


def _require_array(name: str, x: Any, shapes: str) -> None:
    """A score operand is an array (a TypeError naming it and the shapes it takes otherwise)."""
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise TypeError(
            f"{name} must be a float32 array {shapes} of the same kind as q, got {type(x).__name__}"
        )


def _check_operand_dtype(name: str, x: Any, q: Any) -> None:
    """A bias in float32 (float64 too beside float64 q)."""
    allowed = ("float32", "float64") if dtype_name(q) == "float64" else ("float32",)
    if dtype_name(x) not in allowed:
        raise TypeError(
            f"{name} must be float32 (or float64 beside float64 q), got {dtype_name(x)} "
            f"for q {dtype_name(q)}; cuattn never casts silently"
        )


def check_same_kind(name: str, x: Any, q: Any) -> None:
    """A score operand is q's kind of array (the kernels read it where q lives)."""
    if array_library(x) != array_library(q):
        raise TypeError(
            f"{name} is a {type(x).__module__}.{type(x).__name__} but q is a "
            f"{type(q).__module__}.{type(q).__name__}: pass it as the same kind of array, on "
            "q's device"
        )
