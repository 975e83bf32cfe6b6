"""Fixtures the decode kernel tests share."""

from __future__ import annotations

import pytest

from cuattn.backends import geometry, interp


@pytest.fixture
def launched(monkeypatch):
    """The kernels the interpreter launches, in order, with CUATTN_DECODE=gqa."""
    monkeypatch.setenv(geometry.DECODE_ENV, geometry.DECODE_GQA_FAMILY)
    names: list[str] = []
    launch = interp.InterpBackend.launch

    def spy(self, config, **values):
        names.append(config.kernel)
        return launch(self, config, **values)

    monkeypatch.setattr(interp.InterpBackend, "launch", spy)
    return names
