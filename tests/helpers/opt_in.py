"""The opt-in switches of kernels no GPU has run yet (geometry's environment choices)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cuattn.backends import geometry


def check_opt_in(monkeypatch, variable: str, choice: Callable[[], str]) -> None:
    """``choice()`` reads environment ``variable``: an unknown value is refused by name, and
    unset it is "off" (the GPU path refused until a GPU has run it)."""
    monkeypatch.setenv(variable, "yes")
    with pytest.raises(ValueError, match=variable):
        choice()
    monkeypatch.delenv(variable)
    assert choice() == geometry.DECODE_FP8_OFF_FAMILY
