"""Fixtures the decode kernel tests share."""

from __future__ import annotations

import pytest

from cuattn.backends import geometry, interp
from tests.helpers.launches import record_launches


@pytest.fixture
def launched(monkeypatch):
    """The kernels the interpreter launches, in order, with CUATTN_DECODE=gqa."""
    monkeypatch.setenv(geometry.DECODE_ENV, geometry.DECODE_GQA_FAMILY)
    return record_launches(monkeypatch, interp.InterpBackend)
