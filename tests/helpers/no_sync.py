"""For the GPU tests that a step never waits for the host: every CuPy way to a device-to-host
copy or a synchronisation, patched to fail."""

from __future__ import annotations

from typing import Any


def refuse_host_round_trips(monkeypatch: Any) -> None:
    """Patch (through pytest's ``monkeypatch``, undone after the test) CuPy's copies to the
    host and its synchronisations so that any of them fails the test."""
    import cupy

    def refuse(*args, **kwargs):
        raise AssertionError("a host synchronisation or device-to-host copy")

    for target, name in (
        (cupy.ndarray, "get"),
        (cupy, "asnumpy"),
        (cupy.cuda.Stream, "synchronize"),
        (cupy.cuda.Device, "synchronize"),
    ):
        monkeypatch.setattr(target, name, refuse)
