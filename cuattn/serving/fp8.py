"""FP8 KV pages: the two formats, their codes, and the power-of-two page scales.

An fp8 ``KVCache`` stores each kept element as a one-byte code (uint8 arrays on any device)
and one float32 scale per page for K and one for V (a page belongs to one (sequence, kv head)
pair, so this is the scale per (page, kv head)); the value a kernel or the reference reads is
``decode(code) * scale``.

Scales are powers of two: ``scale = 2^ceil(log2(amax / FORMAT_MAX))`` of the page's kept
finite elements (1 for a page of zeros; the exponent clamped to float32's normal range). A
page is requantised whenever tokens are written to it (an append, a close-up): its kept
tokens are dequantised, the new ones join them, the scale is recomputed from them all and
every kept element is encoded again. With a power-of-two scale, changing it multiplies a code
by a power of two, which is exact for every code that stays in fp8's normal range (the same
mantissa bits, another exponent); only a code that falls below the normal range when the scale
grows is rounded once more, by at most one subnormal step of the new scale (2^-9 scale for
e4m3fn, 2^-16 scale for e5m2). A page that shrinks (its largest token evicted) keeps its scale
until its next write, which may lower it (exactly: the codes move up). So a token's value is its
direct round-to-nearest-even quantisation at its page's current scale, up to those subnormal
steps; it never saturates (the scale covers the page's largest element).

Encoding rounds to nearest, ties to even, as ml_dtypes and CUDA's __nv_cvt_float_to_fp8 do,
and saturates at the format's largest finite value (CUDA's __NV_SATFINITE; it is never reached
by a finite element, see above). NaN stays NaN. e5m2 keeps infinities; e4m3fn has none, so an
infinite element is stored as NaN (its row's output is then NaN where a dense computation might
give inf or NaN). The encoder is written with searchsorted over the format's values, so it runs
on NumPy and CuPy alike; codes decode through a 256-entry table.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = ["FP8_DTYPES", "decode", "encode", "page_scale", "quantize_pages"]

FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
SIGN_BIT = 0x80
# the largest finite code of each format (positive), and its NaN and infinity codes
_MAX_CODE = {"float8_e4m3fn": 0x7E, "float8_e5m2": 0x7B}
_NAN_CODE = {"float8_e4m3fn": 0x7F, "float8_e5m2": 0x7E}
_INF_CODE = {"float8_e4m3fn": 0x7F, "float8_e5m2": 0x7C}  # e4m3fn: none, NaN stands in
# float32's normal exponents: a scale outside them would itself lose bits
MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT = -126, 127


@functools.cache
def _table(name: str) -> np.ndarray:
    """float32 [256]: the value of every code (ml_dtypes' own decoding); shared, never
    written."""
    import ml_dtypes

    return np.arange(256, dtype=np.uint8).view(getattr(ml_dtypes, name)).astype(np.float32)


def format_max(name: str) -> float:
    """The format's largest finite value (448 for e4m3fn, 57344 for e5m2)."""
    return float(_table(name)[_MAX_CODE[name]])


def decode(xp: Any, codes: Any, name: str) -> Any:
    """float32 values of uint8 ``codes`` (exact: every code is a float32)."""
    return xp.asarray(_table(name))[codes.astype(xp.int64)]


def encode(xp: Any, x: Any, name: str) -> Any:
    """uint8 codes of float ``x`` (already divided by its scale): round to nearest, ties to even
    (the even code), saturating at the largest finite value; NaN to NaN, inf as the module doc
    says."""
    top = _MAX_CODE[name]
    values = xp.asarray(_table(name)[: top + 1].astype(np.float64))  # codes 0..top, increasing
    x = x.astype(xp.float64)
    y = xp.minimum(xp.abs(x), float(values[top]))
    upper = xp.minimum(xp.searchsorted(values, y, side="left"), top)
    lower = xp.maximum(upper - 1, 0)
    below, above = y - values[lower], values[upper] - y
    take_upper = (above < below) | ((above == below) & (upper % 2 == 0))
    code = xp.where(take_upper, upper, lower)
    code = xp.where(xp.isinf(x), _INF_CODE[name], code)
    code = xp.where(xp.signbit(x), code | SIGN_BIT, code)
    code = xp.where(xp.isnan(x), _NAN_CODE[name], code)
    return code.astype(xp.uint8)


def page_scale(xp: Any, amax: Any, name: str) -> Any:
    """float32 power-of-two scales of pages whose kept finite elements reach ``amax`` (>= 0):
    the smallest 2^e with amax <= FORMAT_MAX 2^e (1 where amax is 0), e clamped to float32's
    normal exponents."""
    top = format_max(name)
    amax = amax.astype(xp.float64)
    _, exponent = xp.frexp(amax / top)
    exponent = exponent.astype(xp.int64)
    # frexp's exponent e puts amax / top in [2^(e-1), 2^e); the one below may cover it exactly
    exponent = xp.where(amax <= xp.ldexp(top, exponent - 1), exponent - 1, exponent)
    exponent = xp.where(amax > 0, exponent, 0)
    exponent = xp.clip(exponent, MIN_SCALE_EXPONENT, MAX_SCALE_EXPONENT)
    return xp.ldexp(1.0, exponent).astype(xp.float32)


def quantize_pages(xp: Any, values: Any, used: Any, name: str) -> tuple[Any, Any]:
    """(uint8 codes like ``values``, float32 scales [pages]) of float ``values`` [pages,
    page_size, head_dim] whose slots ``used`` [pages, page_size] hold kept tokens: each page's
    scale from its kept finite elements, the slots that keep nothing encoded as 0."""
    used = used[..., None]
    finite = xp.where(used & xp.isfinite(values), xp.abs(values), 0.0)
    scale = page_scale(xp, finite.max(axis=(1, 2)), name)
    scaled = values.astype(xp.float64) / scale.astype(xp.float64)[:, None, None]
    return encode(xp, xp.where(used, scaled, 0.0), name), scale
