"""Small helpers every layer shares; nothing here imports another cuattn module."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for positive ints, in exact integer arithmetic."""
    return -(-a // b)


def one_line(exc: BaseException, limit: int) -> str:
    """``Type: message`` of an exception on one line, cut to ``limit`` characters (for reports
    and one-line error messages; some libraries raise multi-page messages)."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return text if len(text) <= limit else text[: limit - 3] + "..."
