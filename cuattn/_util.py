"""Small helpers every layer shares; nothing here imports another cuattn module."""

from __future__ import annotations


def ceil_div(a: int, b: int) -> int:
    """ceil(a / b) for positive ints, in exact integer arithmetic."""
    return -(-a // b)
