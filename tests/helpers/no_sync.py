"""For the GPU tests that a step never waits for the host: every CuPy way to a device-to-host
copy or a synchronisation, patched to fail."""

from __future__ import annotations

from typing import Any


def _refuse(*args: Any, **kwargs: Any) -> None:
    raise AssertionError("a host synchronisation or device-to-host copy")


def refuse_host_round_trips(monkeypatch: Any) -> None:
    """Patch (through pytest's ``monkeypatch``, undone after the test) CuPy's copies to the
    host and its synchronisations so that any of them fails the test."""
    import cupy

    for target, name in (
        (cupy.ndarray, "get"),
        (cupy.cuda.Stream, "synchronize"),
        (cupy.cuda.Device, "synchronize"),
    ):
        try:
            monkeypatch.setattr(target, name, _refuse)
        except TypeError:
            # CuPy 14's Device is an immutable extension type (seen on the H100, 2026-11-25):
            # refuse through a subclass put where cupy.cuda.Device is looked up.
            refusing = type(target.__name__, (target,), {name: _refuse})
            monkeypatch.setattr(cupy.cuda, target.__name__, refusing)
    monkeypatch.setattr(cupy, "asnumpy", _refuse)
    monkeypatch.setattr(cupy.cuda.runtime, "deviceSynchronize", _refuse)
