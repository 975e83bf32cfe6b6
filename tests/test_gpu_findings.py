"""What the H100 run of 2026-11-25 (bench/results/2026-11-25-h100/) found, each kept as a test
that needs no GPU: both failed on this machine before their fixes."""

from __future__ import annotations

import types

import pytest

cupy = pytest.importorskip("cupy")


def test_a_zero_byte_allocation_from_torch_is_a_valid_cupy_pointer(monkeypatch):
    """Every device layout built on torch CUDA tensors asked CuPy, allocating from torch's
    caching allocator, for an empty mask table: torch hands back a null pointer for zero bytes,
    and CuPy 14 refuses a null pointer whose device is not named."""
    torch = pytest.importorskip("torch")
    from cuattn.adapters import dlpack

    blocks = {}

    def empty(size, dtype, device):
        blocks[size] = device
        return types.SimpleNamespace(data_ptr=lambda: 0)  # torch's pointer for zero bytes

    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(cupy.cuda.runtime, "getDevice", lambda: 0)
    pointer = dlpack._torch_allocation(0)
    assert pointer.ptr == 0 and pointer.device_id == 0 and blocks == {0: "cuda:0"}


def test_the_no_sync_guard_installs_under_this_cupy_and_refuses(monkeypatch):
    """CuPy 14's Device is an immutable type: the guard of the GPU tests that a decode or
    dynamic step never waits for the host failed to install (5 + 1 tests on the H100)."""
    from tests.helpers.no_sync import refuse_host_round_trips

    refuse_host_round_trips(monkeypatch)
    for attempt in (
        lambda: cupy.cuda.Device(0).synchronize(),
        lambda: cupy.cuda.runtime.deviceSynchronize(),
        lambda: cupy.asnumpy(None),
        lambda: cupy.cuda.Stream.synchronize(None),
        lambda: cupy.ndarray.get(None),
    ):
        with pytest.raises(AssertionError, match="host synchronisation"):
            attempt()
